"""A checkpoint folder laid out as a snapshot of a huggingface_hub cache, so that a benchmark measures a
conversion and a verify anchored to what a publisher published (moeconv.provenance), without the Hub.

    python benchmarks/hub_cache.py SOURCE CACHE [--repo org/name] [--move]

Writes huggingface_hub's documented cache layout: `CACHE/models--ORG--NAME/blobs/DIGEST` (the sha256 of a
`.safetensors` file's bytes, as the Hub publishes for an LFS file; the git blob id of any other file),
`snapshots/COMMIT/NAME` a relative link to its blob, `refs/main` the commit; the commit is made up (the
sha1 of the listing). Prints the snapshot folder: `moeconv convert SNAPSHOT` records the anchor, and its
output's verify says "source anchored to ORG/NAME@COMMIT". `--move` moves the files into the blobs
instead of copying them (a 25 GB source on a 64 GB disk). The digests are taken with hashlib, several
files at once; a file of 25 GB takes a few seconds a GB on one core.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_READ = 8 << 20


def published_digest(path: Path) -> str:
    """What the Hub publishes for a file: an LFS file's sha256 (safetensors shards), else its git blob id."""
    if path.suffix == ".safetensors":
        digest = hashlib.sha256()
    else:
        digest = hashlib.sha1(usedforsecurity=False)
        digest.update(b"blob %d\0" % path.stat().st_size)
    with path.open("rb", buffering=0) as handle:
        while chunk := handle.read(_READ):
            digest.update(chunk)
    return digest.hexdigest()


def lay_out(source: Path, cache: Path, repo: str, move: bool = False) -> Path:
    """`source`'s files as a snapshot of `repo` in `cache`; the snapshot folder."""
    files = sorted(path for path in source.iterdir() if path.is_file())
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:  # hashlib releases the GIL
        digests = dict(zip(files, pool.map(published_digest, files)))
    commit = hashlib.sha1("\n".join(f"{path.name} {digest}" for path, digest in digests.items()).encode()).hexdigest()
    repository = cache / f"models--{repo.replace('/', '--')}"
    blobs, snapshot = repository / "blobs", repository / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for path, digest in digests.items():
        blob = blobs / digest
        if not blob.exists():
            (shutil.move if move else shutil.copyfile)(path, blob)
        link = snapshot / path.name
        link.unlink(missing_ok=True)
        link.symlink_to(Path("..", "..", "blobs", digest))
    (repository / "refs").mkdir(exist_ok=True)
    (repository / "refs" / "main").write_text(commit)
    return snapshot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path)
    parser.add_argument("cache", type=Path)
    parser.add_argument("--repo", default="bench/grown-moe")
    parser.add_argument("--move", action="store_true", help="move the files into the blobs instead of copying them")
    args = parser.parse_args()
    started = time.perf_counter()
    snapshot = lay_out(args.source, args.cache, args.repo, args.move)
    print(f"laid out in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    print(snapshot)


if __name__ == "__main__":
    main()
