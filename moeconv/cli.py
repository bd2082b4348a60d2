"""The `moeconv` command line: parses, calls the library, renders with Rich. Nothing else.

Results go to stdout, progress and errors to stderr. Exit codes: 0 ok, 1 verification failed,
2 usage or input error, 3 interrupted (convert: run the same command again to resume).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Optional

import typer
from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn, TransferSpeedColumn)

from moeconv import render
from moeconv.backends import backend_help, cast_help
from moeconv.errors import MoeconvError, human_bytes, printable
from moeconv.render import err, literal, out


class _Commands(typer.core.TyperGroup):
    """Click's usage errors (a bad or missing option) as one line on stderr and exit code 2, like every
    other error, instead of a usage block and a box."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        args = list(sys.argv[1:] if args is None else args) or ["--help"]  # `moeconv` alone: the help
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except typer.Abort:
            err.print("aborted", highlight=False, markup=False)
            sys.exit(1)
        except typer.TyperException as error:  # Click's usage errors (a ClickException: message, exit_code)
            context = getattr(error, "ctx", None)
            where = f" (see '{context.command_path} --help')" if context is not None else ""
            err.print(printable(f"error: {error.format_message()}{where}"), highlight=False, soft_wrap=True,
                      markup=False)
            sys.exit(error.exit_code)
        sys.exit(code if isinstance(code, int) else 0)


class _Command(typer.core.TyperCommand):
    """Help that names each argument by its metavar (SRC, OUT), as the README does, without Typer's type
    label beside it or braces around it."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        return [self.options_metavar, *(param.metavar or param.name for param in self.get_params(ctx)
                                        if param.param_type_name == "argument")]

    def format_options(self, ctx, formatter) -> None:
        params = self.get_params(ctx)
        arguments = [(param.metavar or param.name, param.help or "") for param in params
                     if param.param_type_name == "argument"]
        options = [record for param in params if param.param_type_name == "option"
                   if (record := param.get_help_record(ctx)) is not None]
        for title, rows in (("Arguments", arguments), ("Options", options)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


app = typer.Typer(
    cls=_Commands,
    name="moeconv",
    help="Convert quantized MoE checkpoints into the layouts serving kernels read, once, offline, verified.",
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        from moeconv._version import __version__

        out.print(f"moeconv {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")) -> None:
    """Convert quantized MoE checkpoints into the layouts serving kernels read, once, offline, verified."""

_SIZE_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
               "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match[2].upper() not in _SIZE_UNITS:
        raise typer.BadParameter(f"{text!r} is not a size like 5GB, 500MB or 1000000")
    return int(float(match[1]) * _SIZE_UNITS[match[2].upper()])


SOURCE = typer.Argument(..., metavar="SRC", help="Checkpoint folder, a Hugging Face id (org/model), or an "
                                                 "object store URL (s3://bucket/prefix, gs://, az://).")
INSPECT_SOURCE = SOURCE
REVISION = typer.Option(None, "--revision", metavar="REV", help="Hub branch, tag or commit (Hub ids only).")
LOCAL_ONLY = typer.Option(False, "--local-files-only", help="Use the Hugging Face cache only, never download.")
EXECUTOR = typer.Option("local", "--executor", metavar="local|ray",
                        help="local: this machine's processes; ray: Ray tasks, one per output shard for convert "
                             "(pip install 'moeconv[ray]'; source and output on storage every node sees).")
RAY_ADDRESS = typer.Option(None, "--ray-address", metavar="HOST:PORT",
                           help="The Ray cluster to join (default: the one Ray finds, else a local Ray, said so).")
TP = typer.Option(1, "--tp", min=1, metavar="N",
                  help="Tensor-parallel size the output will be served with (eligibility checks).")


@app.command(cls=_Command, short_help="Say what a checkpoint is and which backends can take it.")
def inspect(
    source: str = INSPECT_SOURCE,
    revision: Optional[str] = REVISION,
    local_files_only: bool = LOCAL_ONLY,
    tp: int = TP,
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    casts: bool = typer.Option(False, "--casts", help="Float codes (MXFP4, NVFP4): count, per target block, which "
                               "casts to block-FP8, NVFP4 and BF16 would be exact. Reads every expert's codes."),
) -> None:
    """Say what a checkpoint is: architecture, quant format (from the config and from the tensors),
    MoE layers, sizes, and which backends can take it. Reads headers, configs and a few small tensors."""
    from moeconv.api import inspect as inspect_source

    report = inspect_source(source, revision=revision, local_files_only=local_files_only, tp=tp, casts=casts)
    if as_json:
        render.print_json(report)
    else:
        render.print_inspect(report, str(source))


@app.command(cls=_Command, short_help="Convert a checkpoint into a backend's layout.")
def convert(
    source: str = SOURCE,
    output: Optional[str] = typer.Option(None, "-o", "--output", metavar="OUT",
                                         help="Output folder (must not exist, or be empty), or an object store "
                                              "URL (s3://bucket/prefix: an empty prefix of an existing bucket)."),
    backend: str = typer.Option("triton", "--backend", "-b", metavar="NAME", help=backend_help()),
    max_shard_size: int = typer.Option("5GB", "--max-shard-size", parser=parse_size, metavar="SIZE",
                                       help="Most tensor bytes per output shard (as transformers counts), e.g. 5GB, 500MB."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and write nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan (--dry-run) or the report as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    revision: Optional[str] = REVISION,
    local_files_only: bool = LOCAL_ONLY,
    trust_config: bool = typer.Option(False, "--trust-config", help="When tensors and config disagree, follow the config."),
    trust_data: bool = typer.Option(False, "--trust-data", help="When tensors and config disagree, follow the tensors."),
    zero_format: Optional[str] = typer.Option(
        None, "--gptq-zero-format", metavar="v1|v2",
        help="Asymmetric GPTQ whose data cannot tell v1 (stored zero - 1) from v2 (true zeros): which it is."),
    tp: int = TP,
    regroup: bool = typer.Option(False, "--regroup", help="Halve the group size (lossless) where that makes the backend fit."),
    workers: Optional[int] = typer.Option(None, "--workers", min=1, max=64, metavar="N",
                                          help="Processes that transform experts (default: one per core, at most 16)."),
    device: Optional[str] = typer.Option(None, "--device", hidden=True),  # removed: only refused (_removed_device)
    executor: str = EXECUTOR,
    ray_address: Optional[str] = RAY_ADDRESS,
    skip_unsafe_files: bool = typer.Option(False, "--skip-unsafe-files",
                                           help="Leave out (and list) source files that link outside the source "
                                                "folder, instead of refusing."),
    cast: Optional[str] = typer.Option(None, "--cast", metavar="bf16|fp8-block", help=cast_help()),
    allow_inexact: bool = typer.Option(False, "--allow-inexact",
                                       help="With --cast: write even where a block is not exact, and record the "
                                            "census and the worst relative error in moeconv.json."),
) -> None:
    """Convert a checkpoint into a backend's layout (docs/FORMAT.md); what the backend does not convert is
    copied byte for byte. An interrupted conversion resumes when the same command is run again."""
    from moeconv.api import plan as make_plan
    from moeconv.conversion import convert as run_conversion, open_output
    from moeconv.storage import is_object_url

    output = None if output is None else output if is_object_url(output) else Path(output)
    _removed_device(device)
    _quiet_hub(quiet)
    if output is None and not dry_run:
        raise typer.BadParameter("an output folder is required (or --dry-run)", param_hint="'-o' / '--output'")
    if trust_config and trust_data:
        raise typer.BadParameter("choose one of --trust-config and --trust-data", param_hint="'--trust-data'")
    trust = "config" if trust_config else "data" if trust_data else None
    zero_format = _zero_format(zero_format)
    with _interrupted_conversion(None if dry_run else output):
        if not dry_run:
            open_output(output).check()  # a link, a file, a full folder or a finished output: refused before any work
        plan = make_plan(source, backend=backend, max_shard_size=max_shard_size, revision=revision,
                         local_files_only=local_files_only, trust=trust, tp=tp, regroup=regroup,
                         zero_format=zero_format, cast=cast, allow_inexact=allow_inexact)
        if plan.choice:
            err.print(literal(plan.choice), highlight=False, soft_wrap=True)
        for note in render.detection_notes(plan):
            err.print(literal(note), highlight=False, soft_wrap=True)
        if dry_run:
            summary = plan.summary()
            if as_json:
                render.print_json(summary)
            else:
                render.print_plan(summary)
                render.print_next_steps(plan, output or Path("OUT"), converted=False)
            return
        if plan.cast is not None and not quiet:
            err.print(literal(f"--cast {plan.cast}: taking the census of every float-coded linear first (each is read "
                              f"once for it, then again to write); an inexact block stops here unless --allow-inexact"),
                      highlight=False, soft_wrap=True)
        with _progress("converting", plan.checkpoint.total_bytes, quiet) as advance:
            report = run_conversion(plan, output, progress=advance, workers=workers, executor=executor,
                                    ray_address=ray_address, skip_unsafe_files=skip_unsafe_files)
    for name, reason in report.skipped_files.items():
        err.print(literal(f"note: {name} not copied: {reason}"), highlight=False, soft_wrap=True)
    if as_json:
        render.print_json(report.to_json())
        return
    rows = [
        ("output", report.output),
        ("backend", f"{plan.backend.name} (layout v{plan.backend.layout_version})"),
        ("resumed", f"{len(report.resumed_files)} finished shard(s) kept" if report.resumed_files else "no"),
        ("MoE layers", len(plan.layers)),
        ("shards", len(report.files)),
        ("bytes in / out", f"{human_bytes(plan.checkpoint.total_bytes)} / {human_bytes(plan.output_bytes)}"),
        ("ran on", report.device),
        ("time", f"{report.seconds:.2f} s ({human_bytes(plan.checkpoint.total_bytes / max(report.seconds, 1e-9))}/s)"),
        ("peak memory", render.memory_line(report)),
    ]
    if report.cast is not None:
        rows.append(("cast", f"{report.cast['label']}: {report.cast['exact']} of {report.cast['blocks']} blocks exact, "
                             f"worst relative error {report.cast['bound']}"))
    rows += render.audit_rows(report.to_json())
    out.print(render.key_values("converted", rows))
    render.print_next_steps(plan, report.output)


# What each verify phase's bar says it counts (moeconv.verification.PHASE_UNITS has the units).
VERIFY_PHASES = {"digests": "verify: digests of the output's files",
                 "tensor-digests": "verify: digests of the output's tensors",
                 "lossless": "verify: digests of both sides and the bit-exact check, bytes read",
                 "kernel": "verify: kernel check, MoE layers"}


# Said before verify's default starts: what it runs, and how to run more or less.
VERIFY_DEFAULT = ("verify: digests, then every tensor bit-exact against the source, then the kernel check: on a "
                  "GPU every MoE layer, on a CPU (about a second an expert) a sample of 4 layers and 4 experts of "
                  "each, named in the verdict; --level numerics runs it on every layer, --level lossless on none")


@contextmanager
def _progress_for_verify(quiet: bool):
    """verify learns each phase's total only when it starts it: `progress(0, total, phase)`, then
    `progress(n)` for each advance. One bar per phase, each counting what its label says."""
    from moeconv.verification import PHASE_UNITS

    state: dict[str, Any] = {}
    with ExitStack() as stack:
        def progress(amount: int, total: int | None = None, phase: str | None = None) -> None:
            if total is not None:
                if "phase" in state:
                    state.pop("phase").close()
                state["phase"] = ExitStack()
                stack.callback(state["phase"].close)
                state["advance"] = state["phase"].enter_context(
                    _progress(VERIFY_PHASES[phase], total, quiet, PHASE_UNITS[phase]))
            elif "advance" in state:
                state["advance"](amount)

        yield progress


def _quiet_hub(quiet: bool) -> None:
    """-q silences huggingface_hub's own bars too (its "Fetching N files", even from the cache): its
    environment switch, read when the library is first imported, which is later (source.py)."""
    if quiet:
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"


@contextmanager
def _progress(description: str, total: int, quiet: bool, unit: str = "bytes"):
    """An `advance(n)` callback (n bytes, or n items of `unit`): a Rich bar (amount, rate, ETA) on a
    terminal; on a pipe or a log, one line every LINE_SECONDS with the same numbers."""
    if quiet:
        yield lambda amount: None
        return
    counted = unit == "bytes"
    if err.is_terminal:
        columns = (DownloadColumn(), TransferSpeedColumn()) if counted else (MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(TextColumn("{task.description}", markup=False), BarColumn(), *columns, TimeRemainingColumn(),
                      console=err, transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield lambda amount: bar.advance(task, amount)
        return
    started, done, last = time.monotonic(), 0, [time.monotonic()]

    def amounts(value: float) -> str:
        return human_bytes(value) if counted else f"{value:.0f}"

    def advance(amount: int) -> None:
        nonlocal done
        done += amount
        now = time.monotonic()
        first = not counted and done == amount  # the first item counted: its rate gives the ETA at once
        if first or now - last[0] >= LINE_SECONDS or done >= total:
            last[0] = now
            rate = done / max(now - started, 1e-9)
            eta = (total - done) / rate if rate else float("inf")
            speed = f"{human_bytes(rate)}/s" if counted else f"{now - started:.0f} s so far"
            err.print(f"{description} {amounts(done)} / {amounts(total)} ({100 * done / max(total, 1):.0f}%), "
                      f"{speed}, ETA {eta:.0f} s", highlight=False, soft_wrap=True, markup=False)

    yield advance


LINE_SECONDS = 5.0


def _removed_device(value: str | None) -> None:
    """`--device cuda` was removed (docs/BENCHMARKS.md says why); `--device cpu`, what always runs, is accepted."""
    if value is not None and value != "cpu":
        raise MoeconvError(f"--device {value}: removed: transforming on the GPU measured 3.4x to 3.7x slower than "
                           f"the CPU workers on a 16-core H200 host and held 10.5 GB of host memory "
                           f"(docs/BENCHMARKS.md); convert runs on the CPU, leave the option out")


def _zero_format(value: str | None) -> str | None:
    """--gptq-zero-format v1|v2 as checkpoint_format spells it."""
    if value is None:
        return None
    formats = {"v1": "gptq", "gptq": "gptq", "v2": "gptq_v2", "gptq_v2": "gptq_v2"}
    if value.lower() not in formats:
        raise typer.BadParameter(f"{value!r}: choose v1 or v2", param_hint="'--gptq-zero-format'")
    return formats[value.lower()]


@app.command(cls=_Command, short_help="Check a converted checkpoint against its source.")
def verify(
    output: str = typer.Argument(..., metavar="OUT", help="A folder (or object store URL) written by "
                                                           "`moeconv convert`."),
    source: Optional[str] = typer.Option(None, "--source", metavar="SRC",
                                         help="Source checkpoint (default: the one in moeconv.json)."),
    sample: Optional[int] = typer.Option(None, "--sample", min=1, metavar="N",
                                         help="Check N random experts per layer, not all."),
    level: Optional[str] = typer.Option(None, "--level", metavar="structure|lossless|numerics",
                                        help="How far to check: structure (files, checksums), lossless (and bit-exact "
                                             "decode against the source), numerics (and the kernel against a float64 "
                                             "reference on every MoE layer). Default: lossless, and the kernel on "
                                             "every layer on a GPU, on a sample of 4 layers on a CPU."),
    tokens: int = typer.Option(8, "--tokens", min=1, metavar="N", help="Random tokens per layer for the kernel check."),
    numerics_layers: Optional[int] = typer.Option(None, "--numerics-layers", min=0, metavar="N",
                                                  help="Kernel check on the first N MoE layers only."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    workers: Optional[int] = typer.Option(None, "--workers", min=1, max=64, metavar="N",
                                          help="Processes that run the bit-exact checks (default: one per core, at most 16)."),
    executor: str = EXECUTOR,
    ray_address: Optional[str] = RAY_ADDRESS,
) -> None:
    """Check a converted checkpoint: structure and checksums, bit-exact decode against the source, and
    the Triton kernel against a float64 reference. Exit code 0 only if every check passes."""
    from moeconv.errors import VerificationFailed
    from moeconv.storage import is_object_url
    from moeconv.verification import verify as run_verification

    # as before, Path-normalised; an object store URL as written (a Path would drop a slash)
    output = output if is_object_url(output) else Path(output)
    source = None if source is None else source if is_object_url(source) else Path(source)
    _quiet_hub(quiet)
    if level is None and not quiet and not as_json:
        err.print(VERIFY_DEFAULT, highlight=False, soft_wrap=True, markup=False)
    with _progress_for_verify(quiet) as progress:
        report = run_verification(output, source=source, sample=sample, level=level, tokens=tokens,
                                  numerics_layers=numerics_layers, progress=progress, workers=workers,
                                  executor=executor, ray_address=ray_address)
    if as_json:
        render.print_json(report.to_json())
    else:
        render.print_verify(report)
    if not report.ok:
        failures = report.failures()
        raise VerificationFailed(f"{output}: {len(failures)} check(s) failed; first: {failures[0]}")


@app.command(cls=_Command, short_help="Make, convert and verify a small synthetic checkpoint.")
def demo(
    workdir: Optional[Path] = typer.Option(None, "--workdir", metavar="DIR",
                                           help="Keep the files here (default: a temporary folder)."),
) -> None:
    """Build a small synthetic GPTQ MoE checkpoint, convert it to the Triton layout and verify it."""
    from moeconv.api import inspect as inspect_source
    from moeconv.conversion import convert as run_conversion
    from moeconv.formats import GPTQ
    from moeconv.plan import make_plan
    from moeconv.synth import SynthSpec, make_checkpoint
    from moeconv.verification import verify as run_verification

    with tempfile.TemporaryDirectory(prefix="moeconv-demo-") as scratch:
        root = Path(workdir or scratch)
        for previous in ("source", "converted"):  # a --workdir used before: the demo owns these two folders
            shutil.rmtree(root / previous, ignore_errors=True)
        spec = SynthSpec(architecture="qwen3_moe", source_format=GPTQ(bits=4, group_size=32, sym=False),
                         layers=3, dense_layers=1, experts=8, hidden=256, intermediate=128)
        source = make_checkpoint(root / "source", spec, max_shard_size=1_000_000)
        kept = "" if workdir else " (a temporary folder, removed when the demo ends: --workdir DIR keeps it)"
        err.print(f"made a synthetic {spec.architecture} checkpoint (GPTQ v1 4-bit asymmetric, g=32): "
                  f"{literal(source)}{kept}")
        render.print_inspect(inspect_source(source), str(source))
        plan = make_plan(source, backend="triton", max_shard_size=1_000_000)
        report = run_conversion(plan, root / "converted")
        err.print(f"converted to the triton layout in {report.seconds:.2f} s: {literal(report.output)}")
        result = run_verification(report.output, numerics_layers=None)
        render.print_verify(result)
        if not result.ok:
            from moeconv.errors import VerificationFailed

            raise VerificationFailed(f"demo: verification failed: {result.failures()[0]}")
        out.print("[bold green]demo ok[/]: every expert bit-exact, kernel within tolerance, "
                  "every other tensor byte-identical.")
        out.print(DEMO_NEXT, highlight=False, soft_wrap=True, markup=False)


DEMO_NEXT = ("next, your own checkpoint: moeconv inspect SRC, then moeconv convert SRC -o OUT --backend auto "
             "(its last lines say how to verify OUT and serve it with vLLM or SGLang)")


def main() -> None:
    """Console entry point: user errors become one line on stderr and a non-zero exit; an interrupt
    anywhere exits 3 with one line. (Usage errors are Click's own: it prints them with the usage line
    and exits 2.) When this process is the command itself, it ends as soon as its output is flushed
    (`_end_now`)."""
    try:
        _main()
    except SystemExit as done:
        if _is_the_command() and "ray" not in sys.modules:  # Ray's own exit handlers stop a local Ray
            _end_now(done.code)
        raise


def _is_the_command() -> bool:
    """Whether this process was started as `moeconv` (the script or `python -m moeconv`), rather than by
    a program that calls main() and goes on (a test, a notebook)."""
    entry = sys.modules.get("__main__")
    spec = getattr(entry, "__spec__", None)
    if spec is not None and spec.name == "moeconv.__main__":
        return True
    return spec is None and Path(getattr(entry, "__file__", None) or "").stem == "moeconv"


def _end_now(code: Any) -> None:
    """Flush and leave without the interpreter's teardown: after `import torch` that teardown alone took
    0.8 to 1.1 s on the dev machine (docs/BENCHMARKS.md), and every file, worker and thread of the
    command is closed, joined or fsynced by then (a local Ray is left to its own exit handlers)."""
    import os

    if isinstance(code, str):  # sys.exit("message"): printed, exit status 1, as the interpreter does
        sys.stderr.write(code + "\n")
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`): nothing more can reach it
            pass
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)


@contextmanager
def _interrupted_conversion(output: Path | None):
    """A conversion into `output` stopped by a signal (or by Ctrl-C in a caller that does not go through
    main()) ends in one line, exit 3, saying what running it again keeps: the shards its journal records
    as finished (a one-shard output, or one stopped before its first shard finished, keeps nothing).
    `output` None (a dry run): nothing is written, main() says so."""
    from moeconv.errors import Interrupted

    try:
        yield
    except (KeyboardInterrupt, Interrupted) as stop:
        if output is None:
            raise
        from moeconv.conversion import finished_shards, staging_folder
        from moeconv.storage import is_object_url

        kept = finished_shards(output)
        where = staging_folder(output)
        if is_object_url(str(output)):  # the shards are in the store; this machine keeps their journal
            where = f"{output} (journaled in {where})"
        again = (f"{len(kept)} finished shard(s) kept in {where}; run the same command again to "
                 f"finish the conversion from there" if kept else
                 "no shard had finished, so nothing is kept; run the same command again to start over")
        which = f" ({stop})" if str(stop) else ""  # the signal's name; Ctrl-C in a caller's process has none
        err.print(f"[bold red]interrupted[/]{which}: {literal(again)}", highlight=False, soft_wrap=True)
        raise typer.Exit(Interrupted.exit_code) from None


def _command_name() -> str:
    """The subcommand on this process's command line (an interrupt outlives Click's context)."""
    return next((arg for arg in sys.argv[1:] if not arg.startswith("-")), "")


def _main() -> None:
    import signal

    from moeconv.errors import Interrupted

    def interrupt(signum, frame):
        raise Interrupted(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        app(prog_name="moeconv")
    except MoeconvError as error:
        err.print(f"[bold red]error:[/] {literal(error)}", highlight=False, soft_wrap=True)
        sys.exit(error.exit_code)
    except Interrupted as interruption:
        changed = "" if _command_name() == "demo" else "nothing was changed; "  # demo remakes its folders
        err.print(f"[bold red]interrupted[/] ({interruption}): {changed}run the command again to start over")
        sys.exit(Interrupted.exit_code)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
