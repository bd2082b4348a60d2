"""What goes where, computed from headers and configs (plus a small sample of expert tensors, read
only to check the config's format against the data: detect.py).

The plan resolves everything up front into a work list: per output shard, the tensors in file
order and the jobs that write them. A job says where its bytes come from (source slices) and where
they go (output slots: tensor, byte offset, the source tensors they derive from); `convert` and
`verify` only iterate jobs. Every check that can be made before writing is made here, so `convert`
either refuses up front or runs to the end.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, replace
from functools import lru_cache
from math import prod
from pathlib import Path
from typing import Any, Callable, NamedTuple, Union

import torch

from moeconv import act_order, transcoders
from moeconv._version import __version__
from moeconv.audit import count as audit_counts
from moeconv.backends import all_backends, auto_order, get_backend
from moeconv.backends.base import Backend, ExpertWeights, Serving
from moeconv.canonical import PROJECTIONS, LinearShape, MoELayerShape, QuantizedWeight, effective_group_size, regroup
from moeconv.checkpoint.reader import Checkpoint, TensorEntry, TensorReader, collection_paused, open_checkpoint
from moeconv.detect import Detection, detect, sample_linears
from moeconv.errors import MoeconvError
from moeconv.formats import SourceFormat, format_from_config
from moeconv.models import Architecture, architecture_from_config
from moeconv.spec import DTYPE_SIZES, FLOAT_DTYPES, TORCH_DTYPES, TensorSpec
from moeconv.transcoders import Transcoder

DEFAULT_MAX_SHARD_SIZE = 5 * 1000**3


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer's routed experts: experts[e][projection][suffix] -> source tensor."""

    module: str
    shape: MoELayerShape
    experts: tuple[dict[str, dict[str, TensorEntry]], ...]
    act_order: str = act_order.STATIC  # or RELABELLED, FOLDED (scan_act_order)

    @property
    def source_bytes(self) -> int:
        return sum(entry.nbytes for expert in self.experts for linear in expert.values() for entry in linear.values())


@dataclass(frozen=True)
class DenseLinear:
    """A quantized linear outside the routed experts (attention, shared experts, dense MLPs), converted
    by backends that convert dense linears: tensors[suffix] -> source tensor."""

    prefix: str
    tensors: dict[str, TensorEntry]
    shape: LinearShape


# The work list. Every output byte is written by exactly one job; a job names where its bytes come
# from (source slices) and where they go (output slots), so `convert` and `verify` only iterate jobs
# and the manifest is written from the same objects.


@dataclass(frozen=True)
class SourceSlice:
    """Where a job's input bytes are: a stored tensor. (The slice of a tensor that stacks experts on
    disk would be one expert's block; no producer writes quantized experts that way today: llm-compressor
    unfuses them before quantizing, tests/packers/make_llmc_fused.py.)"""

    entry: TensorEntry

    @property
    def key(self) -> str:
        return self.entry.name

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes

    def read(self, reader: TensorReader) -> torch.Tensor:
        return reader.read(self.entry)


@dataclass(frozen=True)
class OutputSlot:
    """Where a job's output bytes go: `offset` bytes into output tensor `tensor`, a block of `shape`
    (the whole tensor, or one expert's slice of a stacked one), made from the source tensors `sources`."""

    tensor: TensorSpec
    offset: int
    shape: tuple[int, ...]
    sources: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        return DTYPE_SIZES[self.tensor.dtype] * prod(self.shape)


@dataclass(frozen=True)
class Codec:
    """The two readings a conversion job applies: the source format's decoder (after any lossless
    regrouping) and the backend's encoder, and their inverses for verify."""

    source_format: SourceFormat
    backend: Backend
    regroup_factor: int = 1  # group size divided by this (scales and zeros repeated): lossless
    transcoder: Transcoder | None = None  # stored words straight into the layout (byte-identical)

    def decode_source(self, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        """One source linear in the canonical form the plan writes."""
        return regroup(self.source_format.decode(tensors), self.regroup_factor)

    def decode_ordered(self, tensors: dict[str, torch.Tensor]) -> tuple[QuantizedWeight, torch.Tensor | None]:
        """As `decode_source`, and for an act-order linear the input permutation under which its groups
        are static (act_order.py); formats that store no g_idx have none."""
        weight, inputs = self.source_format.decode_ordered(tensors)
        return regroup(weight, self.regroup_factor), inputs


Audit = tuple[str, dict[str, int]]  # (source linear, audit counts)


@dataclass(frozen=True)
class CopyJob:
    """A tensor that passes through: its bytes are copied as they are."""

    source: SourceSlice
    slot: OutputSlot
    copies = True

    @property
    def inputs(self) -> tuple[SourceSlice, ...]:
        return (self.source,)

    @property
    def slots(self) -> dict[str, OutputSlot]:
        return {"": self.slot}


@dataclass(frozen=True)
class LinearJob:
    """One dense quantized linear, re-encoded by a backend that converts dense linears."""

    prefix: str
    shape: LinearShape
    sources: dict[str, SourceSlice]  # by source suffix
    slots: dict[str, OutputSlot]  # by backend suffix
    copies = False

    @property
    def inputs(self) -> tuple[SourceSlice, ...]:
        return tuple(self.sources.values())

    def convert(self, codec: Codec, reader: TensorReader) -> tuple[dict[str, torch.Tensor], list[Audit]]:
        weights, audits = self.read_source(codec, reader)
        return self.encode(codec, weights), audits

    def read_source(self, codec: Codec, reader: TensorReader) -> tuple[dict[str, QuantizedWeight], list[Audit]]:
        """The canonical weight (keyed "linear"), and the audit counts of its source tensors."""
        tensors = {suffix: piece.read(reader) for suffix, piece in self.sources.items()}
        weight = _decoded(codec.decode_source, self.sources, tensors)
        return {"linear": weight}, [(self.prefix, audit_counts(codec.source_format, tensors, weight))]

    def encode(self, codec: Codec, weights: dict[str, QuantizedWeight]) -> dict[str, torch.Tensor]:
        return codec.backend.encode_linear(weights["linear"], self.shape)

    def decode(self, codec: Codec, blocks: dict[str, torch.Tensor]) -> dict[str, QuantizedWeight]:
        return {"linear": codec.backend.decode_linear(blocks, self.shape)}


@dataclass(frozen=True)
class ExpertJob:
    """One routed expert of one MoE layer: its three projections decoded, its slice of every backend
    tensor of the layer encoded."""

    module: str
    expert: int
    shape: MoELayerShape
    sources: dict[str, dict[str, SourceSlice]]  # projection -> source suffix -> slice
    slots: dict[str, OutputSlot]  # by backend suffix
    copies = False

    @property
    def inputs(self) -> tuple[SourceSlice, ...]:
        return tuple(piece for linear in self.sources.values() for piece in linear.values())

    def convert(self, codec: Codec, reader: TensorReader) -> tuple[dict[str, torch.Tensor], list[Audit]]:
        """This expert's slice of every layer tensor, and the audit counts of its source tensors: through
        the pair's transcoder where there is one and it takes this expert, else decoded to the canonical
        form and encoded."""
        raw = self._read(reader)
        if codec.transcoder is not None:
            try:
                slices = codec.transcoder(codec.source_format, raw, self.shape, codec.regroup_factor)
            except MoeconvError as error:  # any projection's: name the expert
                raise self._refusal(error) from None
            if slices is not None:
                return slices, self._audits(codec, raw, {})
        weights, audits = self._canonical(codec, raw)
        return self.encode(codec, weights), audits

    def read_source(self, codec: Codec, reader: TensorReader) -> tuple[dict[str, QuantizedWeight], list[Audit]]:
        """The canonical gate, up and down, and the audit counts of their source tensors."""
        return self._canonical(codec, self._read(reader))

    def _read(self, reader: TensorReader) -> dict[str, dict[str, torch.Tensor]]:
        return {projection: {suffix: piece.read(reader) for suffix, piece in linear.items()}
                for projection, linear in self.sources.items()}

    def _canonical(self, codec: Codec, raw: dict[str, dict[str, torch.Tensor]]
                   ) -> tuple[dict[str, QuantizedWeight], list[Audit]]:
        """Decoded; an act-order down projection folded with its gate and up (act_order.fold)."""
        weights = {projection: _decoded(codec.decode_source, self.sources[projection], raw[projection])
                   for projection in ("gate", "up")}
        down, inputs = _decoded(codec.decode_ordered, self.sources["down"], raw["down"])
        weights = {**act_order.fold(weights, inputs), "down": down}
        return weights, self._audits(codec, raw, weights)

    def _audits(self, codec: Codec, raw: dict[str, dict[str, torch.Tensor]],
                weights: dict[str, QuantizedWeight]) -> list[Audit]:
        return [(_linear_name(self.sources[projection]), audit_counts(codec.source_format, tensors, weights.get(projection)))
                for projection, tensors in raw.items()]

    def _refusal(self, error: MoeconvError) -> MoeconvError:
        """A decoder's or transcoder's refusal, naming the file and the expert."""
        first = next(iter(self.sources["gate"].values())).entry
        return MoeconvError(f"{first.file}: {self.module}.{self.expert}: {error}")

    def encode(self, codec: Codec, weights: dict[str, QuantizedWeight]) -> dict[str, torch.Tensor]:
        return codec.backend.encode_expert(ExpertWeights(**weights), self.shape)

    def decode(self, codec: Codec, blocks: dict[str, torch.Tensor]) -> dict[str, QuantizedWeight]:
        return codec.backend.decode_expert(blocks, self.shape)._asdict()


Job = Union[CopyJob, LinearJob, ExpertJob]
ConvertJob = Union[LinearJob, ExpertJob]


def _linear_name(linear: dict[str, SourceSlice]) -> str:
    """The module path of one source linear (its tensors' names without the suffix)."""
    return next(iter(linear.values())).key.rsplit(".", 1)[0]


def _refusal(linear: dict[str, SourceSlice], error: MoeconvError) -> MoeconvError:
    """A decoder's or transcoder's refusal, naming the file and the linear it came from."""
    return MoeconvError(f"{next(iter(linear.values())).entry.file}: {_linear_name(linear)}: {error}")


def _decoded(decode: Callable[[dict[str, torch.Tensor]], Any], sources: dict[str, SourceSlice],
             tensors: dict[str, torch.Tensor]) -> Any:
    """`decode` (one of the codec's) of one source linear; a refusal names the file and the linear."""
    try:
        return decode(tensors)
    except MoeconvError as error:
        raise _refusal(sources, error) from None


@dataclass(frozen=True)
class OutputShard:
    file_name: str
    tensors: tuple[TensorSpec, ...]  # in file order
    jobs: tuple[Job, ...]  # in write order

    @property
    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors)

    @property
    def source_bytes(self) -> int:
        return sum(piece.nbytes for job in self.jobs for piece in job.inputs)


@dataclass(frozen=True)
class Plan:
    checkpoint: Checkpoint
    architecture: Architecture
    source_format: SourceFormat
    backend: Backend
    layers: tuple[MoELayer, ...]
    shards: tuple[OutputShard, ...]
    max_shard_size: int
    trust: str | None = None
    detection: Detection | None = None
    regroup_factor: int = 1  # group size divided by this (scales and zeros repeated): lossless
    tp: int = 1
    skipped_backends: tuple[tuple[str, str], ...] = ()  # --backend auto: (name, why not)
    unquantized_experts: tuple[str, ...] = ()  # experts modules held in float: passed through
    zero_format: str | None = None  # --gptq-zero-format: the user's answer where the data cannot decide
    choice: str | None = None  # --backend auto: what it chose and why, one line

    @property
    def codec(self) -> Codec:
        transcoder = transcoders.find(self.source_format, self.backend.name, self.layers[0].shape)
        return Codec(self.source_format, self.backend, self.regroup_factor, transcoder)

    @property
    def jobs(self) -> list[Job]:
        return [job for shard in self.shards for job in shard.jobs]

    def expert_jobs(self, layer: MoELayer) -> list[ExpertJob]:
        """The layer's jobs, indexed by expert."""
        return sorted((job for job in self.jobs if isinstance(job, ExpertJob) and job.module == layer.module),
                      key=lambda job: job.expert)

    def unquantized_modules(self) -> list[str]:
        """Modules whose 2-D float `weight` passes through: the linears a whole-checkpoint scheme must
        be told to leave in float (embeddings are listed too: a backend whose engines ask about every
        module drops them, as compressed-tensors does)."""
        copied = [job.slot.tensor for job in self.jobs if isinstance(job, CopyJob)]  # named as the output names them
        return sorted((tensor.name.removesuffix(".weight") for tensor in copied if tensor.name.endswith(".weight")
                       and len(tensor.shape) == 2 and tensor.dtype in FLOAT_DTYPES), key=_natural_key)

    @property
    def model_dtype(self) -> str | None:
        config = self.checkpoint.config
        return config.get("torch_dtype") or config.get("dtype")

    def engine_scale_cast(self, model_dtype: str | None = None) -> tuple[torch.dtype, torch.dtype] | None:
        """(stored scale dtype, the dtype the engine casts them to) when the backend's engine creates
        scale parameters in the model dtype (`model_dtype`, default the config's) and that differs from
        the scales' own; else None."""
        model = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(
            model_dtype or self.model_dtype or "")
        stored = TORCH_DTYPES[self.layers[0].shape.scale_dtype]
        if not self.backend.scales_in_model_dtype or model is None or model == stored:
            return None
        return stored, model

    def dense_layers_unservable(self) -> bool:
        return dense_layers_unservable(self.backend, self.source_format)

    def serving(self) -> Serving:
        """Which engine serves the output, and how (the command names `{output}`), or why none does."""
        return serving(self.backend, self.source_format, self.layers[0].shape)

    @property
    def output_bytes(self) -> int:
        return sum(shard.nbytes for shard in self.shards)

    @property
    def source_expert_bytes(self) -> int:
        return sum(layer.source_bytes for layer in self.layers)

    def quantization_config(self) -> dict[str, Any]:
        """What a loader needs: the expert layout, and the source's own config for everything else
        (attention and shared experts keep the source format and pass through unchanged). A backend that
        converts dense linears too writes the whole config in its own scheme; moeconv's fields then go
        under "moeconv"."""
        first = self.layers[0].shape
        if self.backend.converts_dense_linears:
            return {
                **self.backend.checkpoint_quantization_config(first, self.model_dtype, self.unquantized_modules()),
                "moeconv": {"backend": self.backend.name, "layout_version": self.backend.layout_version,
                            "source_quantization_config": self.checkpoint.quantization_config},
            }
        return {
            "quant_method": "moeconv",
            "backend": self.backend.name,
            "layout_version": self.backend.layout_version,
            **self.backend.quantization_config(first),
            "source_quantization_config": self.checkpoint.quantization_config,
        }

    def identity(self) -> dict[str, Any]:
        """Everything that decides the output's bytes. A resumed run must match it exactly."""
        return {
            "tool_version": __version__,
            "backend": self.backend.name,
            "layout_version": self.backend.layout_version,
            "max_shard_size": self.max_shard_size,
            "trust": self.trust,
            "zero_format": self.zero_format,
            "tp": self.tp,
            "regroup_factor": self.regroup_factor,
            "format": self.source_format.describe(),
            "source": self.checkpoint.identity(),
        }

    def summary(self) -> dict[str, Any]:
        return {
            "source": str(self.checkpoint.root),
            "backend": self.backend.name,
            "layout_version": self.backend.layout_version,
            "architecture": self.architecture.model_type,
            "format": self.source_format.describe(),
            "regroup_factor": self.regroup_factor,
            "transcoder": transcoder.__name__ if (transcoder := self.codec.transcoder) else None,  # None: canonical
            "tp": self.tp,
            "skipped_backends": [{"backend": name, "reason": reason} for name, reason in self.skipped_backends],
            "auto_choice": self.choice,
            "serving": self.serving()._asdict(),
            "detection": self.detection.to_json() if self.detection else None,
            "moe_layers": len(self.layers),
            "act_order": {layer.module: layer.act_order for layer in self.layers if layer.act_order != act_order.STATIC},
            "unquantized_experts": list(self.unquantized_experts),
            "source_bytes": self.checkpoint.total_bytes,
            "source_expert_bytes": self.source_expert_bytes,
            "output_bytes": self.output_bytes,
            "max_shard_size": self.max_shard_size,
            "shards": [
                {"file": shard.file_name, "bytes": shard.nbytes, "tensors": len(shard.tensors)}
                for shard in self.shards
            ],
        }


def _natural_key(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


Grouped = dict[str, dict[int, dict[str, dict[str, TensorEntry]]]]  # module -> expert -> projection -> suffix


@dataclass(frozen=True)
class ExpertTensors:
    """Every tensor under an `experts` module, from one pass over the names (a Kimi-K2 has 209k):
    the ones a naming scheme claims, grouped, and the modules held wholly in float (an MTP layer left
    bf16, experts fused on disk as 3-D float tensors), which pass through byte for byte."""

    grouped: Grouped
    unquantized: list[str]


def expert_tensors(checkpoint: Checkpoint, architecture: Architecture) -> ExpertTensors:
    """A non-float tensor under an `experts` module that no naming scheme claims is refused, never
    copied as if it were not an expert."""
    grouped: Grouped = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    floats: dict[str, bool] = {}  # module -> every tensor under it is float
    for name, entry in checkpoint.tensors.items():
        parsed = architecture.parse(name)
        module = parsed.module if parsed is not None else architecture.experts_module(name)
        if module is None:
            continue
        if parsed is None and entry.dtype not in FLOAT_DTYPES:
            raise MoeconvError(
                f"{entry.file}: tensor {name} ({entry.dtype}{list(entry.shape)}) is under {module} but matches no "
                f"{architecture.model_type} expert naming (experts.E.<projection>.<suffix>); fused 3-D quantized "
                f"experts (as llm-compressor 0.12 writes `gate_up_proj_packed`) are not read yet; refusing rather "
                f"than copying them unconverted (namings live in moeconv/models.py)")
        floats[module] = floats.get(module, True) and entry.dtype in FLOAT_DTYPES
        if parsed is not None:
            grouped[parsed.module][parsed.expert][parsed.projection][parsed.suffix] = entry
    return ExpertTensors(grouped, sorted((module for module, held in floats.items() if held), key=_natural_key))


def detect_format(checkpoint: Checkpoint, architecture: Architecture, experts: ExpertTensors | None = None,
                  zero_format: str | None = None) -> tuple[SourceFormat, Detection]:
    """The format the config declares (its GPTQ `checkpoint_format` replaced by `zero_format` when the
    user gives one), and what a sample of the expert tensors shows."""
    config_path = str(checkpoint.root / "config.json")
    if not checkpoint.quantization_config:
        raise MoeconvError(f"{config_path}: no quantization_config and no quantize_config.json: not a quantized checkpoint")
    quantization = checkpoint.quantization_config
    if zero_format is not None:
        quantization = {**quantization, "checkpoint_format": zero_format}
    configured = format_from_config(quantization, config_path)
    if zero_format is not None and configured.method != "gptq":
        raise MoeconvError(f"{config_path}: --gptq-zero-format is for GPTQ checkpoints; this one is {configured.method}")
    _, hidden, intermediate = architecture.expected_sizes(checkpoint.config, config_path)
    sizes = {"gate": (intermediate, hidden), "up": (intermediate, hidden), "down": (hidden, intermediate)}
    experts = experts or expert_tensors(checkpoint, architecture)
    detection = detect(sample_linears(experts.grouped, sizes), configured)
    if zero_format is not None:
        detection.decided_by_user += [f"--gptq-zero-format {zero_format}: {what}" for what in detection.undecided]
        detection.undecided, detection.advice = [], []
    return configured, detection


def resolve_format(checkpoint: Checkpoint, architecture: Architecture, trust: str | None = None,
                   experts: ExpertTensors | None = None, zero_format: str | None = None) -> tuple[SourceFormat, Detection]:
    """The source format to decode with: the config's, unless the tensors disagree. Then stop and
    explain, or follow `trust` ("config" or "data"). What the data cannot decide stops the conversion
    too (a guess converted silently is the wrong output this exists to prevent), unless the user decides
    (`zero_format`, or `trust` "config"). Act-order is the plan's (scan_act_order)."""
    configured, detection = detect_format(checkpoint, architecture, experts, zero_format)
    where = checkpoint.root / "config.json"
    if detection.undecided and trust == "config":
        detection.decided_by_user += [f"--trust-config: {what}" for what in detection.undecided]
        detection.undecided, detection.advice = [], []
    if detection.undecided:
        advice = f"; {detection.advice[0]}" if detection.advice else ""
        raise MoeconvError(f"{where}: {detection.undecided[0]}{advice}")
    if not detection.disagreements or trust == "config":
        return configured, detection
    if trust == "data" and detection.detected is not None:
        return detection.detected, detection
    more = f" (and {len(detection.disagreements) - 1} more)" if len(detection.disagreements) > 1 else ""
    hint = "pass --trust-config or --trust-data to choose" if detection.detected else "pass --trust-config to go on"
    said = " (as --gptq-zero-format says)" if zero_format else ""
    raise MoeconvError(f"{where}: {detection.disagreements[0]}{said}{more}; {hint}")


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _check_counts(checkpoint: Checkpoint, layers: list[MoELayer]) -> None:
    """The config's layer count and experts per token, which the output's config.json hands to an
    engine as they are: positive integers the tensors bear out (an engine told num_hidden_layers
    1e9 would try to build them), not more layers than the tensors number, not more experts per
    token than a layer has."""
    where = checkpoint.root / "config.json"
    text = checkpoint.config.get("text_config")
    config = text if isinstance(text, dict) and "num_hidden_layers" in text else checkpoint.config
    for key in ("num_hidden_layers", "num_experts_per_tok"):
        value = config.get(key, checkpoint.config.get(key))
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise MoeconvError(f"{where}: {key} is {value!r}, not a positive integer")
        if key == "num_hidden_layers":
            numbered = {match[1] for name in checkpoint.tensors if (match := _LAYER_INDEX.search(name))}
            if value > len(numbered):
                raise MoeconvError(f"{where}: num_hidden_layers is {value}, but the tensors hold {len(numbered)} "
                                   f"numbered layers")
        elif layers and value > min(layer.shape.experts for layer in layers):
            raise MoeconvError(f"{where}: num_experts_per_tok is {value}, more than the "
                               f"{min(layer.shape.experts for layer in layers)} experts of a layer")


def find_moe_layers(checkpoint: Checkpoint, architecture: Architecture, source_format: SourceFormat,
                    tensors: ExpertTensors | None = None) -> tuple[list[MoELayer], list[str]]:
    """Group the routed-expert tensors into layers and check them against the config. Experts held in
    float (`ExpertTensors.unquantized`) are not a layer to convert: they pass through."""
    where = checkpoint.root / "config.json"
    experts_expected, hidden, intermediate = architecture.expected_sizes(checkpoint.config, str(where))
    tensors = tensors or expert_tensors(checkpoint, architecture)
    grouped, unquantized = tensors.grouped, tensors.unquantized
    layers = []
    for module in sorted(set(grouped) - set(unquantized), key=_natural_key):
        experts = grouped[module]
        # Compare counts before building any list the config's number sizes (a count of 1e9 over tiny files).
        if len(experts) != experts_expected or sorted(experts) != list(range(experts_expected)):
            found = len(experts)
            raise MoeconvError(
                f"{checkpoint.root}: {module} has experts {_ranges(sorted(experts))} ({found}), "
                f"but config.json says {experts_expected}"
            )
        ordered = tuple(experts[e] for e in range(experts_expected))
        for e, expert in enumerate(ordered):
            for projection in PROJECTIONS:
                out_features, in_features = (hidden, intermediate) if projection == "down" else (intermediate, hidden)
                _check_linear(expert.get(projection, {}), f"{module}.{e}", projection, source_format,
                              out_features, in_features)
        scale_dtypes = {entry.dtype for expert in ordered for linear in expert.values()
                        for entry in linear.values() if entry.dtype in FLOAT_DTYPES and len(entry.shape) == 2}
        # scales: the only 2-D floats (a 1-D float is a per-input-channel vector: ModelOpt's pre_quant_scale)
        if len(scale_dtypes) != 1:
            raise MoeconvError(f"{checkpoint.root}: {module} mixes scale dtypes {sorted(scale_dtypes)}")
        shape = MoELayerShape(
            experts=experts_expected,
            hidden=hidden,
            intermediate=intermediate,
            bits=source_format.bits,
            group_size=source_format.group_size,
            symmetric=source_format.symmetric,
            scale_dtype=scale_dtypes.pop(),
            activation_bits=source_format.activation_bits,
            projection_names=architecture.engine_projection_names(tuple(
                architecture.parse(next(iter(ordered[0][projection].values())).name).projection_name
                for projection in PROJECTIONS)),
        )
        layers.append(MoELayer(module, shape, ordered))
    if not layers:
        raise MoeconvError(
            f"{checkpoint.root}: no routed-expert tensors found with {architecture.model_type} naming "
            f"(expected names like model.layers.0.{architecture.parents[0]}.experts.0."
            f"{next(iter(architecture.projections))}.qweight)"
        )
    return layers, unquantized


def act_order_suspected(checkpoint: Checkpoint, source_format: SourceFormat, detection: Detection) -> bool:
    """The config says act-order (the format's `configures_act_order`), or a sampled g_idx is not
    k // g: then every expert g_idx is read."""
    return bool(detection.act_order) or source_format.configures_act_order(checkpoint.quantization_config)


def scan_act_order(layers: list[MoELayer], suffix: str,
                   reader: TensorReader) -> tuple[list[MoELayer], dict[str, str]]:
    """Reads every expert g_idx: the layers with their act-order case (act_order.py), and the layers that
    cannot be folded with the reason (a gate or up permuted over the hidden dimension, uneven groups).
    `suffix`: the format's g_idx tensor (`group_index_suffix`)."""
    scanned, refusals = [], {}
    for layer in layers:
        kinds: dict[str, dict[str, list[str]]] = {projection: defaultdict(list) for projection in PROJECTIONS}
        for expert in layer.experts:
            for projection, linear in expert.items():
                entry = linear.get(suffix)
                if entry is None:
                    continue
                in_features = layer.shape.intermediate if projection == "down" else layer.shape.hidden
                group_size = effective_group_size(in_features, layer.shape.group_size)
                kind = act_order.group_order(reader.read(entry), group_size).kind
                kinds[projection][kind].append(entry.name)
        bad = [(projection, kind, names) for projection in PROJECTIONS for kind, names in kinds[projection].items()
               if kind == act_order.IRREGULAR or (kind == act_order.PERMUTED and projection != "down")]
        if bad:
            projection, kind, names = bad[0]
            refusals[layer.module] = (f"{names[0]}: {act_order.describe(kind, f'{projection} projection')} "
                                      f"({len(names)} of {layer.shape.experts} experts' {projection} projections)")
            continue
        case = (act_order.FOLDED if kinds["down"][act_order.PERMUTED] else
                act_order.RELABELLED if any(kinds[p][act_order.RELABELLED] for p in PROJECTIONS) else act_order.STATIC)
        scanned.append(replace(layer, act_order=case))
    return scanned, refusals


def check_dense_g_idx(checkpoint: Checkpoint, names: list[str], suffix: str, group_size: int,
                      reader: TensorReader, converts: bool) -> None:
    """A dense linear's g_idx must be k // g when it is copied (engines read it with static groups),
    or at most relabel whole groups when a backend re-encodes it: act-order is not folded outside
    the routed experts."""
    for name in names:
        if not name.endswith(f".{suffix}"):
            continue
        entry = checkpoint.tensors[name]
        g_idx = reader.read(entry)
        kind = act_order.group_order(g_idx, effective_group_size(g_idx.numel(), group_size)).kind
        if kind == act_order.STATIC or (converts and kind == act_order.RELABELLED):
            continue
        what = act_order.describe(kind, "linear") if converts else (
            f"{suffix} is not k // group_size (act-order) on a linear this backend copies as it is; engines "
            f"read copied linears with static groups (vLLM 0.33 ignores {suffix})")
        raise MoeconvError(f"{entry.file}: {name}: {what}")


def find_dense_linears(checkpoint: Checkpoint, source_format: SourceFormat, backend: Backend, names: list[str],
                       regroup_factor: int) -> list[DenseLinear]:
    """The quantized linears among `names` (the non-expert tensors): every module that has all of the
    format's required suffixes. Tensors with other suffixes (bias) stay pass-through."""
    modules: dict[str, dict[str, TensorEntry]] = defaultdict(dict)
    for name in names:
        prefix, _, suffix = name.rpartition(".")
        modules[prefix][suffix] = checkpoint.tensors[name]
    required, optional = source_format.suffixes(), source_format.optional_suffixes()
    linears = []
    for prefix, tensors in modules.items():
        if not all(suffix in tensors for suffix in required):
            continue
        own = {suffix: entry for suffix, entry in tensors.items() if suffix in required or suffix in optional}
        out_features, in_features = _linear_shape(source_format, own)
        _check_linear(own, prefix, "linear", source_format, out_features, in_features)
        scale_dtype = next(entry.dtype for entry in own.values() if entry.dtype in FLOAT_DTYPES and len(entry.shape) == 2)
        group_size = source_format.group_size
        shape = LinearShape(out_features, in_features, source_format.bits,
                            group_size // regroup_factor if group_size > 0 else group_size,
                            source_format.symmetric, scale_dtype, source_format.activation_bits)
        reason = backend.linear_refusal(shape)
        if reason:
            raise MoeconvError(f"{checkpoint.root}: {prefix}: backend {backend.name!r} cannot convert this "
                               f"{out_features}x{in_features} linear: {reason}")
        linears.append(DenseLinear(prefix, own, shape))
    return linears


def _linear_shape(source_format: SourceFormat, linear: dict[str, TensorEntry]) -> tuple[int, int]:
    """(N, K) from the header shapes, or an error naming the tensor whose rank does not fit the format."""
    try:
        return source_format.linear_shape({suffix: entry.shape for suffix, entry in linear.items()})
    except (IndexError, ValueError, ZeroDivisionError):
        shapes = ", ".join(f"{entry.name} {list(entry.shape)}" for entry in linear.values())
        where = next(iter(linear.values())).file
        raise MoeconvError(f"{where}: {shapes}: not the tensor shapes of a {source_format.method} linear") from None


def _check_linear(linear: dict[str, TensorEntry], prefix: str, projection: str, source_format: SourceFormat,
                  out_features: int, in_features: int) -> None:
    required, optional = source_format.suffixes(), source_format.optional_suffixes()
    any_entry = next(iter(linear.values()), None)
    where = any_entry.file if any_entry else "checkpoint"
    floats = [entry for entry in linear.values() if entry.dtype in FLOAT_DTYPES and len(entry.shape) == 2]
    if floats and not any(suffix in linear for suffix in required):
        entry = floats[0]
        raise MoeconvError(
            f"{entry.file}: tensor {entry.name} is {entry.dtype}{list(entry.shape)}: this {projection} projection "
            f"is held in float while the layer's other projections are quantized (mixed precision inside one MoE "
            f"layer); every MoE layout moeconv writes (triton, humming, cpu, compressed-tensors) holds one "
            f"quantization scheme for all three projections, so no backend takes it; refusing rather than "
            f"converting part of the layer")
    for suffix in required:
        if suffix not in linear:
            raise MoeconvError(f"{where}: tensor {prefix}.<{projection}>.{suffix} is missing")
    for suffix, entry in linear.items():
        if suffix not in required and suffix not in optional:
            raise MoeconvError(
                f"{entry.file}: tensor {entry.name} has suffix {suffix!r}, which a {source_format.method} "
                f"expert does not have (expected {', '.join(required + optional)})"
            )
    found = _linear_shape(source_format, linear)
    partial = _partial_group(source_format, in_features)
    if partial and found[1] >= in_features:  # stored as it is, or padded to whole groups (AutoRound's RTN)
        padded = f" (stored padded to K = {found[1]})" if found[1] > in_features else ""
        raise MoeconvError(f"{any_entry.file}: {any_entry.name.rsplit('.', 1)[0]}: {partial}{padded}")
    if found != (out_features, in_features):
        entry = any_entry
        raise MoeconvError(
            f"{entry.file}: tensor {entry.name} is a {found[0]}x{found[1]} (out x in) linear, but config.json "
            f"makes the {projection} projection {out_features}x{in_features}"
        )
    expected = _expected(source_format, out_features, in_features)
    for suffix, entry in linear.items():
        want = expected[suffix]
        dtype_ok = entry.dtype == want.dtype if want.dtype else entry.dtype in FLOAT_DTYPES
        if entry.shape != want.shape or not dtype_ok:
            raise MoeconvError(
                f"{entry.file}: tensor {entry.name} is {entry.dtype}{list(entry.shape)}, expected "
                f"{want.dtype or 'a float dtype'}{list(want.shape)} for {source_format.method} "
                f"{source_format.bits}-bit group {source_format.group_size}"
            )


def _partial_group(source_format: SourceFormat, in_features: int) -> str | None:
    """Why a linear whose K is not a multiple of the group size (a partial last group) is refused: the
    canonical form and every layout moeconv writes hold whole groups, and engines that take such a
    linear anyway drop or misread its tail (vLLM issue threads on AutoRound MoE checkpoints)."""
    group_size = effective_group_size(in_features, source_format.group_size)
    if in_features % group_size == 0:
        return None
    return (f"K = {in_features} is not a multiple of group size {group_size}: a partial last group of "
            f"{in_features % group_size} columns, which no layout moeconv writes holds; refusing this linear "
            f"rather than dropping or padding its tail")


@lru_cache(maxsize=256)
def _expected(source_format: SourceFormat, out_features: int, in_features: int) -> dict[str, TensorSpec]:
    """The format's header expectations, once per linear size (a Kimi-K2 plan checks 70k linears)."""
    return source_format.expected(out_features, in_features)


def _ranges(values: list[int]) -> str:
    if not values:
        return "none"
    return f"{values[0]}..{values[-1]}" if values == list(range(values[0], values[-1] + 1)) else str(values[:8])


MIN_REGROUPED_GROUP_SIZE = 32


def _first_refusal(backend: Backend, layers: list[MoELayer], factor: int) -> str | None:
    for layer in layers:
        shape = layer.shape if factor == 1 else replace(layer.shape, group_size=layer.shape.group_size // factor)
        reason = backend.refusal(shape)
        if reason:
            return f"{layer.module}: {reason}"
    return None


def eligibility(backend: Backend, layers: list[MoELayer], allow_regroup: bool) -> tuple[int, str | None]:
    """(regroup factor, None) when the backend takes every layer, possibly after regrouping (halving
    the group size, losslessly, until the sizes divide); otherwise (1, the reason)."""
    reason = _first_refusal(backend, layers, 1)
    group_size = layers[0].shape.group_size
    factor = 2
    while reason and group_size > 0 and group_size % factor == 0 and group_size // factor >= MIN_REGROUPED_GROUP_SIZE:
        if _first_refusal(backend, layers, factor) is None:
            if allow_regroup:
                return factor, None
            return 1, f"{reason} (--regroup makes it eligible: group size {group_size // factor}, lossless)"
        factor *= 2
    return 1, reason


def choose_backend(name: str, layers: list[MoELayer], allow_regroup: bool,
                   source_format: SourceFormat) -> tuple[Backend, int, tuple, str | None]:
    """The backend, its regroup factor, and (for "auto") each skipped backend with its reason and one line
    saying what was chosen and why."""
    if name != "auto":
        backend = get_backend(name)
        factor, reason = eligibility(backend, layers, allow_regroup)
        if reason:
            eligible = [other for other, candidate in all_backends().items()
                        if eligibility(candidate, layers, allow_regroup)[1] is None]
            others = f"; backends that take it: {', '.join(eligible)}" if eligible else ""
            raise MoeconvError(f"backend {name!r} does not support this checkpoint: {reason}{others}")
        return backend, factor, (), None
    return _choose_auto(layers, source_format)


def _choose_auto(layers: list[MoELayer], source_format: SourceFormat) -> tuple[Backend, int, tuple, str]:
    """`--backend auto` means "what I can serve": the first backend, in the registry's order, that takes
    every layer (regrouping losslessly when that is what makes it fit) and whose output an engine loads;
    failing that, the first that takes it, said to be unserved."""
    skipped, unserved = [], []
    for candidate in auto_order():
        factor, reason = eligibility(candidate, layers, allow_regroup=True)
        if reason is not None:
            skipped.append((candidate.name, reason))
            continue
        first = layers[0].shape
        shape = replace(first, group_size=first.group_size // factor)
        served = serving(candidate, source_format, shape)
        if served.engine is None:
            unserved.append((candidate, factor, served))
            skipped.append((candidate.name, f"no engine serves its output: {served.how}"))
            continue
        return candidate, factor, tuple(skipped), _choice_line(candidate, factor, first, f"served by {served.engine}",
                                                               skipped)
    if unserved:
        candidate, factor, served = unserved[0]
        skipped = [(name, reason) for name, reason in skipped if name != candidate.name]
        return candidate, factor, tuple(skipped), _choice_line(
            candidate, factor, layers[0].shape, f"the only backend that takes it, though {served.how}", skipped)
    raise MoeconvError("no backend takes this checkpoint: " + "; ".join(f"{n}: {r}" for n, r in skipped))


def _choice_line(backend: Backend, factor: int, layer: MoELayerShape, why: str,
                 skipped: list[tuple[str, str]]) -> str:
    regrouped = (f", group size {layer.group_size} regrouped to {layer.group_size // factor} (lossless) to fit "
                 f"tp={layer.tp}" if factor > 1 else "")
    passed = f"; skipped {', '.join(name for name, _ in skipped)} (reasons: --dry-run --json)" if skipped else ""
    return f"--backend auto takes {backend.name}: {why}{regrouped}{passed}"


def dense_layers_unservable(backend: Backend, source_format: SourceFormat) -> bool:
    return unserved_dense_layers(backend, source_format) is not None


def unserved_dense_layers(backend: Backend, source_format: SourceFormat) -> str | None:
    """Why no engine loads the output's dense layers, when the backend copies them as they are and vLLM
    0.33 refuses their format: asymmetric GPTQ (its GPTQ is symmetric only; measured with `make
    test-engines`), ModelOpt's int4 (its ModelOpt methods read FP8, NVFP4 and MXFP8 only: LINEAR_ALGOS in
    vllm/model_executor/layers/quantization/modelopt.py)."""
    fmt = source_format
    if backend.converts_dense_linears:
        return None
    if fmt.method == "gptq" and not fmt.symmetric:
        return "the dense layers keep the source's asymmetric GPTQ, which vLLM 0.33 does not load"
    if fmt.method == "modelopt":
        return "the dense layers keep the source's ModelOpt W4A16_AWQ, which vLLM 0.33 does not load"
    return None


def serving(backend: Backend, source_format: SourceFormat, layer: MoELayerShape) -> Serving:
    """The backend's own answer, unless the dense layers it copies are what no engine loads."""
    served = backend.serving(layer)
    reason = unserved_dense_layers(backend, source_format)
    if served.engine and reason:
        return Serving(None, f"{reason} (moeconv's vLLM plugin refuses this output at start-up); for vLLM use "
                             "--backend compressed-tensors")
    return served


def make_plan(source: Path | Checkpoint, backend: str = "triton", max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
              trust: str | None = None, tp: int = 1, regroup: bool = False, zero_format: str | None = None) -> Plan:
    """From headers and configs, plus a small sample of expert tensors to check the format (detect.py).

    backend: a registered backend or "auto". tp: the tensor-parallel size the output will be served
    with (eligibility only). regroup: allow halving the group size when that makes the backend fit.
    zero_format: "gptq" (v1) or "gptq_v2", the user's answer where the data cannot tell a GPTQ
    checkpoint's zero-point convention.
    """
    if tp < 1:
        raise MoeconvError(f"--tp must be at least 1, not {tp}")
    checkpoint = source if isinstance(source, Checkpoint) else open_checkpoint(Path(source))
    with collection_paused():
        return _make_plan(checkpoint, backend, max_shard_size, trust, tp, regroup, zero_format)


def _make_plan(checkpoint: Checkpoint, backend: str, max_shard_size: int, trust: str | None, tp: int,
               regroup: bool, zero_format: str | None) -> Plan:
    config_path = str(checkpoint.root / "config.json")
    architecture = architecture_from_config(checkpoint.config, config_path)
    experts = expert_tensors(checkpoint, architecture)
    source_format, detection = resolve_format(checkpoint, architecture, trust, experts, zero_format)
    found, unquantized = find_moe_layers(checkpoint, architecture, source_format, experts)
    _check_counts(checkpoint, found)
    group_index = source_format.group_index_suffix  # formats that may store a g_idx
    if group_index and act_order_suspected(checkpoint, source_format, detection):
        with TensorReader() as reader:
            found, refusals = scan_act_order(found, group_index, reader)
        if refusals:
            raise MoeconvError(f"{checkpoint.root}: {next(iter(refusals.values()))}; {len(refusals)} of "
                               f"{len(refusals) + len(found)} MoE layers use act-order that cannot be folded")
    layers = [replace(layer, shape=replace(layer.shape, tp=tp)) for layer in found]
    target, factor, skipped, choice = choose_backend(backend, layers, regroup, source_format)
    if factor > 1:
        layers = [replace(layer, shape=replace(layer.shape, group_size=layer.shape.group_size // factor))
                  for layer in layers]
    expert_names = {entry.name for layer in layers for expert in layer.experts
                    for linear in expert.values() for entry in linear.values()}
    named = architecture.engine_name  # outputs carry the names the engine's model class maps (models.py)
    units: list[tuple[str, Unit]] = [(layer.module, _layer_unit(target, layer, named(layer.module))) for layer in layers]
    others = [name for name in checkpoint.tensors if name not in expert_names]
    if group_index:
        with TensorReader() as reader:
            check_dense_g_idx(checkpoint, others, group_index, source_format.group_size, reader,
                              target.converts_dense_linears)
    if target.converts_dense_linears:
        linears = find_dense_linears(checkpoint, source_format, target, others, factor)
        units += [(linear.prefix, _single(_linear_job(target, linear, named(linear.prefix)))) for linear in linears]
        converted = {entry.name for linear in linears for entry in linear.tensors.values()}
        others = [name for name in others if name not in converted]
        _refuse_fp8_beside(checkpoint, target, others)
    units += [(name, _single(_copy_job(checkpoint.tensors[name], named(name)))) for name in others]
    units.sort(key=lambda item: _natural_key(item[0]))
    shards = _assign_shards([unit for _, unit in units], max_shard_size)
    return Plan(checkpoint, architecture, source_format, target, tuple(layers), shards, max_shard_size, trust,
                detection, factor, tp, skipped, tuple(unquantized), zero_format, choice)


def _refuse_fp8_beside(checkpoint: Checkpoint, backend: Backend, others: list[str]) -> None:
    """A whole-checkpoint scheme's config describes every linear: FP8 block-scaled linears beside the
    integer experts (MiniMax, DeepSeek) would be declared either quantized like the experts or float,
    and an engine would misread them either way. Refused with the way out, not written half-right."""
    fp8 = next((checkpoint.tensors[name] for name in others if checkpoint.tensors[name].dtype.startswith("F8_")), None)
    if fp8 is not None:
        raise MoeconvError(f"{fp8.file}: tensor {fp8.name} is {fp8.dtype}: backend {backend.name!r} writes one "
                           f"quantization scheme for the whole checkpoint and cannot describe FP8 linears beside "
                           f"the integer experts yet; --backend triton converts the experts and copies the rest")


class Unit(NamedTuple):
    """Jobs that must share a shard (a layer's experts fill the same stacked tensors), and the output
    tensors they write, in file order."""

    jobs: list[Job]
    tensors: list[TensorSpec]


def _single(job: Job) -> Unit:
    return Unit([job], [slot.tensor for slot in job.slots.values()])


def _copy_job(entry: TensorEntry, name: str) -> CopyJob:
    tensor = TensorSpec(name, entry.shape, entry.dtype)
    return CopyJob(SourceSlice(entry), OutputSlot(tensor, 0, entry.shape, (entry.name,)))


def _linear_job(backend: Backend, linear: DenseLinear, prefix: str) -> LinearJob:
    """`prefix`: the linear's name in the output."""
    names = tuple(entry.name for entry in linear.tensors.values())
    slots = {spec.name: OutputSlot(spec.renamed(f"{prefix}.{spec.name}"), 0, spec.shape, names)
             for spec in backend.linear_tensors(linear.shape)}
    return LinearJob(linear.prefix, linear.shape, {suffix: SourceSlice(entry) for suffix, entry in linear.tensors.items()},
                     slots)


def _layer_unit(backend: Backend, layer: MoELayer, module: str) -> Unit:
    """One job per expert. A stacked backend tensor gets one slot per expert (the e-th block of its
    bytes); a per-expert tensor is the whole of expert e's own tensor. `module`: the layer's `experts`
    module as the output names it."""
    specs = backend.layer_tensors(layer.shape)
    experts = range(layer.shape.experts)
    tensors = {(spec.name, e): spec.renamed(f"{module}.{e}.{spec.name}") if spec.per_expert
               else spec.renamed(f"{module}.{spec.name}")
               for spec in specs for e in (experts if spec.per_expert else (None,))}
    jobs: list[Job] = []
    for e, expert in enumerate(layer.experts):
        slots = {}
        for spec in specs:
            sources = tuple(entry.name for projection in spec.derives_from for entry in expert[projection].values())
            if spec.per_expert:
                slots[spec.name] = OutputSlot(tensors[spec.name, e], 0, spec.shape, sources)
            else:
                tensor = tensors[spec.name, None]
                slots[spec.name] = OutputSlot(tensor, e * (tensor.nbytes // len(experts)), spec.shape[1:], sources)
        sources = {projection: {suffix: SourceSlice(entry) for suffix, entry in linear.items()}
                   for projection, linear in expert.items()}
        jobs.append(ExpertJob(layer.module, e, layer.shape, sources, slots))
    return Unit(jobs, list(tensors.values()))


def _assign_shards(units: list[Unit], max_shard_size: int) -> tuple[OutputShard, ...]:
    """Greedy, in name order. A unit (a layer's jobs, a linear, a pass-through tensor) stays in one
    shard, since its jobs share stacked tensors; a unit larger than the limit gets a shard of its own
    (as transformers does for a tensor larger than max_shard_size)."""
    groups: list[list[Unit]] = [[]]
    size = 0
    for unit in units:
        unit_bytes = sum(tensor.nbytes for tensor in unit.tensors)
        if groups[-1] and size + unit_bytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(unit)
        size += unit_bytes
    count = len(groups)
    return tuple(
        OutputShard(
            file_name=f"model-{index + 1:05d}-of-{count:05d}.safetensors",
            tensors=tuple(tensor for unit in group for tensor in unit.tensors),
            jobs=tuple(job for unit in group for job in unit.jobs),
        )
        for index, group in enumerate(groups)
    )
