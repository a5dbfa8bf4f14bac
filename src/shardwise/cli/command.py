"""The ``shardwise`` command: ``demo``, ``bench``, ``plan``, ``info``.

Invariants:
- The benchmark suite is not part of the installed package: ``bench`` runs the
  repository's ``benchmarks/`` package when one is found (beside these sources,
  or in the current folder or one above it) and otherwise says how to get it.
- Building the parser imports neither torch nor the benchmarks.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

BENCH_MISSING = (
    "shardwise bench runs the benchmark suite in the repository's benchmarks/ folder, "
    "which is not part of the installed package; none was found beside {here} or above the "
    "current folder {cwd}. Run it from a checkout of the shardwise repository "
    "(`shardwise bench` or `python -m benchmarks` in its root).")


def _demo(args: argparse.Namespace) -> int:
    from shardwise.cli import demo

    return demo.main(args.extra)


def _plan(args: argparse.Namespace) -> int:
    from shardwise.cli import plan

    return plan.main(args.extra)


def find_benchmarks(starts: Iterable[Path] | None = None) -> Path | None:
    """The repository root holding the ``benchmarks/`` suite, or None.

    Looks at each of ``starts`` and its parents (default: this source file's folder,
    then the current folder).

    >>> root = find_benchmarks()
    >>> root is None or (root / "benchmarks" / "suite.py").is_file()
    True
    """
    if starts is None:
        starts = (Path(__file__).resolve().parent, Path.cwd())
    for start in starts:
        for folder in (start, *start.parents):
            if (folder / "benchmarks" / "__init__.py").is_file() and (
                    folder / "benchmarks" / "suite.py").is_file():
                return folder
    return None


def _bench_suite(root: Path) -> ModuleType:
    # The found folder goes first on sys.path so that it, not another package named
    # ``benchmarks``, is imported; a different one imported earlier is an error.
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    suite = importlib.import_module("benchmarks.suite")
    got = Path(suite.__file__ or "").resolve().parent
    if got != (root / "benchmarks").resolve():
        raise ImportError(f"shardwise bench: found the suite in {root / 'benchmarks'} but "
                          f"`benchmarks` was already imported from {got}. Run "
                          f"`python -m benchmarks` from {root} instead.")
    return suite


def _bench(args: argparse.Namespace) -> int:
    root = find_benchmarks()
    if root is None:
        print(BENCH_MISSING.format(here=Path(__file__).resolve().parent, cwd=Path.cwd()),
              file=sys.stderr)
        return 2
    main: int = _bench_suite(root).main(args.extra, prog="shardwise bench")
    return main


def _info(args: argparse.Namespace) -> int:
    import platform

    import torch

    import shardwise as sw
    from shardwise.sharding.devices import accelerator_type, available_devices

    print(f"shardwise {sw.__version__}  torch {torch.__version__}  "
          f"python {platform.python_version()}")
    print(f"accelerator: {accelerator_type() or 'none'}")
    print(f"devices: {available_devices()}")
    import torch.distributed as dist

    print(f"torch.distributed available: {dist.is_available()} "
          f"(gloo: {dist.is_gloo_available()}, nccl: {dist.is_nccl_available()})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardwise", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="train a DPxTP MLP on a simulated 2x4 mesh and check parity "
                   "(options: shardwise demo --help)", add_help=False)
    # ``bench`` options (--quick, --out, --no-gloo, --no-dtensor, --devices) are
    # parsed by the suite itself, which lives outside the package.
    sub.add_parser("bench", help="benchmark suite (simulated mesh, memory, Gloo): JSON + "
                   "table; needs a repository checkout (shardwise bench --help)",
                   add_help=False)
    sub.add_parser("plan", help="the top plans (data, fully sharded, tensor, pipeline "
                   "parallel) for a model on N devices: memory, communication, time "
                   "(shardwise plan --help)", add_help=False)
    sub.add_parser("info", help="versions and the devices torch can see")
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in ("demo", "bench", "plan"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    handlers = {"demo": _demo, "bench": _bench, "plan": _plan, "info": _info}
    return handlers[args.command](args)

