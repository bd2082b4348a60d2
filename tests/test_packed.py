"""The packed route (a format's `to_packed`, a layout's `from_packed`: moeconv/packed.py) gives exactly the bytes
of the canonical route (the format's decode, then the layout's encode), for every registered format that packs
and every registered backend that takes the packed form: every bit width, symmetric and asymmetric zero points
(edges 0 and 2^b - 1 included, GPTQ v1 borrow chains included), group size (channel-wise and g >= K), regroup
factor and size, experts and dense linears; and whole conversions are byte-identical with and without it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moeconv
from moeconv import transform
from moeconv.backends import all_backends
from moeconv.backends.base import ExpertWeights
from moeconv.backends.cpu import CpuBackend
from moeconv.canonical import LinearShape, MoELayerShape, QuantizedWeight, regroup
from moeconv.formats import (AWQ, GPTQ, REGISTRY, AutoRound, CompressedTensors, CompressedTensorsFloat, DeepSeekV4Fp4,
                             GptOssMxfp4, ModelOpt, ModelOptNvfp4)

from strategies import random_canonical

# Every registered format class that packs, by the parameters that change the packed form's shape (the group
# size, GPTQ's zero-point convention, the regroup factor and the scale dtype are drawn).
PACKING = {GPTQ: [dict(bits=bits, sym=sym) for bits in (4, 8) for sym in (True, False)],
           AWQ: [dict(zero_point=zero_point) for zero_point in (True, False)],
           CompressedTensors: [dict(bits=bits, symmetric=sym) for bits in (4, 8) for sym in (True, False)]}
GROUP_SIZES = (32, 64, 128, -1)
BACKENDS = all_backends()
# Every pair but 8-bit into the cpu layout, which takes 4-bit weights only (W8A8 aside, whose codes are not packed).
ROUTES = [(cls, params, name) for cls, grid in PACKING.items() for params in grid for name in BACKENDS
          if not (name == "cpu" and params.get("bits", 4) == 8)]


def _id(value) -> str:
    return value.__name__ if isinstance(value, type) else "-".join(f"{k}{v}" for k, v in value.items()) \
        if isinstance(value, dict) else str(value)


def test_every_registered_format_that_packs_is_covered():
    """A new format that packs is added to PACKING; the others take the canonical route."""
    assert not ModelOpt.packs and not CompressedTensors(format="int-quantized", bits=8, group_size=-1).packs
    # float codes have their own route (float_codes.py), never the packed form of integer words
    assert not CompressedTensorsFloat.packs and not ModelOptNvfp4.packs and not GptOssMxfp4.packs
    assert not DeepSeekV4Fp4.packs
    # AutoRound reads its config into the GPTQ or AWQ format its packing names.
    assert set(REGISTRY.values()) - {AutoRound, ModelOpt, CompressedTensorsFloat, ModelOptNvfp4, GptOssMxfp4,
                                     DeepSeekV4Fp4} == set(PACKING)
    assert all(cls(**params).packs for cls, grid in PACKING.items() for params in grid)


def _source(cls: type, params: dict, data) -> object:
    group_size = data.draw(st.sampled_from(GROUP_SIZES))
    if cls is GPTQ:
        params = {**params, "checkpoint_format": data.draw(st.sampled_from(["gptq", "gptq_v2"]))}
    return cls(group_size=group_size, **params) if cls is not AWQ else cls(bits=4, group_size=group_size, **params)


def _factor(source, data) -> int:
    return data.draw(st.sampled_from([f for f in (1, 2, 4) if source.group_size == -1 and f == 1
                                      or source.group_size // f >= 32]))


def _stored_weight(source, n: int, k: int, scale_dtype, data) -> dict[str, np.ndarray]:
    groups = 1 if source.group_size == -1 or source.group_size >= k else k // source.group_size
    weight = random_canonical(torch.Generator().manual_seed(data.draw(st.integers(0, 2**31))), source.bits,
                              source.symmetric, n, k, groups, scale_dtype)
    if weight.zeros is not None:  # whole rows at an edge (v1 borrows), or every zero point and code at one
        edge = data.draw(st.sampled_from([None, 0, (1 << source.bits) - 1]))
        if edge is not None:
            weight.zeros[: min(n, 8)] = edge
    codes = data.draw(st.sampled_from([None, 0, (1 << source.bits) - 1]))
    if codes is not None:
        weight.codes.fill(codes)
    return source.encode(weight)


def _same_bytes(found: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert set(found) == set(expected)
    for suffix, array in expected.items():
        assert found[suffix].shape == array.shape, suffix
        assert found[suffix].itemsize == array.itemsize, suffix
        assert found[suffix].tobytes() == array.tobytes(), suffix


@pytest.mark.parametrize("cls, params, backend", ROUTES, ids=_id)
@given(data=st.data(), scale_dtype=st.sampled_from([torch.float16, torch.bfloat16]))
def test_an_expert_through_the_packed_form_equals_the_canonical_route(cls, params, backend, data, scale_dtype):
    source, layout = _source(cls, params, data), BACKENDS[backend]
    unit = 32 if source.group_size == -1 else source.group_size
    hidden, intermediate = unit * data.draw(st.integers(1, 3)), unit * data.draw(st.integers(1, 2))
    factor = _factor(source, data)
    layer = MoELayerShape(experts=1, hidden=hidden, intermediate=intermediate, bits=source.bits,
                          group_size=-1 if source.group_size == -1 else source.group_size // factor,
                          symmetric=source.symmetric, scale_dtype="F16" if scale_dtype == torch.float16 else "BF16")
    assert layout.refusal(layer) is None and layout.takes_packed(layer)
    stored = {projection: _stored_weight(source, n, k, scale_dtype, data)
              for projection, (n, k) in (("gate", (intermediate, hidden)), ("up", (intermediate, hidden)),
                                         ("down", (hidden, intermediate)))}
    expected = layout.encode_expert(ExpertWeights(**{p: regroup(source.decode(t), factor) for p, t in stored.items()}),
                                    layer)
    packed = {p: source.to_packed(t).regrouped(factor) for p, t in stored.items()}
    _same_bytes(layout.from_packed(packed, layer), expected)


@pytest.mark.parametrize("cls, params, backend", [route for route in ROUTES if BACKENDS[route[2]].linear_layout is not None],
                         ids=_id)
@given(data=st.data(), scale_dtype=st.sampled_from([torch.float16, torch.bfloat16]))
def test_a_dense_linear_through_the_packed_form_equals_the_canonical_route(cls, params, backend, data, scale_dtype):
    source, layout = _source(cls, params, data), BACKENDS[backend].linear_layout
    unit = 32 if source.group_size == -1 else source.group_size
    n, k = 32 * data.draw(st.integers(1, 4)), unit * data.draw(st.integers(1, 3))
    factor = _factor(source, data)
    linear = LinearShape(n, k, source.bits, -1 if source.group_size == -1 else source.group_size // factor,
                         source.symmetric, "F16" if scale_dtype == torch.float16 else "BF16")
    assert layout.linear_refusal(linear) is None and layout.takes_packed(linear)
    stored = _stored_weight(source, n, k, scale_dtype, data)
    expected = layout.encode_linear(regroup(source.decode(stored), factor), linear)
    _same_bytes(layout.from_packed_linear(source.to_packed(stored).regrouped(factor), linear), expected)


def test_the_built_in_layouts_take_the_packed_form():
    int4 = MoELayerShape(1, 64, 32, 4, 32, False, "F16")
    assert all(layout.takes_packed(int4) for layout in BACKENDS.values())
    w8a8 = MoELayerShape(1, 64, 32, 8, -1, True, "F16", activation_bits=8)
    assert not any(layout.takes_packed(w8a8) for layout in BACKENDS.values())  # int8 codes are not packed
    assert not BACKENDS["cpu"].takes_packed(MoELayerShape(1, 64, 32, 8, -1, True, "F16"))  # refused: 8-bit


# fp16 / bf16 bit patterns of scales at the edges: signalling and quiet NaNs with payloads, both infinities,
# -0, the smallest subnormal, the largest finite value.
EDGE_SCALES = {torch.float16: [0x7C01, 0x7E00, 0xFD55, 0x7C00, 0xFC00, 0x8000, 0x0001, 0x7BFF],
               torch.bfloat16: [0x7F81, 0x7FC0, 0xFFAA, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x7F7F]}


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_the_cpu_layout_keeps_edge_scales_through_the_packed_form(scale_dtype):
    """The x86 layout stores fp32 scales, widened exactly on both routes (packing.as_float32: torch's own
    fp16 -> fp32 would quiet a signalling NaN): every edge value, NaN payloads included, goes through the
    packed form to the canonical route's bytes."""
    fmt = GPTQ(4, 32, sym=False)
    patterns = EDGE_SCALES[scale_dtype]
    weight = random_canonical(torch.Generator().manual_seed(1), 4, False, 64, 64, 2, scale_dtype)
    weight.scales.view(np.uint16).reshape(-1)[: len(patterns)] = patterns
    shape = MoELayerShape(1, 64, 32, 4, 32, False, "F16" if scale_dtype == torch.float16 else "BF16")
    stored = {"gate": fmt.encode(weight), "up": fmt.encode(weight),
              "down": fmt.encode(random_canonical(torch.Generator().manual_seed(2), 4, False, 64, 32, 1, scale_dtype))}
    found = CpuBackend().from_packed({p: fmt.to_packed(t) for p, t in stored.items()}, shape)
    _same_bytes(found, CpuBackend().encode_expert(ExpertWeights(**{p: fmt.decode(t) for p, t in stored.items()}), shape))
    scales = found["w13_blocked_scales"][0, :, 0] if scale_dtype == torch.float16 else None
    if scales is not None:  # channel 0's first group: the signalling NaN 0x7C01 kept its payload in float32
        assert scales.view(np.uint32)[0] == 0x7F802000


@pytest.mark.parametrize("fmt, g_idx_suffix", [(GPTQ(4, 32, sym=False), "g_idx"),
                                               (CompressedTensors(bits=4, group_size=32, symmetric=False), "weight_g_idx")],
                         ids=["gptq", "compressed-tensors"])
def test_an_act_order_linear_is_left_to_the_canonical_route(fmt, g_idx_suffix):
    weight = QuantizedWeight(np.zeros((64, 64), dtype=np.uint8), np.zeros((64, 2), dtype=np.uint8),
                             np.ones((64, 2), dtype=np.float16), 4, 32)
    stored = fmt.encode(weight)
    assert fmt.to_packed({**stored, g_idx_suffix: np.arange(64, dtype=np.int32) // 32}) is not None
    assert fmt.to_packed({**stored, g_idx_suffix: np.arange(64, dtype=np.int32) % 2}) is None  # folded or refused


def _digests(folder: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in folder.glob("*.safetensors")}


def _both_routes(tmp_path, monkeypatch, source: Path, backend: str, **options) -> None:
    fast = moeconv.convert(source, tmp_path / "fast", backend=backend, workers=1, **options)
    assert fast.plan["route"] == "packed"
    monkeypatch.setattr(transform, "takes_packed", lambda job, codec: False)
    slow = moeconv.convert(source, tmp_path / "slow", backend=backend, workers=1, **options)
    assert slow.plan["route"] == "canonical"
    assert _digests(tmp_path / "fast") == _digests(tmp_path / "slow") and _digests(tmp_path / "fast")


@pytest.mark.parametrize("source, backend", [(GPTQ(4, 128, sym=False), "triton"), (AWQ(4, 64, zero_point=True), "triton"),
                                             (GPTQ(4, 128, sym=False), "compressed-tensors"),
                                             (GPTQ(8, 64, sym=True, checkpoint_format="gptq_v2"), "compressed-tensors"),
                                             (AWQ(4, 64, zero_point=True), "compressed-tensors"),
                                             (GPTQ(4, 64, sym=True), "humming"), (AWQ(4, 64, zero_point=True), "humming"),
                                             (CompressedTensors(bits=4, group_size=64, symmetric=False), "triton"),
                                             (CompressedTensors(bits=4, group_size=64, symmetric=True), "humming"),
                                             (GPTQ(4, 128, sym=False), "cpu"), (AWQ(4, 64, zero_point=True), "cpu")],
                         ids=str)
def test_a_conversion_is_byte_identical_without_the_packed_route(tmp_path, monkeypatch, source, backend):
    """Whole conversions, dense linears included (an asymmetric GPTQ source's triton output writes them in
    compressed-tensors), through the packed form and through the canonical route."""
    from moeconv.synth import SynthSpec, make_checkpoint

    checkpoint = make_checkpoint(tmp_path / "src", SynthSpec(source_format=source, hidden=256, intermediate=128))
    _both_routes(tmp_path, monkeypatch, checkpoint, backend, regroup=True)


DATA = Path(__file__).parent / "data"
# Checkpoints the real producers wrote with their full algorithms: GPTQModel 7.7.0 (calibration, error
# feedback; v1 and v2 saves) and AutoRound 0.16.1 (AWQ- and GPTQ-packed), tests/data/*/README.md.
REAL = [("gptq_asym/b4_g32/v1", "gptq"), ("gptq_asym/b4_g32/v2", "gptq_v2"), ("autoround/ar-awq-asym-g32", None),
        ("autoround/ar-awq-asym-g128", None), ("autoround/ar-gptq-sym-g32", None), ("autoround/ar-gptq-sym-g128", None)]


@pytest.mark.parametrize("backend", ["triton", "compressed-tensors", "humming", "cpu"])
@pytest.mark.parametrize("source, zero_format", REAL, ids=[path for path, _ in REAL])
def test_real_producers_checkpoints_convert_byte_identical_without_the_packed_route(tmp_path, monkeypatch, source,
                                                                                      zero_format, backend):
    """What the packed form reads is what the real producers wrote, not only codes made by their rounding
    rule: each of these converts through it to the canonical route's bytes."""
    _both_routes(tmp_path, monkeypatch, DATA / source, backend, zero_format=zero_format)
