"""A checkpoint folder as headers: every tensor's file, dtype, shape and byte range.

We parse safetensors headers ourselves (8-byte little-endian length, then JSON) because
safetensors' Python API does not expose byte offsets, and we need them twice: pass-through tensors
are copied as raw byte ranges, and expert tensors are read with one `pread` each. `safe_open` would
memory-map the shard instead, and every page it touches stays resident until the handle closes, so
resident memory would grow with the shard rather than stay at one expert.
"""

from __future__ import annotations

import gc
import hashlib
import os
import re
import struct
import threading
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from moeconv.checkpoint.schema import (MAX_HEADER_BYTES, MAX_JSON_BYTES, MAX_TENSORS, check_tensor_count, header_entries,
                                       open_regular, parse_header, read_bytes, read_json_object, section, weight_map)
from moeconv.errors import MoeconvError
from moeconv.packing import bf16_as_float32
from moeconv.spec import DTYPE_SIZES
from moeconv.storage import StoredPath

INDEX_NAME = "model.safetensors.index.json"
# safetensors code -> numpy dtype, for the values the parent reads to detect the format (read_array);
# BF16, which numpy lacks, is read as its 16 bits and widened to float32 exactly.
# F8_E4M3 as its bytes (numpy has no float8): the float-coded formats read the scale bytes (float_codes.py)
NUMPY_DTYPES = {"U8": np.uint8, "F8_E4M3": np.uint8, "F8_E8M0": np.uint8, "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64, "F16": np.float16,
                "F32": np.float32, "F64": np.float64, "BOOL": np.bool_, "BF16": np.uint16}


@dataclass(frozen=True, slots=True)  # one per tensor: a 600 GB checkpoint has hundreds of thousands
class TensorEntry:
    name: str
    file: Path | StoredPath  # StoredPath: an object in a store, read by ranges
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in `file`
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class Checkpoint:
    root: Path | StoredPath  # StoredPath: a prefix in an object store (prints as its URL)
    config: dict[str, Any]
    quantization_config: dict[str, Any]
    files: list[Path | StoredPath]
    tensors: dict[str, TensorEntry] = field(repr=False)
    headers_sha256: str = ""  # over every shard's header and the config files: what the plan depends on
    origin: dict[str, Any] = field(default_factory=dict)  # Hub sources: {"repo": ..., "revision": commit}

    @property
    def total_bytes(self) -> int:
        return sum(entry.nbytes for entry in self.tensors.values())

    def identity(self) -> dict[str, Any]:
        """Which source this is, for manifests and for refusing to resume against another one."""
        return {"path": str(self.root.absolute()), **self.origin, "headers_sha256": self.headers_sha256}


# An object's header is read with one range request of this many bytes when it fits (a small model's
# header, a few KB), else with a second request for exactly the rest (a large MoE shard's, up to a few MB):
# at most two round trips per shard, and never more than this beyond the header.
FIRST_READ_BYTES = 64 * 1024


def read_header(path: Path | StoredPath, digest: Any = None) -> tuple[Any, int, int]:
    """The parsed JSON header of a safetensors file (or stored object, read by ranges), the absolute
    offset where its data starts, and the file's size (the raw header bytes are fed to `digest` when
    one is given)."""
    if isinstance(path, StoredPath):
        file_size = path.size()
        first = path.read_range(0, min(file_size, FIRST_READ_BYTES))
        length = _header_length(path, first[:8], file_size)
        raw = first[8:8 + length]
        if len(raw) < length:
            raw += path.read_range(8 + len(raw), 8 + length)
        if len(raw) != length:
            raise MoeconvError(f"{path}: ended early: {len(raw)} of its {length} header bytes read")
    else:
        try:
            fd = open_regular(path)
        except MoeconvError as error:
            if not path.exists() and not path.is_symlink():
                raise MoeconvError(f"{path}: shard is missing") from None
            raise error
        try:
            file_size = os.fstat(fd).st_size
            length = _header_length(path, os.pread(fd, 8, 0), file_size)
            raw = os.pread(fd, length, 8)
        finally:
            os.close(fd)
    if digest is not None:
        digest.update(raw)
    return parse_header(raw, f"{path}: safetensors header"), 8 + length, file_size


def _header_length(path: object, prefix: bytes, file_size: int) -> int:
    """A safetensors file's header length, from its first 8 bytes, checked against the file's size."""
    if len(prefix) != 8:
        raise MoeconvError(f"{path}: not a safetensors file (shorter than 8 bytes)")
    (length,) = struct.unpack("<Q", prefix)
    if length > min(MAX_HEADER_BYTES, file_size - 8):
        raise MoeconvError(f"{path}: not a safetensors file (header length {length} for a {file_size}-byte file)")
    return length


read_json = read_json_object  # the name the rest of the package reads JSON objects by


def _entries(path: Path | StoredPath, digest: Any, room: int = MAX_TENSORS) -> dict[str, TensorEntry]:
    header, data_start, file_size = read_header(path, digest)
    if isinstance(header, dict) and len(header) - ("__metadata__" in header) > room:
        check_tensor_count(MAX_TENSORS - room + len(header) - ("__metadata__" in header), f"{path}: with the shards before it")
    return {name: TensorEntry(name, path, dtype, shape, data_start + begin, data_start + end)
            for name, dtype, shape, begin, end in header_entries(header, path, file_size - data_start)}


# ModelOpt's own description of its export: {"producer": ..., "quantization": {quant_algo, group_size, ...}}.
# Its config.json section names the method and algorithm only; the group size is here.
MODELOPT_CONFIG_NAME = "hf_quant_config.json"
QUANTIZATION_CONFIG_NAMES = ("quant_config.json", "quantize_config.json", MODELOPT_CONFIG_NAME)


def _quantization_config(root: Path | StoredPath, config: dict[str, Any]) -> dict[str, Any]:
    """config.json's quantization_config, completed by quantize_config.json / quant_config.json and
    ModelOpt's hf_quant_config.json (its `quantization` section, as a "modelopt" config)."""
    merged: dict[str, Any] = {}
    for name in ("quant_config.json", "quantize_config.json"):
        if (root / name).is_file():
            merged.update(read_json(root / name))
    if (root / MODELOPT_CONFIG_NAME).is_file():
        where = str(root / MODELOPT_CONFIG_NAME)
        modelopt = read_json(root / MODELOPT_CONFIG_NAME)
        merged.update({"quant_method": "modelopt", **section(modelopt, "quantization", where)})
        if "producer" in modelopt:
            merged["producer"] = modelopt["producer"]
    merged.update(section(config, "quantization_config", str(root / "config.json")))
    return merged


_SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<index>\d+)-of-(?P<total>\d+)\.safetensors$")


def _check_shard_set(root: Path | StoredPath, files: list[Path | StoredPath], index_path: Path | StoredPath) -> None:
    """Sharded names (`model-00002-of-00005.safetensors`) promise a set: every member on disk must be
    in the index, or its tensors would be dropped without a word."""
    sets = {(m["stem"], m["total"]) for m in (_SHARD_NAME.match(path.name) for path in files) if m}
    listed = {path.name for path in files}
    for path in sorted(root.glob("*.safetensors")):
        found = _SHARD_NAME.match(path.name)
        if found and (found["stem"], found["total"]) in sets and path.name not in listed:
            raise MoeconvError(f"{path}: a shard of this checkpoint that {index_path.name} does not list")


def inside(path: Path, boundary: Path) -> bool:
    """Whether `path`, its links resolved, lies in the folder `boundary` (already resolved)."""
    resolved = path.resolve()
    return resolved == boundary or boundary in resolved.parents


def boundary(root: Path) -> Path:
    """What a checkpoint's files may resolve into: its folder, or for a Hub snapshot its repository's
    cache folder (a snapshot's files are links into the repository's blobs)."""
    resolved = Path(root).resolve()
    hub_snapshot = resolved.parent.name == "snapshots" and (resolved.parents[1] / "blobs").is_dir()
    return resolved.parents[1] if hub_snapshot else resolved


@contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cycle collector paused: reading and planning a checkpoint of 200k tensors allocates a
    million small long-lived objects and no cycles, and the collector's passes over them took a third
    of the time (Kimi-K2-sized header set: open 4.5 s -> 3.0 s, plan 6.3 s -> 4.3 s)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def open_checkpoint(root: Path | StoredPath, origin: dict[str, Any] | None = None) -> Checkpoint:
    """Reads config, index and every shard's header. Touches no tensor data. Every shard must resolve
    inside the checkpoint folder (for a Hub snapshot: inside its repository's cache folder, where
    the snapshot's links point). `root` a StoredPath (storage.open_root): the same reads and checks, each
    file's bytes by range requests to the object store."""
    with collection_paused():
        return _open_checkpoint(root, origin)


def _open_checkpoint(root: Path | StoredPath, origin: dict[str, Any] | None) -> Checkpoint:
    stored = isinstance(root, StoredPath)  # in an object store: no links there, every read a range request
    root = root if stored else Path(root)
    if not root.is_dir():
        raise MoeconvError(f"{root}: not a folder")
    allowed = None if stored else boundary(root)
    if stored:
        _refuse_unfinished_output(root)
    config = read_json(root / "config.json")
    index_path = root / INDEX_NAME
    if index_path.exists():
        mapping = weight_map(read_json(index_path), index_path)
        files = sorted(root / name for name in set(mapping.values()))
        _check_shard_set(root, files, index_path)
    else:
        files = sorted(root.glob("*.safetensors"))
        mapping = None
    if not files:
        raise MoeconvError(f"{root}: no *.safetensors files and no {INDEX_NAME}")
    for path in files:
        if allowed is not None and path.exists() and not inside(path, allowed):
            raise MoeconvError(f"{path}: a link that leaves the checkpoint folder (to {path.resolve()})")
    tensors: dict[str, TensorEntry] = {}
    digest = hashlib.sha256()
    for name in ("config.json", *QUANTIZATION_CONFIG_NAMES):
        if (root / name).is_file():
            digest.update(read_bytes(root / name, MAX_JSON_BYTES))
    for path in files:
        digest.update(path.name.encode())
        for name, entry in _entries(path, digest, MAX_TENSORS - len(tensors)).items():
            if name in tensors:
                raise MoeconvError(f"{path}: tensor {name} also appears in {tensors[name].file.name}")
            tensors[name] = entry
    if mapping is not None:
        unlisted = sorted(set(tensors) - set(mapping))
        if unlisted:
            entry = tensors[unlisted[0]]
            raise MoeconvError(f"{entry.file}: tensor {entry.name} is not listed in {INDEX_NAME}"
                               + (f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""))
        for name, file_name in mapping.items():
            if name not in tensors:
                raise MoeconvError(f"{root / file_name}: tensor {name} listed in {INDEX_NAME} is missing")
            if tensors[name].file.name != file_name:
                raise MoeconvError(f"{root / file_name}: tensor {name} is listed there in {INDEX_NAME} but "
                                   f"stored in {tensors[name].file.name}")
    return Checkpoint(root, config, _quantization_config(root, config), files, tensors, digest.hexdigest(),
                      dict(origin or {}))


def _refuse_unfinished_output(root: StoredPath) -> None:
    """A prefix whose shards moeconv wrote but which has no moeconv.json is an output still being uploaded
    (or stopped): convert uploads moeconv.json last (docs/FORMAT.md), so the listing is not an output yet."""
    names = root.storage.names()
    shards = [name for name in names if name.endswith(".safetensors")]
    if "moeconv.json" in names or not shards:
        return
    header, _, _ = read_header(root / shards[0])
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    producer = metadata.get("producer") if isinstance(metadata, dict) else None
    if isinstance(producer, str) and producer.startswith("moeconv "):
        raise MoeconvError(f"{root}: an unfinished moeconv output (its shards are there, not its moeconv.json, "
                           f"which convert uploads last); run the same convert again to finish it")


def file_size(path: Path | StoredPath) -> int:
    """A checkpoint file's size in bytes, local or stored."""
    return path.size() if isinstance(path, StoredPath) else Path(path).stat().st_size


def same_bytes(a: Path | StoredPath, a_begin: int, b: Path | StoredPath, b_begin: int, length: int,
               chunk: int = 16 * 1024**2) -> bool:
    """Whether `length` bytes of file `a` from `a_begin` equal those of `b` from `b_begin` (chunked range reads)."""
    with _ranges(a) as read_a, _ranges(b) as read_b:
        for offset in range(0, length, chunk):
            size = min(chunk, length - offset)
            if read_a(a_begin + offset, size) != read_b(b_begin + offset, size):
                return False
    return True


@contextmanager
def _ranges(path: Path | StoredPath) -> Iterator[Callable[[int, int], bytes]]:
    """A reader of (begin, length) ranges of a local file (one descriptor) or a stored object (range requests)."""
    if isinstance(path, StoredPath):
        yield lambda begin, length: path.read_range(begin, begin + length)
        return
    with open(path, "rb") as handle:
        yield lambda begin, length: os.pread(handle.fileno(), length, begin)


class TensorReader:
    """Reads whole tensors, or a block of one (`read_raw_slice`), with `pread`, keeping one descriptor per file."""

    def __init__(self, fingerprints: dict[str, bytes] | None = None) -> None:
        self._files: dict[Path, int] = {}  # local files; a StoredPath's tensors are read by range requests
        self._opening = threading.Lock()  # readers share descriptors across threads; pread is thread-safe
        # tensor name -> a content hash of its bytes, taken as each whole tensor is read (for resume)
        self.fingerprints = fingerprints
        self._fetched: dict[tuple[str, int, int], bytes] = {}  # `prefetch`ed stored ranges, each taken once

    def prefetch(self, entries: list[TensorEntry],
                 blocks: list[tuple[TensorEntry, int, tuple[int, ...]]] | None = None) -> None:
        """The stored tensors among `entries`, and the stored blocks among `blocks` ((entry, offset, shape) as
        `read_raw_slice` takes them), fetched together (one call an object: concurrent, coalesced range
        requests) for the reads that follow; what an earlier prefetch left unread is dropped. Local files are
        read as they are asked for (nothing is gained by reading them early)."""
        self._fetched.clear()
        by_file: dict[StoredPath, list[tuple[int, int]]] = {}
        for entry in entries:
            if isinstance(entry.file, StoredPath):
                by_file.setdefault(entry.file, []).append((entry.begin, entry.end))
        for entry, offset, shape in blocks or ():
            if isinstance(entry.file, StoredPath):
                begin = entry.begin + offset
                by_file.setdefault(entry.file, []).append((begin, begin + self._block_length(entry, offset, shape)))
        for file, ranges in by_file.items():
            for (begin, end), data in zip(ranges, file.read_ranges(ranges)):
                self._fetched[(str(file), begin, end)] = data

    def _descriptor(self, path: Path) -> int:
        with self._opening:
            if path not in self._files:
                self._files[path] = open_regular(path)
            return self._files[path]

    def _bytes(self, entry: TensorEntry, begin: int, length: int) -> bytearray:
        if isinstance(entry.file, StoredPath):  # prefetched, else one range request
            data = self._fetched.pop((str(entry.file), begin, begin + length), None)
            if data is None:
                data = entry.file.read_range(begin, begin + length)
            if len(data) != length:
                raise MoeconvError(f"{entry.file}: ended early while reading tensor {entry.name}")
            return bytearray(data)
        fd = self._descriptor(entry.file)
        data = bytearray(length)
        view, position = memoryview(data), begin
        while view:
            count = os.preadv(fd, [view], position)
            if count <= 0:
                raise MoeconvError(f"{entry.file}: ended early while reading tensor {entry.name}")
            view, position = view[count:], position + count
        return data

    def read_array(self, entry: TensorEntry) -> np.ndarray:
        """A whole tensor's values as a numpy array: what the parent reads to detect the format (BF16 comes
        back as the float32 values it holds, exactly)."""
        values = self.read_raw(entry)
        return bf16_as_float32(values) if entry.dtype == "BF16" else values

    def read_raw(self, entry: TensorEntry) -> np.ndarray:
        """A whole tensor's stored bytes as a numpy array of its dtype (BF16 as its uint16 bit patterns, which
        numpy has no type for): what the codecs read.

        Each one's fingerprint is taken as it is read, for noticing at resume that a source tensor changed in
        place (same size and time): CRC-32, not a secure hash, because this runs over every source byte a
        conversion reads. CRC-32 is 2.4 GB/s on the dev machine against 1.1 GB/s for SHA-256 (it was a third
        of each expert's time), catches every change of up to 32 bits and any other with probability
        1 - 2^-32; zlib releases the GIL, so threads and workers check in parallel."""
        return self._fingerprinted(self._read_raw(entry, entry.begin, entry.nbytes, entry.shape), entry.name)

    def _fingerprinted(self, array: np.ndarray, name: str | None) -> np.ndarray:
        if self.fingerprints is not None and name is not None:
            self.fingerprints[name] = zlib.crc32(array.data).to_bytes(4, "little")
        return array

    def _read_raw(self, entry: TensorEntry, begin: int, length: int, shape: tuple[int, ...]) -> np.ndarray:
        if entry.dtype not in NUMPY_DTYPES:
            raise MoeconvError(f"{entry.file}: tensor {entry.name} is {entry.dtype}, which numpy does not read")
        return np.frombuffer(self._bytes(entry, begin, length), dtype=NUMPY_DTYPES[entry.dtype]).reshape(shape)

    def read_raw_slice(self, entry: TensorEntry, offset: int, shape: tuple[int, ...],
                       fingerprint_as: str | None = None) -> np.ndarray:
        """The `shape`-shaped block of `entry`'s dtype that starts `offset` bytes into its data, as `read_raw`
        gives a tensor; fingerprinted as `read_raw`'s tensors are, under `fingerprint_as`, where given."""
        return self._fingerprinted(
            self._read_raw(entry, entry.begin + offset, self._block_length(entry, offset, shape), shape), fingerprint_as)

    @staticmethod
    def _block_length(entry: TensorEntry, offset: int, shape: tuple[int, ...]) -> int:
        length = DTYPE_SIZES[entry.dtype] * prod(shape)
        if offset < 0 or offset + length > entry.nbytes:
            raise MoeconvError(f"{entry.file}: tensor {entry.name} has no {list(shape)} block at byte {offset}")
        return length

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
