"""The differential oracle of moeconv's vLLM plugin: its MoE parameters against stock vLLM's, on the CPU.

Runs in .venv-engines (vllm==0.33.0 with moeconv installed, `make engines`), never in the main venv:

    .venv-engines/bin/python tests/engines/differential_check.py REFERENCE=OUTPUT [REFERENCE=OUTPUT ...]

OUTPUT is a `--backend triton` conversion served through the plugin; REFERENCE is a checkpoint stock vLLM
loads with the same MoE method (the compressed-tensors source itself, or the `compressed-tensors` output
of a GPTQ / AWQ source). For each pair and each backend choice of vLLM's MoE oracle, forced through
what the platform reports (compute capability 9.0: Humming; 8.0: Marlin; a CPU platform: vLLM's CPU
experts; `--moe-backend triton`: the user's override), both are built and loaded by vLLM's own model
class and loader as in vllm_load.py (every parameter written, twice, with two sentinels), and then,
before `process_weights_after_loading`, every parameter of every MoE layer is compared: names, shapes,
dtypes and bytes; and the backend each layer's method chose. Equal parameters and the same backend mean
both then run the same post-processing and the same kernel. Where the oracle has no backend for the
layer, both must refuse it (the plugin with one `moeconv:` line).

Prints one JSON line per pair and choice.

Tensor parallelism: with MOECONV_DIFFERENTIAL_TP=T (T > 1) the script runs itself T times, one process
per rank (gloo, on the CPU; MOECONV_DIFFERENTIAL_RANK set for each), and every rank compares its own part:
the plugin's slicing of each stacked tensor (moeconv/engines/vllm_plugin/shards.py) against the parameters stock
vLLM's own loaders fill for that rank from the reference. Each line then carries `rank`. With
MOECONV_DIFFERENTIAL_EP=1 as well, vLLM's expert parallelism is on (each rank holds its share of the
experts, placed by vLLM's expert map), and the same comparison runs.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import vllm_load  # noqa: E402
from vllm_load import _Capability, _patch_platform, one_line  # noqa: E402

TP = int(os.environ.get("MOECONV_DIFFERENTIAL_TP", "1"))
RANK = os.environ.get("MOECONV_DIFFERENTIAL_RANK")  # set in a rank's own process
build_and_load = vllm_load.build_and_load
if TP > 1 and RANK is not None:
    build_and_load = functools.partial(vllm_load.build_and_load, tp=TP, rank=int(RANK),
                                       port=int(os.environ["MOECONV_DIFFERENTIAL_PORT"]),
                                       expert_parallel=os.environ.get("MOECONV_DIFFERENTIAL_EP") == "1")

# choice -> (compute capability the platform reports, whether it is a CPU platform, --moe-backend)
CHOICES = {
    "capability 9.0": ((9, 0), False, "auto"),
    "capability 8.0": ((8, 0), False, "auto"),
    "--moe-backend triton": ((9, 0), False, "triton"),
    "CPU platform": ((9, 0), True, "auto"),  # last: the CPU answers are not undone
}
if os.environ.get("MOECONV_DIFFERENTIAL_CHOICES"):  # a subset, for a quicker look
    CHOICES = {name: CHOICES[name] for name in os.environ["MOECONV_DIFFERENTIAL_CHOICES"].split(",")}


def _choose(capability: tuple[int, int], cpu: bool) -> None:
    """What the oracle asks: the device capability (Humming's priority, Marlin's and Triton's support)
    and whether the platform is a CPU one (its own priority list; vLLM's CPU int4 experts also ask for
    an x86 CPU with AMX tiles, answered yes as on a Sapphire Rapids host)."""
    from vllm.platforms import CpuArchEnum, current_platform

    if cpu:
        torch.cpu._is_amx_tile_supported = lambda: True
        type(current_platform).get_cpu_architecture = classmethod(lambda cls: CpuArchEnum.X86)

    platform_class = type(current_platform)
    platform_class.get_device_capability = classmethod(lambda cls, device_id=0: _Capability(*capability))
    platform_class.has_device_capability = classmethod(
        lambda cls, wanted, device_id=0: _Capability(*capability).to_int() >= (
            wanted if isinstance(wanted, int) else wanted[0] * 10 + wanted[1]))
    platform_class.is_cpu = lambda self: cpu


def _moe_parameters(model) -> dict[str, tuple[str, torch.Tensor]]:
    """Every parameter of every MoE layer, by its full name, with the layer method's backend."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    found = {}
    for path, module in model.named_modules():
        if isinstance(module, RoutedExperts):
            method = module.quant_method
            backend = str(next((getattr(method, kind) for kind in ("wna16_backend", "int8_backend", "mxfp4_backend",
                                                                   "nvfp4_backend") if hasattr(method, kind)), None))
            for name, parameter in module.named_parameters(recurse=False):
                found[f"{path}.{name}"] = (backend, parameter.data)
    return found


def _built(checkpoint: Path, moe_backend: str):
    """(model, load report) or the one-line error vLLM (or the plugin) refused it with."""
    try:
        return build_and_load(checkpoint, moe_backend=moe_backend), None
    except Exception as error:  # noqa: BLE001 (a refusal is a result: the driver judges it)
        if os.environ.get("MOECONV_ENGINE_TRACE"):
            traceback.print_exc()
        return None, one_line(error)


def compare(reference: Path, output: Path, moe_backend: str) -> dict:
    stock, stock_error = _built(reference, moe_backend)
    plugin, plugin_error = _built(output, moe_backend)
    if stock is None or plugin is None:
        return {"loaded": False, "stock_error": stock_error, "plugin_error": plugin_error}
    (stock, _), (plugin, loaded) = stock, plugin
    expected, got = _moe_parameters(stock), _moe_parameters(plugin)
    differ = []
    for name in sorted(set(expected) & set(got)):
        want, have = expected[name][1], got[name][1]
        if want.dtype != have.dtype or want.shape != have.shape or not torch.equal(
                want.reshape(-1).view(torch.uint8), have.reshape(-1).view(torch.uint8)):
            differ.append(f"{name}: stock {want.dtype}{list(want.shape)}, plugin {have.dtype}{list(have.shape)}")
    return {"loaded": True, "moe_parameters": len(expected), "only_stock": sorted(set(expected) - set(got))[:5],
            "only_plugin": sorted(set(got) - set(expected))[:5], "differ": differ[:5], "differ_count": len(differ),
            "stock_backends": sorted({backend for backend, _ in expected.values()}),
            "plugin_backends": sorted({backend for backend, _ in got.values()}),
            "plugin_not_consumed": loaded["not_consumed"], "plugin_unloaded": loaded["unloaded_parameters"],
            "plugin_logged": [line for line in LOGGED if any(f"vLLM's {backend.split('.')[-1]} backend" in line
                                                             for backend, _ in got.values())][-1:]}


LOGGED: list[str] = []  # the plugin's one-line backend choices, as vLLM's logger received them


class _Recorder(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        LOGGED.append(record.getMessage())


def _ranks() -> None:
    """One process per tensor-parallel rank, all started at once (they meet in init_distributed_environment);
    their JSON lines, rank 0's first."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:]], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "MOECONV_DIFFERENTIAL_RANK": str(rank),
                                   "MOECONV_DIFFERENTIAL_PORT": str(port)}) for rank in range(TP)]
    outputs = [process.communicate()[0] for process in ranks]
    for output in outputs:
        sys.stdout.write(output)
    sys.exit(max(process.returncode for process in ranks))


def main() -> None:
    if TP > 1 and RANK is None:
        return _ranks()
    from vllm.plugins import load_general_plugins

    from moeconv.engines.vllm_plugin.method import LOGGER_NAME

    load_general_plugins()
    _patch_platform()
    plugin_logger = logging.getLogger(LOGGER_NAME)
    plugin_logger.setLevel(logging.INFO)
    plugin_logger.addHandler(_Recorder())
    for choice, (capability, cpu, moe_backend) in CHOICES.items():
        _choose(capability, cpu)
        for pair in sys.argv[1:]:
            reference, output = (Path(part) for part in pair.split("=", 1))
            result = compare(reference, output, moe_backend)
            rank = {} if RANK is None else {"rank": int(RANK), "tp": TP}
            print(json.dumps({"choice": choice, "reference": str(reference), "output": str(output), **rank, **result}),
                  flush=True)


if __name__ == "__main__":
    main()
