"""moeconv's vLLM plugin on `--backend triton` outputs, with vLLM's OWN loader and kernel, on a CPU machine.

Runs in .venv-engines (vllm==0.33.0, moeconv installed there so its `vllm.general_plugins` entry point
exists), never in the main venv:

    .venv-engines/bin/python tests/engines/plugin_check.py SOURCE=OUTPUT [SOURCE=OUTPUT ...]

For each pair, OUTPUT (a triton conversion of SOURCE) is built and loaded by vLLM as in vllm_load.py
(every parameter written, every tensor consumed; the load time of `load_weights`) with
`--moe-backend triton` (vLLM's oracle would pick Humming for the capability 9.0 the harness reports, and
Humming's repack needs a GPU), and then:

  * the post-load step: vLLM's own `process_weights_after_loading` for its Triton backend runs on every
    MoE layer, and the tensors the Triton kernel then reads equal the file's stacked tensors, byte for
    byte (scales after the cast to the parameters' dtype that every vLLM loader makes; the plugin fills
    compressed-tensors' N-first parameters, and vLLM views them back as moe_wna16);
    how much the process grew;
  * numerics: vLLM's own Triton MoE kernel (`invoke_fused_moe_wna16_triton_kernel` for moe_wna16,
    `invoke_fused_moe_triton_kernel` with int8 W8A8 for the int8 layout; under TRITON_INTERPRET=1 with
    fp16 activations) on the loaded parameters, for the first MoE layer,
    against the float64 reference of the SOURCE (moeconv's decoders of the source checkpoint). The token
    routing is built in torch (vLLM's `moe_align_block_size` is a CUDA op); the activation between the
    GEMMs is SiLU-and-multiply in torch.

Prints one JSON line per pair.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
# vLLM disables Triton (a placeholder module) when no GPU driver is active, unless the visible-devices
# variable is set and empty (vllm/triton_utils/importing.py); on this CPU machine that keeps the real
# Triton, whose interpreter then runs vLLM's kernel.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

from vllm_load import _patch_platform, build_and_load, one_line  # noqa: E402

TOKENS, TOPK_MAX, BLOCK_M = 16, 2, 16


def _rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _file_tensors(output: Path) -> dict[str, tuple[Path, str]]:
    index = json.loads((output / "model.safetensors.index.json").read_text())["weight_map"]
    return {name: output / file for name, file in index.items()}


def _moe_layers(model):
    from moeconv.engines.vllm_plugin.method import STACKED_METHODS

    # (the checkpoint's module path: vLLM nests RoutedExperts one module deeper, and MiniMax's layer_name
    # says mlp where the module and the checkpoint say block_sparse_moe)
    return [(name.removesuffix(".routed_experts"), module) for name, module in model.named_modules()
            if isinstance(getattr(module, "quant_method", None), STACKED_METHODS)]


def check(source: Path, output: Path) -> dict:
    from moeconv.engines.vllm_plugin.shards import PARAMETERS

    model, result = build_and_load(output, moe_backend="triton")
    layers = _moe_layers(model)
    files = _file_tensors(output)
    rss = _rss_mb()
    for _, module in layers:
        module.quant_method.process_weights_after_loading(module)
    mismatched, compared = [], 0
    for name, module in layers:
        for leaf in module.quant_method.stacked_parameters:
            full = f"{name}.{leaf}"
            with safe_open(str(files[full]), "pt") as handle:
                stored = handle.get_tensor(full)
            kernel = getattr(module, PARAMETERS[leaf]).data  # after vLLM's post-load step for Triton
            if stored.dtype.is_floating_point:  # scales: in the parameters' dtype, as vLLM's loaders cast them
                stored = stored.to(kernel.dtype)
            same = stored.dtype == kernel.dtype and stored.shape == kernel.shape and torch.equal(
                stored.reshape(-1).view(torch.uint8), kernel.reshape(-1).view(torch.uint8))
            compared += 1
            if not same:
                mismatched.append(full)
    backends = sorted({str(getattr(module.quant_method, "wna16_backend", getattr(module.quant_method, "int8_backend",
                                                                                      None))) for _, module in layers})
    result.update(moe_layers=len(layers), tensors_compared=compared, not_byte_identical=mismatched,
                  backends=backends, post_load_rss_growth_mb=round(_rss_mb() - rss, 2))
    result.update(_numerics(source, layers[0][1], layers[0][0]))
    return result


def _numerics(source: Path, layer, module_name: str) -> dict:
    import triton.language as tl
    from vllm.model_executor.layers.fused_moe.fused_moe import (
        invoke_fused_moe_triton_kernel,
        invoke_fused_moe_wna16_triton_kernel,
    )

    from moeconv.checkpoint.reader import TensorReader
    from moeconv.kernels.fused_moe import align_tokens_to_experts
    from moeconv.kernels.reference import random_routing, reference_fused_moe, relative_error
    from moeconv.kernels.runners import NUMERICS_TOLERANCE, W8A8_NUMERICS_TOLERANCE
    from moeconv import transform
    from moeconv.plan import make_plan
    from moeconv.backends.triton_config import INT8_LAYOUT

    plan = make_plan(source, backend="triton")
    moe = next(item for item in plan.layers if item.module == module_name)
    stacked = layer.quant_method.moeconv_config.stacked
    int8 = stacked.layout == INT8_LAYOUT
    experts, hidden, intermediate = moe.shape.experts, moe.shape.hidden, moe.shape.intermediate
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(TOKENS, hidden, generator=gen) * 0.5).to(torch.float16)
    topk = min(TOPK_MAX, experts)
    weights, ids = random_routing(TOKENS, experts, topk, gen)
    blocks = align_tokens_to_experts(ids, experts, BLOCK_M)
    expert_ids = torch.where(blocks.block_experts == experts, -1, blocks.block_experts)  # vLLM: -1 skips a block
    padded = torch.tensor([blocks.pair_ids.numel()], dtype=torch.int32)
    kernel = {"BLOCK_SIZE_M": BLOCK_M, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 1, "SPLIT_K": 1}

    def gemm(a, prefix, out_features, pairs_per_row, routed):
        c = torch.zeros(a.shape[0], pairs_per_row, out_features, dtype=torch.float16)
        routing = weights.to(torch.float32) if routed else None
        if int8:  # dynamic per-token int8 activations, as vLLM's W8A8 path quantizes them (s = max|a| / 127)
            scale = a.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / 127
            q = torch.round(a.float() / scale).clamp(-128, 127).to(torch.int8)
            invoke_fused_moe_triton_kernel(
                q, getattr(layer, f"{prefix}_weight"), c, scale, getattr(layer, f"{prefix}_weight_scale"), routing,
                blocks.pair_ids, expert_ids, padded, routed, pairs_per_row, kernel, compute_type=tl.float16,
                use_fp8_w8a8=False, use_int8_w8a8=True, use_int8_w8a16=False, use_int4_w4a16=False,
                per_channel_quant=True, block_shape=None)
            return c
        invoke_fused_moe_wna16_triton_kernel(  # the tensors vLLM's Triton backend reads after its post-load step
            a, getattr(layer, f"{prefix}_weight_packed"), c, getattr(layer, f"{prefix}_weight_scale"),
            getattr(layer, f"{prefix}_weight_zero_point") if stacked.has_zp else None, routing, blocks.pair_ids,
            expert_ids, padded, routed, pairs_per_row, kernel, compute_type=tl.float16,
            use_int8_w8a16=stacked.bits == 8, use_int4_w4a16=stacked.bits == 4,
            block_shape=[0, stacked.group_size])
        return c

    gate_up = gemm(x, "w13", 2 * intermediate, topk, False).reshape(TOKENS * topk, 2 * intermediate)
    activated = (torch.nn.functional.silu(gate_up[:, :intermediate].float()) * gate_up[:, intermediate:].float())
    down = gemm(activated.to(torch.float16), "w2", hidden, 1, True).reshape(TOKENS, topk, hidden)
    out = down.float().sum(dim=1)
    with TensorReader() as reader:
        sources = [transform.source_weights(job, plan.codec, reader)[0] for job in plan.layer_jobs[moe.module]]
    w13 = torch.stack([torch.from_numpy(np.concatenate([s["gate"].dequantize(np.float64), s["up"].dequantize(np.float64)]))
                       for s in sources])
    w2 = torch.stack([torch.from_numpy(s["down"].dequantize(np.float64)) for s in sources])
    error = relative_error(out, reference_fused_moe(x, w13, w2, weights, ids))
    tolerance = W8A8_NUMERICS_TOLERANCE if int8 else NUMERICS_TOLERANCE
    return {"numerics_layer": module_name, "relative_error": error, "tolerance": tolerance,
            "numerics_ok": error <= tolerance}


def main() -> None:
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    _patch_platform()
    for pair in sys.argv[1:]:
        source, output = (Path(part) for part in pair.split("=", 1))
        try:
            result = check(source, output)
        except Exception as error:  # noqa: BLE001 (a refusal is the result being measured)
            if os.environ.get("MOECONV_ENGINE_TRACE"):
                traceback.print_exc()
            result = {"loaded": False, "error": one_line(error)}
        print(json.dumps({"checkpoint": str(output), **result}), flush=True)


if __name__ == "__main__":
    main()
