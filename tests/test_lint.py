"""The linter is part of the test command: ruff, with the rules pyproject.toml selects ([tool.ruff]:
unused and undefined names, bugbear, bare excepts, shadowed builtins), over the whole tree."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> str:
    try:
        from ruff.__main__ import find_ruff_bin
    except ImportError:
        pytest.fail("ruff is not installed: pip install -e '.[test]'", pytrace=False)
    return find_ruff_bin()


def test_ruff_finds_nothing_in_the_tree():
    done = subprocess.run([_ruff(), "check", "--no-cache", "--output-format", "concise", str(ROOT)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_catches_what_it_is_configured_for(tmp_path):
    """The configuration is the one that runs (an undefined name, a mutable default and a bare except in a
    file under the tree's settings are each reported), so a clean run above means something."""
    sample = tmp_path / "sample.py"
    sample.write_text("def f(x=[]):\n    try:\n        return y\n    except:\n        return x\n")
    done = subprocess.run([_ruff(), "check", "--no-cache", "--output-format", "concise", "--config",
                           str(ROOT / "pyproject.toml"), str(sample)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    for code in ("F821", "B006", "E722"):
        assert code in done.stdout, done.stdout
