"""moeconv's SGLang plugin on `--backend triton` outputs, with SGLang's OWN loader and Triton MoE kernel, on a CPU.

Runs in .venv-sglang (sglang==0.5.23, moeconv installed there by `make engines-sglang` so its
`sglang.srt.plugins` entry point exists), never in the main venv:

    .venv-sglang/bin/python tests/engines/sglang_plugin_check.py SOURCE=OUTPUT [SOURCE=OUTPUT ...]
    .venv-sglang/bin/python tests/engines/sglang_plugin_check.py --refusals OUTPUT SCRATCH

    .venv-sglang/bin/python tests/engines/sglang_plugin_check.py --against-stock SOURCE=OUTPUT [...]

(the second form: the plugin's refusals, provoked on a copy of OUTPUT, see `refusals`; the third: the
plugin's MoE parameters against those of SGLang's own moe_wna16 loader of the source, see `against_stock`)

For each pair, OUTPUT (a triton conversion of SOURCE) is built and loaded by SGLang as in sglang_load.py
(SGLang's plugins loaded as its processes load them, two sentinels, every weight loader recording what
it consumed), in float16, and then:

  * the post-load step: the plugin's `process_weights_after_loading` runs on every MoE layer (its refusal
    of a stacked parameter never filled; SGLang's MoeWNA16Method has no repack after it), and every MoE
    parameter SGLang's Triton runner reads (`MoeWNA16Method.get_triton_quant_info`: w13/w2 qweight,
    scales, qzeros) equals the file's stacked tensor byte for byte;
  * numerics: SGLang's own Triton MoE kernel (`fused_moe_kernel_gptq_awq`, launched by SGLang's
    `invoke_fused_moe_kernel` with int4/int8 weight-only flags and `block_shape=[0, group_size]`, as its
    Triton runner launches it; under TRITON_INTERPRET=1 with float16 activations) on the loaded parameters
    of the first MoE layer, against the float64 reference of the SOURCE (moeconv's decoders of the source
    checkpoint). The token routing is built in torch (SGLang's `moe_align_block_size` is a CUDA kernel);
    the activation between the GEMMs is SiLU-and-multiply in torch. With zero points, a control: the same
    kernel with every zero point one higher (the off-by-one a GPTQ v1 checkpoint read without its +1 has).

Prints one JSON line per pair.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

from sglang_load import build_and_load, select_device  # noqa: E402
from vllm_load import one_line  # noqa: E402  (no vLLM import: plain helpers)

TOKENS, TOPK_MAX, BLOCK_M = 16, 2, 16


def _moe_layers(model) -> list[tuple[str, torch.nn.Module]]:
    from moeconv.engines.sglang_plugin.method import StackedMoeWNA16Method

    return [(name, module) for name, module in model.named_modules()
            if isinstance(getattr(module, "quant_method", None), StackedMoeWNA16Method)]


def check(source: Path, output: Path) -> dict:
    model, result = build_and_load(output)
    layers = _moe_layers(model)
    if not layers:
        raise RuntimeError(f"{output}: SGLang built no MoE layer with moeconv's method")
    index = json.loads((output / "model.safetensors.index.json").read_text())["weight_map"]
    for _, module in layers:
        module.quant_method.process_weights_after_loading(module)
    mismatched, compared = [], 0
    for name, module in layers:
        info = module.quant_method.get_triton_quant_info(module)  # what SGLang's Triton runner reads
        read = {"w13_qweight": info.w13_weight, "w2_qweight": info.w2_weight, "w13_scales": info.w13_scale,
                "w2_scales": info.w2_scale, "w13_qzeros": info.w13_zp, "w2_qzeros": info.w2_zp}
        for leaf in module.quant_method.specs:
            full = f"{name}.{leaf}"
            with safe_open(str(output / index[full]), "pt") as handle:
                stored = handle.get_tensor(full)
            kernel = read[leaf].data
            same = stored.dtype == kernel.dtype and stored.shape == kernel.shape and torch.equal(
                stored.reshape(-1).view(torch.uint8), kernel.reshape(-1).view(torch.uint8))
            compared += 1
            if not same:
                mismatched.append(full)
    config = layers[0][1].quant_method.moeconv_config
    result.update(moe_layers=len(layers), tensors_compared=compared, not_byte_identical=mismatched,
                  bytes_copied=sum(sum(layer.values()) for layer in config.written.values()))
    result.update(_numerics(source, layers[0][1], layers[0][0]))
    return result


def _numerics(source: Path, layer, module_name: str) -> dict:
    import triton.language as tl
    from sglang.kernels.ops.moe.fused_moe_triton_kernels import invoke_fused_moe_kernel

    from moeconv import transform
    from moeconv.checkpoint.reader import TensorReader
    from moeconv.kernels.fused_moe import align_tokens_to_experts
    from moeconv.kernels.reference import random_routing, reference_fused_moe, relative_error
    from moeconv.kernels.runners import NUMERICS_TOLERANCE
    from moeconv.plan import make_plan

    plan = make_plan(source, backend="triton")
    moe = next(item for item in plan.layers if item.module == module_name)
    quant = layer.quant_method.quant_config  # SGLang's MoeWNA16Config (the plugin's, or stock SGLang's)
    experts, hidden, intermediate = moe.shape.experts, moe.shape.hidden, moe.shape.intermediate
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(TOKENS, hidden, generator=gen) * 0.5).to(torch.float16)
    topk = min(TOPK_MAX, experts)
    weights, ids = random_routing(TOKENS, experts, topk, gen)
    blocks = align_tokens_to_experts(ids, experts, BLOCK_M)
    expert_ids = torch.where(blocks.block_experts == experts, -1, blocks.block_experts)  # SGLang: -1 skips a block
    padded = torch.tensor([blocks.pair_ids.numel()], dtype=torch.int32)
    kernel = {"BLOCK_SIZE_M": BLOCK_M, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 1}
    info = layer.quant_method.get_triton_quant_info(layer)

    def gemm(a, weight, scale, zeros, out_features, pairs_per_row, routed):
        c = torch.zeros(a.shape[0], pairs_per_row, out_features, dtype=torch.float16)
        invoke_fused_moe_kernel(a, weight, None, c, None, scale, zeros, weights.to(torch.float32).contiguous(),
                                ids, blocks.pair_ids, expert_ids, padded, routed, pairs_per_row, kernel,
                                compute_type=tl.float16, use_fp8_w8a8=False, use_int8_w8a8=False,
                                use_int8_w8a16=info.use_int8_w8a16, use_int4_w4a16=info.use_int4_w4a16,
                                per_channel_quant=False, block_shape=info.block_shape)
        return c

    def fused_moe(w13_zp, w2_zp):
        gate_up = gemm(x, info.w13_weight, info.w13_scale, w13_zp, 2 * intermediate, topk, False)
        gate_up = gate_up.reshape(TOKENS * topk, 2 * intermediate)
        activated = torch.nn.functional.silu(gate_up[:, :intermediate].float()) * gate_up[:, intermediate:].float()
        down = gemm(activated.to(torch.float16), info.w2_weight, info.w2_scale, w2_zp, hidden, 1, True)
        return down.reshape(TOKENS, topk, hidden).float().sum(dim=1)

    out = fused_moe(info.w13_zp, info.w2_zp)
    with TensorReader() as reader:
        sources = [transform.source_weights(job, plan.codec, reader)[0] for job in plan.layer_jobs[moe.module]]
    w13 = torch.stack([torch.from_numpy(np.concatenate([s["gate"].dequantize(np.float64), s["up"].dequantize(np.float64)]))
                       for s in sources])
    w2 = torch.stack([torch.from_numpy(s["down"].dequantize(np.float64)) for s in sources])
    reference = reference_fused_moe(x, w13, w2, weights, ids)
    error = relative_error(out, reference)
    result = {"numerics_layer": module_name, "has_zp": quant.has_zp, "relative_error": error,
              "tolerance": NUMERICS_TOLERANCE, "numerics_ok": error <= NUMERICS_TOLERANCE}
    if quant.has_zp:  # the control: every zero point one higher (GPTQ v1's stored z - 1 read as true) must show
        result["relative_error_zeros_plus_one"] = relative_error(
            fused_moe(_plus_one(info.w13_zp, quant.weight_bits), _plus_one(info.w2_zp, quant.weight_bits)), reference)
    return result


def _plus_one(zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """Each packed zero point + 1 (mod 2^b), nibble by nibble for 4 bits."""
    if bits == 8:
        return zeros + 1
    low, high = zeros & 0xF, zeros >> 4
    return ((low + 1) & 0xF) | (((high + 1) & 0xF) << 4)


def against_stock(source: Path, output: Path) -> dict:
    """SGLang's own loader of the SOURCE under `--quantization moe_wna16` (its MoeWNA16 loader: GPTQ
    qweight transposed, its zero points + 1; AWQ unpacked, de-interleaved and transposed) against the
    plugin's copy of the OUTPUT: every MoE parameter of every layer, byte for byte; how many 4-bit zero
    points differ; and SGLang's Triton kernel on stock SGLang's parameters against the float64 source
    (`_numerics`), which says which of the two readings is right where they differ."""
    from sglang.srt.layers.quantization.moe_wna16 import MoeWNA16Method

    stock, stock_result = build_and_load(source, "moe_wna16")
    plugin = dict(_moe_layers(build_and_load(output)[0]))
    compared, different = 0, []
    for name, module in stock.named_modules():
        if type(getattr(module, "quant_method", None)) is not MoeWNA16Method:
            continue
        for leaf in ("w13_qweight", "w2_qweight", "w13_scales", "w2_scales", "w13_qzeros", "w2_qzeros"):
            ours, theirs = getattr(plugin[name], leaf).data, getattr(module, leaf).data
            if leaf.endswith("qzeros") and not theirs.numel():
                continue  # symmetric: SGLang's placeholder
            compared += 1
            if ours.shape != theirs.shape or ours.dtype != theirs.dtype or not torch.equal(ours, theirs):
                different.append(f"{name}.{leaf}")
    zeros = [(getattr(plugin[name], leaf).data, getattr(module, leaf).data) for name, module in stock.named_modules()
             if type(getattr(module, "quant_method", None)) is MoeWNA16Method
             for leaf in ("w13_qzeros", "w2_qzeros") if getattr(module, leaf).numel()]
    values = [(_nibbles(ours), _nibbles(theirs)) for ours, theirs in zeros]  # 4-bit: two zero points a byte
    first = next(item for item in stock.named_modules() if type(getattr(item[1], "quant_method", None)) is MoeWNA16Method)
    stock_numerics = _numerics(source, first[1], first[0])
    return {"stock_quant_method": stock_result["quant_method"], "moe_tensors_compared": compared,
            "differing_from_stock": different,
            "zero_points_differing": sum(int((a != b).sum()) for a, b in values),
            "zero_points": sum(a.numel() for a, _ in values),
            "stock_relative_error": stock_numerics["relative_error"]}


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1)


def refusals(output: Path, scratch: Path) -> dict:
    """The plugin's two refusals, provoked on a copy of a loadable `output`: under another SGLang release
    (the installed version answered as 0.5.24, `register` run again), and with one stacked tensor removed
    from the files (SGLang's loader would fill the others and say nothing; the plugin must name the missing
    one: from a local folder its check of the config against the headers does, before any parameter
    exists; else its post-load check). Each: the first line of the refusal, or null when nothing refused."""
    import importlib.metadata
    import shutil

    from safetensors.torch import load_file, save_file

    import moeconv.engines.sglang_plugin as plugin
    from moeconv.engines.sglang_plugin.method import StackedMoeWNA16Method

    answers = {}
    real = importlib.metadata.version
    importlib.metadata.version = lambda name: "0.5.24" if name == "sglang" else real(name)
    try:
        plugin.register()
        build_and_load(output)
        answers["other_release"] = None
    except Exception as error:  # noqa: BLE001 (the refusal is the result)
        answers["other_release"] = one_line(error)
    finally:
        importlib.metadata.version = real
        plugin.register()
    copy = scratch / "missing-stacked-tensor"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(output, copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    victim = max(name for name in index["weight_map"] if name.rsplit(".", 1)[-1] in ("w2_qzeros", "w2_scales"))
    shard = copy / index["weight_map"].pop(victim)
    tensors = load_file(str(shard))
    del tensors[victim]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    answers.update(removed=victim, missing_tensor=None)
    try:  # from a local folder the config is held against the headers first (check_files)
        model, result = build_and_load(copy)
    except Exception as error:  # noqa: BLE001 (the refusal is the result)
        answers["missing_tensor"] = one_line(error)
        return answers
    answers["harness_unloaded"] = [n for n in result["unloaded_parameters"] if n == victim]
    for _, module in model.named_modules():
        if isinstance(getattr(module, "quant_method", None), StackedMoeWNA16Method):
            try:
                module.quant_method.process_weights_after_loading(module)
            except Exception as error:  # noqa: BLE001
                answers["missing_tensor"] = one_line(error)
    return answers


def main() -> None:
    select_device()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    if sys.argv[1:2] == ["--against-stock"]:  # --against-stock SOURCE=OUTPUT ...
        for pair in sys.argv[2:]:
            source, output = (Path(part) for part in pair.split("=", 1))
            try:
                result = against_stock(source, output)
            except Exception as error:  # noqa: BLE001 (a refusal is the result being measured)
                result = {"error": one_line(error)}
            print(json.dumps({"checkpoint": str(output), **result}), flush=True)
        return
    if sys.argv[1:2] == ["--refusals"]:  # --refusals OUTPUT SCRATCH
        print(json.dumps(refusals(Path(sys.argv[2]), Path(sys.argv[3]))), flush=True)
        return
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
