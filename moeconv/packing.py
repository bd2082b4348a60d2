"""Bit packing shared by every codec.

Values are packed LSB-first: value j of a container sits at bits [j·b, j·b + b). Containers are
int32 words (checkpoint formats) or uint8 bytes (kernel layouts). Everything is done with explicit
shifts on integers, never by reinterpreting memory, so the result does not depend on the host's
byte order. Only widths that divide the container are supported (2, 4, 8 bits); 3-bit GPTQ's
split words are refused earlier, at plan time.
"""

from __future__ import annotations

import torch

_CONTAINER_BITS = {torch.int32: 32, torch.uint8: 8}


def values_per_container(bits: int, container: torch.dtype) -> int:
    width = _CONTAINER_BITS[container]
    if width % bits:
        raise ValueError(f"{bits}-bit values do not tile a {width}-bit container")
    return width // bits


def pack(codes: torch.Tensor, bits: int, dim: int, container: torch.dtype) -> torch.Tensor:
    """Pack uint8 `codes` (values < 2^bits) along `dim` into `container` (torch.int32 or torch.uint8)."""
    per = values_per_container(bits, container)
    moved = codes.movedim(dim, -1)
    length = moved.shape[-1]
    if length % per:
        raise ValueError(f"cannot pack {length} values into containers of {per}")
    grouped = moved.reshape(*moved.shape[:-1], length // per, per).to(torch.int64)
    shifts = torch.arange(per, dtype=torch.int64) * bits
    words = (grouped << shifts).sum(dim=-1)
    if container is torch.int32:
        # Two's complement wrap of the unsigned 32-bit word into int32, by arithmetic.
        words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.to(container).movedim(-1, dim).contiguous()


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of `pack`: uint8 codes, `dim` grown by the number of values per container."""
    per = values_per_container(bits, packed.dtype)
    width = _CONTAINER_BITS[packed.dtype]
    moved = packed.movedim(dim, -1).to(torch.int64) & ((1 << width) - 1)
    shifts = torch.arange(per, dtype=torch.int64) * bits
    values = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    values = values.reshape(*moved.shape[:-1], moved.shape[-1] * per)
    return values.to(torch.uint8).movedim(-1, dim).contiguous()


def repeated_word(value: int, bits: int) -> int:
    """The 32-bit word with `value` in every `bits`-wide slot (e.g. 1, 4 -> 0x11111111)."""
    word = 0
    for slot in range(32 // bits):
        word |= value << (slot * bits)
    return word


def add_to_words(words: torch.Tensor, addend: int) -> torch.Tensor:
    """int32 words + addend modulo 2^32 (carries cross slots, exactly as integer arithmetic does)."""
    total = (words.to(torch.int64) + addend) & 0xFFFFFFFF
    return torch.where(total >= 1 << 31, total - (1 << 32), total).to(torch.int32)
