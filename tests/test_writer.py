"""The streaming writer's pieces."""

import pytest

from moeconv.checkpoint.writer import BlockHasher, file_digest

from helpers import blocks_sha256


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 1001, 256 * 4099])
def test_block_hasher_and_file_digest_equal_the_definition(tmp_path, size):
    path = tmp_path / "f"
    data = (bytes(range(256)) * (size // 256 + 1))[:size]
    path.write_bytes(b"\0" * len(data))
    # tensors: an empty one, one inside a block, one across blocks, one ending the file (file order)
    tensors = [("a", 0, 0), ("b", 0, min(size, 300)), ("c", min(size, 300), min(size, 2500)),
               ("d", min(size, 2500), size)]
    hasher = BlockHasher(path, threads=3, block=1000, tensors=tensors)
    with open(path, "r+b") as handle:
        for start in range(0, len(data), 70_000):  # written front to back, announced piece by piece
            handle.seek(start)
            handle.write(data[start:start + 70_000])
            handle.flush()
            hasher.advance(min(start + 70_000, len(data)))
    expected = blocks_sha256(data, 1000)
    digest, tensor_digests = hasher.finish(len(data))
    assert digest == expected == file_digest(path, threads=2, block=1000)
    assert tensor_digests == {name: blocks_sha256(data[begin:end], 1000) for name, begin, end in tensors}
    assert file_digest(path, threads=1) == blocks_sha256(data, 64 * 1024 * 1024)
    if size:
        assert expected != blocks_sha256(data[:-1] + bytes([data[-1] ^ 1]), 1000)
