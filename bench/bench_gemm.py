"""Benchmark: the dense projections of a verify pass at small M, cuBLAS (``torch.matmul``) against
``specverify.gemm.skinny_linear``, and both against the weight-bytes floor.

Shapes: the per-rank projections of Kimi-K2 at tp 8 (qkv_a, q_b, o_proj, router, LM head) and Llama-3.1-8B at tp 1
(qkv, o, gate_up, down, LM head), M = 1, 4, 8, 16 tokens. Each graph holds 20 calls that cycle through enough
distinct weight copies (>= 256 MB together) that every call reads its weight from HBM, not from the 50 MB L2.

Metric: µs per call by CUDA-graph replay; ``floor_us = N * K * 2 bytes / copy_bw`` with ``copy_bw`` a device-to-device
copy measured in the same run (``2 * bytes / time``); ``x_floor = measured / floor``; ``vs_cublas`` = cuBLAS time /
ours. Correctness (max relative error against an fp32 matmul) is checked before timing.

Usage: ``python bench/bench_gemm.py [--quick] [--json PATH] [--budget-s S]``; prints a table last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch

from specverify.benchmarking import copy_bandwidth_gbps, git_commit, graph_us

SHAPES = {  # name: (N, K)
    "kimi-k2 qkv_a": (1536 + 576, 7168),
    "kimi-k2 q_b": (8 * 192, 1536),
    "kimi-k2 o_proj": (7168, 8 * 128),
    "kimi-k2 router": (384, 7168),
    "kimi-k2 lm_head": (20480, 7168),
    "llama-3.1-8b qkv": (6144, 4096),
    "llama-3.1-8b o": (4096, 4096),
    "llama-3.1-8b gate_up": (28672, 4096),
    "llama-3.1-8b down": (4096, 14336),
}
CONFIGS = [None, {"BLOCK_N": 16, "BLOCK_K": 512, "SPLIT_K": 1, "num_warps": 4},
           {"BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4},
           {"BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 2, "num_warps": 4},
           {"BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 4, "num_warps": 4},
           {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1, "num_warps": 8},
           {"BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 2}]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="M = 1 and 8, three configs")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--budget-s", type=float, default=300.0, help="start no new shape after this many seconds")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemm: needs a CUDA GPU", file=sys.stderr)
        return 2
    from specverify.gemm import skinny_linear

    t0 = time.time()
    bw = copy_bandwidth_gbps()
    print(f"# copy bandwidth {bw:.0f} GB/s; {torch.cuda.get_device_name()}", flush=True)
    ms = [1, 8] if args.quick else [1, 4, 8, 16]
    configs = CONFIGS[:3] if args.quick else CONFIGS
    rows = []
    for name, (n, k) in SHAPES.items():
        if time.time() - t0 > args.budget_s:
            print(f"# budget spent, skipping {name}")
            continue
        nbytes = n * k * 2
        copies = max(1, min(32, -(-(256 << 20) // nbytes)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
        floor = nbytes / (bw * 1e9) * 1e6
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = x.float() @ ws[0].float().t()
            cases = {"cublas": (lambda w: x @ w.t(), None)}
            for i, cfg in enumerate(configs):
                cases[f"triton{i}" if cfg else "triton"] = (
                    lambda w, cfg=cfg: skinny_linear(x, w, config=cfg, impl="triton"), cfg)
            times = {}
            for label, (fn, cfg) in cases.items():
                try:
                    err = ((fn(ws[0]).float() - want).abs().max() / want.abs().max()).item()
                    it = iter(range(10 ** 9))

                    def call(fn=fn, it=it):
                        fn(ws[next(it) % copies])

                    us = graph_us(call, calls=copies if copies >= 8 else 20, replays=10, repeats=3)
                except Exception as exc:  # a config that does not compile here: say so, keep going
                    print(f"  {name:22s} M{m:<3d} {label:9s} failed: {type(exc).__name__}: {exc}", flush=True)
                    continue
                times[label] = us
                row = dict(shape=name, n=n, k=k, m=m, provider=label, config=cfg, us=us, floor_us=floor,
                           x_floor=us / floor, rel_err=err)
                rows.append(row)
                print(f"  {name:22s} M{m:<3d} {label:9s} {us:8.2f} us  x_floor {us / floor:5.2f}  err {err:.1e}",
                      flush=True)
            best = min((v, kk) for kk, v in times.items() if kk != "cublas") if len(times) > 1 else None
            if best and "cublas" in times:
                rows.append(dict(shape=name, m=m, provider="summary", best=best[1], best_us=best[0],
                                 cublas_us=times["cublas"], vs_cublas=times["cublas"] / best[0], floor_us=floor))
        del ws
        torch.cuda.empty_cache()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, commit=git_commit(__file__),
                date=datetime.datetime.now().isoformat(timespec="seconds"), copy_bw_gbps=bw)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\n{'shape':22s} {'M':>3s} {'floor us':>9s} {'cuBLAS us':>10s} {'best ours':>10s} {'vs cuBLAS':>9s} best")
    for r in rows:
        if r["provider"] == "summary":
            print(f"{r['shape']:22s} {r['m']:3d} {r['floor_us']:9.2f} {r['cublas_us']:10.2f} {r['best_us']:10.2f} "
                  f"{r['vs_cublas']:9.2f} {r['best']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
