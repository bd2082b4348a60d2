"""The `moeconv` quantization method for SGLang (ENGINE_VERSION; imported only by
`moeconv.engines.sglang_plugin.register`).

A MoE layer of a `triton` output is served by SGLang's own `MoeWNA16Method` (`layers/quantization/
moe_wna16.py`), whose parameters are the stacked tensors under the same names and byte layout, TRUE zero
points included (SGLang's own GPTQ loader adds 1 to reach them): each parameter gets a weight loader that
copies this rank's part of the stacked tensor in one copy (shards.fill) after checking its dtype and shape,
and counts it; `process_weights_after_loading` refuses, naming it, any stacked parameter no tensor filled
(SGLang's model loaders skip a name that matches no parameter without a word). `MoeWNA16Method` has no
post-load repack: SGLang's Triton MoE runner reads the parameters as filled. The dense layers get the
method SGLang builds for the source's own config (`gptq` resolved to `gptq_marlin`, `awq` to `awq_marlin`,
as SGLang's ModelConfig resolves them), or for the compressed-tensors config moeconv wrote an asymmetric
GPTQ source's dense linears in.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Any

import torch
from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
from sglang.srt.layers.parameter import BasevLLMParameter
from sglang.srt.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
from sglang.srt.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from sglang.srt.layers.quantization.moe_wna16 import MoeWNA16Config, MoeWNA16Method
from sglang.srt.model_loader.weight_utils import default_weight_loader

from moeconv.backends.triton import TritonBackend
from moeconv.backends.triton_config import QUANT_METHOD, PluginRefusal, StackedLayout, check_files
from moeconv.canonical import MoELayerShape
from moeconv.checkpoint.reader import open_checkpoint
from moeconv.errors import MoeconvError
from moeconv.load_ledger import KV_CACHE_SCALES, LoadLedger, skipped_by_design
from moeconv.engines.sglang_plugin import ENGINE_VERSION, installed_sglang
from moeconv.engines.sglang_plugin.config import parse_for_sglang
from moeconv.engines.sglang_plugin.shards import fill
from moeconv.spec import TORCH_DTYPES

logger = logging.getLogger("sglang.moeconv")
PER_EXPERT = re.compile(r"\.experts\.\d+\.")  # a module of one expert (`...experts.3.w1`)


class MoeconvConfig(QuantizationConfig):
    """A moeconv `triton` output's `quantization_config`: the stacked expert layout, parsed strictly, and
    the dense layers' own config."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        if installed_sglang() != ENGINE_VERSION:
            raise PluginRefusal(f"this plugin was built for SGLang {ENGINE_VERSION}, not {installed_sglang()}")
        if sys.byteorder != "little":
            raise PluginRefusal("the stacked layouts are served on little-endian hosts only")
        self.stacked = parse_for_sglang(config)
        _check_local_files(self.stacked, config)
        self.dense = _dense_config(self.stacked.dense or self.stacked.source, config)
        has_zp = self.stacked.has_zp
        # SGLang's own MoeWNA16 config, which MoeWNA16Method reads its sizes and zero-point flag from; its
        # GPTQ flavour only decides which loader SGLang would wrap the parameters with (replaced here).
        self.wna16 = MoeWNA16Config("gptq", self.stacked.bits, self.stacked.group_size, has_zp, False, [],
                                    {"quant_method": "gptq", "bits": self.stacked.bits, "desc_act": False,
                                     "group_size": self.stacked.group_size, "sym": not has_zp})
        self.written: dict[str, dict[str, int]] = {}  # layer -> stacked tensor -> bytes copied (last pass)

    @classmethod
    def get_name(cls) -> str:
        return QUANT_METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.half]

    @classmethod
    def get_min_capability(cls) -> int:
        return MoeWNA16Config.get_min_capability()

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # config.json's quantization_config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MoeconvConfig:
        return cls(config)

    def update_packed_modules_mapping(self, mapping: dict[str, list[str]]) -> None:
        super().update_packed_modules_mapping(mapping)
        self.dense.update_packed_modules_mapping(mapping)

    def get_scaled_act_names(self) -> list[str]:
        return self.dense.get_scaled_act_names()

    def can_fuse_shared_expert(self) -> bool:
        """No: the stacked tensors hold the routed experts only, and the shared experts stay dense linears.
        SGLang's DeepSeek model asks this before it would fuse the shared expert into the MoE layer as one
        more expert (`models/deepseek_common/utils.py :: quant_blocks_shared_experts_fusion`; by default for
        256 routed experts, DeepSeek-V3's count), which no stacked tensor could fill."""
        return False

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, FusedMoE):
            return StackedMoeWNA16Method(self, prefix)
        if PER_EXPERT.search(prefix):
            # SGLang builds this model's experts one linear each (no FusedMoE), so no stacked tensor has a
            # parameter and the model's loader would skip them without a word.
            raise PluginRefusal(f"{prefix}: SGLang {ENGINE_VERSION} builds this model's experts as one linear each "
                                f"(Mixtral under any quantization not in its own list: model_loader/utils.py :: "
                                f"get_model_architecture, QuantMixtralForCausalLM), which no stacked tensor fills; "
                                f"convert with --backend compressed-tensors (symmetric sources) or humming")
        return self.dense.get_quant_method(layer, prefix)


def _check_local_files(stacked: StackedLayout, config: dict[str, Any]) -> None:
    """The config against the output's headers (config.check_files), when SGLang serves a local folder: the
    model's hf_config, which SGLang's get_quant_config adds to the dict, carries its path (a Hub id is
    downloaded later; then the load's ledger is the bound)."""
    hf_config = config.get("hf_config")
    root = Path(hf_config.name_or_path) if hf_config is not None else None
    if root is None or not root.is_dir():
        return
    try:
        checkpoint = open_checkpoint(root)
    except MoeconvError as error:
        raise PluginRefusal(str(error)) from None
    check_files(stacked, checkpoint)


def _dense_config(source: dict[str, Any], config: dict[str, Any]) -> QuantizationConfig:
    """SGLang's config for the dense linears. Act-order flags are cleared as the vLLM plugin clears them
    (moeconv copies a dense linear only when its g_idx is k // g)."""
    method = source["quant_method"]
    if method == "gptq":
        source = {**source, "desc_act": False}
    if method == "compressed-tensors" and isinstance(source.get("config_groups"), dict):
        source = {**source, "config_groups": {
            name: {**group, "weights": {**group["weights"], "actorder": None}}
            if isinstance(group, dict) and isinstance(group.get("weights"), dict) else group
            for name, group in source["config_groups"].items()}}
    # what SGLang's get_quant_config adds to the config it hands a method
    source = {**source, **{key: config[key] for key in ("packed_modules_mapping", "hf_config") if key in config}}
    resolved = method
    for name, candidate in QUANTIZATION_METHODS.items():  # as SGLang's ModelConfig resolves a checkpoint's method
        claimed = None if name == QUANT_METHOD else candidate.override_quantization_method(source, None)
        if claimed:
            resolved = claimed
            break
    try:
        return get_quantization_config(resolved).from_config(source)
    except (ValueError, KeyError, TypeError, AttributeError, AssertionError, NotImplementedError) as error:
        first = (str(error).splitlines() or [type(error).__name__])[0]
        raise PluginRefusal(f"the dense layers keep {method!r} quantization, which SGLang {ENGINE_VERSION} refuses "
                            f"({first}); convert with --backend compressed-tensors instead") from None


class StackedMoeWNA16Method(MoeWNA16Method):
    """SGLang's MoeWNA16Method (its parameters, its Triton runner), filled from the stacked tensors."""

    def __init__(self, config: MoeconvConfig, prefix: str) -> None:
        super().__init__(config.wna16)
        self.moeconv_config, self.prefix = config, prefix
        self.specs: dict[str, Any] = {}

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        stacked: StackedLayout = self.moeconv_config.stacked
        if layer.moe_ep_size > 1 or num_experts != layer.num_experts:
            raise PluginRefusal(f"{self.prefix}: this rank holds {num_experts} of the layer's {layer.num_experts} "
                                f"experts (expert parallelism, or shared experts fused into the layer); the "
                                f"plugin fills whole stacked tensors only")
        tp, rank = layer.moe_tp_size, layer.moe_tp_rank
        shape = MoELayerShape(experts=num_experts, hidden=hidden_size, intermediate=intermediate_size_per_partition * tp,
                              bits=stacked.bits, group_size=stacked.group_size, symmetric=not stacked.has_zp,
                              scale_dtype=stacked.scale_dtype, tp=tp)
        reason = TritonBackend().refusal(shape)
        if reason:
            raise PluginRefusal(f"{self.prefix}: {reason} (convert with --tp {tp} to check, or --regroup)")
        super().create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                               **extra_weight_attrs)
        self.specs = {spec.name: spec for spec in TritonBackend().layer_tensors(shape)}
        written = self.moeconv_config.written.setdefault(self.prefix, {})
        for name, spec in self.specs.items():
            getattr(layer, name).weight_loader = self._loader(name, spec, shape, rank, written)

    def _loader(self, name: str, spec, shape: MoELayerShape, rank: int, written: dict[str, int]):
        stacked: StackedLayout = self.moeconv_config.stacked
        where = f"{self.prefix}.{name}"

        def load(param: torch.nn.Parameter, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            if args or kwargs:  # a model loader's per-expert call (weight name, shard, expert id)
                raise PluginRefusal(f"{where}: handed one expert's tensor ({args[:1]}); a moeconv triton output "
                                    f"stores each MoE layer's experts stacked")
            expected = TORCH_DTYPES[spec.dtype]
            if tuple(loaded_weight.shape) != tuple(spec.shape) or loaded_weight.dtype != expected:
                raise PluginRefusal(f"{where}: the file holds {loaded_weight.dtype}{list(loaded_weight.shape)}, this "
                                    f"layer expects {expected}{list(spec.shape)}")
            try:
                fill(name, loaded_weight, param.data, shape.intermediate, stacked.bits, stacked.group_size, shape.tp,
                     rank)
            except ValueError as error:
                raise PluginRefusal(f"{where}: {error} (rank {rank} of {shape.tp})") from None
            written[name] = param.data.numel() * param.data.element_size()

        return load

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        written = self.moeconv_config.written.get(self.prefix, {})
        missing = [name for name in self.specs if name not in written]
        if missing:
            raise PluginRefusal(f"{self.prefix}.{missing[0]}: no tensor of the checkpoint filled it "
                                f"({len(missing)} of the layer's {len(self.specs)} stacked parameters unfilled); "
                                f"the output is incomplete or its names are not this model's")
        logger.debug("moeconv: %s: %d stacked tensors, %d bytes copied", self.prefix, len(written), sum(written.values()))
        super().process_weights_after_loading(layer)


def check_loads() -> None:
    """SGLang's `DefaultModelLoader.load_weights_only` (every safetensors load of its default loader runs
    the model's `load_weights` there) wrapped: for a model with the plugin's MoE layers, the load's ledger
    (moeconv/load_ledger.py) refuses, in one line, any tensor of the output no parameter took and any
    parameter no tensor wrote, in every layer: SGLang's model loaders skip both without a word. Idempotent."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    original = DefaultModelLoader.load_weights_only
    if getattr(original, "checks_moeconv_loads", False):
        return

    def load_weights_only(model: torch.nn.Module, weights, target_device) -> None:
        methods = (getattr(module, "quant_method", None) for module in model.modules())
        if not any(isinstance(method, StackedMoeWNA16Method) for method in methods):
            return original(model, weights, target_device)
        skipped = skipped_by_design(model.config.get_text_config().num_hidden_layers, model.config.tie_word_embeddings)
        with LoadLedger(model, _loader_of, _set_loader, optional_parameters=KV_CACHE_SCALES, skipped=skipped) as ledger:
            original(model, ledger.weights(weights), target_device)
        refusal = ledger.refusal()
        if refusal:
            raise PluginRefusal(refusal)

    load_weights_only.checks_moeconv_loads = True
    DefaultModelLoader.load_weights_only = staticmethod(load_weights_only)


def _loader_of(parameter: torch.nn.Parameter):
    """The weight loader SGLang's model loaders call for a parameter (theirs default to default_weight_loader)."""
    return getattr(parameter, "weight_loader", default_weight_loader)


def _set_loader(parameter: torch.nn.Parameter, loader) -> None:
    if isinstance(parameter, BasevLLMParameter):  # its weight_loader is a read-only property
        parameter._weight_loader = loader
    else:
        parameter.weight_loader = loader
