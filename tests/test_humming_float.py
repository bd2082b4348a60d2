"""Float-coded sources converted into Humming's own FP4 weight schema (`quant_method: humming`, b_dtype float4e2m1;
`humming/schema/humming.py` in humming-kernels 0.1.19) and verified.

The outputs are decoded here independently of moeconv, from the layout Humming's schema reads: `weight` int32
(N, K/8) whose little-endian bytes are the producers' code bytes (E2M1, element 2j in the low nibble of byte j: what
Humming's compressed-tensors schema gets by viewing `weight_packed` as int32), `weight_scale` F8_E8M0 (MXFP4) or
F8_E4M3 (NVFP4) bytes, `weight_scale_2` a float32 multiplier. The decoding must give the producer's own decompression
(tests/data/float/*.truth.safetensors) bit for bit. Sources the schema cannot hold exactly (a compressed-tensors
global scale without an exact float32 reciprocal, NVFP4 W4A4's input scales, FP8-block dense layers) are refused in
one line naming why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from helpers import convert_refusal, reseal, run_main
from moeconv import convert, engines, inspect, verify
from moeconv.backends import get_backend
from moeconv.canonical import LinearShape
from moeconv.checkpoint.reader import open_checkpoint
from moeconv.float_codes import DIVIDE, MULTIPLY, MXFP4, FloatWeight, nvfp4
from test_float_conversion import _xor, overwrite, raw_tensors as raw, stored
from test_float_fixtures import (DATA, E2M1, decode_ct_mxfp4, decode_ct_nvfp4, e4m3fn, expert_prefixes,
                                 f32_to_bf16_rne, per_block, read_safetensors)

HUMMING = get_backend("humming")
EXPERT = "model.layers.1.mlp.experts.{}.up_proj.{}"


def humming_codes(words: bytes, shape: list[int]) -> np.ndarray:
    """Humming's `weight` (N, K/8) int32, little-endian as safetensors stores it -> (N, K) E2M1 codes: code i of each
    word at bits [4i, 4i + 4) (Humming's packing: value i of every 32 / b at bits [i·b, i·b + b))."""
    values = np.frombuffer(words, "<i4").reshape(shape).astype(np.int64) & 0xFFFFFFFF
    return np.stack([(values >> (4 * i)) & 0xF for i in range(8)], axis=-1).reshape(shape[0], shape[1] * 8)


@pytest.fixture(scope="module")
def nvfp4_powers(tmp_path_factory) -> Path:
    """llm-compressor's NVFP4A16 fixture with every weight_global_scale moved down to a power of two (another model,
    whose divided global scales have exact float32 reciprocals: the one NVFP4 source Humming's multiplied
    weight_scale_2 holds exactly)."""
    folder = tmp_path_factory.mktemp("humming-nvfp4") / "powers"
    shutil.copytree(DATA / "ct-nvfp4a16", folder)
    for name in open_checkpoint(folder).tensors:
        if name.endswith(".weight_global_scale"):
            value = float(stored(folder, name, np.float32)[0])
            overwrite(folder, name, np.array([2.0 ** np.floor(np.log2(value))], np.float32))
    return folder


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, nvfp4_powers) -> dict[str, tuple[Path, Path]]:
    """name -> (source, humming output)."""
    root = tmp_path_factory.mktemp("humming-float")
    sources = {"ct-mxfp4a16": DATA / "ct-mxfp4a16", "ct-nvfp4a16 (powers of two)": nvfp4_powers}
    return {name: (source, convert(source, root / name.split()[0], backend="humming", workers=1).output)
            for name, source in sources.items()}


def test_mxfp4_codes_and_scale_bytes_decode_to_llm_compressor_s_own_decompression(outputs):
    """Every expert projection: the int32 words' bytes are the source's weight_packed bytes, the F8_E8M0 scale
    bytes the source's U8 ones, and code · 2^(b − 127) read from Humming's layout is compressed-tensors'
    `decompress` output (the truth file) bit for bit, signed zeros included."""
    source, output = outputs["ct-mxfp4a16"]
    src, out = raw(source), raw(output)
    truth = {name: values for name, (_, values) in read_safetensors(DATA / "ct-mxfp4a16.truth.safetensors").items()}
    for prefix, (n, k) in expert_prefixes():
        dtype, shape, words = out[f"{prefix}.weight"]
        assert (dtype, shape) == ("I32", [n, k // 8]) and words == src[f"{prefix}.weight_packed"][2]
        assert out[f"{prefix}.weight_scale"][:2] == ("F8_E8M0", [n, k // 32])
        assert out[f"{prefix}.weight_scale"][2] == src[f"{prefix}.weight_scale"][2]
        assert f"{prefix}.weight_scale_2" not in out
        scales = np.frombuffer(out[f"{prefix}.weight_scale"][2], np.uint8).reshape(n, k // 32)
        decoded = E2M1[humming_codes(words, shape)] * per_block(np.ldexp(1.0, scales.astype(np.int64) - 127), 32)
        expected = truth[f"{prefix}.weight"]
        assert np.array_equal(decoded.astype(np.float32).view(np.uint32), expected.view(np.uint32)), prefix
        # and the fixtures' own decoder of the SOURCE agrees (the truth is bf16-exact here)
        assert np.array_equal(decode_ct_mxfp4({key: (None, np.frombuffer(value[2], np.uint8).reshape(value[1]))
                                               for key, value in src.items() if key.startswith(prefix)}, prefix),
                              expected)
    config = json.loads((output / "config.json").read_text())["quantization_config"]
    source_config = json.loads((source / "config.json").read_text())["quantization_config"]
    assert {key: config[key] for key in ("quant_method", "b_dtype", "bs_dtype", "weight_scale_group_size",
                                         "weight_scale_type", "weight_scale_2_type", "has_zero_point")} == {
        "quant_method": "humming", "b_dtype": "float4e2m1", "bs_dtype": "float8e8m0", "weight_scale_group_size": 32,
        "weight_scale_type": "group", "weight_scale_2_type": "none", "has_zero_point": False}
    # the source's ignore list, and the embedding (every module left in float, as the integer schema lists them)
    assert set(config["ignored_layers"]) - set(source_config["ignore"]) == {"model.embed_tokens"}
    assert set(source_config["ignore"]) <= set(config["ignored_layers"])
    assert not {"a_dtype", "input_quant_mode", "group_size"} & set(config)  # activations stay in the model dtype


def test_nvfp4_weight_scale_2_is_the_reciprocal_multiplied_by(outputs):
    """compressed-tensors divides by weight_global_scale g; Humming multiplies by weight_scale_2 = 1 / g (exact for
    a power of two): code · E4M3(s) · s2 read from Humming's layout equals the compressed-tensors arithmetic of the
    source, bit for bit in the bf16 it decompresses to."""
    source, output = outputs["ct-nvfp4a16 (powers of two)"]
    src, out = raw(source), raw(output)
    for prefix, (n, k) in expert_prefixes():
        dtype, shape, words = out[f"{prefix}.weight"]
        assert (dtype, shape) == ("I32", [n, k // 8]) and words == src[f"{prefix}.weight_packed"][2]
        assert out[f"{prefix}.weight_scale"] == src[f"{prefix}.weight_scale"]  # F8_E4M3 (N, K/16), the same bytes
        assert out[f"{prefix}.weight_scale_2"][:2] == ("F32", [1])
        (g,) = np.frombuffer(src[f"{prefix}.weight_global_scale"][2], np.float32)
        (s2,) = np.frombuffer(out[f"{prefix}.weight_scale_2"][2], np.float32)
        assert float(g) * float(s2) == 1.0
        scales = e4m3fn(np.frombuffer(out[f"{prefix}.weight_scale"][2], np.uint8).reshape(n, k // 16))
        mine = f32_to_bf16_rne((E2M1[humming_codes(words, shape)] * per_block(scales * float(s2), 16)).astype(np.float32))
        theirs = decode_ct_nvfp4({key: (None, np.frombuffer(value[2], np.uint8 if value[0] != "F32" else np.float32)
                                        .reshape(value[1])) for key, value in src.items() if key.startswith(prefix)},
                                 prefix)
        assert np.array_equal(mine.view(np.uint32), theirs.view(np.uint32)), prefix
    config = json.loads((output / "config.json").read_text())["quantization_config"]
    assert (config["bs_dtype"], config["weight_scale_group_size"], config["weight_scale_2_type"]) == (
        "float8e4m3", 16, "tensor")


@pytest.mark.parametrize("name", ["ct-mxfp4a16", "ct-nvfp4a16 (powers of two)"])
def test_verify_is_lossless_and_runs_the_fp4_kernel_on_humming_s_own_words(outputs, name, capsys):
    _, output = outputs[name]
    report = verify(output, level="numerics")
    assert report.ok, report.failures()
    assert sum(layer.experts_exact for layer in report.layers) == 8 and report.dense_linears_checked == 8
    block = 32 if "mxfp4" in name else 16
    for layer in report.layers:
        assert layer.experts_routed == 4 and layer.blocks_checked == 4 * 3 * 64 * 32 // block
        assert layer.relative_error < 1e-3 < layer.tolerance  # fp16 activations: measured 3.7e-4 to 5.4e-4
    code, stdout, _ = run_main(capsys, "verify", output, "--level", "numerics")
    assert code == 0 and f"{2 * 4 * 3 * 64 * 32 // block} FP4 block(s) decoded" in " ".join(stdout.split())


@pytest.fixture
def damaged(tmp_path, nvfp4_powers) -> Path:
    return convert(nvfp4_powers, tmp_path / "out", backend="humming", workers=1).output


@pytest.mark.parametrize("suffix, offset, mask, said", [("weight", 5, 0x80, "up: codes: 1 byte(s) differ"),
                                                        ("weight_scale", 1, 0x01, "up: scales: 1 byte(s) differ"),
                                                        ("weight_scale_2", 0, 0x01, "up: global_scale")])
def test_verify_fails_a_flipped_code_scale_or_weight_scale_2_byte(damaged, suffix, offset, mask, said):
    _xor(damaged, EXPERT.format(2, suffix), offset, mask)
    report = verify(damaged, level="lossless")
    assert not report.ok
    layer = next(layer for layer in report.layers if layer.module == "model.layers.1.mlp.experts")
    assert layer.experts_exact == 3 and any(failure.startswith(f"expert 2 {said}") for failure in
                                            layer.lossless_failures), layer.lossless_failures


def test_numerics_fails_words_read_in_the_wrong_byte_order(damaged):
    """Every up_proj of layer 1 written as big-endian words (what a writer that packed the bytes the other way
    round writes): the kernel reads the output's bytes, the reference the source's, and the error is of order 1."""
    changed = set()
    for expert in range(4):
        name = EXPERT.format(expert, "weight")
        changed.add(overwrite(damaged, name, stored(damaged, name, "<i4").astype(">i4").view("<i4")))
    reseal(damaged, *changed)
    report = verify(damaged, level="numerics")
    layer = next(layer for layer in report.layers if layer.module == "model.layers.1.mlp.experts")
    assert not report.ok and layer.experts_exact == 0 and report.layers[0].ok
    assert layer.relative_error > 100 * layer.tolerance


REFUSED = [
    ("ct-nvfp4a16", "compressed-tensors divides by it, backend 'humming' writes the reciprocal that is multiplied by"),
    ("ct-nvfp4", "its linears store a static input global scale (NVFP4 W4A4), and vLLM's Humming MoE method "
                 "registers none for the experts"),
    ("modelopt-nvfp4", "its linears store a static input global scale (NVFP4 W4A4)"),
    ("ct-mxfp4-fp8block", "backend 'humming' writes one quantization scheme for the whole checkpoint and cannot "
                          "describe FP8 linears beside the quantized experts"),
]


@pytest.mark.parametrize("name, said", REFUSED)
def test_what_humming_s_schema_cannot_hold_exactly_is_refused_in_one_line(capsys, tmp_path, name, said):
    line = convert_refusal(capsys, DATA / name, tmp_path / "out", "--backend", "humming", "--workers", "1")
    assert said in line, line


def test_inspect_says_humming_takes_mxfp4_and_how_each_engine_serves_it():
    verdicts = inspect(DATA / "ct-mxfp4a16")["backends"]["humming"]
    assert verdicts["eligible"], verdicts
    refused = inspect(DATA / "modelopt-nvfp4")["backends"]["humming"]
    assert not refused["eligible"] and "static input global scale" in refused["reason"]
    # what convert refuses beyond the experts' shapes, inspect says too: the reciprocal, the FP8 linears
    reciprocal = inspect(DATA / "ct-nvfp4a16")["backends"]["humming"]
    assert not reciprocal["eligible"] and "is no float32" in reciprocal["reason"]
    fp8 = inspect(DATA / "ct-mxfp4-fp8block")["backends"]
    assert not fp8["humming"]["eligible"] and "cannot describe FP8 linears" in fp8["humming"]["reason"]
    assert fp8["compressed-tensors"]["eligible"], fp8["compressed-tensors"]


def test_the_engines_answers_for_humming_float_outputs(outputs):
    from moeconv.plan import make_plan

    mx = make_plan(outputs["ct-mxfp4a16"][0], backend="humming")
    nv = make_plan(outputs["ct-nvfp4a16 (powers of two)"][0], backend="humming")
    assert mx.serving.engine.startswith("stock vLLM 0.33 (quant_method humming, MXFP4 weights")
    assert nv.serving.engine is None and "RoutedExperts._load_per_tensor_weight_scale: IndexError" in nv.serving.how
    # SGLang 0.5.23's HummingMoEMethod held the MXFP4 output's bytes (run_matrix_sglang.py --only float); NVFP4 not run
    assert mx.sglang_serving.engine.startswith("SGLang 0.5.23 (quant_method humming, HummingMoEMethod")
    assert nv.sglang_serving.engine is None and "--backend compressed-tensors" in nv.sglang_serving.how
    assert engines.VLLM.name in mx.serving.engine


SCHEMES = [MXFP4, nvfp4(MULTIPLY, False), nvfp4(DIVIDE, False)]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), scheme=st.sampled_from(SCHEMES), rows=st.integers(1, 4), blocks=st.integers(1, 4))
def test_a_float_linear_round_trips_and_its_words_are_compressed_tensors_bytes(data, scheme, rows, blocks):
    """from_float_linear then decode_linear gives the same weight (the same reals for a global scale written in the
    other convention: powers of two only); the words' little-endian bytes are compressed-tensors' weight_packed."""
    k = 32 * blocks  # Humming packs runs of 32 values
    packed = np.array(data.draw(st.lists(st.integers(0, 255), min_size=rows * k // 2, max_size=rows * k // 2)),
                      np.uint8).reshape(rows, k // 2)
    scales = np.array(data.draw(st.lists(st.integers(0, 0x7E), min_size=rows * k // scheme.block,
                                         max_size=rows * k // scheme.block)), np.uint8).reshape(rows, -1)
    global_scale = None
    if scheme.global_convention is not None:
        global_scale = np.array(2.0 ** data.draw(st.integers(-20, 20)), np.float32)
    weight = FloatWeight(packed, scales, scheme, global_scale)
    linear = LinearShape(rows, k, 4, scheme.block, True, scheme.scale_dtype, 16, scheme)
    arrays = HUMMING.from_float_linear(weight, linear)
    assert arrays["weight"].dtype == np.int32 and arrays["weight"].shape == (rows, k // 8)
    assert arrays["weight"].astype("<i4").tobytes() == packed.tobytes()
    assert HUMMING.decode_linear(arrays, linear).mismatch(weight) is None
    specs = {spec.name: spec for spec in HUMMING.linear_tensors(linear)}
    assert set(specs) == set(arrays) and all(specs[name].shape == arrays[name].shape for name in arrays)
