"""Issue 26: `load_weights` time, tensors and peak host memory, stock vLLM against the plugin (not in `make test`).

Driver (main venv): builds a Qwen3-MoE GPTQ 4-bit symmetric source (4 layers x 128 experts), its
`compressed-tensors` and `triton` outputs, then loads each RUNS times, alternating, one fresh
.venv-engines process per load (this same file with --one), all at capability 9.0 (vLLM's oracle: Humming),
forced as tests/engines/differential_check.py forces it:

    .venv/bin/python tests/engines/load_memory.py [--hidden 256] [--intermediate 256] [--runs 5] [--keep DIR]

--float (issue 40): the source is instead a compressed-tensors MXFP4 checkpoint of `--layers` layers x 128 experts
(benchmarks/float_source.py, the layout llm-compressor's MXFP4A16 writes), loaded by stock vLLM, against its
`triton` output (the stacked mxfp4 layout) through the plugin; both MoE methods are vLLM's
CompressedTensorsW4A4Mxfp4MoEMethod (Marlin at capability 9.0).

--one CHECKPOINT (in .venv-engines): vLLM's model class built as in vllm_load.py, then ONE pass of vLLM's
DefaultModelLoader.load_weights, timed (every parameter zero-filled first, so its pages are not first
touched inside the pass: on a GPU host they would be device memory). --sample: RssAnon and RssFile read
at every tensor the loader is handed, their maxima reported (the time is then not a measurement).
Memory from /proc/self/status: VmRSS and VmHWM just before the pass, after VmHWM was reset to the current RSS (`5` written to /proc/self/clear_refs), and VmHWM, VmRSS,
RssAnon, RssFile just after; so VmHWM after - VmRSS before is the peak RSS growth during the pass (the
loader's memory-mapped shard pages included: they count in RSS as RssFile).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENGINES = Path(__file__).resolve().parent
KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def _status() -> dict[str, float]:
    """The KEYS of /proc/self/status, in MiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {key: int(fields[key].split()[0]) / 1024 for key in KEYS}


def one(checkpoint: str, sample: bool = False) -> dict:
    import vllm_load
    from differential_check import _choose
    from vllm.config import DeviceConfig, KernelConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    vllm_load._patch_platform()
    _choose((9, 0), False)
    model_config = ModelConfig(model=checkpoint, dtype="float16", enforce_eager=True)
    config = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"),
                        load_config=LoadConfig(), kernel_config=KernelConfig(moe_backend="auto"))
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method="tcp://127.0.0.1:29534",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
        model = initialize_model(vllm_config=config)
        loader = DefaultModelLoader(LoadConfig())
        names, peaks = [], {"RssAnon": 0.0, "RssFile": 0.0}

        def weights():
            for name, tensor in DefaultModelLoader.get_all_weights(loader, model_config, model):
                names.append(name)
                if sample:  # what RSS is made of while the loader holds each tensor (slows the pass)
                    now = _status()
                    peaks.update({key: max(peaks[key], now[key]) for key in peaks})
                yield name, tensor

        loader.get_all_weights = lambda _config, _model: weights()
        for parameter in model.parameters():  # touched first: on a GPU host they are device memory
            parameter.data.zero_()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _status()
        loader.counter_before_loading_weights = started = time.perf_counter()
        loader.load_weights(model, model_config)
        seconds = time.perf_counter() - started
        after = _status()
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    methods = [module.quant_method for module in model.modules() if isinstance(module, RoutedExperts)]
    kinds = ("wna16_backend", "wna16_moe_backend", "mxfp4_backend")
    backends = sorted({f"{type(method).__name__} {next((getattr(method, k) for k in kinds if hasattr(method, k)), None)}"
                       for method in methods})
    return {"checkpoint": checkpoint, "seconds": round(seconds, 4), "tensors": len(names), "backends": backends,
            "before": before, "after": after, "peak_growth_mib": round(after["VmHWM"] - before["VmRSS"], 1),
            **({"sampled_peaks": peaks} if sample else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one")
    parser.add_argument("--sample", action="store_true", help="--one: RssAnon / RssFile at every tensor, untimed")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--keep", type=Path)
    parser.add_argument("--float", action="store_true", help="an MXFP4 source and its triton output (issue 40)")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    if args.one:
        sys.path.insert(0, str(ENGINES))
        print(json.dumps(one(args.one, args.sample)), flush=True)
        return
    import moeconv
    from moeconv.formats import GPTQ
    from moeconv.synth import SynthSpec, make_checkpoint
    from run_matrix import ENGINE_PYTHON

    with tempfile.TemporaryDirectory(prefix="moeconv-load-memory-") as scratch:
        base = args.keep or Path(scratch)
        if args.float:
            source = base / "src"
            if not (source / "config.json").exists():
                subprocess.run([sys.executable, str(ENGINES.parents[1] / "benchmarks" / "float_source.py"), str(source),
                                "--layers", str(args.layers), "--hidden", str(args.hidden), "--intermediate",
                                str(args.intermediate), "--vocab", "1024"], check=True)
            cases = {"compressed-tensors MXFP4 source, stock vLLM": source,
                     "triton output (stacked mxfp4), plugin": moeconv.convert(source, base / "triton",
                                                                              backend="triton").output}
        else:
            spec = SynthSpec(architecture="qwen3_moe", source_format=GPTQ(4, args.group_size, sym=True),
                             layers=args.layers, experts=128, hidden=args.hidden, intermediate=args.intermediate)
            source = make_checkpoint(base / "src", spec)
            cases = {"GPTQ source, stock vLLM": source,
                     "compressed-tensors output, stock vLLM": moeconv.convert(
                         source, base / "ct", backend="compressed-tensors").output,
                     "triton output, plugin": moeconv.convert(source, base / "triton", backend="triton").output}
        runs = {label: [] for label in cases}
        for _ in range(args.runs):
            for label, path in cases.items():
                done = subprocess.run([str(ENGINE_PYTHON), __file__, "--one", str(path)], capture_output=True,
                                      text=True, timeout=900)
                lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
                if not lines:
                    sys.exit(f"{label}: {done.stderr[-3000:]}")
                runs[label].append(json.loads(lines[-1]))
                print(json.dumps({"case": label, **runs[label][-1]}), flush=True)
    scheme = "MXFP4 (block 32)" if args.float else f"GPTQ 4-bit g = {args.group_size}"
    print(f"\n{args.layers} layers x 128 experts, H = {args.hidden}, I = {args.intermediate}, {scheme}\n")
    print("| checkpoint | backend | tensors | `load_weights` s, median (all) | peak RSS growth MiB, median (all) | "
          "VmHWM before -> after MiB (median) |\n|---|---|---|---|---|---|")
    for label, results in runs.items():
        seconds = [r["seconds"] for r in results]
        growth = [r["peak_growth_mib"] for r in results]
        hwm = (statistics.median(r["before"]["VmHWM"] for r in results),
               statistics.median(r["after"]["VmHWM"] for r in results))
        print(f"| {label} | {', '.join(results[0]['backends'])} | {results[0]['tensors']} | "
              f"{statistics.median(seconds):.3f} ({' / '.join(f'{s:.3f}' for s in seconds)}) | "
              f"{statistics.median(growth):.1f} ({' / '.join(f'{g:.1f}' for g in growth)}) | "
              f"{hwm[0]:.0f} -> {hwm[1]:.0f} |")


if __name__ == "__main__":
    main()
