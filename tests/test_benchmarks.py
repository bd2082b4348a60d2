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
    ("bench_convert.py", ["--workdir", "{tmp}"]),
    ("bench_plan.py", []),
    ("bench_ray.py", ["--workdir", "{tmp}"]),
    ("bench_startup.py", ["--workdir", "{tmp}"]),
])
def test_benchmark_smoke(tmp_path, script, extra):
    output = tmp_path / "result.json"
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in extra]
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--json", str(output), *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert json.loads(output.read_text())
