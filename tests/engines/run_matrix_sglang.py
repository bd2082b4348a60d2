"""`make test-engines-sglang`: which moeconv outputs stock SGLang 0.5.23 loads, shown with SGLang's own loader.

Runs in the main venv; tests/engines/sglang_load.py runs in .venv-sglang (sglang==0.5.23). For every
family × source format, a synthetic source checkpoint is converted to every backend that takes it; the
sources (as SGLang picks their method, and also with the `--quantization` a user can choose instead:
`user_methods`) and all outputs are then loaded by SGLang on the CPU in one process. Prints the matrix
(markdown) and exits 1, in every family where SGLang loads the family's own compressed-tensors source,
when a compressed-tensors output of a symmetric source does not load (a W8A8 one with
`--quantization w8a8_int8`), when a 4-bit `triton` output does not load through moeconv's SGLang plugin
(moeconv/engines/sglang_plugin, which sglang_load.py loads as SGLang's processes do), or when an output SGLang
takes leaves a checkpoint tensor unconsumed or a parameter unloaded. The triton outputs that load are then
checked by sglang_plugin_check.py (MoE parameters = file bytes; SGLang's Triton kernel against the float64
source), a second table, failing on any mismatch; and where SGLang's own moe_wna16 loads the source, its
MoE parameters are compared with the plugin's (a third table: identical but for asymmetric GPTQ, whose zero
points SGLang misreads), also per rank at tensor parallelism 2 (sglang_plugin_tp.py). The compressed-tensors outputs of asymmetric sources are expected to be refused:
SGLang 0.5.23 does not transpose the expert zero points of any standard compressed-tensors checkpoint
(docs/SGLANG.md).

    .venv/bin/python tests/engines/run_matrix_sglang.py [--keep DIR] [--only FAMILY ...]

`--only` runs only the named families of FAMILIES, e.g. `--only "deepseek_v3 (routed experts only)"`, or `float`:
the float-coded fixtures (tests/data/float, written by llm-compressor and ModelOpt) and their outputs, held to what
moeconv/engines/sglang_0_5_23.py says of them (`_float_checks`), or `casts`: `convert --cast` (bf16, fp8-block, nvfp4)
of run_matrix.py's two 128-wide MXFP4 sources, each held to what moeconv/engines/sglang_0_5_23.py says of it
(`_cast_checks`). Without `--only`, every family, `float` and `casts`.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import moeconv  # noqa: E402
from moeconv.backends import REGISTRY  # noqa: E402
from moeconv.errors import MoeconvError  # noqa: E402
from moeconv.formats import AWQ, GPTQ, CompressedTensors  # noqa: E402
from moeconv.formats.gptq import V2  # noqa: E402
from moeconv.synth import ROUTED_EXPERTS, SynthSpec, make_checkpoint  # noqa: E402
from run_matrix import FLOAT, ROOT, _mxfp4_source, command_line, fixtures_in, not_consumed  # noqa: E402

ENGINE_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
# label -> the synthetic sources' shapes. DeepSeek-V3 twice: as synth makes every family (attention and
# shared experts quantized like the experts, which SGLang's DeepSeek loader cannot fuse: docs/SGLANG.md),
# and as the first-party INT4 checkpoints of its family ship, only the routed experts quantized
# (moonshotai/Kimi-K2-Thinking), with one dense layer first (first_k_dense_replace) as they have.
FAMILIES = {
    "qwen3_moe": {"architecture": "qwen3_moe"},
    "qwen2_moe": {"architecture": "qwen2_moe"},
    "mixtral": {"architecture": "mixtral"},
    "deepseek_v3": {"architecture": "deepseek_v3"},
    "deepseek_v3 (routed experts only)": {"architecture": "deepseek_v3", "quantized_modules": ROUTED_EXPERTS,
                                          "layers": 3, "dense_layers": 1},
    # float attention lets SGLang's own moe_wna16 load an asymmetric GPTQ source (its GPTQ dense kernel is
    # gone), so its reading of GPTQ zero points can be compared with moeconv's (`_against_stock`)
    "qwen3_moe (routed experts only)": {"architecture": "qwen3_moe", "quantized_modules": ROUTED_EXPERTS},
}
SOURCES = {
    "gptq-sym": GPTQ(4, 32, sym=True),
    "gptq-asym": GPTQ(4, 32, sym=False),
    "gptq-v2-sym": GPTQ(4, 32, sym=True, checkpoint_format=V2),
    "gptq-v2-asym": GPTQ(4, 32, sym=False, checkpoint_format=V2),
    "awq": AWQ(4, 32),
    "ct-sym": CompressedTensors(bits=4, group_size=32, symmetric=True),
    "ct-asym": CompressedTensors(bits=4, group_size=32, symmetric=False),
    "ct-w8a8": CompressedTensors(format="int-quantized", bits=8, group_size=-1, activation_bits=8),
}


def user_methods(fmt) -> tuple[str, ...]:
    """The `--quantization` a user can pass SGLang for such a checkpoint beside its default: moe_wna16
    (SGLang's Triton MoE method) for GPTQ / AWQ, w8a8_int8 (SGLang's own int8 method, which takes
    compressed-tensors W8A8 checkpoints) for W8A8."""
    if fmt.method in ("gptq", "awq"):
        return ("moe_wna16",)
    return ("w8a8_int8",) if fmt.activation_bits == 8 else ()


def main() -> None:
    args = command_line(__doc__, ENGINE_PYTHON, "make engines-sglang", groups=(*FAMILIES, FLOAT_GROUP, CASTS_GROUP),
                        only_help="run only these families")
    with tempfile.TemporaryDirectory(prefix="moeconv-sglang-") as scratch:
        base = args.keep or Path(scratch)
        cases, refusals = [], {}
        if not args.only or FLOAT_GROUP in args.only:
            _float(base / "float", cases, refusals)
        if not args.only or CASTS_GROUP in args.only:
            _casts(base / "casts", cases, refusals)
        for family in [family for family in args.only or FAMILIES if family in FAMILIES]:
            folder = family.replace(" ", "_").replace("(", "").replace(")", "")
            for source_name, fmt in SOURCES.items():
                source = make_checkpoint(base / folder / source_name / "src",
                                         SynthSpec(**FAMILIES[family], source_format=fmt))
                cases.append((family, source_name, "(source)", source, fmt, None))
                cases += [(family, source_name, f"(source) --quantization {method}", source, fmt, method)
                          for method in user_methods(fmt)]
                for backend in REGISTRY:
                    out = base / folder / source_name / backend
                    try:
                        moeconv.convert(source, out, backend=backend)
                    except MoeconvError as refusal:
                        refusals[(family, source_name, backend)] = str(refusal)
                        continue
                    cases.append((family, source_name, backend, out, fmt, None))
                    if backend == "compressed-tensors" and fmt.activation_bits == 8:
                        cases.append((family, source_name, f"{backend} --quantization w8a8_int8", out, fmt,
                                      "w8a8_int8"))
        command = [str(ENGINE_PYTHON), str(ROOT / "tests" / "engines" / "sglang_load.py")]
        for case in cases:
            command += [f"--quantization={case[5] or ''}", str(case[3])]
        done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
        results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        if len(results) != len(cases):
            sys.exit(f"sglang_load.py answered {len(results)} of {len(cases)} checkpoints:\n{done.stderr[-3000:]}")
        failures = _report(cases, results, refusals)
        if not args.only or FLOAT_GROUP in args.only:
            failures += _float_checks(cases, results)
        if not args.only or CASTS_GROUP in args.only:
            failures += _cast_checks(cases, results, refusals)
        failures += _plugin(cases, results)
        failures += _against_stock(cases, results)
        failures += _refused_outputs(base / "refused")
    sys.exit(1 if failures else 0)


CASTS_GROUP = "casts"
CASTS_FAMILY = "qwen3_moe (MXFP4, 128-wide)"


def _casts(base: Path, cases: list, refusals: dict) -> None:
    """`convert --cast` of run_matrix.py's MXFP4 sources shaped for the block-FP8 kernels (`_mxfp4_source`: all-MXFP4,
    and FP8 block attention beside MXFP4 experts), each cast loaded as SGLang picks its method from the config."""
    from moeconv.backends import CASTS

    shutil.rmtree(base, ignore_errors=True)  # a --keep folder's earlier run
    for fixture in ("ct-mxfp4a16", "ct-mxfp4-fp8block"):
        source = _mxfp4_source(base / fixture / "src", fixture)
        cases.append((CASTS_FAMILY, fixture, "(source)", source, None, None))
        for cast in CASTS:
            out = base / fixture / cast
            try:
                moeconv.convert(source, out, cast=cast)
            except MoeconvError as refusal:
                refusals[(CASTS_FAMILY, fixture, f"--cast {cast}")] = str(refusal)
                continue
            cases.append((CASTS_FAMILY, fixture, f"--cast {cast}", out, None, None))


def _cast_checks(cases, results, refusals) -> list[str]:
    """What moeconv/engines/sglang_0_5_23.py says of each cast (the plan's sglang_serving), held to what SGLang did:
    a cast it serves loads with every tensor taken and every parameter loaded, under the MoE method its line names;
    one it does not serve does not load so. A change in SGLang's answer fails here, to update the line."""
    from moeconv.plan import make_plan

    failures = [f"{CASTS_FAMILY} {fixture} {backend}: moeconv refused to write it: {reason[:160]}"
                for (family, fixture, backend), reason in refusals.items() if family == CASTS_FAMILY]
    print("\n| cast source | cast | SGLang 0.5.23 methods | loads (every tensor taken, every parameter loaded) | "
          "moeconv says |\n|---|---|---|---|---|")
    for case, result in zip(cases, results):
        if case[0] != CASTS_FAMILY or case[2] == "(source)":
            continue
        source = next(other[3] for other in cases if other[:2] == case[:2] and other[2] == "(source)")
        cast = case[2].removeprefix("--cast ")
        serving = make_plan(source, cast=cast).sglang_serving
        moe = sorted(name for name in result.get("methods", {}) if name.startswith("FusedMoE: "))
        loads = result["loaded"] and not not_consumed(result) and not result["unloaded_parameters"]
        detail = f"{moe}" if result["loaded"] else result.get("error", "")[:200]
        taken = (f" (not consumed {not_consumed(result)[:2]}, unloaded {result['unloaded_parameters'][:2]})"
                 if result["loaded"] else "")
        print(f"| {case[1]} | {cast} | {detail} | {loads}{taken} | {serving.engine or serving.how[:100]} |")
        # the method's innermost name (the scheme, where SGLang's compressed-tensors method names one) in the line
        named = moe and all(re.findall(r"\w+", method)[-1] in serving.engine for method in moe)
        if serving.engine is not None and not (loads and named):
            failures.append(f"{CASTS_FAMILY} {case[1]} --cast {cast}: moeconv says {serving.engine!r}, SGLang: "
                            f"loaded {result['loaded']}, MoE {moe}{taken}, {result.get('error', '')[:160]}")
        if serving.engine is None and loads:
            failures.append(f"{CASTS_FAMILY} {case[1]} --cast {cast}: moeconv says not served "
                            f"({serving.how[:100]}), SGLang loaded it whole with {moe}")
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    return failures


FLOAT_GROUP = "float"
FLOAT_FAMILY = "float codes (tests/data/float)"
PROBE = "(experts only)"  # sglang_float_probe.py's copy of an MXFP4 checkpoint: its attention decompressed
# What moeconv writes of the llm-compressor fixtures, each held to its line in moeconv/engines/sglang_0_5_23.py
CT_OUTPUTS = (*((name, "compressed-tensors") for name in ("ct-mxfp4-fp8block", "ct-mxfp4a16", "ct-nvfp4", "ct-nvfp4a16")),
              *((f"ct-mxfp4a16 {PROBE}", backend) for backend in ("(source)", "compressed-tensors")),
              ("ct-mxfp4a16", "humming"))
HUMMING_MOE = "FusedMoE: HummingMoEMethod"


def _float(base: Path, cases: list, refusals: dict) -> None:
    """The float-coded fixtures, stock, and every output moeconv writes of them; for each MXFP4 one whose attention is
    MXFP4 too (SGLang stops at it before any MoE layer), also its experts-only probe (sglang_float_probe.py)."""
    for fixture, config, fmt in fixtures_in(FLOAT):
        cases.append((FLOAT_FAMILY, fixture.name, "(source)", fixture, fmt, None))
        probes = [("(source)", fixture)] if config.get("format") == "mxfp4-pack-quantized" else []
        shutil.rmtree(base / fixture.name, ignore_errors=True)  # a --keep folder's earlier run
        for backend in REGISTRY:
            out = base / fixture.name / backend
            out.parent.mkdir(parents=True, exist_ok=True)
            try:
                moeconv.convert(fixture, out, backend=backend)
            except MoeconvError as refusal:
                refusals[(FLOAT_FAMILY, fixture.name, backend)] = str(refusal)
                continue
            cases.append((FLOAT_FAMILY, fixture.name, backend, out, fmt, None))
            if backend == "compressed-tensors" and probes:
                probes.append((backend, out))
        for backend, path in probes:
            copy = base / fixture.name / f"{backend.strip('()')}-experts-only"
            subprocess.run([str(ENGINE_PYTHON), str(ROOT / "tests" / "engines" / "sglang_float_probe.py"), str(path),
                            str(copy)], check=True, capture_output=True, text=True, timeout=600)
            cases.append((FLOAT_FAMILY, f"{fixture.name} {PROBE}", backend, copy, fmt, None))


def _float_checks(cases, results) -> list[str]:
    """What moeconv/engines/sglang_0_5_23.py says of each float output, held to what SGLang did: an output it
    serves loads with every tensor taken and SGLang's NVFP4 MoE method; one it does not serve is refused (MXFP4:
    no MXFP4 linear scheme), and its experts-only probe, like the stock source's, loads with SGLang's Mxfp4MoEMethod
    leaving exactly the experts' weight_packed untaken. A change in SGLang's answer fails here, to update the line."""
    from moeconv.plan import make_plan

    by_case = {(case[1], case[2]): result for case, result in zip(cases, results) if case[0] == FLOAT_FAMILY}
    failures = [f"{FLOAT_FAMILY} {name} -> {backend}: not loaded at all (moeconv refused to write it?)"
                for name, backend in CT_OUTPUTS if (name, backend) not in by_case]
    for (source_name, backend), result in by_case.items():
        methods = result.get("methods", {})
        moe = sorted(name for name in methods if name.startswith("FusedMoE: "))
        label = f"{FLOAT_FAMILY} {source_name} -> {backend}"
        if source_name.endswith(PROBE):
            expected = sorted(f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight_packed"
                              for layer in range(2) for expert in range(4)
                              for projection in ("gate_proj", "up_proj", "down_proj"))
            if not (result["loaded"] and moe == ["FusedMoE: Mxfp4MoEMethod"] and result["not_consumed"] == expected):
                failures.append(f"{label}: SGLang no longer skips exactly the experts' weight_packed under "
                                f"Mxfp4MoEMethod ({moe}, not consumed {result.get('not_consumed', [])[:2]}, "
                                f"{result.get('error', '')[:120]}): update moeconv/engines/sglang_0_5_23.py")
            continue
        if backend == "humming":  # Humming's FP4 schema: SGLang's humming method, every tensor taken
            serving = make_plan(FLOAT / source_name, backend="humming").sglang_serving
            loads = result["loaded"] and not not_consumed(result) and not result["unloaded_parameters"]
            if (serving.engine is not None) != (loads and moe == [HUMMING_MOE]):
                failures.append(f"{label}: moeconv says {serving.engine or serving.how[:80]!r}, SGLang: loaded "
                                f"{result['loaded']}, MoE {moe}, not consumed {result.get('not_consumed', [])[:2]}, "
                                f"{result.get('error', '')[:120]}")
            continue
        if backend != "compressed-tensors":
            continue
        source = FLOAT / source_name
        serving = make_plan(source, backend="compressed-tensors").sglang_serving
        loads = result["loaded"] and not not_consumed(result) and not result["unloaded_parameters"]
        if serving.engine is not None and not (
                loads and moe == ["FusedMoE: CompressedTensorsFusedMoEMethod (CompressedTensorsW4A16Nvfp4MoE)"]):
            failures.append(f"{label}: moeconv says {serving.engine!r}, SGLang: loaded {result['loaded']}, MoE "
                            f"{moe}, not consumed {result.get('not_consumed', [])[:2]}, {result.get('error', '')[:120]}")
        if serving.engine is None and (result["loaded"] or "No compressed-tensors compatible scheme was found"
                                       not in result.get("error", "")):
            failures.append(f"{label}: moeconv says not served ({serving.how[:80]}...), SGLang: loaded "
                            f"{result['loaded']}, {result.get('error', '')[:120]}")
    print(f"\n{len(by_case)} float-coded checkpoints checked against moeconv/engines/sglang_0_5_23.py's answers; "
          f"MoE methods: " + "; ".join(f"{name} {backend}: {sorted(m for m in result.get('methods', {}) if 'FusedMoE' in m)}"
                                       for (name, backend), result in by_case.items() if result["loaded"]))
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    return failures


def _fp8_block_attention(source: Path) -> Path:
    """The (float-attention) source with every attention linear in the FP8 block format of DeepSeek-V3's
    and MiniMax-M2's own checkpoints (`weight` F8_E4M3, `weight_scale_inv` F32 per 128x128 block), which
    the source's config does not describe: what moeconv copies into a triton output as it is."""
    import torch
    from safetensors.torch import load_file, save_file

    index_path = source / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    generator = torch.Generator().manual_seed(0)
    for shard in sorted(source.glob("*.safetensors")):
        tensors = load_file(str(shard))
        linears = [name for name, tensor in tensors.items()
                   if ".self_attn." in name and name.endswith("proj.weight") and tensor.dim() == 2]
        for name in linears:
            n, k = tensors[name].shape
            scale = name.removesuffix("weight") + "weight_scale_inv"
            tensors[name] = (torch.randn(n, k, generator=generator) * 64).to(torch.float8_e4m3fn)
            tensors[scale] = torch.rand(-(-n // 128), -(-k // 128), generator=generator) / 64
            index["weight_map"][scale] = shard.name
        if linears:
            save_file(tensors, str(shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    return source


def _edited_config(output: Path, copy: Path, **changes) -> Path:
    """A copy of a triton output whose quantization_config says `changes` (the files unchanged)."""
    shutil.copytree(output, copy)
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"].update(changes)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def _edited_files(output: Path, copy: Path, remove: str | None = None, add: str | None = None) -> Path:
    """A copy of an output with the tensor `remove` taken out of its files, or a tensor `add` (one float) put in."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(output, copy)
    index_path = copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = copy / index["weight_map"][remove] if remove else next(copy.glob("*.safetensors"))
    tensors = load_file(str(shard))
    if remove:
        del tensors[remove], index["weight_map"][remove]
    if add:
        tensors[add] = torch.ones(1, dtype=torch.float16)
        index["weight_map"][add] = shard.name
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    return copy


def _refused_outputs(base: Path) -> list[str]:
    """Outputs the plugin must refuse in one `moeconv:` line, through SGLang's own loader: layers the dense
    layers' method does not know (FP8 block attention beside integer experts: SGLang's unquantized linears
    would take the FP8 bytes and drop every weight_scale_inv), configs the files contradict (zero points
    stored, `has_zp` false or null; a group size the scales' shapes do not have), and files whose dense
    tensors the model's loader skips (one removed, one shard of a fused linear removed, one the model has no
    parameter for): the load's ledger."""
    sym, asym = SOURCES["gptq-sym"], SOURCES["gptq-asym"]
    cases = {}
    for architecture in ("minimax_m2", "deepseek_v3"):
        spec = SynthSpec(architecture=architecture, source_format=sym, quantized_modules=ROUTED_EXPERTS,
                         hidden=256, intermediate=128)
        source = _fp8_block_attention(make_checkpoint(base / architecture / "src", spec))
        cases[f"{architecture} (FP8 block attention) -> triton"] = (
            moeconv.convert(source, base / architecture / "triton", backend="triton").output,
            "weight_scale_inv")
    asymmetric = moeconv.convert(make_checkpoint(base / "qwen3_moe" / "src", SynthSpec(source_format=asym)),
                                 base / "qwen3_moe" / "triton", backend="triton").output
    for label, changes, expected in (("has_zp false", {"has_zp": False}, "w13_qzeros: the config says has_zp false"),
                                     ("has_zp null", {"has_zp": None}, "has_zp is null"),
                                     ("group_size 64", {"group_size": 64}, "say group_size 32")):
        copy = _edited_config(asymmetric, base / "qwen3_moe" / label.replace(" ", "-"), **changes)
        cases[f"qwen3_moe gptq-asym -> triton, config edited: {label}"] = (copy, expected)
    # what SGLang's Qwen3-MoE loader skips without a word: a parameter no tensor fills, a tensor no parameter has
    removed, stray = "model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.o_proj.bias"
    cases[f"qwen3_moe gptq-asym -> triton, {removed} removed"] = (
        _edited_files(asymmetric, base / "qwen3_moe" / "removed", remove=removed),
        f"1 ({removed}) of the model's parameters were written by no tensor")
    cases[f"qwen3_moe gptq-asym -> triton, {stray} added"] = (
        _edited_files(asymmetric, base / "qwen3_moe" / "stray", add=stray),
        f"1 ({stray}) of the output's tensors were taken by no parameter")
    # one shard of a fused linear: k and v still write qkv_proj, whose q rows would stay as allocated
    shard = "model.layers.0.self_attn.q_proj.weight_packed"
    cases[f"qwen3_moe gptq-asym -> triton, {shard} removed"] = (
        _edited_files(asymmetric, base / "qwen3_moe" / "shard", remove=shard),
        "1 (model.layers.0.self_attn.qkv_proj.weight_packed (no shard q)) of the model's fused parameters were "
        "written in part")
    done = subprocess.run([str(ENGINE_PYTHON), str(ROOT / "tests" / "engines" / "sglang_load.py"),
                           *[str(path) for path, _ in cases.values()]], capture_output=True, text=True, timeout=1200)
    results = {json.loads(line)["checkpoint"]: json.loads(line) for line in done.stdout.splitlines()
               if line.startswith("{")}
    print("\n| refused through SGLang's loader with the plugin | answer |\n|---|---|")
    failures = []
    for label, (path, expected) in cases.items():
        result = results.get(str(path), {"loaded": None, "error": done.stderr[-300:]})
        error = result.get("error") or f"loaded: {result.get('tensors')} tensors"
        print(f"| {label} | {error[:300]} |")
        if result["loaded"] is not False or not error.startswith("PluginRefusal: moeconv: ") or expected not in error:
            failures.append(f"{label}: not refused in one moeconv line naming {expected!r}: {error[:300]}")
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    return failures


def _against_stock(cases, results) -> list[str]:
    """Where SGLang's own moe_wna16 loads the source (`--quantization moe_wna16`) and the plugin its triton
    output: the two sets of MoE parameters compared byte for byte (sglang_plugin_check.py --against-stock).
    They must be identical but for asymmetric GPTQ, whose zero points SGLang reads with a per-nibble +1
    (v1; GPTQModel's whole-word subtraction borrows) or +1 where none is due (v2): those are reported,
    with SGLang's Triton kernel on stock SGLang's parameters against the float64 source."""
    loaded = {(case[0], case[1], case[2]): (case, result) for case, result in zip(cases, results) if result["loaded"]}
    pairs = {}
    for (family, source_name, backend), (case, _) in loaded.items():
        if backend == "triton" and (family, source_name, "(source) --quantization moe_wna16") in loaded:
            pairs[str(case[3])] = (case, str(loaded[(family, source_name, "(source) --quantization moe_wna16")][0][3]))
    if not pairs:
        return []
    done = subprocess.run([str(ENGINE_PYTHON), str(ROOT / "tests" / "engines" / "sglang_plugin_check.py"),
                           "--against-stock", *[f"{source}={output}" for output, (_, source) in pairs.items()]],
                          capture_output=True, text=True, timeout=3600)
    checked = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if len(checked) != len(pairs):
        return [f"sglang_plugin_check.py --against-stock answered {len(checked)} of {len(pairs)}: {done.stderr[-2000:]}"]
    print("\n| family | source | plugin's MoE tensors = stock SGLang moe_wna16's | zero points differing | "
          "SGLang Triton kernel on stock SGLang's parameters vs float64 source |")
    print("|---|---|---|---|---|")
    failures = []
    for result in checked:
        case = pairs[result["checkpoint"]][0]
        if "error" in result:
            failures.append(f"{case[0]} {case[1]} against stock: {result['error'][:200]}")
            continue
        same = result["moe_tensors_compared"] - len(result["differing_from_stock"])
        print(f"| {case[0]} | {case[1]} | {same} of {result['moe_tensors_compared']} | "
              f"{result['zero_points_differing']} of {result['zero_points']} | {result['stock_relative_error']:.2g} |")
        gptq_asymmetric = case[4].method == "gptq" and not case[4].symmetric
        if result["differing_from_stock"] and not gptq_asymmetric:
            failures.append(f"{case[0]} {case[1]}: the plugin's MoE parameters differ from stock SGLang's: "
                            f"{result['differing_from_stock'][:2]}")
    # The same at tensor parallelism 2 (sglang_plugin_tp.py: two gloo ranks), on the family whose dense
    # layers are float (SGLang's dense Marlin takes no 64-wide rank of these small shapes).
    tp_pairs = {output: item for output, item in pairs.items() if item[0][0] == "qwen3_moe (routed experts only)"}
    if tp_pairs:
        done = subprocess.run([str(ENGINE_PYTHON), str(ROOT / "tests" / "engines" / "sglang_plugin_tp.py"),
                               *[f"{source}={output}" for output, (_, source) in tp_pairs.items()]],
                              capture_output=True, text=True, timeout=3600)
        ranks = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        if len(ranks) != 2 * len(tp_pairs):
            failures.append(f"sglang_plugin_tp.py answered {len(ranks)} of {2 * len(tp_pairs)}: {done.stderr[-2000:]}")
        print("\nAt tensor parallelism 2, per rank, the plugin's MoE tensors = stock SGLang moe_wna16's: " + "; ".join(
            f"{tp_pairs[r['checkpoint']][0][1]} rank {r['rank']}: "
            + (f"{r['moe_tensors_compared'] - len(r['differing_from_stock'])} of {r['moe_tensors_compared']}"
               if r.get("loaded") else r.get("error", "")[:120]) for r in ranks))
        for r in ranks:
            case = tp_pairs[r["checkpoint"]][0]
            qzeros_only = all(name.endswith("qzeros") for name in r.get("differing_from_stock", []))
            gptq_asymmetric = case[4].method == "gptq" and not case[4].symmetric
            if not r.get("loaded") or (r["differing_from_stock"] and not (gptq_asymmetric and qzeros_only)):
                failures.append(f"{case[0]} {case[1]} rank {r['rank']} of 2: {r.get('error') or r['differing_from_stock'][:2]}")
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    return failures


def _plugin(cases, results) -> list[str]:
    """The triton outputs SGLang loaded through moeconv's plugin, checked further by sglang_plugin_check.py
    (every MoE parameter SGLang's Triton runner reads = the file, byte for byte; SGLang's Triton kernel
    against the float64 source); one table, and a failure for any mismatch or numerics over tolerance."""
    pairs = {str(case[3]): next(str(other[3]) for other in cases if other[:2] == case[:2] and other[2] == "(source)")
             for case, result in zip(cases, results) if case[2] == "triton" and result["loaded"]}
    if not pairs:
        return []
    done = subprocess.run([str(ENGINE_PYTHON), str(ROOT / "tests" / "engines" / "sglang_plugin_check.py"),
                           *[f"{source}={output}" for output, source in pairs.items()]],
                          capture_output=True, text=True, timeout=3600)
    checked = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if len(checked) != len(pairs):
        return [f"sglang_plugin_check.py answered {len(checked)} of {len(pairs)} outputs: {done.stderr[-2000:]}"]
    labels = {str(case[3]): case[:2] for case in cases}
    print("\n| family | source | MoE tensors = file | SGLang Triton kernel vs float64 source | zero points + 1 (control) |")
    print("|---|---|---|---|---|")
    failures = []
    for result in checked:
        family, source_name = labels[result["checkpoint"]]
        if not result.get("loaded"):
            failures.append(f"{family} {source_name} -> triton (plugin check): {result.get('error', '')[:200]}")
            continue
        same = result["tensors_compared"] - len(result["not_byte_identical"])
        control = result.get("relative_error_zeros_plus_one")
        print(f"| {family} | {source_name} | {same} of {result['tensors_compared']} | {result['relative_error']:.2g} "
              f"(tolerance {result['tolerance']}) | {'' if control is None else f'{control:.2g}'} |")
        if result["not_byte_identical"] or not result["numerics_ok"]:
            failures.append(f"{family} {source_name} -> triton: MoE tensors differing from the file "
                            f"{result['not_byte_identical'][:2]}, relative error {result['relative_error']:.3g}")
    asymmetric = next((output for output in pairs if "asym" in Path(output).parent.name), None)
    if asymmetric is not None:
        with tempfile.TemporaryDirectory(prefix="moeconv-sglang-refusals-") as scratch:
            done = subprocess.run([str(ENGINE_PYTHON), str(ROOT / "tests" / "engines" / "sglang_plugin_check.py"),
                                   "--refusals", asymmetric, scratch], capture_output=True, text=True, timeout=1200)
        answers = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        answer = answers[0] if answers else {}
        print(f"\nThe plugin's refusals, provoked on {labels[asymmetric]}: another SGLang release: "
              f"{answer.get('other_release')}; {answer.get('removed')} removed from the files: "
              f"{answer.get('missing_tensor')}")
        if not (answer.get("other_release") or "").startswith("PluginRefusal: moeconv: this plugin was built for"):
            failures.append(f"no refusal under another SGLang release: {answer or done.stderr[-1000:]}")
        if answer.get("removed") is None or answer["removed"] not in (answer.get("missing_tensor") or ""):
            failures.append(f"no refusal naming the removed stacked tensor: {answer or done.stderr[-1000:]}")
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    return failures


def _report(cases, results, refusals) -> list[str]:
    print("| family | source | backend | SGLang 0.5.23 (+ moeconv plugin) | detail |")
    print("|---|---|---|---|---|")
    failures = []
    # Parameters SGLang creates that the synthetic sources of a family do not fill either (act-order
    # parameters a checkpoint without act-order has no tensor for): found by loading the sources, and not
    # counted against a conversion.
    source_gaps: dict[str, set[str]] = {}
    for (family, _source, backend, *_), result in zip(cases, results):
        if backend.startswith("(source)") and result["loaded"]:
            source_gaps.setdefault(family, set()).update(result["unloaded_parameters"])
    verdicts = {}
    for (family, source_name, backend, _path, fmt, _quantization), result in zip(cases, results):
        unloaded = result.get("unloaded_parameters", [])
        own = [name for name in unloaded if name not in source_gaps.get(family, set())]
        if not result["loaded"]:
            verdict, detail = "refused", result["error"][:160]
        elif not_consumed(result) or own:
            verdict = "INCOMPLETE"
            detail = f"tensors not consumed {not_consumed(result)[:2]}; unloaded {own[:2]}"
        else:
            verdict = "loads"
            gaps = sorted(set(unloaded) & source_gaps.get(family, set()))
            dropped = result["not_consumed_count"] - len(not_consumed(result))
            detail = f"{result['tensors']} tensors, all consumed, as {result['quant_method']}" + (
                f" (SGLang's mapper drops the {dropped} trivial g_idx)" if dropped else "") + (
                f"; unloaded as in the synthetic sources, which lack them: {gaps[:2]}" if gaps else "")
        print(f"| {family} | {source_name} | {backend} | {verdict} | {detail} |")
        verdicts[(family, source_name, backend)] = (verdict, detail, fmt)
    for (family, source_name, backend), (verdict, detail, fmt) in verdicts.items():
        w8a8 = fmt is not None and fmt.activation_bits == 8  # None: a float fixture moeconv refuses (_float_checks)
        # The bar: what SGLang does with the family's own compressed-tensors source of that kind (as
        # llm-compressor writes it). Where SGLang refuses even that (DeepSeek-V3 with quantized MLA
        # attention, docs/SGLANG.md), no output of the family is held to it.
        reference = verdicts.get((family, "ct-w8a8", "(source) --quantization w8a8_int8") if w8a8
                                 else (family, "ct-sym", "(source)"), ("",))[0]
        if backend.startswith("(source)") or reference != "loads":
            continue
        # SGLang's compressed-tensors method has no W8A8 int8 MoE scheme on CUDA ("only for NPU"): its
        # w8a8_int8 method is the one that takes a compressed-tensors W8A8 checkpoint's experts.
        # moeconv's plugin (moeconv/engines/sglang_plugin) serves the moe_wna16 `triton` layout, zero points included.
        # Not Mixtral: SGLang 0.5.23 builds a Mixtral whose quantization is not in its own list with one linear
        # per expert (QuantMixtralForCausalLM), which no stacked tensor can fill; the plugin refuses it.
        expected = (fmt.symmetric and backend == ("compressed-tensors --quantization w8a8_int8" if w8a8
                                                  else "compressed-tensors")) or (
            backend == "triton" and not w8a8 and FAMILIES[family]["architecture"] != "mixtral")
        if verdict == "INCOMPLETE" or (expected and verdict != "loads"):
            failures.append(f"{family} {source_name} -> {backend}: {verdict}: {detail}")
    for (family, source_name, backend), reason in sorted(refusals.items()):
        print(f"| {family} | {source_name} | {backend} | (moeconv refuses) | {reason[:140]} |")
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    return failures


if __name__ == "__main__":
    main()
