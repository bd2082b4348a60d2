"""Small (or large) synthetic quantized MoE checkpoints, for the demo, the tests and the benchmarks.

Weights are honest: random float weights quantized per group with min/max (asymmetric) or max-abs
(symmetric) scaling, then packed by the source format's encoder. A few groups are shifted so that
they are all-positive or all-negative, which puts zero points at the edges 0 and 2^b − 1 as real
checkpoints have them. Names and configs follow each architecture (the naming schemes of moeconv/models.py).
Everything is deterministic from the seed, and files are written with the streaming writer, so
checkpoints of many GB can be made in bounded memory.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from moeconv.canonical import QuantizedWeight
from moeconv.checkpoint.writer import ShardWriter
from moeconv.formats import GPTQ, SourceFormat
from moeconv.formats.base import effective_group_size
from moeconv.spec import SAFETENSORS_DTYPES, TensorSpec
from moeconv.worklist import shard_groups

EDGE_GROUP_FRACTION = 0.08  # share of groups pushed to one sign (zero point 0 or 2^b − 1)

ALL = "all"
ROUTED_EXPERTS = "routed-experts"
# The modules a ROUTED_EXPERTS checkpoint leaves in float (attention, shared experts, dense MLPs), as each
# format's producer says it: compressed-tensors' `ignore` (the patterns of moonshotai/Kimi-K2-Thinking's
# config.json), GPTQModel's `dynamic` with negative ("-:") patterns, which skip a module, and AutoAWQ's
# `modules_to_not_convert` (substrings of the module name: `mlp.gate` is in a dense layer's gate_proj, in
# the gate_up_proj engines fuse it into, and in the router, never in `mlp.experts.0.gate_proj`).
_FLOAT_PATTERNS = (r".*self_attn.*", r".*shared_expert.*", r".*mlp\.(gate|up|gate_up|down)_proj.*")
EXCLUSIONS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "compressed-tensors": lambda config: {**config, "ignore": [*config.get("ignore", []),
                                                               *(f"re:{pattern}" for pattern in _FLOAT_PATTERNS)]},
    "gptq": lambda config: {**config, "dynamic": {f"-:{pattern}": {} for pattern in _FLOAT_PATTERNS}},
    "awq": lambda config: {**config, "modules_to_not_convert": ["self_attn", "shared_expert", "mlp.gate",
                                                                "mlp.up_proj", "mlp.down_proj"]},
}


def quantize(weight: torch.Tensor, bits: int, group_size: int, symmetric: bool,
             scale_dtype: torch.dtype) -> QuantizedWeight:
    """Round-to-nearest per-group quantization of a float (N, K) weight."""
    n, k = weight.shape
    g = effective_group_size(k, group_size)
    groups = weight.float().reshape(n, k // g, g)
    top = (1 << bits) - 1
    if symmetric:
        half = 1 << (bits - 1)
        scales = (groups.abs().amax(dim=-1) / (half - 1)).clamp(min=1e-8).to(scale_dtype)
        codes = torch.round(groups / scales.float().unsqueeze(-1)) + half
        zeros = None
    else:
        low, high = groups.amin(dim=-1).clamp(max=0), groups.amax(dim=-1).clamp(min=0)
        scales = ((high - low) / top).clamp(min=1e-8).to(scale_dtype)
        zero_points = torch.round(-low / scales.float()).clamp(0, top)
        codes = torch.round(groups / scales.float().unsqueeze(-1)) + zero_points.unsqueeze(-1)
        zeros = zero_points.to(torch.uint8)
    codes = codes.clamp(0, top).to(torch.uint8).reshape(n, k)
    return QuantizedWeight(codes=codes.numpy(), zeros=None if zeros is None else zeros.numpy(),
                           scales=stored_array(scales), bits=bits, group_size=g)


def stored_array(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor as the numpy array of its stored form, without a copy (BF16, which numpy lacks, as its
    uint16 bit patterns): what the codecs read and write."""
    return tensor.view(torch.int16).numpy().view(np.uint16) if tensor.dtype == torch.bfloat16 else tensor.numpy()


def random_weight(out_features: int, in_features: int, group_size: int, generator: torch.Generator) -> torch.Tensor:
    weight = torch.randn(out_features, in_features, generator=generator) * 0.02
    g = effective_group_size(in_features, group_size)
    groups = weight.view(out_features, in_features // g, g)
    pick = torch.rand(out_features, in_features // g, 1, generator=generator)
    # Push a few groups entirely positive (zero point 0) or negative (zero point 2^b − 1).
    positive = pick < EDGE_GROUP_FRACTION / 2
    negative = (pick >= EDGE_GROUP_FRACTION / 2) & (pick < EDGE_GROUP_FRACTION)
    groups.copy_(torch.where(positive, groups.abs(), torch.where(negative, -groups.abs(), groups)))
    return weight


@dataclass(frozen=True)
class SynthSpec:
    architecture: str = "qwen3_moe"
    source_format: SourceFormat = field(default_factory=lambda: GPTQ(bits=4, group_size=32, sym=False))
    layers: int = 2
    dense_layers: int = 0  # leading dense layers (mlp_only_layers / first_k_dense_replace)
    experts: int = 4
    hidden: int = 128
    intermediate: int = 64  # per routed expert
    dense_intermediate: int = 256
    vocab: int = 256
    dtype: torch.dtype = torch.float16
    mixtral_naming: str = "legacy"  # "legacy": block_sparse_moe.experts.E.w1; "hf": mlp.experts.E.gate_proj
    expert_order: str = "index-first"  # or "modelopt": experts.gate_proj.E.<suffix>
    mtp_layers: int = 0  # qwen3_5_moe: MTP layers (mtp.layers.N.mlp.experts.E.*), left in float as shipped
    quantized_router: bool = False  # the router quantized like the experts (AutoAWQ's and older AutoRound's Qwen3-MoE)
    # ALL: every linear but the router and lm_head quantized. ROUTED_EXPERTS: only the routed experts, as
    # the first-party INT4 checkpoints of the DeepSeek-V3 family ship (moonshotai/Kimi-K2-Thinking,
    # config.json: `ignore` lists lm_head, `re:.*self_attn.*`, `re:.*shared_experts.*` and the dense layers'
    # `re:.*mlp\.(gate|up|gate_up|down)_proj.*`): attention, shared experts and dense MLPs stay in `dtype`,
    # and the config says so in the format's own words (EXCLUSIONS).
    quantized_modules: str = "all"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.quantized_modules not in (ALL, ROUTED_EXPERTS):
            raise ValueError(f"quantized_modules {self.quantized_modules!r}: expected {ALL!r} or {ROUTED_EXPERTS!r}")
        if self.quantized_modules == ROUTED_EXPERTS and self.quantized_router:
            raise ValueError("quantized_router needs quantized_modules='all' (a routed-experts-only checkpoint "
                             "keeps its router in float)")
        if self.quantized_modules == ROUTED_EXPERTS and self.source_format.method not in EXCLUSIONS:
            raise ValueError(f"quantized_modules={ROUTED_EXPERTS!r}: no way known to say so in a "
                             f"{self.source_format.method!r} config")


# A unit is what one call produces: (declared tensors, producer of their values).
_Unit = tuple[list[TensorSpec], Callable[[], dict[str, np.ndarray]]]


class _Builder:
    def __init__(self, spec: SynthSpec):
        self.spec = spec
        self.units: list[_Unit] = []
        self.float_code = SAFETENSORS_DTYPES[spec.dtype]

    def _generator(self, name: str) -> torch.Generator:
        return torch.Generator().manual_seed(self.spec.seed * 1_000_003 + zlib.crc32(name.encode()))

    def dense(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None, ones: bool = False) -> None:
        dtype = dtype or self.spec.dtype

        def make() -> dict[str, np.ndarray]:
            value = torch.ones(shape) if ones else torch.randn(shape, generator=self._generator(name)) * 0.02
            return {name: stored_array(value.to(dtype))}

        self.units.append(([TensorSpec(name, shape, SAFETENSORS_DTYPES[dtype])], make))

    def quantized(self, prefix: str, out_features: int, in_features: int) -> None:
        fmt = self.spec.source_format
        declared = [
            TensorSpec(f"{prefix}.{suffix}", tensor.shape, tensor.dtype or self.float_code)
            for suffix, tensor in fmt.expected(out_features, in_features).items()
            if suffix in fmt.written_suffixes()
        ]

        def make() -> dict[str, np.ndarray]:
            weight = random_weight(out_features, in_features, fmt.group_size, self._generator(prefix))
            canonical = quantize(weight, fmt.bits, fmt.group_size, fmt.symmetric, self.spec.dtype)
            return {f"{prefix}.{suffix}": tensor for suffix, tensor in fmt.encode(canonical).items()}

        self.units.append((declared, make))

    def linear(self, prefix: str, out_features: int, in_features: int) -> None:
        """A linear that is not a routed expert: quantized, or (ROUTED_EXPERTS) a float `weight`."""
        if self.spec.quantized_modules == ROUTED_EXPERTS:
            self.dense(f"{prefix}.weight", (out_features, in_features))
        else:
            self.quantized(prefix, out_features, in_features)

    def mlp(self, prefix: str, names: tuple[str, str, str], intermediate: int) -> None:
        gate, up, down = names
        self.linear(f"{prefix}.{gate}", intermediate, self.spec.hidden)
        self.linear(f"{prefix}.{up}", intermediate, self.spec.hidden)
        self.linear(f"{prefix}.{down}", self.spec.hidden, intermediate)

    def experts(self, module: str, names: tuple[str, str, str], quantized: bool = True) -> None:
        """Routed experts under `module` (ending in `.experts`), index first or (ModelOpt) projection first."""
        spec = self.spec
        for expert in range(spec.experts):
            for name, out_in in zip(names, ((spec.intermediate, spec.hidden),) * 2 + ((spec.hidden, spec.intermediate),)):
                prefix = f"{module}.{name}.{expert}" if spec.expert_order == "modelopt" else f"{module}.{expert}.{name}"
                if quantized:
                    self.quantized(prefix, *out_in)
                else:
                    self.dense(f"{prefix}.weight", out_in)


_HF_NAMES = ("gate_proj", "up_proj", "down_proj")


# model_type -> (class name, naming family). Families: "qwen" (mlp.experts, shared_expert),
# "deepseek" (mlp.experts, shared_experts, router bias), "mixtral" (block_sparse_moe.experts.E.w1).
_FAMILIES = {"mixtral": ("MixtralForCausalLM", "mixtral"), "qwen2_moe": ("Qwen2MoeForCausalLM", "qwen"),
             "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen"), "qwen3_next": ("Qwen3NextForCausalLM", "qwen"),
             "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", "qwen"),
             "deepseek_v2": ("DeepseekV2ForCausalLM", "deepseek"), "deepseek_v3": ("DeepseekV3ForCausalLM", "deepseek"),
             "kimi_k2": ("DeepseekV3ForCausalLM", "deepseek"), "glm4_moe": ("Glm4MoeForCausalLM", "deepseek"),
             "minimax_m2": ("MiniMaxM2ForCausalLM", "mixtral")}
_QWEN3_HEADS = 2  # attention heads (and KV heads) of a synthetic Qwen3-MoE: head_dim = hidden / 2
_ROUTER_BIAS = ("deepseek_v3", "kimi_k2", "glm4_moe")  # e_score_correction_bias beside the router
# DeepSeek's multi-head latent attention (MLA), small: its projections in place of q/k/v/o_proj. V2 has
# no query LoRA (q_proj); V3 and Kimi-K2 do (q_a_proj, q_a_layernorm, q_b_proj).
_MLA = {"num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 128, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 32, "v_head_dim": 32}
_MLA_Q_LORA = {"deepseek_v2": None, "deepseek_v3": 128, "kimi_k2": 128}


def _build(spec: SynthSpec) -> tuple[_Builder, dict[str, Any]]:
    b = _Builder(spec)
    h, arch = spec.hidden, spec.architecture
    family = _FAMILIES[arch][1]
    root = "model.language_model" if arch == "qwen3_5_moe" else "model"
    b.dense(f"{root}.embed_tokens.weight", (spec.vocab, h))
    for layer in range(spec.layers):
        p = f"{root}.layers.{layer}"
        b.dense(f"{p}.input_layernorm.weight", (h,), ones=True)
        b.dense(f"{p}.post_attention_layernorm.weight", (h,), ones=True)
        if arch in _MLA_Q_LORA:
            _mla(b, f"{p}.self_attn", h, _MLA_Q_LORA[arch])
        else:
            for projection in ("q_proj", "k_proj", "v_proj", "o_proj"):
                b.linear(f"{p}.self_attn.{projection}", h, h)
        if arch == "qwen2_moe":  # Qwen2's attention has q/k/v biases (float beside quantized linears)
            for projection in ("q_proj", "k_proj", "v_proj"):
                b.dense(f"{p}.self_attn.{projection}.bias", (h,))
        if arch == "qwen3_moe":  # Qwen3's per-head RMSNorm of queries and keys
            for norm in ("q_norm", "k_norm"):
                b.dense(f"{p}.self_attn.{norm}.weight", (h // _QWEN3_HEADS,), ones=True)
        if arch == "minimax_m2":  # MiniMax-M2's RMSNorm over all heads' queries and keys (heads x head_dim = h)
            for norm in ("q_norm", "k_norm"):
                b.dense(f"{p}.self_attn.{norm}.weight", (h,), ones=True)
        if layer < spec.dense_layers:
            b.mlp(f"{p}.mlp", _HF_NAMES, spec.dense_intermediate)
            continue
        if family == "mixtral" and (arch == "minimax_m2" or spec.mixtral_naming == "legacy"):
            moe, names = f"{p}.block_sparse_moe", ("w1", "w3", "w2")
        else:
            moe, names = f"{p}.mlp", _HF_NAMES
        if spec.quantized_router:
            b.quantized(f"{moe}.gate", spec.experts, h)
        else:
            b.dense(f"{moe}.gate.weight", (spec.experts, h), dtype=torch.float32 if family == "deepseek" else None)
        if arch in _ROUTER_BIAS:
            b.dense(f"{moe}.gate.e_score_correction_bias", (spec.experts,), dtype=torch.float32)
        b.experts(f"{moe}.experts", names)
        if arch in ("qwen2_moe", "qwen3_next", "qwen3_5_moe"):
            b.mlp(f"{moe}.shared_expert", _HF_NAMES, spec.intermediate * 2)
            b.dense(f"{moe}.shared_expert_gate.weight", (1, h))
        if family == "deepseek":
            b.mlp(f"{moe}.shared_experts", _HF_NAMES, spec.intermediate)
    for layer in range(spec.mtp_layers):  # Qwen3.5's MTP layers ship unquantized
        b.experts(f"mtp.layers.{layer}.mlp.experts", _HF_NAMES, quantized=False)
    b.dense(f"{root}.norm.weight", (h,), ones=True)
    b.dense("lm_head.weight", (spec.vocab, h))
    return b, _config(spec)


def _mla(b: _Builder, prefix: str, hidden: int, q_lora_rank: int | None) -> None:
    heads, rank = _MLA["num_attention_heads"], _MLA["kv_lora_rank"]
    nope, rope, v = _MLA["qk_nope_head_dim"], _MLA["qk_rope_head_dim"], _MLA["v_head_dim"]
    if q_lora_rank is None:
        b.linear(f"{prefix}.q_proj", heads * (nope + rope), hidden)
    else:
        b.linear(f"{prefix}.q_a_proj", q_lora_rank, hidden)
        b.dense(f"{prefix}.q_a_layernorm.weight", (q_lora_rank,), ones=True)
        b.linear(f"{prefix}.q_b_proj", heads * (nope + rope), q_lora_rank)
    b.linear(f"{prefix}.kv_a_proj_with_mqa", rank + rope, hidden)
    b.dense(f"{prefix}.kv_a_layernorm.weight", (rank,), ones=True)
    b.linear(f"{prefix}.kv_b_proj", heads * (nope + v), rank)
    b.linear(f"{prefix}.o_proj", hidden, heads * v)


def _config(spec: SynthSpec) -> dict[str, Any]:
    arch = spec.architecture
    family = _FAMILIES[arch][1]
    config: dict[str, Any] = {
        "architectures": [_FAMILIES[arch][0]],
        "model_type": arch,
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "vocab_size": spec.vocab,
        "torch_dtype": str(spec.dtype).removeprefix("torch."),
        "quantization_config": spec.source_format.quantization_config(),
    }
    if spec.quantized_modules == ROUTED_EXPERTS:
        config["quantization_config"] = EXCLUSIONS[spec.source_format.method](config["quantization_config"])
    if family == "mixtral":
        config.update(num_local_experts=spec.experts, intermediate_size=spec.intermediate, num_experts_per_tok=2)
    elif family == "qwen":
        config.update(num_experts=spec.experts, moe_intermediate_size=spec.intermediate,
                      intermediate_size=spec.dense_intermediate, num_experts_per_tok=2, decoder_sparse_step=1,
                      mlp_only_layers=list(range(spec.dense_layers)))
        if arch != "qwen3_moe":
            config["shared_expert_intermediate_size"] = spec.intermediate * 2
    else:
        config.update(n_routed_experts=spec.experts, moe_intermediate_size=spec.intermediate,
                      intermediate_size=spec.dense_intermediate, num_experts_per_tok=2, n_shared_experts=1,
                      first_k_dense_replace=spec.dense_layers)
        if arch in _ROUTER_BIAS:  # the router's e_score_correction_bias exists only with this routing
            config.update(topk_method="noaux_tc", n_group=1, topk_group=1)
        if arch in _MLA_Q_LORA:  # moe_layer_freq, scoring_func: DeepSeek's config.json has them, SGLang reads them
            config.update(_MLA, q_lora_rank=_MLA_Q_LORA[arch], max_position_embeddings=4096, moe_layer_freq=1,
                          scoring_func="sigmoid" if arch in _ROUTER_BIAS else "softmax")
    if arch == "qwen3_moe":  # q/k/v_proj are hidden x hidden: as many KV heads as heads (the default has 4 of 32)
        config.update(num_attention_heads=_QWEN3_HEADS, num_key_value_heads=_QWEN3_HEADS,
                      head_dim=spec.hidden // _QWEN3_HEADS)
    if arch in ("glm4_moe", "minimax_m2"):  # attention sizes their configs have no usable default for
        config.update(num_attention_heads=2, num_key_value_heads=2, head_dim=spec.hidden // 2,
                      rotary_dim=spec.hidden // 2, partial_rotary_factor=1.0)
    if arch == "minimax_m2":
        config.update(scoring_func="sigmoid", use_routing_bias=False)
    if arch == "qwen3_5_moe":  # a multimodal wrapper: the language model's sizes live in text_config
        text = {key: config.pop(key) for key in list(config) if key not in ("architectures", "model_type",
                                                                               "torch_dtype", "quantization_config")}
        config["text_config"] = {"model_type": "qwen3_5_moe_text", **text, "mtp_num_hidden_layers": spec.mtp_layers}
    return config


def make_checkpoint(path: Path, spec: SynthSpec = SynthSpec(), max_shard_size: int = 2 * 1000**3) -> Path:
    """Writes a synthetic checkpoint folder at `path` (created; must not hold one already)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    builder, config = _build(spec)
    shards = shard_groups(builder.units, lambda unit: sum(tensor.nbytes for tensor in unit[0]), max_shard_size)
    weight_map, total = {}, 0
    for index, units in enumerate(shards):
        file_name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        declared = [tensor for unit in units for tensor in unit[0]]
        with ShardWriter(path / file_name, declared, {"format": "pt"}) as writer:
            for _, make in units:
                for name, tensor in make().items():
                    writer.write(name, tensor)
        for tensor in declared:
            weight_map[tensor.name] = file_name
            total += tensor.nbytes
    _write_json(path / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_json(path / "config.json", config)
    if spec.source_format.method == "gptq":
        _write_json(path / "quantize_config.json", config["quantization_config"])
    _write_json(path / "generation_config.json", {"do_sample": False, "max_new_tokens": 16})
    _write_json(path / "tokenizer_config.json", {"model_max_length": 4096, "tokenizer_class": "PreTrainedTokenizerFast"})
    return path


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")

