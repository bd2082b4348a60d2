"""The SGLang plugin's SGLang-free parts (moeconv/engines/sglang_plugin/config.py, shards.py), without SGLang.

shards.py: rank r's part of each stacked triton tensor, copied into the parameter of SGLang's
MoeWNA16Method, must be exactly that parameter for the rank's own slice of the canonical weights (gate and
up rows [r·I/T, (r+1)·I/T), down's input columns likewise) encoded independently, as one unsplit layer of
I/T, by the triton backend; config.py: the configs `convert --backend triton` writes parse to what their
sources are, and what MoeWNA16Method cannot hold is one refusal line starting `moeconv:`.
tests/engines/sglang_plugin_check.py shows the same against SGLang's own loader and kernel."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moeconv
from moeconv.backends.base import ExpertWeights
from moeconv.backends.triton import TritonBackend
from moeconv.canonical import MoELayerShape
from moeconv.formats import GPTQ, CompressedTensors
from moeconv.engines.sglang_plugin.config import parse_for_sglang
from moeconv.engines.sglang_plugin.shards import STACKED, fill
from moeconv.synth import SynthSpec, make_checkpoint
from moeconv.checkpoint.reader import open_checkpoint
from moeconv.backends.triton_config import PluginRefusal, check_files

from strategies import as_tensors, random_canonical, weight_columns, weight_rows




def _stacked(experts: list[ExpertWeights], shape: MoELayerShape) -> dict[str, torch.Tensor]:
    encoded = [as_tensors(TritonBackend().encode_expert(expert, shape)) for expert in experts]
    return {name: torch.stack([one[name] for one in encoded]) for name in encoded[0]}


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([4, 8]), sym=st.booleans(), group_size=st.sampled_from([32, 64]),
       tp=st.sampled_from([1, 2, 4]), per_rank_groups=st.integers(1, 2), seed=st.integers(0, 2**31 - 1))
def test_each_rank_fills_moe_wna16_parameters_with_the_encoding_of_its_slice(bits, sym, group_size, tp,
                                                                             per_rank_groups, seed):
    generator = torch.Generator().manual_seed(seed)
    hidden, experts = 64, 2
    per_rank = group_size * per_rank_groups
    intermediate = per_rank * tp
    canonical = [ExpertWeights(random_canonical(generator, bits, sym, intermediate, hidden, hidden // group_size),
                               random_canonical(generator, bits, sym, intermediate, hidden, hidden // group_size),
                               random_canonical(generator, bits, sym, hidden, intermediate, intermediate // group_size))
                 for _ in range(experts)]
    whole = MoELayerShape(experts=experts, hidden=hidden, intermediate=intermediate, bits=bits, group_size=group_size,
                          symmetric=sym, scale_dtype="F16")
    stored = _stacked(canonical, whole)
    one_rank = MoELayerShape(experts=experts, hidden=hidden, intermediate=per_rank, bits=bits, group_size=group_size,
                             symmetric=sym, scale_dtype="F16")
    for rank in range(tp):
        rows, columns = slice(rank * per_rank, (rank + 1) * per_rank), (rank * per_rank, (rank + 1) * per_rank)
        expected = _stacked([ExpertWeights(weight_rows(e.gate, rows.start, rows.stop), weight_rows(e.up, rows.start, rows.stop),
                                           weight_columns(e.down, *columns)) for e in canonical], one_rank)
        assert set(expected) == set(stored) and set(stored) <= set(STACKED)
        for name, tensor in stored.items():
            parameter = torch.full_like(expected[name], 0x5A if not tensor.dtype.is_floating_point else -7.0)
            fill(name, tensor, parameter, intermediate, bits, group_size, tp, rank)
            assert torch.equal(parameter, expected[name]), (name, rank)


def test_a_part_that_is_not_the_parameter_s_shape_is_refused():
    """Also where each half would fit into the parameter's first rows (a silent partial fill otherwise)."""
    stored = torch.zeros(2, 128, 32, dtype=torch.uint8)  # w13_qweight of I = 64, H = 64, 4-bit
    with pytest.raises(ValueError, match=r"this rank's part is \[2, 32, 32\], the parameter holds \[2, 64, 32\]"):
        fill("w13_qweight", stored, torch.zeros(2, 64, 32, dtype=torch.uint8), 64, 4, 32, 4, 0)


def _written(tmp_path, fmt) -> dict:
    source = make_checkpoint(tmp_path / "src", SynthSpec(source_format=fmt, layers=1, experts=2))
    out = moeconv.convert(source, tmp_path / "out", backend="triton").output
    return json.loads((out / "config.json").read_text())["quantization_config"]


def test_an_asymmetric_gptq_output_parses_to_its_source(tmp_path):
    stacked = parse_for_sglang(_written(tmp_path, GPTQ(4, 32, sym=False)))
    assert (stacked.bits, stacked.group_size, stacked.has_zp, stacked.scale_dtype) == (4, 32, True, "F16")
    assert stacked.dense is not None and stacked.dense["quant_method"] == "compressed-tensors"


@pytest.mark.parametrize("fmt, refusal", [
    (CompressedTensors(format="int-quantized", bits=8, group_size=-1, activation_bits=8),
     "moeconv: the int8 W8A8 stacked layout is not served on SGLang by this plugin"),
    (CompressedTensors(bits=8, group_size=-1), "moeconv: channel-wise scales: SGLang's MoeWNA16Method"),
], ids=["w8a8", "channel-wise"])
def test_what_moe_wna16_cannot_hold_is_refused(tmp_path, fmt, refusal):
    with pytest.raises(PluginRefusal) as caught:
        parse_for_sglang(_written(tmp_path, fmt))
    assert str(caught.value).startswith(refusal) and "\n" not in str(caught.value)


def test_an_asymmetric_output_whose_config_denies_its_zero_points_is_refused_against_its_files(tmp_path):
    """What the SGLang plugin checks when SGLang builds its config (method.py :: _check_local_files): the
    shared parser, then the config against the output's headers."""
    config = _written(tmp_path, GPTQ(4, 32, sym=False))
    checkpoint = open_checkpoint(tmp_path / "out")
    check_files(parse_for_sglang(config), checkpoint)  # as written: consistent
    for has_zp, expected in ((False, "w13_qzeros: the config says has_zp false"), (None, "has_zp is null")):
        with pytest.raises(PluginRefusal) as caught:
            check_files(parse_for_sglang({**config, "has_zp": has_zp}), checkpoint)
        assert str(caught.value).startswith("moeconv: ") and expected in str(caught.value), str(caught.value)
    with pytest.raises(PluginRefusal, match="^moeconv: the output's quantization_config: group_size is null"):
        parse_for_sglang({**config, "group_size": None})  # used to read as channel-wise


def test_a_cpu_output_is_refused_by_the_shared_parser(tmp_path):
    config = _written(tmp_path, GPTQ(4, 32, sym=True))
    with pytest.raises(PluginRefusal, match="^moeconv: backend 'cpu' outputs"):
        parse_for_sglang({**config, "backend": "cpu"})


def test_the_plugin_is_an_entry_point_and_imports_no_sglang():
    assert [e.value for e in entry_points(group="sglang.srt.plugins") if e.name == "moeconv"] == [
        "moeconv.engines.sglang_plugin:register"]
    code = ("import sys, moeconv.engines.sglang_plugin, moeconv.engines.sglang_plugin.shards, "
            "moeconv.engines.sglang_plugin.config; print('sglang' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
