"""Streaming: converting a 1 GB checkpoint keeps the converter's peak RSS under 600 MB."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from moeconv.formats import GPTQ
from moeconv.synth import SynthSpec, make_checkpoint

LIMIT_MB = 600


def test_peak_rss_of_a_1gb_conversion(tmp_path):
    spec = SynthSpec(architecture="qwen3_moe", source_format=GPTQ(bits=4, group_size=128, sym=False),
                     layers=3, experts=128, hidden=2048, intermediate=768, vocab=8192)
    source = make_checkpoint(tmp_path / "src", spec)
    source_bytes = sum(path.stat().st_size for path in source.iterdir())
    assert source_bytes >= 1.0e9
    exe = Path(sys.executable).with_name("moeconv")
    process = subprocess.Popen([str(exe), "convert", str(source), "-o", str(tmp_path / "out"), "--quiet"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, process.stderr.read()
    peak_mb = usage.ru_maxrss / 1024
    print(f"converted {source_bytes / 1e9:.2f} GB with peak RSS {peak_mb:.0f} MB")
    assert peak_mb < LIMIT_MB
    assert sum(path.stat().st_size for path in (tmp_path / "out").glob("*.safetensors")) > 0.9 * source_bytes
