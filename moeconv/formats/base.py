"""What every source format provides, and the small helpers they share."""

from __future__ import annotations

from typing import Any, Mapping, Protocol

import torch

from moeconv.canonical import QuantizedWeight, effective_group_size, groups_of, is_channelwise  # noqa: F401
from moeconv.errors import MoeconvError
from moeconv.spec import TensorSpec


class SourceFormat(Protocol):
    """One source format with its parameters. Implementations are frozen dataclasses."""

    method: str  # quant_method as configs spell it
    bits: int
    group_size: int  # as configured: -1 means channel-wise
    activation_bits: int  # 16, or 8 for dynamic per-token int8 activations (W8A8)

    @property
    def symmetric(self) -> bool: ...

    def suffixes(self) -> tuple[str, ...]:
        """Tensor name suffixes every quantized linear must have (`qweight`, `scales`, ...)."""

    def optional_suffixes(self) -> tuple[str, ...]:
        """Suffixes that may be present and are checked or ignored (`g_idx`, symmetric filler zeros)."""

    def linear_shape(self, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, int]:
        """(out_features N, in_features K) of a linear, from its tensors' header shapes."""

    def expected(self, out_features: int, in_features: int) -> dict[str, TensorSpec]:
        """Every tensor's spec (named by suffix) for a linear of this size, to validate headers."""

    def decode(self, tensors: Mapping[str, torch.Tensor]) -> QuantizedWeight:
        """One linear's tensors (keyed by suffix) -> the canonical form."""

    def encode(self, weight: QuantizedWeight) -> dict[str, torch.Tensor]:
        """The canonical form -> this format's tensors (keyed by suffix)."""

    def describe(self) -> dict[str, Any]:
        """Parameters for reports (`inspect`, manifests)."""

    def quantization_config(self) -> dict[str, Any]:
        """The `quantization_config` a producer of this format writes (synthetic checkpoints)."""


def config_int(config: Mapping[str, Any], key: str, default: int, where: str, *fallbacks: str) -> int:
    """An integer config value (the first of `key`, `fallbacks` present), refusing 4.7, "4" and true:
    a value that changes the meaning of the bytes is never coerced."""
    for name in (key, *fallbacks):
        if name in config and config[name] is not None:
            value = config[name]
            if isinstance(value, bool) or not isinstance(value, int):
                raise MoeconvError(f"{where}: {name} must be an integer, not {value!r}")
            return value
    return default


def config_bool(config: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    """A boolean config value; the string "false" is an error, not true."""
    value = config.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise MoeconvError(f"{where}: {key} must be true or false, not {value!r}")
    return value


def check_group_size(group_size: int, where: str) -> None:
    if not is_channelwise(group_size) and (group_size < 1 or group_size & (group_size - 1)):
        raise MoeconvError(f"{where}: group_size {group_size} is not -1 or a power of two")


def check_bits(bits: int, allowed: tuple[int, ...], method: str, where: str) -> None:
    if bits not in allowed:
        choices = ", ".join(map(str, allowed))
        raise MoeconvError(f"{where}: {method} with {bits} bits is not supported (supported: {choices})")
