"""The CPU parts of scripts/h200_serving.py (the issue-26 GPU run): its float64 reference of a GPTQ source,
written from the format's definition, against moeconv's own GPTQ decoder; its rebuild of vLLM's
moe_align_block_size against a layout worked out by hand; its permutation-blind w13 comparison."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from moeconv.formats import GPTQ
from moeconv.synth import SynthSpec, make_checkpoint, stored_array

ROOT = Path(__file__).resolve().parent.parent
ACT_ORDER = ROOT / "tests" / "data" / "gptqmodel_act_order" / "down_only"


def _script():
    spec = importlib.util.spec_from_file_location("h200_serving", ROOT / "scripts" / "h200_serving.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("h200_serving", module)
    spec.loader.exec_module(module)
    return module


def _decoded(source: Path, fmt: GPTQ, prefix: str) -> torch.Tensor:
    """The source linear through moeconv's decoder (act-order: put back in the source's input order)."""
    tensors = {}
    for shard in source.glob("*.safetensors"):
        tensors.update({name.removeprefix(prefix + "."): t for name, t in load_file(str(shard)).items()
                        if name.startswith(prefix + ".")})
    weight, inputs = fmt.decode_ordered({name: stored_array(tensor) for name, tensor in tensors.items()})
    dense = torch.from_numpy(weight.dequantize(np.float64))
    if inputs is None:
        return dense
    inputs = torch.from_numpy(inputs)
    source_order = torch.empty_like(dense)
    source_order[:, inputs] = dense  # the decoder's weight is W[:, P]
    return source_order


@pytest.mark.parametrize("fmt", [GPTQ(4, 128, sym=True), GPTQ(4, 32, sym=False),
                                 GPTQ(4, 64, sym=False, checkpoint_format="gptq_v2"), GPTQ(8, 32, sym=False)],
                         ids=["v1-sym-g128", "v1-asym-g32", "v2-asym-g64", "v1-8bit-asym-g32"])
def test_reference_matches_moeconv_decoder(tmp_path, fmt):
    script = _script()
    source = make_checkpoint(tmp_path / "src", SynthSpec(source_format=fmt, layers=1, experts=2, hidden=256,
                                                          intermediate=128))
    reference = script.SourceReference(source, 0, torch.device("cpu"))
    assert not reference.act_order
    for expert in range(2):
        for projection, name in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            expected = _decoded(source, fmt, f"model.layers.0.mlp.experts.{expert}.{name}")
            assert torch.equal(reference.weight(expert, projection), expected)


def test_reference_of_the_real_act_order_checkpoint():
    script = _script()
    reference = script.SourceReference(ACT_ORDER, 0, torch.device("cpu"))
    assert reference.act_order
    fmt = GPTQ(4, 32, sym=False)
    for expert in range(4):
        for projection, name in (("gate", "gate_proj"), ("down", "down_proj")):
            expected = _decoded(ACT_ORDER, fmt, f"model.layers.0.mlp.experts.{expert}.{name}")
            assert torch.equal(reference.weight(expert, projection), expected)


def test_align_block_size_layout():
    script = _script()
    # pairs (token, slot) flattened: 0 -> expert 1, 1 -> expert 0, 2 -> expert 1, 3 -> expert 2; block 2:
    # expert 0 [1, pad], expert 1 [0, 2], expert 2 [3, pad]; buffers sized numel + E * (block - 1) = 7
    sorted_ids, expert_ids, padded = script.moe_align_block_size(torch.tensor([[1, 0], [1, 2]]), 2, 3)
    assert sorted_ids.tolist() == [1, 4, 0, 2, 3, 4, 4]
    assert expert_ids.tolist() == [0, 1, 2, -1]
    assert padded.tolist() == [6]
    # fewer pairs than experts: vLLM sizes the buffer numel * block
    sorted_ids, expert_ids, padded = script.moe_align_block_size(torch.tensor([[5]]), 4, 8)
    assert sorted_ids.tolist() == [0, 1, 1, 1]
    assert expert_ids.tolist() == [5]
    assert padded.tolist() == [4]


def test_channel_sorted_error_ignores_the_order_of_channels_only():
    script = _script()
    reference = torch.randn(3, 8, dtype=torch.float64)
    permuted = torch.cat([reference[:, :4][:, [2, 0, 3, 1]], reference[:, 4:][:, [1, 3, 0, 2]]], dim=1)
    assert script.channel_sorted_error(permuted, reference) == 0
    assert script.relative_error(permuted, reference) > 0.1
    assert script.channel_sorted_error(permuted * 1.01, reference) == pytest.approx(0.01)
