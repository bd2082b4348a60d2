"""The casts `convert --cast` writes (issue 41): a float-coded source's experts and float-coded dense linears
as plain BF16 or as block-FP8, each linear under the checkpoint's own names (docs/FORMAT.md, "Cast outputs").
What the values are is `moeconv.casts`' (one definition, decided per block before any write); this module is
the layout and the config an engine reads:

  bf16        weight            BF16 (N, K)
  fp8-block   weight            F8_E4M3 (N, K)
              weight_scale_inv  F32 (ceil(N/128), ceil(K/128)), a power of two per 128 x 128 block, multiplied
  nvfp4       weight_packed        U8 (N, K/2): E2M1 codes, element 2j in the low nibble of byte j
  (MXFP4      weight_scale         F8_E4M3 (N, K/16), 2^(b - 127) / G for the group's UE8M0 byte b
   sources)   weight_global_scale  F32 (1,), 1 / G with G = 2^γ, divided by

Experts stacked on disk (gpt-oss: `mlp.experts.gate_up_proj_blocks [E, 2I, H/32, 16]`) are cast to BF16 only,
and written stacked in the float form that family's own model class holds and every engine's loader of it reads
(transformers' `GptOssExperts`, vLLM's and SGLang's `GptOssForCausalLM` with no quantization_config), their
stacked biases copied as they are by the plan:

  bf16 (stacked)  <gate_up>  BF16 (E, H, 2I): expert e's gate and up, input-first, their columns in the
                             source's row order (interleaved: gate column i at 2i, up at 2i + 1)
                  <down>     BF16 (E, I, H): expert e's down, input-first

The config is the one the engines' own FP8 block checkpoints carry (vLLM's `Fp8Config.from_config`:
quant_method fp8, activation_scheme dynamic, weight_block_size [128, 128]) with the linears left in BF16 in
`ignored_layers`; a BF16 cast of a source with nothing else quantized is a plain checkpoint with no
quantization_config at all. An NVFP4 cast is the compressed-tensors form the compressed-tensors backend writes for
NVFP4 sources (llm-compressor's NVFP4A16 preset: `nvfp4-pack-quantized`, one config group for every Linear), its
config that backend's. FP8 block-scaled dense linears beside the float-coded experts (DeepSeek's,
compressed-tensors' FP8_BLOCK group) are copied as they are, their scale renamed `weight_scale_inv`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from moeconv import casts
from moeconv.backends.base import ExpertWeights, Numerics, with_fused_names
from moeconv.backends.compressed_tensors import CompressedTensorsBackend
from moeconv.backends.per_linear import PerLinearBackend, per_rank_refusal, projection_shapes
from moeconv.canonical import PROJECTIONS, LinearShape, MoELayerShape, QuantizedWeight
from moeconv.float_codes import DIVIDE, nvfp4
from moeconv.models import ROW_ORDERS
from moeconv.spec import TensorSpec

if TYPE_CHECKING:
    from moeconv.float_codes import FloatWeight

FP8_BLOCK = casts.FP8_BLOCK_SHAPE[0]
NVFP4_CAST = nvfp4(DIVIDE, False)  # what an NVFP4 cast writes: NVFP4A16, the global scale divided by


class CastBackend(PerLinearBackend):
    """One cast target; `target` is a key of `casts.CASTS`."""

    target: str
    layout_version = 1
    fp8_block_suffixes = {"weight": "weight", "weight_scale_inv": "weight_scale_inv", "weight_scale": "weight_scale_inv"}
    # no reference kernel reads a cast's values: verify's lossless level compares every one of them exactly
    numerics = Numerics("triton", float_kernel=None)

    @property
    def quantized(self) -> bool:
        """Whether the cast linears stay quantized (listed in no `ignored_layers`)."""
        return self.target != casts.BF16

    def refusal(self, layer: MoELayerShape) -> str | None:
        scheme = layer.float_scheme
        if scheme is None:
            return (f"--cast {self.target} takes float codes (MXFP4, NVFP4); these experts are "
                    f"{layer.bits}-bit integer codes")
        if self.target not in casts.TARGETS[scheme.name]:
            return (f"no {self.target} cast of {scheme.name} codes is decided (from {scheme.name}: "
                    f"{', '.join(target for target in casts.TARGETS[scheme.name] if target in casts.CASTS)})")
        if layer.stacked_rows is not None:
            if self.target != casts.BF16 or layer.stacked_rows not in ROW_ORDERS:
                return (f"experts stacked on disk (gate and up {layer.stacked_rows}) are written in their stacked "
                        f"BF16 form only (--cast bf16), the float form their model class and the engines read")
        elif layer.expert_biases:
            return "its experts carry biases, which no cast writes yet"
        return per_rank_refusal(layer, lambda what, size: None)

    def linear_refusal(self, linear: LinearShape) -> str | None:
        scheme = linear.float_scheme
        if scheme is None or self.target not in casts.TARGETS[scheme.name]:
            return f"--cast {self.target} takes float codes ({', '.join(sorted(casts.TARGETS))}) it decides"
        return None

    def linear_tensors(self, linear: LinearShape) -> list[TensorSpec]:
        n, k = linear.out_features, linear.in_features
        if self.target == casts.BF16:
            return [TensorSpec("weight", (n, k), "BF16")]
        if self.target == casts.NVFP4:
            return CompressedTensorsBackend().linear_tensors(replace(linear, float_scheme=NVFP4_CAST))
        return [TensorSpec("weight", (n, k), "F8_E4M3"),
                TensorSpec("weight_scale_inv", (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK)), "F32")]

    def layer_tensors(self, layer: MoELayerShape) -> list[TensorSpec]:
        if layer.stacked_rows is None:
            return super().layer_tensors(layer)
        gate_up, _, down = layer.projection_names
        experts, hidden, intermediate = layer.experts, layer.hidden, layer.intermediate
        return [TensorSpec(gate_up, (experts, hidden, 2 * intermediate), "BF16", derives_from=("gate", "up")),
                TensorSpec(down, (experts, intermediate, hidden), "BF16", derives_from=("down",))]

    def encode_linear(self, weight: QuantizedWeight, linear: LinearShape) -> dict[str, np.ndarray]:
        raise NotImplementedError(f"--cast {self.target} writes float codes only (its refusal says so)")

    def takes_packed(self, layer: MoELayerShape | LinearShape) -> bool:
        return False

    def from_float(self, expert: dict[str, FloatWeight], layer: MoELayerShape) -> dict[str, np.ndarray]:
        """Each projection's cast; an nvfp4 cast's gate and up under one global scale (casts.shared_exponents)."""
        if layer.stacked_rows is not None:
            return _stacked(layer, {projection: casts.cast_arrays(expert[projection], casts.BF16)["weight"]
                                    for projection in PROJECTIONS})
        shared = casts.shared_exponents(expert, self.target)
        return {f"{name}.{suffix}": array
                for name, projection, linear in zip(layer.projection_names, PROJECTIONS, projection_shapes(layer))
                for suffix, array in casts.cast_arrays(expert[projection], self.target, shared[projection]).items()}

    def from_float_linear(self, weight: FloatWeight, linear: LinearShape) -> dict[str, np.ndarray]:
        return casts.cast_arrays(weight, self.target)

    def decode_linear(self, tensors: dict[str, np.ndarray], linear: LinearShape) -> casts.CastWeight:
        return casts.CastWeight.of(self.target, tensors)

    def decode_expert(self, slices: dict[str, np.ndarray], layer: MoELayerShape) -> ExpertWeights:
        if layer.stacked_rows is None:
            return super().decode_expert(slices, layer)
        gate_up, _, down = layer.projection_names
        columns = {projection: slice(first, None, step)
                   for projection, (first, step) in ROW_ORDERS[layer.stacked_rows].items()}
        weights = {projection: np.ascontiguousarray(slices[gate_up][:, columns[projection]].T)
                   for projection in ("gate", "up")}
        weights["down"] = np.ascontiguousarray(slices[down].T)
        return ExpertWeights(**{projection: casts.CastWeight.of(casts.BF16, {"weight": weight})
                                for projection, weight in weights.items()})

    def quantization_config(self, layer: MoELayerShape) -> dict[str, Any]:
        return self.checkpoint_quantization_config(layer, None, [])

    def checkpoint_quantization_config(self, layer: MoELayerShape, model_dtype: str | None,
                                       unquantized_modules: list[str],
                                       fp8_block_modules: tuple[str, ...] = ()) -> dict[str, Any]:
        """vLLM's block-FP8 config (quantization/fp8.py, `Fp8Config.from_config`: `ignored_layers` matched
        exactly against each linear's and each MoE layer's module name, a fused one through its shards), or
        none: a BF16 cast where nothing stays quantized."""
        if not self.quantized and not fp8_block_modules:
            return {}
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [FP8_BLOCK, FP8_BLOCK], "ignored_layers": with_fused_names(unquantized_modules)}


def _stacked(layer: MoELayerShape, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Expert e's block of each stacked tensor from its projections' BF16 (N, K) bit patterns: input-first,
    gate and up in the columns their rows held in the source (models.ROW_ORDERS)."""
    gate_up_name, _, down_name = layer.projection_names
    gate_up = np.empty((layer.hidden, 2 * layer.intermediate), dtype=weights["gate"].dtype)
    for projection, (first, step) in ROW_ORDERS[layer.stacked_rows].items():
        gate_up[:, first::step] = weights[projection].T
    return {gate_up_name: gate_up, down_name: np.ascontiguousarray(weights["down"].T)}


class Bf16Cast(CastBackend):
    name = "bf16"
    target = casts.BF16


class Fp8BlockCast(CastBackend):
    name = "fp8-block"
    target = casts.FP8_BLOCK


class Nvfp4Cast(CastBackend):
    name = "nvfp4"
    target = casts.NVFP4
    fp8_block_suffixes = CompressedTensorsBackend.fp8_block_suffixes

    def checkpoint_quantization_config(self, layer: MoELayerShape, model_dtype: str | None,
                                       unquantized_modules: list[str],
                                       fp8_block_modules: tuple[str, ...] = ()) -> dict[str, Any]:
        """The compressed-tensors backend's config for NVFP4A16 experts (compressed-tensors' own
        `QuantizationConfig`, what vLLM reads to pick its NVFP4 MoE method)."""
        return CompressedTensorsBackend().checkpoint_quantization_config(
            replace(layer, float_scheme=NVFP4_CAST), model_dtype, unquantized_modules, fp8_block_modules)
