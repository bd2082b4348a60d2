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

from moeconv.float_codes import DIVIDE, E4M3, E4M3_NAN_MAGNITUDE, UE8M0, UE8M0_NAN, FloatWeight


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


def census(weight: FloatWeight, target: str) -> Census:
    """Count `weight`'s exact target blocks (`exact_blocks`) and the worst relative error of the others."""
    exact, reserved, errors, exponent = _blocks(weight, target)
    inexact = ~exact & ~reserved
    worst = float(errors[inexact].max()) if inexact.any() else 0.0
    return Census(target, int(exact.size), int(exact.sum()), int(reserved.sum()), worst, exponent)


def exact_blocks(weight: FloatWeight, target: str) -> np.ndarray:
    """The exactness predicate: a bool array, one per target block (fp8-block: (ceil(N/128), ceil(K/128));
    nvfp4: (N, K/16); bf16: the source's blocks, (N, K/block)), decided from the bytes alone."""
    return _blocks(weight, target)[0]


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


def _element_dyadic(weight: FloatWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each weight value's |W| = odd · 2^e ((N, K) int64 each; odd -1: not dyadic) and its reserved flag."""
    scheme = weight.scheme
    magnitude = weight.codes & 7
    scale_odd, scale_exp, reserved = (np.repeat(a, scheme.block, axis=1)
                                      for a in _scale_dyadic(weight.scales, scheme.scale_encoding))
    odd = _E2M1_ODD[magnitude] * scale_odd
    exponent = _E2M1_EXP[magnitude] + scale_exp
    if weight.global_scale is not None:
        global_odd, global_exp = _dyadic_scalar(float(weight.global_scale))
        if scheme.global_convention == DIVIDE:
            divides = odd % global_odd == 0
            odd = np.where(divides, odd // global_odd, -1)
            exponent = exponent - global_exp
        else:
            odd, exponent = odd * global_odd, exponent + global_exp
    return odd, exponent, reserved


# ---- per target ---------------------------------------------------------------------------------------

def _blocks(weight: FloatWeight, target: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, int | None]:
    """(exact, reserved, worst relative error) per target block, and the global scale's exponent (nvfp4)."""
    if target not in targets_of(weight):
        raise ValueError(f"no {target} cast of {weight.scheme.name} codes is decided here (from "
                         f"{weight.scheme.name}: {', '.join(targets_of(weight))})")
    if target == FP8_BLOCK:
        return (*_fp8_block(weight), None)
    if target == NVFP4:
        return _nvfp4(weight)
    return (*_bf16(weight), None)


def _tiles(array: np.ndarray, shape: tuple[int, int], fill: Any) -> np.ndarray:
    """(N, K) -> (ceil(N/a), ceil(K/b), a · b), the last tiles padded with `fill`."""
    (n, k), (a, b) = array.shape, shape
    rows, cols = -(-n // a), -(-k // b)
    padded = np.full((rows * a, cols * b), fill, dtype=array.dtype)
    padded[:n, :k] = array
    return padded.reshape(rows, a, cols, b).transpose(0, 2, 1, 3).reshape(rows, cols, a * b)


def _fp8_block(weight: FloatWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    odd, exponent, reserved = _element_dyadic(weight)
    nonzero = odd > 0
    bits = np.frexp(np.where(nonzero, odd, 1).astype(np.float64))[1].astype(np.int64)
    high = exponent + bits - 1
    leading = np.ldexp(np.where(nonzero, odd, 1).astype(np.float64), 1 - bits)  # odd as 1.xxx
    # the smallest t with odd · 2^(e - t) <= 448: the largest value's exponent minus 8, one more past 1.75
    floor = np.where(nonzero & ~reserved, high - 8 + (leading > 1.75), np.iinfo(np.int64).min)
    shift = _tiles(floor, FP8_BLOCK_SHAPE, np.iinfo(np.int64).min).max(axis=2)
    shift = np.where(shift == np.iinfo(np.int64).min, 0, shift)  # an all-zero block: scale 1
    rows, cols = FP8_BLOCK_SHAPE
    element_shift = np.repeat(np.repeat(shift, rows, axis=0), cols, axis=1)[:odd.shape[0], :odd.shape[1]]
    ok = representable(odd, exponent - element_shift, E4M3_FORMAT) & ~reserved
    exact = _tiles(ok, FP8_BLOCK_SHAPE, True).all(axis=2)
    blocked = _tiles(reserved, FP8_BLOCK_SHAPE, False).any(axis=2)
    with np.errstate(invalid="ignore"):
        values = weight.dequantize()
        rounded = np.ldexp(round_to(np.ldexp(values, -element_shift), E4M3_FORMAT, saturate=True), element_shift)
        errors = np.where(reserved, 0.0, relative_errors(values, rounded))
    return exact, blocked, _tiles(errors, FP8_BLOCK_SHAPE, 0.0).max(axis=2)


def _bf16(weight: FloatWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    odd, exponent, reserved = _element_dyadic(weight)
    ok = representable(odd, exponent, BF16_FORMAT) & ~reserved
    n, k = ok.shape
    per_block = (n, k // weight.scheme.block, weight.scheme.block)
    with np.errstate(invalid="ignore", over="ignore"):
        values = weight.dequantize()
        errors = np.where(reserved, 0.0, relative_errors(values, round_to(values, BF16_FORMAT, saturate=False)))
    blocked = _scale_dyadic(weight.scales, weight.scheme.scale_encoding)[2]
    return ok.reshape(per_block).all(axis=2), blocked, errors.reshape(per_block).max(axis=2)


def _nvfp4(weight: FloatWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    assert weight.scheme.scale_encoding == UE8M0 and weight.scheme.block % NVFP4_GROUP == 0, weight.scheme
    halves = weight.scheme.block // NVFP4_GROUP
    b = np.repeat(weight.scales.astype(np.int64), halves, axis=1)  # (N, K/16): each group's UE8M0 byte
    n, k = weight.codes.shape
    codes = weight.codes.reshape(n, k // NVFP4_GROUP, NVFP4_GROUP)
    zero = (codes & 7 == 0).all(axis=2)
    reserved = b == UE8M0_NAN
    exponent = choose_global_exponent(b[~zero & ~reserved])
    low, high = NVFP4_SCALE_RANGE
    exact = ~reserved & (zero | ((b - 127 - exponent >= low) & (b - 127 - exponent <= high)))
    # the cast's rounding: the nearest E4M3 scale (clamped), then each value to the nearest E2M1 code of it
    with np.errstate(invalid="ignore", over="ignore"):
        wanted = np.ldexp(1.0, np.where(reserved, 127, b) - 127 - exponent)
        scale = np.clip(round_to(wanted, E4M3_FORMAT, saturate=True), 2.0 ** low, E4M3_FORMAT.top)
        values = weight.dequantize().reshape(n, k // NVFP4_GROUP, NVFP4_GROUP)
        step = scale[..., None] * 2.0 ** exponent
        rounded = round_to(values / step, E2M1_FORMAT, saturate=True) * step
        errors = np.where(reserved, 0.0, relative_errors(values, rounded).max(axis=2))
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
