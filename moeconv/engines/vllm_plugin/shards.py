"""Which part of each stacked `triton` tensor one tensor-parallel rank holds (docs/FORMAT.md), and how it
fills the parameter vLLM's compressed-tensors MoE method holds for it (`fill`).

vLLM splits a MoE layer's intermediate dimension I over the ranks: rank r of T holds gate rows and up
rows [r·I/T, (r+1)·I/T) of w13 and the same input columns of w2. In the stacked layout that is, per
tensor (E experts on dim 0; packed dimensions in bytes, b bits a code):

  w13_qweight (E, 2I, H·b/8), w13_scales (E, 2I, H/g): the two row ranges, gate's then up's;
  w13_qzeros  (E, 2I·b/8, H/g): the same ranges in packed rows (I/T·b/8 each);
  w2_qweight  (E, H, I·b/8): columns [r·I/T·b/8, ...); w2_scales and w2_qzeros (E, ·, I/g): columns
              [r·I/T/g, ...), or, channel-wise (one group over I), the whole tensor on every rank (each
              rank's down projection keeps the one scale of each output channel, as vLLM loads it);
  the int8 W8A8 layout: w13_weight (E, 2I, H) and w13_weight_scale (E, 2I, 1) the two row ranges,
              w2_weight (E, H, I) its columns, w2_weight_scale (E, H, 1) whole on every rank;
  the float layouts: w13_weight_packed (E, 2I, H/2) and w13_weight_scale (E, 2I, H/block) the two row
              ranges, w2_weight_packed (E, H, I/2) columns [r·I/T/2, ...), w2_weight_scale (E, H, I/block)
              groups [r·I/T/block, ...), the global scales (E, 2) and (E,) whole on every rank.

Under expert parallelism (vLLM's --enable-expert-parallel) I is not split; each rank's parameters hold
its share of the experts on dim 0, whole, in the order vLLM's expert map gives (`fill`'s `experts`).

Whether a layer splits at all (I divisible by T, whole bytes and whole groups per rank) is the
backend's own `refusal` with `tp` set, the same check `convert --tp` and `inspect` make.
"""

from __future__ import annotations

import torch

from moeconv.backends.triton import FLOAT, GEMM_OF, INT8, SPLITS, WNA16
from moeconv.canonical import is_channelwise


# The compressed-tensors MoE parameter (vLLM's CompressedTensorsWNA16MoEMethod / W8A8 int8 method, the
# methods vLLM builds for a `compressed-tensors` output) each stacked tensor fills. Both are N-first:
#   w13_weight_packed int32 (E, 2I, H·b/32) holds, as bytes, exactly w13_qweight (E, 2I, H·b/8): codes
#       packed along K, LSB first, 32/b to a word (little-endian, which vLLM's own moe_wna16 view assumes);
#   w13_weight_scale (E, 2I, G) is w13_scales, cast to the parameter's dtype as vLLM's loader casts;
#   w13_weight_zero_point int32 (E, 2I·b/32, G) packs N: byte j of word [e, w, g] is w13_qzeros[e, 4w + j, g];
#   the int8 layout's tensors are the W8A8 method's parameters under the same names, and the float layouts'
#   those of vLLM's compressed-tensors MXFP4 / NVFP4 MoE methods (uint8 codes, the scale bytes in the
#   parameter's own dtype: uint8, float8_e4m3fn; float32 global scales).
PARAMETERS = {
    **{stored: f"{gemm}_{parameter}" for gemm, names in WNA16.items()
       for stored, parameter in zip(names, ("weight_packed", "weight_scale", "weight_zero_point"))},
    **{stored: stored for names in (*INT8.values(), *FLOAT.values()) for stored in names},
}
QWEIGHTS = {names.qweight for names in WNA16.values()}
QZEROS = {names.qzeros for names in WNA16.values()}
WORD_BYTES = 4


def fill(layout: str, name: str, stored: torch.Tensor, parameter: torch.Tensor, intermediate: int, bits: int,
         group_size: int, tp_size: int, rank: int, experts: torch.Tensor | None = None) -> None:
    """Copies rank `rank`'s part of the stacked tensor `name` of `layout` (the file's, whole) into `parameter` (the
    compressed-tensors parameter of `PARAMETERS`, this rank's): every element copied once, no
    intermediate tensor. `experts` (expert parallelism): the global index of the expert each of the
    parameter's slots holds, in slot order; a run of consecutive experts is a view, any other choice one
    gather of those experts. Raises ValueError when the part and the parameter differ in shape."""
    gemm, unit = GEMM_OF[name], SPLITS[layout][name]
    if experts is not None:
        stored = _experts(stored, experts)
    source, target = stored, parameter
    if name in QWEIGHTS:
        target = parameter.view(torch.uint8)
    elif name in QZEROS:  # compare in words: (E, words, 4, G) on both sides
        experts, words, groups = parameter.shape
        if stored.shape[1] % WORD_BYTES:
            raise ValueError(f"{list(stored.shape)} does not pack into int32 words along dim 1")
        target = parameter.view(torch.uint8).view(experts, words, groups, WORD_BYTES).permute(0, 1, 3, 2)
        source = stored.view(stored.shape[0], stored.shape[1] // WORD_BYTES, WORD_BYTES, stored.shape[2])
    if tp_size == 1 or unit is None or (unit == "groups" and is_channelwise(group_size)):
        _copy(target, source)
        return
    per_rank = intermediate // tp_size
    size = {"rows": per_rank, "bytes": per_rank * bits // 8, "groups": per_rank // group_size if unit == "groups" else 0}[unit]
    if gemm == "w13":  # gate rows, then up rows: this rank's range of each, into the halves of the parameter
        if name in QZEROS:
            if size % WORD_BYTES:
                raise ValueError(f"one rank's {size} packed rows of the gate (and of the up) projection are not "
                                 f"whole int32 words")
            size //= WORD_BYTES
        half = source.shape[1] // 2
        for index, start in enumerate((0, half)):
            _copy(target[:, index * size:(index + 1) * size], source[:, start + rank * size:start + (rank + 1) * size])
        return
    _copy(target, source[..., rank * size:(rank + 1) * size])  # w2: this rank's input columns (groups)


def _experts(stored: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    if not len(experts) or int(experts.max()) >= stored.shape[0] or int(experts.min()) < 0:
        raise ValueError(f"experts {experts.tolist()[:4]}... are not among the {stored.shape[0]} stored")
    first = int(experts[0])
    if torch.equal(experts, torch.arange(first, first + len(experts), dtype=experts.dtype)):
        return stored.narrow(0, first, len(experts))
    return stored.index_select(0, experts)


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    if target.shape != source.shape:
        raise ValueError(f"this rank's part is {list(source.shape)}, the parameter holds {list(target.shape)}")
    target.copy_(source)
