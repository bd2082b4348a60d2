"""Every registered backend, one round trip: decode(encode(x)) == x, bit for bit, for every source
format, bit width, symmetric and asymmetric case, group size (channel-wise and g == K included) and
edge codes and zero points, with the layout's declared shapes and dtypes. A backend added to the
registry is covered here without editing this file."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moeconv.backends import REGISTRY, all_backends, get_backend
from moeconv.backends.base import ExpertWeights
from moeconv.canonical import MoELayerShape
from moeconv.checkpoint.reader import TORCH_DTYPES
from moeconv.formats import AWQ, GPTQ, CompressedTensors

from strategies import decoded_linears

SOURCES = [GPTQ(4, 32, sym=False), GPTQ(4, 64, sym=True, checkpoint_format="gptq_v2"), GPTQ(8, 64, sym=False),
           GPTQ(4, -1, sym=False), GPTQ(8, -1, sym=True), AWQ(4, 32, zero_point=True), AWQ(4, 64, zero_point=False),
           CompressedTensors(bits=4, group_size=32, symmetric=False), CompressedTensors(bits=4, group_size=-1),
           CompressedTensors(bits=8, group_size=64, symmetric=False),
           CompressedTensors(format="int-quantized", bits=8, group_size=-1, activation_bits=8)]
SIZES = [(64, 32), (128, 64), (64, 64)]  # (hidden, intermediate); (64, 64) with g = 64 is g == K for both GEMMs


@pytest.mark.parametrize("backend_name", sorted(REGISTRY))
@pytest.mark.parametrize("source", SOURCES, ids=lambda s: "-".join(map(str, s.describe().values())))
@given(data=st.data(), size=st.sampled_from(SIZES), scale_dtype=st.sampled_from([torch.float16, torch.bfloat16]))
def test_round_trip_through_every_backend(backend_name, source, data, size, scale_dtype):
    backend = get_backend(backend_name)
    hidden, intermediate = size
    shape = MoELayerShape(experts=2, hidden=hidden, intermediate=intermediate, bits=source.bits,
                          group_size=source.group_size, symmetric=source.symmetric,
                          scale_dtype={torch.float16: "F16", torch.bfloat16: "BF16"}[scale_dtype],
                          activation_bits=source.activation_bits)
    if backend.refusal(shape) is not None:
        return  # refused up front, with a reason (tested per backend); nothing to round-trip
    expert = ExpertWeights(*(data.draw(decoded_linears(source, n, k, scale_dtype))
                             for n, k in ((intermediate, hidden), (intermediate, hidden), (hidden, intermediate))))
    slices = backend.encode_expert(expert, shape)
    specs = {spec.name: spec for spec in backend.layer_tensors(shape)}
    assert set(slices) == set(specs)
    for suffix, tensor in slices.items():
        spec = specs[suffix]
        assert tuple(tensor.shape) == (spec.shape if spec.per_expert else spec.shape[1:]), suffix
        assert tensor.dtype == TORCH_DTYPES[spec.dtype], suffix
    decoded = backend.decode_expert(slices, shape)
    for projection in ("gate", "up", "down"):
        assert getattr(decoded, projection).mismatch(getattr(expert, projection)) is None, (backend_name, projection)


def test_every_backend_takes_some_source():
    """A backend that refused every case above would make its round trip vacuous."""
    for name, backend in all_backends().items():
        taken = [s for s in SOURCES if backend.refusal(MoELayerShape(2, 128, 64, s.bits, s.group_size, s.symmetric,
                                                                     "F16", s.activation_bits)) is None]
        assert len(taken) >= 4, (name, taken)


def test_every_output_records_what_it_targets(tmp_path):
    """moeconv.json and verify's report name the engine and kernel versions an output is for."""
    import json

    import moeconv
    from moeconv.synth import SynthSpec, make_checkpoint

    source = make_checkpoint(tmp_path / "src", SynthSpec())
    for name, backend in all_backends().items():
        assert backend.targets.get("engine"), name
        moeconv.convert(source, tmp_path / name, backend=name)
        assert json.loads((tmp_path / name / "moeconv.json").read_text())["targets"] == backend.targets
        assert moeconv.verify(tmp_path / name, numerics=False).to_json()["targets"] == backend.targets
