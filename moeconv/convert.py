"""Executes a plan: streams the source into the output shards, then writes configs and the manifest.

The output is built in a hidden sibling folder and renamed into place only when complete, so an
interrupted run never leaves a folder that looks finished. The source is only ever read.
"""

from __future__ import annotations

import hashlib
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

from moeconv._version import __version__
from moeconv.backends.base import ExpertWeights, converts_dense_linears
from moeconv.canonical import MoELayerShape
from moeconv.checkpoint.reader import INDEX_NAME, TensorEntry, TensorReader, read_header, same_bytes
from moeconv.checkpoint.schema import is_plain_file_name
from moeconv.checkpoint.writer import PrefixHasher, ShardWriter, sha256_file
from moeconv.errors import MoeconvError
from moeconv.audit import Audits, count as audit_counts
from moeconv.models import PROJECTIONS
from moeconv.plan import DenseLinear, MoELayer, PassThrough, Plan

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
    nonfinite_scales: dict[str, Any] = field(default_factory=dict)  # NaN / inf scales: count, first tensor
    resumed_files: list[str] = field(default_factory=list)
    peak_rss_mb: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "output": str(self.output),
            "seconds": round(self.seconds, 3),
            "plan": self.plan,
            "files": self.files,
            "resumed_files": self.resumed_files,
            "peak_rss_mb": self.peak_rss_mb,
            "suspicious_zero_slots": self.suspicious_zero_slots,
            "nonfinite_scales": self.nonfinite_scales,
        }


def output_quantization_config(plan: Plan) -> dict[str, Any]:
    """What a loader needs: the expert layout, and the source's own config for everything else
    (attention and shared experts keep the source format and pass through unchanged). A backend that
    converts dense linears too writes the whole config in its own scheme; moeconv's fields then go
    under "moeconv"."""
    first = plan.layers[0].shape
    if converts_dense_linears(plan.backend):
        return {
            **plan.backend.checkpoint_quantization_config(first, plan.model_dtype, plan.unquantized_modules()),
            "moeconv": {"backend": plan.backend.name, "layout_version": plan.backend.layout_version,
                        "source_quantization_config": plan.checkpoint.quantization_config},
        }
    return {
        "quant_method": "moeconv",
        "backend": plan.backend.name,
        "layout_version": plan.backend.layout_version,
        **plan.backend.quantization_config(first),
        "source_quantization_config": plan.checkpoint.quantization_config,
    }


def resolved_output(output: Path) -> Path:
    """The output folder with its parent's links and `..` resolved (the folder itself may not exist)."""
    output = Path(output).expanduser().absolute()
    return output.parent.resolve() / output.name


def check_output_folder(output: Path, source_root: Path | None = None) -> None:
    """Refuses, before any work, an output that is a link, a file, a non-empty folder, or inside the source."""
    given = Path(output).expanduser()
    if given.is_symlink():
        raise MoeconvError(f"{given}: the output is a symbolic link; give a real folder path")
    output = resolved_output(given)
    if output.exists() and not output.is_dir():
        raise MoeconvError(f"{output}: exists and is a file, not a folder; choose another -o")
    if output.is_dir() and any(output.iterdir()):
        raise MoeconvError(f"{output}: output folder exists and is not empty; choose another -o or remove it")
    if source_root is not None:
        source = Path(source_root).resolve()
        if output == source or source in output.parents:
            raise MoeconvError(f"{output}: the output must not be inside the source checkpoint {source}")


def staging_folder(output: Path) -> Path:
    """Where an unfinished conversion lives until it is renamed to `output`."""
    output = resolved_output(output)
    return output.parent / f".{output.name}.moeconv-partial"


@contextmanager
def _exclusive(output: Path):
    """One writer per output: an advisory lock beside the staging folder, held for the whole run. The
    kernel drops it when the process dies, so a resume after a crash simply takes it over."""
    import fcntl

    path = output.parent / f".{output.name}.moeconv-lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise MoeconvError(f"{output.parent}: cannot create files there ({error.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise MoeconvError(f"{output}: another moeconv (pid {other}) is converting into this folder; "
                               f"wait for it or stop it") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
        os.unlink(path)  # still held: a waiting writer finds the output complete and refuses it
    finally:
        os.close(fd)


def _space_error(error: OSError, output: Path, needed: int) -> MoeconvError:
    """A write that failed for the filesystem's reasons, as one line naming the output."""
    import errno

    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return MoeconvError(f"{output}: no space left on the device; the conversion needs "
                            f"{needed / 1e9:.2f} GB there (free some and rerun to resume)")
    if error.errno == errno.EFBIG:
        return MoeconvError(f"{output}: the filesystem refuses a file that large (shards up to "
                            f"{needed / 1e9:.2f} GB); choose a smaller --max-shard-size")
    return MoeconvError(f"{error.filename or output}: {error.strerror}")


def job_identity(plan: Plan) -> dict[str, Any]:
    """Everything that decides the output's bytes. A resumed run must match it exactly."""
    return {
        "tool_version": __version__,
        "backend": plan.backend.name,
        "layout_version": plan.backend.layout_version,
        "max_shard_size": plan.max_shard_size,
        "trust": plan.trust,
        "tp": plan.tp,
        "regroup_factor": plan.regroup_factor,
        "format": plan.source_format.describe(),
        "source": plan.checkpoint.identity(),
    }


def _converted_entries(shard) -> list[TensorEntry]:
    """The source tensors a shard's converted units (experts, dense linears) were decoded from, in order."""
    entries = []
    for unit in shard.units:
        if isinstance(unit, DenseLinear):
            entries += list(unit.tensors.values())
        elif isinstance(unit, MoELayer):
            entries += [entry for expert in unit.experts for linear in expert.values() for entry in linear.values()]
    return entries


def _source_fingerprint(shard, fingerprints: dict[str, bytes]) -> str:
    """One hash over the content hashes of the source tensors the shard's converted units read, taken
    as they were read (pass-through tensors are copied in the kernel and checked against the output's
    own bytes on resume instead)."""
    digest = hashlib.sha256()
    for entry in _converted_entries(shard):
        digest.update(entry.name.encode() + b"\0" + fingerprints.pop(entry.name))
    return digest.hexdigest()


def _check_unchanged_source(plan: Plan, shard, staging: Path, journal: _Journal) -> None:
    """A finished shard is kept only if the source it came from has not changed since: its converted
    units' source tensors hash as recorded, and its pass-through tensors equal the output's bytes."""
    changed = None
    with TensorReader(fingerprints={}) as reader:
        for entry in _converted_entries(shard):
            reader.read(entry)
        if _source_fingerprint(shard, reader.fingerprints) != journal.done[shard.file_name]["source"]:
            changed = "a converted tensor"
    if changed is None:
        header, data_start, _ = read_header(staging / shard.file_name)
        for unit in shard.units:
            if isinstance(unit, PassThrough):
                begin, end = header[unit.entry.name]["data_offsets"]
                if not same_bytes(unit.entry.file, unit.entry.begin, staging / shard.file_name, data_start + begin,
                                  unit.entry.nbytes):
                    changed = unit.entry.name
                    break
    if changed is not None:
        raise MoeconvError(f"{plan.checkpoint.root}: the source changed since the interrupted conversion "
                           f"({changed} of {shard.file_name} differs); remove {staging} to start over")




def convert(plan: Plan, output: Path, progress: Progress | None = None) -> ConvertReport:
    """Writes the plan's output at `output`. Resumable: an interrupted run (Ctrl-C, kill -9, power
    loss) leaves its finished shards and a journal in the staging folder; running again with the
    same plan re-hashes them, keeps those that match, and writes the rest, so the result is
    byte-identical to an uninterrupted run. A different source or different arguments refuse."""
    check_output_folder(output, plan.checkpoint.root)
    output = resolved_output(output)
    advance = progress or (lambda nbytes: None)
    started = time.perf_counter()
    staging = staging_folder(output)
    with _exclusive(output):
        check_output_folder(output)  # again, under the lock: another writer may have finished it
        try:
            journal = _Journal.open(staging, job_identity(plan))
            _check_free_space(plan, staging, journal)
            audits = Audits()
            try:
                with TensorReader(fingerprints={}) as reader:
                    for shard in plan.shards:
                        if journal.is_done(shard.file_name):
                            _check_unchanged_source(plan, shard, staging, journal)
                            advance(_source_bytes(shard))
                            continue
                        digest = _write_shard(plan, shard, staging / shard.file_name, reader, advance, audits)
                        journal.mark_done(shard.file_name, digest, _source_fingerprint(shard, reader.fingerprints))
                _write_metadata(plan, staging, journal.files())
            except MoeconvError:
                shutil.rmtree(staging, ignore_errors=True)  # a refusal, not an interruption: nothing to resume
                raise
            journal.remove()
            if output.exists():
                output.rmdir()
            staging.rename(output)
        except OSError as error:  # the filesystem's refusal: finished shards stay for a resume
            raise _space_error(error, output, plan.output_bytes) from None
    return ConvertReport(output, plan.summary(), time.perf_counter() - started, journal.files(),
                         audits.report("suspicious_zero_slots"), audits.report("nonfinite_scales"), journal.reused,
                         peak_rss_mb())


def _check_free_space(plan: Plan, staging: Path, journal: _Journal) -> None:
    """Refuse up front when the shards still to write cannot fit."""
    done = sum(info["bytes"] for info in journal.done.values())
    needed = plan.output_bytes - done
    free = shutil.disk_usage(staging).free
    if needed > free:
        if not journal.done:
            shutil.rmtree(staging, ignore_errors=True)
        raise MoeconvError(f"{staging.parent}: {free / 1e9:.2f} GB free, but the conversion needs "
                           f"{needed / 1e9:.2f} GB more there; free some space or choose another -o")


def peak_rss_mb() -> float | None:
    """This process's resident-memory high-water mark. VmHWM (Linux) starts at exec; getrusage's
    maxrss would also count the pages of a large parent the process was forked from."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024
    except (OSError, StopIteration):
        return None


def _source_bytes(shard) -> int:
    return sum(unit.entry.nbytes if isinstance(unit, PassThrough) else unit.source_bytes for unit in shard.units)


def _read_journal(path: Path) -> dict[str, Any] | None:
    """The journal, or None when there is none or it is damaged (then nothing there is trusted and
    the conversion starts over: every shard is rewritten, so the result is still exact)."""
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    done = recorded.get("done") if isinstance(recorded, dict) else None
    if not isinstance(done, dict) or not all(
            is_plain_file_name(name) and isinstance(info, dict) and isinstance(info.get("bytes"), int)
            and isinstance(info.get("sha256"), str) and isinstance(info.get("source"), str)
            for name, info in done.items()):
        return None
    return recorded


class _Journal:
    """The staging folder's record of finished shards, replaced atomically after each one."""

    NAME = "moeconv-progress.json"

    def __init__(self, staging: Path, job: dict[str, Any]):
        self.staging, self.job = staging, job
        self.done: dict[str, dict[str, Any]] = {}
        self.reused: list[str] = []

    @classmethod
    def open(cls, staging: Path, job: dict[str, Any]) -> _Journal:
        journal = cls(staging, job)
        path = staging / cls.NAME
        recorded = _read_journal(path)
        if recorded is not None:
            if recorded.get("job") != job:
                before = recorded["job"] if isinstance(recorded.get("job"), dict) else {}
                changed = sorted(key for key in job if before.get(key) != job[key])
                raise MoeconvError(
                    f"{staging}: an unfinished conversion with a different {', '.join(changed)} is there; "
                    f"rerun with the same source and arguments to resume it, or remove that folder")
            for name, info in recorded["done"].items():
                file = staging / name
                if file.is_file() and file.stat().st_size == info["bytes"] and sha256_file(file) == info["sha256"]:
                    journal.done[name] = info
                    journal.reused.append(name)
        else:
            shutil.rmtree(staging, ignore_errors=True)  # no journal yet: nothing finished there
            staging.mkdir(parents=True)
        journal._save()
        return journal

    def files(self) -> dict[str, dict[str, Any]]:
        """Each finished shard's size and sha256, as the manifest records them."""
        return {name: {"bytes": info["bytes"], "sha256": info["sha256"]} for name, info in self.done.items()}

    def is_done(self, name: str) -> bool:
        return name in self.done

    def mark_done(self, name: str, sha256: str, source: str) -> None:
        """`source`: the fingerprint of the source tensors the shard was converted from (see
        `_source_fingerprint`), so that a resume notices a source changed in between."""
        self.done[name] = {"bytes": (self.staging / name).stat().st_size, "sha256": sha256, "source": source}
        self._save()

    def _save(self) -> None:
        temporary = self.staging / (self.NAME + ".tmp")
        temporary.write_text(json.dumps({"job": self.job, "done": self.done}, indent=2))
        os.replace(temporary, self.staging / self.NAME)

    def remove(self) -> None:
        (self.staging / self.NAME).unlink()


def _write_shard(plan: Plan, shard, path: Path, reader: TensorReader, advance: Progress,
                 audits: Audits) -> str:
    """Writes the shard and returns its sha256. Written under a temporary name and renamed once
    complete and flushed, so a shard file under its final name is always whole."""
    metadata = {"format": "pt", "producer": f"moeconv {__version__}", "backend": plan.backend.name}
    temporary = path.with_name(path.name + ".partial")
    tensors = [(t.name, t.dtype, t.shape) for t in shard.tensors]
    with ShardWriter(temporary, tensors, metadata) as writer:
        # Units are written in file order, so once one is done everything before its end is final.
        hasher = PrefixHasher(temporary)
        try:
            for unit, names in zip(shard.units, _unit_names(plan, shard)):
                if isinstance(unit, PassThrough):
                    entry = unit.entry
                    writer.copy_range(entry.name, entry.file, entry.begin, entry.end)
                    advance(entry.nbytes)
                elif isinstance(unit, DenseLinear):
                    _write_dense_linear(plan, unit, writer, reader, audits)
                    advance(unit.source_bytes)
                else:
                    _write_layer(plan, unit, writer, reader, advance, audits)
                hasher.advance(max(writer.end_of(name) for name in names))
        except BaseException:
            hasher.cancel()
            raise
        digest = hasher.finish(writer.size)
    os.replace(temporary, path)
    return digest


def _unit_names(plan: Plan, shard) -> list[list[str]]:
    """The output tensor names of each unit of the shard, in order."""
    names = []
    for unit in shard.units:
        if isinstance(unit, PassThrough):
            names.append([unit.entry.name])
        elif isinstance(unit, DenseLinear):
            names.append([tensor.name for tensor in plan.linear_tensors(unit)])
        else:
            names.append([tensor.name for tensor in plan.layer_tensors(unit)])
    return names


def _write_layer(plan: Plan, layer: MoELayer, writer: ShardWriter, reader: TensorReader, advance: Progress,
                 audits: Audits) -> None:
    """Expert by expert: decode from the source format, encode into the expert's slice of each
    stacked tensor, write the slice at its offset. Experts are converted by a few worker threads
    (torch releases the GIL inside its ops) with a bounded window, so at most a few experts are in
    memory at a time and the output bytes do not depend on the scheduling."""
    outputs = {tensor.name: tensor for tensor in plan.layer_tensors(layer)}
    experts = layer.shape.experts

    def convert_one(expert: dict[str, dict[str, TensorEntry]]):
        return _convert_expert(plan, layer, expert, reader)

    for index, (slices, counts) in enumerate(_bounded_map(convert_one, layer.experts, WORKERS)):
        for name, found in counts:
            audits.record(name, found)
        slots = plan.expert_slots(layer, index)
        for suffix, data in slices.items():
            name, stacked = slots[suffix]
            writer.write(name, data, offset=index * (outputs[name].nbytes // experts) if stacked else 0)
        advance(sum(entry.nbytes for linear in layer.experts[index].values() for entry in linear.values()))


def _write_dense_linear(plan: Plan, linear: DenseLinear, writer: ShardWriter, reader: TensorReader,
                        audits: Audits) -> None:
    tensors = {suffix: reader.read(entry) for suffix, entry in linear.tensors.items()}
    weight = _decoded(plan, linear.tensors, tensors)
    audits.record(linear.prefix, audit_counts(plan.source_format, tensors, weight))
    for suffix, data in plan.backend.encode_linear(weight, linear.shape).items():
        writer.write(f"{linear.prefix}.{suffix}", data)


def _decoded(plan: Plan, entries: dict[str, TensorEntry], tensors: dict[str, torch.Tensor]):
    """The canonical form of one source linear; a refusal names the file and the linear."""
    try:
        return plan.decode_linear(tensors)
    except MoeconvError as error:
        first = next(iter(entries.values()))
        raise MoeconvError(f"{first.file}: {first.name.rsplit('.', 1)[0]}: {error}") from None


def _convert_expert(plan: Plan, layer: MoELayer, expert: dict[str, dict[str, TensorEntry]], reader: TensorReader):
    """One expert's backend slices, and (linear name, audit counts) of its source linears."""
    decoded, counts = {}, []
    for projection, linear in expert.items():
        tensors = {suffix: reader.read(entry) for suffix, entry in linear.items()}
        decoded[projection] = _decoded(plan, linear, tensors)
        counts.append((next(iter(linear.values())).name.rsplit(".", 1)[0],
                       audit_counts(plan.source_format, tensors, decoded[projection])))
    return plan.backend.encode_expert(ExpertWeights(**decoded), layer.shape), counts


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
        "targets": getattr(plan.backend, "targets", {}),
        "arguments": job_identity(plan),
        "source": {**source.identity(), "files": [path.name for path in source.files]},
        "format": plan.source_format.describe(),
        "files": files,
        "copied_files": copied,
        "tensors": _tensor_sources(plan),
    })


def _tensor_sources(plan: Plan) -> dict[str, dict[str, Any]]:
    sources: dict[str, dict[str, Any]] = {}
    for shard in plan.shards:
        for unit in shard.units:
            transform = f"{plan.source_format.method}->{plan.backend.name}"
            if isinstance(unit, PassThrough):
                sources[unit.entry.name] = {"transform": "copy", "sources": [unit.entry.name]}
            elif isinstance(unit, DenseLinear):
                names = [entry.name for entry in unit.tensors.values()]
                sources.update({t.name: {"transform": transform, "sources": names} for t in plan.linear_tensors(unit)})
            else:
                for e, expert in enumerate(unit.experts):
                    for suffix, (name, _) in plan.expert_slots(unit, e).items():
                        entry = sources.setdefault(name, {"transform": transform, "sources": []})
                        entry["sources"] += [source.name for projection in _source_projections(suffix, unit.shape)
                                             for source in expert[projection].values()]
    return sources


def _source_projections(suffix: str, shape: MoELayerShape) -> tuple[str, ...]:
    """The source projections a backend tensor derives from: the one it is named after, else (stacked
    layouts) gate and up for a fused w13 tensor and down for a w2 one."""
    named = dict(zip(shape.projection_names, PROJECTIONS))
    first = suffix.split(".", 1)[0]
    if first in named:
        return (named[first],)
    return ("gate", "up") if suffix.startswith("w13") else ("down",)


def _dump(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
