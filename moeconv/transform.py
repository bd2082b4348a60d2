"""How bytes are transformed: one conversion job's source tensors into its output blocks, and for
verify the output blocks and the source back to canonical weights. The only code a worker calls
(convert's and verify's tasks), besides reading and writing bytes.

A job goes through the packed form where the source format packs and the layout takes it (packed.py:
numpy on the stored bytes, no torch; proven byte-identical to the canonical route), else through the
canonical form:
the source format decodes each projection (after any lossless regrouping), an act-order down
projection's input permutation is folded into the same expert's gate and up rows (act_order.fold),
and the backend encodes the expert's slice of every layer tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from moeconv import act_order, casts
from moeconv.audit import count as audit_counts
from moeconv.backends.base import Backend, ExpertWeights
from moeconv.canonical import QuantizedWeight, regroup
from moeconv.casts import Census
from moeconv.executor import in_batches, worker_reader
from moeconv.checkpoint.reader import TensorEntry, TensorReader
from moeconv.packing import bf16_as_float32
from moeconv.errors import MoeconvError
from moeconv.formats import SourceFormat
from moeconv.survey import ExpertSlice, linear_name
from moeconv.worklist import ConvertJob, ExpertJob, SourceSlice

Audit = tuple[str, dict[str, int]]  # (source linear, audit counts)
Stored = dict[str, np.ndarray]  # one linear's (or one job's output) stored arrays, by suffix


@dataclass(frozen=True)
class Codec:
    """The two readings a conversion job applies: the source format's decoder (after any lossless
    regrouping) and the backend's encoder, and their inverses for verify."""

    source_format: SourceFormat
    backend: Backend
    regroup_factor: int = 1  # group size divided by this (scales and zeros repeated): lossless

    def decode_source(self, stored: Stored) -> QuantizedWeight:
        """One source linear in the canonical form the plan writes."""
        return regroup(self.source_format.decode(stored), self.regroup_factor)

    def decode_ordered(self, stored: Stored) -> tuple[QuantizedWeight, np.ndarray | None]:
        """As `decode_source`, and for an act-order linear the input permutation under which its groups
        are static (act_order.py); formats that store no g_idx have none."""
        weight, inputs = self.source_format.decode_ordered(stored)
        return regroup(weight, self.regroup_factor), inputs


def takes_packed(job: ConvertJob, codec: Codec) -> bool:
    """Whether the job's format and layout meet in the packed form (packed.py): the fast path, moving the
    stored words as they are. The format may still decline one linear (an act-order g_idx)."""
    layout = codec.backend if isinstance(job, ExpertJob) else job.layout
    return codec.source_format.packs and layout.takes_packed(job.shape)


def convert(job: ConvertJob, codec: Codec, reader: TensorReader) -> tuple[Stored, list[Audit]]:
    """The job's output blocks (by backend suffix), and the audit counts of its source tensors: float codes
    read into the canonical float form and written by the layout; through the packed form where the format and
    the layout take it; else decoded to the canonical form and encoded."""
    stored = _read_sources(job, reader)
    if codec.source_format.float_scheme is not None:
        return _from_float(job, codec, stored), _audits(job, codec, stored, {})
    if takes_packed(job, codec):
        blocks = _through_packed(job, codec, stored)
        if blocks is not None:
            return blocks, _audits(job, codec, stored, {})
    weights = _canonical(job, codec, stored)
    return encode(job, codec, weights), _audits(job, codec, stored, weights)


def _from_float(job: ConvertJob, codec: Codec, stored: dict[str, Stored]) -> Stored:
    """`convert`'s blocks from the canonical float form (float_codes.FloatWeight), which only a layout that
    takes float codes writes (the plan refused the others)."""
    weights = {projection: _decoded(codec.source_format.decode, _sources(job)[projection], tensors)
               for projection, tensors in stored.items()}
    if isinstance(job, ExpertJob):
        return codec.backend.from_float(weights, job.shape)
    return job.layout.from_float_linear(weights["linear"], job.shape)


def _through_packed(job: ConvertJob, codec: Codec, stored: dict[str, Stored]) -> Stored | None:
    """`convert`'s blocks through the packed form; None where the format declines a linear or the layout
    the expert."""
    packed = {}
    for projection, tensors in stored.items():
        weight = _decoded(codec.source_format.to_packed, _sources(job)[projection], tensors)
        if weight is None:
            return None
        packed[projection] = weight.regrouped(codec.regroup_factor)
    if isinstance(job, ExpertJob):
        return codec.backend.from_packed(packed, job.shape)
    return job.layout.from_packed_linear(packed["linear"], job.shape)


def census(job: ConvertJob, codec: Codec, target: str, reader: TensorReader) -> list[tuple[str, Census]]:
    """The census of a float-code cast to `target` (casts.py) of each of the job's source linears, by name:
    what `convert --cast` decides by before writing and `verify` recomputes."""
    stored, sources = _read_sources(job, reader), _sources(job)
    weights = {projection: _decoded(codec.source_format.decode, sources[projection], tensors)
               for projection, tensors in stored.items()}
    shared = casts.shared_exponents(weights, target)  # an expert's gate and up: one NVFP4 global scale
    return [(_linear_name(sources[projection]) if isinstance(job, ExpertJob) else job.prefix,
             casts.census(weight, target, shared[projection]))
            for projection, weight in weights.items()]


def cast_census(executor: Any, jobs: list[ConvertJob], codec: Codec, target: str) -> casts.Tally:
    """The census of every job's linears (`census`) on the executor's workers (executor.in_batches), in job
    order, summed."""
    tally = casts.Tally(codec.source_format.float_scheme.name, target)
    for found in in_batches(executor, _census_task, [(job, codec, target) for job in jobs]):
        for name, counted in found:
            tally.add(name, counted)
    return tally


def _census_task(job: ConvertJob, codec: Codec, target: str) -> list[tuple[str, Census]]:
    return census(job, codec, target, worker_reader())


def source_weights(job: ConvertJob, codec: Codec, reader: TensorReader) -> tuple[dict[str, QuantizedWeight], list[Audit]]:
    """The canonical weights the job's source tensors decode to (gate, up and down of an expert, an act-order
    down projection's permutation folded into gate and up; one keyed "linear" of a dense linear), and their
    audit counts."""
    stored = _read_sources(job, reader)
    weights = _canonical(job, codec, stored)
    return weights, _audits(job, codec, stored, weights)


def encode(job: ConvertJob, codec: Codec, weights: dict[str, QuantizedWeight]) -> Stored:
    """Canonical weights (as `source_weights` keys them) -> the job's output blocks."""
    if isinstance(job, ExpertJob):
        return codec.backend.encode_expert(ExpertWeights(**weights), job.shape)
    return job.layout.encode_linear(weights["linear"], job.shape)


def decode(job: ConvertJob, codec: Codec, blocks: Stored) -> dict[str, QuantizedWeight]:
    """Inverse of `encode`: the job's output blocks back to canonical weights."""
    if isinstance(job, ExpertJob):
        return codec.backend.decode_expert(blocks, job.shape)._asdict()
    return {"linear": job.layout.decode_linear(blocks, job.shape)}


def _sources(job: ConvertJob) -> dict[str, dict[str, SourceSlice]]:
    """The job's source linears: an expert's projections, or a dense linear keyed "linear"."""
    return job.sources if isinstance(job, ExpertJob) else {"linear": job.sources}


def _read_sources(job: ConvertJob, reader: TensorReader) -> dict[str, Stored]:
    """Each source linear's stored arrays (`TensorReader.read_raw`), by suffix."""
    return {projection: {suffix: read_source(piece.entry, reader) for suffix, piece in linear.items()}
            for projection, linear in _sources(job).items()}


def read_source(entry: TensorEntry | ExpertSlice, reader: TensorReader) -> np.ndarray:
    """One source tensor's stored values: a whole stored tensor, or one expert's rows of a tensor that stacks the
    experts on disk (survey.ExpertSlice: gpt-oss)."""
    if isinstance(entry, ExpertSlice):
        return entry.read_raw(reader)
    return reader.read_raw(entry)


def _canonical(job: ConvertJob, codec: Codec, stored: dict[str, Stored]) -> dict[str, QuantizedWeight]:
    """Decoded; an act-order down projection folded with its gate and up (act_order.fold)."""
    sources = _sources(job)
    if not isinstance(job, ExpertJob):
        return {"linear": _decoded(codec.decode_source, sources["linear"], stored["linear"])}
    weights = {projection: _decoded(codec.decode_source, sources[projection], stored[projection])
               for projection in ("gate", "up")}
    down, inputs = _decoded(codec.decode_ordered, sources["down"], stored["down"])
    return {**act_order.fold(weights, inputs), "down": down}


def _audits(job: ConvertJob, codec: Codec, stored: dict[str, Stored], weights: dict[str, QuantizedWeight]) -> list[Audit]:
    """The audit counts of each source linear: its stored arrays with BF16 bit patterns as the float32 values
    they hold, and its canonical form where decoded (not a float form's: its scales are code bytes)."""
    sources = _sources(job)
    integer = codec.source_format.float_scheme is None
    return [(_linear_name(sources[projection]) if isinstance(job, ExpertJob) else job.prefix,
             audit_counts(codec.source_format, _readable_linear(sources[projection], tensors),
                          weights.get(projection) if integer else None))
            for projection, tensors in stored.items()]


def _readable_linear(sources: dict[str, SourceSlice], stored: Stored) -> Stored:
    return {suffix: bf16_as_float32(array) if sources[suffix].entry.dtype == "BF16" else array
            for suffix, array in stored.items()}


def _linear_name(linear: dict[str, SourceSlice]) -> str:
    """The module path of one source linear (its tensors' names without the suffix)."""
    return linear_name(next(iter(linear.values())).entry)


def _decoded(decode_one: Callable[[Stored], Any], sources: dict[str, SourceSlice], tensors: Stored) -> Any:
    """`decode_one` (one of the codec's) of one source linear; a refusal names the file and the linear."""
    try:
        return decode_one(tensors)
    except MoeconvError as error:
        raise MoeconvError(f"{next(iter(sources.values())).entry.file}: {_linear_name(sources)}: {error}") from None
