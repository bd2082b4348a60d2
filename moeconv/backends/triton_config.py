"""A `triton` output's `quantization_config`, parsed strictly, and held against its files: what both engine
plugins read before the engine builds a single layer (moeconv.engines.vllm_plugin, moeconv.engines.sglang_plugin;
no engine here), beside the backend that writes it.

The engine hands the plugin the raw JSON of `config.json`. Every value that decides how the stacked bytes
are read is checked the way `convert` checks a source's config (`moeconv.formats.base.config_int`,
`config_bool`, `checked_group_size`): `has_zp: "false"`, `bits: 4.7`, `group_size: 127.9`, a numeric
or boolean `scale_dtype`, a group size that is negative, not a power of two or wider than a byte
count can hold, a missing or non-object source config, or a source config that is itself a moeconv
config, are each one refusal starting `moeconv:`, never a coerced value or a raw exception. `has_zp`
must be a boolean and `group_size` an integer (null is refused: it used to read as "symmetric" and
"channel-wise").

`check_files` then holds the config against the output's safetensors headers: every MoE layer's stacked
tensors must be exactly the ones the triton backend writes for the config and the sizes the tensors' rows
say, so zero points stored without `has_zp: true` (or missing with it), and a group size or bit width the
shapes contradict, are refused before anything is served, as are FP8 block linears copied from the source,
which the dense layers' method does not read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moeconv.backends.triton import FLOAT, FLOAT_LAYOUTS, INT8, INT8_LAYOUT, WNA16, WNA16_LAYOUT, TritonBackend
from moeconv.canonical import CHANNELWISE, MoELayerShape
from moeconv.float_codes import DIVIDE, MXFP4, FloatScheme, nvfp4
from moeconv.checkpoint.reader import Checkpoint, TensorEntry
from moeconv.errors import MoeconvError
from moeconv.formats.base import checked_group_size, config_bool, config_int
from moeconv.spec import FLOAT_DTYPES

QUANT_METHOD = "moeconv"  # the quant_method of a triton output's config, the name both plugins register

WNA16_BITS = (4, 8)
MAX_GROUP_SIZE = 1 << 20  # wider than any hidden or intermediate size; a larger one is not a group size
WHERE = "the output's quantization_config"


class PluginRefusal(MoeconvError, ValueError):
    """Why an engine plugin will not serve an output; the message is one line starting `moeconv:`. A ValueError
    too: vLLM reports a quantization config's ValueError as the reason its config did not validate."""

    def __init__(self, why: str) -> None:
        super().__init__(f"moeconv: {why}")


@dataclass(frozen=True)
class StackedLayout:
    """What the stacked expert tensors of a `triton` output are, as the plugin reads them."""

    layout: str  # WNA16_LAYOUT, INT8_LAYOUT or one of FLOAT_LAYOUTS
    bits: int
    group_size: int  # a power of two, or CHANNELWISE
    has_zp: bool
    scale_dtype: str  # the stored scales' safetensors dtype (F16, BF16, F32)
    source: dict[str, Any]  # the source's own quantization_config, which copied dense layers keep
    # the dense linears' config when moeconv converted them (an asymmetric GPTQ source's, in
    # compressed-tensors: `dense_quantization_config`); None: they are the source's, copied
    dense: dict[str, Any] | None = None
    float_scheme: FloatScheme | None = None  # the float layouts' codes (global scales divided by); else None

    @property
    def channelwise(self) -> bool:
        return self.group_size == CHANNELWISE


def parse(config: Any) -> StackedLayout:
    """The layout a moeconv `triton` output's `quantization_config` describes, or a PluginRefusal."""
    try:
        return _parse(config)
    except PluginRefusal:
        raise
    except MoeconvError as error:  # config_int & co. word it "WHERE: key must be ..."
        raise PluginRefusal(str(error)) from None


def _parse(config: Any) -> StackedLayout:
    if not isinstance(config, dict):
        raise PluginRefusal(f"{WHERE} must be an object, not {type(config).__name__}")
    backend = config.get("backend")
    if backend != TritonBackend.name:
        if backend == "cpu":  # docs/FORMAT.md, "What the plugin does not serve, and why"
            raise PluginRefusal("backend 'cpu' outputs hold the blocked layout vLLM's CPU experts build in their "
                                "own post-load step, which vLLM 0.33 takes from no file; serve the triton output "
                                "of the same source (on a CPU build vLLM's oracle picks its CPU experts)")
        raise PluginRefusal(f"backend {backend!r} outputs are not served by this plugin (only 'triton')")
    version = config.get("layout_version")
    if isinstance(version, bool) or version != TritonBackend.layout_version:
        raise PluginRefusal(f"layout version {version!r}; this plugin reads triton layout "
                            f"v{TritonBackend.layout_version} (reconvert with this moeconv)")
    layout = config.get("layout")
    known = (WNA16_LAYOUT, INT8_LAYOUT, *FLOAT_LAYOUTS)
    if layout not in known:
        raise PluginRefusal(f"triton layout {layout!r} is not one this plugin knows ({', '.join(known)})")
    for key in ("bits", "group_size", "has_zp"):
        if key not in config:
            raise PluginRefusal(f"{WHERE} has no {key}: reconvert")
    kinds = {"bits": "an integer", "group_size": "an integer (-1: channel-wise)", "has_zp": "true or false"}
    for key, kind in kinds.items():
        if config[key] is None:  # config_int / config_bool read null as their default
            raise PluginRefusal(f"{WHERE}: {key} is null; it must be {kind} (reconvert)")
    bits = config_int(config, "bits", 0, WHERE)
    group_size = config_int(config, "group_size", 0, WHERE)
    has_zp = config_bool(config, "has_zp", False, WHERE)
    if group_size > MAX_GROUP_SIZE:
        raise PluginRefusal(f"{WHERE}: group_size {group_size} is larger than any layer ({MAX_GROUP_SIZE})")
    if group_size < 0 and group_size != CHANNELWISE:
        raise PluginRefusal(f"{WHERE}: group_size {group_size} is negative (-1 means channel-wise)")
    group_size = checked_group_size(group_size, WHERE)
    if layout in FLOAT_LAYOUTS:
        scheme = _float_scheme(config, layout)
        if (bits, group_size, has_zp) != (4, scheme.block, False):
            raise PluginRefusal(f"{WHERE}: the {layout} layout holds 4-bit E2M1 codes in blocks of {scheme.block} "
                                f"without zero points, not bits {bits}, group_size {group_size}, has_zp {has_zp}")
        return StackedLayout(layout, bits, group_size, has_zp, scheme.scale_dtype, _source_config(config),
                             _dense_config(config), scheme)
    if layout == INT8_LAYOUT:
        if bits != 8 or has_zp or group_size != CHANNELWISE:
            raise PluginRefusal(f"{WHERE}: the {INT8_LAYOUT} layout is symmetric 8-bit with one scale per channel, "
                                f"not bits {bits}, has_zp {has_zp}, group_size {group_size}")
        scale_dtype = "F32"
    else:
        if bits not in WNA16_BITS:
            raise PluginRefusal(f"{WHERE}: bits {bits}; the {WNA16_LAYOUT} layout holds 4- or 8-bit codes")
        scale_dtype = config.get("scale_dtype")
        if scale_dtype is None:
            raise PluginRefusal("the config names no scale_dtype (an output of an older moeconv): reconvert")
        if not isinstance(scale_dtype, str) or scale_dtype not in FLOAT_DTYPES:
            raise PluginRefusal(f"{WHERE}: scale_dtype {scale_dtype!r} is not one of {', '.join(FLOAT_DTYPES)}")
    return StackedLayout(layout, bits, group_size, has_zp, scale_dtype, _source_config(config), _dense_config(config))


def _float_scheme(config: dict[str, Any], layout: str) -> FloatScheme:
    """The float scheme the config states, each key exactly as the triton backend writes it for `layout`."""
    inputs = config.get("input_global_scale")
    if not isinstance(inputs, bool) or (inputs and layout != "nvfp4"):
        raise PluginRefusal(f"{WHERE}: input_global_scale {inputs!r}; the {layout} layout says true or false "
                            f"(true for NVFP4 W4A4 only)")
    scheme = MXFP4 if layout == MXFP4.name else nvfp4(DIVIDE, inputs)
    stated = {key: config.get(key) for key in ("scale_dtype", "scale_encoding", "global_scale")}
    expected = {"scale_dtype": scheme.scale_dtype, "scale_encoding": scheme.scale_encoding,
                "global_scale": scheme.global_convention}
    if stated != expected:
        raise PluginRefusal(f"{WHERE}: {stated}; the {layout} layout says {expected} (reconvert)")
    return scheme


DENSE_BACKEND = "compressed-tensors"  # the one layout moeconv converts a triton output's dense linears to


def _dense_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """The converted dense linears' config: absent, or a compressed-tensors config object named by
    `dense_backend` (moeconv.backends.triton.TritonBackend.dense_linear_backend)."""
    backend, dense = config.get("dense_backend"), config.get("dense_quantization_config")
    if backend is None and dense is None:
        return None
    if backend != DENSE_BACKEND or not isinstance(dense, dict) or dense.get("quant_method") != DENSE_BACKEND:
        raise PluginRefusal(f"{WHERE}: dense_backend {backend!r} with a dense_quantization_config that is not a "
                            f"{DENSE_BACKEND} config object; the plugin reads dense linears converted to "
                            f"{DENSE_BACKEND} only (reconvert)")
    return dense


def _source_config(config: dict[str, Any]) -> dict[str, Any]:
    """The source's own config: an object with a string `quant_method` that is not moeconv's (an
    output converted again, or a crafted one, would otherwise nest the plugin inside itself)."""
    source = config.get("source_quantization_config")
    if source is None:
        raise PluginRefusal(f"{WHERE} has no source_quantization_config (the dense layers' method): reconvert")
    if not isinstance(source, dict):
        raise PluginRefusal(f"{WHERE}: source_quantization_config must be an object, not {type(source).__name__}")
    method = source.get("quant_method")
    if not isinstance(method, str) or not method:
        raise PluginRefusal(f"{WHERE}: source_quantization_config names no quant_method")
    if method == QUANT_METHOD or "source_quantization_config" in source:
        raise PluginRefusal(f"{WHERE}: source_quantization_config is itself a moeconv config; convert the "
                            f"original source, not a moeconv output")
    return source


STACKED_NAMES = {name for names in (*WNA16.values(), *INT8.values(), *FLOAT.values()) for name in names}
QZEROS_NAMES = {names.qzeros for names in WNA16.values()}
SCALES_NAMES = {names.scales for names in WNA16.values()}
FP8_BLOCK_SCALE = "weight_scale_inv"  # DeepSeek's and MiniMax's FP8 block linears, which triton outputs copy


def check_files(stacked: StackedLayout, checkpoint: Checkpoint) -> None:
    """Refuses (one line naming the file and tensor) any MoE layer whose stacked tensors in the files are
    not exactly what the config says: each layer's sizes are read from its tensors' rows (w13: 2I, w2:
    H) and the triton backend's own specs for those sizes and the config's bits, group size and zero
    points are compared with what the headers hold, name for name, dtype and shape."""
    layers: dict[str, dict[str, TensorEntry]] = {}
    fp8_scales = []
    for name, entry in checkpoint.tensors.items():
        owner, _, leaf = name.rpartition(".")
        if leaf in STACKED_NAMES:
            layers.setdefault(owner, {})[leaf] = entry
        elif leaf == FP8_BLOCK_SCALE:
            fp8_scales.append(entry)
    if fp8_scales:
        first = min(fp8_scales, key=lambda entry: entry.name)
        method = (stacked.dense or stacked.source)["quant_method"]
        raise PluginRefusal(f"{first.file}: {first.name} (one of {len(fp8_scales)} FP8 block scales): the dense "
                            f"layers are served by their {method!r} method, which reads no FP8 block linear (`weight` "
                            f"F8_E4M3 with `{FP8_BLOCK_SCALE}`): the engine would load the FP8 bytes unscaled; "
                            f"convert with --backend compressed-tensors, whose FP8_BLOCK scheme describes them")
    if not layers:
        raise PluginRefusal(f"{checkpoint.root}: the config says a triton output, but its files hold no stacked "
                            f"expert tensor ({', '.join(sorted(WNA16['w13']))}, ...): reconvert")
    for owner, held in sorted(layers.items()):
        _check_layer(stacked, owner, held)


def _check_layer(stacked: StackedLayout, owner: str, held: dict[str, TensorEntry]) -> None:
    int8 = stacked.layout == INT8_LAYOUT
    anchors = {INT8_LAYOUT: (INT8["w13"].weight, INT8["w2"].weight),
               WNA16_LAYOUT: (WNA16["w13"].qweight, WNA16["w2"].qweight)}.get(
        stacked.layout, (FLOAT["w13"].weight_packed, FLOAT["w2"].weight_packed))
    for anchor in anchors:
        if anchor not in held or len(held[anchor].shape) != 3:
            any_entry = next(iter(held.values()))
            raise PluginRefusal(f"{any_entry.file}: {owner} holds {sorted(held)} but no 3-D {anchor}, which the "
                                f"config's {stacked.layout} layout stores for every MoE layer (reconvert)")
    w13, w2 = held[anchors[0]], held[anchors[1]]
    shape = MoELayerShape(experts=w13.shape[0], hidden=w2.shape[1], intermediate=w13.shape[1] // 2, bits=stacked.bits,
                          group_size=stacked.group_size, symmetric=not stacked.has_zp,
                          scale_dtype=stacked.scale_dtype, activation_bits=8 if int8 else 16,
                          float_scheme=stacked.float_scheme)
    specs = {spec.name: spec for spec in TritonBackend().layer_tensors(shape)}
    for name, entry in sorted(held.items()):
        if name not in specs:
            why = ("the config says has_zp false, so the model would be served without these zero points"
                   if name in QZEROS_NAMES else f"the config's {stacked.layout} layout has no such tensor")
            raise PluginRefusal(f"{entry.file}: {owner}.{name}: {why}; reconvert, or correct the config")
    for name, spec in specs.items():
        if name not in held:
            why = "the config says has_zp true" if name in QZEROS_NAMES else f"the {stacked.layout} layout stores it"
            raise PluginRefusal(f"{w13.file}: {owner}.{name}: the files hold no such tensor, and {why} (reconvert)")
        entry = held[name]
        if entry.dtype != spec.dtype or tuple(entry.shape) != tuple(spec.shape):
            raise PluginRefusal(f"{entry.file}: {owner}.{name} is {entry.dtype}{list(entry.shape)}; bits "
                                f"{stacked.bits}, group_size {stacked.group_size} and has_zp "
                                f"{str(stacked.has_zp).lower()} with the layer's sizes (E {shape.experts}, H "
                                f"{shape.hidden}, I {shape.intermediate}) say {spec.dtype}{list(spec.shape)}"
                                f"{_shapes_say(name, entry, shape)}; reconvert, or correct the config")



def _shapes_say(name: str, entry: TensorEntry, shape: MoELayerShape) -> str:
    """What group size a scales tensor's shape says, for the refusal."""
    if name not in SCALES_NAMES or len(entry.shape) != 3 or entry.shape[2] < 1:
        return ""
    width = shape.hidden if name == WNA16["w13"].scales else shape.intermediate
    groups = entry.shape[2]
    said = CHANNELWISE if groups == 1 else width // groups
    return f" (its {groups} groups over K {width} say group_size {said})"
