"""Float references for the fused-MoE kernel: plain torch, no Triton, no packing tricks.

The reference takes DENSE weights, so the caller dequantizes the source format on its own path
and a layout mistake in the converted tensors cannot cancel out (DESIGN §7.3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def reference_fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``Σ_k w[t,k] · (silu(x·W13gateᵀ) * (x·W13upᵀ)) · W2ᵀ`` in ``dtype``, one expert at a time.

    ``w13`` (E, 2I, H) with gate rows first, ``w2`` (E, H, I): dense float weights, or anything
    whose ``[expert]`` gives them, such as :class:`DequantizedExperts`.
    """
    x = x.to(dtype)
    out = torch.zeros(x.shape, dtype=dtype, device=x.device)
    for expert in topk_ids.unique().tolist():
        tokens, slots = (topk_ids == expert).nonzero(as_tuple=True)
        gate_up = x[tokens] @ w13[expert].to(dtype).T
        intermediate = gate_up.shape[1] // 2
        activated = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        down = activated @ w2[expert].to(dtype).T
        out.index_add_(0, tokens, down * topk_weights[tokens, slots].to(dtype)[:, None])
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere in ``out`` gives NaN, which fails any bound."""
    ref = ref.to(torch.float64)
    return ((out.to(torch.float64) - ref).norm() / ref.norm()).item()


def random_routing(num_tokens: int, num_experts: int, topk: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Router output for random tokens: softmax of random logits, top-k, renormalised.

    Returns (topk_weights float32, topk_ids int64), each (num_tokens, topk), on the generator's device.
    """
    logits = torch.randn(num_tokens, num_experts, generator=generator, device=generator.device)
    weights, ids = torch.softmax(logits, dim=-1).topk(topk, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def covering_routing(num_tokens: int, num_experts: int, topk: int, generator: torch.Generator,
                     experts: list[int], confined: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`random_routing` in which each of `experts` is among some token's top-k, so that a check reads
    every one of them (random routing leaves most experts of a large layer without a token): the
    experts, in a random order, `topk` at a time, rank first in the first tokens' logits. At least
    ceil(len(experts) / topk) tokens; the other slots and tokens are routed as the logits say (`confined`:
    among `experts` only, so a check of a sample reads no other expert; top-k then at most their number), and
    the weights are the softmax of the chosen logits, as in `random_routing`. On the CPU."""
    if confined:
        topk = min(topk, len(experts))
    count = max(num_tokens, -(-len(experts) // topk))
    logits = torch.randn(count, num_experts, generator=generator)
    if confined:
        outside = torch.ones(num_experts, dtype=torch.bool)
        outside[experts] = False
        logits[:, outside] = float("-inf")
    order = torch.tensor(experts, dtype=torch.int64)[torch.randperm(len(experts), generator=generator)]
    ranked = logits.clone()
    finite = logits[logits.isfinite()]
    ranked[torch.arange(len(experts)) // topk, order] += float(finite.max() - finite.min()) + 1.0  # above all others
    ids = ranked.topk(topk, dim=-1).indices
    return torch.softmax(logits.gather(-1, ids), dim=-1), ids


def dequantize_wna16(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None, *,
                     bits: int, group_size: int) -> torch.Tensor:
    """Dense float32 weights (..., N, K) from the ``moe_wna16`` layout, in plain torch.

    ``W[n,k] = (c[n,k] − z[n,k//g]) · s[n,k//g]``; 4-bit codes: low nibble = even k; 4-bit
    zeros packed along N: low nibble = even n; no zeros means 2^(bits−1). ``group_size`` -1 is
    channel-wise. The torch baseline of the kernel benchmark, and a cross-check in the tests.
    """
    if bits == 4:
        codes = torch.stack([qweight & 0xF, qweight >> 4], dim=-1).flatten(-2)
        zeros = None if qzeros is None else torch.stack([qzeros & 0xF, qzeros >> 4], dim=-2).flatten(-3, -2)
    elif bits == 8:
        codes, zeros = qweight, qzeros
    else:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    group = codes.shape[-1] if group_size == -1 else group_size
    zeros = torch.full_like(scales, 1 << (bits - 1), dtype=torch.float32) if zeros is None else zeros.float()
    return (codes.float() - zeros.repeat_interleave(group, -1)) * scales.float().repeat_interleave(group, -1)


@dataclass(frozen=True)
class DequantizedExperts:
    """A ``moe_wna16`` expert stack whose ``[expert]`` dequantizes that one expert on demand.

    With :func:`reference_fused_moe` in bf16 this is the torch dequantize-then-matmul baseline:
    only the experts the routing selects are ever expanded.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    qzeros: torch.Tensor | None
    bits: int
    group_size: int

    def __getitem__(self, expert: int) -> torch.Tensor:
        zeros = None if self.qzeros is None else self.qzeros[expert]
        return dequantize_wna16(self.qweight[expert], self.scales[expert], zeros, bits=self.bits,
                                group_size=self.group_size)
