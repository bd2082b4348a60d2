"""What vLLM's loader does with a checkpoint's scales when their dtype differs from the model dtype.

Runs in .venv-engines (vllm==0.33.0), on the CPU, with vllm_load.py's platform patching:

    .venv-engines/bin/python tests/engines/scale_dtype.py [--dtype auto|float16|bfloat16] CHECKPOINT ...

For each checkpoint, vLLM's ModelConfig resolves the model dtype (params_dtype: config.json's
torch_dtype under "auto", or the --dtype override); the model is built under that default dtype, as
vLLM's load_model does (create_weights included), and fed by vLLM's own load_weights;
`process_weights_after_loading` (the GPU repack) is not run. Each scale parameter that consumes a
checkpoint tensor is measured. The checkpoint is loaded twice: once as vLLM does, then again with every
scale parameter swapped for a float64 one and every scale tensor handed to its loader as float64 (an
exact copy of the stored value), so the second pass puts each stored value exactly where the first
put its cast. Both passes start from NaN, so a value no loader writes is counted as unwritten.
`changed` counts values whose loaded value differs from the stored one (compared in float64);
`max_rel_change` is the largest |loaded - stored| / |stored|; stored_dtype is read from the
safetensors headers of the tensors each parameter consumed.

Prints one JSON line per checkpoint, with one entry per scale parameter kind (layer numbers folded).
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import vllm_load
from safetensors import safe_open


def measure(checkpoint: Path, dtype: str) -> dict:
    from vllm.config import (
        DeviceConfig,
        LoadConfig,
        ModelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
        parallel_state,
    )
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    model_config = ModelConfig(model=str(checkpoint), dtype=dtype, enforce_eager=True)
    vllm_config = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"),
                             load_config=LoadConfig())
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(model_config.dtype):  # as load_model
        if not parallel_state.model_parallel_is_initialized():
            init_distributed_environment(world_size=1, rank=0, distributed_init_method="tcp://127.0.0.1:29534",
                                         local_rank=0, backend="gloo")
            initialize_model_parallel(1, 1)
        model = initialize_model(vllm_config=vllm_config)
        scales = {name: p for name, p in model.named_parameters() if "scale" in name and p.is_floating_point()}
        yielded: dict[int, str] = {}
        consumed: dict[str, set[str]] = defaultdict(set)  # parameter name -> checkpoint tensor names
        shadow_pass = [False]
        for name, parameter in scales.items():
            original = getattr(parameter, "weight_loader", default_weight_loader)

            def recording(*args, _original=original, _name=name, **kwargs):
                args = list(args)
                key = 1 if len(args) > 1 else "loaded_weight"
                holder = args if key == 1 else kwargs
                tensor = holder[key]
                if tensor.untyped_storage().data_ptr() in yielded:
                    consumed[_name].add(yielded[tensor.untyped_storage().data_ptr()])
                if shadow_pass[0]:
                    holder[key] = tensor.double()
                return _original(*args, **kwargs)

            parameter.weight_loader = recording
        loader = DefaultModelLoader(LoadConfig())
        loaded, shadow = {}, {}
        for shadow_pass[0] in (False, True):  # the second pass loads float64 copies into float64 parameters
            for parameter in scales.values():
                parameter.data = torch.full_like(parameter.data, float("nan"),
                                                 dtype=torch.float64 if shadow_pass[0] else parameter.dtype)
            held = []

            def weights(held=held):
                for name, tensor in loader.get_all_weights(model_config, model):
                    held.append(tensor)  # keeps the storage alive, so its address names the tensor
                    yielded[tensor.untyped_storage().data_ptr()] = name
                    yield name, tensor

            model.load_weights(weights())
            for name, parameter in scales.items():
                (shadow if shadow_pass[0] else loaded)[name] = parameter.data
    files = {}
    for shard in checkpoint.glob("*.safetensors"):
        with safe_open(shard, "pt") as handle:
            files.update({key: handle.get_slice(key).get_dtype() for key in handle.keys()})  # noqa: SIM118 (not a dict)
    kinds: dict[str, dict] = {}
    for name in scales:
        if not consumed[name]:
            continue  # not in the checkpoint (e.g. attention q/k/v_scale)
        value, exact = loaded[name].double(), shadow[name]
        written = ~exact.isnan()
        kind = kinds.setdefault(re.sub(r"\.\d+\.", ".N.", name), {
            "stored_dtype": sorted({files[t] for t in consumed[name]}),
            "param_dtype": str(loaded[name].dtype).removeprefix("torch."), "params": 0, "values": 0,
            "unwritten": 0, "changed": 0, "max_rel_change": 0.0})
        kind["params"] += 1
        kind["values"] += int(written.sum())
        kind["unwritten"] += int((~written).sum())
        kind["changed"] += int((value[written] != exact[written]).sum())
        rel = ((value[written] - exact[written]).abs() / exact[written].abs()).max()
        kind["max_rel_change"] = max(kind["max_rel_change"], float(rel))
    return {"loaded": True, "model_dtype": str(model_config.dtype).removeprefix("torch."), "scales": kinds}


def main() -> None:
    arguments = sys.argv[1:]
    dtype = "auto"
    if arguments[:1] == ["--dtype"]:
        dtype, arguments = arguments[1], arguments[2:]
    vllm_load._patch_platform()
    for path in arguments:
        start = time.perf_counter()
        try:
            result = measure(Path(path), dtype)
        except Exception as error:  # noqa: BLE001 (a refusal is a result)
            result = {"loaded": False, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
        print(json.dumps({"checkpoint": path, "dtype_arg": dtype, **result,
                          "seconds": round(time.perf_counter() - start, 2)}), flush=True)


if __name__ == "__main__":
    main()
