"""Shared test helpers: build a synthetic checkpoint, convert it, run the CLI in-process."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from moeconv.cli import app
from moeconv.synth import SynthSpec, make_checkpoint

runner = CliRunner()


def synth(path: Path, **fields) -> Path:
    return make_checkpoint(path, SynthSpec(**fields), max_shard_size=fields.pop("max_shard_size", 150_000))


def cli(*args: str):
    """Invoke the CLI in-process, rendering MoeconvError the way `moeconv` (cli.main) does."""
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=True)
