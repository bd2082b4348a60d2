"""`make test-engines`: which moeconv outputs stock vLLM 0.33 loads, shown with vLLM's own loader.

Runs in the main venv; tests/engines/vllm_load.py runs in .venv-engines (vllm==0.33.0). For every
architecture × source format, a synthetic source checkpoint is converted to every backend that takes
it; the sources and all outputs are then loaded by vLLM on the CPU in one process. Prints the matrix
(markdown) and exits 1 when an output that should load (compressed-tensors; humming from symmetric
sources) does not, or leaves a checkpoint tensor unconsumed or a parameter unloaded. The humming outputs of
float-coded sources are also read by Humming's own loader (tests/engines/humming_load.py: the parameters are the
file's bytes and Humming's own conversion of the source), a second table that fails on any difference.

    .venv/bin/python tests/engines/run_matrix.py [--keep DIR] [--only GROUP ...]

`--only` runs only the named groups of real and special checkpoints (EXTRA_GROUPS: the synthetic
matrix is skipped), e.g. `--only autoround` for the AutoRound 0.16.1 fixtures and their outputs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import moeconv
from moeconv.backends import REGISTRY
from moeconv.errors import MoeconvError
from moeconv.formats import AWQ, GPTQ, CompressedTensors, ModelOpt, format_from_config
from moeconv.synth import ROUTED_EXPERTS, SynthSpec, make_checkpoint

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PYTHON = ROOT / ".venv-engines" / "bin" / "python"
# DeepSeek-V3 with its multi-head latent attention (synth writes MLA for the DeepSeek family)
ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "kimi_k2", "glm4_moe", "minimax_m2")
SOURCES = {
    "gptq-sym": GPTQ(4, 32, sym=True),
    "gptq-v1-asym": GPTQ(4, 32, sym=False),
    "awq": AWQ(4, 32),
    "ct-asym": CompressedTensors(bits=4, group_size=32, symmetric=False),
    "ct-w8a8": CompressedTensors(format="int-quantized", bits=8, group_size=-1, activation_bits=8),
}
# Parameters vLLM creates that no checkpoint carries (kv-cache quantization scales of the attention
# layers); a synthetic source's own absences (e.g. Qwen3's q_norm / k_norm, which synth does not
# write) are found by loading the sources themselves (every source of one architecture has the same
# non-expert tensors) and are not counted against a conversion.
NOT_IN_CHECKPOINTS = (".attn.k_scale", ".attn.v_scale", ".attn.q_scale", ".attn.k_zero_point",
                      ".attn.v_zero_point", ".attn.q_zero_point",
                      ".attn.prob_scale")  # the fp8 config's Fp8KVCacheMethod (quantization/kv_cache.py) adds it


def expected_to_load(backend: str, source_format) -> bool:
    """compressed-tensors always; humming from symmetric sources (vLLM's loader rejects the standard
    schema's expert zero points); triton through moeconv's plugin when vLLM loads the source's dense
    linears (its GPTQ is symmetric only)."""
    if backend.startswith("--cast "):  # _casts: a cast output is the engines' own FP8 block or BF16 checkpoint
        return True
    if backend == "compressed-tensors":
        return source_format is not None  # None: a case shown without an expectation (_float)
    if backend == "triton":
        if source_format is None:  # a case shown without an expectation (_float)
            return False
        if source_format.method == "modelopt":  # the dense linears stay ModelOpt's int4, which vLLM 0.33 does not read
            return False
        return source_format.method != "gptq" or source_format.symmetric
    if backend == "humming" and source_format is not None and source_format.float_scheme is not None:
        # Humming's FP4 schema: MXFP4 loads; NVFP4's per-expert weight_scale_2 does not (vLLM's Humming MoE method
        # keeps one a expert and its per-tensor loader indexes it by shard: engines/vllm_0_33.humming_float)
        return source_format.float_scheme.global_convention is None
    return backend == "humming" and source_format is not None and source_format.symmetric


def not_consumed(result: dict) -> list[str]:
    """Checkpoint tensors no loader consumed, but for GPTQ's `.g_idx`: vLLM's own weight mapper drops
    them (its kernels take none), and moeconv copies only trivial ones (k // g)."""
    return [name for name in result["not_consumed"] if not name.endswith(".g_idx")]


def command_line(doc: str, engine_python: Path = ENGINE_PYTHON, make_target: str = "make engines",
                 groups: tuple[str, ...] = (),
                 only_help: str = "run only these groups, not the synthetic matrix") -> argparse.Namespace:
    """The engine scripts' option (`--keep DIR`; `--only GROUP ...` where the script has `groups`), once
    the engine's venv is there."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="write the checkpoints here instead of a temporary folder")
    if groups:
        parser.add_argument("--only", nargs="+", choices=groups, metavar="GROUP",
                            help=f"{only_help}: {', '.join(groups)}")
    args = parser.parse_args()
    if not engine_python.exists():
        sys.exit(f"{engine_python} is missing: run `{make_target}` first")
    return args


def main() -> None:
    args = command_line(__doc__, groups=tuple(EXTRA_GROUPS))
    with tempfile.TemporaryDirectory(prefix="moeconv-engines-") as scratch:
        base = args.keep or Path(scratch)
        cases, refusals = [], {}
        for architecture in ARCHITECTURES if not args.only else ():
            for source_name, fmt in SOURCES.items():
                source = make_checkpoint(base / architecture / source_name / "src",
                                         SynthSpec(architecture=architecture, source_format=fmt))
                _convert_all(base, cases, refusals, architecture, architecture, source_name, source, fmt, list(REGISTRY))
        for group in args.only or EXTRA_GROUPS:
            EXTRA_GROUPS[group](base, cases, refusals)
        done = subprocess.run([str(ENGINE_PYTHON), str(ROOT / "tests" / "engines" / "vllm_load.py"),
                               *[str(case[3]) for case in cases]], capture_output=True, text=True, timeout=3600)
        results = {json.loads(line)["checkpoint"]: json.loads(line) for line in done.stdout.splitlines()
                   if line.startswith("{")}
        if len(results) != len(cases):
            sys.exit(f"vllm_load.py answered {len(results)} of {len(cases)} checkpoints:\n{done.stderr[-3000:]}")
        failures = _report(cases, results, refusals)
        failures += _humming_own_loader(cases)
    sys.exit(1 if failures else 0)


def _humming_own_loader(cases) -> list[str]:
    """Humming's own loader (tests/engines/humming_load.py) on every humming output of a float-coded source: each
    linear's parameters are the file's bytes and equal Humming's own conversion of the source. Prints a second
    table; a problem or an error is a failure."""
    sources = {(architecture, name): path for architecture, name, backend, path, _ in cases if backend == "(source)"}
    pairs = [(sources[(architecture, name)], path) for architecture, name, backend, path, fmt in cases
             if backend == "humming" and fmt is not None and fmt.float_scheme is not None]
    if not pairs:
        return []
    done = subprocess.run([str(ENGINE_PYTHON), str(ROOT / "tests" / "engines" / "humming_load.py"),
                           *[str(path) for pair in pairs for path in pair]], capture_output=True, text=True,
                          timeout=1800)
    answers = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if len(answers) != len(pairs):
        return [f"humming_load.py answered {len(answers)} of {len(pairs)} outputs: {done.stderr[-2000:]}"]
    print("\n| humming output of | Humming 0.1.19's own loader (HummingLayer.from_safetensors) | its conversion of the "
          "source (convert_humming) | vLLM's expert parameters against the file's bytes |")
    print("|---|---|---|---|")
    failures = []
    for answer in answers:
        if "error" in answer:
            failures.append(f"{answer['output']}: {answer['error']}")
            print(f"| {answer['source']} | error: {answer['error'][:140]} | |")
            continue
        vllm = answer["vllm"]
        held = (f"{vllm['expert_tensors_compared']} expert tensors, the same bytes and dtypes" if vllm["loaded"]
                else f"not loaded: {vllm['error'][:80]}")
        print(f"| {answer['source']} | {answer['linears']} linears, {answer['problem_count']} problem(s) "
              f"{answer['problems'][:1]} | equal on {answer['equal_to_humming_conversion']} of {answer['linears']} | "
              f"{held} |")
        if answer["problem_count"]:
            failures.append(f"{answer['output']}: {answer['problems']}")
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    return failures


MODELOPT = ROOT / "tests" / "data" / "modelopt" / "int4-g32"  # exported by the real ModelOpt 0.47.0
AUTOROUND = ROOT / "tests" / "data" / "autoround"  # written by the real AutoRound 0.16.1


def _fp8_attention(source: Path) -> Path:
    """The source with every o_proj in DeepSeek's FP8 block format (`weight` F8_E4M3, `weight_scale_inv`
    F32 per 128x128 block) instead of its integer tensors: FP8 linears beside integer experts."""
    import torch
    from safetensors.torch import load_file, save_file

    index_path = source / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    generator = torch.Generator().manual_seed(0)
    for shard in sorted(source.glob("*.safetensors")):
        tensors = load_file(str(shard))
        prefixes = {name.rsplit(".", 1)[0] for name in tensors if ".self_attn.o_proj." in name}
        for prefix in prefixes:
            old = [name for name in tensors if name.startswith(prefix + ".")]
            n = tensors[f"{prefix}.scales"].shape[1]
            k = tensors[f"{prefix}.qweight"].shape[0] * 8  # 4-bit GPTQ
            for name in old:
                del tensors[name], index["weight_map"][name]
            tensors[f"{prefix}.weight"] = (torch.randn(n, k, generator=generator) * 64).to(torch.float8_e4m3fn)
            tensors[f"{prefix}.weight_scale_inv"] = torch.rand(-(-n // 128), -(-k // 128), generator=generator) / 64
            index["weight_map"].update(dict.fromkeys((f"{prefix}.weight", f"{prefix}.weight_scale_inv"), shard.name))
        if prefixes:
            save_file(tensors, str(shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    return source


def _convert_all(base: Path, cases: list, refusals: dict, folder: str, label: str, source_name: str, source: Path,
                 fmt, backends) -> None:
    """The source and its output on each of `backends` (or moeconv's refusal) as cases of the matrix."""
    cases.append((label, source_name, "(source)", source, fmt))
    for backend in backends:
        out = base / folder / source_name / backend
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            moeconv.convert(source, out, backend=backend)
        except MoeconvError as refusal:
            refusals[(label, source_name, backend)] = str(refusal)
            continue
        cases.append((label, source_name, backend, out, fmt))


def _mixtral_t5(base: Path, cases: list, refusals: dict) -> None:
    """A Mixtral under transformers 5 names (mlp.experts.E.gate_proj: vLLM 0.33 refuses the source, its
    outputs must carry block_sparse_moe names)."""
    sym = SOURCES["gptq-sym"]
    t5 = make_checkpoint(base / "mixtral-t5" / "gptq-sym" / "src",
                         SynthSpec(architecture="mixtral", mixtral_naming="hf", source_format=sym))
    _convert_all(base, cases, refusals, "mixtral-t5", "mixtral (transformers 5 names)", "gptq-sym", t5, sym,
                 list(REGISTRY))


def _modelopt(base: Path, cases: list, refusals: dict) -> None:
    """The real ModelOpt int4 export (vLLM 0.33 refuses it)."""
    _convert_all(base, cases, refusals, "modelopt", "qwen3_moe (ModelOpt 0.47.0)", "modelopt-int4", MODELOPT,
                 ModelOpt(group_size=32), list(REGISTRY))


def _fp8_beside(base: Path, cases: list, refusals: dict) -> None:
    """FP8 block-scaled attention beside INT4 experts (compressed-tensors: a config group of its own). The
    source config (GPTQ) does not describe its FP8 linears, so vLLM refuses the source and what keeps its
    dense layers (triton, cpu) alike: only the whole-checkpoint outputs are its point."""
    sym = SOURCES["gptq-sym"]
    plain = make_checkpoint(base / "fp8-beside" / "gptq-sym" / "plain",
                            SynthSpec(hidden=256, intermediate=128, source_format=sym))
    # loaded first: what the synthetic source itself leaves unloaded, also when --only skips the matrix
    cases.append(("qwen3_moe (FP8 block o_proj)", "gptq-sym before the FP8 o_proj", "(source)", plain, sym))
    fp8 = _fp8_attention(Path(shutil.copytree(plain, base / "fp8-beside" / "gptq-sym" / "src")))
    _convert_all(base, cases, refusals, "fp8-beside", "qwen3_moe (FP8 block o_proj)", "gptq-sym", fp8, sym,
                 ["compressed-tensors", "humming"])


def _autoround(base: Path, cases: list, refusals: dict) -> None:
    """Every checkpoint the real AutoRound 0.16.1 wrote (tests/data/autoround: its own format in each
    packing, its AWQ export, extra_config overrides, a partial last group) and its outputs; those moeconv
    refuses (per-layer bits, K % g != 0) are loaded as sources only, to show what vLLM makes of them."""
    for fixture, _, fmt in fixtures_in(AUTOROUND):  # a config moeconv refuses: every backend says so
        _convert_all(base, cases, refusals, "autoround", "qwen3_moe (AutoRound 0.16.1)", fixture.name, fixture,
                     fmt, list(REGISTRY))


def _quantized_router(base: Path, cases: list, refusals: dict) -> None:
    """A Qwen3-MoE whose router mlp.gate is GPTQ-quantized like its experts (as AutoAWQ and older AutoRound
    write; vLLM's Qwen3-MoE hands its gate the quant config): 8 experts, so that GPTQ can pack its rows."""
    sym = SOURCES["gptq-sym"]
    source = make_checkpoint(base / "quantized-router" / "gptq-sym" / "src",
                             SynthSpec(experts=8, quantized_router=True, source_format=sym))
    _convert_all(base, cases, refusals, "quantized-router", "qwen3_moe (quantized mlp.gate)", "gptq-sym", source,
                 sym, list(REGISTRY))


def _routed_experts_only(base: Path, cases: list, refusals: dict) -> None:
    """DeepSeek-V3 shapes as the first-party INT4 checkpoints of the family ship (moonshotai/Kimi-K2-Thinking):
    only the routed experts quantized, attention, shared experts and the leading dense layer in float."""
    for source_name, fmt in SOURCES.items():
        source = make_checkpoint(base / "routed-experts-only" / source_name / "src",
                                 SynthSpec(architecture="deepseek_v3", quantized_modules=ROUTED_EXPERTS, layers=3,
                                           dense_layers=1, source_format=fmt))
        _convert_all(base, cases, refusals, "routed-experts-only", "deepseek_v3 (routed experts only)", source_name,
                     source, fmt, list(REGISTRY))


FLOAT = ROOT / "tests" / "data" / "float"  # written by the real llm-compressor 0.14.0.1 and ModelOpt 0.47.0
# What vLLM 0.33's CPU path cannot build even from the producer's own checkpoint: NVFP4 W4A4 asks for a CUDA op
# (cutlass_scaled_mm_supports_fp4), and the mixed fixture's attention (64 rows) is narrower than its 128 FP8 block.
FLOAT_SOURCES_REFUSED_ON_CPU = ("ct-nvfp4", "ct-mxfp4-fp8block")


def fixtures_in(folder: Path):
    """Each checkpoint folder under `folder`, its quantization_config, and the format moeconv reads it as (None where
    moeconv refuses the config itself: gpt-oss's CPU save, bf16 under quant_method mxfp4; an AutoRound config of
    per-layer bits)."""
    for fixture in sorted(path for path in folder.iterdir() if (path / "config.json").exists()):
        config = json.loads((fixture / "config.json").read_text()).get("quantization_config", {})
        try:
            fmt = format_from_config(config, str(fixture / "config.json"))
        except MoeconvError:
            fmt = None
        yield fixture, config, fmt


def _float(base: Path, cases: list, refusals: dict) -> None:
    """The float-coded fixtures (tests/data/float) and their outputs: compressed-tensors is expected to load
    where vLLM's CPU path loads the producer's own checkpoint; the others are shown beside their source."""
    for fixture, _, fmt in fixtures_in(FLOAT):
        _convert_all(base, cases, refusals, "float", "qwen3_moe (float codes)", fixture.name, fixture,
                     None if fixture.name in FLOAT_SOURCES_REFUSED_ON_CPU else fmt, list(REGISTRY))
    # The one NVFP4 source Humming's multiplied weight_scale_2 holds exactly: llm-compressor's NVFP4A16 with every
    # weight_global_scale moved down to a power of two (its reciprocal a float32)
    powers = _global_scales_to_powers_of_two(FLOAT / "ct-nvfp4a16", base / "float" / "ct-nvfp4a16-powers" / "src")
    fmt = format_from_config(json.loads((powers / "config.json").read_text())["quantization_config"], str(powers))
    _convert_all(base, cases, refusals, "float", "qwen3_moe (float codes)", "ct-nvfp4a16, global scales 2^n", powers,
                 fmt, ["humming", "compressed-tensors"])


def _global_scales_to_powers_of_two(fixture: Path, folder: Path) -> Path:
    import numpy as np

    from moeconv.checkpoint.reader import open_checkpoint

    shutil.copytree(fixture, folder)
    for name, entry in open_checkpoint(folder).tensors.items():
        if name.endswith(".weight_global_scale"):
            with open(entry.file, "r+b") as handle:
                handle.seek(entry.begin)
                value = float(np.frombuffer(handle.read(4), np.float32)[0])
                handle.seek(entry.begin)
                handle.write(np.array([2.0 ** np.floor(np.log2(value))], np.float32).tobytes())
    return folder


def _mxfp4_source(folder: Path, fixture: str) -> Path:
    """A Qwen3-MoE compressed-tensors MXFP4 source shaped as the engines' block-FP8 kernels need (every N and K
    a multiple of 128: hidden 256, two heads of 128, one KV head, expert intermediate 128), with `fixture`'s
    config (its quantization_config as llm-compressor wrote it: MXFP4A16 everywhere, or FP8 block attention beside
    MXFP4 experts). Codes at random, scale bytes 122 .. 127: every value is exact in BF16 and in 128x128 E4M3
    blocks (8 binades). The fixtures themselves are too narrow (64 rows) for a 128 block."""
    import numpy as np
    rng = np.random.default_rng(0)
    config = json.loads((FLOAT / fixture / "config.json").read_text())
    config.update(hidden_size=256, head_dim=128, num_attention_heads=2, num_key_value_heads=1,
                  moe_intermediate_size=128, intermediate_size=128, num_local_experts=4, num_hidden_layers=2)
    fp8_attention = "mixed-precision" == config["quantization_config"]["format"]
    tensors = {"model.embed_tokens.weight": rng.standard_normal((128, 256)).astype(np.float32),
               "lm_head.weight": rng.standard_normal((128, 256)).astype(np.float32),
               "model.norm.weight": np.ones(256, np.float32)}

    def mxfp4(prefix: str, n: int, k: int) -> None:
        tensors[f"{prefix}.weight_packed"] = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
        tensors[f"{prefix}.weight_scale"] = rng.integers(122, 128, (n, k // 32), dtype=np.uint8)

    for layer in range(2):
        at = f"model.layers.{layer}"
        for name in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{at}.{name}.weight"] = np.ones(256, np.float32)
        for name in ("q_norm", "k_norm"):
            tensors[f"{at}.self_attn.{name}.weight"] = np.ones(128, np.float32)
        tensors[f"{at}.mlp.gate.weight"] = rng.standard_normal((4, 256)).astype(np.float32)
        for name, n, k in (("q_proj", 256, 256), ("k_proj", 128, 256), ("v_proj", 128, 256), ("o_proj", 256, 256)):
            if fp8_attention:  # compressed-tensors' FP8_BLOCK: E4M3 weight, weight_scale per 128x128 block
                tensors[f"{at}.self_attn.{name}.weight"] = rng.integers(0, 0x7F, (n, k), dtype=np.uint8)
                tensors[f"{at}.self_attn.{name}.weight_scale"] = np.full((n // 128, k // 128), 2.0**-6, np.float32)
            else:
                mxfp4(f"{at}.self_attn.{name}", n, k)
        for expert in range(4):
            for name, n, k in (("gate_proj", 128, 256), ("up_proj", 128, 256), ("down_proj", 256, 128)):
                mxfp4(f"{at}.mlp.experts.{expert}.{name}", n, k)
    folder.mkdir(parents=True)
    fp8 = {name for name in tensors if fp8_attention and ".self_attn." in name and name.endswith("proj.weight")}
    stored = {name: ("F8_E4M3", array) if name in fp8 else ("U8", array) if array.dtype == np.uint8
              else ("F32", array) if name.endswith("weight_scale")
              else ("BF16", (array.view(np.uint32) >> 16).astype(np.uint16)) for name, array in tensors.items()}
    _write_safetensors(folder / "model.safetensors", stored)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _write_safetensors(path: Path, tensors: dict) -> None:
    """name -> (safetensors dtype, little-endian array): 8 bytes of header length, the JSON header, the data."""
    header, offset, data = {"__metadata__": {"format": "pt"}}, 0, []
    for name, (dtype, array) in tensors.items():
        raw = array.astype(array.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        data.append(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(data))


def _casts(base: Path, cases: list, refusals: dict) -> None:
    """`convert --cast` (bf16, fp8-block, nvfp4) of MXFP4 sources shaped for the block-FP8 kernels: all-MXFP4, and
    FP8 block attention beside MXFP4 experts. Every cast is expected to load (vLLM's fp8 config, none, or
    compressed-tensors NVFP4A16). llm-compressor's own NVFP4A16 checkpoint (the ct-nvfp4a16 fixture) is loaded first
    as a source: vLLM's NVFP4 MoE method registers input global scales that no NVFP4A16 checkpoint carries
    (`CompressedTensorsW4A4Nvfp4MoEMethod.create_weights`, unused with 16-bit activations), so what it leaves
    unloaded is what an nvfp4 cast may leave unloaded too, and nothing more."""
    from moeconv.backends import CASTS

    cases.append(("qwen3_moe (NVFP4A16 as llm-compressor writes it)", "ct-nvfp4a16", "(source)",
                  FLOAT / "ct-nvfp4a16", None))
    for fixture in ("ct-mxfp4a16", "ct-mxfp4-fp8block"):
        source = _mxfp4_source(base / "casts" / fixture / "src", fixture)
        cases.append(("qwen3_moe (MXFP4, 128-wide)", fixture, "(source)", source, None))
        for cast in CASTS:
            out = base / "casts" / fixture / cast
            try:
                moeconv.convert(source, out, cast=cast)
            except MoeconvError as refusal:
                refusals[("qwen3_moe (MXFP4, 128-wide)", fixture, f"--cast {cast}")] = str(refusal)
                continue
            cases.append(("qwen3_moe (MXFP4, 128-wide)", fixture, f"--cast {cast}", out, CASTS))


EXTRA_GROUPS = {"mixtral-t5": _mixtral_t5, "float": _float, "modelopt": _modelopt, "fp8-beside": _fp8_beside,
                "autoround": _autoround, "quantized-router": _quantized_router,
                "routed-experts-only": _routed_experts_only, "casts": _casts}


def _report(cases, results, refusals) -> list[str]:
    print("| architecture | source | backend | vLLM 0.33 (+ moeconv plugin) | detail |")
    print("|---|---|---|---|---|")
    failures = []
    source_gaps = {}
    for architecture, source_name, backend, path, fmt in cases:
        result = results[str(path)]
        unloaded = [name for name in result.get("unloaded_parameters", []) if not name.endswith(NOT_IN_CHECKPOINTS)]
        family = architecture.split()[0]  # an extra case ("mixtral (transformers 5 names)") has its family's gaps
        if backend == "(source)" and result["loaded"]:
            source_gaps.setdefault(family, set()).update(unloaded)
        own = [name for name in unloaded if name not in source_gaps.get(family, set())]
        if not result["loaded"]:
            verdict, detail = "refused", result["error"][:140]
        elif not_consumed(result) or (own and backend != "(source)"):
            verdict = "INCOMPLETE"
            detail = f"tensors not consumed {not_consumed(result)[:2]}; unloaded {own[:2]}"
        else:
            verdict = "loads"
            gaps = sorted(set(unloaded) & source_gaps.get(family, set()))
            dropped = result["not_consumed_count"] - len(not_consumed(result))
            detail = f"{result['tensors']} tensors, all consumed" + (
                f" (vLLM's mapper drops the {dropped} trivial g_idx)" if dropped else "") + (
                f"; unloaded as the sources loaded beside leave them: {gaps[:2]}" if gaps else "")
        print(f"| {architecture} | {source_name} | {backend} | {verdict} | {detail} |")
        if backend != "(source)" and expected_to_load(backend, fmt) and verdict != "loads":
            failures.append(f"{architecture} {source_name} -> {backend}: {verdict}: {detail}")
    for (architecture, source_name, backend), reason in sorted(refusals.items()):
        print(f"| {architecture} | {source_name} | {backend} | (moeconv refuses) | {reason[:140]} |")
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    return failures


if __name__ == "__main__":
    main()
