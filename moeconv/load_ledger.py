"""What an engine's load of a moeconv output consumed and wrote, checked after its `load_weights` (both
plugins; torch only, no engine here).

An engine's model loader skips a checkpoint name that matches no parameter without a word, and leaves a
parameter no name matched as it was allocated: a MiniMax-M2 output whose FP8 attention the dense method
does not know loads its `weight` into float parameters and drops every `weight_scale_inv`; a DeepSeek-V3
output whose attention the loader cannot fuse leaves tensors unused and parameters unwritten. The ledger
wraps every parameter's weight loader (the models' loaders call `param.weight_loader`, or the default
loader where a parameter has none) and the weights iterator the model is handed. A tensor of the output
counts as consumed when a weight loader is handed it, or a view of it (same storage), or a concatenation
of it with other tensors of the same module (SGLang's DeepSeek loader hands its fused_qkv_a_proj_with_mqa
parameter `torch.cat` of q_a_proj and kv_a_proj_with_mqa); a parameter counts as written when its weight
loader ran, and, for a fused linear's parameter (q/k/v in one, gate/up in one, DeepSeek's q_a/kv_a), when its
loader was handed every shard (`fused_shards`): a checkpoint missing one shard's tensor otherwise leaves that
part of the parameter as allocated while the others write it. `refusal` names what is left, first few and
count, in one line. Only the tensors not consumed yet are held (so their storage keeps naming them); each is
released when a loader takes it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch

SHOWN = 3  # names a refusal lists before its count
# The attention layers' KV-cache scales, which both engines allocate for some quantization configs and
# default (no scaling) when a checkpoint has none: optional by design. Only attention has them under these
# names (`self_attn.attn.k_scale`; MLA's `mla_attn`, `attn_mqa`), linears' are weight_scale / input_scale.
KV_CACHE_SCALES = (*(f".{which}_{kind}" for which in "qkv" for kind in ("scale", "zero_point")), ".prob_scale")
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def fused_shards(module: torch.nn.Module) -> frozenset | None:
    """The shard ids a fused linear's weight loader must be handed for each of its parameters to be whole, as
    both engines name them (SGLang's linear layers are vLLM's, by class and argument): a QKVParallelLinear's
    "q", "k", "v"; a MergedColumnParallelLinear's 0 .. n - 1, one per output size. None for any other module,
    or a variant whose shards this does not know (its parameters are then held to being written at all).
    Duck-typed on the class names and `output_sizes`: no engine is imported here."""
    sizes = getattr(module, "output_sizes", None)
    if not isinstance(sizes, (list, tuple)):
        return None
    classes = {cls.__name__ for cls in type(module).__mro__}
    if "QKVParallelLinear" in classes:
        return frozenset("qkv") if len(sizes) == 3 else None
    if "MergedColumnParallelLinear" in classes:
        return frozenset(range(len(sizes)))
    return None


def skipped_by_design(hidden_layers: int, tied_embeddings: bool) -> Callable[[str], bool]:
    """The tensors both engines' model loaders skip on purpose, which a faithful output still holds: a
    multi-token-prediction layer (DeepSeek-V3's `model.layers.<num_hidden_layers>`, Qwen3.5's `mtp.`),
    served only by a draft model; rotary `inv_freq` buffers; `lm_head.weight` of a model with tied embeddings."""

    def skipped(name: str) -> bool:
        if name.startswith("mtp.") or name.endswith(".rotary_emb.inv_freq"):
            return True
        if tied_embeddings and name == "lm_head.weight":
            return True
        layer = LAYER.search(name)
        return layer is not None and int(layer.group(1)) >= hidden_layers

    return skipped


class LoadLedger:
    """One load of one model: wrap the loaders (`__enter__`), feed the weights through `weights`, and ask
    `refusal` once the model's `load_weights` returned."""

    def __init__(self, model: torch.nn.Module, loader_of: Callable[[torch.nn.Parameter], Callable],
                 set_loader: Callable[[torch.nn.Parameter, Callable], None], *,
                 optional_parameters: tuple[str, ...] = (),
                 skipped: Callable[[str], bool] = lambda name: False,
                 also_writes: dict[int, list[torch.nn.Parameter]] | None = None,
                 shards_of: Callable[[torch.nn.Module], frozenset | None] = fused_shards):
        """`loader_of` / `set_loader`: the engine's way to read and replace a parameter's weight loader.
        `optional_parameters`: name endings of parameters the engine defaults when a checkpoint has none (the
        KV-cache scales). `skipped`: whether the engine's loader skips a tensor by design (skipped_by_design,
        and what its own name mapper drops). `also_writes`: parameters (by id) a plugin's loader writes
        beside its own. `shards_of`: the shard ids a module's loader must be handed for its parameters to be
        whole (None: not a fused module)."""
        self.model, self.loader_of, self.set_loader = model, loader_of, set_loader
        self.optional, self.skipped = optional_parameters, skipped
        self.also_writes = also_writes or {}
        self.names = {id(parameter): name for name, parameter in model.named_parameters()}
        self.pending: dict[str, torch.Tensor] = {}  # yielded, not consumed yet
        # storage address -> the pending tensors in it (one each, or a whole file's where a loader maps
        # every tensor of a file into one buffer)
        self.storages: dict[int, set[str]] = {}
        self.written: set[int] = set()
        self.shards: dict[int, frozenset] = {}  # a fused module's parameter (by id) -> the shard ids it needs
        for module in model.modules():
            needed = shards_of(module)
            if needed:
                self.shards.update((id(parameter), needed) for parameter in module.parameters(recurse=False))
        self.shards_seen: dict[int, set] = {}
        self.originals: list[tuple[torch.nn.Parameter, Callable]] = []

    def __enter__(self) -> LoadLedger:
        for name, parameter in self.model.named_parameters():
            original = self.loader_of(parameter)
            self.originals.append((parameter, original))
            self.set_loader(parameter, self._recording(parameter, name, original))
        return self

    def __exit__(self, *_: object) -> None:
        for parameter, original in self.originals:
            self.set_loader(parameter, original)

    def weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if not self.skipped(name):
                self.pending[name] = tensor
                self.storages.setdefault(tensor.untyped_storage().data_ptr(), set()).add(name)
            yield name, tensor

    def _recording(self, parameter: torch.nn.Parameter, name: str, original: Callable) -> Callable:
        module = name.rsplit(".", 2)[0] + "."  # the parent of the parameter's module: fused siblings live there

        def load(*args, **kwargs):
            for value in (*args[1:2], *kwargs.values()):
                if isinstance(value, torch.Tensor):
                    self._consume(value, module)
            self.written.add(id(parameter))
            if id(parameter) in self.shards:
                shard = args[2] if len(args) > 2 else kwargs.get("loaded_shard_id", kwargs.get("shard_id"))
                self._shard(parameter, shard)
            self.written.update(id(other) for other in self.also_writes.get(id(parameter), ()))
            return original(*args, **kwargs)

        return load

    def _shard(self, parameter: torch.nn.Parameter, shard: object) -> None:
        seen = self.shards_seen.setdefault(id(parameter), set())
        if shard is None:  # the fused tensor itself (a checkpoint that stores it fused, or a loader's concatenation)
            seen.update(self.shards[id(parameter)])
        elif isinstance(shard, (tuple, list)):
            seen.update(shard)
        else:
            seen.add(shard)

    def _consume(self, value: torch.Tensor, module: str) -> None:
        address = value.data_ptr()
        sharing = self.storages.get(value.untyped_storage().data_ptr(), ())
        names = [name for name in sharing  # the pending tensor this one is a view of: its bytes hold the view's start
                 if self.pending[name].data_ptr() <= address < self.pending[name].data_ptr() + max(
                     self.pending[name].nbytes, 1)]
        if not names:  # made by the model's loader: the module's pending tensors it is made of
            names = _pieces(value, {n: t for n, t in self.pending.items() if n.startswith(module)})
        for name in names:
            tensor = self.pending.pop(name)
            storage = tensor.untyped_storage().data_ptr()
            self.storages[storage].discard(name)
            if not self.storages[storage]:
                del self.storages[storage]

    def refusal(self) -> str | None:
        """None when every tensor was consumed and every parameter written; else why not, in one line."""
        unwritten = [name for name, parameter in self.model.named_parameters()
                     if id(parameter) not in self.written and parameter.numel() and not name.endswith(self.optional)]
        partial = []  # fused parameters some shards wrote, with the shards none did
        for name, parameter in self.model.named_parameters():
            missing = self.shards.get(id(parameter), frozenset()) - self.shards_seen.get(id(parameter), set())
            if id(parameter) in self.shards_seen and missing:
                partial.append(f"{name} (no shard {'/'.join(sorted(map(str, missing)))})")
        parts = []
        if self.pending:
            parts.append(f"{_listed(sorted(self.pending))} of the output's tensors were taken by no parameter")
        if unwritten:
            parts.append(f"{_listed(unwritten)} of the model's parameters were written by no tensor")
        if partial:
            parts.append(f"{_listed(partial)} of the model's fused parameters were written in part, a shard's "
                         f"tensor missing")
        if not parts:
            return None
        return (f"{'; '.join(parts)}: the engine's loader dropped them without a word (a layer the source's "
                f"quantization method does not know, or names this model does not have); this output does not load "
                f"in this engine as it is: `moeconv inspect` on the source says which output each engine serves")


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN])
    return f"{len(names)} ({shown}{', ...' if len(names) > SHOWN else ''})"


def _pieces(value: torch.Tensor, candidates: dict[str, torch.Tensor]) -> list[str]:
    """The names of the `candidates` whose concatenation along dim 0 or 1, in some order, is `value`
    element for element (one candidate: an equal copy); [] when it is none."""
    for dim in range(min(value.dim(), 2)):
        offset, names = 0, []
        while offset < value.shape[dim]:
            piece = next((name for name, tensor in candidates.items()
                          if name not in names and _is_slice(value, tensor, dim, offset)), None)
            if piece is None:
                break
            names.append(piece)
            offset += candidates[piece].shape[dim]
        if names and offset == value.shape[dim]:
            return names
    return []


def _is_slice(value: torch.Tensor, tensor: torch.Tensor, dim: int, offset: int) -> bool:
    """Whether `tensor` is `value`'s slice [offset, offset + its width) along `dim`."""
    if tensor.dim() != value.dim() or tensor.dtype != value.dtype or not tensor.shape[dim]:
        return False
    if offset + tensor.shape[dim] > value.shape[dim]:
        return False
    if any(tensor.shape[d] != value.shape[d] for d in range(value.dim()) if d != dim):
        return False
    return torch.equal(value.narrow(dim, offset, tensor.shape[dim]), tensor)
