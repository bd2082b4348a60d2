"""Only the workers import torch (issue 27): the parts of `convert`'s parent process that plan, journal,
hash and write take none, and neither do the help screens.

Still importing torch in the parent: the plan (`plan.py`, `survey.py`, `detect.py`, `transform.py`'s
`Codec`, the formats and backends it asks for shapes) imports torch at module level, and the
detection from data (GPTQ's v1/v2 statistic, the act-order `g_idx` scan) computes with torch; so do
`inspect` and `convert --dry-run`, and `--workers 1` transforms in the parent by design. The second
test holds the line for the modules already free of it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys
from moeconv.cli import main
sys.argv = ["moeconv", *{args!r}]
try:
    main()
except SystemExit:
    pass
print("torch loaded:", "torch" in sys.modules)
"""


@pytest.mark.parametrize("args", [["convert", "--help"], ["inspect", "--help"], ["verify", "--help"]])
def test_the_help_screens_import_no_torch(args):
    done = subprocess.run([sys.executable, "-c", PROBE.format(args=args)], capture_output=True, text=True,
                          timeout=120)
    assert "Usage: moeconv" in done.stdout and "torch loaded: False" in done.stdout, done.stdout + done.stderr


# The convert parent's own floors: the executor (worker pool, tree memory), the streaming writer and
# block hasher, the header reader, the journal and manifest, the audits' totals, the work list and
# its dtype tables.
PARENT_MODULES = ["moeconv.conversion", "moeconv.executor", "moeconv.checkpoint.reader", "moeconv.checkpoint.writer",
                  "moeconv.checkpoint.manifest", "moeconv.checkpoint.side_files", "moeconv.audit", "moeconv.spec",
                  "moeconv.worklist"]
BLOCKED = f"""
import sys
sys.modules["torch"] = None  # `import torch` raises ImportError
for module in {PARENT_MODULES!r}:
    __import__(module)
print("imported without torch")
"""


def test_the_convert_parents_own_modules_import_without_torch():
    done = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "imported without torch", done.stderr


def test_the_command_ends_without_the_teardown_and_its_output_and_exit_codes_whole(tmp_path):
    """`python -m moeconv` and the `moeconv` script leave through cli._end_now (no interpreter teardown:
    0.8-1.1 s after torch, docs/BENCHMARKS.md): what they printed must still arrive whole, with the exit
    status they meant; a program that calls main() itself (this test process) is never ended by it."""
    import json
    from pathlib import Path

    from moeconv import cli
    from moeconv.synth import SynthSpec, make_checkpoint

    assert not cli._is_the_command()
    source = make_checkpoint(tmp_path / "src", SynthSpec(hidden=128, intermediate=64, experts=4, layers=1))
    done = subprocess.run([sys.executable, "-m", "moeconv", "convert", str(source), "-o", str(tmp_path / "out"),
                           "-q", "--json", "--workers", "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["files"] and (tmp_path / "out" / "moeconv.json").is_file()
    script = Path(sys.executable).with_name("moeconv")
    for command in ([sys.executable, "-m", "moeconv"], [str(script)]):
        done = subprocess.run([*command, "convert", str(source), "-o", str(tmp_path / "out"), "-q"],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and done.stderr.startswith("error: ") and "not empty" in done.stderr, done.stderr
        done = subprocess.run([*command, "inspect", "--help"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.rstrip().endswith("Show this message and exit."), done.stdout
