"""The `moeconv` quantization method for vLLM (imported only by `moeconv.vllm_plugin.register`).

Built for vLLM 0.33 (`vllm/model_executor/layers/quantization/moe_wna16.py` and
`fused_moe/oracle/int_wna16.py` are the code it stands on): its MoE method is vLLM's `MoeWNA16Method`
with the Triton backend chosen, parameters created as moeconv wrote them, a loader that copies each
stacked tensor whole (or this rank's part), and no repack after loading. Everything it cannot serve
is refused when the config is read or the layer is created, with the reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import vllm
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.model_executor.layers.fused_moe import FusedMoeWeightScaleSupported, RoutedExperts
from vllm.model_executor.layers.quantization import get_quantization_config
from compressed_tensors.quantization import QuantizationArgs
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w8a8_int8 import (  # noqa: E501
    CompressedTensorsW8A8Int8MoEMethod,
)
from vllm.model_executor.layers.quantization.moe_wna16 import MoeWNA16Method
from vllm.model_executor.utils import set_weight_attrs

from moeconv.backends.triton import TritonBackend
from moeconv.canonical import MoELayerShape, is_channelwise
from moeconv.spec import TORCH_DTYPES
from moeconv.vllm_plugin import QUANT_METHOD
from moeconv.vllm_plugin.shards import SPLITS, rank_part

ENGINE_VERSIONS = ("0.33.",)  # the vLLM releases whose moe_wna16 code this method was built against
STACKED = tuple(SPLITS)  # every stacked tensor name of the triton layout (both variants)
INT8_LAYOUT = "int8_w8a8"


def _refuse(why: str) -> ValueError:
    return ValueError(f"moeconv: {why}")


class MoeconvConfig(QuantizationConfig):
    """A moeconv `triton` output's `quantization_config`: the stacked expert layout (bits, group size,
    zero points, layout version) and the source's own config, which the dense layers keep."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        if not vllm.__version__.startswith(ENGINE_VERSIONS):
            raise _refuse(f"this plugin was built for vLLM {', '.join(v + 'x' for v in ENGINE_VERSIONS)}, "
                          f"not {vllm.__version__}; reconvert or upgrade moeconv")
        backend = config.get("backend")
        if backend != TritonBackend.name:
            raise _refuse(f"backend {backend!r} outputs are not served by this plugin yet (only 'triton')")
        if config.get("layout_version") != TritonBackend.layout_version:
            raise _refuse(f"layout version {config.get('layout_version')!r}; this plugin reads triton layout "
                          f"v{TritonBackend.layout_version} (reconvert with this moeconv)")
        self.layout = config.get("layout")
        if self.layout not in ("moe_wna16", INT8_LAYOUT):
            raise _refuse(f"triton layout {self.layout!r} is not one this plugin knows (moe_wna16, {INT8_LAYOUT})")
        self.weight_bits = int(config["bits"])
        self.group_size = int(config["group_size"])
        self.has_zp = bool(config["has_zp"])
        if self.layout == INT8_LAYOUT:
            self.scale_dtype = torch.float32  # the int8 layout's per-channel scales
        else:
            if is_channelwise(self.group_size):
                raise _refuse("channel-wise moe_wna16 scales are not served by this plugin yet")
            if config.get("scale_dtype") not in TORCH_DTYPES:
                raise _refuse("the config names no scale_dtype (an output of an older moeconv): reconvert")
            self.scale_dtype = TORCH_DTYPES[config["scale_dtype"]]
        self.bit8_pack_factor = 8 // self.weight_bits
        self.linear_quant_method = "gptq"  # MoeWNA16Method's branches: the stacked tensors are already N-first
        self.dense = _dense_config(config["source_quantization_config"])

    @classmethod
    def get_name(cls) -> str:
        return QUANT_METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.half]

    @classmethod
    def get_min_capability(cls) -> int:
        return 70  # the Triton kernel's; the dense method checks its own

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # config.json's quantization_config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MoeconvConfig:
        return cls(config)

    # What vLLM asks a config about the checkpoint's dense modules is the dense config's to answer.
    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: str | None = None) -> None:
        self.dense.maybe_update_config(model_name, hf_config=hf_config, revision=revision)

    def apply_vllm_mapper(self, hf_to_vllm_mapper: Any) -> None:
        self.dense.apply_vllm_mapper(hf_to_vllm_mapper)

    def get_checkpoint_weight_mapper(self) -> Any:
        return self.dense.get_checkpoint_weight_mapper()

    def get_cache_scale_mapper(self) -> Any:
        return self.dense.get_cache_scale_mapper()

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, RoutedExperts):
            if self.layout == INT8_LAYOUT:
                return StackedInt8ExpertsMethod(self, layer.moe_config)
            return StackedExpertsMethod(self, layer.moe_config)
        # The dense config is rebuilt from the raw dict: it needs the model's fused-module names.
        self.dense.packed_modules_mapping = self.packed_modules_mapping
        return self.dense.get_quant_method(layer, prefix)


def _dense_config(source: dict[str, Any]) -> QuantizationConfig:
    """The source's own quantization config, for the linears moeconv copied unchanged. Act-order flags
    (GPTQ's desc_act, compressed-tensors' actorder) are cleared: moeconv copies a dense linear only when
    its g_idx is k // g (plan.check_dense_g_idx), and an act-order down projection of the experts was
    folded into static groups."""
    method = source.get("quant_method")
    if method == "gptq":
        dynamic = {pattern: {k: v for k, v in override.items() if k != "desc_act"}
                   for pattern, override in (source.get("dynamic") or {}).items()}
        source = {**source, "desc_act": False, "dynamic": {p: o for p, o in dynamic.items() if o or p.startswith("-:")}}
    if method == "compressed-tensors":  # actorder "group" likewise: only trivial weight_g_idx are copied
        source = {**source, "config_groups": {
            name: {**group, "weights": {**group["weights"], "actorder": None}}
            if isinstance(group, dict) and isinstance(group.get("weights"), dict) else group
            for name, group in (source.get("config_groups") or {}).items()}}
    try:
        return get_quantization_config(method).from_config(source)
    except (ValueError, KeyError) as error:
        raise _refuse(f"the dense layers keep the source's {method!r} quantization, which vLLM "
                      f"{vllm.__version__} refuses ({str(error).splitlines()[0]}); convert with "
                      f"--backend compressed-tensors instead") from None


class StackedExpertsMethod(MoeWNA16Method):
    """vLLM's moe_wna16 method on moeconv's stacked tensors: Triton experts, one copy per tensor."""

    supports_pre_processed_weights = True  # the file holds the kernel's layout: nothing to transform

    def __init__(self, quant_config: MoeconvConfig, moe) -> None:
        # The layout is moe_wna16's: its Triton experts, whatever backend vLLM would pick for a checkpoint.
        super().__init__(quant_config, dataclasses.replace(moe, moe_backend="triton"))

    def create_weights(self, layer: RoutedExperts, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        layer.group_size = self.quant_config.group_size
        layer.group_size_div_factor = 1
        _create_stacked(self, layer, num_experts, hidden_size, intermediate_size_per_partition, extra_weight_attrs)

    def process_weights_after_loading(self, layer: RoutedExperts) -> None:
        """Nothing to repack: the parameters are the kernel's tensors as loaded."""
        layer.w13_weight = layer.w13_qweight
        layer.w2_weight = layer.w2_qweight
        self._setup_kernel(layer)


class StackedInt8ExpertsMethod(CompressedTensorsW8A8Int8MoEMethod):
    """vLLM's compressed-tensors W8A8 int8 MoE method (int8 weights, one fp32 scale per channel,
    dynamic per-token int8 activations) with its Triton experts, on moeconv's stacked int8 tensors:
    one copy per tensor. Its post-load step for the Triton backend only builds the kernel."""

    supports_pre_processed_weights = True

    def __init__(self, quant_config: MoeconvConfig, moe) -> None:
        weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
        tokens = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
        super().__init__(weights, tokens, dataclasses.replace(moe, moe_backend="triton"))
        self.quant_config = quant_config

    def create_weights(self, layer: RoutedExperts, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        layer.w13_input_scale = None  # dynamic per-token activations
        layer.w2_input_scale = None
        _create_stacked(self, layer, num_experts, hidden_size, intermediate_size_per_partition, extra_weight_attrs)


def _create_stacked(method, layer: RoutedExperts, num_experts: int, hidden_size: int, intermediate_per_rank: int,
                    extra_weight_attrs: dict[str, Any]) -> None:
    """The layer's parameters exactly as the triton backend lays them out (this rank's part of each),
    each with a loader that copies the stored tensor; refused with the reason when the layer cannot
    be split over this tensor-parallel size (the check `convert --tp` makes)."""
    config: MoeconvConfig = method.quant_config
    tp_size = method.moe.tp_size
    int8 = config.layout == INT8_LAYOUT
    shape = MoELayerShape(experts=num_experts, hidden=hidden_size, intermediate=intermediate_per_rank * tp_size,
                          bits=config.weight_bits, group_size=config.group_size, symmetric=not config.has_zp,
                          scale_dtype=_dtype_name(config.scale_dtype), activation_bits=8 if int8 else 16, tp=tp_size)
    backend = TritonBackend()
    reason = backend.refusal(shape)
    if reason:
        raise _refuse(f"{layer.layer_name}: {reason} (convert with --tp {tp_size} to check, or --regroup)")
    layer.quant_config = config
    rank = get_tensor_model_parallel_rank() if tp_size > 1 else 0
    strategy = FusedMoeWeightScaleSupported.CHANNEL if int8 else FusedMoeWeightScaleSupported.GROUP
    for spec in backend.layer_tensors(shape):
        full = torch.empty(spec.shape, dtype=TORCH_DTYPES[spec.dtype], device="meta")
        per_rank = rank_part(spec.name, full, shape.intermediate, config.weight_bits, config.group_size, tp_size, rank)
        parameter = torch.nn.Parameter(torch.empty(per_rank.shape, dtype=full.dtype), requires_grad=False)
        layer.register_parameter(spec.name, parameter)
        set_weight_attrs(parameter, {**extra_weight_attrs, "quant_method": strategy.value, "is_transposed": False,
                                     "weight_loader": _whole_tensor_loader(layer, spec.name, shape, tp_size, rank)})


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in TORCH_DTYPES.items() if value == dtype)


def _whole_tensor_loader(layer: RoutedExperts, name: str, shape: MoELayerShape, tp_size: int, rank: int):
    """Copies a stacked tensor from the file into its parameter: one copy, of this rank's part."""
    config: MoeconvConfig = layer.quant_config

    def load(param: torch.nn.Parameter, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
        part = rank_part(name, loaded_weight, shape.intermediate, config.weight_bits, config.group_size, tp_size, rank)
        if part.shape != param.shape or part.dtype != param.dtype:
            raise _refuse(f"{layer.layer_name}.{name}: the file holds {loaded_weight.dtype}{list(loaded_weight.shape)}, "
                          f"this layer expects {param.dtype}{list(param.shape)} on rank {rank} of {tp_size}")
        param.data.copy_(part)
        return True

    return load


def route_stacked_tensors() -> None:
    """Model classes map checkpoint names to parameters in their own `load_weights` (per-expert and
    fused expert names; DeepSeek's looks every other name up in its parameter dict, where the experts'
    parameters sit one module deeper, under `routed_experts`). The stacked names are the layers' own
    `<layer_name>.<tensor>`, so vLLM's default loader is wrapped to hand those straight to the
    parameters' loaders and everything else to the model, unchanged. Idempotent."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    original = DefaultModelLoader.load_weights
    if getattr(original, "routes_moeconv_tensors", False):
        return

    def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
        stacked = {}  # every name a checkpoint may give a stacked tensor: the module's path (MiniMax's
        # `block_sparse_moe.experts`, whose layer_name says mlp) and its layer_name
        for path, module in model.named_modules():
            if isinstance(getattr(module, "quant_method", None), (StackedExpertsMethod, StackedInt8ExpertsMethod)):
                for name, parameter in module.named_parameters(recurse=False):
                    if name in STACKED:
                        for owner in (path.removesuffix(".routed_experts"), module.layer_name):
                            stacked[f"{owner}.{name}"] = parameter
        if not stacked:
            return original(self, model, model_config)
        by_model = model.load_weights
        mapper = getattr(model, "hf_to_vllm_mapper", None)  # checkpoint names -> the model's (MiniMax: mlp)

        def routed(weights):
            loaded = set()

            def others():
                for name, tensor in weights:
                    parameter = stacked.get(name) if name.rsplit(".", 1)[-1] in STACKED else None
                    if parameter is None and mapper is not None and name.rsplit(".", 1)[-1] in STACKED:
                        parameter = stacked.get(mapper.map_name(name) or "")
                    if parameter is None:
                        yield name, tensor
                    else:
                        parameter.weight_loader(parameter, tensor)
                        loaded.add(name)

            result = by_model(others())
            return None if result is None else set(result) | loaded

        model.load_weights = routed  # for this call only: the instance attribute shadows the class's
        try:
            return original(self, model, model_config)
        finally:
            del model.load_weights

    load_weights.routes_moeconv_tensors = True
    DefaultModelLoader.load_weights = load_weights
