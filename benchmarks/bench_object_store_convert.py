"""S3 in -> S3 out (issue 43): `moeconv convert s3://... -o s3://...` against the same server's raw copy of the
same objects through the same library (obstore: each object got whole, then put in multipart parts), and
the folder -> folder conversion of the same checkpoint, on one SeaweedFS server started here
(tests/s3_server.py: `weed server -s3` on loopback, the same machine). Prints one JSON object.

    .venv/bin/python benchmarks/bench_object_store_convert.py [--layers 96] [--workers 2] [--work DIR]

The source: a synthetic GPTQ checkpoint (4 layers of 16 experts, hidden 512) grown to `--layers` layers by
benchmarks/grow_checkpoint.py (the layers repeated byte for byte: the converter's work per byte does not
depend on the values), in 100 MB shards.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from grow_checkpoint import grow  # noqa: E402
from s3_server import S3Server  # noqa: E402

from moeconv.synth import SynthSpec, make_checkpoint  # noqa: E402


def raw_copy(environment: dict[str, str], source: str, target: str) -> float:
    """Every object under `source` copied to `target` through obstore (a get of the whole object, then a
    multipart put in the 64 MiB parts moeconv uploads with); its seconds."""
    os.environ.update(environment)
    import obstore
    from obstore.store import from_url

    from moeconv.storage import PART_BYTES, PARTS_AT_ONCE

    reading, writing = from_url(source + "/"), from_url(target + "/")
    started = time.perf_counter()
    for entry in reading.list_with_delimiter()["objects"]:
        data = obstore.get(reading, entry["path"]).bytes()  # one object in memory (a get cannot stream into a
        obstore.put(writing, entry["path"], data, chunk_size=PART_BYTES,  # put of the sync API: nested runtimes)
                    max_concurrency=PARTS_AT_ONCE)
    return time.perf_counter() - started


def converted(environment: dict[str, str], source: str, target: str, workers: int) -> dict:
    clean = {key: value for key, value in os.environ.items() if not key.startswith("AWS_")}
    result = subprocess.run([sys.executable, "-m", "moeconv", "convert", source, "-o", target, "--json", "-q",
                             "--workers", str(workers), "--max-shard-size", "100MB"],
                            capture_output=True, text=True, env={**clean, **environment}, cwd=ROOT, check=False)
    if result.returncode:
        raise SystemExit(result.stderr)
    return json.loads(result.stdout)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("--smoke", action="store_true", help="4 layers: the test suite's run")
    arguments = parser.parse_args()
    if arguments.smoke:
        arguments.layers = 4
    work = Path(tempfile.mkdtemp(dir=arguments.work))
    small = make_checkpoint(work / "small", SynthSpec(layers=4, experts=16, hidden=512, intermediate=512))
    grow(small, work / "src", arguments.layers, 100_000_000)
    source_bytes = sum(path.stat().st_size for path in (work / "src").iterdir())
    with S3Server(work / "s3") as server:
        url = server.upload_folder("models", "src", work / "src")
        server.put("out", "README", b"benchmark outputs\n")
        environment = {**server.environment(), "XDG_CACHE_HOME": str(work / "cache")}
        copy_seconds = raw_copy(environment, url, "s3://out/raw-copy")
        stored = converted(environment, url, "s3://out/converted", arguments.workers)
        local = converted(environment, str(work / "src"), str(work / "local"), arguments.workers)
        verify_started = time.perf_counter()
        verified = subprocess.run([sys.executable, "-m", "moeconv", "verify", "s3://out/converted", "--level",
                                   "lossless", "-q", "--workers", str(arguments.workers)], capture_output=True,
                                  text=True, cwd=ROOT, env={**{k: v for k, v in os.environ.items()
                                                              if not k.startswith("AWS_")}, **environment})
        verify_seconds = time.perf_counter() - verify_started
    megabytes = source_bytes / 1e6
    result = {
        "source_bytes": source_bytes, "shards": len(list((work / "src").glob("*.safetensors"))),
        "output_bytes": sum(path.stat().st_size for path in (work / "local").iterdir()),
        "raw_copy_s3_to_s3": {"seconds": round(copy_seconds, 2), "MB_per_s": round(megabytes / copy_seconds, 1)},
        "convert_s3_to_s3": {"seconds": stored["seconds"], "MB_per_s": round(megabytes / stored["seconds"], 1),
                             "tree_peak_pss_mb": stored["tree_peak_pss_mb"], "peak_rss_mb": stored["peak_rss_mb"]},
        "convert_folder_to_folder": {"seconds": local["seconds"], "MB_per_s": round(megabytes / local["seconds"], 1),
                                     "tree_peak_pss_mb": local["tree_peak_pss_mb"]},
        "verify_lossless_s3": {"seconds": round(verify_seconds, 2), "exit": verified.returncode},
        "workers": arguments.workers, "cores": os.cpu_count(),
    }
    print(json.dumps(result, indent=2))
    if arguments.json:
        arguments.json.write_text(json.dumps(result) + "\n")
    if verified.returncode:
        raise SystemExit(f"verify of the S3 output failed: {verified.stderr[-2000:]}")


if __name__ == "__main__":
    main()
