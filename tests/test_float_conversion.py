"""Float-coded sources converted into the compressed-tensors layout (nvfp4/mxfp4-pack-quantized, the form llm-compressor
writes) and verified: a compressed-tensors source comes out byte for byte as it went in, its FP8-block attention
described as it was; a ModelOpt source is written with the reciprocal of each global scale where that is exact and
refused otherwise; verify is lossless and fails a flipped code byte, a flipped scale byte and swapped experts; the
integer-only backend (cpu) refuses float codes, in `inspect` and in `--backend auto`; a scale byte or a global scale that cannot
be read stops `convert` in one line naming the file and the tensor."""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from helpers import reseal, run_main
from moeconv import convert, inspect, verify
from moeconv.checkpoint.reader import open_checkpoint
from moeconv.errors import MoeconvError
from moeconv.plan import make_plan
from test_float_fixtures import DATA, E2M1, E2M1_MODELOPT, e4m3fn, expert_prefixes

CT = ("ct-nvfp4", "ct-nvfp4a16", "ct-mxfp4a16", "ct-mxfp4-fp8block")
FORMATS = {"ct-nvfp4": "nvfp4-pack-quantized", "ct-nvfp4a16": "nvfp4-pack-quantized",
           "ct-mxfp4a16": "mxfp4-pack-quantized", "ct-mxfp4-fp8block": "mxfp4-pack-quantized"}


def raw_tensors(folder: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """name -> (dtype, shape, bytes), read from the safetensors headers here."""
    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        data = path.read_bytes()
        (length,) = struct.unpack("<Q", data[:8])
        for name, info in json.loads(data[8:8 + length]).items():
            if name != "__metadata__":
                begin, end = info["data_offsets"]
                found[name] = (info["dtype"], info["shape"], data[8 + length + begin:8 + length + end])
    return found


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("float-out")
    return {name: convert(DATA / name, root / name, backend="compressed-tensors", workers=1).output for name in CT}


@pytest.mark.parametrize("name", CT)
def test_a_compressed_tensors_float_source_comes_out_byte_for_byte_and_verifies(outputs, name):
    source, output = raw_tensors(DATA / name), raw_tensors(outputs[name])
    assert source == output
    config = json.loads((outputs[name] / "config.json").read_text())["quantization_config"]
    source_config = json.loads((DATA / name / "config.json").read_text())["quantization_config"]
    groups = config["config_groups"]
    assert groups["group_0"]["format"] == FORMATS[name] and groups["group_0"]["targets"] == ["Linear"]
    source_group = next(group for group in source_config["config_groups"].values() if group["format"] == FORMATS[name])
    for key in ("num_bits", "type", "strategy", "group_size", "symmetric", "dynamic", "scale_dtype"):
        assert groups["group_0"]["weights"][key] == source_group["weights"][key], key
    inputs, source_inputs = groups["group_0"]["input_activations"], source_group["input_activations"]
    assert (inputs is None) == (source_inputs is None)
    if inputs is not None:
        assert {key: inputs[key] for key in source_inputs if key != "observer_kwargs"} == {
            key: value for key, value in source_inputs.items() if key != "observer_kwargs"}
    assert sorted(config["ignore"]) == sorted(source_config["ignore"])
    if name == "ct-mxfp4-fp8block":
        assert config["format"] == "mixed-precision"
        fp8 = groups["group_1"]
        assert fp8["format"] == "float-quantized" and len(fp8["targets"]) == 8
        assert all(".self_attn." in target for target in fp8["targets"])
        assert fp8["weights"]["block_structure"] == [128, 128] and fp8["input_activations"]["group_size"] == 128
    else:
        assert config["format"] == FORMATS[name] and set(groups) == {"group_0"}
    report = verify(outputs[name], level="lossless")
    assert report.ok, report.failures()
    assert sum(layer.experts_exact for layer in report.layers) == 8
    assert report.dense_linears_checked == (0 if name == "ct-mxfp4-fp8block" else 8)  # FP8 attention is copied


@pytest.mark.parametrize("name", CT)
def test_numerics_runs_the_fp4_kernel_on_every_layer_counting_experts_and_blocks(outputs, name, capsys):
    """The FP4 kernel (kernels/fp4_moe.py) on the output's codes and scale bytes against the float64 decoding of
    the source's: every expert routed, every scale block of theirs decoded (3 · H · I / block each)."""
    report = verify(outputs[name], level="numerics")
    assert report.ok, report.failures()
    assert report.numerics_not_run is None and "numerics" in report.proven
    block = 32 if "mxfp4" in name else 16
    for layer in report.layers:
        assert layer.experts_routed == 4 and layer.blocks_checked == 4 * 3 * 64 * 32 // block
        assert layer.relative_error < 1e-3 < layer.tolerance  # fp16 activations: measured 3.7e-4 to 4.3e-4
    code, stdout, _ = run_main(capsys, "verify", outputs[name], "--level", "numerics")
    assert code == 0 and f"4/4, {4 * 3 * 64 * 32 // block} blocks" in stdout
    assert f"kernel within 0.01 on 2 layer(s) (8 expert(s), {2 * 4 * 3 * 64 * 32 // block} FP4 block(s) decoded" \
        in " ".join(stdout.split())


def test_numerics_reads_gate_and_up_with_their_own_global_scales(tmp_path):
    """llm-compressor gives gate and up one global scale (so do the fixtures); another model, with every up_proj's
    doubled, still passes: the kernel divides each half of w13 by its own linear's weight_global_scale."""
    folder = tmp_path / "split"
    shutil.copytree(DATA / "ct-nvfp4a16", folder)
    ups = [name for name in open_checkpoint(folder).tensors if name.endswith("up_proj.weight_global_scale")]
    for name in ups:
        overwrite(folder, name, stored(folder, name, np.float32) * 2)
    report = verify(convert(folder, tmp_path / "out", backend="compressed-tensors", workers=1).output, level="numerics")
    assert len(ups) == 8 and report.ok, report.failures()
    assert all(layer.relative_error < 1e-3 for layer in report.layers)


def overwrite(folder: Path, name: str, values: np.ndarray) -> Path:
    """The stored bytes of tensor `name` replaced (same size); the file changed."""
    entry = open_checkpoint(folder).tensors[name]
    data = np.ascontiguousarray(values).tobytes()
    assert len(data) == entry.nbytes
    with open(entry.file, "r+b") as handle:
        handle.seek(entry.begin)
        handle.write(data)
    return entry.file


def stored(folder: Path, name: str, dtype) -> np.ndarray:
    entry = open_checkpoint(folder).tensors[name]
    with open(entry.file, "rb") as handle:
        handle.seek(entry.begin)
        return np.frombuffer(handle.read(entry.nbytes), dtype).reshape(entry.shape)


@pytest.fixture(scope="module")
def modelopt_powers(tmp_path_factory) -> Path:
    """The ModelOpt fixture with every weight_scale_2 and input_scale moved down to a power of two (another model,
    whose global scales have exact float32 reciprocals)."""
    folder = tmp_path_factory.mktemp("modelopt") / "powers"
    shutil.copytree(DATA / "modelopt-nvfp4", folder)
    for name in open_checkpoint(folder).tensors:
        if name.endswith((".weight_scale_2", ".input_scale")):
            value = float(stored(folder, name, np.float32))
            overwrite(folder, name, np.array(2.0 ** np.floor(np.log2(value)), np.float32))
    return folder


def test_a_modelopt_source_whose_global_scales_have_no_exact_reciprocal_is_refused(capsys, tmp_path):
    code, _, err = run_main(capsys, "convert", DATA / "modelopt-nvfp4", "-o", tmp_path / "out", "--backend", "auto")
    (line,) = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and line.startswith("error: ") and "Traceback" not in err
    assert "modelopt-nvfp4/model-00001-of-00003.safetensors: tensor model.layers.0." in line
    assert "is no float32 (only a power of two's reciprocal is)" in line
    assert not (tmp_path / "out").exists()
    verdicts = inspect(DATA / "modelopt-nvfp4")
    assert "is no float32" in verdicts["backends"]["compressed-tensors"]["reason"]
    assert verdicts["auto"].startswith("convert refuses: ")


def test_a_modelopt_source_with_exact_reciprocals_converts_and_decodes_to_the_same_reals(modelopt_powers, tmp_path):
    """Every expert and attention linear: E2M1(c) * s / g of the output equals E2M1(c) * s * s2 of the source as a
    real (float64 holds both exactly), g = 1 / s2 exactly, the codes and scale bytes the same bytes; verify passes."""
    output = convert(modelopt_powers, tmp_path / "ct", backend="compressed-tensors", workers=1).output
    config = json.loads((output / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_0"]["format"] == "nvfp4-pack-quantized"
    assert config["config_groups"]["group_0"]["input_activations"]["dynamic"] == "local"
    source, out = raw_tensors(modelopt_powers), raw_tensors(output)
    attention = [f"model.layers.{layer}.self_attn.{p}" for layer in range(2) for p in ("q_proj", "k_proj", "v_proj",
                                                                                       "o_proj")]
    for prefix in [prefix for prefix, _ in expert_prefixes()] + attention:
        assert source[f"{prefix}.weight"][2] == out[f"{prefix}.weight_packed"][2]
        assert source[f"{prefix}.weight_scale"][2] == out[f"{prefix}.weight_scale"][2]
        s2, s_in = (np.frombuffer(source[f"{prefix}.{suffix}"][2], np.float32)[0] for suffix in ("weight_scale_2",
                                                                                                "input_scale"))
        g, g_in = (np.frombuffer(out[f"{prefix}.{suffix}"][2], np.float32)[0] for suffix in ("weight_global_scale",
                                                                                            "input_global_scale"))
        assert out[f"{prefix}.weight_global_scale"][:2] == ("F32", [1])
        assert float(g) * float(s2) == 1.0 and float(g_in) * float(s_in) == 1.0
        packed = np.frombuffer(source[f"{prefix}.weight"][2], np.uint8).reshape(source[f"{prefix}.weight"][1])
        codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
        scales = np.repeat(e4m3fn(np.frombuffer(source[f"{prefix}.weight_scale"][2], np.uint8).reshape(
            source[f"{prefix}.weight_scale"][1])), 16, axis=1)
        assert np.array_equal(E2M1[codes] * scales / float(g), E2M1_MODELOPT[codes] * scales * float(s2)), prefix
    # numerics: the kernel divides by the output's g, the reference multiplies by the source's s2
    report = verify(output, level="numerics")
    assert report.ok, report.failures()
    assert report.dense_linears_checked == 8 and sum(layer.experts_exact for layer in report.layers) == 8
    assert all(layer.relative_error < 1e-3 and layer.blocks_checked == 4 * 3 * 64 * 32 // 16 for layer in report.layers)


@pytest.fixture
def damaged(tmp_path) -> Path:
    output = convert(DATA / "ct-nvfp4a16", tmp_path / "out", backend="compressed-tensors", workers=1).output
    return output


EXPERT = "model.layers.1.mlp.experts.{}.up_proj.{}"


def _xor(folder: Path, name: str, offset: int, mask: int) -> None:
    entry = open_checkpoint(folder).tensors[name]
    with open(entry.file, "r+b") as handle:
        handle.seek(entry.begin + offset)
        value = handle.read(1)[0]
        handle.seek(entry.begin + offset)
        handle.write(bytes([value ^ mask]))
    reseal(folder, entry.file)


@pytest.mark.parametrize("suffix, mask, said", [("weight_packed", 0x80, "up: codes: 1 byte(s) differ"),
                                                ("weight_scale", 0x01, "up: scales: 1 byte(s) differ"),
                                                ("weight_global_scale", 0x01, "up: global_scale")])
def test_verify_fails_a_flipped_code_scale_or_global_scale_byte(damaged, suffix, mask, said):
    _xor(damaged, EXPERT.format(2, suffix), 1 if suffix != "weight_global_scale" else 0, mask)
    report = verify(damaged, level="lossless")
    assert not report.ok
    layer = next(layer for layer in report.layers if layer.module == "model.layers.1.mlp.experts")
    assert layer.experts_exact == 3 and any(failure.startswith(f"expert 2 {said}") for failure in
                                            layer.lossless_failures), layer.lossless_failures


@pytest.mark.parametrize("suffix", ["weight_packed", "weight_global_scale"])
def test_numerics_fails_codes_read_in_the_wrong_nibble_order_or_a_global_scale_in_the_other_convention(damaged,
                                                                                                       suffix):
    """The kernel reads the output, the reference the source: every up_proj of layer 1 with its nibbles swapped
    (what a writer with the wrong order writes), or with 1 / g stored for g (a ModelOpt weight_scale_2 copied
    without its reciprocal), fails numerics too, beside the lossless failure."""
    changed = set()
    for expert in range(4):
        name = EXPERT.format(expert, suffix)
        values = stored(damaged, name, np.uint8 if suffix == "weight_packed" else np.float32)
        changed.add(overwrite(damaged, name, (values >> 4) | (values << 4) if suffix == "weight_packed"
                              else (1 / values).astype(np.float32)))
    reseal(damaged, *changed)
    report = verify(damaged, level="numerics")
    layer = next(layer for layer in report.layers if layer.module == "model.layers.1.mlp.experts")
    assert not report.ok and layer.experts_exact == 0 and report.layers[0].ok
    if suffix == "weight_packed":
        assert layer.relative_error > 100 * layer.tolerance  # measured 1.4: the output says nothing of the source's
    else:  # up's outputs 1 / g² ≈ 4e9 times too large: past fp16, the activations' dtype
        assert "model.layers.1.mlp.experts: numerics: the kernel's output is NaN or infinite (the reference's is " \
               "finite)" in report.failures()


def test_verify_fails_swapped_experts(damaged):
    changed = set()
    for suffix in ("weight_packed", "weight_scale"):
        first, second = (open_checkpoint(damaged).tensors[EXPERT.format(e, suffix)] for e in (0, 3))
        a, b = (stored(damaged, entry.name, np.uint8).copy() for entry in (first, second))
        changed |= {overwrite(damaged, first.name, b), overwrite(damaged, second.name, a)}
    reseal(damaged, *changed)
    report = verify(damaged, level="lossless")
    layer = next(layer for layer in report.layers if layer.module == "model.layers.1.mlp.experts")
    assert not report.ok and layer.experts_exact == 2
    assert {failure.split(" ")[1] for failure in layer.lossless_failures} == {"0", "3"}


@pytest.mark.parametrize("name", [*CT, "modelopt-nvfp4"])
def test_the_integer_only_backend_refuses_float_codes_with_the_reason(name):
    """(humming writes Humming's FP4 schema: tests/test_humming_float.py; triton its stacked float layouts:
    tests/test_triton_float.py.) And inspect describes the float source: its codes, block, scale encoding and global-scale convention."""
    report = inspect(DATA / name)
    verdicts = report["backends"]
    mx = "mxfp4" in name
    assert report["format"]["codes"].startswith(f"{'mxfp4' if mx else 'nvfp4'}: E2M1 codes, one "
                                                f"{'UE8M0' if mx else 'E4M3'} scale per {32 if mx else 16}")
    assert report["scale_dtype"] == ("U8" if mx else "F8_E4M3")
    if not mx:
        convention = "multiplied" if name.startswith("modelopt") else "divided"
        assert f"global scale {convention} by" in report["format"]["codes"]
    for backend, said in (("cpu", "x86 CPU kernels' layouts (blocked INT4, VNNI INT8) hold integer codes"),):
        assert not verdicts[backend]["eligible"] and said in verdicts[backend]["reason"], backend
        with pytest.raises(MoeconvError, match=f"backend '{backend}' does not support this checkpoint: .*{re.escape(said)}"):
            make_plan(DATA / name, backend=backend)


BAD_SOURCE_BYTES = [("ct-mxfp4a16", "weight_scale", np.uint8, 0xFF, "weight_scale holds 1 scale byte(s) that UE8M0"),
                    ("ct-nvfp4a16", "weight_scale", np.uint8, 0x7F, "weight_scale holds 1 scale byte(s) that E4M3"),
                    ("ct-nvfp4a16", "weight_global_scale", np.float32, 0.0, "weight_global_scale is 0"),
                    ("ct-nvfp4", "input_global_scale", np.float32, np.inf, "input_global_scale is inf")]


@pytest.mark.parametrize("name, suffix, dtype, value, said", BAD_SOURCE_BYTES)
def test_a_source_byte_that_cannot_be_read_stops_convert_in_one_line(capsys, tmp_path, name, suffix, dtype, value,
                                                                     said):
    folder = tmp_path / name
    shutil.copytree(DATA / name, folder)
    tensor = f"model.layers.0.mlp.experts.3.down_proj.{suffix}"
    values = stored(folder, tensor, dtype).copy()
    values.reshape(-1)[0] = value
    shard = overwrite(folder, tensor, values)
    code, _, err = run_main(capsys, "convert", folder, "-o", tmp_path / "out", "--workers", "1", "--backend",
                            "compressed-tensors")
    (line,) = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and "Traceback" not in err
    assert line.startswith(f"error: {shard}: model.layers.0.mlp.experts.3.down_proj: {said}"), line
