"""Hugging Face transformers models, unchanged, on shardwise (tiny configs, random init, no
hub): their own tensor-parallel plan (``hf_plan``) on tp x ``fully_shard`` on dp of a 2x2
simulated mesh trains like single-device torch with HF's defaults (GQA, RoPE, sdpa,
dropout; Mixtral's grouped experts) and no fallback, and ``generate()`` gives torch's
tokens with and without the KV cache. transformers is a test extra (``pip install -e '.[hf]'``)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import transformers as T  # the `hf` test extra; scripts/setup.sh installs it

import shardwise as sw
from shardwise import PlacementMapping, Replicated, Sharded
from shardwise.ops import registry
from shardwise.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    fully_shard,
    hf_plan,
    parallelize_module,
)
from shardwise.parallel.hf import ShardParameters
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: one torch thread)

MESH = sw.DeviceMesh.cpu((2, 2), ("dp", "tp"))
DATA = PlacementMapping(MESH, [Sharded(0), Replicated()])
GPT2_PLAN = {"transformer.wte": "embedding_rowwise", "transformer.h.*.attn.c_attn": "colwise",
             "transformer.h.*.attn.c_proj": "rowwise", "transformer.h.*.mlp.c_fc": "colwise",
             "transformer.h.*.mlp.c_proj": "rowwise", "lm_head": "colwise_gather_output"}




@pytest.fixture(autouse=True)
def _fresh_warnings() -> Iterator[None]:
    """Fallback warnings come once per op and process: these tests neither eat the
    warnings other tests expect nor miss their own."""
    saved = set(registry._WARNED)
    registry._WARNED.clear()
    yield
    registry._WARNED.clear()
    registry._WARNED.update(saved)


def llama() -> Any:
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def gpt2() -> Any:
    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                          n_positions=64))  # dropout 0.1 (HF's default)


def mixtral() -> Any:
    return T.MixtralForCausalLM(T.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2))


MODELS: dict[str, tuple[Callable[[], Any], dict[str, str] | None]] = {
    "llama": (llama, None), "gpt2": (gpt2, GPT2_PLAN), "mixtral": (mixtral, None)}


def _planned(which: str, fsdp: bool) -> tuple[Any, Any]:
    build, extra = MODELS[which]
    torch.manual_seed(0)
    ref = build()
    model = parallelize_module(copy.deepcopy(ref), MESH, hf_plan(ref, extra), axis="tp")
    if fsdp:
        for layer in (model.transformer.h if which == "gpt2" else model.model.layers):
            fully_shard(layer, MESH, axis="dp")
        fully_shard(model, MESH, axis="dp")
    return model, ref


def _fallbacks(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``fn()`` and the fallback warnings it raised."""
    registry._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught
                 if issubclass(w.category, sw.ShardwiseFallbackWarning)]


def _value(t: Any) -> torch.Tensor:
    return t.detach().to_torch() if isinstance(t, sw.Tensor) else t.detach()


@pytest.mark.parametrize("which", ["llama", "gpt2", "mixtral"])
def test_tp_x_fsdp_training_matches_torch_without_fallback(which: str) -> None:
    model, ref = _planned(which, fsdp=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def steps() -> list[tuple[float, float]]:
        losses = []
        for step in range(2):
            ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(step))
            torch.manual_seed(10 + step)  # dropout (GPT-2) draws the same noise as torch
            loss = model(sw.tensor(ids, sharding=DATA), labels=sw.tensor(ids, sharding=DATA)).loss
            torch.manual_seed(10 + step)
            rloss = ref(ids, labels=ids).loss
            for o, lo in ((opt, loss), (ropt, rloss)):
                o.zero_grad()
                lo.backward()
                o.step()
            losses.append((float(_value(loss)), float(rloss.detach())))
        return losses

    with sw.strict():  # a fallback is an error
        losses, fell = _fallbacks(steps)
    assert fell == []
    for got, want in losses:
        assert abs(got - want) <= 1e-5 * abs(want), losses
    params = dict(model.named_parameters())
    errs = {name: float((_value(params[name]) - q.detach()).abs().max())
            for name, q in ref.named_parameters()}
    # AdamW's first steps move each weight by ~lr whatever its gradient's size, so a
    # near-zero gradient rounded differently (TP sums in another order) moves it a
    # little differently: 2% of one step bounds that (losses above are to 1e-5)
    assert max(errs.values()) <= 0.02 * 1e-2, errs
    up = {"gpt2": "transformer.h.0.mlp.c_fc.weight", "llama": "model.layers.0.mlp.up_proj.weight",
          "mixtral": "model.layers.0.mlp.experts.gate_up_proj"}[which]
    assert set(model.get_parameter(up).dist_layout.sharded_axes) == {0, 1}  # tp and dp


@pytest.mark.parametrize("which", ["llama", "gpt2", "mixtral"])
def test_generate_gives_torchs_tokens(which: str) -> None:
    model, ref = _planned(which, fsdp=False)
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(9))
    for cache in (True, False):
        torch.manual_seed(7)
        got, fell = _fallbacks(lambda c=cache: model.generate(  # type: ignore[misc]
            ids, max_new_tokens=4, do_sample=False, use_cache=c))
        torch.manual_seed(7)
        want = ref.generate(ids, max_new_tokens=4, do_sample=False, use_cache=cache)
        assert torch.equal(_value(got), want), (cache, _value(got), want)
        assert fell == [], fell


def test_moe_forward_matches_torch() -> None:
    """Mixtral (experts as stacked parameters, sharded by the plan's parameter entries:
    gate_up column-parallel, down row-parallel on ``torch._grouped_mm``'s rule):
    forward and gradients equal torch's, with no fallback."""
    model, ref = _planned("mixtral", fsdp=False)
    assert isinstance(hf_plan(ref)["model.layers.0.mlp.experts"], ShardParameters)
    assert model.get_parameter("model.layers.0.mlp.experts.down_proj").placements[1] == \
        Sharded(2)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    with sw.strict():
        out = model(sw.tensor(ids, sharding=DATA), labels=sw.tensor(ids, sharding=DATA))
        out.loss.backward()
    want = ref(ids, labels=ids)
    torch.testing.assert_close(_value(out.logits), want.logits.detach(), rtol=1e-5, atol=1e-5)
    want.loss.backward()
    params = dict(model.named_parameters())
    for name, q in ref.named_parameters():
        assert q.grad is not None
        torch.testing.assert_close(_value(params[name].grad), q.grad, rtol=1e-4, atol=1e-6,
                                   msg=name)


def test_hf_plan_reads_the_models_own_plan() -> None:
    plan = {name: repr(style) for name, style in hf_plan(llama()).items()}
    assert plan["model.layers.1.self_attn.k_proj"] == repr(ColwiseParallel())
    assert plan["model.layers.0.mlp.down_proj"] == repr(RowwiseParallel())
    assert plan["lm_head"] == repr(ColwiseParallel(output_layouts=Replicated()))
    assert plan["model.embed_tokens"] == repr(RowwiseParallel())  # the vocabulary
    assert len(plan) == 2 * 7 + 2
    assert not any("*" in name for name in plan)
    with pytest.raises(sw.ShardingError, match="ships no tensor-parallel plan"):
        hf_plan(gpt2())
    with pytest.raises(sw.ShardingError, match=r"'rowwise_sideways'.*Known styles: .*colwise"):
        hf_plan(llama(), {"model.layers.*.mlp.up_proj": "rowwise_sideways"})


def test_conv1d_is_a_transposed_linear() -> None:
    conv = gpt2().transformer.h[0].mlp.eval()  # no dropout
    x = torch.randn(2, 3, 64)
    want = conv(x)
    parallelize_module(conv, sw.DeviceMesh.cpu(2, "tp"),
                       {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()})
    assert conv.c_fc.weight.placements == (Sharded(1),)  # [in, out]: out features
    assert conv.c_proj.weight.placements == (Sharded(0),)  # in features
    torch.testing.assert_close(_value(conv(x)), want.detach(), rtol=1e-5, atol=1e-6)


def test_tied_and_distinct_parameters_tell_their_storage() -> None:
    """What transformers' save_pretrained asks first (a gathered copy per call made
    every parameter look shared before): tied weights share a storage, others do not."""
    torch.manual_seed(0)
    model = parallelize_module(gpt2(), MESH, hf_plan(gpt2(), GPT2_PLAN), axis="tp")
    from transformers.pytorch_utils import id_tensor_storage

    seen: dict[Any, list[str]] = {}
    for name, t in model.state_dict().items():
        seen.setdefault(id_tensor_storage(t), []).append(name)
    assert [names for names in seen.values() if len(names) > 1] == [
        ["transformer.wte.weight", "lm_head.weight"]]


@pytest.mark.parametrize("how", ["plain", "model_state_dict", "full_state_dict"])
@pytest.mark.parametrize("which", ["llama", "gpt2", "mixtral"])
def test_save_pretrained_loads_into_a_plain_model(which: str, how: str, tmp_path: Any) -> None:
    """A parallelized model (TP x FSDP) saved with plain ``save_pretrained(d)`` (the
    gather that parallelize_module / fully_shard install), with its own shardwise state
    dict, or with the gathered one, loads with ``from_pretrained`` into a plain model with
    equal weights (GPT-2's tied head, Mixtral's stacked experts, which transformers writes
    per expert and stacks back), and the file holds the names and values the plain model's
    own save_pretrained writes (the tied head dropped, as transformers does)."""
    from safetensors.torch import load_file

    model, ref = _planned(which, fsdp=True)
    given = {"plain": None, "model_state_dict": model.state_dict(),
             "full_state_dict": sw.checkpoint.full_state_dict(model)}[how]
    model.save_pretrained(tmp_path / "got", state_dict=given)
    ref.save_pretrained(tmp_path / "want")
    loaded = type(ref).from_pretrained(tmp_path / "got")
    want = ref.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    written = load_file(tmp_path / "got" / "model.safetensors")
    expected = load_file(tmp_path / "want" / "model.safetensors")
    assert set(written) == set(expected)
    for name, value in expected.items():
        assert torch.equal(written[name], value) and written[name].dtype == value.dtype, name
    if which == "gpt2":
        assert "lm_head.weight" not in written  # tied to transformer.wte.weight


def test_save_pretrained_after_training_writes_the_trained_values(tmp_path: Any) -> None:
    """After an optimizer step (parameters updated in place), plain ``save_pretrained``
    writes the updated global values, equal to those of single-device torch trained alike."""
    model, ref = _planned("llama", fsdp=True)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    for m, x in ((model, sw.tensor(ids, sharding=DATA)), (ref, ids)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(x, labels=x).loss.backward()
        opt.step()
    model.save_pretrained(tmp_path)
    loaded = type(ref).from_pretrained(tmp_path)
    trained = {name: _value(p) for name, p in model.named_parameters()}
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, trained[name]), name
        torch.testing.assert_close(value, ref.state_dict()[name], rtol=1e-4, atol=1e-5)


def test_only_models_that_save_pretrained_get_the_gather() -> None:
    """parallelize_module / fully_shard install the gathering save_pretrained on the
    module they lay out, only where one taking ``state_dict`` exists; deepcopy rebinds it."""
    model, _ = _planned("gpt2", fsdp=True)
    assert "save_pretrained" in vars(model)
    assert "save_pretrained" not in vars(model.transformer.h[0])
    twin = copy.deepcopy(model)
    assert twin.save_pretrained.__self__ is twin
    mlp = parallelize_module(torch.nn.Sequential(torch.nn.Linear(4, 4)),
                             sw.DeviceMesh.cpu(2, "tp"), {"0": ColwiseParallel()})
    assert "save_pretrained" not in vars(mlp)
