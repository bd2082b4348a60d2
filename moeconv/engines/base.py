"""What an engine release declares (`EngineRelease`), the question it is asked (`Output`: an output as the
engine meets it) and its answer (`Serving`). No engine is imported here, nor any version named."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple

from moeconv.spec import FLOAT_DTYPES, TORCH_NAMES

if TYPE_CHECKING:
    from moeconv.canonical import MoELayerShape
    from moeconv.formats import SourceFormat


FLOAT_CODES = " (float codes)"  # EngineRelease.targets: the suffix of a backend's entry for its float layouts


class Serving(NamedTuple):
    """Which engine loads an output as it is on disk, and how (`how` may name `{output}`); engine None: none
    does, and `how` says why and the way out. What the docs measured with `make test-engines`."""

    engine: str | None
    how: str


@dataclass(frozen=True)
class Output:
    """An output, as much of it as decides whether and how an engine release serves it."""

    backend: str  # the registered backend whose layout the experts are written in
    layer: MoELayerShape  # the first MoE layer as written (group size after regrouping), served at `layer.tp`
    source_format: SourceFormat
    # The dense quantized linears are written in a layout moeconv chose (the backend's own, or the one it
    # names: Plan.dense_layout); False: copied as the source stores them.
    dense_converted: bool
    source_config: Mapping[str, Any] | None = None  # the source's quantization_config, which copied layers keep
    model_type: str = ""  # config.json's
    attention_quantized: bool = False  # some attention linear holds a scale of the source format
    model_dtype: str | None = None  # config.json's torch_dtype: what an engine may create scale parameters in
    model_config: Mapping[str, Any] | None = None  # config.json: the model class's own keys a release may ignore
    # Why the dense layers the output copies load in no engine (engines.output_of fills it); None: they load.
    dense_refusal: str | None = None


_ENGINE_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class EngineRelease:
    """One release of one engine, everything moeconv knows of it: how it serves each backend's output (or
    why it does not), whose scales it casts at load, and what an output built for it records. A new
    release is a new module declaring one of these, and its line in the registry (engines/__init__.py)."""

    engine: str  # "vLLM": how the CLI names the engine
    version: str  # the release, as its answers name it
    # How it serves the output, or why not (without the scale flag, which `serving` adds).
    answer: Callable[[Output], Serving]
    # Backends whose scale parameters it creates in the model dtype, casting the stored scales into them at
    # load (verify counts the scales the cast changes; the serve line then keeps the stored dtype).
    casts_scales_of: frozenset[str] = frozenset()
    # backend -> the engine and kernel-package versions its outputs are for (moeconv.json's `targets`); a backend
    # whose float-coded layouts target other parts of the release has them apart under backend + FLOAT_CODES.
    targets: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.engine} {self.version}"

    def scale_cast(self, backend: str, scale_dtype: str, model_dtype: str | None) -> tuple[str, str] | None:
        """(stored scale dtype, the dtype this release casts them to), as torch dtype names, when it creates
        the backend's scale parameters in the model dtype and that differs from the scales' own
        (`scale_dtype`, a safetensors code); else None."""
        model = model_dtype if model_dtype in _ENGINE_DTYPES else None  # a config may hold anything
        if scale_dtype not in FLOAT_DTYPES:  # float codes' scale bytes (UE8M0, E4M3): the engines keep their dtype
            return None
        stored = TORCH_NAMES[scale_dtype]
        if backend not in self.casts_scales_of or model is None or model == stored:
            return None
        return stored, model

    def serving(self, output: Output) -> Serving:
        """The answer, its command keeping the stored scale dtype (`--dtype`) where this release would cast."""
        served = self.answer(output)
        cast = self.scale_cast(output.backend, output.layer.scale_dtype, output.model_dtype)
        return served._replace(how=f"{served.how} --dtype {cast[0]}") if served.engine and cast else served
