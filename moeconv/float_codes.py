"""The canonical float form: E2M1 (FP4) codes with their block scales as bytes, in numpy.

MXFP4 and NVFP4 weights are no integer-affine code, so they do not go through `canonical.QuantizedWeight`:
a `FloatWeight` holds one linear's E2M1 codes (one code an element), the scale byte of each block, and the
scheme that says how the bytes read (docs/FLOAT_SOURCES.md has each producer's layout and arithmetic):

- MXFP4: blocks of 32 along K, a UE8M0 scale byte b = 2^(b - 127) each (0xFF is reserved: NaN).
- NVFP4: blocks of 16, an E4M3 scale byte each (S.1111.111 is NaN), and one float32 global scale a linear,
  in its producer's convention: compressed-tensors' `weight_global_scale` g is divided by (W = c · s / g),
  ModelOpt's `weight_scale_2` s2 multiplied by (W = c · s · s2). For the same weights g = 1 / s2. A W4A4
  checkpoint also stores the static input global scale of each linear, in the same convention.

Every byte is kept as stored, so the form is lossless for both schemes and both conventions; equality
(`FloatWeight.mismatch`) is bit for bit on codes and scale bytes, and on the global scales as the reals
they stand for (a divided g equals a multiplied s2 exactly when g · s2 = 1, computed exactly in float64).
Changing convention (`in_convention`) is exact only where the float32 reciprocal is (a power of two);
anything else is refused with the reason, never rounded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from moeconv.packing import pack_array, unpack_array

UE8M0, E4M3 = "ue8m0", "e4m3"  # the block scale's encoding
DIVIDE, MULTIPLY = "divide", "multiply"  # the global scale's convention (compressed-tensors, ModelOpt)
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
UE8M0_NAN = 0xFF
E4M3_NAN_MAGNITUDE = 0x7F  # S.1111.111; E4M3FN has no infinity
SCALE_DTYPES = {UE8M0: "U8", E4M3: "F8_E4M3"}  # the safetensors dtype each encoding is stored in


@dataclass(frozen=True)
class FloatScheme:
    """How one linear's float codes read: the block along K, the scale encoding, and the global scale's
    convention (None: the scheme has none, MXFP4); `input_scale`: each linear stores the static global scale
    of its input activations (NVFP4 W4A4), in the same convention."""

    name: str  # "mxfp4" or "nvfp4"
    block: int
    scale_encoding: str
    global_convention: str | None
    input_scale: bool = False

    @property
    def scale_dtype(self) -> str:
        return SCALE_DTYPES[self.scale_encoding]

    def in_convention(self, convention: str) -> FloatScheme:
        return self if self.global_convention is None else replace(self, global_convention=convention)

    def describe(self) -> str:
        globals_ = {None: "", DIVIDE: ", global scale divided by", MULTIPLY: ", global scale multiplied by"}
        inputs = ", static input global scale" if self.input_scale else ""
        return (f"{self.name}: E2M1 codes, one {self.scale_encoding.upper()} scale per {self.block}"
                f"{globals_[self.global_convention]}{inputs}")


MXFP4 = FloatScheme("mxfp4", 32, UE8M0, None)


def nvfp4(convention: str, input_scale: bool) -> FloatScheme:
    return FloatScheme("nvfp4", 16, E4M3, convention, input_scale)


@dataclass(frozen=True, eq=False)
class FloatWeight:
    """One float-coded linear, W[n, k] = E2M1(codes[n, k]) · scale(scales[n, k // block]) · global.

    packed: uint8 (N, K/2), the codes two a byte as every producer stores them (`unpack_codes`), kept so: a
    layout that stores them so copies them, and two weights compare byte for byte, without unpacking; `codes`
    (N, K), one a byte, is unpacked when first asked for. scales: uint8 (N, K / block), the scale bytes.
    global_scale and input_scale: float32 0-d arrays as stored (the scheme says which it has and how they
    read), else None."""

    packed: np.ndarray
    scales: np.ndarray
    scheme: FloatScheme
    global_scale: np.ndarray | None = None
    input_scale: np.ndarray | None = None

    def __post_init__(self) -> None:
        n, k = self.packed.shape[0], self.packed.shape[1] * 2
        assert self.packed.dtype == np.uint8 and self.scales.dtype == np.uint8, (self.packed.dtype, self.scales.dtype)
        assert k % self.scheme.block == 0 and self.scales.shape == (n, k // self.scheme.block), (
            self.scales.shape, n, k, self.scheme.block)
        assert (self.global_scale is None) == (self.scheme.global_convention is None), self.scheme
        assert (self.input_scale is None) != self.scheme.input_scale, self.scheme
        for value in (self.global_scale, self.input_scale):
            assert value is None or (value.dtype == np.float32 and value.shape == ()), value

    @classmethod
    def from_codes(cls, codes: np.ndarray, scales: np.ndarray, scheme: FloatScheme,
                   global_scale: np.ndarray | None = None, input_scale: np.ndarray | None = None) -> FloatWeight:
        """From (N, K) codes one a byte, each < 16."""
        return cls(pack_codes(codes), scales, scheme, global_scale, input_scale)

    @cached_property
    def codes(self) -> np.ndarray:
        return unpack_codes(self.packed)

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * 2

    def dequantize(self) -> np.ndarray:
        """The (N, K) weight as float64: exact for MXFP4 and a multiplied global scale (every product fits
        in 53 bits), a divided one rounded once. For checks; no producer's own rounding."""
        values = E2M1_VALUES[self.codes] * np.repeat(scale_values(self.scales, self.scheme.scale_encoding),
                                                     self.scheme.block, axis=1)
        if self.scheme.global_convention == DIVIDE:
            return values / np.float64(self.global_scale)
        if self.scheme.global_convention == MULTIPLY:
            return values * np.float64(self.global_scale)
        return values

    def in_convention(self, convention: str) -> FloatWeight:
        """The same weight with its global scales in `convention`, exactly; ValueError (the reason) where a
        reciprocal is not a float32."""
        if self.scheme.global_convention in (None, convention):
            return self
        scales = {}
        for field in ("global_scale", "input_scale"):
            value = getattr(self, field)
            if value is not None:
                inverse = exact_reciprocal(value)
                if inverse is None:
                    raise ValueError(f"{field} {float(value)!r} has no exact float32 reciprocal, so its value "
                                     f"cannot be written {convention}d by without changing the weights")
                scales[field] = inverse
        return replace(self, scheme=self.scheme.in_convention(convention), **scales)

    def mismatch(self, other: object) -> str | None:
        """None if `other` holds the same codes and scale bytes and the same global scales as reals, else
        the first difference."""
        if not isinstance(other, FloatWeight):
            return f"float codes compared with {type(other).__name__}"
        mine, theirs = self.scheme, other.scheme
        if (mine.name, mine.block, mine.scale_encoding, mine.input_scale) != (
                theirs.name, theirs.block, theirs.scale_encoding, theirs.input_scale):
            return f"scheme {mine.describe()} != {theirs.describe()}"
        for field, a, b in (("codes", self.packed, other.packed), ("scales", self.scales, other.scales)):
            if a.shape != b.shape:
                return f"{field}: {list(a.shape)} != {list(b.shape)} bytes"
            if not np.array_equal(a, b):
                return f"{field}: {int(np.count_nonzero(a != b))} byte(s) differ"
        for field in ("global_scale", "input_scale"):
            a, b = getattr(self, field), getattr(other, field)
            if a is not None and not same_real(a, mine.global_convention, b, theirs.global_convention):
                return f"{field}: {float(a)!r} ({mine.global_convention}) != {float(b)!r} ({theirs.global_convention})"
        return None


def unpack_codes(packed: np.ndarray) -> np.ndarray:
    """(N, K/2) bytes -> (N, K) uint8 codes: element 2j in the low nibble of byte j, 2j + 1 in the high one (every
    producer's order)."""
    return unpack_array(packed, 4, -1)


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """Inverse of `unpack_codes`: (N, K) codes < 16 -> (N, K/2) bytes."""
    return pack_array(codes, 4, -1, np.uint8)


def scale_values(scales: np.ndarray, encoding: str) -> np.ndarray:
    """Scale bytes -> their exact values (float64); the reserved bytes read as NaN."""
    b = scales.astype(np.int64)
    if encoding == UE8M0:
        return np.where(b == UE8M0_NAN, np.nan, np.ldexp(1.0, b - 127))
    exponent, mantissa = (b >> 3) & 0xF, b & 0x7
    magnitude = np.where(exponent == 0, np.ldexp(mantissa / 8, -6), np.ldexp(1 + mantissa / 8, exponent - 7))
    magnitude = np.where((b & 0x7F) == E4M3_NAN_MAGNITUDE, np.nan, magnitude)
    return np.where(b & 0x80, -magnitude, magnitude)


def scale_refusal(scales: np.ndarray, encoding: str) -> str | None:
    """Why these scale bytes cannot be read: a byte the encoding reserves for NaN (UE8M0 0xFF, E4M3
    S.1111.111), which every weight of its block would decode to; None if there is none."""
    reserved = scales == UE8M0_NAN if encoding == UE8M0 else (scales & 0x7F) == E4M3_NAN_MAGNITUDE
    if not reserved.any():
        return None
    first = tuple(int(i) for i in np.argwhere(reserved)[0])
    byte = int(scales[first])
    return (f"holds {int(reserved.sum())} scale byte(s) that {encoding.upper()} reserves for NaN (0x{byte:02X} at "
            f"{list(first)}): every weight of such a block would decode to NaN")


def global_refusal(value: np.ndarray) -> str | None:
    """Why a global scale cannot be read: zero (a divided one is a division by zero, a multiplied one zeroes
    the linear) or not finite; None if it is a finite non-zero float32."""
    number = float(value)
    if not np.isfinite(number):
        return f"is {number!r}: not a finite number"
    if number == 0:
        return "is 0: every weight of the linear would be 0 or infinite"
    return None


def exact_reciprocal(value: np.ndarray) -> np.ndarray | None:
    """1 / value as a float32 0-d array when that is exactly a float32 (value a power of two, its reciprocal
    in range), else None. The product of two float32 is exact in float64, so the test is exact."""
    with np.errstate(over="ignore"):  # a reciprocal past float32's range is refused below, not warned about
        inverse = np.float32(1.0 / np.float64(value))
    if not np.isfinite(inverse) or np.float64(inverse) * np.float64(value) != 1.0:
        return None
    return np.array(inverse, dtype=np.float32)


def same_real(a: np.ndarray, a_convention: str | None, b: np.ndarray, b_convention: str | None) -> bool:
    """Whether two global scales stand for the same factor: the same bits in one convention, reciprocal
    reals (a · b = 1 exactly) across the two."""
    if a_convention == b_convention:
        return a.tobytes() == b.tobytes()
    return np.float64(a) * np.float64(b) == 1.0
