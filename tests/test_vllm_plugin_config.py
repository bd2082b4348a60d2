"""The vLLM plugin's reading of an output's quantization_config (moeconv/backends/triton_config.py), without
vLLM: the configs `convert --backend triton` writes parse to what they say, and every hostile value is
one refusal line starting `moeconv:` (a PluginRefusal), never a coerced value or another exception."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import moeconv
from moeconv.canonical import CHANNELWISE
from moeconv.formats import AWQ, GPTQ, CompressedTensors
from moeconv.synth import SynthSpec, make_checkpoint
from moeconv.checkpoint.reader import open_checkpoint
from moeconv.backends.triton_config import INT8_LAYOUT, WNA16_LAYOUT, PluginRefusal, check_files, parse


def _converted(tmp_path_factory, name: str, fmt) -> Path:
    base = tmp_path_factory.mktemp(name)
    source = make_checkpoint(base / "src", SynthSpec(architecture="qwen3_moe", source_format=fmt, layers=1, experts=2))
    return moeconv.convert(source, base / "out", backend="triton").output


def _config(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())["quantization_config"]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, Path]:
    return {"gptq": _converted(tmp_path_factory, "gptq", GPTQ(4, 32, sym=True)),
            "awq": _converted(tmp_path_factory, "awq", AWQ(4, 32)),
            "ct-channelwise-8bit": _converted(tmp_path_factory, "ct8", CompressedTensors(bits=8, group_size=-1)),
            "w8a8": _converted(tmp_path_factory, "w8a8", CompressedTensors(format="int-quantized", bits=8,
                                                                         group_size=-1, activation_bits=8))}


@pytest.fixture(scope="module")
def gptq_config(outputs) -> dict:
    return _config(outputs["gptq"])


@pytest.fixture(scope="module")
def written(outputs) -> dict[str, dict]:
    return {name: _config(out) for name, out in outputs.items()}


def test_the_configs_convert_writes_parse_to_what_they_say(written):
    gptq = parse(written["gptq"])
    assert (gptq.layout, gptq.bits, gptq.group_size, gptq.has_zp, gptq.scale_dtype) == (WNA16_LAYOUT, 4, 32, False, "F16")
    assert gptq.source["quant_method"] == "gptq"
    awq = parse(written["awq"])
    assert (awq.bits, awq.group_size, awq.has_zp, awq.source["quant_method"]) == (4, 32, True, "awq")
    channelwise = parse(written["ct-channelwise-8bit"])
    assert (channelwise.bits, channelwise.group_size, channelwise.channelwise) == (8, CHANNELWISE, True)
    w8a8 = parse(written["w8a8"])
    assert (w8a8.layout, w8a8.bits, w8a8.has_zp, w8a8.scale_dtype) == (INT8_LAYOUT, 8, False, "F32")


def _nested(config: dict) -> dict:
    return {**config, "source_quantization_config": copy.deepcopy(config)}


HOSTILE = {  # what the issue lists, and its neighbours: each must be refused, none coerced
    "has_zp string": (lambda c: {**c, "has_zp": "false"}, "has_zp must be true or false"),
    "has_zp int": (lambda c: {**c, "has_zp": 0}, "has_zp must be true or false"),
    "has_zp null": (lambda c: {**c, "has_zp": None}, "has_zp is null; it must be true or false"),
    "has_zp missing": (lambda c: {k: v for k, v in c.items() if k != "has_zp"}, "has no has_zp"),
    "group_size null": (lambda c: {**c, "group_size": None}, "group_size is null; it must be an integer"),
    "bits null": (lambda c: {**c, "bits": None}, "bits is null; it must be an integer"),
    "bits float": (lambda c: {**c, "bits": 4.7}, "bits must be an integer"),
    "bits bool": (lambda c: {**c, "bits": True}, "bits must be an integer"),
    "bits string": (lambda c: {**c, "bits": "4"}, "bits must be an integer"),
    "bits 3": (lambda c: {**c, "bits": 3}, "4- or 8-bit"),
    "group_size float": (lambda c: {**c, "group_size": 127.9}, "group_size must be an integer"),
    "group_size integral float": (lambda c: {**c, "group_size": 32.0}, "group_size must be an integer"),
    "group_size negative": (lambda c: {**c, "group_size": -32}, "is negative"),
    "group_size not a power of two": (lambda c: {**c, "group_size": 48}, "not -1 or a power of two"),
    "group_size huge": (lambda c: {**c, "group_size": 1 << 40}, "larger than any layer"),
    "scale_dtype int": (lambda c: {**c, "scale_dtype": 16}, "scale_dtype 16 is not one of"),
    "scale_dtype bool": (lambda c: {**c, "scale_dtype": True}, "scale_dtype True is not one of"),
    "scale_dtype unknown": (lambda c: {**c, "scale_dtype": "I32"}, "scale_dtype 'I32' is not one of"),
    "scale_dtype missing": (lambda c: {k: v for k, v in c.items() if k != "scale_dtype"}, "names no scale_dtype"),
    "bits missing": (lambda c: {k: v for k, v in c.items() if k != "bits"}, "has no bits"),
    "layout_version bool": (lambda c: {**c, "layout_version": True}, "layout version True"),
    "layout unknown": (lambda c: {**c, "layout": "marlin"}, "triton layout 'marlin'"),
    "backend cpu": (lambda c: {**c, "backend": "cpu"}, "backend 'cpu' outputs hold the blocked layout vLLM's CPU "
                                                       "experts build in their own post-load step"),
    "backend humming": (lambda c: {**c, "backend": "humming"}, "backend 'humming' outputs are not served by this "
                                                               "plugin (only 'triton')"),
    "source missing": (lambda c: {k: v for k, v in c.items() if k != "source_quantization_config"},
                       "has no source_quantization_config"),
    "source a list": (lambda c: {**c, "source_quantization_config": ["gptq"]}, "must be an object, not list"),
    "source a string": (lambda c: {**c, "source_quantization_config": "gptq"}, "must be an object, not str"),
    "source without method": (lambda c: {**c, "source_quantization_config": {"bits": 4}}, "names no quant_method"),
    "source nests moeconv": (_nested, "is itself a moeconv config"),
    "source nests itself deeply": (lambda c: _nested(_nested(c)), "is itself a moeconv config"),
    "not an object": (lambda c: [c], "must be an object, not list"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_each_hostile_value_is_one_moeconv_refusal(gptq_config, case):
    mutate, expected = HOSTILE[case]
    with pytest.raises(PluginRefusal) as refusal:
        parse(mutate(copy.deepcopy(gptq_config)))
    message = str(refusal.value)
    assert message.startswith("moeconv: ") and "\n" not in message, message
    assert expected in message, message


def test_int8_layout_fields_must_agree(written):
    for change in ({"bits": 4}, {"has_zp": True}, {"group_size": 32}):
        with pytest.raises(PluginRefusal, match="symmetric 8-bit with one scale per channel"):
            parse({**written["w8a8"], **change})


def test_the_outputs_convert_writes_agree_with_their_files(outputs, written):
    for name, out in outputs.items():
        check_files(parse(written[name]), open_checkpoint(out))  # refuses on any disagreement


# The config changed, the files not: what each change would serve wrongly, and the words that say so.
AGAINST_FILES = {
    "asymmetric output, has_zp false": ("awq", {"has_zp": False},
                                        "w13_qzeros: the config says has_zp false, so the model would be served "
                                        "without these zero points"),
    "symmetric output, has_zp true": ("gptq", {"has_zp": True},
                                      "w13_qzeros: the files hold no such tensor, and the config says has_zp true"),
    "group_size wider than the files'": ("gptq", {"group_size": 64}, "say group_size 32"),
    "grouped files, config channel-wise": ("awq", {"group_size": -1}, "say group_size 32"),
    "channel-wise files, config grouped": ("ct-channelwise-8bit", {"group_size": 32}, "say group_size -1"),
    "bits 8, the files 4-bit": ("gptq", {"bits": 8}, "w13_qweight is U8"),
}


@pytest.mark.parametrize("case", sorted(AGAINST_FILES))
def test_a_config_the_files_contradict_is_one_refusal_naming_file_and_tensor(outputs, written, case):
    output, change, expected = AGAINST_FILES[case]
    stacked = parse({**written[output], **change})  # the config alone is well-formed
    with pytest.raises(PluginRefusal) as refusal:
        check_files(stacked, open_checkpoint(outputs[output]))
    message = str(refusal.value)
    assert message.startswith("moeconv: ") and "\n" not in message, message
    assert expected in message and ".safetensors: model.layers.0.mlp.experts." in message, message


def test_fp8_block_linears_the_dense_method_does_not_read_are_refused(tmp_path, outputs, written):
    import shutil

    from safetensors.torch import load_file, save_file

    out = Path(shutil.copytree(outputs["gptq"], tmp_path / "out"))
    shard = next(out.glob("*.safetensors"))
    tensors = load_file(str(shard))
    tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.self_attn.o_proj.weight_scale_inv"] = shard.name
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(PluginRefusal) as refusal:
        check_files(parse(written["gptq"]), open_checkpoint(out))
    assert str(refusal.value) == (
        f"moeconv: {shard}: model.layers.0.self_attn.o_proj.weight_scale_inv (one of 1 FP8 block scales): the dense "
        f"layers are served by their 'gptq' method, which reads no FP8 block linear (`weight` F8_E4M3 with "
        f"`weight_scale_inv`): the engine would load the FP8 bytes unscaled; convert with --backend "
        f"compressed-tensors, whose FP8_BLOCK scheme describes them")
