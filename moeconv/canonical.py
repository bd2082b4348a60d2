"""The canonical form: the one place where source formats and backend layouts meet.

Every source format decodes to a `QuantizedWeight`, every backend encodes from one and decodes back
to one. Equality of canonical forms is what "lossless" means in `verify`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from moeconv.packing import as_float32

if TYPE_CHECKING:
    from moeconv.float_codes import FloatScheme

SUPPORTED_BITS = (2, 4, 8)
PROJECTIONS = ("gate", "up", "down")  # an expert's three linears, in the canonical order
CHANNELWISE = -1  # the configured group size of channel-wise quantization (configs also write 0)


def is_channelwise(group_size: int) -> bool:
    return group_size in (CHANNELWISE, 0)


def effective_group_size(in_features: int, group_size: int) -> int:
    """The canonical group size of a linear with K = `in_features`: the configured one, or K for
    channel-wise and for a group at least as wide as K (one group; GPTQ writes ceil(K / g) = 1)."""
    return in_features if is_channelwise(group_size) or group_size >= in_features else group_size


def groups_of(in_features: int, group_size: int) -> int:
    return in_features // effective_group_size(in_features, group_size)


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """One quantized linear `y = x · Wᵀ` with `W[n, k] = (codes[n, k] − zeros[n, k // g]) · scales[n, k // g]`.

    codes: uint8 (N, K), values in [0, 2^bits).
    zeros: uint8 (N, K / g) of TRUE zero points, or None for the implicit 2^(bits−1).
    scales: (N, K / g) in the source dtype, never silently cast, in the stored form: float16, float32, or
    BF16 as its uint16 bit patterns (as `TensorReader.read_raw` gives them; numpy has no BF16).
    group_size: g, with g == K for channel-wise quantization.

    Numpy arrays: every codec moves bits on the stored arrays, so no worker needs torch.
    """

    codes: np.ndarray
    zeros: np.ndarray | None
    scales: np.ndarray
    bits: int
    group_size: int

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        assert self.codes.dtype == np.uint8, self.codes.dtype
        assert self.bits in SUPPORTED_BITS, self.bits
        assert k % self.group_size == 0, (k, self.group_size)
        groups = k // self.group_size
        assert self.scales.dtype in SCALE_DTYPES, self.scales.dtype
        assert self.scales.shape == (n, groups), (self.scales.shape, n, groups)
        if self.zeros is not None:
            assert self.zeros.dtype == np.uint8, self.zeros.dtype
            assert self.zeros.shape == (n, groups), (self.zeros.shape, n, groups)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    def effective_zeros(self) -> np.ndarray:
        """The zero points with the implicit symmetric one made explicit."""
        if self.zeros is not None:
            return self.zeros
        return np.full(self.scales.shape, 1 << (self.bits - 1), dtype=np.uint8)

    def dequantize(self, dtype: type = np.float32) -> np.ndarray:
        """The dense (N, K) weight, computed in `dtype` (float32, or float64 for references)."""
        codes = self.codes.astype(dtype)
        zeros = np.repeat(self.effective_zeros().astype(dtype), self.group_size, axis=1)
        scales = np.repeat(as_float32(self.scales).astype(dtype), self.group_size, axis=1)
        with np.errstate(invalid="ignore", over="ignore"):  # NaN and infinite scales are the source's: kept
            return (codes - zeros) * scales

    def mismatch(self, other: QuantizedWeight) -> str | None:
        """None if bit-identical to `other`, else a short description of the first difference."""
        if (self.bits, self.group_size) != (other.bits, other.group_size):
            return f"bits/group_size {self.bits}/{self.group_size} != {other.bits}/{other.group_size}"
        for field in ("codes", "scales"):
            problem = _array_mismatch(getattr(self, field), getattr(other, field))
            if problem:
                return f"{field}: {problem}"
        if (self.zeros is None) != (other.zeros is None):
            return "zeros: one side symmetric, the other not"
        if self.zeros is not None:
            problem = _array_mismatch(self.zeros, other.zeros)
            if problem:
                return f"zeros: {problem}"
        return None


# The scales' dtypes in the stored form (uint16: BF16 bit patterns).
SCALE_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.uint16))


def _array_mismatch(a: np.ndarray, b: np.ndarray) -> str | None:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
    # Compare bytes, not values: NaN scales and -0.0 must round-trip too. reshape(-1) first: a transposed
    # (N, 1) array counts as contiguous in both orders.
    mine, theirs = (np.ascontiguousarray(values.reshape(-1)).view(np.uint8) for values in (a, b))
    # as 8-byte words where the length allows: one comparison per 8 bytes (3x faster on 1.5 MB of codes)
    unit = np.uint64 if mine.size % 8 == 0 else np.uint8
    if np.array_equal(mine.view(unit), theirs.view(unit)):
        return None
    return f"{int(np.count_nonzero(mine != theirs))} byte(s) differ"


@dataclass(frozen=True)
class MoELayerShape:
    """What a backend needs to know about one MoE layer to lay out its stacked tensors.

    group_size is the configured one (−1: channel-wise), resolved per GEMM by `group_size_for`,
    because channel-wise means K = hidden for w13 and K = intermediate for w2.
    """

    experts: int
    hidden: int
    intermediate: int
    bits: int
    group_size: int
    symmetric: bool
    scale_dtype: str  # safetensors dtype code of the source scales ("F16", "BF16", "F32")
    activation_bits: int = 16  # 8: the scheme quantizes activations to int8 per token (W8A8)
    tp: int = 1  # tensor-parallel ranks the layer will be split over (eligibility only: tensors stay whole)
    projection_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate/up/down as the output names them
    float_scheme: FloatScheme | None = None  # float-coded experts (float_codes.py); None: integer codes
    expert_biases: bool = False  # each expert linear stores a bias beside its codes (gpt-oss)
    # experts stacked on disk, gate and up fused in one tensor with their rows in this order (models.INTERLEAVED:
    # gpt-oss); None: one tensor per expert and projection
    stacked_rows: str | None = None

    def group_size_for(self, in_features: int) -> int:
        return effective_group_size(in_features, self.group_size)

    @property
    def intermediate_per_rank(self) -> int:
        """I / tp: the rows of w13 and the input width of w2 one rank holds."""
        return self.intermediate // self.tp


@dataclass(frozen=True)
class LinearShape:
    """One dense (non-expert) quantized linear, for backends that convert those too.

    group_size is the configured one (−1: channel-wise), as in `MoELayerShape`."""

    out_features: int
    in_features: int
    bits: int
    group_size: int
    symmetric: bool
    scale_dtype: str
    activation_bits: int = 16
    float_scheme: FloatScheme | None = None  # a float-coded linear (float_codes.py); None: integer codes

    @property
    def effective_group_size(self) -> int:
        return effective_group_size(self.in_features, self.group_size)


def regroup(weight: QuantizedWeight, factor: int) -> QuantizedWeight:
    """The same weight with groups `factor` times smaller: every scale and zero point repeated
    `factor` times along K. Lossless (the dequantized weight is identical); it is what the
    moe_wna16 loader does when the group size does not divide a per-rank size."""
    if factor == 1:
        return weight
    zeros = None if weight.zeros is None else np.repeat(weight.zeros, factor, axis=1)
    return QuantizedWeight(codes=weight.codes, zeros=zeros, scales=np.repeat(weight.scales, factor, axis=1),
                           bits=weight.bits, group_size=weight.group_size // factor)


def coarsen(weight: QuantizedWeight, factor: int, name: str) -> QuantizedWeight:
    """Inverse of `regroup`: groups `factor` times wider. Raises ValueError
    naming the tensor when the `factor` scales or zero points of a wider group are not all the same (bytes
    no regrouping made)."""
    if factor == 1:
        return weight
    n, groups = weight.scales.shape
    wide = []
    for part in (weight.scales, weight.zeros):
        if part is None:
            wide.append(None)
            continue
        bits = part.view(f"u{part.itemsize}").reshape(n, groups // factor, factor)  # bits: NaN scales repeat too
        if not np.array_equal(bits, np.broadcast_to(bits[..., :1], bits.shape)):
            raise ValueError(f"{name}: the {factor} groups that make one source group of "
                             f"{weight.group_size * factor} do not repeat the same scale and zero point")
        wide.append(np.ascontiguousarray(part.reshape(n, groups // factor, factor)[..., 0]))
    return QuantizedWeight(codes=weight.codes, zeros=wide[1], scales=wide[0], bits=weight.bits,
                           group_size=weight.group_size * factor)
