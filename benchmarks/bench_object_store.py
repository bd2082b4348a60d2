"""Object-store libraries against one S3 server (docs/BENCHMARKS.md): obstore and s3fs, 256 MiB uploaded
multipart, read back in 8 MiB ranges one after another and all at once, and 64 small header reads.
Run with the server's AWS_* variables set (tests/s3_server.py starts one); needs obstore and s3fs."""
import os
import time

import numpy as np
ENDPOINT = os.environ["AWS_ENDPOINT_URL"]
import obstore
from obstore.store import S3Store
import s3fs
size = 256 * 2**20
data = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8).tobytes()
store = S3Store("bench", endpoint=ENDPOINT, region="us-east-1", client_options={"allow_http": True})
fs = s3fs.S3FileSystem(endpoint_url=ENDPOINT)
try: fs.mkdir("bench")
except Exception as e: print("mkdir", e)
def timed(label, f, n=size):
    best = 1e9
    for _ in range(3):
        t = time.perf_counter(); f(); best = min(best, time.perf_counter() - t)
    print(f"{label}: {n / best / 1e6:.0f} MB/s (best of 3, {best:.2f} s)")
timed("obstore put (multipart 16 MiB parts)", lambda: obstore.put(store, "a.bin", memoryview(data), chunk_size=16 * 2**20))
timed("s3fs put (pipe, multipart)", lambda: fs.pipe_file("bench/b.bin", data, block_size=16 * 2**20))
chunk = 8 * 2**20
starts = list(range(0, size, chunk))
def ob_ranges():
    out = obstore.get_ranges(store, "a.bin", starts=starts, lengths=[chunk] * len(starts))
    assert sum(len(b) for b in out) == size
def ob_serial():
    for s in starts: assert len(obstore.get_range(store, "a.bin", start=s, length=chunk)) == chunk
def fs_serial():
    for s in starts: assert len(fs.cat_file("bench/b.bin", start=s, end=s + chunk)) == chunk
def fs_ranges():
    out = fs.cat_ranges(["bench/b.bin"] * len(starts), starts, [s + chunk for s in starts])
    assert sum(len(b) for b in out) == size
timed("obstore get_range, 8 MiB ranges one after another", ob_serial)
timed("s3fs cat_file, 8 MiB ranges one after another", fs_serial)
timed("obstore get_ranges, 8 MiB ranges at once", ob_ranges)
timed("s3fs cat_ranges, 8 MiB ranges at once", fs_ranges)
hs = list(range(0, size, size // 64))
timed("obstore 64 header reads (8 B + 4 KiB)", lambda: [obstore.get_range(store, "a.bin", start=s, length=4104) for s in hs], n=64 * 4104)
timed("s3fs 64 header reads (8 B + 4 KiB)", lambda: [fs.cat_file("bench/b.bin", start=s, end=s + 4104) for s in hs], n=64 * 4104)
