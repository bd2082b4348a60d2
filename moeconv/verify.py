"""Proof that a converted checkpoint is right (DESIGN.md §7).

1. structure: every tensor the layout needs is there with its shape and dtype; index, config,
   quantize_config and manifest agree; each file's digest matches the manifest (its blocks hashed in parallel).
2. lossless: every conversion job of the plan (each expert, each dense linear a backend converts)
   decodes from the output back to the canonical form, and equals what the SOURCE format's decoder
   gives for the source tensors, bit for bit; pass-through tensors are byte-identical to the source.
3. numerics: the reference kernel the backend names (moeconv.kernels.runners) runs on the converted
   tensors for random tokens and routing; the reference dequantizes the source independently and
   computes in float64.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from moeconv.audit import Audits
from moeconv.backends import get_backend
from moeconv.checkpoint import manifest as manifests
from moeconv.checkpoint.manifest import MANIFEST_NAME, QUANTIZE_CONFIG_NAME
from moeconv.checkpoint.reader import INDEX_NAME, TensorEntry, TensorReader, open_checkpoint, read_json, same_bytes
from moeconv.checkpoint.schema import weight_map
from moeconv.checkpoint.writer import DIGEST_KEY, file_digest
from moeconv.errors import MoeconvError
from moeconv.kernels.runners import LAYER_KERNELS, NUMERICS_TOLERANCE
from moeconv.executor import Executor, worker_reader
from moeconv.plan import Codec, ConvertJob, CopyJob, ExpertJob, LinearJob, MoELayer, Plan, make_plan
from moeconv.source import resolve_source


@dataclass
class LayerResult:
    module: str
    experts_checked: int = 0
    experts_exact: int = 0
    lossless_failures: list[str] = field(default_factory=list)
    numerics_failure: str | None = None  # the kernel cannot read the tensors (it would misread them)
    relative_error: float | None = None
    max_abs_error: float | None = None
    seconds: float = 0.0
    tolerance: float = NUMERICS_TOLERANCE

    @property
    def ok(self) -> bool:
        numerics_ok = self.relative_error is None or self.relative_error <= self.tolerance
        return not self.lossless_failures and not self.numerics_failure and numerics_ok


@dataclass
class VerifyReport:
    output: str
    source: str
    structure_problems: list[str] = field(default_factory=list)
    passthrough_checked: int = 0
    passthrough_problems: list[str] = field(default_factory=list)
    dense_linears_checked: int = 0
    dense_linear_problems: list[str] = field(default_factory=list)
    layers: list[LayerResult] = field(default_factory=list)
    numerics_device: str | None = None
    tolerance: float = NUMERICS_TOLERANCE
    nonfinite_scales: dict[str, Any] = field(default_factory=dict)  # in the source: count, first tensor
    targets: dict[str, Any] = field(default_factory=dict)  # what the output is for, from its manifest
    # The engine casts scales to the model dtype at load: how many of the checked ones change, how
    # many overflow to inf (a failure: the served model would compute with them), the largest change.
    engine_scale_cast: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (not self.structure_problems and not self.passthrough_problems and not self.dense_linear_problems
                and all(l.ok for l in self.layers) and not self.engine_scale_cast.get("overflow"))

    def failures(self) -> list[str]:
        found = self.structure_problems + self.passthrough_problems + self.dense_linear_problems
        cast = self.engine_scale_cast
        if cast.get("overflow"):
            found.append(f"{cast['overflow']} scales overflow to inf when the engine casts them from "
                         f"{cast['stored']} to the model dtype {cast['model']}; serve with --dtype {cast['stored']}")
        for layer in self.layers:
            found += [f"{layer.module}: {problem}" for problem in layer.lossless_failures]
            if layer.numerics_failure:
                found.append(f"{layer.module}: numerics: {layer.numerics_failure}")
            elif not layer.ok and not layer.lossless_failures:
                found.append(f"{layer.module}: relative error {layer.relative_error:.3g} > {layer.tolerance:g}")
        return found

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        for layer, result in zip(data["layers"], self.layers):
            layer["ok"] = result.ok
        return data


LEVELS = ("structure", "lossless", "numerics")  # each includes the ones before it


def verify(output: Path, source: str | Path | None = None, sample: int | None = None, level: str = "numerics",
           tokens: int = 8, numerics_layers: int | None = None, seed: int = 0,
           progress: Callable[..., None] | None = None, workers: int | None = None, executor: str = "local",
           ray_address: str | None = None) -> VerifyReport:
    """Runs the levels up to `level` and returns the report; `report.ok` is the verdict.

    level: "structure" (files, index, configs, manifest, file digests), "lossless" (and every job decodes to
    the source's canonical form bit for bit, pass-through bytes equal), "numerics" (and the kernel).
    sample: check only this many experts per layer for losslessness (chosen at random from `seed`).
    numerics_layers: run the kernel on only the first N MoE layers (the interpreter on a CPU is slow).
    workers: processes that run the lossless checks (default: one per core, at most 16).
    executor: "local", or "ray" (each check a Ray task; `ray_address` as for convert).
    """
    if level not in LEVELS:
        raise MoeconvError(f"verify level {level!r} is not one of {', '.join(LEVELS)}")
    output = Path(output).expanduser().resolve()
    if not output.is_dir():
        raise MoeconvError(f"{output}: not a folder (give the folder `moeconv convert -o` wrote)")
    manifest = manifests.read(output)
    recorded, arguments = manifest["source"], manifest["arguments"]
    if source is None:
        source = recorded.get("path")
        if not isinstance(source, str):
            raise MoeconvError(f"{output / MANIFEST_NAME}: source.path is missing; pass --source")
    resolved = resolve_source(source)  # a folder, or a Hub id (from the cache or the Hub)
    checkpoint = open_checkpoint(resolved.path, origin=resolved.origin)
    if recorded.get("headers_sha256") not in (None, checkpoint.headers_sha256):
        raise MoeconvError(f"{checkpoint.root}: not the source {output} was made from (its configs and shard "
                           f"headers differ from those recorded in {MANIFEST_NAME})")
    backend = manifest["backend"]
    regroup_factor = arguments.get("regroup_factor", 1)
    plan = make_plan(checkpoint, backend=backend, trust=arguments.get("trust"), tp=arguments.get("tp", 1),
                     regroup=isinstance(regroup_factor, int) and regroup_factor > 1)
    kernel = LAYER_KERNELS[plan.backend.numerics.kernel]
    report = VerifyReport(str(output), str(checkpoint.root), targets=manifest["targets"],
                          tolerance=max(kernel.tolerance(l.shape) for l in plan.layers))
    converted = open_checkpoint(output)
    advance = progress or (lambda nbytes, total=None: None)
    advance(0, sum(path.stat().st_size for path in converted.files) + plan.source_expert_bytes)
    report.structure_problems = _check_reading(plan) + _check_structure(plan, output, manifest, converted.tensors,
                                                                        advance)
    if report.structure_problems or level == "structure":
        return report
    report.passthrough_problems, report.passthrough_checked = _check_passthrough(plan, converted.tensors)
    generator = torch.Generator().manual_seed(seed)
    audits = Audits()
    cast = plan.engine_scale_cast(_served_dtype(output))
    codec = plan.codec
    with TensorReader() as reader, _checkers(executor, workers, ray_address) as executor:
        linears = [job for job in plan.jobs if isinstance(job, LinearJob)]
        tasks = [(codec, job, _outputs_of(job, converted.tensors), cast) for job in linears]
        for job, (problems, found) in zip(linears, executor.map(_check_task, tasks)):
            audits.merge(found)
            report.dense_linear_problems += [f"{job.prefix}: {problem}" for _, problem in problems]
        report.dense_linears_checked = len(linears)
        for index, layer in enumerate(plan.layers):
            started = time.perf_counter()
            result = LayerResult(layer.module, tolerance=kernel.tolerance(layer.shape))
            jobs = plan.expert_jobs(layer)
            experts = _sampled(layer.shape.experts, sample, generator)
            tasks = [(codec, jobs[e], _outputs_of(jobs[e], converted.tensors), cast) for e in experts]
            for e, (problems, found) in zip(experts, executor.map(_check_task, tasks)):
                audits.merge(found)
                result.lossless_failures += [f"expert {e}{f' {key}' if key else ''}: {problem}"
                                             for key, problem in problems]
                result.experts_exact += not problems
                result.experts_checked += 1
            advance(layer.source_bytes)
            if level == "numerics" and (numerics_layers is None or index < numerics_layers):
                report.numerics_device = kernel.device()
                try:
                    result.relative_error, result.max_abs_error = _check_numerics(
                        plan, layer, jobs, converted.tensors, reader, tokens, generator)
                except ValueError as error:  # the serving kernel's own reading of the bytes fails
                    result.numerics_failure = str(error)
            result.seconds = time.perf_counter() - started
            report.layers.append(result)
    report.nonfinite_scales = audits.report("nonfinite_scales")
    if cast is not None:
        report.engine_scale_cast = {"stored": str(cast[0]).removeprefix("torch."),
                                    "model": str(cast[1]).removeprefix("torch."), **audits.casts}
    return report


def _checkers(executor: str, workers: int | None, ray_address: str | None) -> Any:
    """What runs the lossless checks: this machine's worker processes, or Ray tasks."""
    if executor == "local":
        return Executor(workers)
    if executor == "ray":
        from moeconv.distributed import RayMap

        return RayMap(ray_address)
    raise MoeconvError(f"--executor {executor}: choose local or ray")


def _served_dtype(output: Path) -> str | None:
    """The model dtype an engine reads from the OUTPUT's config.json (a user may have changed it)."""
    config = read_json(output / "config.json")
    value = config.get("torch_dtype") or config.get("dtype")
    return value if isinstance(value, str) else None


def _check_reading(plan: Plan) -> list[str]:
    """The source's own data against the reading the output was made with: an output converted under
    --trust-config over a config the data contradicts is not certified (decoding the source with the
    same reading would only agree with itself)."""
    if plan.detection is None or plan.trust == "data":
        return []
    return [f"the source's tensors contradict the reading this output was converted with: {disagreement}"
            for disagreement in plan.detection.disagreements]


def _check_structure(plan: Plan, output: Path, manifest: dict[str, Any],
                     tensors: dict[str, TensorEntry], advance: Callable[..., None]) -> list[str]:
    problems = []
    expected = {t.name: t for shard in plan.shards for t in shard.tensors}
    for name, want in expected.items():
        have = tensors.get(name)
        if have is None:
            problems.append(f"tensor {name} is missing")
        elif (have.dtype, have.shape) != (want.dtype, want.shape):
            problems.append(f"{have.file.name}: tensor {name} is {have.dtype}{list(have.shape)}, "
                            f"expected {want.dtype}{list(want.shape)}")
    problems += [f"{tensors[name].file.name}: unexpected tensor {name}" for name in sorted(set(tensors) - set(expected))]
    index = read_json(output / INDEX_NAME)
    declared = sum(entry.nbytes for entry in tensors.values())
    if index.get("metadata", {}).get("total_size") != declared:
        problems.append(f"{INDEX_NAME}: total_size {index.get('metadata', {}).get('total_size')} != {declared}")
    quantization = plan.quantization_config()
    if read_json(output / "config.json").get("quantization_config") != quantization:
        problems.append("config.json: quantization_config does not describe this conversion")
    if read_json(output / QUANTIZE_CONFIG_NAME) != quantization:
        problems.append(f"{QUANTIZE_CONFIG_NAME}: does not match config.json's quantization_config")
    shard_files = set(weight_map(index, output / INDEX_NAME).values())
    files = manifests.recorded_files(manifest)
    if files is None:
        return problems + [f"{MANIFEST_NAME}: files must map plain file names to their bytes and {DIGEST_KEY}"]
    if shard_files != set(files):
        problems.append(f"{MANIFEST_NAME}: files {sorted(files)} != index's {sorted(shard_files)}")
    for name, recorded in files.items():
        path = output / name
        if not path.is_file():
            problems.append(f"{name}: listed in {MANIFEST_NAME} but missing")
        elif path.stat().st_size != recorded["bytes"] or file_digest(path) != recorded[DIGEST_KEY]:
            problems.append(f"{name}: digest or size differs from {MANIFEST_NAME}")
        if path.is_file():
            advance(path.stat().st_size)
    return problems


def _check_passthrough(plan: Plan, tensors: dict[str, TensorEntry]) -> tuple[list[str], int]:
    problems, copies = [], [job for job in plan.jobs if isinstance(job, CopyJob)]
    for job in copies:
        name = job.slot.tensor.name
        if not _same_bytes(job.source.entry, tensors[name]):
            problems.append(f"{tensors[name].file.name}: tensor {name} differs from the source's bytes")
    return problems, len(copies)


def _same_bytes(a: TensorEntry, b: TensorEntry) -> bool:
    return a.nbytes == b.nbytes and same_bytes(a.file, a.begin, b.file, b.begin, a.nbytes)


def _sampled(count: int, sample: int | None, generator: torch.Generator) -> list[int]:
    if sample is None or sample >= count:
        return list(range(count))
    return sorted(torch.randperm(count, generator=generator)[:sample].tolist())


def _output_blocks(job: ConvertJob, tensors: dict[str, TensorEntry], reader: TensorReader) -> dict[str, torch.Tensor]:
    """The bytes the job wrote, read back from the output, keyed by backend suffix."""
    return {suffix: reader.read_slice(tensors[slot.tensor.name], slot.offset, slot.shape)
            for suffix, slot in job.slots.items()}


def _outputs_of(job: ConvertJob, tensors: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    """The output tensors a job's slots lie in (what a worker process needs of the output's header)."""
    return {slot.tensor.name: tensors[slot.tensor.name] for slot in job.slots.values()}


def _check_task(codec: Codec, job: ConvertJob, outputs: dict[str, TensorEntry],
                cast: tuple[torch.dtype, torch.dtype] | None) -> tuple[list[tuple[str | None, str]], Audits]:
    """`_check_job` in a worker (moeconv.executor): its problems, and what its audits found."""
    audits = Audits()
    return _check_job(codec, job, outputs, worker_reader(), audits, cast), audits


def _check_job(codec: Codec, job: ConvertJob, tensors: dict[str, TensorEntry], reader: TensorReader,
               audits: Audits, cast: tuple[torch.dtype, torch.dtype] | None) -> list[tuple[str | None, str]]:
    """(projection, mismatch) for every canonical weight whose output bytes do not decode to exactly
    what the source format's decoder gives; (None, why) when the layout cannot be decoded at all."""
    try:
        converted = job.decode(codec, _output_blocks(job, tensors, reader))
    except ValueError as error:  # the layout's own redundancy (e.g. CPU compensation sums) disagrees
        return [(None, str(error))]
    source, counts = job.read_source(codec, reader)
    for name, found in counts:
        audits.record(name, found)
    if cast is not None:
        for weight in source.values():
            audits.record_cast(weight.scales, cast[1])
    return [(key if isinstance(job, ExpertJob) else None, problem) for key, weight in source.items()
            if (problem := converted[key].mismatch(weight))]


def _kernel_tensors(plan: Plan, jobs: list[ExpertJob], tensors: dict[str, TensorEntry],
                    reader: TensorReader) -> dict[str, torch.Tensor]:
    """The layout the backend's reference kernel reads, for the experts of `jobs` stacked along dim 0:
    the output's own bytes, or (Numerics.layout) those re-encoded into another backend's layout
    through the canonical form."""
    layout = plan.backend.numerics.layout
    blocks = [_output_blocks(job, tensors, reader) for job in jobs]
    if layout is not None:
        target = get_backend(layout)
        blocks = [target.encode_expert(plan.backend.decode_expert(own, job.shape), job.shape)
                  for own, job in zip(blocks, jobs)]
    return {suffix: torch.stack([own[suffix] for own in blocks]) for suffix in blocks[0]}


def _check_numerics(plan: Plan, layer: MoELayer, jobs: list[ExpertJob], tensors: dict[str, TensorEntry],
                    reader: TensorReader, tokens: int, generator: torch.Generator) -> tuple[float, float]:
    """The backend's kernel on the converted tensors against a float64 reference that dequantizes
    the SOURCE through the source format's decoder. Only the experts the routing picks are read."""
    from moeconv.kernels import random_routing, reference_fused_moe, relative_error

    shape = layer.shape
    configured = plan.checkpoint.config.get("num_experts_per_tok")
    # Only the check's routing depends on it: a value that is not a positive integer falls back to 2.
    topk = min(configured if isinstance(configured, int) and not isinstance(configured, bool) and configured > 0
               else 2, shape.experts)
    weights, ids = random_routing(tokens, shape.experts, topk, generator)
    used = sorted(set(ids.flatten().tolist()))
    local_ids = torch.tensor([used.index(e) for e in ids.flatten().tolist()]).reshape(ids.shape)
    x = torch.randn(tokens, shape.hidden, generator=generator).to(torch.float16)
    slices = _kernel_tensors(plan, [jobs[e] for e in used], tensors, reader)
    out = LAYER_KERNELS[plan.backend.numerics.kernel].run(slices, shape, x, weights, local_ids)
    sources = [jobs[e].read_source(plan.codec, reader)[0] for e in used]
    w13 = torch.stack([torch.cat([s["gate"].dequantize(torch.float64), s["up"].dequantize(torch.float64)])
                       for s in sources])
    w2 = torch.stack([s["down"].dequantize(torch.float64) for s in sources])
    ref = reference_fused_moe(x.double(), w13, w2, weights.double(), local_ids, dtype=torch.float64)
    return float(relative_error(out.double(), ref)), float((out.double() - ref).abs().max())
