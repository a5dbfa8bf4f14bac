"""``shardwise demo``: train a small MLP with data x tensor parallelism.

On a simulated 2x4 mesh (``dp`` x ``tp``) by default, or over processes under
torchrun (``torchrun --nproc-per-node 4 -m shardwise.cli.demo``: a 2x2 mesh). The
MLP is Megatron-style::

    x[S(dp)] @ W1[S(tp) on cols] -> gelu -> @ W2[S(tp) on rows] -> Partial(tp)
      -> all_reduce(tp) -> mse(y[S(dp)]) -> Partial(dp) scalar

so the forward pass runs exactly one all_reduce over ``tp`` (plus the loss's
over ``dp``), and the backward pass's gradient all-reduce over ``dp`` comes
from the replicated weights. Every step's loss is checked against the same
model trained on one device with plain torch; the demo exits non-zero if they
disagree beyond tolerance.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

import shardwise as sw
from shardwise.api.distributed import maybe_initialize, process_count, process_index, shutdown
from shardwise.debug import CommCounter, visualize

__all__ = ["main", "run"]


@dataclass(frozen=True)
class Config:
    steps: int = 300
    batch: int = 64
    d_in: int = 16
    hidden: int = 64
    d_out: int = 8
    lr: float = 0.05
    seed: int = 0
    rtol: float = 1e-3


def _data(cfg: Config) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.batch, cfg.d_in, generator=g)
    teacher = torch.randn(cfg.d_in, cfg.d_out, generator=g)
    y = torch.tanh(x @ teacher) + 0.1 * torch.randn(cfg.batch, cfg.d_out, generator=g)
    w1 = torch.randn(cfg.d_in, cfg.hidden, generator=g) / cfg.d_in ** 0.5
    w2 = torch.randn(cfg.hidden, cfg.d_out, generator=g) / cfg.hidden ** 0.5
    return x, y, w1, w2


def _reference(cfg: Config) -> list[float]:
    """The same training on one device with plain torch."""
    x, y, w1, w2 = _data(cfg)
    w1, w2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    losses = []
    for _ in range(cfg.steps):
        loss = ((torch.nn.functional.gelu(x @ w1) @ w2 - y) ** 2).mean()
        losses.append(loss.item())
        g1, g2 = torch.autograd.grad(loss, (w1, w2))
        with torch.no_grad():
            w1 = (w1 - cfg.lr * g1).requires_grad_()
            w2 = (w2 - cfg.lr * g2).requires_grad_()
    return losses


def _forward(x: sw.Tensor, y: sw.Tensor, w1: sw.Tensor, w2: sw.Tensor) -> sw.Tensor:
    h = sw.gelu(x @ w1)                       # [S(dp), S(tp)], no communication
    partial = h @ w2                          # contraction over tp: Partial(sum), no comm
    out = sw.all_reduce(partial, reduce_axes="tp")  # the one all_reduce of the layer
    return ((out - y) ** 2).mean()            # Partial(sum) over dp


class _PlainConsole:
    """The few ``rich.console.Console`` calls the demo makes, as plain ``print``s
    (used when the ``viz`` extra, rich, is not installed)."""

    def rule(self, title: str) -> None:
        print(f"--- {title} ---")

    def print(self, text: str) -> None:
        print(re.sub(r"\[/?[a-z ]+\]", "", text))  # drop rich's [bold]...[/bold] markup


def _console() -> Any:
    try:
        from rich.console import Console
    except ImportError:
        return _PlainConsole()
    return Console()


def _print_table(console: Any, title: str, columns: Sequence[str],
                 rows: Sequence[Sequence[str]]) -> None:
    if isinstance(console, _PlainConsole):
        widths = [max(len(c), *(len(r[j]) for r in rows)) for j, c in enumerate(columns)]
        print(title)
        for line in (columns, *rows):
            print("  ".join(f"{v:>{w}}" for v, w in zip(line, widths)))
        return
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*row)
    console.print(table)


@contextmanager
def _progress(console: Any, total: int, show: bool) -> Iterator[Any]:
    """Yield ``advance(loss)``: a progress bar with rich, nothing without it."""
    if isinstance(console, _PlainConsole) or not show:
        yield lambda loss: None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("training"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("loss {task.fields[loss]:.5f}"), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("train", total=total, loss=float("nan"))
        yield lambda loss: progress.update(task, advance=1, loss=loss)


def run(cfg: Config, mesh_shape: tuple[int, int], *, show: bool = True) -> int:
    """Train; return 0 if every loss matches the single-device run, else 1.

    Prints with rich when it is installed (``pip install shardwise[viz]``), plain
    text otherwise.
    """
    console = _console()
    say = show and process_index() == 0
    mesh = sw.DeviceMesh.cpu(mesh_shape, ("dp", "tp"))
    x0, y0, w10, w20 = _data(cfg)
    x = sw.shard(x0, mesh, ["dp", None])
    y = sw.shard(y0, mesh, ["dp", None])
    w1 = sw.shard(w10, mesh, [None, "tp"]).detach().requires_grad_()
    w2 = sw.shard(w20, mesh, ["tp", None]).detach().requires_grad_()
    if say:
        runtime = (f"torch.distributed, {process_count()} processes"
                   if sw.distributed.is_initialized() else "simulated, one process")
        console.rule(f"shardwise demo: MLP {cfg.d_in}->{cfg.hidden}->{cfg.d_out}, "
                     f"{mesh!r} ({runtime})")
        for name, t in (("x (batch over dp)", x), ("W1 (columns over tp)", w1),
                        ("W2 (rows over tp)", w2)):
            console.print(f"[bold]{name}[/bold]")
            visualize(t, console=console)
    with CommCounter() as cc:  # every process: collectives must match across processes
        _forward(x, y, w1, w2)
    if say:
        console.print(f"collectives per forward step: {dict(cc.counts)} "
                      f"({sum(cc.bytes.values())} B/device)")
    ref = _reference(cfg)
    losses: list[float] = []
    start = time.perf_counter()
    with _progress(console, cfg.steps, say) as advance:
        for _ in range(cfg.steps):
            loss = _forward(x, y, w1, w2)
            loss.backward()
            losses.append(loss.item())
            assert w1.grad is not None and w2.grad is not None
            with torch.no_grad():
                w1 = (w1 - cfg.lr * w1.grad).detach().requires_grad_()
                w2 = (w2 - cfg.lr * w2.grad).detach().requires_grad_()
            advance(losses[-1])
    elapsed = time.perf_counter() - start
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref))
    ok = worst <= cfg.rtol
    if say:
        _print_table(console, "loss: shardwise vs single-device torch",
                     ("step", "shardwise", "torch", "rel. diff"),
                     [(str(i), f"{losses[i]:.6f}", f"{ref[i]:.6f}",
                       f"{abs(losses[i] - ref[i]) / max(abs(ref[i]), 1e-12):.2e}")
                      for i in sorted({0, 1, cfg.steps // 2, cfg.steps - 1})])
        console.print(f"{cfg.steps} steps in {elapsed:.2f} s ({elapsed / cfg.steps * 1e3:.1f} "
                      f"ms/step); worst relative loss difference {worst:.2e} "
                      f"(tolerance {cfg.rtol:.0e})")
        console.print("[green]parity OK[/green]" if ok else "[red]PARITY FAILED[/red]")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardwise demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--mesh", default=None,
                        help="DPxTP, e.g. 2x4 (default: 2x4 simulated, 2x(N/2) under torchrun)")
    args = parser.parse_args(argv)
    multi = maybe_initialize()
    if args.mesh:
        dp, tp = (int(v) for v in args.mesh.lower().split("x"))
    elif multi:
        n = process_count()
        dp, tp = (2, n // 2) if n % 2 == 0 and n > 1 else (1, n)
    else:
        dp, tp = 2, 4
    try:
        return run(Config(steps=args.steps), (dp, tp))
    finally:
        if multi:
            shutdown()


if __name__ == "__main__":
    sys.exit(main())
