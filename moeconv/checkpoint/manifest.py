"""`moeconv.json`: what an output folder is, written by `convert` from the plan's work list and read
back by `verify`. It records the tool, the backend and its layout version, the engines the layout
targets, the arguments and source that decide the bytes, the size and digest of every file the
output holds (shards, index, configs, the files copied as they are) and of every source shard as
the conversion read it, the source files left out and why, for every output tensor the source
tensors it derives from, and a digest of the manifest itself.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeconv._version import __version__
from moeconv.checkpoint.schema import is_plain_file_name, read_json_object, section
from moeconv.checkpoint.writer import BLAKE3, BLOCK_BYTES, CURRENT, SHA256, TENSOR_DIGESTS_KEY, DigestScheme
from moeconv.errors import MoeconvError

MANIFEST_NAME = "moeconv.json"
QUANTIZE_CONFIG_NAME = "quantize_config.json"
SELF_DIGEST_KEY = "manifest_sha256"
# 2: each shard's `tensor_digests` (docs/FORMAT.md); manifests without the field are version 1.
# 3: each shard's digest is made of its tensors' (`sha256_header_and_tensors`, writer.shard_digest).
# 4: every block digest is BLAKE3's (`blake3_64mib_blocks`, `blake3_header_and_tensors`); 3 still verifies.
MANIFEST_VERSION = 4
SCHEMES = {3: SHA256, 4: BLAKE3}  # the versions verify reads, and the digests each records
assert SCHEMES[MANIFEST_VERSION] is CURRENT


def scheme_of(manifest: dict[str, Any]) -> DigestScheme | None:
    """The digests a manifest records, by its version; None for a version verify does not read."""
    version = manifest.get("manifest_version")
    return SCHEMES.get(version) if type(version) is int else None


def output_config(plan: Any) -> dict[str, Any]:
    """The output's config.json: the source's, with moeconv's quantization_config (none where the plan's is
    empty: a BF16 cast with nothing left quantized is a plain checkpoint)."""
    if not plan.quantization_config:
        return {key: value for key, value in plan.checkpoint.config.items() if key != "quantization_config"}
    return {**plan.checkpoint.config, "quantization_config": plan.quantization_config}


def output_index(plan: Any) -> dict[str, Any]:
    """The output's model.safetensors.index.json."""
    weight_map = {tensor.name: shard.file_name for shard in plan.shards for tensor in shard.tensors}
    return {"metadata": {"total_size": plan.output_bytes}, "weight_map": weight_map}


def self_digest(manifest: dict[str, Any]) -> str:
    """The sha256 of the manifest's content without this field, as sorted compact JSON: any change
    to a value of the manifest changes it, a change of JSON whitespace does not."""
    content = {key: value for key, value in manifest.items() if key != SELF_DIGEST_KEY}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def build(plan: Any, files: dict[str, dict[str, Any]], written: dict[str, dict[str, Any]],
          copied: dict[str, dict[str, Any]], skipped: dict[str, str],
          source_digests: dict[str, dict[str, Any]], cast: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest of `plan`'s output (a moeconv.plan.Plan). `files`: each shard's bytes and digest
    (the scheme's shard_key: writer.shard_digest) and its tensors' (`tensor_digests`: writer.tensor_digest); `written`: the
    index's and configs'; `copied`: the source's side files
    copied as they are; `skipped`: the source's files left out, with why; `source_digests`: each
    source shard's bytes and digest, hashed as the conversion ran."""
    source = plan.checkpoint
    built = {
        "tool": "moeconv",
        "tool_version": __version__,
        "manifest_version": MANIFEST_VERSION,
        **derived(plan),
        "arguments": plan.identity,
        "source": {**source.identity(), "files": [path.name for path in source.files],
                   "file_digests": source_digests},
        "files": files,
        "metadata_files": written,
        "copied_files": copied,
        "skipped_files": skipped,
        # --cast: the census the cast was decided by (casts.Tally), whether inexact blocks were allowed, and the
        # bound: the worst relative error of any written value (0 for an exact cast)
        **({"cast": cast} if cast is not None else {}),
    }
    built[SELF_DIGEST_KEY] = self_digest(built)
    return built


def derived(plan: Any, scheme: DigestScheme = CURRENT) -> dict[str, Any]:
    """The sections that follow from the plan alone (what verify, having planned from the source,
    expects to find), for a manifest whose digests are `scheme`'s."""
    tensors: dict[str, dict[str, Any]] = {}
    for job in plan.jobs:
        transform = "copy" if job.copies else f"{plan.source_format.method}->{plan.layout_of(job)}"
        for slot in job.slots.values():
            entry = tensors.setdefault(slot.tensor.name, {"transform": transform,
                                                          "sources": []})
            entry["sources"] += slot.sources
    return {
        "backend": plan.backend.name,
        "layout_version": plan.backend.layout_version,
        "targets": plan.targets,
        "format": plan.source_format.describe(),
        # How the format was decided: the data's evidence, and what the user chose where it could not decide.
        "format_decision": {"evidence": plan.detection.evidence if plan.detection else [],
                            "decided_by_user": plan.detection.decided_by_user if plan.detection else []},
        "file_digest": f"{scheme.file_key}: {scheme.name} of the {scheme.name} digests of each {BLOCK_BYTES >> 20} MiB "
                       f"block, in order",
        "shard_digest": f"{scheme.shard_key}: {scheme.name} of the {scheme.name} of the bytes before the first tensor's "
                        f"data, then each tensor's {TENSOR_DIGESTS_KEY} entry (32 bytes), in file-offset order",
        "tensors": tensors,
    }


def read(output: Path) -> dict[str, Any]:
    """An output folder's manifest, with the sections verify relies on checked."""
    path = output / MANIFEST_NAME
    if path.is_symlink():  # it could name any file: read only the one convert wrote
        raise MoeconvError(f"{path}: a link, not the file `moeconv convert` wrote; it is read only as a regular file "
                           f"inside the output")
    if not path.exists():
        raise MoeconvError(f"{output}: no {MANIFEST_NAME}: not a folder written by `moeconv convert`")
    manifest = read_json_object(path)
    for name in ("source", "arguments", "targets"):
        section(manifest, name, str(path))
    if not isinstance(manifest.get("backend"), str):
        raise MoeconvError(f"{path}: backend is missing")
    return manifest


def digest_key_of(section: str, scheme: DigestScheme) -> str:
    """The digest a section records for each of its files: the shards' is made of their tensors'."""
    return scheme.shard_key if section == "files" else scheme.file_key


def recorded_files(manifest: dict[str, Any], key: str, scheme: DigestScheme) -> dict[str, dict[str, Any]] | None:
    """The files a section lists (name -> bytes and digest): `files` the shards, `metadata_files` the
    index and configs, `copied_files` the side files, a manifest's `source` section's `file_digests` the
    source's shards; None when that section is malformed."""
    files, digest_key = manifest.get(key), digest_key_of(key, scheme)
    if not isinstance(files, dict) or not all(
            is_plain_file_name(name) and isinstance(recorded, dict) and isinstance(recorded.get("bytes"), int)
            and isinstance(recorded.get(digest_key), str) for name, recorded in files.items()):
        return None
    return files


def recorded_tensor_digests(manifest: dict[str, Any]) -> dict[str, tuple[str, str]] | None:
    """Each output tensor's shard and digest (`files` -> shard -> `tensor_digests`, manifest version 3 and
    later); None when the manifest is of an older version or that section is malformed."""
    scheme = scheme_of(manifest)
    files = None if scheme is None else recorded_files(manifest, "files", scheme)
    if files is None:
        return None
    digests: dict[str, tuple[str, str]] = {}
    for shard, recorded in files.items():
        tensors = recorded.get(TENSOR_DIGESTS_KEY)
        if not isinstance(tensors, dict) or not all(
                isinstance(name, str) and isinstance(digest, str) for name, digest in tensors.items()):
            return None
        for name, digest in tensors.items():
            if name in digests:
                return None
            digests[name] = (shard, digest)
    return digests


@dataclass(frozen=True)
class Manifest:
    """An output's manifest as verify reads it: parsed once, sealed and of a version whose digests it
    takes. A malformed list of files is None (each a problem of its own for the structure level)."""

    path: Path
    data: dict[str, Any]  # as read: the derived sections are compared with what the plan writes
    scheme: DigestScheme
    backend: str
    targets: dict[str, Any]
    source: dict[str, Any]  # where the conversion read from: path, Hub id, headers' digest, shards' digests
    arguments: dict[str, Any]  # what decides the bytes, as the conversion was asked
    files: dict[str, dict[str, Any]] | None  # the shards
    metadata_files: dict[str, dict[str, Any]] | None  # the index and configs
    copied_files: dict[str, dict[str, Any]] | None  # the source's side files, copied as they are
    skipped_files: dict[str, Any]
    source_files: dict[str, dict[str, Any]] | None  # the source's shards as the conversion read them
    tensor_digests: dict[str, tuple[str, str]] | None  # tensor -> (shard, digest)

    def listed(self, key: str) -> dict[str, dict[str, Any]] | None:
        """One of the lists of the files the output holds: `files`, `metadata_files` or `copied_files`."""
        return {"files": self.files, "metadata_files": self.metadata_files, "copied_files": self.copied_files}[key]


def parse(output: Path) -> Manifest:
    """An output folder's manifest for verify; MoeconvError (its one problem) when it cannot be read, its
    content differs from its own digest, or its version records digests verify does not take."""
    manifest = read(output)
    recorded = manifest.get(SELF_DIGEST_KEY)
    if recorded is None:
        raise MoeconvError(f"{MANIFEST_NAME}: records no digest of itself, of the configs or of the source's data "
                           f"(written by a moeconv before 2026-12-02); convert again")
    if recorded != self_digest(manifest):
        raise MoeconvError(f"{MANIFEST_NAME}: its content differs from its own recorded digest (changed after the "
                           f"conversion)")
    scheme = scheme_of(manifest)
    if scheme is None:
        read_versions = " or ".join(map(str, SCHEMES))
        raise MoeconvError(f"{MANIFEST_NAME}: manifest_version {manifest.get('manifest_version')}, not {read_versions} "
                           f"(files -> shard -> {CURRENT.shard_key}, made of its {TENSOR_DIGESTS_KEY}; written by an "
                           f"older moeconv); convert again")
    where, skipped = str(output / MANIFEST_NAME), manifest.get("skipped_files")
    source = section(manifest, "source", where)
    return Manifest(output / MANIFEST_NAME, manifest, scheme, manifest["backend"], section(manifest, "targets", where),
                    source, section(manifest, "arguments", where), recorded_files(manifest, "files", scheme),
                    recorded_files(manifest, "metadata_files", scheme), recorded_files(manifest, "copied_files", scheme),
                    skipped if isinstance(skipped, dict) else {}, recorded_files(source, "file_digests", scheme),
                    recorded_tensor_digests(manifest))
