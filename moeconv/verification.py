"""Proof that a converted checkpoint is right (what each level proves, and what no level proves, is the
threat model in docs/FORMAT.md).

1. structure: every file of the output folder is one the manifest lists, with its size and digest
   (blocks hashed in parallel), and the manifest matches its own digest; every tensor the layout
   needs is there with its shape and dtype; config.json is the source's, field by field, with
   moeconv's quantization_config; index, quantize_config and manifest are what the plan writes; the
   copied files are the source's files, and the source's other files are the ones recorded as skipped.
2. lossless: every source shard hashes to the digest recorded as the conversion read it; every
   conversion job of the plan (each expert, each dense linear a backend converts) decodes from the
   output back to the canonical form, and equals what the SOURCE format's decoder gives for the
   source tensors, bit for bit (both read in numpy where the layout and the format can be, else in
   torch; never through the converter's transcoders); pass-through tensors are byte-identical to the source.
3. numerics: the reference kernel the backend names (moeconv.kernels.runners) runs on the converted
   tensors for random tokens, routed so that every checked expert gets one; the reference dequantizes
   the source independently and computes in float64.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

from moeconv.audit import Audits
from moeconv.backends import get_backend
from moeconv.checkpoint import manifest as manifests
from moeconv.checkpoint.manifest import MANIFEST_NAME
from moeconv.checkpoint.reader import TensorEntry, TensorReader, collection_paused, open_checkpoint, read_json, same_bytes
from moeconv.errors import MoeconvError
from moeconv.packing import as_float32
from moeconv.kernels.runners import LAYER_KERNELS, NUMERICS_TOLERANCE
from moeconv.executor import Executor, in_batches, start_workers, worker_reader
from moeconv import provenance, structure, transform
from moeconv.plan import DEFAULT_MAX_SHARD_SIZE, Plan, engine_scale_cast, make_plan
from moeconv.survey import MoELayer
from moeconv.transform import Codec
from moeconv.worklist import ConvertJob, CopyJob, ExpertJob, LinearJob
from moeconv.source import ResolvedSource, is_hub_id, resolve_source

if TYPE_CHECKING:  # the checks import it in the workers; a lossless verify's own process never does
    import torch

    from moeconv.canonical import QuantizedWeight


@dataclass
class LayerResult:
    module: str
    experts: int = 0  # in the layer
    experts_checked: int = 0
    experts_exact: int = 0
    experts_routed: int | None = None  # the experts the kernel check's tokens reached (numerics)
    lossless_failures: list[str] = field(default_factory=list)
    numerics_failure: str | None = None  # the kernel cannot read the tensors (it would misread them)
    relative_error: float | None = None
    max_abs_error: float | None = None
    max_abs_reference: float | None = None  # the reference's largest output: the scale max_abs_error is on
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
    level: str = "numerics"  # the level asked for
    source_files_checked: int = 0  # source shards hashed against the digests recorded at conversion
    source_problems: list[str] = field(default_factory=list)
    # Where the source came from (moeconv.provenance): the Hub repository and commit it is anchored to
    # ({} for a local folder), how many of its files were hashed against the published digests, the line.
    source_anchor: dict[str, str] = field(default_factory=dict)
    published_files_checked: int = 0
    provenance_problems: list[str] = field(default_factory=list)
    provenance: str = ""
    proven: dict[str, list[str]] = field(default_factory=dict)  # level -> what passing it proved (PROOFS)
    # What the source's data could not decide and the user chose at conversion (--gptq-zero-format,
    # --trust-config): lossless then means "exact under that choice", not "the data confirms it".
    decided_by_user: list[str] = field(default_factory=list)
    # The MoE layers the kernel ran on when verify's default sampled them (on a CPU); empty: every layer it ran on
    # was asked for (--level numerics, --numerics-layers).
    kernel_sample: list[str] = field(default_factory=list)
    phase_seconds: dict[str, float] = field(default_factory=dict)  # wall time of each phase (PHASE_UNITS)

    @property
    def ok(self) -> bool:
        return (not self.structure_problems and not self.source_problems and not self.provenance_problems
                and not self.passthrough_problems and not self.dense_linear_problems
                and all(l.ok for l in self.layers) and not self.engine_scale_cast.get("overflow"))

    def failures(self) -> list[str]:
        found = (self.structure_problems + self.source_problems + self.provenance_problems + self.passthrough_problems
                 + self.dense_linear_problems)
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

    def caveats(self) -> list[str]:
        """What a passing verdict does not say, in its own words: the last line's caveats and the JSON's (the
        table's rows carry each too)."""
        found = (["the tensors' bytes are self-consistent; not compared with the source (--level lossless compares "
                  "them)"] if self.level == "structure" else [])
        found += [f"decided by the user, not the data: {what}" for what in self.decided_by_user]
        if self.engine_scale_cast.get("changed"):
            found.append(f"{self.engine_scale_cast['changed']} scale(s) change when the engine casts them "
                         f"(serve with --dtype {self.engine_scale_cast['stored']})")
        if self.nonfinite_scales:
            found.append(f"{self.nonfinite_scales['count']} NaN or infinite scales in the source (first: "
                         f"{self.nonfinite_scales['first_tensor']}), converted as they are: no kernel can compute with them")
        return found

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        data["caveats"] = self.caveats()
        for layer, result in zip(data["layers"], self.layers):
            layer["ok"] = result.ok
        return data


LEVELS = ("structure", "lossless", "numerics")  # each includes the ones before it
# verify's progress, phase by phase: `progress(0, total, phase)` starts a phase, `progress(n)` advances it.
# --level structure: digests (the output's file bytes, hashed), then tensor-digests (the output's tensor
# bytes: hashed in the same pass, counted again). Above it, one phase, lossless: the output's file bytes
# and the source's shard bytes hashed (on a thread) while the source bytes of the checked jobs are read
# and compared (in the workers), all three counted; then kernel: MoE layers run through the reference
# kernel. `phase_seconds` also gives what came before the first phase (`prepare`: the manifest, both
# checkpoints' headers, the plan, the structure checks) and, inside lossless, how long the output's digests,
# the source's, the workers' start and the checks each took (the digests overlap the other two).
PHASE_UNITS = {"digests": "bytes", "tensor-digests": "bytes", "lossless": "bytes", "kernel": "layers"}

# What passing each level proves, as the report states it (docs/FORMAT.md, "What verify proves").
PROOFS = {
    "structure": [
        "every file in the output folder is listed in moeconv.json with its size and block digest, and "
        "nothing else is there; moeconv.json matches its own digest (this proves the output is as recorded, "
        "not who recorded it: the levels below compare it with the source)",
        "every tensor of every shard hashes to the digest moeconv.json records for it (what vLLM's plugin checks "
        "with MOECONV_VERIFY_ON_LOAD=1)",
        "config.json equals the source's config.json field by field, with moeconv's quantization_config; "
        "quantize_config.json, the index and moeconv.json's derived sections are what this conversion writes",
        "every tensor the layout needs is there with the planned shape and dtype, and no other tensor",
        "each copied file equals the source's file of that name; every other file of the source folder is one "
        "recorded as skipped",
    ],
    "lossless": [
        "every source shard hashes to the digest recorded while the conversion read it",
        "every expert and every converted dense linear decodes bit for bit to what the source format's decoder "
        "gives for the source's tensors; every pass-through tensor is byte-identical to the source's",
    ],
    "numerics": [
        "the backend's reference kernel, run on the output's bytes for random tokens that reach every checked "
        "expert, agrees with a float64 reference computed from the source within the stated tolerance (on the "
        "layers it ran)",
    ],
}


# verify's default on a CPU, where the Triton interpreter takes seconds a layer: the kernel on this many MoE
# layers, spread from the first to the last (every tensor is still checked bit for bit).
KERNEL_SAMPLE = 4


def kernel_layers(count: int, level: str | None, numerics_layers: int | None,
                  on_cpu: Callable[[], bool]) -> tuple[list[int], bool]:
    """(the indices of the MoE layers the kernel runs on, whether they are verify's default sample). `on_cpu` is
    asked only for the default (it imports torch)."""
    if level not in (None, "numerics"):
        return [], False
    if numerics_layers is not None:
        return list(range(min(numerics_layers, count))), False
    if level is None and count > KERNEL_SAMPLE and on_cpu():
        return sorted({round(i * (count - 1) / (KERNEL_SAMPLE - 1)) for i in range(KERNEL_SAMPLE)}), True
    return list(range(count)), False


def verify(output: Path, source: str | Path | None = None, sample: int | None = None, level: str | None = None,
           tokens: int = 8, numerics_layers: int | None = None, seed: int = 0,
           progress: Callable[..., None] | None = None, workers: int | None = None, executor: str = "local",
           ray_address: str | None = None) -> VerifyReport:
    """Runs the levels up to `level` and returns the report; `report.ok` is the verdict.

    level: "structure" (files, index, configs, manifest, file digests), "lossless" (and every job decodes to
    the source's canonical form bit for bit, pass-through bytes equal), "numerics" (and the kernel on every
    MoE layer); None, the default: "numerics", with the kernel on KERNEL_SAMPLE layers on a CPU (the sample is
    in the report: `kernel_sample`).
    sample: check only this many experts per layer for losslessness (chosen at random from `seed`).
    numerics_layers: run the kernel on only the first N MoE layers (the interpreter on a CPU is slow).
    workers: processes that run the lossless checks (default: one per core, at most 16).
    executor: "local", or "ray" (each check a Ray task; `ray_address` as for convert).
    """
    if level is not None and level not in LEVELS:
        raise MoeconvError(f"verify level {level!r} is not one of {', '.join(LEVELS)}")
    asked, level = level, level or "numerics"
    began = time.perf_counter()
    output = Path(output).expanduser().resolve()
    if not output.is_dir():
        raise MoeconvError(f"{output}: not a folder (give the folder `moeconv convert -o` wrote)")
    if not os.path.lexists(output / MANIFEST_NAME):
        raise MoeconvError(f"{output}: no {MANIFEST_NAME}: not a folder written by `moeconv convert`")
    linked = structure.check_links(output)
    if linked:  # convert writes no link, and verify reads nothing through one (it may point anywhere)
        return VerifyReport(str(output), str(source or ""), structure_problems=linked, level=level)
    # Reading the manifest and both checkpoints' headers, planning and the structure checks make hundreds
    # of thousands of long-lived objects and no cycles: the cycle collector's passes over them were a
    # third of this part's time (docs/BENCHMARKS.md).
    with collection_paused():
        try:  # a damaged output is a failed verification (exit 1), not a usage error
            manifest = manifests.read(output)
        except MoeconvError as error:
            return VerifyReport(str(output), str(source or ""), structure_problems=[str(error)], level=level)
        sealed = structure.check_seal(manifest) or structure.check_version(manifest)
        if sealed:  # nothing it says (backend, arguments, source) can be planned from
            return VerifyReport(str(output), str(source or ""), structure_problems=sealed, level=level)
        recorded, arguments = manifest["source"], manifest["arguments"]
        if source is None:
            if not isinstance(recorded.get("path"), str):
                return VerifyReport(str(output), "", level=level, structure_problems=[
                    f"{output / MANIFEST_NAME}: source.path is missing; pass --source"])
            resolved = _recorded_source(output, recorded)
        else:
            resolved = resolve_source(source)  # a folder, or a Hub id (from the cache or the Hub)
        anchor = _anchor(output, source or recorded["path"], recorded, resolved.origin)
        checkpoint = open_checkpoint(resolved.path, origin=resolved.origin)
        if recorded.get("headers_sha256") not in (None, checkpoint.headers_sha256):
            raise MoeconvError(f"{checkpoint.root}: not the source {output} was made from (its configs and shard "
                               f"headers differ from those recorded in {MANIFEST_NAME})")
        # The digests of both sides (the output's files and tensors, the source's shards) need no plan: they
        # start now, on a thread, beside the planning (seconds for a large checkpoint) and then the checks.
        held, digested, digest_seconds = _Held(), None, {}
        try:
            converted, unreadable = open_checkpoint(output), None
        except MoeconvError as error:  # a damaged shard or index: reported below, with what the digests find
            converted, unreadable = None, error
        if converted is not None and level != "structure":
            digested = _in_background(_digests, output, manifest, list(converted.tensors.values()), checkpoint,
                                      anchor, held, digest_seconds)
        try:  # until the digests' progress has somewhere to go: an error or an interrupt stops them
            backend = manifest["backend"]
            regroup_factor = arguments.get("regroup_factor", 1)
            plan = make_plan(checkpoint, backend=backend, trust=arguments.get("trust"), tp=arguments.get("tp", 1),
                             max_shard_size=_recorded_shard_size(arguments),
                             regroup=isinstance(regroup_factor, int) and regroup_factor > 1,
                             zero_format=arguments.get("zero_format"))
            if level != "structure" and executor == "local" and plan.checks_need_torch:
                start_workers(workers)  # the checkers' torch import, while the digests are taken
            kernel = LAYER_KERNELS[plan.backend.numerics.kernel]
            report = VerifyReport(str(output), str(checkpoint.root), targets=manifest["targets"], level=level,
                                  tolerance=max(kernel.tolerance(l.shape) for l in plan.layers),
                                  source_anchor={} if anchor is None else {"repo": anchor.repo,
                                                                           "revision": anchor.revision},
                                  provenance=provenance.describe(anchor, 0, []))
            report.decided_by_user = list(plan.detection.decided_by_user) if plan.detection else []
            advance = _PhaseClock(report.phase_seconds, progress or (lambda amount, total=None, phase=None: None),
                                  began)
            output_bytes = sum(path.stat().st_size for path in output.iterdir() if path.is_file())
            if converted is None:  # the digests then name what else differs
                advance(0, output_bytes, "digests")
                report.structure_problems = structure.check_files(output, manifest, advance) + [str(unreadable)]
                return report
            entries = list(converted.tensors.values())
            report.structure_problems = structure.check_reading(plan) + structure.check_structure(
                plan, output, manifest, converted.tensors)
            if report.structure_problems or level == "structure":
                held.stop()  # the early digests: taken again here, phase by phase, for the structure's verdict alone
                advance(0, output_bytes, "digests")
                hashed: dict[str, dict[str, str]] = {}  # each shard's tensors' digests, taken once for the shard's digest
                report.structure_problems += structure.check_files(output, manifest, advance, hashed)
                # each tensor too: a damaged shard is then named with the tensors whose bytes changed
                advance(0, sum(entry.nbytes for entry in entries), "tensor-digests")
                report.structure_problems += structure.check_tensor_digests(entries, manifest, advance, hashed)
                if not report.structure_problems:
                    report.proven["structure"] = PROOFS["structure"]
                return report
            generator = _generator(seed) if sample is not None or level == "numerics" else None
            layer_experts = [_sampled(layer.shape.experts, sample, generator) for layer in plan.layers]
            layer_jobs = [plan.layer_jobs[layer.module] for layer in plan.layers]
            copies = [job for job in plan.jobs if isinstance(job, CopyJob)]
            linears = [job for job in plan.jobs if isinstance(job, LinearJob)]
            compared = _input_bytes(copies + linears + [jobs[e] for jobs, experts in zip(layer_jobs, layer_experts)
                                                        for e in experts])
            # The digests of both sides run beside the checks: one after the other they were a third of verify's
            # time (docs/BENCHMARKS.md). One phase counts the bytes of all three (what the digests did before it
            # began comes in at once); the structure level's verdict still comes first: with a digest that
            # differs, the checks' results are not reported.
            published = 0 if anchor is None else sum(
                (checkpoint.root / name).stat().st_size for name in anchor.published if (checkpoint.root / name).is_file())
            advance(0, output_bytes + sum(path.stat().st_size for path in checkpoint.files) + compared + published,
                    "lossless")
            advance = _Serialized(advance)
            held.attach(advance)
        except BaseException:
            held.stop()
            raise
    audits = Audits()
    served = _served_dtype(output)
    cast = plan.scale_cast if served is None else engine_scale_cast(plan.backend, plan.layers[0].shape.scale_dtype, served)
    try:
        with TensorReader() as reader:
            started = time.perf_counter()
            try:
                # Pass-through bytes need no worker: compared here (while the fork server imports torch, if
                # the checks need it).
                report.passthrough_problems, report.passthrough_checked = _check_passthrough(
                    copies, converted.tensors, advance)
                report.phase_seconds["pass-through"] = round(time.perf_counter() - started, 3)
                started = time.perf_counter()
                executor = _checkers(executor, workers, ray_address, plan.checks_need_torch)
                # the rest of the workers' start: the fork server's import of torch, where they need it
                report.phase_seconds["workers-start"] = round(time.perf_counter() - started, 3)
                started = time.perf_counter()
                with executor:
                    _check_jobs(report, executor, plan, converted.tensors, linears, layer_jobs, layer_experts, cast,
                                audits, advance)
            except Exception:
                if not digested.result()[0]:
                    raise
                # the output differs from its digests, and the checks could not even read it: the digests say why
            report.phase_seconds["checks"] = round(time.perf_counter() - started, 3)
            (structure_problems, report.source_problems, report.source_files_checked,
             report.provenance_problems) = digested.result()
            if anchor is not None:
                report.published_files_checked = len(anchor.published)
                report.provenance = provenance.describe(anchor, len(anchor.published), report.provenance_problems)
            report.phase_seconds.update(digest_seconds)
            if structure_problems:  # the structure level's verdict alone, as when it runs by itself
                return replace(report, structure_problems=structure_problems, source_problems=[],
                               source_files_checked=0, passthrough_problems=[], passthrough_checked=0,
                               dense_linear_problems=[], dense_linears_checked=0, layers=[], provenance_problems=[],
                               published_files_checked=0, provenance=provenance.describe(anchor, 0, []))
            report.proven["structure"] = PROOFS["structure"]
            # The kernel check last, in its own phase: on a CPU the Triton interpreter takes seconds a layer.
            indices, sampled = kernel_layers(len(report.layers), asked, numerics_layers,
                                             lambda: kernel.device().startswith("cpu"))
            checked = [report.layers[index] for index in indices]
            report.kernel_sample = [layer.module for layer in checked] if sampled else []
            if checked:
                report.numerics_device = kernel.device()
                advance(0, len(checked), "kernel")
            for layer, jobs, experts, result in [(plan.layers[index], layer_jobs[index], layer_experts[index],
                                                  report.layers[index]) for index in indices]:
                started = time.perf_counter()
                try:
                    _check_numerics(plan, layer, jobs, experts, converted.tensors, reader, tokens, generator, result)
                except ValueError as error:  # the serving kernel's own reading of the bytes fails
                    result.numerics_failure = str(error)
                result.seconds += time.perf_counter() - started
                advance(1)
    except BaseException:  # an error or an interrupt: the digests stop at their next file
        advance.stop()
        raise
    report.nonfinite_scales = audits.report("nonfinite_scales")
    if cast is not None:
        report.engine_scale_cast = {"stored": cast[0], "model": cast[1], **audits.casts}
    if report.ok:
        report.proven["lossless"] = PROOFS["lossless"] + ([f"(only {sample} random experts per layer were "
                                                            f"decoded: --sample)"] if sample else [])
        if anchor is not None:
            report.proven["lossless"].append(f"every file of the source matches the digest the Hub published for it "
                                             f"in {anchor.repo}@{anchor.revision}")
        if level == "numerics" and any(layer.relative_error is not None for layer in report.layers):
            report.proven["numerics"] = PROOFS["numerics"]
    return report


def _check_jobs(report: VerifyReport, executor: Any, plan: Plan, tensors: dict[str, TensorEntry],
                linears: list[LinearJob], layer_jobs: list[list[ExpertJob]],
                layer_experts: list[list[int]], cast: tuple[str, str] | None, audits: Audits,
                advance: Callable[..., None]) -> None:
    """The lossless level's checks into `report`: the dense linears' and the experts' decodes on the
    executor's workers."""
    linear_results = _checked(executor, plan.codec, [(job, _outputs_of(job, tensors)) for job in linears], cast, audits)
    for job, problems in zip(linears, linear_results):
        report.dense_linear_problems += [f"{job.prefix}: {problem}" for _, problem in problems]
        advance(_input_bytes([job]))
    report.dense_linears_checked = len(linears)
    # Every layer's experts in one stream of tasks, so the workers never wait for a layer's last expert
    # before the next layer starts; a layer's seconds run from its first task's hand-over (the previous
    # layer's last result) to its last result.
    kernel = LAYER_KERNELS[plan.backend.numerics.kernel]
    report.layers = [LayerResult(layer.module, experts=layer.shape.experts, tolerance=kernel.tolerance(layer.shape))
                     for layer in plan.layers]
    checks = [(index, e) for index, experts in enumerate(layer_experts) for e in experts]
    expert_jobs = [(layer_jobs[index][e], _outputs_of(layer_jobs[index][e], tensors)) for index, e in checks]
    started = time.perf_counter()
    for (index, e), problems in zip(checks, _checked(executor, plan.codec, expert_jobs, cast, audits)):
        result, job = report.layers[index], layer_jobs[index][e]
        result.lossless_failures += [f"expert {e}{f' {key}' if key else ''}: {problem}" for key, problem in problems]
        result.experts_exact += not problems
        result.experts_checked += 1
        advance(_input_bytes([job]))
        now = time.perf_counter()
        result.seconds, started = result.seconds + (now - started), now


def _checked(executor: Any, codec: Codec, jobs: list[tuple[ConvertJob, dict[str, TensorEntry]]],
             cast: tuple[str, str] | None, audits: Audits) -> Iterator[list[tuple[str | None, str]]]:
    """Each job's problems (`_check_job`), in order, checked on the executor's workers a batch of jobs a
    task (executor.in_batches); what the audits found goes into `audits`."""
    for problems, found in in_batches(executor, _check_task, [(codec, job, outputs, cast) for job, outputs in jobs]):
        audits.merge(found)
        yield problems


def _digests(output: Path, manifest: dict[str, Any], entries: list[TensorEntry], checkpoint: Any,
             anchor: provenance.Anchor | None, advance: Callable[..., None],
             seconds: dict[str, float]) -> tuple[list[str], list[str], int, list[str]]:
    """The structure level's digests (the output's files, then its tensors, from the same pass), the
    source's shard digests and, for an anchored source, its files against the published digests:
    (structure problems, source problems, source shards checked, files unlike their published digests). `seconds`
    gets each one's duration (they overlap verify's other work)."""
    started = time.perf_counter()
    hashed: dict[str, dict[str, str]] = {}
    problems = structure.check_files(output, manifest, advance, hashed)
    problems += structure.check_tensor_digests(entries, manifest, lambda amount: None, hashed)
    seconds["digests"] = round(time.perf_counter() - started, 3)
    started = time.perf_counter()
    source_problems, checked = structure.check_source_digests(checkpoint, manifest, advance)
    seconds["source-digests"] = round(time.perf_counter() - started, 3)
    if anchor is None:
        return problems, source_problems, checked, []
    started = time.perf_counter()
    unpublished = provenance.mismatches(checkpoint.root, anchor, sorted(anchor.published), advance)
    seconds["source-published-digests"] = round(time.perf_counter() - started, 3)
    return problems, source_problems, checked, unpublished


def _anchor(output: Path, source: str | Path, recorded: dict[str, Any],
            origin: dict[str, Any]) -> provenance.Anchor | None:
    """What the source is checked against: the Hub snapshot the conversion read (recorded in the manifest),
    else the one `--source` names now (a check anchored after a conversion from a local copy); a source
    of another commit than the one converted is refused."""
    converted, named = provenance.recorded_anchor(recorded), provenance.recorded_anchor(origin)
    if converted is not None and named is not None and (named.repo, named.revision) != (converted.repo,
                                                                                          converted.revision):
        raise MoeconvError(f"{source}: is {named.repo}@{named.revision}, but {output} was converted from "
                           f"{converted.repo}@{converted.revision}; pass --source {converted.repo}@{converted.revision}")
    return converted or named


class _Held:
    """The early digests' progress: held (summed) until `attach` gives it somewhere to go, the lossless
    phase's progress, then passed on; after `stop`, a call raises KeyboardInterrupt (in the digest thread:
    it ends at its next file)."""

    def __init__(self) -> None:
        self.lock, self.held, self.target, self.stopped = threading.Lock(), 0, None, False

    def __call__(self, amount: int) -> None:
        if self.stopped:
            raise KeyboardInterrupt
        with self.lock:
            if self.target is None:
                self.held += amount
                return
        self.target(amount)

    def attach(self, target: Callable[[int], None]) -> None:
        with self.lock:
            self.target, held, self.held = target, self.held, 0
        if held:
            target(held)

    def stop(self) -> None:
        self.stopped = True


class _Serialized:
    """A progress callback that the digest thread and the main thread both call, one at a time; after
    `stop`, a call raises KeyboardInterrupt (in the digest thread: it ends at its next file)."""

    def __init__(self, progress: Callable[..., None]):
        self.progress, self.lock, self.stopped = progress, threading.Lock(), False

    def __call__(self, *args: Any) -> None:
        if self.stopped:
            raise KeyboardInterrupt
        with self.lock:
            self.progress(*args)

    def stop(self) -> None:
        self.stopped = True


def _in_background(function: Callable[..., Any], *args: Any) -> Future:
    """function(*args) on a daemon thread (an interrupted verify does not wait for it at exit)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(function(*args))
        except BaseException as error:  # handed to whoever reads the result
            future.set_exception(error)

    threading.Thread(target=run, name="moeconv-digests", daemon=True).start()
    return future


class _PhaseClock:
    """verify's progress callback, passed through, that also times each phase (from its start to the
    next one's, or to the last call) into `seconds`, and what came before the first (`began`: reading the
    manifest, opening both checkpoints, the plan, the structure checks) as `prepare`."""

    def __init__(self, seconds: dict[str, float], progress: Callable[..., None], began: float):
        self.seconds, self.progress, self.phase, self.started = seconds, progress, None, began

    def __call__(self, amount: int, total: int | None = None, phase: str | None = None) -> None:
        now = time.perf_counter()
        if phase is not None:
            if self.phase is None:
                self.seconds["prepare"] = round(now - self.started, 3)
            self.phase, self.started = phase, now
            self.progress(amount, total, phase)
        else:
            self.progress(amount)
        if self.phase is not None:
            self.seconds[self.phase] = round(now - self.started, 3)


def _recorded_source(output: Path, recorded: dict[str, Any]) -> ResolvedSource:
    """The source moeconv.json names, found without the network: its folder (a relative path is relative
    to the output folder, not to where verify runs), else its Hub id, from the local cache only (a manifest
    must not make verify download anything: `--source ID` does)."""
    path = recorded["path"]
    folder = Path(os.path.normpath(output / path))
    if folder.is_dir():
        return resolve_source(folder)
    repo = recorded.get("repo")
    repo, revision = (repo, recorded.get("revision")) if isinstance(repo, str) else (path, None)
    where = output / MANIFEST_NAME
    if not is_hub_id(repo):
        raise MoeconvError(f"{where}: source {path}: no such folder (the source path recorded at conversion; a "
                           f"relative path is relative to {output}); if the source moved, or this is another machine, "
                           f"pass --source SRC")
    try:
        return resolve_source(repo, revision=revision if isinstance(revision, str) else None, local_files_only=True)
    except MoeconvError:
        raise MoeconvError(f"{where}: the source is the Hub id {repo}, not in the local Hugging Face cache; verify "
                           f"downloads only when asked: pass --source {repo}") from None


def _recorded_shard_size(arguments: dict[str, Any]) -> int:
    """The --max-shard-size the output was converted with (the index's shards follow from it)."""
    value = arguments.get("max_shard_size")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else DEFAULT_MAX_SHARD_SIZE


def _checkers(executor: str, workers: int | None, ray_address: str | None, needs_torch: bool) -> Any:
    """What runs the lossless checks: this machine's worker processes (forked from this process where
    the checks need no torch), or Ray tasks."""
    if executor == "local":
        return Executor(workers, needs_torch=needs_torch)
    if executor == "ray":
        from moeconv.distributed import RayMap

        return RayMap(ray_address)
    raise MoeconvError(f"--executor {executor}: choose local or ray")


def _served_dtype(output: Path) -> str | None:
    """The model dtype an engine reads from the OUTPUT's config.json (a user may have changed it)."""
    config = read_json(output / "config.json")
    value = config.get("torch_dtype") or config.get("dtype")
    return value if isinstance(value, str) else None




def _check_passthrough(copies: list[CopyJob], tensors: dict[str, TensorEntry],
                       advance: Callable[..., None]) -> tuple[list[str], int]:
    problems = []
    for job in copies:
        name = job.slot.tensor.name
        if not _same_bytes(job.source.entry, tensors[name]):
            problems.append(f"{tensors[name].file.name}: tensor {name} differs from the source's bytes")
        advance(job.source.nbytes)
    return problems, len(copies)


def _input_bytes(jobs: list) -> int:
    """The source bytes the jobs read."""
    return sum(piece.nbytes for job in jobs for piece in job.inputs)


def _same_bytes(a: TensorEntry, b: TensorEntry) -> bool:
    return a.nbytes == b.nbytes and same_bytes(a.file, a.begin, b.file, b.begin, a.nbytes)


def _generator(seed: int) -> torch.Generator:
    """The random source of the sampled experts, then of the kernel check's tokens and routing."""
    import torch

    return torch.Generator().manual_seed(seed)


def _sampled(count: int, sample: int | None, generator: torch.Generator | None) -> list[int]:
    if sample is None or sample >= count:
        return list(range(count))
    import torch

    return sorted(torch.randperm(count, generator=generator)[:sample].tolist())


def _output_blocks(job: ConvertJob, tensors: dict[str, TensorEntry],
                   read: Callable[[TensorEntry, int, tuple[int, ...]], Any]) -> dict[str, Any]:
    """The bytes the job wrote, read back from the output (`read`: TensorReader.read_slice for tensors,
    read_raw_slice for the stored arrays), keyed by backend suffix."""
    return {suffix: read(tensors[slot.tensor.name], slot.offset, slot.shape) for suffix, slot in job.slots.items()}


def _outputs_of(job: ConvertJob, tensors: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    """The output tensors a job's slots lie in (what a worker process needs of the output's header)."""
    return {slot.tensor.name: tensors[slot.tensor.name] for slot in job.slots.values()}


def _check_task(codec: Codec, job: ConvertJob, outputs: dict[str, TensorEntry],
                cast: tuple[str, str] | None) -> tuple[list[tuple[str | None, str]], Audits]:
    """`_check_job` in a worker (moeconv.executor): its problems, and what its audits found."""
    audits = Audits()
    return _check_job(codec, job, outputs, worker_reader(), audits, cast), audits


def _check_job(codec: Codec, job: ConvertJob, tensors: dict[str, TensorEntry], reader: TensorReader,
               audits: Audits, cast: tuple[str, str] | None) -> list[tuple[str | None, str]]:
    """(projection, mismatch) for every canonical weight whose output bytes do not decode to exactly
    what the source format's decoder gives; (None, why) when the layout cannot be decoded at all. In
    numpy where the job's layout and format decode the stored arrays (`transform.decodes_stored`), else,
    or for an act-order fold, in torch."""
    if transform.decodes_stored(job, codec):
        try:
            converted = transform.decode_stored(job, codec, _output_blocks(job, tensors, reader.read_raw_slice))
        except ValueError as error:  # the layout's own redundancy (e.g. weight_shape) disagrees
            return [(None, str(error))]
        decoded = transform.source_weights_stored(job, codec, reader)
        if decoded is not None:
            return _compared(job, converted, *decoded, audits, cast)
    try:
        converted = transform.decode(job, codec, _output_blocks(job, tensors, reader.read_slice))
    except ValueError as error:  # the layout's own redundancy (e.g. CPU compensation sums) disagrees
        return [(None, str(error))]
    return _compared(job, converted, *transform.source_weights(job, codec, reader), audits, cast)


def _compared(job: ConvertJob, converted: dict[str, QuantizedWeight], source: dict[str, QuantizedWeight],
              counts: list[tuple[str, dict[str, int]]], audits: Audits,
              cast: tuple[str, str] | None) -> list[tuple[str | None, str]]:
    """The mismatches of the output's decoding against the source's (both tensors, or both stored arrays);
    the source's audit counts and engine cast recorded."""
    for name, found in counts:
        audits.record(name, found)
    if cast is not None:
        for weight in source.values():  # stored BF16 bit patterns as the values they hold
            scales = weight.scales
            audits.record_cast(as_float32(scales) if isinstance(scales, np.ndarray) else scales, *cast)
    return [(key if isinstance(job, ExpertJob) else None, problem) for key, weight in source.items()
            if (problem := converted[key].mismatch(weight))]


def _kernel_tensors(plan: Plan, jobs: list[ExpertJob], tensors: dict[str, TensorEntry],
                    reader: TensorReader) -> dict[str, torch.Tensor]:
    """The layout the backend's reference kernel reads, for the experts of `jobs` stacked along dim 0:
    the output's own bytes, or (Numerics.layout) those re-encoded into another backend's layout
    through the canonical form."""
    import torch

    layout = plan.backend.numerics.layout
    blocks = [_output_blocks(job, tensors, reader.read_slice) for job in jobs]
    if layout is not None:
        target = get_backend(layout)
        blocks = [target.encode_expert(plan.backend.decode_expert(own, job.shape), job.shape)
                  for own, job in zip(blocks, jobs)]
    return {suffix: torch.stack([own[suffix] for own in blocks]) for suffix in blocks[0]}


def _check_numerics(plan: Plan, layer: MoELayer, jobs: list[ExpertJob], experts: list[int],
                    tensors: dict[str, TensorEntry], reader: TensorReader, tokens: int, generator: torch.Generator,
                    result: LayerResult) -> None:
    """The backend's kernel on the converted tensors against a float64 reference that dequantizes
    the SOURCE through the source format's decoder, for random tokens routed so that each of `experts`
    (the layer's checked ones) gets one at least: into `result`, how many experts the tokens reached and
    the errors (relative, max abs, max abs of the reference), or why they say nothing (the source's
    weights or the kernel's output not finite). Only the experts the routing picks are read."""
    import torch

    from moeconv.kernels.reference import covering_routing, reference_fused_moe, relative_error

    shape = layer.shape
    configured = plan.checkpoint.config.get("num_experts_per_tok")
    # Only the check's routing depends on it: a value that is not a positive integer falls back to 2.
    topk = min(configured if isinstance(configured, int) and not isinstance(configured, bool) and configured > 0
               else 2, shape.experts)
    weights, ids = covering_routing(tokens, shape.experts, topk, generator, experts)
    used = sorted(set(ids.flatten().tolist()))
    result.experts_routed = len(used)
    local_ids = torch.tensor([used.index(e) for e in ids.flatten().tolist()]).reshape(ids.shape)
    x = torch.randn(len(ids), shape.hidden, generator=generator).to(torch.float16)
    nonfinite: list[str] = []

    @functools.lru_cache(maxsize=1)  # the reference asks for an expert's w13, then for its w2
    def dequantized(index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One routed expert of the source in float64 (never the whole layer at once: 16 times a 4-bit layer)."""
        source = transform.source_weights(jobs[used[index]], plan.codec, reader)[0]
        dense = {key: source[key].dequantize(torch.float64) for key in ("gate", "up", "down")}
        nonfinite.extend(f"expert {used[index]} {key}" for key, weight in dense.items()
                         if not bool(weight.isfinite().all()))
        return torch.cat([dense["gate"], dense["up"]]), dense["down"]

    ref = reference_fused_moe(x.double(), _Indexed(lambda i: dequantized(i)[0]), _Indexed(lambda i: dequantized(i)[1]),
                              weights.double(), local_ids, dtype=torch.float64)
    if nonfinite:
        result.numerics_failure = (f"{', '.join(nonfinite)}: the source's scales are NaN or infinite (converted as "
                                   f"they are): no kernel can compute with them")
        return
    slices = _kernel_tensors(plan, [jobs[e] for e in used], tensors, reader)
    with warnings.catch_warnings():  # the Triton interpreter's numpy warns of NaN or overflow: the check below says it
        warnings.simplefilter("ignore", RuntimeWarning)
        out = LAYER_KERNELS[plan.backend.numerics.kernel].run(slices, shape, x, weights, local_ids).double()
    if not bool(out.isfinite().all()):
        result.numerics_failure = "the kernel's output is NaN or infinite (the reference's is finite)"
        return
    result.relative_error = float(relative_error(out, ref))
    result.max_abs_error, result.max_abs_reference = float((out - ref).abs().max()), float(ref.abs().max())


class _Indexed:
    """`[index]` is `get(index)`: what `reference_fused_moe` indexes for each expert's weights."""

    def __init__(self, get: Callable[[int], Any]) -> None:
        self.get = get

    def __getitem__(self, index: int) -> Any:
        return self.get(index)
