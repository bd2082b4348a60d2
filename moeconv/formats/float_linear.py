"""What the float-coded formats share: one linear's stored arrays read into the canonical float form
(float_codes.FloatWeight), refusing what cannot be read exactly, each refusal naming the tensor's suffix (the
codec's caller adds the file and the linear)."""

from __future__ import annotations

from typing import Mapping

import numpy as np

from moeconv.errors import MoeconvError
from moeconv.float_codes import FloatScheme, FloatWeight, global_refusal, scale_refusal


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

