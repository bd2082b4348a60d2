"""The canonical form: the one place where source formats and backend layouts meet.

Every source format decodes to a `QuantizedWeight`, every backend encodes from one and decodes back
to one. Equality of canonical forms is what "lossless" means in `verify`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import numpy as np

from moeconv.packing import stored_array

if TYPE_CHECKING:  # torch is imported where tensors are made (the workers), not to plan
    import torch

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
    scales: (N, K / g) in the source dtype, never silently cast.
    group_size: g, with g == K for channel-wise quantization.

    The fields are torch tensors, or numpy arrays in the stored form (BF16 scales as their uint16 bit
    patterns, as `TensorReader.read_raw` gives them) where a format or a layout decodes without torch
    (`decode_stored`, for verify's workers); `mismatch` compares either, the other methods take tensors.
    """

    codes: torch.Tensor | np.ndarray
    zeros: torch.Tensor | np.ndarray | None
    scales: torch.Tensor | np.ndarray
    bits: int
    group_size: int

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        assert _dtype_name(self.codes) == "uint8", self.codes.dtype
        assert self.bits in SUPPORTED_BITS, self.bits
        assert k % self.group_size == 0, (k, self.group_size)
        groups = k // self.group_size
        assert tuple(self.scales.shape) == (n, groups), (self.scales.shape, n, groups)
        if self.zeros is not None:
            assert _dtype_name(self.zeros) == "uint8", self.zeros.dtype
            assert tuple(self.zeros.shape) == (n, groups), (self.zeros.shape, n, groups)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    def effective_zeros(self) -> torch.Tensor:
        """The zero points with the implicit symmetric one made explicit."""
        import torch

        if self.zeros is not None:
            return self.zeros
        return torch.full(self.scales.shape, 1 << (self.bits - 1), dtype=torch.uint8)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense (N, K) weight, computed in `dtype` (float32 if None; float32/float64 for references)."""
        import torch

        dtype = torch.float32 if dtype is None else dtype
        codes = self.codes.to(dtype)
        zeros = self.effective_zeros().to(dtype).repeat_interleave(self.group_size, dim=1)
        scales = self.scales.to(dtype).repeat_interleave(self.group_size, dim=1)
        return (codes - zeros) * scales

    def mismatch(self, other: QuantizedWeight) -> str | None:
        """None if bit-identical to `other`, else a short description of the first difference."""
        if (self.bits, self.group_size) != (other.bits, other.group_size):
            return f"bits/group_size {self.bits}/{self.group_size} != {other.bits}/{other.group_size}"
        for field in ("codes", "scales"):
            mine, theirs = getattr(self, field), getattr(other, field)
            problem = _tensor_mismatch(mine, theirs)
            if problem:
                return f"{field}: {problem}"
        if (self.zeros is None) != (other.zeros is None):
            return "zeros: one side symmetric, the other not"
        if self.zeros is not None:
            problem = _tensor_mismatch(self.zeros, other.zeros)
            if problem:
                return f"zeros: {problem}"
        return None


def _dtype_name(values: torch.Tensor | np.ndarray) -> str:
    return str(values.dtype).removeprefix("torch.")


def _stored_bytes(values: torch.Tensor | np.ndarray) -> np.ndarray:
    """The values' bytes, flat and contiguous. reshape(-1) first: a transposed (N, 1) tensor counts as
    contiguous but has stride(-1) != 1."""
    if isinstance(values, np.ndarray):
        return np.ascontiguousarray(values.reshape(-1)).view(np.uint8)
    import torch

    return np.ascontiguousarray(values.reshape(-1).view(torch.uint8).numpy())


def _tensor_mismatch(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray) -> str | None:
    if isinstance(a, np.ndarray) != isinstance(b, np.ndarray) or a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
    # Compare bytes, not values: NaN scales and -0.0 must round-trip too.
    # Compared in numpy: faster than torch's on one thread (docs/BENCHMARKS.md, verify's bit-exact check).
    mine, theirs = _stored_bytes(a), _stored_bytes(b)
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
    zeros = None if weight.zeros is None else _repeat_groups(weight.zeros, factor)
    return QuantizedWeight(codes=weight.codes, zeros=zeros, scales=_repeat_groups(weight.scales, factor),
                           bits=weight.bits, group_size=weight.group_size // factor)


def _repeat_groups(values: torch.Tensor | np.ndarray, factor: int) -> torch.Tensor | np.ndarray:
    """(N, G) -> (N, G · factor), each group repeated: tensors, or arrays in the stored form."""
    if isinstance(values, np.ndarray):
        return np.repeat(values, factor, axis=1)
    return values.repeat_interleave(factor, dim=1)


def coarsen(weight: QuantizedWeight, factor: int, name: str) -> QuantizedWeight:
    """Inverse of `regroup`, on a weight in the stored form: groups `factor` times wider. Raises ValueError
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


def stored_arrays(tensors: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Tensors as the numpy arrays `decode_stored` reads (no copy; BF16 as its uint16 bit patterns)."""
    return {name: stored_array(tensor) for name, tensor in tensors.items()}


def as_tensors(weight: QuantizedWeight) -> QuantizedWeight:
    """A weight decoded in the stored form (numpy) as torch tensors (no copy of writable arrays). Scales
    are floating point in every format, so uint16 scales are BF16 bit patterns and become BF16 again."""
    import torch

    def tensor(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values if values.flags.writeable else values.copy())

    scales = tensor(weight.scales)
    if weight.scales.dtype == np.uint16:
        scales = scales.view(torch.bfloat16)
    return QuantizedWeight(codes=tensor(weight.codes), zeros=None if weight.zeros is None else tensor(weight.zeros),
                           scales=scales, bits=weight.bits, group_size=weight.group_size)
