"""The canonical float form (moeconv/float_codes.py): every byte kept, read as torch's own float8 types read it,
round trips with the edge bytes forced in, and the refusals of what cannot be read."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeconv.float_codes import (DIVIDE, E4M3, MULTIPLY, MXFP4, UE8M0, FloatWeight, exact_reciprocal, global_refusal,
                                 nvfp4, pack_codes, scale_refusal, scale_values, unpack_codes)

ALL_BYTES = np.arange(256, dtype=np.uint8)
# E2M1 by its definition (sign, 2 exponent bits with bias 1, 1 mantissa bit; exponent 0 subnormal), not the module's table
E2M1_BY_BITS = [(-1.0 if code & 8 else 1.0) * ((code & 1) / 2 if not code & 6 else (1 + (code & 1) / 2) *
                                                2.0 ** (((code >> 1) & 3) - 1)) for code in range(16)]


def test_e2m1_values_are_the_format_s_definition():
    weight = FloatWeight.from_codes(np.arange(16, dtype=np.uint8).repeat(2).reshape(1, 32), np.full((1, 1), 127, np.uint8), MXFP4)
    decoded = weight.dequantize()[0, ::2]
    assert decoded.tolist() == E2M1_BY_BITS
    assert np.signbit(decoded[8]) and not np.signbit(decoded[0])  # code 0x8 is -0.0


def test_e4m3_bytes_read_as_torch_float8_e4m3fn_reads_them():
    ours = scale_values(ALL_BYTES, E4M3)
    theirs = torch.from_numpy(ALL_BYTES.copy()).view(torch.float8_e4m3fn).to(torch.float64).numpy()
    assert np.array_equal(np.isnan(ours), np.isnan(theirs)) and np.isnan(ours).sum() == 2
    finite = ~np.isnan(ours)
    assert np.array_equal(ours[finite], theirs[finite]) and np.array_equal(np.signbit(ours), np.signbit(theirs))
    assert (ours[0x7E], ours[0x01], ours[0x38]) == (448.0, 2.0 ** -9, 1.0)


def test_ue8m0_bytes_read_as_torch_float8_e8m0fnu_reads_them():
    ours = scale_values(ALL_BYTES, UE8M0)
    theirs = torch.from_numpy(ALL_BYTES.copy()).view(torch.float8_e8m0fnu).to(torch.float64).numpy()
    assert np.isnan(ours[255]) and np.isnan(theirs[255])
    assert np.array_equal(ours[:255], theirs[:255]) and (ours[0], ours[127], ours[254]) == (2.0 ** -127, 1.0, 2.0 ** 127)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_codes_pack_low_nibble_first_and_round_trip(rows, pairs, seed):
    codes = np.random.default_rng(seed).integers(0, 16, (rows, 2 * pairs), dtype=np.uint8)
    codes[0, :2] = [0x8, 0xF]
    packed = pack_codes(codes)
    assert packed[0, 0] == 0xF8 and packed.shape == (rows, pairs)
    assert np.array_equal(unpack_codes(packed), codes)
    assert np.array_equal(pack_codes(unpack_codes(packed)), packed)


EDGE_E4M3 = [0x00, 0x80, 0x01, 0x07, 0x08, 0x7E, 0xFE, 0x38]  # zeros, subnormals, the normal boundary, +-448, 1
EDGE_UE8M0 = [0x00, 0x01, 0x7F, 0xFE]


@st.composite
def float_weights(draw, scheme):
    """A random float-coded linear with the edge codes and scale bytes forced in, and a global scale that is
    a power of two or not."""
    rows, blocks = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    codes = rng.integers(0, 16, (rows, blocks * scheme.block), dtype=np.uint8)
    codes[0, :16] = np.arange(16)
    edges = EDGE_UE8M0 if scheme.scale_encoding == UE8M0 else EDGE_E4M3
    scales = rng.choice(np.array([byte for byte in range(255) if scale_refusal(np.array([byte], np.uint8),
                                                                               scheme.scale_encoding) is None],
                                 np.uint8), (rows, blocks))
    scales.reshape(-1)[:len(edges)] = edges[:scales.size]
    scalars = {}
    if scheme.global_convention is not None:
        power = draw(st.booleans())
        scalar = st.integers(-20, 20).map(lambda e: 2.0 ** e) if power else st.floats(
            float(np.float32(1e-6)), float(np.float32(1e6)), width=32)
        scalars["global_scale"] = np.array(draw(scalar), np.float32)
        if scheme.input_scale:
            scalars["input_scale"] = np.array(draw(scalar), np.float32)
    return FloatWeight.from_codes(codes, scales, scheme, **scalars)


@pytest.mark.parametrize("scheme", [MXFP4, nvfp4(DIVIDE, False), nvfp4(MULTIPLY, True)], ids=lambda s: s.describe())
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_weight_equals_itself_and_no_byte_flip(scheme, data):
    weight = data.draw(float_weights(scheme))
    same = FloatWeight(pack_codes(unpack_codes(weight.packed)), weight.scales.copy(), scheme, weight.global_scale,
                       weight.input_scale)
    assert weight.mismatch(same) is None
    flipped_code = weight.codes.copy()
    flipped_code[-1, -1] ^= 0x8
    assert "codes" in weight.mismatch(FloatWeight.from_codes(flipped_code, weight.scales, scheme, weight.global_scale,
                                                  weight.input_scale))
    flipped_scale = weight.scales.copy()
    flipped_scale[-1, -1] ^= 0x01
    assert "scales" in weight.mismatch(FloatWeight(weight.packed, flipped_scale, scheme, weight.global_scale,
                                                   weight.input_scale))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_convention_changes_exactly_or_not_at_all(data):
    """Multiplied by s2 -> divided by 1/s2: the decoded reals are unchanged (checked in float64, where the product
    c * s * s2 is exact and c * s / g is the correctly rounded quotient of the same real), and only a power of
    two has a float32 reciprocal; a value that has none is refused with the reason."""
    weight = data.draw(float_weights(nvfp4(MULTIPLY, True)))
    exact = {float(weight.global_scale), float(weight.input_scale)}
    powers = all(np.frexp(value)[0] == 0.5 for value in exact)
    if not powers:
        with pytest.raises(ValueError, match="no exact float32 reciprocal"):
            weight.in_convention(DIVIDE)
        return
    divided = weight.in_convention(DIVIDE)
    assert divided.scheme.global_convention == DIVIDE and weight.mismatch(divided) is None
    assert float(divided.global_scale) * float(weight.global_scale) == 1.0
    assert np.array_equal(divided.dequantize(), weight.dequantize())
    assert divided.in_convention(MULTIPLY).global_scale.tobytes() == weight.global_scale.tobytes()


def test_reciprocals_only_of_powers_of_two_in_range():
    assert float(exact_reciprocal(np.array(0.25, np.float32))) == 4.0
    assert exact_reciprocal(np.array(3.0, np.float32)) is None
    assert exact_reciprocal(np.array(np.float32(1) / np.float32(2688), np.float32)) is None
    assert exact_reciprocal(np.array(2.0 ** -140, np.float32)) is None  # 2^140 is past float32


def test_a_global_scale_in_the_other_convention_is_not_the_same_weight():
    weight = FloatWeight.from_codes(np.zeros((1, 16), np.uint8), np.full((1, 1), 0x38, np.uint8), nvfp4(DIVIDE, False),
                         np.array(4.0, np.float32))
    other = FloatWeight(weight.packed, weight.scales, nvfp4(MULTIPLY, False), np.array(4.0, np.float32))
    assert "global_scale" in weight.mismatch(other)
    assert weight.mismatch(FloatWeight(weight.packed, weight.scales, nvfp4(MULTIPLY, False),
                                       np.array(0.25, np.float32))) is None


def test_reserved_scale_bytes_and_bad_global_scales_are_refused():
    assert "0xFF" in scale_refusal(np.array([[1, 0xFF]], np.uint8), UE8M0)
    assert scale_refusal(np.array([[0xFE]], np.uint8), UE8M0) is None
    for nan in (0x7F, 0xFF):
        assert "NaN" in scale_refusal(np.array([[0x38, nan]], np.uint8), E4M3)
    assert scale_refusal(np.array([[0x7E, 0xFE, 0x00, 0x80]], np.uint8), E4M3) is None
    for bad in (0.0, -0.0, np.inf, np.nan):
        assert global_refusal(np.array(bad, np.float32)) is not None
    assert global_refusal(np.array(2.0 ** -149, np.float32)) is None
