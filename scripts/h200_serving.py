"""Issue 26 on the H200: Humming on the plugin's parameters (correctness), Humming vs vLLM's Triton wna16 kernel (time).

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .h200/whl19/*.whl
    PYTHONPATH=.:/tmp/site python3 scripts/h200_serving.py --inputs .h200 --out $OUT

Runs on the lent GPU machine (torch 2.11+cu130, Triton 3.6, no vLLM) over the folder that
scripts/h200_serving_stage.py staged on a CPU machine with vLLM 0.33.0: the MoE parameters vLLM holds after
loading a `triton` output through moeconv's plugin (before `process_weights_after_loading`), for sources
whose MoE layers vLLM's oracle serves with HUMMING on compute capability 9.0, and vLLM's own
`fused_moe.py` from the wheel (the Triton wna16 kernel, imported without vLLM).

Part A, for each staged source (GPTQ 4-bit symmetric g128; asymmetric g32; the real GPTQModel act-order
checkpoint, asymmetric g32):
  1. the staged parameters equal what moeconv's plugin fills from the `triton` output (moeconv.convert
     here, moeconv.engines.vllm_plugin.shards.fill), so the synthetic timing layers of part B hold what vLLM would;
  2. they equal, after Humming's own schema conversion (`convert_humming`, as vLLM calls it, before its
     symmetric-integer step), what Humming's own `HummingLayer.from_safetensors` reads from moeconv's
     `humming` output of the same source, expert by expert;
  3. the calls vLLM 0.33's Humming MoE path makes run on the GPU (listed in CALLS below), then its
     apply (indexed GEMM, fused SiLU-and-mul, indexed GEMM, weighted sum), for several token counts and
     fp16 / bf16 activations; every output is checked against a float64 reference of the SOURCE
     (dequantized here from the GPTQ tensors' definition, no moeconv decoder): relative error <= 1e-2;
  4. vLLM's Triton wna16 kernel on the same layer (the `triton` output's bytes), same check.
Part B, timing: Qwen3-30B-A3B's layer (E = 128, top-8, H = 2048, I = 768) and Mixtral's (E = 8, top-2,
H = 4096, I = 14336), GPTQ 4-bit symmetric g128 sources made by moeconv.synth and converted by moeconv
on this machine's CPU; 1 / 16 / 128 tokens; each GEMM of Humming (the plugin's choice on Hopper) and of
vLLM's Triton wna16 kernel (what the plugin replaced), same weights, same routing, CUDA-graph replays
timed with CUDA events after warm-up, the L2 flushed before each, median of many; and the whole expert
computation (w13, activation, w2, weighted sum) of each. Every timed output is checked as in part A.
Part C: can vLLM 0.33's compiled Marlin MoE extension (the oracle's choice for asymmetric layers of other
group sizes) load here? Every symbol and library it needs, looked up in this machine's torch.

Prints one JSON line per row and writes them all to OUT/h200_serving.json. Exits 1 on any correctness
miss (or a Triton/Humming failure), 0 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

TOLERANCE = 1e-2
PAD_N, PAD_K = 256, 128  # quantization/utils/humming/moe.py :: _prepare_and_transform_sublayer
# quantization/utils/humming/activation.py :: _HUMMING_ACTIVATIONS[MoEActivation.SILU]
SILU_AND_MUL = {"activation_type": "binary_split", "activation_impl": "(a / (1.f + expf(-a))) * b"}
# The calls vLLM 0.33 makes for a WNA16 MoE layer on its HUMMING backend (paths in the vllm 0.33.0 wheel):
CALLS = [
    "compressed_tensors_moe_wna16.py :: CompressedTensorsWNA16MoEMethod.process_weights_after_loading -> "
    "fused_moe/oracle/int_wna16.py :: convert_to_wna16_moe_kernel_format(HUMMING) -> "
    "quantization/utils/humming/moe.py :: convert_to_humming_moe_kernel_format(layer, "
    "quant_config=int_wna16._humming_wna16_weight_schema(weight_quant))",
    "humming BaseWeightSchema.from_config(quant_config); HummingInputSchema() (VLLM_HUMMING_INPUT_QUANT_CONFIG "
    "unset: humming_is_layer_skipped)",
    "per sublayer w13 (N = 2I, K = H, n stacks [I, I]) and w2 (N = H, K = I): "
    "weight_schema.convert_humming(tensors, shape_n_stacks, shape_k_stacks, param_dtype, num_experts) "
    "(moe.py :: _convert_sublayer_to_humming), input_schema.convert_humming(...)",
    "schema.py :: check_and_fallback_input_schema -> input_schema.to_humming_schema(param_dtype) (16-bit input)",
    "humming.transform.prepare_and_transform_humming_tensors(tensors, shape_n, shape_k, pad_n_to_multiple=256, "
    "pad_k_to_multiple=128, input_schema, weight_schema, has_bias=False, num_experts, torch_dtype, device) "
    "(moe.py :: _prepare_and_transform_sublayer)",
    "apply: fused_moe/experts/fused_humming_moe.py :: HummingIndexedExperts (gemm type 'indexed' without EP): "
    "get_heuristics_config(config, use_f16_accum=False, use_batch_invariant=False, gemm_type=INDEXED) per "
    "sublayer; block size for valid_shape_m = M*top_k from the w13 tuning config; moe_align_block_size "
    "(a CUDA op of vLLM, rebuilt here in torch with its sizes); humming_forward(w13, top_k); "
    "may_process_input(w2 config, activation SILU fused, binary_split); humming_forward(w2, top_k=1, own "
    "alignment when the w2 tuning config's block differs); moe_fused_mul_sum (here: a torch weighted sum)",
]
FUSED_MOE_NAMES = ("write_zeros_to_output", "fused_moe_kernel_gptq_awq", "invoke_fused_moe_wna16_triton_kernel",
                   "get_moe_wna16_block_config", "should_moe_wna16_use_cuda", "get_default_config")
SHIM = '''# Generated by scripts/h200_serving.py: functions of vLLM 0.33.0's fused_moe.py (sha256 {sha}),
# verbatim, under a shim of the names they import from vLLM.
from typing import Any

import torch
import triton
import triton.language as tl


class envs:  # vllm.envs: the defaults
    VLLM_BATCH_INVARIANT = False


class current_platform:  # vllm.platforms.current_platform on a CUDA GPU
    @staticmethod
    def is_cuda():
        return torch.cuda.is_available()

    @staticmethod
    def is_rocm():
        return False


def next_power_of_2(n):  # vllm.utils.math_utils.next_power_of_2
    return 1 << (n - 1).bit_length() if n > 0 else 1


'''
ROWS: list[dict] = []
FAILURES: list[str] = []
STARTED = time.monotonic()


OUT_FILE: list[Path] = []  # set by main: rewritten after every row, so a run cut short leaves its rows


def emit(row: dict) -> None:
    ROWS.append(row)
    print(json.dumps(row), flush=True)
    if OUT_FILE:
        OUT_FILE[0].write_text(json.dumps(ROWS, indent=1))


def check(row: dict, error: float, what: str) -> None:
    """Records a relative error against the float64 reference; a miss fails the run."""
    row[what] = error
    if not math.isfinite(error) or error > TOLERANCE:
        FAILURES.append(f"{row.get('case')} {what} = {error}")
        row.setdefault("fail", []).append(what)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double()
    if not torch.isfinite(out).all():
        return float("nan")
    return float((out - ref).norm() / ref.norm())


# ---------------------------------------------------------------------------------------------------
# The float64 reference of a GPTQ source, from the format's definition (AutoGPTQ / GPTQModel):
#   qweight int32 (K/8·b/4.., N): codes packed along K, LSB first (k = word·(32/b) + j at bits j·b);
#   qzeros int32 (G, N·b/32): zero points packed along N the same way; checkpoint_format "gptq" (v1)
#   stores z − 1 by subtracting 0x11111111 (4-bit) from each whole word, so the word + 0x11111111
#   (mod 2^32) holds the true zeros; "gptq_v2" stores them as they are;
#   scales (G, N); g_idx (K,): the group of input k (act-order: any order);
#   W[n, k] = scales[g_idx[k], n] · (q[k, n] − z[g_idx[k], n]).
# ---------------------------------------------------------------------------------------------------


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    per = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, device=w.device, dtype=torch.int64) * bits
    codes = (w.unsqueeze(dim + 1) >> shifts.view([-1 if i == dim + 1 else 1 for i in range(w.dim() + 1)])) & (
        (1 << bits) - 1)
    shape = list(w.shape)
    shape[dim] *= per
    return codes.reshape(shape)


def gptq_dense(tensors: dict[str, torch.Tensor], prefix: str, bits: int, v1: bool) -> torch.Tensor:
    qweight, scales = tensors[f"{prefix}.qweight"], tensors[f"{prefix}.scales"]
    qzeros, g_idx = tensors[f"{prefix}.qzeros"], tensors.get(f"{prefix}.g_idx")
    codes = _unpack(qweight, bits, 0)  # (K, N)
    words = qzeros.to(torch.int64) & 0xFFFFFFFF
    if v1:
        words = (words + sum(1 << (bits * j) for j in range(32 // bits))) & 0xFFFFFFFF
    zeros = _unpack(words, bits, 1)  # (G, N)
    k = codes.shape[0]
    if g_idx is None:
        g_idx = torch.arange(k, device=codes.device) // (k // scales.shape[0])
    g_idx = g_idx.long()
    return ((codes - zeros[g_idx]).double() * scales[g_idx].double()).t().contiguous()  # (N, K)


class SourceReference:
    """The float64 expert weights of a GPTQ source (one MoE layer), dequantized on the GPU on demand."""

    def __init__(self, source: Path, layer: int, device: torch.device):
        config = json.loads((source / "config.json").read_text())
        quant = config["quantization_config"]
        self.bits = int(quant["bits"])
        self.v1 = quant.get("checkpoint_format", "gptq") != "gptq_v2"
        self.tensors: dict[str, torch.Tensor] = {}
        pattern = re.compile(rf"\.layers\.{layer}\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.(qweight|qzeros|scales|g_idx)$")
        self.names: dict[tuple[int, str], str] = {}
        for shard in sorted(source.glob("*.safetensors")):
            with safe_open(str(shard), "pt") as f:
                for name in f.keys():
                    found = pattern.search(name)
                    if found:
                        self.tensors[name] = f.get_tensor(name).to(device)
                        self.names[int(found.group(2)), found.group(3)] = name.rsplit(".", 1)[0]
        self.cache: dict[tuple[int, str], torch.Tensor] = {}
        # act-order (desc_act): a g_idx that is not k // g. moeconv folds a down projection's input
        # permutation into the gate/up output rows, so the w13 output's channels come out permuted
        self.act_order = any(not torch.equal(t.long(), torch.arange(t.numel(), device=t.device) // (
            t.numel() // self.tensors[n.removesuffix("g_idx") + "scales"].shape[0]))
            for n, t in self.tensors.items() if n.endswith(".g_idx"))

    def weight(self, expert: int, projection: str) -> torch.Tensor:
        aliases = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}[projection]
        key = (expert, projection)
        if key not in self.cache:
            prefix = next(self.names[expert, a] for a in aliases if (expert, a) in self.names)
            self.cache[key] = gptq_dense(self.tensors, prefix, self.bits, self.v1)
        return self.cache[key]

    def w13(self, expert: int) -> torch.Tensor:
        return torch.cat([self.weight(expert, "gate"), self.weight(expert, "up")])


def reference_moe(ref: SourceReference, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
    """float64: the w13 output per (token, slot), the activation, the w2 output per pair, and the layer."""
    x64 = x.double()
    m, k = topk_ids.shape
    w13_out, act, w2_out = [None] * (m * k), [None] * (m * k), [None] * (m * k)
    for expert in topk_ids.unique().tolist():
        rows = (topk_ids == expert).nonzero()
        tokens, slots = rows[:, 0], rows[:, 1]
        h13 = x64[tokens] @ ref.w13(expert).t()
        i = h13.shape[1] // 2
        a = torch.nn.functional.silu(h13[:, :i]) * h13[:, i:]
        h2 = a @ ref.weight(expert, "down").t()
        for r, (t, s) in enumerate(zip(tokens.tolist(), slots.tolist())):
            w13_out[t * k + s], act[t * k + s], w2_out[t * k + s] = h13[r], a[r], h2[r]
    w13_out, act, w2_out = torch.stack(w13_out), torch.stack(act), torch.stack(w2_out)
    layer = (w2_out.view(m, k, -1) * topk_weights.double().unsqueeze(-1)).sum(1)
    return w13_out, act, w2_out, layer


def channel_sorted_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The relative error of a w13 output whose intermediate channels are in another order: each row's
    gate half and up half sorted, on both sides."""
    half = ref.shape[1] // 2

    def key(t: torch.Tensor) -> torch.Tensor:
        t = t.double()
        return torch.cat([t[:, :half].sort(dim=1).values, t[:, half:].sort(dim=1).values], dim=1)

    return relative_error(key(out), key(ref))


# ---------------------------------------------------------------------------------------------------
# Routing, as vLLM's moe_align_block_size lays it out (fused_moe/moe_align_block_size.py, a CUDA op):
# the flattened (token, slot) indices sorted by expert, each expert's run padded to the block size
# with the index numel; expert_ids per block; the buffers sized as vLLM sizes them.
# ---------------------------------------------------------------------------------------------------


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int):
    numel = topk_ids.numel()
    max_padded = numel + num_experts * (block_size - 1)
    if numel < num_experts:
        max_padded = min(numel * block_size, max_padded)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    sorted_ids = torch.full((max_padded,), numel, dtype=torch.int32, device=flat.device)
    expert_ids = torch.full((triton_cdiv(max_padded, block_size),), -1, dtype=torch.int32, device=flat.device)
    start, position, block = 0, 0, 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        sorted_ids[position:position + count] = order[start:start + count].to(torch.int32)
        blocks = triton_cdiv(count, block_size)
        expert_ids[block:block + blocks] = expert
        start, position, block = start + count, position + blocks * block_size, block + blocks
    return sorted_ids, expert_ids, torch.tensor([position], dtype=torch.int32, device=flat.device)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def random_routing(m: int, num_experts: int, top_k: int, generator: torch.Generator, device):
    logits = torch.randn(m, num_experts, generator=generator, device=device)
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).float(), ids.to(torch.int32)


# ---------------------------------------------------------------------------------------------------
# Humming, as vLLM 0.33 calls it (CALLS)
# ---------------------------------------------------------------------------------------------------


class HummingMoE:
    """One MoE layer after vLLM's Humming post-load step, and its apply (HummingIndexedExperts)."""

    def __init__(self, params: dict[str, torch.Tensor], schema_config: dict, num_experts: int, hidden: int,
                 intermediate: int, dtype: torch.dtype, device: torch.device):
        from humming.config import GemmType
        from humming.schema import BaseWeightSchema, HummingInputSchema
        from humming.transform import prepare_and_transform_humming_tensors
        from humming.tune import get_heuristics_config

        self.dtype, self.device, self.hidden, self.intermediate = dtype, device, hidden, intermediate
        self.num_experts = num_experts
        weight_schema = BaseWeightSchema.from_config(schema_config)
        input_schema = HummingInputSchema()
        self.configs, self.tensors, self.schemas = {}, {}, {}
        for sub, n, k, n_stacks in (("w13", 2 * intermediate, hidden, [intermediate] * 2),
                                    ("w2", hidden, intermediate, [hidden])):
            tensors = {name.removeprefix(sub + "_"): value.to(device) for name, value in params.items()
                       if name.startswith(sub + "_")}
            # vLLM creates the scales in the model's dtype; the staging harness held them in float32
            # (exact copies of the file's fp16 scales): cast as vLLM's loader would for this dtype
            tensors["weight_scale"] = tensors["weight_scale"].to(dtype)
            converted_schema, converted = weight_schema.convert_humming(
                tensors=tensors, shape_n_stacks=n_stacks, shape_k_stacks=[k], param_dtype=dtype,
                num_experts=num_experts)
            in_schema, in_tensors = input_schema.convert_humming(
                tensors=tensors, shape_n_stacks=n_stacks, shape_k_stacks=[k], param_dtype=dtype,
                num_experts=num_experts)
            converted.update(in_tensors)
            in_schema = in_schema.to_humming_schema(dtype)  # check_and_fallback_input_schema, 16-bit input
            config, transformed = prepare_and_transform_humming_tensors(
                tensors=converted, shape_n=n, shape_k=k, pad_n_to_multiple=PAD_N, pad_k_to_multiple=PAD_K,
                input_schema=in_schema, weight_schema=converted_schema, has_bias=False, num_experts=num_experts,
                torch_dtype=dtype, device=device)
            self.configs[sub], self.tensors[sub], self.schemas[sub] = config, transformed, converted_schema
        self.tuning = {sub: get_heuristics_config(layer_config=self.configs[sub], use_f16_accum=False,
                                                  use_batch_invariant=False, gemm_type=GemmType.INDEXED)
                       for sub in self.configs}
        self.compute_config = json.dumps({"use_batch_invariant": False, "use_f16_accum": False,
                                          "gemm_type": GemmType.INDEXED.value})
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.locks = torch.zeros(sms * 8, dtype=torch.int32, device=device)  # vllm/utils/humming.py

    def _block(self, sub: str, valid_shape_m: int) -> int:
        for lower, upper, config in self.tuning[sub]:
            if lower < valid_shape_m <= upper:
                return config["block_shape"][0]
        return 64

    def prepare(self, topk_ids: torch.Tensor):
        """What HummingIndexedExperts.prepare_humming_moe_kwargs computes (routing metadata)."""
        valid = topk_ids.numel()
        b13, b2 = self._block("w13", valid), self._block("w2", valid)
        align13 = moe_align_block_size(topk_ids, b13, self.num_experts)
        align2 = align13 if b2 == b13 else moe_align_block_size(topk_ids, b2, self.num_experts)
        m, k = topk_ids.shape
        buffers = {"gate_up": torch.empty(m * k, 2 * self.intermediate, dtype=self.dtype, device=self.device),
                   "down_in": torch.empty(m * k, self.intermediate, dtype=self.dtype, device=self.device),
                   "down": torch.empty(m * k, self.hidden, dtype=self.dtype, device=self.device)}
        return {"valid": valid, "top_k": k, "align": {"w13": align13, "w2": align2}, "blocks": (b13, b2),
                "buffers": buffers}

    def gemm(self, sub: str, inputs: torch.Tensor, outputs: torch.Tensor, plan: dict) -> torch.Tensor:
        from humming.forward import humming_forward

        sorted_ids, expert_ids, padded = plan["align"][sub]
        t = self.tensors[sub]
        return humming_forward(
            self.configs[sub], inputs=inputs, weight=t["weight"], weight_scale=t.get("weight_scale"),
            zero_point=t.get("zero_point"), bias=t.get("bias"), weight_scale_2=t.get("weight_scale_2"),
            input_scale=None, input_scale_2=None, outputs=outputs, locks=self.locks, sorted_ids=sorted_ids,
            expert_ids=expert_ids, num_tokens_padded=padded, top_k=plan["top_k"] if sub == "w13" else 1,
            valid_shape_m=plan["valid"], compute_config=self.compute_config,
            tuning_config=json.dumps(self.tuning[sub]))

    def activation(self, plan: dict) -> torch.Tensor:
        from humming.forward import may_process_input

        hadamard = getattr(self.schemas["w2"], "hadamard_block_size", None)
        out, _, _ = may_process_input(self.configs["w2"], inputs=plan["buffers"]["gate_up"],
                                      outputs=plan["buffers"]["down_in"], token_scales=None,
                                      hadamard_block_size=hadamard, layout="normal", **SILU_AND_MUL)
        return out

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, plan: dict) -> torch.Tensor:
        buffers = plan["buffers"]
        self.gemm("w13", x, buffers["gate_up"], plan)
        down_in = self.activation(plan)
        self.gemm("w2", down_in, buffers["down"], plan)
        m, k = topk_weights.shape
        return (buffers["down"].view(m, k, -1).float() * topk_weights.unsqueeze(-1)).sum(1).to(self.dtype)


# ---------------------------------------------------------------------------------------------------
# vLLM's Triton wna16 kernel, from the wheel's fused_moe.py (no vLLM import)
# ---------------------------------------------------------------------------------------------------


def load_vllm_triton(inputs: Path, scratch: Path):
    source_path = inputs / "vllm_triton" / "fused_moe.py"
    data = source_path.read_bytes()
    expected = json.loads((inputs / "marlin_ext.json").read_text())["fused_moe_sha256"]
    sha = hashlib.sha256(data).hexdigest()
    if sha != expected:
        raise SystemExit(f"{source_path}: sha256 {sha}, the wheel's is {expected}")
    text = data.decode()
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    parts = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in FUSED_MOE_NAMES:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            parts.append("".join(lines[start - 1:node.end_lineno]) + "\n\n")
    found = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)} & set(FUSED_MOE_NAMES)
    if found != set(FUSED_MOE_NAMES):
        raise SystemExit(f"fused_moe.py lacks {set(FUSED_MOE_NAMES) - found}")
    module_path = scratch / "vllm_fused_moe_wna16.py"
    module_path.write_text(SHIM.format(sha=sha) + "".join(parts))
    spec = importlib.util.spec_from_file_location("vllm_fused_moe_wna16", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TritonMoE:
    """vLLM's TritonWNA16Experts.apply (fused_moe/experts/triton_moe.py) on the triton output's tensors."""

    def __init__(self, vllm_triton, stacked: dict[str, torch.Tensor], num_experts: int, hidden: int,
                 intermediate: int, group_size: int, dtype: torch.dtype, device: torch.device):
        import triton.language as tl

        self.k = vllm_triton
        self.w13, self.w2 = stacked["w13_qweight"].to(device), stacked["w2_qweight"].to(device)
        self.s13, self.s2 = stacked["w13_scales"].to(device, dtype), stacked["w2_scales"].to(device, dtype)
        self.z13 = stacked["w13_qzeros"].to(device) if "w13_qzeros" in stacked else None
        self.z2 = stacked["w2_qzeros"].to(device) if "w2_qzeros" in stacked else None
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.group_size, self.dtype, self.device = group_size, dtype, device
        self.compute_type = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]

    def prepare(self, topk_ids: torch.Tensor):
        m, k = topk_ids.shape
        # try_get_optimal_moe_config: no tuned int4_w4a16 file for NVIDIA_H200 in the wheel -> get_default_config
        config = self.k.get_default_config(m, self.num_experts, self.intermediate, self.w13.shape[2], k,
                                           "int4_w4a16", [0, self.group_size])
        align = moe_align_block_size(topk_ids, config["BLOCK_SIZE_M"], self.num_experts)
        buffers = {"cache1": torch.empty(m, k, 2 * self.intermediate, dtype=self.dtype, device=self.device),
                   "cache2": torch.empty(m * k, self.intermediate, dtype=self.dtype, device=self.device),
                   "cache3": torch.empty(m, k, self.hidden, dtype=self.dtype, device=self.device)}
        return {"config": config, "align": align, "top_k": k, "buffers": buffers}

    def gemm(self, sub: str, inputs: torch.Tensor, outputs: torch.Tensor, plan: dict,
             topk_weights: torch.Tensor | None = None) -> torch.Tensor:
        sorted_ids, expert_ids, padded = plan["align"]
        w, s, z = (self.w13, self.s13, self.z13) if sub == "w13" else (self.w2, self.s2, self.z2)
        self.k.invoke_fused_moe_wna16_triton_kernel(
            inputs, w, outputs, s, z, topk_weights, sorted_ids, expert_ids, padded, topk_weights is not None,
            plan["top_k"] if sub == "w13" else 1, plan["config"], compute_type=self.compute_type,
            use_int8_w8a16=False, use_int4_w4a16=True, block_shape=[0, self.group_size])
        return outputs

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, plan: dict) -> torch.Tensor:
        b = plan["buffers"]
        self.gemm("w13", x, b["cache1"], plan)
        h = b["cache1"].view(-1, 2 * self.intermediate)
        torch.mul(torch.nn.functional.silu(h[:, :self.intermediate]), h[:, self.intermediate:], out=b["cache2"])
        self.gemm("w2", b["cache2"], b["cache3"], plan, topk_weights)
        return b["cache3"].sum(1)  # the weights were applied in the w2 GEMM (MUL_ROUTED_WEIGHT)


# ---------------------------------------------------------------------------------------------------
# Timing: CUDA graph of one call, replayed after warm-up, L2 flushed before each replay, CUDA events
# ---------------------------------------------------------------------------------------------------


class Timer:
    def __init__(self, device: torch.device, iterations: int, warmup: int):
        self.flush = torch.empty(512 * 2**20, dtype=torch.uint8, device=device)  # > 60 MB of L2
        self.iterations, self.warmup = iterations, warmup

    def _median_us(self, run, iterations: int) -> float:
        for _ in range(self.warmup):
            run()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iterations)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iterations)]
        for start, end in zip(starts, ends):
            self.flush.zero_()
            start.record()
            run()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3

    def median_us(self, fn) -> tuple[float | None, float, str]:
        """(CUDA-graph replay µs or None where capture failed, eager launch µs, why capture failed)."""
        fn()
        torch.cuda.synchronize()
        graph_us, why = None, ""
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            graph.replay()
            torch.cuda.synchronize()
            graph_us = self._median_us(graph.replay, self.iterations)
        except Exception as error:  # noqa: BLE001 (recorded: the eager time stands alone)
            torch.cuda.synchronize()
            why = f"{type(error).__name__}: {str(error)[:120]}"
        return graph_us, self._median_us(fn, max(20, self.iterations // 4)), why


# ---------------------------------------------------------------------------------------------------
# Part A: the staged plugin parameters
# ---------------------------------------------------------------------------------------------------


def stacked_tensors(output: Path, layer_name: str) -> dict[str, torch.Tensor]:
    found = {}
    for shard in sorted(output.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                if name.startswith(layer_name + "."):
                    found[name[len(layer_name) + 1:]] = f.get_tensor(name)
    return found


def plugin_fill(stacked: dict[str, torch.Tensor], like: dict[str, torch.Tensor], meta: dict, bits: int,
                group_size: int) -> dict[str, torch.Tensor]:
    """The compressed-tensors parameters moeconv's plugin fills from the stacked tensors (tp 1)."""
    from moeconv.engines.vllm_plugin.shards import PARAMETERS, fill

    filled = {}
    for name, tensor in stacked.items():
        parameter = torch.empty_like(like[PARAMETERS[name]], dtype=like[PARAMETERS[name]].dtype)
        if parameter.dtype.is_floating_point and tensor.dtype.is_floating_point:
            parameter = torch.empty(parameter.shape, dtype=tensor.dtype)
            fill(name, tensor, parameter, meta["intermediate_per_partition"], bits, group_size, 1, 0)
            parameter = parameter.to(like[PARAMETERS[name]].dtype)
        else:
            fill(name, tensor, parameter, meta["intermediate_per_partition"], bits, group_size, 1, 0)
        filled[PARAMETERS[name]] = parameter
    return filled


def sampled_experts(num_experts: int) -> list[int]:
    """The experts compared with Humming's own loader (each of its reads loads a whole shard: about a
    second); the plugin's fill is compared for every expert."""
    return sorted({0, num_experts // 2, num_experts - 1})


def humming_layer_tensors(humming_output: Path, layer_name: str, experts: list[int], names: dict[str, str]):
    """Per expert and projection, what Humming's own HummingLayer.from_safetensors reads."""
    from humming.layer import HummingLayer

    read = {}
    for expert in experts:
        for projection, stored in names.items():
            # torch_dtype float16: the scales as stored (a bf16 model's layer would round them to bf16)
            layer = HummingLayer.from_safetensors(str(humming_output), prefix=f"{layer_name}.{expert}.{stored}",
                                                  torch_dtype=torch.float16)
            read[expert, projection] = ({k: v.detach().clone() for k, v in layer.state_dict().items()},
                                        layer.weight_schema)
    return read


def part_a(inputs: Path, scratch: Path, device, vllm_triton, dtype: torch.dtype, tokens: list[int],
           first: bool) -> None:
    """`first`: also the equality checks (1, 2); every call: Humming and Triton in `dtype` (3, 4)."""
    import moeconv

    for folder in sorted(p for p in inputs.iterdir() if (p / "plugin_params.json").exists()):
        meta_all = json.loads((folder / "plugin_params.json").read_text())
        params_all = load_file(str(folder / "plugin_params.safetensors"))
        source = folder / "src"
        out_triton, out_humming = scratch / folder.name / "triton", scratch / folder.name / "humming"
        if first:  # one worker: in this process, no start-up of worker processes
            out_triton.parent.mkdir(parents=True, exist_ok=True)
            moeconv.convert(source, out_triton, backend="triton", workers=1)
            moeconv.convert(source, out_humming, backend="humming", workers=1)
        triton_config = json.loads((out_triton / "config.json").read_text())["quantization_config"]
        bits, group_size = triton_config["bits"], triton_config["group_size"]
        for layer_name, meta in meta_all["layers"].items():
            params = {name[len(layer_name) + 1:]: t for name, t in params_all.items() if name.startswith(layer_name + ".")}
            e, h, i = meta["num_experts"], meta["hidden"], meta["intermediate_per_partition"]
            row = {"part": "A", "case": f"{folder.name} {layer_name}", "source": meta_all["source"],
                   "backend_at_cc90": meta["backend"], "E": e, "H": h, "I": i, "top_k": meta["top_k"],
                   "group_size": group_size, "has_zp": triton_config["has_zp"], "vllm": meta_all["vllm"],
                   "plugin_log": meta_all["plugin_log"]}
            stacked = stacked_tensors(out_triton, layer_name)
            ref = SourceReference(source, int(re.search(r"layers\.(\d+)\.", layer_name).group(1)), device)
            if first:
                equalities(row, params, stacked, meta, bits, group_size, out_humming, layer_name)
            humming = build_humming(row, params, meta["humming_weight_schema_config"], e, h, i, dtype, device)
            triton_moe = TritonMoE(vllm_triton, stacked, e, h, i, group_size, dtype, device)
            for m in tokens:
                run_case({**row, "part": "A", "dtype": str(dtype).removeprefix("torch."), "tokens": m},
                         humming, triton_moe, ref, m, meta["top_k"], e, dtype, device, timer=None)


def build_humming(row: dict, *args) -> HummingMoE | None:
    """vLLM's Humming post-load step on the parameters, or None (the error recorded as a row)."""
    built = []
    failed = dict(row, part="humming-build")
    if attempt(failed, "humming_build", lambda: built.append(HummingMoE(*args))):
        return built[0]
    emit(failed)
    return None


def equalities(row: dict, params: dict, stacked: dict, meta: dict, bits: int, group_size: int, out_humming: Path,
               layer_name: str) -> None:
    """Checks 1 and 2 of part A; emits the row."""
    from humming.schema import BaseWeightSchema

    e, h, i = meta["num_experts"], meta["hidden"], meta["intermediate_per_partition"]
    # 1. staged parameters == the plugin's fill of the triton output computed here
    filled = plugin_fill(stacked, params, meta, bits, group_size)
    differ = [n for n, t in filled.items() if not torch.equal(t, params[n])]
    row["staged_equals_plugin_fill"] = not differ and set(filled) <= set(params)
    if not row["staged_equals_plugin_fill"]:
        FAILURES.append(f"{row['case']}: staged parameters differ from the plugin's fill: {differ}")
    # 2. after Humming's schema conversion == HummingLayer.from_safetensors of the humming output
    schema = BaseWeightSchema.from_config(meta["humming_weight_schema_config"])
    names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    if not any(".gate_proj." in n for n in json.loads((out_humming / "model.safetensors.index.json")
                                                     .read_text())["weight_map"]):
        names = {"gate": "w1", "up": "w3", "down": "w2"}
    experts = sampled_experts(e)
    read = humming_layer_tensors(out_humming, layer_name, experts, names)
    row["humming_loader_experts"] = experts
    mismatches = []
    for sub, n_stacks, k in (("w13", [i, i], h), ("w2", [h], i)):
        tensors = {n.removeprefix(sub + "_"): t.clone() for n, t in params.items() if n.startswith(sub + "_")}
        tensors["weight_scale"] = tensors["weight_scale"].to(torch.float16)
        conv_schema, conv = schema.convert_humming(tensors=tensors, shape_n_stacks=n_stacks, shape_k_stacks=[k],
                                                   param_dtype=torch.float16, num_experts=e,
                                                   convert_symmetric_integer=False)
        for expert in experts:
            parts = ("gate", "up") if sub == "w13" else ("down",)
            for name, value in conv.items():
                # gate rows then up rows (zero points: packed rows, whole words per part)
                theirs = torch.cat([read[expert, p][0][name] for p in parts])
                if not torch.equal(value[expert].cpu(), theirs.to(value.dtype).cpu()):
                    mismatches.append(f"{sub} expert {expert} {name}")
            theirs_schema = read[expert, parts[0]][1]
            if theirs_schema.bs_dtype is not None and conv_schema.bs_dtype is None:
                # moeconv's humming output names the scales' dtype (bs_dtype float16) where vLLM's
                # compressed-tensors schema leaves it to the parameters' dtype (here float16)
                row["humming_output_bs_dtype"] = str(theirs_schema.bs_dtype)
                theirs_schema = dataclasses.replace(theirs_schema, bs_dtype=None)
            if theirs_schema != conv_schema:
                mismatches.append(f"{sub} schema {conv_schema} != {theirs_schema}")
    row["plugin_params_equal_humming_from_safetensors"] = not mismatches
    row["humming_mismatches"] = sorted(set(mismatches))[:6]
    if mismatches:
        FAILURES.append(f"{row['case']}: Humming's own loader reads other tensors: {mismatches[:3]}")
    emit(dict(row, part="A-equal"))


HARD_LIMIT_S = [330.0]  # --hard-s: no case starts after this (the run must end within 6 minutes)


def attempt(row: dict, label: str, fn) -> bool:
    """Runs one step of a case; an exception is recorded in the row (and fails the run), not raised."""
    try:
        fn()
        return True
    except Exception as error:  # noqa: BLE001 (a failure is a row, and fails the run)
        row[f"{label}_error"] = f"{type(error).__name__}: {str(error)[:400]}"
        row[f"{label}_traceback"] = traceback.format_exc()[-1500:]
        FAILURES.append(f"{row.get('case')} {row.get('dtype')} {row.get('tokens')} {label}: {row[label + '_error']}")
        torch.cuda.synchronize()
        return False


def run_case(row: dict, humming: HummingMoE | None, triton_moe: TritonMoE, ref: SourceReference, m: int,
             top_k: int, num_experts: int, dtype, device, timer: Timer | None) -> None:
    """One token count: both kernels' outputs against the float64 reference (every element written: the
    buffers are poisoned with NaN first), then, with a timer, each GEMM and the whole expert computation
    of both timed, and the outputs checked again. `humming` None: its construction failed (recorded)."""
    row = {k: v for k, v in row.items() if k not in ("plugin_log", "humming_mismatches")}
    if time.monotonic() - STARTED > HARD_LIMIT_S[0]:
        emit({**row, "skipped": f"past {HARD_LIMIT_S[0]} s"})
        return
    generator = torch.Generator(device=device).manual_seed(1000 + m)
    x = torch.randn(m, triton_moe.hidden, generator=generator, device=device).to(dtype)
    topk_weights, topk_ids = random_routing(m, num_experts, top_k, generator, device)
    ref13, _, ref2, ref_layer = reference_moe(ref, x, topk_ids, topk_weights)
    row["ref_rounding_err"] = relative_error(ref_layer.to(dtype), ref_layer)  # the reference's own rounding
    w13_error = channel_sorted_error if ref.act_order else relative_error
    row["w13_check"] = "each row's gate and up channels sorted (act-order fold)" if ref.act_order else "exact"
    t_plan = triton_moe.prepare(topk_ids)
    row["triton_config"] = t_plan["config"]
    h_plan = None
    if humming is not None:
        h_plan = humming.prepare(topk_ids)
        row["humming_blocks"] = list(h_plan["blocks"])

    def check_humming(suffix: str = "") -> None:
        for b in h_plan["buffers"].values():
            b.fill_(float("nan"))  # poison: an element never written shows as NaN
        out = humming.forward(x, topk_weights, h_plan)
        torch.cuda.synchronize()
        if not suffix:
            check(row, w13_error(h_plan["buffers"]["gate_up"], ref13), "humming_w13_err")
            check(row, relative_error(h_plan["buffers"]["down"], ref2), "humming_w2_err")
        check(row, relative_error(out, ref_layer), "humming_layer_err" + suffix)

    def check_triton(suffix: str = "") -> None:
        for b in t_plan["buffers"].values():
            b.fill_(float("nan"))
        out = triton_moe.forward(x, topk_weights, t_plan)
        torch.cuda.synchronize()
        if not suffix:
            check(row, w13_error(t_plan["buffers"]["cache1"].view(m * top_k, -1), ref13), "triton_w13_err")
        check(row, relative_error(out, ref_layer), "triton_layer_err" + suffix)

    humming_ok = humming is not None and attempt(row, "humming", check_humming)
    triton_ok = attempt(row, "triton", check_triton)
    if timer is not None:
        timings = {}
        if humming_ok:
            act_h = h_plan["buffers"]["down_in"]
            timings.update({
                "humming_w13": lambda: humming.gemm("w13", x, h_plan["buffers"]["gate_up"], h_plan),
                "humming_w2": lambda: humming.gemm("w2", act_h, h_plan["buffers"]["down"], h_plan),
                "humming_layer": lambda: humming.forward(x, topk_weights, h_plan)})
        if triton_ok:
            act_t = t_plan["buffers"]["cache2"]
            timings.update({
                "triton_w13": lambda: triton_moe.gemm("w13", x, t_plan["buffers"]["cache1"], t_plan),
                "triton_w2": lambda: triton_moe.gemm("w2", act_t, t_plan["buffers"]["cache3"], t_plan, topk_weights),
                "triton_layer": lambda: triton_moe.forward(x, topk_weights, t_plan)})
        for name, fn in timings.items():
            def timed(name=name, fn=fn):
                graph_us, eager_us, why = timer.median_us(fn)
                row[f"{name}_eager_us"] = eager_us
                if graph_us is not None:
                    row[f"{name}_graph_us"] = graph_us
                else:
                    row[f"{name}_graph_failed"] = why
            attempt(row, f"time_{name}", timed)
        # the comparison in one mode for both: CUDA-graph replays where both captured, else eager launches
        names = [f"{k}_{w}" for k in ("humming", "triton") for w in ("w13", "w2", "layer")]
        mode = "graph" if all(f"{n}_graph_us" in row for n in names) else "eager"
        if all(f"{n}_{mode}_us" in row for n in names):
            row["timed_as"] = mode
            for name in names:
                row[f"{name}_us"] = row[f"{name}_{mode}_us"]
            for what in ("w13", "w2", "layer"):
                row[f"speedup_{what}"] = row[f"triton_{what}_us"] / row[f"humming_{what}_us"]
            row["humming_faster_everywhere"] = all(row[f"speedup_{w}"] > 1 for w in ("w13", "w2", "layer"))
        # after timing (graphs replayed into the same buffers), both run again and are checked again
        if humming_ok:
            attempt(row, "humming_after", lambda: check_humming("_after"))
        if triton_ok:
            attempt(row, "triton_after", lambda: check_triton("_after"))
    emit(row)


# ---------------------------------------------------------------------------------------------------
# Part B: the timing shapes, built here with moeconv
# ---------------------------------------------------------------------------------------------------

SHAPES = {"qwen3-30b-a3b": {"architecture": "qwen3_moe", "experts": 128, "top_k": 8, "hidden": 2048, "intermediate": 768},
          "mixtral-8x7b": {"architecture": "mixtral", "experts": 8, "top_k": 2, "hidden": 4096, "intermediate": 14336}}


class TimingLayer:
    """One timing shape: a GPTQ source made by moeconv.synth, its triton output, the parameters the
    plugin fills from it, and the float64 reference of the source (built once, used for every dtype)."""

    def __init__(self, name: str, scratch: Path, device):
        import moeconv
        from moeconv.formats import GPTQ
        from moeconv.synth import SynthSpec, make_checkpoint

        shape = SHAPES[name]
        started = time.monotonic()
        spec = SynthSpec(architecture=shape["architecture"], source_format=GPTQ(4, 128, sym=True), layers=1,
                         experts=shape["experts"], hidden=shape["hidden"], intermediate=shape["intermediate"],
                         vocab=256, dense_intermediate=256, seed=7)
        source = make_checkpoint(scratch / name / "src", spec)
        output = moeconv.convert(source, scratch / name / "triton", backend="triton").output
        self.build_s = round(time.monotonic() - started, 1)
        index = json.loads((output / "model.safetensors.index.json").read_text())["weight_map"]
        layer_name = next(n.rsplit(".", 1)[0] for n in index if n.endswith(".w13_qweight"))
        self.stacked = stacked_tensors(output, layer_name)
        e, h, i = shape["experts"], shape["hidden"], shape["intermediate"]
        # the compressed-tensors parameters the plugin fills (shapes of CompressedTensorsWNA16MoEMethod)
        like = {"w13_weight_packed": torch.empty(e, 2 * i, h // 8, dtype=torch.int32),
                "w13_weight_scale": torch.empty(e, 2 * i, h // 128, dtype=torch.float16),
                "w2_weight_packed": torch.empty(e, h, i // 8, dtype=torch.int32),
                "w2_weight_scale": torch.empty(e, h, i // 128, dtype=torch.float16)}
        self.params = plugin_fill(self.stacked, like, {"intermediate_per_partition": i}, 4, 128)
        self.ref = SourceReference(source, 0, device)
        self.name, self.shape = name, shape


SCHEMA_SYM_G128 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "type": "int", "num_bits": 4,
                   "strategy": "group", "group_size": 128, "symmetric": True}  # _humming_wna16_weight_schema's


def part_b(layer: TimingLayer, device, vllm_triton, dtype: torch.dtype, tokens: list[int], timer: Timer) -> None:
    e, h, i, top_k = (layer.shape[key] for key in ("experts", "hidden", "intermediate", "top_k"))
    humming = build_humming({"case": layer.name, "dtype": str(dtype)}, layer.params, SCHEMA_SYM_G128, e, h, i, dtype,
                            device)
    triton_moe = TritonMoE(vllm_triton, layer.stacked, e, h, i, 128, dtype, device)
    for m in tokens:
        row = {"part": "B", "case": layer.name, "E": e, "top_k": top_k, "H": h, "I": i,
               "dtype": str(dtype).removeprefix("torch."), "tokens": m, "build_s": layer.build_s}
        run_case(row, humming, triton_moe, layer.ref, m, top_k, e, dtype, device, timer)
    del humming, triton_moe
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------
# Part C: vLLM 0.33's compiled Marlin MoE extension against this machine's torch
# ---------------------------------------------------------------------------------------------------


def part_c(inputs: Path) -> None:
    """Every library and symbol the extension needs, looked up in what this process has loaded (torch
    with CUDA initialized) and, by file, in torch's and the nvidia packages' library folders."""
    info = json.loads((inputs / "marlin_ext.json").read_text())
    if torch.cuda.is_available():
        torch.cuda.init()
    folders = [Path(torch.__file__).parent / "lib"]
    for entry in sys.path:
        folders += list(Path(entry).glob("nvidia/*/lib")) + list(Path(entry).glob("nvidia/cu13/lib"))
    for name, library in info["libraries"].items():
        handles, found_libraries = [ctypes.CDLL(None)], {}
        for needed in library["needed"]:
            handle = None
            try:
                handle = ctypes.CDLL(needed, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                for folder in folders:
                    if (folder / needed).exists():
                        try:
                            handle = ctypes.CDLL(str(folder / needed), mode=ctypes.RTLD_GLOBAL)
                            break
                        except OSError:
                            continue
            found_libraries[needed] = handle is not None
            if handle is not None:
                handles.append(handle)
        missing = [symbol for symbol in library["undefined_symbols"]
                   if not symbol.startswith(("_ITM_", "__gmon")) and symbol != "__pthread_key_create"
                   and not any(hasattr(handle, symbol) for handle in handles)]
        emit({"part": "C", "case": name, "ops": library["ops"], "bytes": library["bytes"],
              "xz_bytes": library["xz_bytes"], "needed_found": found_libraries,
              "undefined": len(library["undefined_symbols"]), "missing_in_this_torch": missing,
              "torch": torch.__version__})


def print_table() -> None:
    """The rows in short, last (the device call returns the end of the output)."""
    print("\n| part | case | dtype | M | humming w13 / w2 / layer us | triton w13 / w2 / layer us | speedup w13 / w2 / layer "
          "| max rel err humming / triton |")
    print("|---|---|---|--:|--:|--:|--:|--:|")
    for row in ROWS:
        if row.get("part") not in ("A", "B") or "tokens" not in row:
            continue
        times = [" / ".join(f"{row[f'{k}_{w}_us']:.1f}" if f"{k}_{w}_us" in row else "-" for w in ("w13", "w2", "layer"))
                 for k in ("humming", "triton")]
        speed = " / ".join(f"{row[f'speedup_{w}']:.2f}" if f"speedup_{w}" in row else "-" for w in ("w13", "w2", "layer"))
        errors = [max([v for k, v in row.items() if k.startswith(side) and k.endswith("_err")] or [float("nan")])
                  for side in ("humming", "triton")]
        flag = " FAIL " + ",".join(row["fail"]) if row.get("fail") else ""
        flag += " ERROR" if any(k.endswith("_error") for k in row) else ""
        flag += f" skipped ({row['skipped']})" if row.get("skipped") else ""
        flag += f" [{row['timed_as']}]" if row.get("timed_as") else ""
        print(f"| {row['part']} | {row['case']} | {row.get('dtype')} | {row['tokens']} | {times[0]} | {times[1]} | {speed} "
              f"| {errors[0]:.1e} / {errors[1]:.1e}{flag} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="C,A,B")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", default="1,16,128")
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--budget-s", type=float, default=200.0,
                        help="after this many seconds, start nothing of a dtype after the first")
    parser.add_argument("--hard-s", type=float, default=330.0, help="start no case after this many seconds")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    HARD_LIMIT_S[0] = args.hard_s
    OUT_FILE.append(args.out / f"h200_serving{('_' + args.tag) if args.tag else ''}.json")
    if os.environ.get("TRITON_INTERPRET") == "1":
        device = torch.device("cpu")
    else:
        device = torch.device("cuda")
    import humming
    import triton

    env = {"part": "env", "tag": args.tag, "torch": torch.__version__, "triton": triton.__version__,
           "humming": getattr(humming, "__version__", "?"), "python": sys.version.split()[0],
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "calls": CALLS}
    emit(env)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",") if d]
    tokens = [int(t) for t in args.tokens.split(",")]
    parts = args.parts.split(",")
    with tempfile.TemporaryDirectory(prefix="h200-serving-") as scratch:
        scratch = Path(scratch)
        try:
            vllm_triton = load_vllm_triton(args.inputs, scratch)
            if "C" in parts:
                part_c(args.inputs)
            timer = Timer(device, args.iterations, warmup=20)
            layers = {}
            # the first dtype in full (within --hard-s); the others while the time budget lasts
            for n, dtype in enumerate(dtypes):
                if n and time.monotonic() - STARTED > args.budget_s:
                    emit({"part": "skipped", "dtype": str(dtype), "why": f"past the {args.budget_s} s budget"})
                    continue
                # the first dtype: the staged layers (small) first, then the timing shapes; later ones the
                # timing shapes first
                for part in (("A", "B") if n == 0 else ("B", "A")):
                    if part not in parts:
                        continue
                    if part == "A":
                        part_a(args.inputs, scratch, device, vllm_triton, dtype, tokens, first=n == 0)
                        continue
                    for shape in [s for s in args.shapes.split(",") if s]:
                        if n and time.monotonic() - STARTED > args.budget_s:
                            emit({"part": "skipped", "case": shape, "dtype": str(dtype), "why": "time budget"})
                            continue
                        if shape not in layers:
                            layers[shape] = TimingLayer(shape, scratch, device)
                        part_b(layers[shape], device, vllm_triton, dtype, tokens, timer)
        except Exception as error:  # noqa: BLE001 (reported, then a non-zero exit)
            FAILURES.append(f"{type(error).__name__}: {error}")
            traceback.print_exc()
    print_table()
    summary = {"part": "summary", "tag": args.tag, "seconds": round(time.monotonic() - STARTED, 1),
               "failures": FAILURES}
    emit(summary)
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
