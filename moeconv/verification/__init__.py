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
   source tensors, bit for bit (both decoded in numpy, never through the converter's packed route);
   pass-through tensors are byte-identical to the source.
3. numerics: the reference kernel the backend names (moeconv.kernels.runners) runs on the converted
   tensors for random tokens, routed so that every checked expert gets one; the reference dequantizes
   the source independently and computes in float64 (float codes: the FP4 kernel decodes the output's
   codes and scale bytes in-kernel, the reference the source's through a table; the layer counts the
   scale blocks decoded).

The package, one question a module: `prepare` (the manifest, both checkpoints, the plan), `structure`,
`lossless` and `numerics` (each level's checks, in order), `decoding` (every call into the codecs and
their workers), `scheduler` (phases, progress, timing, the digests' thread and its stop), `report`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from moeconv.audit import Audits
from moeconv.checkpoint.reader import TensorReader, collection_paused
from moeconv.errors import MoeconvError
from moeconv.storage import local_or_stored
from moeconv.verification import decoding, lossless, numerics, prepare, structure
from moeconv.verification.report import LEVELS, PHASE_UNITS, PROOFS, LayerResult, VerifyReport, finished
from moeconv.verification.scheduler import Scheduler

__all__ = ["LEVELS", "PHASE_UNITS", "LayerResult", "VerifyReport", "verify"]


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
    output = local_or_stored(output)  # an object store URL: read by range requests (storage.py)
    with Scheduler(progress, time.perf_counter()) as scheduler:
        # The manifest, both checkpoints' headers, the plan and the structure checks make hundreds of thousands
        # of long-lived objects and no cycles: the cycle collector's passes were a third of this part's time.
        with collection_paused():
            opened = prepare.open_output(output, source)
            if isinstance(opened, list):  # nothing to plan from: the structure level's verdict
                return VerifyReport(str(output), str(source or ""), structure_problems=opened, level=level)
            if opened.converted is not None and level != "structure":  # they need no plan: they start now
                scheduler.background(structure.digests, output, opened.manifest,
                                     list(opened.converted.tensors.values()), opened.checkpoint, opened.anchor)
            plan = prepare.plan_of(opened)
            report = prepare.report_of(opened, plan, level, scheduler.seconds)
            if opened.converted is not None:
                report.structure_problems = structure.check_reading(plan) + structure.check_structure(
                    plan, output, opened.manifest, opened.converted.tensors)
            if opened.converted is None or report.structure_problems or level == "structure":
                scheduler.cancel()  # the early digests: taken again, phase by phase, for this verdict alone
                return structure.run_alone(report, opened, plan, scheduler)
            generator = lossless.generator(seed) if sample is not None or level == "numerics" else None
            checks = lossless.Checks.of(plan, sample, generator)
            # One phase counts the bytes of the digests of both sides (on the scheduler's thread; what they did
            # before it began comes in at once) and of the checks.
            scheduler.phase("lossless", lossless.phase_bytes(opened, checks))
            scheduler.share()
        audits, cast = Audits(), prepare.scale_cast(output, plan)
        with TensorReader() as reader:
            report = lossless.run(report, plan, checks, opened.converted.tensors, reader, scheduler, executor,
                                  workers, ray_address, opened.anchor, cast, audits)
            if report.structure_problems:
                return report
            if plan.cast is not None:  # the census the cast was decided by, recomputed from the source
                report.cast_census = opened.manifest.data.get("cast") or {}
                report.cast_problems = decoding.cast_problems(plan, opened.manifest.data.get("cast"), executor, workers,
                                                              ray_address)
            report.proven["structure"] = PROOFS["structure"]
            report.nonfinite_scales = audits.report("nonfinite_scales")
            # The kernel check last, in its own phase: on a CPU the Triton interpreter takes seconds a layer.
            numerics.run(report, plan, checks, opened.converted.tensors, reader, scheduler, asked, numerics_layers,
                         tokens, generator)
    return finished(report, audits, cast, sample, opened.anchor)
