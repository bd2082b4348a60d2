"""Architecture naming schemes: which tensors are routed experts, and how big the config says they are.

A routed expert tensor is named `<module>.<expert>.<projection>.<suffix>`, where `<module>` ends in
`.experts`. Everything else (attention, routers, shared experts, dense MLPs, norms, embeddings)
passes through untouched, so the patterns only need to recognise routed experts.
"""

from __future__ import annotations

import re
from functools import cached_property
from dataclasses import dataclass
from typing import Any, Mapping

from moeconv.errors import MoeconvError


_HF_PROJECTIONS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_MIXTRAL_PROJECTIONS = {"w1": "gate", "w3": "up", "w2": "down", **_HF_PROJECTIONS}


@dataclass(frozen=True)
class ExpertName:
    module: str  # e.g. "model.layers.3.mlp.experts"
    expert: int
    projection: str  # "gate" | "up" | "down"
    suffix: str  # e.g. "qweight"


@dataclass(frozen=True)
class Architecture:
    model_type: str
    parents: tuple[str, ...]  # module names that hold `experts`
    projections: Mapping[str, str]  # checkpoint projection name -> canonical projection
    experts_key: str  # config key: number of routed experts
    intermediate_key: str  # config key: per-expert intermediate size

    def parse(self, tensor_name: str) -> ExpertName | None:
        match = self._pattern.match(tensor_name)
        if match is None:
            return None
        return ExpertName(
            module=match["module"],
            expert=int(match["expert"]),
            projection=self.projections[match["projection"]],
            suffix=match["suffix"],
        )

    @cached_property
    def _pattern(self) -> re.Pattern[str]:
        parents = "|".join(map(re.escape, self.parents))
        projections = "|".join(map(re.escape, self.projections))
        return re.compile(
            rf"^(?P<module>(?:.+\.)?(?:{parents})\.experts)\.(?P<expert>\d+)"
            rf"\.(?P<projection>{projections})\.(?P<suffix>[A-Za-z0-9_]+)$"
        )

    def expected_sizes(self, config: Mapping[str, Any], where: str) -> tuple[int, int, int]:
        """(experts, hidden, intermediate) from config.json: positive integers (not 4.7, "8" or true)."""
        sizes = []
        for key in (self.experts_key, "hidden_size", self.intermediate_key):
            value = config.get(key)
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
        # `mlp.experts.E.gate_proj/...` names GPTQModel writes under transformers 5.
        Architecture("mixtral", ("block_sparse_moe", "mlp"), _MIXTRAL_PROJECTIONS,
                     "num_local_experts", "intermediate_size"),
        Architecture("qwen2_moe", **_QWEN_LIKE),
        Architecture("qwen3_moe", **_QWEN_LIKE),
        Architecture("deepseek_v2", **_DEEPSEEK_LIKE),
        Architecture("deepseek_v3", **_DEEPSEEK_LIKE),
    )
}


def architecture_from_config(config: Mapping[str, Any], where: str) -> Architecture:
    model_type = config.get("model_type", "")
    if not isinstance(model_type, str):
        raise MoeconvError(f"{where}: model_type must be a string, not {model_type!r}")
    if model_type not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise MoeconvError(
            f"{where}: unsupported architecture {model_type or '(no model_type)'!r}; supported: {supported}"
        )
    return ARCHITECTURES[model_type]
