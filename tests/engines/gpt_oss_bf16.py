"""gpt-oss converted by `moeconv convert --cast bf16`, loaded by vLLM 0.33's own GptOssForCausalLM on the CPU,
its expert parameters held against what transformers itself loads from the MXFP4 source.

    .venv/bin/python tests/engines/gpt_oss_bf16.py            (drives .venv-engines; `make test-engines`)

The source is the committed fixture tests/data/float/gptoss-mxfp4-bytes; the truth is
tests/data/float/gptoss-mxfp4-bytes.truth.safetensors, written by transformers 5.24.0's own gpt-oss reader
(`GptOssForCausalLM.from_pretrained` with `Mxfp4Config(dequantize=True)`: `<expert tensor>.loaded`, float32 of
its BF16 parameters; tests/packers/make_float_gptoss_bytes.py), never by moeconv. The output is converted with
--allow-inexact because the fixture holds scale bytes whose values overflow BF16 on purpose (transformers makes
them inf as well). vLLM builds the model in bfloat16 (`--dtype bfloat16`), loads the output with its own
DefaultModelLoader (vllm_load.build_and_load: every parameter written, twice over with two sentinels), and each
layer's `w13_weight`, `w13_bias`, `w2_weight` and `w2_bias` must equal transformers' parameters in the layout
vLLM's gpt-oss loader documents (models/gpt_oss.py `_load_weights_other`: the stacked [E, H, 2I] transposed to
[E, 2I, H], gate and up rows left interleaved, which its swigluoai activation reads), value for value (vLLM
holds them in float32 on this CPU path; every BF16 value, infinities included, is one float32). Exits 1 on any
difference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PYTHON = ROOT / ".venv-engines" / "bin" / "python"
SOURCE = ROOT / "tests" / "data" / "float" / "gptoss-mxfp4-bytes"
TRUTH = ROOT / "tests" / "data" / "float" / "gptoss-mxfp4-bytes.truth.safetensors"
# vLLM's parameter (under the layer's routed experts) -> (transformers' tensor, transposed to vLLM's layout)
PARAMETERS = {"w13_weight": ("gate_up_proj", True), "w13_bias": ("gate_up_proj_bias", False),
              "w2_weight": ("down_proj", True), "w2_bias": ("down_proj_bias", False)}


def check(output: Path) -> dict:
    """In .venv-engines: load `output` with vLLM and compare its expert parameters with the truth."""
    import torch
    from safetensors.torch import load_file

    sys.path.insert(0, str(ROOT / "tests" / "engines"))
    import vllm_load
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    vllm_load._patch_platform()
    model, result = vllm_load.build_and_load(output, dtype="bfloat16")
    truth = load_file(str(TRUTH))
    parameters = dict(model.named_parameters())
    compared, differing = [], []
    for layer in range(2):
        for parameter, (tensor, transposed) in PARAMETERS.items():
            name = next(name for name in parameters
                        if name.startswith(f"model.layers.{layer}.mlp.experts.") and name.endswith(f".{parameter}"))
            expected = truth[f"model.layers.{layer}.mlp.experts.{tensor}.loaded"]
            expected = expected.transpose(1, 2) if transposed else expected
            held = parameters[name].data.float()  # vLLM holds them in float32 on this path; BF16 values, exactly
            same = held.shape == expected.shape and bool(torch.equal(held, expected))
            compared.append(name)
            if not same:
                differing.append(name)
    return {**result, "compared": compared, "differing": differing,
            "infinite_values": int(sum(torch.isinf(parameters[name].data.float()).sum() for name in compared))}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--in-engine":
        print(json.dumps(check(Path(sys.argv[2]))), flush=True)
        return
    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "gptoss-bf16"
        subprocess.run([str(ROOT / ".venv" / "bin" / "moeconv"), "convert", str(SOURCE), "-o", str(output),
                        "--cast", "bf16", "--allow-inexact", "-q"], check=True, stdout=subprocess.DEVNULL)
        run = subprocess.run([str(ENGINE_PYTHON), __file__, "--in-engine", str(output)], capture_output=True,
                             text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode or not lines:
        sys.exit(f"vLLM did not load the gpt-oss BF16 cast: {run.stderr.strip().splitlines()[-1:]}")
    result = json.loads(lines[-1])
    print(json.dumps(result))
    if result["unloaded_count"] or result["differing"] or len(result["compared"]) != 2 * len(PARAMETERS):
        sys.exit(1)


if __name__ == "__main__":
    main()
