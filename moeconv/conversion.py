"""Executes a plan: streams the source into the output shards, then writes configs and the manifest.

The output is built in a hidden sibling folder and renamed into place only when complete, so an
interrupted run never leaves a folder that looks finished. The source is only ever read.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

from moeconv._version import __version__
from moeconv.audit import Audits
from moeconv.checkpoint import manifest
from moeconv.checkpoint.journal import Journal, record_name, recorded_shards, temporary_name, write_record
from moeconv.checkpoint.manifest import MANIFEST_NAME, QUANTIZE_CONFIG_NAME
from moeconv.checkpoint.reader import INDEX_NAME, TensorReader, file_size, read_header, same_bytes
from moeconv.checkpoint.side_files import SideFiles, copy_side_file, side_files
from moeconv.checkpoint.writer import (
    CURRENT, TENSOR_DIGESTS_KEY, BlockHasher, ShardWriter, copy_into, file_digest, hash_threads, write_at,
)
from moeconv.errors import MoeconvError, PlantedLink, Unfinished, human_bytes
from moeconv.executor import Executor, in_batches, peak_rss_mb, worker_descriptor, worker_reader
from moeconv import provenance, transform
from moeconv.provenance import Anchor, recorded_anchor
from moeconv.storage import StoredPath, is_object_url, refuse_mangled_url
from moeconv.worklist import OutputShard, SourceSlice

if TYPE_CHECKING:  # the plan arrives made; this module only walks it (and so imports no torch)
    from moeconv.plan import Plan

Progress = Callable[[int], None]
@dataclass
class ConvertReport:
    output: Path | str  # a folder, or an object store URL
    plan: dict[str, Any]
    seconds: float
    files: dict[str, dict[str, Any]]
    copied_files: list[str] = field(default_factory=list)
    skipped_files: dict[str, str] = field(default_factory=dict)  # the source's files left out, and why
    suspicious_zero_slots: dict[str, Any] = field(default_factory=dict)
    nonfinite_scales: dict[str, Any] = field(default_factory=dict)  # NaN / inf scales: count, first tensor
    resumed_files: list[str] = field(default_factory=list)
    peak_rss_mb: float | None = None
    worker_peak_rss_mb: float | None = None  # the largest worker process's (pages shared with this one included)
    device: str = "cpu"  # where the experts were transformed, in words
    # The whole process tree (this process and its workers) while the workers ran, sampled
    # (executor.TreeMemory): the peak of the summed PSS, each shared page counted once, and the largest
    # PSS a single worker reached (None for Ray tasks: not this machine's tree).
    tree_peak_pss_mb: float | None = None
    largest_worker_pss_mb: float | None = None
    tree_cpu_seconds: float | None = None  # CPU (user + system) the tree used meanwhile
    cast: dict[str, Any] | None = None  # --cast: the census it was decided by (moeconv.json's `cast`)

    def to_json(self) -> dict[str, Any]:
        return {
            "output": str(self.output),
            "seconds": round(self.seconds, 3),
            "device": self.device,
            "plan": self.plan,
            "files": self.files,
            "copied_files": self.copied_files,
            "skipped_files": self.skipped_files,
            "resumed_files": self.resumed_files,
            "peak_rss_mb": self.peak_rss_mb,
            "worker_peak_rss_mb": self.worker_peak_rss_mb,
            "tree_peak_pss_mb": _rounded(self.tree_peak_pss_mb),
            "largest_worker_pss_mb": _rounded(self.largest_worker_pss_mb),
            "tree_cpu_seconds": _rounded(self.tree_cpu_seconds),
            "suspicious_zero_slots": self.suspicious_zero_slots,
            "nonfinite_scales": self.nonfinite_scales,
            **({"cast": self.cast} if self.cast is not None else {}),
        }


def _rounded(megabytes: float | None) -> float | None:
    return None if megabytes is None else round(megabytes, 1)


def resolved_output(output: Path) -> Path:
    """The output folder with its parent's links and `..` resolved (the folder itself may not exist)."""
    output = Path(output).expanduser().absolute()
    return output.parent.resolve() / output.name


def check_output_folder(output: Path, source_root: Path | StoredPath | None = None) -> None:
    """Refuses, before any work, an output that is a link, a file, a non-empty folder, or inside the source."""
    given = Path(output).expanduser()
    if given.is_symlink():
        raise MoeconvError(f"{given}: the output is a symbolic link; give a real folder path")
    output = resolved_output(given)
    if output.exists() and not output.is_dir():
        raise MoeconvError(f"{output}: exists and is a file, not a folder; choose another -o")
    if output.is_dir() and (output / MANIFEST_NAME).is_file():  # a finished conversion: nothing resumes
        raise MoeconvError(f"{output}: a finished moeconv conversion is already there (`moeconv verify {output}` "
                           f"checks it); choose another -o, or remove it to convert again")
    if output.is_dir() and any(output.iterdir()):
        raise MoeconvError(f"{output}: output folder exists and is not empty; choose another -o or remove it")
    if isinstance(source_root, Path):  # a source in an object store is apart from any folder
        source = source_root.resolve()
        if output == source or source in output.parents:
            raise MoeconvError(f"{output}: the output must not be inside the source checkpoint {source}")


def local_folder(output: str | Path) -> Path:
    """The folder this machine builds the output in: the output folder itself, or for an object store URL
    its spool folder (checkpoint/upload.py), which never exists itself: its staging folder and lock do."""
    if is_object_url(str(output)):
        from moeconv.checkpoint.upload import spool_folder

        return spool_folder(str(output))
    return Path(output)


def staging_folder(output: str | Path) -> Path:
    """Where an unfinished conversion lives until it is renamed to `output` (or uploaded there)."""
    output = resolved_output(local_folder(output))
    return output.parent / f".{output.name}.moeconv-partial"


def finished_shards(output: str | Path) -> list[str]:
    """The shards an unfinished conversion into `output` has journaled or recorded as finished: what
    running it again keeps (each re-hashed first); none when there is no journal, or a damaged one."""
    return recorded_shards(staging_folder(output))


def lock_file(output: Path) -> Path:
    """The file `_exclusive` locks, beside the staging folder."""
    output = resolved_output(output)
    return output.parent / f".{output.name}.moeconv-lock"


def _check_source_apart(output: Path, source: Path | StoredPath, files: list[Path | StoredPath]) -> None:
    """Refuses, before anything is written or deleted, a source (its folder or any file it is read
    from, links resolved) inside what convert writes or removes: the output, its staging folder (a
    refusal removes it) or its lock file."""
    places = (resolved_output(output), staging_folder(output), lock_file(output))
    for path in (source, *files) if isinstance(source, Path) else ():  # an object store's are apart from folders
        resolved = Path(path).resolve()
        for place in places:
            if resolved == place or place in resolved.parents:
                raise MoeconvError(f"{path}: the source lies in {place}, which convert writes and removes; "
                                   f"move the source or choose another -o")


def _staging_names(plan: Plan, sides: SideFiles) -> set[str]:
    """Every file convert writes in the staging folder (the journal adds its own, and each writer's
    temporary copies): the shards and their tasks' records, the side files (first under their `.partial`
    name), the index, the configs and the manifest."""
    shards = [shard.file_name for shard in plan.shards]
    copied = [side.name for side in sides.copied]
    return {*shards, *map(record_name, shards), *copied, *(name + ".partial" for name in copied), INDEX_NAME,
            "config.json", QUANTIZE_CONFIG_NAME, MANIFEST_NAME}


@contextmanager
def _exclusive(output: Path):
    """One writer per output: an advisory lock beside the staging folder, held for the whole run. The
    kernel drops it when the process dies, so a resume after a crash simply takes it over. Opened
    without following a link, and only a regular file of one name is written: the PID written there
    must not land in a file outside (a planted link, or a hard link to someone's file)."""
    import fcntl

    path = lock_file(output)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise PlantedLink(path) from None
            if error.errno == errno.EISDIR:  # a folder under the lock's name: the lock's to name, not its parent
                raise _not_a_lock(path) from None
            raise MoeconvError(f"{output.parent}: cannot create files there ({error.strerror})") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise _not_a_lock(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise MoeconvError(f"{output}: another moeconv (pid {other}) is converting into this folder; "
                               f"wait for it or stop it") from None
        try:
            if os.lstat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # the holder removed the file between our open and our lock: take the new one
    if os.fstat(fd).st_nlink != 1:  # another name of someone's file
        os.close(fd)
        raise _not_a_lock(path)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.unlink(path)  # while still held, on every exit (only a kill -9 leaves it, to be taken over)
        os.close(fd)


def _not_a_lock(path: Path) -> MoeconvError:
    """The lock's name holds another file (or a FIFO): writing the PID there would replace its bytes."""
    return MoeconvError(f"{path}: not a lock file moeconv made (a hard link to another file, or not a regular "
                        f"file); moeconv does not write into it: remove it")


def _space_error(error: OSError, output: Path, needed: int) -> MoeconvError:
    """A write that failed for the filesystem's reasons, as one line naming the output."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return MoeconvError(f"{output}: no space left on the device; the conversion needs "
                            f"{human_bytes(needed)} there (free some and rerun to resume)")
    if error.errno == errno.EFBIG:
        return MoeconvError(f"{output}: the filesystem refuses a file that large (shards up to "
                            f"{human_bytes(needed)}); choose a smaller --max-shard-size")
    return MoeconvError(f"{error.filename or output}: {error.strerror}")


def _converted_inputs(shard: OutputShard) -> list[SourceSlice]:
    """The source slices the shard's conversion jobs (experts, dense linears) decode, in order."""
    return [piece for job in shard.jobs if not job.copies for piece in job.inputs]


def _source_fingerprint(shard: OutputShard, fingerprints: dict[str, bytes]) -> str:
    """One hash over the content hashes of the source slices the shard's conversion jobs read, taken
    as they were read (pass-through tensors are copied in the kernel and checked against the output's
    own bytes on resume instead)."""
    digest = hashlib.sha256()
    for piece in _converted_inputs(shard):
        digest.update(piece.key.encode() + b"\0" + fingerprints.pop(piece.key))
    return digest.hexdigest()


def _check_unchanged_source(plan: Plan, shard: OutputShard, finished: Path | StoredPath, journal: Journal) -> None:
    """A finished shard is kept only if the source it came from has not changed since: its conversion
    jobs' source slices hash as recorded, and its pass-through tensors equal the output's bytes."""
    changed = None
    with TensorReader(fingerprints={}) as reader:
        for piece in _converted_inputs(shard):
            transform.read_source(piece.entry, reader)
        if _source_fingerprint(shard, reader.fingerprints) != journal.done[shard.file_name]["source"]:
            changed = "a converted tensor"
    if changed is None:
        header, data_start, _ = read_header(finished)
        for job in shard.jobs:
            if job.copies:
                entry = job.source.entry
                begin, _ = header[job.slot.tensor.name]["data_offsets"]
                if not same_bytes(entry.file, entry.begin, finished, data_start + begin, entry.nbytes):
                    raise MoeconvError(
                        f"{plan.checkpoint.root}: the source changed since the interrupted conversion, or the "
                        f"finished output shard {finished} did (its tensor {entry.name} no longer "
                        f"equals the source's, in {entry.file.name}); remove {journal.staging} to start over")
    if changed is not None:
        raise MoeconvError(f"{plan.checkpoint.root}: the source changed since the interrupted conversion "
                           f"({changed} of output shard {shard.file_name} differs); remove {journal.staging} to start over")


def convert(plan: Plan, output: str | Path, progress: Progress | None = None, workers: int | None = None,
            executor: str | ShardRunner = "local", ray_address: str | None = None,
            skip_unsafe_files: bool = False) -> ConvertReport:
    """Writes the plan's output at `output`. Resumable: an interrupted run (Ctrl-C, kill -9, power
    loss) leaves its finished shards and a journal in the staging folder; running again with the
    same plan re-hashes them, keeps those that match, and writes the rest, so the result is
    byte-identical to an uninterrupted run. A different source or different arguments refuse.
    executor: "local" (this machine's worker processes),
    "ray" (one Ray task per shard, moeconv.distributed; `ray_address` or the cluster Ray finds, else
    a local Ray), or an object with the same `run` as those two. skip_unsafe_files: leave out (and
    list) a source file that links outside the source folder, instead of refusing (side_files.py)."""
    source = plan.checkpoint
    sides = side_files(source, skip_unsafe_files)
    names = _staging_names(plan, sides)
    sink = open_output(output)
    sink.check(names, source.root, [*source.files, *(side.path for side in sides.copied)])
    census = _decide_cast(plan, workers)  # before anything is written
    advance = progress or (lambda nbytes: None)
    runner = _runner(executor, workers, ray_address, sink)
    started = time.perf_counter()
    staging = staging_folder(sink.local)
    with _exclusive(sink.local):
        sink.check(names)  # again, under the lock: another writer may have finished it
        try:
            journal = Journal.open(staging, plan.identity, names, sink.kept)
            _check_free_space(plan, staging, journal, sides.nbytes, sink)
            audits = Audits()
            hashing = SourceDigests(source.files, source.root, recorded_anchor(source.origin))
            try:
                todo = []
                for shard in plan.shards:
                    if journal.is_done(shard.file_name):
                        where = sink.finished(staging, shard.file_name, journal.done[shard.file_name])
                        _check_unchanged_source(plan, shard, where, journal)
                        advance(shard.source_bytes)
                    else:
                        todo.append(shard)
                for done in runner.run(plan, todo, staging, advance):
                    audits.merge(done.audits)
                    journal.mark_done(done.file_name, done.digest, done.source, done.tensor_digests, done.size)
                    sink.publish(staging, done.file_name, journal, done.uploaded)
                finished = journal.files()  # in the order the shards finished: listed in the plan's
                _write_metadata(plan, staging, {shard.file_name: finished[shard.file_name] for shard in plan.shards},
                                sides, hashing.result(), census)
            except MoeconvError as error:
                if not isinstance(error, Unfinished):
                    journal.discard()  # a refusal, not an interruption: nothing to resume
                raise
            finally:
                hashing.cancel()
            files = journal.files()
            sink.commit(staging, journal)
        except OSError as error:  # the filesystem's refusal: finished shards stay for a resume
            raise _space_error(error, sink.local, plan.output_bytes + sides.nbytes) from None
    return ConvertReport(sink.report_path, plan.summary(), time.perf_counter() - started, files,
                         [side.name for side in sides.copied], sides.skipped,
                         audits.report("suspicious_zero_slots"), audits.report("nonfinite_scales"), journal.reused,
                         peak_rss_mb(), runner.worker_peak_rss_mb, runner.device,
                         runner.tree_peak_pss_mb, runner.largest_worker_pss_mb, runner.tree_cpu_seconds, census)


def _decide_cast(plan: Plan, workers: int | None) -> dict[str, Any] | None:
    """A cast's census (transform.cast_census: every converted linear read on this machine's workers, whatever
    the executor), or None when the plan keeps the codes. An inexact block refuses the cast, unless the plan
    allows it (--allow-inexact); what moeconv.json records then."""
    if plan.cast is None:
        return None
    with Executor(workers) as executor:
        tally = transform.cast_census(executor, [job for job in plan.jobs if not job.copies], plan.codec, plan.cast)
    if (unshared := tally.unshared()) is not None:
        raise MoeconvError(f"{plan.checkpoint.root}: --cast {plan.cast}: {unshared}, and vLLM reads one for the fused "
                           f"layer; nothing was written (a global scale shared by dense linears is not chosen yet)")
    if not tally.is_exact and not plan.allow_inexact:
        raise MoeconvError(f"{plan.checkpoint.root}: --cast {plan.cast} is not exact: {tally.summary()}; nothing was "
                           f"written (--allow-inexact writes it and records the census and the bound in "
                           f"{MANIFEST_NAME}; `moeconv inspect --casts` lists every inexact linear)")
    return tally.record(plan.allow_inexact)


class OutputSink(Protocol):
    """Where a conversion's output goes (FolderOutput, or checkpoint/upload.StoreOutput): the shards are
    filled in a staging folder beside `local` on this machine either way, journaled, handed to `publish`
    as each finishes, and the whole committed by `commit` once the metadata is written."""

    location: str  # for messages and the report
    local: Path  # the folder whose staging folder and lock this machine keeps
    remote: bool  # elsewhere than this machine's filesystem

    def check(self, names: set[str] | None = None, source_root: Path | StoredPath | None = None,
              source_files: list[Path | StoredPath] | None = None) -> None:
        ...

    def kept(self, name: str, info: dict[str, Any]) -> bool:
        ...

    def finished(self, staging: Path, name: str, info: dict[str, Any]) -> Path | StoredPath:
        ...

    def publish(self, staging: Path, name: str, journal: Journal, uploaded: str | None = None) -> None:
        ...

    def space_needed(self, output_bytes: int, largest_shard: int, side_bytes: int, done_bytes: int) -> int:
        ...

    def commit(self, staging: Path, journal: Journal) -> None:
        ...


def open_output(output: str | Path) -> OutputSink:
    """The output `-o` names: an object store URL (checkpoint/upload.py), else a folder."""
    refuse_mangled_url(output, "OUT")
    if is_object_url(str(output)):
        from moeconv.checkpoint.upload import StoreOutput

        return StoreOutput(str(output))
    return FolderOutput(Path(output))


class FolderOutput:
    """An output folder on this machine: built in a hidden sibling staging folder and renamed into
    place only when complete."""

    remote = False

    def __init__(self, output: Path):
        self.given, self.local = Path(output), resolved_output(output)
        self.location, self.report_path = str(self.local), self.local

    def check(self, names: set[str] | None = None, source_root: Path | StoredPath | None = None,
              source_files: list[Path | StoredPath] | None = None) -> None:
        check_output_folder(self.given, source_root)
        if source_root is not None:
            _check_source_apart(self.given, source_root, source_files or [])

    def kept(self, name: str, info: dict[str, Any]) -> bool:
        return False  # a shard of a folder output is kept only where it is, re-hashed (the journal's own check)

    def finished(self, staging: Path, name: str, info: dict[str, Any]) -> Path:
        return staging / name

    def publish(self, staging: Path, name: str, journal: Journal, uploaded: str | None = None) -> None:
        pass  # it stays in the staging folder, which becomes the output (no Ray task uploads to a folder)

    def space_needed(self, output_bytes: int, largest_shard: int, side_bytes: int, done_bytes: int) -> int:
        return output_bytes + side_bytes - done_bytes

    def commit(self, staging: Path, journal: Journal) -> None:
        journal.remove()
        if self.local.exists():
            self.local.rmdir()
        staging.rename(self.local)


class ShardRunner(Protocol):
    """What runs a plan's shards (LocalShards, distributed.RayShards, or a caller's own) and what it
    says of the run afterwards (None where it cannot tell: Ray tasks are not this machine's tree)."""

    device: str
    worker_peak_rss_mb: float | None
    tree_peak_pss_mb: float | None
    largest_worker_pss_mb: float | None
    tree_cpu_seconds: float | None

    def run(self, plan: Plan, shards: list[OutputShard], staging: Path, advance: Progress) -> Iterator[ShardDone]:
        ...


def _runner(executor: str | ShardRunner, workers: int | None, ray_address: str | None, sink: OutputSink) -> ShardRunner:
    """What runs the shards: LocalShards, distributed.RayShards (into the staging folder, which every node
    sees; or, for an output in an object store, each task uploading its own shard: no storage shared), or the
    caller's own."""
    if not isinstance(executor, str):
        return executor
    if executor == "local":
        return LocalShards(workers)
    if executor == "ray":
        from moeconv.distributed import RayShards

        if sink.remote:
            return RayShards(convert_shard_to_store, ray_address, destination=sink.location)
        return RayShards(convert_shard_alone, ray_address)
    raise MoeconvError(f"--executor {executor}: choose local or ray")


@dataclass
class ShardDone:
    """What converting one output shard leaves for the journal and the report."""

    file_name: str
    digest: str  # writer.shard_digest of the finished file (made of its tensors' digests)
    source: str  # _source_fingerprint: what a resume compares
    audits: Audits
    tensor_digests: dict[str, str]  # each tensor's digest (writer.tensor_digest), by name
    # A shard its task uploaded itself (convert_shard_to_store): its size and the object's entity tag; else
    # None (the shard is in the staging folder)
    size: int | None = None
    uploaded: str | None = None


class LocalShards:
    """The shards one after another, each one's jobs spread over this machine's worker processes
    (moeconv.executor)."""

    def __init__(self, workers: int | None = None):
        self.workers = workers
        self.device = "cpu"  # where the experts are transformed, in words
        self.worker_peak_rss_mb: float | None = None
        self.tree_peak_pss_mb: float | None = None  # this process and its workers (executor.TreeMemory)
        self.largest_worker_pss_mb: float | None = None
        self.tree_cpu_seconds: float | None = None

    def run(self, plan: Plan, shards: list[OutputShard], staging: Path, advance: Progress) -> Iterator[ShardDone]:
        """Each shard is finished (its last blocks hashed, fsync, rename) on a thread while the workers
        fill the next one: the fsync waits for the disk, and the cores need not wait with it. A
        shard is yielded (and so journaled) only once finished, and a shard that finishes while the next
        one is stopped (Ctrl-C, a failure) is yielded too, before the stop goes on: else a whole shard
        would be on disk but not in the journal, and a resume would delete it and write it again."""
        from concurrent.futures import ThreadPoolExecutor

        with Executor(self.workers) as executor, \
                ThreadPoolExecutor(1, thread_name_prefix="moeconv-finish") as finisher:
            finishing = None  # the shard on the finishing thread, not yet yielded
            try:
                for shard in shards:
                    audits, path = Audits(), staging / shard.file_name
                    writer, hasher, fingerprints = _fill_shard(plan, shard, path, advance, audits, executor)
                    try:
                        if finishing is not None:
                            done, finishing = _finished(*finishing), None
                            yield done
                    except BaseException:  # the previous shard failed, or the caller stopped: drop this one
                        hasher.cancel()
                        writer.abort()
                        raise
                    finishing = (finisher.submit(_finish_shard, writer, hasher, path), shard, fingerprints, audits)
                if finishing is not None:
                    done, finishing = _finished(*finishing), None
                    yield done
            except GeneratorExit:  # the caller stopped taking shards: it journals nothing more
                raise
            except BaseException:
                if finishing is not None and finishing[0].exception() is None:  # waits for it to finish
                    yield _finished(*finishing)  # journaled by the caller; its next step re-raises the stop
                raise
            finally:
                self.worker_peak_rss_mb = executor.worker_peak_rss_mb
        # After close: the sampler's last look was taken while the workers still lived.
        self.tree_peak_pss_mb, self.largest_worker_pss_mb = executor.memory.peak_mb, executor.memory.largest_worker_mb
        self.tree_cpu_seconds = executor.memory.cpu_seconds


def _finished(digests: Any, shard: OutputShard, fingerprints: dict[str, bytes], audits: Audits) -> ShardDone:
    """The ShardDone of a shard whose `_finish_shard` runs as the future `digests`."""
    digest, tensors = digests.result()
    return ShardDone(shard.file_name, digest, _source_fingerprint(shard, fingerprints), audits, tensors)


def convert_shard_alone(plan: Plan, index: int, staging: str) -> ShardDone:
    """Output shard `index` converted in this process alone: the body of a Ray task (distributed.py).
    Its record is written before the shard takes its final name, so a shard whole under that name is
    kept by a resume even when the driver died before it heard of it (checkpoint/journal.py)."""
    shard, folder = plan.shards[index], Path(staging)
    path = folder / shard.file_name
    done, writer = _shard_alone(plan, shard, path)
    write_record(folder, shard.file_name, {"bytes": writer.size, CURRENT.shard_key: done.digest,
                                           "source": done.source, TENSOR_DIGESTS_KEY: done.tensor_digests})
    os.replace(writer.path, path)
    return done


def _shard_alone(plan: Plan, shard: OutputShard, path: Path) -> tuple[ShardDone, ShardWriter]:
    """One shard filled in this process (one worker) under a temporary name beside `path`, and sealed: what
    its journal entry says, and its writer (the temporary file, not yet renamed)."""
    with Executor(1) as executor:
        audits = Audits()
        writer, hasher, fingerprints = _fill_shard(plan, shard, path, lambda nbytes: None, audits, executor)
    digest, tensors = _sealed(writer, hasher)
    return ShardDone(shard.file_name, digest, _source_fingerprint(shard, fingerprints), audits, tensors), writer


def convert_shard_to_store(plan: Plan, index: int, location: str) -> ShardDone:
    """Output shard `index` converted in this process alone and uploaded by it to the object store prefix
    `location`: the body of a Ray task for an output in a store (distributed.py), so that no node shares a
    folder with the driver. The shard is filled in a temporary folder on the task's own machine, sealed,
    uploaded whole (a multipart upload: the object appears whole or not at all) and deleted there; the driver
    journals its size and entity tag (checkpoint/upload.py). A task that outlives a killed driver may still
    upload its shard, which the resume, not knowing it, converts and uploads again: the same bytes."""
    import tempfile

    from moeconv.storage import ObjectStore

    shard = plan.shards[index]
    with tempfile.TemporaryDirectory(prefix="moeconv-shard-") as folder:
        path = Path(folder) / shard.file_name
        done, writer = _shard_alone(plan, shard, path)
        os.replace(writer.path, path)
        done.size, done.uploaded = path.stat().st_size, ObjectStore(location).put_file(shard.file_name, path) or ""
        return done


def _check_free_space(plan: Plan, staging: Path, journal: Journal, side_bytes: int, sink: OutputSink) -> None:
    """Refuse up front when what this machine must hold (the shards still to write and the side files, or
    for an output elsewhere what the sink spools) cannot fit."""
    done = sum(info["bytes"] for info in journal.done.values())
    largest = max((sum(spec.nbytes for spec in shard.tensors) for shard in plan.shards), default=0)
    needed = sink.space_needed(plan.output_bytes, largest, side_bytes, done)
    free = shutil.disk_usage(staging).free
    if needed > free:
        if not journal.done:
            journal.discard()
        raise MoeconvError(f"{staging.parent}: {human_bytes(free)} free, but the conversion needs "
                           f"{human_bytes(needed)} more there; free some space or choose another -o")


def _fill_shard(plan: Plan, shard: OutputShard, path: Path, advance: Progress, audits: Audits,
                executor: Executor) -> tuple[ShardWriter, BlockHasher, dict[str, bytes]]:
    """Writes every byte of the shard under a temporary name; returns its open writer, its hasher (the
    blocks still hashing) and the content checks of the source tensors its jobs read, for
    `_finish_shard`. Each job is read, transformed and written at its slots by one worker
    (moeconv.executor), a bounded window of jobs at a time, so at most a few experts are in memory
    per worker; every byte has one place, so the bytes do not depend on the scheduling. Completions
    are taken in job order, which tells the hasher how far the file is final."""
    metadata = {"format": "pt", "producer": f"moeconv {__version__}", "backend": plan.backend.name}
    temporary = path.with_name(temporary_name(path.name))
    codec = plan.codec
    writer = ShardWriter(temporary, shard.tensors, metadata)
    try:
        tasks = [(job, codec, temporary, {suffix: writer.claim(slot.tensor.name, slot.offset, slot.nbytes)
                                          for suffix, slot in job.slots.items()}) for job in shard.jobs]
        # Once job i is written, every byte before the first slot of a later job is final.
        final = [writer.size] * (len(tasks) + 1)
        for index in range(len(tasks) - 1, -1, -1):
            final[index] = min(final[index + 1], *tasks[index][3].values())
        hasher = BlockHasher(temporary, writer.data_start, writer.tensor_ranges())
        fingerprints: dict[str, bytes] = {}
        try:
            for index, (job, (counts, read)) in enumerate(zip(shard.jobs, in_batches(executor, _run_job, tasks))):
                fingerprints.update(read)
                for name, found in counts:
                    audits.record(name, found)
                advance(sum(piece.nbytes for piece in job.inputs))
                hasher.advance(final[index + 1])
        except BaseException:
            hasher.cancel()
            raise
    except BaseException:
        writer.abort()
        raise
    return writer, hasher, fingerprints


def _finish_shard(writer: ShardWriter, hasher: BlockHasher, path: Path) -> tuple[str, dict[str, str]]:
    """The filled shard's digests (`_sealed`), then renamed to `path`, so a shard file under its final
    name is always whole."""
    digests = _sealed(writer, hasher)
    os.replace(writer.path, path)
    return digests


def _sealed(writer: ShardWriter, hasher: BlockHasher) -> tuple[str, dict[str, str]]:
    """The filled shard's digest and its tensors' once its last blocks are hashed; then flushed to disk
    (fsync) and closed."""
    try:
        digests = hasher.finish(writer.size)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return digests


def _run_job(job, codec, path: Path, positions: dict[str, int]) -> tuple[list, dict[str, bytes]]:
    """Reads, transforms and writes one job at its file positions (through this process's own
    descriptor of the shard); returns the audit counts and the content hashes of what it read."""
    reader = worker_reader()
    reader.fingerprints = {}
    fd = worker_descriptor(path)
    if job.copies:
        entry = job.source.entry
        copy_into(fd, positions[""], entry.file, entry.begin, entry.end, entry.name)
        return [], {}
    reader.prefetch([piece.entry for piece in job.inputs])  # a stored source's: one call for the job's tensors
    blocks, counts = transform.convert(job, codec, reader)
    for suffix, data in blocks.items():
        if data.nbytes != job.slots[suffix].nbytes:
            raise ValueError(f"{job.slots[suffix].tensor.name}: the backend made {tuple(data.shape)}, "
                             f"not the planned {job.slots[suffix].shape}")
        write_at(fd, data, positions[suffix])
    return counts, reader.fingerprints


class SourceDigests:
    """The block digest (writer.file_digest) of every source shard, taken on a thread while the
    conversion runs, so the manifest records the source's data as this run read it; for a Hub snapshot
    (`anchor`), every file of it against the digest the Hub published, from a second thread, several
    files at once (a published sha256 is one stream a file): a cached blob changed since its download is
    refused, never converted."""

    def __init__(self, files: list[Path], root: Path, anchor: Anchor | None):
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(2, thread_name_prefix="moeconv-source-hash")
        self._anchor, self._cancelled = anchor, threading.Event()
        # submitted first, so that it has a thread from the start (it was queued behind every shard's digest)
        self._published = None if anchor is None else self._pool.submit(
            provenance.mismatches, root, anchor, sorted(anchor.published), threads=hash_threads(),
            cancelled=self._cancelled)
        self._digests = {path.name: self._pool.submit(_sized_digest, path) for path in files}

    def result(self) -> dict[str, dict[str, Any]]:
        problems = [] if self._published is None else self._published.result()
        if problems:
            more = f" (and {len(problems) - 1} more file(s))" if len(problems) > 1 else ""
            raise MoeconvError(f"{problems[0]}{more}: the Hugging Face cache changed since the download; remove "
                               f"{self._anchor.repo} from the cache (`hf cache delete`) and download it again")
        return {name: future.result() for name, future in self._digests.items()}

    def cancel(self) -> None:
        self._cancelled.set()  # the published digests' files not begun yet are skipped
        self._pool.shutdown(wait=True, cancel_futures=True)


def _sized_digest(path: Path | StoredPath) -> dict[str, Any]:
    return {"bytes": file_size(path), CURRENT.file_key: file_digest(path)}


def _write_metadata(plan: Plan, staging: Path, files: dict[str, dict[str, Any]], sides: SideFiles,
                    source_digests: dict[str, dict[str, Any]], census: dict[str, Any] | None = None) -> None:
    """The index, configs and copied side files, then the manifest recording every one's digest."""
    _dump(staging / INDEX_NAME, manifest.output_index(plan))
    _dump(staging / "config.json", manifest.output_config(plan))
    configs = (INDEX_NAME, "config.json", QUANTIZE_CONFIG_NAME) if plan.quantization_config else (INDEX_NAME, "config.json")
    if plan.quantization_config:  # none for a plain checkpoint (a BF16 cast with nothing left quantized)
        _dump(staging / QUANTIZE_CONFIG_NAME, plan.quantization_config)
    written = {name: _sized_digest(staging / name) for name in configs}
    copied = {side.name: copy_side_file(side, staging) for side in sides.copied}
    _dump(staging / MANIFEST_NAME, manifest.build(plan, files, written, copied, sides.skipped, source_digests,
                                                  census))


def _dump(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
