"""`moeconv.json`: what an output folder is, written by `convert` from the plan's work list and read
back by `verify`. It records the tool, the backend and its layout version, the engines the layout
targets, the arguments and source that decide the bytes, each shard's size and digest, the files
copied as they are, and for every output tensor the source tensors it derives from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeconv._version import __version__
from moeconv.checkpoint.schema import is_plain_file_name, read_json_object, section
from moeconv.checkpoint.writer import BLOCK_BYTES, DIGEST_KEY
from moeconv.errors import MoeconvError

MANIFEST_NAME = "moeconv.json"
QUANTIZE_CONFIG_NAME = "quantize_config.json"


def build(plan: Any, files: dict[str, dict[str, Any]], copied: list[str]) -> dict[str, Any]:
    """The manifest of `plan`'s output (a moeconv.plan.Plan): `files` maps each shard to its bytes and
    digest (writer.combined_digest), `copied` lists the source's other files copied as they are."""
    source = plan.checkpoint
    transform = f"{plan.source_format.method}->{plan.backend.name}"
    tensors: dict[str, dict[str, Any]] = {}
    for job in plan.jobs:
        for slot in job.slots.values():
            entry = tensors.setdefault(slot.tensor.name, {"transform": "copy" if job.copies else transform,
                                                          "sources": []})
            entry["sources"] += slot.sources
    return {
        "tool": "moeconv",
        "tool_version": __version__,
        "backend": plan.backend.name,
        "layout_version": plan.backend.layout_version,
        "targets": plan.backend.targets,
        "arguments": plan.identity(),
        "source": {**source.identity(), "files": [path.name for path in source.files]},
        "format": plan.source_format.describe(),
        "file_digest": f"{DIGEST_KEY}: sha256 of the sha256 digests of each {BLOCK_BYTES >> 20} MiB block, in order",
        "files": files,
        "copied_files": copied,
        "tensors": tensors,
    }


def read(output: Path) -> dict[str, Any]:
    """An output folder's manifest, with the sections verify relies on checked."""
    path = output / MANIFEST_NAME
    if not path.exists():
        raise MoeconvError(f"{output}: no {MANIFEST_NAME}: not a folder written by `moeconv convert`")
    manifest = read_json_object(path)
    for name in ("source", "arguments", "targets"):
        section(manifest, name, str(path))
    if not isinstance(manifest.get("backend"), str):
        raise MoeconvError(f"{path}: backend is missing")
    return manifest


def recorded_files(manifest: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """The shards the manifest lists (name -> bytes and digest), or None when that section is malformed."""
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
            is_plain_file_name(name) and isinstance(recorded, dict) and isinstance(recorded.get("bytes"), int)
            and isinstance(recorded.get(DIGEST_KEY), str) for name, recorded in files.items()):
        return None
    return files
