"""The benchmark scripts and examples run (tiny shapes, CPU): they are part of the product, not dead code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("script, extra", [
    ("bench_kernel.py", []),
    ("bench_int8_kernel.py", []),
    ("bench_convert.py", ["--workdir", "{tmp}", "--verify"]),
    ("bench_plan.py", []),
    ("bench_plan.py", ["--declared", "--workdir", "{tmp}"]),
    ("bench_ray.py", ["--workdir", "{tmp}"]),
    ("bench_startup.py", ["--workdir", "{tmp}"]),
    pytest.param("bench_object_store_convert.py", ["--work", "{tmp}"], marks=pytest.mark.skipif(
        not (Path(sys.executable).parent / "weed").is_file(), reason="no `weed` binary: no S3 server")),
])
def test_benchmark_smoke(tmp_path, script, extra):
    output = tmp_path / "result.json"
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in extra]
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--json", str(output), *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert json.loads(output.read_text())


def test_bench_builds_exports_a_commit_and_compares_it(tmp_path):
    """benchmarks/bench_builds.py: this checkout's HEAD exported, then run on a tiny source with only that
    build on the path; the row carries the build's own report."""
    from moeconv.synth import SynthSpec, make_checkpoint

    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    script = str(ROOT / "benchmarks" / "bench_builds.py")
    builds, output = tmp_path / "builds", tmp_path / "result.json"
    done = subprocess.run([sys.executable, script, "export", "HEAD", "--into", str(builds)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0 and (builds / "HEAD" / "moeconv" / "cli.py").is_file(), done.stderr
    source = make_checkpoint(tmp_path / "src", SynthSpec(hidden=128, intermediate=64, experts=4, layers=1))
    done = subprocess.run([sys.executable, script, "run", str(source), "--builds", str(builds), "--repeats", "1",
                           "--workers", "2", "--scratch", str(tmp_path / "scratch"), "--verify", "--json", str(output)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(output.read_text())
    assert row["build"] == "HEAD" and row["backend"] == "triton" and row["conversion_seconds"] > 0
    assert row["verify_seconds"] > 0  # the script refuses a failed verify (exit 1), so this one passed
    assert row["verify_cpu_seconds"] > 0


def test_a_grown_checkpoint_repeats_the_layers_and_converts_and_verifies(tmp_path):
    """benchmarks/grow_checkpoint.py: layer i of the grown checkpoint is layer i % L of the source, byte
    for byte (read through safetensors, not the script's own reading), and it converts and verifies."""
    from safetensors.numpy import load_file

    from moeconv.api import convert, verify
    from moeconv.synth import SynthSpec, make_checkpoint

    source = make_checkpoint(tmp_path / "src", SynthSpec(hidden=128, intermediate=64, experts=4, layers=2))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "grow_checkpoint.py"), str(source),
                           str(tmp_path / "grown"), "--layers", "5", "--shard-gb", "0.0002"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    grown = tmp_path / "grown"
    assert len(list(grown.glob("*.safetensors"))) > 1
    assert json.loads((grown / "config.json").read_text())["num_hidden_layers"] == 5
    original = {name: array for shard in source.glob("*.safetensors") for name, array in load_file(shard).items()}
    repeated = {name: array for shard in grown.glob("*.safetensors") for name, array in load_file(shard).items()}
    origin = {name: name for name in original if not name.startswith("model.layers.")}
    for layer in range(5):
        prefix = f"model.layers.{layer % 2}."
        origin.update({f"model.layers.{layer}." + name[len(prefix):]: name for name in original
                       if name.startswith(prefix)})
    assert set(repeated) == set(origin)
    for name, array in repeated.items():
        assert array.dtype == original[origin[name]].dtype and array.tobytes() == original[origin[name]].tobytes(), name
    convert(grown, tmp_path / "out", backend="triton", workers=2)
    assert verify(tmp_path / "out", level="lossless", workers=2).ok


@pytest.mark.skipif(sys.platform != "linux", reason="/proc")
def test_tree_memory_splits_the_peak_between_the_command_and_its_children(tmp_path):
    """A command that forks one child holding 120 MB of its own: the peak sample shows one other process
    with that memory, and the command's own PSS without it."""
    holder = ("import os, time\n"
              "if os.fork() == 0:\n"
              "    held = bytearray(120 << 20)\n"
              "    held[::4096] = b'x' * len(held[::4096])\n"
              "    time.sleep(1.5)\n"
              "    os._exit(0)\n"
              "os.wait()\n")
    output = tmp_path / "tree.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tree_memory.py"), "--interval", "0.1",
                           "--json", str(output), "--", sys.executable, "-c", holder],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    peak = json.loads(output.read_text())["peak_sample"]
    assert peak["others"] == 1
    assert 115 < peak["others_private_dirty_mb"] < 160, peak
    assert peak["command_pss_mb"] < 60, peak
    assert abs(peak["tree_pss_mb"] - peak["command_pss_mb"] - peak["others_pss_mb"]) < 0.5, peak


@pytest.mark.parametrize("command", [[], ["--", "/nonexistent/program"]])
def test_tree_memory_without_a_runnable_command_is_one_line_exit_2(command):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tree_memory.py"), *command],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2 and done.stderr.splitlines()[-1].startswith("tree_memory.py: error: "), done.stderr
    assert "Traceback" not in done.stderr


def test_hub_cache_lays_a_folder_out_as_a_snapshot_that_converts_anchored(tmp_path):
    """benchmarks/hub_cache.py: a checkpoint as a huggingface_hub cache snapshot (the benchmarks' anchored
    source): huggingface_hub's own cache scan reads it, moeconv anchors it to the digests hashlib gives."""
    import hashlib

    from huggingface_hub import scan_cache_dir

    from moeconv.provenance import anchor_of
    from moeconv.synth import SynthSpec, make_checkpoint

    source = make_checkpoint(tmp_path / "src", SynthSpec(layers=1, experts=2, hidden=64, intermediate=32,
                                                        dense_intermediate=64, vocab=64))
    expected = {path.name: path.read_bytes() for path in source.iterdir()}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hub_cache.py"), str(source), str(tmp_path / "cache"),
                           "--repo", "acme/grown", "--move"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    snapshot = Path(done.stdout.strip())
    assert not any(source.iterdir())  # moved, not copied
    anchor = anchor_of(snapshot)
    assert (anchor.repo, anchor.revision) == ("acme/grown", snapshot.name)
    assert anchor.published == {name: ("sha256", hashlib.sha256(data).hexdigest()) if name.endswith(".safetensors")
                                else ("git_sha1", hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest())
                                for name, data in expected.items()}
    [repository] = scan_cache_dir(tmp_path / "cache").repos
    assert repository.repo_id == "acme/grown" and {rev.commit_hash for rev in repository.revisions} == {snapshot.name}
    assert {path.name: path.read_bytes() for path in snapshot.iterdir()} == expected


def test_profile_cpu_puts_verify_s_unpacking_in_its_bucket(tmp_path):
    """benchmarks/profile_cpu.py: every command of every backend asked for profiled, its buckets found by name (a
    renamed function would leave its bucket at zero: verify lossless always unpacks the source's codes)."""
    from moeconv.synth import SynthSpec, make_checkpoint

    source = make_checkpoint(tmp_path / "src", SynthSpec(hidden=128, intermediate=64, experts=4, layers=1))
    output = tmp_path / "profile.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_cpu.py"), str(source), "--backends",
                           "triton,humming", "--workdir", str(tmp_path), "--json", str(output)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    rows = json.loads(output.read_text())
    assert [(row["backend"], row["command"]) for row in rows] == [
        ("triton", "convert"), ("triton", "verify"), ("humming", "convert"), ("humming", "verify")]
    for row in rows:
        assert row["process_cpu_s"] > 0 and row["wall_s"] > 0
        if row["command"] == "verify":
            assert row["unpack codes"] > 0 and row["read (pread into arrays)"] > 0 and row["write (pwrite)"] == 0
        else:
            assert row["write (pwrite)"] > 0 and row["resume fingerprint (CRC-32)"] > 0

def test_the_float_source_is_compressed_tensors_mxfp4_and_its_grown_copy_benchmarks(tmp_path):
    """benchmarks/float_source.py writes llm-compressor's MXFP4A16 layout (the fixture ct-mxfp4a16's tensors and
    config, at the sizes asked), grow_checkpoint.py repeats its layer, and bench_convert.py converts the grown
    source into compressed-tensors and verifies it, labelling the row by the source's own format."""
    from safetensors import safe_open

    one, grown, output = tmp_path / "one", tmp_path / "grown", tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "float_source.py"), str(one), "--experts", "4",
                           "--hidden", "256", "--intermediate", "128", "--vocab", "64"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    config = json.loads((one / "config.json").read_text())
    assert config["quantization_config"]["format"] == "mxfp4-pack-quantized" and config["num_local_experts"] == 4
    tensors = {}
    for shard in one.glob("*.safetensors"):
        with safe_open(str(shard), "np") as handle:
            tensors.update({name: handle.get_slice(name) for name in handle.keys()})
    prefix = "model.layers.0.mlp.experts.3.down_proj"
    assert (tensors[f"{prefix}.weight_packed"].get_dtype(), tensors[f"{prefix}.weight_packed"].get_shape()) == (
        "U8", [256, 64])
    assert (tensors[f"{prefix}.weight_scale"].get_dtype(), tensors[f"{prefix}.weight_scale"].get_shape()) == (
        "U8", [256, 4])
    assert tensors["model.layers.0.mlp.gate.weight"].get_dtype() == "BF16"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "grow_checkpoint.py"), str(one), str(grown),
                           "--layers", "3"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_convert.py"), "--smoke", "--source",
                           str(grown), "--workdir", str(tmp_path / "work"), "--backends", "compressed-tensors",
                           "--verify", "--json", str(output)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(output.read_text())
    assert row["format"] == "mxfp4-pack-quantized" and row["layers"] == 3 and row["verify_ok"] is True
