"""Tiny Qwen3-MoE checkpoints quantized by the REAL AutoRound 0.16.1, in every integer format it writes on
CPU, with AutoRound's own quantizer's reading of the same float weights as the truth.

Runs in .venv-packers (scripts/install-packers.sh), never in the main venv. From the repo root:

    .venv-packers/bin/python tests/packers/make_autoround.py tests/data/autoround [NAME ...]
    .venv-packers/bin/python tests/packers/make_autoround.py --truth tests/data/autoround TRUTH_DIR

The first form (a few minutes on 2 cores) makes the committed fixtures: small random bf16
Qwen3MoeForCausalLMs (seeded; 1 MoE layer of 2 experts, a 16-token WordLevel tokenizer built offline,
see Float), each quantized with `AutoRound(..., iters=0, disable_opt_rtn=True)` (plain RTN, no
calibration) and `quantize_and_save(format=...)` into `NAME/` (VARIANTS: sym and asym, group 32 and
128, the `auto_round` format's packings, `extra_config` overrides, the `auto_gptq` / `auto_awq` exports,
a K that is not a multiple of the group size), and `floats.json`, the digest of each float model.

The second form (the tests run it) rebuilds the float models, checks their digests, and writes
`TRUTH_DIR/NAME.truth.safetensors`: for every linear the checkpoint holds quantized, what AutoRound's own
quantizer makes of its float weight, `quant_tensor_sym` / `quant_tensor_asym` (auto_round.data_type.int,
the functions its RTN path calls) applied to the float weight (cast to float32 as the `auto_round` format's model-free RTN does, or in
bf16 as its model route does for the other exports) with that layer's bits and group size:
`<prefix>.codes` uint8 (N, K) = qdq / scale + zero, `<prefix>.zeros` uint8 (N, G) (true zero points;
2^(b-1) when symmetric), `<prefix>.scales` float16 (N, G) (signed when symmetric: AutoRound maps each
group's largest magnitude to -2^(b-1)). The last group of a K % g != 0 linear is short (the quantizer
pads it with zeros). moeconv's tests compare their decodings with these.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

@dataclass(frozen=True)
class Float:
    """A random bf16 Qwen3MoeForCausalLM (seeded: the same weights on every run of these pinned versions)."""

    hidden: int = 128
    intermediate: int = 64  # moe_intermediate_size: the down projection's K
    heads: int = 2
    head_dim: int = 32
    experts: int = 2
    vocab: int = 16


SMALL, WIDE, PARTIAL = Float(), Float(hidden=256, intermediate=128, heads=4), Float(intermediate=48)


@dataclass(frozen=True)
class Variant:
    format: str  # quantize_and_save's format
    sym: bool
    group_size: int
    model: Float = SMALL
    layer_config: dict = field(default_factory=dict)


MIXED = {"model.layers.0.self_attn.q_proj": {"bits": 8, "group_size": 64},  # a dense linear at 8 bits, g64
         "model.layers.0.self_attn.o_proj": {"bits": 16}}  # a dense linear kept 16-bit
KEEP16 = {"model.layers.0.self_attn.o_proj": {"bits": 16}}  # only a dense linear kept 16-bit: no scheme differs

VARIANTS = {
    "ar-gptq-sym-g32": Variant("auto_round", True, 32),  # packing_format auto_round:auto_gptq
    "ar-plain-asym-g32": Variant("auto_round", False, 32),  # RTN's asymmetric default: plain auto_round
    "ar-awq-asym-g32": Variant("auto_round:auto_awq", False, 32),
    "ar-gptq-sym-g32-mixed": Variant("auto_round", True, 32, layer_config=MIXED),
    "ar-gptq-sym-g32-keep16": Variant("auto_round", True, 32, layer_config=KEEP16),
    "awq-sym-g32": Variant("auto_awq", True, 32),  # quant_method awq, zero_point false, qzeros all 8
    "ar-gptq-sym-g128": Variant("auto_round", True, 128, WIDE),
    "ar-awq-asym-g128": Variant("auto_round:auto_awq", False, 128, WIDE),  # (its AWQ packer needs K >= g)
    "ar-gptq-sym-g32-partial": Variant("auto_round", True, 32, PARTIAL),  # down K = 48: 1.5 groups
}
# No quantized-router variant: asked for {"model.layers.0.mlp.gate": {"bits": 4}} (8 experts), AutoRound
# 0.16.1's RTN still keeps the router 16-bit and says so in extra_config.


def build_float_model(folder: Path, model: Float) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=model.hidden, moe_intermediate_size=model.intermediate,
                            intermediate_size=model.hidden, num_experts=model.experts, num_experts_per_tok=2,
                            num_hidden_layers=1, num_attention_heads=model.heads, num_key_value_heads=1,
                            head_dim=model.head_dim, vocab_size=model.vocab, max_position_embeddings=64,
                            decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(model.vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token="t1",
                            eos_token="t2").save_pretrained(folder)


def quantize(float_dir: Path, out: Path, variant: Variant) -> None:
    from auto_round import AutoRound

    with tempfile.TemporaryDirectory() as tmp:
        rounder = AutoRound(str(float_dir), bits=4, group_size=variant.group_size, sym=variant.sym, iters=0,
                            disable_opt_rtn=True, device_map="cpu", enable_torch_compile=False,
                            layer_config=variant.layer_config or None)
        rounder.quantize_and_save(tmp, format=variant.format)
        # The auto_round format saves into OUT itself, the others into OUT/<model name>-w4g<g>/.
        made = next(path.parent for path in Path(tmp).rglob("config.json"))
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(made, out, ignore=shutil.ignore_patterns(".cache"))


def truth(float_dir: Path, out: Path, variant: Variant) -> dict[str, torch.Tensor]:
    """AutoRound's quantizer on every linear the checkpoint holds quantized (those with a qweight or
    weight_packed), with the layer's own bits and group size."""
    from safetensors import safe_open
    from auto_round.data_type.int import quant_tensor_asym, quant_tensor_sym

    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as stored:
        quantized = sorted({name.rsplit(".", 1)[0] for name in stored.keys()
                            if name.endswith((".qweight", ".weight_packed"))})
    # AutoRound's model-free RTN (the `auto_round` format's route) quantizes the weight cast to float32
    # (auto_round/utils/model_free_utils.py, quantize_weight_rtn); its model route (the other exports)
    # quantizes the layer's own bf16 weight, so its scales are computed in bf16.
    model_free = json.loads((out / "config.json").read_text())["quantization_config"].get("model_free") is True
    found = {}
    with safe_open(str(float_dir / "model.safetensors"), "pt") as floats:
        for prefix in quantized:
            weight = floats.get_tensor(f"{prefix}.weight")
            weight = weight.float() if model_free else weight
            own = variant.layer_config.get(prefix, {})
            bits, g = own.get("bits", 4), own.get("group_size", variant.group_size)
            n, k = weight.shape
            if variant.sym:
                qdq, scale, zero = quant_tensor_sym(weight, bits=bits, group_size=g)
            else:
                qdq, scale, zero = quant_tensor_asym(weight, bits=bits, group_size=g)
            groups = -(-k // g)
            scale = scale.reshape(n, groups)
            zeros = torch.full((n, groups), zero, dtype=torch.float32) if variant.sym else zero.reshape(n, groups)
            per_column = torch.arange(k) // g
            # qdq = s·(q − z) in the weight's dtype: exact in float32; in bf16 within 2^-8 relative of
            # an integer multiple of s, so the rounding below recovers q − z (checked to be far from .5)
            steps = qdq.float() / scale[:, per_column].float()
            assert bool(((steps - steps.round()).abs() < 0.25).all()), prefix
            codes = steps.round() + zeros[:, per_column].float()
            found[f"{prefix}.codes"] = codes.to(torch.uint8)
            found[f"{prefix}.zeros"] = zeros.to(torch.uint8)
            found[f"{prefix}.scales"] = scale.to(torch.float16)
    return found


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make(root: Path, names: list[str]) -> None:
    """Quantize: OUT/NAME/ per variant, and OUT/floats.json with the digest of each float model."""
    root.mkdir(parents=True, exist_ok=True)
    digests = json.loads((root / "floats.json").read_text()) if (root / "floats.json").exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        folders = {}
        for model in dict.fromkeys(VARIANTS[name].model for name in names):  # all before AutoRound runs: a
            folders[model] = Path(tmp) / f"float-{len(folders)}"             # model built after it differs
            build_float_model(folders[model], model)
        for name in names:
            variant = VARIANTS[name]
            folder = folders[variant.model]
            digests[name] = _digest(folder / "model.safetensors")
            quantize(folder, root / name, variant)
            config = json.loads((root / name / "config.json").read_text())["quantization_config"]
            print(name, config.get("quant_method"), config.get("packing_format", ""), flush=True)
    (root / "floats.json").write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")


def write_truths(root: Path, out: Path) -> None:
    """The truth for every variant under ROOT, from the float models rebuilt here (their digests must be
    the ones `make` recorded: the same weights AutoRound quantized)."""
    from safetensors.torch import save_file

    digests = json.loads((root / "floats.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        folders = {}
        for name, digest in sorted(digests.items()):
            variant = VARIANTS[name]
            folder = folders.setdefault(variant.model, Path(tmp) / f"float-{len(folders)}")
            if not folder.exists():
                build_float_model(folder, variant.model)
            if _digest(folder / "model.safetensors") != digest:
                raise SystemExit(f"make_autoround: the rebuilt float model of {name} differs from the one quantized")
            save_file(truth(folder, root / name, variant), str(out / f"{name}.truth.safetensors"))


def main() -> int:
    if sys.argv[1:2] == ["--truth"]:
        write_truths(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        make(Path(sys.argv[1]), sys.argv[2:] or list(VARIANTS))
    print("make_autoround: OK")
    return 0


if __name__ == "__main__":  # AutoRound's model-free RTN runs a process pool: spawned children import this file
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
