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
