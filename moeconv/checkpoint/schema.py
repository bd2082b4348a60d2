"""The boundary: every byte moeconv reads from a checkpoint's JSON (configs, index, safetensors headers)
is parsed and validated here, so the code above never sees an unvalidated value.

Hand-written because the rules are few and specific (the safetensors spec's dtype list and offset
arithmetic, plain file names in an index), and because every violation must become one line that
names the file and the tensor, which generic schema libraries do not word that way.
"""

from __future__ import annotations

import json
import os
import re
import stat
from operator import itemgetter
from pathlib import Path
from typing import Any

from moeconv.errors import MoeconvError
from moeconv.spec import DTYPE_SIZES
from moeconv.storage import StoredPath

MAX_JSON_BYTES = 64 * 1024**2  # configs and indexes; Kimi-K2's index is about 20 MB
MAX_HEADER_BYTES = 100 * 1024**2
# Planning costs memory per tensor (measured in docs/BENCHMARKS.md, "Many listed tensors"), so a
# checkpoint may list at most this many: planning then stays under about 1.35 GB,
# with room above the largest MoE checkpoints in GPTQ with g_idx (Kimi-K2: 61 layers x 384 experts x 3
# linears x 4 tensors, about 285k; 60 layers of 512 experts, about 370k).
MAX_TENSORS = 600_000


def check_tensor_count(count: int, where: str) -> None:
    """Refuses, before anything is built per tensor, a checkpoint that lists more than MAX_TENSORS."""
    if count > MAX_TENSORS:
        raise MoeconvError(f"{where}: lists {count} tensors, more than the {MAX_TENSORS} moeconv plans "
                           f"(more than any known checkpoint has)")


def open_regular(path: Path) -> int:
    """A read-only descriptor of `path`, which must be a regular file: a FIFO or a device must not
    hang or stream forever (O_NONBLOCK keeps the open itself from waiting for a writer)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise MoeconvError(f"{path}: file is missing") from None
    except IsADirectoryError:
        raise MoeconvError(f"{path}: is a folder, not a file") from None
    except PermissionError:
        raise MoeconvError(f"{path}: permission denied") from None
    except OSError as error:
        raise MoeconvError(f"{path}: cannot be opened ({error.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise MoeconvError(f"{path}: not a regular file")
    return fd


def read_bytes(path: Path | StoredPath, limit: int) -> bytes:
    """A whole regular file (or stored object) of at most `limit` bytes."""
    if isinstance(path, StoredPath):
        size = _within(path, path.size(), limit)
        data = path.read_range(0, size)
        if len(data) != size:
            raise MoeconvError(f"{path}: ended early: {len(data)} of its {size} bytes read")
        return data
    fd = open_regular(path)
    try:
        return os.pread(fd, _within(path, os.fstat(fd).st_size, limit), 0)
    finally:
        os.close(fd)


def _within(path: object, size: int, limit: int) -> int:
    if size > limit:
        raise MoeconvError(f"{path}: {size} bytes is more than the {limit} a JSON file here may have")
    return size


def parse_json(raw: bytes, where: str) -> Any:
    """Strict JSON: UTF-8, no duplicate keys, no NaN, bounded nesting; one-line errors."""
    return _parse(raw, where, strict_keys=True)


# The keys of a safetensors header entry. Inside a JSON string a quote is escaped, so `"dtype":` in the
# raw text is always a key: counting them counts every occurrence of the key, duplicates included.
_ENTRY_KEYS = [re.compile(rf'"{key}"\s*:') for key in ("dtype", "shape", "data_offsets")]


def parse_header(raw: bytes, where: str) -> Any:
    """`parse_json` for a safetensors header, at the C parser's speed when that is provably the same
    reading: when every entry key occurs in the raw text exactly once per tensor and no
    `__metadata__` key occurs twice, the text has no duplicate keys (a duplicate tensor name would
    add a second set of entry keys). Anything else is parsed strictly, to name the duplicate."""
    data = _parse(raw, where, strict_keys=False)
    if isinstance(data, dict):
        text = raw.decode("utf-8")
        metadata = data.get("__metadata__")
        tensors = len(data) - ("__metadata__" in data)
        counts_fit = all(len(pattern.findall(text)) == tensors for pattern in _ENTRY_KEYS)
        if counts_fit and (not isinstance(metadata, dict) or all(
                text.count(json.dumps(key) + ":") + text.count(json.dumps(key) + " :") == 1 for key in metadata)):
            return data
    return parse_json(raw, where)


def _parse(raw: bytes, where: str, strict_keys: bool) -> Any:
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in items:
            if key in result and result[key] != value:
                raise MoeconvError(f"{where}: key {key!r} appears twice with different values")
            result[key] = value
        return result

    def constant(name: str) -> Any:
        raise MoeconvError(f"{where}: {name} is not JSON")

    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=pairs if strict_keys else None,
                          parse_constant=constant)
    except UnicodeDecodeError:
        raise MoeconvError(f"{where}: not valid UTF-8") from None
    except RecursionError:
        raise MoeconvError(f"{where}: nested too deeply") from None
    except ValueError as error:  # JSONDecodeError, and integers too long to convert
        raise MoeconvError(f"{where}: not valid JSON ({str(error).splitlines()[0][:120]})") from None


def read_json_object(path: Path | StoredPath) -> dict[str, Any]:
    """A JSON file whose top level must be an object."""
    data = parse_json(read_bytes(path, MAX_JSON_BYTES), str(path))
    if not isinstance(data, dict):
        raise MoeconvError(f"{path}: expected a JSON object at the top level, found {type(data).__name__}")
    return data


def section(data: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    """An optional object-valued key: {} when absent or null, an error when anything else."""
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise MoeconvError(f"{where}: {key} must be an object, not {type(value).__name__}")
    return value


def natural_number(value: Any, what: str) -> int:
    """A non-negative int that is not a bool."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MoeconvError(f"{what} must be a non-negative integer, not {value!r}")
    return value


def weight_map(index: dict[str, Any], path: Path) -> dict[str, str]:
    """The index's tensor -> file map; files must be plain names inside the checkpoint folder."""
    mapping = index.get("weight_map")
    if not isinstance(mapping, dict) or not mapping:
        raise MoeconvError(f"{path}: weight_map must be a non-empty object of tensor name -> file name")
    check_tensor_count(len(mapping), str(path))
    for name, file_name in mapping.items():
        if not isinstance(file_name, str) or not is_plain_file_name(file_name):
            raise MoeconvError(f"{path}: tensor {name} maps to {file_name!r}, which is not a plain file name "
                               f"inside the checkpoint folder")
    return mapping


def is_plain_file_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name


_ENTRY_FIELDS = {"dtype", "shape", "data_offsets"}


def header_entries(header: Any, path: Path, data_size: int) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    """(name, dtype, shape, begin, end) of every tensor of a safetensors header, offsets relative to
    the data buffer, after checking everything the spec requires: dtypes from its list, shapes of
    non-negative integers, offsets inside the buffer with end − begin = numel × itemsize, no overlaps."""
    if not isinstance(header, dict):
        raise MoeconvError(f"{path}: safetensors header is not a JSON object")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise MoeconvError(f"{path}: __metadata__ must be an object of strings")
    entries = []
    for name, info in header.items():  # per tensor, 90,000 in a 25 GB humming output: only checks till one fails
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or info.keys() != _ENTRY_FIELDS:
            raise MoeconvError(f"{path}: tensor {name}: header entry must have exactly dtype, shape and data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise MoeconvError(f"{path}: tensor {name}: dtype {dtype!r} is not a safetensors dtype")
        if not isinstance(shape, list):
            raise MoeconvError(f"{path}: tensor {name}: shape must be a list, not {shape!r}")
        numel = 1
        for size in shape:
            if type(size) is not int or size < 0:  # a bool, a float, a negative number: refused, named
                natural_number(size, f"{path}: tensor {name}: each shape entry")
            numel *= size
        shape = tuple(shape)
        if not isinstance(offsets, list) or len(offsets) != 2:
            raise MoeconvError(f"{path}: tensor {name}: data_offsets must be [begin, end], not {offsets!r}")
        begin, end = offsets
        if not (type(begin) is int and type(end) is int and begin >= 0 and end >= 0):
            begin, end = (natural_number(offset, f"{path}: tensor {name}: data_offsets") for offset in offsets)
        if end < begin or end > data_size:
            raise MoeconvError(f"{path}: tensor {name}: data_offsets [{begin}, {end}] lie outside the {data_size}-byte "
                               f"data buffer (truncated file or damaged header)")
        if end - begin != numel * DTYPE_SIZES[dtype]:
            raise MoeconvError(f"{path}: tensor {name}: data_offsets hold {end - begin} bytes, but "
                               f"{dtype}{list(shape)} needs {numel * DTYPE_SIZES[dtype]}")
        entries.append((name, dtype, shape, begin, end))
    ordered = sorted(entries, key=itemgetter(3, 4))
    for before, after in zip(ordered, ordered[1:]):
        if after[3] < before[4]:
            raise MoeconvError(f"{path}: tensors {before[0]} and {after[0]} overlap in the data buffer")
    return entries
