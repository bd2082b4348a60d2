"""Bit packing shared by every codec.

Values are packed LSB-first: value j of a container sits at bits [j·b, j·b + b). Containers are
int32 words (checkpoint formats) or uint8 bytes (kernel layouts). Values are moved with explicit
shifts on integers. The one place memory is reinterpreted is splitting words into bytes (and back)
along the innermost dimension, and only on a little-endian host, where a word's bytes in memory are
its bytes in order of significance: there a view is six times faster than four shifts, and gives
the same bytes (tests check both paths); elsewhere the shifts are used. Along the innermost dimension
the sub-byte values of one byte are spread to (or gathered from) adjacent bytes through an explicitly
little-endian word ('<u2', '<u4'), which numpy reads the same on any host. So the result never
depends on the host's byte order. All numpy: its uint8 kernels beat torch's on one thread
(docs/BENCHMARKS.md), and no codec needs torch. Only widths that divide the container are supported (2, 4, 8 bits);
3-bit GPTQ's split words are refused earlier, at plan time.
"""

from __future__ import annotations

import sys

import numpy as np

_LITTLE_ENDIAN = sys.byteorder == "little"

_CONTAINER_BITS = {"int32": 32, "uint8": 8}  # by dtype name


def values_per_container(bits: int, container: np.dtype | str) -> int:
    width = _CONTAINER_BITS[str(container)]
    if width % bits:
        raise ValueError(f"{bits}-bit values do not tile a {width}-bit container")
    return width // bits


def pack_array(values: np.ndarray, bits: int, axis: int, container: type | np.dtype) -> np.ndarray:
    """Pack uint8 `values` (< 2^bits) along `axis` into `container` (np.int32 words or np.uint8 bytes):
    value j of a container at bits [j·b, j·b + b)."""
    per = values_per_container(bits, np.dtype(container))
    axis = axis % values.ndim
    if values.shape[axis] % per:
        raise ValueError(f"cannot pack {values.shape[axis]} values into containers of {per}")
    packed = _pack_slots(values, bits, axis) if bits < 8 else np.ascontiguousarray(values)
    return _bytes_to_words(packed, axis) if np.dtype(container) == np.int32 else packed


def _slots(values: np.ndarray, axis: int, per: int) -> np.ndarray:
    """Split `axis` into (length / per, per)."""
    return values.reshape(values.shape[:axis] + (values.shape[axis] // per, per) + values.shape[axis + 1:])


def _pack_slots(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """uint8 values -> bytes along `axis`; every shift stays inside the byte."""
    per = 8 // bits
    if axis == values.ndim - 1:  # each byte's values are adjacent: read them as one little-endian word
        # Slot i's value sits at bits [8i, 8i + bits) of the word; a right shift by i·(8 - bits) puts it at
        # [i·bits, i·bits + bits), where a mask keeps it alone (every other slot's copy lands a multiple of 8
        # bits away), and the cast to uint8 drops the rest: the inverse of unpack_array's shifts.
        word = np.dtype(f"u{per}").type  # native, for the arithmetic
        words = np.ascontiguousarray(values).reshape(-1, per).view(_WORD_OF[per]).astype(word).reshape(
            values.shape[:-1] + (-1,))
        mask = (1 << bits) - 1
        packed = words & word(mask)
        for slot in range(1, per):
            shifted = words >> word(slot * (8 - bits))
            shifted &= word(mask << (slot * bits))
            packed |= shifted
        return packed.astype(np.uint8)
    grouped = _slots(values, axis, per)
    packed = np.take(grouped, 0, axis=axis + 1)  # a copy
    for slot in range(1, per):
        packed |= np.take(grouped, slot, axis=axis + 1) << np.uint8(slot * bits)
    return packed


# The little-endian word that holds one byte's `per` values as its bytes: byte i is the value of slot i.
_WORD_OF = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


def _bytes_to_words(packed_bytes: np.ndarray, axis: int, allow_view: bool = True) -> np.ndarray:
    """Bytes -> int32 words along `axis`, byte i at bits [8i, 8i + 8)."""
    if allow_view and _LITTLE_ENDIAN and axis == packed_bytes.ndim - 1:
        return np.ascontiguousarray(packed_bytes).view(np.int32)
    grouped = _slots(packed_bytes, axis, 4)
    words = np.take(grouped, 0, axis=axis + 1).astype(np.uint32)
    for i in range(1, 4):
        words |= np.take(grouped, i, axis=axis + 1).astype(np.uint32) << np.uint32(8 * i)
    return words.view(np.int32)


def unpack_array(packed: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Inverse of `pack_array`: int32 words (or uint8 bytes) -> uint8 codes, `axis` grown by the number of
    values per container. Words are split into bytes, then bytes into values with uint8 shifts, each slot
    written into its place of the result."""
    values_per_container(bits, packed.dtype)  # refuses widths that do not tile the container
    axis = axis % packed.ndim
    if packed.dtype == np.int32:
        packed = _word_array_bytes(packed, axis)
    if bits == 8:
        return np.ascontiguousarray(packed)
    data, per, mask = np.ascontiguousarray(packed), 8 // bits, np.uint8((1 << bits) - 1)
    shape = data.shape[:axis] + (data.shape[axis] * per,) + data.shape[axis + 1:]
    if axis == data.ndim - 1:  # each byte's values become adjacent bytes: one little-endian word a byte
        # Slot i moves to byte i, a left shift by i·(8 - bits); after all shifts are or-ed together one
        # mask keeps the low `bits` of each byte, where nothing but slot i's copy has landed (every copy's
        # slots sit on multiples of `bits`, and only slot i's reaches byte i's low bits).
        word = np.dtype(f"u{per}").type  # native, for the arithmetic
        wide = data.astype(word)
        words = wide << word(8 - bits)
        for slot in range(2, per):
            words |= wide << word(slot * (8 - bits))
        words |= wide
        words &= word(sum(int(mask) << (8 * slot) for slot in range(per)))
        return words.astype(_WORD_OF[per], copy=False).view(np.uint8).reshape(shape)
    values = np.empty(data.shape[:axis + 1] + (per,) + data.shape[axis + 1:], dtype=np.uint8)
    for slot in range(per):  # each slot's values are a contiguous plane of the result
        place = values[(slice(None),) * (axis + 1) + (slot,)]
        np.right_shift(data, np.uint8(slot * bits), out=place)
        np.bitwise_and(place, mask, out=place)
    return values.reshape(shape)


def _word_array_bytes(words: np.ndarray, axis: int, allow_view: bool = True) -> np.ndarray:
    """int32 words -> bytes along `axis`, least significant first (a view of the memory along the innermost
    axis on a little-endian host, else shifts)."""
    if allow_view and _LITTLE_ENDIAN and axis == words.ndim - 1:
        return np.ascontiguousarray(words).view(np.uint8)
    unsigned = words.view(np.uint32)
    split = np.stack([((unsigned >> np.uint32(8 * i)) & np.uint32(0xFF)).astype(np.uint8) for i in range(4)], axis + 1)
    return split.reshape(words.shape[:axis] + (words.shape[axis] * 4,) + words.shape[axis + 1:])


def add_to_word_array(words: np.ndarray, addend: int) -> np.ndarray:
    """int32 words + addend modulo 2^32 (carries cross slots, exactly as integer arithmetic does)."""
    total = (np.asarray(words).astype(np.int64) + addend) & 0xFFFFFFFF
    return total.astype(np.uint32).view(np.int32)


def repeated_word(value: int, bits: int) -> int:
    """The 32-bit word with `value` in every `bits`-wide slot (e.g. 1, 4 -> 0x11111111)."""
    word = 0
    for slot in range(32 // bits):
        word |= value << (slot * bits)
    return word


def int8_array_to_offset_codes(weight: np.ndarray) -> np.ndarray:
    """Signed int8 w -> uint8 codes w + 128: the two's-complement byte with its top bit flipped
    (a byte reinterpreted as a byte, so no byte-order question arises)."""
    return np.ascontiguousarray(weight).view(np.uint8) ^ np.uint8(0x80)


def offset_codes_to_int8(codes: np.ndarray) -> np.ndarray:
    """Inverse of `int8_array_to_offset_codes`."""
    return (np.ascontiguousarray(codes) ^ np.uint8(0x80)).view(np.int8)


def bf16_as_float32(bits: np.ndarray) -> np.ndarray:
    """BF16 bit patterns (uint16) as the float32 values they are, exactly (BF16 is float32's top half)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def as_float32(values: np.ndarray) -> np.ndarray:
    """Floating-point values in the stored form (BF16 as its uint16 bit patterns, float16, float32) as the
    float32 values they are, exactly."""
    return bf16_as_float32(values) if values.dtype == np.uint16 else values.astype(np.float32, copy=False)


def float32_cast(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 `values` cast to torch's `dtype` (float16, bfloat16 or float32), in that dtype's stored form
    (BF16 as uint16 bit patterns): finite values and infinities rounded to nearest even, bit for bit as
    torch's `.to()` rounds them (BF16 on the bits, float16 by numpy's own cast). A NaN stays a NaN of its sign
    with the payload bits the dtype holds, so that every value of the dtype comes back exactly (torch's NaN
    bits differ between its vectorized and scalar paths: 0xFFFF and 0x7FC0 for BF16 on the dev machine)."""
    values = np.asarray(values, dtype=np.float32)
    if dtype == "float32":
        return values
    if dtype == "float16":
        with np.errstate(over="ignore", invalid="ignore"):
            return values.astype(np.float16)
    if dtype != "bfloat16":
        raise ValueError(f"no cast to {dtype}")
    bits = values.view(np.uint32)
    top = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():  # the top half, made quiet where its payload bits would all be zero (an infinity)
        kept = (bits[nan] >> np.uint32(16)).astype(np.uint16)
        top[nan] = np.where(kept & np.uint16(0x7F), kept, kept | np.uint16(0x40))
    return top
