"""DeepSeek-V4's FP4 routed experts under its FP8 config, read by moeconv exactly as transformers reads them.

tests/data/float/dsv4-fp4-bytes: the quantized BYTES are made by tests/packers/make_float_dsv4_bytes.py (no producer
of this layout runs here: docs/FLOAT_SOURCES.md section 6), the rest by transformers 5.24.0; the TRUTH beside it is
transformers' own reader on those files (`Fp8Dequantize._dequantize_one`, float32), not moeconv. Here: moeconv finds
the experts under DeepSeek's own names (`layers.L.ffn.experts.E.w1/w3/w2`: gate, up, down), decodes every one to
transformers' values bit for bit, signed zeros included; inspect describes the source; convert refuses in one line
saying what blocks the output and what serves the source; what cannot be read (a reserved scale byte, an FP8 config
without FP4 experts) is refused naming it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from helpers import run_main
from moeconv import inspect
from moeconv.checkpoint.reader import TensorReader, open_checkpoint
from moeconv.errors import MoeconvError
from moeconv.float_codes import UE8M0
from moeconv.formats.deepseek_v4_fp4 import DeepSeekV4Fp4
from moeconv.survey import survey
from test_float_fixtures import DATA, read_safetensors

NAME = "dsv4-fp4-bytes"
LAYERS, EXPERTS, HIDDEN, INTERMEDIATE = 2, 4, 128, 64
NATIVE = {"gate": "w1", "up": "w3", "down": "w2"}


@pytest.fixture(scope="module")
def truth() -> dict[str, np.ndarray]:
    return {key: values for key, (_, values) in read_safetensors(DATA / f"{NAME}.truth.safetensors").items()}


@pytest.fixture(scope="module")
def found():
    return survey(open_checkpoint(DATA / NAME))


def test_the_experts_are_found_under_deepseeks_own_names(found):
    assert isinstance(found.source_format, DeepSeekV4Fp4) and found.source_format.float_scheme.scale_encoding == UE8M0
    assert [moe.module for moe in found.layers] == [f"layers.{layer}.ffn.experts" for layer in range(LAYERS)]
    for moe in found.layers:
        assert len(moe.experts) == EXPERTS
        for expert, linears in enumerate(moe.experts):
            for projection, native in NATIVE.items():
                names = {suffix: entry.name for suffix, entry in linears[projection].items()}
                assert names == {"weight": f"{moe.module}.{expert}.{native}.weight",
                                 "scale": f"{moe.module}.{expert}.{native}.scale"}


def test_moeconv_reads_every_expert_as_transformers_does_bit_for_bit(found, truth):
    """moeconv's FloatWeight of every expert linear dequantizes (float64, exactly) to transformers' float32 reading
    of the same bytes: equal after rounding to float32 (inf where a code under scale byte 254 leaves float32's
    range, as transformers has it), signed zeros included."""
    checked = 0
    with TensorReader() as reader:
        for moe in found.layers:
            for expert, linears in enumerate(moe.experts):
                for projection, native in NATIVE.items():
                    stored = {suffix: reader.read_raw(entry) for suffix, entry in linears[projection].items()}
                    want = truth[f"{moe.module}.{expert}.{native}.weight.dequant"]
                    with np.errstate(over="ignore"):
                        got = found.source_format.decode(stored).dequantize().astype(np.float32)
                    assert got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32)), (
                        moe.module, expert, projection)
                    checked += 1
    assert checked == LAYERS * EXPERTS * 3


def test_inspect_describes_the_source_and_every_backend_refuses_it():
    report = inspect(DATA / NAME)
    assert report["architecture"] == "deepseek_v4" and report["format"]["method"] == "fp8"
    assert report["format"]["codes"] == "mxfp4: E2M1 codes, one UE8M0 scale per 32"
    assert report["experts_per_layer"] == EXPERTS
    assert report["expert_shapes"] == {"gate": [INTERMEDIATE, HIDDEN], "up": [INTERMEDIATE, HIDDEN],
                                       "down": [HIDDEN, INTERMEDIATE]}
    for name, verdict in report["backends"].items():
        assert not verdict["eligible"] and not verdict["eligible_with_regroup"], name
    assert "one E8M0 `scale` per 128x128 tile" in report["backends"]["compressed-tensors"]["reason"]
    assert report["auto"].startswith("moeconv does not convert this checkpoint yet: DeepSeek-V4's FP4 experts are "
                                     "read exactly")


@pytest.mark.parametrize("backend", ["auto", "compressed-tensors", "triton"])
def test_convert_refuses_in_one_line_saying_what_blocks_it_and_what_serves_it(capsys, tmp_path, backend):
    code, _, err = run_main(capsys, "convert", DATA / NAME, "-o", tmp_path / "out", "--backend", backend)
    (line,) = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and line.startswith("error: moeconv does not convert this checkpoint yet: ") and "Traceback" not in err
    assert "no engine has been shown to serve a compressed-tensors DeepSeek-V4" in line
    assert "vLLM serves the checkpoint as it is (quant_method fp8 with expert_dtype fp4" in line
    assert not (tmp_path / "out").exists()


def test_a_reserved_scale_byte_is_refused_naming_the_tensor(found):
    """torch's float8_e8m0fnu reads 0xFF as NaN (transformers' dequantization then yields NaN); moeconv refuses it."""
    with TensorReader() as reader:
        stored = {suffix: reader.read_raw(entry) for suffix, entry in found.layers[1].experts[2]["down"].items()}
    stored["scale"] = stored["scale"].copy()
    stored["scale"][5, 1] = 0xFF
    with pytest.raises(MoeconvError, match=r"^scale holds 1 scale byte\(s\) that UE8M0 reserves for NaN \(0xFF at "
                                           r"\[5, 1\]\)"):
        DeepSeekV4Fp4().decode(stored)


def test_the_v4_1_spelling_with_expert_dtype_in_the_quantization_config_reads_the_same(tmp_path):
    folder = tmp_path / "v41"
    shutil.copytree(DATA / NAME, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["expert_dtype"] = config.pop("expert_dtype")
    (folder / "config.json").write_text(json.dumps(config))
    assert isinstance(survey(open_checkpoint(folder)).source_format, DeepSeekV4Fp4)


@pytest.mark.parametrize("expert_dtype", [None, "fp8"])
def test_an_fp8_config_without_fp4_experts_is_refused_in_one_line(capsys, tmp_path, expert_dtype):
    folder = tmp_path / "src"
    shutil.copytree(DATA / NAME, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["expert_dtype"]
    if expert_dtype:
        config["expert_dtype"] = expert_dtype
    (folder / "config.json").write_text(json.dumps(config))
    code, _, err = run_main(capsys, "inspect", folder)
    (line,) = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and "Traceback" not in err
    assert line == (f"error: {folder}/config.json: quantization_config: quant_method 'fp8' with expert_dtype "
                    f"{expert_dtype!r}: moeconv reads DeepSeek-V4's FP4 experts under an FP8 config (expert_dtype "
                    f"'fp4'), not FP8 experts")
