"""Humming's OWN loader on moeconv's humming outputs, on a CPU machine, beside Humming's own conversion of the source.

Runs in .venv-engines (humming-kernels 0.1.19, vLLM's pin), never in the main venv:

    .venv-engines/bin/python tests/engines/humming_load.py SOURCE OUTPUT [SOURCE OUTPUT ...]

For every quantized linear of OUTPUT (each prefix with a `weight` int32 tensor), `HummingLayer.from_safetensors(OUTPUT,
prefix)` builds the layer from the output's config (`HummingWeightSchema.from_config`) and loads its tensors; since it
loads with `load_state_dict(strict=False)`, the parameters are then held against the file: the same names, dtypes,
shapes and bytes. The same prefix of SOURCE is loaded the same way (Humming's schema for the source's own format) and
converted by Humming itself (`convert_humming`'s body, what vLLM's `--quantization humming` does at load): its schema and
tensors must be the output's, byte for byte. Prints one JSON line per pair: linears loaded, those equal to Humming's
conversion, and the first problems.

Then vLLM's own loader on OUTPUT (vllm_load.build_and_load): every expert's slice of its Humming MoE parameters
must be the file's bytes, in the file's dtype (a scale converted by value on its way in would differ).

What is patched (none of it a loader): vllm_load's platform answers, Humming's device probe (a CUDA extension)
answering as an H200, and `torch.cuda.current_device`, where `HummingLayer` allocates its kernel locks, answering
"cpu".
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch  # noqa: E402

SCHEMA_FIELDS = ("b_dtype", "bs_dtype", "weight_scale_group_size", "weight_scale_type", "weight_scale_2_type",
                 "has_zero_point")


def _patch_device() -> None:
    """vllm_load's patches (vLLM's platform answers, Humming's device probe as an H200), and HummingLayer's locks."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from vllm.plugins import load_general_plugins
    from vllm_load import _patch_platform

    load_general_plugins()
    _patch_platform()
    torch.cuda.current_device = lambda: "cpu"


def _file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def check(source: Path, output: Path) -> dict:
    from humming.layer import HummingLayer

    files = _file_tensors(output)
    prefixes = sorted(name[: -len(".weight")] for name, tensor in files.items()
                      if name.endswith(".weight") and tensor.dtype == torch.int32)
    problems, equal_to_humming = [], 0
    for prefix in prefixes:
        layer = HummingLayer.from_safetensors(str(output), prefix=prefix, torch_dtype=torch.float16)
        params = {name: parameter.data for name, parameter in layer.named_parameters()}
        stored = {name[len(prefix) + 1:]: tensor for name, tensor in files.items() if name.startswith(prefix + ".")}
        if set(params) != set(stored):
            problems.append(f"{prefix}: parameters {sorted(params)} != tensors {sorted(stored)}")
            continue
        problems += [f"{prefix}.{name}: the parameter is not the file's tensor ({params[name].dtype} "
                     f"{list(params[name].shape)} vs {stored[name].dtype} {list(stored[name].shape)})"
                     for name in params if not _same(params[name], stored[name])]
        own = HummingLayer.from_safetensors(str(source), prefix=prefix, torch_dtype=torch.float16)
        n, k = layer.shape_n, layer.shape_k
        # convert_humming is this hook inside a torch.cuda.device context (which needs a GPU), then the
        # symmetric-integer step, which leaves a float b_dtype as it is
        schema, converted = own.weight_schema._convert_humming(
            {name: parameter.data for name, parameter in own.named_parameters()}, [n], [k], torch.float16)
        schema, converted = schema.convert_symmetric_integer_weight(converted)
        mine = {field: str(getattr(layer.weight_schema, field)) for field in SCHEMA_FIELDS}
        theirs = {field: str(getattr(schema, field)) for field in SCHEMA_FIELDS}
        differ = [name for name in params if name not in converted or not _same(params[name], converted[name])]
        if mine != theirs or differ or set(converted) != set(params):
            problems.append(f"{prefix}: Humming's conversion of the source differs: schema {theirs} vs {mine}, "
                            f"tensors {sorted(converted)} (differing: {differ})")
        else:
            equal_to_humming += 1
    vllm = vllm_expert_bytes(output, files)
    problems += vllm.pop("problems", [])
    return {"source": str(source), "output": str(output), "linears": len(prefixes),
            "equal_to_humming_conversion": equal_to_humming, "vllm": vllm, "problems": problems[:5],
            "problem_count": len(problems)}


def vllm_expert_bytes(output: Path, files: dict[str, torch.Tensor]) -> dict:
    """vLLM's own loader (vllm_load.build_and_load) on the output, then every expert's slice of its Humming MoE
    parameters (`w13_*`: gate's rows then up's; `w2_*`) held against the file's tensors byte for byte, dtypes
    included (a scale converted by value on its way in would differ). Qwen3-MoE names (the fixtures' family)."""
    import re

    from vllm_load import build_and_load

    try:
        model, _ = build_and_load(output, port=29541)
    except Exception as error:  # noqa: BLE001 (vLLM's refusal is the result being measured)
        return {"loaded": False, "error": f"{type(error).__name__}: {error}"[:300]}
    pattern = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.routed_experts\.(w13|w2)_(\w+)$")
    projections = {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}
    compared, problems = 0, []
    for name, parameter in model.named_parameters():
        found = pattern.search(name)
        if not found:
            continue
        layer, gemm, suffix = found.groups()
        for expert in range(parameter.shape[0]):
            expected = torch.cat([files[f"model.layers.{layer}.mlp.experts.{expert}.{projection}.{suffix}"]
                                  for projection in projections[gemm]])
            compared += 1
            if not _same(parameter.data[expert], expected):
                problems.append(f"vLLM's {name}[{expert}] is not the file's {suffix} bytes")
    return {"loaded": True, "expert_tensors_compared": compared, "problems": problems}


def main() -> None:
    _patch_device()
    paths = sys.argv[1:]
    for source, output in zip(paths[::2], paths[1::2]):
        try:
            result = check(Path(source), Path(output))
        except Exception as error:  # noqa: BLE001 (Humming's refusal is the result being measured)
            result = {"source": source, "output": output, "error": f"{type(error).__name__}: {error}"[:600]}
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
