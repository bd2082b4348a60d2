"""Compare builds of moeconv on one source: which commit made the conversion slower, and where.

    python benchmarks/bench_builds.py export COMMIT... [--into .builds]
    python benchmarks/bench_builds.py run SRC [--builds .builds] [--backends triton] [--workers N]
        [--repeats 2] [--verify] [--json out.json]

`export` writes each commit's `moeconv/` package to `.builds/COMMIT/` (git archive), so that the
builds can travel to a machine without the repository's history. `run` converts SRC with every build
in turn (round-robin, so that a drifting page cache or a busy neighbour hits every build alike), each a
fresh `python -m moeconv convert` process with only that build on its path, after a `cp -r` + `sync`
of SRC in the same round (the copied files fsynced: `sync FILE...`, as bench_convert.py). Per row: the whole process's wall time, the conversion as the build reports
it, and the CPU seconds of the process and every process below it that it waited for (getrusage), beside
the tree CPU seconds the build reports itself where it does (a fork server's workers are not waited for
by the process): CPU seconds show added work even where the cores hide it. With --verify, each output is
then verified (`verify --level lossless`, whole process, the same build): its seconds, CPU seconds and phases.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def export(commits: list[str], into: Path) -> None:
    for commit in commits:
        target = into / commit
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", commit, "moeconv"], check=True, stdout=subprocess.PIPE).stdout
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
        print(f"exported {commit} -> {target}")


def timed(command: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the child and its waited descendants, stdout)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout


def run(source: Path, builds: Path, backends: list[str], workers: str, repeats: int, scratch: Path,
        verify: bool = False) -> list[dict]:
    names = sorted(path.name for path in builds.iterdir() if (path / "moeconv").is_dir())
    if not names:
        raise SystemExit(f"{builds}: no exported builds (run `export` first)")
    scratch.mkdir(parents=True, exist_ok=True)
    copy_target, output = scratch / "copy", scratch / "out"
    samples: dict[tuple[str, str], list[dict]] = {}
    for repeat in range(repeats):
        for backend in backends:
            for name in names:
                for earlier in (copy_target, output):  # the disk may hold the source and one of them only
                    shutil.rmtree(earlier, ignore_errors=True)
                copy_wall, _, _ = timed(["sh", "-c", f"cp -r '{source}' '{copy_target}' && sync '{copy_target}'/*"])
                shutil.rmtree(copy_target, ignore_errors=True)
                env = dict(os.environ, PYTHONPATH=str((builds / name).resolve()))
                command = [sys.executable, "-m", "moeconv", "convert", str(source.resolve()), "-o", str(output.resolve()),
                           "--backend", backend, "-q", "--json"]
                if workers:
                    command += ["--workers", workers]
                wall, cpu, stdout = timed(command, env=env, cwd=scratch)  # cwd: no other moeconv on the path
                report = json.loads(stdout)
                row = {"build": name, "backend": backend, "repeat": repeat, "copy_seconds": round(copy_wall, 3),
                       "process_seconds": round(wall, 3), "conversion_seconds": report.get("seconds"),
                       "cpu_seconds": round(cpu, 2), "tree_cpu_seconds": report.get("tree_cpu_seconds"),
                       "tree_peak_pss_mb": report.get("tree_peak_pss_mb")}
                if verify:
                    # a failed verify exits 1, which `timed` refuses
                    wall, cpu, stdout = timed([sys.executable, "-m", "moeconv", "verify", str(output.resolve()), "--level",
                                               "lossless", "-q", "--json"], env=env, cwd=scratch)
                    row["verify_seconds"], row["verify_cpu_seconds"] = round(wall, 3), round(cpu, 2)
                    row["verify_phase_seconds"] = json.loads(stdout)["phase_seconds"]
                print(json.dumps(row), flush=True)
                samples.setdefault((name, backend), []).append(row)
    shutil.rmtree(output, ignore_errors=True)
    summary = []
    def median(rows: list[dict], key: str) -> float | None:
        values = [row[key] for row in rows if row.get(key) is not None]
        return round(statistics.median(values), 3) if values else None

    for (name, backend), rows in samples.items():
        summary.append({"build": name, "backend": backend, "runs": len(rows), "copy_seconds": median(rows, "copy_seconds"),
                        "process_seconds": median(rows, "process_seconds"),
                        "conversion_seconds": median(rows, "conversion_seconds"), "cpu_seconds": median(rows, "cpu_seconds"),
                        "tree_cpu_seconds": median(rows, "tree_cpu_seconds"),
                        "tree_peak_pss_mb": median(rows, "tree_peak_pss_mb"),
                        "verify_seconds": median(rows, "verify_seconds"),
                        "verify_cpu_seconds": median(rows, "verify_cpu_seconds")})
    print("| build | backend | copy + sync | process | conversion | CPU s (waited) | tree CPU s (reported) | tree PSS MB "
          "| verify | verify CPU s (waited) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in summary:
        print(f"| {row['build']} | {row['backend']} | {row['copy_seconds']} | {row['process_seconds']} | "
              f"{row['conversion_seconds']} | {row['cpu_seconds']} | {row['tree_cpu_seconds']} | {row['tree_peak_pss_mb']} | {row['verify_seconds']} | "
              f"{row['verify_cpu_seconds']} |")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    exporting = commands.add_parser("export")
    exporting.add_argument("commits", nargs="+")
    exporting.add_argument("--into", type=Path, default=Path(".builds"))
    running = commands.add_parser("run")
    running.add_argument("source", type=Path)
    running.add_argument("--builds", type=Path, default=Path(".builds"))
    running.add_argument("--backends", default="triton")
    running.add_argument("--workers", default="")
    running.add_argument("--repeats", type=int, default=2)
    running.add_argument("--scratch", type=Path, default=Path("/tmp/moeconv-bench-builds"))
    running.add_argument("--verify", action="store_true", help="also time verify --level lossless of each output")
    running.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.command == "export":
        export(args.commits, args.into)
        return
    summary = run(args.source, args.builds, args.backends.split(","), args.workers, args.repeats, args.scratch, args.verify)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
