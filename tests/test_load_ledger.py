"""The plugins' ledger of a load (moeconv/load_ledger.py), without an engine: a toy model whose
`load_weights` behaves as the engines' do (a name with no parameter skipped without a word, q/k/v
shards loaded into one fused parameter, two tensors concatenated into one, as SGLang's DeepSeek loader
does) shows every dropped tensor and every unwritten parameter named in one line, and a complete load
passing."""

from __future__ import annotations

import pytest
import torch

from moeconv.load_ledger import KV_CACHE_SCALES, LoadLedger, fused_shards, skipped_by_design


def default_loader(parameter: torch.nn.Parameter, loaded: torch.Tensor) -> None:
    parameter.data.copy_(loaded)


class Toy(torch.nn.Module):
    """A decoder layer's worth: fused qkv (three shards), o_proj, a fused q_a/kv_a (one cat), a KV-cache scale."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(6, 4), requires_grad=False)
        self.qkv.weight_loader = self._shard_loader
        self.o = torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False)
        self.fused_qa_kva = torch.nn.Parameter(torch.zeros(5, 4), requires_grad=False)
        self.k_scale = torch.nn.Parameter(torch.tensor(-1.0), requires_grad=False)

    @staticmethod
    def _shard_loader(parameter: torch.nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        start = {"q": 0, "k": 2, "v": 4}[shard]
        parameter.data[start:start + 2].copy_(loaded)


def load_weights(model: torch.nn.Module, weights) -> None:
    """As an engine model's load_weights: mapped names to parameters, others skipped silently."""
    parameters = {f"layers.0.attn.{name}": p for name, p in model.named_parameters()}
    stashed = {}
    for name, tensor in weights:
        module, _, kind = name.rpartition(".")
        leaf = module.rsplit(".", 1)[-1] if kind == "weight" else None
        if leaf in ("q_proj", "k_proj", "v_proj"):
            parameter = parameters["layers.0.attn.qkv"]
            parameter.weight_loader(parameter, tensor, leaf[0])
        elif leaf in ("q_a_proj", "kv_a_proj"):
            stashed[leaf] = tensor
            if len(stashed) == 2:  # made by the loader: a tensor no file holds
                parameter = parameters["layers.0.attn.fused_qa_kva"]
                getattr(parameter, "weight_loader", default_loader)(
                    parameter, torch.cat([stashed["q_a_proj"], stashed["kv_a_proj"]]))
        elif name == "layers.0.attn.o_proj.weight":
            parameter = parameters["layers.0.attn.o"]
            getattr(parameter, "weight_loader", default_loader)(parameter, tensor.view(4, 4))
        # anything else: no parameter, skipped without a word (as the engines do)


def checkpoint(**extra: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    tensors = {f"layers.0.attn.{p}_proj.weight": torch.randn(2, 4) for p in "qkv"}
    tensors.update({"layers.0.attn.o_proj.weight": torch.randn(16).view(4, 4),
                    "layers.0.attn.q_a_proj.weight": torch.randn(2, 4),
                    "layers.0.attn.kv_a_proj.weight": torch.randn(3, 4)})
    tensors.update(extra)
    return list(tensors.items())


class Wrapped(torch.nn.Module):
    """The toy under `layers.0.attn`, the names a model gives its parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.layers[0].attn = Toy()


def loader_of(parameter):
    return getattr(parameter, "weight_loader", default_loader)


def set_loader(parameter, loader) -> None:
    parameter.weight_loader = loader


def run(weights, **options) -> tuple[str | None, torch.nn.Module]:
    model = Wrapped()
    with LoadLedger(model, loader_of, set_loader, optional_parameters=(".k_scale",), **options) as ledger:
        load_weights(model.layers[0].attn, ledger.weights(weights))
    return ledger.refusal(), model


def test_a_complete_load_passes_views_shards_and_concatenations_included():
    weights = checkpoint()
    refusal, model = run(weights)
    assert refusal is None
    fused = model.layers[0].attn.fused_qa_kva
    assert torch.equal(fused, torch.cat([dict(weights)["layers.0.attn.q_a_proj.weight"],
                                         dict(weights)["layers.0.attn.kv_a_proj.weight"]]))


def test_tensors_no_parameter_took_are_named_with_their_count():
    extra = {f"layers.0.attn.{p}_proj.weight_scale_inv": torch.ones(1, 1) for p in "qkvo"}
    refusal, _ = run(checkpoint(**extra))
    assert refusal is not None and "\n" not in refusal
    assert refusal.startswith("4 (layers.0.attn.k_proj.weight_scale_inv, layers.0.attn.o_proj.weight_scale_inv, "
                              "layers.0.attn.q_proj.weight_scale_inv, ...) of the output's tensors were taken by "
                              "no parameter"), refusal
    assert "written by no tensor" not in refusal


def test_parameters_no_tensor_wrote_are_named_and_the_tensors_left_over_too():
    weights = [(name, tensor) for name, tensor in checkpoint() if "kv_a_proj" not in name]  # the cat never happens
    refusal, _ = run(weights)
    assert refusal == ("1 (layers.0.attn.q_a_proj.weight) of the output's tensors were taken by no parameter; "
                       "1 (layers.0.attn.fused_qa_kva) of the model's parameters were written by no tensor: the "
                       "engine's loader dropped them without a word (a layer the source's quantization method does "
                       "not know, or names this model does not have); this output does not load in this engine as it "
                       "is: `moeconv inspect` on the source says which output each engine serves")


def test_a_concatenation_of_other_bytes_consumes_nothing():
    weights = checkpoint()
    original = load_weights

    def forged(model, weights):  # the fused parameter is handed bytes no file tensor holds
        for name, tensor in weights:
            if "kv_a_proj" in name:
                tensor = torch.zeros_like(tensor)
            yield name, tensor

    model = Wrapped()
    with LoadLedger(model, loader_of, set_loader, optional_parameters=(".k_scale",)) as ledger:
        original(model.layers[0].attn, forged(model, ledger.weights(weights)))
    refusal = ledger.refusal()
    assert refusal is not None and refusal.startswith("2 (layers.0.attn.kv_a_proj.weight, layers.0.attn.q_a_proj."
                                                      "weight) of the output's tensors were taken by no parameter")


def test_what_the_engine_drops_or_defaults_by_design_and_what_a_plugin_writes_are_not_refused():
    weights = checkpoint(**{"layers.0.attn.o_proj.g_idx": torch.arange(4)})
    assert run(weights)[0].startswith("1 (layers.0.attn.o_proj.g_idx)")
    assert run(weights, skipped=lambda name: name.endswith(".g_idx"))[0] is None
    model = Wrapped()
    with LoadLedger(model, loader_of, set_loader) as ledger:  # the KV-cache scale not optional here
        load_weights(model.layers[0].attn, ledger.weights(checkpoint()))
    assert ledger.refusal().startswith("1 (layers.0.attn.k_scale) of the model's parameters")
    attn = model.layers[0].attn
    with LoadLedger(model, loader_of, set_loader, also_writes={id(attn.o): [attn.k_scale]}) as ledger:
        load_weights(attn, ledger.weights(checkpoint()))
    assert ledger.refusal() is None


def test_the_loaders_are_restored_after_the_load():
    model = Wrapped()
    attn = model.layers[0].attn
    before = attn.qkv.weight_loader
    with pytest.raises(RuntimeError):
        with LoadLedger(model, loader_of, set_loader):
            assert attn.qkv.weight_loader is not before
            raise RuntimeError("the model's loader failed")
    assert attn.qkv.weight_loader is before
    assert attn.o.weight_loader is default_loader  # the engine's default, set where a parameter had none


def test_what_both_engines_skip_by_design():
    skipped = skipped_by_design(hidden_layers=61, tied_embeddings=False)
    for name in ("model.layers.61.eh_proj.weight", "model.layers.61.mlp.experts.w13_qweight",
                 "mtp.layers.0.mlp.experts.0.gate_proj.weight", "model.layers.3.self_attn.rotary_emb.inv_freq"):
        assert skipped(name), name
    for name in ("model.layers.60.mlp.experts.w13_qweight", "model.language_model.layers.6.self_attn.q_proj.qweight",
                 "lm_head.weight", "model.embed_tokens.weight"):
        assert not skipped(name), name
    assert skipped_by_design(hidden_layers=61, tied_embeddings=True)("lm_head.weight")


def test_tensors_in_one_buffer_are_told_apart_by_their_bytes():
    """A loader that maps a whole file into one buffer (its tensors views of one storage): each tensor is
    consumed by the view of its own bytes only, so one the model skipped is still named."""
    weights = checkpoint(**{"layers.0.attn.o_proj.weight_scale_inv": torch.ones(1, 1)})
    buffer = torch.cat([tensor.reshape(-1) for _, tensor in weights])
    views, offset = [], 0
    for name, tensor in weights:
        views.append((name, buffer[offset:offset + tensor.numel()].view(tensor.shape)))
        offset += tensor.numel()
    refusal, _ = run(views)
    assert refusal.startswith("1 (layers.0.attn.o_proj.weight_scale_inv) of the output's tensors were taken by no "
                              "parameter:"), refusal
    assert run(views[:-1])[0] is None


def test_the_kv_cache_scales_are_optional_and_no_linear_scale_is():
    for name in ("model.layers.0.self_attn.attn.k_scale", "model.layers.0.self_attn.mla_attn.v_scale",
                 "model.layers.0.self_attn.attn_mqa.k_scale", "model.layers.0.self_attn.attn.q_zero_point"):
        assert name.endswith(KV_CACHE_SCALES), name
    for name in ("model.layers.0.self_attn.o_proj.weight_scale", "model.layers.0.self_attn.qkv_proj.input_scale",
                 "model.layers.0.mlp.experts.w13_weight_scale", "model.layers.0.self_attn.k_proj.weight_zero_point"):
        assert not name.endswith(KV_CACHE_SCALES), name


def test_a_fused_parameter_one_shard_of_which_no_tensor_wrote_is_refused():
    """The q shard's tensor missing: k and v write the fused qkv parameter, whose q rows stay as allocated
    (found through vLLM 0.33's loader: an output without `q_proj.weight_packed` loaded without a word)."""
    weights = [(name, tensor) for name, tensor in checkpoint() if name != "layers.0.attn.q_proj.weight"]
    shards_of = lambda module: frozenset("qkv") if isinstance(module, Toy) else None  # noqa: E731
    refusal, _ = run(weights, shards_of=shards_of)
    assert refusal is not None and "\n" not in refusal
    assert refusal.startswith("1 (layers.0.attn.qkv (no shard q)) of the model's fused parameters were written in "
                              "part, a shard's tensor missing: the engine's loader dropped them"), refusal
    # every shard there, or the fused tensor handed whole (no shard id), or a parameter loaded without shards: passes
    assert run(checkpoint(), shards_of=shards_of)[0] is None


def test_which_modules_are_fused_and_their_shards_as_both_engines_name_them():
    class ColumnParallelLinear(torch.nn.Module):
        def __init__(self, sizes):
            super().__init__()
            self.output_sizes = sizes

    class MergedColumnParallelLinear(ColumnParallelLinear):
        pass

    class QKVParallelLinear(ColumnParallelLinear):
        pass

    class DeepSeekV2FusedQkvAProjLinear(MergedColumnParallelLinear):  # vLLM's q_a / kv_a, shard ids 0 and 1
        pass

    assert fused_shards(QKVParallelLinear([8, 2, 2])) == {"q", "k", "v"}
    assert fused_shards(MergedColumnParallelLinear([4, 4])) == {0, 1}
    assert fused_shards(DeepSeekV2FusedQkvAProjLinear([4, 3])) == {0, 1}
    assert fused_shards(QKVParallelLinear([8, 2, 2, 1])) is None  # a variant with another shard: not guessed
    assert fused_shards(ColumnParallelLinear([8])) is None and fused_shards(torch.nn.Linear(2, 2)) is None
