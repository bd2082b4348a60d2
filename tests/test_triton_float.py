"""Float-coded sources converted into the triton backend's stacked float layouts (`layout` mxfp4 / nvfp4: the
parameters of vLLM's compressed-tensors MXFP4 / NVFP4 MoE methods, experts stacked, which moeconv's vLLM plugin fills
by copy) and verified.

The outputs are decoded here independently of moeconv, from the layout docs/FORMAT.md states: expert e's gate and up
are rows [0, I) and [I, 2I) of `w13_weight_packed[e]` (E2M1 codes two a byte, element 2j in the low nibble) and
`w13_weight_scale[e]` (U8 UE8M0 or F8_E4M3 block scales), their global scales `w13_weight_global_scale[e, 0]` and
`[e, 1]` (divided by); down is `w2_*[e]`. Each decoding must give the producer's own decompression
(tests/data/float/*.truth.safetensors) bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import convert_refusal, reseal, run_main
from moeconv import convert, inspect, verify
from moeconv.backends.triton_config import FLOAT_LAYOUTS, PluginRefusal, check_files, parse
from moeconv.checkpoint.reader import open_checkpoint
from moeconv.engines.sglang_plugin.config import parse_for_sglang
from moeconv.float_codes import DIVIDE
from test_float_conversion import _xor, overwrite, raw_tensors as raw, stored
from test_float_fixtures import (CT, DATA, DECODERS, EXPERTS, INTERMEDIATE, LAYERS, read_safetensors)

NUMPY = {"U8": np.uint8, "F8_E4M3": np.uint8, "F32": np.float32}
LAYER = "model.layers.{}.mlp.experts.{}"


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("triton-float")
    return {name: convert(DATA / name, root / name, backend="triton", workers=1).output for name in CT}


def stacked(folder: Path, layer: int) -> dict[str, tuple[str, np.ndarray]]:
    """The layer's stacked tensors: suffix -> (dtype, array), from the headers read here."""
    found = {}
    for name, (dtype, shape, data) in raw(folder).items():
        prefix = LAYER.format(layer, "")
        if name.startswith(prefix) and name[len(prefix):].startswith(("w13_", "w2_")):
            found[name[len(prefix):]] = (dtype, np.frombuffer(data, NUMPY[dtype]).reshape(shape))
    return found


def projection(tensors: dict, gemm: str, expert: int, index: int, rows: int) -> dict:
    """One projection's tensors, under compressed-tensors' own suffixes, cut from the stacked ones."""
    part = slice(index * rows, (index + 1) * rows)
    own = {"weight_packed": tensors[f"{gemm}_weight_packed"][1][expert, part],
           "weight_scale": tensors[f"{gemm}_weight_scale"][1][expert, part]}
    if f"{gemm}_weight_global_scale" in tensors:
        own["weight_global_scale"] = tensors[f"{gemm}_weight_global_scale"][1][expert].reshape(-1)[index:index + 1]
    return {f"p.{suffix}": (None, array) for suffix, array in own.items()}


@pytest.mark.parametrize("name", CT)
def test_stacked_codes_and_scales_decode_to_the_producer_s_own_decompression(outputs, name):
    truth = {key: values for key, (_, values) in read_safetensors(DATA / f"{name}.truth.safetensors").items()}
    mx = "mxfp4" in name
    block, scale_dtype = (32, "U8") if mx else (16, "F8_E4M3")
    hidden = 64
    for layer in range(LAYERS):
        tensors = stacked(outputs[name], layer)
        expected = {"w13_weight_packed": ("U8", (EXPERTS, 2 * INTERMEDIATE, hidden // 2)),
                    "w13_weight_scale": (scale_dtype, (EXPERTS, 2 * INTERMEDIATE, hidden // block)),
                    "w2_weight_packed": ("U8", (EXPERTS, hidden, INTERMEDIATE // 2)),
                    "w2_weight_scale": (scale_dtype, (EXPERTS, hidden, INTERMEDIATE // block))}
        if not mx:
            expected |= {"w13_weight_global_scale": ("F32", (EXPERTS, 2)), "w2_weight_global_scale": ("F32", (EXPERTS,))}
        if name == "ct-nvfp4":  # W4A4: the static input global scales too
            expected |= {"w13_input_global_scale": ("F32", (EXPERTS, 2)), "w2_input_global_scale": ("F32", (EXPERTS,))}
        assert {suffix: (dtype, array.shape) for suffix, (dtype, array) in tensors.items()} == expected
        for expert in range(EXPERTS):
            for gemm, index, proj, rows in (("w13", 0, "gate_proj", INTERMEDIATE), ("w13", 1, "up_proj", INTERMEDIATE),
                                            ("w2", 0, "down_proj", hidden)):
                decoded = DECODERS[name](projection(tensors, gemm, expert, index, rows), "p")
                want = truth[f"{LAYER.format(layer, expert)}.{proj}.weight"]
                assert np.array_equal(decoded.view(np.uint32), want.view(np.uint32)), (layer, expert, proj)
    config = json.loads((outputs[name] / "config.json").read_text())["quantization_config"]
    assert {key: config[key] for key in ("quant_method", "backend", "layout", "bits", "group_size", "has_zp",
                                         "scale_dtype", "scale_encoding", "global_scale", "input_global_scale")} == {
        "quant_method": "moeconv", "backend": "triton", "layout": "mxfp4" if mx else "nvfp4", "bits": 4,
        "group_size": block, "has_zp": False, "scale_dtype": scale_dtype, "scale_encoding": "ue8m0" if mx else "e4m3",
        "global_scale": None if mx else DIVIDE, "input_global_scale": name == "ct-nvfp4"}


@pytest.mark.parametrize("name", CT)
def test_the_manifest_records_vllm_s_float_methods_as_the_target(outputs, name):
    """moeconv.json's `targets` of a float triton output names vLLM's float MoE methods' parameters, not the Triton
    wna16 layouts an integer triton output is for; verify reports the same."""
    recorded = json.loads((outputs[name] / "moeconv.json").read_text())["targets"]
    assert recorded["kernel"] == "vLLM 0.33.0 compressed-tensors MXFP4 / NVFP4 MoE methods' parameters"
    assert recorded["engine"].startswith("vLLM 0.33 with moeconv's plugin")
    assert verify(outputs[name], level="lossless").to_json()["targets"] == recorded




@pytest.mark.parametrize("name", CT)
def test_the_plugins_read_the_config_and_hold_it_against_the_files(outputs, name):
    """What both plugins read before an engine builds a layer: vLLM's parses the float layout and finds the files
    agree; SGLang's refuses it in one line (its MoeWNA16Method holds integer codes)."""
    checkpoint = open_checkpoint(outputs[name])
    layout = parse(checkpoint.quantization_config)
    assert layout.layout in FLOAT_LAYOUTS and layout.float_scheme.input_scale == (name == "ct-nvfp4")
    check_files(layout, checkpoint)
    with pytest.raises(PluginRefusal, match=f"^moeconv: the {layout.layout} stacked layout is served by moeconv's vLLM "
                                            f"plugin only"):
        parse_for_sglang(checkpoint.quantization_config)


@pytest.mark.parametrize("edit, said", [
    ({"layout": "nvfp4"}, "the nvfp4 layout says {'scale_dtype': 'F8_E4M3'"),  # an mxfp4 config claiming nvfp4
    ({"scale_encoding": "e4m3"}, "the mxfp4 layout says"),
    ({"group_size": 16}, "blocks of 32"),
    ({"input_global_scale": "false"}, "input_global_scale 'false'"),
])
def test_a_float_config_that_contradicts_itself_is_refused(outputs, edit, said):
    config = {**open_checkpoint(outputs["ct-mxfp4a16"]).quantization_config, **edit}
    with pytest.raises(PluginRefusal, match="^moeconv: ") as raised:
        parse(config)
    assert said in str(raised.value)


def test_files_that_contradict_the_config_are_refused(tmp_path, outputs):
    """The W4A16 output's config with the W4A4 output's files (input global scales the config does not state)."""
    checkpoint = open_checkpoint(outputs["ct-nvfp4"])
    config = {**checkpoint.quantization_config, "input_global_scale": False}
    with pytest.raises(PluginRefusal, match="w13_input_global_scale: the config's nvfp4 layout has no such tensor"):
        check_files(parse(config), checkpoint)


@pytest.mark.parametrize("name", CT)
def test_verify_is_lossless_and_runs_the_fp4_kernel_on_the_stacked_bytes(outputs, name, capsys):
    report = verify(outputs[name], level="numerics")
    assert report.ok, report.failures()
    assert sum(layer.experts_exact for layer in report.layers) == 8
    block = 32 if "mxfp4" in name else 16
    for layer in report.layers:
        assert layer.experts_routed == 4 and layer.blocks_checked == 4 * 3 * 64 * 32 // block
        assert layer.relative_error < 1e-3 < layer.tolerance  # fp16 activations: the same 3.7e-4 to 4.3e-4
    code, stdout, _ = run_main(capsys, "verify", outputs[name], "--level", "numerics")
    assert code == 0 and f"{2 * 4 * 3 * 64 * 32 // block} FP4 block(s) decoded" in " ".join(stdout.split())


@pytest.fixture
def damaged(tmp_path) -> Path:
    return convert(DATA / "ct-nvfp4a16", tmp_path / "out", backend="triton", workers=1).output


# expert 2's up projection: row I of its w13 block (32 code bytes, 4 scale bytes a row), its second global scale
W13 = "model.layers.1.mlp.experts.w13_{}"


@pytest.mark.parametrize("suffix, offset, said", [
    ("weight_packed", (2 * 2 * INTERMEDIATE + INTERMEDIATE) * 32 + 1, "up: codes: 1 byte(s) differ"),
    ("weight_scale", (2 * 2 * INTERMEDIATE + INTERMEDIATE) * 4 + 1, "up: scales: 1 byte(s) differ"),
    ("weight_global_scale", (2 * 2 + 1) * 4, "up: global_scale")])
def test_verify_fails_a_flipped_code_scale_or_global_scale_byte(damaged, suffix, offset, said):
    _xor(damaged, W13.format(suffix), offset, 0x01)
    report = verify(damaged, level="lossless")
    layer = next(layer for layer in report.layers if layer.module == "model.layers.1.mlp.experts")
    assert not report.ok and layer.experts_exact == 3
    assert any(failure.startswith(f"expert 2 {said}") for failure in layer.lossless_failures), layer.lossless_failures


def test_verify_fails_swapped_experts(damaged):
    changed = set()
    for suffix in ("weight_packed", "weight_scale", "weight_global_scale"):
        name = W13.format(suffix)
        values = stored(damaged, name, np.uint8 if suffix != "weight_global_scale" else np.float32).copy()
        values[[0, 3]] = values[[3, 0]]
        changed.add(overwrite(damaged, name, values))
    reseal(damaged, *changed)
    report = verify(damaged, level="lossless")
    layer = next(layer for layer in report.layers if layer.module == "model.layers.1.mlp.experts")
    assert not report.ok and layer.experts_exact == 2
    assert {failure.split(" ")[1] for failure in layer.lossless_failures} == {"0", "3"}


def test_numerics_fails_codes_read_in_the_wrong_nibble_order(damaged):
    name = W13.format("weight_packed")
    values = stored(damaged, name, np.uint8)
    reseal(damaged, overwrite(damaged, name, (values >> 4) | (values << 4)))
    report = verify(damaged, level="numerics")
    layer = next(layer for layer in report.layers if layer.module == "model.layers.1.mlp.experts")
    assert not report.ok and layer.experts_exact == 0 and report.layers[0].ok
    assert layer.relative_error > 100 * layer.tolerance


REFUSED = [
    ("modelopt-nvfp4", "modelopt multiplies by it, backend 'triton' writes the reciprocal that is divided by"),
    ("gptoss-mxfp4-bytes", "its experts carry biases (gpt-oss's gate_up_proj_bias, down_proj_bias)"),
]


@pytest.mark.parametrize("name, said", REFUSED)
def test_what_the_float_layouts_cannot_hold_exactly_is_refused_in_one_line(capsys, tmp_path, name, said):
    line = convert_refusal(capsys, DATA / name, tmp_path / "out", "--backend", "triton", "--workers", "1")
    assert said in line, line


def test_inspect_says_triton_takes_float_codes_and_serves_them_through_vllm_s_plugin_only():
    report = inspect(DATA / "ct-mxfp4a16")
    triton = report["backends"]["triton"]
    assert triton["eligible"] and triton["serving"]["engine"].startswith("vLLM 0.33 through moeconv's plugin (vLLM's "
                                                                         "compressed-tensors mxfp4 MoE method")
    assert triton["sglang_serving"]["engine"] is None
    assert "for SGLang use --backend compressed-tensors" in triton["sglang_serving"]["how"]
    assert report["auto"].startswith("--backend auto takes triton")
    assert not report["backends"]["cpu"]["eligible"]
    assert "--backend triton or compressed-tensors writes them" in report["backends"]["cpu"]["reason"]
