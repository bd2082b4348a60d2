"""Which part of each stacked `triton` tensor one SGLang MoE tensor-parallel rank holds, copied into the
parameter SGLang's MoeWNA16Method creates for it (no SGLang here).

MoeWNA16Method's parameters have the file's names and byte layout (`layers/quantization/moe_wna16.py ::
create_weights`): w13_qweight uint8 (E, 2·I/T, H·b/8), w13_scales (E, 2·I/T, H/g), w13_qzeros uint8
(E, 2·I/T·b/8, H/g), w2_qweight uint8 (E, H, I/T·b/8), w2_scales and w2_qzeros (E, ·, I/T/g), for rank r
of T of the MoE layer's tensor-parallel group. Rank r holds gate rows and up rows [r·I/T, (r+1)·I/T) of
the w13 tensors (in packed rows for qzeros) and the same input columns of the w2 tensors (bytes, or groups),
as SGLang's own MoeWNA16 loader splits them; moeconv.backends.triton.SPLITS names each tensor's unit.
Scales are cast to the parameter's dtype, as SGLang's loader casts them (the model dtype: a float16 output
served in float16 keeps its bytes).
"""

from __future__ import annotations

import torch

from moeconv.backends.triton import GEMM_OF, SPLITS, WNA16, WNA16_LAYOUT

STACKED = tuple(name for names in WNA16.values() for name in names)  # the stacked moe_wna16 tensor names


def fill(name: str, stored: torch.Tensor, parameter: torch.Tensor, intermediate: int, bits: int, group_size: int,
         tp_size: int, rank: int) -> None:
    """Copies rank `rank`'s part of the stacked tensor `name` (the file's, whole) into `parameter`, every
    element once. Raises ValueError when the part and the parameter differ in shape."""
    gemm, unit = GEMM_OF[name], SPLITS[WNA16_LAYOUT][name]
    if tp_size == 1:
        _copy(parameter, stored)
        return
    per_rank = intermediate // tp_size
    size = {"rows": per_rank, "bytes": per_rank * bits // 8, "groups": per_rank // group_size}[unit]
    if gemm == "w13":  # gate rows, then up rows: this rank's range of each, into the halves of the parameter
        half = stored.shape[1] // 2
        part = (stored.shape[0], 2 * size, *stored.shape[2:])
        if tuple(parameter.shape) != part:  # each half is copied into its range: the whole must match first
            raise ValueError(f"this rank's part is {list(part)}, the parameter holds {list(parameter.shape)}")
        for index, start in enumerate((0, half)):
            _copy(parameter[:, index * size:(index + 1) * size], stored[:, start + rank * size:start + (rank + 1) * size])
        return
    _copy(parameter, stored[..., rank * size:(rank + 1) * size])  # w2: this rank's input columns (bytes, groups)


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    if target.shape != source.shape:
        raise ValueError(f"this rank's part is {list(source.shape)}, the parameter holds {list(target.shape)}")
    target.copy_(source)
