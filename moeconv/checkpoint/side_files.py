"""The source's files other than its shards and the configs moeconv rewrites: which are copied into
an output, which are left out and why, and the copy itself.

The trust boundary: an output may hold only what the source folder holds. A file is copied only when
it is a regular file that resolves inside the checkpoint folder (a Hub snapshot's links into its
repository's blobs are inside) and is of a kind a model folder holds; a link that leaves the folder
(`notes.txt -> /proc/self/environ`, `tokenizer_config.json -> ~/.ssh/id_rsa`) is refused, because
following it would copy moeconv's environment or a secret into a folder made to be uploaded.
"""

from __future__ import annotations

import os
import re
import stat
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from moeconv.checkpoint.manifest import MANIFEST_NAME, QUANTIZE_CONFIG_NAME
from moeconv.checkpoint.reader import INDEX_NAME, QUANTIZATION_CONFIG_NAMES, boundary, inside
from moeconv.checkpoint.writer import BLOCK_BYTES, CURRENT, combined_digest
from moeconv.errors import MoeconvError
from moeconv.storage import StoredPath

# Configs, tokenizer and vocabulary files, chat templates, READMEs, and the remote code an auto_map names.
_KINDS = {".json", ".txt", ".model", ".tiktoken", ".jinja", ".py", ".md"}
_DOCUMENTS = re.compile(r"^(LICEN[CS]E|NOTICE|COPYING|README|USE_POLICY)([._-].*)?$", re.IGNORECASE)
_KIND_WORDS = "configs, tokenizer files, chat templates, README, license, code"
_READ_BYTES = 8 * 1024 * 1024
# Source files that describe the source's quantization or weights: rewritten by convert, never copied.
# ModelOpt's hf_quant_config.json is folded into the source's config (reader.py): copied, it would tell an engine
# that reads it (vLLM's ModelOpt detection) that the output is still ModelOpt's.
_REWRITTEN = {"config.json", INDEX_NAME, QUANTIZE_CONFIG_NAME, MANIFEST_NAME, *QUANTIZATION_CONFIG_NAMES}


@dataclass(frozen=True)
class SideFile:
    name: str
    path: Path | StoredPath  # with every link resolved: what is opened and copied (or the stored object)
    nbytes: int


@dataclass
class SideFiles:
    copied: list[SideFile] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why it is not copied

    @property
    def nbytes(self) -> int:
        return sum(side.nbytes for side in self.copied)


def side_files(checkpoint: Any, skip_unsafe: bool = False) -> SideFiles:
    """The top-level entries of a checkpoint's folder (a reader.Checkpoint) other than its shards and
    the files convert rewrites, sorted into copied and skipped. A link that leaves the checkpoint's
    boundary (reader.boundary) is refused in one line naming the file, or skipped when `skip_unsafe`."""
    found = SideFiles()
    replaced = _REWRITTEN | {path.name for path in checkpoint.files}
    if isinstance(checkpoint.root, StoredPath):  # objects: no links, no folders, no devices
        return _stored_side_files(checkpoint.root, replaced)
    root, allowed = checkpoint.root, boundary(checkpoint.root)
    for path in sorted(root.iterdir()):
        name = path.name
        if name in replaced:
            continue
        if path.is_symlink() and not inside(path, allowed):
            where = f"a link that leaves the checkpoint folder (to {path.resolve()})"
            if not skip_unsafe:
                raise MoeconvError(f"{path}: {where}; nothing outside the source is copied: remove it, "
                                   f"or pass --skip-unsafe-files to leave it out")
            found.skipped[name] = where
            continue
        try:
            info = path.stat()
        except OSError as error:
            found.skipped[name] = f"cannot be read ({error.strerror or 'broken link'})"
            continue
        if stat.S_ISDIR(info.st_mode):
            found.skipped[name] = "a folder (only the checkpoint folder's own files are copied)"
        elif not stat.S_ISREG(info.st_mode):
            found.skipped[name] = "not a regular file (a device, FIFO or socket)"
        elif path.suffix == ".safetensors":
            found.skipped[name] = "a safetensors file that is not one of the checkpoint's shards"
        elif path.suffix not in _KINDS and not _DOCUMENTS.match(name):
            found.skipped[name] = f"not a kind of file a model folder holds ({_KIND_WORDS})"
        else:
            found.copied.append(SideFile(name, path.resolve(), info.st_size))
    return found


def _stored_side_files(root: StoredPath, replaced: set[str]) -> SideFiles:
    """side_files of a prefix in an object store: the same kinds copied, the same others skipped."""
    found = SideFiles()
    for name in root.storage.names():
        if name in replaced:
            continue
        if name.endswith(".safetensors"):
            found.skipped[name] = "a safetensors file that is not one of the checkpoint's shards"
        elif Path(name).suffix not in _KINDS and not _DOCUMENTS.match(name):
            found.skipped[name] = f"not a kind of file a model folder holds ({_KIND_WORDS})"
        else:
            found.copied.append(SideFile(name, root / name, root.storage.size(name)))
    return found


def copy_side_file(side: SideFile, folder: Path) -> dict[str, int | str]:
    """Copies `side` into `folder` under a temporary name, flushes it and renames it, so a failed copy
    never survives under the real name; returns its bytes and block digest (writer.combined_digest) as
    read. The resolved path is opened without following a link, so a file swapped for one since it was
    listed is refused rather than followed; a stored object is read by ranges."""
    temporary = folder / f"{side.name}.partial"
    try:
        with _pieces(side) as pieces:
            blocks, digest, in_block, size = [], CURRENT.new(), 0, 0
            target = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            try:
                while data := pieces(size, min(_READ_BYTES, BLOCK_BYTES - in_block)):
                    view = memoryview(data)
                    while view:
                        view = view[os.write(target, view):]
                    digest.update(data)
                    in_block, size = in_block + len(data), size + len(data)
                    if in_block == BLOCK_BYTES:
                        blocks.append(digest.digest())
                        digest, in_block = CURRENT.new(), 0
                if in_block or not blocks:
                    blocks.append(digest.digest())
                os.fsync(target)
            finally:
                os.close(target)
        os.replace(temporary, folder / side.name)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return {"bytes": size, CURRENT.file_key: combined_digest(blocks)}


@contextmanager
def _pieces(side: SideFile) -> Iterator[Callable[[int, int], bytes]]:
    """A reader of `side`'s bytes from an offset, at most a count at a time (empty at its end)."""
    if isinstance(side.path, StoredPath):
        stored = side.path
        yield lambda offset, count: stored.read_range(offset, offset + count)
        return
    try:
        source = os.open(side.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as error:
        raise MoeconvError(f"{side.path}: cannot be copied ({error.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(source).st_mode):
            raise MoeconvError(f"{side.path}: is no longer a regular file")
        yield lambda offset, count: os.read(source, count)
    finally:
        os.close(source)
