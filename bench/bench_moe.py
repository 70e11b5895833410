"""Benchmark: MoE routing + alignment (one launch) and the small-M expert GEMM against its weight-bytes floor.

Providers: ``reference`` (torch), ``triton`` (specverify), ``sglang`` (its Triton router ``moe_fused_gate``, its
alignment and its fused-MoE kernel, through ``bench/sglang_peer.py`` when that module and SGLang import).
Shapes: per-rank (tp 8) Kimi-K2, DeepSeek-V3, Qwen3-30B-A3B at M = 1, 2, 4, 8, 16, 32, 64 tokens.

Metrics: µs per call by ``triton.testing.do_bench`` (median, L2 flushed between calls) and by CUDA-graph replay
(20 calls per graph, L2 warm). For the expert GEMM:
``floor_us = distinct_experts * (w13 + w2 bytes per expert) / copy_bw`` with ``copy_bw`` a device-to-device copy
measured in the same run (``2 * bytes / time``), and ``floor_frac = floor_us / measured_us`` (1.0 = at the floor).

Every provider's output is checked before it is timed: ours against the fp32 reference (M <= 16) and the router's
ids; SGLang's experts against ours (``rel_err_vs_triton``) and the reference, its routing ids against the
reference's. SGLang rows carry ``peer_not_sglang``: where the peer is not what SGLang itself runs at that shape
(its Triton alignment beyond the one-launch kernel's gate, its Triton expert sum above 32 tokens, where SGLang calls
``sgl_kernel``; its Triton activation instead of the JIT-CUDA one), starred in the table.

Usage: ``python bench/bench_moe.py [--quick] [--json PATH]`` (``--quick``: M = 1, 4, 16, 64, fewer repeats).
The SGLang comparison of issue 24 in one device call (M = 1-64, Kimi-K2 and DeepSeek-V3):
``python bench/bench_moe.py --models kimi-k2,deepseek-v3 --providers triton,sglang --budget-s 420 --json PATH``
(SGLang rows up to ``--peer-max-m``, 32 by default)
(the JSON is rewritten after every (model, M), so a run cut by its time limit keeps what it measured; ``--budget-s``
stops starting new cases in time and lists the ones left out).
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


OPS = ("route+align", "experts")
PROVIDERS = ("reference", "triton", "sglang")


def _names(text: str, known: tuple, what: str) -> list:
    got = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in got if t not in known]
    if bad or not got:
        raise argparse.ArgumentTypeError(f"--{what} takes a comma-separated subset of {','.join(known)}, got {text!r}")
    return got


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _peer_not_sglang(peer, op, m, e, top_k) -> list:
    """Where the peer's call differs from what SGLang runs at this shape (see specverify.peers.sglang)."""
    mods, _ = peer.pieces()
    out = []
    path = peer.align_path(m * top_k, e)
    if path == "small_numel_outside_gate":
        out.append("alignment: Triton moe_align_small_numel beyond its gate (more than 64 slots, or at most 64 "
                   "experts), where SGLang calls sgl_kernel.moe_align_block_size (not installed)")
    if op == "experts":
        out.append("activation: act_and_mul_triton, not SGLang's JIT-CUDA silu_and_mul")
        if top_k > 2 and m > 32 and mods["experts"].cuda_sum is None:
            out.append("expert sum: moe_sum_reduce_triton above 32 tokens, where SGLang calls "
                       "sgl_kernel.moe_sum_reduce")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="M = 1, 4, 16, 64 and fewer repeats (< 90 s on H200)")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON (rewritten after every model and M)")
    ap.add_argument("--models", default=",".join(MODELS), type=lambda t: _names(t, tuple(MODELS), "models"),
                    help="comma-separated subset of " + ",".join(MODELS))
    ap.add_argument("--ms", type=token_counts, help="comma-separated token counts M (default 1, 2, 4, 8, 16, 32, 64; "
                                                    "1, 4, 16, 64 with --quick)")
    ap.add_argument("--ops", default=",".join(OPS), type=lambda t: _names(t, OPS, "ops"),
                    help="comma-separated subset of " + ",".join(OPS) + " (default: both)")
    ap.add_argument("--providers", default=",".join(PROVIDERS), type=lambda t: _names(t, PROVIDERS, "providers"),
                    help="comma-separated subset of " + ",".join(PROVIDERS) + " (default: all; sglang when SGLang's "
                         "kernels import)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new (model, M) case after this many seconds (compilation included); the cases "
                         "left out are printed and in the JSON's meta (default: no budget)")
    ap.add_argument("--peer-max-m", type=int, default=32,
                    help="leave out the sglang rows above this M (default 32): beyond M * top_k = 64 SGLang calls "
                         "sgl_kernel.moe_align_block_size (not installable beside the GPU machine's torch), and the "
                         "Triton alignment standing in for it (starred rows) did not finish at M = 64 on the H200 "
                         "within two minutes (2026-12-02)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe: needs a CUDA GPU", file=sys.stderr)
        return 2

    from specverify.moe import fused_moe, moe_route
    from specverify.reference.moe import align_reference, fused_moe_reference, random_expert_weights, route_reference

    want_p = set(args.providers)
    peer, peer_why = _peer() if "sglang" in want_p else (None, "not requested (--providers)")
    if peer is None:
        print(f"# sglang provider skipped: {peer_why}")
    ms_list = args.ms or ([1, 4, 16, 64] if args.quick else [1, 2, 4, 8, 16, 32, 64])
    t0 = time.time()
    bw = copy_bandwidth_gbps()
    print(f"# measured D2D copy bandwidth: {bw:.0f} GB/s", flush=True)
    meta = run_meta(__file__, copy_gbps=bw)
    meta.update(models=args.models, ms=ms_list, ops=args.ops, providers=args.providers,
                sglang=peer.available().reason if peer is not None else peer_why, left_out=[])
    rows = []

    def dump(partial):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(meta=meta, rows=rows, partial=partial), f, indent=1)

    for name in args.models:
        cfg = MODELS[name]
        e, h, inter, top_k = cfg["e"], cfg["h"], cfg["inter"], cfg["top_k"]
        gen = torch.Generator(device="cuda").manual_seed(0)
        w13, w2 = random_expert_weights(e, h, inter, generator=gen, device="cuda")
        bias = (torch.randn(e, device="cuda", generator=gen) * 0.05) if cfg["bias"] else None
        expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
        rkw = dict(top_k=top_k, scoring=cfg["scoring"], correction_bias=bias, n_group=cfg["n_group"],
                   topk_group=cfg["topk_group"], routed_scaling_factor=cfg["scale"])
        for m in ms_list:
            if args.budget_s is not None and time.time() - t0 > args.budget_s:
                meta["left_out"].append(f"{name} M={m}")
                print(f"# {name} M={m} left out: --budget-s {args.budget_s:.0f} spent", flush=True)
                continue
            logits = torch.randn(m, e, device="cuda", generator=gen).bfloat16()
            hidden = torch.randn(m, h, device="cuda", generator=gen).bfloat16()
            # correctness before timing
            ids, w, al = moe_route(logits, block_size=BLOCK, impl="triton", **rkw)
            rids, rw = route_reference(logits, top_k, cfg["scoring"], bias, cfg["n_group"], cfg["topk_group"], True,
                                       cfg["scale"])
            agree = (ids == rids).float().mean().item()
            out = fused_moe(hidden, w13, w2, ids, w, alignment=al, impl="triton")
            distinct = int(torch.unique(ids[ids >= 0]).numel())
            ref = fused_moe_reference(hidden, w13, w2, ids, w) if m <= 16 else None
            rel = _rel(out, ref) if ref is not None else float("nan")
            base = dict(model=name, m=m, distinct_experts=distinct, ids_agree=agree, moe_rel_err=rel)

            def add(op, provider, fn, floor_us=None, **extra):
                if op not in args.ops or provider not in want_p:
                    return
                try:
                    us = bench_us(fn, args.quick)
                    gus = graph_us(fn)
                except Exception as exc:  # a provider that fails is reported, not fatal
                    print(f"# {name} M={m} {op}/{provider} failed: {exc}")
                    return
                row = dict(base, op=op, provider=provider, us=us, graph_us=gus, **extra)
                if floor_us is not None:
                    row.update(floor_us=floor_us, floor_frac=floor_us / us)
                rows.append(row)
                # progress as it goes: a step cut by its time limit still shows what it measured
                print(f"# {name} M={m} {op}/{provider}: {us:.2f} us eager, {gus:.2f} us graph "
                      f"({time.time() - t0:.0f} s)", flush=True)

            add("route+align", "triton", lambda: moe_route(logits, block_size=BLOCK, impl="triton", **rkw))
            if (not args.quick or m <= 4) and "route+align" in args.ops and "reference" in want_p:
                rows.append(dict(base, op="route+align", provider="reference",
                                 us=bench_us(lambda: align_reference(route_reference(
                                     logits, top_k, cfg["scoring"], bias, cfg["n_group"], cfg["topk_group"], True,
                                     cfg["scale"])[0], e, BLOCK), args.quick), graph_us=float("nan")))
            peer_kw = {k: v for k, v in rkw.items() if k != "correction_bias"}
            peer_m = peer if m <= args.peer_max_m else None
            if peer is not None and peer_m is None:
                meta["left_out"].append(f"{name} M={m} sglang (--peer-max-m {args.peer_max_m})")
                print(f"# {name} M={m} sglang rows left out: --peer-max-m {args.peer_max_m}", flush=True)
            if peer_m is not None and "route+align" in args.ops:
                try:
                    pids, _ = peer.route(logits, bias, renormalize=True, **peer_kw)
                    pagree = (torch.sort(pids.long(), 1).values == torch.sort(rids.long(), 1).values).float().mean()
                    add("route+align", "sglang", lambda: peer.route_and_align(logits, bias, BLOCK, **peer_kw),
                        ids_agree_peer=pagree.item(), peer_not_sglang=_peer_not_sglang(peer, "route+align", m, e,
                                                                                       top_k))
                except Exception as exc:
                    print(f"# {name} M={m} route+align/sglang failed its check: {type(exc).__name__}: {exc}")
            floor_us = distinct * expert_bytes / (bw * 1e9) * 1e6
            add("experts", "triton", lambda: fused_moe(hidden, w13, w2, ids, w, alignment=al, out=out,
                                                       impl="triton"), floor_us)
            if m <= (4 if args.quick else 16):
                add("experts", "reference", lambda: fused_moe_reference(hidden, w13, w2, ids, w,
                                                                        compute_dtype=torch.bfloat16), floor_us)
            if peer_m is not None and "experts" in args.ops:
                try:
                    # SGLang's config resolved once, as its layer does; the call is alignment + 2 GEMMs + combine
                    peer_fn = peer.prepare_fused_experts(hidden, w13, w2, w, ids)
                    pout = peer_fn()
                    checks = dict(rel_err_vs_triton=_rel(pout, out),
                                  rel_err_vs_reference=_rel(pout, ref) if ref is not None else float("nan"))
                    add("experts", "sglang", peer_fn, floor_us, **checks,
                        peer_not_sglang=_peer_not_sglang(peer, "experts", m, e, top_k))
                except Exception as exc:
                    print(f"# {name} M={m} experts/sglang failed its check: {type(exc).__name__}: {exc}")
            dump(partial=True)
        del w13, w2
        torch.cuda.empty_cache()
    dump(partial=False)
    hdr = f"{'model':<14} {'M':>3} {'op':<12} {'provider':<10} {'us':>9} {'graph_us':>9} {'floor_us':>9} " \
          f"{'floor%':>7} {'experts':>7} {'ids_ok':>6} {'rel_err':>8}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        fl = r.get("floor_us")
        fl_s = f"{fl:.2f}" if fl else "-"
        frac_s = f"{100 * r['floor_frac']:.0f}" if fl else "-"
        star = "*" if any(not n.startswith("activation") for n in r.get("peer_not_sglang", ())) else ""
        err = (r.get("rel_err_vs_triton", float("nan")) if r["provider"] == "sglang"
               else r["moe_rel_err"] if (r["op"], r["provider"]) == ("experts", "triton") else float("nan"))
        ids_ok = r.get("ids_agree_peer", r["ids_agree"])
        print(f"{r['model']:<14} {r['m']:>3} {r['op']:<12} {r['provider'] + star:<10} {r['us']:>9.2f} "
              f"{r['graph_us']:>9.2f} {fl_s:>9} {frac_s:>7} {r['distinct_experts']:>7} {ids_ok:>6.3f} {err:>8.1e}")
    print("rel_err: experts output against the fp32 reference (ours, M <= 16) or against ours (sglang); ids_ok: "
          "routing ids equal to the reference's (sglang: as sets per token)")
    notes = sorted({n for r in rows for n in r.get("peer_not_sglang", ())})
    if notes:
        print("sglang rows are SGLang's Triton kernels as its layer calls them, except: " + "; ".join(notes)
              + " (* = more than the activation differs)")
    if meta["left_out"]:
        print("left out (--budget-s): " + ", ".join(meta["left_out"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
