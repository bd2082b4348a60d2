"""The reference kernels `verify` runs on a converted layer, by name: each reads one layout's tensors
(keyed by suffix, restricted to the experts the routing uses, dim 0 renumbered from 0) and computes
the fused MoE. A backend names the one that reads its layout (`Backend.numerics`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

from moeconv.canonical import MoELayerShape

if TYPE_CHECKING:  # the kernels import torch when they run; verify's lossless level reads only the tolerances
    import torch

# Relative error ‖out − ref‖ / ‖ref‖ allowed for the kernel with fp16 activations against the
# float64 reference of the source. The kernel rounds activations, the fused gate/up output and
# the down output to fp16 (unit roundoff 4.9e-4); with fp32 accumulation the measured error on
# random inputs stays near 1e-3, so 1e-2 leaves room for unlucky routing without hiding a wrong
# nibble (a single wrong code in a layer moves the error by orders of magnitude more).
NUMERICS_TOLERANCE = 1e-2
# W8A8 kernels also round each GEMM's input to int8 per token (scale max|a| / 127), which the
# float reference does not: ‖δa‖ / ‖a‖ ≈ (max|a| / rms a) / (127 · √12) per GEMM, with max / rms ≈
# √(2 ln K) ≈ 3-4.4 for random tokens and heavier tails after SiLU-and-mul. Measured on random
# layers: 1.3e-2 (H=128) to 3.0e-2 (H=4096, I=14336); 6e-2 leaves 2x room, and a layout mistake
# still shows as an error of order 1. The x86 CPU kernels' W4A8 and W8A8 round activations to int8
# per row too: measured 1.3e-2 (H=128) to 2.6e-2 (H=4096, I=1536).
W8A8_NUMERICS_TOLERANCE = 6e-2

Run = Callable[[dict[str, "torch.Tensor"], MoELayerShape, "torch.Tensor", "torch.Tensor", "torch.Tensor"], "torch.Tensor"]


class LayerKernel(NamedTuple):
    """A kernel that computes one layer's fused MoE from a layout's tensors, where it runs, and the
    relative error its arithmetic allows."""

    run: Run
    device: Callable[[], str]
    tolerance: Callable[[MoELayerShape], float]


def _run_triton(tensors: dict[str, torch.Tensor], shape: MoELayerShape, x: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    import torch

    from moeconv.kernels.fused_moe import fused_moe
    from moeconv.kernels.int8_moe import int8_fused_moe

    from moeconv.backends.triton import INT8, WNA16

    device = "cuda" if torch.cuda.is_available() else "cpu"
    on = {name: tensor.to(device) for name, tensor in tensors.items()}
    if shape.activation_bits == 8:
        w13, w2 = INT8["w13"], INT8["w2"]
        return int8_fused_moe(x.to(device), on[w13.weight], on[w13.weight_scale], on[w2.weight],
                              on[w2.weight_scale], topk_weights.to(device), topk_ids.to(device)).cpu()
    w13, w2 = WNA16["w13"], WNA16["w2"]
    return fused_moe(
        x.to(device), on[w13.qweight], on[w13.scales], on.get(w13.qzeros),
        on[w2.qweight], on[w2.scales], on.get(w2.qzeros),
        topk_weights.to(device), topk_ids.to(device), bits=shape.bits, group_size=shape.group_size,
    ).cpu()


def _run_cpu(tensors: dict[str, torch.Tensor], shape: MoELayerShape, x: torch.Tensor,
             topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The x86 kernels' semantics (W4A8 or W8A8: activations rounded to uint8 per row), read from the
    blocked INT4 or VNNI INT8 layout."""
    from moeconv.kernels.cpu_reference import cpu_fused_moe

    return cpu_fused_moe(tensors, shape, x, topk_weights, topk_ids)


def _triton_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu (Triton interpreter)"


def _triton_tolerance(shape: MoELayerShape) -> float:
    return W8A8_NUMERICS_TOLERANCE if shape.activation_bits == 8 else NUMERICS_TOLERANCE


LAYER_KERNELS: dict[str, LayerKernel] = {
    "triton": LayerKernel(_run_triton, _triton_device, _triton_tolerance),
    "cpu": LayerKernel(_run_cpu, lambda: "cpu (torch model of the x86 W4A8 / W8A8 kernels)",
                       lambda shape: W8A8_NUMERICS_TOLERANCE),
}
