"""Hugging Face transformers bodies on real Gloo processes (see ``harness.py``): a tiny
Llama parallelized on a process mesh (``hf_plan`` on tp, ``fully_shard`` on dp, or
both) is saved with ``save_pretrained(d, state_dict=full_state_dict(model),
is_main_process=rank == 0)`` and with plain ``save_pretrained(d)`` (every rank gathers,
rank 0 writes), and rank 0's ``from_pretrained`` loads a plain model with the
single-device model's weights from both;
``generate()`` gives torch's tokens on every rank. A tiny Mixtral's experts run on
``torch._grouped_mm``'s rule over each process's blocks. Every rank builds the
single-device model itself from the same seed.

The folder the checkpoint goes to is ``$SHARDWISE_HF_TEST_DIR`` (the test sets it;
spawned ranks inherit it)."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
import transformers as T  # the `hf` test extra

import shardwise as sw
import shardwise.distributed as sd
from shardwise.parallel import fully_shard, hf_plan, parallelize_module


def _llama() -> Any:
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def _save_load_generate(model: Any, ref: Any, folder: str) -> None:
    rank = sd.process_index()
    path = Path(os.environ["SHARDWISE_HF_TEST_DIR"]) / folder
    with sw.strict():  # gathering the state dict and generating need no fallback
        state = sw.checkpoint.full_state_dict(model)  # a collective: every rank
        for name, value in ref.state_dict().items():  # every rank holds the global values
            assert torch.equal(state[name], value), (rank, name)
        # (rank 0's save_pretrained edits the dict it is given: compared before)
        model.save_pretrained(path, state_dict=state, is_main_process=rank == 0)
        model.save_pretrained(path.with_name(folder + "_plain"))  # gathers itself
        ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(9))
        got = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=True)
        got = got.to_torch() if isinstance(got, sw.Tensor) else got
    want = ref.generate(ids, max_new_tokens=4, do_sample=False, use_cache=True)
    assert torch.equal(got, want), (rank, got, want)
    sd.barrier("hf checkpoint written")
    if rank == 0:
        for where in (path, path.with_name(folder + "_plain")):
            loaded = type(ref).from_pretrained(where)
            want_sd, got_sd = ref.state_dict(), loaded.state_dict()
            assert set(got_sd) == set(want_sd), where
            for name, value in want_sd.items():
                assert torch.equal(got_sd[name], value), (where, name)
    sd.barrier("hf checkpoint read")


def body_tp_llama_saves_and_generates(world: int) -> None:
    ref = _llama()
    mesh = sw.DeviceMesh.cpu(world, "tp")
    model = parallelize_module(copy.deepcopy(ref), mesh, hf_plan(ref), axis="tp")
    assert model.get_parameter("model.layers.0.mlp.up_proj.weight").placements == (
        sw.Sharded(0),)
    _save_load_generate(model, ref, "tp")


def body_fsdp_llama_saves_and_generates(world: int) -> None:
    ref = _llama()
    mesh = sw.DeviceMesh.cpu(world, "dp")
    model = copy.deepcopy(ref)
    for layer in model.model.layers:
        fully_shard(layer, mesh, axis="dp")
    fully_shard(model, mesh, axis="dp")
    _save_load_generate(model, ref, "fsdp")


def body_tp_mixtral_on_grouped_mm_blocks(world: int) -> None:
    """Mixtral's experts on ``torch._grouped_mm``'s rule where each process holds only
    its blocks (gate_up column-parallel, down row-parallel): loss, gradients and
    greedy tokens equal torch's, with no fallback."""
    torch.manual_seed(0)
    ref = T.MixtralForCausalLM(T.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2))
    mesh = sw.DeviceMesh.cpu(world, "tp")
    model = parallelize_module(copy.deepcopy(ref), mesh, hf_plan(ref), axis="tp")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    with sw.strict():
        out = model(ids, labels=ids)
        out.loss.backward()
        got = model.generate(ids[:, :5], max_new_tokens=4, do_sample=False)
        got = got.to_torch() if isinstance(got, sw.Tensor) else got
        grads = {name: p.grad.to_torch() if isinstance(p.grad, sw.Tensor) else p.grad
                 for name, p in model.named_parameters()}
    want = ref(ids, labels=ids)
    want.loss.backward()
    loss = out.loss.detach()
    torch.testing.assert_close(loss.to_torch() if isinstance(loss, sw.Tensor) else loss,
                               want.loss.detach(), rtol=1e-5, atol=1e-6)
    for name, q in ref.named_parameters():
        torch.testing.assert_close(grads[name], q.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert torch.equal(got, ref.generate(ids[:, :5], max_new_tokens=4, do_sample=False))


BODIES = [name for name in dir() if name.startswith("body_")]


def four_tp_x_fsdp_llama_saves_and_generates(world: int) -> None:
    """The README's setup on 4 processes: hf_plan on tp x fully_shard on dp (2x2)."""
    ref = _llama()
    mesh = sw.DeviceMesh.cpu((world // 2, 2), ("dp", "tp"))
    model = parallelize_module(copy.deepcopy(ref), mesh, hf_plan(ref), axis="tp")
    for layer in model.model.layers:
        fully_shard(layer, mesh, axis="dp")
    fully_shard(model, mesh, axis="dp")
    up = model.get_parameter("model.layers.0.mlp.up_proj.weight")
    assert set(up.dist_layout.sharded_axes) == {0, 1}  # tp and dp
    _save_load_generate(model, ref, "tp_x_fsdp")


BODIES_4 = [name for name in dir() if name.startswith("four_")]
