"""What will be written and what the output says: the backend (named, or chosen by `--backend auto`),
the regroup factor, the work list (worklist.py) in output shards, and the output's answers, computed
once as the plan's fields: the jobs of each MoE layer, the codec, the quantization config, the
identity a resumed run must match, what it targets, how each engine release serves it (engines/) and the
scale cast the engine makes at load.

`make_plan` works from headers and configs (what the source is: survey.py), so `convert --dry-run`
and `inspect` read no expert weights. Every check that can be made before writing is made here, so
`convert` either refuses up front or runs to the end; `convert` and `verify` only read the plan's fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from moeconv import act_order, engines, transform
from moeconv._version import __version__
from moeconv.backends import all_backends, auto_order, backend_name, get_backend, get_cast
from moeconv.backends.base import Backend, LinearLayout
from moeconv.canonical import MoELayerShape
from moeconv.checkpoint.reader import Checkpoint, TensorEntry, TensorReader, collection_paused, open_checkpoint
from moeconv.detect import Detection
from moeconv.errors import MoeconvError
from moeconv.engines import Serving
from moeconv.formats import SourceFormat
from moeconv.models import Architecture
from moeconv.spec import FLOAT_DTYPES
from moeconv.survey import (EXPERT_BIAS, ExpertSlice, MoELayer, check_dense_g_idx, check_global_scales, find_dense_linears,
                            fp8_block_linears, natural_key, survey)
from moeconv.transform import Codec
from moeconv.worklist import (CopyJob, ExpertJob, Job, LinearJob, OutputShard, Unit, assign_shards, copy_job, layer_unit,
                              linear_job, single)

DEFAULT_MAX_SHARD_SIZE = 5 * 1000**3



@dataclass(frozen=True)
class Plan:
    """The decisions (the fields given), and the answers computed from them once (the fields after
    `choice`): what `convert`, `verify` and the manifest read."""

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
    fp8_block_modules: tuple[str, ...] = ()  # FP8 block-scaled linears a whole-checkpoint config describes
    # The linear layout the dense quantized linears are written in: the backend's own (Backend.linear_layout),
    # that of the backend it names for this source (Backend.dense_linear_backend), or None: copied.
    dense_layout: LinearLayout | None = None
    # --cast: the float-code cast the backend writes (backends.CASTS; None: the codes are kept), whether an
    # inexact one may be written (convert decides by the census, casts.py), and the modules the cast leaves
    # in BF16 (MoE layers and dense linears, as the output names them: what the config's ignored_layers lists)
    cast: str | None = None
    allow_inexact: bool = False
    cast_float_modules: tuple[str, ...] = ()
    jobs: tuple[Job, ...] = field(init=False)  # every shard's, in write order
    layer_jobs: dict[str, tuple[ExpertJob, ...]] = field(init=False)  # MoE layer -> its jobs, by expert
    codec: Codec = field(init=False)
    quantization_config: dict[str, Any] = field(init=False)  # config.json's, and quantize_config.json
    identity: dict[str, Any] = field(init=False)  # everything that decides the bytes: a resumed run must match it
    targets: dict[str, str] = field(init=False)  # the engine and kernel versions it is for (engines.targets)
    serving: Serving = field(init=False)  # how vLLM serves the output (`{output}`), or why it does not (engines.VLLM)
    sglang_serving: Serving = field(init=False)  # the same for SGLang (engines.SGLANG)
    scale_cast: tuple[str, str] | None = field(init=False)  # vLLM's, as torch dtype names, at the config's model dtype

    def __post_init__(self) -> None:
        answer = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen: set once here)
        answer("jobs", tuple(job for shard in self.shards for job in shard.jobs))
        experts: dict[str, list[ExpertJob]] = {layer.module: [] for layer in self.layers}
        for job in self.jobs:
            if isinstance(job, ExpertJob):
                experts[job.module].append(job)
        answer("layer_jobs", {module: tuple(sorted(jobs, key=lambda job: job.expert)) for module, jobs in experts.items()})
        first = self.layers[0].shape
        answer("codec", Codec(self.source_format, self.backend, self.regroup_factor))
        answer("quantization_config", _quantization_config(self))
        answer("identity", {
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
            **({"cast": self.cast, "allow_inexact": self.allow_inexact} if self.cast else {}),
        })
        answer("targets", engines.targets(self.backend.name, self.source_format.float_scheme is not None))
        model_dtype = _model_dtype(self.checkpoint)
        answer("scale_cast", engines.VLLM.scale_cast(self.backend.name, first.scale_dtype, model_dtype))
        output = engines.output_of(self.backend.name, first, self.source_format, self.dense_layout is not None,
                                   self.checkpoint.quantization_config, self.architecture.model_type,
                                   attention_quantized(self.checkpoint, self.source_format), model_dtype,
                                   self.checkpoint.config)
        answer("serving", engines.VLLM.serving(output))
        answer("sglang_serving", engines.SGLANG.serving(output))

    @property
    def output_bytes(self) -> int:
        return sum(shard.nbytes for shard in self.shards)

    def layout_of(self, job: Job) -> str:
        """The backend whose layout a converting job writes: a dense linear's may be another's
        (`dense_layout`); the manifest records it per tensor."""
        return job.layout.name if isinstance(job, LinearJob) else self.backend.name

    @property
    def source_expert_bytes(self) -> int:
        return sum(layer.source_bytes for layer in self.layers)

    def summary(self) -> dict[str, Any]:
        return {
            "source": str(self.checkpoint.root),
            "backend": self.backend.name,
            "layout_version": self.backend.layout_version,
            "architecture": self.architecture.model_type,
            "format": self.source_format.describe(),
            "regroup_factor": self.regroup_factor,
            "cast": self.cast,
            # how the first layer's experts are converted: as float codes, through the packed form, or the canonical one
            "route": "float" if self.source_format.float_scheme is not None else "packed" if self.layer_jobs and
            transform.takes_packed(next(iter(self.layer_jobs.values()))[0], self.codec) else "canonical",
            "tp": self.tp,
            "skipped_backends": [{"backend": name, "reason": reason} for name, reason in self.skipped_backends],
            "auto_choice": self.choice,
            "serving": self.serving._asdict(),
            "sglang_serving": self.sglang_serving._asdict(),
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


def _model_dtype(checkpoint: Checkpoint) -> str | None:
    config = checkpoint.config
    return config.get("torch_dtype") or config.get("dtype")


def _unquantized_modules(jobs: tuple[Job, ...]) -> list[str]:
    """Modules whose 2-D float `weight` passes through: the linears a whole-checkpoint scheme must
    be told to leave in float (embeddings are listed too: a backend whose engines ask about every
    module drops them, as compressed-tensors does)."""
    copied = [job.slot.tensor for job in jobs if isinstance(job, CopyJob)]  # named as the output names them
    return sorted((tensor.name.removesuffix(".weight") for tensor in copied if tensor.name.endswith(".weight")
                   and len(tensor.shape) == 2 and tensor.dtype in FLOAT_DTYPES), key=natural_key)


def _quantization_config(plan: Plan) -> dict[str, Any]:
    """What a loader needs: the expert layout, and the source's own config for everything else
    (attention and shared experts keep the source format and pass through unchanged). A backend that
    converts dense linears too writes the whole config in its own scheme; moeconv's fields then go
    under "moeconv"."""
    backend, first = plan.backend, plan.layers[0].shape
    if plan.cast is not None:  # the engines' own config of the cast code (backends/casts.py), or none
        return backend.linear_layout.checkpoint_quantization_config(
            first, _model_dtype(plan.checkpoint), _unquantized_modules(plan.jobs) + list(plan.cast_float_modules),
            plan.fp8_block_modules)
    if backend.linear_layout is not None:
        return {
            **backend.linear_layout.checkpoint_quantization_config(first, _model_dtype(plan.checkpoint),
                                                     _unquantized_modules(plan.jobs), plan.fp8_block_modules),
            "moeconv": {"backend": backend.name, "layout_version": backend.layout_version,
                        "source_quantization_config": plan.checkpoint.quantization_config},
        }
    dense = {}
    if plan.dense_layout is not None:  # the converted dense linears' own config, in their layout's scheme
        dense = {"dense_backend": plan.dense_layout.name, "dense_quantization_config":
                 plan.dense_layout.checkpoint_quantization_config(first, _model_dtype(plan.checkpoint),
                                                                  _unquantized_modules(plan.jobs))}
    return {
        "quant_method": "moeconv",
        "backend": backend.name,
        "layout_version": backend.layout_version,
        **backend.quantization_config(first),
        "source_quantization_config": plan.checkpoint.quantization_config,
        **dense,
    }


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


def choose_backend(name: str, layers: list[MoELayer], allow_regroup: bool, source_format: SourceFormat,
                   source_config: Mapping[str, Any] | None = None) -> tuple[Backend, int, tuple, str | None]:
    """The backend, its regroup factor, and (for "auto") each skipped backend with its reason and one line
    saying what was chosen and why."""
    if source_format.unconverted:
        raise MoeconvError(f"moeconv does not convert this checkpoint yet: {source_format.unconverted}")
    if backend_name(name) != "auto":
        backend = get_backend(name)
        factor, reason = eligibility(backend, layers, allow_regroup)
        if reason:
            eligible = [other for other, candidate in all_backends().items()
                        if eligibility(candidate, layers, allow_regroup)[1] is None]
            others = f"; backends that take it: {', '.join(eligible)}" if eligible else ""
            raise MoeconvError(f"backend {name!r} does not support this checkpoint: {reason}{others}"
                               f"{_fitting_tp_sizes([backend], layers, allow_regroup)}")
        return backend, factor, (), None
    return _choose_auto(layers, source_format, source_config)


def _choose_auto(layers: list[MoELayer], source_format: SourceFormat,
                 source_config: Mapping[str, Any] | None) -> tuple[Backend, int, tuple, str]:
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
        served = engines.VLLM.serving(engines.output_of(
            candidate.name, shape, source_format, converts_dense(candidate, source_format, factor), source_config))
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
    reasons: dict[str, list[str]] = {}
    for name, reason in skipped:
        reasons.setdefault(reason, []).append(name)
    raise MoeconvError("no backend takes this checkpoint: " + "; ".join(f"{', '.join(names)}: {reason}"
                                                                        for reason, names in reasons.items())
                       + _fitting_tp_sizes(auto_order(), layers, True))


TP_SIZES = (1, 2, 4, 8, 16)  # the tensor-parallel sizes suggested when the one asked for does not fit


def _fitting_tp_sizes(backends, layers: list[MoELayer], allow_regroup: bool) -> str:
    """"; tp sizes that fit: ..." when the layers were checked at a tensor-parallel size above 1 and some
    other size fits one of `backends`; else ""."""
    asked = layers[0].shape.tp
    if asked == 1:
        return ""
    fitting = [tp for tp in TP_SIZES if tp != asked and any(
        eligibility(backend, [replace(layer, shape=replace(layer.shape, tp=tp)) for layer in layers],
                    allow_regroup)[1] is None for backend in backends)]
    return f"; --tp sizes that fit: {', '.join(map(str, fitting))}" if fitting else ""


def _choice_line(backend: Backend, factor: int, layer: MoELayerShape, why: str,
                 skipped: list[tuple[str, str]]) -> str:
    regrouped = (f", group size {layer.group_size} regrouped to {layer.group_size // factor} (lossless) to fit "
                 f"tp={layer.tp}" if factor > 1 else "")
    reasons: dict[str, list[str]] = {}  # one reason, said once, for every backend it skipped
    for name, reason in skipped:
        reasons.setdefault(reason, []).append(name)
    passed = "".join(f"; skipped {', '.join(names)}: {reason}" for reason, names in reasons.items())
    return f"--backend auto takes {backend.name}: {why}{regrouped}{passed}"


def converts_dense(backend: Backend, source_format: SourceFormat, factor: int) -> bool:
    """Whether the plan writes the dense quantized linears in a layout of its own (Plan.dense_layout) at
    regroup `factor`, before planning: a backend that names another one for them converts them unregrouped
    only (_dense_layout)."""
    return backend.linear_layout is not None or (backend.dense_linear_backend(source_format) is not None and factor == 1)


def attention_quantized(checkpoint: Checkpoint, source_format: SourceFormat) -> bool:
    """Whether any attention linear of the source is quantized (a scale of the source format under
    `self_attn`), which SGLang's DeepSeek loader refuses (engines.SGLANG)."""
    scales = tuple(f".{suffix}" for suffix in source_format.suffixes() if suffix != "weight")
    return any(".self_attn." in name and name.endswith(scales) for name in checkpoint.tensors)


def make_plan(source: Path | Checkpoint, backend: str = "triton", max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
              trust: str | None = None, tp: int = 1, regroup: bool = False, zero_format: str | None = None,
              cast: str | None = None, allow_inexact: bool = False) -> Plan:
    """From headers and configs, plus a small sample of expert tensors to check the format (detect.py).

    backend: a registered backend or "auto". tp: the tensor-parallel size the output will be served
    with (eligibility only). regroup: allow halving the group size when that makes the backend fit.
    zero_format: "gptq" (v1) or "gptq_v2", the user's answer where the data cannot tell a GPTQ
    checkpoint's zero-point convention.
    cast: a key of backends.CASTS: write the float codes cast to that code instead of a backend's layout
    (`backend` is then not asked); allow_inexact: convert writes it even where the census finds inexact blocks.
    """
    if tp < 1:
        raise MoeconvError(f"--tp must be at least 1, not {tp}")
    if allow_inexact and cast is None:
        raise MoeconvError("--allow-inexact applies to a --cast only (the codes are kept otherwise)")
    checkpoint = source if isinstance(source, Checkpoint) else open_checkpoint(Path(source))
    with collection_paused():
        return _make_plan(checkpoint, backend, max_shard_size, trust, tp, regroup, zero_format, cast, allow_inexact)


def _make_plan(checkpoint: Checkpoint, backend: str, max_shard_size: int, trust: str | None, tp: int,
               regroup: bool, zero_format: str | None, cast: str | None, allow_inexact: bool) -> Plan:
    source = survey(checkpoint, tp=tp, trust=trust, zero_format=zero_format)
    if source.act_order_refusals:
        refusals = source.act_order_refusals
        raise MoeconvError(f"{checkpoint.root}: {next(iter(refusals.values()))}; {len(refusals)} of "
                           f"{len(source.layers)} MoE layers use act-order that cannot be folded")
    source_format, layers = source.source_format, list(source.layers)
    if cast is not None:
        target, factor, skipped, choice = get_cast(cast), 1, (), None
        cast = target.name
        reason = _first_refusal(target, layers, 1)
        if reason:
            raise MoeconvError(f"{checkpoint.root}: --cast {cast}: {reason}")
    else:
        target, factor, skipped, choice = choose_backend(backend, layers, regroup, source_format,
                                                         checkpoint.quantization_config)
    if factor > 1:
        layers = [replace(layer, shape=replace(layer.shape, group_size=layer.shape.group_size // factor))
                  for layer in layers]
    layers = [_biases_apart(layer) for layer in layers]
    expert_names = {_stored(entry).name for layer in layers for expert in layer.experts
                    for linear in expert.values() for entry in linear.values()}
    named = source.architecture.engine_name  # outputs carry the names the engine's model class maps (models.py)
    units: list[tuple[str, Unit]] = [(layer.module, layer_unit(target, layer, named(layer.module))) for layer in layers]
    others = [name for name in checkpoint.tensors if name not in expert_names]
    dense, linears = _dense_layout(checkpoint, target, source_format, others, factor)
    if source_format.group_index_suffix:
        with TensorReader() as reader:
            check_dense_g_idx(checkpoint, others, source_format, reader, dense is not None)
    if source_format.float_scheme is not None and cast is None:  # a cast reads global scales as they are
        with TensorReader() as reader:
            check_global_scales([entry for layer in layers for expert in layer.experts for linear in expert.values()
                                 for entry in linear.values()] +
                                [entry for linear in linears for entry in linear.tensors.values()],
                                source_format, target, reader)
    fp8: dict[str, str] = {}  # FP8 block-scaled tensors a whole-checkpoint config describes: source -> output name
    if dense is not None:
        units += [(linear.prefix, single(linear_job(dense, linear, named(linear.prefix)))) for linear in linears]
        converted = {entry.name for linear in linears for entry in linear.tensors.values()}
        others = [name for name in others if name not in converted]
        if dense is target.linear_layout:
            fp8 = fp8_block_linears(checkpoint, dense, others)
    units += [(name, single(copy_job(checkpoint.tensors[name], named(fp8.get(name, name))))) for name in others]
    units.sort(key=lambda item: natural_key(item[0]))
    shards = assign_shards([unit for _, unit in units], max_shard_size)
    fp8_modules = tuple(sorted({named(name).rpartition(".")[0] for name in fp8.values()}, key=natural_key))
    float_modules = () if cast is None or target.quantized else tuple(sorted(
        [named(layer.module) for layer in layers] + [named(linear.prefix) for linear in linears], key=natural_key))
    return Plan(checkpoint, source.architecture, source_format, target, tuple(layers), shards, max_shard_size, trust,
                source.detection, factor, tp, skipped, source.unquantized_experts, zero_format, choice, fp8_modules,
                dense, cast, allow_inexact, float_modules)


def _biases_apart(layer: MoELayer) -> MoELayer:
    """Experts stacked on disk keep their stacked bias tensors as they are (gpt-oss's `gate_up_proj_bias [E, 2I]`,
    rows interleaved like the codes): the only layout that takes them (the bf16 cast's stacked form, which every
    engine reads beside the same biases) copies them, so the expert jobs read only the codes and scales."""
    if layer.shape.stacked_rows is None or not layer.shape.expert_biases:
        return layer
    return replace(layer, experts=tuple({projection: {suffix: entry for suffix, entry in linear.items() if suffix != EXPERT_BIAS}
                                         for projection, linear in expert.items()} for expert in layer.experts))


def _stored(entry: TensorEntry | ExpertSlice) -> TensorEntry:
    """The stored tensor a source slice reads."""
    return entry.stored if isinstance(entry, ExpertSlice) else entry


def _dense_layout(checkpoint: Checkpoint, target: Backend, source_format: SourceFormat, names: list[str],
                  factor: int) -> tuple[LinearLayout | None, list]:
    """What writes the dense quantized linears (Plan.dense_layout), and those linears (survey.DenseLinear).
    A backend that names another one for them (Backend.dense_linear_backend) copies them as before where
    that one cannot take one of them, the layers are regrouped (their groups stay the source's) or FP8
    linears sit beside them (the dense config would have to describe those too): the output then says
    that no engine serves it (Plan.serving)."""
    if target.linear_layout is not None:
        return target.linear_layout, find_dense_linears(checkpoint, source_format, target.linear_layout, names,
                                                        factor)
    name = target.dense_linear_backend(source_format)
    if name is None or factor > 1 or any(checkpoint.tensors[other].dtype.startswith("F8_") for other in names):
        return None, []
    dense = get_backend(name).linear_layout
    try:
        return dense, find_dense_linears(checkpoint, source_format, dense, names, factor)
    except MoeconvError:
        return None, []
