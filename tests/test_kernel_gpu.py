"""The fused-MoE kernel compiled on a CUDA GPU: the CPU matrix plus bf16 activations, larger
shapes, and the tile configurations the heuristic picks for decode (split-K) and prefill.

Skipped without CUDA. Helpers and tolerances come from tests/test_kernel.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_kernel import check_layer_and_gemm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MATRIX = list(itertools.product((4, 8), (True, False), (32, 64, 128, -1),
                                (torch.float16, torch.bfloat16, torch.float32)))
TOKENS = (1, 3, 16, 77, 300)


@pytest.mark.parametrize(
    ("bits", "with_zeros", "group_size", "dtype", "num_tokens"),
    [(*case, TOKENS[i % len(TOKENS)]) for i, case in enumerate(MATRIX)],
    ids=[f"w{b}-{'zp' if z else 'sym'}-g{g}-{str(d)[6:]}-t{TOKENS[i % len(TOKENS)]}"
         for i, (b, z, g, d) in enumerate(MATRIX)],
)
def test_compiled_kernel_matches_float_reference(bits, with_zeros, group_size, dtype, num_tokens):
    check_layer_and_gemm(bits=bits, with_zeros=with_zeros, group_size=group_size, dtype=dtype,
                         num_tokens=num_tokens, device="cuda", num_experts=8, hidden=1024, intermediate=512)


@pytest.mark.parametrize("num_tokens", [1, 16, 600])
@pytest.mark.parametrize("with_zeros", [True, False])
def test_model_sized_layer_in_bf16(num_tokens, with_zeros):
    # Decode splits K over the long GEMMs; 600 tokens x top-4 over 16 experts takes 64-row blocks.
    check_layer_and_gemm(bits=4, with_zeros=with_zeros, group_size=128, dtype=torch.bfloat16, num_tokens=num_tokens,
                         device="cuda", num_experts=16, hidden=2048, intermediate=768, topk=4)
