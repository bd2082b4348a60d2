"""The vLLM plugin's loading (moeconv/engines/vllm_plugin/shards.py), without vLLM: rank r's part of each stacked
triton tensor, copied into the parameter of vLLM's compressed-tensors MoE method, must be exactly what
that parameter holds for the compressed-tensors encoding of the rank's own slice of the canonical
weights (gate and up rows [r·I/T, (r+1)·I/T), down's input columns likewise), encoded independently by
moeconv's compressed-tensors format; and the split is possible exactly when the backend's own `--tp`
check says so (the plugin refuses a layer with that same check). tests/engines/run_differential.py
shows the same against vLLM's own loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeconv.backends.base import ExpertWeights
from moeconv.backends.triton import INT8_LAYOUT, WNA16_LAYOUT, TritonBackend
from moeconv.canonical import MoELayerShape, QuantizedWeight
from moeconv.formats import CompressedTensors
from moeconv.engines.vllm_plugin.shards import PARAMETERS, fill

from strategies import as_tensors, random_canonical, weight_columns, weight_rows




def _ct_parameters(expert: ExpertWeights, bits: int, sym: bool, group_size: int) -> dict[str, torch.Tensor]:
    """One expert's compressed-tensors MoE parameters as vLLM's loader assembles them from a
    compressed-tensors checkpoint: each projection encoded by moeconv's compressed-tensors format
    (pack-quantized, N-first), gate rows then up rows in w13."""
    fmt = CompressedTensors(bits=bits, group_size=group_size, symmetric=sym)
    gate, up, down = (as_tensors(fmt.encode(w)) for w in expert)
    parameters = {"w13_weight_packed": torch.cat([gate["weight_packed"], up["weight_packed"]]),
                  "w13_weight_scale": torch.cat([gate["weight_scale"], up["weight_scale"]]),
                  "w2_weight_packed": down["weight_packed"], "w2_weight_scale": down["weight_scale"]}
    if not sym:
        parameters["w13_weight_zero_point"] = torch.cat([gate["weight_zero_point"], up["weight_zero_point"]])
        parameters["w2_weight_zero_point"] = down["weight_zero_point"]
    return parameters


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([4, 8]), sym=st.booleans(), group_size=st.sampled_from([32, 64, -1]),
       tp=st.sampled_from([1, 2, 4]), per_rank_groups=st.integers(1, 2), seed=st.integers(0, 2**31 - 1))
def test_each_rank_fills_the_compressed_tensors_parameters_of_its_slice(bits, sym, group_size, tp, per_rank_groups,
                                                                        seed):
    """`fill` copies rank r's part of each stacked triton tensor into the parameter vLLM's compressed-tensors
    MoE method holds, and the result is what that parameter holds when vLLM loads the compressed-tensors
    encoding of the rank's own slice of the canonical weights (gate and up rows [r·I/T, (r+1)·I/T),
    down's input columns likewise; channel-wise, the one scale and zero of each channel on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, intermediate = 64, tp * per_rank_groups * abs(group_size) * (32 if group_size == -1 else 1)
    groups = (lambda k: 1) if group_size == -1 else (lambda k: k // group_size)
    expert = ExpertWeights(*(random_canonical(gen, bits, sym, intermediate, hidden, groups(hidden)) for _ in range(2)),
                           random_canonical(gen, bits, sym, hidden, intermediate, groups(intermediate)))
    shape = MoELayerShape(1, hidden, intermediate, bits, group_size, sym, "F16", tp=tp)
    assert TritonBackend().refusal(shape) is None
    full = {name: tensor.unsqueeze(0) for name, tensor in as_tensors(TritonBackend().encode_expert(expert, shape)).items()}
    per = intermediate // tp
    for rank in range(tp):
        span = (rank * per, (rank + 1) * per)
        own = ExpertWeights(weight_rows(expert.gate, *span), weight_rows(expert.up, *span), weight_columns(expert.down, *span))
        expected = _ct_parameters(own, bits, sym, group_size)
        assert sorted(expected) == sorted(PARAMETERS[name] for name in full)
        for name, tensor in full.items():
            want = expected[PARAMETERS[name]]
            parameter = torch.full((1, *want.shape), -1, dtype=want.dtype)  # the sentinel must all be overwritten
            fill(WNA16_LAYOUT, name, tensor, parameter, intermediate, bits, group_size, tp, rank)
            assert torch.equal(parameter[0], want), (name, rank)


@pytest.mark.parametrize("intermediate, group_size, tp, splits", [
    (256, 32, 2, True), (256, 32, 8, True), (256, 64, 8, False),  # 32 per rank: half a group
    (96, 32, 4, False),  # 24 per rank
    (128, 128, 2, False),
])
def test_the_split_is_possible_exactly_when_the_backend_check_says_so(intermediate, group_size, tp, splits):
    shape = MoELayerShape(4, 128, intermediate, 4, group_size, False, "F16", tp=tp)
    assert (TritonBackend().refusal(shape) is None) == splits
    if splits:  # every rank's parts are whole bytes and whole groups, and they tile the tensor
        per = intermediate // tp
        rank_shape = MoELayerShape(4, 128, per, 4, group_size, False, "F16")
        for spec, rank_spec in zip(TritonBackend().layer_tensors(shape), TritonBackend().layer_tensors(rank_shape)):
            tensor = torch.arange(torch.Size(spec.shape).numel(), dtype=torch.int64).reshape(spec.shape)
            parts = []
            for rank in range(tp):
                part = torch.full(rank_spec.shape, -1, dtype=torch.int64)
                if not spec.name.endswith(("_qweight", "_qzeros")):  # (the packed ones view their int32 as bytes)
                    fill(WNA16_LAYOUT, spec.name, tensor, part, intermediate, 4, group_size, tp, rank)
                    parts.append(part)
            if parts:
                assert sorted(torch.cat([p.reshape(-1) for p in parts]).tolist()) == list(range(tensor.numel()))


def test_zero_points_that_do_not_fill_whole_words_per_rank_are_refused():
    """4-bit, I/T = 4: one rank's gate zero points are 2 bytes, half an int32 word of the parameter."""
    stored = torch.zeros(1, 2 * 8 // 2, 1, dtype=torch.uint8)  # w13_qzeros of I = 8, one group
    with pytest.raises(ValueError, match="not whole int32 words"):
        fill(WNA16_LAYOUT, "w13_qzeros", stored, torch.zeros(1, 1, 1, dtype=torch.int32), 8, 4, 64, 2, 0)


def test_the_plugin_is_an_entry_point_and_imports_no_vllm():
    """vLLM finds the plugin through the installed package's metadata; importing it (as every moeconv
    user without vLLM may) pulls in nothing of vLLM until vLLM calls `register`."""
    import subprocess
    import sys
    from importlib.metadata import entry_points

    assert [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "moeconv"] == [
        "moeconv.engines.vllm_plugin:register"]
    code = ("import sys, moeconv.engines.vllm_plugin, moeconv.engines.vllm_plugin.shards, "
            "moeconv.backends.triton_config; print('vllm' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


@settings(max_examples=20, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**31 - 1))
def test_each_rank_holds_its_slice_of_a_w8a8_expert(tp, seed):
    """The int8 W8A8 layout: gate/up rows and down columns split, one scale per output channel (down's
    scales are whole on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, intermediate = 64, 32 * tp
    expert = ExpertWeights(random_canonical(gen, 8, True, intermediate, hidden, 1),
                           random_canonical(gen, 8, True, intermediate, hidden, 1),
                           random_canonical(gen, 8, True, hidden, intermediate, 1))
    shape = MoELayerShape(1, hidden, intermediate, 8, -1, True, "F16", activation_bits=8, tp=tp)
    assert TritonBackend().refusal(shape) is None
    full = {name: tensor.unsqueeze(0) for name, tensor in as_tensors(TritonBackend().encode_expert(expert, shape)).items()}
    per = intermediate // tp
    for rank in range(tp):
        span = slice(rank * per, (rank + 1) * per)
        down = QuantizedWeight(np.ascontiguousarray(expert.down.codes[:, span]), None, expert.down.scales, 8, per)
        own = ExpertWeights(weight_rows(expert.gate, span.start, span.stop), weight_rows(expert.up, span.start, span.stop), down)
        expected = as_tensors(TritonBackend().encode_expert(own, MoELayerShape(1, hidden, per, 8, -1, True, "F16",
                                                                               activation_bits=8)))
        for name, tensor in full.items():
            assert PARAMETERS[name] == name  # the W8A8 method's parameters carry the stacked names
            parameter = torch.full((1, *expected[name].shape), -1, dtype=expected[name].dtype)
            fill(INT8_LAYOUT, name, tensor, parameter, intermediate, 8, -1, tp, rank)
            assert torch.equal(parameter[0], expected[name]), (name, rank)


@pytest.mark.parametrize("experts", [[2, 3], [1, 3], [3, 0]])
def test_expert_parallel_slots_hold_their_global_experts(experts):
    """Expert parallelism: slot s of the rank's parameter holds global expert experts[s] of the stacked
    tensor, whole (a consecutive run, or any order vLLM's expert map places)."""
    stored = torch.arange(4 * 6 * 2, dtype=torch.int64).reshape(4, 6, 2)
    parameter = torch.full((2, 6, 2), -1, dtype=torch.int64)
    fill(WNA16_LAYOUT, "w13_scales", stored, parameter, 3, 4, 32, 1, 0, torch.tensor(experts))
    assert parameter.tolist() == [stored[e].tolist() for e in experts]
    with pytest.raises(ValueError, match="are not among the 4 stored"):
        fill(WNA16_LAYOUT, "w13_scales", stored, parameter, 3, 4, 32, 1, 0, torch.tensor([3, 4]))


@settings(max_examples=20, deadline=None)
@given(scheme=st.sampled_from(["mxfp4", "nvfp4", "nvfp4 w4a4"]), tp=st.sampled_from([1, 2, 4]),
       seed=st.integers(0, 2**31 - 1))
def test_each_rank_holds_its_slice_of_a_float_coded_expert(scheme, tp, seed):
    """The float layouts: rank r's parameters of vLLM's compressed-tensors MXFP4 / NVFP4 MoE method hold gate's and
    up's rows [r·I/T, (r+1)·I/T) and down's input columns likewise (codes two a byte, one scale a block), sliced
    here from each projection's own bytes; the global scales whole on every rank."""
    from moeconv.float_codes import DIVIDE, MXFP4, FloatWeight, nvfp4

    float_scheme = MXFP4 if scheme == "mxfp4" else nvfp4(DIVIDE, scheme.endswith("w4a4"))
    block, rng = float_scheme.block, np.random.default_rng(seed)
    hidden, intermediate = 64, 2 * block * tp

    def weight(n: int, k: int) -> FloatWeight:
        scalar = (lambda: rng.uniform(1, 500, ()).astype(np.float32))
        return FloatWeight(rng.integers(0, 256, (n, k // 2), dtype=np.uint8),
                           rng.integers(0, 127, (n, k // block), dtype=np.uint8), float_scheme,
                           scalar() if float_scheme.global_convention else None,
                           scalar() if float_scheme.input_scale else None)

    gate, up, down = weight(intermediate, hidden), weight(intermediate, hidden), weight(hidden, intermediate)
    shape = MoELayerShape(1, hidden, intermediate, 4, block, True, float_scheme.scale_dtype, tp=tp,
                          float_scheme=float_scheme)
    assert TritonBackend().refusal(shape) is None
    full = {name: torch.from_numpy(np.ascontiguousarray(array))[None]
            for name, array in TritonBackend().from_float({"gate": gate, "up": up, "down": down}, shape).items()}
    per = intermediate // tp
    for rank in range(tp):
        rows, columns = slice(rank * per, (rank + 1) * per), slice(rank * per // 2, (rank + 1) * per // 2)
        groups = slice(rank * per // block, (rank + 1) * per // block)
        expected = {"w13_weight_packed": np.concatenate([gate.packed[rows], up.packed[rows]]),
                    "w13_weight_scale": np.concatenate([gate.scales[rows], up.scales[rows]]),
                    "w2_weight_packed": down.packed[:, columns], "w2_weight_scale": down.scales[:, groups]}
        for field, suffix in (("global_scale", "weight_global_scale"), ("input_scale", "input_global_scale")):
            if getattr(gate, field) is not None:
                expected[f"w13_{suffix}"] = np.array([getattr(gate, field), getattr(up, field)])
                expected[f"w2_{suffix}"] = getattr(down, field)
        assert sorted(expected) == sorted(full) and all(PARAMETERS[name] == name for name in full)
        for name, tensor in full.items():
            want = torch.from_numpy(np.ascontiguousarray(expected[name]))
            parameter = torch.full((1, *want.shape), 7, dtype=want.dtype)
            fill(scheme.split()[0], name, tensor, parameter, intermediate, 4, block, tp, rank)
            assert torch.equal(parameter[0], want), (name, rank)
