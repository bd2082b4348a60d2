"""What a newcomer meets first: the report lines that say what a checkpoint is and what to do next."""

from __future__ import annotations

import json
import threading

from moeconv.formats import CompressedTensors
from moeconv.synth import SynthSpec, make_checkpoint

from helpers import run_main


def test_w8a8_format_evidence_reads_as_evidence_not_a_failure(tmp_path, capsys):
    """int-quantized W8A8 stores unpacked int8 weights: nothing to infer from packing, and inspect says the
    headers are what the config says, while every backend stays eligible."""
    source = make_checkpoint(tmp_path / "src", SynthSpec(source_format=CompressedTensors(
        format="int-quantized", bits=8, group_size=-1, activation_bits=8)))
    code, out, err = run_main(capsys, "inspect", source, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["detection"]["evidence"] == [
        "weight I8[64, 128], weight_scale F16[64, 1] for a 64x128 linear: the headers are what the config's "
        "compressed-tensors int-quantized W8A8 says (unpacked weights: no packing or zero points in the data to "
        "cross-check)"]
    assert all(verdict["eligible"] for verdict in report["backends"].values()), report["backends"]


def test_the_python_api_example_runs_every_backend(tmp_path, capsys):
    """examples/python_api.py, as the README describes it, on a smaller model of the same kind."""
    import dataclasses
    import importlib.util
    from pathlib import Path

    from moeconv.backends import REGISTRY

    path = Path(__file__).parents[1] / "examples" / "python_api.py"
    spec = importlib.util.spec_from_file_location("python_api", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(tmp_path, dataclasses.replace(example.SPEC, layers=1, experts=4, hidden=128, intermediate=64))
    lines = capsys.readouterr().out.splitlines()
    ran = [line.split(":")[0] for line in lines if "verify ok" in line]
    assert ran == list(REGISTRY) and "compressed-tensors" in ran, lines


def _tensor_bytes(folder) -> int:
    """The tensor data bytes of a folder's safetensors files: each file less its 8-byte length and header."""
    import struct

    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as handle:
            (header,) = struct.unpack("<Q", handle.read(8))
        total += path.stat().st_size - 8 - header
    return total


def test_verify_progress_counts_what_each_phase_says(tmp_path, capsys):
    """--level structure: digests (the output's file bytes), then tensor-digests (the output's tensor
    bytes). Above it: lossless (the output's file bytes and the source's shard bytes hashed, and the source
    tensor bytes compared: for triton every source tensor, experts decoded, the rest byte-compared; the
    digests' thread may advance it too), then kernel (one per MoE layer checked). Each phase advances to its total."""
    from moeconv.verification import verify

    source = make_checkpoint(tmp_path / "src", SynthSpec())
    assert run_main(capsys, "convert", source, "-o", tmp_path / "out", "-q")[0] == 0
    phases, done, threads = [], {}, set()

    def progress(amount, total=None, phase=None):
        if total is not None:
            phases.append((phase, total))
            done[phase] = 0
        else:
            done[phases[-1][0]] += amount
            threads.add((phases[-1][0], threading.current_thread().name))

    output_files = sum(path.stat().st_size for path in (tmp_path / "out").iterdir())
    source_shards = sum(path.stat().st_size for path in source.glob("*.safetensors"))
    assert verify(tmp_path / "out", progress=progress, level="structure").ok
    assert phases == [("digests", output_files), ("tensor-digests", _tensor_bytes(tmp_path / "out"))]
    assert done == dict(phases)
    phases.clear()
    done.clear()
    assert verify(tmp_path / "out", progress=progress, numerics_layers=1).ok
    assert phases == [("lossless", output_files + source_shards + _tensor_bytes(source)), ("kernel", 1)]
    assert done == dict(phases)
    # this thread gathers the checks' results; the digests, begun before the plan, advance it from their own
    # thread, unless they finished before the phase began (their progress is then passed on from this one)
    assert "MainThread" in {name for phase, name in threads if phase == "lossless"}
    assert {name for phase, name in threads if phase == "lossless"} <= {"moeconv-digests", "MainThread"}


def test_verify_times_each_phase_and_what_comes_before(tmp_path):
    """`phase_seconds`: `prepare` (the manifest, both checkpoints, the plan, the structure checks), then each
    phase of the level, and inside lossless its parts; every one a duration, none longer than verify took."""
    import time

    from moeconv.api import convert
    from moeconv.verification import verify

    source = make_checkpoint(tmp_path / "src", SynthSpec())
    convert(source, tmp_path / "out", workers=1)
    for level, phases in (("structure", {"prepare", "digests", "tensor-digests"}),
                          ("lossless", {"prepare", "lossless", "pass-through", "workers-start", "checks", "digests",
                                        "source-digests"})):
        started = time.perf_counter()
        report = verify(tmp_path / "out", level=level, workers=1)
        took = time.perf_counter() - started
        assert report.ok and set(report.phase_seconds) == phases, (level, report.phase_seconds)
        assert all(0 <= seconds <= took for seconds in report.phase_seconds.values()), report.phase_seconds
        assert report.phase_seconds["prepare"] > 0


def test_verify_report_says_what_ran_and_ends_with_the_verdict(tmp_path, capsys):
    source = make_checkpoint(tmp_path / "src", SynthSpec())
    assert run_main(capsys, "convert", source, "-o", tmp_path / "cpu", "--backend", "cpu", "-q")[0] == 0
    code, out, _ = run_main(capsys, "verify", tmp_path / "cpu", "--level", "structure", "-q")
    assert code == 0 and "0/0" not in out and "tolerance" not in out and "not run (--level structure)" in out
    assert out.splitlines()[-1] == ("verdict: ok (structure and digests; --level structure); caveat: the tensors' "
                                    "bytes are self-consistent; not compared with the source (--level lossless "
                                    "compares them)")
    code, out, _ = run_main(capsys, "verify", tmp_path / "cpu", "-q")
    flat = " ".join(out.split())
    assert code == 0 and "rel err = ||out - ref|| / ||ref||, against a float64 reference of the source, is what is " \
                         "checked (<= 0.06); max abs is the largest single difference, for scale: the reference's " \
                         "outputs reach |ref| =" in flat, out
    shards = len(list(source.glob("*.safetensors")))
    assert out.splitlines()[-1] == (f"verdict: ok (structure and digests, {shards} source shard(s) as recorded, "
                                    f"8 expert(s) in 2 MoE layer(s) bit-exact against the source, kernel within 0.06 "
                                    f"on 2 layer(s); --level numerics)")
