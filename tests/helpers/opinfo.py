"""torch's OpInfo database run on shardwise Tensors, each op classified against torch.

Every op of ``op_db`` (CPU) runs on its OpInfo samples with every tensor argument a
shardwise Tensor on a simulated 4-device mesh, laid out ``S0`` (Sharded on its first
dim), ``S-1`` (Sharded on its last dim) or ``R`` (Replicated); 0-d tensors are always
Replicated. The same call runs on plain torch and the two are compared.

Invariants:

- Inputs are the samples' tensors as torch gives them: views with storage offsets,
  non-contiguous strides, 0-d and size-0 tensors, and the samples' own arguments
  (a left-out ``dim`` stays left out). A Tensor is built from each one of two ways,
  and torch runs on the tensor that Tensor holds: ``copy`` (``shardwise.tensor``,
  which copies as torch's ``clone`` does: strides kept, a storage of its own; torch
  runs on that clone) and ``shared`` (``shardwise.from_local`` of the blocks cut from
  the sample's tensor, sharing its memory: torch runs on the tensor itself, offsets
  and strides included). ``copy`` runs every sample; ``shared`` the samples with a
  view or a non-contiguous tensor (the only ones where the two hold different
  memory).
- Execution paths: ``fwd``, ``int`` and ``bool`` run on Tensors without autograd
  (``copy``: held whole; ``shared``: blocks run on their derived whole); ``bwd`` on
  block leaves (``requires_grad=True``: autograd per block) and ``grad`` on whole
  leaves (``.requires_grad_()`` on a Tensor held whole) for ``copy``, on block
  leaves for ``shared``.
- Samples: per mode the first :data:`SAMPLES` on every placement; then, in ``fwd``
  and ``bwd``, each later one among the first :data:`SCAN` that brings a feature none
  before it had (:func:`features`: another call signature, a 0-d, size-0,
  non-contiguous or viewed tensor) on one Sharded placement (S0 and S-1 in turn).
- Modes: ``fwd`` (float32, or the op's first dtype without float32), ``bwd``
  (``loss.backward()``) and ``grad`` (``torch.autograd.grad``) for ops that support
  autograd, ``int`` (int64) and ``bool`` forward for ops that support those dtypes.
  The loss is ``sum((out * w).sum())`` over the floating outputs, ``w`` a fixed
  torch tensor (Replicated), so every output element carries its own weight.
- Outcomes, best first: ``rule`` (torch's value, no ShardwiseFallbackWarning),
  ``fallback`` (torch's value through the gathered fallback), ``refused`` (a
  ShardingError naming the op), ``graph-lost`` (``torch.autograd.grad`` returned None
  for an input torch differentiates: it has no handler and runs through the
  fallback, on gathered copies outside the graph; the known gap another change
  closes), ``wrong`` (a value, dtype, shape or NaN differs, or inputs
  changed differently) and ``internal`` (any other exception from shardwise). The
  last two are never acceptable; a sample torch itself rejects is skipped.
- Values: integer and bool results bitwise, and the results of the fallback (torch's
  own call on the gathered operands); floating results of rules and all gradients
  (accumulation order may differ) within ``rtol=1e-4, atol=1e-5``; NaNs in the same
  places, always. Inputs are compared after the call too (in-place writes). Uninitialized results
  (``empty``...) compare shape, dtype and layout only. Random ops run under the
  same seed on both sides.
- Deterministic: the samples of an op are drawn after seeding torch with a hash of
  its name, so the table is the same from run to run.
- One op's outcome per mode is its worst over samples and placements; the summary
  counts ops per mode and placement.

Regenerate the expected-outcome table in ``tests/ops/test_opinfo.py`` and print the
summary with ``python -m tests.helpers.opinfo --write`` (from the repository root,
``PYTHONPATH=src:.``); ``--summary`` prints without writing; op names after the
flags limit the run (``--summary add,index_select``).
"""

from __future__ import annotations

import sys
import time
import warnings
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.opinfo.core import OpInfo

import shardwise as sw
from shardwise import DeviceMesh
from shardwise.ops import registry
from shardwise.sharding.errors import ShardingError
from shardwise.sharding.layout import Layout
from tests.helpers.shardcheck import block

MESH = DeviceMesh.cpu(4, "x")
PLACEMENTS = ("S0", "S-1", "R")
MODES = ("fwd", "bwd", "grad", "int", "bool")
OUTCOMES = ("rule", "fallback", "refused", "graph-lost", "wrong", "internal")
#: outcomes the expected table may hold; ``graph-lost`` only until autograd.grad
#: through the fallback keeps the graph (then the table shrinks)
ALLOWED = ("rule", "fallback", "refused", "graph-lost")
#: samples per op and placement, per mode (every op is covered; more cost CI time)
SAMPLES = {"fwd": 3, "bwd": 2, "grad": 1, "int": 2, "bool": 1}
#: samples looked at per mode for a new feature (the later ones run on one placement):
#: the forward and block leaves; more cost CI time
SCAN = {"fwd": 12, "bwd": 12}
PATHS = ("copy", "shared")
#: ops whose results are uninitialized memory: shape, dtype and layout only
UNINITIALIZED = frozenset({"empty", "empty_like", "new_empty", "new_empty_strided",
                           "empty_strided", "empty_permuted"})
RTOL, ATOL = 1e-4, 1e-5
TEST_MODULE = Path(__file__).resolve().parent.parent / "ops" / "test_opinfo.py"
BEGIN, END = "# --- BEGIN EXPECTED (generated) ---", "# --- END EXPECTED ---"


def key(op: OpInfo) -> str:
    """An op's name in the table: ``name`` or ``name.variant``."""
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def all_ops() -> dict[str, OpInfo]:
    """Every OpInfo op that runs on CPU, by key."""
    return {key(op): op for op in op_db if op.supported_dtypes("cpu")}


@dataclass
class Outcome:
    """One op's results: per (mode, placement) the worst outcome and its first note."""
    worst: dict[tuple[str, str], str] = field(default_factory=dict)
    notes: dict[tuple[str, str], str] = field(default_factory=dict)
    seconds: float = 0.0

    def add(self, mode: str, placement: str, outcome: str, note: str = "") -> None:
        k = (mode, placement)
        if OUTCOMES.index(outcome) > OUTCOMES.index(self.worst.get(k, "rule")) or (
                k not in self.worst):
            self.worst[k] = outcome
            if note:
                self.notes[k] = note

    def by_mode(self) -> dict[str, str]:
        """The worst outcome of each mode that ran, over placements."""
        out: dict[str, str] = {}
        for (mode, _), o in self.worst.items():
            if OUTCOMES.index(o) >= OUTCOMES.index(out.get(mode, "rule")):
                out[mode] = o
        return out

    def note(self, mode: str) -> str:
        worst = self.by_mode().get(mode)
        return next((f"{p}: {self.notes[(m, p)]}" for (m, p), o in self.worst.items()
                     if m == mode and o == worst and (m, p) in self.notes), "")


# --- the two sides -------------------------------------------------------------------------
def _layout(t: torch.Tensor, placement: str) -> Layout:
    if t.ndim == 0 or placement == "R":
        return Layout.replicated(MESH, t.ndim)
    d = 0 if placement == "S0" else t.ndim - 1
    return Layout(MESH, tuple((0,) if e == d else () for e in range(t.ndim)), (None,))


def _plain(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor and t.layout == torch.strided and not t.is_quantized


def _map(x: Any, f: Callable[[torch.Tensor], Any]) -> Any:
    """``x`` with every plain strided torch tensor (in lists, tuples, dicts) mapped."""
    if isinstance(x, torch.Tensor):
        return f(x) if _plain(x) else x
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(_map(v, f) for v in x)
    if isinstance(x, dict):
        return {k: _map(v, f) for k, v in x.items()}
    return x


def _copy(t: torch.Tensor) -> torch.Tensor:
    """What ``shardwise.tensor`` holds of ``t``: a fresh leaf, torch's clone (strides
    kept, a storage of its own), with ``t``'s requires_grad."""
    c = t.detach().clone()
    return c.requires_grad_() if t.requires_grad else c


def _twin(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the sample gives it, in memory of its own: a copy of its whole storage
    viewed with its size, strides and storage offset (a fresh leaf, with ``t``'s
    requires_grad), so a write into one sample's run never reaches another's."""
    if t.is_conj() or t.is_neg():  # lazy bits a storage copy would drop
        return _copy(t)
    d = t.detach()
    c = torch.empty(0, dtype=t.dtype, device=t.device)
    c.set_(d.untyped_storage().clone(), d.storage_offset(), d.size(), d.stride())
    return c.requires_grad_() if t.requires_grad else c


def _reference(path: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return _copy if path == "copy" else _twin


def _to_sw(placement: str, path: str, whole_leaf: bool = False
           ) -> Callable[[torch.Tensor], Any]:
    """The Tensor a sample's tensor becomes on ``path`` (module doc); ``whole_leaf``:
    a leaf requiring grad held whole (``.requires_grad_()``), not as block leaves."""
    def f(t: torch.Tensor) -> Any:
        lay, grad = _layout(t, placement), t.requires_grad
        if path == "shared":
            mine = _twin(t).detach()
            blocks = [mine[block(MESH, lay, t.shape, k)] for k in range(MESH.num_devices)]
            return sw.from_local(blocks, lay, tuple(t.shape), requires_grad=grad)
        if whole_leaf and grad:
            return sw.tensor(t.detach(), sharding=lay).requires_grad_()
        return sw.tensor(t.detach(), sharding=lay, requires_grad=grad)
    return f


def _back(x: Any) -> Any:
    """Results as plain torch values (shardwise Tensors gathered)."""
    if isinstance(x, sw.Tensor):
        return x.to_torch().detach()
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, (list, tuple)):
        return [_back(v) for v in x]
    if isinstance(x, dict):
        return [_back(v) for _, v in sorted(x.items())]
    return x


def _leaves(x: Any) -> list[Any]:
    out: list[Any] = []
    _map(x, lambda t: out.append(t) if t.requires_grad else None)
    return out


def _sw_leaves(x: Any) -> list[Any]:
    if isinstance(x, sw.Tensor):
        return [x] if x.requires_grad else []
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return [t for v in x for t in _sw_leaves(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _sw_leaves(v)]
    return []


def _tensors(x: Any) -> list[Any]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


# --- comparison ------------------------------------------------------------------------------
def diff(got: Any, exp: Any, *, exact: bool, uninitialized: bool = False) -> str | None:
    """None when ``got`` is ``exp`` (see the module's rules), else what differs.

    >>> diff(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, float("nan")]), exact=True)
    >>> diff(torch.tensor([1, 2]), torch.tensor([1.0, 2.0]), exact=False)
    'dtype torch.int64, torch expects torch.float32'
    """
    if isinstance(exp, torch.Tensor) or isinstance(got, torch.Tensor):
        if not (isinstance(exp, torch.Tensor) and isinstance(got, torch.Tensor)):
            return f"{type(got).__name__}, torch expects {type(exp).__name__}"
        if got.dtype != exp.dtype:
            return f"dtype {got.dtype}, torch expects {exp.dtype}"
        if got.shape != exp.shape:
            return f"shape {list(got.shape)}, torch expects {list(exp.shape)}"
        if got.layout != exp.layout:
            return f"layout {got.layout}, torch expects {exp.layout}"
        if uninitialized or exp.layout != torch.strided:
            return None
        exact = exact or not (exp.is_floating_point() or exp.is_complex())
        if exact:
            same = got.eq(exp) | (got.isnan() & exp.isnan() if exp.is_floating_point()
                                  or exp.is_complex() else got.eq(exp))
            return None if bool(same.all()) else _first_diff(got, exp, "bitwise")
        try:
            torch.testing.assert_close(got, exp, rtol=RTOL, atol=ATOL, equal_nan=True)
        except AssertionError:
            return _first_diff(got, exp, "allclose")
        return None
    if isinstance(exp, (list, tuple)) and isinstance(got, (list, tuple)):
        if len(got) != len(exp):
            return f"{len(got)} results, torch gives {len(exp)}"
        for i, (g, e) in enumerate(zip(got, exp)):
            d = diff(g, e, exact=exact, uninitialized=uninitialized)
            if d:
                return f"[{i}] {d}"
        return None
    if isinstance(exp, float) and isinstance(got, float) and exp != exp and got != got:
        return None
    if type(got) is not type(exp) or (got != exp and not uninitialized):
        return f"{got!r}, torch gives {exp!r}"
    return None


def _first_diff(got: torch.Tensor, exp: torch.Tensor, how: str) -> str:
    g, e = got.reshape(-1), exp.reshape(-1)
    bad = ~(g.eq(e) | (g.isnan() & e.isnan()) if e.is_floating_point() else g.eq(e))
    i = int(bad.nonzero()[0]) if bool(bad.any()) else 0
    return f"values ({how}) at flat index {i}: {g[i].item()!r}, torch gives {e[i].item()!r}"


# --- one call ------------------------------------------------------------------------------
def _run_fwd(op: OpInfo, s: Any, placement: str, path: str, uninit: bool
             ) -> tuple[str, str]:
    args = (s.input, *s.args)
    ref = _reference(path)
    ref_args, ref_kwargs = _map(args, ref), _map(s.kwargs, ref)
    torch.manual_seed(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exp = op.op(*ref_args, **ref_kwargs)
    except Exception:
        return "skip", ""
    to_sw = _to_sw(placement, path)
    sw_args, sw_kwargs = _map(args, to_sw), _map(s.kwargs, to_sw)
    return _call(lambda: op.op(*sw_args, **sw_kwargs), exp, True, uninit,
                 inputs=lambda: (_back([sw_args, sw_kwargs]), _back([ref_args, ref_kwargs])))


def _call(f: Callable[[], Any], exp: Any, fallback_exact: bool, uninit: bool,
          inputs: Callable[[], tuple[Any, Any]] | None = None) -> tuple[str, str]:
    registry._WARNED.clear()  # the fallback warns once per op name and process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        try:
            got = _back(f())
        except ShardingError as e:
            return "refused", f"{type(e).__name__}: {_short(e)}"
        except Exception as e:
            return "internal", f"{type(e).__name__}: {_short(e)}"
    fell_back = any(issubclass(w.category, sw.ShardwiseFallbackWarning) for w in caught)
    exact = fell_back and fallback_exact
    d = diff(got, exp, exact=exact, uninitialized=uninit)
    if d is None and inputs is not None:
        d = diff(*inputs(), exact=exact, uninitialized=uninit)
        d = d and f"inputs after the call: {d}"
    if d:
        return "wrong", d
    return ("fallback" if fell_back else "rule"), ""


def _short(e: BaseException) -> str:
    return " ".join(str(e).split())[:200]


def _weights(out: list[Any]) -> list[torch.Tensor | None]:
    """A fixed weight per floating output (None for the others)."""
    ws: list[torch.Tensor | None] = []
    for i, o in enumerate(out):
        if o.is_floating_point() and o.requires_grad:
            g = torch.Generator().manual_seed(i)
            ws.append(torch.randn(o.shape, generator=g, dtype=o.dtype))
        else:
            ws.append(None)
    return ws


def _loss(out: list[Any], ws: list[torch.Tensor | None]) -> Any:
    terms = [(o * w).sum() for o, w in zip(out, ws) if w is not None]
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return total


def _run_bwd(op: OpInfo, s: Any, placement: str, path: str, mode: str) -> tuple[str, str]:
    args = (s.input, *s.args)
    ref = _reference(path)
    ref_args, ref_kwargs = _map(args, ref), _map(s.kwargs, ref)
    ref_leaves = _leaves([ref_args, ref_kwargs])
    if not ref_leaves:
        return "skip", ""
    torch.manual_seed(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = _tensors(op.op(*ref_args, **ref_kwargs))
            ws = _weights(out)
            if all(w is None for w in ws):
                return "skip", ""
            loss = _loss(out, ws)
            exp = list(torch.autograd.grad(loss, ref_leaves, allow_unused=True))
    except Exception:
        return "skip", ""
    to_sw = _to_sw(placement, path, whole_leaf=mode == "grad")
    sw_args, sw_kwargs = _map(args, to_sw), _map(s.kwargs, to_sw)
    leaves = _sw_leaves([sw_args, sw_kwargs])

    def step() -> list[Any]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _tensors(op.op(*sw_args, **sw_kwargs))
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if len(got) != len(out):
            raise _Mismatch(f"{len(got)} outputs, torch gives {len(out)}")
        sw_loss = _loss(got, ws)
        if mode == "bwd":
            sw_loss.backward()
            return [t.grad for t in leaves]
        return list(torch.autograd.grad(sw_loss, leaves, allow_unused=True))

    result, note = _call(step, exp, False, False)
    if result == "internal" and note.startswith("_Mismatch"):
        return "wrong", note
    # torch.autograd.grad has no handler yet: it runs through the fallback, on gathered
    # copies of the inputs, which are not in the graph (a None where torch has a tensor)
    if mode == "grad" and ((result == "wrong" and "NoneType, torch expects Tensor" in note)
                           or (result == "internal" and "does not require grad" in note)):
        return "graph-lost", note
    return result, note


class _Mismatch(Exception):
    pass


# --- one op --------------------------------------------------------------------------------
def features(s: Any) -> set[Any]:
    """What a sample exercises beyond its values: its call signature (how many
    positional arguments, which keywords are given, which are None) and each kind of
    tensor among its arguments (``0-d``, ``size-0`` of each rank, ``non-contiguous``,
    ``view``: a storage offset or a storage holding more than the tensor)."""
    args = (s.input, *s.args)
    tensors = _tensors([*args, *s.kwargs.values()])
    out: set[Any] = {("call", len(args), tuple(sorted(s.kwargs)),
                      tuple(k for k, v in s.kwargs.items() if v is None),
                      tuple(i for i, a in enumerate(args) if a is None))}
    for t in tensors:
        if not _plain(t):
            continue
        if t.ndim == 0:
            out.add("0-d")
        if t.numel() == 0:
            out.add(("size-0", t.ndim))
        if not t.is_contiguous():
            out.add("non-contiguous")
        if t.storage_offset() or t.untyped_storage().nbytes() > t.numel() * t.element_size():
            out.add("view")
    return out


def _viewed(s: Any) -> bool:
    return bool(features(s) & {"view", "non-contiguous"})


def _samples(op: OpInfo, dtype: torch.dtype, n: int, scan: int, requires_grad: bool
             ) -> list[tuple[Any, bool]]:
    """(sample, whether it is a later one run for a new feature): the first ``n``, then
    each of the first ``scan`` that brings a feature none before it had."""
    torch.manual_seed(zlib.crc32(key(op).encode()))
    try:
        it: Iterator[Any] = iter(op.sample_inputs("cpu", dtype, requires_grad=requires_grad))
        drawn = [s for _, s in zip(range(max(n, scan)), it)]
    except Exception:
        return []
    out, seen = [], set()
    for i, s in enumerate(drawn):
        f = features(s)
        if i < n or f - seen:
            out.append((s, i >= n))
            seen |= f
    return out


def _fwd_dtype(op: OpInfo) -> torch.dtype:
    dtypes = op.supported_dtypes("cpu")
    if torch.float32 in dtypes:
        return torch.float32
    return sorted(dtypes, key=str)[0]


def run_op(op: OpInfo) -> Outcome:
    """Every mode, sample and placement of ``op``, against torch."""
    t0 = time.perf_counter()
    result = Outcome()
    uninit = op.name in UNINITIALIZED
    dtypes = op.supported_dtypes("cpu")
    fwd = _fwd_dtype(op)
    plans: list[tuple[str, torch.dtype, bool]] = [("fwd", fwd, False)]
    if op.supports_autograd and fwd.is_floating_point and fwd in op.supported_backward_dtypes(
            "cpu"):
        plans += [("bwd", fwd, True), ("grad", fwd, True)]
    if fwd != torch.int64 and torch.int64 in dtypes:
        plans.append(("int", torch.int64, False))
    if fwd != torch.bool and torch.bool in dtypes:
        plans.append(("bool", torch.bool, False))
    for mode, dtype, grad in plans:
        later = 0
        for s, extra in _samples(op, dtype, SAMPLES[mode], SCAN.get(mode, 0), grad):
            placements = PLACEMENTS if not extra else (PLACEMENTS[later % 2],)
            later += extra
            paths = PATHS if _viewed(s) else PATHS[:1]
            for placement in placements:
                for path in paths:
                    if grad:
                        o, note = _run_bwd(op, s, placement, path, mode)
                    else:
                        o, note = _run_fwd(op, s, placement, path, uninit)
                    if o != "skip":
                        result.add(mode, placement, o, f"{path}: {note}" if note else "")
    result.seconds = time.perf_counter() - t0
    return result


# --- the table and the summary -------------------------------------------------------------
def table_line(name: str, outcome: Outcome) -> str | None:
    """The op's entry in the expected table (None when every mode is on rules)."""
    modes = outcome.by_mode()
    parts = [f"{m}={modes[m]}" for m in MODES if modes.get(m, "rule") != "rule"]
    if not parts:
        return None
    line = f'    "{name}": "{" ".join(parts)}",'
    return line if len(line) <= 100 else f'    "{name}":\n        "{" ".join(parts)}",'



def parse(entry: str) -> dict[str, str]:
    """``"fwd=fallback bwd=refused"`` as a dict.

    >>> parse("fwd=fallback grad=graph-lost")
    {'fwd': 'fallback', 'grad': 'graph-lost'}
    """
    return dict(p.split("=", 1) for p in entry.split())


def summary(results: dict[str, Outcome]) -> str:
    """Ops per outcome, per mode and placement (``all``: an op's worst placement)."""
    results = {k: r for k, r in results.items() if r.worst}  # not the CUDA-only ops
    lines = [f"{'mode':5} {'placement':9} " + " ".join(f"{o:>10}" for o in OUTCOMES)
             + f" {'ops':>5}"]
    for mode in MODES:
        for placement in (*PLACEMENTS, "all"):
            c: Counter[str] = Counter()
            for r in results.values():
                if placement == "all":
                    if mode in r.by_mode():
                        c[r.by_mode()[mode]] += 1
                elif (mode, placement) in r.worst:
                    c[r.worst[(mode, placement)]] += 1
            if c:
                lines.append(f"{mode:5} {placement:9} " + " ".join(
                    f"{c[o]:>10}" for o in OUTCOMES) + f" {sum(c.values()):>5}")
    whole = Counter(max(r.by_mode().values(), key=OUTCOMES.index)
                    for r in results.values() if r.worst)
    lines.append(f"{len(results)} ops; every mode on rules: {whole['rule']}; worst "
                 "outcome per op: " + ", ".join(f"{o} {whole[o]}" for o in OUTCOMES))
    return "\n".join(lines)


def write_table(results: dict[str, Outcome], path: Path = TEST_MODULE) -> None:
    """Replace the generated block of the test module with ``results``' table."""
    text = path.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    lines = [ln for k in sorted(results) if (ln := table_line(k, results[k]))]
    path.write_text(head + BEGIN + "\n" + "\n".join(lines) + "\n    " + END + tail)


def main(argv: list[str]) -> None:
    write = "--write" in argv
    names = [a for a in argv if not a.startswith("--")]
    ops = all_ops()
    if names:
        wanted = {n for a in names for n in a.split(",")}
        ops = {k: v for k, v in ops.items() if k in wanted}
    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    results = {k: run_op(op) for k, op in ops.items()}
    for k, r in results.items():
        for mode, o in r.by_mode().items():
            if o in ("wrong", "internal", "refused", "graph-lost"):
                print(f"{k} {mode}={o}: {r.note(mode)}")
    print(summary(results))
    slow = sorted(results.items(), key=lambda kv: -kv[1].seconds)[:5]
    print(f"{time.perf_counter() - t0:.0f}s; slowest: "
          + ", ".join(f"{k} {r.seconds:.1f}s" for k, r in slow))
    if write:
        if names:
            sys.exit("--write regenerates the whole table: give no op names")
        write_table(results)
        print(f"wrote {TEST_MODULE}")


if __name__ == "__main__":
    main(sys.argv[1:])


__all__ = ["ALLOWED", "MODES", "OUTCOMES", "PATHS", "PLACEMENTS", "Outcome", "all_ops", "diff",
           "features", "key", "main", "parse", "run_op", "summary", "table_line",
           "write_table"]
