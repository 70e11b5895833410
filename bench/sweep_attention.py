"""Sweep: Kimi-K2 MLA tree attention, the default against the tl.dot kernel's configs and other split counts.

Shapes (Kimi-K2 per rank at tp 8: 8 heads, kv_lora_rank 512 + rope 64, bf16, page size 64, pages scattered):
batch 1 context 4096 k 1 (decode) and k 4 (top-2 tree) — the <= 10 us latency target of issue 4 —, batch 8
context 32768 k 4 and batch 64 context 4096 k 4 (bandwidth). Rows: ``default`` (the plan without a config: the
Gluon wgmma kernel on sm_90 with Triton 3.6, else the tl.dot kernel with its per-shape config), the tl.dot kernel's
two configs the plan chooses between where the Gluon kernel cannot run (``tl.dot``: ``MLA_CONFIGS[0]``, splits of one
KV tile; ``tl.dot page-ahead``: ``MLA_BANDWIDTH_CONFIG``, splits of two or more tiles) and the default at forced split
counts.

Each variant is checked before timing: ``err`` = max |out - ref| against the fp32 torch reference, ``tol`` = 2 x the
torch bf16 reference's own error + one bf16 ulp of the output scale (the tests' derived tolerance); a variant over
tol is marked WRONG. Time: µs per call by CUDA-graph replay (20 calls per graph, best of 3,
``specverify.benchmarking.graph_us``). ``bw% = KV bytes / time / copy_bw`` with KV bytes = batch x context x 576 x 2
and ``copy_bw`` a 1 GiB device-to-device copy (``2 * bytes / time``) measured in the same run.

More sets: ``--only dsv3`` (DeepSeek-V3's verify-pass shape: 16 heads, batch 4, 16k, page size 1, top-2 tree at
k 4 / 8 / 1, with other row tiles, split counts and bf16 split partials) and ``--only rows64`` (split counts at 64
query rows: Kimi-K2 b 1 / 4k / page 64 / chain k 8 and DeepSeek-V3 b 4 / 16k / page 1 / tree k 4) and ``--only
tiles`` (33-64 query rows a program where the batch fills the GPU: Kimi-K2 b 64 / 4k and b 8 / 32k at k 6 and 8,
the rule's two 32-row tiles, each reading its split's KV, against one 64-row tile). A variant whose
plan (kernel, row tile, splits, partials' dtype) equals one already timed at the shape is skipped.

Usage: ``python bench/sweep_attention.py [--quick] [--json PATH] [--budget-s S] [--only
latency|bandwidth|long|wgmma|dsv3|rows64|tiles] [--resources]``; prints a table last. ``--quick``: fewer variants per
shape. ``--only``: the batch-1 shapes, the batch 8 / 64 shapes, batch 1 at 32k, every shape with the wgmma split
counts, or the sets above. ``--resources`` needs no GPU: it
compiles the tl.dot kernel's MLA configs for sm_90a here and prints registers, spilled bytes, shared memory and
whether wgmma is used. ``--budget-s``: start no new
variant after S seconds (default 420), so one device call stays bounded; the JSON is rewritten after every row, so a
killed run still leaves its numbers.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROWS: list[dict] = []
MODEL = "kimi-k2"


def log(msg: str) -> None:
    print(msg, flush=True)


def variants_for(batch: int, k: int, quick: bool):
    """[(label, config or None, num_splits or None)], most informative first."""
    from specverify.kernels import tree_attention as kernels

    v = [("default", None, None), ("tl.dot", kernels.MLA_CONFIGS[0], None),
         ("tl.dot page-ahead", kernels.MLA_BANDWIDTH_CONFIG, None)]
    if batch == 1:
        v += [("default s32", None, 32), ("default s64", None, 64), ("default s128", None, 128),
              ("tl.dot s64", kernels.MLA_CONFIGS[0], 64), ("tl.dot page-ahead s16", kernels.MLA_BANDWIDTH_CONFIG, 16)]
    elif batch == 8:
        v += [("default s8", None, 8), ("default s16", None, 16), ("default s32", None, 32)]
    else:
        v += [("default s1", None, 1), ("default s2", None, 2), ("default s4", None, 4)]
    return v[:4] if quick else v


def variants_long():
    """Batch 1 at 32k: the default split count against forced ones (the heuristic caps at HEURISTIC_MAX_SPLITS)."""
    return [("default", None, None), ("s64", None, 64), ("s128", None, 128), ("s96", None, 96)]


def variants_wgmma(batch: int, ctx: int):
    """The Gluon wgmma kernel (the MLA default on sm_90, ``MLA_WGMMA_DEFAULT``) against the ``tl.dot`` kernels the
    plan takes elsewhere, at the heuristic's and forced split counts."""
    from specverify.kernels import tree_attention as kernels

    v = [("default", None, None)]
    if batch == 1:
        return v + [("tl.dot", kernels.MLA_CONFIGS[0], None), ("default s128", None, 128), ("default s32", None, 32)]
    v.append(("tl.dot page-ahead", kernels.MLA_BANDWIDTH_CONFIG, None))
    if batch == 8:
        return v + [("default s8", None, 8), ("default s32", None, 32)]
    return v + [("default s4", None, 4)]


def variants_dsv3(k: int):
    """DeepSeek-V3's verify-pass shape (16 heads a rank, batch 4, 16k, page size 1, ``topk:2`` tree): the default
    against other row tiles (at 64 rows one 64-row tile instead of the plan's two 32-row tiles; at 128 rows four
    32-row tiles instead of two 64-row ones; 16-row tiles), other split counts and bf16 split partials (``bf16 ws``:
    the plan's fp32 workspace replaced by a bf16 one; the merge sums in fp32)."""
    v = [("default", None, None), ("default bf16 ws", None, None)]
    if 16 * k >= 64:
        alt = 64 if 16 * k == 64 else 32
        cfg = {"KERNEL": "mla_wgmma", "PDL": True, "BLOCK_M": alt}
        v += [(f"M{alt}", cfg, None), (f"M{alt} bf16 ws", cfg, None), (f"M{alt} s16", cfg, 16),
              ("default s16", None, 16), ("default s64", None, 64)]
    if 16 * k > 16:
        v += [("M16", {"KERNEL": "mla_wgmma", "PDL": True, "BLOCK_M": 16}, None)]
    return v


def variants_rows64():
    """64 query rows a program (two 32-row tiles): the split count, which sets the partials' bytes."""
    return [("default", None, None)] + [(f"s{n}", None, n) for n in (8, 16, 24, 32, 48, 64)]


def variants_tiles():
    """33-64 query rows a program: the rule's two 32-row tiles (``MLA_WGMMA_64_ROW_TILE``) against one 64-row tile."""
    return [("default", None, None), ("M64", {"KERNEL": "mla_wgmma", "PDL": True, "BLOCK_M": 64}, None)]


def write_json(path, bw):
    if not path:
        return
    import triton

    from specverify.benchmarking import git_commit

    with open(path, "w") as fh:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       commit=git_commit(__file__), date=datetime.datetime.now().isoformat(timespec="seconds"),
                       copy_gbps=bw, rows=ROWS), fh, indent=1)


def resources(quick: bool) -> list[dict]:
    """Registers / spills / shared memory of the tl.dot MLA kernel's configs, compiled for sm_90a here (no GPU: the
    launches ``specverify.attention`` would make are captured and compiled offline)."""
    from specverify.kernels import tree_attention as kernels
    from sweep_verify_kernels import _captured_launches, _compile_sm90

    cfgs = [("default", dict(kernels.MLA_CONFIGS[0], BLOCK_M=32)), ("ahead", kernels.MLA_BANDWIDTH_CONFIG)]
    cfgs += [(f"cfg{i}", c) for i, c in enumerate(kernels.MLA_CONFIGS[1:], 1)]
    shapes = [(64, 4096, 4, 2), (1, 4096, 4, 64)] + ([] if quick else [(64, 4096, 8, 2)])
    rows = []
    for batch, ctx, k, splits in shapes:
        for label, config in cfgs:
            if k == 8 and label != "default" and config["BLOCK_M"] < 64:
                continue  # the k 8 shape (64 rows) is for the 64-row configs
            t0 = time.time()
            row = {"shape": f"b{batch} c{ctx} k{k}", "variant": label, "config": config}
            try:
                sink, _ = _captured_launches(True, batch, k, ctx, dict(config), splits)
                fn, grid, args, kw = sink[0]
                regs, spill, shared, wgmma = _compile_sm90(fn, args, kw)
                row.update(regs=regs, spill_bytes=spill, shared_bytes=shared, mma="wgmma" if wgmma else "mma.sync",
                           grid=list(grid))
            except Exception as exc:  # noqa: BLE001 - report and go on
                row.update(note=f"FAILED {exc.__class__.__name__}: {str(exc)[:160]}")
            rows.append(row)
            log(f"  {row['shape']:<14} {label:<8} {row.get('regs', '-')!s:>4} regs  spill "
                f"{row.get('spill_bytes', '-')!s:>5} B  shared {row.get('shared_bytes', '-')!s:>6} B  "
                f"{row.get('mma', '')}  {time.time() - t0:.0f} s {row.get('note', '')}")
    log(f"\n{'shape':<14} {'variant':<8} {'regs':>5} {'spill B':>8} {'shared B':>9} {'mma':<9} config")
    for r in rows:
        log(f"{r['shape']:<14} {r['variant']:<8} {r.get('regs', '-')!s:>5} {r.get('spill_bytes', '-')!s:>8} "
            f"{r.get('shared_bytes', '-')!s:>9} {r.get('mma', 'FAILED'):<9} {r['config']}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer variants per shape")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON (rewritten after every row)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no new variant after this many seconds")
    ap.add_argument("--only", choices=("latency", "bandwidth", "long", "wgmma", "dsv3", "rows64", "tiles"),
                    help="only the batch-1 4k shapes, only the batch 8 / 64 shapes, only batch 1 at 32k (split "
                    "counts), the Gluon wgmma kernel against the default at every shape, or DeepSeek-V3's pass shape "
                    "(b 4, 16k, page size 1, top-2 tree, k 1 / 4 / 8) with row tiles, splits and bf16 partials, or "
                    "split counts at 64 query rows (Kimi-K2 b 1 / 4k k 8, DeepSeek-V3 b 4 / 16k k 4), or the row "
                    "tiles at 33-64 rows where the batch fills the GPU (Kimi-K2 b 64 / 4k and b 8 / 32k, k 6 and 8)")
    ap.add_argument("--resources", action="store_true", help="offline sm_90a registers/spills of the tl.dot kernel's "
                    "MLA configs (no GPU)")
    args = ap.parse_args(argv)
    if args.resources:
        rows = resources(args.quick)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(dict(resources=rows), fh, indent=1)
        return 0 if all("regs" in r for r in rows) else 1
    if not torch.cuda.is_available():
        print("sweep_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    import bench_tree_attention as bta

    from specverify.attention import tree_attention_mla
    from specverify.benchmarking import copy_bandwidth_gbps
    from specverify.benchmarking import graph_us as _graph_us
    from specverify.reference.attention import tree_attention_mla_reference

    graph_us = partial(_graph_us, calls=20, repeats=3)
    t0 = time.time()
    bw = copy_bandwidth_gbps()
    log(f"# copy bandwidth {bw:.0f} GB/s; {torch.cuda.get_device_name()}")
    shapes = [(1, 4096, 4, True), (1, 4096, 1, False), (8, 32768, 4, True), (64, 4096, 4, True)]
    model = MODEL
    eps = torch.finfo(torch.bfloat16).eps
    if args.only == "long":
        shapes = [(1, 32768, 1, False), (1, 32768, 2, False), (1, 32768, 4, True)]
    elif args.only == "wgmma":
        shapes = [(64, 4096, 4, True), (8, 32768, 4, True), (1, 4096, 4, True), (1, 4096, 1, False),
                  (1, 32768, 4, True), (8, 4096, 8, True)]
    elif args.only == "dsv3":
        shapes = [("deepseek-v3", 1, 4, 16384, k, k > 1) for k in (4, 8, 1)]
    elif args.only == "rows64":
        shapes = [("kimi-k2", 64, 1, 4096, 8, False), ("deepseek-v3", 1, 4, 16384, 4, True)]
    elif args.only == "tiles":
        shapes = [("kimi-k2", 64, batch, ctx, k, True) for batch, ctx in ((64, 4096), (8, 32768)) for k in (6, 8)]
    elif args.only:
        shapes = [sh for sh in shapes if (sh[0] == 1) == (args.only == "latency")]
    for shape in shapes:
        prefix = ""
        if len(shape) == 6:  # (model, page size, batch, context, k, tree)
            model, bta.PAGE_SIZE = shape[:2]
            prefix, shape = f"{model[:4]} ", shape[2:]
        batch, ctx, k, tree = shape
        name = f"{prefix}b{batch} c{ctx} k{k}{'t' if tree else ''}"
        if time.time() - t0 > args.budget_s:
            log(f"# budget of {args.budget_s:.0f} s spent, skipping {name}")
            continue
        cfg, tensors, meta, _ = bta.make_inputs(model, batch, ctx, k, tree)
        kv_bytes = batch * ctx * (cfg["r"] + cfg["dr"]) * 2
        args_ref = (tensors["q_latent"], tensors["q_rope"], tensors["kv_cache"], meta["page_table"],
                    meta["prefix_lens"], meta["tree_mask"], meta["sm_scale"])
        ref32, lse32 = tree_attention_mla_reference(*args_ref, return_lse=True)
        low = tree_attention_mla_reference(*args_ref, compute_dtype=torch.bfloat16)
        tol = 2.0 * (low.float() - ref32).abs().max().item() + eps * max(1.0, ref32.abs().max().item())
        del low
        torch.cuda.empty_cache()
        variants = (variants_wgmma(batch, ctx) if args.only == "wgmma" else
                    variants_dsv3(k) if args.only == "dsv3" else variants_rows64() if args.only == "rows64" else
                    variants_tiles() if args.only == "tiles" else
                    variants_long() if ctx > 4096 and batch == 1 else variants_for(batch, k, args.quick))
        timed = {}  # (kernel, row tile, splits, bf16 partials) -> the variant that timed it
        for label, config, splits in variants:
            if time.time() - t0 > args.budget_s:
                log(f"# budget of {args.budget_s:.0f} s spent, skipping {name} {label} and the rest")
                break
            row = dict(shape=name, variant=label, us=float("nan"), bw_pct=float("nan"), err=float("nan"),
                       lse_err=float("nan"), tol=tol, splits=None, note="")
            try:
                fn, plan = bta.triton_fn(cfg, tensors, meta, batch, k, ctx, config=config, num_splits=splits)
                same = (plan.config["KERNEL"], plan.config["BLOCK_M"], plan.num_splits, "bf16 ws" in label)
                if same in timed:
                    log(f"  {name:<14} {label:<32} skipped: the same plan as {timed[same]}")
                    continue
                timed[same] = label
                if "bf16 ws" in label and plan.workspace_out is not None:
                    plan.workspace_out = plan.workspace_out.to(torch.bfloat16)
                out, lse = tree_attention_mla(*bta._positional(cfg, tensors), **meta, plan=plan, validate=False,
                                              return_lse=True)
                row["err"] = (out.float() - ref32).abs().max().item()
                row["lse_err"] = (lse - lse32).abs().max().item()
                row["us"] = graph_us(fn)
                row["bw_pct"] = 100.0 * kv_bytes / (row["us"] * 1e-6) / (bw * 1e9)
                row["splits"] = plan.num_splits
                pc = plan.config
                row["note"] = (f"S{plan.num_splits} {pc['KERNEL']} M{pc['BLOCK_M']} N{pc['BLOCK_N']} "
                               f"DV{pc['BLOCK_DV']} w{pc['num_warps']} s{pc['num_stages']}"
                               f"{' ahead' if pc['PAGE_AHEAD'] else ''}{' pdl' if pc['PDL'] else ''}")
                if not row["err"] <= tol:
                    row["note"] += " WRONG"
            except Exception as exc:  # noqa: BLE001 - a variant that fails to compile, launch or capture is reported
                row["note"] = f"FAILED {exc.__class__.__name__}: {str(exc)[:160]}"
                try:
                    torch.cuda.synchronize()
                except Exception as sync_exc:  # noqa: BLE001 - a broken context: the rows so far are in the JSON
                    row["note"] += f"; then {sync_exc.__class__.__name__}"
            ROWS.append(row)
            log(f"  {name:<14} {label:<32} {row['us']:8.2f} us  bw {row['bw_pct']:5.1f}%  err {row['err']:.3g} "
                f"(tol {tol:.3g}) lse {row['lse_err']:.2g}  {row['note']}")
            write_json(args.json, bw)
        del tensors, meta, ref32, lse32
        torch.cuda.empty_cache()
    write_json(args.json, bw)
    log(f"# done in {time.time() - t0:.0f} s")
    log(f"\n{'shape':<14} {'variant':<32} {'us':>8} {'bw%':>6} {'max err':>9} {'tol':>9}  note")
    for r in ROWS:
        log(f"{r['shape']:<14} {r['variant']:<32} {r['us']:8.2f} {r['bw_pct']:6.1f} {r['err']:9.3g} {r['tol']:9.3g}"
            f"  {r['note']}")
    log(f"\n{'shape':<14} {'default us':>10} {'best us':>8} best variant")
    for shape in dict.fromkeys(r["shape"] for r in ROWS):
        ok = [r for r in ROWS if r["shape"] == shape and r["us"] == r["us"] and "WRONG" not in r["note"]
              and "FAILED" not in r["note"]]
        if ok:
            best = min(ok, key=lambda r: r["us"])
            log(f"{shape:<14} {ok[0]['us']:10.2f} {best['us']:8.2f} {best['variant']} ({best['bw_pct']:.1f}% bw)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
