"""Load a checkpoint with SGLang's OWN model classes and weight loaders, on a CPU machine.

Runs in .venv-sglang (`make engines-sglang`: sglang==0.5.23), never in the main venv:

    .venv-sglang/bin/python tests/engines/sglang_load.py [--quantization=NAME] CHECKPOINT ...

`--quantization=NAME` is SGLang's own option (`--quantization`) for the checkpoints after it, up to the
next `--quantization=` (empty: SGLang picks the method from the checkpoint, as by default).

For each checkpoint: SGLang's ModelConfig parses config.json and its quantization config (SGLang's
`_get_quantization_config`, capability check included), SGLang's `_initialize_model` builds the model
class on the CPU (FusedMoE `create_weights` included), and SGLang's own
`DefaultModelLoader.load_weights_only` runs the model's `load_weights` over the loader's own weights
iterator. As in vllm_load.py: every parameter is filled with a sentinel first, twice over with two
sentinels, and every weight loader is wrapped to record which checkpoint tensors it consumed. Prints
one JSON line per checkpoint: loaded (true/false), SGLang's error if it refused, the checkpoint
tensors no loader consumed, the parameters left unloaded. SGLang's general plugins are loaded first, as
SGLang's processes load them (`sglang.srt.plugins.load_plugins`): moeconv's own (moeconv/engines/sglang_plugin,
installed into .venv-sglang by `make engines-sglang`), which serves the `triton` outputs.

What is chosen for the CPU, and why (none of it is a loader; the list is the whole of it):
- The platform. SGLang has a CUDA platform (needs a driver: `sgl_kernel` opens libcuda.so.1) and a CPU
  engine (needs sgl_kernel's CPU build, which is not on PyPI); with neither, some layers import vLLM's
  kernels at construction. So the harness installs, before SGLang first asks, an out-of-tree platform
  (`sglang.srt.platforms.interface.SRTPlatform`, the class SGLang's `sglang.srt.platforms` entry points
  name) whose device is "cpu": layers take their native torch paths.
- The GPU's compute capability answers 9.0 (an H200): `torch.cuda.get_device_capability`, which
  compressed-tensors asks when it picks a scheme (`_check_scheme_supported`), and SGLang's own
  `sglang.srt.utils.get_device_capability`, which decides whether GPTQ / AWQ checkpoints are Marlin
  compatible (`gptq_marlin` / `awq_marlin`, the methods SGLang serves them with on a GPU) and checks the
  method's minimum capability.
- AWQ's Marlin eligibility (`AWQMarlinConfig.is_awq_marlin_compatible`) also asks whether the machine is
  CUDA, through its module's `_is_cuda` (set at import; after import, read by that check only): it
  answers yes, so an AWQ checkpoint gets `awq_marlin` as on a GPU (plain `awq` has no MoE method: its
  experts would be built unquantized).
- The ServerArgs device is "cuda", as on the GPU (a "cpu" device sends layers to SGLang's CPU-engine
  paths, e.g. DeepSeek's CPU rotary embedding); the model is still built under `torch.device("cpu")`,
  and the platform's default attention backend is torch_native (no CUDA kernels).
`process_weights_after_loading` (the Marlin / Triton repack) is not run: it needs CUDA kernels.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("SGLANG_LOGGING_LEVEL", "ERROR")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_load import SENTINELS, one_line, sentinel_of, sentinel_view  # noqa: E402  (no vLLM import: plain helpers)

H200_CAPABILITY = (9, 0)


def select_device() -> None:
    """The CPU as SGLang's device (an out-of-tree platform) and an H200's compute capability."""
    import sglang.srt.platforms as platforms
    from sglang.srt.platforms.device_mixin import PlatformEnum
    from sglang.srt.platforms.interface import SRTPlatform

    class CpuLoadCheckPlatform(SRTPlatform):
        _enum = PlatformEnum.OOT
        device_name = "cpu"
        device_type = "cpu"

        def get_default_attention_backend(self) -> str:
            return "torch_native"

    platforms._current_platform = CpuLoadCheckPlatform()
    torch.cuda.get_device_capability = lambda device=None: H200_CAPABILITY
    import sglang.srt.utils
    import sglang.srt.utils.common

    # SGLang's own probe, re-exported by sglang.srt.utils; bound by name at import in the modules that
    # read it (marlin_utils, moe_wna16, the loader), so both names answer before those modules load.
    for module in (sglang.srt.utils.common, sglang.srt.utils):
        module.get_device_capability = lambda device_id=0: H200_CAPABILITY
    early = sorted(name for name in sys.modules if name.startswith(("sglang.srt.layers", "sglang.srt.model_loader")))
    assert not early, f"loaded before the device was chosen, so they kept the old answers: {early[:3]}"
    import sglang.srt.layers.quantization.awq.awq as awq

    awq._is_cuda = True  # read (after import) only by is_awq_marlin_compatible: AWQ goes to awq_marlin, as on a GPU


def _init_once(server_args, rank: int = 0, world_size: int = 1, init_method: str | None = None) -> None:
    """One gloo process group (of one rank unless told otherwise), as SGLang's weight-cache daemon sets it up."""
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )

    if model_parallel_is_initialized():
        return
    if init_method is None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            init_method = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    init_distributed_environment(world_size=world_size, rank=rank, distributed_init_method=init_method,
                                 local_rank=rank, backend="gloo")
    initialize_model_parallel()


def build_and_load(checkpoint: Path, quantization: str | None = None, rank: int = 0, tp_size: int = 1,
                   init_method: str | None = None) -> tuple[torch.nn.Module, dict]:
    """The model SGLang builds for the checkpoint, after its own loader ran twice (two sentinels), and
    what the loading showed; `load_seconds` is the faster of the two passes. `rank` of `tp_size`: this
    process's tensor-parallel rank (one gloo process per rank, joined at `init_method`)."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.dp_attention import init_dp_gathered_buffer, initialize_dp_attention
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.model_loader.loader import (
        DefaultModelLoader,
        _get_quantization_config,
        _initialize_model,
        set_default_torch_dtype,
    )
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path=str(checkpoint), device="cuda", dtype="float16", tp_size=tp_size,
                             quantization=quantization)
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=rank, gpu_id=rank))
    initialize_moe_config()
    model_config = ModelConfig.from_server_args(server_args)
    _init_once(server_args, rank, tp_size, init_method)
    initialize_dp_attention(server_args)
    init_dp_gathered_buffer(model_config)
    load_config = LoadConfig()
    loader = DefaultModelLoader(load_config)
    quant_config = _get_quantization_config(model_config, load_config)
    with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
        model = _initialize_model(model_config, load_config, quant_config)
    consumed: set[str] = set()
    unloaded_per_pass, seconds = [], []
    checkpoint_names: set[str] = set()
    for sentinel in SENTINELS:
        for parameter in model.parameters():
            with torch.no_grad():
                sentinel_view(parameter).fill_(sentinel_of(parameter, sentinel))
        yielded: dict[int, str] = {}
        held: dict[str, torch.Tensor] = {}
        _wrap_loaders(model, yielded, held, consumed)

        def weights(held=held, yielded=yielded):  # this pass's, bound (the generator runs within it)
            for name, tensor in loader._get_all_weights(model_config, model):
                held[name] = tensor  # keeps the storage alive, so its address names the tensor
                yielded[tensor.untyped_storage().data_ptr()] = name
                yield name, tensor

        started = time.perf_counter()
        DefaultModelLoader.load_weights_only(model, weights(), torch.device("cpu"))
        seconds.append(time.perf_counter() - started)
        unloaded_per_pass.append({name for name, parameter in model.named_parameters()
                                  if parameter.numel() and bool((sentinel_view(parameter) == sentinel_of(
                                      parameter, sentinel)).all())})
        checkpoint_names = set(yielded.values())
    unloaded = sorted(set.intersection(*unloaded_per_pass))
    not_consumed = sorted(checkpoint_names - consumed)
    return model, {"loaded": True, "tensors": len(checkpoint_names), "not_consumed": not_consumed,
                   "not_consumed_count": len(not_consumed), "unloaded_parameters": unloaded,
                   "unloaded_count": len(unloaded), "load_seconds": round(min(seconds), 4),
                   "quant_method": type(quant_config).__name__ if quant_config is not None else None,
                   "methods": methods_chosen(model)}


def methods_chosen(model: torch.nn.Module) -> dict[str, int]:
    """The method SGLang chose for each quantizable module, counted: "module class: method class" and, where the
    method delegates to a per-layer scheme (compressed-tensors), "(scheme class)"."""
    counts: dict[str, int] = {}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None or isinstance(method, (str, dict)):
            continue
        scheme = getattr(module, "scheme", None)
        key = f"{type(module).__name__}: {type(method).__name__}" + (f" ({type(scheme).__name__})" if scheme else "")
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def _wrap_loaders(model, yielded: dict[int, str], held: dict[str, torch.Tensor], consumed: set[str]) -> None:
    """Every parameter's weight loader records which checkpoint tensor it was handed: by storage, or, for a
    tensor the model's loader made itself, the checkpoint tensors of the same module it is the concatenation
    of (SGLang's DeepSeek loader hands its fused_qkv_a_proj_with_mqa parameter torch.cat of q_a_proj and
    kv_a_proj_with_mqa)."""
    from sglang.srt.layers.parameter import BasevLLMParameter
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    for parameter_name, parameter in model.named_parameters():
        original = getattr(parameter, "_moeconv_original_loader", None) or getattr(parameter, "weight_loader",
                                                                                     default_weight_loader)
        module = parameter_name.rsplit(".", 2)[0] + "."  # the parent of the parameter's module

        def recording(*args, _original=original, _module=module, **kwargs):
            for value in list(args[1:2]) + list(kwargs.values()):
                if not isinstance(value, torch.Tensor):
                    continue
                if value.untyped_storage().data_ptr() in yielded:
                    consumed.add(yielded[value.untyped_storage().data_ptr()])
                else:
                    consumed.update(_concatenation_of(value, {name: tensor for name, tensor in held.items()
                                                              if name.startswith(_module)}))
            return _original(*args, **kwargs)

        parameter._moeconv_original_loader = original
        if isinstance(parameter, BasevLLMParameter):  # its weight_loader is a read-only property
            parameter._weight_loader = recording
        else:
            parameter.weight_loader = recording


def _concatenation_of(value: torch.Tensor, candidates: dict[str, torch.Tensor]) -> list[str]:
    """The names of two or more `candidates` whose concatenation along dim 0 or 1, in some order, is
    `value` element for element; [] when it is no such concatenation."""
    for dim in range(min(value.dim(), 2)):
        offset, names = 0, []
        while offset < value.shape[dim]:
            for name, tensor in candidates.items():
                width = tensor.shape[dim] if tensor.dim() == value.dim() else 0
                if (name not in names and width and tensor.dtype == value.dtype
                        and offset + width <= value.shape[dim]
                        and all(tensor.shape[d] == value.shape[d] for d in range(value.dim()) if d != dim)
                        and torch.equal(value.narrow(dim, offset, width), tensor)):
                    names.append(name)
                    offset += width
                    break
            else:
                break
        if offset == value.shape[dim] and len(names) > 1:
            return names
    return []


def main() -> None:
    select_device()
    from sglang.srt.plugins import load_plugins

    load_plugins()  # as each SGLang process does at start-up: moeconv's own (sglang.srt.plugins entry point)
    quantization = None
    for path in sys.argv[1:]:
        if path.startswith("--quantization="):
            quantization = path.partition("=")[2] or None
            continue
        try:
            result = build_and_load(Path(path), quantization)[1]
        except Exception as error:  # noqa: BLE001 (SGLang's refusal is the result being measured)
            if os.environ.get("MOECONV_ENGINE_TRACE"):
                traceback.print_exc()
            result = {"loaded": False, "error": one_line(error),
                      "where": traceback.format_exc().splitlines()[-3][:200]}
        print(json.dumps({"checkpoint": path, "quantization": quantization, **result}), flush=True)


if __name__ == "__main__":
    main()
