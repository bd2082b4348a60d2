"""The Python API, mirroring the CLI: `moeconv.inspect`, `moeconv.convert`, `moeconv.verify`.

Each takes what the command takes and returns what the command prints with `--json`; user errors
raise `moeconv.errors.MoeconvError` (exit_code 2) and a failed verification is a report with
`ok == False` (the CLI turns it into exit code 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from moeconv.checkpoint.reader import Checkpoint, open_checkpoint
from moeconv.conversion import ConvertReport
from moeconv.conversion import convert as _execute
from moeconv.inspection import inspect_checkpoint
from moeconv.plan import DEFAULT_MAX_SHARD_SIZE, Plan, make_plan
from moeconv.source import resolve_source
from moeconv.storage import is_object_url, refuse_mangled_url

if TYPE_CHECKING:  # verify's module imports Triton (its reference kernels), which convert does not need
    from moeconv.verification import VerifyReport


def open_source(source: str | Path, revision: str | None = None, local_files_only: bool = False) -> Checkpoint:
    """A local folder, a Hub id (`org/model`, optionally at `revision`) or an object store URL
    (`s3://bucket/prefix`: read by ranges, nothing downloaded whole), read as headers."""
    resolved = resolve_source(source, revision=revision, local_files_only=local_files_only)
    return open_checkpoint(resolved.path, origin=resolved.origin)


def inspect(source: str | Path, *, revision: str | None = None, local_files_only: bool = False,
            tp: int = 1, casts: bool = False) -> dict[str, Any]:
    """What a checkpoint is, as `moeconv inspect --json` prints it: architecture, the format the config
    declares and the one the tensors show (with the evidence and any disagreement), experts, sizes,
    and per-backend eligibility at tensor-parallel size `tp`. Reads headers and a sample of tensors;
    `source` may be an object store URL (`s3://bucket/prefix`), whose files are read by range requests
    with the credentials of the store's standard environment (AWS_ACCESS_KEY_ID, ..., AWS_ENDPOINT_URL).
    `casts`: for float codes, the census of each cast (casts.py), which reads every expert linear."""
    return inspect_checkpoint(open_source(source, revision, local_files_only), tp=tp, casts=casts)


def plan(source: str | Path, *, backend: str = "triton", revision: str | None = None,
         local_files_only: bool = False, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, trust: str | None = None,
         tp: int = 1, regroup: bool = False, zero_format: str | None = None, cast: str | None = None,
         allow_inexact: bool = False) -> Plan:
    """backend: a backend name or "auto". trust: None (refuse when tensors and config disagree, or when
    the data cannot decide), "config" or "data". tp: tensor-parallel size to check eligibility for.
    regroup: allow a lossless halving of the group size when that makes the backend fit. zero_format:
    "gptq" (v1) or "gptq_v2" for an asymmetric GPTQ source whose data cannot tell them apart. cast: "bf16",
    "fp8-block" or "nvfp4" (backends.CASTS): the float codes cast to that code instead of a backend's layout; allow_inexact:
    write it even where the census finds inexact blocks (else convert refuses)."""
    return make_plan(open_source(source, revision, local_files_only), backend=backend,
                     max_shard_size=max_shard_size, trust=trust, tp=tp, regroup=regroup, zero_format=zero_format,
                     cast=cast, allow_inexact=allow_inexact)


def convert(source: str | Path, output: str | Path, *, backend: str = "triton", revision: str | None = None,
            local_files_only: bool = False, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
            trust: str | None = None, tp: int = 1, regroup: bool = False, zero_format: str | None = None,
            progress: Callable[[int], None] | None = None, workers: int | None = None,
            executor: str = "local", ray_address: str | None = None,
            skip_unsafe_files: bool = False, cast: str | None = None, allow_inexact: bool = False) -> ConvertReport:
    """Convert (resuming an interrupted run with the same arguments) and return the report.
    workers: processes that transform experts (default: one per core, at most 16; on the CPU: a GPU
    path measured slower and was removed, docs/BENCHMARKS.md). executor: "local", or "ray" (one Ray task per output shard, on the cluster at `ray_address`, the
    one Ray finds, or a local Ray; the same bytes). skip_unsafe_files: leave out source files that
    link outside the source folder (listed in the report) instead of refusing. cast, allow_inexact: as for
    `plan`; an inexact cast not allowed is refused (MoeconvError, exit code 2) before anything is written."""
    conversion = plan(source, backend=backend, revision=revision, local_files_only=local_files_only,
                      max_shard_size=max_shard_size, trust=trust, tp=tp, regroup=regroup, zero_format=zero_format,
                      cast=cast, allow_inexact=allow_inexact)
    return _execute(conversion, output if is_object_url(str(output)) else Path(output), progress=progress,
                    workers=workers, executor=executor,
                    ray_address=ray_address, skip_unsafe_files=skip_unsafe_files)


def verify(output: str | Path, *, source: str | Path | None = None, sample: int | None = None,
           level: str | None = None, tokens: int = 8, numerics_layers: int | None = None, workers: int | None = None,
           executor: str = "local", ray_address: str | None = None) -> VerifyReport:
    """Checks a folder written by `convert` (structure and sha256, bit-exact decode against the source,
    kernel numerics; `level` stops after "structure" or "lossless"; None, the default, runs the kernel on a
    sample of the MoE layers on a CPU, "numerics" on every layer) and returns the report; `report.ok`
    is the verdict. `source` (a folder or a Hub
    id) defaults to the one recorded in the output's manifest; a different checkpoint is refused.
    workers / executor / ray_address: where the bit-exact checks run, as for `convert`."""
    from moeconv.verification import verify as _verify

    refuse_mangled_url(output, "OUT")
    if source is not None:
        refuse_mangled_url(source, "--source")
    return _verify(output, source=source, sample=sample, level=level, tokens=tokens,
                   numerics_layers=numerics_layers, workers=workers, executor=executor, ray_address=ray_address)
