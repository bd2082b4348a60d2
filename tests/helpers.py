"""Shared test helpers: build a synthetic checkpoint, convert it, run the CLI in-process."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import blake3
import pytest
from typer.testing import CliRunner

from moeconv.cli import app
from moeconv.synth import SynthSpec, make_checkpoint

runner = CliRunner()

ROOT = Path(__file__).resolve().parents[1]
# The real quantizers' environment (scripts/install-packers.sh); its stamp is written last.
PACKERS_VENV = Path(os.environ.get("MOECONV_PACKERS_VENV", ROOT / ".venv-packers"))


def packers_python() -> Path:
    """The real packers' interpreter. Without it the calling test fails (CI must have it), unless
    MOECONV_SKIP_PACKERS=1 asks to skip."""
    if os.environ.get("MOECONV_SKIP_PACKERS") == "1":
        pytest.skip("MOECONV_SKIP_PACKERS=1")
    python = PACKERS_VENV / "bin" / "python"
    if not (python.exists() and (PACKERS_VENV / ".packers-installed").exists()):
        pytest.fail(f"the real packers' environment {PACKERS_VENV} is missing or incomplete: run "
                    "scripts/install-packers.sh (or set MOECONV_SKIP_PACKERS=1 to skip these tests)", pytrace=False)
    return python


def synth(path: Path, **fields) -> Path:
    """A synthetic checkpoint of SynthSpec(**fields), in shards of at most `max_shard_size` bytes."""
    max_shard_size = fields.pop("max_shard_size", 150_000)  # not a SynthSpec field: taken out first
    return make_checkpoint(path, SynthSpec(**fields), max_shard_size=max_shard_size)


def cli(*args: str):
    """Invoke the CLI in-process, rendering MoeconvError the way `moeconv` (cli.main) does."""
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=True)


def run_main(capsys, *args) -> tuple[int, str, str]:
    """Run the console entry point (`moeconv ARGS`) in-process: (exit code, stdout, stderr)."""
    import sys

    from moeconv.cli import main

    argv, sys.argv = sys.argv, ["moeconv", *map(str, args)]
    try:
        main()
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code if isinstance(exit_info.code, int) else 1
    finally:
        sys.argv = argv
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def convert_refusal(capsys, source, output, *args) -> str:
    """`moeconv convert SOURCE -o OUTPUT ARGS` that must stop: a non-zero exit, one `error:` line on stderr (no
    traceback), nothing at OUTPUT; the line."""
    code, _, err = run_main(capsys, "convert", source, "-o", output, *args)
    (line,) = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and line.startswith("error: ") and "Traceback" not in err, err
    assert not Path(output).exists()
    return line


HASHES = {"blake3": lambda data: blake3.blake3(data).digest(),  # manifest version 4
          "sha256": lambda data: hashlib.sha256(data).digest()}  # manifest version 3


def tree(folder: Path) -> dict[str, str]:
    """Every entry under `folder` (links not followed): a file's sha256, a link's target, a folder's kind,
    another entry's (a FIFO, never opened) mode."""
    found = {}
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder))
        if path.is_symlink():
            found[name] = f"-> {os.readlink(path)}"
        elif path.is_dir():
            found[name] = "folder"
        elif path.is_file():
            found[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            found[name] = f"mode {path.lstat().st_mode:o}"
    return found


def blocks_digest(data: bytes, block: int, hash_name: str = "blake3") -> str:
    """The manifest's file digest written out from its definition in docs/FORMAT.md, with the hash libraries
    themselves: the hash over the concatenated hashes of each block (one empty block for an empty file)."""
    hash_of = HASHES[hash_name]
    pieces = [data[start:start + block] for start in range(0, max(len(data), 1), block)]
    return hash_of(b"".join(hash_of(piece) for piece in pieces)).hex()


def shard_digest_of(data: bytes, block: int = 64 << 20, hash_name: str = "blake3") -> str:
    """An output shard's digest written out from its definition in docs/FORMAT.md (manifest version 3 with
    sha256, 4 with BLAKE3): the hash over the hash of the bytes before the first tensor's data, then each
    tensor's block digest (64 MiB pieces from its first byte) as 32 bytes, in the order of the tensors'
    offsets; the tensors must cover every byte after the header."""
    ranges = sorted(tensor_ranges(data).values())
    data_start = 8 + int.from_bytes(data[:8], "little")
    assert [begin for begin, _ in ranges] == [data_start] + [end for _, end in ranges[:-1]]
    assert (ranges[-1][1] if ranges else data_start) == len(data)
    hash_of = HASHES[hash_name]
    parts = [hash_of(data[:data_start])]
    parts += [bytes.fromhex(blocks_digest(data[begin:end], block, hash_name)) for begin, end in ranges]
    return hash_of(b"".join(parts)).hex()


def tensor_ranges(data: bytes) -> dict[str, tuple[int, int]]:
    """Each tensor's absolute byte range in a safetensors file's bytes, read from its header here (8-byte
    little-endian length, JSON, data_offsets from the end of the header)."""
    import json

    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    return {name: (8 + length + info["data_offsets"][0], 8 + length + info["data_offsets"][1])
            for name, info in header.items() if name != "__metadata__"}


def reseal(folder: Path, *changed: Path, edit=None) -> None:
    """Record the changed files' new sizes and digests in the folder's moeconv.json (after `edit(manifest)`,
    if given), and the manifest's own digest, as a writer that is consistent but wrong, or an attacker,
    would: only a comparison with the source can then notice."""
    import json

    from moeconv.checkpoint.manifest import SELF_DIGEST_KEY, self_digest

    path = folder / "moeconv.json"
    manifest = json.loads(path.read_text())
    if edit is not None:
        edit(manifest)
    for file in changed:
        section = next(key for key in ("files", "metadata_files", "copied_files") if file.name in manifest[key])
        if section == "files":  # a shard: its digest and its tensors'
            data = file.read_bytes()
            manifest[section][file.name] = {"bytes": len(data), "blake3_header_and_tensors": shard_digest_of(data)}
            manifest[section][file.name]["tensor_digests"] = {
                name: blocks_digest(data[begin:end], 64 << 20) for name, (begin, end) in tensor_ranges(data).items()}
        else:
            manifest[section][file.name] = {"bytes": file.stat().st_size,
                                            "blake3_64mib_blocks": blocks_digest(file.read_bytes(), 64 << 20)}
    manifest[SELF_DIGEST_KEY] = self_digest(manifest)
    path.write_text(json.dumps(manifest))


def converted_weights(output: Path, source: Path, backend: str, trust: str | None = None) -> dict:
    """Every converted linear of an output (its plan's expert and dense-linear jobs), decoded with the
    backend, by source prefix: the canonical weights the output holds, to compare with a producer's own."""
    from moeconv.checkpoint.reader import TensorReader, open_checkpoint
    from moeconv import transform
    from moeconv.plan import make_plan
    from moeconv.worklist import CopyJob, LinearJob

    plan = make_plan(source, backend=backend, trust=trust)
    converted = open_checkpoint(output)
    found = {}
    with TensorReader() as reader:
        for job in plan.jobs:
            if isinstance(job, CopyJob):
                continue
            blocks = {suffix: reader.read_raw_slice(converted.tensors[slot.tensor.name], slot.offset, slot.shape)
                      for suffix, slot in job.slots.items()}
            decoded = transform.decode(job, plan.codec, blocks)
            if isinstance(job, LinearJob):
                found[job.prefix] = decoded["linear"]
            else:
                for projection, linear in job.sources.items():
                    found[next(iter(linear.values())).key.rsplit(".", 1)[0]] = decoded[projection]
    return found
