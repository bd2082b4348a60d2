"""The FP4 fused-MoE kernel (moeconv/kernels/fp4_moe.py) against float64 references, on the CPU under Triton's
interpreter (`kernel_for_device` picks it for CPU tensors: no TRITON_INTERPRET needed). fp16 and fp32 activations;
bf16 is left to tests/test_fp4_kernel_gpu.py (a bf16 cast before tl.dot is garbage under the interpreter).

The weights are drawn here as E2M1 codes and scale bytes, packed by this file's own line (element 2j in the low
nibble of byte j: docs/FORMAT.md, "Float codes") and decoded for the references by the tests' spec tables
(tests/test_float_fixtures.py: the E2M1 values, E4M3FN and UE8M0 in exact float64), never through moeconv's
decoders, so the kernel's reading of the bytes is checked against the formats, not against itself:

* `test_every_code_and_scale_byte_decodes_exactly`: one-hot activations read every weight back, bit for bit,
  for all 16 codes and every scale byte the encoding allows: a wrong nibble order, a wrong exponent bias of
  either scale encoding, a wrong E2M1 bit layout or a lost sign fail it;
* `test_fp4_layer_matches_float64_reference`: whole layers, both global-scale conventions with gate and up
  scaled differently: a swapped convention (a factor g² off) or gate's global scale read for up fail it;
* `test_fp4_gemm_writes_every_row_with_router_weights`: the grouped GEMM's routing (an expert without tokens,
  one with several row blocks, a wrapped last column block).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from moeconv.float_codes import DIVIDE, MULTIPLY, MXFP4, FloatScheme, nvfp4
from moeconv.kernels.fp4_moe import Fp4Experts, fp4_fused_moe, fp4_moe_gemm
from moeconv.kernels.fused_moe import GemmConfig, align_tokens_to_experts
from moeconv.kernels.reference import random_routing, reference_fused_moe, relative_error
from test_float_fixtures import E2M1, e4m3fn, ue8m0

# As tests/test_kernel.py: fp32 accumulation leaves fp32 exact to about 1e-7, and fp16 rounds the activations,
# the gate/up output and the result (measured here 2.3e-4 to 5e-4); one GEMM rounds once.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
SCHEMES = {"mxfp4": MXFP4, "nvfp4-divide": nvfp4(DIVIDE, False), "nvfp4-multiply": nvfp4(MULTIPLY, False)}
NUM_EXPERTS, HIDDEN, INTERMEDIATE, TOPK = 5, 64, 32, 2  # prime E; K = 32 (down) is one MXFP4 block
# UE8M0 bytes the kernel's fp32 holds times every code: 2^(b - 127) · 6 overflows fp32 from b = 253; 0 is the
# subnormal 2^-127, 0xFF reserved (NaN, refused at read). E4M3: every byte but S.1111.111 (NaN).
UE8M0_BYTES = np.arange(0, 253, dtype=np.uint8)
E4M3_BYTES = np.array([b for b in range(256) if b & 0x7F != 0x7F], dtype=np.uint8)


def pack(codes: np.ndarray) -> np.ndarray:
    """(..., K) codes -> (..., K/2) bytes, element 2j in the low nibble of byte j."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def scale_value(scales: np.ndarray, scheme: FloatScheme) -> np.ndarray:
    return ue8m0(scales) if scheme.scale_encoding == "ue8m0" else e4m3fn(scales)


def dense(codes: np.ndarray, scales: np.ndarray, global_scale: np.ndarray | None, scheme: FloatScheme) -> np.ndarray:
    """(E, N, K) float64 weights: E2M1 table value × block scale, the global scale of each row segment applied
    as its convention says."""
    weights = E2M1[codes] * np.repeat(scale_value(scales, scheme), scheme.block, axis=-1)
    if global_scale is None:
        return weights
    per_row = np.repeat(global_scale.astype(np.float64), codes.shape[1] // global_scale.shape[1], axis=1)[..., None]
    return weights / per_row if scheme.global_convention == DIVIDE else weights * per_row


def random_experts(num_experts: int, n: int, k: int, scheme: FloatScheme, segments: int,
                   rng: np.random.Generator) -> tuple[Fp4Experts, torch.Tensor]:
    """Random codes (all 16 in every row) and scale bytes: weights of magnitude 0.1-1, so that x · Wᵀ of x with
    norm about 1 stays near 1 (no fp16 overflow). NVFP4: a global scale of 2-8 per expert and segment, segment
    s + 1 twice segment s (gate and up differ), stored as its convention reads it (MULTIPLY: the reciprocal).
    Returns the kernel's tensors and the (E, N, K) float64 weights they stand for."""
    codes = rng.integers(0, 16, (num_experts, n, k), dtype=np.uint8)
    codes[..., :16] = np.arange(16, dtype=np.uint8)
    blocks = (num_experts, n, k // scheme.block)
    global_scale = None
    if scheme.scale_encoding == "ue8m0":  # 2^-5 .. 2^-2
        scales = rng.integers(122, 126, blocks, dtype=np.uint8)
    else:  # E4M3 0.25 .. 1.875 (bytes 0x28-0x3F)
        scales = rng.integers(0x28, 0x40, blocks, dtype=np.uint8)
        divisor = rng.uniform(2, 4, (num_experts, 1)) * 2.0 ** np.arange(segments)
        global_scale = (divisor if scheme.global_convention == DIVIDE else 1 / divisor).astype(np.float32)
    weights = dense(codes, scales, global_scale, scheme)
    return (Fp4Experts(torch.from_numpy(pack(codes)), torch.from_numpy(scales),
                       None if global_scale is None else torch.from_numpy(global_scale)), torch.from_numpy(weights))


def check_fp4_layer(scheme: FloatScheme, dtype: torch.dtype, num_tokens: int, device: str, seed: int,
                    num_experts: int = NUM_EXPERTS, hidden: int = HIDDEN, intermediate: int = INTERMEDIATE,
                    topk: int = TOPK) -> float:
    """Relative error of fp4_fused_moe against the float64 reference on one random layer and routing."""
    rng = np.random.default_rng(seed)
    w13, dense13 = random_experts(num_experts, 2 * intermediate, hidden, scheme, 2, rng)
    w2, dense2 = random_experts(num_experts, hidden, intermediate, scheme, 1, rng)
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(num_tokens, hidden, generator=generator) / hidden ** 0.5).to(dtype)
    topk_weights, topk_ids = random_routing(num_tokens, num_experts, topk, generator)
    ref = reference_fused_moe(x, dense13, dense2, topk_weights, topk_ids)
    on = [Fp4Experts(*(None if t is None else t.to(device) for t in w)) for w in (w13, w2)]
    out = fp4_fused_moe(x.to(device), *on, topk_weights.to(device), topk_ids.to(device), scheme=scheme)
    assert out.dtype == dtype and out.shape == x.shape
    assert float(ref.abs().max()) > 1e-3  # the layer's output is not vanishingly small: the bound means something
    return relative_error(out.cpu(), ref)


LAYERS = list(itertools.product(SCHEMES, (torch.float16, torch.float32)))


@pytest.mark.parametrize(("scheme", "dtype", "num_tokens"), [(*case, 1 + 2 * i % 7) for i, case in enumerate(LAYERS)],
                         ids=[f"{s}-{str(d)[6:]}-t{1 + 2 * i % 7}" for i, (s, d) in enumerate(LAYERS)])
def test_fp4_layer_matches_float64_reference(scheme, dtype, num_tokens):
    err = check_fp4_layer(SCHEMES[scheme], dtype, num_tokens, "cpu", seed=num_tokens)
    assert err < TOLERANCE[dtype]


def code_table(scheme: FloatScheme) -> tuple[np.ndarray, np.ndarray]:
    """(N, K) codes and (N, K / block) scale bytes holding every code in every block, in an order where
    neighbours differ (a swapped nibble order moves every weight), and every allowed scale byte once at least."""
    allowed = UE8M0_BYTES if scheme.scale_encoding == "ue8m0" else E4M3_BYTES
    n, k = 32, 8 * scheme.block  # 256 blocks: every allowed byte (253 or 254 of them)
    codes = ((np.arange(n)[:, None] * 3 + np.arange(k)[None, :] * 5) % 16).astype(np.uint8)
    scales = np.resize(allowed, n * (k // scheme.block)).reshape(n, k // scheme.block)
    return codes, scales


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_every_code_and_scale_byte_decodes_exactly(scheme, dtype, device="cpu"):
    """One-hot activations: row k of the output is column k of W, computed as one exact product and one scale
    multiplication in fp32, so it equals the table's value bit for bit (the global scale a power of two)."""
    scheme = SCHEMES[scheme]
    codes, scales = code_table(scheme)
    n, k = codes.shape
    global_scale = None if scheme.global_convention is None else np.full((1, 2), 2.0, np.float32)
    expected = dense(codes[None], scales[None], global_scale, scheme)[0]
    weights = Fp4Experts(torch.from_numpy(pack(codes))[None].to(device), torch.from_numpy(scales)[None].to(device),
                         None if global_scale is None else torch.from_numpy(global_scale).to(device))
    blocks = align_tokens_to_experts(torch.zeros(k, 1, dtype=torch.int64, device=device), 1, 64)
    out = fp4_moe_gemm(torch.eye(k, dtype=dtype, device=device), weights, blocks, scheme=scheme,
                       out_dtype=torch.float32)
    found = out.cpu().double().numpy().T
    wrong = np.argwhere(found != expected)
    assert len(wrong) == 0, (f"{len(wrong)} of {n * k} weights differ; first at {wrong[0].tolist()}: code "
                             f"{codes[tuple(wrong[0])]}, scale byte 0x{scales[wrong[0][0], wrong[0][1] // scheme.block]:02X}"
                             f": {found[tuple(wrong[0])]!r} != {expected[tuple(wrong[0])]!r}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("scheme", ["mxfp4", "nvfp4-divide"])
def test_fp4_gemm_writes_every_row_with_router_weights(scheme, dtype):
    # Expert 2 of 5 gets no token, expert 4 more rows than a 16-row block holds; N = 96 is one full and one
    # wrapped 64-column block, and three global-scale segments of 32 rows.
    scheme = SCHEMES[scheme]
    topk_ids = torch.tensor([[4, 0]] * 12 + [[1, 3], [4, 3], [0, 4], [3, 1], [4, 1], [1, 0], [4, 3], [0, 4]])
    rng = np.random.default_rng(7)
    weights, reference = random_experts(5, 96, 64, scheme, 3, rng)
    generator = torch.Generator().manual_seed(7)
    rows = torch.randn(topk_ids.numel(), 64, generator=generator).to(dtype)
    router = torch.rand(topk_ids.shape, generator=generator)
    expected = torch.einsum("pk,pnk->pn", rows.double(), reference[topk_ids.reshape(-1)]) * router.reshape(-1, 1)
    blocks = align_tokens_to_experts(topk_ids, 5, 16)
    config = GemmConfig(block_m=16, block_n=64, block_k=scheme.block, num_warps=1, num_stages=1)
    out = fp4_moe_gemm(rows, weights, blocks, scheme=scheme, topk_weights=router, config=config)
    assert relative_error(out, expected) < TOLERANCE[dtype] / 2


def test_bytes_that_do_not_fit_are_refused():
    scheme = SCHEMES["nvfp4-divide"]
    weights, _ = random_experts(2, 32, 64, scheme, 2, np.random.default_rng(0))
    blocks = align_tokens_to_experts(torch.tensor([[0], [1]]), 2, 16)
    with pytest.raises(ValueError, match=r"scales \(2, 32, 2\) do not match \(2, 32, 4\)"):
        fp4_moe_gemm(torch.randn(2, 64), weights._replace(scales=weights.scales[..., :2]), blocks, scheme=scheme)
    with pytest.raises(ValueError, match="nvfp4: E2M1 codes, one E4M3 scale per 16, global scale divided by: no "
                                         "global scale given"):
        fp4_moe_gemm(torch.randn(2, 64), weights._replace(global_scale=None), blocks, scheme=scheme)
    with pytest.raises(ValueError, match="block_k must be the scale block 16"):
        fp4_moe_gemm(torch.randn(2, 64), weights, blocks, scheme=scheme, config=GemmConfig(16, 32, 32))
