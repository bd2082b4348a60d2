"""compressed-tensors' float-coded formats, `nvfp4-pack-quantized` and `mxfp4-pack-quantized` (llm-compressor's
NVFP4, NVFP4A16 and MXFP4A16 presets; docs/FLOAT_SOURCES.md sections 2 and 3, measured on their output).

Per linear (N out, K in):

  weight_packed        uint8 (N, K/2): E2M1 codes, element 2j in the low nibble of byte j
  weight_scale         NVFP4: F8_E4M3 (N, K/16), the block scale; MXFP4: U8 (N, K/32), the UE8M0 exponent byte
  weight_global_scale  NVFP4 only: F32 (1,), g = 448 · 6 / amax, DIVIDED by: W = E2M1(c) · s / g
  input_global_scale   NVFP4 W4A4 only: F32 (1,), the static input global scale (the same convention)

The bytes go into the canonical float form (float_codes.FloatWeight) as they are; a scale byte reserved for
NaN, a zero or non-finite global scale are refused naming the tensor. Other config groups (FP8-block attention
beside MXFP4 experts, the `mixed-precision` checkpoint) are not this format's: their tensors pass through and
the plan describes them (survey.fp8_block_linears).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

import numpy as np

from moeconv.errors import MoeconvError
from moeconv.float_codes import DIVIDE, MXFP4, FloatScheme, FloatWeight, nvfp4
from moeconv.formats.base import Detection, FormatDefaults, Linear, Read, SourceFormat
from moeconv.formats.compressed_tensors import expert_groups, ignored_modules, one_scheme
from moeconv.formats.float_linear import float_weight
from moeconv.spec import TensorSpec

NVFP4_FORMAT, MXFP4_FORMAT = "nvfp4-pack-quantized", "mxfp4-pack-quantized"
COMPRESSED_TENSORS_VERSION = "0.19.0"  # what the fixtures' llm-compressor 0.14.0.1 writes (tests/data/float)
GLOBAL, INPUT = "weight_global_scale", "input_global_scale"
# The weights each format's presets write (compressed_tensors/quantization/quant_scheme.py: NVFP4, NVFP4A16,
# MXFP4A16): what a config must say for the bytes to mean what this module reads.
_WEIGHTS = {NVFP4_FORMAT: {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
            MXFP4_FORMAT: {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}}
_SCALE_DTYPES = {NVFP4_FORMAT: "torch.float8_e4m3fn", MXFP4_FORMAT: "torch.uint8"}
# NVFP4's W4A4 activations: one static global scale a linear (stored), block scales at run time ("local")
_NVFP4_INPUTS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "dynamic": "local"}


@dataclass(frozen=True)
class CompressedTensorsFloat(FormatDefaults):
    format: str = NVFP4_FORMAT
    input_scale: bool = False  # NVFP4 W4A4: each linear stores its input_global_scale
    ignore: tuple[str, ...] = ("lm_head", "re:.*mlp.gate$")
    method: str = "compressed-tensors"
    bits = 4

    @property
    def float_scheme(self) -> FloatScheme:
        return MXFP4 if self.format == MXFP4_FORMAT else nvfp4(DIVIDE, self.input_scale)

    @property
    def group_size(self) -> int:
        return self.float_scheme.block

    @property
    def activation_bits(self) -> int:
        return 4 if self.input_scale else 16

    @property
    def symmetric(self) -> bool:
        return True

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str) -> CompressedTensorsFloat:
        field = f"{where}: quantization_config"
        schemes = {name: _scheme(group, group.get("format") or config.get("format"), f"{field}.config_groups.{name}")
                   for name, group in expert_groups(config, field).items()}
        fmt, input_scale = one_scheme(schemes, field)
        return cls(format=fmt, input_scale=input_scale, ignore=ignored_modules(config, field))

    def suffixes(self) -> tuple[str, ...]:
        if self.format == MXFP4_FORMAT:
            return ("weight_packed", "weight_scale")
        return ("weight_packed", "weight_scale", GLOBAL) + ((INPUT,) if self.input_scale else ())

    def optional_suffixes(self) -> tuple[str, ...]:
        return ()

    vector_suffixes = (GLOBAL, INPUT)

    @classmethod
    def claims(cls, linears: list[Linear]) -> bool:
        """weight_packed bytes (N, K/2), two E2M1 codes each, beside weight_scale."""
        return bool(linears) and all(
            "weight_packed" in tensors and "weight_scale" in tensors and tensors["weight_packed"].dtype == "U8"
            and tuple(tensors["weight_packed"].shape) == (n, k // 2) for tensors, n, k in linears)

    @classmethod
    def from_data(cls, linears: list[Linear], configured: SourceFormat, read: Read,
                  detection: Detection) -> CompressedTensorsFloat | None:
        """The scheme from weight_scale's dtype and columns (U8 per 32: MXFP4; F8_E4M3 per 16 with a
        weight_global_scale: NVFP4), W4A4 from stored input_global_scales."""
        found = set()
        for tensors, _, k in linears:
            scale = tensors["weight_scale"]
            found.add((scale.dtype, k // scale.shape[1] if len(scale.shape) == 2 and scale.shape[1] else None,
                       GLOBAL in tensors, INPUT in tensors))
        if len(found) != 1:
            detection.evidence.append("the expert linears' weight_scale dtypes, blocks or global scales differ")
            return None
        ((dtype, block, stores_global, stores_input),) = found
        if (dtype, block, stores_global) == ("U8", 32, False) and not stores_input:
            fmt = MXFP4_FORMAT
        elif (dtype, block, stores_global) == ("F8_E4M3", 16, True):
            fmt = NVFP4_FORMAT
        else:
            detection.evidence.append(f"weight_scale {dtype} one per {block} inputs"
                                      f"{' with' if stores_global else ', no'} {GLOBAL}: neither MXFP4 nor NVFP4")
            return None
        detection.evidence.append(f"weight_packed U8 {list(linears[0][0]['weight_packed'].shape)} (two E2M1 codes a "
                                  f"byte) and weight_scale {dtype} per {block}: {fmt}"
                                  + (f", {INPUT} stored: W4A4" if stores_input else ""))
        base = configured if isinstance(configured, CompressedTensorsFloat) else cls()
        return replace(base, format=fmt, input_scale=stores_input)

    def linear_shape(self, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, int]:
        out_features, width = shapes["weight_packed"]
        return out_features, width * 2

    def expected(self, out_features: int, in_features: int) -> dict[str, TensorSpec]:
        scheme = self.float_scheme
        specs = {"weight_packed": TensorSpec("weight_packed", (out_features, in_features // 2), "U8"),
                 "weight_scale": TensorSpec("weight_scale", (out_features, in_features // scheme.block),
                                            scheme.scale_dtype)}
        if self.format == NVFP4_FORMAT:
            specs[GLOBAL] = TensorSpec(GLOBAL, (1,), "F32")
            specs[INPUT] = TensorSpec(INPUT, (1,), "F32")
        return specs

    def decode(self, stored: Mapping[str, np.ndarray]) -> FloatWeight:
        return float_weight(self.float_scheme, stored["weight_packed"], stored["weight_scale"],
                            {"global_scale": (GLOBAL, stored.get(GLOBAL)),
                             "input_scale": (INPUT, stored.get(INPUT) if self.input_scale else None)})

    def encode(self, weight: FloatWeight) -> dict[str, np.ndarray]:
        return float_arrays(weight)

    def describe(self) -> dict[str, Any]:
        return {"method": self.method, "format": self.format,
                "scheme": "NVFP4" if self.input_scale else "NVFP4A16" if self.format == NVFP4_FORMAT else "MXFP4A16",
                "bits": 4, "group_size": self.group_size, "symmetric": True, "codes": self.float_scheme.describe()}

    def quantization_config(self) -> dict[str, Any]:
        """What llm-compressor writes for the scheme (the fixtures' config.json)."""
        return {"config_groups": {"group_0": config_group(self.float_scheme)}, "format": self.format,
                "ignore": list(self.ignore), "quant_method": self.method, "quantization_status": "compressed",
                "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
                "global_compression_ratio": None, "version": COMPRESSED_TENSORS_VERSION}


def format_of(scheme: FloatScheme) -> str:
    return MXFP4_FORMAT if scheme.name == "mxfp4" else NVFP4_FORMAT


def config_group(scheme: FloatScheme, targets: tuple[str, ...] = ("Linear",)) -> dict[str, Any]:
    """The config group compressed-tensors writes for a float scheme (its NVFP4, NVFP4A16, MXFP4A16 presets)."""
    fmt = format_of(scheme)
    weights = {**_WEIGHTS[fmt], "symmetric": True, "dynamic": False, "actorder": None, "block_structure": None,
               "observer": "memoryless_minmax", "observer_kwargs": {}, "scale_dtype": _SCALE_DTYPES[fmt],
               "zp_dtype": None}
    inputs = None
    if scheme.input_scale:
        inputs = {**_NVFP4_INPUTS, "symmetric": True, "actorder": None, "block_structure": None,
                  "observer": "static_minmax", "observer_kwargs": {}, "scale_dtype": _SCALE_DTYPES[fmt],
                  "zp_dtype": None}
    return {"format": fmt, "targets": list(targets), "weights": weights, "input_activations": inputs,
            "output_activations": None}


def _scheme(group: Mapping[str, Any], fmt: Any, field: str) -> tuple[str, bool]:
    """(format, whether the linears store input global scales) of one experts' group, or a refusal naming the
    field: anything but what the presets write would make the bytes mean something else."""
    if fmt not in _WEIGHTS:
        raise MoeconvError(f"{field}: format {fmt!r} is not a float-coded format moeconv reads "
                           f"(supported: {', '.join(_WEIGHTS)}); the experts must be float-coded here")
    weights = group.get("weights")
    if not isinstance(weights, Mapping):
        raise MoeconvError(f"{field}.weights is missing: the experts would not be quantized")
    for key, value in {**_WEIGHTS[fmt], "symmetric": True}.items():
        if weights.get(key, True if key == "symmetric" else None) != value:
            raise MoeconvError(f"{field}.weights.{key} is {weights.get(key)!r}; {fmt} stores {value!r}")
    if weights.get("dynamic"):
        raise MoeconvError(f"{field}.weights.dynamic is true: weights quantized at run time are not stored")
    if weights.get("scale_dtype") not in (None, _SCALE_DTYPES[fmt]):
        raise MoeconvError(f"{field}.weights.scale_dtype is {weights['scale_dtype']!r}; {fmt} stores "
                           f"{_SCALE_DTYPES[fmt]}")
    inputs = group.get("input_activations")
    if not inputs:
        return fmt, False
    if fmt == NVFP4_FORMAT and isinstance(inputs, Mapping) and all(
            inputs.get(key) == value for key, value in _NVFP4_INPUTS.items()):
        return fmt, True
    raise MoeconvError(f"{field}.input_activations is not read: {fmt} with 16-bit activations, or NVFP4 W4A4 with "
                       f"a static input global scale (num_bits 4, type float, strategy tensor_group, group_size 16, "
                       f"dynamic 'local')")


def float_arrays(weight: FloatWeight) -> dict[str, np.ndarray]:
    """The canonical float form -> compressed-tensors' arrays (weight_packed, weight_scale, the global scales
    as (1,), divided by: FloatWeight.in_convention, exact or ValueError); the compressed-tensors backend
    writes the same."""
    weight = weight.in_convention(DIVIDE)
    arrays = {"weight_packed": weight.packed, "weight_scale": weight.scales}
    if weight.global_scale is not None:
        arrays[GLOBAL] = weight.global_scale.reshape(1)
    if weight.input_scale is not None:
        arrays[INPUT] = weight.input_scale.reshape(1)
    return arrays
