"""The staging folder's journal of an unfinished conversion: which shards are finished (size,
digest, tensors' digests, and the fingerprint of the source tensors they were made from), replaced
atomically after each shard, so an interrupted `convert` resumes where it stopped and a changed job
or a damaged journal starts over. The folder holds only the files the job writes: nothing else there is
ever deleted, and a link there is never followed.

A shard converted away from the journal's keeper (a Ray task) leaves its own record beside it, written
before the shard takes its final name: a task that finishes after its driver was killed is then kept
by the resume, which the journal alone could not tell. Each writer's temporary files carry a name of
their own (`temporary_name`), so a task outliving its driver never renames another attempt's file."""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Any, Callable

from moeconv.checkpoint.schema import is_plain_file_name
from moeconv.checkpoint.writer import CURRENT, TENSOR_DIGESTS_KEY, shard_file_digests
from moeconv.errors import MoeconvError, PlantedLink


_TEMPORARY = re.compile(r"(?P<name>.+)\.[0-9a-f]{8}\.partial")
RECORD_SUFFIX = ".record"


def temporary_name(name: str) -> str:
    """A name for one writer's unfinished copy of `name`, unlike any other writer's."""
    return f"{name}.{secrets.token_hex(4)}.partial"


def record_name(shard: str) -> str:
    """The name of the record a task leaves beside the shard it finished (see the module docstring)."""
    return shard + RECORD_SUFFIX


def write_record(staging: Path, shard: str, info: dict[str, Any]) -> None:
    """The record of a finished shard, whole under its name (`info`: what the journal keeps of it)."""
    temporary = staging / temporary_name(record_name(shard))
    temporary.write_text(json.dumps(info))
    os.replace(temporary, staging / record_name(shard))


def _is_shard_info(info: Any) -> bool:
    return (isinstance(info, dict) and isinstance(info.get("bytes"), int) and isinstance(info.get(CURRENT.shard_key), str)
            and isinstance(info.get("source"), str) and isinstance(info.get(TENSOR_DIGESTS_KEY), dict))


def read_journal(path: Path) -> dict[str, Any] | None:
    """The journal, or None when there is none or it is damaged (then nothing there is trusted and
    the conversion starts over: every shard is rewritten, so the result is still exact)."""
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    done = recorded.get("done") if isinstance(recorded, dict) else None
    if not isinstance(done, dict) or not all(is_plain_file_name(name) and _is_shard_info(info)
                                             for name, info in done.items()):
        return None
    return recorded


def _read_record(path: Path) -> dict[str, Any] | None:
    """A task's record of its shard, None when it is damaged or not there (the shard is then rewritten)."""
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return info if _is_shard_info(info) else None


def recorded_shards(staging: Path) -> list[str]:
    """The shards a resume into `staging` would keep before re-hashing them: those its journal lists,
    and those whose task left a record beside them."""
    recorded = read_journal(staging / Journal.NAME)
    try:
        present = {entry.name for entry in staging.iterdir()}
    except OSError:
        present = set()
    return sorted({*(recorded["done"] if recorded else ()),
                   *(name for name in present if record_name(name) in present)})


def _staging_entries(staging: Path) -> set[str] | None:
    """The names in the staging folder (None when there is none), each checked without following a
    link: the folder, or an entry in it, that is a link is refused (deleting through it would delete
    someone's files), and so is an entry that is not a regular file."""
    try:
        mode = staging.lstat().st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(mode):
        raise PlantedLink(staging)
    if not stat.S_ISDIR(mode):
        raise MoeconvError(f"{staging}: is not a folder; moeconv keeps an unfinished conversion under that name: "
                           f"remove it")
    names = set()
    for entry in staging.iterdir():
        mode = entry.lstat().st_mode
        if stat.S_ISLNK(mode):
            raise PlantedLink(entry)
        if not stat.S_ISREG(mode):
            raise MoeconvError(f"{entry}: not a file moeconv writes (a folder, device or FIFO); moeconv deletes only "
                               f"its own files in {staging.name}: move it away, or remove that folder")
        names.add(entry.name)
    return names


def _digests(shard: Path) -> tuple[str, dict[str, str]] | None:
    """A finished shard's digest and its tensors' (each byte hashed once), None when it is not a whole shard."""
    try:
        return shard_file_digests(shard)
    except ValueError:
        return None


class Journal:
    """The staging folder's record of finished shards, replaced atomically after each one."""

    NAME = "moeconv-progress.json"

    def __init__(self, staging: Path, job: dict[str, Any], names: set[str]):
        self.staging, self.job = staging, job
        self.names = names | {self.NAME, self.NAME + ".tmp"}  # every file the job writes in the staging folder
        self.done: dict[str, dict[str, Any]] = {}
        self.reused: list[str] = []

    def _writes(self, name: str) -> bool:
        """Whether `name` is one the job writes there, or a writer's temporary copy of one."""
        temporary = _TEMPORARY.fullmatch(name)
        return name in self.names or (temporary is not None and temporary["name"] in self.names)

    @classmethod
    def open(cls, staging: Path, job: dict[str, Any], names: set[str],
             kept: Callable[[str, dict[str, Any]], bool] | None = None) -> Journal:
        """The staging folder's journal, the folder made when missing. `names`: every file the job
        writes there (the journal adds its own; each may also be there under a `temporary_name`). A
        resume keeps the finished shards the journal or their tasks' records list, each re-hashed, and
        removes the rest of those names; anything else there (a link, a folder, a file
        the job does not write) is refused before anything is deleted, so a folder planted under the
        staging name, or someone's files in it, lose nothing. `kept(name, info)`: whether a journaled
        shard no longer here is kept where it went (an output in an object store: upload.StoreOutput)."""
        journal = cls(staging, job, names)
        entries = _staging_entries(staging)
        if entries is None:
            staging.mkdir()
            journal._save()
            return journal
        recorded = read_journal(staging / cls.NAME)
        if recorded is not None and recorded.get("job") != job:
            before = recorded["job"] if isinstance(recorded.get("job"), dict) else {}
            changed = sorted(key for key in job if before.get(key) != job[key])
            raise MoeconvError(
                f"{staging}: an unfinished conversion with a different {', '.join(changed)} is there; "
                f"rerun with the same source and arguments to resume it, or remove that folder")
        foreign = sorted(name for name in entries if not journal._writes(name))
        if foreign:
            others = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
            raise MoeconvError(f"{staging / foreign[0]}{others}: not a file this conversion writes; moeconv deletes "
                               f"only its own files in {staging.name}: move it away, or remove that folder")
        claimed = dict(recorded["done"]) if recorded else {}  # records are trusted only beside a journal of this job
        for name in sorted(entries) if recorded else ():
            if name not in claimed and record_name(name) in entries:
                info = _read_record(staging / record_name(name))
                if info is not None:
                    claimed[name] = info
        for name, info in claimed.items():
            file = staging / name
            if name in entries and file.stat().st_size == info["bytes"] and _digests(file) == (
                    info[CURRENT.shard_key], info[TENSOR_DIGESTS_KEY]) or \
                    name not in entries and kept is not None and kept(name, info):
                journal.done[name] = info
                journal.reused.append(name)
        for leftover in entries - set(journal.done) - {cls.NAME}:  # partial shards, side files and configs
            (staging / leftover).unlink()
        journal._save()
        return journal

    def files(self) -> dict[str, dict[str, Any]]:
        """Each finished shard's size, digest and tensors' digests, as the manifest records them."""
        return {name: {key: info[key] for key in ("bytes", CURRENT.shard_key, TENSOR_DIGESTS_KEY)}
                for name, info in self.done.items()}

    def is_done(self, name: str) -> bool:
        return name in self.done

    def mark_done(self, name: str, digest: str, source: str, tensors: dict[str, str], size: int | None = None) -> None:
        """`source`: the fingerprint of the source tensors the shard was converted from (see
        moeconv.conversion._source_fingerprint), so that a resume notices a source changed in between; `tensors`: each
        tensor's digest, which the manifest records; `size`: the shard's bytes where it is not in the staging folder
        (a Ray task uploaded it)."""
        size = (self.staging / name).stat().st_size if size is None else size
        self.done[name] = {"bytes": size, CURRENT.shard_key: digest, "source": source, TENSOR_DIGESTS_KEY: tensors}
        self._save()
        (self.staging / record_name(name)).unlink(missing_ok=True)  # the journal holds it now

    def note(self, name: str, key: str, value: str) -> None:
        """One more fact of a finished shard, journaled (an upload's entity tag)."""
        self.done[name][key] = value
        self._save()

    def _save(self) -> None:
        temporary = self.staging / (self.NAME + ".tmp")
        temporary.write_text(json.dumps({"job": self.job, "done": self.done}, indent=2))
        os.replace(temporary, self.staging / self.NAME)

    def remove(self) -> None:
        """Before the folder becomes the output: the journal goes, and so do the records and temporary
        copies a task that outlived an earlier driver may have left since (none of them is output)."""
        for entry in self.staging.iterdir():
            if self._writes(entry.name) and (entry.name.endswith(RECORD_SUFFIX) or _TEMPORARY.fullmatch(entry.name)):
                entry.unlink(missing_ok=True)
        (self.staging / self.NAME).unlink()

    def discard(self) -> None:
        """After a refusal (nothing to resume): the files the job wrote are removed, then the folder.
        Only those names: a file that appeared there since `open` stays, and so does the folder."""
        for name in self.names:
            (self.staging / name).unlink(missing_ok=True)
        for entry in self.staging.iterdir():
            if _TEMPORARY.fullmatch(entry.name) and self._writes(entry.name):
                entry.unlink(missing_ok=True)
        try:
            self.staging.rmdir()
        except OSError:
            pass  # not empty: what the job did not write is not its to delete
