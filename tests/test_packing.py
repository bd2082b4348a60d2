import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moeconv import packing


@given(bits=st.sampled_from([2, 4, 8]), container=st.sampled_from([np.int32, np.uint8]),
       rows=st.integers(1, 5), words=st.integers(1, 6), dim=st.sampled_from([0, 1]), seed=st.integers(0, 2**31))
def test_pack_unpack_round_trip(bits, container, rows, words, dim, seed):
    per = (32 if container is np.int32 else 8) // bits
    shape = [rows, rows]
    shape[dim] = words * per
    codes = np.random.default_rng(seed).integers(0, 1 << bits, shape, dtype=np.uint8)
    packed = packing.pack_array(codes, bits, dim, container)
    assert packed.dtype == container
    assert packed.shape[dim] == words
    assert np.array_equal(packing.unpack_array(packed, bits, dim), codes)


def test_int32_words_match_lsb_first_arithmetic():
    """Value j of a word sits at bits [4j, 4j+4): computed here with Python integers."""
    codes = np.array([[1, 2, 3, 4, 5, 6, 7, 15], [15, 15, 15, 15, 15, 15, 15, 15]], dtype=np.uint8)
    words = packing.pack_array(codes, 4, axis=1, container=np.int32)
    assert words.tolist() == [[0xF7654321 - (1 << 32)], [-1]]
    assert np.array_equal(packing.unpack_array(words, 4, axis=1), codes)
    # along the other axis (shifts, not a view): the same words, transposed
    assert packing.pack_array(codes.T.copy(), 4, axis=0, container=np.int32).T.tolist() == words.tolist()


def test_uint8_bytes_even_value_in_low_nibble():
    codes = np.array([[0x3, 0xA, 0xF, 0x0]], dtype=np.uint8)
    assert packing.pack_array(codes, 4, axis=1, container=np.uint8).tolist() == [[0xA3, 0x0F]]
    assert packing.pack_array(codes.T.copy(), 4, axis=0, container=np.uint8).tolist() == [[0xA3], [0x0F]]


def test_eight_bit_words_hold_bytes_in_order():
    codes = np.array([[0x01, 0x80, 0xFF, 0x7F]], dtype=np.uint8)
    assert packing.pack_array(codes, 8, axis=1, container=np.int32).tolist() == [[0x7FFF8001]]


def test_add_to_words_borrows_across_slots():
    # 0x76543210 - 0x11111111 = 0x654320FF: nibble 0 (0 - 1) borrows from nibble 1, which then
    # borrows from nibble 2 (1 - 1 - 1): a per-nibble "+1" reader would see zeros 16, 15, 2, ...
    words = np.array([0x76543210], dtype=np.int32)
    assert packing.add_to_word_array(words, -0x11111111).tolist() == [0x654320FF]
    assert packing.add_to_word_array(np.array([0x654320FF], dtype=np.int32), 0x11111111).tolist() == [0x76543210]
    # Wrapping past 2^32 in both directions.
    assert packing.add_to_word_array(np.array([0], dtype=np.int32), -0x11111111).tolist() == [0xEEEEEEEF - (1 << 32)]


def test_repeated_word():
    assert packing.repeated_word(1, 4) == 0x11111111
    assert packing.repeated_word(1, 8) == 0x01010101
    assert packing.repeated_word(1, 2) == 0x55555555


def test_refuses_widths_that_do_not_tile():
    with pytest.raises(ValueError):
        packing.pack_array(np.zeros((1, 32), dtype=np.uint8), 3, axis=1, container=np.int32)


@given(shape=st.tuples(st.integers(1, 4), st.integers(1, 6)), seed=st.integers(0, 2**31))
def test_byte_split_view_equals_the_shifts(shape, seed):
    """On little-endian hosts words are split into bytes (and bytes joined into words) with a view; it must
    equal the shifts."""
    words = np.random.default_rng(seed).integers(-2**31, 2**31, shape, dtype=np.int64).astype(np.int32)
    by_shifts = packing._word_array_bytes(words, 1, allow_view=False)
    assert np.array_equal(packing._word_array_bytes(words, 1), by_shifts)
    assert np.array_equal(packing._bytes_to_words(by_shifts, 1, allow_view=False), words)
    assert np.array_equal(packing._bytes_to_words(by_shifts, 1), words)


@given(bits=st.sampled_from([2, 4, 8]), rows=st.integers(1, 5), columns=st.integers(1, 6), axis=st.sampled_from([0, 1]),
       addend=st.sampled_from([0, 0x11111111, 0x01010101, -0x11111111]), seed=st.integers(0, 2**31))
def test_the_numpy_unpack_of_words_is_pythons_integer_arithmetic(bits, rows, columns, axis, addend, seed):
    """unpack_array and add_to_word_array against Python's integer arithmetic, on any int32 words (sign bit and
    borrows included), along the innermost axis (a view of the words' bytes) and the other (shifts);
    pack_array gives the words back."""
    words = np.random.default_rng(seed).integers(-2**31, 2**31, (rows, columns), dtype=np.int64).astype(np.int32)
    shifted = packing.add_to_word_array(words, addend)
    wrapped = [[(word + addend) % (1 << 32) for word in row] for row in words.tolist()]  # Python's integers
    assert shifted.dtype.name == "int32" and shifted.view("uint32").tolist() == wrapped
    values = packing.unpack_array(shifted, bits, axis)
    assert np.array_equal(packing.pack_array(values, bits, axis, np.int32), shifted)
    # both against Python's integers: value i of a word is (word >> i·bits) & mask, placed along `axis`
    per, mask = 32 // bits, (1 << bits) - 1
    slots = [[[(word >> (i * bits)) & mask for i in range(per)] for word in row] for row in wrapped]
    if axis == 1:
        by_integers = [[value for word in row for value in word] for row in slots]
    else:
        by_integers = [[slots[r][c][i] for c in range(columns)] for r in range(rows) for i in range(per)]
    assert values.dtype.name == "uint8" and values.tolist() == by_integers


@given(bits=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64),
       dtype=st.sampled_from(["float16", "bfloat16", "float32"]))
def test_the_numpy_float32_cast_rounds_as_torch_does(bits, dtype):
    """Any float32 bit pattern that is not a NaN (infinities, subnormals, ties, overflow) cast as torch's
    `.to()` casts it, bit for bit, in the dtype's stored form (BF16 as uint16 bit patterns); a NaN stays a
    NaN of its sign."""
    import numpy as np

    values = np.array(bits, dtype=np.uint32).view(np.float32)
    expected = torch.from_numpy(values.copy()).to(getattr(torch, dtype))
    if dtype == "bfloat16":
        expected = expected.view(torch.int16).numpy().view(np.uint16)
    else:
        expected = expected.numpy()
    found = packing.float32_cast(values, dtype)
    nan = np.isnan(values)
    assert found.dtype == expected.dtype
    assert found[~nan].view(np.uint8).tobytes() == expected[~nan].view(np.uint8).tobytes()
    back = packing.bf16_as_float32(found[nan]) if dtype == "bfloat16" else found[nan].astype(np.float32)
    assert np.isnan(back).all() and (np.signbit(back) == np.signbit(values[nan])).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_16_bit_value_comes_back_from_float32_exactly(dtype):
    """All 65,536 bit patterns, NaNs included: a scale stored as float32 (the int8 layouts) and cast back is
    the source's own bytes."""
    import numpy as np

    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    widened = packing.bf16_as_float32(patterns) if dtype == "bfloat16" else patterns.view(np.float16).astype(np.float32)
    assert packing.float32_cast(widened, dtype).view(np.uint16).tobytes() == patterns.tobytes()
