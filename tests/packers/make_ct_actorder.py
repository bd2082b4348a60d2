"""Make tests/data/ct_actorder/packed.safetensors: linears packed by the REAL compressed-tensors with
actorder "group" (a weight_g_idx), as llm-compressor's GPTQ writes them.

compressed-tensors 0.17.1 (in .venv-llmc, the llm-compressor 0.12 environment; the 0.20.1 of
.venv-packers no longer passes weight_g_idx to its quantizer). From the repo root:

    .venv-llmc/bin/python tests/packers/make_ct_actorder.py

For each case (4-bit, g = 32, K = 128, N = 64; symmetric and asymmetric) the script chooses codes, zero
points and scales and an act-order g_idx (a random permutation of the channels, groups of 32 in
quantization order, `argsort(perm) // 32` as GPTQ writes it), makes the float weight those mean
(channel k in group g_idx[k]), and has `PackedQuantizationCompressor.compress` (with weight_g_idx)
pack it, then `decompress` read it back. Stored per case: the packed tensors, the intended `codes`
(N, K) uint8, `zeros` (N, G) uint8 (unsigned, true), `scales` (N, G) fp16, and `decompressed`: the
library's own reading of its packing, float32.
"""

from __future__ import annotations

import os
import sys

import torch
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "ct_actorder", "packed.safetensors")
N, K, GROUP, BITS = 64, 128, 32, 4


def case(symmetric: bool, seed: int) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    gen = torch.Generator().manual_seed(seed)
    groups, offset = K // GROUP, 1 << (BITS - 1)
    codes = torch.randint(0, 1 << BITS, (N, K), generator=gen, dtype=torch.uint8)
    codes[0, 0], codes[-1, -1] = 0, (1 << BITS) - 1
    zeros = (torch.full((N, groups), offset, dtype=torch.uint8) if symmetric
             else torch.randint(0, 1 << BITS, (N, groups), generator=gen, dtype=torch.uint8))
    scales = (torch.rand(N, groups, generator=gen) * 0.05 + 0.001).to(torch.float16)
    perm = torch.randperm(K, generator=gen)
    g_idx = (torch.argsort(perm) // GROUP).to(torch.int32)
    weight = ((codes.float() - zeros.float()[:, g_idx.long()]) * scales.float()[:, g_idx.long()]).to(torch.float16)
    args = QuantizationArgs(num_bits=BITS, symmetric=symmetric, strategy="group", group_size=GROUP, actorder="group")
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    state = {"weight": weight, "weight_scale": scales, "weight_g_idx": g_idx,
             "weight_zero_point": (zeros.to(torch.int16) - offset).to(torch.int8)}  # signed, as CT's observers make
    packed = PackedQuantizationCompressor.compress(state, scheme)
    packed = {key: value for key, value in packed.items() if value is not None and key != "weight_scale_inv"}
    readback = PackedQuantizationCompressor.decompress(dict(packed), scheme)["weight"]
    stored = {key: packed[key] for key in ("weight_packed", "weight_scale", "weight_shape", "weight_g_idx")}
    if not symmetric:
        stored["weight_zero_point"] = packed["weight_zero_point"]
    return {**stored, "codes": codes, "zeros": zeros, "scales": scales, "decompressed": readback.float()}


def main() -> None:
    import compressed_tensors

    assert compressed_tensors.__version__.startswith("0.17"), compressed_tensors.__version__
    tensors = {}
    for name, symmetric, seed in (("sym", True, 1), ("asym", False, 2)):
        tensors.update({f"{name}.{key}": value.contiguous().clone() for key, value in case(symmetric, seed).items()})
    save_file(tensors, OUT, metadata={"compressed_tensors": compressed_tensors.__version__})
    print("make_ct_actorder: OK", sorted(tensors))


if __name__ == "__main__":
    sys.exit(main())
