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
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from moeconv import act_order
from moeconv.audit import count as audit_counts
from moeconv.backends.base import Backend, ExpertWeights
from moeconv.canonical import QuantizedWeight, regroup
from moeconv.checkpoint.reader import TensorEntry, TensorReader
from moeconv.packing import bf16_as_float32
from moeconv.errors import MoeconvError
from moeconv.formats import SourceFormat
from moeconv.worklist import ConvertJob, ExpertJob, SourceSlice

if TYPE_CHECKING:  # torch is imported where tensors are made (the workers), not to plan
    import torch

Audit = tuple[str, dict[str, int]]  # (source linear, audit counts)


@dataclass(frozen=True)
class Codec:
    """The two readings a conversion job applies: the source format's decoder (after any lossless
    regrouping) and the backend's encoder, and their inverses for verify."""

    source_format: SourceFormat
    backend: Backend
    regroup_factor: int = 1  # group size divided by this (scales and zeros repeated): lossless

    def decode_source(self, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        """One source linear in the canonical form the plan writes."""
        return regroup(self.source_format.decode(tensors), self.regroup_factor)

    def decode_ordered(self, tensors: dict[str, torch.Tensor]) -> tuple[QuantizedWeight, torch.Tensor | None]:
        """As `decode_source`, and for an act-order linear the input permutation under which its groups
        are static (act_order.py); formats that store no g_idx have none."""
        weight, inputs = self.source_format.decode_ordered(tensors)
        return regroup(weight, self.regroup_factor), inputs

    def decode_stored(self, stored: dict[str, np.ndarray]) -> tuple[QuantizedWeight, np.ndarray | None]:
        """As `decode_ordered`, in numpy on the stored arrays (where the format `decodes_stored`)."""
        weight, inputs = self.source_format.decode_stored(stored)
        return regroup(weight, self.regroup_factor), inputs


def takes_packed(job: ConvertJob, codec: Codec) -> bool:
    """Whether the job's format and layout meet in the packed form (packed.py): the fast path, numpy on the
    stored bytes. The format may still decline one linear (an act-order g_idx), the layout one expert."""
    layout = codec.backend if isinstance(job, ExpertJob) else job.encoder
    return codec.source_format.packs and layout.takes_packed(job.shape)


def numpy_route(job: ConvertJob, codec: Codec) -> bool:
    """Whether `convert` runs in numpy on the stored bytes: through the packed form, or float codes (whose
    canonical form is numpy: float_codes.py)."""
    return codec.source_format.float_scheme is not None or takes_packed(job, codec)


def convert(job: ConvertJob, codec: Codec, reader: TensorReader) -> tuple[dict[str, Any], list[Audit]]:
    """The job's output blocks (by backend suffix), and the audit counts of its source tensors: float codes
    read into the canonical float form and written by the layout; through the packed form where the format and
    the layout take it; else decoded to the canonical form and encoded."""
    if codec.source_format.float_scheme is not None:
        weights, audits = source_weights_stored(job, codec, reader)
        layout = codec.backend.from_float if isinstance(job, ExpertJob) else job.encoder.from_float_linear
        return layout(weights if isinstance(job, ExpertJob) else weights["linear"], job.shape), audits
    if takes_packed(job, codec):
        found = _through_packed(job, codec, reader)
        if found is not None:
            return found
    if isinstance(job, ExpertJob):
        weights, audits = _expert_canonical(job, codec, _read_expert(job, reader.read))
    else:
        weights, audits = source_weights(job, codec, reader)
    return encode(job, codec, weights), audits


def _through_packed(job: ConvertJob, codec: Codec, reader: TensorReader) -> tuple[dict[str, np.ndarray], list[Audit]] | None:
    """`convert` through the packed form; None where the format or the layout declines."""
    sources = job.sources if isinstance(job, ExpertJob) else {"linear": job.sources}
    stored = {projection: {suffix: reader.read_raw(piece.entry) for suffix, piece in linear.items()}
              for projection, linear in sources.items()}
    packed = {}
    for projection, tensors in stored.items():
        weight = _decoded(codec.source_format.to_packed, sources[projection], tensors)
        if weight is None:
            return None
        packed[projection] = weight.regrouped(codec.regroup_factor)
    if isinstance(job, ExpertJob):
        blocks = codec.backend.from_packed(packed, job.shape)
    else:
        blocks = job.encoder.from_packed_linear(packed["linear"], job.shape)
    if blocks is None:
        return None
    return blocks, [(_linear_name(linear) if isinstance(job, ExpertJob) else job.prefix,
                     audit_counts(codec.source_format, _readable_linear(linear, stored[projection]), None))
                    for projection, linear in sources.items()]


def source_weights(job: ConvertJob, codec: Codec,
                   reader: TensorReader) -> tuple[dict[str, QuantizedWeight], list[Audit]]:
    """The canonical weights the job's source tensors decode to (gate, up and down of an expert; one
    keyed "linear" of a dense linear), and their audit counts."""
    if isinstance(job, ExpertJob):
        return _expert_canonical(job, codec, _read_expert(job, reader.read))
    tensors = {suffix: reader.read(piece.entry) for suffix, piece in job.sources.items()}
    weight = _decoded(codec.decode_source, job.sources, tensors)
    return {"linear": weight}, [(job.prefix, audit_counts(codec.source_format, tensors, weight))]


def encode(job: ConvertJob, codec: Codec, weights: dict[str, QuantizedWeight]) -> dict[str, torch.Tensor]:
    """Canonical weights (as `source_weights` keys them) -> the job's output blocks."""
    if isinstance(job, ExpertJob):
        return codec.backend.encode_expert(ExpertWeights(**weights), job.shape)
    return job.encoder.encode_linear(weights["linear"], job.shape)


def decode(job: ConvertJob, codec: Codec, blocks: dict[str, torch.Tensor]) -> dict[str, QuantizedWeight]:
    """Inverse of `encode`: the job's output blocks back to canonical weights."""
    if isinstance(job, ExpertJob):
        return codec.backend.decode_expert(blocks, job.shape)._asdict()
    return {"linear": job.encoder.decode_linear(blocks, job.shape)}


def decodes_stored(job: ConvertJob, codec: Codec) -> bool:
    """Whether `decode_stored` and `source_weights_stored` read this job in numpy (no torch)."""
    layout = codec.backend if isinstance(job, ExpertJob) else job.encoder
    return layout.decodes_stored(job.shape) and codec.source_format.decodes_stored


def decode_stored(job: ConvertJob, codec: Codec, blocks: dict[str, np.ndarray]) -> dict[str, QuantizedWeight]:
    """`decode` in numpy, on the output blocks' stored arrays (where `decodes_stored`)."""
    if isinstance(job, ExpertJob):
        return codec.backend.decode_expert_stored(blocks, job.shape)._asdict()
    return {"linear": job.encoder.decode_linear_stored(blocks, job.shape)}


def source_weights_stored(job: ConvertJob, codec: Codec, reader: TensorReader
                          ) -> tuple[dict[str, QuantizedWeight], list[Audit]] | None:
    """`source_weights` in numpy, the weights in the stored form (where `decodes_stored`); None for an
    act-order expert, whose fold takes the canonical route. The audits count the stored tensors, as the
    packed route's conversions do."""
    sources = job.sources if isinstance(job, ExpertJob) else {"linear": job.sources}
    stored = {projection: {suffix: reader.read_raw(piece.entry) for suffix, piece in linear.items()}
              for projection, linear in sources.items()}
    weights = {}
    for projection, tensors in stored.items():
        weight, inputs = _decoded(codec.decode_stored, sources[projection], tensors)
        if inputs is not None:
            return None
        weights[projection] = weight
    audits = [(_linear_name(linear) if isinstance(job, ExpertJob) else job.prefix,
               audit_counts(codec.source_format, _readable_linear(linear, stored[projection]), None))
              for projection, linear in sources.items()]
    return weights, audits


def _read_expert(job: ExpertJob, read: Callable[[TensorEntry], Any]) -> dict[str, dict[str, Any]]:
    """Each projection's tensors by suffix, as `read` gives them (TensorReader.read: torch tensors;
    read_raw: the stored bytes in numpy)."""
    return {projection: {suffix: read(piece.entry) for suffix, piece in linear.items()}
            for projection, linear in job.sources.items()}


def _readable_linear(sources: dict[str, SourceSlice], stored: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The stored arrays with BF16 bit patterns as the float32 values they hold, for the audits."""
    return {suffix: bf16_as_float32(array) if sources[suffix].entry.dtype == "BF16" else array
            for suffix, array in stored.items()}


def _expert_canonical(job: ExpertJob, codec: Codec, raw: dict[str, dict[str, torch.Tensor]]
                      ) -> tuple[dict[str, QuantizedWeight], list[Audit]]:
    """Decoded; an act-order down projection folded with its gate and up (act_order.fold)."""
    weights = {projection: _decoded(codec.decode_source, job.sources[projection], raw[projection])
               for projection in ("gate", "up")}
    down, inputs = _decoded(codec.decode_ordered, job.sources["down"], raw["down"])
    weights = {**act_order.fold(weights, inputs), "down": down}
    return weights, _expert_audits(job, codec, raw, weights)


def _expert_audits(job: ExpertJob, codec: Codec, raw: dict[str, dict[str, torch.Tensor]],
                   weights: dict[str, QuantizedWeight]) -> list[Audit]:
    return [(_linear_name(job.sources[projection]), audit_counts(codec.source_format, tensors, weights.get(projection)))
            for projection, tensors in raw.items()]


def _linear_name(linear: dict[str, SourceSlice]) -> str:
    """The module path of one source linear (its tensors' names without the suffix)."""
    return next(iter(linear.values())).key.rsplit(".", 1)[0]


def _decoded(decode_one: Callable[[dict[str, torch.Tensor]], Any], sources: dict[str, SourceSlice],
             tensors: dict[str, torch.Tensor]) -> Any:
    """`decode_one` (one of the codec's) of one source linear; a refusal names the file and the linear."""
    try:
        return decode_one(tensors)
    except MoeconvError as error:
        raise MoeconvError(f"{next(iter(sources.values())).entry.file}: {_linear_name(sources)}: {error}") from None
