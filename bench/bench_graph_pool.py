"""Benchmark of VerifyGraphPool: capture cost, pool memory, launch vs GPU time, and the cost of switching k.

For k in {1,2,3,4,6,8} x batch buckets {1,2,4,8,16,32} it captures one graph per key into one pool (largest
first) and reports, per graph: capture ms, pool growth, node count, host launch us vs GPU us of one replay and
whether the pass is launch-bound; then the pool's memory against its largest graph (acceptance: <= 1.2x); then,
per switch batch, verify time per k when k alternates every step (1,4,2,8,3,6,...) against the same k repeated
(acceptance: within 5%).

GPU time per step comes from CUDA events around each replay, with the whole step sequence queued behind a spin
kernel so the GPU runs it back to back (host launch cost excluded); ``wall us/step`` is the host loop's time per
step, synchronised once at the end (launch cost included).

Forward: ``--forward toy`` (the fallback when the verify model cannot be built) is
specverify.graph_pool.make_toy_verify; ``--forward reference`` (the default, ``auto``, when it can) is the verify
forward, specverify.forward.model.build_verify_model, on kimi-k2 per-rank shapes (tp 8, ``--layers`` layers,
specverify's kernels) through its adapter's ``make_inputs(batch, k)`` / ``verify(inputs, k)`` methods.

    python bench/bench_graph_pool.py --quick --json graph_pool.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time

import torch

from specverify.graph_pool import VerifyGraphPool, make_toy_verify

KS = [1, 2, 3, 4, 6, 8]
BUCKETS = [1, 2, 4, 8, 16, 32]
SWITCH_PATTERN = [1, 4, 2, 8, 3, 6]


def _verify_model_forward(layers: int):
    from specverify.configs import get_config
    from specverify.forward.model import build_verify_model

    model = build_verify_model(get_config("kimi-k2"), tp=8, num_layers=layers, device="cuda", dtype=torch.bfloat16)
    return model.verify, model.make_inputs, f"kimi-k2 reference, tp 8, {layers} layers"


def _forward(args):
    if args.forward in ("auto", "reference"):
        try:
            return _verify_model_forward(args.layers)
        except (ImportError, AttributeError, TypeError) as e:
            if args.forward == "reference":
                raise SystemExit(f"--forward reference: {e}")
            print(f"note: the verify model is unavailable ({e}); using the toy forward", file=sys.stderr)
    fwd, make = make_toy_verify(hidden=args.hidden, vocab=args.vocab, layers=args.layers, prefix=args.prefix,
                                device="cuda")
    return fwd, make, f"toy (hidden {args.hidden}, vocab {args.vocab}, {args.layers} layers, prefix {args.prefix})"


def _timed_sequence(pool: VerifyGraphPool, batch: int, seq: list[int], host_us: dict[int, float]):
    """GPU us per step (events, queued behind a spin kernel) and host wall us per step for a sequence of k."""
    for k in set(seq):
        pool.replay(batch, k)
    torch.cuda.synchronize()
    gpu: dict[int, list[float]] = {k: [] for k in set(seq)}
    chunk = 64  # steps per queued burst: stays well inside the launch queue
    for s in range(0, len(seq), chunk):
        part = seq[s:s + chunk]
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in part]
        ahead_us = 2.0 * sum(host_us[k] + 20.0 for k in part) + 100.0
        torch.cuda._sleep(int(ahead_us * 2000))  # ~2 GHz SM clock
        for k, (a, b) in zip(part, events):
            a.record()
            pool.replay(batch, k)
            b.record()
        torch.cuda.synchronize()
        for k, (a, b) in zip(part, events):
            gpu[k].append(a.elapsed_time(b) * 1e3)
    # host loop without events or spin kernel, synchronised once: launch cost included
    t0 = time.perf_counter()
    for k in seq:
        pool.replay(batch, k)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e6 / len(seq)
    return {k: statistics.median(v) for k, v in gpu.items()}, wall


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer iterations (about 30 s)")
    p.add_argument("--json", default=None, metavar="PATH", help="write rows as JSON")
    p.add_argument("--forward", choices=["auto", "toy", "reference"], default="auto")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=20480)
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--switch-batches", default="1,8", help="batch sizes for the switch-mode comparison")
    p.add_argument("--iters", type=int, default=None, help="replays per timing (default 100, --quick 20)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_graph_pool needs a CUDA GPU (CUDA graphs); nothing to measure on this machine")
        return 0
    iters = args.iters or (20 if args.quick else 100)
    fwd, make, what = _forward(args)
    print(f"forward: {what}", file=sys.stderr)
    pool = VerifyGraphPool(fwd, make, batch_buckets=BUCKETS, draft_lengths=KS, capture="eager")
    records = {(r["batch_bucket"], r["k"]): r for r in pool.report()}
    rows = []
    for bucket, k in pool.keys():
        t = pool.time_replay(bucket, k, iters=iters)
        rows.append({"kind": "graph", **records[(bucket, k)], **{n: t[n] for n in ("host_us", "gpu_us",
                                                                                 "launch_bound")}})
        print(f"timed bucket {bucket:>2} k {k}", file=sys.stderr)
    largest, total = pool.largest_graph_bytes(), pool.pool_bytes()
    summary = {"kind": "pool", "graphs": len(rows), "pool_bytes": total, "largest_graph_bytes": largest,
               "pool_over_largest": total / largest if largest else float("nan")}
    switch_rows = []
    host = {(r["batch_bucket"], r["k"]): r["host_us"] for r in rows}
    for batch in [int(x) for x in args.switch_batches.split(",") if x.strip()]:
        bucket = pool.bucket_of(batch)
        h = {k: host[(bucket, k)] for k in KS}
        reps = max(iters // 2, 5)
        fixed_gpu, fixed_wall = {}, {}
        for k in KS:
            g, w = _timed_sequence(pool, batch, [k] * reps, h)
            fixed_gpu[k], fixed_wall[k] = g[k], w
        pattern = [k for k in SWITCH_PATTERN if k in KS] + [k for k in KS if k not in SWITCH_PATTERN]
        switch_gpu, switch_wall = _timed_sequence(pool, batch, pattern * reps, h)
        for k in KS:
            switch_rows.append({"kind": "switch", "batch": batch, "k": k, "fixed_gpu_us": fixed_gpu[k],
                                "switch_gpu_us": switch_gpu[k], "switch_over_fixed": switch_gpu[k] / fixed_gpu[k],
                                "fixed_wall_us_per_step": fixed_wall[k],
                                "switch_wall_us_per_step_mean_over_pattern": switch_wall})

    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "forward": what, "iters": iters}
    try:
        meta["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        check=False).stdout.strip() or None
    except OSError:
        meta["commit"] = None
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": [*rows, summary, *switch_rows]}, f, indent=2)

    mib = 2 ** 20
    print(f"\n{meta['gpu']}  torch {meta['torch']}  forward: {what}")
    print(f"{'bucket':>6} {'k':>2} {'capture ms':>10} {'pool +MiB':>9} {'nodes':>6} {'host us':>8} {'GPU us':>8}"
          f"  launch-bound")
    for r in rows:
        nodes = "-" if r["node_count"] is None else str(r["node_count"])
        print(f"{r['batch_bucket']:>6} {r['k']:>2} {r['capture_ms']:>10.1f} {r['pool_growth_bytes'] / mib:>9.1f} "
              f"{nodes:>6} {r['host_us']:>8.1f} {r['gpu_us']:>8.1f}  {'LAUNCH-BOUND' if r['launch_bound'] else ''}")
    print(f"\npool: {len(rows)} graphs, {total / mib:.1f} MiB; largest graph alone {largest / mib:.1f} MiB; "
          f"pool / largest = {summary['pool_over_largest']:.3f} (target <= 1.2)")
    print(f"\n{'batch':>5} {'k':>2} {'fixed GPU us':>12} {'switch GPU us':>13} {'switch/fixed':>12} "
          f"{'fixed wall us/step':>18}")
    for r in switch_rows:
        flag = "" if abs(r["switch_over_fixed"] - 1) <= 0.05 else "  > 5% apart"
        print(f"{r['batch']:>5} {r['k']:>2} {r['fixed_gpu_us']:>12.1f} {r['switch_gpu_us']:>13.1f} "
              f"{r['switch_over_fixed']:>12.3f} {r['fixed_wall_us_per_step']:>18.1f}{flag}")
    for batch in sorted({r["batch"] for r in switch_rows}):
        sw = next(r for r in switch_rows if r["batch"] == batch)["switch_wall_us_per_step_mean_over_pattern"]
        fx = statistics.mean(r["fixed_wall_us_per_step"] for r in switch_rows if r["batch"] == batch)
        print(f"batch {batch}: wall us/step switching {sw:.1f} vs mean over fixed k {fx:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
