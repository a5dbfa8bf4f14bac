"""``shardwise plan``: the top plans for a model on N devices, side by side.

Invariants:
- The model is a Hugging Face ``config.json`` (``--hf``), a named size
  (``--model``: examples/gpt.py's GPT, Llama-3 8B or 70B), with any size overridden
  (``--layers``, ``--dim``, ...); nothing is downloaded and no weights are made.
- What it prints is ``auto_plan``'s choice and candidates (:func:`shardwise.planning.
  report.side_by_side`): memory per device, bytes per step per mesh axis, predicted
  step time, where the time goes.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["main", "parser"]

_SIZES = ("vocab", "seq", "dim", "heads", "kv_heads", "layers", "ff")


def parser(prog: str = "shardwise plan") -> argparse.ArgumentParser:
    """The ``shardwise plan`` options."""
    p = argparse.ArgumentParser(prog=prog, description=(__doc__ or "").splitlines()[0])
    p.add_argument("--devices", type=int, required=True, help="how many devices")
    p.add_argument("--batch", type=int, required=True, help="sequences per step (global)")
    p.add_argument("--hf", metavar="CONFIG_JSON", help="a Hugging Face config.json")
    p.add_argument("--model", default="gpt", choices=("gpt", "llama3-8b", "llama3-70b"),
                   help="a named size when no --hf is given (gpt: examples/gpt.py's)")
    for key in _SIZES:
        p.add_argument(f"--{key.replace('_', '-')}", type=int, dest=key, default=None,
                       help=f"override the model's {key}")
    p.add_argument("--profile", default="h100", help="a preset (h100, a100); default h100")
    p.add_argument("--memory", type=float, default=None, metavar="GIB",
                   help="memory budget per device in GiB (default: the profile's)")
    p.add_argument("--max-pp", type=int, default=8, help="largest pipeline degree tried")
    p.add_argument("--top", type=int, default=3, help="how many plans to show")
    return p


def config_of(args: argparse.Namespace) -> Any:
    """The ``ModelConfig`` the options name.

    >>> config_of(parser().parse_args(["--devices", "8", "--batch", "8", "--layers", "2"]))
    ModelConfig(vocab=..., layers=2, ...)
    """
    from shardwise.planning import ModelConfig

    if args.hf:
        config = ModelConfig.from_hf(args.hf, seq=args.seq)
    elif args.model == "llama3-8b":
        config = ModelConfig.llama3_8b()
    elif args.model == "llama3-70b":
        config = ModelConfig.llama3_70b()
    else:
        config = ModelConfig.gpt()
    sizes = {k: getattr(args, k) for k in _SIZES if getattr(args, k) is not None}
    return config.with_(**sizes) if sizes else config


def main(argv: list[str] | None = None, prog: str = "shardwise plan") -> int:
    """Parse ``argv``, plan, print the top plans.

    >>> main(["--devices", "4", "--batch", "8"])  # doctest: +SKIP
    gpt (0.1 M parameters, seq 16) on 4 devices, batch 8, h100: best dp4
    ...
    """
    from shardwise.planner.steps import fmt_bytes
    from shardwise.planning import auto_plan, get_profile

    args = parser(prog).parse_args(argv)
    config = config_of(args)
    profile = get_profile(args.profile)
    budget = None if args.memory is None else int(args.memory * 2**30)
    choice = auto_plan(config, devices=args.devices, batch=args.batch, profile=profile,
                       memory_budget=budget, max_pp=args.max_pp)
    print(f"{config.name} ({config.parameters() / 1e6:,.1f} M parameters, seq {config.seq}) "
          f"on {args.devices} devices, batch {args.batch}, {profile.name}: best {choice.plan}")
    print(f"memory budget {fmt_bytes(choice.budget)} per device")
    print(choice.table(args.top))
    return 0
