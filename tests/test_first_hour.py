"""What a newcomer meets first: the report lines that say what a checkpoint is and what to do next."""

from __future__ import annotations

import json

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
