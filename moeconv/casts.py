"""Casts between float codes: which blocks of a target are exact, decided from the source's bytes before
anything is written (issue 41, first step: the census; no cast is written yet). numpy only.

Every source value is E2M1(code) · scale (· global): a dyadic rational odd · 2^e (or zero, or not dyadic when
an NVFP4 global scale is divided by and its odd part does not divide). A value is representable in a float
format with M mantissa bits, smallest normal exponent emin and largest finite value `top` iff

    e >= max(e_hi - M, emin - M)  and  odd · 2^e <= top,      e_hi = e + bitlength(odd) - 1

(its lowest set bit is within M bits of its highest, or on the subnormal grid), which this module evaluates
with integers, never by rounding. A target block is exact iff every value in it is representable after the
block's scale; a block holding a reserved scale byte (UE8M0 0xFF, E4M3 S.1111.111) never is. Targets:

- `fp8-block` (MXFP4 sources): E4M3 codes and one float32 scale per 128 x 128 weight block (`weight` F8_E4M3
  times `weight_scale_inv` F32, as vLLM's and SGLang's block-FP8 MoE kernels load). The scale is the power of
  two 2^t with t the smallest that overflows no value (for E2M1 codes: the block's largest exponent minus 8,
  so 6 · 2^x lands on 384). Each value allows an interval of t (overflow bounds it below, the subnormal grid
  above), so the block is exact under some power of two iff it is under the smallest: this choice loses no
  exact block. A float32 scale that is not a power of two (3 · 2^j is the only other whose quotients of E2M1
  values are dyadic) helps only blocks whose every non-zero code is 1.5, 3 or 6, by one binade; not taken.
- `nvfp4` (MXFP4 sources): the same E2M1 codes, an E4M3 scale per 16 (each 32-block's two halves) equal to
  2^(b - 127) / G, and one global scale G = 2^γ per linear (written 1 / G, divided by, in compressed-tensors'
  convention; both are float32 for |γ| <= 126). A group is exact iff its codes are all zero or 2^(b - 127 - γ)
  is an E4M3 value (2^-9 .. 2^8); γ is chosen per linear to make the most groups exact (a window of 18
  binades over the scale bytes), aligned to the largest scale byte when that costs nothing. Re-coding a
  group (halving its codes to double its scale) could rescue a few more groups; not done.
- `bf16` (MXFP4 or NVFP4 sources), per source block: exact iff no value over- or underflows bfloat16 (and,
  for an NVFP4 global scale that is not a power of two, every value is still a bfloat16: 8 significant bits).

The worst relative error of the inexact blocks is what the cast would give, computed by rounding each value
to the target in float64, round-to-nearest-even (`round_to`): fp8-block divides by the block's 2^t; nvfp4
writes the nearest E4M3 scale, clamped to 2^-9 .. 448, and rounds each value to the nearest E2M1 code of it
(saturating at 6); bf16 overflows to infinity (an infinite error). docs/FORMAT.md ("Casts between float
codes") states the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from moeconv.float_codes import (DIVIDE, E2M1_VALUES, E4M3, E4M3_NAN_MAGNITUDE, UE8M0, UE8M0_NAN, FloatWeight,
                                 pack_codes, scale_values, unpack_codes)


class FloatFormat(NamedTuple):
    """A sign-magnitude binary float format: mantissa bits, smallest normal exponent, largest finite value."""

    name: str
    mantissa: int
    emin: int
    top: float


E2M1_FORMAT = FloatFormat("E2M1", 1, 0, 6.0)
E4M3_FORMAT = FloatFormat("E4M3", 3, -6, 448.0)  # E4M3FN: no infinity, S.1111.111 is NaN
BF16_FORMAT = FloatFormat("BF16", 7, -126, float(np.ldexp(255, 120)))  # 0x7F7F = (2 - 2^-7) · 2^127

FP8_BLOCK, NVFP4, BF16 = "fp8-block", "nvfp4", "bf16"
FP8_BLOCK_SHAPE = (128, 128)  # vLLM's / SGLang's block-FP8 MoE weight blocks (out, in)
NVFP4_GROUP = 16
NVFP4_SCALE_RANGE = (-9, 8)  # the powers of two E4M3 holds: 2^-9 (smallest subnormal) .. 2^8
GLOBAL_EXPONENTS = (-126, 126)  # G = 2^γ and 1 / G both float32 normals
TARGETS = {"mxfp4": (FP8_BLOCK, NVFP4, BF16), "nvfp4": (BF16,)}  # source scheme -> the casts this module decides
LABELS = {FP8_BLOCK: "FP8-block", NVFP4: "NVFP4", BF16: "BF16"}

# E2M1 magnitude (code & 7: 0, 0.5, 1, 1.5, 2, 3, 4, 6) as odd · 2^e; zero has odd 0
_E2M1_ODD = np.array([0, 1, 1, 3, 1, 3, 1, 3], dtype=np.int64)
_E2M1_EXP = np.array([0, -1, 0, -1, 1, 0, 2, 1], dtype=np.int64)


@dataclass(frozen=True)
class Census:
    """One linear's census for one target: `blocks` target blocks, `exact` of them exact, `reserved` of the
    others holding a reserved scale byte; `worst_relative_error` over the inexact blocks without one (0.0 if
    there are none; inf where a value overflows the target); `scale_exponent` the global scale's γ (nvfp4)."""

    target: str
    blocks: int
    exact: int
    reserved: int
    worst_relative_error: float
    scale_exponent: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target, "blocks": self.blocks, "exact": self.exact, "reserved": self.reserved,
                "worst_relative_error": json_float(self.worst_relative_error),
                **({} if self.scale_exponent is None else {"global_scale": f"2^{self.scale_exponent}"})}


def json_float(value: float) -> float | str:
    """A float for JSON: inf as the string "inf" (JSON has no infinity)."""
    return value if np.isfinite(value) else str(value)


def targets_of(weight: FloatWeight) -> tuple[str, ...]:
    return TARGETS[weight.scheme.name]


def census(weight: FloatWeight, target: str, exponent: int | None = None) -> Census:
    """Count `weight`'s exact target blocks (`exact_blocks`) and the worst relative error of the others
    (`exponent`: nvfp4's γ where linears share it, `shared_exponents`; None: the linear's own)."""
    exact, reserved, errors, exponent = _blocks(weight, target, exponent)
    inexact = ~exact & ~reserved
    worst = float(errors[inexact].max()) if inexact.any() else 0.0
    return Census(target, int(exact.size), int(exact.sum()), int(reserved.sum()), worst, exponent)


def exact_blocks(weight: FloatWeight, target: str, exponent: int | None = None) -> np.ndarray:
    """The exactness predicate: a bool array, one per target block (fp8-block: (ceil(N/128), ceil(K/128));
    nvfp4: (N, K/16); bf16: the source's blocks, (N, K/block)), decided from the bytes alone."""
    return _blocks(weight, target, exponent)[0]


def representable(odd: np.ndarray, exponent: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """Whether each odd · 2^exponent (odd >= 0; 0 is zero, always representable; -1 marks a value that is
    not dyadic, never representable) is a value of `fmt`. Integer arithmetic but for the comparison with
    the largest value, which is exact in float64 for these magnitudes."""
    nonzero = odd > 0
    bits = np.frexp(np.where(nonzero, odd, 1).astype(np.float64))[1].astype(np.int64)  # bit length
    high = exponent + bits - 1
    fits = exponent >= np.maximum(high - fmt.mantissa, fmt.emin - fmt.mantissa)
    with np.errstate(over="ignore"):
        in_range = np.ldexp(np.where(nonzero, odd, 0).astype(np.float64), exponent.astype(np.int64)) <= fmt.top
    return (odd == 0) | (nonzero & fits & in_range)


def round_to(values: np.ndarray, fmt: FloatFormat, saturate: bool) -> np.ndarray:
    """float64 values rounded to `fmt`, round-to-nearest-even; past the largest value: the largest (saturate)
    or infinity."""
    magnitude = np.abs(values)
    exponent = np.frexp(np.where(magnitude > 0, magnitude, 1.0))[1] - 1  # floor(log2 |x|)
    quantum = np.maximum(exponent, fmt.emin) - fmt.mantissa
    rounded = np.ldexp(np.round(np.ldexp(values, -quantum)), quantum)  # np.round: halves to even
    past = np.abs(rounded) > fmt.top
    return np.where(past, np.copysign(fmt.top if saturate else np.inf, values), rounded)


def relative_errors(values: np.ndarray, rounded: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        errors = np.abs(rounded - values) / np.abs(values)
    return np.where(values == 0, np.where(rounded == 0, 0.0, np.inf), errors)


# ---- the values as odd · 2^e ------------------------------------------------------------------------------

def _dyadic_scalar(value: float) -> tuple[int, int]:
    """A finite non-zero float as (odd, e) with |value| = odd · 2^e."""
    if value == 0 or not np.isfinite(value):
        raise ValueError(f"a global scale of {value!r} has no value set to decide (float_codes.global_refusal)")
    mantissa, exponent = np.frexp(abs(value))
    odd, e = int(np.ldexp(mantissa, 53)), int(exponent) - 53
    while odd % 2 == 0:
        odd, e = odd // 2, e + 1
    return odd, e


def _scale_dyadic(scales: np.ndarray, encoding: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scale bytes as (odd, e, reserved): UE8M0 b = 1 · 2^(b-127); E4M3 by its bits (zero: odd 0)."""
    b = scales.astype(np.int64)
    if encoding == UE8M0:
        return np.ones_like(b), b - 127, b == UE8M0_NAN
    assert encoding == E4M3, encoding
    field, mantissa = (b >> 3) & 0xF, b & 0x7
    odd = np.where(field > 0, 8 + mantissa, mantissa)
    exponent = np.where(field > 0, field, 1) - 10  # (8 + m) · 2^(E - 10), subnormal m · 2^-9
    for _ in range(3):  # strip the trailing zero bits (at most 3 of a 4-bit integer)
        even = (odd > 0) & (odd % 2 == 0)
        odd, exponent = np.where(even, odd // 2, odd), np.where(even, exponent + 1, exponent)
    return odd, exponent, (b & 0x7F) == E4M3_NAN_MAGNITUDE


def _pair_dyadic(weight: FloatWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """|E2M1(code) · scale(byte) (· global)| as odd · 2^e for every scale byte and code magnitude ((256, 8)
    int64 each, indexed [byte, code & 7]; odd -1: not dyadic), and whether the byte is reserved. Every
    property of a value is a lookup in a table of these 2048 pairs."""
    scheme = weight.scheme
    scale_odd, scale_exp, reserved = _scale_dyadic(np.arange(256, dtype=np.uint8), scheme.scale_encoding)
    odd = scale_odd[:, None] * _E2M1_ODD[None, :]
    exponent = scale_exp[:, None] + _E2M1_EXP[None, :]
    if weight.global_scale is not None:
        global_odd, global_exp = _dyadic_scalar(float(weight.global_scale))
        if scheme.global_convention == DIVIDE:
            divides = odd % global_odd == 0
            odd = np.where(divides, odd // global_odd, -1)
            exponent = exponent - global_exp
        else:
            odd, exponent = odd * global_odd, exponent + global_exp
    return odd, exponent, np.broadcast_to(reserved[:, None], odd.shape)


def _present(weight: FloatWeight) -> np.ndarray:
    """(N, K / block) uint8: bit m set iff some code of the block has magnitude m (code & 7)."""
    n, k = weight.codes.shape
    block = weight.scheme.block
    return np.bitwise_or.reduce((np.uint8(1) << (weight.codes & 7)).reshape(n, k // block, block), axis=2)


def _per_block(array: np.ndarray, block: int, reduce) -> np.ndarray:
    """(N, K) -> (N, K / block), reduced along each source block."""
    n, k = array.shape
    return reduce(array.reshape(n, k // block, block), axis=2)


# ---- per target ---------------------------------------------------------------------------------------

def _blocks(weight: FloatWeight, target: str,
            exponent: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, int | None]:
    """(exact, reserved, worst relative error: 0 for exact blocks) per target block, and the global scale's
    exponent (nvfp4)."""
    if target not in targets_of(weight):
        raise ValueError(f"no {target} cast of {weight.scheme.name} codes is decided here (from "
                         f"{weight.scheme.name}: {', '.join(targets_of(weight))})")
    if target == FP8_BLOCK:
        return (*_fp8_block(weight), None)
    if target == NVFP4:
        return _nvfp4(weight, exponent)
    return (*_bf16(weight), None)


def _tiles(array: np.ndarray, shape: tuple[int, int], fill: Any) -> np.ndarray:
    """(N, M) -> (ceil(N/a), ceil(M/b), a · b), the last tiles padded with `fill`."""
    (n, k), (a, b) = array.shape, shape
    rows, cols = -(-n // a), -(-k // b)
    padded = np.full((rows * a, cols * b), fill, dtype=array.dtype)
    padded[:n, :k] = array
    return padded.reshape(rows, a, cols, b).transpose(0, 2, 1, 3).reshape(rows, cols, a * b)


def _spread(tiles: np.ndarray, shape: tuple[int, int], like: np.ndarray) -> np.ndarray:
    """A per-tile array back to `like`'s (N, K) elements."""
    return np.repeat(np.repeat(tiles, shape[0], axis=0), shape[1], axis=1)[:like.shape[0], :like.shape[1]]


_LOWEST, _HIGHEST = np.iinfo(np.int32).min, np.iinfo(np.int32).max


def _fp8_shift(weight: FloatWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per 128 x 128 tile: the scale's exponent t (the smallest that overflows no value; 0 for an all-zero
    tile), the lowest set bit's exponent of any value, whether every value's bits fit E4M3's mantissa, and
    whether the tile holds a reserved scale byte."""
    odd, exponent, reserved = _pair_dyadic(weight)
    nonzero = (odd > 0) & ~reserved
    bits = np.frexp(np.where(nonzero, odd, 1).astype(np.float64))[1].astype(np.int64)
    high = exponent + bits - 1
    leading = np.ldexp(np.where(nonzero, odd, 1).astype(np.float64), 1 - bits)  # odd as 1.xxx
    # the smallest t with odd · 2^(e - t) <= 448 (the largest value's exponent minus 8, one more past 1.75),
    # the lowest set bit's exponent (E4M3's grid reaches 2^(t - 9)), and whether the bits fit E4M3's mantissa
    floor_table = np.where(nonzero, high - 8 + (leading > 1.75), _LOWEST).astype(np.int32).ravel()
    low_table = np.where(nonzero, exponent, _HIGHEST).astype(np.int32).ravel()
    fits_table = (~nonzero | (exponent >= high - E4M3_FORMAT.mantissa)).ravel()
    # A UE8M0 byte b adds b - 127 to every exponent of its block (no global scale: fp8-block casts MXFP4 only), so
    # a block's largest floor and smallest low bit are its byte's offset plus those of the codes present in it:
    # one mask of the magnitudes present per block (an OR over the block), looked up in tables over the 256 masks.
    assert weight.scheme.scale_encoding == UE8M0 and weight.global_scale is None, weight.scheme
    block = weight.scheme.block
    row = 127 * 8  # the pairs of byte 127 (scale 1): codes 0 .. 7
    masks = np.arange(256)[:, None] >> np.arange(8)[None, :] & 1 == 1  # (mask, magnitude): present
    mask_floor = np.where(masks, floor_table[row:row + 8], _LOWEST).max(axis=1)
    mask_low = np.where(masks, low_table[row:row + 8], _HIGHEST).min(axis=1)
    mask_fits = np.where(masks, fits_table[row:row + 8], True).all(axis=1)
    present = _present(weight)
    offset = weight.scales.astype(np.int64) - 127
    usable = weight.scales != UE8M0_NAN
    floor = np.where(usable & (mask_floor[present] != _LOWEST), mask_floor[present] + offset, _LOWEST)
    lowest = np.where(usable & (mask_low[present] != _HIGHEST), mask_low[present] + offset, _HIGHEST)
    per_row = (FP8_BLOCK_SHAPE[0], FP8_BLOCK_SHAPE[1] // block)  # a tile in source blocks
    shift = _tiles(floor, per_row, _LOWEST).max(axis=2)
    shift = np.where(shift == _LOWEST, 0, shift)  # an all-zero block: scale 1
    low = _tiles(lowest, per_row, _HIGHEST).min(axis=2)
    fits = _tiles(mask_fits[present] | ~usable, per_row, True).all(axis=2)
    blocked = _tiles(weight.scales == UE8M0_NAN, per_row, False).any(axis=2)
    return shift, low, fits, blocked


def _fp8_block(weight: FloatWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    fmt = E4M3_FORMAT
    shift, low, fits, blocked = _fp8_shift(weight)
    exact = ~blocked & fits & ((low == _HIGHEST) | (low.astype(np.int64) - shift >= fmt.emin - fmt.mantissa))
    errors = np.zeros(exact.shape)
    inexact = ~exact & ~blocked
    if inexact.any():  # the cast's rounding, on the elements of the inexact blocks only
        where = _spread(inexact, FP8_BLOCK_SHAPE, weight.codes)
        element_shift = _spread(shift, FP8_BLOCK_SHAPE, weight.codes)[where]
        values = weight.dequantize()[where]
        rounded = np.ldexp(round_to(np.ldexp(values, -element_shift), fmt, saturate=True), element_shift)
        element_errors = np.zeros(weight.codes.shape)
        element_errors[where] = relative_errors(values, rounded)
        errors = _tiles(element_errors, FP8_BLOCK_SHAPE, 0.0).max(axis=2)
    return exact, blocked, errors


def _bf16(weight: FloatWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    odd, exponent, reserved = _pair_dyadic(weight)
    table = representable(odd, exponent, BF16_FORMAT) & ~reserved  # (byte, magnitude)
    block = weight.scheme.block
    # a block is exact iff every magnitude present in it is representable under its byte: one mask of the
    # magnitudes present per block (an OR over the block), looked up in a table over (byte, mask)
    masks = np.arange(256)[:, None] >> np.arange(8)[None, :] & 1 == 1  # (mask, magnitude): present
    by_mask = (table[:, None, :] | ~masks[None, :, :]).all(axis=2) & ~reserved[:, :1]  # (byte, mask)
    exact = by_mask[weight.scales, _present(weight)]
    blocked = _scale_dyadic(weight.scales, weight.scheme.scale_encoding)[2]
    errors = np.zeros(exact.shape)
    inexact = ~exact & ~blocked
    if inexact.any():
        where = np.repeat(inexact, block, axis=1)
        with np.errstate(over="ignore"):
            values = weight.dequantize()[where]
            element_errors = np.zeros(weight.codes.shape)
            element_errors[where] = relative_errors(values, round_to(values, BF16_FORMAT, saturate=False))
        errors = _per_block(element_errors, block, np.max)
    return exact, blocked, errors


def _nvfp4_groups(weight: FloatWeight,
                  exponent: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Per 16-group: its UE8M0 byte b, whether its codes are all zero, whether b is reserved; and γ (`exponent`,
    or the linear's own choice)."""
    assert weight.scheme.scale_encoding == UE8M0 and weight.scheme.block % NVFP4_GROUP == 0, weight.scheme
    b = np.repeat(weight.scales, weight.scheme.block // NVFP4_GROUP, axis=1)  # (N, K/16): each group's byte
    zero = _per_block(weight.codes & 7 == 0, NVFP4_GROUP, np.all)
    reserved = b == UE8M0_NAN
    if exponent is None:
        exponent = choose_global_exponent(b[~zero & ~reserved])
    return b, zero, reserved, exponent


def global_bytes(weight: FloatWeight) -> np.ndarray:
    """The UE8M0 bytes of the groups of 16 an nvfp4 cast's global scale is chosen over (not all-zero, not
    reserved)."""
    b, zero, reserved, _ = _nvfp4_groups(weight, 0)
    return b[~zero & ~reserved]


# The linears an engine fuses into one and reads one global scale for: an expert's gate and up (vLLM's NVFP4 MoE
# method takes gate's for both, `CompressedTensorsW4A4Nvfp4MoEMethod.process_weights_after_loading`).
FUSED = (("gate", "up"),)
# The dense linears vLLM fuses (QKVParallelLinear, MergedColumnParallelLinear), by their checkpoint names.
FUSED_DENSE = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def shared_exponents(weights: dict[str, FloatWeight], target: str) -> dict[str, int | None]:
    """Per key of `weights` (an expert's projections), the γ its nvfp4 cast takes: one γ for each set of `FUSED`
    present, chosen over the set's bytes together (`choose_global_exponent`); None (the linear's own) otherwise
    and for other targets."""
    found: dict[str, int | None] = dict.fromkeys(weights)
    if target != NVFP4:
        return found
    for fused in FUSED:
        if all(key in weights for key in fused):
            gamma = choose_global_exponent(np.concatenate([global_bytes(weights[key]) for key in fused]))
            found.update(dict.fromkeys(fused, gamma))
    return found


def nvfp4_scale(relative: np.ndarray) -> np.ndarray:
    """The E4M3 scale (float64) a group with UE8M0 byte b gets under G = 2^γ, from relative = b - 127 - γ:
    2^relative rounded to the nearest E4M3, clamped to 2^-9 .. 448 (exactly 2^relative for -9 .. 8)."""
    with np.errstate(over="ignore"):
        return np.clip(round_to(np.ldexp(1.0, relative), E4M3_FORMAT, saturate=True), 2.0 ** NVFP4_SCALE_RANGE[0],
                       E4M3_FORMAT.top)


def _nvfp4(weight: FloatWeight, exponent: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    b, zero, reserved, exponent = _nvfp4_groups(weight, exponent)
    low, high = NVFP4_SCALE_RANGE
    relative = b.astype(np.int64) - 127 - exponent
    exact = ~reserved & (zero | ((relative >= low) & (relative <= high)))
    errors = np.zeros(exact.shape)
    inexact = ~exact & ~reserved
    if inexact.any():  # the cast's rounding: the nearest E4M3 scale (clamped), each value to the nearest code of it
        with np.errstate(over="ignore"):
            scale = nvfp4_scale(relative[inexact])
            n, k = weight.codes.shape
            values = weight.dequantize().reshape(n, k // NVFP4_GROUP, NVFP4_GROUP)[inexact]
            step = scale[:, None] * 2.0 ** exponent
            rounded = round_to(values / step, E2M1_FORMAT, saturate=True) * step
            errors[inexact] = relative_errors(values, rounded).max(axis=1)
    return exact, reserved, errors, exponent


def choose_global_exponent(scale_bytes: np.ndarray) -> int:
    """γ for G = 2^γ: the one under which the most of these UE8M0 bytes b have 2^(b - 127 - γ) in E4M3's
    2^-9 .. 2^8, the largest byte landing on 2^8 when that is among them (else the highest such γ)."""
    low, high = NVFP4_SCALE_RANGE
    if scale_bytes.size == 0:
        return 0
    counts = np.bincount(scale_bytes.astype(np.int64), minlength=256)
    gammas = np.arange(GLOBAL_EXPONENTS[0], GLOBAL_EXPONENTS[1] + 1)
    covered = np.cumsum(np.concatenate([[0], counts]))  # covered[x] = count of bytes < x
    top = np.clip(gammas + 127 + high + 1, 0, 256)
    bottom = np.clip(gammas + 127 + low, 0, 256)
    exact = covered[top] - covered[bottom]
    best = exact.max()
    aligned = int(scale_bytes.max()) - 127 - high
    if GLOBAL_EXPONENTS[0] <= aligned <= GLOBAL_EXPONENTS[1] and exact[aligned - GLOBAL_EXPONENTS[0]] == best:
        return aligned
    return int(gammas[exact == best].max())


# ---- writing a cast (issue 41, second step) ---------------------------------------------------------------
#
# What a cast writes is defined once, here: every value rounded to the target as the census rounds it
# (`cast_values`), so the values of an exact block are the source's own and the others are the rounding whose
# worst relative error the census reports. The stored arrays follow from those values without rounding again.

CASTS = (BF16, FP8_BLOCK, NVFP4)  # the casts `convert --cast` writes


def cast_values(weight: FloatWeight, target: str, exponent: int | None = None) -> np.ndarray:
    """The (N, K) values the cast writes, float64: each source value rounded to the target (bf16: to the
    nearest bfloat16, overflow to infinity; fp8-block: divided by its tile's 2^t, rounded to the nearest E4M3
    value, saturating, times 2^t; nvfp4: divided by its group's E4M3 scale (`nvfp4_scale`) times G = 2^γ, rounded
    to the nearest E2M1 value, saturating at 6, times both again)."""
    if target not in CASTS or target not in targets_of(weight):
        raise ValueError(f"no {target} cast of {weight.scheme.name} codes is written here")
    with np.errstate(over="ignore"):
        values = weight.dequantize()
        if target == BF16:
            return round_to(values, BF16_FORMAT, saturate=False)
        if target == NVFP4:
            b, _, _, exponent = _nvfp4_groups(weight, exponent)
            step = np.repeat(nvfp4_scale(b.astype(np.int64) - 127 - exponent) * 2.0 ** exponent, NVFP4_GROUP, axis=1)
            return round_to(values / step, E2M1_FORMAT, saturate=True) * step
        shift = _spread(_fp8_shift(weight)[0], FP8_BLOCK_SHAPE, weight.codes)
        return np.ldexp(round_to(np.ldexp(values, -shift), E4M3_FORMAT, saturate=True), shift)


def exact_elements(weight: FloatWeight, target: str, exponent: int | None = None) -> np.ndarray:
    """(N, K) bool: whether each element lies in a block the predicate calls exact (`exact_blocks`)."""
    exact = exact_blocks(weight, target, exponent)
    if target == FP8_BLOCK:
        return _spread(exact, FP8_BLOCK_SHAPE, weight.codes)
    return np.repeat(exact, NVFP4_GROUP if target == NVFP4 else weight.scheme.block, axis=1)


def cast_arrays(weight: FloatWeight, target: str, exponent: int | None = None) -> dict[str, np.ndarray]:
    """The stored arrays of one cast linear: bf16 `weight` (uint16 bit patterns); fp8-block `weight` (E4M3
    bytes) and `weight_scale_inv` (float32); nvfp4 compressed-tensors' `weight_packed`, `weight_scale` (E4M3
    bytes, as uint8) and `weight_global_scale` (float32 (1,), 1 / G, divided by: `_nvfp4_arrays`). `cast_values`, encoded, by table: a bf16 value depends only on the
    element's (scale byte, code) pair and an E4M3 byte only on (scale byte - 127 - its block's t, code), so each
    table is that definition evaluated on every pair (tests/test_cast_outputs.py holds the two equal)."""
    if target not in CASTS or target not in targets_of(weight):
        raise ValueError(f"no {target} cast of {weight.scheme.name} codes is written here")
    block = weight.scheme.block
    if target == BF16:
        pairs = np.arange(256 * 16)
        table = FloatWeight.from_codes((pairs & 15).astype(np.uint8).reshape(-1, 1).repeat(block, axis=1),
                                       (pairs >> 4).astype(np.uint8).reshape(-1, 1), weight.scheme,
                                       weight.global_scale, weight.input_scale)
        with np.errstate(invalid="ignore", over="ignore"):  # the reserved bytes' NaN rows: never indexed
            bits = bf16_bits(round_to(table.dequantize()[:, 0], BF16_FORMAT, saturate=False))
        rows = np.repeat(weight.scales.astype(np.uint16) << 4, block, axis=1)
        return {"weight": bits[rows | weight.codes]}
    if target == NVFP4:
        return _nvfp4_arrays(weight, exponent)
    shift = _fp8_shift(weight)[0]
    low, high = _FP8_OFFSETS
    # one offset a source block (its byte and its tile's t), then each element's row of the table
    tile = (FP8_BLOCK_SHAPE[0], FP8_BLOCK_SHAPE[1] // block)
    offset = np.clip(weight.scales.astype(np.int64) - 127 - _spread(shift, tile, weight.scales), low, high)
    rows = np.repeat(((offset - low) << 4).astype(np.uint16), block, axis=1)
    return {"weight": _fp8_table()[rows | weight.codes],
            "weight_scale_inv": np.ldexp(np.float32(1.0), shift).astype(np.float32)}


def _nvfp4_arrays(weight: FloatWeight, exponent: int | None = None) -> dict[str, np.ndarray]:
    """`cast_values` for nvfp4, encoded by tables over the scale bytes: a group's E4M3 scale byte depends only on
    its UE8M0 byte b (`nvfp4_scale` of b - 127 - γ), and each output code only on (b, code): E2M1(code) ·
    2^(b - 127 - γ) / scale rounded to E2M1, which is the code itself wherever the scale is exactly 2^(b - 127 - γ)
    (every exact group), so the source's packed bytes are kept as they are unless some byte re-codes."""
    b, _, reserved, exponent = _nvfp4_groups(weight, exponent)
    if reserved.any():
        raise ValueError("a reserved UE8M0 scale byte (0xFF) has no NVFP4 cast (the source formats refuse it)")
    bytes_ = np.arange(255)
    scale = nvfp4_scale(bytes_ - 127 - exponent)
    ratio = np.ldexp(1.0, bytes_ - 127 - exponent) / scale  # exact: both powers of two, or 448 = 7 · 2^6
    recoded = round_to(E2M1_VALUES[None, :] * ratio[:, None], E2M1_FORMAT, saturate=True)  # (byte, code)
    codes_table = e2m1_codes(recoded)
    present = np.unique(weight.scales)
    if np.array_equal(codes_table[present], np.broadcast_to(np.arange(16, dtype=np.uint8), (present.size, 16))):
        packed = weight.packed
    else:
        rows = np.repeat(weight.scales.astype(np.uint16) << 4, weight.scheme.block, axis=1)
        packed = pack_codes(codes_table.ravel()[rows | weight.codes])
    return {"weight_packed": packed, "weight_scale": e4m3_bytes(scale)[b],
            "weight_global_scale": np.array([np.ldexp(1.0, -exponent)], dtype=np.float32)}


def e2m1_codes(values: np.ndarray) -> np.ndarray:
    """float64 values that are E2M1 values -> their 4-bit codes (sign in bit 3, -0 as 8)."""
    magnitudes = E2M1_VALUES[:8]
    index = np.searchsorted(magnitudes, np.abs(values))
    assert (magnitudes[np.minimum(index, 7)] == np.abs(values)).all(), "not E2M1 values"
    return (index | (np.signbit(values).astype(np.int64) << 3)).astype(np.uint8)


# E2M1(code) · 2^d as E4M3 bytes, for every offset d a value of a block can have: above 10 only a zero code can lie
# (0.5 · 2^10 > 448, the scale's t bounds every other), and below -20 every code rounds to 0 (6 · 2^-20 < 2^-10,
# half E4M3's smallest subnormal), as at -20.
_FP8_OFFSETS = (-20, 10)


def _fp8_table() -> np.ndarray:
    low, high = _FP8_OFFSETS
    offsets = np.arange(low, high + 1)[:, None]
    values = np.ldexp(E2M1_VALUES[None, :], offsets)
    return e4m3_bytes(round_to(values, E4M3_FORMAT, saturate=True)).ravel()


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float64 values that are bfloat16 values (or infinite) -> their uint16 bit patterns, exactly."""
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns -> float64 (a NaN pattern as NaN)."""
    with np.errstate(invalid="ignore"):
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def e4m3_bytes(values: np.ndarray) -> np.ndarray:
    """float64 values that are E4M3 values -> their bytes (S.EEEE.MMM, bias 7, subnormals m · 2^-9)."""
    magnitude = np.abs(values)
    exponent = np.frexp(np.where(magnitude > 0, magnitude, 1.0))[1] - 1
    normal = (magnitude > 0) & (exponent >= E4M3_FORMAT.emin)
    field = np.where(normal, exponent + 7, 0)
    mantissa = np.where(normal, np.ldexp(magnitude, -exponent) - 1, np.ldexp(magnitude, 6)) * 8
    assert np.array_equal(mantissa, np.round(mantissa)) and (mantissa < 8).all(), "not E4M3 values"
    sign = np.signbit(values).astype(np.int64) << 7
    return (sign | (field.astype(np.int64) << 3) | mantissa.astype(np.int64)).astype(np.uint8)


def e4m3_values(codes: np.ndarray) -> np.ndarray:
    """E4M3 bytes -> float64 (S.1111.111 as NaN)."""
    return scale_values(np.arange(256, dtype=np.uint8), E4M3)[codes]  # by a table of the 256 bytes


class CastWeight:
    """One linear of a cast output read back: its stored arrays (`tensors`), the cast that wrote them, and its
    (N, K) values as float64 (`values`, decoded when asked). `mismatch` holds them against the source's float
    codes (what verify compares, as the canonical forms' `mismatch` do)."""

    def __init__(self, tensors: dict[str, np.ndarray], target: str):
        self.tensors, self.target = tensors, target

    @classmethod
    def of(cls, target: str, tensors: dict[str, np.ndarray]) -> CastWeight:
        return cls(tensors, target)

    @property
    def shape(self) -> tuple[int, ...]:
        if self.target == NVFP4:
            n, width = self.tensors["weight_packed"].shape
            return n, 2 * width
        return tuple(self.tensors["weight"].shape)

    @property
    def values(self) -> np.ndarray:
        """Exact in float64: E2M1 x E4M3 products, times 2^t (fp8-block) or divided by a power of two (nvfp4:
        `mismatch` first holds weight_global_scale to the cast's 2^-γ)."""
        if self.target == BF16:
            return bf16_values(self.tensors["weight"])
        if self.target == NVFP4:
            scales = np.repeat(e4m3_values(self.tensors["weight_scale"].view(np.uint8)), NVFP4_GROUP, axis=1)
            codes = unpack_codes(self.tensors["weight_packed"])
            return E2M1_VALUES[codes] * scales / np.float64(self.tensors["weight_global_scale"].reshape(()))
        codes, scale_inv = self.tensors["weight"].view(np.uint8), self.tensors["weight_scale_inv"].astype(np.float64)
        return e4m3_values(codes) * _spread(scale_inv, FP8_BLOCK_SHAPE, codes)

    def mismatch(self, source: object, exponent: int | None = None) -> str | None:
        """None if every value of an exact block equals the source's value as a real (compared in float64,
        where both are exact: an exact block's values are target values, so even a divided NVFP4 global
        scale's quotient is computed exactly) and every other value is the cast's rounding of it; else the
        first difference. A bf16 cast is compared by its bit patterns (`_bf16_mismatch`). `exponent`: the γ an nvfp4
        cast shares with its fused siblings (`shared_exponents`), None: the linear's own."""
        if not isinstance(source, FloatWeight):
            return f"a {self.target} cast compared with {type(source).__name__}"
        if self.shape != source.codes.shape:
            return f"shape {list(self.shape)} != the source's {list(source.codes.shape)}"
        if self.target == BF16:
            return self._bf16_mismatch(source)
        if self.target == NVFP4:
            stored, exponent = self.tensors["weight_global_scale"], _nvfp4_groups(source, exponent)[3]
            if stored.shape != (1,) or float(stored[0]) != np.ldexp(1.0, -exponent):
                return f"weight_global_scale {stored.tolist()} != the cast's [2^{-exponent}] (1 / G, G = 2^{exponent})"
            if self._nvfp4_same_codes(source, exponent):
                return None
        values = self.values
        exact = exact_elements(source, self.target, exponent)
        with np.errstate(over="ignore"):
            truth = source.dequantize()
        checks = [(exact, truth, "the source's value, in an exact block")]
        if not exact.all():  # the rounding is computed only where some block needs it
            checks.append((~exact, cast_values(source, self.target, exponent), "the cast's rounding of the source's, in an "
                                                                      "inexact block"))
        for where, want, what in checks:
            differ = where & ~((values == want) & (np.signbit(values) == np.signbit(want)))
            if differ.any():
                first = tuple(int(i) for i in np.argwhere(differ)[0])
                return (f"{int(differ.sum())} value(s) differ from {what} (first at {list(first)}: "
                        f"{values[first]!r} != {want[first]!r})")
        return None

    def _nvfp4_same_codes(self, source: FloatWeight, exponent: int) -> bool:
        """Whether every group is exact and the output holds the source's own codes, each group's scale byte reading
        (`e4m3_values`, one value a group) as exactly 2^(b - 127 - γ): then every value E2M1(c) · 2^(b - 127 - γ) ·
        2^γ (the global scale held to 2^-γ before) is the source's E2M1(c) · 2^(b - 127) as a real, without a
        float64 of every element. Otherwise (an inexact group, or any byte otherwise) the element check decides
        and names the first difference."""
        b, _, _, gamma = _nvfp4_groups(source, exponent)
        if not exact_blocks(source, NVFP4, gamma).all() or not np.array_equal(self.tensors["weight_packed"],
                                                                             source.packed):
            return False
        scales = e4m3_values(self.tensors["weight_scale"].view(np.uint8))
        return bool(np.array_equal(scales, np.ldexp(1.0, b.astype(np.int64) - 127 - gamma)))

    def _bf16_mismatch(self, source: FloatWeight) -> str | None:
        """The same comparison for bf16, without a float64 of every element: a source value depends only on its
        (scale byte, code) pair (and the linear's global scale), so `_bf16_truth` evaluates the source's own
        `dequantize` on every pair once and gives the bit pattern of the bfloat16 equal to it as a real (-1
        where none is: never equal to a stored pattern), and of the cast's rounding of it; each element's
        stored pattern is compared with its pair's, from the first table in an exact block and the second in
        an inexact one. A bfloat16 other than NaN is one pattern and one real (-0 and +0 two patterns, as the
        float64 check tells their signs apart), so equal patterns are equal reals and the converse."""
        block = source.scheme.block
        n, k = source.codes.shape
        inexact = ~exact_blocks(source, BF16)
        table = _bf16_truth(source)
        base = (inexact.astype(np.uint16) << 12) | (source.scales.astype(np.uint16) << 4)
        index = base[:, :, None] | source.codes.reshape(n, k // block, block)
        differ = (table[index] != self.tensors["weight"].reshape(n, k // block, block)).reshape(n, k)
        if not differ.any():
            return None
        first = tuple(int(i) for i in np.argwhere(differ)[0])
        rounded = bool(inexact[first[0], first[1] // block])
        what = ("the cast's rounding of the source's, in an inexact block" if rounded
                else "the source's value, in an exact block")
        want = table[index.reshape(n, k)[first]]
        wanted = bf16_values(np.uint16(want)) if want >= 0 else "no bfloat16"
        if not rounded:
            with np.errstate(over="ignore", invalid="ignore"):
                wanted = FloatWeight.from_codes(source.codes[first[0]:first[0] + 1],
                                                source.scales[first[0]:first[0] + 1], source.scheme,
                                                source.global_scale, source.input_scale).dequantize()[0, first[1]]
        where = differ & np.repeat(inexact == rounded, block, axis=1)
        return (f"{int(where.sum())} value(s) differ from {what} (first at {list(first)}: "
                f"{bf16_values(self.tensors['weight'][first])!r} != {wanted!r})")


def _bf16_truth(weight: FloatWeight) -> np.ndarray:
    """(8192,) int32 indexed [inexact · 4096 + scale byte · 16 + code]: for an exact block the bit pattern of the
    bfloat16 equal as a real to the source value (`FloatWeight.dequantize` of that pair, float64; -1 where no
    bfloat16 is: not representable, or NaN), for an inexact one that of the cast's rounding (`round_to`, as
    `cast_values`; -1 for NaN)."""
    block, pairs = weight.scheme.block, np.arange(256 * 16)
    table = FloatWeight.from_codes((pairs & 15).astype(np.uint8).reshape(-1, 1).repeat(block, axis=1),
                                   (pairs >> 4).astype(np.uint8).reshape(-1, 1), weight.scheme,
                                   weight.global_scale, weight.input_scale)
    with np.errstate(invalid="ignore", over="ignore"):
        values = table.dequantize()[:, 0]
        single = values.astype(np.float32)
        bits = single.view(np.uint32).astype(np.int64)
        is_bf16 = (single.astype(np.float64) == values) & (bits & 0xFFFF == 0)  # NaN: never equal
        exact = np.where(is_bf16, bits >> 16, -1)
        rounded_values = round_to(values, BF16_FORMAT, saturate=False)
        rounded = np.where(np.isnan(rounded_values), -1, bf16_bits(rounded_values).astype(np.int64))
    return np.concatenate([exact, rounded]).astype(np.int32)


class Tally:
    """A cast's census over many linears (what convert decides by and moeconv.json records): the blocks,
    exact blocks and reserved ones, the linears, and each linear with an inexact block, with the worst
    relative error; the bound is the worst over all."""

    def __init__(self, source: str, target: str):
        self.source, self.target = source, target
        self.blocks = self.exact = self.reserved = self.linears = 0
        self.worst = 0.0
        self.inexact: list[dict[str, Any]] = []
        self.exponents: dict[str, int] = {}  # nvfp4: each linear's γ (not recorded: the output's global scales say it)

    def add(self, name: str, counted: Census) -> None:
        if counted.scale_exponent is not None:
            self.exponents[name] = counted.scale_exponent
        self.linears += 1
        self.blocks += counted.blocks
        self.exact += counted.exact
        self.reserved += counted.reserved
        if counted.exact < counted.blocks:
            self.inexact.append({"tensor": name, **counted.to_json()})
            self.worst = max(self.worst, counted.worst_relative_error)

    def unshared(self) -> str | None:
        """Where linears an engine fuses into one (a module's q/k/v, a dense MLP's gate/up: `FUSED_DENSE`) got
        different nvfp4 global scales (each dense linear is decided alone; an expert's gate and up share one):
        vLLM reads one for the fused layer (the largest, `CompressedTensorsW4A4Fp4.process_weights_after_loading`),
        so the others' values would be wrong there. None where every fused set agrees."""
        sets: dict[tuple[str, int], dict[str, int]] = {}
        for name, gamma in self.exponents.items():
            parent, _, leaf = name.rpartition(".")
            for index, fused in enumerate(FUSED_DENSE):
                if leaf in fused:
                    sets.setdefault((parent, index), {})[leaf] = gamma
        for (parent, _), found in sets.items():
            if len(set(found.values())) > 1:
                shown = ", ".join(f"{leaf} 2^{gamma}" for leaf, gamma in found.items())
                return f"{parent}: the linears an engine fuses would get different NVFP4 global scales ({shown})"
        return None

    @property
    def is_exact(self) -> bool:
        return self.exact == self.blocks

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "target": self.target, "label": f"{self.source.upper()} -> {LABELS[self.target]}",
                "blocks": self.blocks, "exact": self.exact, "reserved": self.reserved, "linears": self.linears,
                "worst_relative_error": json_float(self.worst), "inexact": self.inexact}

    def record(self, allow_inexact: bool) -> dict[str, Any]:
        """What moeconv.json records (its `cast`): the census, whether inexact blocks were allowed, and the bound,
        the worst relative error of any written value (0 for an exact cast)."""
        found = self.to_json()
        return {**found, "allow_inexact": allow_inexact, "bound": found["worst_relative_error"]}

    def summary(self) -> str:
        """One line: "MXFP4 -> BF16: 12 of 40 blocks inexact in 3 linears (first model...down_proj), worst
        relative error 0.5"."""
        label = f"{self.source.upper()} -> {LABELS[self.target]}"
        if self.is_exact:
            return f"{label}: all {self.blocks} blocks of {self.linears} linears exact"
        names = [entry["tensor"] for entry in self.inexact]
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return (f"{label}: {self.blocks - self.exact} of {self.blocks} blocks inexact in {len(names)} of "
                f"{self.linears} linears ({shown}), worst relative error {self.worst:.3g}")
