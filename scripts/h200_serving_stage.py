"""Stage the inputs of scripts/h200_serving.py on a CPU machine (issue 26, the GPU parts of the plugin).

    .venv-engines/bin/python scripts/h200_serving_stage.py --out DIR --vllm-wheel vllm-0.33.0-...whl

Runs in .venv-engines (`make engines`: vllm==0.33.0 with moeconv beside it). Writes into DIR (an ignored
folder that travels to the GPU machine):

- one folder per source of DUMPS (a synthetic Qwen3-MoE GPTQ checkpoint, 1 layer, 8 experts,
  H = 1024, I = 256: 4-bit symmetric g = 128, and 4-bit asymmetric g = 32; the real GPTQModel act-order
  checkpoint of tests/data, asymmetric g = 32), each holding `src/` (the source) and
  `plugin_params.safetensors` + `plugin_params.json`: the MoE parameters of every MoE layer of that
  source's `triton` output as vLLM 0.33 holds them after loading through moeconv's plugin and BEFORE
  `process_weights_after_loading`, with the oracle's backend forced as on an H200 (compute capability
  9.0; the plugin's choice is HUMMING for all three), vLLM's own Humming weight-schema config for the
  layer (`oracle/int_wna16.py :: _humming_wna16_weight_schema`) and the layer's sizes;
- `oracle_hopper.json`: the backend vLLM 0.33's oracle picks at capability 9.0 for the `triton` outputs
  of sources where stock vLLM cannot load the source (asymmetric GPTQ; GPTQModel act-order), and the
  plugin's log line that says why;
- `vllm_triton/fused_moe.py`: vLLM 0.33.0's `vllm/model_executor/layers/fused_moe/fused_moe.py`, byte for
  byte from the wheel (its sha256 checked against the wheel's RECORD), from which the device script
  takes the Triton wna16 kernel without importing vLLM;
- `marlin_ext.json`: the shared libraries and symbols vLLM's compiled Marlin MoE path needs
  (`_moe_C_stable_libtorch.abi3.so`: `moe_wna16_marlin_gemm`; `_C_stable_libtorch.abi3.so`:
  `gptq_marlin_repack`), their sizes, and what they compress to, so the device script can say whether
  the H200 image's torch could load them.

- `h200_serving.py`: a copy of scripts/h200_serving.py, so the device can run it from DIR whatever branch
  its checkout is on.

Humming's wheels are fetched beside them, by name (vLLM 0.33 pins 0.1.19; 0.1.20 is the newest):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d DIR/whl19 humming-kernels==0.1.19   # and DIR/whl: ==0.1.20

Nothing of vLLM is committed: DIR is ignored, and only the device script reads it.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import logging
import lzma
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "engines"))
sys.path.insert(0, str(ROOT))

SPEC = {"architecture": "qwen3_moe", "layers": 1, "experts": 8, "hidden": 1024, "intermediate": 256, "seed": 0}
FUSED_MOE = "vllm/model_executor/layers/fused_moe/fused_moe.py"
MARLIN_LIBRARIES = {"vllm/_moe_C_stable_libtorch.abi3.so": "moe_wna16_marlin_gemm, moe_align_block_size",
                    "vllm/_C_stable_libtorch.abi3.so": "gptq_marlin_repack (gptq_marlin_moe_repack calls it per expert)"}


def _wheel_file(wheel: zipfile.ZipFile, name: str) -> bytes:
    """A file of the wheel, checked against the sha256 its RECORD lists."""
    data = wheel.read(name)
    record = next(n for n in wheel.namelist() if n.endswith(".dist-info/RECORD"))
    for line in wheel.read(record).decode().splitlines():
        path, digest, _ = line.rsplit(",", 2)
        if path == name:
            algorithm, value = digest.split("=", 1)
            got = base64.urlsafe_b64encode(hashlib.new(algorithm, data).digest()).rstrip(b"=").decode()
            if got != value:
                sys.exit(f"{name}: sha256 {got} is not the wheel RECORD's {value}")
            return data
    sys.exit(f"{name} is not in the wheel's RECORD")


def stage_wheel_files(wheel_path: Path, out: Path) -> None:
    with zipfile.ZipFile(wheel_path) as wheel:
        data = _wheel_file(wheel, FUSED_MOE)
        (out / "vllm_triton").mkdir(exist_ok=True)
        (out / "vllm_triton" / "fused_moe.py").write_bytes(data)
        libraries = {}
        with tempfile.TemporaryDirectory() as scratch:
            for name, ops in MARLIN_LIBRARIES.items():
                library = Path(scratch) / Path(name).name
                library.write_bytes(_wheel_file(wheel, name))
                dynamic = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True)
                needed = [line.split("[", 1)[1].rstrip("]") for line in dynamic.stdout.splitlines() if "(NEEDED)" in line]
                symbols = subprocess.run(["nm", "-D", "--undefined-only", str(library)], capture_output=True,
                                         text=True, check=True)
                undefined = sorted({line.split()[-1].split("@")[0] for line in symbols.stdout.splitlines()
                                    if line.split() and line.split()[0] == "U"})
                libraries[name] = {"ops": ops, "bytes": library.stat().st_size,
                                   "xz_bytes": len(lzma.compress(library.read_bytes(), preset=1)),
                                   "needed": needed, "undefined_symbols": undefined}
    (out / "marlin_ext.json").write_text(json.dumps({
        "wheel": wheel_path.name, "fused_moe_sha256": hashlib.sha256(data).hexdigest(), "libraries": libraries},
        indent=1))


def _moe_layers(model):
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    return [(path, module) for path, module in model.named_modules() if isinstance(module, RoutedExperts)]


# The sources whose triton outputs the plugin serves on HUMMING at capability 9.0 (oracle_hopper.json says
# which do not): name -> a synthetic spec (format, sizes) or a real checkpoint under tests/data.
DUMPS = {
    "gptq_sym_g128": ("synthetic", {"bits": 4, "group_size": 128, "sym": True}),
    "gptq_asym_g32": ("synthetic", {"bits": 4, "group_size": 32, "sym": False}),
    "gptqmodel_act_order_down_only": ("real", "tests/data/gptqmodel_act_order/down_only"),
}


def stage_dump(out: Path, scratch: Path) -> None:
    """The plugin-loaded parameters of each DUMPS source's triton output at capability 9.0."""
    from vllm.plugins import load_general_plugins

    from differential_check import _choose
    from vllm_load import _patch_platform

    load_general_plugins()
    _patch_platform()
    _choose((9, 0), False)
    for name, (kind, what) in DUMPS.items():
        _dump_one(out / name, scratch / name, kind, what)


def _dump_one(target: Path, scratch: Path, kind: str, what) -> None:
    import torch
    import vllm
    from safetensors.torch import save_file
    from vllm.model_executor.layers.fused_moe.oracle import int_wna16

    import moeconv
    from moeconv.formats import GPTQ
    from moeconv.synth import SynthSpec, make_checkpoint
    from moeconv.engines.vllm_plugin.method import LOGGER_NAME
    from vllm_load import build_and_load

    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    scratch.mkdir(parents=True, exist_ok=True)
    if kind == "synthetic":
        source = make_checkpoint(target / "src", SynthSpec(source_format=GPTQ(**what), **SPEC))
    else:
        source = Path(shutil.copytree(ROOT / what, target / "src"))
    logged = _record_plugin_log(LOGGER_NAME)
    triton = moeconv.convert(source, scratch / "triton", backend="triton").output
    model, report = build_and_load(triton)
    tensors, layers = {}, {}
    for path, layer in _moe_layers(model):
        method = layer.quant_method
        for name, parameter in layer.named_parameters(recurse=False):
            tensors[f"{layer.layer_name}.{name}"] = parameter.data.clone().contiguous()
        moe = layer.moe_config
        layers[layer.layer_name] = {
            "module": path, "backend": method.wna16_backend.value,
            "humming_weight_schema_config": int_wna16._humming_wna16_weight_schema(method.weight_quant),
            "num_experts": moe.num_local_experts, "hidden": moe.hidden_dim,
            "intermediate_per_partition": moe.intermediate_size_per_partition, "top_k": moe.experts_per_token,
            "activation": str(moe.activation), "is_gated": moe.activation.is_gated, "has_bias": moe.has_bias,
            "params_dtype": str(layer.params_dtype)}
    if not layers or any(layer["backend"] != "HUMMING" for layer in layers.values()):
        sys.exit(f"{target.name}: expected HUMMING on every MoE layer at capability 9.0: {layers}")
    save_file(tensors, str(target / "plugin_params.safetensors"))
    (target / "plugin_params.json").write_text(json.dumps({
        "vllm": vllm.__version__, "torch": torch.__version__, "source": kind if kind == "real" else what,
        "spec": SPEC if kind == "synthetic" else what, "load_report": report, "layers": layers,
        "plugin_log": logged[-1:]}, indent=1))


def stage_oracle(out: Path, scratch: Path) -> None:
    """What vLLM 0.33's oracle picks on Hopper for triton outputs of sources stock vLLM cannot load."""
    import moeconv
    from moeconv.formats import GPTQ
    from moeconv.synth import SynthSpec, make_checkpoint
    from vllm_load import build_and_load, one_line

    small = {**SPEC, "experts": 4}
    sources = {f"gptq-asym (synthetic, v1, {bits}-bit, g{group})": make_checkpoint(
        scratch / f"asym{bits}-{group}", SynthSpec(source_format=GPTQ(bits, group, sym=False), **small))
        for bits, group in ((4, 128), (4, 64), (4, 32), (8, 32), (8, 128))}
    sources.update({
        "GPTQModel act-order, down_proj only (real, asymmetric, g32)": ROOT / "tests/data/gptqmodel_act_order/down_only",
        "GPTQModel act-order, every projection (real, asymmetric, g32)": ROOT / "tests/data/gptqmodel_act_order/everywhere"})
    results = {}
    for label, source in sources.items():
        logged = _record_plugin_log("vllm.moeconv")
        try:
            output = moeconv.convert(source, scratch / f"out-{len(results)}", backend="triton").output
        except Exception as error:  # noqa: BLE001 (a refusal is the result)
            results[label] = {"converted": False, "error": one_line(error)}
            continue
        try:
            model, _ = build_and_load(output)
            backends = sorted({module.quant_method.wna16_backend.value for _, module in _moe_layers(model)})
            results[label] = {"converted": True, "loaded": True, "backends": backends, "plugin_log": logged[-1:]}
        except Exception as error:  # noqa: BLE001
            results[label] = {"converted": True, "loaded": False, "error": one_line(error)}
    (out / "oracle_hopper.json").write_text(json.dumps(results, indent=1))


def _record_plugin_log(name: str) -> list[str]:
    lines: list[str] = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger(name)
    logger.setLevel(logging.INFO)
    logger.handlers = [handler for handler in logger.handlers if type(handler).__name__ != "Recorder"]
    logger.addHandler(Recorder())
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vllm-wheel", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    stage_wheel_files(args.vllm_wheel, args.out)
    with tempfile.TemporaryDirectory(prefix="moeconv-h200-stage-") as scratch:
        stage_dump(args.out, Path(scratch))
        stage_oracle(args.out, Path(scratch))
    shutil.copy2(ROOT / "scripts" / "h200_serving.py", args.out / "h200_serving.py")
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"staged {args.out}: {total / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
