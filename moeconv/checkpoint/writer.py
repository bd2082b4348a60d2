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

import functools
import hashlib
import json
import os
import sys
import threading
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np

from moeconv.errors import MoeconvError
from moeconv.spec import DTYPE_SIZES, TensorSpec
from moeconv.storage import StoredPath

if TYPE_CHECKING:
    from concurrent.futures import Future

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
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        os.pwrite(self._fd, len(encoded).to_bytes(8, "little") + encoded, 0)
        os.ftruncate(self._fd, self.size)

    @property
    def data_start(self) -> int:
        """Where the first tensor's data starts (after the 8-byte length, the header and its padding)."""
        return self._data_start

    def tensor_ranges(self) -> list[tuple[str, int, int]]:
        """Each tensor's name and byte range [begin, end) in the file, in file order."""
        return [(name, self._data_start + start, self._data_start + start + nbytes)
                for name, (start, nbytes) in self._layout.items()]

    def claim(self, name: str, offset: int, length: int) -> int:
        """Counts `length` bytes at `offset` inside tensor `name` as written and returns their file
        position: for writers in other processes, which write there through their own descriptor."""
        start, nbytes = self._layout[name]
        if offset < 0 or offset + length > nbytes:
            raise ValueError(f"write of {length} bytes at {offset} overflows tensor {name} ({nbytes} bytes)")
        with self._counting:  # claims come from several threads; pwrite itself needs no lock
            self._written[name] += length
        return self._data_start + start + offset

    def write(self, name: str, data: np.ndarray, offset: int = 0) -> None:
        """Write the bytes of `data` (a stored array: BF16 as its uint16 bit patterns) at byte `offset` inside
        tensor `name`."""
        write_at(self._fd, data, self.claim(name, offset, data.nbytes))

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()  # the caller's error wins

    def abort(self) -> None:
        """Close without the completeness check or the flush; the partial file is the caller's to remove."""
        os.close(self._fd)

    def close(self) -> None:
        """Fails if any declared byte was not written; the file is flushed to disk."""
        missing = [name for name, nbytes in self._layout.items() if self._written[name] != nbytes[1]]
        try:
            if missing:
                raise ValueError(f"{self.path}: tensors not fully written: {missing[:3]}")
            os.fsync(self._fd)
        finally:
            os.close(self._fd)


def write_at(fd: int, data: np.ndarray, position: int) -> None:
    """All of the bytes of `data` (a stored array) at file `position` of `fd`."""
    view = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    while view:
        written = os.pwrite(fd, view, position)
        view, position = view[written:], position + written


def copy_into(fd: int, position: int, source: Path | StoredPath, begin: int, end: int, name: str) -> None:
    """Bytes [begin, end) of `source` at file `position` of `fd`, in the kernel where possible (a stored
    object: by range requests of at most `_COPY_CHUNK` bytes, so memory stays bounded)."""
    if isinstance(source, StoredPath):
        while begin < end:
            data = source.read_range(begin, min(end, begin + _COPY_CHUNK))
            if not data:
                raise MoeconvError(f"{source}: ended early while copying tensor {name}")
            write_at(fd, np.frombuffer(data, dtype=np.uint8), position)
            begin, position = begin + len(data), position + len(data)
        return
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


BLOCK_BYTES = 64 * 1024 * 1024  # the unit of a block digest (docs/FORMAT.md, moeconv.json)
TENSOR_DIGESTS_KEY = "tensor_digests"  # a shard's tensors' digests (the block digest of each tensor's bytes)
_READ_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class DigestScheme:
    """The hash a manifest's block digests are made of, and the keys it records them under (docs/FORMAT.md).
    Every digest of one manifest uses one scheme, chosen by its `manifest_version`: BLAKE3 from version 4
    (collision-resistant like sha256, which an output's integrity needs against a crafted file, and several
    times faster a core: docs/BENCHMARKS.md), SHA256 for version 3, which still verifies."""

    name: str
    file_key: str  # a non-shard file's digest (index, configs, side files, source shards)
    shard_key: str  # an output shard's digest, made of its tensors' (shard_digest)

    def new(self):
        """A fresh hasher (`update`, `digest`); both libraries release the GIL while they hash. blake3 is
        imported here: the engine plugins import this module, and an engine's environment may not hold
        blake3, which only hashing needs (docs/SERVING.md)."""
        if self.name != "blake3":
            return hashlib.sha256()
        try:
            from blake3 import blake3
        except ImportError:
            raise MoeconvError("moeconv.json's version-4 digests need the blake3 package, which this Python "
                               "environment lacks: pip install blake3 (it needs nothing else)") from None
        return blake3()

    def of(self, data) -> bytes:
        hasher = self.new()
        hasher.update(data)
        return hasher.digest()


SHA256 = DigestScheme("sha256", "sha256_64mib_blocks", "sha256_header_and_tensors")
BLAKE3 = DigestScheme("blake3", "blake3_64mib_blocks", "blake3_header_and_tensors")
CURRENT = BLAKE3  # what a conversion writes


def _read_into(fd: int, view: memoryview, offset: int) -> None:
    """Fills `view` with the bytes of `fd` from `offset` on (OSError where the file ends first)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if not got:
            raise OSError(f"file ended at {offset + done} while reading up to {offset + len(view)}")
        done += got


def _hash_block(fd: int, start: int, end: int, buffer: bytearray, scheme: DigestScheme) -> bytes:
    """The digest of bytes [start, end) of `fd`, read through `buffer` (a thread's own: no allocation per read)."""
    digest = scheme.new()
    while start < end:
        piece = memoryview(buffer)[:min(len(buffer), end - start)]
        _read_into(fd, piece, start)
        digest.update(piece)
        start += len(piece)
    return digest.digest()


def combined_digest(block_digests: Sequence[bytes], scheme: DigestScheme = CURRENT) -> str:
    """A block digest: the hash of the BLOCK_BYTES blocks' digests, concatenated in order. Not the hash
    of the bytes, because one hash stream is one core: blocks are hashed on every core, so hashing
    keeps up with a conversion on many cores."""
    return scheme.of(b"".join(block_digests)).hex()


def shard_digest(header_digest: bytes, tensor_digests: Sequence[str], scheme: DigestScheme = CURRENT) -> str:
    """An output shard's digest (the scheme's `shard_key`, docs/FORMAT.md): the hash of the hash of the bytes
    before the first tensor's data (the 8-byte length, the header JSON and its padding) followed by each
    tensor's digest (hex, as recorded) as 32 bytes, in file-offset order. The tensors tile the rest of the
    file (`tiling`), so every byte is covered, and each byte is hashed once: for its tensor."""
    return scheme.of(header_digest + b"".join(bytes.fromhex(digest) for digest in tensor_digests)).hex()


def tiling(ranges: Sequence[tuple[str, int, int]], data_start: int, size: int) -> list[tuple[str, int, int]]:
    """`ranges` ((name, begin, end), absolute) in file-offset order, checked to cover [data_start, size)
    exactly: no gap, no overlap, nothing after the last tensor (else ValueError naming the place)."""
    ordered = sorted(ranges, key=lambda item: (item[1], item[2]))
    position = data_start
    for name, begin, end in ordered:
        if begin != position or end < begin:
            raise ValueError(f"tensor {name} starts at byte {begin}, not at {position} where the previous data "
                             f"ends (a gap or an overlap)")
        position = end
    if position != size:
        raise ValueError(f"{size - position} bytes after the last tensor's data (at {position}), covered by no tensor")
    return ordered


def _size(path: Path | StoredPath) -> int:
    return path.size() if isinstance(path, StoredPath) else Path(path).stat().st_size


def _reader(path: Path | StoredPath):
    """(begin, length) -> bytes of a local file or a stored object (fewer where it ends first)."""
    if isinstance(path, StoredPath):
        return lambda begin, length: path.read_range(begin, begin + length)

    def read(begin: int, length: int) -> bytes:
        with open(path, "rb") as handle:
            return os.pread(handle.fileno(), length, begin)
    return read


def header_ranges(path: Path | StoredPath) -> tuple[int, list[tuple[str, int, int]]]:
    """A safetensors file's data start and its tensors' absolute byte ranges, from its header (ValueError
    when the header cannot be read)."""
    read = _reader(path)
    prefix = read(0, 8)
    if len(prefix) != 8:
        raise ValueError("shorter than a safetensors header")
    length = int.from_bytes(prefix, "little")
    if length > min(_size(path) - 8, 100 << 20):
        raise ValueError(f"header length {length} exceeds the file")
    header = json.loads(read(8, length))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    data_start, ranges = 8 + length, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
            raise ValueError(f"tensor {name}: no valid data_offsets")
        ranges.append((name, data_start + offsets[0], data_start + offsets[1]))
    return data_start, ranges


INLINE_BYTES = 64 << 10


class _Hashed(NamedTuple):
    """A digest already taken, read like the futures of the pool's."""

    digest: bytes

    def result(self) -> bytes:
        return self.digest


HASHING_SWITCH_SECONDS = 1e-4
_switch_lock = threading.Lock()
_switch = {"pools": 0, "default": sys.getswitchinterval()}


def _hash_pool_opened() -> None:
    """While any hash pool lives, the interpreter asks a thread running Python to hand the GIL over
    after HASHING_SWITCH_SECONDS instead of its default 5 ms. A hash thread releases the GIL for every
    preadv and hash call and must get it back after each: beside a busy Python thread (convert's and
    verify's main threads take the workers' results) each return waited up to the whole interval, and
    a per-linear layout has four tensors per linear, thousands of returns a layer (docs/BENCHMARKS.md).
    The default comes back when the last pool closes."""
    with _switch_lock:
        if _switch["pools"] == 0:
            _switch["default"] = sys.getswitchinterval()
            sys.setswitchinterval(min(_switch["default"], HASHING_SWITCH_SECONDS))
        _switch["pools"] += 1


def _hash_pool_closed() -> None:
    with _switch_lock:
        _switch["pools"] -= 1
        if _switch["pools"] == 0:
            sys.setswitchinterval(_switch["default"])


class _Hashers:
    """Threads that hash blocks (the hash libraries and preadv release the GIL), each with its own read buffer."""

    def __init__(self, threads: int, scheme: DigestScheme = CURRENT):
        from concurrent.futures import ThreadPoolExecutor

        self.scheme = scheme
        self._local = threading.local()
        self.pool: ThreadPoolExecutor | None = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="moeconv-hash")
        _hash_pool_opened()
        self._pending: list = []  # [fd, start, end]: inline pieces' bytes not yet handed to writeback

    def submit(self, fd: int, start: int, end: int, writeback: bool):
        """A future of the digest of bytes [start, end). A range of at most INLINE_BYTES is hashed here
        and now (the caller's thread), and its writeback joins the adjacent inline pieces' in one call:
        a per-linear layout has four tensors per linear, three of them small and lying next to the
        other experts' of their kind, and a pool task or a writeback call each costs more than hashing
        them."""
        if end - start > INLINE_BYTES:
            return self.pool.submit(self._run, fd, start, end, writeback)
        digest = self._run(fd, start, end, writeback=False)
        if writeback and end > start:
            if self._pending and self._pending[0] == fd and self._pending[2] == start:
                self._pending[2] = end
            else:
                self.flush()
                self._pending = [fd, start, end]
        return _Hashed(digest)

    def flush(self) -> None:
        """Hands the inline pieces' pending bytes to writeback."""
        if self._pending:
            fd, start, end = self._pending
            self._pending = []
            start_writeback(fd, start, end - start)

    def submit_group(self, fd: int, members: Sequence[tuple[int, int]], writeback: bool):
        """A future of the digest of each of `members` ((begin, end), in file order, spanning at most
        _READ_BYTES), read in one pass and hashed on one pool thread: a per-linear layout has a thousand
        tensors a layer, and a task (or an inline hash) for each kept the digests on one thread's Python,
        convert's and verify's (docs/BENCHMARKS.md)."""
        return self.pool.submit(self._hash_group, fd, members, writeback)

    def _hash_group(self, fd: int, members: Sequence[tuple[int, int]], writeback: bool) -> list[bytes]:
        start, end = members[0][0], max(member_end for _, member_end in members)
        view = memoryview(self._buffer())[:end - start]
        _read_into(fd, view, start)
        digests = [self.scheme.of(view[begin - start:member_end - start]) for begin, member_end in members]
        if writeback and end > start:
            start_writeback(fd, start, end - start)
        return digests

    def _buffer(self) -> bytearray:
        buffer = getattr(self._local, "buffer", None)
        if buffer is None:
            buffer = self._local.buffer = bytearray(_READ_BYTES)
        return buffer

    def _run(self, fd: int, start: int, end: int, writeback: bool) -> bytes:
        digest = _hash_block(fd, start, end, self._buffer(), self.scheme)
        if writeback and end > start:
            start_writeback(fd, start, end - start)
        return digest

    def close(self) -> None:
        self._pending = []  # the shard is finished (its fsync writes everything) or dropped
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
            _hash_pool_closed()


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def hash_threads() -> int:
    return max(1, min(8, usable_cores()))


class _Stream:
    """One digest over the byte range [begin, end) of a file, cut into `block`-byte pieces counted from
    `begin` (a file: from 0; a tensor: from its first byte), each piece hashed as soon as it is final."""

    def __init__(self, begin: int, end: int, block: int):
        self.begin, self.end, self.block = begin, end, block
        self.submitted = begin
        self.pieces: list = []  # futures, in order

    def advance(self, hashers: _Hashers, fd: int, upto: int, writeback: bool) -> None:
        while self.submitted + self.block <= min(upto, self.end):
            self._submit(hashers, fd, self.submitted + self.block, writeback)

    def finish(self, hashers: _Hashers, fd: int, writeback: bool) -> None:
        self.advance(hashers, fd, self.end, writeback)
        if self.submitted < self.end or not self.pieces:  # the short last piece; an empty range is one empty piece
            self._submit(hashers, fd, self.end, writeback)

    def _submit(self, hashers: _Hashers, fd: int, end: int, writeback: bool) -> None:
        self.pieces.append(hashers.submit(fd, self.submitted, end, writeback))
        self.submitted = end

    def digest(self, scheme: DigestScheme) -> str:
        return combined_digest([piece.result() for piece in self.pieces], scheme)


class _GroupPiece(NamedTuple):
    """One member's digest of a group task (`_Hashers.submit_group`), read like the pool's futures."""

    group: Future
    index: int

    def result(self) -> bytes:
        return self.group.result()[self.index]


def _finish_streams(hashers: _Hashers, fd: int, streams: Sequence[_Stream], writeback: bool) -> None:
    """Finishes each of `streams` (in file order, their bytes all final). Runs of streams not yet begun that
    are one piece each and lie within one read are hashed together, a task a run."""
    group: list[_Stream] = []

    def hash_group() -> None:
        if group:
            task = hashers.submit_group(fd, [(stream.begin, stream.end) for stream in group], writeback)
            for index, stream in enumerate(group):
                stream.pieces.append(_GroupPiece(task, index))
                stream.submitted = stream.end
            group.clear()

    for stream in streams:
        if stream.pieces or stream.end - stream.begin > min(stream.block, _READ_BYTES):
            hash_group()
            stream.finish(hashers, fd, writeback)
            continue
        if group and stream.end - group[0].begin > _READ_BYTES:
            hash_group()
        group.append(stream)
    hash_group()


class BlockHasher:
    """The digest of an output shard that is written in pieces (`shard_digest`), and each of its tensors'
    (the block digest of the tensor's bytes, pieces counted from its first byte): `advance(n)` says the
    first n bytes are final, and each whole piece of a tensor below n, and each tensor wholly below n, is
    hashed on a pool of threads while the writer goes on, then handed to the kernel to start writing back
    to disk (the final fsync then waits for little). Hashing thus overlaps the conversion and scales with
    cores instead of re-reading the file at the end in one stream; each byte is hashed once (the file's
    digest is made of its tensors'). `tensors`: (name, begin, end), which must tile [data_start, end of
    file); the bytes before `data_start` (length, header, padding) are hashed at `finish`."""

    def __init__(self, path: Path, data_start: int, tensors: Sequence[tuple[str, int, int]],
                 threads: int | None = None, block: int = BLOCK_BYTES, scheme: DigestScheme = CURRENT):
        self._fd = os.open(path, os.O_RDONLY)
        self._scheme = scheme
        self._hashers = _Hashers(threads or hash_threads(), scheme)
        self._data_start = data_start
        self._header = _Stream(0, data_start, 1 << 62)
        self._tensors = [(name, _Stream(begin, end, block))
                         for name, begin, end in sorted(tensors, key=lambda item: (item[1], item[2]))]
        self._next = 0  # the first tensor not yet wholly final

    def advance(self, upto: int) -> None:
        index, final = self._next, []
        while index < len(self._tensors) and self._tensors[index][1].begin < upto:
            stream = self._tensors[index][1]
            if stream.end <= upto:
                final.append(stream)
                if index == self._next:
                    self._next += 1
            else:
                stream.advance(self._hashers, self._fd, upto, writeback=True)
            index += 1
        _finish_streams(self._hashers, self._fd, final, writeback=True)

    def finish(self, size: int) -> tuple[str, dict[str, str]]:
        """The shard's digest (its `size` bytes: the whole file), and each tensor's digest by name."""
        try:
            tiling([(name, stream.begin, stream.end) for name, stream in self._tensors], self._data_start, size)
            self.advance(size)
            self._header.finish(self._hashers, self._fd, writeback=True)
            for _, stream in self._tensors:
                stream.finish(self._hashers, self._fd, writeback=True)
            self._hashers.flush()
            tensors = {name: stream.digest(self._scheme) for name, stream in self._tensors}
            header = self._header.pieces[0].result()
            return shard_digest(header, [tensors[name] for name, _ in self._tensors], self._scheme), tensors
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Stop hashing (the writer failed, or the digest is taken)."""
        self._hashers.close()
        os.close(self._fd)


def start_writeback(fd: int, start: int, length: int) -> None:
    """Asks the kernel to start writing these final pages to disk now (Linux sync_file_range, no
    wait): without it every dirty page waits for the fsync at the end of the shard. A no-op elsewhere."""
    function = _sync_file_range()
    if function is not None:
        function(fd, start, length, 2)  # SYNC_FILE_RANGE_WRITE


@functools.lru_cache(maxsize=1)
def _sync_file_range():
    import ctypes

    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return function


def file_digest(path: Path | StoredPath, threads: int | None = None, block: int = BLOCK_BYTES,
                scheme: DigestScheme = CURRENT) -> str:
    """The block digest (`combined_digest`) of a finished file that is not an output shard, its blocks
    hashed in parallel, never the whole file in memory (a stored object: each block read in 8 MiB range
    requests, up to 4 blocks at a time)."""
    if isinstance(path, StoredPath):
        from concurrent.futures import ThreadPoolExecutor

        def hashed(start: int) -> bytes:
            try:
                return _stored_block(path, start, min(size, start + block), scheme)
            except ValueError:
                raise MoeconvError(f"{path}: ended early while hashing it") from None

        size = path.size()
        with ThreadPoolExecutor(max(1, min(threads or hash_threads(), 4))) as pool:
            return combined_digest(list(pool.map(hashed, range(0, size, block) if size else [0])), scheme)
    return range_digests(path, {"": (0, Path(path).stat().st_size)}, threads, block, scheme)[""]


def range_digests(path: Path, ranges: dict[str, tuple[int, int]], threads: int | None = None,
                  block: int = BLOCK_BYTES, scheme: DigestScheme = CURRENT) -> dict[str, str]:
    """`combined_digest` of each byte range [begin, end) of a finished file, its blocks counted from the
    range's first byte (a tensor's digest: `tensor_digest`), all hashed in parallel, never in memory whole."""
    if isinstance(path, StoredPath):
        return _stored_range_digests(path, ranges, threads, block, scheme)
    fd = os.open(path, os.O_RDONLY)
    hashers = _Hashers(threads or hash_threads(), scheme)
    try:
        streams = {name: _Stream(begin, end, block) for name, (begin, end) in ranges.items()}
        _finish_streams(hashers, fd, sorted(streams.values(), key=lambda stream: (stream.begin, stream.end)),
                        writeback=False)
        return {name: stream.digest(scheme) for name, stream in streams.items()}
    finally:
        hashers.close()
        os.close(fd)


def _stored_block(path: StoredPath, begin: int, end: int, scheme: DigestScheme) -> bytes:
    """The digest of bytes [begin, end) of a stored object, read `_READ_BYTES` a request (so a thread holds
    one such piece, not a whole block); ValueError where the object ends first."""
    digest = scheme.new()
    for start in range(begin, end, _READ_BYTES):
        data = path.read_range(start, min(end, start + _READ_BYTES))
        if len(data) != min(end, start + _READ_BYTES) - start:
            raise ValueError(f"{path}: ended early at {start + len(data)}")
        digest.update(data)
    return digest.digest()


def _stored_range_digests(path: StoredPath, ranges: dict[str, tuple[int, int]], threads: int | None,
                          block: int, scheme: DigestScheme) -> dict[str, str]:
    """range_digests of a stored object: each range's blocks read in 8 MiB requests (`_stored_block`; a small
    range is one request of its own), up to 4 blocks at a time, never the object in memory whole."""
    from concurrent.futures import ThreadPoolExecutor

    def hashed(piece: tuple[int, int]) -> bytes:
        return _stored_block(path, *piece, scheme)

    pieces = {name: [(start, min(end, start + block)) for start in range(begin, end, block)] or [(begin, begin)]
              for name, (begin, end) in ranges.items()}
    with ThreadPoolExecutor(max(1, min(threads or hash_threads(), 4))) as pool:
        return {name: combined_digest(list(pool.map(hashed, parts)), scheme) for name, parts in pieces.items()}


def shard_file_digests(path: Path, threads: int | None = None, block: int = BLOCK_BYTES,
                       scheme: DigestScheme = CURRENT) -> tuple[str, dict[str, str]]:
    """A finished shard's digest (`shard_digest`) and its tensors' digests, each byte read and hashed once;
    ValueError when its header cannot be read or its tensors do not tile its data (a gap, an overlap,
    bytes after the last tensor: the shard digest would not cover them)."""
    data_start, ranges = header_ranges(path)
    ordered = tiling(ranges, data_start, _size(path))
    tensors = range_digests(path, {name: (begin, end) for name, begin, end in ordered}, threads, block, scheme)
    header = scheme.of(_reader(path)(0, data_start))
    return shard_digest(header, [tensors[name] for name, _, _ in ordered], scheme), tensors


def tensor_digest(data: memoryview | bytes, threads: int | None = None, block: int = BLOCK_BYTES,
                  scheme: DigestScheme = CURRENT) -> str:
    """The digest a manifest records for a tensor (its `tensor_digests`): `combined_digest` of its bytes
    cut into `block`-byte pieces from its first byte, here of bytes already in memory (or memory-mapped),
    hashed on up to `threads` threads (the hash libraries release the GIL)."""
    view = memoryview(data).cast("B")
    starts = range(0, len(view), block) if len(view) else [0]
    pieces = [view[start:start + block] for start in starts]
    if len(pieces) == 1:
        return combined_digest([scheme.of(pieces[0])], scheme)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(len(pieces), threads or hash_threads()), thread_name_prefix="moeconv-hash") as pool:
        return combined_digest(list(pool.map(scheme.of, pieces)), scheme)
