"""Decompress every float-coded linear of a compressed-tensors output with the REAL compressed-tensors library.

Runs in .venv-packers:

    .venv-packers/bin/python tests/packers/ct_float_decompress.py OUT DECOMPRESSED.safetensors

The output's quantization_config goes through compressed-tensors' own `QuantizationConfig` validator; each
linear stored as `weight_packed` (nvfp4- or mxfp4-pack-quantized) is decompressed by the compressor registered
for its group's format (`BaseCompressor.get_value_from_registry(format).decompress(tensors, scheme)`, as
tests/packers/make_float_llmc.py takes its truth) and written as `<prefix>.weight`, float32 (the library's output
dtype cast up, exactly). Prints one JSON line: the format and how many linears were decompressed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationConfig
from safetensors.torch import load_file, save_file


def main() -> None:
    out, target = Path(sys.argv[1]), Path(sys.argv[2])
    config = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    groups = [
        group
        for group in config.config_groups.values()
        if group.format in ("nvfp4-pack-quantized", "mxfp4-pack-quantized")
    ]
    (group,) = groups
    tensors = {}
    for shard in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(shard))
    found = {}
    for name in sorted(tensors):
        prefix = name.removesuffix(".weight_packed")
        if prefix == name:
            continue
        local = {key[len(prefix) + 1 :]: value for key, value in tensors.items() if key.startswith(prefix + ".")}
        weight = BaseCompressor.get_value_from_registry(group.format).decompress(local, group)["weight"]
        found[f"{prefix}.weight"] = weight.to(torch.float32).contiguous()
    save_file(found, str(target))
    print(json.dumps({"format": group.format, "linears": len(found)}))


if __name__ == "__main__":
    main()
