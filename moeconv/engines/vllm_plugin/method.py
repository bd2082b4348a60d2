"""The `moeconv` quantization method for vLLM (imported only by `moeconv.engines.vllm_plugin.register`).

Built for the vLLM release engines/ names (ENGINE_VERSION). A MoE layer of a `triton` output is served by
the method vLLM itself builds for the `compressed-tensors` output of the same source
(`CompressedTensorsWNA16MoEMethod`, or the W8A8 int8 one), because its parameters are N-first like the stacked tensors: each stacked tensor fills its
parameter with one copy of this rank's part (`shards.fill`), no per-expert tensor, no per-expert Python.
That method's `__init__` asks vLLM's own MoE oracle which backend serves the layer on this machine
(`fused_moe/oracle/int_wna16.py`, `oracle/int8.py`: Humming on compute capability 9.0, Marlin or
FlashInfer elsewhere, Triton when nothing better takes it, vLLM's CPU experts on a CPU build; `--moe-backend`
overrides it), and its own `process_weights_after_loading` then repacks for that backend, unchanged.
A MoE layer of a float layout (MXFP4, NVFP4) likewise gets vLLM's compressed-tensors MXFP4 / NVFP4 MoE method
(`CompressedTensorsW4A4Mxfp4MoEMethod`: Marlin on SM90, CUTLASS where it runs; `CompressedTensorsW4A4Nvfp4MoEMethod`,
whose `__init__` runs `oracle/nvfp4.py`), its parameters filled by one copy each, its own repack after.
The chosen backend is logged once per layer kind with the oracle's reason. The dense layers load
through the source's own quantization method, which the config records.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import vllm
from compressed_tensors.quantization import QuantizationArgs
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.fused_moe.oracle import int_wna16
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w4a4_mxfp4 import (  # noqa: E501
    CompressedTensorsW4A4Mxfp4MoEMethod,
)
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w4a4_nvfp4 import (  # noqa: E501
    CompressedTensorsW4A4Nvfp4MoEMethod,
)
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w8a8_int8 import (  # noqa: E501
    CompressedTensorsW8A8Int8MoEMethod,
)
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_wna16 import (  # noqa: E501
    CompressedTensorsWNA16MoEMethod,
)

from moeconv.backends.compressed_tensors import CompressedTensorsBackend
from moeconv.backends.triton import FLOAT, GEMM_OF, WNA16, TritonBackend
from moeconv.backends.triton_config import (FLOAT_LAYOUTS, INT8_LAYOUT, QUANT_METHOD, PluginRefusal, StackedLayout,
                                            check_files, parse)
from moeconv.canonical import MoELayerShape
from moeconv.checkpoint.reader import open_checkpoint
from moeconv.engines import VLLM
from moeconv.errors import MoeconvError
from moeconv.load_ledger import KV_CACHE_SCALES, LoadLedger, skipped_by_design
from moeconv.spec import TORCH_DTYPES
from moeconv.engines.vllm_plugin import integrity
from moeconv.engines.vllm_plugin.shards import PARAMETERS, fill

ENGINE_VERSION = VLLM.version  # the vLLM release whose MoE methods and oracle this plugin was built against
STACKED = tuple(PARAMETERS)  # every stacked tensor name of the triton layout (both variants)

LOGGER_NAME = "vllm.moeconv"  # under vLLM's logger: its handler, format and VLLM_LOGGING_LEVEL
logger = init_logger(LOGGER_NAME)


class MoeconvConfig(QuantizationConfig):
    """A moeconv `triton` output's `quantization_config`: the stacked expert layout (config.py parses it
    strictly) and the source's own config, which the dense layers keep."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        if not vllm.__version__.startswith(f"{ENGINE_VERSION}."):
            raise PluginRefusal(f"this plugin was built for vLLM {ENGINE_VERSION}.x, "
                                f"not {vllm.__version__}; reconvert or upgrade moeconv")
        if sys.byteorder != "little":  # the int32 parameters are filled byte for byte, as vLLM's own views assume
            raise PluginRefusal("the stacked layouts are served on little-endian hosts only")
        self.stacked = parse(config)
        self.dense = _dense_config(self.stacked.dense or self.stacked.source)
        self._stored: dict[str, dict[str, tuple[str, tuple[int, ...], Path]]] | None = None
        self.verify_on_load = integrity.requested()
        self._digests: integrity.TensorDigests | None = None

    @classmethod
    def get_name(cls) -> str:
        return QUANT_METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.half]

    @classmethod
    def get_min_capability(cls) -> int:
        return 70  # the lowest of the MoE backends'; the oracle and the dense method check their own

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
        # The files against the config before the first layer's method is built, dense or MoE (read once): a
        # model's attention comes before its first MoE layer, and a dense method may refuse what the files
        # hold in its own words first (vLLM's GPTQ, DeepSeek-V3's FP8 block attention: "some but not all
        # shards of ...fused_qkv_a_proj are quantized"), where check_files says what is wrong in one line.
        self.stored_tensors()
        if isinstance(layer, RoutedExperts):
            return _experts_method(self, layer, prefix)
        # The dense config is rebuilt from the raw dict: it needs the model's fused-module names.
        self.dense.packed_modules_mapping = self.packed_modules_mapping
        return self.dense.get_quant_method(layer, prefix)

    def stored_tensors(self) -> dict[str, dict[str, tuple[str, tuple[int, ...], Path]]] | None:
        """The output's stacked tensors (safetensors dtype, shape, file) by layer and name, from its
        headers, when vLLM serves it from a local folder (a Hub id is downloaded after the layers are
        built: then each loader's own shape check and the load's ledger are the bound); read once, strictly
        (moeconv.checkpoint), and held against the config (config.check_files)."""
        if self._stored is None:
            root = Path(str(get_current_vllm_config().model_config.model))
            if not root.is_dir():
                if self.verify_on_load:
                    raise PluginRefusal(f"{integrity.ENV}=1 checks a local output folder; {root} is not one")
                return None
            if self.verify_on_load:  # the manifest is read (and refused) before any parameter is allocated
                self._digests = integrity.TensorDigests(root)
            try:
                checkpoint = open_checkpoint(root)
            except MoeconvError as error:
                raise PluginRefusal(str(error)) from None
            check_files(self.stacked, checkpoint)  # the config against the headers: zero points, group size, bits
            self._stored = {}
            for name, entry in checkpoint.tensors.items():
                owner, _, leaf = name.rpartition(".")
                if leaf in PARAMETERS:
                    self._stored.setdefault(owner, {})[leaf] = (entry.dtype, entry.shape, entry.file)
        return self._stored

    def tensor_digests(self) -> integrity.TensorDigests | None:
        """With MOECONV_VERIFY_ON_LOAD=1: the manifest's digest of every tensor, which each tensor the
        loader hands over is checked against (route_stacked_tensors); else None."""
        if self.verify_on_load:
            self.stored_tensors()
        return self._digests


def _dense_config(source: dict[str, Any]) -> QuantizationConfig:
    """The dense linears' quantization config: the one moeconv wrote them in when it converted them
    (compressed-tensors, for an asymmetric GPTQ source), else the source's own, for the linears moeconv
    copied unchanged. Act-order flags
    (GPTQ's desc_act, compressed-tensors' actorder) are cleared: moeconv copies a dense linear only when
    its g_idx is k // g (plan.check_dense_g_idx), and an act-order down projection of the experts was
    folded into static groups."""
    method = source["quant_method"]
    if method == "gptq":
        dynamic = source.get("dynamic") or {}
        if not isinstance(dynamic, dict) or not all(isinstance(o, dict) for o in dynamic.values()):
            raise PluginRefusal("the source's GPTQ config has a malformed 'dynamic' section")
        dynamic = {pattern: {k: v for k, v in override.items() if k != "desc_act"} for pattern, override in dynamic.items()}
        source = {**source, "desc_act": False, "dynamic": {p: o for p, o in dynamic.items() if o or p.startswith("-:")}}
    if method == "compressed-tensors":  # actorder "group" likewise: only trivial weight_g_idx are copied
        groups = source.get("config_groups") or {}
        if not isinstance(groups, dict):
            raise PluginRefusal("the source's compressed-tensors config_groups is not an object")
        source = {**source, "config_groups": {
            name: {**group, "weights": {**group["weights"], "actorder": None}}
            if isinstance(group, dict) and isinstance(group.get("weights"), dict) else group
            for name, group in groups.items()}}
    try:
        return get_quantization_config(_vllm_method(method, source)).from_config(source)
    except (ValueError, KeyError, TypeError, AttributeError, AssertionError) as error:
        first = (str(error).splitlines() or [type(error).__name__])[0]
        raise PluginRefusal(f"the dense layers keep the source's {method!r} quantization, which vLLM "
                            f"{vllm.__version__} refuses ({first}); convert with --backend compressed-tensors "
                            f"instead") from None


def _vllm_method(method: str, source: dict[str, Any]) -> str:
    """The name vLLM serves the source's quant_method under. A producer's own name that vLLM does not
    register (AutoRound's 'auto-round') is claimed by one of vLLM's configs through its
    `override_quantization_method`, as vLLM's ModelConfig resolves it ('auto-round' -> 'inc')."""
    if method in QUANTIZATION_METHODS:
        return method
    for name in QUANTIZATION_METHODS:
        claimed = get_quantization_config(name).override_quantization_method(source, None, hf_config=None)
        if claimed is not None:
            return claimed
    return method


def _layer_shape(stacked: StackedLayout, experts: int, hidden: int, intermediate: int, tp: int) -> MoELayerShape:
    return MoELayerShape(experts=experts, hidden=hidden, intermediate=intermediate, bits=stacked.bits,
                         group_size=stacked.group_size, symmetric=not stacked.has_zp, scale_dtype=stacked.scale_dtype,
                         activation_bits=8 if stacked.layout == INT8_LAYOUT else 16, tp=tp,
                         float_scheme=stacked.float_scheme)


def _quantization_args(stacked: StackedLayout) -> tuple[QuantizationArgs, QuantizationArgs | None]:
    """The weight (and activation) scheme of the stacked layout, in the words of moeconv's own
    compressed-tensors backend: the config its output carries for the same layer."""
    shape = _layer_shape(stacked, 1, 1, 1, 1)  # (the scheme does not depend on the sizes)
    group = CompressedTensorsBackend().checkpoint_quantization_config(shape, None, [])["config_groups"]["group_0"]
    activations = group["input_activations"]
    return QuantizationArgs(**group["weights"]), None if activations is None else QuantizationArgs(**activations)


def _experts_method(config: MoeconvConfig, layer: RoutedExperts, prefix: str) -> QuantizeMethodBase:
    """vLLM's compressed-tensors MoE method for the layer, built as vLLM's compressed-tensors config
    builds it (`CompressedTensorsMoEMethod.get_moe_method`), whose `__init__` runs the oracle."""
    if config.stacked.layout in FLOAT_LAYOUTS:
        return _float_experts_method(config, layer, prefix)
    weights, activations = _quantization_args(config.stacked)
    try:
        if config.stacked.layout == INT8_LAYOUT:
            method = StackedInt8Method(config, weights, activations, layer.moe_config)
            backend, reason = method.int8_backend.value, _int8_reason(layer.moe_config)
        else:
            method = StackedWNA16Method(config, weights, layer.moe_config)
            backend, reason = method.wna16_backend.value, _wna16_reason(layer.moe_config, weights, method.wna16_backend)
    except AssertionError:  # CompressedTensorsWNA16MoEMethod asserts group scales for every backend but Marlin
        raise PluginRefusal(f"{prefix}: channel-wise scales are served by vLLM {vllm.__version__}'s Marlin MoE "
                            f"experts only, and vLLM's oracle picked another backend on this machine (pass "
                            f"--moe-backend marlin where Marlin runs)") from None
    except (ValueError, NotImplementedError) as error:  # the oracle: an override it refuses, or no backend
        raise PluginRefusal(f"{prefix}: vLLM's MoE oracle serves no backend for this layer: "
                            f"{(str(error).splitlines() or [''])[0]}") from None
    logger.info_once("moeconv: MoE layers on vLLM's %s backend (%s)", backend, reason, scope="local")
    return method


def _float_experts_method(config: MoeconvConfig, layer: RoutedExperts, prefix: str) -> QuantizeMethodBase:
    """vLLM's compressed-tensors MXFP4 or NVFP4 MoE method for the layer, built as vLLM's compressed-tensors config
    builds it for the same scheme (`CompressedTensorsMoEMethod.get_moe_method`: NVFP4A16 when no input scale)."""
    scheme = config.stacked.float_scheme
    try:
        if scheme.name == "mxfp4":
            method = StackedMxfp4Method(config, layer.moe_config)
            backend = method.mxfp4_backend.value
        else:
            method = StackedNvfp4Method(config, layer.moe_config, prefix, use_a16=not scheme.input_scale)
            backend = method.nvfp4_backend.value
    except (ValueError, NotImplementedError) as error:
        raise PluginRefusal(f"{prefix}: vLLM serves no {scheme.name} MoE backend for this layer here: "
                            f"{(str(error).splitlines() or [''])[0]}") from None
    logger.info_once("moeconv: %s MoE layers on vLLM's %s backend (vLLM's compressed-tensors %s MoE method's choice)",
                     scheme.name, backend, scheme.name, scope="local")
    return method


def _wna16_reason(moe, weights: QuantizationArgs, chosen) -> str:
    """Why the oracle chose `chosen`: the user's override, or the backends before it in vLLM's priority
    order for this platform and the reason each gave (the oracle's own functions, read back)."""
    if moe.moe_backend != "auto":
        return f"--moe-backend {moe.moe_backend}"
    skipped = []
    for backend in int_wna16._get_priority_backends():
        if backend == chosen:
            break
        why = int_wna16._backend_incompatibility_reason(backend, moe, weights, not weights.symmetric, False, True)
        skipped.append(f"{backend.value}: {why or 'its kernels do not support this device or layer'}")
    order = "the first of vLLM's WNA16 MoE priority order on this platform that takes the layer"
    return f"{order}; skipped {'; '.join(skipped)}" if skipped else order


def _int8_reason(moe) -> str:
    return f"--moe-backend {moe.moe_backend}" if moe.moe_backend != "auto" else "vLLM's Int8 MoE priority order"


class _StackedLoading:
    """What the two methods add to vLLM's: before the parameters exist, the layer is checked against
    the backend's own refusals and the files' headers (so nothing is allocated that the files do not
    hold); after, each parameter a stacked tensor fills gets a loader that copies this rank's part."""

    # Parameters vLLM's method creates that its kernels never read for this scheme, which no checkpoint of it
    # holds and stock vLLM leaves unloaded too (the load's ledger does not ask for them).
    unused_parameters: tuple[str, ...] = ()

    def _create_stacked(self, create, layer: RoutedExperts, num_experts: int, hidden_size: int,
                        intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        config: MoeconvConfig = self.moeconv_config
        tp_size = self.moe.tp_size  # the MoE layer's own split: tensor x data parallel ranks when no EP
        # Expert parallelism: this rank holds some of the experts (its `num_experts`), the files all of them.
        stored_experts = layer.global_num_experts if self.moe.use_ep else num_experts
        shape = _layer_shape(config.stacked, stored_experts, hidden_size, intermediate_size_per_partition * tp_size,
                             tp_size)
        for backend in (TritonBackend(), CompressedTensorsBackend()):  # the file's layout, then the method's packing
            reason = backend.refusal(shape)
            if reason:
                way_out = "" if shape.float_scheme is not None else ", or --regroup"  # a float block is the codes'
                raise PluginRefusal(f"{layer.layer_name}: {reason} (convert with --tp {tp_size} to check{way_out})")
        specs = {spec.name: spec for spec in TritonBackend().layer_tensors(shape)}
        _check_files(config, layer, specs)
        create(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra_weight_attrs)
        rank = self.moe.tp_rank if tp_size > 1 else 0  # the rank within that split, as vLLM's loaders use
        parameters = dict(layer.named_parameters(recurse=False))
        # compressed-tensors' (E, 2) weight_shape of the WNA16 method: [N, K] of every expert's projections,
        # filled with the GEMM's weights (the int8 method has none)
        shapes = {WNA16[gemm].qweight: f"{gemm}_weight_shape" for gemm in WNA16}
        self.stacked_parameters, self.companions = {}, {}
        for name, spec in specs.items():
            parameter = parameters[PARAMETERS[name]]
            companions = [(parameters[shapes[name]], _projection_shape(name, shape))] if shapes.get(name) in parameters else []
            parameter.weight_loader = _stacked_loader(layer, name, spec, shape, rank, companions)
            self.stacked_parameters[name] = parameter
            self.companions[id(parameter)] = [companion for companion, _ in companions]  # written by its loader


def _projection_shape(name: str, shape: MoELayerShape) -> torch.Tensor:
    """[N, K] of one projection of the GEMM, unsharded, as a compressed-tensors checkpoint's `weight_shape`
    (gate and up are each [I, H]; down is [H, I])."""
    n, k = (shape.intermediate, shape.hidden) if GEMM_OF[name] == "w13" else (shape.hidden, shape.intermediate)
    return torch.tensor([n, k], dtype=torch.int64)


def _check_files(config: MoeconvConfig, layer: RoutedExperts, specs: dict) -> None:
    stored = config.stored_tensors()
    if stored is None:
        return  # a Hub id: the loader checks each tensor's shape
    held = _held(stored, layer.layer_name)
    for name, spec in specs.items():
        if name not in held:
            raise PluginRefusal(f"{layer.layer_name}.{name}: the files hold no such tensor; the config says "
                                f"{spec.dtype}{list(spec.shape)} (reconvert)")
        dtype, shape, _ = held[name]
        if dtype != spec.dtype or tuple(shape) != tuple(spec.shape):
            raise PluginRefusal(f"{layer.layer_name}.{name}: the file holds {dtype}{list(shape)}, the config and the "
                                f"model's sizes say {spec.dtype}{list(spec.shape)}; reconvert")


def _held(stored: dict[str, dict], layer_name: str) -> dict:
    """The stacked tensors the files hold for a layer: under its layer_name, or under the one module of the
    same decoder layer the checkpoint names otherwise (MiniMax's `block_sparse_moe.experts`, whose layer_name
    says mlp)."""
    if layer_name in stored:
        return stored[layer_name]
    same = [owner for owner in stored if owner.rsplit(".", 2)[0] == layer_name.rsplit(".", 2)[0]]
    return stored[same[0]] if len(same) == 1 else {}


def _stacked_loader(layer: RoutedExperts, name: str, spec, shape: MoELayerShape, rank: int,
                    companions: list[tuple[torch.nn.Parameter, torch.Tensor]]):
    """Copies a stacked tensor from the file into its parameter: one copy, of this rank's part (and sets
    the companion parameters that follow from its shape)."""
    stacked: StackedLayout = layer.quant_method.moeconv_config.stacked

    def load(param: torch.nn.Parameter, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
        expected = TORCH_DTYPES[spec.dtype]
        if tuple(loaded_weight.shape) != tuple(spec.shape) or loaded_weight.dtype != expected:
            raise PluginRefusal(f"{layer.layer_name}.{name}: the file holds {loaded_weight.dtype}"
                                f"{list(loaded_weight.shape)}, this layer expects {expected}{list(spec.shape)}")
        try:
            fill(stacked.layout, name, loaded_weight, param.data, shape.intermediate, stacked.bits, stacked.group_size, shape.tp, rank,
                 _local_experts(layer))
        except ValueError as error:
            raise PluginRefusal(f"{layer.layer_name}.{name}: {error} (rank {rank} of {shape.tp})") from None
        for companion, value in companions:
            companion.data.copy_(value.expand(companion.shape))
        return True

    return load


def _local_experts(layer: RoutedExperts) -> torch.Tensor | None:
    """Under expert parallelism, the global index of the expert each of this rank's slots holds (vLLM's own
    expert map: global index -> local slot, -1 where another rank holds it); else None (all of them)."""
    if not layer.use_ep:
        return None
    expert_map = layer._expert_map.cpu()
    held = (expert_map >= 0).nonzero().squeeze(1)
    return held[expert_map[held].argsort()]


class StackedWNA16Method(_StackedLoading, CompressedTensorsWNA16MoEMethod):
    """vLLM's compressed-tensors WNA16 MoE method (the oracle's backend, its own post-load repack), its
    parameters filled from moeconv's stacked moe_wna16 tensors."""

    def __init__(self, config: MoeconvConfig, weights: QuantizationArgs, moe) -> None:
        super().__init__(weights, None, moe)
        self.moeconv_config = config

    def create_weights(self, layer: RoutedExperts, *args: Any, **kwargs: Any) -> None:
        self._create_stacked(super().create_weights, layer, *args, **kwargs)


class StackedInt8Method(_StackedLoading, CompressedTensorsW8A8Int8MoEMethod):
    """vLLM's compressed-tensors W8A8 int8 MoE method (int8 weights, one fp32 scale per channel, dynamic
    per-token int8 activations; the oracle's backend), its parameters filled from the int8 layout."""

    def __init__(self, config: MoeconvConfig, weights: QuantizationArgs, activations: QuantizationArgs, moe) -> None:
        super().__init__(weights, activations, moe)
        self.moeconv_config = config

    def create_weights(self, layer: RoutedExperts, *args: Any, **kwargs: Any) -> None:
        self._create_stacked(super().create_weights, layer, *args, **kwargs)


class StackedMxfp4Method(_StackedLoading, CompressedTensorsW4A4Mxfp4MoEMethod):
    """vLLM's compressed-tensors MXFP4 MoE method (its backend choice, its own post-load repack), its parameters
    filled from moeconv's stacked mxfp4 layout."""

    def __init__(self, config: MoeconvConfig, moe) -> None:
        super().__init__(moe)
        self.moeconv_config = config

    def create_weights(self, layer: RoutedExperts, *args: Any, **kwargs: Any) -> None:
        self._create_stacked(super().create_weights, layer, *args, **kwargs)


class StackedNvfp4Method(_StackedLoading, CompressedTensorsW4A4Nvfp4MoEMethod):
    """vLLM's compressed-tensors NVFP4 MoE method (W4A16 or W4A4; the oracle's backend, its own post-load repack),
    its parameters filled from moeconv's stacked nvfp4 layout."""

    def __init__(self, config: MoeconvConfig, moe, layer_name: str, use_a16: bool) -> None:
        super().__init__(moe, layer_name, use_a16=use_a16)
        self.moeconv_config = config
        # NVFP4A16: the method registers the input global scales all the same, and its W4A16 kernels take none
        # (llm-compressor's own NVFP4A16 checkpoints hold none; stock vLLM leaves them unloaded as well)
        if use_a16:
            self.unused_parameters = tuple(FLOAT[gemm].input_global_scale for gemm in FLOAT)

    def create_weights(self, layer: RoutedExperts, *args: Any, **kwargs: Any) -> None:
        self._create_stacked(super().create_weights, layer, *args, **kwargs)


STACKED_METHODS = (StackedWNA16Method, StackedInt8Method, StackedMxfp4Method, StackedNvfp4Method)


def route_stacked_tensors() -> None:
    """Model classes map checkpoint names to parameters in their own `load_weights` (per-expert and
    fused expert names; DeepSeek's looks every other name up in its parameter dict, where the experts'
    parameters sit one module deeper, under `routed_experts`). The stacked names are the layers' own
    `<layer_name>.<tensor>`, so vLLM's default loader is wrapped to hand those straight to the loaders
    of the parameters they fill and everything else to the model, unchanged. The whole load runs under the
    ledger (moeconv/load_ledger.py): a tensor of the output no parameter took, or a parameter of any layer
    (dense, FP8, attention) no tensor wrote, is one refusal once the model's loader returns (vLLM checks
    this itself only for unquantized models). Idempotent."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    original = DefaultModelLoader.load_weights
    if getattr(original, "routes_moeconv_tensors", False):
        return

    def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
        stacked = {}  # every name a checkpoint may give a stacked tensor: the module's path (MiniMax's
        # `block_sparse_moe.experts`, whose layer_name says mlp) and its layer_name
        digests = None
        companions, unused = {}, []
        for path, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, STACKED_METHODS):
                digests = method.moeconv_config.tensor_digests()
                companions.update(method.companions)
                unused += [f"{path}.{name}" for name in method.unused_parameters]
                for name, parameter in method.stacked_parameters.items():
                    for owner in (path.removesuffix(".routed_experts"), module.layer_name):
                        stacked[f"{owner}.{name}"] = parameter
        if not stacked:
            return original(self, model, model_config)
        by_model = model.load_weights
        mapper = getattr(model, "hf_to_vllm_mapper", None)  # checkpoint names -> the model's (MiniMax: mlp)

        by_design = skipped_by_design(model_config.hf_text_config.num_hidden_layers,
                                      model_config.hf_config.tie_word_embeddings)

        def skipped(name: str) -> bool:  # vLLM's mapper drops g_idx (act-order is gone; moeconv copies trivial ones)
            return name.endswith(".g_idx") or by_design(name)

        def routed(weights):
            loaded = set()

            def others(weights):
                for name, tensor in weights:
                    if digests is not None:  # MOECONV_VERIFY_ON_LOAD=1: every tensor, before anything reads it
                        digests.check(name, tensor)
                    parameter = stacked.get(name) if name.rsplit(".", 1)[-1] in STACKED else None
                    if parameter is None and mapper is not None and name.rsplit(".", 1)[-1] in STACKED:
                        parameter = stacked.get(mapper.map_name(name) or "")
                    if parameter is None:
                        yield name, tensor
                    else:
                        parameter.weight_loader(parameter, tensor)
                        loaded.add(name)

            with LoadLedger(model, _loader_of, _set_loader, optional_parameters=(*KV_CACHE_SCALES, *unused), skipped=skipped,
                            also_writes=companions) as ledger:
                result = by_model(others(ledger.weights(weights)))
            refusal = ledger.refusal()
            if refusal:
                raise PluginRefusal(refusal)
            if digests is not None:
                logger.info(digests.summary())
            return None if result is None else set(result) | loaded

        model.load_weights = routed  # for this call only: the instance attribute shadows the class's
        try:
            return original(self, model, model_config)
        finally:
            del model.load_weights

    load_weights.routes_moeconv_tensors = True
    DefaultModelLoader.load_weights = load_weights


def _loader_of(parameter: torch.nn.Parameter):
    """The weight loader vLLM's model loaders call for a parameter (theirs default to default_weight_loader)."""
    return getattr(parameter, "weight_loader", default_weight_loader)


def _set_loader(parameter: torch.nn.Parameter, loader) -> None:
    parameter.weight_loader = loader  # vLLM's parameter classes take it as an attribute (a property with a setter)
