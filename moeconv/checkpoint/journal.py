"""The staging folder's journal of an unfinished conversion: which shards are finished (size,
digest, tensors' digests, and the fingerprint of the source tensors they were made from), replaced
atomically after each shard, so an interrupted `convert` resumes where it stopped and a changed job
or a damaged journal starts over."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from moeconv.checkpoint.schema import is_plain_file_name
from moeconv.checkpoint.writer import CURRENT, TENSOR_DIGESTS_KEY, shard_file_digests
from moeconv.errors import MoeconvError


def read_journal(path: Path) -> dict[str, Any] | None:
    """The journal, or None when there is none or it is damaged (then nothing there is trusted and
    the conversion starts over: every shard is rewritten, so the result is still exact)."""
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    done = recorded.get("done") if isinstance(recorded, dict) else None
    if not isinstance(done, dict) or not all(
            is_plain_file_name(name) and isinstance(info, dict) and isinstance(info.get("bytes"), int)
            and isinstance(info.get(CURRENT.shard_key), str) and isinstance(info.get("source"), str)
            and isinstance(info.get(TENSOR_DIGESTS_KEY), dict) for name, info in done.items()):
        return None
    return recorded


def _digests(shard: Path) -> tuple[str, dict[str, str]] | None:
    """A finished shard's digest and its tensors' (each byte hashed once), None when it is not a whole shard."""
    try:
        return shard_file_digests(shard)
    except ValueError:
        return None


class Journal:
    """The staging folder's record of finished shards, replaced atomically after each one."""

    NAME = "moeconv-progress.json"

    def __init__(self, staging: Path, job: dict[str, Any]):
        self.staging, self.job = staging, job
        self.done: dict[str, dict[str, Any]] = {}
        self.reused: list[str] = []

    @classmethod
    def open(cls, staging: Path, job: dict[str, Any]) -> Journal:
        journal = cls(staging, job)
        path = staging / cls.NAME
        recorded = read_journal(path)
        if recorded is not None:
            if recorded.get("job") != job:
                before = recorded["job"] if isinstance(recorded.get("job"), dict) else {}
                changed = sorted(key for key in job if before.get(key) != job[key])
                raise MoeconvError(
                    f"{staging}: an unfinished conversion with a different {', '.join(changed)} is there; "
                    f"rerun with the same source and arguments to resume it, or remove that folder")
            for name, info in recorded["done"].items():
                file = staging / name
                if file.is_file() and file.stat().st_size == info["bytes"] and _digests(file) == (
                        info[CURRENT.shard_key], info[TENSOR_DIGESTS_KEY]):
                    journal.done[name] = info
                    journal.reused.append(name)
            for leftover in staging.iterdir():  # partial shards, side files and configs of the last run
                if leftover.name not in journal.done and leftover.name != cls.NAME:
                    if leftover.is_dir() and not leftover.is_symlink():
                        shutil.rmtree(leftover)
                    else:
                        leftover.unlink()
        else:
            shutil.rmtree(staging, ignore_errors=True)  # no journal yet: nothing finished there
            staging.mkdir(parents=True)
        journal._save()
        return journal

    def files(self) -> dict[str, dict[str, Any]]:
        """Each finished shard's size, digest and tensors' digests, as the manifest records them."""
        return {name: {key: info[key] for key in ("bytes", CURRENT.shard_key, TENSOR_DIGESTS_KEY)}
                for name, info in self.done.items()}

    def is_done(self, name: str) -> bool:
        return name in self.done

    def mark_done(self, name: str, digest: str, source: str, tensors: dict[str, str]) -> None:
        """`source`: the fingerprint of the source tensors the shard was converted from (see
        moeconv.conversion._source_fingerprint), so that a resume notices a source changed in between; `tensors`: each
        tensor's digest, which the manifest records."""
        self.done[name] = {"bytes": (self.staging / name).stat().st_size, CURRENT.shard_key: digest, "source": source,
                           TENSOR_DIGESTS_KEY: tensors}
        self._save()

    def _save(self) -> None:
        temporary = self.staging / (self.NAME + ".tmp")
        temporary.write_text(json.dumps({"job": self.job, "done": self.done}, indent=2))
        os.replace(temporary, self.staging / self.NAME)

    def remove(self) -> None:
        (self.staging / self.NAME).unlink()
