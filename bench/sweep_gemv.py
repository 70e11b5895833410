"""Sweep: the skinny GEMV's launch configs (tile, split waves, warps, stages) against cuBLAS at the verify pass's
projection shapes, in one device call (issue 22).

For each shape (one tp-8 rank of Kimi-K2 / DeepSeek-V3, ``bench_gemv.SHAPES``) and M in ``--ms``: every config of
``CONFIGS`` is checked against the fp32 reference and timed by CUDA-graph replay over copies of the weight (enough to
exceed 4x L2, so each call reads HBM as in the pass); cuBLAS (``torch.matmul``) beside it. ``bw`` = weight bytes /
time / copy bandwidth of the same run.

Usage: ``python bench/sweep_gemv.py [--ms 1,4] [--shapes kimi-k2:qkv_a,...] [--row-range] [--json PATH]``; prints a
table last.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_gemv import SHAPES  # noqa: E402

from specverify.benchmarking import copy_bandwidth_gbps, graph_us, token_counts, write_rows_json  # noqa: E402

#: candidate overrides of each shape's config (``specverify.gemv.gemv_config``: ``_CONFIG`` and its
#: ``SHAPE_CONFIGS`` rule; the first, empty, is today's launch)
CONFIGS = [
    {},
    {"num_stages": 4}, {"num_stages": 5}, {"num_warps": 8},
    {"WAVES": 3}, {"WAVES": 4}, {"WAVES": 4, "num_stages": 4},
    {"BLOCK_K": 256}, {"BLOCK_K": 256, "num_stages": 4}, {"BLOCK_K": 256, "WAVES": 4},
    {"BLOCK_N": 128}, {"BLOCK_N": 128, "WAVES": 3}, {"BLOCK_N": 128, "num_warps": 8},
    {"BLOCK_N": 32}, {"BLOCK_N": 32, "WAVES": 4},
    # row ranges: one range of weight rows a program over all K, no split reduce (``ROW_RANGE``)
    {"ROW_RANGE": True, "WAVES": 1, "BLOCK_K": 128, "num_stages": 4},
    {"ROW_RANGE": True, "WAVES": 1, "BLOCK_K": 256, "num_stages": 3},
    {"ROW_RANGE": True, "WAVES": 1, "BLOCK_K": 256, "num_stages": 4},
    {"ROW_RANGE": True, "WAVES": 1, "BLOCK_K": 512, "num_stages": 3},
    {"ROW_RANGE": True, "WAVES": 1, "BLOCK_K": 256, "num_stages": 3, "num_warps": 8},
    {"ROW_RANGE": True, "WAVES": 2, "BLOCK_K": 256, "num_stages": 3},
    {"ROW_RANGE": True, "WAVES": 2, "BLOCK_K": 128, "num_stages": 4},
]


def _name(over: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in over.items()) or "default"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", type=token_counts, default=[1, 2, 4, 8])
    ap.add_argument("--shapes", default="", help="comma-separated model:proj (default: all of bench_gemv.SHAPES but "
                                                 "the LM head)")
    ap.add_argument("--row-range", action="store_true", help="today's launch and the row-range candidates only")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    configs = [c for c in CONFIGS if not c or c.get("ROW_RANGE")] if args.row_range else CONFIGS
    if not torch.cuda.is_available():
        print("sweep_gemv: needs a CUDA GPU", file=sys.stderr)
        return 2
    from specverify import gemv as gm

    keys = [tuple(s.split(":")) for s in args.shapes.split(",") if s] or [k for k in SHAPES if k[1] != "lm_head"]
    bw = copy_bandwidth_gbps() * 1e9
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    base = dict(gm._CONFIG)
    rules = gm.SHAPE_CONFIGS
    gm.SHAPE_CONFIGS = ()  # each candidate applies on top of the shape's own config (its rule, looked up below)
    rows = []
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    for key in keys:
        n, k = SHAPES[key]
        nbytes = n * k * 2
        copies = max(2, -(-4 * l2 // nbytes))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        floor = nbytes / bw * 1e6
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            want = (x.float() @ ws[0].float().t())
            scale = float(want.abs().max())
            cycle = itertools.cycle(ws)
            cublas = graph_us(lambda: torch.matmul(x, next(cycle).t(), out=out), calls=len(ws), replays=5, repeats=5)
            row = dict(model=key[0], proj=key[1], m=m, n=n, k=k, floor_us=floor, cublas_us=cublas, configs={})
            gm.SHAPE_CONFIGS = rules
            shape_cfg = gm.gemv_config(m, n, k)  # today's launch of this shape ("default")
            gm.SHAPE_CONFIGS = ()
            for over in configs:
                gm._CONFIG.clear()
                gm._CONFIG.update(shape_cfg, **over)
                try:
                    out.fill_(float("nan"))
                    err = float((gm.gemv(x, ws[0], out=out).float() - want).abs().max()) / scale
                    if not err < 2e-2:
                        raise RuntimeError(f"error {err:.3g}")
                    us = graph_us(lambda: gm.gemv(x, next(cycle), out=out), calls=len(ws), replays=5, repeats=5)
                except Exception as exc:  # a config that does not compile or fit: recorded, not fatal
                    row["configs"][_name(over)] = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
                    continue
                row["configs"][_name(over)] = {"us": us, "bw": floor / us, "err": err}
            gm._CONFIG.clear()
            gm._CONFIG.update(base)
            rows.append(row)
            ok = {c: v["us"] for c, v in row["configs"].items() if "us" in v}
            best = min(ok, key=ok.get) if ok else "-"
            line = (f"{key[0]:>11} {key[1]:>7} M{m:<2} floor {floor:6.2f} cuBLAS {cublas:6.2f} default "
                    f"{ok.get('default', float('nan')):6.2f} best {ok.get(best, float('nan')):6.2f} ({best}, "
                    f"{floor / ok[best] if ok else 0:.0%})")
            print(line, flush=True)
        del ws
        torch.cuda.empty_cache()
    gm.SHAPE_CONFIGS = rules
    if args.json:
        write_rows_json(args.json, __file__, rows, copy_bandwidth_gbps=bw / 1e9)
    return 0


if __name__ == "__main__":
    sys.exit(main())
