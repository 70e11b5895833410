"""Benchmark: the L2 weight prefetch beside a latency-bound window (``specverify.prefetch.prefetch_l2``, issue 22).

One Kimi-K2 tp-8 layer's post-attention weights (o_proj 1024 -> 7168, router 7168 -> 384, shared expert gate/up
7168 -> 512 and down 256 -> 7168: 31.2 MB), in ``--sets`` copies so each call reads HBM. One iteration is what the
verify pass does after qkv_a at one token: a window of ``--window`` small dependent kernels (standing in for q_a's
norm, q_b, MLA preparation, attention, merge and the V up-projection, which read ~10 MB), then the four
projections (cuBLAS, as ``torch.matmul``). Rows:

* ``window``: the window alone; ``consumers``: the projections alone (cold); ``hot``: the projections on one set
  (L2-resident: the best a prefetch can give);
* ``none``: window then projections, no prefetch (the pass without it);
* ``<mode>/<programs>``: the same with the prefetch forked onto a side stream at the window's start and joined
  after the projections (the forward's schedule).

``saved_us = none - row``; ``ideal_us = none - (window + hot)``. CUDA-graph replay medians.

Usage: ``python bench/bench_prefetch.py [--window 8] [--sets 8] [--programs 16,32,64,132] [--modes line,bulk]
[--json PATH]``.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from specverify.benchmarking import copy_bandwidth_gbps, graph_us, run_meta

SHAPES = {"o_proj": (7168, 1024), "router": (384, 7168), "shared_gate_up": (512, 7168), "shared_down": (7168, 256)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=8, help="small kernels in the window")
    ap.add_argument("--sets", type=int, default=8, help="weight copies (each call reads the next)")
    ap.add_argument("--programs", default="16,32,64,132")
    ap.add_argument("--modes", default="line,bulk")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_prefetch: needs a CUDA device", file=sys.stderr)
        return 2
    from specverify import prefetch as pf

    dev = torch.device("cuda")
    bw = copy_bandwidth_gbps()
    sets = [{k: torch.randn(n, kk, device=dev, dtype=torch.bfloat16) * 0.02 for k, (n, kk) in SHAPES.items()}
            for _ in range(args.sets)]
    nbytes = sum(t.numel() * 2 for t in sets[0].values())
    x7168 = torch.randn(1, 7168, device=dev, dtype=torch.bfloat16)
    x1024 = torch.randn(1, 1024, device=dev, dtype=torch.bfloat16)
    x256 = torch.randn(1, 256, device=dev, dtype=torch.bfloat16)
    small = torch.zeros(1024, device=dev)
    side = torch.cuda.Stream(dev)
    state = {"i": 0}

    def window():
        for _ in range(args.window):
            small.add_(1.0)

    def consumers(w):
        x1024 @ w["o_proj"].t()
        x7168 @ w["router"].t()
        x7168 @ w["shared_gate_up"].t()
        x256 @ w["shared_down"].t()

    def nxt():
        state["i"] = (state["i"] + 1) % args.sets
        return sets[state["i"]]

    def with_prefetch(mode, programs):
        def fn():
            w = nxt()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                pf.prefetch_l2(list(w.values()), mode=mode, programs=programs)
            window()
            consumers(w)
            torch.cuda.current_stream().wait_stream(side)
        return fn

    rows = []

    def row(name, fn):
        us = graph_us(fn, calls=args.sets * 4, replays=20, repeats=3)
        rows.append({"row": name, "us": us})
        print(f"{name:>12} {us:8.2f} us", flush=True)

    row("window", window)
    row("consumers", lambda: consumers(nxt()))
    row("hot", lambda: consumers(sets[0]))
    row("none", lambda: (window(), consumers(nxt())))
    for mode in args.modes.split(","):
        for programs in (int(p) for p in args.programs.split(",")):
            row(f"{mode}/{programs}", with_prefetch(mode, programs))
    base = {r["row"]: r["us"] for r in rows}
    ideal = base["none"] - (base["window"] + base["hot"])
    print(f"\nweights {nbytes / 1e6:.1f} MB, floor {nbytes / (bw * 1e3):.2f} us at copy bw {bw:.0f} GB/s; "
          f"ideal saving {ideal:.2f} us")
    for r in rows:
        r["saved_us"] = base["none"] - r["us"]
        print(f"{r['row']:>12} {r['us']:8.2f} us  saved {r['saved_us']:6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": run_meta(__file__, copy_bw_gbps=bw, weight_bytes=nbytes, ideal_saving_us=ideal,
                                        args=vars(args)), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
