"""The dense linears of a `triton` output of an asymmetric GPTQ source (vLLM 0.33 loads no asymmetric GPTQ
linear): written in compressed-tensors pack-quantized with TRUE zero points, byte for byte what the
`compressed-tensors` backend writes for the same linears, with that backend's config as the output's
`dense_quantization_config`, which the plugin's config reader takes (and refuses in any other form).
vLLM's own loading of them through the plugin is in tests/engines/run_plugin.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import moeconv
from moeconv.checkpoint.reader import open_checkpoint
from moeconv.formats import GPTQ
from moeconv.synth import SynthSpec, make_checkpoint
from moeconv.backends.triton_config import PluginRefusal, parse

ATTENTION = "model.layers.0.self_attn.q_proj"


def _tensors(folder) -> dict[str, torch.Tensor]:
    tensors = {}
    for entry in open_checkpoint(folder).tensors.values():
        with safe_open(str(entry.file), framework="pt") as handle:
            tensors[entry.name] = handle.get_tensor(entry.name)
    return tensors


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    base = tmp_path_factory.mktemp("dense")
    spec = SynthSpec(architecture="qwen3_moe", source_format=GPTQ(4, 32, sym=False), layers=2, experts=2)
    source = make_checkpoint(base / "src", spec)
    return {backend: moeconv.convert(source, base / backend, backend=backend).output
            for backend in ("triton", "compressed-tensors")}


def test_dense_linears_are_the_compressed_tensors_backends_bytes(outputs):
    triton, reference = _tensors(outputs["triton"]), _tensors(outputs["compressed-tensors"])
    dense = {name for name in reference if ".experts." not in name}
    assert {f"{ATTENTION}.weight_packed", f"{ATTENTION}.weight_zero_point"} <= dense
    assert not any(name.endswith((".qweight", ".qzeros", ".g_idx")) and ".experts." not in name for name in triton)
    for name in dense:
        assert name in triton and triton[name].dtype == reference[name].dtype, name
        assert torch.equal(triton[name].reshape(-1).view(torch.uint8), reference[name].reshape(-1).view(torch.uint8))
    assert "model.layers.0.mlp.experts.w13_qzeros" in triton  # the experts stay stacked
    manifest = json.loads((outputs["triton"] / "moeconv.json").read_text())
    assert manifest["tensors"][f"{ATTENTION}.weight_packed"]["transform"] == "gptq->compressed-tensors"
    assert manifest["tensors"]["model.layers.0.mlp.experts.w13_qweight"]["transform"] == "gptq->triton"
    report = moeconv.verify(outputs["triton"])
    assert report.ok and report.dense_linears_checked == 8  # q, k, v, o of two layers


def test_the_config_names_them_and_the_plugin_reads_it(outputs):
    config = json.loads((outputs["triton"] / "config.json").read_text())["quantization_config"]
    reference = json.loads((outputs["compressed-tensors"] / "config.json").read_text())["quantization_config"]
    assert config["dense_backend"] == "compressed-tensors"
    assert config["dense_quantization_config"] == {k: v for k, v in reference.items() if k != "moeconv"}
    assert config["source_quantization_config"]["sym"] is False
    layout = parse(config)
    assert layout.dense == config["dense_quantization_config"] and layout.has_zp


@pytest.mark.parametrize("change", [
    {"dense_backend": "humming"},
    {"dense_backend": None},
    {"dense_quantization_config": "compressed-tensors"},
    {"dense_quantization_config": {"quant_method": "gptq"}},
    {"dense_quantization_config": None},
])
def test_a_dense_config_in_another_form_is_refused(outputs, change):
    config = json.loads((outputs["triton"] / "config.json").read_text())["quantization_config"]
    with pytest.raises(PluginRefusal, match="^moeconv: the output's quantization_config: dense_backend .* the "
                                            "plugin reads dense linears converted to compressed-tensors only"):
        parse({**config, **change})


def test_a_symmetric_gptq_source_keeps_its_dense_linears(tmp_path):
    source = make_checkpoint(tmp_path / "src", SynthSpec(architecture="qwen3_moe", source_format=GPTQ(4, 32, sym=True),
                                                         layers=1, experts=2))
    out = moeconv.convert(source, tmp_path / "out", backend="triton").output
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "dense_backend" not in config and "dense_quantization_config" not in config and parse(config).dense is None
    assert f"{ATTENTION}.qweight" in open_checkpoint(out).tensors
