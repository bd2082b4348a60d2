"""Every registered backend, one round trip: decode(encode(x)) == x, bit for bit, for every source
format, bit width, symmetric and asymmetric case, group size (channel-wise and g == K included) and
edge codes and zero points, with the layout's declared shapes and dtypes. A backend added to the
registry is covered here without editing this file (it replaces one copy per backend)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moeconv.backends import REGISTRY, all_backends, get_backend
from moeconv.backends.base import ExpertWeights
from moeconv.canonical import MoELayerShape, QuantizedWeight
from moeconv.checkpoint.reader import NUMPY_DTYPES
from moeconv.formats import AWQ, GPTQ, CompressedTensors

from strategies import decoded_linears

SOURCES = (
    [AWQ(4, g, zero_point=zp) for g in (32, 64, 128, -1) for zp in (True, False)]
    + [GPTQ(bits, g, sym, fmt) for bits in (4, 8) for g in (32, 64, 128, -1) for sym in (True, False)
       for fmt in ("gptq", "gptq_v2")]
    + [GPTQ(2, 32, False)]
    + [CompressedTensors(bits=bits, group_size=g, symmetric=sym) for bits in (4, 8) for g in (32, 128, -1)
       for sym in (True, False)]
    + [CompressedTensors(format="int-quantized", bits=8, group_size=-1, activation_bits=8)]
)


@st.composite
def layer_sizes(draw, source):
    """(hidden, intermediate) in multiples of the group (of 32 for channel-wise, with K = 384 > 128 so
    that one group spans several of the CPU layout's K blocks); g == K happens for one multiple."""
    if source.group_size == -1:
        return draw(st.sampled_from([32, 64, 96, 384])), draw(st.sampled_from([32, 64, 128]))
    unit = max(source.group_size, 32)
    return unit * draw(st.integers(1, 3)), unit * draw(st.integers(1, 2))


@pytest.mark.parametrize("backend_name", list(REGISTRY))
@pytest.mark.parametrize("source", SOURCES, ids=lambda s: "-".join(map(str, s.describe().values())))
@given(data=st.data(), scale_dtype=st.sampled_from([torch.float16, torch.bfloat16]),
       names=st.sampled_from([("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")]))
def test_round_trip_through_every_backend(backend_name, source, data, scale_dtype, names):
    backend = get_backend(backend_name)
    hidden, intermediate = data.draw(layer_sizes(source))
    shape = MoELayerShape(experts=2, hidden=hidden, intermediate=intermediate, bits=source.bits,
                          group_size=source.group_size, symmetric=source.symmetric,
                          scale_dtype={torch.float16: "F16", torch.bfloat16: "BF16"}[scale_dtype],
                          activation_bits=source.activation_bits, projection_names=names)
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
        assert tensor.dtype == NUMPY_DTYPES[spec.dtype], suffix  # the stored form: BF16 as uint16
        assert set(spec.derives_from) <= {"gate", "up", "down"} and spec.derives_from, suffix
    decoded = backend.decode_expert(slices, shape)
    for projection in ("gate", "up", "down"):
        assert getattr(decoded, projection).mismatch(getattr(expert, projection)) is None, (backend_name, projection)


def test_every_backend_takes_some_source():
    """A backend that refused every case above would make its round trip vacuous."""
    for name, backend in all_backends().items():
        taken = [s for s in SOURCES if backend.refusal(MoELayerShape(2, 128, 64, s.bits, s.group_size, s.symmetric,
                                                                     "F16", s.activation_bits)) is None]
        assert len(taken) >= 8, (name, taken)


def test_every_output_records_what_it_targets(tmp_path):
    """moeconv.json and verify's report name the engine and kernel versions an output is for."""
    import json

    import moeconv
    from moeconv import engines
    from moeconv.synth import SynthSpec, make_checkpoint

    source = make_checkpoint(tmp_path / "src", SynthSpec())
    for name in all_backends():
        targets = engines.targets(name)
        assert targets.get("engine"), name
        moeconv.convert(source, tmp_path / name, backend=name)
        assert json.loads((tmp_path / name / "moeconv.json").read_text())["targets"] == targets
        assert moeconv.verify(tmp_path / name, level="lossless").to_json()["targets"] == targets


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
@pytest.mark.parametrize("name, w8a8", [("cpu", False), ("cpu", True), ("triton", True)])
def test_every_16_bit_scale_comes_back_from_float32_scales(name, w8a8, dtype):
    """The layouts that store float32 scales (the x86 cpu ones, triton's int8): every one of the 65,536
    float16 or bfloat16 patterns, NaNs (signalling ones too) and infinities included, as an expert's scales,
    encoded and decoded, is the same pattern. torch's own float16 -> float32 cast quiets a signalling NaN;
    the encoders widen exactly (packing.as_float32)."""
    backend = get_backend(name)
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)  # BF16's stored form: its bit patterns
    patterns = patterns.view(np.float16) if dtype == "F16" else patterns
    if w8a8:  # one scale per channel: the gate's and the up's 32,768 channels hold the patterns
        shape = MoELayerShape(1, 32, 1 << 15, 8, -1, True, dtype, activation_bits=8)
        scales = (patterns[: 1 << 15, None], patterns[1 << 15:, None], patterns[:32, None])
    else:  # groups of 4 along K = 1,024: each projection's (1,024, 256) scales hold the patterns 4 times
        shape = MoELayerShape(1, 1024, 1024, 4, 4, True, dtype)
        scales = (np.tile(patterns.reshape(1024, 64), (1, 4)),) * 3
    rng = np.random.default_rng(0)
    weights = [QuantizedWeight(codes=rng.integers(0, 1 << shape.bits, (s.shape[0], k), dtype=np.uint8),
                               zeros=None, scales=np.ascontiguousarray(s), bits=shape.bits, group_size=k // s.shape[1])
               for s, k in zip(scales, (shape.hidden, shape.hidden, shape.intermediate))]
    slices = backend.encode_expert(ExpertWeights(*weights), shape)
    decoded = backend.decode_expert(slices, shape)
    for projection, weight, back in zip(ExpertWeights._fields, weights, decoded):
        assert back.mismatch(weight) is None, projection
