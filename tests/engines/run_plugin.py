"""`make test-engines`, second part: moeconv's vLLM plugin serving `--backend triton` outputs.

Runs in the main venv; tests/engines/plugin_check.py and vllm_load.py run in .venv-engines
(vllm==0.33.0 with moeconv installed, `make engines`). For every architecture x source format (an
asymmetric GPTQ source's dense linears written in compressed-tensors, which vLLM loads), a synthetic
source is converted with `--backend triton` and checked by plugin_check.py with `--moe-backend triton`: vLLM's model class and loader consume every tensor through
the plugin, after vLLM's own post-load step for its Triton backend the tensors the kernel reads are the
file's stacked tensors byte for byte, and vLLM's own Triton MoE kernel (moe_wna16, or int8 W8A8) on them
matches the float64 reference of the source (run_differential.py compares the parameters with stock
vLLM's for every oracle choice). Then:

  * load time: a Qwen3-MoE-shaped GPTQ source with many experts and its triton output, each loaded by
    vLLM's `load_weights` (stock vLLM for the source, the plugin for the output), tensors and seconds;
  * the real GPTQModel act-order checkpoint's output (asymmetric GPTQ, its down projections' act-order
    folded), served like the synthetic ones;
  * refusals at start-up, with the reason: a `cpu` output (not served by the plugin yet), and a triton
    output whose config was edited (a string has_zp; a group size its files do not hold, refused from
    the headers before any parameter is allocated); and, with MOECONV_VERIFY_ON_LOAD=1, a
    triton output as written (loads) and copies with one byte of one tensor flipped, a stacked expert
    tensor and a dense attention weight (each refused, naming that tensor and its shard);
  * hostile outputs (issue 45), each through vLLM's own loader: either one `moeconv:` refusal line naming
    what is wrong, or a load with every tensor consumed and every parameter written, never a silent drop:
    an asymmetric triton output (zero points in its files) whose config says `has_zp: false` or
    `has_zp: null`; MiniMax-M2 and DeepSeek-V3 outputs with FP8 block attention (`weight_scale_inv`)
    beside GPTQ experts; a DeepSeek-V3 output whose MLA attention is quantized like its experts (loads);
    and the asymmetric output with one tensor removed from its files (q_norm; or q_proj's, one shard of the
    fused qkv_proj, which k and v still write in part), or one tensor the model has no parameter for added
    (the load's ledger, moeconv/load_ledger.py).

MOECONV_PLUGIN_ONLY=verify-on-load runs only the on-load digest part (one conversion, three loads);
MOECONV_PLUGIN_ONLY=hostile only the hostile outputs (five conversions, one vLLM process).

Prints markdown tables; exits 1 when a check fails.

    .venv/bin/python tests/engines/run_plugin.py [--keep DIR]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import moeconv
from moeconv.formats import AWQ, GPTQ, CompressedTensors
from moeconv.synth import SynthSpec, make_checkpoint
from moeconv.engines.vllm_plugin.integrity import ENV as VERIFY_ENV

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_matrix import ENGINE_PYTHON, NOT_IN_CHECKPOINTS, command_line, not_consumed  # noqa: E402
from run_matrix_sglang import _edited_config, _edited_files, _fp8_block_attention  # noqa: E402
from moeconv.synth import ROUTED_EXPERTS  # noqa: E402

# Parameters moeconv's synthetic sources do not have (Qwen3's q_norm / k_norm, Qwen2's attention
# biases): stock vLLM leaves them unloaded for the sources too (run_matrix.py's table shows it).
SYNTH_GAPS = ("q_norm.weight", "k_norm.weight", "qkv_proj.bias")

ROOT = Path(__file__).resolve().parents[2]
ENGINES = ROOT / "tests" / "engines"
ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "kimi_k2", "glm4_moe", "minimax_m2")
SOURCES = {  # asymmetric GPTQ: its dense linears are written in compressed-tensors (vLLM's GPTQ is symmetric only)
    "gptq-sym": GPTQ(4, 32, sym=True),
    "gptq-asym": GPTQ(4, 32, sym=False),
    "gptq-8bit-sym": GPTQ(8, 32, sym=True),
    "awq": AWQ(4, 32),
    "ct-sym": CompressedTensors(bits=4, group_size=32, symmetric=True),
    "ct-asym": CompressedTensors(bits=4, group_size=32, symmetric=False),
    "ct-w8a8": CompressedTensors(format="int-quantized", bits=8, group_size=-1, activation_bits=8),
}
MANY_EXPERTS = SynthSpec(architecture="qwen3_moe", source_format=GPTQ(4, 32, sym=True), layers=4, experts=128,
                         hidden=64, intermediate=64)
EXPECTED_REFUSALS = {
    "cpu backend output": "backend 'cpu' outputs hold the blocked layout vLLM's CPU experts build",
    'config edited: has_zp "false"': "moeconv: the output's quantization_config: has_zp must be true or false",
    "config edited: group_size 16, files hold 32": "w13_scales is F16[4, 128, 4]; bits 4, group_size 16 and has_zp "
                                                   "false with the layer's sizes (E 4, H 128, I 64) say F16[4, 128, 8]",
}
# With MOECONV_VERIFY_ON_LOAD=1: copies of a triton output with one byte of one tensor flipped, a stacked
# one (the plugin copies it) and a dense one (the model's own loader takes it); the manifest records each
# tensor's digest, so the refusal names the tensor whose bytes changed.
FLIPPED = ("model.layers.1.mlp.experts.w2_qweight", "model.layers.0.self_attn.q_proj.qweight")
VERIFY_REFUSAL = ("{tensor}: its bytes in model-00001-of-00001.safetensors differ from the digest moeconv.json "
                  "records")
EDITS = {'config edited: has_zp "false"': {"has_zp": "false"},
         "config edited: group_size 16, files hold 32": {"group_size": 16}}


def _edited(output: Path, where: Path, change: dict) -> Path:
    """A copy of `output` whose quantization_config has `change` applied (copied, not linked: the
    plugin's header check, moeconv's reader, refuses files that are links out of the folder)."""
    shutil.copytree(output, where)
    config = json.loads((output / "config.json").read_text())
    config["quantization_config"].update(change)
    (where / "config.json").write_text(json.dumps(config))
    return where


def _engine(script: str, *args: str, env: dict[str, str] | None = None) -> list[dict]:
    done = subprocess.run([str(ENGINE_PYTHON), str(ENGINES / script), *args], capture_output=True, text=True,
                          timeout=3600, env=None if env is None else {**os.environ, **env})
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if len(results) != len(args):
        sys.exit(f"{script} answered {len(results)} of {len(args)}:\n{done.stderr[-3000:]}")
    return results


def _problems(result: dict) -> list[str]:
    """What is wrong with one plugin_check result (GPTQ's trivial `.g_idx`, which vLLM's own mapper
    drops, not counted; NOT_IN_CHECKPOINTS: kv-cache scales no checkpoint carries)."""
    if not result["loaded"]:
        return [result["error"]]
    problems = []
    if not_consumed(result):
        problems.append(f"not consumed: {not_consumed(result)[:3]}")
    unloaded = [name for name in result["unloaded_parameters"] if not name.endswith(NOT_IN_CHECKPOINTS + SYNTH_GAPS)]
    if unloaded:
        problems.append(f"unloaded: {unloaded[:3]}")
    if result["backends"] != ["WNA16MoEBackend.TRITON"] and result["backends"] != ["Int8MoeBackend.TRITON"]:
        problems.append(f"served on {result['backends']}, not the --moe-backend triton asked for")
    for key in ("not_byte_identical",):
        if result[key]:
            problems.append(f"{key}: {result[key][:3]}")
    if not result["numerics_ok"]:
        problems.append(f"relative error {result['relative_error']:.2e} > {result['tolerance']}")
    return problems


def _flip_a_byte(output: Path, tensor: str) -> None:
    from moeconv.checkpoint.reader import open_checkpoint

    entry = open_checkpoint(output).tensors[tensor]
    with open(entry.file, "r+b") as handle:
        handle.seek(entry.begin)
        byte = handle.read(1)
        handle.seek(entry.begin)
        handle.write(bytes([byte[0] ^ 0x01]))


def _verify_on_load(base: Path, triton: Path, failures: list[str]) -> None:
    """MOECONV_VERIFY_ON_LOAD=1: the output as written loads; each copy with one flipped byte is refused."""
    cases = {"as written": (triton, None)}
    for index, tensor in enumerate(FLIPPED):
        flipped = base / "flipped" / str(index)
        shutil.copytree(triton, flipped)
        _flip_a_byte(flipped, tensor)
        cases[f"one byte of {tensor} flipped"] = (flipped, tensor)
    for name, (path, tensor) in cases.items():
        result, = _engine("vllm_load.py", str(path), env={VERIFY_ENV: "1"})
        error = result.get("error", "")
        print(f"| {name}, {VERIFY_ENV}=1 | {'loaded' if result['loaded'] else 'refused: ' + error[:200]} |")
        expected = None if tensor is None else VERIFY_REFUSAL.format(tensor=tensor)
        if (tensor is not None) == result["loaded"] or (expected is not None and expected not in error):
            failures.append(f"{name}: expected {'a refusal naming ' + expected if expected else 'a load'}, "
                            f"got {error or 'a load'}")


# What the hostile outputs must end in through vLLM's loader with the plugin: None, a load with every tensor
# consumed and every parameter written; else the text its one `moeconv:` line must hold.
STRAY, REMOVED = "model.layers.0.self_attn.o_proj.bias", "model.layers.0.self_attn.q_norm.weight"
SHARD = "model.layers.0.self_attn.q_proj.weight_packed"  # one shard of the fused qkv_proj: k and v still write it
HOSTILE = {
    "qwen3_moe gptq-asym -> triton, config edited: has_zp false":
        "model.layers.0.mlp.experts.w13_qzeros: the config says has_zp false, so the model would be served without "
        "these zero points",
    "qwen3_moe gptq-asym -> triton, config edited: has_zp null": "has_zp is null; it must be true or false",
    "minimax_m2 (routed experts GPTQ, attention FP8 block) -> triton":
        "model.layers.0.self_attn.k_proj.weight_scale_inv (one of 8 FP8 block scales)",
    "deepseek_v3 (routed experts GPTQ, attention FP8 block) -> triton":
        "model.layers.0.self_attn.kv_b_proj.weight_scale_inv (one of 8 FP8 block scales)",
    "deepseek_v3 gptq-sym (MLA attention quantized) -> triton": None,
    f"qwen3_moe gptq-asym -> triton, {REMOVED} removed":
        f"1 ({REMOVED}) of the model's parameters were written by no tensor",
    f"qwen3_moe gptq-asym -> triton, {STRAY} added": f"1 ({STRAY}) of the output's tensors were taken by no parameter",
    f"qwen3_moe gptq-asym -> triton, {SHARD} removed":
        "1 (model.layers.0.self_attn.qkv_proj.weight_packed (no shard q)) of the model's fused parameters were "
        "written in part",
}


def _hostile_outputs(base: Path) -> dict[str, Path]:
    """The outputs of HOSTILE, built: converted from synthetic sources, then edited as an attacker (or a
    careless hand) would edit them."""
    sym, asym = SOURCES["gptq-sym"], SOURCES["gptq-asym"]
    labels = iter(HOSTILE)
    asymmetric = moeconv.convert(make_checkpoint(base / "qwen3_moe-asym" / "src", SynthSpec(source_format=asym)),
                                 base / "qwen3_moe-asym" / "triton", backend="triton").output
    outputs = {next(labels): _edited_config(asymmetric, base / "qwen3_moe-asym" / "has_zp-false", has_zp=False),
               next(labels): _edited_config(asymmetric, base / "qwen3_moe-asym" / "has_zp-null", has_zp=None)}
    for architecture in ("minimax_m2", "deepseek_v3"):  # FP8 block attention beside integer experts, as both ship
        spec = SynthSpec(architecture=architecture, source_format=sym, quantized_modules=ROUTED_EXPERTS,
                         hidden=256, intermediate=128)
        source = _fp8_block_attention(make_checkpoint(base / f"{architecture}-fp8" / "src", spec))
        outputs[next(labels)] = moeconv.convert(source, base / f"{architecture}-fp8" / "triton", backend="triton").output
    source = make_checkpoint(base / "deepseek_v3" / "src", SynthSpec(architecture="deepseek_v3", source_format=sym))
    outputs[next(labels)] = moeconv.convert(source, base / "deepseek_v3" / "triton", backend="triton").output
    outputs[next(labels)] = _edited_files(asymmetric, base / "qwen3_moe-asym" / "removed", remove=REMOVED)
    outputs[next(labels)] = _edited_files(asymmetric, base / "qwen3_moe-asym" / "stray", add=STRAY)
    outputs[next(labels)] = _edited_files(asymmetric, base / "qwen3_moe-asym" / "shard", remove=SHARD)
    return outputs


def _hostile(base: Path, failures: list[str]) -> None:
    """HOSTILE through vLLM's own loader with the plugin (vllm_load.py, one process): each either refused in
    one `moeconv:` line holding the expected text (no traceback, no other error), or loaded with every tensor
    consumed and every parameter written (the harness's own sentinels and loader records, not the plugin's)."""
    outputs = _hostile_outputs(base)
    print("\n| hostile output (issue 45) | vLLM 0.33 with the plugin | s |\n|---|---|---|")
    for label, result in zip(outputs, _engine("vllm_load.py", *map(str, outputs.values()))):
        expected = HOSTILE[label]
        if result["loaded"]:
            unloaded = [name for name in result["unloaded_parameters"]
                        if not name.endswith(NOT_IN_CHECKPOINTS + SYNTH_GAPS)]
            answer = (f"loaded: {result['tensors']} tensors, {len(not_consumed(result))} not consumed, "
                      f"{len(unloaded)} parameters unwritten")
            if expected is not None:
                failures.append(f"{label}: expected one moeconv line naming {expected!r}, got a load ({answer})")
            elif not_consumed(result) or unloaded:
                failures.append(f"{label}: a silent drop: not consumed {not_consumed(result)[:3]}, "
                                f"unwritten {unloaded[:3]}")
        else:
            answer = result.get("moeconv_line") or f"(no moeconv line) {result['error'][:300]}"
            if expected is None:
                failures.append(f"{label}: expected a load, got {answer}")
            elif result.get("moeconv_line") is None or expected not in result["moeconv_line"]:
                failures.append(f"{label}: expected one moeconv line naming {expected!r}, got {result['error'][:400]}")
        print(f"| {label} | {answer.replace(str(base), '<base>')} | {result.get('seconds', 0):.1f} |")


def main() -> None:
    args = command_line(__doc__)
    failures = []
    with tempfile.TemporaryDirectory(prefix="moeconv-plugin-") as scratch:
        base = args.keep or Path(scratch)
        if os.environ.get("MOECONV_PLUGIN_ONLY") == "verify-on-load":
            spec = SynthSpec(architecture="qwen3_moe", source_format=SOURCES["gptq-sym"])
            source = make_checkpoint(base / "src", spec)
            print("| output | plugin at start-up |\n|---|---|")
            _verify_on_load(base, moeconv.convert(source, base / "triton", backend="triton").output, failures)
            for failure in failures:
                print(f"FAIL {failure}", file=sys.stderr)
            sys.exit(1 if failures else 0)
        if os.environ.get("MOECONV_PLUGIN_ONLY") == "hostile":
            _hostile(base, failures)
            for failure in failures:
                print(f"FAIL {failure}", file=sys.stderr)
            sys.exit(1 if failures else 0)
        pairs = {}
        for architecture in ARCHITECTURES:
            for name, fmt in SOURCES.items():
                source = make_checkpoint(base / architecture / name / "src",
                                         SynthSpec(architecture=architecture, source_format=fmt))
                out = moeconv.convert(source, base / architecture / name / "triton", backend="triton").output
                pairs[(architecture, name)] = (source, out)
        act_order = ROOT / "tests" / "data" / "gptqmodel_act_order" / "down_only"
        (base / "act-order").mkdir(parents=True, exist_ok=True)
        pairs[("qwen3_moe", "GPTQModel act-order, asymmetric")] = (
            act_order, moeconv.convert(act_order, base / "act-order" / "triton", backend="triton").output)
        results = _engine("plugin_check.py", *[f"{s}={o}" for s, o in pairs.values()])
        print("| architecture | source | tensors | Triton kernel tensors after vLLM's post-load step = file | "
              "backend | vLLM Triton kernel vs float64 source | verdict |")
        print("|---|---|---|---|---|---|---|")
        for (architecture, name), result in zip(pairs, results):
            problems = _problems(result)
            failures += [f"{architecture} {name}: {problem}" for problem in problems]
            if result["loaded"]:
                print(f"| {architecture} | {name} | {result['tensors']} | {result['tensors_compared']} MoE tensors, "
                      f"{len(result['not_byte_identical'])} differ | {', '.join(result['backends'])} | "
                      f"{result['relative_error']:.1e} | {'ok' if not problems else '; '.join(problems)} |")
            else:
                print(f"| {architecture} | {name} | | | | | refused: {result['error'][:120]} |")

        source = make_checkpoint(base / "many" / "src", MANY_EXPERTS)
        out = moeconv.convert(source, base / "many" / "triton", backend="triton").output
        loads = _engine("vllm_load.py", str(source), str(out))
        print("\n| checkpoint | tensors | vLLM `load_weights` (s) |\n|---|---|---|")
        for label, result in zip(("GPTQ source, stock vLLM", "triton output, plugin"), loads):
            if not result["loaded"]:
                failures.append(f"{label}: {result['error']}")
                continue
            print(f"| {label} ({MANY_EXPERTS.layers} layers x {MANY_EXPERTS.experts} experts) | {result['tensors']} | "
                  f"{result['load_seconds']:.3f} |")

        gptq = pairs[("qwen3_moe", "gptq-sym")][0]
        refused = {"cpu backend output": moeconv.convert(gptq, base / "qwen3_moe" / "gptq-sym" / "cpu", backend="cpu").output}
        triton = pairs[("qwen3_moe", "gptq-sym")][1]
        for index, (label, change) in enumerate(EDITS.items()):
            refused[label] = _edited(triton, base / "edited" / str(index), change)
        print("\n| output | plugin at start-up |\n|---|---|")
        for label, result in zip(refused, _engine("vllm_load.py", *map(str, refused.values()))):
            error = result.get("error", "")
            print(f"| {label} | {'loaded' if result['loaded'] else 'refused: ' + error[:160]} |")
            if result["loaded"] or EXPECTED_REFUSALS[label] not in error:
                failures.append(f"{label}: expected a refusal naming {EXPECTED_REFUSALS[label]!r}, got {error or 'a load'}")

        _verify_on_load(base, triton, failures)
        _hostile(base / "hostile", failures)
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
