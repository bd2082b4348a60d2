"""Every packed-to-packed transcoder gives exactly the bytes of the canonical route (decode to the
canonical form, then the backend's encode_expert), for every bit width, symmetric and asymmetric
zero points (edges 0 and 2^b - 1 included, v1 borrow chains included), group size (channel-wise and
g >= K), regroup factor and size; and a whole conversion is byte-identical with and without them."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moeconv import transcoders
from moeconv.backends.base import ExpertWeights
from moeconv.backends.compressed_tensors import CompressedTensorsBackend
from moeconv.backends.cpu import CpuBackend
from moeconv.backends.humming import HummingBackend
from moeconv.backends.triton import TritonBackend
from moeconv.canonical import LinearShape, MoELayerShape, QuantizedWeight, regroup
from moeconv.formats import AWQ, GPTQ, CompressedTensors

from strategies import random_canonical

def _as_stored(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """What a worker hands a transcoder: each tensor's stored bytes as numpy (TensorReader.read_raw:
    BF16 as its uint16 bit patterns)."""
    return {suffix: tensor.view(torch.int16).numpy().view(np.uint16) if tensor.dtype == torch.bfloat16
            else tensor.numpy() for suffix, tensor in tensors.items()}


SOURCES = ([GPTQ(bits, g, sym, version) for bits in (4, 8) for g in (32, 64, 128, -1) for sym in (True, False)
            for version in ("gptq", "gptq_v2")]
           + [AWQ(4, g, zero_point=zp) for g in (32, 64, 128, -1) for zp in (True, False)]
           + [CompressedTensors(bits=bits, group_size=g, symmetric=sym) for bits in (4, 8) for g in (32, 128, -1)
              for sym in (True, False)])


PAIRS = ([(source, "triton") for source in SOURCES]
         + [(source, backend) for source in SOURCES for backend in ("compressed-tensors", "humming")]
         + [(source, "cpu") for source in SOURCES if source.bits == 4])
BACKENDS = {"triton": TritonBackend(), "compressed-tensors": CompressedTensorsBackend(), "humming": HummingBackend(),
            "cpu": CpuBackend()}


@pytest.mark.parametrize("source, backend", PAIRS,
                         ids=lambda p: p if isinstance(p, str) else "-".join(map(str, p.describe().values())))
@given(data=st.data(), scale_dtype=st.sampled_from([torch.float16, torch.bfloat16]))
def test_transcoder_equals_the_canonical_route(source, backend, data, scale_dtype):
    unit = 32 if source.group_size == -1 else source.group_size
    hidden, intermediate = unit * data.draw(st.integers(1, 3)), unit * data.draw(st.integers(1, 2))
    factor = data.draw(st.sampled_from([f for f in (1, 2, 4) if source.group_size == -1 and f == 1
                                        or source.group_size // f >= 32]))
    group = -1 if source.group_size == -1 else source.group_size // factor
    shape = MoELayerShape(experts=1, hidden=hidden, intermediate=intermediate, bits=source.bits, group_size=group,
                          symmetric=source.symmetric, scale_dtype="F16" if scale_dtype == torch.float16 else "BF16")
    transcoder = transcoders.find(source, backend, shape)
    assert transcoder is not None
    stored = {}
    for projection, (n, k) in (("gate", (intermediate, hidden)), ("up", (intermediate, hidden)),
                               ("down", (hidden, intermediate))):
        groups = 1 if source.group_size == -1 or source.group_size >= k else k // source.group_size
        weight = random_canonical(torch.Generator().manual_seed(data.draw(st.integers(0, 2**31))), source.bits,
                                  source.symmetric, n, k, groups, scale_dtype)
        if weight.zeros is not None and data.draw(st.booleans()):  # whole rows at an edge: v1 borrows
            weight.zeros[: min(n, 8)] = data.draw(st.sampled_from([0, (1 << source.bits) - 1]))
        stored[projection] = source.encode(weight)
    canonical = ExpertWeights(**{p: regroup(source.decode(t), factor) for p, t in stored.items()})
    expected = BACKENDS[backend].encode_expert(canonical, shape)
    found = transcoder(source, {projection: _as_stored(tensors) for projection, tensors in stored.items()}, shape,
                       factor)
    assert set(found) == set(expected)
    for suffix, tensor in expected.items():
        assert found[suffix].shape == tuple(tensor.shape), suffix
        assert found[suffix].itemsize == tensor.element_size(), suffix
        assert found[suffix].tobytes() == tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), suffix


@pytest.mark.parametrize("source, backend", [(source, backend) for source in SOURCES
                                             for backend in ("compressed-tensors", "humming")],
                         ids=lambda p: p if isinstance(p, str) else "-".join(map(str, p.describe().values())))
@given(data=st.data(), scale_dtype=st.sampled_from([torch.float16, torch.bfloat16]))
def test_the_dense_linear_transcoder_equals_the_canonical_route(source, backend, data, scale_dtype):
    """A dense GPTQ or AWQ linear written in compressed-tensors (by that backend, and by triton for an
    asymmetric GPTQ source): the bytes of CompressedTensorsBackend.encode_linear of the decoded,
    regrouped weight."""
    unit = 32 if source.group_size == -1 else source.group_size
    n, k = 8 * data.draw(st.integers(1, 12)), unit * data.draw(st.integers(1, 3))
    factor = data.draw(st.sampled_from([f for f in (1, 2, 4) if source.group_size == -1 and f == 1
                                        or source.group_size // f >= 32]))
    groups = 1 if source.group_size == -1 or source.group_size >= k else k // source.group_size
    weight = random_canonical(torch.Generator().manual_seed(data.draw(st.integers(0, 2**31))), source.bits,
                              source.symmetric, n, k, groups, scale_dtype)
    if weight.zeros is not None and data.draw(st.booleans()):  # whole rows at an edge: v1 borrows
        weight.zeros[: min(n, 8)] = data.draw(st.sampled_from([0, (1 << source.bits) - 1]))
    stored = source.encode(weight)
    linear = LinearShape(n, k, source.bits, -1 if source.group_size == -1 else source.group_size // factor,
                         source.symmetric, "F16" if scale_dtype == torch.float16 else "BF16")
    expected = BACKENDS[backend].encode_linear(regroup(source.decode(stored), factor), linear)
    transcoder = transcoders.find_linear(source, backend)
    found = transcoder(source, _as_stored(stored), factor)
    assert set(found) == set(expected)
    for suffix, tensor in expected.items():
        assert found[suffix].shape == tuple(tensor.shape) and found[suffix].itemsize == tensor.element_size(), suffix
        assert found[suffix].tobytes() == tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), suffix


# fp16 / bf16 bit patterns of scales at the edges: signalling and quiet NaNs with payloads, both infinities,
# -0, the smallest subnormal, the largest finite value.
EDGE_SCALES = {torch.float16: [0x7C01, 0x7E00, 0xFD55, 0x7C00, 0xFC00, 0x8000, 0x0001, 0x7BFF],
               torch.bfloat16: [0x7F81, 0x7FC0, 0xFFAA, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x7F7F]}


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("nan", [True, False], ids=["with-nan", "no-nan"])
def test_the_cpu_transcoder_keeps_edge_scales_or_leaves_them_to_the_canonical_route(scale_dtype, nan):
    """The x86 layout stores fp32 scales. torch's fp16 -> fp32 (the canonical route) quiets a signalling
    NaN, numpy's keeps its bits: an fp16 expert with a NaN scale is left to the canonical route; every
    other edge value, and every BF16 one (a shift in both), is transcoded to the canonical route's bytes."""
    fmt = GPTQ(4, 32, sym=False)
    patterns = [p for p in EDGE_SCALES[scale_dtype] if nan or p not in EDGE_SCALES[scale_dtype][:3]]
    weight = random_canonical(torch.Generator().manual_seed(1), 4, False, 64, 64, 2, scale_dtype)
    edges = torch.tensor(patterns, dtype=torch.int32).to(torch.int16).view(scale_dtype)
    weight.scales.view(-1)[: len(patterns)] = edges
    shape = MoELayerShape(1, 64, 32, 4, 32, False, "F16" if scale_dtype == torch.float16 else "BF16")
    stored = {"gate": fmt.encode(weight), "up": fmt.encode(weight),
              "down": fmt.encode(random_canonical(torch.Generator().manual_seed(2), 4, False, 64, 32, 1, scale_dtype))}
    found = transcoders.gptq_to_cpu(fmt, {p: _as_stored(t) for p, t in stored.items()}, shape, 1)
    if nan and scale_dtype == torch.float16:
        assert found is None
        return
    expected = CpuBackend().encode_expert(ExpertWeights(**{p: fmt.decode(t) for p, t in stored.items()}), shape)
    assert set(found) == set(expected)
    for suffix, tensor in expected.items():
        assert found[suffix].tobytes() == tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), suffix


def test_pairs_without_a_transcoder_take_the_canonical_route():
    shape = MoELayerShape(1, 64, 32, 4, 32, False, "F16")
    assert transcoders.find(GPTQ(8, -1, sym=True), "cpu", MoELayerShape(1, 64, 32, 8, -1, True, "F16")) is None
    w8a8 = CompressedTensors(bits=8, group_size=-1, symmetric=True, activation_bits=8, format="int-quantized")
    assert transcoders.find(w8a8, "cpu", MoELayerShape(1, 64, 32, 8, -1, True, "F16", activation_bits=8)) is None
    assert transcoders.find_linear(AWQ(4, 32), "triton") is None
    assert transcoders.find_linear(GPTQ(4, 32, sym=False), "compressed-tensors", activation_bits=8) is None
    assert transcoders.find_linear(GPTQ(4, 32, sym=False), None) is None
    assert transcoders.find(GPTQ(2, 32, sym=False), "triton", shape) is None
    assert transcoders.find(GPTQ(8, -1, sym=True), "triton", MoELayerShape(1, 64, 32, 8, -1, True, "F16",
                                                                           activation_bits=8)) is None


def test_the_transcoder_leaves_act_order_experts_to_the_canonical_route():
    fmt = GPTQ(4, 32, sym=False)
    weight = QuantizedWeight(torch.zeros(64, 64, dtype=torch.uint8), torch.zeros(64, 2, dtype=torch.uint8),
                             torch.ones(64, 2, dtype=torch.float16), 4, 32)
    stored = {p: _as_stored(fmt.encode(weight)) for p in ("gate", "up", "down")}
    shape = MoELayerShape(1, 64, 64, 4, 32, False, "F16")
    assert transcoders.gptq_to_triton(fmt, stored, shape, 1) is not None
    stored["down"]["g_idx"] = np.arange(64, dtype=np.int32) % 2  # act-order: folded by the canonical route
    assert transcoders.gptq_to_triton(fmt, stored, shape, 1) is None


@pytest.mark.parametrize("source, backend", [(GPTQ(4, 128, sym=False), "triton"), (AWQ(4, 64, zero_point=True), "triton"),
                                             (GPTQ(4, 128, sym=False), "compressed-tensors"),
                                             (GPTQ(8, 64, sym=True, checkpoint_format="gptq_v2"), "compressed-tensors"),
                                             (AWQ(4, 64, zero_point=True), "compressed-tensors"),
                                             (GPTQ(4, 64, sym=True), "humming"), (AWQ(4, 64, zero_point=True), "humming"),
                                             (CompressedTensors(bits=4, group_size=64, symmetric=False), "triton"),
                                             (CompressedTensors(bits=4, group_size=64, symmetric=True), "humming"),
                                             (GPTQ(4, 128, sym=False), "cpu"), (AWQ(4, 64, zero_point=True), "cpu")],
                         ids=str)
def test_a_conversion_is_byte_identical_without_the_transcoders(tmp_path, monkeypatch, source, backend):
    """Whole conversions, dense linears included (an asymmetric GPTQ source's triton output writes them in
    compressed-tensors), with the transcoders and through the canonical route; the first runs its workers
    without torch where every job has a transcoder."""
    import moeconv
    from moeconv.api import plan as make_plan
    from moeconv.synth import SynthSpec, make_checkpoint

    checkpoint = make_checkpoint(tmp_path / "src", SynthSpec(source_format=source, hidden=256, intermediate=128))
    fast = moeconv.convert(checkpoint, tmp_path / "fast", backend=backend, regroup=True)
    assert fast.plan["transcoder"] == f"{source.describe()['method'].replace('-', '_')}_to_{backend.replace('-', '_')}"
    assert not make_plan(checkpoint, backend=backend, regroup=True).workers_need_torch
    monkeypatch.setattr(transcoders, "find", lambda *args: None)
    monkeypatch.setattr(transcoders, "find_linear", lambda *args: None)
    slow = moeconv.convert(checkpoint, tmp_path / "slow", backend=backend, regroup=True)
    assert slow.plan["transcoder"] is None
    digests = [{path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in folder.glob("*.safetensors")}
               for folder in (tmp_path / "fast", tmp_path / "slow")]
    assert digests[0] == digests[1] and digests[0]


DATA = Path(__file__).parent / "data"
# Checkpoints the real producers wrote with their full algorithms: GPTQModel 7.7.0 (calibration, error
# feedback; v1 and v2 saves) and AutoRound 0.16.1 (AWQ- and GPTQ-packed), tests/data/*/README.md.
REAL = [("gptq_asym/b4_g32/v1", "gptq"), ("gptq_asym/b4_g32/v2", "gptq_v2"), ("autoround/ar-awq-asym-g32", None),
        ("autoround/ar-awq-asym-g128", None), ("autoround/ar-gptq-sym-g32", None), ("autoround/ar-gptq-sym-g128", None)]


@pytest.mark.parametrize("backend", ["triton", "compressed-tensors", "humming", "cpu"])
@pytest.mark.parametrize("source, zero_format", REAL, ids=[path for path, _ in REAL])
def test_real_producers_checkpoints_convert_byte_identical_without_the_transcoders(tmp_path, monkeypatch, source,
                                                                                     zero_format, backend):
    """What the transcoders read is what the real producers wrote, not only codes made by their
    rounding rule: each of these converts through its transcoder to the canonical route's bytes."""
    import moeconv

    fast = moeconv.convert(DATA / source, tmp_path / "fast", backend=backend, zero_format=zero_format, workers=1)
    assert fast.plan["transcoder"] is not None
    monkeypatch.setattr(transcoders, "find", lambda *args: None)
    monkeypatch.setattr(transcoders, "find_linear", lambda *args: None)
    slow = moeconv.convert(DATA / source, tmp_path / "slow", backend=backend, zero_format=zero_format, workers=1)
    assert slow.plan["transcoder"] is None
    digests = [{path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in folder.glob("*.safetensors")}
               for folder in (tmp_path / "fast", tmp_path / "slow")]
    assert digests[0] == digests[1] and digests[0]
