"""compressed-tensors checkpoints (quant_method "compressed-tensors"; llm-compressor output).

Two storage formats (compressed-tensors 0.20.1, `PackedQuantizationCompressor` / `IntQuantizationCompressor`):

* `pack-quantized` (W4A16, W8A16): `weight_packed` int32 (N, K·b/32) holds offset-binary codes
  c = q + 2^(b−1) of the signed values q, packed along K LSB-first; `weight_scale` (N, K/g), or
  (N, 1) for the channel strategy; `weight_shape` int64 [N, K]; asymmetric schemes add
  `weight_zero_point` int32 (N·b/32, K/g), packed along N and offset-binary too (z = zp + 2^(b−1)).
  Both sides carry the same offset, so c − z = q − zp: the stored zero point IS the canonical true
  zero, with no ±1 correction; symmetric schemes have the implicit zero 2^(b−1).
* `int-quantized` / `naive-quantized` (W8A8 INT8, or W8A16 without input activations): `weight` int8
  (N, K) signed and symmetric, `weight_scale` (N, 1) per channel.

Signed INT8 in the canonical form: codes = w + 128 as uint8 (XOR 0x80 on the two's-complement
byte), zeros None (the implicit 128), bits 8, group size K, scales as stored. The mapping is a
bijection on bytes, so nothing is lost; (codes − 128) · scale is the stored dequantization.
That activations are dynamically int8-quantized per token is a property of the scheme, not of the
weights: it travels as `activation_bits` (8 for W8A8, 16 otherwise) to `MoELayerShape`.

Only widths that tile an int32 word (4, 8) are read; K and N must be multiples of 32/b (true of
every MoE size in practice), so the dense packing compressed-tensors uses for odd widths never
splits a value across words here. The experts must fall under one scheme (one config group, or
several groups with the same scheme).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

import numpy as np

from moeconv import act_order, packing
from moeconv.canonical import QuantizedWeight
from moeconv.errors import MoeconvError
from moeconv.packed import PackedWeight
from moeconv.spec import TensorSpec
from moeconv.checkpoint.schema import section
from moeconv.formats.base import (Detection, FormatDefaults, Linear, Read, SourceFormat, checked_group_size, config_bool,
                                  config_int, config_pattern, effective_group_size, group_size_from_shapes, groups_of,
                                  static_groups_only)
from moeconv.models import ARCHITECTURES

PACK_QUANTIZED = "pack-quantized"
INT_QUANTIZED = "int-quantized"
NAIVE_QUANTIZED = "naive-quantized"
_BITS = {PACK_QUANTIZED: (4, 8), INT_QUANTIZED: (8,), NAIVE_QUANTIZED: (8,)}
# actorder "weight" (alias "static") only changes calibration; "group" ("dynamic") stores each linear's
# weight_g_idx, read like GPTQ's act-order g_idx (act_order.py).
ACTORDERS = (None, False, "weight", "static", "group", "dynamic")
GROUP_ACTORDERS = ("group", "dynamic")
COMPRESSED_TENSORS_VERSION = "0.20.1"

# Module names of routed-expert linears in every naming scheme moeconv reads: a config group whose
# targets match one of them quantizes the experts.
_EXPERT_LINEAR_NAMES = tuple(
    f"model.layers.0.{parent}.experts.0.{projection}"
    for architecture in ARCHITECTURES.values()
    for parent in architecture.parents
    for projection in architecture.projections
)


@dataclass(frozen=True)
class CompressedTensors(FormatDefaults):
    format: str = PACK_QUANTIZED
    bits: int = 4
    group_size: int = 128  # -1: channel strategy
    symmetric: bool = True
    activation_bits: int = 16  # 8: dynamic per-token symmetric int8 activations (W8A8)
    ignore: tuple[str, ...] = ("lm_head", "re:.*mlp.gate$")
    method: str = "compressed-tensors"

    @property
    def packed(self) -> bool:
        return self.format == PACK_QUANTIZED

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str) -> CompressedTensors:
        field = f"{where}: quantization_config"
        schemes = {name: _scheme(group, group.get("format") or config.get("format"), f"{field}.config_groups.{name}")
                   for name, group in expert_groups(config, field).items()}
        fmt, bits, group_size, symmetric, activation_bits = one_scheme(schemes, field)
        return cls(format=fmt, bits=bits, group_size=group_size, symmetric=symmetric,
                   activation_bits=activation_bits, ignore=ignored_modules(config, field))

    @staticmethod
    def configures_act_order(config: Mapping[str, Any]) -> bool:
        """A config group with actorder "group": its linears store weight_g_idx."""
        groups = config.get("config_groups")
        return isinstance(groups, dict) and any(
            isinstance(group, dict) and isinstance(group.get("weights"), dict)
            and group["weights"].get("actorder") in GROUP_ACTORDERS for group in groups.values())

    def suffixes(self) -> tuple[str, ...]:
        if not self.packed:
            return ("weight", "weight_scale")
        required = ("weight_packed", "weight_scale", "weight_shape")
        return required if self.symmetric else required + ("weight_zero_point",)

    def optional_suffixes(self) -> tuple[str, ...]:
        return ("weight_g_idx",) if self.packed else ()

    vector_suffixes = ("weight_shape", "weight_g_idx")
    group_index_suffix = "weight_g_idx"  # actorder "group": the group of each input channel (act_order.py)

    @classmethod
    def claims(cls, linears: list[Linear]) -> bool:
        """pack-quantized: weight_packed int32 words and weight_scale (int-quantized W8A8 is read from the config;
        the float schemes' weight_packed is bytes: compressed_tensors_float.py)."""
        return bool(linears) and all({"weight_packed", "weight_scale"} <= set(tensors)
                                     and tensors["weight_packed"].dtype == "I32" for tensors, _, _ in linears)

    @classmethod
    def from_data(cls, linears: list[Linear], configured: SourceFormat, read: Read,
                  detection: Detection) -> CompressedTensors | None:
        """Bits from weight_packed's words per row, the group size from weight_scale's columns, symmetry
        from whether zero points are stored."""
        widths = {tensors["weight_packed"].shape[1] * 32 // k for tensors, _, k in linears}
        if len(widths) != 1 or not widths <= {4, 8}:
            detection.evidence.append(f"weight_packed rows hold {sorted(widths)} bits per weight")
            return None
        (bits,) = widths
        detection.evidence.append(f"weight_packed {list(linears[0][0]['weight_packed'].shape)}: {bits}-bit")
        group_size = group_size_from_shapes([(tensors["weight_scale"], 1, k) for tensors, _, k in linears],
                                            configured.group_size, detection)
        if group_size is None:
            return None
        stored = {"weight_zero_point" in tensors for tensors, _, _ in linears}
        if len(stored) != 1:
            detection.evidence.append("some expert linears store zero points and others do not")
            return None
        symmetric = not stored.pop()
        detection.evidence.append("no weight_zero_point: symmetric" if symmetric
                                  else "weight_zero_point stored: asymmetric")
        base = configured if isinstance(configured, CompressedTensors) else cls()
        return replace(base, bits=bits, group_size=group_size, symmetric=symmetric)

    def linear_shape(self, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, int]:
        if not self.packed:
            return tuple(shapes["weight"])
        out_features, words = shapes["weight_packed"]
        return out_features, words * 32 // self.bits

    def expected(self, out_features: int, in_features: int) -> dict[str, TensorSpec]:
        groups = groups_of(in_features, self.group_size)
        if not self.packed:
            return {"weight": TensorSpec("weight", (out_features, in_features), "I8"),
                    "weight_scale": TensorSpec("weight_scale", (out_features, 1), None)}
        return {
            "weight_packed": TensorSpec("weight_packed", (out_features, in_features * self.bits // 32), "I32"),
            "weight_scale": TensorSpec("weight_scale", (out_features, groups), None),
            "weight_shape": TensorSpec("weight_shape", (2,), "I64"),
            "weight_zero_point": TensorSpec("weight_zero_point", (out_features * self.bits // 32, groups), "I32"),
            "weight_g_idx": TensorSpec("weight_g_idx", (in_features,), "I32"),
        }

    def decode(self, stored: Mapping[str, np.ndarray]) -> QuantizedWeight:
        """Static (or relabelled) groups only: an act-order weight_g_idx is refused (act_order.py)."""
        return static_groups_only(self.decode_ordered(stored))

    def decode_ordered(self, stored: Mapping[str, np.ndarray]) -> tuple[QuantizedWeight, np.ndarray | None]:
        """The canonical form, and for actorder "group" the input permutation P under which it holds
        (the stored linear is W[:, P]); None for static groups."""
        if self.packed:
            codes = packing.unpack_array(stored["weight_packed"], self.bits, axis=1)
            stated = tuple(stored["weight_shape"].tolist())
            if stated != tuple(codes.shape):
                raise MoeconvError(f"weight_shape says {list(stated)}, weight_packed holds {list(codes.shape)}")
        else:
            codes = packing.int8_array_to_offset_codes(stored["weight"])
        zeros = None
        if not self.symmetric:
            zeros = packing.unpack_array(stored["weight_zero_point"], self.bits, axis=0)
        group_size = effective_group_size(codes.shape[1], self.group_size)
        codes, zeros, scales, inputs = act_order.static_form(codes, zeros, np.ascontiguousarray(stored["weight_scale"]),
                                                             stored.get("weight_g_idx"), group_size)
        return QuantizedWeight(codes=codes, zeros=zeros, scales=scales, bits=self.bits, group_size=group_size), inputs

    @property
    def packs(self) -> bool:
        """pack-quantized's words are the packed form's (int-quantized's bytes are not packed)."""
        return self.packed

    def to_packed(self, stored: Mapping[str, np.ndarray]) -> PackedWeight | None:
        """The words as they are, checked as `decode` checks them; None for a weight_g_idx that is not
        k // g (the canonical route folds act-order or refuses it)."""
        words = stored["weight_packed"]
        shape = (words.shape[0], words.shape[1] * 32 // self.bits)
        stated = tuple(int(size) for size in stored["weight_shape"].reshape(-1))
        if stated != shape:
            raise MoeconvError(f"weight_shape says {list(stated)}, weight_packed holds {list(shape)}")
        group_size = effective_group_size(shape[1], self.group_size)
        g_idx = stored.get("weight_g_idx")
        if g_idx is not None and act_order.group_order(g_idx, group_size).kind != act_order.STATIC:
            return None
        return PackedWeight(words=words, zero_words=None if self.symmetric else stored["weight_zero_point"],
                            scales=stored["weight_scale"], bits=self.bits, group_size=group_size)

    def encode(self, weight: QuantizedWeight) -> dict[str, np.ndarray]:
        if not self.packed:
            return {"weight": packing.offset_codes_to_int8(weight.codes), "weight_scale": weight.scales}
        tensors = {
            "weight_packed": packing.pack_array(weight.codes, self.bits, axis=1, container=np.int32),
            "weight_scale": weight.scales,
            "weight_shape": np.array(weight.codes.shape, dtype=np.int64),
        }
        if not self.symmetric:
            tensors["weight_zero_point"] = packing.pack_array(weight.effective_zeros(), self.bits, axis=0,
                                                              container=np.int32)
        return tensors

    def describe(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "format": self.format,
            "scheme": f"W{self.bits}A{self.activation_bits}",
            "bits": self.bits,
            "group_size": self.group_size,
            "symmetric": self.symmetric,
            "activations": "dynamic per-token int8" if self.activation_bits == 8 else "16-bit float",
        }

    def quantization_config(self) -> dict[str, Any]:
        """What compressed-tensors' `ModelCompressor.update_config` writes for this scheme."""
        weights = {
            "num_bits": self.bits, "type": "int", "symmetric": self.symmetric,
            "strategy": "channel" if self.group_size == -1 else "group",
            "group_size": None if self.group_size == -1 else self.group_size,
            "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax",
            "observer_kwargs": {},
        }
        activations = None
        if self.activation_bits == 8:
            activations = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                           "group_size": None, "block_structure": None, "dynamic": True, "actorder": None,
                           "observer": None, "observer_kwargs": {}}
        return {
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations, "output_activations": None,
                                          "format": self.format}},
            "format": self.format,
            "ignore": list(self.ignore),
            "quant_method": self.method,
            "quantization_status": "compressed",
            "kv_cache_scheme": None,
            "sparsity_config": {},
            "transform_config": {},
            "global_compression_ratio": None,
            "version": COMPRESSED_TENSORS_VERSION,
        }


def expert_groups(config: Mapping[str, Any], field: str) -> dict[str, Mapping[str, Any]]:
    """The config groups whose targets cover the routed experts, after the checks every compressed-tensors
    config must pass (`field`: the config, for refusals): compressed, dense, groups that are objects with
    lists of targets. The experts' format and float or integer scheme are the reading format's to check."""
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        raise MoeconvError(f"{field}.quantization_status is {status!r}; only 'compressed' checkpoints hold packed weights")
    sparsity = section(config, "sparsity_config", field)
    if sparsity.get("format") not in (None, "dense"):
        raise MoeconvError(f"{field}.sparsity_config.format {sparsity['format']!r} is not supported")
    groups = section(config, "config_groups", field)
    if not groups:
        raise MoeconvError(f"{field}.config_groups is missing or empty")
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise MoeconvError(f"{field}.config_groups.{name} must be an object, not {type(group).__name__}")
        targets = group.get("targets") or []
        if not isinstance(targets, list) or not all(isinstance(target, str) for target in targets):
            raise MoeconvError(f"{field}.config_groups.{name}.targets must be a list of strings")
    experts = {name: group for name, group in groups.items()
               if _targets_experts(group.get("targets") or [], f"{field}.config_groups.{name}.targets")}
    if not experts:
        raise MoeconvError(f"{field}.config_groups: no group's targets cover the routed experts")
    return experts


def one_scheme(schemes: Mapping[str, Any], field: str) -> Any:
    """The one scheme the experts' groups (`schemes`: group name -> scheme) share, or a refusal."""
    if len(set(schemes.values())) > 1:
        names = ", ".join(sorted(schemes))
        raise MoeconvError(f"{field}.config_groups: the experts fall under groups with different schemes ({names}); "
                           "moeconv needs one scheme for all experts")
    return next(iter(schemes.values()))


def ignored_modules(config: Mapping[str, Any], field: str) -> tuple[str, ...]:
    ignore = config.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(name, str) for name in ignore):
        raise MoeconvError(f"{field}.ignore must be a list of module names")
    return tuple(ignore)


def _targets_experts(targets: list[str], where: str) -> bool:
    """Whether a config group's targets (class names, module names, `re:` patterns) take in expert
    linears, matched as compressed-tensors does (`re.match` for patterns), in linear time
    (`config_pattern`). `where`: the targets' config field, for refusals."""
    for target in targets:
        if target == "Linear":
            return True
        if target.startswith("re:"):
            pattern = config_pattern(target[3:], where)
            if any(pattern.match(name) for name in _EXPERT_LINEAR_NAMES):
                return True
        elif any(name == target or name.endswith("." + target) for name in _EXPERT_LINEAR_NAMES):
            return True
    return False


def _scheme(group: Mapping[str, Any], fmt: str | None, field: str) -> tuple[str, int, int, bool, int]:
    """(format, bits, group_size, symmetric, activation_bits) of one config group, or a refusal
    that names the field."""
    if not isinstance(fmt, str) or fmt not in _BITS:
        raise MoeconvError(
            f"{field}: format {fmt!r} is not supported (supported: {', '.join(_BITS)})"
        )
    weights = section(group, "weights", field)
    if not weights:
        raise MoeconvError(f"{field}.weights is missing: the experts would not be quantized")
    if weights.get("type", "int") != "int":
        raise MoeconvError(f"{field}.weights.type {weights.get('type')!r} is not supported (only 'int')")
    bits = config_int(weights, "num_bits", 8, f"{field}.weights")
    if bits not in _BITS[fmt]:
        allowed = ", ".join(map(str, _BITS[fmt]))
        raise MoeconvError(f"{field}.weights.num_bits {bits} is not supported by {fmt} (supported: {allowed})")
    if weights.get("dynamic"):
        raise MoeconvError(f"{field}.weights.dynamic is true: weights quantized at run time are not stored packed")
    actorder = weights.get("actorder")
    if actorder not in ACTORDERS:
        raise MoeconvError(f"{field}.weights.actorder {actorder!r} is not one of {', '.join(map(str, ACTORDERS[2:]))}")
    strategy = weights.get("strategy")
    if strategy == "group" and fmt == PACK_QUANTIZED:
        group_size = config_int(weights, "group_size", 0, f"{field}.weights")
        if group_size < 1:
            raise MoeconvError(f"{field}.weights.group_size is missing for the group strategy")
        group_size = checked_group_size(group_size, f"{field}.weights")
    elif strategy == "channel":
        group_size = -1
    else:
        supported = "group or channel" if fmt == PACK_QUANTIZED else "channel"
        raise MoeconvError(f"{field}.weights.strategy {strategy!r} is not supported by {fmt} (supported: {supported})")
    symmetric = config_bool(weights, "symmetric", True, f"{field}.weights")
    if not symmetric and fmt != PACK_QUANTIZED:
        raise MoeconvError(f"{field}.weights.symmetric is false: {fmt} INT8 experts must be symmetric")
    return fmt, bits, group_size, symmetric, _activation_bits(section(group, "input_activations", field), fmt, field)


def _activation_bits(activations: Mapping[str, Any] | None, fmt: str, field: str) -> int:
    if not activations:
        return 16
    wanted = {"type": "int", "num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": True}
    if fmt == PACK_QUANTIZED or any(activations.get(key) != value for key, value in wanted.items()):
        raise MoeconvError(
            f"{field}.input_activations is not supported: only 16-bit activations, or with int-quantized "
            "weights dynamic per-token symmetric int8 (type int, num_bits 8, strategy token, dynamic true)"
        )
    return 8
