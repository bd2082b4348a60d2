"""Integrity at load (moeconv/engines/vllm_plugin/integrity.py, MOECONV_VERIFY_ON_LOAD=1), without vLLM: each tensor
as vLLM's default loader hands it over (safetensors' `get_tensor`, memory-mapped) passes only while its
bytes hash to the digest moeconv.json records for it (computed by the writer as it wrote the shard); one
flipped byte inside one tensor is one `moeconv:` refusal naming that tensor and its shard, and every other
tensor of the same shard still passes (the check reads exactly the tensor's bytes)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

import moeconv
from moeconv.checkpoint.reader import open_checkpoint
from moeconv.checkpoint.writer import tensor_digest
from moeconv.formats import GPTQ
from moeconv.synth import SynthSpec, make_checkpoint
from moeconv.backends.triton_config import PluginRefusal
from moeconv.engines.vllm_plugin.integrity import ENV, TensorDigests, requested, tensor_bytes

from helpers import blocks_digest, reseal

STACKED = "model.layers.1.mlp.experts.w2_qweight"
DENSE = "model.layers.0.self_attn.q_proj.qweight"


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    base = tmp_path_factory.mktemp("integrity")
    source = make_checkpoint(base / "src", SynthSpec(architecture="qwen3_moe", source_format=GPTQ(4, 32, sym=True),
                                                     layers=2, experts=2))
    return moeconv.convert(source, base / "out", backend="triton").output


def _loaded(folder):
    """Every tensor of the output as vLLM's safetensors iterator yields them: (name, tensor, shard)."""
    for entry in open_checkpoint(folder).tensors.values():
        with safe_open(str(entry.file), framework="pt") as handle:
            yield entry.name, handle.get_tensor(entry.name), entry.file


def _flip(folder, name):
    entry = open_checkpoint(folder).tensors[name]
    with open(entry.file, "r+b") as handle:
        handle.seek(entry.begin + entry.nbytes // 2)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 0x10]))
    return entry.file


def test_every_tensor_as_written_passes_and_its_digest_is_the_definition(output):
    digests = TensorDigests(output)
    loaded = list(_loaded(output))
    assert {name for name, _, _ in loaded} == set(digests.recorded) and STACKED in digests.recorded
    for name, tensor, shard in loaded:
        digests.check(name, tensor)
        entry = open_checkpoint(output).tensors[name]
        with open(shard, "rb") as handle:  # the digest of the file's bytes, from docs/FORMAT.md's definition
            handle.seek(entry.begin)
            assert digests.recorded[name] == (shard.name, blocks_digest(handle.read(entry.nbytes), 64 << 20))
    # the load log's line (vLLM's logger, after the model's load_weights) says what passing proves
    assert digests.summary() == (f"moeconv: MOECONV_VERIFY_ON_LOAD=1: {len(loaded)} tensors of {output} match the "
                                 f"digests moeconv.json records: self-consistent; not compared with the source "
                                 f"(`moeconv verify` compares them)")


def test_the_load_log_line_shows_an_output_path_s_controls_escaped(output, tmp_path):
    """vLLM's log goes to a terminal: a folder named with escape sequences, a newline and a bidi override is
    shown escaped in the line, as the CLI shows it."""
    copy = tmp_path / "out\x1b[8m\x1b]0;TITLE\x07\nverdict: ok\u202e"
    shutil.copytree(output, copy)
    digests = TensorDigests(copy)
    for name, tensor, _ in _loaded(copy):
        digests.check(name, tensor)
    line = digests.summary()
    assert line == (f"moeconv: MOECONV_VERIFY_ON_LOAD=1: {len(digests.recorded)} tensors of {tmp_path}/"
                    r"out\x1b[8m\x1b]0;TITLE\x07\nverdict: ok\u202e match the digests moeconv.json records: "
                    "self-consistent; not compared with the source (`moeconv verify` compares them)"), line


@pytest.mark.parametrize("name", [STACKED, DENSE])
def test_a_flipped_byte_in_one_tensor_is_refused_naming_the_tensor_and_its_shard(output, tmp_path, name):
    copy = tmp_path / "out"
    shutil.copytree(output, copy)
    shard = _flip(copy, name)
    digests = TensorDigests(copy)
    checked = 0
    for loaded, tensor, file in _loaded(copy):
        if loaded != name:
            digests.check(loaded, tensor)  # the other tensors, of this shard too, still pass
            checked += file == shard
            continue
        with pytest.raises(PluginRefusal) as refusal:
            digests.check(loaded, tensor)
        message = str(refusal.value)
        assert message == (f"moeconv: {name}: its bytes in {shard.name} differ from the digest moeconv.json "
                           f"records: the output was corrupted or changed; restore or reconvert it")
    assert checked > 0


def test_tensor_digest_cuts_pieces_from_the_tensors_first_byte():
    data = bytes(range(256)) * 40 + b"tail"
    assert tensor_digest(data, threads=3, block=1000) == blocks_digest(data, 1000)
    assert tensor_digest(b"", block=1000) == blocks_digest(b"", 1000)
    assert tensor_digest(data, threads=3, block=1000) != tensor_digest(data[:-1] + b"u", threads=3, block=1000)
    weights = torch.tensor([[1.5, -2.25], [3.0, 65504.0]], dtype=torch.bfloat16)
    assert bytes(tensor_bytes(weights)) == weights.view(torch.int16).numpy().astype("<i2").tobytes()


def test_a_manifest_without_tensor_digests_or_changed_after_writing_is_refused(output, tmp_path):
    copy = tmp_path / "out"
    shutil.copytree(output, copy)
    manifest = copy / "moeconv.json"
    data = json.loads(manifest.read_text())

    def version_1(content):  # as a moeconv before per-tensor digests wrote it, sealed
        del content["manifest_version"]
        for recorded in content["files"].values():
            recorded.pop("tensor_digests")

    reseal(copy, edit=version_1)
    with pytest.raises(PluginRefusal, match="records no digest per tensor .*: reconvert, or load without"):
        TensorDigests(copy)
    manifest.write_text(json.dumps(data))
    TensorDigests(copy)  # as written: taken
    reseal(copy, edit=lambda content: content.update({"manifest_version": 2}))  # version 2: the same refusal
    with pytest.raises(PluginRefusal, match="records no digest per tensor .*: reconvert, or load without"):
        TensorDigests(copy)
    manifest.write_text(json.dumps({**data, "tool_version": "0"}))  # edited, not resealed
    with pytest.raises(PluginRefusal, match="differs from its own recorded digest"):
        TensorDigests(copy)
    manifest.write_text(json.dumps({**data, "files": ["not", "an", "object"]}))
    with pytest.raises(PluginRefusal, match="moeconv.json"):
        TensorDigests(copy)
    manifest.unlink()
    with pytest.raises(PluginRefusal, match="no moeconv.json"):
        TensorDigests(copy)


def test_a_tensor_the_manifest_does_not_record_is_refused(output):
    with pytest.raises(PluginRefusal, match="^moeconv: model.extra: MOECONV_VERIFY_ON_LOAD=1, but moeconv.json "
                                            "records no digest for it$"):
        TensorDigests(output).check("model.extra", torch.zeros(2))


def test_the_switch_is_1_or_0(monkeypatch):
    for value, on in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv(ENV, value)
        assert requested() is on
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(PluginRefusal, match="set it to 1"):
        requested()
