"""Benchmark: MoE routing + alignment (one launch) and the small-M expert GEMM against its weight-bytes floor.

Providers: ``reference`` (torch), ``triton`` (specverify), ``sglang`` (its Triton router ``moe_fused_gate``, its
alignment and its fused-MoE kernel, through ``bench/sglang_peer.py`` when that module and SGLang import).
Shapes: per-rank (tp 8) Kimi-K2, DeepSeek-V3, Qwen3-30B-A3B at M = 1, 2, 4, 8, 16, 32, 64 tokens.

Metrics: µs per call by ``triton.testing.do_bench`` (median, L2 flushed between calls) and by CUDA-graph replay
(20 calls per graph, L2 warm). For the expert GEMM:
``floor_us = distinct_experts * (w13 + w2 bytes per expert) / copy_bw`` with ``copy_bw`` a device-to-device copy
measured in the same run (``2 * bytes / time``), and ``floor_frac = floor_us / measured_us`` (1.0 = at the floor).

Usage: ``python bench/bench_moe.py [--quick] [--json PATH]`` (``--quick``: M = 1, 4, 16, 64, fewer repeats).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from specverify.benchmarking import run_meta, load_sglang_peer, bench_us, copy_bandwidth_gbps, graph_us, token_counts

# per-rank shapes at tp 8: hidden H, expert intermediate I (2048/8 etc.), experts, top-k, routing
MODELS = {
    "kimi-k2": dict(h=7168, inter=256, e=384, top_k=8, scoring="sigmoid", bias=True, n_group=1, topk_group=1,
                    scale=2.827),
    "deepseek-v3": dict(h=7168, inter=256, e=256, top_k=8, scoring="sigmoid", bias=True, n_group=8, topk_group=4,
                        scale=2.5),
    "qwen3-30b-a3b": dict(h=2048, inter=96, e=128, top_k=8, scoring="softmax", bias=False, n_group=1,
                          topk_group=1, scale=1.0),
}
BLOCK = 16


def _peer():
    return load_sglang_peer(__file__)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="M = 1, 4, 16, 64 and fewer repeats (< 90 s on H200)")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    ap.add_argument("--ms", type=token_counts, help="comma-separated token counts M (default 1, 2, 4, 8, 16, 32, 64; "
                                                    "1, 4, 16, 64 with --quick)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe: needs a CUDA GPU", file=sys.stderr)
        return 2

    from specverify.moe import fused_moe, moe_route
    from specverify.reference.moe import align_reference, fused_moe_reference, random_expert_weights, route_reference

    peer, peer_why = _peer()
    if peer is None:
        print(f"# sglang provider skipped: {peer_why}")
    ms_list = args.ms or ([1, 4, 16, 64] if args.quick else [1, 2, 4, 8, 16, 32, 64])
    t0 = time.time()
    bw = copy_bandwidth_gbps()
    print(f"# measured D2D copy bandwidth: {bw:.0f} GB/s", flush=True)
    meta = run_meta(__file__, copy_gbps=bw)
    rows = []
    for name in args.models.split(","):
        cfg = MODELS[name]
        e, h, inter, top_k = cfg["e"], cfg["h"], cfg["inter"], cfg["top_k"]
        gen = torch.Generator(device="cuda").manual_seed(0)
        w13, w2 = random_expert_weights(e, h, inter, generator=gen, device="cuda")
        bias = (torch.randn(e, device="cuda", generator=gen) * 0.05) if cfg["bias"] else None
        expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
        rkw = dict(top_k=top_k, scoring=cfg["scoring"], correction_bias=bias, n_group=cfg["n_group"],
                   topk_group=cfg["topk_group"], routed_scaling_factor=cfg["scale"])
        for m in ms_list:
            logits = torch.randn(m, e, device="cuda", generator=gen).bfloat16()
            hidden = torch.randn(m, h, device="cuda", generator=gen).bfloat16()
            # correctness before timing
            ids, w, al = moe_route(logits, block_size=BLOCK, impl="triton", **rkw)
            rids, rw = route_reference(logits, top_k, cfg["scoring"], bias, cfg["n_group"], cfg["topk_group"], True,
                                       cfg["scale"])
            agree = (ids == rids).float().mean().item()
            out = fused_moe(hidden, w13, w2, ids, w, alignment=al, impl="triton")
            distinct = int(torch.unique(ids[ids >= 0]).numel())
            if m <= 16:
                ref = fused_moe_reference(hidden, w13, w2, ids, w)
                rel = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
            else:
                rel = float("nan")
            base = dict(model=name, m=m, distinct_experts=distinct, ids_agree=agree, moe_rel_err=rel)

            def add(op, provider, fn, floor_us=None):
                try:
                    us = bench_us(fn, args.quick)
                    gus = graph_us(fn)
                except Exception as exc:  # a provider that fails is reported, not fatal
                    print(f"# {name} M={m} {op}/{provider} failed: {exc}")
                    return
                row = dict(base, op=op, provider=provider, us=us, graph_us=gus)
                if floor_us is not None:
                    row.update(floor_us=floor_us, floor_frac=floor_us / us)
                rows.append(row)
                # progress as it goes: a step cut by its time limit still shows what it measured
                print(f"# {name} M={m} {op}/{provider}: {us:.2f} us eager, {gus:.2f} us graph "
                      f"({time.time() - t0:.0f} s)", flush=True)

            add("route+align", "triton", lambda: moe_route(logits, block_size=BLOCK, impl="triton", **rkw))
            if not args.quick or m <= 4:
                rows.append(dict(base, op="route+align", provider="reference",
                                 us=bench_us(lambda: align_reference(route_reference(
                                     logits, top_k, cfg["scoring"], bias, cfg["n_group"], cfg["topk_group"], True,
                                     cfg["scale"])[0], e, BLOCK), args.quick), graph_us=float("nan")))
            if peer is not None and hasattr(peer, "route_and_align"):
                add("route+align", "sglang", lambda: peer.route_and_align(logits, bias, BLOCK, **{
                    k: v for k, v in rkw.items() if k != "correction_bias"}))
            floor_us = distinct * expert_bytes / (bw * 1e9) * 1e6
            add("experts", "triton", lambda: fused_moe(hidden, w13, w2, ids, w, alignment=al, out=out,
                                                       impl="triton"), floor_us)
            if m <= (4 if args.quick else 16):
                add("experts", "reference", lambda: fused_moe_reference(hidden, w13, w2, ids, w,
                                                                        compute_dtype=torch.bfloat16), floor_us)
            if peer is not None and hasattr(peer, "fused_experts"):
                add("experts", "sglang", lambda: peer.fused_experts(hidden, w13, w2, w, ids), floor_us)
        del w13, w2
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    hdr = f"{'model':<14} {'M':>3} {'op':<12} {'provider':<10} {'us':>9} {'graph_us':>9} {'floor_us':>9} " \
          f"{'floor%':>7} {'experts':>7} {'ids_ok':>6}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        fl = r.get("floor_us")
        fl_s = f"{fl:.2f}" if fl else "-"
        frac_s = f"{100 * r['floor_frac']:.0f}" if fl else "-"
        print(f"{r['model']:<14} {r['m']:>3} {r['op']:<12} {r['provider']:<10} {r['us']:>9.2f} {r['graph_us']:>9.2f} "
              f"{fl_s:>9} {frac_s:>7} "
              f"{r['distinct_experts']:>7} {r['ids_agree']:>6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
