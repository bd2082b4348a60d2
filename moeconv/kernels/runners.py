"""The reference kernels `verify` runs on a converted layer, by name: each reads one layout's tensors
(keyed by suffix, restricted to the experts the routing uses, dim 0 renumbered from 0) and computes
the fused MoE. A backend names the one that reads its layout (`Backend.numerics`; `kernel_of` for a layer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

from moeconv.canonical import MoELayerShape

if TYPE_CHECKING:  # the kernels import torch when they run; verify's lossless level reads only the tolerances
    import torch

    from moeconv.backends.base import Numerics

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


def _run_triton_fp4(tensors: dict[str, torch.Tensor], shape: MoELayerShape, x: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The FP4 kernel (kernels/fp4_moe.py) on the compressed-tensors float layout: each projection's
    `weight_packed` and `weight_scale` bytes, gate and up stacked into w13 as vLLM stacks them, each linear's
    `weight_global_scale` one segment of its GEMM's global scale (NVFP4), divided by."""
    import torch

    from moeconv.kernels.fp4_moe import Fp4Experts, fp4_fused_moe

    from moeconv.backends.compressed_tensors import GLOBAL_SCALE, CompressedTensorsBackend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    scheme = shape.float_scheme.in_convention(CompressedTensorsBackend.float_global_convention)

    def experts(*names: str) -> Fp4Experts:
        def cat(suffix: str) -> torch.Tensor:
            return torch.cat([tensors[f"{name}.{suffix}"].to(device) for name in names], dim=1)

        globals_ = (None if scheme.global_convention is None else
                    torch.cat([tensors[f"{name}.{GLOBAL_SCALE}"].reshape(-1, 1).to(device) for name in names], dim=1))
        return Fp4Experts(cat("weight_packed"), cat("weight_scale"), globals_)

    gate, up, down = shape.projection_names
    return fp4_fused_moe(x.to(device), experts(gate, up), experts(down), topk_weights.to(device),
                         topk_ids.to(device), scheme=scheme).cpu()


def _run_triton_fp4_stacked(tensors: dict[str, torch.Tensor], shape: MoELayerShape, x: torch.Tensor,
                            topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The FP4 kernel (kernels/fp4_moe.py) on the triton backend's float layouts: the stacked tensors are the
    kernel's own (`w13_weight_packed`, `w13_weight_scale`, `w13_weight_global_scale` (E, 2) gate's and up's)."""
    import torch

    from moeconv.kernels.fp4_moe import Fp4Experts, fp4_fused_moe

    from moeconv.backends.triton import FLOAT, TritonBackend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    scheme = shape.float_scheme.in_convention(TritonBackend.float_global_convention)

    def experts(gemm: str) -> Fp4Experts:
        names = FLOAT[gemm]
        globals_ = tensors.get(names.weight_global_scale)
        return Fp4Experts(tensors[names.weight_packed].to(device), tensors[names.weight_scale].to(device),
                          None if globals_ is None else globals_.reshape(globals_.shape[0], -1).to(device))

    return fp4_fused_moe(x.to(device), experts("w13"), experts("w2"), topk_weights.to(device),
                         topk_ids.to(device), scheme=scheme).cpu()


def _run_humming_fp4(tensors: dict[str, torch.Tensor], shape: MoELayerShape, x: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The FP4 kernel (kernels/fp4_moe.py) on Humming's float layout: each projection's int32 `weight` words
    split back into their bytes, least significant first (the codes two a byte), its `weight_scale` bytes (F8_E8M0 or F8_E4M3,
    read as bytes), gate and up stacked into w13, each linear's `weight_scale_2` one segment of its GEMM's global
    scale (NVFP4), multiplied by."""
    import torch

    from moeconv.kernels.fp4_moe import Fp4Experts, fp4_fused_moe
    from moeconv.packing import unpack_array

    from moeconv.backends.humming import WEIGHT_SCALE_2, HummingBackend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    scheme = shape.float_scheme.in_convention(HummingBackend.float_global_convention)

    def code_bytes(words: torch.Tensor) -> torch.Tensor:  # (E, N, K/8) int32 -> (E, N, K/2) uint8, by shifts
        return torch.from_numpy(unpack_array(words.numpy(), 8, axis=-1))

    def experts(*names: str) -> Fp4Experts:
        codes = torch.cat([code_bytes(tensors[f"{name}.weight"]) for name in names], dim=1).to(device)
        scales = torch.cat([tensors[f"{name}.weight_scale"] for name in names], dim=1).to(device)
        globals_ = (None if scheme.global_convention is None else
                    torch.cat([tensors[f"{name}.{WEIGHT_SCALE_2}"].reshape(-1, 1) for name in names], dim=1).to(device))
        return Fp4Experts(codes, scales, globals_)

    gate, up, down = shape.projection_names
    return fp4_fused_moe(x.to(device), experts(gate, up), experts(down), topk_weights.to(device),
                         topk_ids.to(device), scheme=scheme).cpu()


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


def kernel_of(numerics: Numerics, layer: MoELayerShape) -> LayerKernel | None:
    """The kernel that checks `layer` of a backend with these `numerics`; None where none reads its codes."""
    name = numerics.kernel_for(layer)
    return None if name is None else LAYER_KERNELS[name]


def layer_tolerance(numerics: Numerics, layer: MoELayerShape) -> float:
    """The relative error the kernel checking `layer` allows (NUMERICS_TOLERANCE where none runs)."""
    kernel = kernel_of(numerics, layer)
    return NUMERICS_TOLERANCE if kernel is None else kernel.tolerance(layer)


LAYER_KERNELS: dict[str, LayerKernel] = {
    "triton": LayerKernel(_run_triton, _triton_device, _triton_tolerance),
    # W4A16 arithmetic (the activations of an NVFP4 W4A4 checkpoint are not quantized: the check is of the
    # weights' bytes), so the W4A16 bound holds: measured 2.3e-4 to 5e-4 with fp16 activations on random layers
    # (tests/test_fp4_kernel.py), 3.7e-4 to 4.3e-4 on the producers' fixtures (tests/test_float_conversion.py)
    "triton-fp4": LayerKernel(_run_triton_fp4, _triton_device, lambda shape: NUMERICS_TOLERANCE),
    # the same kernel and bound, fed from the triton backend's stacked float layouts
    "triton-fp4-stacked": LayerKernel(_run_triton_fp4_stacked, _triton_device, lambda shape: NUMERICS_TOLERANCE),
    # the same kernel and bound, fed from Humming's float layout (int32 words, F8 scale bytes, multiplied scales)
    "humming-fp4": LayerKernel(_run_humming_fp4, _triton_device, lambda shape: NUMERICS_TOLERANCE),
    "cpu": LayerKernel(_run_cpu, lambda: "cpu (torch model of the x86 W4A8 / W8A8 kernels)",
                       lambda shape: W8A8_NUMERICS_TOLERANCE),
}
