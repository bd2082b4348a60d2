import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moeconv import packing


@given(bits=st.sampled_from([2, 4, 8]), container=st.sampled_from([torch.int32, torch.uint8]),
       rows=st.integers(1, 5), words=st.integers(1, 6), dim=st.sampled_from([0, 1]), seed=st.integers(0, 2**31))
def test_pack_unpack_round_trip(bits, container, rows, words, dim, seed):
    per = (32 if container is torch.int32 else 8) // bits
    shape = [rows, rows]
    shape[dim] = words * per
    codes = torch.randint(0, 1 << bits, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    packed = packing.pack(codes, bits, dim, container)
    assert packed.dtype == container
    assert packed.shape[dim] == words
    assert torch.equal(packing.unpack(packed, bits, dim), codes)


def test_int32_words_match_lsb_first_arithmetic():
    """Value j of a word sits at bits [4j, 4j+4): computed here with Python integers."""
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15], [15, 15, 15, 15, 15, 15, 15, 15]], dtype=torch.uint8)
    words = packing.pack(codes, 4, dim=1, container=torch.int32)
    assert words.tolist() == [[0xF7654321 - (1 << 32)], [-1]]
    assert torch.equal(packing.unpack(words, 4, dim=1), codes)


def test_uint8_bytes_even_value_in_low_nibble():
    codes = torch.tensor([[0x3, 0xA, 0xF, 0x0]], dtype=torch.uint8)
    assert packing.pack(codes, 4, dim=1, container=torch.uint8).tolist() == [[0xA3, 0x0F]]


def test_eight_bit_words_hold_bytes_in_order():
    codes = torch.tensor([[0x01, 0x80, 0xFF, 0x7F]], dtype=torch.uint8)
    assert packing.pack(codes, 8, dim=1, container=torch.int32).tolist() == [[0x7FFF8001]]


def test_add_to_words_borrows_across_slots():
    # 0x76543210 - 0x11111111 = 0x654320FF: nibble 0 (0 - 1) borrows from nibble 1, which then
    # borrows from nibble 2 (1 - 1 - 1): a per-nibble "+1" reader would see zeros 16, 15, 2, ...
    words = torch.tensor([0x76543210], dtype=torch.int32)
    assert packing.add_to_words(words, -0x11111111).tolist() == [0x654320FF]
    assert packing.add_to_words(torch.tensor([0x654320FF], dtype=torch.int32), 0x11111111).tolist() == [0x76543210]
    # Wrapping past 2^32 in both directions.
    assert packing.add_to_words(torch.tensor([0], dtype=torch.int32), -0x11111111).tolist() == [0xEEEEEEEF - (1 << 32)]


def test_repeated_word():
    assert packing.repeated_word(1, 4) == 0x11111111
    assert packing.repeated_word(1, 8) == 0x01010101
    assert packing.repeated_word(1, 2) == 0x55555555


def test_refuses_widths_that_do_not_tile():
    with pytest.raises(ValueError):
        packing.pack(torch.zeros(1, 32, dtype=torch.uint8), 3, dim=1, container=torch.int32)


@given(shape=st.tuples(st.integers(1, 4), st.integers(1, 6)), seed=st.integers(0, 2**31))
def test_byte_split_view_equals_the_shifts(shape, seed):
    """On little-endian hosts words are split into bytes with a view; it must equal the shifts."""
    words = torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, generator=torch.Generator().manual_seed(seed))
    by_shifts = packing.words_to_bytes(words, 1, allow_view=False)
    assert torch.equal(packing.words_to_bytes(words, 1), by_shifts)
    assert torch.equal(packing._bytes_to_words(by_shifts, 1, allow_view=False), words)
    assert torch.equal(packing._bytes_to_words(by_shifts, 1), words)



@given(bits=st.sampled_from([2, 4, 8]), rows=st.integers(1, 5), columns=st.integers(1, 6), axis=st.sampled_from([0, 1]),
       addend=st.sampled_from([0, 0x11111111, 0x01010101, -0x11111111]), seed=st.integers(0, 2**31))
def test_the_numpy_unpack_of_words_is_pythons_integer_arithmetic(bits, rows, columns, axis, addend, seed):
    """What the parent's detection and verify's workers read without torch (unpack_array, add_to_word_array)
    against Python's integer arithmetic, on any int32 words (sign bit and borrows included), along the
    innermost axis (a view of the words' bytes) and the other (shifts); the torch unpack gives the same."""
    words = torch.randint(-2**31, 2**31, (rows, columns), dtype=torch.int64,
                          generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    shifted = packing.add_to_word_array(words.numpy(), addend)
    wrapped = [[(word + addend) % (1 << 32) for word in row] for row in words.tolist()]  # Python's integers
    assert shifted.dtype.name == "int32" and shifted.view("uint32").tolist() == wrapped
    assert torch.equal(packing.add_to_words(words, addend), torch.from_numpy(shifted))
    values = packing.unpack_array(shifted, bits, axis)
    assert torch.equal(packing.unpack(torch.from_numpy(shifted), bits, axis), torch.from_numpy(values))
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
