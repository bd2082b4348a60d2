"""Target layouts: one module per serving kernel's layout, each encoding one expert's canonical
weights into its slice of the layer's stacked tensors and decoding them back.

Backends map tensors to tensors; they know nothing of files, source formats or each other
(triton_config.py, which reads a triton output's config back for the engine plugins, excepted). The
registry is a plain table: adding a backend is one module and one entry here. Entries name their
class rather than import it, so the CLI builds its `--backend` help without importing torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moeconv.errors import MoeconvError

if TYPE_CHECKING:
    from moeconv.backends.base import Backend
    from moeconv.backends.casts import CastBackend


@dataclass
class BackendEntry:
    """A registered backend: where its class lives ("module:Class"), its help line, and its place in
    `--backend auto`'s order (the engines' kernel layout first, then stock vLLM's checkpoint format; auto
    also skips a backend whose output no engine serves while a later one is served; None: only when named)."""

    target: str
    summary: str
    auto_priority: int | None = None
    _loaded: Backend | None = field(default=None, repr=False)

    def load(self) -> Backend:
        if self._loaded is None:
            module, _, name = self.target.partition(":")
            self._loaded = getattr(importlib.import_module(module), name)()
        return self._loaded


REGISTRY: dict[str, BackendEntry] = {
    "triton": BackendEntry("moeconv.backends.triton:TritonBackend",
                           "stacked experts moeconv's vLLM plugin loads by copy: vLLM's Triton layouts (moe_wna16, "
                           "W8A8), its MXFP4 / NVFP4 MoE methods' parameters", 0),
    "humming": BackendEntry("moeconv.backends.humming:HummingBackend",
                            "per-expert Humming schema (quant_method humming; vLLM loads it from symmetric sources only)", 2),
    "cpu": BackendEntry("moeconv.backends.cpu:CpuBackend",
                        "x86 CPU kernels' blocked INT4 (W4A8) and VNNI INT8 layouts", 3),
    "compressed-tensors": BackendEntry("moeconv.backends.compressed_tensors:CompressedTensorsBackend",
                                       "a normalised compressed-tensors checkpoint stock vLLM serves", 1),
}


# The casts `convert --cast` writes (issue 41): a target layout each, chosen by --cast rather than --backend
# (never by auto): a cast changes the codes, which no backend does.
CASTS: dict[str, BackendEntry] = {
    "bf16": BackendEntry("moeconv.backends.casts:Bf16Cast",
                         "plain BF16 weights (MXFP4 or NVFP4 sources; no quantization_config unless FP8 layers stay)"),
    "fp8-block": BackendEntry("moeconv.backends.casts:Fp8BlockCast",
                              "E4M3 weights with a F32 weight_scale_inv per 128x128 block, vLLM's fp8 block config "
                              "(MXFP4 sources)"),
    "nvfp4": BackendEntry("moeconv.backends.casts:Nvfp4Cast",
                          "compressed-tensors NVFP4A16 (E2M1 codes, an E4M3 scale per 16, one F32 global scale a "
                          "linear; MXFP4 sources)"),
}


def get_cast(name: str) -> CastBackend:
    name = backend_name(name)
    if name not in CASTS:
        raise MoeconvError(f"--cast {name!r} is not available; expected one of {', '.join(CASTS)}")
    return CASTS[name].load()


def cast_help() -> str:
    """The CLI's `--cast` help, from the registry."""
    choices = "; ".join(f"{name}: {entry.summary}" for name, entry in CASTS.items())
    return (f"Cast float codes (MXFP4, NVFP4) to another code instead of keeping them (replaces --backend): "
            f"{choices}. Every target block is decided before writing; an inexact one refuses (exit 2) "
            f"unless --allow-inexact.")


def backend_name(name: str) -> str:
    """The registry's spelling of a backend name as a user may type it: any case, `_` for `-`."""
    return name.strip().lower().replace("_", "-")


def get_backend(name: str) -> Backend:
    name = backend_name(name)
    if name not in REGISTRY:
        raise MoeconvError(f"backend {name!r} is not available; expected one of {', '.join(REGISTRY)} or auto")
    return REGISTRY[name].load()


def all_backends() -> dict[str, Backend]:
    return {name: entry.load() for name, entry in REGISTRY.items()}


def auto_order() -> list[Backend]:
    """The backends `--backend auto` tries, first to last."""
    ranked = sorted((entry.auto_priority, name) for name, entry in REGISTRY.items() if entry.auto_priority is not None)
    return [get_backend(name) for _, name in ranked]


def backend_help() -> str:
    """The CLI's `--backend` help, from the registry."""
    auto = [name for _, name in sorted((entry.auto_priority, name) for name, entry in REGISTRY.items()
                                       if entry.auto_priority is not None)]
    choices = "; ".join(f"{name}: {entry.summary}" for name, entry in REGISTRY.items())
    return (f"Target layout. {choices}; auto: the first of {', '.join(auto)} that fits (regrouping losslessly "
            f"if that makes it fit) and whose output an engine serves, else the first that fits.")


__all__ = ["BackendEntry", "CASTS", "REGISTRY", "cast_help", "get_cast", "all_backends", "auto_order", "backend_help", "backend_name", "get_backend"]
