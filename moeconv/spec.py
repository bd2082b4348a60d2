"""What a tensor is before it has bytes: a name, a shape and a safetensors dtype.

The ground floor every other room uses for sizes: the plan sizes output shards with it, backends
declare their layouts with it, formats declare what their headers must say, and the writer lays out
its header from it.
"""

from __future__ import annotations

from math import prod
from typing import NamedTuple

from typing import Any

# The safetensors spec's dtypes and their sizes in bytes.
DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
FLOAT_DTYPES = ("F16", "BF16", "F32")  # the dtypes scales come in
TORCH_NAMES = {"U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64", "F16": "float16",
               "BF16": "bfloat16", "F32": "float32", "F64": "float64", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
               "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu"}  # code -> torch dtype name


def __getattr__(name: str) -> Any:
    """TORCH_DTYPES (code -> torch dtype) and SAFETENSORS_DTYPES (its inverse), built on first use so that
    the work list (worklist.py), which sizes tensors with DTYPE_SIZES, is importable without torch."""
    if name in ("TORCH_DTYPES", "SAFETENSORS_DTYPES"):
        import torch

        tables = globals()
        tables["TORCH_DTYPES"] = {code: getattr(torch, dtype) for code, dtype in TORCH_NAMES.items()}
        tables["SAFETENSORS_DTYPES"] = {dtype: code for code, dtype in tables["TORCH_DTYPES"].items()}
        return tables[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class TensorSpec(NamedTuple):
    """A tensor's name, shape and safetensors dtype (None: any of FLOAT_DTYPES, in a format's
    expectations of a source header).

    In a backend's layout the name is a suffix, appended to the module path, and `per_expert` says
    the tensor is one expert's (named `<module>.<e>.<suffix>`, no expert dim); otherwise it is
    stacked over experts, dim 0 the expert, expert e's slice the e-th contiguous block of its bytes.
    `derives_from` names the canonical projections (gate, up, down) a backend tensor is made from."""

    name: str
    shape: tuple[int, ...]
    dtype: str | None
    per_expert: bool = False
    derives_from: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return DTYPE_SIZES[self.dtype] * prod(self.shape)

    def renamed(self, name: str) -> TensorSpec:
        return TensorSpec(name, self.shape, self.dtype)
