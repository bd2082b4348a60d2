"""A larger checkpoint from a small one, at disk speed: its decoder layers repeated.

    python benchmarks/grow_checkpoint.py SOURCE TARGET --layers N [--shard-gb 5]

Layer i of TARGET holds the tensors of layer i % L of SOURCE (L its layer count), byte for byte, under
layer i's names; the other tensors (embeddings, final norm, head) once. The shards are written as
safetensors (sorted header, 8-byte aligned) with their index, and config.json says N layers; the other
side files are copied. Building a synthetic source of 25 GB quantizes every expert (minutes on 16
cores); this takes the time of writing the bytes, so a benchmark call can measure a checkpoint larger
than the page cache of a device call's budget allows to build. What the converter does per byte does
not depend on the values, so repeated layers measure the same work.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import time
from pathlib import Path

LAYER = re.compile(r"^(model\.layers\.)(\d+)(\..*)$")


def _header(path: Path) -> tuple[dict, int]:
    with path.open("rb") as handle:
        size = struct.unpack("<Q", handle.read(8))[0]
        return json.loads(handle.read(size)), 8 + size


def _tensors(source: Path) -> list[tuple[str, dict, Path, int]]:
    """(name, header entry, shard, absolute data offset) of every tensor of `source`."""
    found = []
    for shard in sorted(source.glob("*.safetensors")):
        header, start = _header(shard)
        found += [(name, entry, shard, start + entry["data_offsets"][0])
                  for name, entry in header.items() if name != "__metadata__"]
    return found


def _write_shard(path: Path, tensors: list[tuple[str, dict, Path, int]]) -> None:
    header, offset = {}, 0
    for name, entry, _, _ in tensors:
        size = entry["data_offsets"][1] - entry["data_offsets"][0]
        header[name] = {"dtype": entry["dtype"], "shape": entry["shape"], "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(encoded)) + encoded)
        handles: dict[Path, int] = {}
        try:
            for _, entry, shard, begin in tensors:
                size = entry["data_offsets"][1] - entry["data_offsets"][0]
                if shard not in handles:
                    handles[shard] = os.open(shard, os.O_RDONLY)
                descriptor = handles[shard]
                copied = 0
                while copied < size:
                    copied += os.copy_file_range(descriptor, out.fileno(), size - copied, begin + copied)
        finally:
            for descriptor in handles.values():
                os.close(descriptor)


def grow(source: Path, target: Path, layers: int, shard_bytes: int) -> None:
    config = json.loads((source / "config.json").read_text())
    have = config["num_hidden_layers"]
    tensors = _tensors(source)
    by_layer: dict[int, list] = {}
    rest = []
    for name, entry, shard, begin in tensors:
        match = LAYER.match(name)
        (by_layer.setdefault(int(match[2]), []).append((match[1], match[3], entry, shard, begin)) if match
         else rest.append((name, entry, shard, begin)))
    grown = list(rest)
    for layer in range(layers):
        grown += [(f"{head}{layer}{tail}", entry, shard, begin)
                  for head, tail, entry, shard, begin in by_layer[layer % have]]
    shards, current, size = [], [], 0
    for item in grown:
        nbytes = item[1]["data_offsets"][1] - item[1]["data_offsets"][0]
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(item)
        size += nbytes
    shards.append(current)
    target.mkdir(parents=True)
    weight_map, total = {}, 0
    for index, items in enumerate(shards, 1):
        name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(target / name, items)
        for tensor, entry, _, _ in items:
            weight_map[tensor] = name
            total += entry["data_offsets"][1] - entry["data_offsets"][0]
    (target / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    for side in source.iterdir():
        if side.is_file() and not side.name.endswith(".safetensors") and side.name not in (
                "model.safetensors.index.json", "config.json"):
            shutil.copy2(side, target / side.name)
    (target / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--shard-gb", type=float, default=5.0)
    args = parser.parse_args()
    started = time.perf_counter()
    grow(args.source, args.target, args.layers, int(args.shard_gb * 1e9))
    size = sum(path.stat().st_size for path in args.target.iterdir())
    print(f"grew {args.target} to {args.layers} layers, {size / 1e9:.2f} GB, in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
