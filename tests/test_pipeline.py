"""Pipeline behaviour: Hub ids from a real cache folder (offline), resume after kill -9, refusals."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import moeconv
from moeconv.conversion import staging_folder
from moeconv.formats import GPTQ
from moeconv.synth import SynthSpec, make_checkpoint

EXE = str(Path(sys.executable).with_name("moeconv"))
COMMIT = "4f3c2b1a0e9d8c7b6a5f4e3d2c1b0a9f8e7d6c5b"


def _hub_cache(root: Path, source: Path, repo: str = "acme/tiny-moe") -> Path:
    """Lay out `source` the way huggingface_hub's cache does: content-addressed blobs, a snapshot
    folder of symlinks per commit, and refs/main naming the commit."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / COMMIT
    (repo_dir / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(COMMIT)
    for path in source.iterdir():
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copy2(path, repo_dir / "blobs" / digest)
        (snapshot / path.name).symlink_to(Path("../../blobs") / digest)
    return root


def _offline_env(cache: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def test_hub_id_resolved_offline_from_the_cache(tmp_path):
    source = make_checkpoint(tmp_path / "src", SynthSpec())
    cache = _hub_cache(tmp_path / "cache", source)
    env = _offline_env(cache)
    done = subprocess.run([EXE, "convert", "acme/tiny-moe", "--revision", "main", "-o", str(tmp_path / "out"),
                           "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "out" / "moeconv.json").read_text())
    assert "generation_config.json" in manifest["copied_files"]  # a link into the repository's blobs: inside
    assert manifest["source"]["repo"] == "acme/tiny-moe"
    assert manifest["source"]["revision"] == COMMIT
    assert manifest["source"]["path"].endswith(f"snapshots/{COMMIT}")
    done = subprocess.run([EXE, "verify", str(tmp_path / "out"), "--level", "lossless"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_hub_source_named_by_the_manifest_is_found_in_the_cache(tmp_path):
    """The recorded snapshot folder gone (another machine, a moved cache): verify finds the manifest's
    repository and revision in the local cache, with HF_HUB_OFFLINE unset (test_verify's
    test_a_hub_id_in_the_manifest_is_never_downloaded shows that it does not download)."""
    from helpers import reseal

    source = make_checkpoint(tmp_path / "src", SynthSpec())
    cache = _hub_cache(tmp_path / "cache", source)
    env = {**os.environ, "HF_HUB_CACHE": str(cache)}
    env.pop("HF_HUB_OFFLINE", None)
    done = subprocess.run([EXE, "convert", "acme/tiny-moe", "-o", str(tmp_path / "out"), "-q"], capture_output=True,
                          text=True, env={**env, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr
    reseal(tmp_path / "out", edit=lambda manifest: manifest["source"].update(path=str(tmp_path / "gone")))
    done = subprocess.run([EXE, "verify", str(tmp_path / "out"), "--level", "lossless", "--json"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["source"].endswith(f"models--acme--tiny-moe/snapshots/{COMMIT}")


@pytest.mark.parametrize("args, expected", [
    (["acme/missing"], "acme/missing: no such folder, and not a model in the local Hugging Face cache"),
    (["acme/tiny-moe", "--revision", "v9"], "acme/tiny-moe@v9: revision not in the local cache (cached: 4f3c2b1a0e9d, main)"),
])
def test_missing_repo_and_revision_are_clear(tmp_path, args, expected):
    source = make_checkpoint(tmp_path / "src", SynthSpec())
    env = _offline_env(_hub_cache(tmp_path / "cache", source))
    done = subprocess.run([EXE, "inspect", *args], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert expected in done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1


@pytest.mark.parametrize("case, expected", [
    ("revision with ..", "--revision ../../x: not a branch, tag or commit name"),
    ("ref leaving the cache", "acme/tiny-moe@main: the Hugging Face cache names"),
])
def test_hub_paths_stay_inside_the_cache(tmp_path, case, expected):
    """A --revision with `..` (a path inside the cache's refs), or a refs/main naming `../../elsewhere`
    (a folder outside the snapshots): one line, never a traceback or a folder outside the cache."""
    source = make_checkpoint(tmp_path / "src", SynthSpec())
    cache = _hub_cache(tmp_path / "cache", source)
    args = ["acme/tiny-moe"]
    if case == "revision with ..":
        args += ["--revision", "../../x"]
    else:
        repo = cache / "models--acme--tiny-moe"
        shutil.copytree(source, repo / "elsewhere")
        (repo / "refs" / "main").write_text("../elsewhere")
    done = subprocess.run([EXE, "inspect", *args], capture_output=True, text=True, env=_offline_env(cache), timeout=120)
    assert done.returncode == 2 and expected in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1


def _files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def _journal_done(staging: Path) -> int:
    try:
        return len(json.loads((staging / "moeconv-progress.json").read_text())["done"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return -1


def _kill_when(command: list[str], staging: Path, finished_shards: int, mid_shard: bool) -> bool:
    """Start `command`, SIGKILL it once the journal records `finished_shards` shards (and, if
    `mid_shard`, a half-written shard is on disk). False if it finished first."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while process.poll() is None:
        partial = any(staging.glob("*.partial")) if staging.exists() else False
        if _journal_done(staging) >= finished_shards and (partial or not mid_shard):
            process.send_signal(signal.SIGKILL)
            process.wait()
            return True
        time.sleep(0.001)
    return False


def test_kill_9_then_resume_is_byte_identical(tmp_path):
    spec = SynthSpec(source_format=GPTQ(bits=4, group_size=64, sym=False), layers=6, experts=16, hidden=512,
                     intermediate=256)
    source = make_checkpoint(tmp_path / "src", spec)
    reference = tmp_path / "reference"
    assert subprocess.run([EXE, "convert", str(source), "-o", str(reference), "-q", "--max-shard-size", "3MB"],
                          timeout=300).returncode == 0
    shards = len(list(reference.glob("*.safetensors")))
    assert shards >= 5

    out = tmp_path / "out"
    staging = staging_folder(out)
    command = [EXE, "convert", str(source), "-o", str(out), "-q", "--max-shard-size", "3MB"]
    kills = 0
    for finished, mid in ((0, True), (2, False), (3, True), (shards - 1, False)):
        kills += _kill_when(command, staging, finished, mid)
        assert not out.exists()  # nothing that looks finished
    assert kills >= 2, "the conversion finished before it could be interrupted"
    resumed = subprocess.run(command + ["--json"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["resumed_files"]
    assert not staging.exists()
    assert _files(out) == _files(reference)


def test_resume_with_other_arguments_refuses(tmp_path):
    source = make_checkpoint(tmp_path / "src", SynthSpec(layers=4, experts=16, hidden=256, intermediate=128))
    out = tmp_path / "out"
    staging = staging_folder(out)
    command = [EXE, "convert", str(source), "-o", str(out), "-q", "--max-shard-size", "300KB"]
    assert _kill_when(command, staging, 1, mid_shard=False)
    done = subprocess.run([EXE, "convert", str(source), "-o", str(out), "-q", "--max-shard-size", "400KB"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "an unfinished conversion with a different max_shard_size is there" in done.stderr
    assert staging.exists()  # the user's partial work is not thrown away


def test_interrupt_exit_code_3(tmp_path):
    source = make_checkpoint(tmp_path / "src", SynthSpec(layers=8, experts=32, hidden=512, intermediate=256))
    process = subprocess.Popen([EXE, "convert", str(source), "-o", str(tmp_path / "out"), "-q"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    staging = staging_folder(tmp_path / "out")
    while not staging.exists() and process.poll() is None:
        time.sleep(0.001)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    if process.returncode == 0:
        pytest.skip("the conversion finished before the interrupt arrived")
    assert process.returncode == 3, stderr
    kept = len(list(staging.glob("*.safetensors")))  # the whole shards the interrupted run left
    assert stderr.strip().splitlines()[-1] == "interrupted (SIGINT): " + (
        f"{kept} finished shard(s) kept in {staging}; run the same command again to finish the conversion from there"
        if kept else "no shard had finished, so nothing is kept; run the same command again to start over"), stderr


def test_python_api_mirrors_the_cli(tmp_path):
    source = make_checkpoint(tmp_path / "src", SynthSpec())
    assert moeconv.inspect(source)["architecture"] == "qwen3_moe"
    report = moeconv.convert(source, tmp_path / "out", max_shard_size=200_000)
    assert report.output == (tmp_path / "out").absolute()
    assert moeconv.verify(tmp_path / "out", level="lossless").ok
