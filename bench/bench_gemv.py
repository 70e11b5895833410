"""Benchmark: the verify pass's projections at M = 1-8 rows, cuBLAS (``torch.matmul``, what the pass runs today) and
our candidate (``specverify.gemv``: swap-AB ``tl.dot`` tiles, split K, one launch) side by side, against the
weight-bytes floor (issue 22).

A first kernel of ours (one program per weight-row tile, broadcast products reduced with ``tl.sum``, no split-K)
measured 0.76x-15x cuBLAS's time here (faster only at q_b, M = 1) and was removed; its rows are in
``bench/results/bench_gemv_2026-12-02.json``.

Shapes: one tp-8 rank of Kimi-K2 and DeepSeek-V3 (q_a + kv_a 7168 -> 2112, q_b 1536 -> heads x 192, o_proj
heads x 128 -> 7168, router 7168 -> experts, the LM head's vocabulary shard 7168 -> 20480).

Timing: :func:`specverify.benchmarking.graph_us` over one CUDA graph of back-to-back projections, each over its own
copy of the weight (copies enough to exceed 4x the L2 cache, so every call reads HBM as in the pass, where each
layer has its own weights).
``floor_us = N * K * bytes / copy_bw`` with ``copy_bw`` a device-to-device copy in the same run; ``bw_frac`` =
floor / measured. Every row is checked against the fp32 reference first.

Each row also times ours with programmatic dependent launch off (``SPECVERIFY_PDL=0``: each call waits for the
previous one) and with PDL but without the L2 prefetch of the weight's first columns (``ours_no_prefetch_us``);
the default (PDL with prefetch on sm_90+) is ``ours_us``. A variant with q_a's RMSNorm in the q_b GEMV's prologue
measured slower than RMSNorm + GEMV with PDL and was removed (bench/RESULTS.md, "Verify pass").

Usage: ``python bench/bench_gemv.py [--quick] [--json PATH]`` (``--quick``: M = 1, 4, 8; about a minute).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys

import torch

from specverify.benchmarking import copy_bandwidth_gbps, graph_us, token_counts, write_rows_json

#: (model, projection) -> (N, K) for one tp-8 rank
SHAPES = {
    ("kimi-k2", "qkv_a"): (2112, 7168), ("kimi-k2", "q_b"): (8 * 192, 1536), ("kimi-k2", "o_proj"): (7168, 8 * 128),
    ("kimi-k2", "router"): (384, 7168), ("kimi-k2", "lm_head"): (20480, 7168),
    ("deepseek-v3", "q_b"): (16 * 192, 1536), ("deepseek-v3", "o_proj"): (7168, 16 * 128),
    ("deepseek-v3", "router"): (256, 7168),
}


@contextlib.contextmanager
def _pdl_off():
    """Calls made (and captured) inside launch without PDL."""
    old = os.environ.get("SPECVERIFY_PDL")
    os.environ["SPECVERIFY_PDL"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["SPECVERIFY_PDL"]
        else:
            os.environ["SPECVERIFY_PDL"] = old


@contextlib.contextmanager
def _no_prefetch():
    from specverify import gemv as gemv_mod

    old = gemv_mod._CONFIG["PREFETCH_BYTES"]
    gemv_mod._CONFIG["PREFETCH_BYTES"] = 0
    try:
        yield
    finally:
        gemv_mod._CONFIG["PREFETCH_BYTES"] = old


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="M = 1, 4, 8")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    ap.add_argument("--ms", type=token_counts, help="comma-separated M (default 1, 2, 4, 8)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemv: needs a CUDA GPU", file=sys.stderr)
        return 2
    ms = args.ms or ([1, 4, 8] if args.quick else [1, 2, 4, 8])
    bw = copy_bandwidth_gbps() * 1e9
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    rows = []
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; us per call (bw fraction)")
    from specverify.gemv import gemv, gemv_split

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{'model':>12} {'proj':>8} {'M':>3} {'N':>6} {'K':>6} {'floor':>7} {'ours':>14} {'cuBLAS':>14}  ours/cuBLAS")
    for (model, proj), (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(2, -(-4 * l2 // nbytes))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        floor = nbytes / bw * 1e6
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = (x.float() @ ws[0].float().t()).to(torch.bfloat16).float()
            scale = float(want.abs().max())
            err = float(((x @ ws[0].t()).float() - want).abs().max()) / scale
            err_ours = float((gemv(x, ws[0]).float() - want).abs().max()) / scale
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            cycle = itertools.cycle(ws)  # each captured call reads the next copy: HBM, as in the pass
            cublas = graph_us(lambda: torch.matmul(x, next(cycle).t(), out=out), calls=len(ws), replays=5, repeats=5)
            ours = graph_us(lambda: gemv(x, next(cycle), out=out), calls=len(ws), replays=5, repeats=5)
            with _pdl_off():
                ours_nopdl = graph_us(lambda: gemv(x, next(cycle), out=out), calls=len(ws), replays=5, repeats=5)
            with _no_prefetch():
                ours_nopf = graph_us(lambda: gemv(x, next(cycle), out=out), calls=len(ws), replays=5, repeats=5)
            row = dict(model=model, proj=proj, m=m, n=n, k=k, floor_us=floor, cublas_us=cublas, ours_us=ours,
                       ours_no_pdl_us=ours_nopdl, ours_no_prefetch_us=ours_nopf,
                       cublas_bw_frac=floor / cublas, ours_bw_frac=floor / ours, ours_over_cublas=ours / cublas,
                       max_rel_err_vs_fp32=err, ours_max_rel_err_vs_fp32=err_ours, weight_copies=copies,
                       split=gemv_split(n, k, sms))
            rows.append(row)
            print(f"{model:>12} {proj:>8} {m:>3} {n:>6} {k:>6} {floor:7.2f} {ours:7.2f} ({floor / ours:4.0%}) "
                  f"{cublas:7.2f} ({floor / cublas:4.0%})  {ours / cublas:5.2f}  err {err_ours:.1e}  "
                  f"no-PDL {ours_nopdl:.2f} no-prefetch {ours_nopf:.2f}")
        del ws
        torch.cuda.empty_cache()
    if args.json:
        write_rows_json(args.json, __file__, rows, copy_bandwidth_gbps=bw / 1e9)
    return 0


if __name__ == "__main__":
    sys.exit(main())
