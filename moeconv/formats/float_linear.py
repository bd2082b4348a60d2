"""What the float-coded formats share: one linear's stored arrays read into the canonical float form
(float_codes.FloatWeight), refusing what cannot be read exactly, each refusal naming the tensor's suffix (the
codec's caller adds the file and the linear)."""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import numpy as np

from moeconv.errors import MoeconvError
from moeconv.float_codes import MXFP4, FloatScheme, FloatWeight, global_refusal, scale_refusal
from moeconv.formats.base import Detection, FormatDefaults, Linear, Read, SourceFormat
from moeconv.spec import TensorSpec


def float_weight(scheme: FloatScheme, packed: np.ndarray, scales: np.ndarray,
                 scalars: Mapping[str, tuple[str, np.ndarray | None]], scale_suffix: str = "weight_scale") -> FloatWeight:
    """`packed` (N, K/2) code bytes and `scales` (N, K/block) scale bytes (stored under `scale_suffix`, for
    messages); `scalars`: FloatWeight field -> (suffix, its stored array or None), the global scales of one
    element each."""
    packed = np.ascontiguousarray(packed).view(np.uint8)
    n, k = packed.shape[0], packed.shape[1] * 2
    scales = np.ascontiguousarray(scales).view(np.uint8)
    if k % scheme.block or scales.shape != (n, k // scheme.block):
        raise MoeconvError(f"{scale_suffix} {list(scales.shape)} is not one scale per {scheme.block} of the "
                           f"{[n, k]} codes")
    reason = scale_refusal(scales, scheme.scale_encoding)
    if reason:
        raise MoeconvError(f"{scale_suffix} {reason}")
    found = {}
    for field, (suffix, stored) in scalars.items():
        if stored is None:
            continue
        if stored.size != 1 or stored.dtype != np.float32:
            raise MoeconvError(f"{suffix} is {stored.dtype}{list(stored.shape)}, not one float32")
        value = np.array(stored.reshape(()), dtype=np.float32)
        reason = global_refusal(value)
        if reason:
            raise MoeconvError(f"{suffix} {reason}")
        found[field] = value
    return FloatWeight(packed, scales, scheme, **found)



class Mxfp4Pair(FormatDefaults):
    """What the MXFP4 formats that store a linear as two tensors share (gpt-oss's `blocks`/`scales`, DeepSeek-V4's
    `weight`/`scale`): the codes two a byte (N, K/2), element 2j in the low nibble of byte j, beside one UE8M0
    scale byte per 32 inputs (N, K/32), each under its own suffix and safetensors dtype; read as they are."""

    codes: ClassVar[tuple[str, str]]  # (suffix, dtype)
    scale: ClassVar[tuple[str, str]]
    evidence: ClassVar[str]  # what the detection says it saw, after the two tensors
    bits = 4
    group_size = MXFP4.block
    activation_bits = 16

    @property
    def symmetric(self) -> bool:
        return True

    def suffixes(self) -> tuple[str, ...]:
        return (self.codes[0], self.scale[0])

    def optional_suffixes(self) -> tuple[str, ...]:
        return ()

    @classmethod
    def claims(cls, linears: list[Linear]) -> bool:
        (codes, codes_dtype), (scale, scale_dtype) = cls.codes, cls.scale
        return bool(linears) and all(
            {codes, scale} <= set(tensors) and tensors[codes].dtype == codes_dtype and tensors[scale].dtype == scale_dtype
            and tuple(tensors[codes].shape) == (n, k // 2) for tensors, n, k in linears)

    @classmethod
    def from_data(cls, linears: list[Linear], configured: SourceFormat, read: Read,
                  detection: Detection) -> SourceFormat | None:
        (codes, codes_dtype), (scale, scale_dtype) = cls.codes, cls.scale
        blocks = {k // tensors[scale].shape[1] if len(tensors[scale].shape) == 2 and tensors[scale].shape[1]
                  else None for tensors, _, k in linears}
        if blocks != {MXFP4.block}:
            detection.evidence.append(f"{scale} gives blocks of {sorted(map(str, blocks))} inputs, not {MXFP4.block}")
            return None
        first = linears[0][0]
        detection.evidence.append(f"{first[codes].name} {codes_dtype} {list(first[codes].shape)} (two E2M1 codes a "
                                  f"byte) and {scale} {scale_dtype} one per {MXFP4.block}: {cls.evidence}")
        return configured if isinstance(configured, cls) else cls()

    def linear_shape(self, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, int]:
        out_features, width = shapes[self.codes[0]]
        return out_features, width * 2

    def expected(self, out_features: int, in_features: int) -> dict[str, TensorSpec]:
        (codes, codes_dtype), (scale, scale_dtype) = self.codes, self.scale
        return {codes: TensorSpec(codes, (out_features, in_features // 2), codes_dtype),
                scale: TensorSpec(scale, (out_features, in_features // MXFP4.block), scale_dtype)}

    def decode(self, stored: Mapping[str, np.ndarray]) -> FloatWeight:
        """One linear's codes and scale bytes (the bytes of an I8 tensor are the code pairs)."""
        return float_weight(MXFP4, np.ascontiguousarray(stored[self.codes[0]]).view(np.uint8), stored[self.scale[0]],
                            {}, scale_suffix=self.scale[0])

    def encode(self, weight: FloatWeight) -> dict[str, Any]:
        if weight.scheme.name != MXFP4.name:
            raise ValueError(f"{self.evidence} stores MXFP4, not {weight.scheme.describe()}")
        codes_dtype = np.int8 if self.codes[1] == "I8" else np.uint8
        return {self.codes[0]: weight.packed.view(codes_dtype), self.scale[0]: weight.scales}
