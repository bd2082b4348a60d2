"""The fixed cost of `moeconv convert`: a whole process converting a tiny checkpoint, with and without
bytecode caches.

    python benchmarks/bench_startup.py [--repeats 5] [--workdir bench-data] [--json out.json]

Modes, each a fresh `python -m moeconv convert TINY -o OUT -q` process (and a `python -m moeconv
inspect TINY`), run in turn so that a change of load hits every mode alike; the median of each is
reported, wall and CPU seconds (user + system of the process and the workers it waited for), with
`python -c "import torch"` in the same mode for scale:
- `warm`: the bytecode caches as they are (moeconv's and the environment's `.pyc` files).
- `no-moeconv-pyc`: a fresh copy of the `moeconv` package without `__pycache__`, run with
  PYTHONDONTWRITEBYTECODE=1, so moeconv's own modules are compiled from source every time; the
  environment's (torch's) bytecode is still used.
- `no-pyc`: as `no-moeconv-pyc`, and PYTHONPYCACHEPREFIX set to an empty folder, so no `.pyc` file
  is found anywhere and every module (torch's too) is compiled from source every time: what an image
  that sets PYTHONDONTWRITEBYTECODE and ships no bytecode pays on every run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from moeconv.synth import SynthSpec, make_checkpoint

ROOT = Path(__file__).resolve().parent.parent
MODES = ("warm", "no-moeconv-pyc", "no-pyc")


def environment(mode: str, workdir: Path) -> dict[str, str]:
    """The child's environment for `mode` (its PYTHONPATH puts the package copy first where asked)."""
    env = dict(os.environ)
    if mode == "warm":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        return env
    copy = workdir / "package"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(ROOT / "moeconv", copy / "moeconv", ignore=shutil.ignore_patterns("__pycache__"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(copy), env.get("PYTHONPATH")]))
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if mode == "no-pyc":
        prefix = workdir / "empty-pycache-prefix"
        shutil.rmtree(prefix, ignore_errors=True)
        prefix.mkdir(parents=True)
        env["PYTHONPYCACHEPREFIX"] = str(prefix)
    return env


def timed(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child and its waited-for descendants)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{command} failed: {done.stderr}")
    return seconds, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=Path("bench-data"))
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--workers", default="", help="comma-separated --workers values (default: moeconv's own)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--smoke", action="store_true", help="one repeat of the warm mode (checks the script runs)")
    args = parser.parse_args()
    modes = ("warm",) if args.smoke else tuple(mode for mode in args.modes.split(",") if mode)
    if set(modes) - set(MODES):
        parser.error(f"--modes: expected some of {', '.join(MODES)}")
    repeats = 1 if args.smoke else args.repeats
    workdir = args.workdir.absolute() / "startup"
    source = workdir / "tiny"
    if not (source / "config.json").is_file():
        make_checkpoint(source, SynthSpec(hidden=128, intermediate=64, experts=4, layers=1))
    envs = {mode: environment(mode, workdir) for mode in modes}
    out = workdir / "out"
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(repeats):
        for mode in modes:
            for workers in [w for w in args.workers.split(",") if w] or [""]:
                shutil.rmtree(out, ignore_errors=True)
                command = [sys.executable, "-m", "moeconv", "convert", str(source), "-o", str(out), "-q",
                           *(["--workers", workers] if workers else [])]
                runs.setdefault((mode, workers or "default"), []).append(timed(command, envs[mode]))
            runs.setdefault((mode, "inspect"), []).append(
                timed([sys.executable, "-m", "moeconv", "inspect", str(source)], envs[mode]))
            runs.setdefault((mode, "import torch"), []).append(
                timed([sys.executable, "-c", "import torch"], envs[mode]))
    shutil.rmtree(out, ignore_errors=True)
    results = [{"date": time.strftime("%Y-%m-%d"),
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
                "load_average_at_end": os.getloadavg()[0], "mode": mode, "what": what,
                "median_seconds": round(statistics.median(wall for wall, _ in times), 3),
                "median_cpu_seconds": round(statistics.median(cpu for _, cpu in times), 3),
                "runs": [round(wall, 3) for wall, _ in times], "cpu_runs": [round(cpu, 3) for _, cpu in times]}
               for (mode, what), times in runs.items()]
    for result in results:
        command = {"import torch": "python -c 'import torch'", "inspect": "inspect tiny"}.get(
            result["what"], f"convert tiny, --workers {result['what']}")
        print(f"| {result['date']} | {result['mode']} | {command} | {result['median_seconds']:.2f} s "
              f"({', '.join(f'{t:.2f}' for t in result['runs'])}) | {result['median_cpu_seconds']:.2f} s "
              f"({', '.join(f'{t:.2f}' for t in result['cpu_runs'])}) |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
