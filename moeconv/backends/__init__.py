"""Target layouts: one module per serving kernel's layout, each encoding one expert's canonical
weights into its slice of the layer's stacked tensors and decoding them back.

Backends map tensors to tensors; they know nothing of files, source formats or each other.
"""

from __future__ import annotations

from moeconv.backends.base import Backend, TensorSpec
from moeconv.backends.compressed_tensors import CompressedTensorsBackend
from moeconv.backends.cpu import CpuBackend
from moeconv.backends.humming import HummingBackend
from moeconv.backends.triton import TritonBackend
from moeconv.errors import MoeconvError

REGISTRY: dict[str, Backend] = {backend.name: backend for backend in (TritonBackend(), HummingBackend(), CpuBackend(),
                                                                     CompressedTensorsBackend())}


def get_backend(name: str) -> Backend:
    if name not in REGISTRY:
        raise MoeconvError(f"backend {name!r} is not available; expected one of {', '.join(sorted(REGISTRY))} "
                           f"or auto")
    return REGISTRY[name]


__all__ = ["Backend", "CompressedTensorsBackend", "CpuBackend", "HummingBackend", "REGISTRY", "TensorSpec", "TritonBackend", "get_backend"]
