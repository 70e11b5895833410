"""Benchmark: allreduce latency against message size, 1 KiB - 1 MiB, bf16.

Providers: ``oneshot`` and ``twoshot`` (specverify's IPC kernels), ``fused`` (one-shot + residual add + RMSNorm,
rows of hidden 7168 or fewer), ``nccl`` (our NCCL binding; only with one GPU per rank).

World size from the machine: with N >= 2 GPUs, N processes, one per GPU (real figures; NCCL included). With one
GPU, ``--world`` processes (default 2) share it through CUDA IPC: their kernels time-slice, so those figures are
**correctness-only** (rows carry ``correctness_only: true``) and NCCL cannot run (it refuses two ranks on a GPU).

Method: each (provider, size) is checked first (small-integer inputs, exact sum), then ``--calls`` allreduces are
captured in one CUDA graph and replayed; ``us = replay time / calls`` (CUDA events, median over ``--reps``
replays, taken on rank 0). Derived metric: bus bandwidth ``busbw_gbps = 2 * (W - 1) / W * nbytes / us / 1e3``
(the NCCL-tests convention: the bytes a ring allreduce moves per rank).

Usage: ``python bench/bench_allreduce.py [--quick] [--json PATH] [--refit PATH] [--world W]``.
``--refit PATH`` writes a threshold table (specverify.comm.thresholds JSON) fit to the rows (multi-GPU only).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import statistics
import subprocess
import tempfile
import time
import traceback

import torch

KiB = 1024
SIZES = [KiB * k for k in (1, 2, 4, 8, 14, 16, 32, 56, 64, 128, 256, 512, 1024)]
QUICK_SIZES = [KiB * k for k in (1, 14, 56, 256, 1024)]
HIDDEN = 7168


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except Exception:
        return "?"


def _ints(rank: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randint(-4, 5, (n,), generator=g).to(torch.bfloat16)


def _time_graph(fn, calls: int, reps: int) -> float:
    """Median microseconds per call of ``fn`` replayed ``calls`` times inside one CUDA graph."""
    fn()  # warm-up (eager)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def _worker(rank, world, init_file, cfg, results):
    try:
        import torch.distributed as dist

        from specverify.comm import CustomAllReduce

        device = rank if cfg["one_gpu_per_rank"] else 0
        torch.cuda.set_device(device)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        ar = CustomAllReduce(dist.group.WORLD, device=device, max_bytes=2 * 1024 * 1024,
                             nccl=cfg["one_gpu_per_rank"])
        if ar.disabled:
            raise RuntimeError(f"custom allreduce disabled: {ar.disabled_reason}")
        rows = []
        for nbytes in cfg["sizes"]:
            n = nbytes // 2
            providers = ["oneshot", "twoshot", "fused"] + (["nccl"] if ar.nccl is not None else [])
            for algo in providers:
                seed = nbytes + len(algo)
                x = _ints(rank, n, seed).cuda()
                want = sum(_ints(r, n, seed).double() for r in range(world)).to(torch.bfloat16)
                if algo == "fused":
                    # rows of the model's hidden size where the message allows it, else the largest that divides
                    hidden = next(h for h in (HIDDEN, 4096, 2048, 1024, 512, 256, 128, 64, 8) if n % h == 0)
                    xf = x.view(n // hidden, hidden)
                    residual = torch.zeros_like(xf)
                    weight = torch.ones(hidden, dtype=torch.bfloat16, device="cuda")
                    out = torch.empty_like(xf)
                    ar.all_reduce_residual_rmsnorm(xf, residual, weight, out=out)
                    torch.cuda.synchronize()
                    ok = torch.equal(residual.flatten().cpu(), want)

                    def fn(xf=xf, residual=residual, weight=weight, out=out):
                        ar.all_reduce_residual_rmsnorm(xf, residual, weight, out=out)
                else:
                    out = torch.empty_like(x)
                    ar.all_reduce(x, out=out, algo=algo)
                    torch.cuda.synchronize()
                    ok = torch.equal(out.cpu(), want)

                    def fn(x=x, out=out, algo=algo):
                        ar.all_reduce(x, out=out, algo=algo)
                ar.check()
                if not ok:
                    raise AssertionError(f"{algo} at {nbytes} bytes gave a wrong sum")
                dist.barrier()
                us = _time_graph(fn, cfg["calls"], cfg["reps"])
                ar.check()
                rows.append(dict(algo=algo, nbytes=nbytes, us=us, world_size=world, link=ar.link,
                                 correctness_only=not cfg["one_gpu_per_rank"],
                                 busbw_gbps=2 * (world - 1) / world * nbytes / us / 1e3))
        dist.barrier()
        ar.close()
        dist.destroy_process_group()
        results.put((rank, "ok", rows))
    except BaseException:
        results.put((rank, "fail", traceback.format_exc()))


def _run(world: int, cfg: dict, wall_s: float):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(prefix="sv_bench_ar_"), "store")
    procs = [ctx.Process(target=_worker, args=(r, world, init_file, cfg, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + wall_s
    while len(got) < world and time.monotonic() < deadline:
        try:
            rank, status, payload = results.get(timeout=1.0)
            got[rank] = (status, payload)
            if status != "ok":
                break
        except queue.Empty:
            if all(p.exitcode is not None for p in procs):
                break
    for p in procs:
        p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        if p.is_alive():
            p.kill()
    fails = {r: msg for r, (status, msg) in got.items() if status != "ok"}
    if fails or 0 not in got:
        raise SystemExit("benchmark failed:\n" + "\n".join(f"rank {r}: {m}" for r, m in fails.items())
                         + ("" if 0 in got else f"\nrank 0 reported nothing within {wall_s:.0f} s"))
    return got[0][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 sizes, fewer calls and replays")
    ap.add_argument("--json", metavar="PATH", help="write meta + rows as JSON")
    ap.add_argument("--refit", metavar="PATH", help="write a threshold table fit to the rows (multi-GPU only)")
    ap.add_argument("--world", type=int, default=None, help="ranks (default: GPUs, or 2 sharing one GPU)")
    ap.add_argument("--wall-s", type=float, default=150.0, help="kill the ranks after this many seconds")
    args = ap.parse_args()

    n_gpu = torch.cuda.device_count()
    if n_gpu == 0:
        raise SystemExit("bench_allreduce needs a CUDA GPU")
    one_gpu_per_rank = n_gpu >= 2
    world = args.world or (min(n_gpu, 8) if one_gpu_per_rank else 2)
    if one_gpu_per_rank and world > n_gpu:
        raise SystemExit(f"--world {world} > {n_gpu} GPUs")
    cfg = dict(sizes=QUICK_SIZES if args.quick else SIZES, one_gpu_per_rank=one_gpu_per_rank,
               calls=5 if not one_gpu_per_rank else (10 if args.quick else 50),
               reps=3 if not one_gpu_per_rank else (5 if args.quick else 20))
    rows = _run(world, cfg, args.wall_s)

    import cupy

    meta = dict(gpu=torch.cuda.get_device_name(0), gpus=n_gpu, world_size=world, torch=torch.__version__,
                cuda=torch.version.cuda, cupy=cupy.__version__, commit=_commit(),
                date=datetime.datetime.now().isoformat(timespec="seconds"),
                correctness_only=not one_gpu_per_rank,
                note=("ranks share one GPU: their kernels time-slice, figures are correctness-only"
                      if not one_gpu_per_rank else "one process per GPU"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    if args.refit:
        if not one_gpu_per_rank:
            print("--refit skipped: figures from ranks sharing one GPU are correctness-only")
        else:
            from specverify.comm import thresholds

            plain = [r for r in rows if r["algo"] in ("oneshot", "twoshot", "nccl")]
            thresholds.refit(plain, rows[0]["link"], world).save(args.refit)
            print(f"threshold table written to {args.refit}")

    print(f"# {meta['gpu']} x{n_gpu}, world {world}, link {rows[0]['link'] if rows else '?'}, {meta['note']}")
    algos = sorted({r["algo"] for r in rows}, key=["oneshot", "twoshot", "fused", "nccl"].index)
    print(f"{'bytes':>9} " + " ".join(f"{a + ' us':>12}" for a in algos)
          + ("" if not one_gpu_per_rank else f" {'busbw GB/s (1-shot)':>20}"))
    for nbytes in cfg["sizes"]:
        cells = {r["algo"]: r for r in rows if r["nbytes"] == nbytes}
        line = f"{nbytes:>9} " + " ".join(
            f"{cells[a]['us']:>12.1f}" if a in cells else f"{'-':>12}" for a in algos)
        if one_gpu_per_rank and "oneshot" in cells:
            line += f" {cells['oneshot']['busbw_gbps']:>20.1f}"
        print(line + ("  (correctness-only)" if not one_gpu_per_rank else ""))


if __name__ == "__main__":
    main()
