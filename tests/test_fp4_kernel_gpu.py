"""The FP4 fused-MoE kernel compiled on a CUDA GPU: the CPU checks of tests/test_fp4_kernel.py (every code and
scale byte bit for bit, whole layers in both global-scale conventions) plus bf16 activations and larger shapes.

Skipped without CUDA. Helpers and tolerances come from tests/test_fp4_kernel.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_fp4_kernel import SCHEMES, TOLERANCE, check_fp4_layer
from test_fp4_kernel import test_every_code_and_scale_byte_decodes_exactly as decodes_exactly  # not collected here

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TOKENS = (1, 3, 16, 77, 300)
MATRIX = list(itertools.product(SCHEMES, DTYPES))


@pytest.mark.parametrize(("scheme", "dtype", "num_tokens"),
                         [(*case, TOKENS[i % len(TOKENS)]) for i, case in enumerate(MATRIX)],
                         ids=[f"{s}-{str(d)[6:]}-t{TOKENS[i % len(TOKENS)]}" for i, (s, d) in enumerate(MATRIX)])
def test_compiled_fp4_layer_matches_float64_reference(scheme, dtype, num_tokens):
    err = check_fp4_layer(SCHEMES[scheme], dtype, num_tokens, "cuda", seed=num_tokens, num_experts=8, hidden=1024,
                          intermediate=512, topk=2)
    assert err < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_compiled_kernel_decodes_every_code_and_scale_byte_exactly(scheme, dtype):
    decodes_exactly(scheme, dtype, device="cuda")


@pytest.mark.parametrize("num_tokens", [1, 600])
def test_model_sized_mxfp4_layer_in_bf16(num_tokens):
    # gpt-oss-like widths: 600 tokens x top-4 over 16 experts takes 64-row blocks
    err = check_fp4_layer(SCHEMES["mxfp4"], torch.bfloat16, num_tokens, "cuda", seed=num_tokens, num_experts=16,
                          hidden=2880, intermediate=2880, topk=4)
    assert err < TOLERANCE[torch.bfloat16]
