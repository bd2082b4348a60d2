"""Integrity at load (`MOECONV_VERIFY_ON_LOAD=1`; no vLLM here): every tensor vLLM's loader hands over
is checked against the digest `moeconv.json` records for it, before the plugin copies it or the model's
own loader takes it.

The manifest (version 3 and later, docs/FORMAT.md) records each shard's tensors' digests (`tensor_digests`:
moeconv.checkpoint.writer.tensor_digest, the hash of the hashes of the tensor's 64 MiB pieces: BLAKE3
from version 4, sha256 in version 3). The check hashes exactly the bytes the loader read for the tensor
(the memory-mapped tensor itself, pieces on up to 8 threads), so a flipped byte anywhere in it stops start-up
with one line naming the tensor and its shard, and no other bytes are read. Off by default.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from moeconv.checkpoint import manifest as manifests
from moeconv.checkpoint.writer import tensor_digest
from moeconv.errors import MoeconvError, printable
from moeconv.backends.triton_config import PluginRefusal

ENV = "MOECONV_VERIFY_ON_LOAD"


def requested() -> bool:
    value = os.environ.get(ENV, "")
    if value not in ("", "0", "1"):
        raise PluginRefusal(f"{ENV}={value!r}: set it to 1 (check each tensor against moeconv.json) or 0")
    return value == "1"


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes a tensor holds, as the file stores them (a CPU tensor's own memory, no copy; a tensor a
    loader already put on a GPU is copied back once)."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return memoryview(flat.contiguous().view(torch.uint8).numpy())


class TensorDigests:
    """The digests `moeconv.json` records for an output's tensors, each tensor checked when it is loaded."""

    def __init__(self, root: Path) -> None:
        path = root / manifests.MANIFEST_NAME
        try:
            manifest = manifests.read(root)
        except MoeconvError as error:
            raise PluginRefusal(f"{ENV}=1: {error}") from None
        if manifest.get(manifests.SELF_DIGEST_KEY) != manifests.self_digest(manifest):
            raise PluginRefusal(f"{ENV}=1: {path}: its content differs from its own recorded digest (changed "
                                f"after the conversion)")
        recorded = manifests.recorded_tensor_digests(manifest)
        if recorded is None:
            raise PluginRefusal(f"{ENV}=1: {path} records no digest per tensor (an output of an older moeconv, "
                                f"or a damaged manifest): reconvert, or load without {ENV}")
        self.root, self.recorded, self.scheme, self.checked = root, recorded, manifests.scheme_of(manifest), 0

    def check(self, name: str, tensor: torch.Tensor) -> None:
        """Refuses when `tensor` (the loader's tensor `name`, as read from its shard) is not the bytes
        moeconv wrote."""
        recorded = self.recorded.get(name)
        if recorded is None:
            raise PluginRefusal(f"{name}: {ENV}=1, but {manifests.MANIFEST_NAME} records no digest for it")
        shard, digest = recorded
        if tensor_digest(tensor_bytes(tensor), scheme=self.scheme) != digest:
            raise PluginRefusal(f"{name}: its bytes in {shard} differ from the digest {manifests.MANIFEST_NAME} "
                                f"records: the output was corrupted or changed; restore or reconvert it")
        self.checked += 1

    def summary(self) -> str:
        """The load log's line: what the check proved, and what it did not (the digests are the output's own).
        The output's path shown through `printable`, as every name moeconv prints (a log is read on a terminal)."""
        return printable(f"moeconv: {ENV}=1: {self.checked} tensors of {self.root} match the digests "
                         f"{manifests.MANIFEST_NAME} records: self-consistent; not compared with the source "
                         f"(`moeconv verify` compares them)")
