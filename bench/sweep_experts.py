"""Sweep: the weight-streaming experts (``_VARIANT["experts"] = "stream"``) at M = 1..8 against the bytes floor.

Shape: Kimi-K2 per rank (tp 8: H 7168, expert intermediate 256, 384 routed experts, top-8, bf16 SwiGLU; w13
[E, 512, 7168], w2 [E, 7168, 256]), with and without the shared expert (stacked as expert 384 and appended to every
token with ``specverify.moe.append_shared_expert``, weight 1), M = 1, 2, 4, 8 tokens (``--ms``); above the
default ``max_m`` the stream rows raise it for the measurement.

Providers: ``default`` (``_VARIANT["experts"] = "auto"``: stream up to its ``max_m``, then the dot path), ``dot``
(the default above ``max_m``) and ``stream`` with each tile config of ``STREAM_GRID`` (merged into
``_STREAM_OVERRIDE``), all given the same precomputed alignment (block 16; the stream path does not read it);
``stream noalign`` runs with ``alignment=None``. Every provider is first checked against
a per-expert fp64 torch reference (tolerance: twice torch's own bf16 error + 1e-6), then timed by CUDA-graph replay
(``graph_us``): each graph holds ``SETS`` = 20 calls, each with its own routing (different random logits), so
consecutive calls hit different experts (~20 x 9 x 11 MB = ~2 GB of weights) and come from HBM, not the 50 MB L2.

``floor_us = mean over the sets of distinct experts * (w13 + w2 bytes per expert) / copy_bw``, ``copy_bw`` from
``copy_bandwidth_gbps`` (read + write bytes / time) in the same run; ``x_floor = us / floor_us`` (target <= 1.25).

``--gate-up-only``: launch 1 alone (``specverify.moe.stream_gate_up``) with each config of ``GATE_UP_GRID``,
checked against an fp64 per-slot reference of ``act`` and timed the same way; its floor counts w13 bytes only.

Usage: ``python bench/sweep_experts.py [--quick] [--json PATH] [--budget-s S] [--ms 1,2] [--variants LABELS]
[--routed-only] [--shared-only] [--gate-up-only]``. Stops starting new measurements
once ``--budget-s`` seconds have passed (the table still prints). Needs a CUDA GPU (exit code 2 otherwise).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from specverify.benchmarking import label_matches, token_counts

SETS = 20  # calls per graph, each with its own routing
BLOCK = 16
#: stream tile configs swept (merged into ``_STREAM_OVERRIDE``); "q" marks the ones --quick keeps
STREAM_GRID = [
    dict(q=1),  # the defaults of _STREAM_CONFIG
    dict(q=1, PDL=False),  # the down kernel launched plainly (GPUs before sm_90)
    dict(q=1, num_stages=3),
    dict(q=0, num_stages=4, R=1),
    dict(q=1, R=1),
    dict(q=1, R=4, BK=512),
    dict(q=0, R=2, BK=2048),
    dict(q=1, R=2, BK=512),
    dict(q=0, R=4, BK=1024, num_warps=8),
    dict(q=0, R=1, BK=2048, num_warps=8),
    dict(q=0, R=2, num_warps=2, BK=512),
    dict(q=1, BH=4, down_warps=4),
    dict(q=1, BH=1, down_warps=4),
    dict(q=0, BH=4, down_warps=8, TILE=16384),
    dict(q=0, BH=8, down_warps=8, TILE=32768),
    dict(q=0, BH=2, down_warps=2),
    dict(q=1, gate_up="splitk"),  # the split-K MMA gate/up (SBN 32, SBK 128, 3 stages, 4 warps, 2 waves)
    dict(q=0, gate_up="splitk", SBK=256),
    dict(q=0, gate_up="splitk", SBN=64),
    dict(q=0, gate_up="splitk", SBN=16),
    dict(q=0, gate_up="splitk", split_waves=4),
    dict(q=0, gate_up="splitk", split_waves=1),
    dict(q=0, gate_up="splitk", split_stages=4),
    dict(q=0, gate_up="splitk", split_stages=2),
    dict(q=0, gate_up="splitk", SBN=64, split_warps=8),
    dict(q=0, gate_up="splitk", SBK=64, split_stages=6),
]
#: gate/up configs of ``--gate-up-only`` (merged into ``_STREAM_OVERRIDE``): the FMA programs and the split-K MMA
#: tiles (a stream-K kernel and TMA tiles were timed here on 2026-12-03 and removed: bench/results/HISTORY.md)
GATE_UP_GRID = [
    dict(q=1, gate_up="fma"),
    dict(q=1, gate_up="splitk"),
    dict(q=0, gate_up="splitk", split_waves=3),
    dict(q=0, gate_up="splitk", split_waves=6),
]


def gate_up_reference(hidden, w13, w2, ids, w, dtype):
    """act [M * top_k, I] = silu(x @ gate^T) * (x @ up^T) per routed slot in ``dtype`` (w2 and w unused; the
    signature of the experts' reference)."""
    inter = w13.shape[1] // 2
    flat = ids.reshape(-1).long()
    x = hidden.to(dtype).repeat_interleave(ids.shape[1], dim=0)
    w_s = w13[flat].to(dtype)  # [S, 2I, H]
    gu = torch.einsum("sh,snh->sn", x, w_s)
    return (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]).to(hidden.dtype if dtype == torch.bfloat16
                                                                         else dtype)


def _label(ov: dict) -> str:
    return "stream " + (" ".join(f"{k}{v}" for k, v in ov.items()) or "default")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the configs marked q")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop starting measurements after this long")
    ap.add_argument("--ms", type=token_counts, default=[1, 2, 4, 8], help="comma list of token counts")
    ap.add_argument("--variants", help="comma list of provider labels (a trailing * matches a prefix), e.g. "
                                       "'default (auto),stream R1': time only those")
    ap.add_argument("--routed-only", action="store_true", help="skip the cases with the shared expert")
    ap.add_argument("--shared-only", action="store_true", help="skip the cases without the shared expert")
    ap.add_argument("--gate-up-only", action="store_true", help="time launch 1 (gate/up) alone, GATE_UP_GRID")
    args = ap.parse_args(argv)
    ms_list = args.ms
    if not torch.cuda.is_available():
        print("sweep_experts: needs a CUDA GPU", file=sys.stderr)
        return 2

    import specverify.moe as moe
    from specverify.benchmarking import run_meta, copy_bandwidth_gbps, dict_restorer, graph_us
    from specverify.configs import per_rank_shapes
    from specverify.reference.moe import fused_moe_by_expert_reference as by_expert
    from specverify.reference.moe import random_expert_weights

    t0 = time.time()

    def over():
        return time.time() - t0 > args.budget_s
    bw = copy_bandwidth_gbps()
    print(f"# measured D2D copy bandwidth: {bw:.0f} GB/s", flush=True)
    meta = run_meta(__file__, copy_gbps=bw,
                sets=SETS, block=BLOCK, stream_config=dict(moe._STREAM_CONFIG))
    rows, skipped = [], []
    restore = dict_restorer(moe._VARIANT, moe._STREAM_OVERRIDE)

    rs = per_rank_shapes("kimi-k2", tp=8)
    cfg = rs.config
    e, h, inter, top_k = cfg.n_routed_experts, cfg.hidden_size, rs.moe_intermediate_size, cfg.num_experts_per_tok
    gen = torch.Generator(device="cuda").manual_seed(0)
    # the routed experts and the shared one (expert e) stacked: one pool serves both cases
    w13, w2 = random_expert_weights(e + 1, h, inter, generator=gen, device="cuda")
    bias = torch.randn(e, device="cuda", generator=gen) * 0.05 if cfg.e_score_correction_bias else None
    expert_bytes = (w13[0].numel() + (0 if args.gate_up_only else w2[0].numel())) * w13.element_size()
    rkw = dict(top_k=top_k, scoring=cfg.scoring_func, correction_bias=bias, n_group=cfg.n_group,
               topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor)
    for shared in (False,) if args.routed_only else (True,) if args.shared_only else (True, False):
        for m in ms_list:
            case = f"M={m} {'+shared' if shared else 'routed'}"
            if over():
                skipped.append(case)
                continue
            restore()
            logits = [torch.randn(m, e, device="cuda", generator=gen).bfloat16() for _ in range(SETS)]
            hidden = [torch.randn(m, h, device="cuda", generator=gen).bfloat16() for _ in range(SETS)]
            routed = []
            for x in logits:
                ids, w, al = moe.moe_route(x, block_size=BLOCK, impl="triton", **rkw)
                if shared:  # one more slot per token (expert e, weight 1), realigned over e + 1 experts
                    ids, w = moe.append_shared_expert(ids, w, e)
                    _, _, al = moe._launch_route_align(None, None, top_k + 1, False, 1, 1, False, 1.0, BLOCK,
                                                       topk_ids=ids, num_experts=e + 1)
                routed.append((ids, w, al))
            distinct = sum(int(torch.unique(r[0][r[0] >= 0]).numel()) for r in routed) / SETS
            floor_us = distinct * expert_bytes / (bw * 1e9) * 1e6
            ids0, w0, _ = routed[0]
            ref = gate_up_reference if args.gate_up_only else by_expert
            want = ref(hidden[0], w13, w2, ids0, w0, torch.float64)
            tol = 2 * (ref(hidden[0], w13, w2, ids0, w0, torch.bfloat16) - want).abs().max().item() + 1e-6
            outs = [torch.empty(m, h, dtype=torch.bfloat16, device="cuda") for _ in range(SETS)]
            base = dict(model="kimi-k2", m=m, shared=shared, distinct_experts=distinct, floor_us=floor_us)
            print(f"# {case}: {distinct:.2f} distinct experts per call, floor {floor_us:.2f} us", flush=True)

            def measure(label, variant, override, use_alignment=True):
                if args.variants and not label_matches(label, args.variants):
                    return
                if over():
                    skipped.append(f"{case} {label}")
                    return
                restore()
                moe._VARIANT["experts"] = variant
                moe._STREAM_OVERRIDE.update(override)
                if variant == "stream":
                    moe._STREAM_OVERRIDE["max_m"] = max(m, moe._STREAM_CONFIG["max_m"])

                # the gate/up launch's tiles under this measurement's overrides (the ids are int32 [M, top_k])
                cfg_g = moe._stream_config(m, h, inter, routed[0][0].shape[1], True)
                pdl_g = moe._pdl(cfg_g["PDL"], w13.device)

                def call(i):
                    ids, w, al = routed[i % SETS]
                    if args.gate_up_only:
                        return moe.stream_gate_up(hidden[i % SETS], w13, ids, cfg_g, pdl_g)
                    return moe.fused_moe(hidden[i % SETS], w13, w2, ids, w, alignment=al if use_alignment else None,
                                         out=outs[i % SETS], impl="triton")
                try:
                    err = (call(0).double() - want).abs().max().item()
                    it = iter(range(1 << 30))
                    us = graph_us(lambda: call(next(it)), calls=SETS, repeats=3)
                except Exception as exc:  # a config that fails to compile or run is reported, not fatal
                    print(f"# {case} {label} failed: {exc.__class__.__name__}: {exc}", flush=True)
                    return
                rows.append(dict(base, variant=label, us=us, x_floor=us / floor_us, err=err, tol=tol, ok=err <= tol))
                print(f"# {case} {label}: {us:.2f} us ({us / floor_us:.2f}x floor) err {err:.3g} tol {tol:.3g}",
                      flush=True)

            if not args.gate_up_only:
                measure("default (auto)", "auto", {})
                measure("dot", "dot", {})  # the three-launch tl.dot path (the default above the stream's max_m)
            for c in GATE_UP_GRID if args.gate_up_only else STREAM_GRID:
                if args.quick and not c["q"]:
                    continue
                ov = {k: v for k, v in c.items() if k != "q"}
                measure(_label(ov), "stream", ov)
            if not args.gate_up_only:
                measure("stream noalign", "stream", {}, use_alignment=False)
            restore()
            logits = hidden = routed = outs = None  # free this case's buffers before the next
    w13 = w2 = None
    torch.cuda.empty_cache()
    restore()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows, skipped=skipped, elapsed_s=time.time() - t0), f, indent=1)
    if skipped:
        print(f"# budget reached: skipped {len(skipped)} measurements, first: {skipped[0]}")
    best = {}
    for r in rows:
        k = (r["m"], r["shared"])
        if r["ok"] and r["variant"].startswith("stream") and (k not in best or r["us"] < best[k]["us"]):
            best[k] = r
    for (m, shared), r in sorted(best.items()):
        print(f"# best stream M={m} {'+shared' if shared else 'routed'}: {r['variant']} {r['us']:.2f} us "
              f"({r['x_floor']:.2f}x floor)")
    hdr = f"{'M':>2} {'experts':<8} {'variant':<44} {'us':>8} {'floor_us':>9} {'x_floor':>7} {'ok':>3}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['m']:>2} {'+shared' if r['shared'] else 'routed':<8} {r['variant']:<44} {r['us']:>8.2f} "
              f"{r['floor_us']:>9.2f} {r['x_floor']:>7.2f} {'y' if r['ok'] else 'N':>3}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
