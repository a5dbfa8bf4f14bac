"""Checkpoints (issue 15): DCP save/load throughput of a sharded state beside DCP with
plain torch tensors of the same bytes, safetensors beside ``safetensors.torch``, and
the peak memory of a sharded safetensors load.

- The state: ``n`` float32 tensors of 32 MiB (256 MiB in all for the full preset) on
  a simulated 2x2 mesh in four layouts (``[S0,S1]``, ``[R,S0]``, ``[S1,R]``,
  ``[S0,S0]``), each device's block its own contiguous buffer (as in a real sharded
  run; replicas share one). The plain state: the same global tensors as torch tensors.
- Throughput: bytes of the global state / seconds, medians (and minima) of interleaved
  runs into a fresh directory under the system temp folder (DCP fsyncs its files, and
  so do save_safetensors and the reference). The safetensors load reference is
  ``load_file`` (memory-mapped) copied into existing tensors.
  Loads fill existing targets; "resharded" loads into a 4-device mesh with other
  layouts, shown beside the plain same-layout load for scale only (DCP's reader
  deserialises a saved chunk once per target block it overlaps, here twice). Target:
  shardwise save and same-layout load >= 80% of plain. ``shardwise.checkpoint.save``
  and ``load`` (atomic; a CRC-32 per chunk written, checked on load) are shown beside
  the plain ``dcp.save``/``dcp.load`` too.
- The checksums' cost (issue 24): ``checkpoint.save``/``load`` and
  ``save_safetensors``/``load_safetensors`` with the checksums on and off, the same code
  path with its switch (``store._save(checksums=)``, ``load(verify=)``; the loads read
  the same checksummed files), in alternating order, each save into a fresh path and
  each load from the page cache (the file just written), ``repeat`` pairs of their
  own; the ratio is the throughput with them over that without (median, and best).
  Target: >= 0.95 (the checksums cost <= 5%). Beside it the same ratio of CPU time
  (``time.process_time``, every thread of the process, medians): on a machine shared
  with other work, wall time is mostly others' load, CPU time what the checksums add.
- Peak memory of ``load_safetensors`` into the sharded model, in a fresh process,
  after ``malloc_trim(0)`` (freed heap pages would otherwise be reused unseen):
  anonymous memory (``RssAnon`` of ``/proc/self/status``, sampled every 0.1 ms by a
  thread while the load runs; the GIL switch interval is lowered to 0.1 ms so the
  sampler runs between slices) above the model, and ``VmHWM`` (peak resident set,
  reset through ``/proc/self/clear_refs``) above the model, which also counts the
  file's pages that safetensors maps while reading (page cache, shared, reclaimable).
  psutil is not installed and torch has no allocator statistics on CPU, hence /proc.
  Target: anonymous peak <= one block (the largest shard) above the model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

__all__ = ["measure", "run"]

MiB = 2**20
SHAPE = (2048, 4096)  # one 32 MiB float32 tensor


def _state(n: int, shape: tuple[int, int] = SHAPE) -> tuple[dict[str, Any], dict[str, Any]]:
    """(sharded state, plain state) of ``n`` 32 MiB tensors with equal values."""
    import torch

    import shardwise as sw
    from shardwise import DeviceMesh, PlacementMapping, Replicated, Sharded
    from shardwise.sharding.shapes import local_bounds

    mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
    r = Replicated()
    layouts: list[list[Any]] = [[Sharded(0), Sharded(1)], [r, Sharded(0)], [Sharded(1), r],
                                [Sharded(0), Sharded(0)]]
    sharded, plain = {}, {}
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        whole = torch.randn(*shape, generator=g)
        mapping = PlacementMapping(mesh, tuple(layouts[i % len(layouts)]))
        layout = sw.tensor(torch.zeros(1, 1), sharding=mapping).dist_layout
        blocks: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}
        shards = []
        for k in range(mesh.num_devices):
            b = local_bounds(shape, layout, mesh.coord_of(k))
            if b not in blocks:  # replicas share one buffer
                blocks[b] = whole[b[0][0]:b[0][1], b[1][0]:b[1][1]].clone()
            shards.append(blocks[b])
        sharded[f"layer{i}.weight"] = sw.from_local(shards, mapping, shape)
        plain[f"layer{i}.weight"] = whole
    return sharded, plain


def _targets(n: int, resharded: bool, shape: tuple[int, int] = SHAPE) -> dict[str, Any]:
    import shardwise as sw
    from shardwise import DeviceMesh, PlacementMapping, Replicated, Sharded

    places: list[list[Any]]
    if resharded:
        mesh, places = DeviceMesh.cpu(4, "x"), [[Sharded(1)], [Sharded(0)], [Replicated()]]
    else:
        mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
        r = Replicated()
        places = [[Sharded(0), Sharded(1)], [r, Sharded(0)], [Sharded(1), r],
                  [Sharded(0), Sharded(0)]]
    return {f"layer{i}.weight": sw.zeros(shape, sharding=PlacementMapping(
        mesh, tuple(places[i % len(places)]))) for i in range(n)}


def _timed(fn: Any, *args: Any, **kwargs: Any) -> float:
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t0


def _timed_cpu(fn: Any, *args: Any, **kwargs: Any) -> tuple[float, float]:
    """(wall seconds, CPU seconds of every thread of this process) of ``fn(...)``."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn(*args, **kwargs)
    return time.perf_counter() - t0, time.process_time() - c0


def _summary(case: str, mib: float, sw_s: list[float], ref_s: list[float], ref: str
             ) -> dict[str, Any]:
    med = sorted(sw_s)[len(sw_s) // 2]
    rmed = sorted(ref_s)[len(ref_s) // 2]
    return {"case": case, "mib": mib, "reference": ref,
            "shardwise_mib_s": mib / med, "reference_mib_s": mib / rmed,
            "shardwise_best_mib_s": mib / min(sw_s), "reference_best_mib_s": mib / min(ref_s),
            "ratio": rmed / med, "ratio_best": min(ref_s) / min(sw_s)}


def _save_file_synced(state: dict[str, Any], path: Path) -> None:
    """``safetensors.torch.save_file`` with the fsync save_safetensors does."""
    import safetensors.torch

    safetensors.torch.save_file(state, path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _load_file_into(path: Path, targets: dict[str, Any]) -> None:
    """``safetensors.torch.load_file`` (lazy: memory-mapped), copied into the model."""
    import safetensors.torch

    for k, v in safetensors.torch.load_file(path).items():
        targets[k].copy_(v)


def measure_throughput(n: int, repeat: int, shape: tuple[int, int] = SHAPE
                       ) -> list[dict[str, Any]]:
    """Interleaved DCP and safetensors runs of the sharded and the plain state."""
    import torch
    import torch.distributed.checkpoint as dcp

    import shardwise as sw

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    sharded, plain = _state(n, shape)
    mib = n * shape[0] * shape[1] * 4 / MiB
    root = Path(tempfile.mkdtemp(prefix="shardwise-bench-ckpt-"))
    times: dict[str, list[float]] = {}

    def add(key: str, seconds: float) -> None:
        times.setdefault(key, []).append(seconds)

    try:
        for i in range(repeat):
            # shardwise.checkpoint (atomic, a CRC-32 per chunk written and checked) beside
            # plain DCP, in alternating order: each save's fsync waits for the writeback
            # of the saves before it
            savers = [("sw", sharded, dcp.save), ("plain", plain, dcp.save),
                      ("store", sharded, sw.checkpoint.save)]
            for who, state, save in (savers if i % 2 else savers[::-1]):
                path = root / f"{who}{i}"
                if who == "store":
                    add("store save", _timed(save, state, path))
                else:
                    add(f"save {who}", _timed(save, state, checkpoint_id=path))
            same, moved = _targets(n, False, shape), _targets(n, True, shape)
            plain_t = {k: torch.empty_like(v) for k, v in plain.items()}
            add("load sw", _timed(dcp.load, same, checkpoint_id=root / f"sw{i}"))
            add("load plain", _timed(dcp.load, plain_t, checkpoint_id=root / f"plain{i}"))
            add("store load", _timed(sw.checkpoint.load, _targets(n, False, shape),
                                     root / f"store{i}"))
            add("reshard sw", _timed(dcp.load, moved, checkpoint_id=root / f"sw{i}"))
            shutil.rmtree(root / f"store{i}")
            for k in plain:
                assert torch.equal(moved[k].to_torch(), plain[k]), k
            for who in ("sw", "plain"):
                shutil.rmtree(root / f"{who}{i}")
            f_sw, f_plain = root / "sw.safetensors", root / "plain.safetensors"
            add("st save sw", _timed(sw.checkpoint.save_safetensors, sharded, f_sw))
            add("st save plain", _timed(_save_file_synced, plain, f_plain))
            add("st load sw", _timed(sw.checkpoint.load_safetensors, f_sw, moved))
            add("st load plain", _timed(_load_file_into, f_plain, plain_t))
            f_sw.unlink()
            f_plain.unlink()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return [
        _summary("dcp.save", mib, times["save sw"], times["save plain"], "dcp.save, plain"),
        _summary("dcp.load, same layout", mib, times["load sw"], times["load plain"],
                 "dcp.load, plain"),
        _summary("dcp.load, resharded 2x2 -> 4", mib, times["reshard sw"], times["load plain"],
                 "dcp.load, plain"),
        _summary("checkpoint.save (atomic, CRC-32s)", mib, times["store save"],
                 times["save plain"], "dcp.save, plain"),
        _summary("checkpoint.load (CRC-32s checked), same layout", mib, times["store load"],
                 times["load plain"], "dcp.load, plain"),
        _summary("save_safetensors (by offsets)", mib, times["st save sw"],
                 times["st save plain"], "safetensors.torch.save_file"),
        _summary("load_safetensors (slices, resharded)", mib, times["st load sw"],
                 times["st load plain"], "safetensors.torch.load_file"),
    ]


def measure_checksums(n: int, repeat: int, shape: tuple[int, int] = SHAPE
                      ) -> list[dict[str, Any]]:
    """Checksums on beside off, interleaved (see the module doc)."""
    import shardwise as sw
    from shardwise.checkpoint import integrity, safetensors_io, store

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    sharded, _ = _state(n, shape)
    mib = n * shape[0] * shape[1] * 4 / MiB
    root = Path(tempfile.mkdtemp(prefix="shardwise-bench-crc-"))
    times: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}

    def add(key: str, seconds: tuple[float, float]) -> None:
        times.setdefault(key, []).append(seconds[0])
        cpu.setdefault(key, []).append(seconds[1])

    try:
        for i in range(repeat):
            order = (True, False) if i % 2 else (False, True)
            for on in order:
                add(f"save {on}", _timed_cpu(store._save, sharded, root / f"{on}{i}",
                                         checksums=on))
            for on in order:  # both read the checksummed checkpoint
                add(f"load {on}", _timed_cpu(sw.checkpoint.load, _targets(n, False, shape),
                                         root / f"True{i}", verify=on))
            for on in order:
                shutil.rmtree(root / f"{on}{i}")
            for on in order:
                add(f"st save {on}", _timed_cpu(safetensors_io._save_safetensors, sharded,
                                            root / f"{on}.safetensors", None, checksums=on))
            moved = _targets(n, True, shape)
            for on in order:
                add(f"st load {on}", _timed_cpu(sw.checkpoint.load_safetensors,
                                            root / "True.safetensors", moved, verify=on))
            for on in order:
                (root / f"{on}.safetensors").unlink()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    how = "zlib-ng" if integrity.FAST else "zlib"

    def row(case: str, key: str, ref: str) -> dict[str, Any]:
        out = _summary(case, mib, times[f"{key} True"], times[f"{key} False"], ref)
        on, off = sorted(cpu[f"{key} True"]), sorted(cpu[f"{key} False"])
        out["cpu_ratio"] = off[len(off) // 2] / on[len(on) // 2]
        out["cpu_on_ms"], out["cpu_off_ms"] = 1e3 * on[len(on) // 2], 1e3 * off[len(off) // 2]
        return out

    return [
        row(f"checkpoint.save, CRC-32s ({how}) on / off", "save", "the same, checksums off"),
        row(f"checkpoint.load, CRC-32s ({how}) checked / not", "load",
            "the same, verify=False"),
        row(f"save_safetensors, CRC-32s ({how}) on / off", "st save", "the same, checksums off"),
        row(f"load_safetensors, CRC-32s ({how}) checked / not", "st load",
            "the same, verify=False"),
    ]


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _trim() -> None:
    """Give free heap pages back (glibc ``malloc_trim``), so that the load's own
    allocations show as growth instead of reusing pages freed earlier."""
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _sampled_peak(fn: Any) -> int:
    """The largest ``RssAnon`` growth seen while ``fn`` runs (see the module doc)."""
    _trim()
    base = _status("RssAnon")
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _status("RssAnon"))
            time.sleep(0.0001)

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.0001)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        fn()
    finally:
        stop.set()
        sampler.join()
        sys.setswitchinterval(old)
    return peak[0] - base


def _calibrate(nbytes: int) -> int:
    """What the sampler sees of one block-sized buffer written and freed: it shows that
    a block-sized allocation during the load would not go unseen."""
    import torch

    def one_block() -> None:
        x = torch.empty(nbytes // 4)
        x.fill_(1.0)
        time.sleep(0.002)
        del x

    return _sampled_peak(one_block)


def measure_memory(n: int, shape: tuple[int, int] = SHAPE) -> dict[str, Any]:
    """Peak memory of load_safetensors into the sharded model (see the module doc)."""
    import safetensors.torch

    import shardwise as sw

    _, plain = _state(n, shape)
    root = Path(tempfile.mkdtemp(prefix="shardwise-bench-mem-"))
    try:
        f = root / "model.safetensors"
        safetensors.torch.save_file(plain, f)
        del plain
        model = _targets(n, False, shape)
        sw.checkpoint.load_safetensors(f, _targets(1, True, shape), strict=False)  # warm up
        largest = max(s.numel() * s.element_size() for t in model.values() for s in t.shards)
        distinct = sum(s.numel() * s.element_size() for t in model.values()
                       for s in {id(b): b for b in t.shards}.values())
        rss0 = _status("VmRSS")
        try:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            hwm_ok = True
        except OSError:
            hwm_ok = False
        anon = _sampled_peak(lambda: sw.checkpoint.load_safetensors(f, model))
        hwm = _status("VmHWM") if hwm_ok else None
        seen = _calibrate(largest)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"model_mib": distinct / MiB, "largest_block_mib": largest / MiB,
            "anon_peak_above_model_mib": anon / MiB,
            "hwm_above_model_mib": None if hwm is None else (hwm - rss0) / MiB,
            "sampler_sees_one_block_mib": seen / MiB,
            "method": "RssAnon sampled every 0.1 ms; VmHWM after clear_refs (includes the "
                      "file pages safetensors maps)"}


def measure(n: int = 8, repeat: int = 3, shape: tuple[int, int] = SHAPE) -> dict[str, Any]:
    return {"tensors": n, "tensor": list(shape), "mib": n * shape[0] * shape[1] * 4 / MiB,
            "repeat": repeat, "rows": measure_throughput(n, repeat, shape),
            "checksum_repeat": 2 * repeat + 1,
            "checksum_rows": measure_checksums(n, 2 * repeat + 1, shape)}


def _fresh(args: list[str], timeout_s: float) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.checkpoint", *args],
                          capture_output=True, text=True, timeout=timeout_s, env=env,
                          check=False)
    if proc.returncode != 0:
        return {"error": f"exit code {proc.returncode}: {proc.stderr[-2000:]}"}
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def run(tensors: int = 8, repeat: int = 3, shape: tuple[int, int] = SHAPE,
        timeout_s: float = 900.0) -> dict[str, Any]:
    """Throughput and memory, each in a fresh Python process."""
    common = ["--tensors", str(tensors), "--shape", str(shape[0]), str(shape[1])]
    res = _fresh([*common, "--repeat", str(repeat)], timeout_s)
    res["memory"] = _fresh([*common, "--memory"], timeout_s)
    return res


def tables(res: dict[str, Any]) -> list[str]:
    """The checkpoint section as text lines."""
    from benchmarks.common import fmt

    if "error" in res:
        return [f"\ncheckpoints: failed ({res['error']})"]
    lines = [f"\ncheckpoints: {res['tensors']} x {res['tensor'][0]}x{res['tensor'][1]} float32 "
             f"({res['mib']:.0f} MiB) on a simulated 2x2 mesh beside plain torch tensors; "
             f"median (best) of {res['repeat']}, interleaved",
             f"  {'case':38} {'shardwise MiB/s':>16} {'reference MiB/s':>16} {'ratio':>12}"
             "  reference"]
    for r in res["rows"]:
        lines.append(f"  {r['case']:38} {r['shardwise_mib_s']:9.0f} "
                     f"({r['shardwise_best_mib_s']:4.0f}) {r['reference_mib_s']:9.0f} "
                     f"({r['reference_best_mib_s']:4.0f}) {r['ratio']:5.2f} "
                     f"({r['ratio_best']:4.2f})  {r['reference']}")
    if res.get("checksum_rows"):
        lines.append(f"  the checksums' cost: with / without, the same code path; median "
                     f"(best) of {res['checksum_repeat']}, interleaved; CPU: ms of CPU time "
                     "(all threads), medians")
        for r in res["checksum_rows"]:
            lines.append(f"  {r['case']:50} {r['shardwise_mib_s']:6.0f} "
                         f"({r['shardwise_best_mib_s']:4.0f}) / {r['reference_mib_s']:6.0f} "
                         f"({r['reference_best_mib_s']:4.0f}) MiB/s = {r['ratio']:4.2f} "
                         f"({r['ratio_best']:4.2f}); CPU {r['cpu_on_ms']:.0f} / "
                         f"{r['cpu_off_ms']:.0f} ms = {r['cpu_ratio']:4.2f}")
    mem = res.get("memory") or {}
    if "error" in mem:
        lines.append(f"  load_safetensors peak memory: failed ({mem['error']})")
    elif mem:
        lines.append(f"  load_safetensors peak memory above the {mem['model_mib']:.0f} MiB "
                     f"sharded model (largest block {mem['largest_block_mib']:.0f} MiB): "
                     f"anonymous {fmt(mem['anon_peak_above_model_mib'], 0, 1)} MiB, "
                     f"VmHWM {fmt(mem['hwm_above_model_mib'], 0, 1)} MiB ({mem['method']}; "
                     f"the sampler sees {mem['sampler_sees_one_block_mib']:.1f} MiB of a "
                     "block-sized buffer)")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--shape", type=int, nargs=2, default=list(SHAPE))
    p.add_argument("--memory", action="store_true")
    p.add_argument("--checksums-only", action="store_true",
                   help="only the checksums on/off rows, --repeat pairs")
    args = p.parse_args(argv)
    shape = (args.shape[0], args.shape[1])
    out: Any
    if args.memory:
        out = measure_memory(args.tensors, shape)
    elif args.checksums_only:
        out = measure_checksums(args.tensors, args.repeat, shape)
    else:
        out = measure(args.tensors, args.repeat, shape)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
