"""The streaming writer's pieces."""

import hashlib

from moeconv.checkpoint.writer import PrefixHasher, sha256_file


def test_prefix_hasher_equals_hashing_the_finished_file(tmp_path):
    path = tmp_path / "f"
    data = bytes(range(256)) * 4099
    path.write_bytes(b"\0" * len(data))
    hasher = PrefixHasher(path, chunk=1000)
    with open(path, "r+b") as handle:
        for start in range(0, len(data), 70_000):  # written front to back, announced piece by piece
            handle.seek(start)
            handle.write(data[start:start + 70_000])
            handle.flush()
            hasher.advance(min(start + 70_000, len(data)))
    assert hasher.finish(len(data)) == hashlib.sha256(data).hexdigest() == sha256_file(path)
