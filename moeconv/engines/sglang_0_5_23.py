"""SGLang 0.5.23: which path serves each backend's output and how, or why none does, measured with `make
test-engines-sglang` (docs/SGLANG.md). The plugin (engines/sglang_plugin) is built for this release only:
under any other its config refuses."""

from __future__ import annotations

from moeconv.canonical import MoELayerShape, is_channelwise
from moeconv.engines.base import EngineRelease, Output, Serving

VERSION = "0.5.23"  # the one release whose MoeWNA16Method and loaders the plugin was checked against
NAME = f"SGLang {VERSION}"
SHOWN_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")  # loaded by SGLang's own classes here
DEEPSEEK = ("deepseek_v2", "deepseek_v3", "kimi_k2")  # SGLang's DeepSeek loader (MLA attention)
QWEN_MOE = ("qwen2_moe", "qwen3_moe")
FLOAT_SHOWN_FAMILIES = ("qwen3_moe",)  # the float-coded fixtures' family (tests/data/float)
MIXED_PRECISION = "mixed-precision"  # a compressed-tensors config of several groups (its `format`)
PLUGIN = "triton (moeconv's SGLang plugin)"
CAST_BLOCK = 128  # its Fp8MoEMethod.create_weights wants the intermediate size per rank a multiple of block_n
CAST_METHODS = {  # --cast output -> the MoE method this release picked for it (run_matrix_sglang.py --only casts)
    "bf16": "UnquantizedFusedMoEMethod",
    "fp8-block": "Fp8MoEMethod",
    "nvfp4": "CompressedTensorsW4A16Nvfp4MoE",
}

# The backends whose serve line keeps the stored scale dtype: vLLM's (measured there, not apart here). Its
# MoeWNA16Method casts the plugin's triton scales too (docs/SGLANG.md), which the line does not flag yet.
CASTS_SCALES_OF = frozenset({"humming", "compressed-tensors"})


def launch(layer: MoELayerShape, flags: str = "") -> str:
    """SGLang's launch line for an output folder, at the tensor-parallel size it was checked for."""
    return ("python -m sglang.launch_server --model-path {output}" + flags
            + (f" --tp-size {layer.tp}" if layer.tp > 1 else ""))


def dense_mlp_layers(output: Output) -> str | None:
    """The dense MLP layers a Qwen2/3-MoE config declares among its MoE layers (`mlp_only_layers`, or a
    `decoder_sparse_step` above 1), which this release's Qwen2MoeForCausalLM and Qwen3MoeForCausalLM ignore:
    they build every layer as MoE, so a dense layer's tensors are taken by no parameter (the fresh-clone run,
    docs/BENCHMARKS.md; vLLM 0.33 honours both keys). None where the config declares none."""
    config = output.model_config or {}
    if output.model_type not in QWEN_MOE:
        return None
    only, step = config.get("mlp_only_layers"), config.get("decoder_sparse_step")
    if isinstance(only, list) and only:
        return f"mlp_only_layers {only[:4]}{' ...' if len(only) > 4 else ''}"
    if isinstance(step, int) and not isinstance(step, bool) and step > 1:
        return f"decoder_sparse_step {step}"
    return None


def float_codes(output: Output) -> Serving:
    """A compressed-tensors output of float-coded experts, as this release's own compressed-tensors config picks
    their methods (sglang/srt/layers/quantization/compressed_tensors/compressed_tensors.py, `get_quant_method`),
    measured on Qwen3-MoE with `make test-engines-sglang` (run_matrix_sglang.py --only float; docs/BENCHMARKS.md).
    NVFP4: CompressedTensorsW4A16Nvfp4MoE for the experts (CompressedTensorsW4A16Fp4 for NVFP4 dense linears),
    whose loader took every tensor of the NVFP4A16 and NVFP4 outputs on the CPU path; a W4A4 (NVFP4) checkpoint
    gets it too below SM100, weight-only (the W4A4 MoE method checks for a Blackwell itself). MXFP4: its gpt-oss
    method Mxfp4MoEMethod, whose parameters only the Kimi-K3 loader renames weight_packed for: other models'
    loaders skip every expert's codes without a word. Mixed outputs (FP8-block attention beside the FP4 group):
    its target matcher (compressed_tensors/utils.py, `find_matched_target`) tries the module's class against the
    `Linear` target before the fused q/k/v names, so a fused qkv_proj takes the FP4 group."""
    layer, scheme = output.layer, output.layer.float_scheme
    family = output.model_type or "this model"
    if scheme.name == "mxfp4":
        return Serving(None, f"{NAME} gives compressed-tensors MXFP4 experts its gpt-oss method Mxfp4MoEMethod, whose "
                             f"parameters are w13_weight / w2_weight: only its Kimi-K3 loader renames weight_packed "
                             f"to weight, so {family}'s loader skips every expert's weight_packed (their codes stay "
                             f"unloaded); and it has no compressed-tensors MXFP4 linear scheme, so start-up stops "
                             f"(\"No compressed-tensors compatible scheme was found\") at an MXFP4 dense linear, or "
                             f"at a fused qkv_proj its matcher gives the MXFP4 group's `Linear` target; serve it with vLLM")
    if (output.source_config or {}).get("format") == MIXED_PRECISION:
        return Serving(None, f"not shown with {NAME}: its compressed-tensors matcher tries the module class before "
                             f"the fused q/k/v names, so a fused qkv_proj takes the {scheme.name} group's `Linear` "
                             f"target instead of its FP8-block group (as measured on the MXFP4 + FP8-block output); "
                             f"serve it with vLLM")
    w4a4 = ("; below SM100 (H100, H200) weight-only, the activation quantization ignored: its W4A4 method "
            "CompressedTensorsW4A4Nvfp4MoE needs a Blackwell") if scheme.input_scale else ""
    served = Serving(f"{NAME} (compressed-tensors CompressedTensorsW4A16Nvfp4MoE for the experts{w4a4}; its loader "
                     f"took every tensor on the CPU path; no GPU run yet)", launch(layer))
    return _shown_for(served, output)


def _shown_for(served: Serving, output: Output) -> Serving:
    """A float or cast output's answer, said to be measured on Qwen3-MoE only where the family is another."""
    if output.model_type not in FLOAT_SHOWN_FAMILIES:
        return served._replace(engine=f"{served.engine}, not shown for {output.model_type}")
    return served


def casts(output: Output) -> Serving:
    """A `convert --cast` output (backends/casts.py), as this release's loader took the casts of run_matrix.py's two
    128-wide MXFP4 sources on the CPU path (run_matrix_sglang.py --only casts, 2026-12-07; docs/BENCHMARKS.md): bf16
    under no quantization (or its fp8 config where FP8 block attention stays), fp8-block under its fp8 config, and
    nvfp4 under its compressed-tensors config, each with every tensor taken and every parameter loaded. Refused: an
    fp8-block cast whose intermediate size per rank is no multiple of 128 (sglang/srt/layers/quantization/fp8.py,
    Fp8MoEMethod.create_weights raises), and an nvfp4 cast that keeps FP8 block attention: its compressed-tensors
    matcher (compressed_tensors/utils.py, `find_matched_target`) tries the module's class against the NVFP4 group's
    `Linear` target before the fused q/k/v names, so qkv_proj gets NVFP4 parameters and loading the FP8 block
    weight_scale into them fails ("start (0) + length (128) exceeds dimension size (1)" on the 128-wide source).
    gpt-oss's stacked BF16 cast: its GptOssForCausalLM loader held transformers' own values (gpt_oss_bf16.py)."""
    layer, cast = output.layer, output.backend
    if cast == "fp8-block" and layer.intermediate_per_rank % CAST_BLOCK:
        return Serving(None, f"{NAME}'s block-FP8 MoE method (Fp8MoEMethod) wants the expert intermediate size per rank "
                             f"a multiple of {CAST_BLOCK}, not {layer.intermediate_per_rank}; --cast bf16 is served")
    if cast == "nvfp4" and (output.source_config or {}).get("format") == MIXED_PRECISION:
        instead = "--cast bf16" if layer.intermediate_per_rank % CAST_BLOCK else "--cast fp8-block or bf16"
        return Serving(None, f"{NAME}'s compressed-tensors matcher tries the module class before the fused q/k/v names, "
                             f"so a fused qkv_proj takes the NVFP4 group's `Linear` target instead of the FP8-block group "
                             f"this cast keeps, and loading the FP8 block weight_scale into its NVFP4 parameters fails; "
                             f"{instead} is served, or serve this one with vLLM")
    if layer.stacked_rows is not None:  # gpt-oss's stacked BF16 form (tests/engines/gpt_oss_bf16.py)
        return Serving(f"{NAME} (its GptOssForCausalLM loader, {CAST_METHODS[cast]}, held transformers' own values in "
                       f"every expert parameter on the CPU path; no GPU run yet)", launch(layer))
    served = Serving(f"{NAME} ({CAST_METHODS[cast]} for the experts: its loader took every tensor of MXFP4 sources' "
                     f"casts, 128-wide, on the CPU path; no GPU run yet)", launch(layer))
    return _shown_for(served, output)


def answer(output: Output) -> Serving:
    """Which path serves the backend's output of this source, and how; engine None: why not, and the backend
    that SGLang does serve for it. Families its loader was not run on here get the command with that said."""
    layer, backend = output.layer, output.backend
    dense = dense_mlp_layers(output)
    if dense:
        return Serving(None, f"{NAME} builds every layer of {output.model_type} as MoE, ignoring its dense MLP layers "
                             f"({dense}): their tensors would load into nothing, from the source as from any output; "
                             f"serve it with vLLM")
    if backend in CAST_METHODS:
        return casts(output)
    mixtral, deepseek = output.model_type == "mixtral", output.model_type in DEEPSEEK
    int8 = layer.activation_bits == 8
    if backend == "cpu":
        instead = PLUGIN if not mixtral else "compressed-tensors" if layer.symmetric else "humming"
        return Serving(None, f"no engine loads this layout from disk yet; for SGLang use --backend {instead}")
    if deepseek and output.attention_quantized and not (backend == "humming" and layer.symmetric) and not int8:
        return Serving(None, f"{NAME}'s DeepSeek loader takes float, FP8 or AWQ attention only, and this source's "
                             "attention is quantized"
                             + ("; for SGLang use --backend humming" if layer.symmetric else ""))
    if backend == "triton":
        if layer.float_scheme is not None:
            return Serving(None, f"moeconv's SGLang plugin does not serve the {layer.float_scheme.name} stacked layout "
                                 "(it fills SGLang's MoeWNA16Method, which holds integer codes); for SGLang use "
                                 "--backend compressed-tensors")
        if int8:
            return Serving(None, "moeconv's SGLang plugin does not serve the int8 layout; for SGLang use --backend "
                                 "compressed-tensors, served with --quantization w8a8_int8")
        if is_channelwise(layer.group_size):
            return Serving(None, "moeconv's SGLang plugin does not serve channel-wise scales; for SGLang use "
                                 "--backend compressed-tensors")
        if mixtral:
            return Serving(None, f"{NAME} builds Mixtral's experts one linear each under this quantization; for "
                                 "SGLang use --backend " + ("compressed-tensors" if layer.symmetric else "humming"))
        reason = output.dense_refusal  # the plugin hands the copied dense layers to SGLang's own methods
        if reason:
            return Serving(None, f"{reason}; for SGLang use --backend compressed-tensors" if layer.symmetric
                           else f"{reason}, not shown to load in {NAME}")
        served = Serving(f"{NAME} through moeconv's plugin", "install moeconv into SGLang's environment ("
                                                              "docs/SERVING.md; it registers the plugin), then " + launch(layer))
    elif backend == "compressed-tensors":
        if layer.float_scheme is not None:
            return float_codes(output)
        if int8:
            served = Serving(NAME, launch(layer, " --quantization w8a8_int8"))
        elif not layer.symmetric:
            return Serving(None, f"{NAME} refuses the expert zero points of every asymmetric compressed-tensors "
                                 "checkpoint (sgl-project/sglang PR #39510); for SGLang use --backend "
                                 + ("humming" if mixtral else PLUGIN))
        else:
            served = Serving(NAME, launch(layer))
    elif backend == "humming":
        if layer.float_scheme is not None:  # MXFP4 only: the plan refuses NVFP4 into Humming with a W4A4 input scale
            if layer.float_scheme.name != "mxfp4":
                return Serving(None, f"{NAME}'s loader was not run on Humming's NVFP4 schema (moeconv wrote no fixture's "
                                     f"NVFP4 into it exactly: tests/engines/run_matrix_sglang.py --only float); for "
                                     f"SGLang use --backend compressed-tensors")
            return _shown_for(Serving(f"{NAME} (quant_method humming, HummingMoEMethod: its loader held the file's bytes "
                                      f"in every expert parameter of the MXFP4 fixture's output on the CPU path; no GPU "
                                      f"run yet)", launch(layer)), output)
        if not layer.symmetric and not mixtral:
            return Serving(None, f"{NAME}'s loader refuses the expert zero_point of an asymmetric Humming "
                                 f"checkpoint; for SGLang use --backend {PLUGIN}")
        served = Serving(f"{NAME} (quant_method humming)", launch(layer))
    else:
        return Serving(None, f"not shown with {NAME}")
    if output.model_type not in SHOWN_FAMILIES:
        return served._replace(engine=f"{served.engine}, not shown for {output.model_type}")
    return served


RELEASE = EngineRelease("SGLang", VERSION, answer, CASTS_SCALES_OF)
