"""Integrity at load (`MOECONV_VERIFY_ON_LOAD=1`; no vLLM here): before the plugin copies a stacked
tensor, the shard that holds it must have the digest `moeconv.json` recorded for it when it was written.

The manifest records one digest per file (`sha256_64mib_blocks`, moeconv.checkpoint.writer), so the check
reads each shard that holds a stacked tensor once, whole, hashing its 64 MiB blocks on up to 8 threads
(about 1 GB/s a core): start-up reads those bytes twice, once to hash and once to load. Off by default.
"""

from __future__ import annotations

import os
from pathlib import Path

from moeconv.checkpoint import manifest as manifests
from moeconv.checkpoint.writer import DIGEST_KEY, file_digest
from moeconv.errors import MoeconvError
from moeconv.vllm_plugin.config import PluginRefusal

ENV = "MOECONV_VERIFY_ON_LOAD"


def requested() -> bool:
    value = os.environ.get(ENV, "")
    if value not in ("", "0", "1"):
        raise PluginRefusal(f"{ENV}={value!r}: set it to 1 (check each stacked tensor's shard) or 0")
    return value == "1"


class ShardDigests:
    """The digests `moeconv.json` records for an output's shards, each shard checked once."""

    def __init__(self, root: Path) -> None:
        try:
            manifest = manifests.read(root)
        except MoeconvError as error:
            raise PluginRefusal(f"{ENV}=1: {error}") from None
        recorded = manifests.recorded_files(manifest)
        if recorded is None:
            raise PluginRefusal(f"{ENV}=1: {root / manifests.MANIFEST_NAME}: its files section is malformed")
        self.root, self.recorded, self.checked = root, recorded, set()

    def check(self, file: Path, tensor: str) -> None:
        """Refuses when `file` (a shard holding `tensor`) is not the file moeconv wrote."""
        if file.name in self.checked:
            return
        recorded = self.recorded.get(file.name)
        if recorded is None:
            raise PluginRefusal(f"{tensor}: its shard {file.name} is not among the files moeconv.json records")
        if file.stat().st_size != recorded["bytes"] or file_digest(file) != recorded[DIGEST_KEY]:
            raise PluginRefusal(f"{tensor}: its shard {file.name} is not the file moeconv wrote (its digest differs "
                                f"from moeconv.json's): the output was corrupted or changed; restore or reconvert it")
        self.checked.add(file.name)
