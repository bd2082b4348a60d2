"""Which part of each stacked `triton` tensor one tensor-parallel rank holds (docs/FORMAT.md).

vLLM splits a MoE layer's intermediate dimension I over the ranks: rank r of T holds gate rows and up
rows [r·I/T, (r+1)·I/T) of w13 and the same input columns of w2. In the stacked layout that is, per
tensor (E experts on dim 0; packed dimensions in bytes, b bits a code):

  w13_qweight (E, 2I, H·b/8), w13_scales (E, 2I, H/g): the two row ranges, gate's then up's;
  w13_qzeros  (E, 2I·b/8, H/g): the same ranges in packed rows (I/T·b/8 each);
  w2_qweight  (E, H, I·b/8): columns [r·I/T·b/8, ...); w2_scales and w2_qzeros (E, ·, I/g): columns
              [r·I/T/g, ...).

Whether a layer splits at all (I divisible by T, whole bytes and whole groups per rank) is the
backend's own `refusal` with `tp` set, the same check `convert --tp` and `inspect` make.
"""

from __future__ import annotations

import torch

W13 = ("w13_qweight", "w13_scales", "w13_qzeros")
W2 = ("w2_qweight", "w2_scales", "w2_qzeros")


def rank_part(name: str, tensor: torch.Tensor, intermediate: int, bits: int, group_size: int,
              tp_size: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of the stacked tensor `name` (a copy only where the rows are two ranges)."""
    if tp_size == 1:
        return tensor
    per_rank = intermediate // tp_size
    if name in W13:
        rows = per_rank * bits // 8 if name == "w13_qzeros" else per_rank
        half = tensor.shape[1] // 2
        return torch.cat([tensor[:, start + rank * rows:start + (rank + 1) * rows] for start in (0, half)], dim=1)
    if name in W2:
        columns = per_rank * bits // 8 if name == "w2_qweight" else per_rank // group_size
        return tensor[:, :, rank * columns:(rank + 1) * columns]
    raise ValueError(f"{name} is not a tensor of the triton layout")
