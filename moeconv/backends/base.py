"""What every backend provides."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from moeconv.canonical import LinearShape, MoELayerShape, QuantizedWeight
from moeconv.spec import TensorSpec

if TYPE_CHECKING:
    import numpy as np

    from moeconv.float_codes import FloatWeight
    from moeconv.packed import PackedWeight


# The two GEMMs of a fused MoE layer and the canonical projections each is made of (gate rows first).
FUSED_GEMMS = {"w13": ("gate", "up"), "w2": ("down",)}


# Modules the engines build fused from several checkpoint linears, by the name of the fused module. An
# engine asks an output's list of float linears about the fused name; where the model class declares the
# fusion it unfuses the name and asks about each shard, but SGLang's DeepseekV2ForCausalLM (engines/) declares
# only fused_qkv_a_proj_with_mqa (`models/deepseek_v2.py :: packed_modules_mapping`), so a dense layer's or a
# shared expert's float gate_proj and up_proj, listed by name, left its gate_up_proj quantized
# (compressed-tensors: "KeyError: 'model.layers.0.mlp.gate_up_proj.weight'"; humming: "'MergedColumnParallelLinear'
# object has no attribute 'weight'"). So when every shard under one parent is listed, the fused name is
# listed too (moonshotai/Kimi-K2-Thinking's own `ignore` covers gate_up_proj). SGLang's rule (adapted from
# vLLM's, `compressed_tensors/utils.py :: should_ignore_layer`) takes a listed fused name as it is, and vLLM
# loads these outputs with every tensor consumed (tests/engines/run_matrix.py --only routed-experts-only).
FUSED_SHARDS = {"gate_up_proj": ("gate_proj", "up_proj")}


def with_fused_names(modules: list[str]) -> list[str]:
    """The float linears `modules`, each fused module whose shards are all among them added after its last shard."""
    listed, result = set(modules), []
    for name in modules:
        result.append(name)
        parent, _, leaf = name.rpartition(".")
        for fused, shards in FUSED_SHARDS.items():
            if leaf == shards[-1] and all(f"{parent}.{shard}" in listed for shard in shards) \
                    and f"{parent}.{fused}" not in listed:
                result.append(f"{parent}.{fused}")
    return result


class ExpertWeights(NamedTuple):
    gate: QuantizedWeight
    up: QuantizedWeight
    down: QuantizedWeight


class Numerics(NamedTuple):
    """How `verify` checks a backend's numerics: the reference kernel that computes the fused MoE (a key
    of moeconv.kernels.runners.LAYER_KERNELS), reading the backend's own tensors, or (`layout`) those of
    the named backend the output is re-encoded into through the canonical form; for float-coded layers
    (`MoELayerShape.float_scheme`), `float_kernel`, which always reads the backend's own tensors (None: no
    reference kernel reads this layout's float codes)."""

    kernel: str
    layout: str | None = None
    float_kernel: str | None = None

    def kernel_for(self, layer: MoELayerShape) -> str | None:
        """The kernel that checks `layer`: `float_kernel` for float codes, else `kernel`."""
        return self.float_kernel if layer.float_scheme is not None else self.kernel


class LinearLayout(Protocol):
    """How a whole-checkpoint scheme (compressed-tensors, humming) lays out ONE quantized linear, dense or an
    expert's projection, and the checkpoint's own quantization_config that describes it. A backend that has
    one (`Backend.linear_layout`) converts the dense quantized linears too (attention, shared experts, dense
    MLPs); a backend that copies them may name another backend's for the source's (`dense_linear_backend`)."""

    name: str  # the registered backend's, recorded per tensor in the manifest
    # How the output holds FP8 block-scaled linears beside the integer ones (DeepSeek's and MiniMax's `weight`
    # F8_E4M3 with `weight_scale_inv` F32, one scale a 128x128 block): source suffix -> output suffix, the
    # bytes copied as they are and the linears described by `checkpoint_quantization_config`; None: a scheme
    # that cannot describe them.
    fp8_block_suffixes: dict[str, str] | None

    def linear_refusal(self, linear: LinearShape) -> str | None:
        """Why this layout cannot take the dense linear, or None if it can."""

    def linear_tensors(self, linear: LinearShape) -> list[TensorSpec]:
        """The tensors of one linear; suffixes are appended to the linear's module path."""

    def encode_linear(self, weight: QuantizedWeight, linear: LinearShape) -> dict[str, np.ndarray]:
        """One linear's tensors, as stored arrays (BF16 as its uint16 bit patterns), in numpy."""

    def decode_linear(self, tensors: dict[str, np.ndarray], linear: LinearShape) -> QuantizedWeight | FloatWeight:
        """Inverse of `encode_linear` (and of `from_float_linear` for float codes); raises ValueError naming
        the tensor where the layout's own redundancy (weight_shape) disagrees."""

    def takes_packed(self, layer: MoELayerShape | LinearShape) -> bool:
        """Whether `from_packed_linear` writes this linear from the packed form (packed.py)."""

    def from_packed_linear(self, weight: PackedWeight, linear: LinearShape) -> dict[str, np.ndarray]:
        """`encode_linear` from the packed form, byte for byte (where `takes_packed` of the linear)."""

    def from_float_linear(self, weight: FloatWeight, linear: LinearShape) -> dict[str, np.ndarray]:
        """One float-coded linear (float_codes.py) as stored arrays; `decode_linear` gives it back."""

    def checkpoint_quantization_config(self, layer: MoELayerShape, model_dtype: str | None,
                                       unquantized_modules: list[str],
                                       fp8_block_modules: tuple[str, ...] = ()) -> dict[str, Any]:
        """The whole `quantization_config`; `unquantized_modules` are the linears left in float,
        `fp8_block_modules` the FP8 block-scaled ones (only with `fp8_block_suffixes`)."""


class Backend(Protocol):
    """One target layout of the MoE layers' experts. Implementations inherit `BackendDefaults`, which holds
    the default of every member a backend may leave out (marked "default:" below); nothing else in moeconv
    probes a backend for a member.

    A backend whose scheme covers the whole checkpoint has a `linear_layout`: it converts the dense quantized
    linears too, and its config is the checkpoint's own quantization_config (`checkpoint_quantization_config`
    of that layout) rather than a section of moeconv's."""

    name: str
    layout_version: int
    numerics: Numerics
    # The per-linear layout of a whole-checkpoint scheme. Default: None (dense linears pass through byte for
    # byte, or in the layout `dense_linear_backend` names).
    linear_layout: LinearLayout | None

    def refusal(self, layer: MoELayerShape) -> str | None:
        """Why this backend cannot take the layer, or None if it can."""

    def layer_tensors(self, layer: MoELayerShape) -> list[TensorSpec]:
        """The stacked tensors of one MoE layer. Dim 0 is the expert, and expert e's slice of every
        tensor is the contiguous e-th block of its bytes, so experts can be written one at a time."""

    def encode_expert(self, expert: ExpertWeights, layer: MoELayerShape) -> dict[str, np.ndarray]:
        """One expert's slice (without the expert dim) of every tensor of `layer_tensors`, as stored arrays
        (BF16 as its uint16 bit patterns), in numpy. `layer` carries what the canonical weights cannot
        (activation_bits: W8A8 and W8A16 weights are alike)."""

    def decode_expert(self, slices: dict[str, np.ndarray], layer: MoELayerShape) -> ExpertWeights:
        """Inverse of `encode_expert`, on the stored arrays; raises ValueError naming the tensor where the
        layout's own redundancy disagrees (weight_shape, compensation sums)."""

    def takes_packed(self, layer: MoELayerShape | LinearShape) -> bool:
        """Whether `from_packed` writes this layer's layout from the packed form (packed.py), the fast path
        of every format that `packs`. Default: False."""

    def from_packed(self, expert: dict[str, PackedWeight], layer: MoELayerShape) -> dict[str, np.ndarray]:
        """`encode_expert`'s slices from the expert's projections (gate, up, down) in the packed form, byte
        for byte what `encode_expert` of their decoding gives (tests/test_packed.py). Only where
        `takes_packed`."""

    # The convention the layout writes an NVFP4 global scale in (float_codes.DIVIDE or MULTIPLY); the plan reads
    # every global scale of a source in the other one and refuses one whose reciprocal is not exact. Default:
    # None (the layout takes no float codes; its `refusal` says so).
    float_global_convention: str | None

    def from_float(self, expert: dict[str, FloatWeight], layer: MoELayerShape) -> dict[str, np.ndarray]:
        """`encode_expert`'s slices from the expert's projections in the canonical float form (float_codes.py),
        as stored arrays. Only for a layer the backend takes whose `float_scheme` is set; its
        `decode_expert` gives FloatWeights back."""

    def quantization_config(self, layer: MoELayerShape) -> dict[str, Any]:
        """Backend fields of the output's quantization config."""

    def dense_linear_backend(self, source_format: Any) -> str | None:
        """For a backend without a `linear_layout`: the registered backend whose linear layout its output
        writes the source's dense quantized linears in instead, when the engine it targets cannot load them
        as the source stores them. Default: None (copied)."""


class BackendDefaults:
    """The default of every member of `Backend` a backend may leave out, declared once: dense linears
    pass through, no packed route, no float codes."""

    linear_layout: LinearLayout | None = None
    float_global_convention: str | None = None

    def from_float(self, expert: dict[str, FloatWeight], layer: MoELayerShape) -> dict[str, np.ndarray]:
        raise NotImplementedError(f"backend {self.name!r} takes no float codes")

    def dense_linear_backend(self, source_format: Any) -> str | None:
        return None

    def takes_packed(self, layer: MoELayerShape | LinearShape) -> bool:
        return False

    def from_packed(self, expert: dict[str, PackedWeight], layer: MoELayerShape) -> dict[str, np.ndarray]:
        raise NotImplementedError(f"backend {self.name!r} has no packed route")
