"""The ``shardwise`` command: ``demo``, ``info``."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from shardwise import demo

    return demo.main(args.extra)


def _bench(args: argparse.Namespace) -> int:
    from shardwise.bench.suite import run_from_args

    return run_from_args(args)


def _info(args: argparse.Namespace) -> int:
    import platform

    import torch

    import shardwise as sw
    from shardwise.devices import accelerator_type, available_devices

    print(f"shardwise {sw.__version__}  torch {torch.__version__}  "
          f"python {platform.python_version()}")
    print(f"accelerator: {accelerator_type() or 'none'}")
    print(f"devices: {available_devices()}")
    import torch.distributed as dist

    print(f"torch.distributed available: {dist.is_available()} "
          f"(gloo: {dist.is_gloo_available()}, nccl: {dist.is_nccl_available()})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardwise", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="train a DPxTP MLP on a simulated 2x4 mesh and check parity "
                   "(options: shardwise demo --help)", add_help=False)
    from shardwise.bench import suite

    bench = sub.add_parser("bench", help="benchmark suite (simulated mesh, memory, Gloo): "
                           "JSON + table (shardwise bench --help)", description=suite.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    suite.add_arguments(bench)
    sub.add_parser("info", help="versions and the devices torch can see")
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "demo":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    handlers = {"demo": _demo, "bench": _bench, "info": _info}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
