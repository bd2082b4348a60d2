"""Architecture naming schemes: which tensors are routed experts, and how big the config says they are.

A routed expert tensor is named `<module>.<expert>.<projection>.<suffix>`, where `<module>` ends in
`.experts` (any prefix: `model.`, `model.language_model.`, `mtp.`), or, as ModelOpt exports write
it, `<module>.<projection>.<expert>.<suffix>`. Everything else (attention, routers, shared experts,
dense MLPs, norms, embeddings) passes through untouched, so the patterns only need to recognise
routed experts; a tensor under an `experts` module that no pattern claims is refused by the plan,
never copied as if it were not an expert.

A new family is one `Architecture` entry in ARCHITECTURES: its model_type, the modules that hold
`experts`, its projection names, and the config keys of the expert count and size; where checkpoints
name the MoE block otherwise than the engine's model class does (Mixtral under transformers 5), the
engine's names too, which every output carries (`engine_name`, `engine_projection_names`).

A family that stacks its experts on disk (gpt-oss: `<module>.gate_up_proj_blocks [E, 2I, ...]`, dim 0 the
expert) declares it in `stacked` (`StackedExperts`): which stacked tensors hold which projections, and in what
row order a fused gate/up tensor holds them. The survey reads each expert's linears as slices of those
tensors by that declaration (survey.ExpertSlice), never by guessing from the data.
"""

from __future__ import annotations

import re
from functools import cached_property
from dataclasses import dataclass
from typing import Any, Mapping

from moeconv.errors import MoeconvError


_HF_PROJECTIONS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

# How a fused gate/up tensor holds its rows: gate row i at 2i and up row i at 2i + 1.
INTERLEAVED = "interleaved"
ROW_ORDERS = {INTERLEAVED: {"gate": (0, 2), "up": (1, 2)}}  # projection -> (first row, step)


@dataclass(frozen=True)
class StackedExperts:
    """Experts stacked on disk, one tensor per projection group and suffix, dim 0 the expert:
    `<module>.<tensor>_<suffix>` (gpt-oss: `mlp.experts.gate_up_proj_blocks`, `..._scales`, `..._bias`).

    `tensors`: stacked tensor -> the projections it holds; `gate_up_rows`: the row order of a tensor that holds
    gate and up (INTERLEAVED), with `row_order_source` saying where that order is established."""

    tensors: Mapping[str, tuple[str, ...]]
    gate_up_rows: str
    row_order_source: str

    def rows(self, tensor: str, projection: str) -> tuple[int, int]:
        """(first row, step) of `projection`'s rows in stacked `tensor`: (0, 1) where it holds one projection."""
        held = self.tensors[tensor]
        return (0, 1) if len(held) == 1 else ROW_ORDERS[self.gate_up_rows][projection]

    def describe(self) -> dict[str, Any]:
        return {"tensors": {tensor: list(held) for tensor, held in self.tensors.items()},
                "gate_up_rows": f"{self.gate_up_rows}: gate row i is row 2i, up row i is row 2i + 1 "
                                f"({self.row_order_source})" if self.gate_up_rows == INTERLEAVED else self.gate_up_rows}


@dataclass(frozen=True)
class StackedName:
    module: str  # e.g. "model.layers.3.mlp.experts"
    tensor: str  # the stacked tensor's own name: "gate_up_proj", "down_proj"
    suffix: str  # "blocks", "scales", "bias"
_MIXTRAL_PROJECTIONS = {"w1": "gate", "w3": "up", "w2": "down", **_HF_PROJECTIONS}


@dataclass(frozen=True)
class ExpertName:
    module: str  # e.g. "model.layers.3.mlp.experts"
    expert: int
    projection: str  # "gate" | "up" | "down"
    suffix: str  # e.g. "qweight"
    projection_name: str  # the checkpoint's own: "gate_proj", "w1", ...


@dataclass(frozen=True)
class Architecture:
    model_type: str
    parents: tuple[str, ...]  # module names that hold `experts`
    projections: Mapping[str, str]  # checkpoint projection name -> canonical projection (per-expert tensors)
    experts_key: str  # config key: number of routed experts
    intermediate_key: str  # config key: per-expert intermediate size
    # The names the engine's model class maps (vLLM's, engines/), which an output carries whatever names the source
    # used: the module that holds the router and `experts`, and gate, up, down. None: the source's own.
    engine_parent: str | None = None
    engine_projections: tuple[str, str, str] | None = None
    stacked: StackedExperts | None = None  # experts stacked on disk (gpt-oss); None: one tensor per expert

    def parse_stacked(self, tensor_name: str) -> StackedName | None:
        """`<module>.<tensor>_<suffix>` for a stacked tensor this family declares, else None (a bare
        `gate_up_proj`, held in float, is no stacked quantized tensor)."""
        module = self.experts_module(tensor_name) if self.stacked else None
        if module is None:
            return None
        rest = tensor_name[len(module) + 1:]
        for tensor in self.stacked.tensors:
            suffix = rest.removeprefix(f"{tensor}_")
            if suffix != rest and _is_word(suffix) and "." not in suffix:
                return StackedName(module, tensor, suffix)
        return None

    def parse(self, tensor_name: str) -> ExpertName | None:
        """Remembered: planning asks about each name several times, and Qwen3-Next has 220k names."""
        cache = self._parsed
        if tensor_name not in cache:
            if len(cache) > 1 << 20:
                cache.clear()
            cache[tensor_name] = self._parse(tensor_name)
        return cache[tensor_name]

    @cached_property
    def _parsed(self) -> dict[str, ExpertName | None]:
        return {}

    def _parse(self, tensor_name: str) -> ExpertName | None:
        module = self.experts_module(tensor_name)
        if module is None:
            return None
        parts = tensor_name[len(module) + 1:].split(".")
        if len(parts) != 3 or not _is_word(parts[2]):
            return None
        first, second, suffix = parts
        if _is_index(first) and second in self.projections:  # experts.E.gate_proj.qweight
            expert, projection = first, second
        elif _is_index(second) and first in self.projections:  # ModelOpt: experts.gate_proj.E.weight_packed
            expert, projection = second, first
        else:
            return None
        return ExpertName(module=module, expert=int(expert), projection=self.projections[projection],
                          suffix=suffix, projection_name=projection)

    def engine_name(self, name: str) -> str:
        """A source tensor's (or module's) name as the engine's model class names it: the MoE block's
        parent renamed where the source used another (Mixtral saved by transformers 5: `layers.N.mlp.` ->
        `layers.N.block_sparse_moe.`, router included). Projection names: `engine_projection_names`."""
        if self._other_parents is None:
            return name
        return self._other_parents.sub(rf"\1\2.{self.engine_parent}.", name, count=1)

    def engine_projection_names(self, source: tuple[str, str, str]) -> tuple[str, str, str]:
        """gate, up, down as an output names them: the engine's names, else the source's."""
        return self.engine_projections or source

    @cached_property
    def _other_parents(self) -> re.Pattern[str] | None:
        others = [parent for parent in self.parents if parent != self.engine_parent]
        if self.engine_parent is None or not others:
            return None
        return re.compile(rf"(^|\.)(layers\.\d+)\.(?:{'|'.join(map(re.escape, others))})\.")

    def experts_module(self, tensor_name: str) -> str | None:
        """The `experts` module a tensor lies under (whether or not a pattern claims it), else None."""
        head, found, _ = tensor_name.rpartition(".experts.")
        if not found or head.rsplit(".", 1)[-1] not in self.parents:
            return None
        return f"{head}.experts"

    def expected_sizes(self, config: Mapping[str, Any], where: str) -> tuple[int, int, int]:
        """(experts, hidden, intermediate) from config.json (or its `text_config`, where a multimodal
        model keeps them): positive integers (not 4.7, "8" or true)."""
        text = config.get("text_config")
        sources = [config, text] if isinstance(text, dict) else [config]
        sizes = []
        for key in (self.experts_key, "hidden_size", self.intermediate_key):
            # transformers 5 writes the expert count as num_local_experts for every MoE family
            # (measured on the configs of Qwen3-MoE checkpoints llm-compressor 0.12 saves)
            names = (key, "num_local_experts") if key == self.experts_key else (key,)
            value = next((found[name] for found in sources for name in names if found.get(name) is not None), None)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                found = "is missing" if value is None else f"is {value!r}, not a positive integer"
                raise MoeconvError(f"{where}: {self.model_type} config key {key} {found} "
                                   f"(needs {self.experts_key}, hidden_size, {self.intermediate_key})")
            sizes.append(value)
        return sizes[0], sizes[1], sizes[2]


_QWEN_LIKE = dict(parents=("mlp",), projections=_HF_PROJECTIONS, experts_key="num_experts",
                  intermediate_key="moe_intermediate_size")
_DEEPSEEK_LIKE = dict(parents=("mlp",), projections=_HF_PROJECTIONS, experts_key="n_routed_experts",
                      intermediate_key="moe_intermediate_size")

ARCHITECTURES: dict[str, Architecture] = {
    arch.model_type: arch
    for arch in (
        # Both the legacy `block_sparse_moe.experts.E.w1/w2/w3` names and the
        # `mlp.experts.E.gate_proj/...` names GPTQModel writes under transformers 5; outputs carry the
        # former, which vLLM's MixtralForCausalLM maps (its WeightsMapper renames gate_proj to w1 but
        # not mlp to block_sparse_moe: "no module or parameter named 'layers.0.mlp'").
        Architecture("mixtral", ("block_sparse_moe", "mlp"), _MIXTRAL_PROJECTIONS,
                     "num_local_experts", "intermediate_size", engine_parent="block_sparse_moe",
                     engine_projections=("w1", "w3", "w2")),
        Architecture("qwen2_moe", **_QWEN_LIKE),
        Architecture("qwen3_moe", **_QWEN_LIKE),
        Architecture("qwen3_next", **_QWEN_LIKE),  # 512 experts x 48 layers
        Architecture("qwen3_5_moe", **_QWEN_LIKE),  # sizes in text_config; model.language_model. prefix; mtp.
        Architecture("deepseek_v2", **_DEEPSEEK_LIKE),
        Architecture("deepseek_v3", **_DEEPSEEK_LIKE),
        Architecture("kimi_k2", **_DEEPSEEK_LIKE),  # DeepSeek-V3 names, 384 experts
        Architecture("glm4_moe", **_DEEPSEEK_LIKE),
        Architecture("minimax_m2", ("block_sparse_moe",), _MIXTRAL_PROJECTIONS, "num_local_experts",
                     "intermediate_size"),
        # DeepSeek-V4 as DeepSeek ships it: `layers.L.ffn.experts.E.w1/w3/w2` (gate, up, down), no `model.`
        # prefix (transformers' conversion_mapping.py "deepseek_v4" and vLLM's models/deepseek_v4 map these names);
        # `ffn.shared_experts` and the router `ffn.gate` pass through.
        Architecture("deepseek_v4", ("ffn",), _MIXTRAL_PROJECTIONS, "n_routed_experts", "moe_intermediate_size"),
        # gpt-oss: experts stacked per layer, gate and up fused and interleaved (transformers
        # models/gpt_oss/modeling_gpt_oss.py GptOssExperts: gate_up[..., ::2], gate_up[..., 1::2]; its MXFP4
        # reader integrations/mxfp4.py keeps the stored row order); the router `mlp.router` passes through.
        Architecture("gpt_oss", ("mlp",), {}, "num_local_experts",
                     "intermediate_size",
                     stacked=StackedExperts({"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}, INTERLEAVED,
                                            "transformers GptOssExperts: gate_up[..., ::2], gate_up[..., 1::2]")),
    )
}


# Families refused with the reason, not as "unknown" (none at present).
REFUSED: dict[str, str] = {}


def _is_index(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _is_word(text: str) -> bool:
    return text.isascii() and text.replace("_", "a").isalnum()


def architecture_from_config(config: Mapping[str, Any], where: str) -> Architecture:
    model_type = config.get("model_type", "")
    if not isinstance(model_type, str):
        raise MoeconvError(f"{where}: model_type must be a string, not {model_type!r}")
    if model_type in REFUSED:
        raise MoeconvError(f"{where}: {REFUSED[model_type]}")
    if model_type not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise MoeconvError(
            f"{where}: unsupported architecture {model_type or '(no model_type)'!r}; supported: {supported} "
            f"(a new naming scheme is one Architecture entry in moeconv/models.py, docs/ARCHITECTURE.md)"
        )
    return ARCHITECTURES[model_type]
