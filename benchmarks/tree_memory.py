"""Where a command's memory is: every process of its tree sampled from /proc (Linux) while it runs.

    python benchmarks/tree_memory.py [--interval 0.25] [--json out.json] -- moeconv convert SRC -o OUT ...

At each sample, each process's smaps_rollup: RSS, PSS (its private pages plus its share of each shared
one, so that summed over processes every page counts once), anonymous PSS, private and shared dirty
pages. Reported: the sample where the tree's summed PSS peaked, split into the command's own process
and the others (workers, fork server, resource tracker): count, summed PSS, the largest PSS, and the
summed private dirty and anonymous PSS; and each field's peak over the run for the command's process.
`convert --json` reports the same peak (TreeMemory) but not its split.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from moeconv.executor import descendants

FIELDS = ("Rss", "Pss", "Pss_Anon", "Private_Dirty", "Shared_Dirty")


def rollup(pid: int) -> dict[str, float] | None:
    """A process's smaps_rollup fields in MB (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            found = {}
            for line in handle:
                key, _, rest = line.partition(":")
                if key in FIELDS:
                    found[key] = int(rest.split()[0]) / 1024
            return found
    except (OSError, ValueError, IndexError):
        return None


def split(command_pid: int, sample: dict[int, dict[str, float]]) -> dict[str, float]:
    """One sample as the command's process and the rest of its tree."""
    own = sample.get(command_pid, {})
    others = [fields for pid, fields in sample.items() if pid != command_pid]
    return {
        "tree_pss_mb": round(sum(fields.get("Pss", 0.0) for fields in sample.values()), 1),
        "command_pss_mb": round(own.get("Pss", 0.0), 1),
        "command_rss_mb": round(own.get("Rss", 0.0), 1),
        "command_private_dirty_mb": round(own.get("Private_Dirty", 0.0), 1),
        "others": len(others),
        "others_pss_mb": round(sum(fields.get("Pss", 0.0) for fields in others), 1),
        "others_largest_pss_mb": round(max((fields.get("Pss", 0.0) for fields in others), default=0.0), 1),
        "others_private_dirty_mb": round(sum(fields.get("Private_Dirty", 0.0) for fields in others), 1),
        "others_pss_anon_mb": round(sum(fields.get("Pss_Anon", 0.0) for fields in others), 1),
        "others_shared_dirty_mb": round(sum(fields.get("Shared_Dirty", 0.0) for fields in others), 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=0.25)
    parser.add_argument("--json", type=str, default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    started = time.perf_counter()
    try:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    except OSError as error:
        parser.error(f"cannot run {command[0]}: {error.strerror}")
    peak: dict[str, float] = {}
    command_peaks: dict[str, float] = {}
    samples = 0
    while process.poll() is None:
        sample = {pid: fields for pid in [process.pid, *descendants(process.pid)] if (fields := rollup(pid))}
        if sample:
            samples += 1
            now = split(process.pid, sample)
            if now["tree_pss_mb"] > peak.get("tree_pss_mb", -1.0):
                peak = {**now, "at_seconds": round(time.perf_counter() - started, 2)}
            for key, value in sample.get(process.pid, {}).items():
                command_peaks[key] = round(max(command_peaks.get(key, 0.0), value), 1)
        time.sleep(args.interval)
    result = {"command": command, "exit": process.returncode, "seconds": round(time.perf_counter() - started, 2),
              "samples": samples, "peak_sample": peak, "command_peaks_mb": command_peaks}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return process.returncode


if __name__ == "__main__":
    sys.exit(main())
