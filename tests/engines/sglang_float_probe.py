"""The MoE half of a compressed-tensors MXFP4 checkpoint alone, for SGLang's loader (run_matrix_sglang.py --only float).

Runs in .venv-sglang (compressed-tensors, SGLang's own dependency):

    .venv-sglang/bin/python tests/engines/sglang_float_probe.py CHECKPOINT COPY

SGLang 0.5.23 stops at an MXFP4 dense linear ("No compressed-tensors compatible scheme was found"), before it builds
any MoE layer, so what its MoE method does with the experts is not seen on a checkpoint whose attention is MXFP4 too.
COPY is CHECKPOINT with every attention projection's `weight_packed` / `weight_scale` decompressed to a bf16
`weight` by compressed-tensors' own MXFP4 compressor (`BaseCompressor.get_value_from_registry`), and those
projections added to `ignore`: the experts, their tensors and the config group that describes them stay as they are.
A probe of the loader, not a fixture: its attention values are only what the loader is handed.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationConfig
from safetensors.torch import load_file, save_file

MXFP4 = "mxfp4-pack-quantized"
ATTENTION = r"re:.*self_attn\..*_proj$"


def experts_only(source: Path, copy: Path) -> int:
    """Write COPY; returns how many attention projections were decompressed."""
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(source, copy)
    config = json.loads((copy / "config.json").read_text())
    quantization = config["quantization_config"]
    parsed = QuantizationConfig.model_validate({key: value for key, value in quantization.items() if key != "moeconv"})
    group = next(group for group in parsed.config_groups.values() if group.format == MXFP4)
    compressor = BaseCompressor.get_value_from_registry(MXFP4)
    index_path = copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    decompressed = 0
    for shard in sorted(copy.glob("*.safetensors")):
        tensors = load_file(str(shard))
        packed = [name for name in tensors if ".self_attn." in name and name.endswith("_proj.weight_packed")]
        for name in packed:
            prefix = name.removesuffix(".weight_packed")
            local = {"weight_packed": tensors.pop(name), "weight_scale": tensors.pop(f"{prefix}.weight_scale")}
            weight = compressor.decompress(local, group)["weight"]
            tensors[f"{prefix}.weight"] = weight.to(torch.bfloat16).contiguous()
            del index["weight_map"][name], index["weight_map"][f"{prefix}.weight_scale"]
            index["weight_map"][f"{prefix}.weight"] = shard.name
        if packed:
            save_file(tensors, str(shard), metadata={"format": "pt"})
            decompressed += len(packed)
    index_path.write_text(json.dumps(index))
    quantization["ignore"] = sorted({*quantization["ignore"], ATTENTION})
    (copy / "config.json").write_text(json.dumps(config, indent=1))
    return decompressed


if __name__ == "__main__":
    count = experts_only(Path(sys.argv[1]), Path(sys.argv[2]))
    print(json.dumps({"checkpoint": sys.argv[2], "attention_decompressed": count}))
