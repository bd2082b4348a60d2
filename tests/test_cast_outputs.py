"""`convert --cast` (issue 41, second step): float codes written as BF16 or block-FP8, decided by the census.

Truth for a source value is the producer's own decompression (`<fixture>.truth.safetensors`, compressed-tensors'
`decompress` and ModelOpt's `dequantize`), read with numpy here; the output's bytes are decoded by hand (a BF16 is
the high half of a float32, an E4M3 byte is read by torch). A synthetic source is made by editing a fixture's
bytes so that the number of inexact blocks is known by construction.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeconv import casts
from moeconv.api import inspect, verify
from moeconv.checkpoint.reader import open_checkpoint
from moeconv.float_codes import MXFP4, FloatWeight
from moeconv.render import verdict

from helpers import ROOT, packers_python, reseal, run_main
from test_casts import mx_values, mxfp4_weights
from test_float_fixtures import expert_prefixes, read_checkpoint, read_safetensors

DATA = Path(__file__).parent / "data" / "float"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def bf16(bits: np.ndarray) -> np.ndarray:
    """BF16 bit patterns as float64 values (NaN patterns stay NaN: a signalling NaN's cast is not a fault here)."""
    with np.errstate(invalid="ignore"):
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def e4m3(codes: np.ndarray) -> np.ndarray:
    return torch.from_numpy(codes.view(np.uint8).copy()).view(torch.float8_e4m3fn).double().numpy()


def truth(name: str) -> dict[str, np.ndarray]:
    return {key: values.astype(np.float64) for key, (_, values) in
            read_safetensors(DATA / f"{name}.truth.safetensors").items()}


def cli_convert(capsys, tmp_path, fixture, *options):
    code, out, err = run_main(capsys, "convert", DATA / fixture, "-o", tmp_path / "out", "-q", "--workers", "1",
                              *options)
    return code, out, err, tmp_path / "out"


# ---- exact casts of real producers' MXFP4 --------------------------------------------------------------------

def test_bf16_cast_of_llm_compressor_mxfp4_is_the_producers_decompression_as_a_plain_checkpoint(capsys, tmp_path):
    code, out, err, output = cli_convert(capsys, tmp_path, "ct-mxfp4a16", "--cast", "bf16")
    assert code == 0, err
    tensors, _ = read_checkpoint(output)
    want = truth("ct-mxfp4a16")
    for prefix, shape in expert_prefixes():
        dtype, bits = tensors[f"{prefix}.weight"]
        assert dtype == "BF16" and bits.shape == shape
        assert np.array_equal(bf16(bits), want[f"{prefix}.weight"]), prefix
    # the dense MXFP4 attention linears are cast too; nothing of the float codes is left
    assert all(tensors[f"model.layers.0.self_attn.{name}.weight"][0] == "BF16" for name in ATTENTION)
    assert not [name for name in tensors if name.endswith(("weight_packed", "weight_scale"))]
    config = json.loads((output / "config.json").read_text())
    assert "quantization_config" not in config and not (output / "quantize_config.json").exists()
    cast = json.loads((output / "moeconv.json").read_text())["cast"]
    assert (cast["blocks"], cast["exact"], cast["linears"], cast["bound"], cast["inexact"]) == (2304, 2304, 32, 0.0, [])
    assert verify(output, level="lossless", workers=1).ok


def test_bf16_cast_keeps_fp8_block_dense_linears_under_vllms_fp8_config(capsys, tmp_path):
    code, _, err, output = cli_convert(capsys, tmp_path, "ct-mxfp4-fp8block", "--cast", "bf16")
    assert code == 0, err
    tensors, _ = read_checkpoint(output)
    source, _ = read_checkpoint(DATA / "ct-mxfp4-fp8block")
    want = truth("ct-mxfp4-fp8block")
    for prefix, _shape in expert_prefixes():
        assert np.array_equal(bf16(tensors[f"{prefix}.weight"][1]), want[f"{prefix}.weight"]), prefix
    q = "model.layers.0.self_attn.q_proj"
    assert tensors[f"{q}.weight"][0] == "F8_E4M3" and np.array_equal(tensors[f"{q}.weight"][1], source[f"{q}.weight"][1])
    assert np.array_equal(tensors[f"{q}.weight_scale_inv"][1], source[f"{q}.weight_scale"][1])  # renamed, same bytes
    config = json.loads((output / "config.json").read_text())["quantization_config"]
    assert config == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": [128, 128],
                      "ignored_layers": ["lm_head", "model.embed_tokens", "model.layers.0.mlp.gate",
                                         "model.layers.1.mlp.gate", "model.layers.0.mlp.experts",
                                         "model.layers.1.mlp.experts"]}


# ---- refusal, and an allowed inexact cast ----------------------------------------------------------------------

def test_an_inexact_cast_is_refused_with_the_census_and_nothing_written(capsys, tmp_path):
    code, out, err, output = cli_convert(capsys, tmp_path, "modelopt-nvfp4", "--cast", "bf16")
    assert code == 2 and "Traceback" not in err
    line = " ".join(err.split())
    assert "--cast bf16 is not exact: NVFP4 -> BF16: 4434 of 4608 blocks inexact in 32 of 32 linears" in line
    assert "worst relative error 0.00364" in line and "--allow-inexact" in line
    assert not output.exists() and not list(tmp_path.glob(".out*"))


def test_allow_inexact_writes_and_records_a_census_and_bound_that_hold_exactly(capsys, tmp_path):
    code, _, err, output = cli_convert(capsys, tmp_path, "modelopt-nvfp4", "--cast", "bf16", "--allow-inexact")
    assert code == 0, err
    cast = json.loads((output / "moeconv.json").read_text())["cast"]
    assert (cast["blocks"], cast["exact"], cast["allow_inexact"]) == (4608, 174, True)
    tensors, _ = read_checkpoint(output)
    source, _ = read_checkpoint(DATA / "modelopt-nvfp4")
    worst = 0.0
    for prefix, _shape in expert_prefixes():
        written = bf16(tensors[f"{prefix}.weight"][1])
        # the source value by hand, exactly: E2M1 (ModelOpt reads code 8 as +0) x E4M3 scale x weight_scale_2
        packed = source[f"{prefix}.weight"][1]
        codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
        magnitude = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])[codes & 7] * np.where(codes & 8, -1.0, 1.0)
        scale = np.repeat(e4m3(source[f"{prefix}.weight_scale"][1]), 16, axis=1)
        value = magnitude * scale * np.float64(source[f"{prefix}.weight_scale_2"][1].reshape(()))
        nonzero = value != 0
        assert (written[~nonzero] == 0).all()
        errors = np.abs(written[nonzero] - value[nonzero]) / np.abs(value[nonzero])
        # every written value is the nearest bfloat16 of the source value: within half a bfloat16 step
        assert (errors <= 2.0**-8).all(), prefix
        worst = max(worst, float(errors.max()))
    assert worst == cast["bound"] == cast["worst_relative_error"]
    report = verify(output, level="lossless", workers=1)
    assert report.ok, report.failures()
    assert any("an inexact cast (NVFP4 -> BF16): 4434 of 4608 blocks" in caveat for caveat in report.caveats())
    assert "cast from the source as recorded (NVFP4 -> BF16: 174 of 4608 blocks exact" in verdict(report)


def test_the_convert_report_carries_the_census(capsys, tmp_path):
    code, out, err, _ = cli_convert(capsys, tmp_path, "ct-mxfp4a16", "--cast", "bf16", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["plan"]["cast"] == "bf16" and report["plan"]["backend"] == "bf16"
    assert (report["cast"]["label"], report["cast"]["blocks"], report["cast"]["exact"]) == ("MXFP4 -> BF16", 2304, 2304)


@pytest.mark.parametrize("fixture", ["ct-nvfp4a16", "ct-nvfp4"])
def test_an_inexact_bf16_cast_of_llm_compressor_nvfp4_is_compressed_tensors_own_bf16_decompression(capsys, tmp_path,
                                                                                                  fixture):
    """Its truth is the compressor's `decompress` into the model's bfloat16 (tests/packers/make_float_llmc.py):
    the cast's rounding (c · s / g to float64, then to the nearest bfloat16) gives the same bits, every one."""
    code, _, err, output = cli_convert(capsys, tmp_path, fixture, "--cast", "bf16", "--allow-inexact")
    assert code == 0, err
    tensors, _ = read_checkpoint(output)
    want = truth(fixture)
    for prefix, _shape in expert_prefixes():
        assert np.array_equal(bf16(tensors[f"{prefix}.weight"][1]), want[f"{prefix}.weight"]), prefix


def test_allow_inexact_without_a_cast_is_refused(capsys, tmp_path):
    code, _, err, _ = cli_convert(capsys, tmp_path, "ct-mxfp4a16", "--allow-inexact")
    assert code == 2 and "--allow-inexact applies to a --cast only" in err


@pytest.mark.parametrize("cast, said", [("fp8-block", "no fp8-block cast of nvfp4 codes is decided (from nvfp4: bf16)"),
                                        ("nvfp4", "no nvfp4 cast of nvfp4 codes is decided (from nvfp4: bf16)"),
                                        ("fp4", "--cast 'fp4' is not available; expected one of bf16, fp8-block, "
                                                "nvfp4")])
def test_a_cast_the_source_has_not_is_refused_before_reading_it(capsys, tmp_path, cast, said):
    code, _, err, output = cli_convert(capsys, tmp_path, "ct-nvfp4a16", "--cast", cast)
    assert code == 2 and said in " ".join(err.split()) and "Traceback" not in err and not output.exists()


def test_a_cast_of_integer_codes_is_refused(capsys, tmp_path):
    gptq = Path(__file__).parent / "data" / "modelopt" / "int4-g128"
    code, _, err = run_main(capsys, "convert", gptq, "-o", tmp_path / "out", "--cast", "bf16", "-q")
    assert code == 2 and "--cast bf16 takes float codes" in err and not (tmp_path / "out").exists()


# ---- a synthetic source whose inexact blocks are known by construction -------------------------------------------

def _rewrite(folder: Path, name: str, values: np.ndarray) -> None:
    entry = open_checkpoint(folder).tensors[name]
    with open(entry.file, "r+b") as handle:
        handle.seek(entry.begin)
        handle.write(np.ascontiguousarray(values, dtype=np.uint8).tobytes())


@pytest.fixture
def synthetic(tmp_path) -> tuple[Path, list[str]]:
    """ct-mxfp4a16 with every code 6 (0x77) and every scale byte 127 (every value 6: exact in any target), then
    in 3 chosen linears one scale byte 254 (6 · 2^127: past bfloat16's largest, 2^128 (1 - 2^-8)) in the first
    32-block of row 0, and in 2 others one byte 100 (6 · 2^-27 beside 6 · 2^0: 27 binades, more than E4M3's 18
    in one 128 x 128 block; each of these linears is one such block). BF16: 3 inexact blocks (of 32 elements);
    FP8-block: 5 (the bytes 254 spread 127 binades in theirs)."""
    folder = tmp_path / "synthetic"
    shutil.copytree(DATA / "ct-mxfp4a16", folder)
    tensors = open_checkpoint(folder).tensors
    for name, entry in tensors.items():
        if name.endswith("weight_packed"):
            _rewrite(folder, name, np.full(entry.shape, 0x77))
        elif name.endswith("weight_scale"):
            _rewrite(folder, name, np.full(entry.shape, 127))
    over = ["model.layers.0.mlp.experts.1.up_proj", "model.layers.1.mlp.experts.0.down_proj",
            "model.layers.0.self_attn.q_proj"]
    spread = ["model.layers.0.mlp.experts.2.gate_proj", "model.layers.1.mlp.experts.0.up_proj"]
    for names, byte in ((over, 254), (spread, 100)):
        for prefix in names:
            scales = np.full(tensors[f"{prefix}.weight_scale"].shape, 127)
            scales[0, 0] = byte
            _rewrite(folder, f"{prefix}.weight_scale", scales)
    return folder, over, spread


def test_the_census_counts_exactly_the_blocks_made_inexact(capsys, tmp_path, synthetic):
    folder, over, spread = synthetic
    code, _, err = run_main(capsys, "convert", folder, "-o", tmp_path / "bf16", "--cast", "bf16", "-q")
    line = " ".join(err.split())
    assert code == 2 and "3 of 2304 blocks inexact in 3 of 32 linears" in line and "worst relative error inf" in line
    code, _, err = run_main(capsys, "convert", folder, "-o", tmp_path / "fp8", "--cast", "fp8-block", "-q")
    # the bytes 254 spread 127 binades in their block too: FP8 counts both kinds
    assert code == 2 and "5 of 32 blocks inexact in 5 of 32 linears" in " ".join(err.split())
    code, _, err = run_main(capsys, "convert", folder, "-o", tmp_path / "fp8", "--cast", "fp8-block", "-q",
                            "--allow-inexact", "--workers", "1")
    assert code == 0, err
    cast = json.loads((tmp_path / "fp8" / "moeconv.json").read_text())["cast"]
    assert sorted(entry["tensor"] for entry in cast["inexact"]) == sorted(over + spread)
    assert cast["bound"] == 1.0  # 6 · 2^-27 is below E4M3's smallest subnormal under 2^-6: flushed to 0
    tensors, _ = read_checkpoint(tmp_path / "fp8")
    for prefix in spread:
        codes, scale_inv = tensors[f"{prefix}.weight"][1], tensors[f"{prefix}.weight_scale_inv"][1]
        values = e4m3(codes) * scale_inv.astype(np.float64)[0, 0]
        assert (values[0, :32] == 0).all() and (values[0, 32:] == 6).all() and (values[1:] == 6).all()
    prefix = "model.layers.0.mlp.experts.0.gate_proj"  # exact: every value 6 = 384 · 2^-6
    assert tensors[f"{prefix}.weight_scale_inv"][1].tolist() == [[2.0**-6]]
    assert (e4m3(tensors[f"{prefix}.weight"][1]) == 384).all()


# ---- verify fails what was not written by the cast -------------------------------------------------------------

@pytest.mark.parametrize("cast, fixture, extra, suffix", [("bf16", "ct-mxfp4a16", (), "weight"),
                                                          ("fp8-block", "ct-mxfp4a16", ("--allow-inexact",), "weight"),
                                                          ("bf16", "modelopt-nvfp4", ("--allow-inexact",), "weight"),
                                                          ("nvfp4", "ct-mxfp4a16", (), "weight_packed"),
                                                          ("nvfp4", "ct-mxfp4a16", (), "weight_scale")])
def test_verify_fails_a_flipped_output_byte(capsys, tmp_path, cast, fixture, extra, suffix):
    code, _, err, output = cli_convert(capsys, tmp_path, fixture, "--cast", cast, *extra)
    assert code == 0, err
    entry = open_checkpoint(output).tensors[f"model.layers.1.mlp.experts.0.up_proj.{suffix}"]
    with open(entry.file, "r+b") as handle:
        handle.seek(entry.begin + 1)
        value = handle.read(1)[0]
        handle.seek(entry.begin + 1)
        handle.write(bytes([value ^ 0x01]))
    reseal(output, entry.file)
    report = verify(output, level="lossless", workers=1)
    assert not report.ok
    layer = next(layer for layer in report.layers if layer.module == "model.layers.1.mlp.experts")
    # one code: one value; an NVFP4 group's scale byte: the group's non-zero values (at most 16)
    counts = [int(found[1]) for failure in layer.lossless_failures
              if (found := re.match(r"expert 0 up: (\d+) value\(s\) differ", failure))]
    assert counts and (counts[0] == 1 if suffix != "weight_scale" else 1 <= counts[0] <= 16), layer.lossless_failures


def test_verify_fails_a_census_recorded_otherwise(capsys, tmp_path):
    code, _, err, output = cli_convert(capsys, tmp_path, "modelopt-nvfp4", "--cast", "bf16", "--allow-inexact")
    assert code == 0, err

    def edit(manifest):
        manifest["cast"]["bound"] = manifest["cast"]["bound"] / 2

    reseal(output, edit=edit)
    report = verify(output, level="lossless", workers=1)
    assert not report.ok and any(problem.startswith("moeconv.json: cast.bound records") for problem in
                                 report.cast_problems), report.cast_problems


# ---- the written arrays against a brute force, over the edge scale bytes ------------------------------------------


def readable(weight: FloatWeight) -> FloatWeight:
    """The strategy's weight with its reserved bytes (0xFF, which every source format refuses) made 254."""
    return FloatWeight(weight.packed, np.where(weight.scales == 0xFF, 254, weight.scales).astype(np.uint8), MXFP4)


@settings(max_examples=80, deadline=None)
@given(mxfp4_weights(rows=4, columns=128))
def test_written_bf16_is_torchs_rounding_of_the_values_decoded_by_hand(weight):
    weight = readable(weight)
    values = mx_values(weight)  # by hand: E2M1 x 2^(b - 127), exact (and exact in float32, as torch converts)
    want = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(casts.cast_arrays(weight, casts.BF16)["weight"], want)


@settings(max_examples=80, deadline=None)
@given(mxfp4_weights(rows=4, columns=128))
def test_written_fp8_block_is_the_smallest_power_of_two_scale_and_torchs_e4m3(weight):
    weight = readable(weight)
    values = mx_values(weight)  # one 128 x 128 block (4 rows of it)
    if (values == 0).all():
        t = 0
    else:
        t = next(t for t in range(-160, 140) if (np.abs(values) <= np.ldexp(448.0, t)).all())
    arrays = casts.cast_arrays(weight, casts.FP8_BLOCK)
    assert arrays["weight_scale_inv"].dtype == np.float32 and arrays["weight_scale_inv"].tolist() == [[2.0**t]]
    want = torch.from_numpy(np.ldexp(values, -t)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(arrays["weight"], want)
    exact = casts.exact_blocks(weight, casts.FP8_BLOCK)[0, 0]
    assert exact == bool((e4m3(want) * 2.0**t == values).all())


@settings(max_examples=80, deadline=None)
@given(mxfp4_weights(rows=4, columns=256))
def test_the_tables_write_what_the_definition_rounds_to(weight):
    """cast_arrays (tables over the (byte, code) pairs) against cast_values (each value rounded in float64), read
    back by hand: bit for bit, zeros' signs included."""
    weight = readable(weight)
    for target in casts.CASTS:
        arrays, want = casts.cast_arrays(weight, target), casts.cast_values(weight, target)
        if target == casts.BF16:
            got = bf16(arrays["weight"])
        elif target == casts.NVFP4:
            packed = arrays["weight_packed"]
            codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
            magnitude = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])[codes & 7] * np.where(codes & 8, -1.0, 1.0)
            scale = np.repeat(e4m3(arrays["weight_scale"]), 16, axis=1)
            got = magnitude * scale / np.float64(arrays["weight_global_scale"].reshape(()))
        else:
            got = e4m3(arrays["weight"]) * np.repeat(arrays["weight_scale_inv"].astype(np.float64), 128, axis=1)[:4]
        assert np.array_equal(got, want) and np.array_equal(np.signbit(got), np.signbit(want)), target


@settings(max_examples=80, deadline=None)
@given(mxfp4_weights(rows=4, columns=128), st.lists(st.tuples(st.integers(0, 3), st.integers(0, 127),
                                                              st.integers(0, 15)), max_size=3))
def test_verify_of_a_bf16_cast_by_bit_patterns_finds_exactly_the_values_that_differ(weight, flips):
    """CastWeight.mismatch of a bf16 cast (tables over the (byte, code) pairs, compared as bit patterns) against a
    check by hand: each stored bfloat16 read as a real and compared with the source value decoded by hand in an
    exact block (the predicate's) and with torch's bfloat16 rounding of it in an inexact one, signs of zero
    included. Some stored bits flipped first."""
    weight = readable(weight)
    stored = casts.cast_arrays(weight, casts.BF16)["weight"].copy()
    for row, column, bit in flips:
        stored[row, column] ^= np.uint16(1 << bit)
    values = mx_values(weight)
    rounded = torch.from_numpy(values).to(torch.bfloat16).double().numpy()
    exact = np.repeat(casts.exact_blocks(weight, casts.BF16), 32, axis=1)
    want = np.where(exact, values, rounded)
    got = bf16(stored)
    differ = ~((got == want) & (np.signbit(got) == np.signbit(want)))
    found = casts.CastWeight.of(casts.BF16, {"weight": stored}).mismatch(weight)
    assert (found is None) == (not differ.any()), found
    if found is not None:
        first = [int(i) for i in np.argwhere(differ)[0]]
        assert f"first at {first}" in found


# ---- NVFP4 from MXFP4: compressed-tensors' NVFP4A16 form, read back by compressed-tensors itself ------------------

def ct_decompressed(output: Path, tmp_path: Path) -> dict[str, np.ndarray]:
    """Every float-coded linear of `output` decompressed by compressed-tensors' own compressor for its config group
    (tests/packers/ct_float_decompress.py in .venv-packers), float64."""
    target = tmp_path / "decompressed.safetensors"
    proc = subprocess.run([str(packers_python()), str(ROOT / "tests" / "packers" / "ct_float_decompress.py"),
                           str(output), str(target)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1])["format"] == "nvfp4-pack-quantized"
    return {name: values.astype(np.float64) for name, (_, values) in read_safetensors(target).items()}


def test_nvfp4_cast_of_llm_compressor_mxfp4_is_the_producers_nvfp4a16_form_and_decompresses_to_the_source(
        capsys, tmp_path):
    code, out, err, output = cli_convert(capsys, tmp_path, "ct-mxfp4a16", "--cast", "nvfp4")
    assert code == 0, err
    decompressed, want = ct_decompressed(output, tmp_path), truth("ct-mxfp4a16")
    for prefix, shape in expert_prefixes():
        got = decompressed[f"{prefix}.weight"]
        assert got.shape == shape
        assert np.array_equal(got, want[f"{prefix}.weight"]), prefix
        assert np.array_equal(np.signbit(got), np.signbit(want[f"{prefix}.weight"])), prefix
    # the layout and the config llm-compressor's NVFP4A16 preset writes (the ct-nvfp4a16 fixture, made by it)
    tensors, _ = read_checkpoint(output)
    preset, _ = read_checkpoint(DATA / "ct-nvfp4a16")
    prefix = "model.layers.1.mlp.experts.2.down_proj"
    for suffix in ("weight_packed", "weight_scale", "weight_global_scale"):
        assert tensors[f"{prefix}.{suffix}"][0] == preset[f"{prefix}.{suffix}"][0], suffix
        assert tensors[f"{prefix}.{suffix}"][1].shape == preset[f"{prefix}.{suffix}"][1].shape, suffix
    assert not [name for name in tensors if name.endswith(".weight") and tensors[name][0] == "BF16"
                and ".self_attn." in name and "norm" not in name]  # the MXFP4 attention is cast too
    # vLLM's NVFP4 MoE method reads one global scale for gate and up (gate's): the cast writes them equal
    for layer in range(2):
        for expert in range(4):
            at = f"model.layers.{layer}.mlp.experts.{expert}"
            gate, up = (tensors[f"{at}.{name}_proj.weight_global_scale"][1] for name in ("gate", "up"))
            assert gate.tolist() == up.tolist() and preset[f"{at}.gate_proj.weight_global_scale"][1].tolist() == \
                preset[f"{at}.up_proj.weight_global_scale"][1].tolist(), at
    config = json.loads((output / "config.json").read_text())["quantization_config"]
    made = json.loads((DATA / "ct-nvfp4a16" / "config.json").read_text())["quantization_config"]
    assert config["config_groups"] == made["config_groups"]
    assert (config["quant_method"], config["format"], config["quantization_status"]) == (
        made["quant_method"], made["format"], made["quantization_status"])
    cast = json.loads((output / "moeconv.json").read_text())["cast"]
    assert (cast["target"], cast["blocks"], cast["exact"], cast["linears"], cast["bound"]) == ("nvfp4", 4608, 4608,
                                                                                                32, 0.0)
    assert verify(output, level="lossless", workers=1).ok
    assert "serve: stock vLLM 0.33 (its compressed-tensors NVFP4 MoE method" in " ".join(out.split())


def test_nvfp4_cast_census_refusal_and_an_allowed_inexact_cast_as_compressed_tensors_reads_it(capsys, tmp_path,
                                                                                             synthetic):
    """The synthetic source: every value 6, but one 32-block of byte 254 (6 · 2^127) in 3 linears and one of byte
    100 (6 · 2^-27) in 2: each such block is 2 groups of 16 that no E4M3 scale under the linear's one global scale
    holds beside the others' 6 (2^127 and 2^-27 are 127 and 27 binades from 2^0; E4M3 spans 18). q_proj's outlier
    would give it another global scale than k_proj and v_proj, which is refused first (the next test); here it is
    taken out again: 8 groups inexact in 4 linears."""
    folder, over, spread = synthetic
    code, _, err = run_main(capsys, "convert", folder, "-o", tmp_path / "refused", "--cast", "nvfp4", "-q",
                            "--allow-inexact")
    assert code == 2 and "model.layers.0.self_attn: the linears an engine fuses would get different NVFP4 global " \
        "scales (k_proj 2^-8, q_proj 2^9, v_proj 2^-8)" in " ".join(err.split())
    entry = open_checkpoint(folder).tensors["model.layers.0.self_attn.q_proj.weight_scale"]
    _rewrite(folder, entry.name, np.full(entry.shape, 127))
    over = [name for name in over if ".self_attn." not in name]
    code, _, err = run_main(capsys, "convert", folder, "-o", tmp_path / "refused", "--cast", "nvfp4", "-q")
    assert code == 2 and "MXFP4 -> NVFP4: 8 of 4608 blocks inexact in 4 of 32 linears" in " ".join(err.split())
    assert not (tmp_path / "refused").exists()
    code, _, err = run_main(capsys, "convert", folder, "-o", tmp_path / "out", "--cast", "nvfp4", "-q",
                            "--allow-inexact", "--workers", "1")
    assert code == 0, err
    output = tmp_path / "out"
    decompressed, tensors = ct_decompressed(output, tmp_path), read_checkpoint(output)[0]
    worst = 0.0
    for prefix in {name.removesuffix(".weight") for name in decompressed}:
        got = decompressed[f"{prefix}.weight"]
        g = np.float64(tensors[f"{prefix}.weight_global_scale"][1].reshape(()))
        want = np.full(got.shape, 6.0)
        if prefix in over:  # 6 · 2^127 saturates: the largest value the linear's global scale allows, 6 · 448 / g
            want[0, :32] = 6 * 448 / g
            worst = max(worst, abs(want[0, 0] - 6 * 2.0**127) / (6 * 2.0**127))
        elif prefix in spread:  # 6 · 2^-27 is below half the smallest step (2^-9 / g · 0.5): 0
            want[0, :32] = 0.0
            assert 6 * 2.0**-27 < 2.0**-9 / g * 0.25
            worst = max(worst, 1.0)
        assert np.array_equal(got, want) and not np.signbit(got).any(), prefix
    cast = json.loads((output / "moeconv.json").read_text())["cast"]
    assert sorted(entry["tensor"] for entry in cast["inexact"]) == sorted(over + spread)
    assert cast["bound"] == worst == 1.0
    # inspect counts the experts as convert does (gate and up under one global scale)
    inspected = inspect(folder, casts=True)["casts"]["nvfp4"]
    assert inspected["inexact"] == [entry for entry in cast["inexact"] if ".mlp.experts." in entry["tensor"]]
    assert verify(output, level="lossless", workers=1).ok


def test_an_experts_gate_and_up_share_one_nvfp4_global_scale_and_the_census_counts_under_it():
    """gate's bytes 110 .. 127 and up's 100 .. 117: each alone within E4M3's 18 binades, together 28. The shared γ
    (the one vLLM reads for both) leaves exactly the groups outside its 18-binade window inexact, counted by hand."""
    rng = np.random.default_rng(3)
    codes = rng.integers(1, 8, (32, 128), dtype=np.uint8)  # no zero magnitude: every group counts
    gate = FloatWeight.from_codes(codes, np.tile(np.arange(110, 128, dtype=np.uint8), 8)[:128].reshape(32, 4), MXFP4)
    up = FloatWeight.from_codes(codes, np.tile(np.arange(100, 118, dtype=np.uint8), 8)[:128].reshape(32, 4), MXFP4)
    assert casts.census(gate, casts.NVFP4).exact == casts.census(up, casts.NVFP4).exact == 256  # alone: all exact
    shared = casts.shared_exponents({"gate": gate, "up": up, "down": gate}, casts.NVFP4)
    gamma = shared["gate"]
    assert shared["up"] == gamma and shared["down"] is None
    for weight in (gate, up):
        byte = np.repeat(weight.scales.astype(int), 2, axis=1)  # each 32-block's two groups
        by_hand = int(((byte - 127 - gamma >= -9) & (byte - 127 - gamma <= 8)).sum())
        assert casts.census(weight, casts.NVFP4, gamma).exact == by_hand
        arrays = casts.cast_arrays(weight, casts.NVFP4, gamma)
        assert arrays["weight_global_scale"].tolist() == [2.0 ** -gamma]
        assert casts.CastWeight.of(casts.NVFP4, arrays).mismatch(weight, gamma) is None
        if casts.census(weight, casts.NVFP4).scale_exponent != gamma:  # held to its own γ, the shared scale fails
            assert casts.CastWeight.of(casts.NVFP4, arrays).mismatch(weight).startswith("weight_global_scale")
    together = sum(casts.census(weight, casts.NVFP4, gamma).exact for weight in (gate, up))
    assert together < 512  # 28 binades: some group of one of them is outside any one window


def test_an_nvfp4_cast_whose_fused_dense_linears_would_get_different_global_scales_is_refused(capsys, tmp_path):
    """ct-mxfp4a16 with q_proj's scale bytes all 127 and k_proj's all 100 (27 binades apart): each linear's own
    global scale differs, and vLLM reads one for the fused qkv: refused, nothing written."""
    folder = tmp_path / "source"
    shutil.copytree(DATA / "ct-mxfp4a16", folder)
    tensors = open_checkpoint(folder).tensors
    for name, byte in (("q_proj", 127), ("k_proj", 100)):
        entry = tensors[f"model.layers.0.self_attn.{name}.weight_scale"]
        _rewrite(folder, entry.name, np.full(entry.shape, byte))
    code, _, err = run_main(capsys, "convert", folder, "-o", tmp_path / "out", "--cast", "nvfp4", "-q")
    line = " ".join(err.split())
    assert code == 2 and "Traceback" not in err and not (tmp_path / "out").exists()
    assert "model.layers.0.self_attn: the linears an engine fuses would get different NVFP4 global scales" in line
    assert "q_proj 2^-8" in line and "k_proj 2^-35" in line
