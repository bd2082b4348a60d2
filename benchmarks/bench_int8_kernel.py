"""Time moeconv's W8A8 Triton fused-MoE kernel (int8 weights, per-token int8 activations) on a CUDA GPU.

For each model shape and token count it reports the whole layer's time (triton.testing.do_bench,
activation quantization included), the bytes of the int8 weights and scales of only the experts
the routing selects, the bandwidth that implies against the device-to-device copy bandwidth
measured in the same run, and the relative error against the float64 reference (which does not
quantize activations: expect 1-3e-2, see kernels/runners.W8A8_NUMERICS_TOLERANCE). ``--smoke`` runs tiny
shapes on the CPU under Triton's interpreter, so the script cannot rot unnoticed.

    PYTHONPATH=. python benchmarks/bench_int8_kernel.py --json results.json
    PYTHONPATH=. python benchmarks/bench_int8_kernel.py --smoke
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from moeconv.kernels.int8_moe import int8_fused_moe
from moeconv.kernels.reference import random_routing, reference_fused_moe, relative_error

# (name, experts, top-k, hidden, intermediate)
SHAPES = [("mixtral-8x7b", 8, 2, 4096, 14336), ("qwen3-30b-a3b", 128, 8, 2048, 768)]
SMOKE_SHAPES = [("smoke", 4, 2, 128, 64)]
TOKENS = (1, 16, 128)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy (read + write), the roofline's ceiling."""
    source = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    milliseconds = triton.testing.do_bench(lambda: target.copy_(source))
    return 2 * source.numel() / (milliseconds * 1e-3)


def run_shape(name: str, experts: int, topk: int, hidden: int, intermediate: int, tokens: int,
              device: torch.device, generator: torch.Generator) -> dict:
    def int8(*shape):
        return torch.randint(-128, 128, shape, dtype=torch.int8, device=device, generator=generator)

    def scales(*shape):
        return (torch.rand(shape, device=device, generator=generator) + 0.5) * 2e-3

    w13, w2 = int8(experts, 2 * intermediate, hidden), int8(experts, hidden, intermediate)
    s13, s2 = scales(experts, 2 * intermediate, 1), scales(experts, hidden, 1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    x = torch.randn(tokens, hidden, device=device, generator=generator).to(dtype)
    topk_weights, topk_ids = random_routing(tokens, experts, topk, generator)
    out = int8_fused_moe(x, w13, s13, w2, s2, topk_weights, topk_ids)
    used = topk_ids.unique()
    reference = reference_fused_moe(x.double(), w13[used].double() * s13[used].double(),
                                    w2[used].double() * s2[used].double(), topk_weights.double(),
                                    torch.searchsorted(used, topk_ids))
    result = {"shape": name, "experts": experts, "topk": topk, "hidden": hidden, "intermediate": intermediate,
              "tokens": tokens, "relative_error": relative_error(out, reference)}
    if device.type == "cuda":
        milliseconds = triton.testing.do_bench(lambda: int8_fused_moe(x, w13, s13, w2, s2, topk_weights, topk_ids))
        weight_bytes = used.numel() * (3 * hidden * intermediate + 4 * (2 * intermediate + hidden))
        result.update(ms=milliseconds, weight_bytes=weight_bytes, bandwidth=weight_bytes / (milliseconds * 1e-3))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    report = {"device": "cpu (interpreter)" if args.smoke else torch.cuda.get_device_name(device),
              "torch": torch.__version__, "triton": triton.__version__, "results": []}
    if device.type == "cuda":
        report["copy_bandwidth"] = copy_bandwidth(device)
    for shape in SMOKE_SHAPES if args.smoke else SHAPES:
        for tokens in (1, 8) if args.smoke else TOKENS:
            result = run_shape(*shape, tokens, device, generator)
            if "ms" in result:
                result["roofline_share"] = result["bandwidth"] / report["copy_bandwidth"]
                print(f"{result['shape']:>14} tokens={tokens:<4} {result['ms'] * 1e3:8.1f} us  "
                      f"{result['bandwidth'] / 1e12:5.2f} TB/s ({result['roofline_share']:.0%} of copy)  "
                      f"rel.err {result['relative_error']:.2e}", flush=True)
            else:
                print(f"{result['shape']} tokens={tokens}: rel.err {result['relative_error']:.2e}")
            report["results"].append(result)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
