"""Time moeconv's Triton fused-MoE kernel (moe_wna16, 4-bit, g=128, bf16 activations) on a CUDA GPU.

For each model shape, token count and zero-point mode it reports each GEMM's time and the whole
layer's, the HBM roofline (bytes of the weights, scales and zeros of only the experts the routing
selects, over the device-to-device copy bandwidth measured in the same run), the share of it
reached, and torch's dequantize-then-matmul time over the same experts. Every timed output is
checked against that torch result. ``--sweep`` also times the tile levers (rows per block, N tile,
split-K, warps) per GEMM. ``--smoke`` runs tiny shapes on the CPU under Triton's interpreter (fp16:
the interpreter cannot do bf16), so the script cannot rot unnoticed.

    python benchmarks/bench_kernel.py --json results.json [--sweep]
    python benchmarks/bench_kernel.py --smoke
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import time
from dataclasses import asdict, dataclass

import torch
import triton

from moeconv.kernels.fused_moe import GemmConfig, align_tokens_to_experts, choose_block_m, choose_config, fused_moe, moe_gemm
from moeconv.kernels.reference import DequantizedExperts, random_routing, reference_fused_moe, relative_error

BITS, GROUP_SIZE = 4, 128


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_experts: int
    topk: int
    hidden: int
    intermediate: int


MODELS = (ModelShape("E128-top8-H2048-I768", 128, 8, 2048, 768),
          ModelShape("E8-top2-H4096-I14336", 8, 2, 4096, 14336))
SMOKE_MODELS = (ModelShape("smoke-E4-top2-H256-I128", 4, 2, 256, 128),)


@dataclass(frozen=True)
class QuantizedLinear:
    """Random bytes in the moe_wna16 layout: timing needs real bit patterns, not exact values."""

    qweight: torch.Tensor
    scales: torch.Tensor
    qzeros: torch.Tensor | None

    @classmethod
    def random(cls, num_experts, n, k, *, with_zeros, dtype, device, generator):
        groups = k // GROUP_SIZE
        qweight = torch.randint(0, 256, (num_experts, n, k * BITS // 8), dtype=torch.uint8, device=device,
                                generator=generator)
        # |code - zero| <= 15 and scale ~2e-3 keep x·Wᵀ of unit-normal x near 1 for K in the thousands.
        scales = ((torch.rand(num_experts, n, groups, device=device, generator=generator) + 0.5) * 2e-3).to(dtype)
        qzeros = torch.randint(0, 256, (num_experts, n * BITS // 8, groups), dtype=torch.uint8, device=device,
                               generator=generator) if with_zeros else None
        return cls(qweight, scales, qzeros)

    def bytes_per_expert(self) -> int:
        tensors = [self.qweight, self.scales] + ([self.qzeros] if self.qzeros is not None else [])
        return sum(t[0].numel() * t.element_size() for t in tensors)

    def args(self):
        return self.qweight, self.scales, self.qzeros

    def dequantized(self) -> DequantizedExperts:
        return DequantizedExperts(*self.args(), bits=BITS, group_size=GROUP_SIZE)


def measure_ms(fn, device: torch.device, *, graph: bool, rep_ms: int = 40) -> float:
    """Median milliseconds of ``fn``. On CUDA through do_bench, which flushes L2 before each call;
    with ``graph`` the call is one CUDA-graph replay, so the host's launch overhead (tens of µs
    per launch on the benchmark machine, more than small decode kernels take) stays out."""
    if device.type != "cuda":
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    if graph:
        fn()  # compile and warm up outside the capture
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()
        fn = captured.replay
    return triton.testing.do_bench(fn, warmup=rep_ms // 4, rep=rep_ms, return_mode="median")


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / (measure_ms(lambda: dst.copy_(src), device, graph=False) * 1e-3)


class Case:
    """One model shape, token count and zero mode: weights, routing and what each GEMM reads."""

    def __init__(self, model: ModelShape, num_tokens: int, with_zeros: bool, dtype, device, seed: int):
        generator = torch.Generator(device=device).manual_seed(seed)
        e, h, i = model.num_experts, model.hidden, model.intermediate
        self.model, self.num_tokens, self.with_zeros, self.device = model, num_tokens, with_zeros, device
        self.w13 = QuantizedLinear.random(e, 2 * i, h, with_zeros=with_zeros, dtype=dtype, device=device,
                                          generator=generator)
        self.w2 = QuantizedLinear.random(e, h, i, with_zeros=with_zeros, dtype=dtype, device=device,
                                         generator=generator)
        self.x = torch.randn(num_tokens, h, device=device, generator=generator).to(dtype)
        self.topk_weights, self.topk_ids = random_routing(num_tokens, e, model.topk, generator)
        self.activated = torch.randn(self.topk_ids.numel(), i, device=device, generator=generator).to(dtype)
        active_experts = self.topk_ids.unique().numel()
        self.gemm_bytes = {"w13": active_experts * self.w13.bytes_per_expert(),
                           "w2": active_experts * self.w2.bytes_per_expert()}

    def gemm(self, which: str, config: GemmConfig | None = None):
        """A callable running one GEMM as fused_moe does (``config`` None: the heuristic's)."""
        num_pairs = self.topk_ids.numel()
        block_m = config.block_m if config else choose_block_m(num_pairs, self.model.num_experts, self.device)
        blocks = align_tokens_to_experts(self.topk_ids, self.model.num_experts, block_m)
        if which == "w13":
            return lambda: moe_gemm(self.x, *self.w13.args(), blocks, bits=BITS, group_size=GROUP_SIZE, config=config)
        return lambda: moe_gemm(self.activated, *self.w2.args(), blocks, bits=BITS, group_size=GROUP_SIZE,
                                topk_weights=self.topk_weights, config=config, out_dtype=torch.float32)

    def heuristic_config(self, which: str) -> GemmConfig:
        num_pairs, e, h, i = self.topk_ids.numel(), self.model.num_experts, self.model.hidden, self.model.intermediate
        n, k = (2 * i, h) if which == "w13" else (h, i)
        return choose_config(num_pairs, e, n, k, GROUP_SIZE, BITS, choose_block_m(num_pairs, e, self.device), self.device)

    def layer(self):
        return fused_moe(self.x, *self.w13.args(), *self.w2.args(), self.topk_weights, self.topk_ids, bits=BITS,
                         group_size=GROUP_SIZE)

    def torch_layer(self):
        return reference_fused_moe(self.x, self.w13.dequantized(), self.w2.dequantized(), self.topk_weights,
                                   self.topk_ids, dtype=self.x.dtype)


def run_case(case: Case, bandwidth: float) -> dict:
    device = case.device
    times = {which: measure_ms(case.gemm(which), device, graph=True) for which in ("w13", "w2")}
    layer_ms = measure_ms(case.layer, device, graph=True)
    layer_eager_ms = measure_ms(case.layer, device, graph=False)
    torch_ms = measure_ms(case.torch_layer, device, graph=False)  # syncs with the host: no graph
    roofline_ms = sum(case.gemm_bytes.values()) / bandwidth * 1e3
    return {
        "model": case.model.name, "tokens": case.num_tokens, "zeros": case.with_zeros,
        "config_w13": asdict(case.heuristic_config("w13")), "config_w2": asdict(case.heuristic_config("w2")),
        "w13_ms": times["w13"], "w2_ms": times["w2"], "gemms_ms": times["w13"] + times["w2"], "layer_ms": layer_ms,
        "layer_eager_ms": layer_eager_ms,
        "roofline_ms": roofline_ms, "roofline_pct_gemms": 100 * roofline_ms / (times["w13"] + times["w2"]),
        "roofline_pct_layer": 100 * roofline_ms / layer_ms, "torch_ms": torch_ms,
        "bytes": sum(case.gemm_bytes.values()),
        "rel_err_vs_torch": relative_error(case.layer(), case.torch_layer()),
    }


def lever_configs(case: Case, which: str):
    """Configurations to time: the heuristic's, then one-row (register path) and 16-row tiles over
    N tile width, K split and warps, then prefill tiles over rows, columns and warps."""
    yield case.heuristic_config(which)
    k_tiles = (case.model.hidden if which == "w13" else case.model.intermediate) // 64
    if case.num_tokens <= 16:
        grid = [(1, n, w) for n in (128, 256, 512) for w in (4, 8)] + [(16, 128, 4)]
        for (m, n, w), split in itertools.product(grid, (1, 4, 16)):
            if k_tiles % split == 0:
                yield GemmConfig(block_m=m, block_n=n, block_k=64, split_k=split, num_warps=w, num_stages=4)
    else:
        for m, n, w in itertools.product((32, 64, 128), (64, 128), (4, 8)):
            yield GemmConfig(block_m=m, block_n=n, block_k=64, num_warps=w, num_stages=3)


def sweep(case: Case, bandwidth: float) -> list[dict]:
    rows = []
    for which in ("w13", "w2"):
        reference = case.gemm(which)().float()
        timed = {}
        for config in lever_configs(case, which):
            if config not in timed:
                timed[config] = measure_ms(case.gemm(which, config), case.device, graph=True, rep_ms=15)
        roofline_ms = case.gemm_bytes[which] / bandwidth * 1e3
        for config, ms in timed.items():
            err = relative_error(case.gemm(which, config)(), reference)
            rows.append({"model": case.model.name, "tokens": case.num_tokens, "gemm": which, **asdict(config),
                         "ms": ms, "roofline_pct": 100 * roofline_ms / ms, "rel_err": err,
                         "heuristic": config == case.heuristic_config(which)})
    return rows


def print_table(rows: list[dict]) -> None:
    print("| model | tokens | zeros | w13 µs | w2 µs | GEMMs µs | layer µs | layer eager µs | roofline µs "
          "| % roof GEMMs | % roof layer | torch µs | vs torch | rel err |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['tokens']} | {'yes' if r['zeros'] else 'no'} | {r['w13_ms'] * 1e3:.1f} "
              f"| {r['w2_ms'] * 1e3:.1f} | {r['gemms_ms'] * 1e3:.1f} | {r['layer_ms'] * 1e3:.1f} "
              f"| {r['layer_eager_ms'] * 1e3:.0f} | {r['roofline_ms'] * 1e3:.1f} | {r['roofline_pct_gemms']:.0f}% "
              f"| {r['roofline_pct_layer']:.0f}% | {r['torch_ms'] * 1e3:.0f} | {r['torch_ms'] / r['layer_ms']:.1f}x "
              f"| {r['rel_err_vs_torch']:.1e} |")


def print_sweep_summary(rows: list[dict]) -> None:
    """Per case and GEMM: the best time each value of each lever reaches, and the heuristic's."""
    for (model, tokens, gemm), group in itertools.groupby(rows, key=lambda r: (r["model"], r["tokens"], r["gemm"])):
        group = list(group)
        best = min(group, key=lambda r: r["ms"])
        heuristic = next((r for r in group if r["heuristic"]), None)
        levers = []
        for lever in ("block_m", "block_n", "block_k", "split_k", "num_stages", "num_warps"):
            values = sorted({r[lever] for r in group})
            if len(values) > 1:
                levers.append(f"{lever} " + " ".join(
                    f"{v}:{min(r['ms'] for r in group if r[lever] == v) * 1e3:.0f}" for v in values))
        heuristic_ms = f"{heuristic['ms'] * 1e3:.1f} µs" if heuristic else "not swept"
        print(f"{model} t={tokens} {gemm}: best {best['ms'] * 1e3:.1f} µs ({best['roofline_pct']:.0f}% roof) "
              f"m{best['block_m']} n{best['block_n']} k{best['block_k']} s{best['split_k']} "
              f"st{best['num_stages']} w{best['num_warps']}; heuristic {heuristic_ms}; "
              f"max err {max(r['rel_err'] for r in group):.1e}")
        print("    " + "; ".join(levers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write all results to this path")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under the interpreter")
    parser.add_argument("--sweep", action="store_true", help="also time the tile levers around the heuristic")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 1024])
    parser.add_argument("--sweep-tokens", type=int, nargs="+", default=[1])
    args = parser.parse_args()

    if args.smoke:
        device, dtype, models, tokens, sweep_tokens = torch.device("cpu"), torch.float16, SMOKE_MODELS, [1, 4], [1]
    elif torch.cuda.is_available():
        device, dtype, models, tokens, sweep_tokens = (torch.device("cuda"), torch.bfloat16, MODELS, args.tokens,
                                                       args.sweep_tokens)
    else:
        parser.error("needs a CUDA GPU (or --smoke)")
    bandwidth = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 24)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"{datetime.date.today()} {device_name}: copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
          f"torch {torch.__version__}, triton {triton.__version__}")

    report = {"date": str(datetime.date.today()), "device": device_name, "copy_bandwidth": bandwidth,
              "torch": torch.__version__, "triton": triton.__version__, "bits": BITS, "group_size": GROUP_SIZE,
              "results": [], "sweep": []}
    for model, num_tokens, with_zeros in itertools.product(models, tokens, (False, True)):
        report["results"].append(run_case(Case(model, num_tokens, with_zeros, dtype, device, seed=num_tokens),
                                          bandwidth))
    print_table(report["results"])
    save(report, args.json)
    if args.sweep:  # after the table, so that a sweep cut short loses only itself
        for model, num_tokens in itertools.product(models, sweep_tokens):
            rows = sweep(Case(model, num_tokens, False, dtype, device, seed=num_tokens), bandwidth)
            print_sweep_summary(rows)
            report["sweep"] += rows
            save(report, args.json)


def save(report: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
