"""verify's second level, lossless: the checks the plan's jobs give (each pass-through tensor, each dense
linear, each checked expert of each MoE layer, in that order) and their run: the pass-through bytes compared
here, the rest decoded on the workers (`decoding`), while the digests of both sides run on the scheduler's
thread; a digest that differs decides the verdict alone (the structure level's, as when it runs by itself)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from moeconv import provenance
from moeconv.audit import Audits
from moeconv.checkpoint.reader import TensorEntry, TensorReader, same_bytes
from moeconv.kernels.runners import layer_tolerance
from moeconv.plan import Plan
from moeconv.verification import decoding
from moeconv.verification.report import LayerResult, VerifyReport
from moeconv.verification.scheduler import Scheduler
from moeconv.worklist import CopyJob, ExpertJob, LinearJob

if TYPE_CHECKING:  # imported only to sample the experts (--sample) or for the kernel check's tokens
    import torch


@dataclass(frozen=True)
class Checks:
    """The jobs the lossless level checks, built from the plan: `experts[i]` the checked experts of
    `plan.layers[i]` (all of them, or `sample` chosen at random)."""

    copies: list[CopyJob]
    linears: list[LinearJob]
    layer_jobs: list[list[ExpertJob]]
    experts: list[list[int]]

    @classmethod
    def of(cls, plan: Plan, sample: int | None, generator: torch.Generator | None) -> Checks:
        return cls([job for job in plan.jobs if isinstance(job, CopyJob)],
                   [job for job in plan.jobs if isinstance(job, LinearJob)],
                   [plan.layer_jobs[layer.module] for layer in plan.layers],
                   [sampled(layer.shape.experts, sample, generator) for layer in plan.layers])

    def source_bytes(self) -> int:
        """The source bytes the checks read."""
        checked = [jobs[e] for jobs, experts in zip(self.layer_jobs, self.experts) for e in experts]
        return _input_bytes(self.copies + self.linears + checked)


def phase_bytes(opened: Any, checks: Checks) -> int:
    """What the lossless phase counts: the output's file bytes and the source's shard bytes (and, for an
    anchored source, its published files), hashed, and the source bytes the checks read."""
    root, anchor = opened.checkpoint.root, opened.anchor
    published = 0 if anchor is None else sum(
        (root / name).stat().st_size for name in anchor.published if (root / name).is_file())
    return (sum(path.stat().st_size for path in opened.output.iterdir() if path.is_file())
            + sum(path.stat().st_size for path in opened.checkpoint.files) + checks.source_bytes() + published)


def run(report: VerifyReport, plan: Plan, checks: Checks, tensors: dict[str, TensorEntry], reader: TensorReader,
        scheduler: Scheduler, executor: str, workers: int | None, ray_address: str | None,
        anchor: provenance.Anchor | None, cast: tuple[str, str] | None, audits: Audits) -> VerifyReport:
    """The lossless phase into `report` (begun by the caller, the digests' thread sharing it); returns the
    structure level's report alone when the digests found a difference."""
    started = time.perf_counter()
    try:
        with scheduler.timed("pass-through"):  # no worker: compared here
            report.passthrough_problems = _passthrough_problems(checks.copies, tensors, scheduler)
            report.passthrough_checked = len(checks.copies)
        with scheduler.timed("workers-start"):
            running = decoding.checkers(executor, workers, ray_address)
        started = time.perf_counter()
        with running:
            _check_jobs(report, running, plan, checks, tensors, cast, audits, scheduler)
    except Exception:
        if not scheduler.background_result()[0]:
            raise
        # the output differs from its digests, and the checks could not even read it: the digests say why
    scheduler.seconds["checks"] = round(time.perf_counter() - started, 3)
    structure_problems, report.source_problems, report.source_files_checked, report.provenance_problems = (
        scheduler.background_result())
    if anchor is not None:
        report.published_files_checked = len(anchor.published)
        report.provenance = provenance.describe(anchor, len(anchor.published), report.provenance_problems)
    if structure_problems:  # the structure level's verdict alone, as when it runs by itself
        return replace(report, structure_problems=structure_problems, source_problems=[], source_files_checked=0,
                       passthrough_problems=[], passthrough_checked=0, dense_linear_problems=[],
                       dense_linears_checked=0, layers=[], provenance_problems=[], published_files_checked=0,
                       provenance=provenance.describe(anchor, 0, []) if anchor is not None else report.provenance)
    return report


def _passthrough_problems(copies: list[CopyJob], tensors: dict[str, TensorEntry], scheduler: Scheduler) -> list[str]:
    problems = []
    for job in copies:
        name = job.slot.tensor.name
        if not _same_bytes(job.source.entry, tensors[name]):
            problems.append(f"{tensors[name].file.name}: tensor {name} differs from the source's bytes")
        scheduler.advance(job.source.nbytes)
    return problems


def _check_jobs(report: VerifyReport, running: Any, plan: Plan, checks: Checks, tensors: dict[str, TensorEntry],
                cast: tuple[str, str] | None, audits: Audits, scheduler: Scheduler) -> None:
    """The dense linears' and the experts' decodes on the workers, into `report`."""
    linear_results = decoding.checked(running, plan.codec, checks.linears, tensors, cast, audits)
    for job, problems in zip(checks.linears, linear_results):
        report.dense_linear_problems += [f"{job.prefix}: {problem}" for _, problem in problems]
        scheduler.advance(_input_bytes([job]))
    report.dense_linears_checked = len(checks.linears)
    # Every layer's experts in one stream of tasks, so the workers never wait for a layer's last expert
    # before the next layer starts; a layer's seconds run from its first task's hand-over (the previous
    # layer's last result) to its last result.
    report.layers = [LayerResult(layer.module, experts=layer.shape.experts,
                                 tolerance=layer_tolerance(plan.backend.numerics, layer.shape)) for layer in plan.layers]
    indices = [(index, e) for index, experts in enumerate(checks.experts) for e in experts]
    jobs = [checks.layer_jobs[index][e] for index, e in indices]
    started = time.perf_counter()
    for (index, e), job, problems in zip(indices, jobs, decoding.checked(running, plan.codec, jobs, tensors, cast,
                                                                         audits)):
        result = report.layers[index]
        result.lossless_failures += [f"expert {e}{f' {key}' if key else ''}: {problem}" for key, problem in problems]
        result.experts_exact += not problems
        result.experts_checked += 1
        scheduler.advance(_input_bytes([job]))
        now = time.perf_counter()
        result.seconds, started = result.seconds + (now - started), now


def _input_bytes(jobs: list) -> int:
    """The source bytes the jobs read."""
    return sum(piece.nbytes for job in jobs for piece in job.inputs)


def _same_bytes(a: TensorEntry, b: TensorEntry) -> bool:
    return a.nbytes == b.nbytes and same_bytes(a.file, a.begin, b.file, b.begin, a.nbytes)


def generator(seed: int) -> torch.Generator:
    """The random source of the sampled experts, then of the kernel check's tokens and routing."""
    import torch

    return torch.Generator().manual_seed(seed)


def sampled(count: int, sample: int | None, generator: torch.Generator | None) -> list[int]:
    if sample is None or sample >= count:
        return list(range(count))
    import torch

    return sorted(torch.randperm(count, generator=generator)[:sample].tolist())
