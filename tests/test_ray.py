"""`convert --executor ray`: one Ray task per output shard, on a local Ray of two CPUs. The output
must be byte-identical to the local executor's, survive a worker killed mid-task, resume after the
driver is killed, and report an input error once, as one line."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import moeconv
from moeconv.api import plan as make_plan
from moeconv.checkpoint.reader import open_checkpoint
from moeconv.errors import MoeconvError
from moeconv.formats import GPTQ
from moeconv.synth import SynthSpec, make_checkpoint

from helpers import reseal, run_main

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


def _files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def _module_ray():
    """Shuts down, at the module's end, the Ray that `local_ray` started."""
    yield
    ray.shutdown()


@pytest.fixture
def local_ray(_module_ray):
    """A local Ray of two CPUs owned by this test process (starting one takes seconds, so it is kept
    between tests, and started again after a test that needed none); convert joins it. So the code
    under test never starts, and never shuts down, a Ray inside pytest's own process: a Ray driver whose
    raylet goes away while its IPC is busy exits its process at once (exit 1, nothing printed), which
    took the whole suite down with it on CI."""
    import logging

    if not ray.is_initialized():
        ray.init(num_cpus=2, object_store_memory=100 * 2**20, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.ERROR)


@pytest.fixture
def no_ray():
    """No Ray in this process, for the tests of addresses that must not join one."""
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A checkpoint whose output has several shards (150 kB each at most)."""
    return make_checkpoint(tmp_path_factory.mktemp("ray") / "src",
                           SynthSpec(source_format=GPTQ(4, 32, sym=False), hidden=256, intermediate=128,
                                     experts=8, layers=3), max_shard_size=400_000)


def _local(source: Path, folder: Path, backend: str = "triton", max_shard_size: int = 150_000) -> Path:
    moeconv.convert(source, folder, backend=backend, max_shard_size=max_shard_size, workers=1)
    return folder


@pytest.mark.parametrize("backend", ["triton", "humming"])
def test_ray_writes_the_bytes_the_local_executor_writes(local_ray, source, tmp_path, backend):
    on_ray = moeconv.convert(source, tmp_path / "ray", backend=backend, max_shard_size=150_000, executor="ray")
    assert on_ray.device.startswith("ray: the Ray cluster (1 node, 2 CPUs)")
    assert len(on_ray.files) > 3
    assert _files(tmp_path / "ray") == _files(_local(source, tmp_path / "local", backend))


def test_verify_on_ray_checks_every_expert(local_ray, source, tmp_path):
    _local(source, tmp_path / "out", "humming")
    report = moeconv.verify(tmp_path / "out", level="lossless", executor="ray")
    assert report.ok and sum(layer.experts_checked for layer in report.layers) == 3 * 8
    entry = open_checkpoint(tmp_path / "out").tensors["model.layers.1.mlp.experts.3.down_proj.weight"]
    with open(entry.file, "r+b") as handle:  # one nibble of one expert, the manifest digest made to match
        handle.seek(entry.begin + entry.nbytes // 2)
        byte = handle.read(1)[0]
        handle.seek(entry.begin + entry.nbytes // 2)
        handle.write(bytes([byte ^ 0x10]))
    reseal(tmp_path / "out", entry.file)  # as if the writer itself had put the wrong byte
    damaged = moeconv.verify(tmp_path / "out", level="lossless", executor="ray")
    assert not damaged.ok and not damaged.structure_problems
    failed = {layer.module: layer.lossless_failures for layer in damaged.layers if layer.lossless_failures}
    assert list(failed) == ["model.layers.1.mlp.experts"]
    assert failed["model.layers.1.mlp.experts"][0].startswith("expert 3 down")


def _dies_once(plan, index, staging):
    """A task body whose first attempt at the shard with the most jobs kills its own worker process
    after writing that shard's first job."""
    target = max(range(len(plan.shards)), key=lambda number: len(plan.shards[number].jobs))
    attempts = Path(staging).parent / f"attempts-{index}"
    with open(attempts, "a") as record:
        record.write("x")
    if index == target and attempts.read_text() == "x":
        convert_module = importlib.import_module("moeconv.conversion")
        real, jobs = convert_module._run_job, []

        def run_then_die(*args):
            jobs.append(1)
            if len(jobs) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args)

        convert_module._run_job = run_then_die
    return importlib.import_module("moeconv.conversion").convert_shard_alone(plan, index, staging)


def test_a_worker_killed_mid_task_is_retried_to_the_same_bytes(local_ray, source, tmp_path):
    from moeconv import distributed

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the task body lives in this file
    plan = make_plan(source, max_shard_size=150_000)
    report = importlib.import_module("moeconv.conversion").convert(
        plan, tmp_path / "ray", executor=distributed.RayShards(_dies_once))
    target = max(range(len(plan.shards)), key=lambda number: len(plan.shards[number].jobs))
    assert len(plan.shards[target].jobs) > 2
    attempts = {number: (tmp_path / f"attempts-{number}").read_text() for number in range(len(plan.shards))}
    assert attempts == {number: "xx" if number == target else "x" for number in attempts}  # killed, retried once
    assert len(report.files) == len(plan.shards)
    assert _files(tmp_path / "ray") == _files(_local(source, tmp_path / "local"))


def test_an_input_error_in_a_task_is_one_line(local_ray, source, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in source.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    shard = sorted(broken.glob("*.safetensors"))[-1]
    with open(shard, "r+b") as handle:  # the last shard's data cut short: found only when a task reads it
        handle.truncate(shard.stat().st_size - 64)
    code, _, err = run_main(capsys, "convert", broken, "-o", tmp_path / "out", "--executor", "ray", "-q",
                            "--max-shard-size", "150KB")
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and shard.name in err
    assert not (tmp_path / "out").exists()


def _whole_shards(staging: Path) -> set[str]:
    """The shards under their final names in the staging folder (a shard is renamed there only when whole)."""
    return {path.name for path in staging.glob("*.safetensors")} if staging.is_dir() else set()


def _journaled(journal: Path) -> int:
    try:
        return len(json.loads(journal.read_text())["done"])
    except (OSError, ValueError, KeyError):
        return -1


def _settled(staging: Path) -> set[str]:
    """The whole shards once the tasks that outlived a killed driver have stopped adding any (1 s
    without a new one, 10 s at most)."""
    seen, quiet_since, deadline = _whole_shards(staging), time.monotonic(), time.monotonic() + 10
    while time.monotonic() - quiet_since < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
        now = _whole_shards(staging)
        if now != seen:
            seen, quiet_since = now, time.monotonic()
    return seen


@pytest.mark.parametrize("kill", ["group", "driver"])
def test_a_driver_killed_at_several_points_resumes_to_the_same_bytes(no_ray, source, tmp_path, kill):
    """kill -9 of the driver while its first shard is being written, after two are journaled and with
    one left, each rerun killed in turn, then a last rerun: the same bytes as one uninterrupted run. No
    Ray in this process (a driver would join it through address="auto", and killing the group would
    then leave it alone): each driver starts its own local Ray, as a user's would. `driver`: kill -9 of
    the driver alone, its local Ray left to die: its tasks outlive it (seen here: they finish their
    shard), so each rerun must keep what they finished (their records) and never take their temporary
    files for its own."""
    command = [sys.executable, "-m", "moeconv", "convert", str(source), "-o", str(tmp_path / "out"), "-q",
               "--executor", "ray", "--max-shard-size", "50KB", "--json"]
    shards = len(make_plan(source, max_shard_size=50_000).shards)
    assert shards >= 6
    staging = tmp_path / ".out.moeconv-partial"
    journal = staging / "moeconv-progress.json"
    stages = [("its first shard being written", lambda: _journaled(journal) == 0 and any(staging.glob("*.partial"))),
              ("two shards journaled", lambda: _journaled(journal) >= 2),
              ("one shard left", lambda: _journaled(journal) >= shards - 1)]
    whole = set()
    for stage, reached in stages:
        driver = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and driver.poll() is None and not reached():
            time.sleep(0.01)
        if driver.poll() is not None:
            pytest.fail(f"the driver ended before {stage}: {driver.communicate()[1].decode()[-500:]}")
        try:
            if kill == "group":
                os.killpg(driver.pid, signal.SIGKILL)
            else:
                os.kill(driver.pid, signal.SIGKILL)
            driver.wait()
            whole = _settled(staging)
        finally:
            try:  # what the killed driver's Ray left running (it shares the driver's process group)
                os.killpg(driver.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads(resumed.stdout)
    assert report["device"].startswith("ray:")
    assert len(whole) >= shards - 1 and whole <= set(report["resumed_files"])  # none finished was written again
    assert _files(tmp_path / "out") == _files(_local(source, tmp_path / "local", max_shard_size=50_000))


def test_an_unreachable_ray_address_is_one_line(no_ray, tmp_path, source, capsys):
    code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "--executor", "ray",
                            "--ray-address", "127.0.0.1:1", "-q")
    assert code == 2 and "--ray-address 127.0.0.1:1: no Ray cluster reachable there" in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_malformed_ray_address_is_one_line(tmp_path, source, capsys):
    code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "--executor", "ray",
                            "--ray-address", "headnode", "-q")
    assert code == 2 and "--ray-address headnode: give the head node's HOST:PORT" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_ray_missing_is_one_line(tmp_path, source, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if `pip install 'moeconv[ray]'` had not been run
    code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "--executor", "ray", "-q")
    assert code == 2 and "--executor ray needs Ray: pip install 'moeconv[ray]'" in err, err
    assert len(err.strip().splitlines()) == 1


def test_an_unknown_executor_is_refused(source, tmp_path):
    with pytest.raises(MoeconvError, match="--executor threads: choose local or ray"):
        moeconv.convert(source, tmp_path / "out", executor="threads")


def _breaks(plan, index, staging):
    """A task body with a bug."""
    raise ZeroDivisionError("division by zero")


def _dies(plan, index, staging):
    """A task body whose worker dies at every attempt (as when its raylet is gone)."""
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("body, expected", [(_breaks, "a Ray task failed: ZeroDivisionError: division by zero"),
                                            (_dies, "Ray could not finish a task: WorkerCrashedError")])
def test_an_unexpected_failure_in_a_task_is_one_line(local_ray, source, tmp_path, body, expected):
    from moeconv import distributed

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the task body lives in this file
    plan = make_plan(source, max_shard_size=150_000)
    with pytest.raises(MoeconvError) as refusal:
        importlib.import_module("moeconv.conversion").convert(
            plan, tmp_path / "out", executor=distributed.RayShards(body, max_retries=0))
    assert expected in str(refusal.value) and "\n" not in str(refusal.value), str(refusal.value)
    assert not (tmp_path / "out").exists()
    assert (tmp_path / ".out.moeconv-partial").is_dir()  # not a refusal: what was finished stays for a resume


@pytest.mark.parametrize("address, expected", [
    ("http://127.0.0.1:8265", "give the head node's HOST:PORT, or a Ray client address ray://HOST:PORT"),
    ("ray://127.0.0.1:1", "--ray-address ray://127.0.0.1:1: no Ray cluster reachable there"),
])
def test_a_client_or_url_ray_address_is_one_line(no_ray, tmp_path, source, capsys, address, expected):
    code, _, err = run_main(capsys, "convert", source, "-o", tmp_path / "out", "--executor", "ray",
                            "--ray-address", address, "-q")
    assert code == 2 and expected in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
