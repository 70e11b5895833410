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

Quantised experts (``--quant none,int4,fp8``, default ``none``): each model's random bf16 experts are quantised once,
a few experts at a time (no E-sized fp32 temporary): int4 group 32 with bf16 scales (Kimi-K2.5's routed experts) and
block fp8 (128, 128) with fp32 scales (DeepSeek-V3 / Kimi-K2). For each M, ours (``fused_moe(..., quant=q)``, W4A16 /
W8A16) is checked first against a per-expert fp64 torch loop over the dequantised activated experts (tolerance:
twice torch's own bf16 error on the same weights + 1e-6, as in the sweeps; a failed check is not timed and makes the
exit status 1), then timed; its floor counts the stored bytes: ``floor_us = distinct_experts * (packed w13 + w2 bytes
+ scale bytes per expert) / copy_bw``. The SGLang peer runs its Triton fused MoE on the same stored weights
(``prepare_fused_experts(..., quant=q)``: int4 ``use_int4_w4a16`` with ``block_shape=[0, 32]``, block fp8
``use_fp8_w8a8`` with ``[128, 128]`` and fp8 activations per 128-column group, W8A8; ``--peer-act-quant``) and is
compared with ours; what in it is not SGLang's default is in ``peer_not_sglang`` (for int4 always: on Hopper SGLang
serves these checkpoints with Marlin by default). No ``reference`` provider rows for quantised experts. Rows carry
``quant`` (``none`` for routing and unquantised experts).

Usage: ``python bench/bench_moe.py [--quick] [--json PATH]`` (``--quick``: M = 1, 4, 16, 64, fewer repeats).
Quantised, ours and SGLang's, Kimi-K2 and DeepSeek-V3 (one device call):
``python bench/bench_moe.py --models kimi-k2,deepseek-v3 --ops experts --providers triton,sglang
--quant none,int4,fp8 --budget-s 480 --json PATH``
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
QUANTS = ("none", "int4", "fp8")
INT4_GROUP = 32  # Kimi-K2.5's routed experts (compressed-tensors pack-quantized, symmetric, group 32, bf16 scales)
FP8_BLOCK = (128, 128)  # DeepSeek-V3 / Kimi-K2's weight_block_size (fp32 weight_scale_inv)
QUANT_CHUNK = 8  # experts quantised per step: fp32 temporaries of 8 experts (about 0.2 GB at Kimi-K2's rank shapes)


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


def _quantise_experts(fmt, w13, w2):
    """``(p13, p2, MoEQuant, bytes per expert)``: the stored weights of ``fmt`` made from bf16 ``w13`` / ``w2``,
    :data:`QUANT_CHUNK` experts at a time."""
    from specverify.moe import MoEQuant
    from specverify.reference.quant import quantize_experts

    kw = dict(group_size=INT4_GROUP, block_shape=FP8_BLOCK, chunk=QUANT_CHUNK)
    (p13, s13), (p2, s2) = quantize_experts(w13, fmt, **kw), quantize_experts(w2, fmt, **kw)
    q = (MoEQuant("int4", s13, s2, group_size=INT4_GROUP) if fmt == "int4"
         else MoEQuant("fp8", s13, s2, block_shape=FP8_BLOCK))
    per_expert = sum(t[0].numel() * t.element_size() for t in (p13, p2, s13, s2))
    return p13, p2, q, per_expert


def _quant_unfit(fmt, h, inter) -> str:
    """Why ``fmt`` does not fit a model's H and I ("" when it does)."""
    if fmt == "int4" and (h % INT4_GROUP or inter % INT4_GROUP):
        return f"H={h} and I={inter} must be multiples of the int4 group {INT4_GROUP}"
    if fmt == "fp8" and (inter % FP8_BLOCK[0] or h % FP8_BLOCK[1] or inter % FP8_BLOCK[1]):
        return (f"I={inter} must be a multiple of {FP8_BLOCK[0]} (gate and up blocks) and H={h}, I of "
                f"{FP8_BLOCK[1]} (whole activation groups for SGLang's W8A8)")
    return ""


def _quant_reference(hidden, p13, p2, q, ids, w):
    """(fp64 truth, torch's bf16 result as fp64), both [M, H]: the experts over the dequantised weights, one activated
    expert at a time (each dequantised alone: no E-sized temporary); the bf16 experts' outputs summed in fp64."""
    from specverify.reference.moe import fused_moe_by_expert_reference

    truth = torch.zeros(hidden.shape, dtype=torch.float64, device=hidden.device)
    torch_bf16 = torch.zeros_like(truth)
    for e in torch.unique(ids[ids >= 0]).tolist():
        only = torch.where(ids == e, ids, torch.full_like(ids, -1))  # this expert's slots alone
        truth += fused_moe_by_expert_reference(hidden, p13, p2, only, w, torch.float64, quant=q)
        torch_bf16 += fused_moe_by_expert_reference(hidden, p13, p2, only, w, torch.bfloat16, quant=q)
    return truth, torch_bf16


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
    ap.add_argument("--quant", default="none", type=lambda t: _names(t, QUANTS, "quant"),
                    help="comma-separated subset of " + ",".join(QUANTS) + " (default none): experts stored as "
                         f"int4 (group {INT4_GROUP}, W4A16) or block fp8 {FP8_BLOCK} as well as / instead of bf16")
    ap.add_argument("--peer-act-quant", default="auto", choices=("auto", "sglang", "triton"),
                    help="block fp8, sglang rows: who quantises the activations (auto: SGLang's own call where it "
                         "runs here, i.e. its JIT-CUDA kernel on CUDA if that builds, else its Triton kernel; see "
                         "specverify.peers.sglang.prepare_fused_experts)")
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
    meta.update(models=args.models, ms=ms_list, ops=args.ops, providers=args.providers, quant=args.quant,
                int4_group=INT4_GROUP, fp8_block=list(FP8_BLOCK), peer_act_quant=args.peer_act_quant,
                sglang=peer.available().reason if peer is not None else peer_why, left_out=[], failed_checks=[])
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
        quantised = {}
        if "experts" in args.ops:
            for fmt in args.quant:
                unfit = _quant_unfit(fmt, h, inter)
                if unfit:
                    meta["left_out"].append(f"{name} {fmt}: {unfit}")
                    print(f"# {name} {fmt} experts left out: {unfit}", flush=True)
                elif fmt != "none":
                    quantised[fmt] = _quantise_experts(fmt, w13, w2)
                    print(f"# {name}: experts stored as {fmt}, {quantised[fmt][3] / 1e6:.2f} MB an expert "
                          f"(bf16 {expert_bytes / 1e6:.2f} MB)", flush=True)
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
            plain = "none" in args.quant
            out = fused_moe(hidden, w13, w2, ids, w, alignment=al, impl="triton") if plain else None
            distinct = int(torch.unique(ids[ids >= 0]).numel())
            ref = fused_moe_reference(hidden, w13, w2, ids, w) if plain and m <= 16 else None
            rel = _rel(out, ref) if ref is not None else float("nan")
            base = dict(model=name, m=m, quant="none", distinct_experts=distinct, ids_agree=agree, moe_rel_err=rel)

            def add(op, provider, fn, floor_us=None, row_base=None, **extra):
                if op not in args.ops or provider not in want_p:
                    return
                try:
                    us = bench_us(fn, args.quick)
                    gus = graph_us(fn)
                except Exception as exc:  # a provider that fails is reported, not fatal
                    print(f"# {name} M={m} {op}/{provider} failed: {exc}")
                    return
                row = dict(row_base or base, op=op, provider=provider, us=us, graph_us=gus, **extra)
                if floor_us is not None:
                    row.update(floor_us=floor_us, floor_frac=floor_us / us)
                rows.append(row)
                # progress as it goes: a step cut by its time limit still shows what it measured
                print(f"# {name} M={m} {row['quant']} {op}/{provider}: {us:.2f} us eager, {gus:.2f} us graph "
                      f"({time.time() - t0:.0f} s)", flush=True)

            def _quant_rows(fmt, p13, p2, q, q_floor_us):
                """Ours checked against the fp64 loop over the dequantised experts, then timed; then SGLang's."""
                q_out = fused_moe(hidden, p13, p2, ids, w, alignment=al, quant=q, impl="triton")
                truth, torch_bf16 = _quant_reference(hidden, p13, p2, q, ids, w)
                err = (q_out.double() - truth).abs().max().item()
                tol = 2 * (torch_bf16 - truth).abs().max().item() + 1e-6
                q_base = dict(base, quant=fmt, moe_rel_err=_rel(q_out, truth), max_err=err, tol=tol, ok=err <= tol)
                if err <= tol:
                    add("experts", "triton", lambda: fused_moe(hidden, p13, p2, ids, w, alignment=al, out=q_out,
                                                               quant=q, impl="triton"), q_floor_us, q_base)
                else:
                    meta["failed_checks"].append(f"{name} M={m} {fmt} experts/triton: error {err:.3g} > {tol:.3g}")
                    print(f"# {name} M={m} {fmt} experts/triton FAILED its check (not timed): max error {err:.3g} > "
                          f"tolerance {tol:.3g}", flush=True)
                if peer_m is None:
                    return
                try:
                    peer_fn = peer.prepare_fused_experts(hidden, p13, p2, w, ids, quant=q,
                                                         act_quant=args.peer_act_quant)
                    pout = peer_fn()
                    add("experts", "sglang", peer_fn, q_floor_us, q_base, rel_err_vs_triton=_rel(pout, q_out),
                        rel_err_vs_reference=_rel(pout, truth), peer_act_quant=peer_fn.act_quant,
                        peer_not_sglang=_peer_not_sglang(peer, "experts", m, e, top_k) + list(peer_fn.not_sglang))
                except Exception as exc:
                    print(f"# {name} M={m} {fmt} experts/sglang failed its check: {type(exc).__name__}: {exc}")

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
            if plain:
                add("experts", "triton", lambda: fused_moe(hidden, w13, w2, ids, w, alignment=al, out=out,
                                                           impl="triton"), floor_us)
            if plain and m <= (4 if args.quick else 16):
                add("experts", "reference", lambda: fused_moe_reference(hidden, w13, w2, ids, w,
                                                                        compute_dtype=torch.bfloat16), floor_us)
            if plain and peer_m is not None and "experts" in args.ops:
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
            for fmt, (p13, p2, q, q_bytes) in quantised.items():
                _quant_rows(fmt, p13, p2, q, distinct * q_bytes / (bw * 1e9) * 1e6)
            dump(partial=True)
        del w13, w2, quantised
        torch.cuda.empty_cache()
    dump(partial=False)
    hdr = f"{'model':<14} {'M':>3} {'quant':<5} {'op':<12} {'provider':<10} {'us':>9} {'graph_us':>9} " \
          f"{'floor_us':>9} {'floor%':>7} {'experts':>7} {'ids_ok':>6} {'rel_err':>8}"
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
        print(f"{r['model']:<14} {r['m']:>3} {r['quant']:<5} {r['op']:<12} {r['provider'] + star:<10} "
              f"{r['us']:>9.2f} {r['graph_us']:>9.2f} {fl_s:>9} {frac_s:>7} {r['distinct_experts']:>7} "
              f"{ids_ok:>6.3f} {err:>8.1e}")
    print("rel_err: experts output against the fp32 reference (ours, M <= 16; quantised: the fp64 loop over the "
          "dequantised experts, every M) or against ours (sglang, same quant); ids_ok: routing ids equal to the "
          "reference's (sglang: as sets per token); floor_us: distinct experts x stored bytes an expert (packed "
          "weights + scales when quantised) / copy bandwidth")
    if any(r["quant"] == "fp8" and r["provider"] == "sglang" for r in rows):
        print("fp8 sglang rows round the activations to fp8 per 128-column group (W8A8, SGLang's block-fp8 path); "
              "ours keeps them in bf16 (W8A16), so their rel_err includes that rounding")
    notes = sorted({n for r in rows for n in r.get("peer_not_sglang", ())})
    if notes:
        print("sglang rows are SGLang's Triton kernels as its layer calls them, except: " + "; ".join(notes)
              + " (* = more than the activation differs)")
    if meta["left_out"]:
        print("left out (--budget-s, --peer-max-m, formats that do not fit): " + ", ".join(meta["left_out"]))
    if meta["failed_checks"]:
        print("FAILED correctness checks (not timed): " + "; ".join(meta["failed_checks"]))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
