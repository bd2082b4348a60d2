"""moeconv's SGLang plugin under tensor parallelism: two gloo processes on the CPU, each one SGLang
tensor-parallel rank, each building the model with SGLang's own classes and loading it with SGLang's own
loader (sglang_load.build_and_load), in .venv-sglang:

    .venv-sglang/bin/python tests/engines/sglang_plugin_tp.py SOURCE=OUTPUT [SOURCE=OUTPUT ...]

For each pair, on each rank: the plugin's MoE parameters of the `triton` OUTPUT against those stock
SGLang's own moe_wna16 loader gives the same rank for the SOURCE (`--quantization moe_wna16`: SGLang's
own split of each tensor over the ranks), byte for byte, after the plugin's post-load check. Prints one
JSON line per pair and rank.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from pathlib import Path

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

TP = 2


def _rank(rank: int, init_method: str, pairs: list[str], queue) -> None:
    os.environ.setdefault("SGLANG_LOGGING_LEVEL", "ERROR")
    from sglang_load import build_and_load, select_device
    from vllm_load import one_line

    select_device()
    from sglang.srt.layers.quantization.moe_wna16 import MoeWNA16Method
    from sglang.srt.plugins import load_plugins

    from moeconv.engines.sglang_plugin.method import StackedMoeWNA16Method

    load_plugins()
    for pair in pairs:
        source, output = (Path(part) for part in pair.split("=", 1))
        try:
            stock, _ = build_and_load(source, "moe_wna16", rank, TP, init_method)
            plugin, result = build_and_load(output, None, rank, TP, init_method)
            ours = {name: module for name, module in plugin.named_modules()
                    if isinstance(getattr(module, "quant_method", None), StackedMoeWNA16Method)}
            compared, different = 0, []
            for name, module in stock.named_modules():
                if type(getattr(module, "quant_method", None)) is not MoeWNA16Method:
                    continue
                ours[name].quant_method.process_weights_after_loading(ours[name])
                for leaf in ours[name].quant_method.specs:
                    mine, theirs = getattr(ours[name], leaf).data, getattr(module, leaf).data
                    compared += 1
                    if mine.shape != theirs.shape or not torch_equal(mine, theirs):
                        different.append(f"{name}.{leaf}")
            result = {"loaded": result["loaded"], "not_consumed_count": result["not_consumed_count"],
                      "moe_tensors_compared": compared, "differing_from_stock": different,
                      "w13_qweight_shape": list(next(iter(ours.values())).w13_qweight.shape)}
        except Exception as error:  # noqa: BLE001 (a refusal is the result being measured)
            if os.environ.get("MOECONV_ENGINE_TRACE"):
                traceback.print_exc()
            result = {"loaded": False, "error": one_line(error)}
        queue.put(json.dumps({"checkpoint": str(output), "rank": rank, "tp": TP, **result}))


def torch_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and torch.equal(a, b)


def main() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_rank, args=(rank, init_method, sys.argv[1:], queue)) for rank in range(TP)]
    for process in processes:
        process.start()
    for _ in range(TP * len(sys.argv[1:])):
        print(queue.get(timeout=1800), flush=True)
    for process in processes:
        process.join()


if __name__ == "__main__":
    main()
