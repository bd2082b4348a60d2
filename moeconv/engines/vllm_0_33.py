"""vLLM 0.33: how it serves each backend's output, what it refuses, whose scales it casts, and what an
output built for it records, each measured with `make test-engines` (docs/SERVING.md, docs/FORMAT.md).
The plugin (engines/vllm_plugin) refuses to run in any other release (0.33.x)."""

from __future__ import annotations

from typing import Any, Mapping

from moeconv.canonical import MoELayerShape, is_channelwise
from moeconv.engines.base import FLOAT_CODES, EngineRelease, Output, Serving
from moeconv.formats import autoround

VERSION = "0.33"
NAME = f"vLLM {VERSION}"

# What each backend's output records it is for (moeconv.json's `targets`): kernel layouts and loaders age.
# Recorded text, kept byte for byte (tests/test_output_digests.py): the plugin's path is the one it had then.
TARGETS = {
    "triton": {"kernel": "vLLM 0.33.0 TritonWNA16Experts / TritonExperts layouts",
               "engine": "vLLM 0.33 with moeconv's plugin (moeconv/vllm_plugin): stock vLLM has no loader for "
                         "stacked experts"},
    f"triton{FLOAT_CODES}": {"kernel": "vLLM 0.33.0 compressed-tensors MXFP4 / NVFP4 MoE methods' parameters",
                             "engine": "vLLM 0.33 with moeconv's plugin (moeconv/engines/vllm_plugin)"},
    "humming": {"engine": "vllm==0.33.0 (quant_method humming)", "humming-kernels": "0.1.19"},
    "cpu": {"kernel": "vLLM 0.33.0 CPUExpertsInt4 / CPUExpertsInt8 (sgl-kernel x86 layouts)",
            "engine": "none yet: stock vLLM 0.33 repacks at load and has no loader for these (plugin planned)"},
    # The compressed-tensors release vLLM 0.33 pins, whose QuantizationConfig reads the backend's config.
    "compressed-tensors": {"engine": "vllm==0.33.0", "compressed-tensors": "0.17.0 (QuantizationConfig)"},
    # --cast outputs (backends/casts.py): its unquantized layers, or its own fp8 config (Fp8Config.from_config)
    "bf16": {"engine": "vllm==0.33.0 (unquantized; quant_method fp8 where FP8 block layers stay)"},
    "fp8-block": {"engine": "vllm==0.33.0 (quant_method fp8, weight_block_size [128, 128])"},
    "nvfp4": {"engine": "vllm==0.33.0", "compressed-tensors": "0.17.0 (QuantizationConfig, nvfp4-pack-quantized)"},
}
CAST_BLOCK = 128  # vLLM's block-FP8 MoE: validate_fp8_block_shape_moe wants the intermediate size per rank a multiple

# vLLM creates the per-linear schemas' scale parameters in the model dtype and casts the stored scales into
# them at load (measured with its own loader: tests/engines/scale_dtype.py).
CASTS_SCALES_OF = frozenset({"humming", "compressed-tensors"})

# The integer packings its INC method (which serves quant_method "auto-round") reads: INCConfig's
# SUPPORTED_FORMATS, with a missing packing read as auto_round:auto_gptq
# (vllm/model_executor/layers/quantization/inc/inc.py); it takes no other spelling of the method.
AUTOROUND_METHOD, AUTOROUND_PACKINGS = "auto-round", ("auto_round:auto_gptq", "auto_round:auto_awq")


def serve(layer: MoELayerShape) -> str:
    """The `vllm serve` line for an output folder, at the tensor-parallel size it was checked for."""
    return "vllm serve {output}" + (f" --tensor-parallel-size {layer.tp}" if layer.tp > 1 else "")


def autoround_refusal(config: Mapping[str, Any]) -> str | None:
    """For an AutoRound config (any other: None), why this release would not load layers kept in it: a
    packing or spelling its INC method does not read (the plain `auto_round` packing, measured with `make
    test-engines`: "Unsupported packing_format: auto_round")."""
    method = config.get("quant_method")
    if method not in autoround.METHODS:
        return None
    packing = config.get("packing_format") or AUTOROUND_PACKINGS[0]
    if method == AUTOROUND_METHOD and packing in AUTOROUND_PACKINGS:
        return None
    return (f"AutoRound quantization ({method!r}, packing_format {packing!r}), which {NAME} does not load "
            f"(its INC method reads {AUTOROUND_METHOD!r} with {' or '.join(AUTOROUND_PACKINGS)})")


def dense_refusal(output: Output) -> str | None:
    """Why this release does not load the dense layers the output copies as the source stores them: asymmetric
    GPTQ (its GPTQ is symmetric only, `AutoGPTQConfig`; measured with `make test-engines`), ModelOpt's int4
    (its ModelOpt methods read FP8, NVFP4 and MXFP8 only: LINEAR_ALGOS in
    vllm/model_executor/layers/quantization/modelopt.py), an AutoRound config its INC method does not read."""
    fmt = output.source_format
    if output.dense_converted:
        return None
    if output.source_config is not None and (refusal := autoround_refusal(output.source_config)):
        return f"the dense layers keep the source's {refusal}"
    if fmt.method == "gptq" and not fmt.symmetric:
        return f"the dense layers keep the source's asymmetric GPTQ, which {NAME} does not load"
    if fmt.method == "modelopt" and fmt.float_scheme is None:
        return f"the dense layers keep the source's ModelOpt W4A16_AWQ, which {NAME} does not load"
    return None


def answer(output: Output) -> Serving:
    """Which loader serves the backend's output, unless the dense layers it copies are what it does not load
    (output.dense_refusal)."""
    layer = output.layer
    if output.backend == "triton":
        if layer.activation_bits != 8 and is_channelwise(layer.group_size):
            return Serving(None, "moeconv's vLLM plugin does not serve channel-wise moe_wna16 scales yet; "
                                 "for vLLM use --backend compressed-tensors")
        if layer.float_scheme is not None:  # tests/engines/run_matrix.py --only float, the triton outputs
            return Serving(f"{NAME} through moeconv's plugin (vLLM's compressed-tensors {layer.float_scheme.name} MoE "
                           f"method, its parameters filled by one copy each: byte for byte those stock vLLM loads from "
                           f"the compressed-tensors form, on the CPU path; no GPU run yet)", f"install moeconv into vLLM's environment (docs/SERVING.md; it "
                                                     f"registers the plugin), then {serve(layer)}")
        served = Serving(f"{NAME} through moeconv's plugin",
                         f"install moeconv into vLLM's environment (docs/SERVING.md; it registers the plugin), "
                         f"then {serve(layer)}")
    elif output.backend == "compressed-tensors":
        if layer.float_scheme is not None:
            return Serving(f"stock {NAME} (its compressed-tensors {layer.float_scheme.name} MoE method: its loader took "
                           f"every tensor of NVFP4A16 and MXFP4A16 outputs on the CPU path; no GPU run yet)", serve(layer))
        served = Serving(f"stock {NAME}", serve(layer))
    elif output.backend == "humming":
        if layer.float_scheme is not None:
            return humming_float(layer)
        if not layer.symmetric:
            return Serving(None, f"{NAME}'s loader refuses the expert zero_point of an asymmetric Humming checkpoint "
                                 "(Humming's own loader reads it); for vLLM use --backend compressed-tensors")
        served = Serving(f"{NAME} (quant_method humming)", serve(layer))
    elif output.backend == "nvfp4":
        served = Serving(f"stock {NAME} (its compressed-tensors NVFP4 MoE method: its loader took every tensor of MXFP4 "
                         f"sources' NVFP4A16 casts on the CPU path, leaving unloaded only the input global scales it "
                         f"leaves unloaded in llm-compressor's own NVFP4A16 checkpoint; no GPU run yet)", serve(layer))
    elif output.backend in ("bf16", "fp8-block"):
        if output.backend == "fp8-block" and layer.intermediate_per_rank % CAST_BLOCK:
            return Serving(None, f"{NAME}'s block-FP8 MoE method wants the expert intermediate size per rank a multiple "
                                 f"of {CAST_BLOCK} (validate_fp8_block_shape_moe), not {layer.intermediate_per_rank}; "
                                 f"--cast bf16 is served")
        if layer.stacked_rows is not None:  # gpt-oss's stacked BF16 form (tests/engines/gpt_oss_bf16.py)
            served = Serving(f"stock {NAME} (its GptOssForCausalLM loader, unquantized MoE method, held transformers' own "
                             f"values in every expert parameter on the CPU path; no GPU run yet)", serve(layer))
        else:
            served = Serving(f"stock {NAME} (its loader took every tensor of MXFP4 sources' casts, 128-wide, on the CPU "
                             f"path with its {'fp8 block' if output.backend == 'fp8-block' else 'unquantized'} MoE method; "
                             f"no GPU run yet)", serve(layer))
    elif output.backend == "cpu":
        return Serving(None, f"no engine loads this layout from disk yet ({NAME}'s CPU experts build it at load "
                             "time from the source); for vLLM use --backend compressed-tensors")
    else:
        return Serving(None, f"not shown with {NAME}")
    if output.dense_refusal:
        return Serving(None, f"{output.dense_refusal} (moeconv's vLLM plugin refuses this output at start-up); for "
                             "vLLM use --backend compressed-tensors")
    return served


def humming_float(layer: MoELayerShape) -> Serving:
    """Humming's FP4 schema (backends/humming.py). MXFP4: its loader took every tensor on the CPU path
    (tests/engines/run_matrix.py --only float). NVFP4: HummingMoEMethod.create_weights registers each GEMM's
    weight_scale_2 as one float32 a expert (`may_add_expert_dim`: (1,) -> (E,)) with scale type "tensor", and
    RoutedExperts._load_per_tensor_weight_scale stores gate's and up's at `param[expert][shard]`, which indexes a
    0-d tensor (IndexError): no per-expert NVFP4 checkpoint loads through it, the source itself under
    --quantization humming included."""
    if layer.float_scheme.global_convention is not None:
        return Serving(None, f"{NAME}'s Humming MoE method keeps one weight_scale_2 per expert and its loader indexes "
                             f"it by gate/up shard (RoutedExperts._load_per_tensor_weight_scale: IndexError), so it does "
                             f"not load NVFP4 experts in Humming's schema; for vLLM use --backend compressed-tensors")
    return Serving(f"stock {NAME} (quant_method humming, MXFP4 weights: its loader took every tensor on the CPU path; "
                   f"no GPU run yet)", serve(layer))


RELEASE = EngineRelease("vLLM", VERSION, answer, CASTS_SCALES_OF, TARGETS)
