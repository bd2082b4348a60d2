"""What the source is: from its configs and headers (plus a small sample of expert tensors, read only
to check the config's format against the data: detect.py, and every g_idx when act-order is
suspected), the architecture, the format the tensors are read with, the routed-expert layers with
their shapes and act-order case, the experts held in float, and the dense quantized linears.

`survey` is the one walk both `inspect` (which renders it) and `plan` (which decides what to write
from it) take; the checks a backend's choice adds (dense linears, FP8 beside the experts) are the
functions below it, called by the plan.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from functools import lru_cache
from math import prod
from typing import Any

import numpy as np

from moeconv import act_order, engines
from moeconv.backends.base import Backend, LinearLayout
from moeconv.canonical import PROJECTIONS, LinearShape, MoELayerShape, effective_group_size
from moeconv.checkpoint import manifest as manifests
from moeconv.checkpoint.reader import Checkpoint, TensorEntry, TensorReader
from moeconv.detect import Detection, detect, sample_linears
from moeconv.errors import MoeconvError
from moeconv.formats import SourceFormat, format_from_config
from moeconv.formats.base import check_header
from moeconv.models import Architecture, architecture_from_config
from moeconv.packing import bf16_as_float32
from moeconv.spec import DTYPE_SIZES, FLOAT_DTYPES, TensorSpec


EXPERT_BIAS = "bias"  # the suffix of an expert linear's bias, stored beside its codes (gpt-oss)


@dataclass(frozen=True)
class ExpertSlice:
    """One expert's linear inside a tensor that stacks the experts on disk (gpt-oss): rows `first::step` of the
    `expert`-th block of `stored` along dim 0 (a contiguous 1/E of its bytes), as the architecture's naming scheme
    declares them (models.StackedExperts), never inferred from the data. Its `name` says which rows it is
    (`model.layers.0.mlp.experts.gate_up_proj_blocks[2, 0::2]`), so every report that lists sources shows the row
    order read. Its `shape` is the linear's: the rows, and the trailing dimensions as one (blocks [E, 2I, H/32, 16]
    give (I, H/2) bytes, compressed-tensors' weight_packed layout)."""

    stored: TensorEntry
    expert: int
    first: int
    step: int

    @property
    def name(self) -> str:
        return f"{self.stored.name}[{self.expert}, {self.first}::{self.step}]"

    @property
    def dtype(self) -> str:
        return self.stored.dtype

    @property
    def file(self) -> Any:
        return self.stored.file

    @property
    def shape(self) -> tuple[int, ...]:
        rows, tail = self.stored.shape[1] // self.step, self.stored.shape[2:]
        return (rows, prod(tail)) if tail else (rows,)

    @property
    def nbytes(self) -> int:
        return DTYPE_SIZES[self.dtype] * prod(self.shape)

    @property
    def begin(self) -> int:
        """Where the expert's block (every row of it, which `read_raw` reads) starts in its file."""
        return self.stored.begin + self.expert * (self.stored.nbytes // self.stored.shape[0])

    @property
    def end(self) -> int:
        return self.begin + self.stored.nbytes // self.stored.shape[0]

    def read_raw(self, reader: TensorReader) -> np.ndarray:
        """The linear's stored values (BF16 as its uint16 bit patterns), as `TensorReader.read_raw` gives a tensor;
        the expert's block fingerprinted under this slice's name where the reader takes fingerprints (resume)."""
        rows, tail = self.stored.shape[1], self.stored.shape[2:]
        block = (rows, prod(tail)) if tail else (rows,)
        values = reader.read_raw_slice(self.stored, self.begin - self.stored.begin, block, fingerprint_as=self.name)
        return np.ascontiguousarray(values[self.first::self.step])

    def read_array(self, reader: TensorReader) -> np.ndarray:
        values = self.read_raw(reader)
        return bf16_as_float32(values) if self.dtype == "BF16" else values


def linear_name(entry: TensorEntry | ExpertSlice) -> str:
    """The source linear one of its tensors belongs to, as reports name it: a stored tensor's module path, or an
    expert slice's own name (which rows of which stacked tensor)."""
    return entry.name if isinstance(entry, ExpertSlice) else entry.name.rsplit(".", 1)[0]


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


def natural_key(name: str) -> list[Any]:
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
        stacked = architecture.parse_stacked(name) if parsed is None else None
        if stacked is not None:
            _stacked_slices(checkpoint, architecture, entry, stacked, grouped[module])
        elif parsed is None and entry.dtype not in FLOAT_DTYPES:
            raise MoeconvError(
                f"{entry.file}: tensor {name} ({entry.dtype}{list(entry.shape)}) is under {module} but matches no "
                f"{architecture.model_type} expert naming ({_naming(architecture)}); fused 3-D quantized "
                f"experts (as llm-compressor 0.12 writes `gate_up_proj_packed`) are not read yet; refusing rather "
                f"than copying them unconverted (namings live in moeconv/models.py)")
        floats[module] = floats.get(module, True) and entry.dtype in FLOAT_DTYPES
        if parsed is not None:
            grouped[parsed.module][parsed.expert][parsed.projection][parsed.suffix] = entry
    return ExpertTensors(grouped, sorted((module for module, held in floats.items() if held), key=natural_key))


def _naming(architecture: Architecture) -> str:
    if architecture.stacked is not None:
        return ", ".join(f"experts.{tensor}_<suffix>" for tensor in architecture.stacked.tensors) + ", stacked"
    return "experts.E.<projection>.<suffix>"


def _stacked_slices(checkpoint: Checkpoint, architecture: Architecture, entry: TensorEntry, name: Any,
                    experts: dict[int, dict[str, dict[str, Any]]]) -> None:
    """Each expert's linears in a stacked tensor (`name`: models.StackedName), by the rows the naming scheme
    declares; a stacked tensor whose first dimension is not the config's expert count, or whose rows do not
    split into its projections, is refused naming it (before any per-expert list is built)."""
    where = str(checkpoint.root / "config.json")
    count, _, _ = architecture.expected_sizes(checkpoint.config, where)
    held = architecture.stacked.tensors[name.tensor]
    if len(entry.shape) < 2 or entry.shape[0] != count or entry.shape[1] % len(held):
        raise MoeconvError(f"{entry.file}: tensor {entry.name} is {entry.dtype}{list(entry.shape)}: {architecture.model_type} "
                           f"stacks the {count} experts config.json names along dim 0, then the rows of "
                           f"{' and '.join(held)}")
    for expert in range(count):
        for projection in held:
            first, step = architecture.stacked.rows(name.tensor, projection)
            experts[expert][projection][name.suffix] = ExpertSlice(entry, expert, first, step)


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
    expert_dtype = checkpoint.config.get("expert_dtype")
    if expert_dtype is not None and "expert_dtype" not in quantization:
        # DeepSeek-V4 says `expert_dtype` at the top of config.json, V4.1 in its quantization config; transformers
        # moves V4's there too (models/deepseek_v4/configuration_deepseek_v4.py), and so does this
        quantization = {**quantization, "expert_dtype": expert_dtype}
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


def resolve_format(checkpoint: Checkpoint, trust: str | None, configured: SourceFormat, detection: Detection,
                   zero_format: str | None = None) -> SourceFormat:
    """The source format to decode with: the config's (`configured`), unless the tensors disagree
    (`detection`, from detect_format). Then stop and explain, or follow `trust` ("config" or "data").
    What the data cannot decide stops the conversion too (a guess converted silently is the wrong output
    this exists to prevent), unless the user decides (`zero_format`, or `trust` "config"). Act-order is
    the survey's (scan_act_order)."""
    where = checkpoint.root / "config.json"
    if detection.undecided and trust == "config":
        detection.decided_by_user += [f"--trust-config: {what}" for what in detection.undecided]
        detection.undecided, detection.advice = [], []
    if detection.undecided:
        advice = f"; {detection.advice[0]}" if detection.advice else ""
        raise MoeconvError(f"{where}: {detection.undecided[0]}{advice}")
    if not detection.disagreements or trust == "config":
        return configured
    if trust == "data" and detection.detected is not None:
        return detection.detected
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
    for module in sorted(set(grouped) - set(unquantized), key=natural_key):
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
        scale_dtypes: dict[str, TensorEntry] = {}  # dtype -> the first scale tensor in it
        for expert in ordered:
            for linear in expert.values():
                for entry in linear.values():
                    # scales: the only 2-D floats (a 1-D float is a per-input-channel vector: ModelOpt's pre_quant_scale)
                    if entry.dtype in FLOAT_DTYPES and len(entry.shape) == 2:
                        scale_dtypes.setdefault(entry.dtype, entry)
        if len(scale_dtypes) > 1:
            first, other = list(scale_dtypes.values())[:2]
            raise MoeconvError(f"{other.file}: tensor {other.name} is {other.dtype}{list(other.shape)}, but "
                               f"{first.name} is {first.dtype}: {module} mixes scale dtypes {sorted(scale_dtypes)}")
        scheme = source_format.float_scheme  # float codes: the block scales are bytes of the scheme's encoding
        shape = MoELayerShape(
            experts=experts_expected,
            hidden=hidden,
            intermediate=intermediate,
            bits=source_format.bits,
            group_size=source_format.group_size,
            symmetric=source_format.symmetric,
            scale_dtype=scheme.scale_dtype if scheme else next(iter(scale_dtypes)),
            activation_bits=source_format.activation_bits,
            projection_names=_projection_names(architecture, ordered[0]),
            float_scheme=scheme,
            expert_biases=any(suffix == EXPERT_BIAS for expert in ordered for linear in expert.values() for suffix in linear),
            stacked_rows=None if architecture.stacked is None else architecture.stacked.gate_up_rows,
        )
        layers.append(MoELayer(module, shape, ordered))
    if not layers and unquantized:
        held = next(entry for name, entry in checkpoint.tensors.items()
                    if architecture.experts_module(name) == unquantized[0])
        raise MoeconvError(
            f"{held.file}: tensor {held.name} is {held.dtype}{list(held.shape)}: the routed experts are held in float "
            f"while config.json says quant_method {checkpoint.quantization_config.get('quant_method')!r}, so there is "
            f"nothing quantized to convert (transformers saves gpt-oss this way after dequantizing MXFP4 on CPU; "
            f"docs/FLOAT_SOURCES.md section 5)")
    if not layers:
        raise MoeconvError(
            f"{checkpoint.root}: no routed-expert tensors found with {architecture.model_type} naming "
            f"(expected names like model.layers.0.{architecture.parents[0]}.experts."
            f"{f'{next(iter(architecture.stacked.tensors))}_blocks' if architecture.stacked else f'0.{next(iter(architecture.projections))}.qweight'})"
        )
    return layers, unquantized


def _projection_names(architecture: Architecture, expert: dict[str, dict[str, Any]]) -> tuple[str, str, str]:
    """gate, up, down as the source names them (per expert, or the stacked tensors that hold them), then as the
    engine does (models.py)."""
    if architecture.stacked is not None:
        return tuple(next(tensor for tensor, held in architecture.stacked.tensors.items() if projection in held)
                     for projection in PROJECTIONS)
    return architecture.engine_projection_names(tuple(
        architecture.parse(next(iter(expert[projection].values())).name).projection_name for projection in PROJECTIONS))


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
                kind = act_order.group_order(reader.read_array(entry), group_size).kind
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


def check_dense_g_idx(checkpoint: Checkpoint, names: list[str], source_format: SourceFormat,
                      reader: TensorReader, converts: bool) -> None:
    """A dense linear's g_idx (the format's `group_index_suffix`) must be k // g when it is copied (engines
    read it with static groups), or at most relabel whole groups when a backend re-encodes it: act-order
    is not folded outside the routed experts. Its header is checked first: one vector of K integers."""
    suffix, group_size = source_format.group_index_suffix, source_format.group_size
    for name in names:
        if not name.endswith(f".{suffix}"):
            continue
        entry = checkpoint.tensors[name]
        check_header(entry, _expected(source_format, 1, entry.shape[-1] if entry.shape else 0)[suffix], source_format)
        g_idx = reader.read_array(entry)
        kind = act_order.group_order(g_idx, effective_group_size(g_idx.size, group_size)).kind
        if kind == act_order.STATIC or (converts and kind == act_order.RELABELLED):
            continue
        what = act_order.describe(kind, "linear") if converts else (
            f"{suffix} is not k // group_size (act-order) on a linear this backend copies as it is; engines "
            f"read copied linears with static groups ({engines.VLLM.name} ignores {suffix})")
        raise MoeconvError(f"{entry.file}: {name}: {what}")


def find_dense_linears(checkpoint: Checkpoint, source_format: SourceFormat, layout: LinearLayout, names: list[str],
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
        scheme = source_format.float_scheme
        scale_dtype = scheme.scale_dtype if scheme else next(
            entry.dtype for entry in own.values() if entry.dtype in FLOAT_DTYPES and len(entry.shape) == 2)
        group_size = source_format.group_size
        shape = LinearShape(out_features, in_features, source_format.bits,
                            group_size // regroup_factor if group_size > 0 else group_size,
                            source_format.symmetric, scale_dtype, source_format.activation_bits, scheme)
        reason = layout.linear_refusal(shape)
        if reason:
            raise MoeconvError(f"{checkpoint.root}: {prefix}: backend {layout.name!r} cannot convert this "
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
    expected = _expected(source_format, out_features, in_features)
    if found != (out_features, in_features):
        # named: the tensor whose header gives the wrong size (a zero-sized qweight, not its g_idx)
        entry = next((entry for suffix, entry in linear.items() if tuple(entry.shape) != expected[suffix].shape),
                     any_entry)
        raise MoeconvError(
            f"{entry.file}: tensor {entry.name} is {entry.dtype}{list(entry.shape)}, which makes a {found[0]}x{found[1]} "
            f"(out x in) linear, but config.json makes the {projection} projection {out_features}x{in_features}"
        )
    for suffix, entry in linear.items():
        check_header(entry, expected[suffix], source_format)


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


FP8_BLOCK = 128  # DeepSeek-V3's and MiniMax-M2's weight_block_size: one weight_scale_inv per 128x128 block


def fp8_block_linears(checkpoint: Checkpoint, layout: LinearLayout, others: list[str]) -> dict[str, str]:
    """A whole-checkpoint scheme's config describes every linear, so FP8 block-scaled linears beside the
    quantized experts (MiniMax, DeepSeek: `weight` F8_E4M3 and `weight_scale_inv` F32, one scale a 128x128
    block; compressed-tensors' FP8_BLOCK: `weight_scale` in the weight's float dtype, docs/FLOAT_SOURCES.md
    section 3) are copied as they are under the backend's names and described as such (`fp8_block_suffixes`):
    source name -> output name (the suffix renamed). A backend that cannot describe them refuses, with
    the way out; FP8 tensors of any other shape are refused naming them: never declared quantized like the
    experts or float, which an engine would misread."""
    fp8 = [checkpoint.tensors[name] for name in others if checkpoint.tensors[name].dtype.startswith("F8_")]
    if not fp8:
        return {}
    suffixes = layout.fp8_block_suffixes
    if suffixes is None:
        raise MoeconvError(f"{fp8[0].file}: tensor {fp8[0].name} is {fp8[0].dtype}: backend {layout.name!r} writes "
                           f"one quantization scheme for the whole checkpoint and cannot describe FP8 linears beside "
                           f"the quantized experts; --backend compressed-tensors writes them as a config group of their "
                           f"own, --backend triton converts the experts and copies the rest")
    renames = {}
    for weight in fp8:
        prefix, _, suffix = weight.name.rpartition(".")
        scale = checkpoint.tensors.get(f"{prefix}.weight_scale_inv") or checkpoint.tensors.get(f"{prefix}.weight_scale")
        grid = tuple(-(-size // FP8_BLOCK) for size in weight.shape)
        scale_ok = scale is not None and (scale.dtype == "F32" if scale.name.endswith("_inv") else
                                          scale.dtype in FLOAT_DTYPES)
        if suffix != "weight" or weight.dtype != "F8_E4M3" or len(weight.shape) != 2 or not scale_ok or \
                tuple(scale.shape) != grid:
            found = "none" if scale is None else f"{scale.dtype}{list(scale.shape)}"
            raise MoeconvError(
                f"{weight.file}: tensor {weight.name} is {weight.dtype}{list(weight.shape)} with {prefix}.weight_scale_inv "
                f"{found}: backend {layout.name!r} describes FP8 linears as a `weight` F8_E4M3 with a F32 "
                f"`weight_scale_inv` of one scale per {FP8_BLOCK}x{FP8_BLOCK} block (F32{list(grid)} here); "
                f"--backend triton converts the experts and copies the rest")
        renames[weight.name] = f"{prefix}.{suffixes['weight']}"
        renames[scale.name] = f"{prefix}.{suffixes[scale.name.rpartition('.')[2]]}"
    return renames


def check_global_scales(entries: list[TensorEntry], source_format: SourceFormat, backend: Backend,
                        reader: TensorReader) -> None:
    """Float codes written in the other global-scale convention than the source's (a ModelOpt weight_scale_2 as
    compressed-tensors' divided weight_global_scale): every global scale of `entries` (the float32 scalars of
    the float-coded linears: weight and input global scales) is read, and the first whose reciprocal is not a
    float32 refused, since the output would decode to other weights (float_codes.exact_reciprocal)."""
    from moeconv.float_codes import DIVIDE, MULTIPLY, exact_reciprocal

    scheme, wanted = source_format.float_scheme, backend.float_global_convention
    if scheme is None or scheme.global_convention in (None, wanted):
        return
    for entry in entries:
        if entry.dtype != "F32" or entry.nbytes != 4:
            continue
        value = reader.read_array(entry).reshape(())
        if exact_reciprocal(value) is None:
            verbs = {DIVIDE: "divides by it", MULTIPLY: "multiplies by it"}
            raise MoeconvError(
                f"{entry.file}: tensor {entry.name} is {float(value)!r}: {source_format.method} "
                f"{verbs[scheme.global_convention]}, backend {backend.name!r} writes the reciprocal that is "
                f"{'divided' if wanted == DIVIDE else 'multiplied'} by, and 1/{float(value)!r} is no "
                f"float32 (only a power of two's reciprocal is), so the output would not decode to the source's values; "
                f"refusing rather than rounding it (docs/FLOAT_SOURCES.md, section 4)")


@dataclass(frozen=True)
class Survey:
    """What the source is, as `survey` finds it."""

    checkpoint: Checkpoint
    architecture: Architecture
    configured: SourceFormat  # the format the config declares (with the user's --gptq-zero-format)
    detection: Detection
    source_format: SourceFormat  # the format the tensors are read with
    layers: tuple[MoELayer, ...]  # with their act-order case, at tensor-parallel size `tp`
    unquantized_experts: tuple[str, ...]  # experts modules held in float: passed through
    act_order_scanned: bool = False  # every expert g_idx was read (act_order_suspected)
    act_order_refusals: dict[str, str] = field(default_factory=dict)  # MoE layer -> why it cannot be folded


def _refuse_moeconv_layout(checkpoint: Checkpoint) -> None:
    """A moeconv output in one of its own layouts (`quant_method: moeconv`: triton, cpu) is no source format:
    say what it is and where it came from, rather than what its stacked tensors fail to match."""
    quantization = checkpoint.quantization_config
    if quantization.get("quant_method") != "moeconv":
        return
    try:
        origin = manifests.read(checkpoint.root)["source"].get("path")
    except MoeconvError:  # a damaged or missing manifest: what the config says still holds
        origin = None
    came_from = f" (source: {origin})" if isinstance(origin, str) else ""
    raise MoeconvError(f"{checkpoint.root}: already a moeconv {quantization.get('backend', '')} output{came_from}: "
                       f"`moeconv verify {checkpoint.root}` checks it; to convert again, convert its source")


def survey(checkpoint: Checkpoint, tp: int = 1, trust: str | None = None, zero_format: str | None = None,
           strict: bool = True) -> Survey:
    """strict (the plan): the format as `resolve_format` decides it, refusing what the data contradicts
    or cannot decide. Not strict (inspect): the tensors' format where they disagree with the config,
    nothing refused. Layers whose act-order cannot be folded are listed in `act_order_refusals`."""
    config_path = str(checkpoint.root / "config.json")
    _refuse_moeconv_layout(checkpoint)
    architecture = architecture_from_config(checkpoint.config, config_path)
    experts = expert_tensors(checkpoint, architecture)
    if strict:
        configured, detection = detect_format(checkpoint, architecture, experts, zero_format)
        source_format = resolve_format(checkpoint, trust, configured, detection, zero_format)
    else:
        configured, detection = detect_format(checkpoint, architecture, experts)
        source_format = detection.detected if detection.disagreements and detection.detected else configured
    found, unquantized = find_moe_layers(checkpoint, architecture, source_format, experts)
    if strict:
        _check_counts(checkpoint, found)
    group_index = source_format.group_index_suffix  # formats that may store a g_idx
    scanned, refusals = False, {}
    if group_index and act_order_suspected(checkpoint, source_format, detection):
        with TensorReader() as reader:
            cases, refusals = scan_act_order(found, group_index, reader)
        scanned = True
        found = cases if not refusals else [next((case for case in cases if case.module == layer.module), layer)
                                            for layer in found]
    layers = tuple(replace(layer, shape=replace(layer.shape, tp=tp)) for layer in found)
    return Survey(checkpoint, architecture, configured, detection, source_format, layers, tuple(unquantized),
                  scanned, refusals)
