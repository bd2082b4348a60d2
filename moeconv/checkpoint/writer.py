"""A streaming safetensors writer.

Written by hand because no library does this: `safetensors` serialises a dict of complete tensors,
but we know every output tensor's shape before any byte exists (from the plan), so the header is
written first and tensor bytes arrive later, piece by piece, at their offsets (one expert's slice
of a stacked tensor at a time, or a raw byte range copied from a source shard). No tensor, layer or
shard is ever held in memory.

The data is written in the host's byte order, which safetensors requires to be little-endian; a
big-endian host is refused rather than silently writing the wrong bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import sys
import threading
from math import prod
from pathlib import Path
from typing import Sequence

import torch

from moeconv.errors import MoeconvError
from moeconv.spec import DTYPE_SIZES, TensorSpec

_ALIGNMENT = 8
_COPY_CHUNK = 64 * 1024 * 1024


def _require_little_endian() -> None:
    if sys.byteorder != "little":
        raise MoeconvError("moeconv writes safetensors (little-endian) and refuses to run on a big-endian host")


class ShardWriter:
    """Declare every tensor up front, then fill their bytes in any order, from any thread; `close`
    checks nothing is missing. Use it as a context manager: leaving with an exception closes without
    that check."""

    def __init__(self, path: Path, tensors: Sequence[TensorSpec], metadata: dict[str, str]):
        _require_little_endian()
        self.path = Path(path)
        self._layout: dict[str, tuple[int, int]] = {}
        header: dict[str, object] = {"__metadata__": metadata}
        offset = 0
        for name, shape, dtype, *_ in tensors:
            if name in self._layout:
                raise ValueError(f"tensor {name} declared twice")
            nbytes = DTYPE_SIZES[dtype] * prod(shape)
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._layout[name] = (offset, nbytes)
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-(8 + len(encoded)) % _ALIGNMENT)
        self._data_start = 8 + len(encoded)
        self.size = self._data_start + offset
        self._written = dict.fromkeys(self._layout, 0)
        self._counting = threading.Lock()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self._fd, len(encoded).to_bytes(8, "little") + encoded, 0)
        os.ftruncate(self._fd, self.size)

    def start_of(self, name: str) -> int:
        """The file offset of tensor `name`'s first byte."""
        return self._data_start + self._layout[name][0]

    def claim(self, name: str, offset: int, length: int) -> int:
        """Counts `length` bytes at `offset` inside tensor `name` as written and returns their file
        position: for writers in other processes, which write there through their own descriptor."""
        start, nbytes = self._layout[name]
        if offset < 0 or offset + length > nbytes:
            raise ValueError(f"write of {length} bytes at {offset} overflows tensor {name} ({nbytes} bytes)")
        with self._counting:  # claims come from several threads; pwrite itself needs no lock
            self._written[name] += length
        return self._data_start + start + offset

    def write(self, name: str, tensor: torch.Tensor, offset: int = 0) -> None:
        """Write `tensor`'s bytes at byte `offset` inside tensor `name`."""
        write_at(self._fd, tensor, self.claim(name, offset, tensor.numel() * tensor.element_size()))

    def copy_range(self, name: str, source: Path, begin: int, end: int) -> None:
        """Copy bytes [begin, end) of `source` as the whole of tensor `name`, in the kernel where possible."""
        copy_into(self._fd, self.claim(name, 0, end - begin), source, begin, end, name)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.close()
        else:
            os.close(self._fd)  # the caller's error wins; the partial file is the caller's to remove

    def close(self) -> None:
        """Fails if any declared byte was not written; the file is flushed to disk."""
        missing = [name for name, nbytes in self._layout.items() if self._written[name] != nbytes[1]]
        try:
            if missing:
                raise ValueError(f"{self.path}: tensors not fully written: {missing[:3]}")
            os.fsync(self._fd)
        finally:
            os.close(self._fd)


def write_at(fd: int, tensor: torch.Tensor, position: int) -> None:
    """All of `tensor`'s bytes at file `position` of `fd`."""
    view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    while view:
        written = os.pwrite(fd, view, position)
        view, position = view[written:], position + written


def copy_into(fd: int, position: int, source: Path, begin: int, end: int, name: str) -> None:
    """Bytes [begin, end) of `source` at file `position` of `fd`, in the kernel where possible."""
    with open(source, "rb") as handle:
        src = handle.fileno()
        while begin < end:
            chunk = min(_COPY_CHUNK, end - begin)
            try:
                copied = os.copy_file_range(src, fd, chunk, begin, position)
            except OSError:
                copied = os.pwrite(fd, os.pread(src, chunk, begin), position)
            if copied <= 0:
                raise MoeconvError(f"{source}: ended early while copying tensor {name}")
            begin, position = begin + copied, position + copied


class PrefixHasher:
    """sha256 of a file that is written front to back in pieces: `advance(n)` says the first n bytes
    are final, and a background thread hashes them while the writer goes on (hashlib releases the
    GIL), so hashing overlaps the conversion instead of re-reading the whole file at the end."""

    def __init__(self, path: Path, chunk: int = 16 * 1024 * 1024):
        self._fd = os.open(path, os.O_RDONLY)
        self._chunk = chunk
        self._digest = hashlib.sha256()
        self._hashed = 0
        self._pending: queue.Queue[int | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while (upto := self._pending.get()) is not None:
                while self._hashed < upto:
                    block = os.pread(self._fd, min(self._chunk, upto - self._hashed), self._hashed)
                    if not block:
                        raise OSError(f"file ended at {self._hashed} while hashing up to {upto}")
                    self._digest.update(block)
                    self._hashed += len(block)
        except BaseException as error:  # reported by finish()
            self._error = error

    def advance(self, upto: int) -> None:
        self._pending.put(upto)

    def finish(self, size: int) -> str:
        """The digest of the first `size` bytes (the whole file)."""
        self._pending.put(size)
        self.cancel()
        if self._error is not None:
            raise self._error
        return self._digest.hexdigest()

    def cancel(self) -> None:
        """Stop after what was already asked for; the writer failed, the digest is not needed."""
        self._pending.put(None)
        self._thread.join()
        os.close(self._fd)


def sha256_file(path: Path, chunk: int = 16 * 1024 * 1024) -> str:
    """Streamed, never the whole file in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()
