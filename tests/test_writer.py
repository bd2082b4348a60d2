"""The streaming writer's pieces."""

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeconv.checkpoint import writer as writer_module
from moeconv.checkpoint.writer import BLAKE3, SHA256, BlockHasher, ShardWriter, file_digest, shard_file_digests
from moeconv.spec import TensorSpec

from helpers import blocks_digest, shard_digest_of, tensor_ranges


def _shard(path, size):
    """A shard whose tensors are an empty one, one inside a 1000-byte block, one across blocks, one
    ending the file; its header written, its data not yet (zeros)."""
    sizes = {"a": 0, "b": min(size, 300), "c": max(0, min(size, 2500) - 300), "d": max(0, size - 2500)}
    with ShardWriter(path, [TensorSpec(name, (n,), "U8") for name, n in sizes.items()], {"format": "pt"}) as shard:
        ranges = shard.tensor_ranges()
        for name, n in sizes.items():
            shard.claim(name, 0, n)
    return ranges


@pytest.mark.parametrize("scheme", [BLAKE3, SHA256], ids=lambda scheme: scheme.name)
@pytest.mark.parametrize("size", [0, 1, 999, 1000, 1001, 256 * 4099])
def test_block_hasher_and_shard_digest_equal_the_definition(tmp_path, size, scheme, monkeypatch):
    """Both schemes a manifest may record (version 4: BLAKE3, version 3: sha256) against their definitions,
    written with the hash libraries themselves."""
    path = tmp_path / "f.safetensors"
    ranges = _shard(path, size)
    begin = ranges[0][1]
    data = (bytes(range(256)) * (size // 256 + 1))[:size]
    written_back = []
    monkeypatch.setattr(writer_module, "start_writeback", lambda fd, start, length: written_back.append(
        (start, start + length)))
    hasher = BlockHasher(path, begin, ranges, threads=3, block=1000, scheme=scheme)
    with open(path, "r+b") as handle:
        for start in range(0, len(data), 70_000):  # written front to back, announced piece by piece
            handle.seek(begin + start)
            handle.write(data[start:start + 70_000])
            handle.flush()
            hasher.advance(begin + min(start + 70_000, len(data)))
    content = path.read_bytes()
    expected = shard_digest_of(content, 1000, scheme.name)
    digest, tensor_digests = hasher.finish(len(content))
    assert (digest, tensor_digests) == (expected, {
        name: blocks_digest(content[b:e], 1000, scheme.name) for name, (b, e) in tensor_ranges(content).items()})
    assert shard_file_digests(path, threads=2, block=1000, scheme=scheme) == (digest, tensor_digests)
    assert shard_file_digests(path, scheme=scheme)[0] == shard_digest_of(content, hash_name=scheme.name)
    assert file_digest(path, threads=1, scheme=scheme) == blocks_digest(content, 64 << 20, scheme.name)  # a non-shard file's
    # every byte was handed to the kernel's writeback once, header included
    covered = sorted(written_back)
    assert covered[0][0] == 0 and covered[-1][1] == len(content)
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    # a flipped byte anywhere, header or data, changes the shard's digest
    metadata = content.index(b'"pt"') + 1  # a header byte that leaves the header readable
    for position in sorted({0, 9, metadata, begin - 1, begin, len(content) - 1} - {len(content)}):
        changed = bytearray(content)
        changed[position] ^= 1
        path.write_bytes(bytes(changed))
        try:
            assert shard_file_digests(path, block=1000, scheme=scheme)[0] != expected
        except ValueError:  # the header no longer reads, or no longer tiles the data: refused, not passed
            assert position < begin and position != metadata


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), size=st.integers(0, 600), read=st.sampled_from([16, 64, 1 << 20]),
       block=st.sampled_from([8, 50, 1000]))
def test_range_digests_equal_the_definition(tmp_path, monkeypatch, data, size, read, block):
    """Small ranges are hashed in groups that share one read (of at most _READ_BYTES), larger ones piece by
    piece: every range's digest is still the block digest of its bytes, whatever the ranges (empty, adjacent,
    overlapping, apart, nested) and however they fall into groups."""
    content = bytes(data.draw(st.integers(0, 255)) for _ in range(8)) * (size // 8 + 1)
    content = bytes((b + i) % 256 for i, b in enumerate(content[:size]))
    path = tmp_path / f"r{size}-{read}-{block}.bin"
    path.write_bytes(content)
    bounds = st.integers(0, size)
    ranges = {f"t{i}": tuple(sorted(data.draw(st.tuples(bounds, bounds)))) for i in range(data.draw(st.integers(1, 12)))}
    monkeypatch.setattr(writer_module, "_READ_BYTES", read)
    found = writer_module.range_digests(path, ranges, threads=2, block=block)
    assert found == {name: blocks_digest(content[b:e], block) for name, (b, e) in ranges.items()}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 120), min_size=1, max_size=14), step=st.integers(1, 400),
       read=st.sampled_from([32, 100, 1 << 20]), block=st.sampled_from([16, 64, 1000]))
def test_block_hasher_groups_small_tensors_and_still_equals_the_definition(tmp_path, monkeypatch, sizes, step,
                                                                         read, block):
    """Many small tensors (a per-linear layout's), final a few bytes at a time: those wholly final together
    are hashed in groups, the others piece by piece; each digest is still its definition's, and every byte
    is handed to writeback exactly once."""
    monkeypatch.setattr(writer_module, "_READ_BYTES", read)
    written_back = []
    monkeypatch.setattr(writer_module, "start_writeback", lambda fd, start, length: written_back.append(
        (start, start + length)))
    path = tmp_path / f"g-{len(sizes)}-{step}-{read}-{block}.safetensors"
    names = {f"t{i}": n for i, n in enumerate(sizes)}
    with ShardWriter(path, [TensorSpec(name, (n,), "U8") for name, n in names.items()], {"format": "pt"}) as shard:
        ranges = shard.tensor_ranges()
        for name, n in names.items():
            shard.claim(name, 0, n)
    begin, total = ranges[0][1], sum(sizes)
    data = bytes((7 * i + 3) % 256 for i in range(total))
    hasher = BlockHasher(path, begin, ranges, threads=2, block=block)
    with open(path, "r+b") as handle:
        for start in range(0, total, step):
            handle.seek(begin + start)
            handle.write(data[start:start + step])
            handle.flush()
            hasher.advance(begin + min(start + step, total))
    content = path.read_bytes()
    assert hasher.finish(len(content)) == (shard_digest_of(content, block), {
        name: blocks_digest(content[b:e], block) for name, (b, e) in tensor_ranges(content).items()})
    covered = sorted(piece for piece in written_back if piece[1] > piece[0])
    assert covered[0][0] == 0 and covered[-1][1] == len(content)
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))


def test_bytes_no_tensor_covers_are_refused(tmp_path):
    path = tmp_path / "f.safetensors"
    ranges = _shard(path, 3000)
    with open(path, "ab") as handle:
        handle.write(b"x")  # after the last tensor
    with pytest.raises(ValueError, match="1 bytes after the last tensor's data"):
        shard_file_digests(path)
    hasher = BlockHasher(path, ranges[0][1], ranges, threads=1)
    with pytest.raises(ValueError, match="after the last tensor"):
        hasher.finish(os.path.getsize(path))
    gap = [ranges[0], ranges[1], (ranges[2][0], ranges[2][1] + 1, ranges[2][2]), ranges[3]]
    hasher = BlockHasher(path, ranges[0][1], gap, threads=1)
    with pytest.raises(ValueError, match="tensor c starts at byte"):
        hasher.finish(os.path.getsize(path) - 1)


def test_hash_pools_shorten_the_gil_turns_while_they_live(tmp_path):
    """A hash thread gets the GIL back after each preadv and sha256 call; beside a busy Python thread
    each return waited up to the interpreter's switch interval (docs/BENCHMARKS.md). While any hash
    pool lives the interval is short; the caller's own value comes back when the last one closes,
    also when pools overlap and when a digest fails."""
    import sys

    default = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.004)
        first = writer_module._Hashers(2)
        assert sys.getswitchinterval() == pytest.approx(writer_module.HASHING_SWITCH_SECONDS)
        second = writer_module._Hashers(2)
        first.close()
        assert sys.getswitchinterval() == pytest.approx(writer_module.HASHING_SWITCH_SECONDS)
        second.close()
        second.close()  # closing twice gives back nothing twice
        assert sys.getswitchinterval() == pytest.approx(0.004)
        path = tmp_path / "f.bin"
        path.write_bytes(b"x" * 10)
        with pytest.raises(OSError):  # a range past the file's end
            writer_module.range_digests(path, {"a": (0, 1 << 20)}, threads=2)
        assert sys.getswitchinterval() == pytest.approx(0.004)
    finally:
        sys.setswitchinterval(default)
