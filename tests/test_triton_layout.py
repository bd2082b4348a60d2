"""The Triton (moe_wna16) layout: bytes as docs/FORMAT.md describes them, and round trips."""

import numpy as np
import pytest
import torch

from moeconv.backends.triton import TritonBackend
from moeconv.backends.base import ExpertWeights
from moeconv.canonical import MoELayerShape, QuantizedWeight
from moeconv.formats import GPTQ



backend = TritonBackend()


def _weight(codes, zeros, group_size):
    codes = np.array(codes, dtype=np.uint8)
    groups = codes.shape[1] // group_size
    zeros = None if zeros is None else np.array(zeros, dtype=np.uint8)
    return QuantizedWeight(codes, zeros, np.ones((codes.shape[0], groups), dtype=np.float16), 4, group_size)


def test_hand_checked_bytes():
    """I = 2, H = 4, 4-bit, one group per row. Expected bytes written from the spec by hand:
    w13 byte [n, j] = c[n, 2j] | c[n, 2j+1] << 4 (gate rows, then up rows); zeros byte [r, g] =
    z[2r] | z[2r+1] << 4."""
    gate = _weight([[1, 2, 3, 4], [9, 10, 11, 12]], [[3], [12]], 4)
    up = _weight([[0, 0, 0, 0], [15, 15, 15, 15]], [[0], [15]], 4)
    down = _weight([[1, 2], [3, 4], [5, 6], [7, 8]], [[1], [2], [3], [4]], 2)
    shape = MoELayerShape(experts=1, hidden=4, intermediate=2, bits=4, group_size=-1, symmetric=False, scale_dtype="F16")
    slices = backend.encode_expert(ExpertWeights(gate, up, down), shape)
    assert slices["w13_qweight"].tolist() == [[0x21, 0x43], [0xA9, 0xCB], [0x00, 0x00], [0xFF, 0xFF]]
    assert slices["w13_qzeros"].tolist() == [[0xC3], [0xF0]]
    assert slices["w2_qweight"].tolist() == [[0x21], [0x43], [0x65], [0x87]]
    assert slices["w2_qzeros"].tolist() == [[0x21], [0x43]]
    assert slices["w13_scales"].shape == (4, 1) and slices["w2_scales"].shape == (4, 1)


def test_eight_bit_is_one_code_per_byte():
    codes = np.array([[0, 255, 128, 7]], dtype=np.uint8)
    weight = QuantizedWeight(codes, np.array([[200]], dtype=np.uint8), np.ones((1, 1), dtype=np.float32), 8, 4)
    down = QuantizedWeight(np.zeros((4, 1), dtype=np.uint8), np.zeros((4, 1), dtype=np.uint8),
                           np.ones((4, 1), dtype=np.float32), 8, 1)
    shape = MoELayerShape(experts=1, hidden=4, intermediate=1, bits=8, group_size=-1, symmetric=False, scale_dtype="F32")
    slices = backend.encode_expert(ExpertWeights(weight, weight, down), shape)
    assert slices["w13_qweight"].tolist() == [[0, 255, 128, 7], [0, 255, 128, 7]]
    assert slices["w13_qzeros"].tolist() == [[200], [200]]


def test_gptq_qweight_transpose_equals_the_layout_on_little_endian():
    """vLLM's GPTQ loader takes qweight.T.contiguous().view(uint8) (vLLM moe_wna16.py `get_weight_loader`); moeconv
    computes the same bytes with explicit shifts."""
    generator = torch.Generator().manual_seed(0)
    weight = QuantizedWeight(torch.randint(0, 16, (16, 64), dtype=torch.uint8, generator=generator).numpy(), None,
                             np.ones((16, 2), dtype=np.float16), 4, 32)
    qweight = torch.from_numpy(GPTQ(4, 32, sym=True).encode(weight)["qweight"])
    down = QuantizedWeight(torch.randint(0, 16, (64, 16), dtype=torch.uint8, generator=generator).numpy(), None,
                           np.ones((64, 1), dtype=np.float16), 4, 16)
    shape = MoELayerShape(experts=1, hidden=64, intermediate=16, bits=4, group_size=32, symmetric=True, scale_dtype="F16")
    slices = backend.encode_expert(ExpertWeights(weight, weight, down), shape)
    assert torch.equal(torch.from_numpy(slices["w13_qweight"][:16]), qweight.T.contiguous().view(torch.uint8))


@pytest.mark.parametrize("shape, reason", [
    (MoELayerShape(4, 64, 32, 2, 32, True, "F16"), "4- or 8-bit"),
    (MoELayerShape(4, 96, 32, 4, 64, True, "F16"), "group size 64 does not divide the hidden size 96"),
    (MoELayerShape(4, 128, 704, 4, 128, True, "F16", tp=2), "does not divide the intermediate size per rank 352"),
])
def test_refusals(shape, reason):
    assert reason in backend.refusal(shape)
