"""Only the workers import torch (issue 27): the parts of `convert`'s parent process that plan, journal,
hash and write take none, and neither do the help screens.

Still importing torch in the parent: `moeconv.spec` builds its torch dtype tables at import, and the
plan (`plan.py`, `detect.py`, the formats and backends it asks for shapes and reads a data sample
with) imports torch at module level; `inspect` and `convert --dry-run` detect the format from data
with torch. Those are being split out (plan.py into a torch-free work list and the workers'
transform). The second test below holds the line for the modules already done: it builds spec's
tables first, then makes torch unimportable and imports the rest.
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
# block hasher, the header reader, the journal and manifest, the audits' totals.
PARENT_MODULES = ["moeconv.convert", "moeconv.executor", "moeconv.checkpoint.reader", "moeconv.checkpoint.writer",
                  "moeconv.checkpoint.manifest", "moeconv.checkpoint.side_files", "moeconv.audit"]
BLOCKED = f"""
import sys
import moeconv.spec  # its dtype tables still import torch (see the module docstring)
for name in [name for name in sys.modules if name == "torch" or name.startswith("torch.")]:
    del sys.modules[name]
sys.modules["torch"] = None  # from here on, `import torch` raises ImportError
for module in {PARENT_MODULES!r}:
    __import__(module)
print("imported without torch")
"""


def test_the_convert_parents_own_modules_import_without_torch():
    done = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "imported without torch", done.stderr
