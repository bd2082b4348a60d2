"""gpt-oss converted by `moeconv convert --cast bf16`, loaded by vLLM 0.33's and SGLang 0.5.23's own
GptOssForCausalLM on the CPU, their expert parameters held against what transformers itself loads from the MXFP4
source.

    .venv/bin/python tests/engines/gpt_oss_bf16.py [vllm] [sglang]   (drives .venv-engines and .venv-sglang;
                                                                      `make test-engines`, `make test-engines-sglang`)

The source is the committed fixture tests/data/float/gptoss-mxfp4-bytes; the truth is
tests/data/float/gptoss-mxfp4-bytes.truth.safetensors, written by transformers 5.24.0's own gpt-oss reader
(`GptOssForCausalLM.from_pretrained` with `Mxfp4Config(dequantize=True)`: `<expert tensor>.loaded`, float32 of
its BF16 parameters; tests/packers/make_float_gptoss_bytes.py), never by moeconv. The output is converted with
--allow-inexact because the fixture holds scale bytes whose values overflow BF16 on purpose (transformers makes
them inf as well). Each engine builds the model and loads the output with its own loader (vllm_load.py,
sglang_load.py `build_and_load`: every parameter written, twice over with two sentinels), and each layer's
expert weights and biases must equal transformers' parameters in the layout the engine's gpt-oss loader
documents (vLLM: models/gpt_oss.py `_load_weights_other`; SGLang: srt/models/gpt_oss.py; both: the stacked
[E, H, 2I] transposed to [E, 2I, H], gate and up rows left interleaved, which their swigluoai activation reads),
value for value in the dtype the engine holds them in (vLLM built with `--dtype bfloat16` keeps the experts in
float32 on this CPU path, where every BF16 value, infinities included, is one float32; SGLang's harness builds in
float16, and the truth is cast to it the way a copy into the parameter casts). Exits 1 on any difference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PYTHONS = {"vllm": ROOT / ".venv-engines" / "bin" / "python", "sglang": ROOT / ".venv-sglang" / "bin" / "python"}
SOURCE = ROOT / "tests" / "data" / "float" / "gptoss-mxfp4-bytes"
TRUTH = ROOT / "tests" / "data" / "float" / "gptoss-mxfp4-bytes.truth.safetensors"
# per engine: its parameter (under the layer's experts) -> (transformers' tensor, transposed to the engine's layout)
PARAMETERS = {
    "vllm": {"w13_weight": ("gate_up_proj", True), "w13_bias": ("gate_up_proj_bias", False),
             "w2_weight": ("down_proj", True), "w2_bias": ("down_proj_bias", False)},
    "sglang": {"w13_weight": ("gate_up_proj", True), "w13_weight_bias": ("gate_up_proj_bias", False),
               "w2_weight": ("down_proj", True), "w2_weight_bias": ("down_proj_bias", False)},
}


def _build(engine: str, output: Path):
    sys.path.insert(0, str(ROOT / "tests" / "engines"))
    if engine == "vllm":
        import vllm_load
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        vllm_load._patch_platform()
        return vllm_load.build_and_load(output, dtype="bfloat16")
    import sglang_load
    from sglang.srt.plugins import load_plugins

    sglang_load.select_device()
    load_plugins()
    return sglang_load.build_and_load(output)


def check(engine: str, output: Path) -> dict:
    """In the engine's venv: load `output` with the engine and compare its expert parameters with the truth."""
    import torch
    from safetensors.torch import load_file

    model, result = _build(engine, output)
    truth = load_file(str(TRUTH))
    parameters = dict(model.named_parameters())
    compared, differing = [], []
    for layer in range(2):
        for parameter, (tensor, transposed) in PARAMETERS[engine].items():
            name = next(name for name in parameters
                        if name.startswith(f"model.layers.{layer}.mlp.experts.") and name.endswith(f".{parameter}"))
            expected = truth[f"model.layers.{layer}.mlp.experts.{tensor}.loaded"]
            expected = expected.transpose(1, 2) if transposed else expected
            held = parameters[name].data
            same = held.shape == expected.shape and bool(torch.equal(held, expected.to(held.dtype)))
            compared.append(f"{name} ({str(held.dtype).removeprefix('torch.')})")
            if not same:
                differing.append(name)
    return {"engine": engine, **result, "compared": compared, "differing": differing}


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--in-engine":
        print(json.dumps(check(sys.argv[2], Path(sys.argv[3]))), flush=True)
        return
    engines = sys.argv[1:] or ["vllm"]
    failed = False
    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "gptoss-bf16"
        subprocess.run([str(ROOT / ".venv" / "bin" / "moeconv"), "convert", str(SOURCE), "-o", str(output),
                        "--cast", "bf16", "--allow-inexact", "-q"], check=True, stdout=subprocess.DEVNULL)
        for engine in engines:
            run = subprocess.run([str(ENGINE_PYTHONS[engine]), __file__, "--in-engine", engine, str(output)],
                                 capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
            if run.returncode or not lines:
                print(f"{engine} did not load the gpt-oss BF16 cast: {run.stderr.strip().splitlines()[-1:]}")
                failed = True
                continue
            result = json.loads(lines[-1])
            print(json.dumps(result))
            failed |= bool(result["unloaded_count"] or result["differing"]
                           or len(result["compared"]) != 2 * len(PARAMETERS[engine]))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
