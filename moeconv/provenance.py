"""Where a source came from: a Hugging Face Hub snapshot's published digests, and the source's bytes
checked against them.

The Hub publishes a digest for every file of a commit: the sha256 of an LFS file's bytes (safetensors
shards), the git blob id of a small file (configs, tokenizer files: sha1 of `blob <size>\\0` and the
bytes). huggingface_hub's cache keeps them offline: a snapshot's files are links to blobs named by
that digest (its documented cache layout), so a snapshot of a commit says what its publisher published
without a network. A conversion from such a snapshot records them (the manifest's `source.published`)
and checks the bytes it read against them; `verify` checks the source's bytes again, on any machine.
A local folder has no such anchor: its output is proven equal to the conversion of that folder only.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from moeconv.errors import MoeconvError

_SHA256 = re.compile(r"^[0-9a-f]{64}$")  # an LFS file's blob name: the sha256 of its bytes
_GIT_SHA1 = re.compile(r"^[0-9a-f]{40}$")  # a regular git file's (and a commit's): its git object id
_READ_BYTES = 8 << 20


@dataclass(frozen=True)
class Anchor:
    """A Hub snapshot: its repository, its commit, and what the Hub published for each of its files
    (file name -> ("sha256" or "git_sha1", hex))."""

    repo: str
    revision: str
    published: dict[str, tuple[str, str]]

    def to_json(self) -> dict[str, Any]:
        return {"repo": self.repo, "revision": self.revision,
                "files": {name: {kind: digest} for name, (kind, digest) in sorted(self.published.items())}}


def anchor_of(folder: Path) -> Anchor | None:
    """The anchor of a folder that is a snapshot in a huggingface_hub cache
    (`.../models--ORG--NAME/snapshots/COMMIT`, its files links to `../../blobs/DIGEST`), None for any
    other folder. A file that is not such a link (a file copied or edited in place) has no published
    digest, so its folder is not anchored."""
    folder = Path(folder).resolve()
    repository = folder.parents[1] if len(folder.parents) > 1 else folder
    if folder.parent.name != "snapshots" or not _GIT_SHA1.match(folder.name) or not repository.name.startswith("models--"):
        return None
    parts = repository.name[len("models--"):].split("--")
    if len(parts) != 2 or not all(parts):
        return None
    blobs = repository / "blobs"
    published: dict[str, tuple[str, str]] = {}
    for path in sorted(folder.iterdir()):
        if path.is_dir() and not path.is_symlink():
            continue  # a sub-folder's files are not a checkpoint's
        target = Path(os.path.realpath(path))
        if not path.is_symlink() or target.parent != blobs.resolve():
            return None
        kind = "sha256" if _SHA256.match(target.name) else "git_sha1" if _GIT_SHA1.match(target.name) else None
        if kind is None:
            return None
        published[path.name] = (kind, target.name)
    return Anchor("/".join(parts), folder.name, published) if published else None


def recorded_anchor(source: dict[str, Any]) -> Anchor | None:
    """The anchor a manifest's `source` section records (None for a local folder's); MoeconvError when the
    section is malformed (a damaged manifest must not read as unanchored)."""
    recorded = source.get("published")
    if recorded is None:
        return None
    files = recorded.get("files") if isinstance(recorded, dict) else None
    if not (isinstance(files, dict) and isinstance(recorded.get("repo"), str)
            and isinstance(recorded.get("revision"), str) and _GIT_SHA1.match(recorded["revision"])):
        raise MoeconvError("moeconv.json: source.published must give repo, revision (a commit) and files")
    published = {}
    for name, digest in files.items():
        kind, value = next(iter(digest.items())) if isinstance(digest, dict) and len(digest) == 1 else (None, None)
        pattern = {"sha256": _SHA256, "git_sha1": _GIT_SHA1}.get(kind)
        if pattern is None or not isinstance(value, str) or not pattern.match(value):
            raise MoeconvError(f"moeconv.json: source.published.files.{name}: not a sha256 or git_sha1 digest")
        published[name] = (kind, value)
    return Anchor(recorded["repo"], recorded["revision"], published)


def published_digest(path: Path, kind: str) -> str:
    """The digest the Hub publishes for a file's bytes: sha256 (LFS) or the git blob id."""
    size = Path(path).stat().st_size
    if kind == "sha256":
        digest = hashlib.sha256()
    else:
        digest = hashlib.sha1(usedforsecurity=False)
        digest.update(b"blob %d\0" % size)
    with open(path, "rb", buffering=0) as handle:
        while chunk := handle.read(_READ_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def mismatches(folder: Path, anchor: Anchor, names: list[str],
               advance: Callable[[int], None] = lambda nbytes: None, threads: int = 1,
               cancelled: threading.Event | None = None) -> list[str]:
    """Each of `names` (files of `folder`) whose bytes are not what `anchor` says was published for it,
    that it does not list, or that is missing, as one problem each, in the order of `names`; `advance`
    gets each file's bytes (from any of the threads). A published sha256 is one stream over a file, so
    `threads` files are hashed at once, the largest first (a checkpoint's shards: one 5 GB shard on one
    core is about 3 to 5 s); a file not begun when `cancelled` is set is skipped."""

    def check(name: str) -> str | None:
        path = Path(folder) / name
        if name not in anchor.published:
            return f"{path}: {anchor.repo}@{anchor.revision} published no such file"
        if not path.is_file():
            return f"{path}: missing, but {anchor.repo}@{anchor.revision} published it"
        if cancelled is not None and cancelled.is_set():
            return None
        kind, digest = anchor.published[name]
        size = path.stat().st_size
        found = published_digest(path, kind)
        advance(size)
        if found != digest:
            return f"{path}: its bytes do not match the {kind} {anchor.repo}@{anchor.revision} published for it"
        return None

    if threads <= 1 or len(names) <= 1:
        found = {name: check(name) for name in names}
    else:
        from concurrent.futures import ThreadPoolExecutor

        def size(name: str) -> int:
            path = Path(folder) / name
            return path.stat().st_size if path.is_file() else 0

        with ThreadPoolExecutor(min(threads, len(names)), thread_name_prefix="moeconv-published") as pool:
            futures = {name: pool.submit(check, name) for name in sorted(names, key=size, reverse=True)}
            found = {name: future.result() for name, future in futures.items()}
    return [found[name] for name in names if found[name] is not None]


def describe(anchor: Anchor | None, checked: int, problems: list[str], stored: bool = False) -> str:
    """verify's one line on where the source came from (`stored`: a source in an object store, not a folder)."""
    if anchor is None:
        where = "an object store prefix" if stored else "a local folder"
        return (f"source not anchored ({where}): this proves the output equals the conversion of that "
                f"{'prefix' if stored else 'folder'}, not what its publisher published")
    if not checked:
        return f"source recorded as {anchor.repo}@{anchor.revision}; its bytes were not checked at this level"
    return (f"source anchored to {anchor.repo}@{anchor.revision}: {checked - len(problems)}/{checked} files match "
            f"the published digests")
