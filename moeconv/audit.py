"""Values worth a word in the reports: counted per source linear, with the first tensor that has any.

- what each source format's own `audit` counts: GPTQ v1 asymmetric's `suspicious_zero_slots`, stored
  zero slots that are all ones, i.e. a true zero of 0, which producers write differently (formats/gptq.py).
- `nonfinite_scales`: NaN or infinite scales. They are converted faithfully (the bytes are the
  source's), but a kernel cannot use them, so `inspect`, `convert` and `verify` say where they are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from moeconv.packing import as_float32, float32_cast

if TYPE_CHECKING:
    from moeconv.canonical import QuantizedWeight


def count(source_format: Any, tensors: dict[str, np.ndarray], weight: QuantizedWeight | None) -> dict[str, int]:
    """The audit counts of one source linear: its stored arrays by suffix with BF16 widened to float32, and
    its canonical form if decoded (whose scales are in the stored form)."""
    found = source_format.audit(tensors)
    scales = as_float32(weight.scales) if weight is not None else next(
        (tensor for tensor in tensors.values() if tensor.dtype.kind == "f"), None)
    if scales is not None:
        found["nonfinite_scales"] = int((~np.isfinite(scales)).sum())
    return found


class Audits:
    """Totals per kind over many linears, and the first tensor of each kind that has any."""

    def __init__(self) -> None:
        self.totals: dict[str, int] = {}
        self.first: dict[str, str] = {}
        self.casts = {"checked": 0, "changed": 0, "overflow": 0, "max_relative_change": 0.0}

    def merge(self, other: Audits) -> None:
        """Adds what another Audits (a worker process's) found; the first tensor stays the earliest."""
        for kind, found in other.totals.items():
            self.record(other.first[kind], {kind: found})
        for key in ("checked", "changed", "overflow"):
            self.casts[key] += other.casts[key]
        self.casts["max_relative_change"] = max(self.casts["max_relative_change"], other.casts["max_relative_change"])

    def record_cast(self, scales: np.ndarray, stored: str, engine: str) -> None:
        """What an engine's cast of `scales` (of torch dtype `stored`: float16, bfloat16 or float32; in the
        stored form, BF16 as its uint16 bit patterns) to `engine` does to them: values that change, values
        that become infinite, the largest relative change among the finite ones. Each of the three dtypes
        holds only float32 values, so every cast is a rounding of float32 values (`packing.float32_cast`)."""
        values = as_float32(scales).reshape(-1)
        finite = np.isfinite(values)
        cast = _rounded(values, engine)
        changed = finite & (_rounded(cast, stored).view(np.uint32) != values.view(np.uint32))
        overflow = finite & ~np.isfinite(cast)
        self.casts["checked"] += int(finite.sum())
        self.casts["changed"] += int(changed.sum())
        self.casts["overflow"] += int(overflow.sum())
        kept = finite & ~overflow & (values != 0)
        if bool(kept.any()):
            before, after = values[kept].astype(np.float64), cast[kept].astype(np.float64)
            relative = float((np.abs(after - before) / np.abs(before)).max())
            self.casts["max_relative_change"] = max(self.casts["max_relative_change"], relative)

    def record(self, name: str, counts: dict[str, int]) -> None:
        for kind, found in counts.items():
            if found:
                self.totals[kind] = self.totals.get(kind, 0) + found
                self.first.setdefault(kind, name)

    def report(self, kind: str) -> dict[str, Any]:
        """{"count", "first_tensor"}, or {} when there is nothing to say."""
        if not self.totals.get(kind):
            return {}
        return {"count": self.totals[kind], "first_tensor": self.first[kind]}


def _rounded(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 `values` cast to the torch dtype `dtype` (packing.float32_cast) and read back as float32, exactly."""
    return as_float32(float32_cast(values, dtype))
