"""What will be written: the work list a plan resolves into, as frozen data.

Every output byte is written by exactly one job; a job names where its bytes come from (source
slices) and where they go (output slots), so `convert` and `verify` only iterate jobs and the
manifest is written from the same objects. How a job turns its bytes into the output's is
transform.py; nothing here reads a tensor, so this module is importable without torch or codecs.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING, Callable, NamedTuple, TypeVar, Union

from moeconv.spec import DTYPE_SIZES, TensorSpec

if TYPE_CHECKING:
    from moeconv.backends.base import Backend, LinearLayout
    from moeconv.canonical import LinearShape, MoELayerShape
    from moeconv.checkpoint.reader import TensorEntry
    from moeconv.survey import DenseLinear, ExpertSlice, MoELayer


@dataclass(frozen=True)
class SourceSlice:
    """Where a job's input bytes are: a stored tensor, or one expert's rows of a tensor that stacks the experts
    on disk (survey.ExpertSlice: gpt-oss's; `transform.read_source` reads either)."""

    entry: TensorEntry | ExpertSlice

    @property
    def key(self) -> str:
        return self.entry.name

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes


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
    """One dense quantized linear, re-encoded in a backend's linear layout."""

    prefix: str
    shape: LinearShape
    sources: dict[str, SourceSlice]  # by source suffix
    slots: dict[str, OutputSlot]  # by backend suffix
    layout: LinearLayout  # the linear layout it is written in (Plan.dense_layout)
    copies = False

    @property
    def inputs(self) -> tuple[SourceSlice, ...]:
        return tuple(self.sources.values())


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


Job = Union[CopyJob, LinearJob, ExpertJob]
ConvertJob = Union[LinearJob, ExpertJob]


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


class Unit(NamedTuple):
    """Jobs that must share a shard (a layer's experts fill the same stacked tensors), and the output
    tensors they write, in file order."""

    jobs: list[Job]
    tensors: list[TensorSpec]


Item = TypeVar("Item")


def shard_groups(units: list[Item], nbytes: Callable[[Item], int], max_shard_size: int) -> list[list[Item]]:
    """Greedy, in the given order: a unit stays in one shard, the next shard starts when the unit would
    pass the limit, and a unit larger than the limit gets a shard of its own (as transformers does for a
    tensor larger than max_shard_size). The plan's sharding, and synth's for its checkpoints."""
    groups: list[list[Item]] = [[]]
    size = 0
    for unit in units:
        unit_bytes = nbytes(unit)
        if groups[-1] and size + unit_bytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(unit)
        size += unit_bytes
    return groups


def assign_shards(units: list[Unit], max_shard_size: int) -> tuple[OutputShard, ...]:
    """In name order. A unit (a layer's jobs, a linear, a pass-through tensor) stays in one shard,
    since its jobs share stacked tensors (`shard_groups`)."""
    groups = shard_groups(units, lambda unit: sum(tensor.nbytes for tensor in unit.tensors), max_shard_size)
    count = len(groups)
    return tuple(
        OutputShard(
            file_name=f"model-{index + 1:05d}-of-{count:05d}.safetensors",
            tensors=tuple(tensor for unit in group for tensor in unit.tensors),
            jobs=tuple(job for unit in group for job in unit.jobs),
        )
        for index, group in enumerate(groups)
    )


def single(job: Job) -> Unit:
    return Unit([job], [slot.tensor for slot in job.slots.values()])


def copy_job(entry: TensorEntry, name: str) -> CopyJob:
    """`name`: the tensor's name in the output."""
    tensor = TensorSpec(name, entry.shape, entry.dtype)
    return CopyJob(SourceSlice(entry), OutputSlot(tensor, 0, entry.shape, (entry.name,)))


def linear_job(layout: LinearLayout, linear: DenseLinear, prefix: str) -> LinearJob:
    """`prefix`: the linear's name in the output."""
    names = tuple(entry.name for entry in linear.tensors.values())
    slots = {spec.name: OutputSlot(spec.renamed(f"{prefix}.{spec.name}"), 0, spec.shape, names)
             for spec in layout.linear_tensors(linear.shape)}
    return LinearJob(linear.prefix, linear.shape, {suffix: SourceSlice(entry) for suffix, entry in linear.tensors.items()},
                     slots, layout)


def layer_unit(backend: Backend, layer: MoELayer, module: str) -> Unit:
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
