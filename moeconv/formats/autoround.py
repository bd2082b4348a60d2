"""AutoRound's own format (quant_method "auto-round", also spelled "intel/auto-round").

AutoRound stores integer weights in the words of the formats it exports, named by the config's
`packing_format` (auto_round/inference/backend.py in intel/auto-round 0.16.1):

- `auto_round:auto_gptq` (its default for symmetric int; older configs write `auto_round:gptq`, and
  AutoRound's loader reads a missing or `auto` packing this way too): GPTQ words, stored zero − 1 (v1);
- `auto_round` and `auto_round:gptqmodel`: GPTQ words with the zero points as they are (v2);
- `auto_round:auto_awq` (`auto_round:awq`): AWQ GEMM words, true zeros.

So this format reads its config and hands back the GPTQ or AWQ reading of the same words: the data
checks (v1 vs v2 from the zero points, symmetry, the group size from the scales) are theirs, and the
packing name is only the claim they confirm. Symmetric scales are signed (AutoRound maps each group's
largest magnitude to −2^(b−1)); the codecs carry them as they are.

`extra_config` holds per-layer overrides. A layer kept at 16 bits (routers, heads) is stored in float
and passes through; any other override (other bits, group size, symmetry or data type) would need a
per-layer scheme, which moeconv does not convert yet: refused naming the layer.
"""

from __future__ import annotations

from typing import Any, Mapping

from moeconv.errors import MoeconvError
from moeconv.formats.awq import AWQ
from moeconv.formats.base import Linear, checked_group_size, config_bool, config_int
from moeconv.formats.gptq import GPTQ, V1, V2

# packing_format -> the words it names: a GPTQ checkpoint_format, or "awq"
PACKINGS = {
    "auto_round:auto_gptq": V1, "auto_round:gptq": V1, "auto": V1,
    "auto_round": V2, "auto_round:gptqmodel": V2,
    "auto_round:auto_awq": "awq", "auto_round:awq": "awq",
}
FLOAT_BITS = 16  # an extra_config entry at 16 bits or more keeps the layer in float
METHODS = ("auto-round", "intel/auto-round")  # its quant_method, and the alias (the registry's keys)


class AutoRound:
    """Reads an AutoRound config into the GPTQ or AWQ format its packing names (see module doc)."""

    vector_suffixes: tuple[str, ...] = ()

    @classmethod
    def claims(cls, linears: list[Linear]) -> bool:
        """Never: AutoRound's words are GPTQ's or AWQ's, and those formats claim them."""
        return False

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str) -> GPTQ | AWQ:
        packing = config.get("packing_format") or "auto_round:auto_gptq"
        if not isinstance(packing, str) or packing.lower() not in PACKINGS:
            raise MoeconvError(f"{where}: AutoRound packing_format {packing!r} is not an integer packing moeconv "
                               f"reads (supported: {', '.join(sorted(PACKINGS))})")
        words = PACKINGS[packing.lower()]
        bits = config_int(config, "bits", 4, where)
        group_size = checked_group_size(config_int(config, "group_size", 128, where), where)
        sym = config_bool(config, "sym", True, where)
        _check_integer(config, where, "the checkpoint")
        extra = config.get("extra_config") or {}
        if not isinstance(extra, Mapping):
            raise MoeconvError(f"{where}: extra_config must be an object of per-layer overrides, not {extra!r}")
        for layer, override in extra.items():
            _check_override(layer, override, config, where)
        if words == "awq":
            return AWQ.from_config({"bits": bits, "group_size": group_size, "zero_point": not sym}, where)
        return GPTQ.from_config({"bits": bits, "group_size": group_size, "sym": sym, "checkpoint_format": words}, where)


def _check_integer(config: Mapping[str, Any], where: str, what: str) -> None:
    """Integer weights with 16-bit activations only: AutoRound's fp8 / mxfp / nvfp data types, and
    quantized activations, are other formats."""
    data_type = config.get("data_type", "int")
    if data_type != "int":
        raise MoeconvError(f"{where}: AutoRound data_type {data_type!r} for {what}: only integer weights "
                           f"(data_type 'int') are read")
    act_bits = config.get("act_bits", 16)
    if act_bits is not None and (isinstance(act_bits, bool) or not isinstance(act_bits, int) or act_bits < FLOAT_BITS):
        raise MoeconvError(f"{where}: AutoRound act_bits {act_bits!r} for {what}: quantized activations are not "
                           f"read, only weight-only checkpoints (act_bits 16)")


def _check_override(layer: str, override: Any, config: Mapping[str, Any], where: str) -> None:
    place = f"{where}: extra_config[{layer!r}]"
    if not isinstance(override, Mapping):
        raise MoeconvError(f"{place} must be an object, not {override!r}")
    bits = config_int(override, "bits", config_int(config, "bits", 4, where), place)
    if bits >= FLOAT_BITS:
        return  # kept in float: its tensors pass through
    _check_integer({"data_type": config.get("data_type", "int"), **override}, where, f"layer {layer}")
    differs = [f"{key} {override[key]!r} (the checkpoint's {config.get(key, default)!r})"
               for key, default in (("bits", 4), ("group_size", 128), ("sym", True))
               if key in override and override[key] != config.get(key, default)]
    if differs:
        raise MoeconvError(f"{place}: layer {layer} is quantized with {', '.join(differs)}: per-layer schemes are "
                           f"not converted yet (every layout moeconv writes holds one scheme per checkpoint)")
