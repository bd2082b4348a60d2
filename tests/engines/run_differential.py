"""`make test-engines`, third part: the plugin's MoE parameters against stock vLLM's, per oracle choice.

Runs in the main venv; tests/engines/differential_check.py runs in .venv-engines (vllm==0.33.0 with
moeconv installed, `make engines`). For every source format stock vLLM 0.33 loads (GPTQ symmetric, AWQ,
compressed-tensors symmetric and asymmetric, W8A8 int8), a synthetic Qwen3-MoE source is converted with
`--backend triton` (served through the plugin) and, for GPTQ and AWQ, with `--backend compressed-tensors`
(served by stock vLLM with the method the plugin uses; a compressed-tensors source is its own reference).
For each choice of vLLM's MoE oracle (capability 9.0, 8.0, a CPU platform, `--moe-backend triton`), the
parameters of every MoE layer before `process_weights_after_loading` must be byte-identical (names,
shapes, dtypes, values) to stock vLLM's, and both must have chosen the same backend: the one the table
shows. Prints a markdown table; exits 1 when a check fails.

MOECONV_DIFFERENTIAL_TP=2: the same at tensor-parallel size 2 (two gloo processes on the CPU, each rank's
parameters against stock vLLM's for that rank; intermediate size doubled so each rank holds what the
single-rank run holds); with MOECONV_DIFFERENTIAL_EP=1 as well, vLLM's expert parallelism on.
MOECONV_DIFFERENTIAL_CHOICES=a,b: only those oracle choices.

    .venv/bin/python tests/engines/run_differential.py [--keep DIR]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import moeconv
from moeconv.formats import AWQ, GPTQ, CompressedTensors
from moeconv.synth import SynthSpec, make_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_matrix import ENGINE_PYTHON, command_line  # noqa: E402

ENGINES = Path(__file__).resolve().parent
SOURCES = {  # the formats stock vLLM 0.33 loads (its GPTQ is symmetric only)
    "gptq-sym": GPTQ(4, 64, sym=True),
    "gptq-8bit-sym": GPTQ(8, 64, sym=True),
    "awq": AWQ(4, 64),
    "ct-sym": CompressedTensors(bits=4, group_size=64, symmetric=True),
    "ct-sym-g32": CompressedTensors(bits=4, group_size=32, symmetric=True),
    "ct-asym": CompressedTensors(bits=4, group_size=64, symmetric=False),
    "ct-asym-g32": CompressedTensors(bits=4, group_size=32, symmetric=False),
    "ct-channelwise": CompressedTensors(bits=4, group_size=-1, symmetric=True),
    "ct-w8a8": CompressedTensors(format="int-quantized", bits=8, group_size=-1, activation_bits=8),
}
TP = int(os.environ.get("MOECONV_DIFFERENTIAL_TP", "1"))
# Marlin's tiles: hidden % 128, intermediate per rank % group size
SHAPE = {"hidden": 128, "intermediate": 128 * TP}
NO_BACKEND = None


def expected_backend(choice: str, name: str, fmt) -> str | None:
    """The backend vLLM 0.33's oracle picks (read from oracle/int_wna16.py, oracle/int8.py and the
    experts' `is_supported_config`): the int8 W8A8 oracle ranks Triton first everywhere; WNA16 takes
    Humming on capability 9.0 and Marlin on 8.0; vLLM's CPU int4 experts take symmetric 4-bit groups
    other than 32 only (their quant keys), so the rest has no backend on a CPU build; compressed-tensors'
    WNA16 MoE method takes channel-wise scales on Marlin only (it asserts group scales otherwise). On
    capability 9.0 Humming's experts take an asymmetric 4-bit layer only with group size 32: the method's
    quant key carries the group shape (1, 32) for g = 32 and the placeholder (1, -1) for any other group
    size, which Humming's `_is_supported_wna16_weight_key` refuses (it wants a positive column count) and
    its list of supported keys holds the 4-bit key in its symmetric form only (`kInt4Static`); Marlin takes the other asymmetric
    4-bit layers."""
    if fmt.activation_bits == 8:
        return "Int8MoeBackend.TRITON"
    if fmt.group_size == -1 and choice != "capability 8.0":
        return NO_BACKEND
    if choice == "CPU platform":
        cpu_takes = fmt.bits == 4 and fmt.symmetric and fmt.group_size != 32
        return "WNA16MoEBackend.CPU" if cpu_takes else NO_BACKEND
    if choice == "capability 9.0" and not fmt.symmetric and not (fmt.bits == 4 and fmt.group_size == 32):
        return "WNA16MoEBackend.MARLIN"
    return {"capability 9.0": "WNA16MoEBackend.HUMMING", "capability 8.0": "WNA16MoEBackend.MARLIN",
            "--moe-backend triton": "WNA16MoEBackend.TRITON"}[choice]


CHOICES = ("capability 9.0", "capability 8.0", "--moe-backend triton", "CPU platform")
if os.environ.get("MOECONV_DIFFERENTIAL_CHOICES"):
    CHOICES = tuple(os.environ["MOECONV_DIFFERENTIAL_CHOICES"].split(","))
# (source, choice) pairs whose result says nothing about the MoE layers: there the GPTQ 8-bit source's
# dense linears (kept by the triton output, not by the compressed-tensors reference) meet the harness's
# CUDA linear-kernel tables, whose Marlin refuses 8-bit GPTQ before any MoE layer is built; vLLM's CPU
# int4 experts take no 8-bit layer either.
NOT_COMPARABLE = {("gptq-8bit-sym", "CPU platform"): "dense 8-bit GPTQ linears refused by the harness's kernel tables"}


def main() -> None:
    args = command_line(__doc__)
    failures = []
    with tempfile.TemporaryDirectory(prefix="moeconv-differential-") as scratch:
        base = args.keep or Path(scratch)
        pairs, names, logged = [], {}, {}
        for name, fmt in SOURCES.items():
            source = make_checkpoint(base / name / "src", SynthSpec(architecture="qwen3_moe", source_format=fmt, **SHAPE))
            out = moeconv.convert(source, base / name / "triton", backend="triton").output
            reference = source if fmt.method == "compressed-tensors" else moeconv.convert(
                source, base / name / "compressed-tensors", backend="compressed-tensors").output
            pairs.append(f"{reference}={out}")
            names[str(out)] = (name, fmt, "source" if reference == source else "its compressed-tensors output")
        done = subprocess.run([str(ENGINE_PYTHON), str(ENGINES / "differential_check.py"), *pairs],
                              capture_output=True, text=True, timeout=3600)
        results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        if len(results) != len(pairs) * len(CHOICES) * TP:
            sys.exit(f"differential_check.py answered {len(results)} of {len(pairs) * len(CHOICES) * TP}:\n"
                     f"{done.stderr[-3000:]}")
        print("| source | stock vLLM loads | oracle choice | backend (stock = plugin) | MoE parameters | "
              "differ | verdict |")
        print("|---|---|---|---|---|---|---|")
        for result in results:
            name, fmt, reference = names[result["output"]]
            rank = f" (rank {result['rank']} of {result['tp']})" if "rank" in result else ""
            label = f"| {name} | {reference} | {result['choice']}{rank} |"
            expected = expected_backend(result["choice"], name, fmt)
            if (name, result["choice"]) in NOT_COMPARABLE:
                print(f"{label} | | | not compared: {NOT_COMPARABLE[name, result['choice']]} |")
                continue
            if not result["loaded"]:
                refused = (expected is NO_BACKEND and result["stock_error"] is not None
                           and ": moeconv: " in (result["plugin_error"] or ""))
                if not refused:
                    failures.append(f"{name}, {result['choice']}: stock {result['stock_error']}; "
                                    f"plugin {result['plugin_error']}")
                print(f"{label} none: both refuse | | | {'ok' if refused else 'FAIL'}: stock "
                      f"{(result['stock_error'] or 'loads')[:90]}; plugin {(result['plugin_error'] or 'loads')[:140]} |")
                continue
            problems = []
            if result["stock_backends"] != [expected] or result["plugin_backends"] != [expected]:
                problems.append(f"backends: stock {result['stock_backends']}, plugin {result['plugin_backends']}, "
                                f"expected {expected}")
            result["plugin_not_consumed"] = [n for n in result["plugin_not_consumed"] if not n.endswith(".g_idx")]
            for key in ("only_stock", "only_plugin", "differ", "plugin_not_consumed", "plugin_unloaded"):
                if result[key] and not (key == "plugin_unloaded" and _synth_gaps_only(result[key])):
                    problems.append(f"{key}: {result[key][:3]}")
            if not result["moe_parameters"]:
                problems.append("no MoE parameters compared")
            logs = result.get("rank", 0) == 0  # vLLM logs a "local"-scope line on each host's first rank only
            if logs and (not result["plugin_logged"] or not result["plugin_logged"][0].startswith("moeconv: MoE layers on")):
                problems.append(f"the plugin logged no line naming {expected}")
            failures += [f"{name}, {result['choice']}: {problem}" for problem in problems]
            print(f"{label} {', '.join(result['plugin_backends'])} | {result['moe_parameters']} | "
                  f"{result['differ_count']} | {'ok' if not problems else '; '.join(problems)} |")
            logged.setdefault(result["choice"], result["plugin_logged"][:1])
    print("\n| oracle choice | the plugin's line in vLLM's log (first source) |\n|---|---|")
    for choice, lines in logged.items():
        print(f"| {choice} | {' '.join(lines)[:400]} |")
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    sys.exit(1 if failures else 0)


def _synth_gaps_only(unloaded: list[str]) -> bool:
    """Parameters no synthetic checkpoint carries (Qwen3's q_norm / k_norm; attention kv-cache scales):
    run_matrix.py shows stock vLLM leaves them unloaded for the sources too. (GPTQ's `.g_idx`, which
    vLLM's own mapper drops, are not counted as unconsumed either.)"""
    from run_matrix import NOT_IN_CHECKPOINTS
    from run_plugin import SYNTH_GAPS

    return all(name.endswith(NOT_IN_CHECKPOINTS + SYNTH_GAPS) for name in unloaded)


if __name__ == "__main__":
    main()
