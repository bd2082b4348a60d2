"""The exactness predicate of the casts between float codes (moeconv/casts.py), against a brute force written
here independently: every value of a block decoded in Python floats, rounded to the target by torch's own
float8_e4m3fn / bfloat16 conversions (or the nearest E2M1 value), and compared as reals."""

import json
import math
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeconv import casts
from moeconv.api import inspect
from moeconv.float_codes import DIVIDE, MULTIPLY, MXFP4, FloatWeight, nvfp4
from moeconv.render import cast_rows

from helpers import run_main

FLOAT_DATA = Path(__file__).parent / "data" / "float"
E8M0_EDGES = [0, 1, 126, 127, 128, 254, 0xFF]  # smallest, 2^-126, 1/2, 1, 2, largest finite, NaN
E4M3_EDGES = [0x00, 0x01, 0x07, 0x08, 0x38, 0x7E, 0x7F, 0xFF, 0x80, 0x81]  # 0, subnormals, 2^-6, 1, 448, NaN, -0
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# ---- the brute force: values decoded by hand, rounded by torch ---------------------------------------------

def value(code: int, scale: float) -> float:
    return (-1.0 if code & 8 else 1.0) * E2M1[code & 7] * scale


def ue8m0(byte: int) -> float:
    return math.nan if byte == 0xFF else math.ldexp(1.0, byte - 127)


def e4m3(byte: int) -> float:
    return float(torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).double())


def mx_values(weight: FloatWeight) -> np.ndarray:
    return np.array([[value(int(c), ue8m0(int(weight.scales[i, j // 32]))) for j, c in enumerate(row)]
                     for i, row in enumerate(weight.codes)])


def same_as_fp8(values: np.ndarray) -> np.ndarray:
    """Whether each float64 value survives torch's float8_e4m3fn round trip as a real (NaN never does)."""
    rounded = torch.from_numpy(values).to(torch.float8_e4m3fn).double().numpy()
    return rounded == values


def fp8_block_exact_brute(values: np.ndarray) -> bool:
    """Some power-of-two scale 2^t (any float32 one) under which every value of the block is an E4M3 value."""
    shifts = np.arange(-149, 128)[:, None]
    return bool(same_as_fp8(np.ldexp(values.reshape(1, -1), -shifts)).all(axis=1).any())


def bf16_exact_brute(values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(values).to(torch.bfloat16).double().numpy() == values


def nvfp4_group_exact_brute(codes: np.ndarray, byte: int, exponent: int) -> bool:
    """The cast under G = 2^exponent: the E4M3 scale torch gives 2^(b - 127) / G, then each value to the nearest
    E2M1 value of it; an all-zero group is held by any scale (0 is a code)."""
    if byte == 0xFF:
        return False
    values = [value(int(c), ue8m0(byte)) for c in codes]
    if all(v == 0 for v in values):
        return True
    scale = float(torch.tensor([ue8m0(byte) / 2.0**exponent]).to(torch.float8_e4m3fn).double())
    step = scale * 2.0**exponent
    if step == 0 or not math.isfinite(step):
        return False
    return all(math.copysign(min(E2M1, key=lambda e: abs(e - abs(v) / step)), v) * step == v for v in values)


# ---- strategies -------------------------------------------------------------------------------------------

@st.composite
def mxfp4_weights(draw, rows: int, columns: int):
    """MXFP4 codes with scale bytes near the E8M0 edges (or any byte)."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    # codes from a drawn subset of the magnitudes (a block whose largest is 2, or that lacks 0.5, ...)
    magnitudes = draw(st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True))
    codes = rng.choice(np.array(magnitudes, np.uint8), (rows, columns)) | (rng.integers(0, 2, (rows, columns),
                                                                                           dtype=np.uint8) << 3)
    # bytes within 20 binades of an edge byte (spreads around E4M3's 18), now and then an edge or any byte
    base = draw(st.sampled_from(E8M0_EDGES[:-1]))
    near = st.integers(max(base - 20, 0), min(base + 20, 254))
    byte = st.one_of(near, near, near, st.sampled_from(E8M0_EDGES), st.integers(0, 255))
    scales = np.array(draw(st.lists(byte, min_size=rows * columns // 32, max_size=rows * columns // 32)),
                      dtype=np.uint8).reshape(rows, columns // 32)
    return FloatWeight.from_codes(codes, scales, MXFP4)


@st.composite
def nvfp4_weights(draw):
    rows, columns = 2, 32
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    magnitudes = draw(st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True))
    codes = rng.choice(np.array(magnitudes, np.uint8), (rows, columns)) | (rng.integers(0, 2, (rows, columns),
                                                                                           dtype=np.uint8) << 3)
    byte = st.one_of(st.sampled_from(E4M3_EDGES), st.integers(0, 255))
    scales = np.array(draw(st.lists(byte, min_size=4, max_size=4)), dtype=np.uint8).reshape(rows, 2)
    convention = draw(st.sampled_from([DIVIDE, MULTIPLY]))
    # powers of two reaching bfloat16's subnormals and overflow (with either convention), and any float32
    powers = st.integers(-126, 126).map(lambda k: 2.0**k)
    edges = st.sampled_from([1.0, 3.0, 448 * 6 / 2.5, *(2.0**k for k in (-126, -125, -124, -123, -120, 112, 115, 118,
                                                                          119, 120, 126))])
    few_bits = st.tuples(st.integers(1, 255), st.integers(-120, 110)).map(lambda m: m[0] * 2.0**m[1])  # 8 bits
    global_scale = draw(st.one_of(edges, powers, few_bits, st.floats(2.0**-126, 2.0**126, width=32)))
    return FloatWeight.from_codes(codes, scales, nvfp4(convention, False), global_scale=np.array(global_scale, np.float32))


# ---- the predicate against the brute force ------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(mxfp4_weights(rows=4, columns=128))
def test_fp8_block_predicate_agrees_with_brute_force(weight):
    # one 128 x 128 block (4 rows of it): up to 16 scale bytes, the edges among them
    values = mx_values(weight)
    found = casts.census(weight, casts.FP8_BLOCK)
    assert found.blocks == 1
    assert bool(casts.exact_blocks(weight, casts.FP8_BLOCK)[0, 0]) == fp8_block_exact_brute(values)
    assert found.reserved == int((weight.scales == 0xFF).any())
    if found.exact == 0 and not found.reserved:
        assert found.worst_relative_error > 0


@settings(max_examples=150, deadline=None)
@given(mxfp4_weights(rows=2, columns=64))
def test_mxfp4_to_bf16_predicate_agrees_with_brute_force(weight):
    exact = bf16_exact_brute(mx_values(weight)).reshape(2, 2, 32).all(axis=2)
    assert np.array_equal(casts.exact_blocks(weight, casts.BF16), exact)


@settings(max_examples=150, deadline=None)
@given(mxfp4_weights(rows=2, columns=64))
def test_mxfp4_to_nvfp4_predicate_agrees_with_brute_force(weight):
    found = casts.census(weight, casts.NVFP4)
    exponent = found.scale_exponent
    groups = weight.codes.reshape(2, 4, 16)
    bytes_ = np.repeat(weight.scales, 2, axis=1)
    brute = np.array([[nvfp4_group_exact_brute(groups[i, j], int(bytes_[i, j]), exponent) for j in range(4)]
                      for i in range(2)])
    assert np.array_equal(casts.exact_blocks(weight, casts.NVFP4), brute)
    # no other global power of two makes more groups exact (a sample of them, with the edges of the range)
    for other in sorted({-126, 126, exponent - 1, exponent + 1, *(int(b) - 127 - 8 for b in weight.scales.flat)}):
        if -126 <= other <= 126:
            assert sum(nvfp4_group_exact_brute(groups[i, j], int(bytes_[i, j]), other)
                       for i in range(2) for j in range(4)) <= found.exact


def nvfp4_bf16_exact_brute(weight: FloatWeight) -> np.ndarray:
    g = float(weight.global_scale)
    rows, groups = weight.scales.shape
    exact = np.zeros((rows, groups), dtype=bool)
    for i in range(rows):
        for j in range(groups):
            s = e4m3(int(weight.scales[i, j]))
            products = [value(int(c), s) for c in weight.codes[i, 16 * j:16 * (j + 1)]]  # exact in float64
            if weight.scheme.global_convention == MULTIPLY:
                exact[i, j] = bf16_exact_brute(np.array(products) * g).all()
            else:  # a bfloat16 x is c · s / g as a real iff x · g == c · s (exact products in float64)
                rounded = torch.tensor(products, dtype=torch.float64).div(g).to(torch.bfloat16).double().numpy()
                exact[i, j] = bool(np.all(rounded * g == np.array(products))) and not math.isnan(s)
    return exact


@settings(max_examples=200, deadline=None)
@given(nvfp4_weights())
def test_nvfp4_to_bf16_predicate_agrees_with_brute_force(weight):
    assert np.array_equal(casts.exact_blocks(weight, casts.BF16), nvfp4_bf16_exact_brute(weight))


@pytest.mark.parametrize("convention", [DIVIDE, MULTIPLY])
@pytest.mark.parametrize("global_scale", [2.0**-126, 2.0**-120, 2.0**-117, 3.0, 2.0**117, 2.0**120, 2.0**126])
def test_nvfp4_edge_scale_bytes_and_globals_to_bf16_against_the_brute_force(convention, global_scale):
    # every E4M3 edge byte (a column each) under every code (a row each), a global scale that pushes the values
    # to bfloat16's subnormals (2^-133 = 0.5 · 2^-6 · 2^-126) or past its largest
    codes = np.repeat(np.arange(16, dtype=np.uint8)[:, None], 16 * len(E4M3_EDGES), axis=1)
    scales = np.tile(np.array(E4M3_EDGES, np.uint8), (16, 1))
    weight = FloatWeight.from_codes(codes, scales, nvfp4(convention, False), global_scale=np.array(global_scale, np.float32))
    assert np.array_equal(casts.exact_blocks(weight, casts.BF16), nvfp4_bf16_exact_brute(weight))


@pytest.mark.parametrize("byte", E8M0_EDGES)
def test_every_edge_byte_and_code_against_the_brute_force(byte):
    # one code at a time under each edge byte (bf16 overflows from 2 · 2^127 on, so byte 254 splits the codes)
    for code in range(16):
        weight = FloatWeight.from_codes(np.full((1, 32), code, np.uint8), np.full((1, 1), byte, np.uint8), MXFP4)
        values = mx_values(weight)
        assert casts.exact_blocks(weight, casts.BF16)[0, 0] == bf16_exact_brute(values).all(), code
        assert casts.exact_blocks(weight, casts.FP8_BLOCK)[0, 0] == fp8_block_exact_brute(values), code


@pytest.mark.parametrize("high", [e for e in E8M0_EDGES if 17 < e < 0xFF] + [20, 200])
def test_fp8_block_spreads_around_eighteen_binades_against_the_brute_force(high):
    # a block's largest code under byte `high`, its smallest under `high - spread`: the edge of E4M3's range
    for large, small, spread in [(l, s, d) for l in (4, 6, 7) for s in (1, 2, 3) for d in range(13, 20)]:
        codes = np.zeros((2, 32), np.uint8)
        codes[0, 0], codes[1, 0] = large, small
        weight = FloatWeight.from_codes(codes, np.array([[high], [high - spread]], np.uint8), MXFP4)
        assert casts.exact_blocks(weight, casts.FP8_BLOCK)[0, 0] == fp8_block_exact_brute(mx_values(weight)), (
            large, small, spread)


@pytest.mark.parametrize("global_scale", [0.0, math.inf, math.nan])
def test_a_global_scale_that_reads_as_no_number_is_refused(global_scale):
    weight = FloatWeight.from_codes(np.zeros((1, 16), np.uint8), np.full((1, 1), 0x38, np.uint8), nvfp4(MULTIPLY, False),
                         global_scale=np.array(global_scale, np.float32))
    with pytest.raises(ValueError, match=f"a global scale of {global_scale!r} has no value set to decide"):
        casts.census(weight, casts.BF16)


def test_a_target_the_source_has_not_is_refused():
    weight = FloatWeight.from_codes(np.zeros((1, 16), np.uint8), np.full((1, 1), 0x38, np.uint8), nvfp4(DIVIDE, False),
                         global_scale=np.array(1.0, np.float32))
    with pytest.raises(ValueError, match=r"no fp8-block cast of nvfp4 codes is decided here \(from nvfp4: bf16\)"):
        casts.census(weight, casts.FP8_BLOCK)


# ---- a synthetic spread: a known number of FP8 blocks inexact ------------------------------------------------

def test_census_counts_the_blocks_a_spread_of_exponents_makes_inexact():
    # 256 x 384: 2 x 3 FP8 blocks, every scale byte 127 and every code 6 (the largest exponent 2^2: t = -6),
    # then one small value per chosen block. E4M3's smallest subnormal under 2^-6 is 2^-15:
    codes = np.full((256, 384), 7, np.uint8)
    scales = np.full((256, 12), 127, np.uint8)
    codes[0, 0], scales[0, 0] = 1, 113      # block (0, 0): 0.5 · 2^-14 = 2^-15, the edge: exact
    codes[5, 128], scales[5, 4] = 1, 112    # block (0, 1): 2^-16 halfway to 0: flushed (relative error 1)
    codes[130, 300], scales[130, 9] = 3, 112  # block (1, 2): 1.5 · 2^-16 rounds to 2^-15 (error 1/3)
    scales[200, 1] = 0xFF                   # block (1, 0): a reserved byte, never exact
    weight = FloatWeight.from_codes(codes, scales, MXFP4)
    assert casts.exact_blocks(weight, casts.FP8_BLOCK).tolist() == [[True, False, True], [False, True, False]]
    assert casts.census(weight, casts.FP8_BLOCK) == casts.Census(casts.FP8_BLOCK, 6, 3, 1, 1.0)
    codes[5, 128] = 0                       # without the flushed value the worst error is the rounded one's
    assert casts.census(FloatWeight.from_codes(codes, scales, MXFP4), casts.FP8_BLOCK).worst_relative_error == 1 / 3


# ---- inspect on real llm-compressor output -------------------------------------------------------------------

def test_inspect_counts_the_casts_of_llm_compressor_mxfp4():
    found = inspect(FLOAT_DATA / "ct-mxfp4a16", casts=True)["casts"]
    assert {target: (entry["blocks"], entry["exact"], entry["reserved"], entry["linears"])
            for target, entry in found.items()} == {"fp8-block": (24, 8, 0, 24), "nvfp4": (3072, 3072, 0, 24),
                                                    "bf16": (1536, 1536, 0, 24)}
    # the 16 inexact FP8 blocks: a linear's scale bytes span more binades than E4M3 (down_proj of expert 0:
    # bytes 105 .. 122, values from 2^-23 to 1.5 · 2^-3); each flushes its smallest values to 0
    inexact = found["fp8-block"]["inexact"]
    assert len(inexact) == 16 and inexact[0]["tensor"] == "model.layers.0.mlp.experts.0.down_proj"
    assert found["fp8-block"]["worst_relative_error"] == 1.0
    assert [row[1] for row in cast_rows(found)][1:] == ["100% of 3,072 blocks exact", "100% of 1,536 blocks exact"]
    assert cast_rows(found)[0][1] == ("33.33% of 24 blocks exact (8); 16 of 24 linears with inexact blocks (first: "
                                      "model.layers.0.mlp.experts.0.down_proj, 1 inexact block(s)); worst relative "
                                      "error 1 (a value flushed to 0)")


def test_the_census_is_asked_for_inspect_reads_no_expert_data_without_it(capsys):
    """inspect reads headers and a few small tensors; the census reads every expert linear (half an hour for a
    gpt-oss-120b on one core), so it runs only under --casts / casts=True, and the table shows it then."""
    assert "casts" not in inspect(FLOAT_DATA / "ct-mxfp4a16")
    code, out, _ = run_main(capsys, "inspect", FLOAT_DATA / "ct-mxfp4a16")
    assert code == 0 and "MXFP4 -> FP8-block" not in out
    code, out, _ = run_main(capsys, "inspect", FLOAT_DATA / "ct-mxfp4a16", "--casts")
    assert code == 0 and "33.33% of 24 blocks exact (8)" in out and "100% of 3,072 blocks exact" in out


def test_inspect_census_agrees_with_the_brute_force_on_the_fixture():
    from moeconv.checkpoint.reader import TensorReader, open_checkpoint
    from moeconv.survey import survey

    checkpoint = open_checkpoint(FLOAT_DATA / "ct-mxfp4a16")
    found = survey(checkpoint, strict=False)
    exact = 0
    with TensorReader() as reader:
        for layer in found.layers:
            for expert in layer.experts:
                for linear in expert.values():
                    weight = found.source_format.decode({s: reader.read_raw(e) for s, e in linear.items()})
                    exact += fp8_block_exact_brute(mx_values(weight))  # each linear is one (partial) block
    assert exact == inspect(FLOAT_DATA / "ct-mxfp4a16", casts=True)["casts"]["fp8-block"]["exact"] == 8


def test_the_census_of_hostile_scale_bytes_is_strict_json():
    # gpt-oss's stacked experts with scale bytes up to 254: a BF16 cast overflows (an infinite error, "inf")
    found = inspect(FLOAT_DATA / "gptoss-mxfp4-bytes", casts=True)["casts"]
    json.loads(json.dumps(found, allow_nan=False))
    bf16 = found["bf16"]
    assert (bf16["blocks"], bf16["exact"], bf16["worst_relative_error"]) == (2304, 2300, "inf")
    assert bf16["inexact"][0]["tensor"] == "model.layers.0.mlp.experts.gate_up_proj_blocks[1, 1::2]"
    assert cast_rows({"bf16": {**bf16, "exact": 2303}})[0][1] == (
        "99.95% of 2,304 blocks exact (2,303); 4 of 24 linears with inexact blocks (first: "
        "model.layers.0.mlp.experts.gate_up_proj_blocks[1, 1::2], 1 inexact block(s)); worst relative error inf "
        "(a value overflows the target)")
    assert cast_rows({"bf16": {**bf16, "blocks": 10**6, "exact": 10**6 - 1}})[0][1].startswith("99.99% of")


def set_scale_byte(folder: Path, tensor: str, byte: int) -> None:
    """Overwrite the first byte of `tensor`'s data in its shard (safetensors: 8-byte header length, JSON)."""
    shard = folder / json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][tensor]
    with open(shard, "r+b") as handle:
        length = struct.unpack("<Q", handle.read(8))[0]
        begin = json.loads(handle.read(length))[tensor]["data_offsets"][0]
        handle.seek(8 + length + begin)
        handle.write(bytes([byte]))


def test_the_census_counts_a_changed_scale_byte_and_names_an_unreadable_linear(tmp_path):
    # llm-compressor's MXFP4 output with one exact FP8 block made inexact (a scale byte of 254 beside bytes
    # near 120: 2^127 among 2^-7) and one linear made unreadable (0xFF: the format refuses to read it, so it is
    # listed apart and its blocks are not counted; the census never shows 100% while one is)
    source = shutil.copytree(FLOAT_DATA / "ct-mxfp4a16", tmp_path / "src")
    before = inspect(source, casts=True)["casts"]["fp8-block"]
    exact_linear = next(f"model.layers.{layer}.mlp.experts.{expert}.{projection}"
                        for layer in range(2) for expert in range(4) for projection in ("gate_proj", "up_proj", "down_proj")
                        if f"model.layers.{layer}.mlp.experts.{expert}.{projection}" not in
                        {entry["tensor"] for entry in before["inexact"]})
    set_scale_byte(source, f"{exact_linear}.weight_scale", 254)
    set_scale_byte(source, "model.layers.1.mlp.experts.3.down_proj.weight_scale", 0xFF)
    after = inspect(source, casts=True)["casts"]
    fp8 = after["fp8-block"]
    unreadable_was_exact = "model.layers.1.mlp.experts.3.down_proj" not in {e["tensor"] for e in before["inexact"]}
    assert (fp8["blocks"], fp8["exact"], fp8["linears"]) == (23, 7 - unreadable_was_exact, 23)
    assert exact_linear in {entry["tensor"] for entry in fp8["inexact"]}
    for entry in after.values():
        assert [refused["tensor"] for refused in entry["refused"]] == ["model.layers.1.mlp.experts.3.down_proj"]
        assert "reserves for NaN (0xFF at [0, 0])" in entry["refused"][0]["reason"]
    assert cast_rows(after)[2][1].endswith("; 1 linears unreadable (first: model.layers.1.mlp.experts.3.down_proj)")
