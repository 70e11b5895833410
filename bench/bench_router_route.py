"""Benchmark: a MoE layer's router GEMV and routing in one launch (``specverify.moe_layer.router_route``) against the
launches the pass otherwise runs (``specverify.gemv.linear``, then ``moe_route`` with the shared slot), at Kimi-K2 /
DeepSeek-V3 rank shapes (tp 8), each timed by CUDA-graph replay over ``--sets`` router weights in turn (HBM, not
L2), with the bytes floor (the router's bytes over a copy bandwidth of the same run) (issue 22). ``--rrows`` times
the one launch once per rows-a-round of its routing (``_RR_ROWS``).

Usage: ``python bench/bench_router_route.py [--models kimi-k2,deepseek-v3] [--tokens 1,3,4,8,16] [--sets 16]
[--rrows 4] [--json PATH]``.
"""
from __future__ import annotations

import argparse
import sys

import torch

from specverify.benchmarking import copy_bandwidth_gbps, graph_us, write_rows_json

_RANK = {"kimi-k2": dict(h=7168, e=384, top_k=8, n_group=1, topk_group=1, scale=2.827),
         "deepseek-v3": dict(h=7168, e=256, top_k=8, n_group=8, topk_group=4, scale=2.5)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="kimi-k2,deepseek-v3")
    ap.add_argument("--tokens", default="1,3,4,8,16")
    ap.add_argument("--sets", type=int, default=16, help="router weights cycled through (HBM, not L2)")
    ap.add_argument("--rrows", default="4", help="comma list of rows a routing round")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_router_route: needs a CUDA device", file=sys.stderr)
        return 2
    import specverify.moe_layer as layer
    from specverify.gemv import linear
    from specverify.moe import moe_route

    dev = torch.device("cuda")
    bw = copy_bandwidth_gbps()
    rows = []
    saved = layer._RR_ROWS
    for model in args.models.split(","):
        c = _RANK[model]
        h, e = c["h"], c["e"]
        g = torch.Generator(device=dev).manual_seed(0)
        sets = [(torch.randn(e, h, device=dev, generator=g).mul_(h ** -0.5).bfloat16(),
                 torch.randn(e, device=dev, generator=g) * 0.05) for _ in range(args.sets)]
        rk = dict(top_k=c["top_k"], scoring="sigmoid", n_group=c["n_group"], topk_group=c["topk_group"],
                  renormalize=True, routed_scaling_factor=c["scale"])
        for m in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(m, h, device=dev).bfloat16()
            logits32 = torch.randn(m, e, device=dev)

            def chain():
                for router, bias in sets:
                    moe_route(linear(x, router), correction_bias=bias, shared_expert_id=e, impl="triton", **rk)

            def gemv_alone():
                for router, _ in sets:
                    linear(x, router)

            def route_alone():
                for _, bias in sets:
                    moe_route(logits32, correction_bias=bias, shared_expert_id=e, impl="triton", **rk)

            def fused():
                for router, bias in sets:
                    layer.router_route(x, router, correction_bias=bias, shared_expert_id=e, **rk)

            floor = 2 * e * h / (bw * 1e3)
            row = {"model": model, "m": m, "floor_us": floor}
            for name, fn in (("chain", chain), ("gemv", gemv_alone), ("route", route_alone)):
                row[f"{name}_us"] = graph_us(fn, calls=2, replays=10, repeats=5, stat="median") / len(sets)
            for rr in (int(r) for r in args.rrows.split(",")):
                layer._RR_ROWS = rr
                row[f"fused_rr{rr}_us"] = graph_us(fused, calls=2, replays=10, repeats=5, stat="median") / len(sets)
            layer._RR_ROWS = saved
            rows.append(row)
            print(f"{model:>12} M={m:2d}: " + ", ".join(f"{k[:-3]} {v:6.2f}" for k, v in row.items()
                                                       if k.endswith("_us")) + " us", flush=True)
    if args.json:
        write_rows_json(args.json, __file__, rows, copy_bw_gbps=bw, args=vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
