"""Executes a plan: streams the source into the output shards, then writes configs and the manifest.

The output is built in a hidden sibling folder and renamed into place only when complete, so an
interrupted run never leaves a folder that looks finished. The source is only ever read.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from moeconv import __version__
from moeconv.backends.base import ExpertWeights
from moeconv.checkpoint.reader import INDEX_NAME, TensorEntry, TensorReader
from moeconv.checkpoint.writer import ShardWriter, sha256_file
from moeconv.errors import MoeconvError
from moeconv.formats.gptq import SuspiciousZeroTally, zero_tally
from moeconv.plan import MoELayer, PassThrough, Plan

MANIFEST_NAME = "moeconv.json"
QUANTIZE_CONFIG_NAME = "quantize_config.json"
# Source files that describe the source's quantization or weights: replaced, never copied.
_NOT_COPIED = {"config.json", INDEX_NAME, QUANTIZE_CONFIG_NAME, "quant_config.json", MANIFEST_NAME}

Progress = Callable[[int], None]
WORKERS = max(1, min(4, os.cpu_count() or 1))


@dataclass
class ConvertReport:
    output: Path
    plan: dict[str, Any]
    seconds: float
    files: dict[str, dict[str, Any]]
    suspicious_zero_slots: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "output": str(self.output),
            "seconds": round(self.seconds, 3),
            "plan": self.plan,
            "files": self.files,
            "suspicious_zero_slots": self.suspicious_zero_slots,
        }


def output_quantization_config(plan: Plan) -> dict[str, Any]:
    """What a loader needs: the expert layout, and the source's own config for everything else
    (attention and shared experts keep the source format and pass through unchanged)."""
    first = plan.layers[0].shape
    return {
        "quant_method": "moeconv",
        "backend": plan.backend.name,
        "layout_version": plan.backend.layout_version,
        **plan.backend.quantization_config(first),
        "source_quantization_config": plan.checkpoint.quantization_config,
    }


def check_output_folder(output: Path) -> None:
    output = Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise MoeconvError(f"{output}: output folder exists and is not empty; choose another -o or remove it")


def _prepare_output(output: Path) -> Path:
    check_output_folder(output)
    staging = output.parent / f".{output.name}.moeconv-partial"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def convert(plan: Plan, output: Path, progress: Progress | None = None) -> ConvertReport:
    output = Path(output).absolute()
    if output == plan.checkpoint.root.absolute() or plan.checkpoint.root.absolute() in output.parents:
        raise MoeconvError(f"{output}: the output must not be inside the source checkpoint")
    staging = _prepare_output(output)
    advance = progress or (lambda nbytes: None)
    started = time.perf_counter()
    suspicious = zero_tally(plan.source_format)
    try:
        with TensorReader() as reader:
            for shard in plan.shards:
                _write_shard(plan, shard, staging / shard.file_name, reader, advance, suspicious)
        files = {
            shard.file_name: {"bytes": (staging / shard.file_name).stat().st_size,
                              "sha256": sha256_file(staging / shard.file_name)}
            for shard in plan.shards
        }
        _write_metadata(plan, staging, files)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if output.exists():
        output.rmdir()
    staging.rename(output)
    return ConvertReport(output, plan.summary(), time.perf_counter() - started, files,
                         suspicious.report() if suspicious else {})


def _write_shard(plan: Plan, shard, path: Path, reader: TensorReader, advance: Progress,
                 suspicious: SuspiciousZeroTally | None) -> None:
    metadata = {"format": "pt", "producer": f"moeconv {__version__}", "backend": plan.backend.name}
    with ShardWriter(path, [(t.name, t.dtype, t.shape) for t in shard.tensors], metadata) as writer:
        for unit in shard.units:
            if isinstance(unit, PassThrough):
                entry = unit.entry
                writer.copy_range(entry.name, entry.file, entry.begin, entry.end)
                advance(entry.nbytes)
            else:
                _write_layer(plan, unit, writer, reader, advance, suspicious)


def _write_layer(plan: Plan, layer: MoELayer, writer: ShardWriter, reader: TensorReader, advance: Progress,
                 suspicious: SuspiciousZeroTally | None) -> None:
    """Expert by expert: decode from the source format, encode into the expert's slice of each
    stacked tensor, write the slice at its offset. Experts are converted by a few worker threads
    (torch releases the GIL inside its ops) with a bounded window, so at most a few experts are in
    memory at a time and the output bytes do not depend on the scheduling."""
    outputs = {tensor.name: tensor for tensor in plan.layer_tensors(layer)}

    def convert_one(expert: dict[str, dict[str, TensorEntry]]):
        return _convert_expert(plan, expert, reader, track_zeros=suspicious is not None)

    for index, (slices, zero_counts) in enumerate(_bounded_map(convert_one, layer.experts, WORKERS)):
        for name, found in zero_counts:
            suspicious.record(name, found)
        for suffix, data in slices.items():
            name = f"{layer.module}.{suffix}"
            writer.write(name, data, offset=index * (outputs[name].nbytes // layer.shape.experts))
        advance(sum(entry.nbytes for linear in layer.experts[index].values() for entry in linear.values()))


def _convert_expert(plan: Plan, expert: dict[str, dict[str, TensorEntry]], reader: TensorReader, track_zeros: bool):
    """One expert's backend slices, and (name, count) of v1 zero slots stored as all ones."""
    decoded, zero_counts = {}, []
    for projection, linear in expert.items():
        tensors = {suffix: reader.read(entry) for suffix, entry in linear.items()}
        if track_zeros:
            zero_counts.append((linear["qzeros"].name, plan.source_format.suspicious_zero_slots(tensors["qzeros"])))
        try:
            decoded[projection] = plan.source_format.decode(tensors)
        except MoeconvError as error:
            first = next(iter(linear.values()))
            prefix = first.name.rsplit(".", 1)[0]
            raise MoeconvError(f"{first.file}: {prefix}: {error}") from None
    return plan.backend.encode_expert(ExpertWeights(**decoded)), zero_counts


def _bounded_map(function, items, workers: int):
    """Like ThreadPoolExecutor.map, in order, but with at most 2 × workers items in flight."""
    with ThreadPoolExecutor(max_workers=workers) as pool, _single_threaded_torch():
        pending: deque = deque()
        for item in items:
            pending.append(pool.submit(function, item))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


@contextmanager
def _single_threaded_torch():
    """Parallelism comes from the expert workers; torch's own threads would only contend with them."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _write_metadata(plan: Plan, staging: Path, files: dict[str, dict[str, Any]]) -> None:
    source = plan.checkpoint
    weight_map = {tensor.name: shard.file_name for shard in plan.shards for tensor in shard.tensors}
    _dump(staging / INDEX_NAME, {"metadata": {"total_size": plan.output_bytes}, "weight_map": weight_map})
    quantization = output_quantization_config(plan)
    config = dict(source.config)
    config["quantization_config"] = quantization
    _dump(staging / "config.json", config)
    _dump(staging / QUANTIZE_CONFIG_NAME, quantization)
    copied = []
    for path in sorted(source.root.iterdir()):
        if path.is_file() and path.suffix != ".safetensors" and path.name not in _NOT_COPIED:
            shutil.copy2(path, staging / path.name)
            copied.append(path.name)
    _dump(staging / MANIFEST_NAME, {
        "tool": "moeconv",
        "tool_version": __version__,
        "backend": plan.backend.name,
        "layout_version": plan.backend.layout_version,
        "source": {"path": str(source.root.absolute()), "revision": None,
                   "files": [path.name for path in source.files]},
        "format": plan.source_format.describe(),
        "files": files,
        "copied_files": copied,
        "tensors": _tensor_sources(plan),
    })


def _tensor_sources(plan: Plan) -> dict[str, dict[str, Any]]:
    sources: dict[str, dict[str, Any]] = {}
    for shard in plan.shards:
        for unit in shard.units:
            if isinstance(unit, PassThrough):
                sources[unit.entry.name] = {"transform": "copy", "sources": [unit.entry.name]}
                continue
            for tensor in plan.layer_tensors(unit):
                # Every w13 tensor derives from the gate and up linears, every w2 one from down.
                projections = ("gate", "up") if tensor.name.rsplit(".", 1)[1].startswith("w13") else ("down",)
                names = [entry.name for expert in unit.experts for projection in projections
                         for entry in expert[projection].values()]
                sources[tensor.name] = {"transform": f"{plan.source_format.method}->{plan.backend.name}",
                                        "sources": names}
    return sources


def _dump(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
