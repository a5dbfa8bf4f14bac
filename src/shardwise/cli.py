"""The ``shardwise`` command: ``demo``, ``info``."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    import shardwise as sw
    from shardwise.debug import visualize

    console = Console()
    mesh = sw.DeviceMesh.cpu((2, 4), ("dp", "tp"))
    console.rule(f"shardwise demo: a simulated {mesh!r} of virtual CPU devices")
    x = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    t = sw.shard(x, mesh, ["dp", "tp"])
    console.print("x = shard(arange(48).reshape(8, 6), mesh, ['dp', 'tp'])")
    visualize(t, console=console)
    steps = [
        ("all_gather(x, axis=1)", lambda: sw.all_gather(t, axis=1)),
        ("all_to_all(x, split_axis=0, concat_axis=1)", lambda: sw.all_to_all(t, 0, 1)),
        ("shard(x, mesh, ['tp', 'dp'])", lambda: sw.shard(t, mesh, ["tp", "dp"])),
    ]
    ok = True
    for title, fn in steps:
        out = fn()
        console.print(f"\n{title}")
        console.print(str(sw.plan(t, out.layout)))
        visualize(out, console=console)
        same = torch.equal(out.to_torch(), x)
        ok &= same
        console.print(f"global value unchanged: {same}")
    p = sw.tensor(x, sharding=sw.PlacementMapping(mesh, (sw.Partial(), sw.Replicated())))
    r = sw.reduce_scatter(p, 0, reduce_axes="dp")
    console.print("\nreduce_scatter(Partial('sum') over dp, axis=0)")
    console.print(str(sw.plan(p, r.layout)))
    visualize(r, console=console)
    same = torch.equal(r.to_torch(), x)
    ok &= same
    console.print(f"global value unchanged: {same}")
    return 0 if ok else 1


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
    sub.add_parser("demo", help="show sharded layouts and resharding on a simulated 2x4 mesh")
    sub.add_parser("info", help="versions and the devices torch can see")
    args = parser.parse_args(argv)
    handlers = {"demo": _demo, "info": _info}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
