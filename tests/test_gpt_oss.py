"""gpt-oss MXFP4 sources (`quant_method: mxfp4`, experts stacked per layer, gate and up interleaved), read exactly.

tests/data/float/gptoss-mxfp4-bytes: the stacked expert BYTES are made by tests/packers/make_float_gptoss_bytes.py
(no producer writes gpt-oss MXFP4 offline here: docs/FLOAT_SOURCES.md section 5), everything else by transformers
5.24.0; the TRUTH beside it is transformers' own MXFP4 reader on those files (`_convert_moe_packed_tensors` in
float64, and the parameters of `GptOssForCausalLM.from_pretrained(..., Mxfp4Config(dequantize=True))`), not
moeconv. Here: the fixture is what the doc says (numpy alone); moeconv reads every expert's gate, up and down
exactly as transformers does, bit for bit, with the rows the naming scheme declares (a contiguous split does not
reproduce it); inspect describes the source; every backend refuses it, convert in one line saying why and what
serves it; `--cast bf16` writes gpt-oss's own stacked BF16 form, whose experts hold what transformers itself loads
(tests/engines/gpt_oss_bf16.py shows vLLM 0.33's own loader holding the same values); what cannot be read (a reserved scale byte, a stacked tensor of another expert count, a checkpoint that
claims MXFP4 over bf16 experts) is refused naming the tensor."""

from __future__ import annotations

import json
import re
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest

from helpers import reseal, run_main
from moeconv import inspect
from moeconv.api import convert, verify
from moeconv.checkpoint.reader import TensorReader, open_checkpoint
from moeconv.errors import MoeconvError
from moeconv.float_codes import UE8M0
from moeconv.formats.gpt_oss_mxfp4 import GptOssMxfp4
from moeconv.packing import bf16_as_float32
from moeconv.survey import ExpertSlice, survey
from moeconv.transform import read_source
from moeconv.worklist import SourceSlice
from test_float_fixtures import DATA, E2M1, read_checkpoint, read_safetensors

NAME = "gptoss-mxfp4-bytes"
LAYERS, EXPERTS, HIDDEN, INTERMEDIATE = 2, 4, 96, 32
STACKED = {"gate_up_proj": (2 * INTERMEDIATE, HIDDEN), "down_proj": (HIDDEN, INTERMEDIATE)}  # rows, K


@pytest.fixture(scope="module")
def truth() -> dict[str, np.ndarray]:
    return {key: values for key, (_, values) in read_safetensors(DATA / f"{NAME}.truth.safetensors").items()}


def test_the_fixture_is_the_documented_stacked_layout():
    """docs/FLOAT_SOURCES.md section 5, read with numpy alone: every stacked tensor's dtype and shape, every E2M1
    code and the UE8M0 edge bytes present, the experts of each layer split over shards, the config as gpt-oss's."""
    tensors, weight_map = read_checkpoint(DATA / NAME)
    config = json.loads((DATA / NAME / "config.json").read_text())
    assert config["model_type"] == "gpt_oss" and config["quantization_config"]["quant_method"] == "mxfp4"
    codes, scales = set(), set()
    for layer in range(LAYERS):
        experts = f"model.layers.{layer}.mlp.experts"
        for tensor, (rows, k) in STACKED.items():
            blocks = tensors[f"{experts}.{tensor}_blocks"]
            assert (blocks[0], blocks[1].shape) == ("U8", (EXPERTS, rows, k // 32, 16))
            assert (tensors[f"{experts}.{tensor}_scales"][0], tensors[f"{experts}.{tensor}_scales"][1].shape) == (
                "U8", (EXPERTS, rows, k // 32))
            assert (tensors[f"{experts}.{tensor}_bias"][0], tensors[f"{experts}.{tensor}_bias"][1].shape) == (
                "BF16", (EXPERTS, rows))
            codes |= set(np.unique(blocks[1] & 0xF)) | set(np.unique(blocks[1] >> 4))
            scales |= set(np.unique(tensors[f"{experts}.{tensor}_scales"][1]))
        assert weight_map[f"{experts}.gate_up_proj_blocks"] != weight_map[f"{experts}.down_proj_blocks"]
        assert tensors[f"model.layers.{layer}.mlp.router.bias"][1].shape == (EXPERTS,)
    assert codes == set(range(16)) and {0, 1, 126, 127, 128, 254} <= scales and 255 not in scales


def test_transformers_loaded_model_is_its_dequantization_of_the_bytes(truth):
    """The two readings of transformers agree (float32 where the float64 fits): what `from_pretrained` computes
    with is `_convert_moe_packed_tensors` of the stored bytes, in its [E, in, out] layout."""
    for layer in range(LAYERS):
        for tensor in STACKED:
            prefix = f"model.layers.{layer}.mlp.experts.{tensor}"
            with np.errstate(over="ignore"):
                assert np.array_equal(truth[f"{prefix}.weight"].astype(np.float32), truth[f"{prefix}.loaded"])


def read_expert(checkpoint, layer, expert) -> dict[str, dict[str, np.ndarray]]:
    """moeconv's reading of one expert: each projection's stored slices (survey.ExpertSlice) by suffix."""
    found = survey(checkpoint)
    moe = next(moe for moe in found.layers if moe.module == f"model.layers.{layer}.mlp.experts")
    with TensorReader() as reader:
        return {projection: {suffix: entry.read_raw(reader) for suffix, entry in linear.items()}
                for projection, linear in moe.experts[expert].items()}


def test_moeconv_reads_every_expert_as_transformers_does_bit_for_bit(truth):
    """gate = transformers' gate_up[..., ::2], up = gate_up[..., 1::2] (GptOssExperts), down = down_proj, each
    transposed to (out, in): moeconv's FloatWeight of every expert's three linears dequantizes (float64, exactly) to
    them bit for bit, signed zeros included, and its biases are what transformers loads."""
    checkpoint = open_checkpoint(DATA / NAME)
    fmt = survey(checkpoint).source_format
    assert isinstance(fmt, GptOssMxfp4) and fmt.float_scheme.scale_encoding == UE8M0
    for layer in range(LAYERS):
        experts = f"model.layers.{layer}.mlp.experts"
        gate_up, down = truth[f"{experts}.gate_up_proj.weight"], truth[f"{experts}.down_proj.weight"]
        for expert in range(EXPERTS):
            stored = read_expert(checkpoint, layer, expert)
            expected = {"gate": gate_up[expert][:, 0::2].T, "up": gate_up[expert][:, 1::2].T, "down": down[expert].T}
            biases = {"gate": truth[f"{experts}.gate_up_proj_bias.loaded"][expert, 0::2],
                      "up": truth[f"{experts}.gate_up_proj_bias.loaded"][expert, 1::2],
                      "down": truth[f"{experts}.down_proj_bias.loaded"][expert]}
            for projection, want in expected.items():
                weight = fmt.decode(stored[projection]).dequantize()
                assert weight.shape == want.shape and np.array_equal(weight, want), (layer, expert, projection)
                assert np.array_equal(np.signbit(weight), np.signbit(want)), (layer, expert, projection)
                assert np.array_equal(bf16_as_float32(fmt.bias(stored[projection])), biases[projection])


def test_a_contiguous_gate_up_split_does_not_reproduce_the_truth(truth):
    """The row order matters: reading the first I rows as gate (as a contiguous W13 would be) gives other weights."""
    tensors, _ = read_checkpoint(DATA / NAME)
    blocks = tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"][1][0].reshape(2 * INTERMEDIATE, -1)
    scales = tensors["model.layers.0.mlp.experts.gate_up_proj_scales"][1][0]
    codes = np.stack([blocks & 0xF, blocks >> 4], axis=-1).reshape(2 * INTERMEDIATE, -1)
    values = E2M1[codes] * np.repeat(np.ldexp(1.0, scales.astype(np.int64) - 127), 32, axis=1)
    gate_up = truth["model.layers.0.mlp.experts.gate_up_proj.weight"][0]
    assert np.array_equal(values[0::2], gate_up[:, 0::2].T) and np.array_equal(values[1::2], gate_up[:, 1::2].T)
    assert not np.array_equal(values[:INTERMEDIATE], gate_up[:, 0::2].T)


def test_inspect_describes_the_gpt_oss_source():
    report = inspect(DATA / NAME)
    assert report["architecture"] == "gpt_oss" and report["format"]["method"] == "mxfp4"
    assert report["format"]["codes"] == "mxfp4: E2M1 codes, one UE8M0 scale per 32"
    assert report["experts_per_layer"] == EXPERTS and report["moe_layers"] == [
        f"model.layers.{layer}.mlp.experts" for layer in range(LAYERS)]
    assert report["expert_shapes"] == {"gate": [INTERMEDIATE, HIDDEN], "up": [INTERMEDIATE, HIDDEN],
                                       "down": [HIDDEN, INTERMEDIATE]}
    stacked = report["stacked_experts"]
    assert stacked["tensors"] == {"gate_up_proj": ["gate", "up"], "down_proj": ["down"]}
    assert stacked["gate_up_rows"].startswith("interleaved: gate row i is row 2i, up row i is row 2i + 1")
    first = "model.layers.0.mlp.experts"
    assert stacked["expert_0_of_first_layer"]["up"] == [f"{first}.gate_up_proj_bias[0, 1::2]",
                                                        f"{first}.gate_up_proj_blocks[0, 1::2]",
                                                        f"{first}.gate_up_proj_scales[0, 1::2]"]
    assert stacked["expert_biases"] == f"4 tensors (e.g. {first}.gate_up_proj_bias), stored BF16, unquantized"
    assert stacked["router"] == ["model.layers.0.mlp.router.bias", "model.layers.0.mlp.router.weight"]
    for name, verdict in report["backends"].items():
        assert not verdict["eligible"] and not verdict["eligible_with_regroup"], name
    assert "CompressedTensorsW4A4Mxfp4MoEMethod" in report["backends"]["compressed-tensors"]["reason"]
    assert report["auto"].startswith("no backend takes this checkpoint: ")


@pytest.mark.parametrize("backend", ["auto", "compressed-tensors"])
def test_convert_refuses_in_one_line_saying_why_and_what_serves_it(capsys, tmp_path, backend):
    code, _, err = run_main(capsys, "convert", DATA / NAME, "-o", tmp_path / "out", "--backend", backend)
    (line,) = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and line.startswith("error: ") and "Traceback" not in err
    assert "its experts carry biases (gpt-oss's gate_up_proj_bias, down_proj_bias)" in line
    assert "registers none (CompressedTensorsW4A4Mxfp4MoEMethod.create_weights)" in line
    assert "vLLM serves the gpt-oss checkpoint as it is with its own mxfp4 method (GptOssMxfp4MoEMethod" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_a_checkpoint_that_claims_mxfp4_over_bf16_experts_is_refused_in_one_line(capsys, tmp_path, command):
    """gptoss-cpu-dequantized: what transformers saves on CPU without kernels (docs/FLOAT_SOURCES.md section 5)."""
    folder = DATA / "gptoss-cpu-dequantized"
    code, _, err = run_main(capsys, command, folder, *(["-o", tmp_path / "out"] if command == "convert" else []))
    (line,) = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and "Traceback" not in err
    assert line == (f"error: {folder}/model-00001-of-00006.safetensors: tensor model.layers.0.mlp.experts.gate_up_proj "
                    f"is BF16[4, 96, 64]: the routed experts are held in float while config.json says quant_method "
                    f"'mxfp4', so there is nothing quantized to convert (transformers saves gpt-oss this way after "
                    f"dequantizing MXFP4 on CPU; docs/FLOAT_SOURCES.md section 5)")


def test_a_reserved_scale_byte_is_refused_naming_the_tensor(tmp_path):
    """transformers reads 0xFF as 2^128 (docs/FLOAT_SOURCES.md section 1); moeconv refuses it."""
    checkpoint = open_checkpoint(DATA / NAME)
    stored = read_expert(checkpoint, 1, 2)["down"]
    stored["scales"] = stored["scales"].copy()
    stored["scales"][3, 0] = 0xFF
    with pytest.raises(MoeconvError, match=r"^scales holds 1 scale byte\(s\) that UE8M0 reserves for NaN \(0xFF at "
                                           r"\[3, 0\]\)"):
        GptOssMxfp4().decode(stored)


def test_a_stacked_tensor_of_another_expert_count_is_refused_naming_it(capsys, tmp_path):
    folder = tmp_path / "src"
    shutil.copytree(DATA / NAME, folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_local_experts"] = 3
    (folder / "config.json").write_text(json.dumps(config))
    code, _, err = run_main(capsys, "inspect", folder)
    assert code == 2 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.strip()]
    assert re.fullmatch(r"error: \S+\.safetensors: tensor model\.layers\.0\.mlp\.experts\.(gate_up|down)_proj_\w+ is "
                        r"\w+\[4, [\d, ]+\]: gpt_oss stacks the 3 experts config\.json names along dim 0, then the rows "
                        r"of (gate and up|down)", line), line


def test_an_expert_slice_is_its_rows_of_the_experts_block():
    """The slice's bytes are rows first::step of the expert's contiguous block, named so."""
    checkpoint = open_checkpoint(DATA / NAME)
    stored = checkpoint.tensors["model.layers.1.mlp.experts.gate_up_proj_scales"]
    tensors, _ = read_checkpoint(DATA / NAME)
    whole = tensors[stored.name][1]
    with TensorReader() as reader:
        for expert in range(EXPERTS):
            for first in (0, 1):
                piece = ExpertSlice(stored, expert, first, 2)
                assert piece.name == f"{stored.name}[{expert}, {first}::2]" and piece.shape == (INTERMEDIATE, 3)
                assert np.array_equal(piece.read_raw(reader), whole[expert, first::2])


def bf16_of(values: np.ndarray) -> np.ndarray:
    """float32 values as BF16 bit patterns, round to nearest even (numpy; exact for BF16 values, inf kept)."""
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def test_the_bf16_cast_is_refused_where_the_census_finds_blocks_bf16_cannot_hold(capsys, tmp_path, truth):
    """The fixture's UE8M0 edge bytes make some values overflow BF16 (transformers loads them as inf); the
    count of such blocks comes from transformers' float64 dequantization, not from moeconv."""
    inexact = 0
    for layer in range(LAYERS):
        for tensor in STACKED:
            exact = truth[f"model.layers.{layer}.mlp.experts.{tensor}.weight"]  # [E, K, N] float64
            with np.errstate(over="ignore"):  # the overflowing values: inf in float32, which is the point
                held = bf16_as_float32(bf16_of(exact.astype(np.float32))).astype(np.float64)
            lost = (held != exact).transpose(0, 2, 1)  # [E, N, K]
            inexact += int(lost.reshape(*lost.shape[:2], -1, 32).any(axis=-1).sum())
    assert inexact > 0
    code, _, err = run_main(capsys, "convert", DATA / NAME, "-o", tmp_path / "out", "--cast", "bf16")
    (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and "Traceback" not in err and not (tmp_path / "out").exists()
    assert f"MXFP4 -> BF16: {inexact} of {LAYERS * EXPERTS * 3 * HIDDEN * INTERMEDIATE // 32} blocks inexact" in line


@pytest.fixture(scope="module")
def bf16_cast(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gptoss") / "bf16"
    convert(DATA / NAME, out, cast="bf16", allow_inexact=True, workers=1)
    return out


def test_the_bf16_cast_holds_what_transformers_loads_in_gpt_oss_own_stacked_form(bf16_cast, truth):
    """Every expert tensor equals the parameter transformers' GptOssForCausalLM loads from the MXFP4 source
    (`.loaded`, infinities included), in its own layout ([E, H, 2I], gate and up interleaved: `GptOssExperts`);
    the biases, router and every other tensor are the source's bytes; no quantization_config is left."""
    tensors, _ = read_checkpoint(bf16_cast)
    source, _ = read_checkpoint(DATA / NAME)
    for layer in range(LAYERS):
        experts = f"model.layers.{layer}.mlp.experts"
        for tensor in STACKED:
            dtype, values = tensors[f"{experts}.{tensor}"]
            loaded = truth[f"{experts}.{tensor}.loaded"]
            assert dtype == "BF16" and values.shape == loaded.shape
            assert np.array_equal(values, bf16_of(loaded)), (layer, tensor)
            assert tensors[f"{experts}.{tensor}_bias"][0] == "BF16"
            assert np.array_equal(tensors[f"{experts}.{tensor}_bias"][1], source[f"{experts}.{tensor}_bias"][1])
            assert f"{experts}.{tensor}_blocks" not in tensors and f"{experts}.{tensor}_scales" not in tensors
    passed = {name for name in source if not name.endswith(("_blocks", "_scales"))}
    assert passed | {f"model.layers.{layer}.mlp.experts.{tensor}" for layer in range(LAYERS) for tensor in STACKED} \
        == set(tensors)
    for name in passed:
        assert np.array_equal(tensors[name][1], source[name][1]), name
    config = json.loads((bf16_cast / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "gpt_oss"
    # the manifest names the rows each expert block came from: gate and up interleaved, never guessed
    sources = json.loads((bf16_cast / "moeconv.json").read_text())["tensors"]["model.layers.1.mlp.experts.gate_up_proj"]
    assert sources["transform"] == "mxfp4->bf16" and sources["sources"][:4] == [
        "model.layers.1.mlp.experts.gate_up_proj_blocks[0, 0::2]", "model.layers.1.mlp.experts.gate_up_proj_scales[0, 0::2]",
        "model.layers.1.mlp.experts.gate_up_proj_blocks[0, 1::2]", "model.layers.1.mlp.experts.gate_up_proj_scales[0, 1::2]"]


def test_verify_passes_the_bf16_cast_and_fails_one_flipped_expert_value(bf16_cast, tmp_path):
    assert verify(bf16_cast, level="lossless", workers=1).ok
    flipped = tmp_path / "flipped"
    shutil.copytree(bf16_cast, flipped)
    entry = open_checkpoint(flipped).tensors["model.layers.1.mlp.experts.down_proj"]  # [E, I, H] BF16
    position = entry.begin + 2 * (INTERMEDIATE * HIDDEN + 3) + 1  # expert 1's down, one value's high byte
    with open(entry.file, "r+b") as handle:
        handle.seek(position)
        value = handle.read(1)[0]
        handle.seek(position)
        handle.write(bytes([value ^ 0x01]))
    reseal(flipped, entry.file)
    report = verify(flipped, level="lossless", workers=1)
    layer = next(layer for layer in report.layers if layer.module == "model.layers.1.mlp.experts")
    assert not report.ok
    # stacked [i, h] = [0, 3] is row 3, column 0 of the (N = H, K = I) down projection
    (failure,) = [failure for failure in layer.lossless_failures if failure.startswith("expert")]
    assert failure.startswith("expert 1 down: 1 value(s) differ") and "first at [3, 0]" in failure, failure


@pytest.mark.parametrize("cast", ["fp8-block", "nvfp4"])
def test_the_other_casts_refuse_stacked_experts_in_one_line(capsys, tmp_path, cast):
    code, _, err = run_main(capsys, "convert", DATA / NAME, "-o", tmp_path / "out", "--cast", cast)
    (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and "Traceback" not in err and not (tmp_path / "out").exists()
    assert line.endswith("experts stacked on disk (gate and up interleaved) are written in their stacked BF16 form "
                         "only (--cast bf16), the float form their model class and the engines read")


def test_a_job_reads_an_expert_slice_with_its_block_fingerprinted_for_resume():
    """A conversion job's source slice of a stacked tensor: its rows, and the CRC-32 of the expert's whole block
    (what resume compares: a changed byte anywhere in the block is a changed source) under the slice's name."""
    checkpoint = open_checkpoint(DATA / NAME)
    stored = checkpoint.tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    tensors, _ = read_checkpoint(DATA / NAME)
    whole = tensors[stored.name][1]  # [E, 2I, H/32, 16] U8
    with TensorReader(fingerprints={}) as reader:
        piece = SourceSlice(ExpertSlice(stored, 2, 1, 2))
        values = read_source(piece.entry, reader)
        assert np.array_equal(values, whole[2, 1::2].reshape(INTERMEDIATE, -1))
        assert reader.fingerprints == {piece.key: zlib.crc32(whole[2].tobytes()).to_bytes(4, "little")}
        assert piece.key == "model.layers.0.mlp.experts.gate_up_proj_blocks[2, 1::2]"
