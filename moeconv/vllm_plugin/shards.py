"""Which part of each stacked `triton` tensor one tensor-parallel rank holds (docs/FORMAT.md).

vLLM splits a MoE layer's intermediate dimension I over the ranks: rank r of T holds gate rows and up
rows [r·I/T, (r+1)·I/T) of w13 and the same input columns of w2. In the stacked layout that is, per
tensor (E experts on dim 0; packed dimensions in bytes, b bits a code):

  w13_qweight (E, 2I, H·b/8), w13_scales (E, 2I, H/g): the two row ranges, gate's then up's;
  w13_qzeros  (E, 2I·b/8, H/g): the same ranges in packed rows (I/T·b/8 each);
  w2_qweight  (E, H, I·b/8): columns [r·I/T·b/8, ...); w2_scales and w2_qzeros (E, ·, I/g): columns
              [r·I/T/g, ...);
  the int8 W8A8 layout: w13_weight (E, 2I, H) and w13_weight_scale (E, 2I, 1) the two row ranges,
              w2_weight (E, H, I) its columns, w2_weight_scale (E, H, 1) whole on every rank.

Whether a layer splits at all (I divisible by T, whole bytes and whole groups per rank) is the
backend's own `refusal` with `tp` set, the same check `convert --tp` and `inspect` make.
"""

from __future__ import annotations

import torch

# (fused GEMM, what one rank's share of I is in this tensor's split dimension: "rows", "bytes" (b-bit
# codes packed along I), "groups", or None: not split)
SPLITS = {
    "w13_qweight": ("w13", "rows"), "w13_scales": ("w13", "rows"), "w13_qzeros": ("w13", "bytes"),
    "w2_qweight": ("w2", "bytes"), "w2_scales": ("w2", "groups"), "w2_qzeros": ("w2", "groups"),
    # the int8 W8A8 layout: one code a byte, one scale per output channel
    "w13_weight": ("w13", "rows"), "w13_weight_scale": ("w13", "rows"),
    "w2_weight": ("w2", "rows"), "w2_weight_scale": ("w2", None),
}


def rank_part(name: str, tensor: torch.Tensor, intermediate: int, bits: int, group_size: int,
              tp_size: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of the stacked tensor `name` (a copy only where the rows are two ranges)."""
    if name not in SPLITS:
        raise ValueError(f"{name} is not a tensor of the triton layout")
    gemm, unit = SPLITS[name]
    if tp_size == 1 or unit is None:
        return tensor
    per_rank = intermediate // tp_size
    size = {"rows": per_rank, "bytes": per_rank * bits // 8, "groups": per_rank // max(group_size, 1)}[unit]
    if gemm == "w13":  # gate rows, then up rows: this rank's range of each
        half = tensor.shape[1] // 2
        return torch.cat([tensor[:, start + rank * size:start + (rank + 1) * size] for start in (0, half)], dim=1)
    return tensor[:, :, rank * size:(rank + 1) * size]  # w2: this rank's input columns
