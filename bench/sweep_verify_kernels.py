"""Sweep: tree attention and MoE (router + experts) configs on the acceptance shapes, in one device call.

Checks every variant against the reference (or against the checked default) before timing it, then times it by
CUDA-graph replay (20 calls per graph, the convention of bench_tree_attention.py / bench_moe.py). Derived metrics:
attention ``bw% = (KV + q + out bytes) / time / copy_bw``; experts ``x_floor = time / (distinct experts x expert
bytes / copy_bw)`` with ``copy_bw`` a 1 GiB device-to-device copy (``2 * bytes / time``) measured in the same run.

Usage: ``python bench/sweep_verify_kernels.py [--quick] [--json PATH] [--only attn,route,experts]``; prints a table
last. ``--quick`` trims the variant lists (about half the compile time).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from functools import partial

from specverify.benchmarking import graph_us as _graph_us

graph_us = partial(_graph_us, repeats=3)  # best of 3: less host noise in a sweep

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROWS: list[dict] = []


def log(msg: str) -> None:
    print(msg, flush=True)


def add(group, shape, variant, us, metric, err, note=""):
    row = dict(group=group, shape=shape, variant=variant, us=us, metric=metric, err=err, note=note)
    ROWS.append(row)
    log(f"  {group:<8} {shape:<26} {variant:<34} {us:9.2f} us  {metric:<14} err {err:.3g} {note}")


# ------------------------------------------------------------------------------------------------ attention
def sweep_attention(bw, quick):
    import bench_tree_attention as bta
    from specverify.kernels import tree_attention as kernels

    shapes = [("kimi-k2", 1, 4096, 4, True), ("kimi-k2", 1, 4096, 1, False), ("kimi-k2", 64, 4096, 4, True),
              ("kimi-k2", 8, 32768, 4, True), ("deepseek-v3", 8, 4096, 8, True), ("llama-3.1-8b", 1, 4096, 4, True),
              ("llama-3.1-8b", 8, 32768, 4, True), ("gqa-8to1", 64, 4096, 16, False)]
    for model, batch, ctx, k, tree in shapes:
        cfg, tensors, meta, nbytes = bta.make_inputs(model, batch, ctx, k, tree)
        name = f"{model} b{batch} c{ctx} k{k}{'t' if tree else ''}"
        fn, plan = bta.triton_fn(cfg, tensors, meta, batch, k, ctx)
        got = fn().clone()
        if batch * ctx <= 8 * 4096:
            ref = bta.reference_fn(cfg, tensors, meta)()
            err = bta.max_err(got, ref)
        else:
            err = float("nan")
        ok = not (err > 0.05)
        us = graph_us(fn)
        add("attn", name, f"default s{plan.num_splits}", us, f"bw {100 * nbytes / (us * 1e-6) / (bw * 1e9):.1f}%",
            err, str({k_: v for k_, v in plan.config.items() if k_ not in ("M_TILES", "DV_TILES", "BLOCK_K")})
            + ("" if ok else " WRONG"))
        if not ok:
            continue
        mla = cfg["kind"] == "mla"
        configs = list(kernels.MLA_CONFIGS if mla else kernels.GQA_CONFIGS)
        if quick:
            configs = configs[:3]
        if batch == 1:
            split_list = [8, 16, 32, 48, 64]
        elif batch == 8:
            split_list = [4, 8, 16, 32]
        else:
            split_list = [1, 2, 4]
        variants = [(c, None) for c in configs] + [(None, s) for s in split_list if s != plan.num_splits]
        if batch == 1 and mla:
            variants += [(c, s) for c in configs[:2] for s in (32, 64)]
        for c, s in variants:
            try:
                f2, p2 = bta.triton_fn(cfg, tensors, meta, batch, k, ctx, config=c, num_splits=s)
                e2 = bta.max_err(f2(), got)
                us2 = graph_us(f2)
            except Exception as exc:  # a config that does not compile or launch is reported, not fatal
                add("attn", name, f"cfg{configs.index(c) if c else '-'} s{s}", float("nan"), "-", float("nan"),
                    f"FAILED {exc.__class__.__name__}: {str(exc)[:120]}")
                continue
            tag = f"cfg{configs.index(c)}" if c is not None else "dflt"
            add("attn", name, f"{tag} s{p2.num_splits}", us2,
                f"bw {100 * nbytes / (us2 * 1e-6) / (bw * 1e9):.1f}%", e2,
                (str(c) if c else "") + (" WRONG" if e2 > 0.05 else ""))
        del tensors, meta
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ MoE
KIMI = dict(h=7168, inter=256, e=384, top_k=8, scoring="sigmoid", n_group=1, topk_group=1, scale=2.827)


def sweep_route(quick):
    import specverify.moe as moe
    from specverify.reference.moe import route_reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    e, top_k = KIMI["e"], KIMI["top_k"]
    bias = torch.randn(e, device="cuda", generator=gen) * 0.05
    kw = dict(top_k=top_k, scoring="sigmoid", correction_bias=bias, routed_scaling_factor=KIMI["scale"])
    for m in (1, 4, 16, 64):
        logits = torch.randn(m, e, device="cuda", generator=gen).bfloat16()
        rids, _ = route_reference(logits, top_k, "sigmoid", bias, 1, 1, True, KIMI["scale"])
        for nw in ((1, 4) if quick else (1, 2, 4, 8)):
            moe._ROUTE_NUM_WARPS["num_warps"] = nw
            ids, w, al = moe.moe_route(logits, block_size=16, impl="triton", **kw)
            agree = (ids == rids).float().mean().item()
            # alignment invariants: every slot once, grouped by its expert
            npad = int(al.num_tokens_post_padded.item())
            sl = al.sorted_token_ids[:npad]
            real = sl[sl < m * top_k].long()
            ok_align = real.numel() == m * top_k and torch.equal(real.sort().values,
                                                                  torch.arange(m * top_k, device="cuda"))
            blk_e = al.expert_ids[:npad // 16].repeat_interleave(16)
            ok_align = ok_align and bool((ids.view(-1)[real] == blk_e[sl < m * top_k]).all())
            us = graph_us(lambda: moe.moe_route(logits, block_size=16, impl="triton", **kw))
            us_r = graph_us(lambda: moe.moe_route(logits, impl="triton", **kw))
            add("route", f"kimi-k2 M{m}", f"warps{nw}", us, f"route-only {us_r:.2f}", 1 - agree,
                "" if ok_align else "ALIGN WRONG")
        moe._ROUTE_NUM_WARPS["num_warps"] = 4


def sweep_experts(bw, quick):
    import specverify.moe as moe
    from specverify.reference.moe import fused_moe_reference

    gen = torch.Generator(device="cuda").manual_seed(1)
    e, h, inter, top_k = KIMI["e"], KIMI["h"], KIMI["inter"], KIMI["top_k"]
    w13 = (torch.randn(e, 2 * inter, h, device="cuda", generator=gen) / math.sqrt(h)).bfloat16()
    w2 = (torch.randn(e, h, inter, device="cuda", generator=gen) / math.sqrt(inter)).bfloat16()
    expert_bytes = (w13[0].numel() + w2[0].numel()) * 2
    variants = [
        {},
        {"g1": {"SPLIT_K": 1}},
        {"g1": {"SPLIT_K": 2}},
        {"g1": {"SPLIT_K": 4}},
        {"g1": {"SPLIT_K": 8}},
        {"g1": {"SPLIT_K": 4, "num_stages": 6}},
        {"g1": {"SPLIT_K": 4, "BLOCK_K": 128, "num_stages": 6}},
        {"g1": {"SPLIT_K": 4, "BLOCK_N": 32, "num_warps": 4}},
        {"g1": {"SPLIT_K": 4, "num_warps": 8}},
        {"g2": {"BLOCK_N": 128}},
        {"g2": {"BLOCK_N": 32, "BLOCK_K": 256}},
        {"g2": {"BLOCK_N": 64, "num_stages": 4, "BLOCK_K": 64}},
        {"g1": {"SPLIT_K": 2, "num_stages": 6}},
        {"g1": {"SPLIT_K": 1, "num_stages": 6}},
        {"g1": {"SPLIT_K": 4}, "g2": {"num_stages": 2}},
        {"g1": {"SPLIT_K": 4}, "g2": {"BLOCK_N": 128, "num_stages": 2}},
        {"g1": {"SPLIT_K": 2}, "g2": {"num_stages": 2}},
    ]
    if quick:
        variants = variants[:6]
    for m in (1, 4, 16):
        hidden = torch.randn(m, h, device="cuda", generator=gen).bfloat16()
        logits = torch.randn(m, e, device="cuda", generator=gen).bfloat16()
        ids, w, al = moe.moe_route(logits, top_k=top_k, block_size=16, routed_scaling_factor=KIMI["scale"])
        distinct = int(torch.unique(ids[ids >= 0]).numel())
        floor_us = distinct * expert_bytes / (bw * 1e9) * 1e6
        want = fused_moe_reference(hidden, w13, w2, ids, w, compute_dtype=torch.float64)
        scale = want.abs().max().item()
        out = torch.empty_like(hidden)
        for v in variants:
            moe._CONFIG_OVERRIDE = v
            try:
                res = moe.fused_moe(hidden, w13, w2, ids, w, alignment=al, out=out, impl="triton")
                err = (res.double() - want).abs().max().item() / scale
                us = graph_us(lambda: moe.fused_moe(hidden, w13, w2, ids, w, alignment=al, out=out, impl="triton"))
            except Exception as exc:
                add("experts", f"kimi-k2 M{m}", str(v)[:34], float("nan"), "-", float("nan"),
                    f"FAILED {exc.__class__.__name__}: {str(exc)[:120]}")
                continue
            g1, g2 = moe._gemm_configs(m, h, inter, 16, True, top_k=top_k, num_experts=e)
            add("experts", f"kimi-k2 M{m}", json.dumps(v).replace(" ", "")[:34], us,
                f"x_floor {us / floor_us:.2f}", err,
                f"floor {floor_us:.1f} split {g1['SPLIT_K']} g1 {g1['BLOCK_N']}x{g1['BLOCK_K']} w{g1['num_warps']} "
                f"s{g1['num_stages']} g2 {g2['BLOCK_N']}x{g2['BLOCK_K']}" + (" WRONG" if err > 2e-2 else ""))
        moe._CONFIG_OVERRIDE = {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--only", default="attn,route,experts")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_verify_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    import bench_tree_attention as bta

    t0 = time.time()
    bw = bta.copy_bandwidth_gbps()
    log(f"# copy bandwidth {bw:.0f} GB/s; {torch.cuda.get_device_name()}")
    only = set(args.only.split(","))
    for name, fn in (("route", lambda: sweep_route(args.quick)), ("experts", lambda: sweep_experts(bw, args.quick)),
                     ("attn", lambda: sweep_attention(bw, args.quick))):
        if name in only:
            try:
                fn()
            except Exception as exc:  # keep the other groups' numbers
                import traceback

                traceback.print_exc()
                log(f"# {name} sweep failed: {exc}")
            log(f"# {name} done at {time.time() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_gbps=bw, rows=ROWS), f, indent=1)
    # compact table: per shape the default and the best variant
    log("\n" + f"{'group':<8} {'shape':<26} {'default us':>10} {'best us':>9} {'best variant':<34} metric")
    shapes = []
    for r in ROWS:
        if (r["group"], r["shape"]) not in shapes:
            shapes.append((r["group"], r["shape"]))
    for g, s in shapes:
        rs = [r for r in ROWS if r["group"] == g and r["shape"] == s and r["us"] == r["us"]
              and "WRONG" not in r["note"]]
        if not rs:
            continue
        d = rs[0]
        b = min(rs, key=lambda r: r["us"])
        log(f"{g:<8} {s:<26} {d['us']:>10.2f} {b['us']:>9.2f} {b['variant']:<34} {b['metric']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
