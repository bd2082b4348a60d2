"""Integrity at load (moeconv/vllm_plugin/integrity.py, MOECONV_VERIFY_ON_LOAD=1), without vLLM: the shard
that holds a stacked tensor passes only while it is the file moeconv wrote (the digest moeconv.json
records, computed by the writer as it wrote it); one flipped byte inside a stacked tensor is one
`moeconv:` refusal naming the tensor and the shard."""

from __future__ import annotations

import json
import shutil

import pytest

import moeconv
from moeconv.checkpoint.reader import open_checkpoint
from moeconv.formats import GPTQ
from moeconv.synth import SynthSpec, make_checkpoint
from moeconv.vllm_plugin.config import PluginRefusal
from moeconv.vllm_plugin.integrity import ENV, ShardDigests, requested

TENSOR = "model.layers.0.mlp.experts.w13_qweight"


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    base = tmp_path_factory.mktemp("integrity")
    source = make_checkpoint(base / "src", SynthSpec(architecture="qwen3_moe", source_format=GPTQ(4, 32, sym=True),
                                                     layers=1, experts=2))
    return moeconv.convert(source, base / "out", backend="triton").output


def test_the_files_moeconv_wrote_pass_and_a_flipped_byte_in_a_stacked_tensor_is_refused(output, tmp_path):
    copy = tmp_path / "out"
    shutil.copytree(output, copy)
    entry = open_checkpoint(copy).tensors[TENSOR]
    ShardDigests(copy).check(entry.file, TENSOR)  # as written: passes
    with open(entry.file, "r+b") as handle:
        handle.seek(entry.begin + (entry.end - entry.begin) // 2)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(PluginRefusal) as refusal:
        ShardDigests(copy).check(entry.file, TENSOR)
    message = str(refusal.value)
    assert message.startswith(f"moeconv: {TENSOR}: its shard {entry.file.name} is not the file moeconv wrote")
    assert "\n" not in message


def test_a_missing_or_malformed_manifest_is_refused(output, tmp_path):
    copy = tmp_path / "out"
    shutil.copytree(output, copy)
    manifest = copy / "moeconv.json"
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**data, "files": ["not", "an", "object"]}))
    with pytest.raises(PluginRefusal, match="files section is malformed"):
        ShardDigests(copy)
    manifest.unlink()
    with pytest.raises(PluginRefusal, match="no moeconv.json"):
        ShardDigests(copy)


def test_the_switch_is_1_or_0(monkeypatch):
    for value, on in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv(ENV, value)
        assert requested() is on
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(PluginRefusal, match="set it to 1"):
        requested()
