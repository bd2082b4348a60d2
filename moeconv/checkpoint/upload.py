"""An output in an object store (`convert -o s3://bucket/prefix`): what `conversion.convert` writes there,
through the same staging folder, journal and lock as a folder output, kept on this machine in a spool
folder (`spool_folder`): each shard is filled there, journaled, uploaded whole (storage.ObjectStore.put_file:
a multipart upload), its entity tag journaled, and only then deleted here, so this machine's disk holds
about two shards at a time, never the output.

The commit (docs/FORMAT.md): every shard first, then the index, the configs and the copied side files,
moeconv.json last; a prefix without moeconv.json is an unfinished output, which `inspect` and `verify`
refuse. A resume after a kill keeps each shard the journal lists as uploaded whose object still has the
size and entity tag the upload returned (a shard journaled but not yet uploaded is re-hashed here and
uploaded), so it ends with the same bytes. The journal lives in the spool, on this machine: a resume from
another machine starts over (and overwrites the shards).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeconv.checkpoint.manifest import MANIFEST_NAME
from moeconv.errors import MoeconvError
from moeconv.storage import ObjectStore, StoredPath

if TYPE_CHECKING:
    from moeconv.checkpoint.journal import Journal

UPLOADED_KEY = "e_tag"  # a journaled shard's entity tag, once uploaded


def spool_folder(url: str) -> Path:
    """Where an output bound for `url` is built on this machine: under $MOECONV_SPOOL, else the user's
    cache ($XDG_CACHE_HOME or ~/.cache, moeconv/uploads), one folder a URL (its digest: a URL holds no
    credential, but a folder name need not hold the URL either)."""
    root = os.environ.get("MOECONV_SPOOL") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / \
        "moeconv" / "uploads"
    return Path(root) / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:24]


class StoreOutput:
    """An output prefix in an object store (see the module docstring)."""

    def __init__(self, url: str):
        self.store = ObjectStore(url)
        self.location = self.report_path = self.store.location
        self.local = spool_folder(self.location)  # convert's staging folder and lock are beside it
        self.local.parent.mkdir(parents=True, exist_ok=True)

    remote = True

    def check(self, names: set[str] | None = None, source_root: Any = None, source_files: Any = None) -> None:
        """Refuses a prefix that holds a finished output, or objects this conversion does not write
        (`names`: every file it writes, None before the plan); its own shards left by an interrupted run
        are overwritten or kept. The source is never in the way: a store's objects are not a folder's."""
        present = self.store.names_if_any()
        if MANIFEST_NAME in present:
            raise MoeconvError(f"{self.location}: a finished moeconv conversion is already there (`moeconv verify "
                               f"{self.location}` checks it); choose another -o, or remove it to convert again")
        foreign = sorted(set(present) - names) if names is not None else []
        if foreign:
            raise MoeconvError(f"{self.location}/{foreign[0]}: the output prefix holds objects this conversion does "
                               f"not write; choose an empty prefix for -o")

    def kept(self, name: str, info: dict[str, Any]) -> bool:
        """Whether shard `name`, journaled as `info`, is in the store as it was uploaded."""
        return UPLOADED_KEY in info and self.store.stamp(name) == (info["bytes"], info[UPLOADED_KEY])

    def finished(self, staging: Path, name: str, info: dict[str, Any]) -> Path | StoredPath:
        """Where a finished shard's bytes are read back (a resume's check of its pass-through tensors)."""
        return StoredPath(self.store, self.location, name) if UPLOADED_KEY in info else staging / name

    def publish(self, staging: Path, name: str, journal: Journal, uploaded: str | None = None) -> None:
        """A journaled shard uploaded, its entity tag journaled, then deleted here; `uploaded`: the entity tag
        of a shard its Ray task uploaded itself (conversion.convert_shard_to_store), journaled."""
        if uploaded is not None:
            journal.note(name, UPLOADED_KEY, uploaded)
        if UPLOADED_KEY in journal.done[name]:
            return
        journal.note(name, UPLOADED_KEY, self.store.put_file(name, staging / name) or "")
        (staging / name).unlink()

    def space_needed(self, output_bytes: int, largest_shard: int, side_bytes: int, done_bytes: int) -> int:
        """This machine's disk: the shard being filled and the one being uploaded, and the metadata."""
        return min(output_bytes - done_bytes, 2 * largest_shard) + side_bytes

    def commit(self, staging: Path, journal: Journal) -> None:
        """Every file in the staging folder but moeconv.json uploaded (the shards are already), then
        moeconv.json: the prefix is a finished output from that moment; then the spool is removed."""
        for name in journal.done:
            self.publish(staging, name, journal)
        journal.remove()
        names = sorted(entry.name for entry in staging.iterdir())
        for name in [*(name for name in names if name != MANIFEST_NAME), MANIFEST_NAME]:
            self.store.put_file(name, staging / name)
        for name in names:
            (staging / name).unlink()
        staging.rmdir()

    def __str__(self) -> str:
        return self.location
