"""Sweep: the MoE dot-path expert tiles against the activated-expert bytes floor, and the router + alignment configs.

Shapes: per-rank (tp 8) Kimi-K2 and DeepSeek-V3 from ``specverify.configs.per_rank_shapes`` (H 7168, I 256,
384 / 256 experts, top-8, bf16), M = 1, 2, 4, 8, 16, 32, 64 tokens (``--quick``: 1, 4, 16, 64).

Experts: the ``dot`` path (three launches, ``specverify.moe._VARIANT["experts"] = "dot"``: the default above M = 6)
with its default tiles and each tile change of ``DOT_GRID``, and SGLang's fused experts (the stream experts, the
default at M <= 6, have their own sweep: ``bench/sweep_experts.py``), each checked against a per-expert fp64 torch
reference (tolerance: twice torch's own bf16 error + 1e-6) and timed by CUDA-graph
replay (``graph_us``). Each graph holds ``SETS`` calls, each with its own routing (different random logits), so
consecutive calls hit different experts and the weights (GBs per layer) come from HBM, not the 50 MB L2.
``floor_us = mean over the sets of distinct experts * (w13 + w2 bytes per expert) / copy_bw``, ``copy_bw`` from
``copy_bandwidth_gbps`` (read + write bytes / time) in the same run; ``x_floor = graph_us / floor_us`` (target
<= 1.25 at M <= 16).

Router + alignment (block 16): the default (``fast``) and the rows of ``ROUTE_GRID`` (its size thresholds, which
choose the one-program, sorted, row-mask or atomic-rank alignment per M, and its warps), checked (ids against
``route_reference``, counts / blocks against ``align_reference``) and timed the same way; the router alone (no
alignment) and an empty kernel (the launch floor) as baselines, SGLang's router + alignment as the peer. Target
<= 4 us at M <= 64.

Usage: ``python bench/sweep_moe.py [--quick] [--json PATH] [--budget-s S] [--models kimi-k2,deepseek-v3]
[--ops experts,route]``.
Stops starting new measurements once ``--budget-s`` seconds have passed (the table still prints).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import triton

from specverify.benchmarking import label_matches, token_counts

SETS = 20  # calls per graph, each with its own routing
BLOCK = 16
#: dot-path tiles swept besides the default (the "dot" row), merged into ``_CONFIG_OVERRIDE`` (g1 = gate/up GEMM,
#: g2 = down GEMM); skipped with --quick
DOT_GRID = [
    ("g1 N32", dict(BLOCK_N=32), {}),
    ("g1 N32 K128", dict(BLOCK_N=32, BLOCK_K=128), {}),
    ("g1 N64 K128", dict(BLOCK_N=64, BLOCK_K=128), {}),
    ("g1 K512 s3", dict(BLOCK_K=512, num_stages=3), {}),
    ("g1 s5", dict(num_stages=5), {}),
    ("g1 w2", dict(num_warps=2), {}),
    ("g2 N32", {}, dict(BLOCK_N=32)),
    ("g2 N128", {}, dict(BLOCK_N=128)),
    ("g2 K256", {}, dict(BLOCK_K=256)),
    ("g2 s4", {}, dict(num_stages=4)),
    ("g1 N32 g2 N128", dict(BLOCK_N=32), dict(BLOCK_N=128)),
    ("g1 N32 w2", dict(BLOCK_N=32, num_warps=2), {}),
    ("g1 N32 s3", dict(BLOCK_N=32, num_stages=3), {}),
    ("g1 N32 s5", dict(BLOCK_N=32, num_stages=5), {}),
    ("g1 N32 w8", dict(BLOCK_N=32, num_warps=8), {}),
    ("g1 N64", dict(BLOCK_N=64), {}),
    ("g1 N64 K128 w2", dict(BLOCK_N=64, BLOCK_K=128, num_warps=2), {}),
    ("g1 N64 K128 s5", dict(BLOCK_N=64, BLOCK_K=128, num_stages=5), {}),
]
#: router configs: (name, config dict merged into _FAST_ROUTE_CONFIG); "fast" is the default, which picks winners by
#: a bitonic top-k, routes M * top_k <= one_max_slots in one program, and beyond aligns in the last program by one
#: sort up to sorted_max_slots slots, from per-expert row masks up to mask_max_rows tokens, by atomic ranks above
#: (see _FAST_ROUTE_CONFIG)
ROUTE_GRID = [
    ("fast", {}),
    ("fast one32", dict(one_max_slots=32)),
    ("fast sorted all", dict(sorted_max_slots=1024)),
    ("fast atomic ranks", dict(sorted_max_slots=0, mask_max_rows=0)),
    ("fast w8", dict(num_warps=8)),
    ("fast w2", dict(num_warps=2)),
    ("fast w1", dict(num_warps=1)),
    # without the row masks: the sorted alignment up to 32 slots, atomic ranks above (the default before them)
    ("fast no mask", dict(mask_max_rows=0)),
    ("fast mask w8", dict(num_warps=8)),
    ("fast rows2", dict(ROWS=2)),
    # one program for every M (routes all rows, aligns in registers: no ticket, no global round trip) with more warps
    ("fast one all w8", dict(one_max_slots=1024, one_num_warps=8)),
    ("fast one all w16", dict(one_max_slots=1024, one_num_warps=16)),
    ("fast one all w32", dict(one_max_slots=1024, one_num_warps=32)),
]
#: skipped with --quick
ROUTE_SLOW = ("fast w2", "fast w1", "fast rows2")


@triton.jit
def _null_kernel(x_ptr):
    """An empty one-program kernel: the launch floor the router rows are read against."""
    pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="M = 1, 4, 16, 64 and the configs marked q")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop starting measurements after this long")
    ap.add_argument("--models", default="kimi-k2,deepseek-v3")
    ap.add_argument("--ops", default="experts,route", help="comma list: experts, route")
    ap.add_argument("--ms", type=token_counts, help="comma list of M (default: 1,4,16,64 with --quick, else 1..64)")
    ap.add_argument("--expert-variants", help="comma list of expert row labels (a trailing * matches a prefix): time "
                                              "only those")
    ap.add_argument("--route-variants", help="comma list of router row labels (a trailing * matches a prefix): time "
                                             "only those")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_moe: needs a CUDA GPU", file=sys.stderr)
        return 2

    import specverify.moe as moe
    from specverify.benchmarking import run_meta, copy_bandwidth_gbps, dict_restorer, graph_us, load_sglang_peer
    from specverify.configs import per_rank_shapes
    from specverify.reference.moe import fused_moe_by_expert_reference as by_expert
    from specverify.reference.moe import random_expert_weights
    from specverify.reference.moe import align_reference, route_reference

    t0 = time.time()
    def over():
        return time.time() - t0 > args.budget_s
    ms_list = args.ms or ([1, 4, 16, 64] if args.quick else [1, 2, 4, 8, 16, 32, 64])
    ops = set(args.ops.split(","))
    bw = copy_bandwidth_gbps()
    print(f"# measured D2D copy bandwidth: {bw:.0f} GB/s", flush=True)
    meta = run_meta(__file__, copy_gbps=bw,
                sets=SETS, block=BLOCK)
    rows, skipped = [], []
    restore = dict_restorer(moe._VARIANT, moe._FAST_ROUTE_CONFIG, moe._ROUTE_CONFIG, moe._CONFIG_OVERRIDE)
    peer, peer_why = load_sglang_peer(__file__) if {"experts", "route"} & set(ops) else (None, "nothing swept")
    if peer is None:
        print(f"# sglang experts and router skipped: {peer_why}")

    for name in args.models.split(","):
        rs = per_rank_shapes(name, tp=8)
        cfg = rs.config
        e, h, inter, top_k = cfg.n_routed_experts, cfg.hidden_size, rs.moe_intermediate_size, cfg.num_experts_per_tok
        gen = torch.Generator(device="cuda").manual_seed(0)
        w13, w2 = random_expert_weights(e, h, inter, generator=gen, device="cuda")
        bias = torch.randn(e, device="cuda", generator=gen) * 0.05 if cfg.e_score_correction_bias else None
        expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
        rkw = dict(top_k=top_k, scoring=cfg.scoring_func, correction_bias=bias, n_group=cfg.n_group,
                   topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor)
        for m in ms_list:
            if over():
                skipped.append(f"{name} M={m}")
                continue
            restore()
            logits = [torch.randn(m, e, device="cuda", generator=gen).bfloat16() for _ in range(SETS)]
            hidden = [torch.randn(m, h, device="cuda", generator=gen).bfloat16() for _ in range(SETS)]
            routed = [moe.moe_route(x, block_size=BLOCK, impl="triton", **rkw) for x in logits]
            distinct = sum(int(torch.unique(r[0][r[0] >= 0]).numel()) for r in routed) / SETS
            floor_us = distinct * expert_bytes / (bw * 1e9) * 1e6
            ids0, w0, _ = routed[0]
            want = by_expert(hidden[0], w13, w2, ids0, w0, torch.float64)
            tol = 2 * (by_expert(hidden[0], w13, w2, ids0, w0, torch.bfloat16) - want).abs().max().item() + 1e-6
            outs = [torch.empty(m, h, dtype=torch.bfloat16, device="cuda") for _ in range(SETS)]
            base = dict(model=name, m=m, distinct_experts=distinct, floor_us=floor_us)

            def time_sets(call):
                it = iter(range(1 << 30))
                return graph_us(lambda: call(next(it) % SETS), calls=SETS, repeats=3)

            def experts(label, tiles=None, sglang=False):
                if args.expert_variants and not label_matches(label, args.expert_variants):
                    return
                if over():
                    skipped.append(f"{name} M={m} experts {label}")
                    return
                restore()
                moe._VARIANT["experts"] = "dot"
                moe._CONFIG_OVERRIDE.update(tiles or {})

                def call(i):
                    ids, w, al = routed[i]
                    if sglang:
                        return peer.fused_experts(hidden[i], w13, w2, w, ids)
                    return moe.fused_moe(hidden[i], w13, w2, ids, w, alignment=al, out=outs[i], impl="triton")
                try:
                    err = (call(0).double() - want).abs().max().item()
                    us = time_sets(call)
                except Exception as exc:  # a config that fails to compile or run is reported, not fatal
                    print(f"# {name} M={m} experts {label} failed: {exc.__class__.__name__}: {exc}", flush=True)
                    return
                rows.append(dict(base, op="experts", variant=label, us=us, x_floor=us / floor_us, err=err, tol=tol,
                                 ok=err <= tol))
                print(f"# {name} M={m} experts {label}: {us:.2f} us ({us / floor_us:.2f}x floor) err {err:.3g} "
                      f"tol {tol:.3g}", flush=True)

            if "experts" in ops:
                experts("dot")
                if peer is not None:
                    experts("sglang (peer)", sglang=True)
                if not args.quick:
                    for label, g1, g2 in DOT_GRID:
                        experts("dot " + label, tiles=dict(g1=g1, g2=g2))

            # router + alignment
            restore()
            rid, _ = route_reference(logits[0], top_k, cfg.scoring_func, bias, cfg.n_group, cfg.topk_group, True,
                                     cfg.routed_scaling_factor)
            rs_, re_, rn_ = align_reference(rid, e, BLOCK)

            def route_row(label, ov, align=True, sglang=False):
                if over():
                    skipped.append(f"{name} M={m} route {label}")
                    return
                restore()
                moe._FAST_ROUTE_CONFIG.update(ov)
                bs = BLOCK if align else None

                def call(i):
                    if sglang:  # SGLang's router, then its alignment
                        return peer.route_and_align(logits[i], bias, bs, **{
                            k: v for k, v in rkw.items() if k != "correction_bias"})
                    return moe.moe_route(logits[i], block_size=bs, impl="triton", **rkw)
                try:
                    res = call(0)
                    agree = (res[0] == rid).float().mean().item()
                    ok = agree == 1.0
                    if align:  # SGLang returns (ids, w, sorted, expert ids, used length), ours an MoEAlignment
                        sorted_ids, eids, npad = res[2:5] if sglang else res[2][:3]
                        n = int(npad.item())
                        ok = ok and n == int(rn_.item()) and torch.equal(eids[: n // BLOCK].cpu(), re_.cpu())
                        ok = ok and sorted(sorted_ids[:n].cpu().tolist()) == sorted(rs_.cpu().tolist())
                    us = time_sets(call)
                except Exception as exc:
                    print(f"# {name} M={m} route {label} failed: {exc.__class__.__name__}: {exc}", flush=True)
                    return
                rows.append(dict(base, op="route+align" if align else "route", variant=label, us=us,
                                 x_floor=float("nan"), err=1.0 - agree, tol=0.0, ok=bool(ok)))
                print(f"# {name} M={m} route {label}: {us:.2f} us ok={ok}", flush=True)

            if "route" in ops:
                # the floor of any one-launch router: an empty kernel timed the same way
                us = time_sets(lambda i: _null_kernel[(1,)](logits[i]))
                rows.append(dict(base, op="route", variant="empty kernel (launch floor)", us=us,
                                 x_floor=float("nan"), err=0.0, tol=0.0, ok=True))
                print(f"# {name} M={m} empty kernel: {us:.2f} us", flush=True)
                route_row("router only", {}, align=False)  # the baselines above and this one: always
                for label, ov in ROUTE_GRID:
                    if args.quick and label in ROUTE_SLOW:
                        continue
                    if args.route_variants and not label_matches(label, args.route_variants):
                        continue
                    route_row(label, ov)
                if peer is not None and (not args.route_variants
                                         or label_matches("sglang (peer)", args.route_variants)):
                    route_row("sglang (peer)", {}, sglang=True)
            restore()
            del logits, hidden, routed, outs
        del w13, w2
        torch.cuda.empty_cache()
    restore()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows, skipped=skipped, elapsed_s=time.time() - t0), f, indent=1)
    if skipped:
        print(f"# budget reached: skipped {len(skipped)} measurements, first: {skipped[0]}")
    hdr = f"{'model':<12} {'M':>3} {'op':<12} {'variant':<58} {'us':>9} {'floor_us':>9} {'x_floor':>7} {'ok':>3}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        xf = f"{r['x_floor']:.2f}" if r["op"] == "experts" else "-"
        fl = f"{r['floor_us']:.2f}" if r["op"] == "experts" else "-"
        okc = "y" if r["ok"] else "N"
        print(f"{r['model']:<12} {r['m']:>3} {r['op']:<12} {r['variant']:<58} {r['us']:>9.2f} {fl:>9} {xf:>7} "
              f"{okc:>3}")
    best = {}
    for r in rows:
        if r["ok"]:
            k = (r["model"], r["m"], r["op"])
            if k not in best or r["us"] < best[k]["us"]:
                best[k] = r
    print("# best per (model, M, op):")
    for (mod, m, op), r in sorted(best.items()):
        extra = f" ({r['x_floor']:.2f}x floor)" if op == "experts" else ""
        print(f"#   {mod:<12} M={m:<3} {op:<12} {r['variant']}: {r['us']:.2f} us{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
