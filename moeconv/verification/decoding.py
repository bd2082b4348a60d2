"""Every call verify makes into the codecs and their workers: what a lossless check decodes on each side
(the output's bytes through the backend, the source's through its format: `transform`), the processes
that decode (`executor`), and the layout the reference kernel reads. The rest of the package asks this
module and never `transform`, a codec or the executor directly."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from moeconv import casts, transform
from moeconv.audit import Audits
from moeconv.backends import get_backend
from moeconv.checkpoint.reader import TensorEntry, TensorReader
from moeconv.errors import MoeconvError
from moeconv.executor import Executor, in_batches, worker_reader
from moeconv.plan import Plan
from moeconv.transform import Codec
from moeconv.worklist import ConvertJob, ExpertJob

if TYPE_CHECKING:  # the kernel check's, in verify's own process; a lossless verify never imports it
    import torch

    from moeconv.canonical import QuantizedWeight

Problems = list[tuple[str | None, str]]  # (projection, or None for the whole job; what differs)


def checkers(executor: str, workers: int | None, ray_address: str | None) -> Any:
    """What runs the lossless checks: this machine's worker processes, or Ray tasks."""
    if executor == "local":
        return Executor(workers)
    if executor == "ray":
        from moeconv.distributed import RayMap

        return RayMap(ray_address)
    raise MoeconvError(f"--executor {executor}: choose local or ray")


def checked(executor: Any, codec: Codec, jobs: list[ConvertJob], tensors: dict[str, TensorEntry],
            cast: tuple[str, str] | None, audits: Audits) -> Iterator[Problems]:
    """Each job's problems (`_check_job`), in order, checked on the executor's workers a batch of jobs a
    task (executor.in_batches); what the audits found goes into `audits`."""
    tasks = [(codec, job, _outputs_of(job, tensors), cast) for job in jobs]
    for problems, found in in_batches(executor, _check_task, tasks):
        audits.merge(found)
        yield problems


def _outputs_of(job: ConvertJob, tensors: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    """The output tensors a job's slots lie in (what a worker process needs of the output's header)."""
    return {slot.tensor.name: tensors[slot.tensor.name] for slot in job.slots.values()}


def _output_blocks(job: ConvertJob, tensors: dict[str, TensorEntry], reader: TensorReader) -> transform.Stored:
    """The bytes the job wrote, read back from the output as stored arrays, keyed by backend suffix."""
    return {suffix: reader.read_raw_slice(tensors[slot.tensor.name], slot.offset, slot.shape)
            for suffix, slot in job.slots.items()}


def _check_task(codec: Codec, job: ConvertJob, outputs: dict[str, TensorEntry],
                cast: tuple[str, str] | None) -> tuple[Problems, Audits]:
    """`_check_job` in a worker (moeconv.executor): its problems, and what its audits found."""
    audits = Audits()
    return _check_job(codec, job, outputs, worker_reader(), audits, cast), audits


def _check_job(codec: Codec, job: ConvertJob, tensors: dict[str, TensorEntry], reader: TensorReader,
               audits: Audits, cast: tuple[str, str] | None) -> Problems:
    """(projection, mismatch) for every canonical weight whose output bytes do not decode to exactly
    what the source format's decoder gives; (None, why) when the layout cannot be decoded at all."""
    # where either side is in an object store: the job's ranges of both fetched in one call an object
    reader.prefetch([piece.entry for piece in job.inputs],
                    [(tensors[slot.tensor.name], slot.offset, slot.shape) for slot in job.slots.values()])
    try:
        converted = transform.decode(job, codec, _output_blocks(job, tensors, reader))
    except ValueError as error:  # the layout's own redundancy (weight_shape, CPU compensation sums) disagrees
        return [(None, str(error))]
    return _compared(job, converted, *transform.source_weights(job, codec, reader), audits, cast)


def _compared(job: ConvertJob, converted: dict[str, QuantizedWeight], source: dict[str, QuantizedWeight],
              counts: list[tuple[str, dict[str, int]]], audits: Audits, cast: tuple[str, str] | None) -> Problems:
    """The mismatches of the output's decoding against the source's; the source's audit counts and engine
    cast recorded."""
    for name, found in counts:
        audits.record(name, found)
    if cast is not None:
        for weight in source.values():
            audits.record_cast(weight.scales, *cast)
    if any(isinstance(weight, casts.CastWeight) for weight in converted.values()):  # a cast: fused linears' γ
        shared = casts.shared_exponents(source, converted[next(iter(converted))].target)
        return [(key if isinstance(job, ExpertJob) else None, problem) for key, weight in source.items()
                if (problem := converted[key].mismatch(weight, shared[key]))]
    return [(key if isinstance(job, ExpertJob) else None, problem) for key, weight in source.items()
            if (problem := converted[key].mismatch(weight))]


def cast_problems(plan: Plan, recorded: Any, executor: str, workers: int | None,
                  ray_address: str | None) -> list[str]:
    """A cast output's census recomputed from the source (transform.cast_census, every converted linear) against
    the one moeconv.json records (its `cast`): the counts, each inexact linear and the bound must be the same
    exactly; and an inexact cast must have been allowed."""
    with checkers(executor, workers, ray_address) as running:
        tally = transform.cast_census(running, [job for job in plan.jobs if not job.copies], plan.codec, plan.cast)
    found = tally.record(plan.allow_inexact)
    if not isinstance(recorded, dict):
        return ["moeconv.json: records no census of its --cast (`cast`)"]
    problems = [f"moeconv.json: cast.{key} records {recorded.get(key)!r}, the source's census gives {value!r}"
                for key, value in found.items() if recorded.get(key) != value]
    if not tally.is_exact and not plan.allow_inexact:
        problems.append(f"an inexact cast not allowed at conversion: {tally.summary()}")
    return problems


def source_weights(plan: Plan, job: ExpertJob, reader: TensorReader) -> dict[str, QuantizedWeight]:
    """One expert of the source in the canonical form, through the source format's decoder."""
    return transform.source_weights(job, plan.codec, reader)[0]


def kernel_tensors(plan: Plan, jobs: list[ExpertJob], tensors: dict[str, TensorEntry],
                   reader: TensorReader) -> dict[str, torch.Tensor]:
    """The layout the backend's reference kernel reads, for the experts of `jobs` stacked along dim 0:
    the output's own bytes, or (Numerics.layout, integer codes only) those re-encoded into another backend's
    layout through the canonical form."""
    layout = plan.backend.numerics.layout if jobs[0].shape.float_scheme is None else None
    blocks = [_output_blocks(job, tensors, reader) for job in jobs]
    if layout is not None:
        target = get_backend(layout)
        blocks = [target.encode_expert(plan.backend.decode_expert(own, job.shape), job.shape)
                  for own, job in zip(blocks, jobs)]
    return {suffix: _tensor(np.stack([own[suffix] for own in blocks])) for suffix in blocks[0]}


def _tensor(stored: np.ndarray) -> torch.Tensor:
    """A stored array as the tensor the kernel reads: uint16 is BF16's bit patterns (no layout stores U16)."""
    import torch

    tensor = torch.from_numpy(stored)
    return tensor.view(torch.bfloat16) if stored.dtype == np.uint16 else tensor
