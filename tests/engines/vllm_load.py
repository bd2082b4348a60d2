"""Load a checkpoint with vLLM's OWN model classes and weight loaders, on a CPU machine.

Runs in .venv-engines (`make engines`: vllm==0.33.0), never in the main venv:

    .venv-engines/bin/python tests/engines/vllm_load.py CHECKPOINT [CHECKPOINT ...]

For each checkpoint: vLLM's ModelConfig parses config.json and its quantization config, the model
class is built on the CPU (FusedMoE `create_weights` included), and vLLM's own `load_weights` is fed by
its `DefaultModelLoader`. Every parameter is first filled with a sentinel, twice over with two
different sentinels, so a parameter the loader never writes is found (an int8 parameter cannot hold
the same sentinel by chance both times); every weight loader is wrapped to record which checkpoint
tensors it consumed. Prints one JSON line per checkpoint: loaded (true/false), the error if vLLM
refused, the checkpoint tensors no loader consumed, the parameters left unloaded.

What is patched, and why (none of it is a loader): vLLM picks devices and kernels by platform, and on
a machine without a GPU the platform is "unspecified"; attention-backend selection is pointed at the
CPU backend, the device capability answers 9.0 (the H200's), and linear-kernel selection treats the
platform as CUDA. `process_weights_after_loading` (the GPU repack) is not run: it needs CUDA.
"""

from __future__ import annotations

import json
import os
import re
import sys
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch  # noqa: E402

SENTINELS = (-77.0, 55.0)


def _patch_platform() -> None:
    """After vLLM's modules are imported (some ask the platform at import time): CUDA-like answers
    for kernel selection, the CPU attention backend for the attention layers."""
    import vllm.model_executor.layers.attention.attention as attention_module
    import importlib

    for module in ("vllm.model_executor.model_loader", "vllm.model_executor.layers.quantization.online.fp8",
                   "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
                   "vllm.model_executor.layers.quantization.humming", "vllm.model_executor.models.qwen3_moe",
                   "vllm.model_executor.models.mixtral", "vllm.model_executor.models.deepseek_v2"):
        try:
            importlib.import_module(module)  # before the platform's answers change: some ask at import
        except ImportError:
            pass
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    platform_class = type(current_platform)
    platform_class.get_device_capability = classmethod(lambda cls, device_id=0: _Capability(9, 0))
    platform_class.has_device_capability = classmethod(lambda cls, capability, device_id=0: True)
    platform_class.is_cuda = lambda self: True  # kernel selection; custom ops keep their native forward
    platform_class.get_attn_backend_cls = classmethod(lambda cls, backend, attn_selector_config, **kwargs: (
        "vllm.v1.attention.backends.mla.cpu_mla.CPUMLABackend" if attn_selector_config.use_mla
        else "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"))
    attention_module.get_attn_backend = lambda *args, **kwargs: CPUAttentionBackend
    from vllm.platforms.cpu import CpuPlatform

    platform_class.get_mla_prefill_backend_cls = CpuPlatform.get_mla_prefill_backend_cls
    try:  # Humming reads the GPU's properties through a CUDA extension: answer as an H200 would
        import humming.device

        humming.device.DeviceInfo._get_value = lambda self: _H200
    except ImportError:
        pass
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts, TritonWNA16Experts

    # The Triton experts' device check (is_cuda_alike, which would also switch activations to CUDA-only
    # custom ops): answered as on a GPU, for the experts classes only (moe_wna16 and int8 W8A8).
    for experts in (TritonExperts, TritonWNA16Experts):
        experts._supports_current_device = staticmethod(lambda: True)
    import vllm.model_executor.kernels.linear as linear_kernels
    from vllm.platforms import PlatformEnum

    for name in dir(linear_kernels):  # the kernel tables, keyed by platform: the unspecified one gets CUDA's
        table = getattr(linear_kernels, name)
        if name.startswith("_POSSIBLE") and isinstance(table, dict) and PlatformEnum.CUDA in table:
            table[current_platform._enum] = table[PlatformEnum.CUDA]


class _DeviceProperties:
    """What Humming's device-info extension reports for an H200 (only read while creating weights)."""

    name, is_ppu, sm_version, sm_count = "NVIDIA H200", False, 90, 132

    def __getattr__(self, name: str) -> int:
        return 1 << 16  # limits (threads, registers, shared memory): large enough for any tile


_H200 = _DeviceProperties()


class _Capability(tuple):
    def __new__(cls, major: int, minor: int):
        instance = super().__new__(cls, (major, minor))
        instance.major, instance.minor = major, minor
        return instance

    def to_int(self) -> int:
        return self.major * 10 + self.minor

    def as_version_str(self) -> str:
        return f"{self.major}.{self.minor}"


def load(checkpoint: Path) -> dict:
    return build_and_load(checkpoint)[1]


def build_and_load(checkpoint: Path, moe_backend: str = "auto", tp: int = 1, rank: int = 0,
                   port: int = 29533, expert_parallel: bool = False,
                   dtype: str = "float16") -> tuple[torch.nn.Module, dict]:
    """The model vLLM builds for the checkpoint (`moe_backend`: vLLM's --moe-backend), after its own
    loader ran twice (two sentinels), and what the loading showed; `load_seconds` is the faster of the
    two `load_weights` passes. `tp` > 1: this process is tensor-parallel rank `rank` of `tp` (gloo, the
    ranks meeting at 127.0.0.1:`port`), and the model holds that rank's part, as vLLM builds it
    (`expert_parallel`: vLLM's --enable-expert-parallel, the experts split over the ranks); `dtype`: vLLM's
    --dtype."""
    import time

    from vllm.config import (
        DeviceConfig, KernelConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config,
    )
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import initialize_model

    model_config = ModelConfig(model=str(checkpoint), dtype=dtype, enforce_eager=True)
    # Expert parallelism: vLLM's MoE layers read the flag from the parallel config and their sizes from
    # the process groups (initialized below with `tp` ranks); the config's own tensor-parallel size stays 1,
    # because a larger one sends VllmConfig into compile-pass set-up that needs vLLM's CUDA ops.
    parallel = {"parallel_config": ParallelConfig(enable_expert_parallel=True)} if expert_parallel else {}
    vllm_config = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"),
                             load_config=LoadConfig(), kernel_config=KernelConfig(moe_backend=moe_backend), **parallel)
    with set_current_vllm_config(vllm_config):
        from vllm.distributed import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            init_distributed_environment(world_size=tp, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                         local_rank=rank, backend="gloo")
            initialize_model_parallel(tp, 1)
        model = initialize_model(vllm_config=vllm_config)
        loader = DefaultModelLoader(LoadConfig())
        consumed: set[str] = set()
        unloaded_per_pass, seconds = [], []
        for sentinel in SENTINELS:
            for parameter in model.parameters():
                with torch.no_grad():
                    sentinel_view(parameter).fill_(sentinel_of(parameter, sentinel))
            yielded: dict[int, str] = {}
            held = []
            _wrap_loaders(model, yielded, consumed)

            def weights(held=held, yielded=yielded):  # this pass's, bound (the generator runs within it)
                for name, tensor in DefaultModelLoader.get_all_weights(loader, model_config, model):
                    held.append(tensor)  # keeps the storage alive, so its address names the tensor
                    yielded[tensor.untyped_storage().data_ptr()] = name
                    yield name, tensor

            # vLLM's own DefaultModelLoader.load_weights (which hands the model its weights iterator), fed
            # by the recording iterator above.
            loader.get_all_weights = lambda _config, _model: weights()
            loader.counter_before_loading_weights = started = time.perf_counter()
            loader.load_weights(model, model_config)
            seconds.append(time.perf_counter() - started)
            unloaded_per_pass.append({name for name, parameter in model.named_parameters()
                                      if parameter.numel() and bool((sentinel_view(parameter) == sentinel_of(
                                          parameter, sentinel)).all())})
            checkpoint_names = set(yielded.values())
    unloaded = sorted(set.intersection(*unloaded_per_pass))
    not_consumed = sorted(checkpoint_names - consumed)
    return model, {"loaded": True, "tensors": len(checkpoint_names), "not_consumed": not_consumed[:20],
                   "not_consumed_count": len(not_consumed), "unloaded_parameters": unloaded[:20],
                   "unloaded_count": len(unloaded), "load_seconds": round(min(seconds), 4)}


def sentinel_view(parameter: torch.Tensor) -> torch.Tensor:
    """The parameter's data as the sentinel is written and read: a float8_e8m0fnu parameter (Humming's MXFP4
    scales) holds no negative number, so its bytes are filled instead."""
    return parameter.data.view(torch.uint8) if parameter.dtype == torch.float8_e8m0fnu else parameter.data


def sentinel_of(parameter: torch.Tensor, sentinel: float) -> float | int:
    if parameter.dtype == torch.float8_e8m0fnu:
        return int(abs(sentinel))
    return sentinel if parameter.dtype.is_floating_point else int(sentinel)


def _wrap_loaders(model, yielded: dict[int, str], consumed: set[str]) -> None:
    """Every parameter's weight loader records which checkpoint tensor it was handed (by storage)."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    for parameter in model.parameters():
        original = getattr(parameter, "_moeconv_original_loader", None) or getattr(parameter, "weight_loader",
                                                                                     default_weight_loader)

        def recording(*args, _original=original, **kwargs):
            for value in list(args[1:2]) + list(kwargs.values()):
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in yielded:
                    consumed.add(yielded[value.untyped_storage().data_ptr()])
            return _original(*args, **kwargs)

        parameter._moeconv_original_loader = original
        parameter.weight_loader = recording


def one_line(error: Exception) -> str:
    """An exception as one line: vLLM wraps a quantization config's refusal in pydantic's
    ValidationError, whose first line says only that VllmConfig did not validate."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {' / '.join(lines)}"[:600]


# what pydantic's ValidationError appends to a validator's message on its line
PYDANTIC_SUFFIX = re.compile(r" \[type=value_error, .*$")


def moeconv_line(error: BaseException) -> str | None:
    """The plugin's refusal in `error` (itself, its cause or context, or the message vLLM's config
    validation wrapped it in): its one line, from `moeconv: `; None when there is none, or when what
    follows `moeconv: ` spans more than one line (a refusal must be one)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)
        if "moeconv: " in text:
            refusal = text[text.index("moeconv: "):]
            lines = refusal.splitlines()
            # pydantic's ValidationError appends its own lines (the input value, a docs link) after the message
            ours = [line for line in lines[1:] if line.strip() and not line.lstrip().startswith(("[type=", "For further"))]
            return PYDANTIC_SUFFIX.sub("", lines[0]) if not ours else None
        error = error.__cause__ or error.__context__
    return None


def main() -> None:
    import time

    from vllm.plugins import load_general_plugins

    load_general_plugins()  # as vLLM's engine does at start-up: moeconv's entry point registers "moeconv"
    _patch_platform()
    for path in sys.argv[1:]:
        started = time.perf_counter()
        try:
            result = load(Path(path))
        except Exception as error:  # noqa: BLE001 (vLLM's refusal is the result being measured)
            if os.environ.get("MOECONV_ENGINE_TRACE"):
                traceback.print_exc()
            result = {"loaded": False, "error": one_line(error), "moeconv_line": moeconv_line(error),
                      "where": traceback.format_exc().splitlines()[-3][:200]}
        result["seconds"] = round(time.perf_counter() - started, 2)  # this checkpoint's, vLLM's import excluded
        print(json.dumps({"checkpoint": path, **result}), flush=True)


if __name__ == "__main__":
    main()
