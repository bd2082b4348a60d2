"""Source provenance: a conversion from a Hugging Face Hub snapshot records what the Hub published for
each file and checks the bytes it read against it; verify says whether the source is anchored, on any
machine. The cache is written by huggingface_hub itself, downloading from a local stand-in of the Hub's
HTTP API (tests/hub_server.py: it publishes the sha256 and git blob ids of the files it serves), then
used offline."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from moeconv import conversion, provenance
from moeconv.provenance import Anchor
from moeconv.source import ALLOW_PATTERNS
from moeconv.synth import SynthSpec, make_checkpoint

from hub_server import HubServer, git_blob_id

REPO = "acme/tiny-moe"


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("HF_")}
    return {**env, "HF_HUB_CACHE": str(cache), "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "1", "COLUMNS": "1000", **extra}


def _download(cache: Path, folder: Path) -> str:
    """huggingface_hub's own snapshot_download of `folder` published as REPO, into `cache`; the commit."""
    with HubServer({REPO: folder}) as hub:
        code = (f"from huggingface_hub import snapshot_download; "
                f"print(snapshot_download({REPO!r}, allow_patterns={ALLOW_PATTERNS!r}))")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env=_env(cache, HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0", HF_HUB_DISABLE_XET="1"))
        assert done.returncode == 0, done.stderr
        assert Path(done.stdout.strip()).name == hub.commit(REPO)
        return hub.commit(REPO)


def _moeconv(cache: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeconv", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=_env(cache))


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A synthetic source published as REPO and downloaded into a cache: (cache, source folder, commit)."""
    base = tmp_path_factory.mktemp("hub")
    source = make_checkpoint(base / "published", SynthSpec(layers=1, experts=2, hidden=64, intermediate=32,
                                                          dense_intermediate=64, vocab=64))
    cache = base / "cache"
    return cache, source, _download(cache, source)


def _snapshot(cache: Path, commit: str) -> Path:
    return cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / commit


def test_a_hub_conversion_records_the_published_digests_and_verify_is_anchored(hub, tmp_path):
    cache, published, commit = hub
    out = tmp_path / "out"
    done = _moeconv(cache, "convert", REPO, "-o", out, "-q")
    assert done.returncode == 0, done.stderr
    recorded = json.loads((out / "moeconv.json").read_text())["source"]
    assert (recorded["repo"], recorded["revision"]) == (REPO, commit)
    # what the Hub stand-in published (hashlib on the files it served), not what moeconv computes
    expected = {path.name: ({"sha256": hashlib.sha256(path.read_bytes()).hexdigest()} if path.suffix == ".safetensors"
                            else {"git_sha1": git_blob_id(path.read_bytes())}) for path in published.iterdir()}
    assert recorded["published"] == {"repo": REPO, "revision": commit, "files": expected}
    done = _moeconv(cache, "verify", out, "--level", "lossless", "-q")
    assert done.returncode == 0, done.stdout + done.stderr
    flat = " ".join(done.stdout.split())
    assert f"source anchored to {REPO}@{commit}: {len(expected)}/{len(expected)} files match the published digests" in flat
    assert done.stdout.splitlines()[-1].startswith("verdict: ok (") and f"source anchored to {REPO}@{commit};" in \
        done.stdout.splitlines()[-1]
    report = json.loads(_moeconv(cache, "verify", out, "--level", "lossless", "--json").stdout)
    assert report["source_anchor"] == {"repo": REPO, "revision": commit}
    assert report["published_files_checked"] == len(expected) and report["provenance_problems"] == []


def test_a_changed_cache_blob_is_a_mismatch_naming_the_file_and_is_never_converted(hub, tmp_path):
    cache, _, commit = hub
    out = tmp_path / "out"
    assert _moeconv(cache, "convert", REPO, "-o", out, "-q").returncode == 0
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy, symlinks=True)
    shard = _snapshot(copy, commit) / "model-00001-of-00001.safetensors"
    blob = Path(os.path.realpath(shard))
    data = bytearray(blob.read_bytes())
    data[-1] ^= 1  # a tensor byte: the headers (and so the plan) stay the same
    blob.write_bytes(bytes(data))
    done = _moeconv(copy, "verify", out, "--level", "lossless", "--source", REPO)
    assert done.returncode == 1
    assert (f"{shard}: its bytes do not match the sha256 {REPO}@{commit} published for it") in " ".join(
        done.stderr.split())
    again = _moeconv(copy, "convert", REPO, "-o", tmp_path / "again", "-q")
    assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1
    assert f"{shard}: its bytes do not match the sha256 {REPO}@{commit} published for it" in again.stderr
    assert "the Hugging Face cache changed since the download" in again.stderr
    assert not (tmp_path / "again").exists()


def test_a_local_copy_reads_as_unanchored_and_a_named_hub_id_anchors_it(hub, tmp_path):
    cache, _, commit = hub
    local = tmp_path / "local"
    shutil.copytree(_snapshot(cache, commit), local)  # links followed: a plain folder of the same bytes
    out = tmp_path / "out"
    assert _moeconv(cache, "convert", local, "-o", out, "-q").returncode == 0
    assert "published" not in json.loads((out / "moeconv.json").read_text())["source"]
    done = _moeconv(cache, "verify", out, "--level", "lossless", "-q")
    assert done.returncode == 0, done.stderr
    assert ("source not anchored (a local folder): this proves the output equals the conversion of that folder, "
            "not what its publisher published") in " ".join(done.stdout.split())
    assert "source not anchored (a local folder);" in done.stdout.splitlines()[-1]
    done = _moeconv(cache, "verify", out, "--level", "lossless", "--source", f"{REPO}@{commit}", "-q")
    assert done.returncode == 0, done.stderr
    assert f"source anchored to {REPO}@{commit}:" in " ".join(done.stdout.split())


def test_a_source_of_another_revision_is_refused_in_one_line(hub, tmp_path):
    cache, published, commit = hub
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy, symlinks=True)
    out = tmp_path / "out"
    assert _moeconv(copy, "convert", REPO, "-o", out, "-q").returncode == 0
    second = tmp_path / "second"
    shutil.copytree(published, second)
    (second / "generation_config.json").write_text(json.dumps({"temperature": 0.5}))
    newer = _download(copy, second)
    assert newer != commit
    done = _moeconv(copy, "verify", out, "--source", f"{REPO}@{newer}", "-q")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert (f"{REPO}@{newer}: is {REPO}@{newer}, but {out} was converted from {REPO}@{commit}; pass --source "
            f"{REPO}@{commit}") in " ".join(done.stderr.split())


def _published_folder(tmp_path: Path) -> tuple[Path, Anchor]:
    """Five files of different sizes and the anchor that publishes each one's sha256."""
    folder = tmp_path / "snapshot"
    folder.mkdir()
    for index, size in enumerate((3 << 20, 1, 9 << 20, 0, 5 << 20)):
        (folder / f"file-{index}.safetensors").write_bytes(bytes([index]) * size)
    published = {path.name: ("sha256", hashlib.sha256(path.read_bytes()).hexdigest()) for path in folder.iterdir()}
    return folder, Anchor(REPO, "0" * 40, published)


@pytest.mark.parametrize("threads", [1, 2, 8])
def test_the_published_digests_name_each_bad_file_in_order_however_many_files_are_hashed_at_once(tmp_path, threads):
    folder, anchor = _published_folder(tmp_path)
    (folder / "file-2.safetensors").write_bytes(b"\2" * (9 << 20) + b"!")
    (folder / "file-0.safetensors").unlink()
    (folder / "file-4.safetensors").write_bytes(b"\5" * (5 << 20))
    names = [*sorted(anchor.published), "extra.json"]
    seen = []
    problems = provenance.mismatches(folder, anchor, names, seen.append, threads=threads)
    assert problems == [
        f"{folder / 'file-0.safetensors'}: missing, but {REPO}@{'0' * 40} published it",
        f"{folder / 'file-2.safetensors'}: its bytes do not match the sha256 {REPO}@{'0' * 40} published for it",
        f"{folder / 'file-4.safetensors'}: its bytes do not match the sha256 {REPO}@{'0' * 40} published for it",
        f"{folder / 'extra.json'}: {REPO}@{'0' * 40} published no such file",
    ]
    assert sorted(seen) == sorted([1, 9 << 20 | 1, 0, 5 << 20])
    cancelled = threading.Event()
    cancelled.set()  # nothing hashed; what needs no hashing is still said
    assert provenance.mismatches(folder, anchor, names, seen.append, threads=threads, cancelled=cancelled) == [
        problems[0], problems[3]]


def test_a_conversions_published_digests_do_not_wait_behind_the_source_shards_digests(tmp_path, monkeypatch):
    """The check against the publisher's digests has a thread from the start: queued behind every shard's
    block digest, it began only when all but one had (a many-shard source's last seconds, one file at a time)."""
    folder, anchor = _published_folder(tmp_path)
    release = threading.Event()
    monkeypatch.setattr(conversion, "_sized_digest", lambda path: release.wait(30) and {})
    digests = conversion.SourceDigests(sorted(folder.iterdir()), folder, anchor)
    try:
        assert digests._published.result(timeout=20) == []
    finally:
        release.set()
        digests.cancel()
