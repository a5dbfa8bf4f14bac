"""Op conformance against torch's OpInfo database: every op, as torch computes it.

Every op of ``op_db`` (CPU) runs on shardwise Tensors over a simulated 4-device mesh,
each tensor argument Sharded on its first dim, on its last dim and Replicated:
forward (float32, int64, bool), ``loss.backward()`` and ``torch.autograd.grad``,
compared with plain torch (values, dtype, shape, NaNs, inputs after the call). The
rules of the run and of the comparison live in :mod:`tests.helpers.opinfo`.

Invariants:

- :data:`EXPECTED` lists each op's modes that do not run on sharding rules, with the
  outcome they reach (``fallback``, ``refused``, ``graph-lost``); an op or mode not
  listed runs on rules. It is checked both ways: a mode that does worse fails, and a
  mode that does better fails too, asking to remove it from the list, so the list
  only shrinks.
- ``wrong`` and ``internal`` are never in the list: a wrong value or an exception
  from inside shardwise always fails.
- Every op listed as ``refused`` has its reason in :data:`REFUSALS` (why a distributed
  value cannot honour that sample), and every reason a refusal listed.
- ``graph-lost`` (``torch.autograd.grad`` returns None: it has no handler and runs
  through the fallback on gathered copies) is listed only until that path keeps the
  graph.

Regenerate the list after moving ops to rules, and print the summary table (ops per
outcome, mode and placement):
``PYTHONPATH=src:. python -m tests.helpers.opinfo --write``. Running this module
prints the same summary at its end.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers import opinfo

OPS = opinfo.all_ops()
_RESULTS: dict[str, opinfo.Outcome] = {}
_REGENERATE = "PYTHONPATH=src:. python -m tests.helpers.opinfo --write"

EXPECTED: dict[str, str] = {
    # --- BEGIN EXPECTED (generated) ---
    "_batch_norm_with_update": "fwd=fallback bwd=fallback grad=fallback",
    "_segment_reduce.lengths": "fwd=fallback bwd=fallback grad=fallback",
    "_segment_reduce.offsets": "fwd=fallback bwd=fallback grad=fallback",
    "argwhere": "fwd=fallback int=fallback bool=fallback",
    "as_strided.partial_views": "fwd=refused bwd=refused int=refused",
    "bincount": "fwd=fallback int=fallback",
    "hash_tensor": "fwd=fallback int=fallback bool=fallback",
    "histogram": "fwd=fallback",
    "histogramdd": "fwd=fallback",
    "istft": "fwd=fallback",
    "item": "fwd=fallback int=fallback bool=fallback",
    "linspace.tensor_overload": "fwd=fallback int=fallback",
    "logspace.tensor_overload": "fwd=fallback int=fallback",
    "masked.amax": "int=fallback",
    "masked.amin": "int=fallback",
    "masked.argmax": "int=fallback",
    "masked.argmin": "int=fallback",
    "masked.logsumexp": "int=fallback",
    "masked_select": "fwd=fallback bwd=fallback grad=fallback int=fallback bool=fallback",
    "max_pool2d_with_indices_backward": "fwd=fallback bwd=fallback grad=fallback",
    "new_empty_strided": "fwd=fallback int=fallback bool=fallback",
    "nn.functional.cosine_similarity": "fwd=fallback bwd=fallback",
    "nn.functional.ctc_loss": "fwd=fallback bwd=fallback grad=fallback",
    "nn.functional.embedding": "fwd=refused",
    "nn.functional.embedding_bag": "fwd=refused",
    "nn.functional.multi_head_attention_forward": "fwd=fallback bwd=fallback grad=fallback",
    "nn.functional.normalize": "fwd=fallback bwd=fallback",
    "nn.functional.pdist": "fwd=fallback bwd=fallback grad=fallback",
    "nonzero": "fwd=fallback int=fallback bool=fallback",
    "nonzero_static": "fwd=fallback int=fallback bool=fallback",
    "pca_lowrank": "fwd=fallback bwd=fallback grad=fallback",
    "renorm": "fwd=fallback bwd=fallback grad=fallback",
    "resize_": "fwd=refused int=refused bool=refused",
    "sparse.mm.reduce": "fwd=fallback bwd=fallback grad=fallback",
    "sparse.sampled_addmm": "fwd=fallback bwd=refused grad=refused",
    "stft": "fwd=fallback bwd=fallback",
    "svd_lowrank": "fwd=fallback bwd=fallback grad=fallback",
    "to_sparse": "fwd=fallback bwd=fallback grad=fallback int=fallback bool=fallback",
    "torch._scaled_mm": "fwd=fallback",
    "torch._scaled_mm_v2": "fwd=fallback",
    "unique": "fwd=fallback int=fallback bool=fallback",
    "unique_consecutive": "fwd=fallback int=fallback bool=fallback",
    # --- END EXPECTED ---
}


#: why each op EXPECTED lists as ``refused`` is refused (what the samples ask for)
REFUSALS: dict[str, str] = {
    "as_strided.partial_views":
        "torch's samples read storage around a view (offset 0 is before base[5:15], 10 "
        "past the ten elements of its copy): a Tensor's storage is its own elements",
    "nn.functional.embedding": "max_norm renormalizes rows of the table in place",
    "nn.functional.embedding_bag": "max_norm renormalizes rows of the table in place",
    "resize_": "a Tensor keeps the shape and layout it was made with",
    "sparse.sampled_addmm": "backward through a sparse CSR result: torch cannot sum CSR "
                            "blocks",
}


def _rank(outcome: str) -> int:
    return opinfo.OUTCOMES.index(outcome)


@pytest.fixture(scope="module", autouse=True)
def _print_summary(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if _RESULTS and reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():  # past pytest's output capture
            reporter.write_sep("-", f"OpInfo conformance ({len(_RESULTS)} ops)")
            reporter.write_line(opinfo.summary(_RESULTS))


def test_the_list_holds_known_ops_and_allowed_outcomes() -> None:
    for name, entry in EXPECTED.items():
        assert name in OPS, f"{name} is no OpInfo op: remove it from EXPECTED"
        for mode, outcome in opinfo.parse(entry).items():
            assert mode in opinfo.MODES, f"EXPECTED[{name!r}]: no mode {mode!r}"
            assert outcome in opinfo.ALLOWED and outcome != "rule", (
                f"EXPECTED[{name!r}] lists {mode}={outcome}: only fallback, refused and "
                "graph-lost may be listed (a wrong value or internal error is a bug to fix)")


def test_every_refusal_has_its_reason() -> None:
    refused = {name for name, entry in EXPECTED.items()
               if "refused" in opinfo.parse(entry).values()}
    assert refused == set(REFUSALS), (
        f"give REFUSALS a reason for {sorted(refused - set(REFUSALS))}, and remove "
        f"{sorted(set(REFUSALS) - refused)}")


def test_every_op_is_covered() -> None:
    assert len(OPS) >= 600
    assert sorted(OPS) == sorted(opinfo.key(op) for op in opinfo.op_db
                                 if op.supported_dtypes("cpu"))


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_matches_torch(name: str) -> None:
    result = opinfo.run_op(OPS[name])
    _RESULTS[name] = result
    got, want = result.by_mode(), opinfo.parse(EXPECTED.get(name, ""))
    if not got:  # the jiterator ops are CUDA only: torch runs no sample of them on CPU
        assert name.startswith("jiterator_"), f"{name}: torch rejected every sample"
        return
    assert "fwd" in got, f"{name}: no forward sample ran (torch rejected every one)"
    problems = []
    for mode in opinfo.MODES:
        listed = want.get(mode, "rule")
        if mode not in got:
            if mode in want:
                problems.append(f"{mode} did not run: remove '{mode}={listed}' from "
                                f"EXPECTED[{name!r}]")
            continue
        outcome = got[mode]
        if outcome in ("wrong", "internal"):
            problems.append(f"{mode}: {outcome}: {result.note(mode)}")
        elif _rank(outcome) > _rank(listed):
            problems.append(f"{mode}: {outcome}, listed as {listed}: {result.note(mode)}")
        elif _rank(outcome) < _rank(listed):
            fix = (f"change it to '{mode}={outcome}'" if outcome != "rule"
                   else f"remove '{mode}={listed}' from EXPECTED[{name!r}]")
            problems.append(f"{mode} does better than listed ({listed} -> {outcome}): {fix}"
                            f" (or regenerate the list: {_REGENERATE})")
    assert not problems, f"{name}:\n  " + "\n  ".join(problems)
