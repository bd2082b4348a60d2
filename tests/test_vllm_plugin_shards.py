"""The vLLM plugin's tensor-parallel loading (moeconv/vllm_plugin/shards.py), without vLLM: rank r's
part of each stacked triton tensor must be exactly what the triton layout holds for the rank's own
slice of the canonical weights (gate and up rows [r·I/T, (r+1)·I/T), down's input columns likewise),
encoded independently; and the split is possible exactly when the backend's own `--tp` check says so
(the plugin refuses a layer with that same check)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeconv.backends.base import ExpertWeights
from moeconv.backends.triton import TritonBackend
from moeconv.canonical import MoELayerShape, QuantizedWeight
from moeconv.vllm_plugin.shards import rank_part

from strategies import random_canonical


def _rows(weight: QuantizedWeight, start: int, stop: int) -> QuantizedWeight:
    return QuantizedWeight(weight.codes[start:stop].contiguous(),
                           None if weight.zeros is None else weight.zeros[start:stop].contiguous(),
                           weight.scales[start:stop].contiguous(), weight.bits, weight.group_size)


def _columns(weight: QuantizedWeight, start: int, stop: int) -> QuantizedWeight:
    g = weight.group_size
    return QuantizedWeight(weight.codes[:, start:stop].contiguous(),
                           None if weight.zeros is None else weight.zeros[:, start // g:stop // g].contiguous(),
                           weight.scales[:, start // g:stop // g].contiguous(), weight.bits, g)


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([4, 8]), sym=st.booleans(), group_size=st.sampled_from([32, 64]),
       tp=st.sampled_from([1, 2, 4]), per_rank_groups=st.integers(1, 2), seed=st.integers(0, 2**31 - 1))
def test_each_rank_holds_its_slice_of_the_canonical_expert(bits, sym, group_size, tp, per_rank_groups, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden, intermediate = 64, tp * per_rank_groups * group_size
    expert = ExpertWeights(*(random_canonical(gen, bits, sym, intermediate, hidden, hidden // group_size)
                             for _ in range(2)),
                           random_canonical(gen, bits, sym, hidden, intermediate, intermediate // group_size))
    shape = MoELayerShape(1, hidden, intermediate, bits, group_size, sym, "F16", tp=tp)
    assert TritonBackend().refusal(shape) is None
    full = {name: tensor.unsqueeze(0) for name, tensor in TritonBackend().encode_expert(expert, shape).items()}
    per = intermediate // tp
    rank_shape = MoELayerShape(1, hidden, per, bits, group_size, sym, "F16")
    for rank in range(tp):
        span = (rank * per, (rank + 1) * per)
        own = ExpertWeights(_rows(expert.gate, *span), _rows(expert.up, *span), _columns(expert.down, *span))
        expected = TritonBackend().encode_expert(own, rank_shape)
        for name, tensor in full.items():
            part = rank_part(name, tensor, intermediate, bits, group_size, tp, rank)
            assert torch.equal(part[0], expected[name]), (name, rank)


@pytest.mark.parametrize("intermediate, group_size, tp, splits", [
    (256, 32, 2, True), (256, 32, 8, True), (256, 64, 8, False),  # 32 per rank: half a group
    (96, 32, 4, False),  # 24 per rank
    (128, 128, 2, False),
])
def test_the_split_is_possible_exactly_when_the_backend_check_says_so(intermediate, group_size, tp, splits):
    shape = MoELayerShape(4, 128, intermediate, 4, group_size, False, "F16", tp=tp)
    assert (TritonBackend().refusal(shape) is None) == splits
    if splits:  # every rank's parts are whole bytes and whole groups, and they tile the tensor
        for spec in TritonBackend().layer_tensors(shape):
            tensor = torch.arange(torch.Size(spec.shape).numel(), dtype=torch.int64).reshape(spec.shape)
            parts = [rank_part(spec.name, tensor, intermediate, 4, group_size, tp, r) for r in range(tp)]
            assert sorted(torch.cat([p.reshape(-1) for p in parts]).tolist()) == list(range(tensor.numel()))


def test_the_plugin_is_an_entry_point_and_imports_no_vllm():
    """vLLM finds the plugin through the installed package's metadata; importing it (as every moeconv
    user without vLLM may) pulls in nothing of vLLM until vLLM calls `register`."""
    import subprocess
    import sys
    from importlib.metadata import entry_points

    assert [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "moeconv"] == [
        "moeconv.vllm_plugin:register"]
    code = "import sys, moeconv.vllm_plugin, moeconv.vllm_plugin.shards; print('vllm' in sys.modules)"
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
    full = {name: tensor.unsqueeze(0) for name, tensor in TritonBackend().encode_expert(expert, shape).items()}
    per = intermediate // tp
    for rank in range(tp):
        span = slice(rank * per, (rank + 1) * per)
        down = QuantizedWeight(expert.down.codes[:, span].contiguous(), None, expert.down.scales, 8, per)
        own = ExpertWeights(_rows(expert.gate, span.start, span.stop), _rows(expert.up, span.start, span.stop), down)
        expected = TritonBackend().encode_expert(own, MoELayerShape(1, hidden, per, 8, -1, True, "F16", activation_bits=8))
        for name, tensor in full.items():
            assert torch.equal(rank_part(name, tensor, intermediate, 8, -1, tp, rank)[0], expected[name]), (name, rank)
