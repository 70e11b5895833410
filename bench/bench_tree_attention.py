"""Benchmark: tree attention (verify pass) over a paged KV cache, MLA and GQA, against the bytes it must read.

Providers: ``reference`` (torch, small shapes only), ``triton`` (specverify), ``sglang`` (SGLang's Triton
extend-attention kernel with a custom mask, through ``bench/sglang_peer.py`` when that module and SGLang import:
it must offer ``tree_attention(q, k_cache, v_cache, *, page_table, prefix_lens, tree_mask, sm_scale)`` and/or
``tree_attention_mla(q_latent, q_rope, kv_cache, ...)`` with our semantics, or ``prepare_tree_attention(kind,
**same)`` returning a zero-argument callable so set-up stays out of the timing), ``flashinfer`` (when importable:
MLA chains and decode through ``BatchMLAPagedAttentionWrapper`` planned as SGLang's flashinfer MLA backend plans it,
GQA through its paged prefill wrapper with a dense custom mask).

Shapes: Kimi-K2 per rank (MLA, 8 heads, 512 + 64), DeepSeek-V3 per rank (MLA, 16 heads), Llama-3.1-8B (GQA 32/8,
d 128), a GQA 8:1 case (8/1, d 128); batch 1, 8, 64; context 1k, 4k, 32k; k = 1, 2, 4, 8, 16 as chains, and
k >= 4 also as top-2 trees. Page size 64, pages scattered.

Metrics: µs per call by ``triton.testing.do_bench`` (median) and by CUDA-graph replay (20 calls per graph);
``bytes = KV bytes of every request's prefix_len + k tokens + q bytes + out bytes``;
``bw_frac = bytes / graph_time / copy_bw`` with ``copy_bw`` a device-to-device copy measured in the same run
(``2 * bytes / time``). ``vs_sglang`` = sglang µs / triton µs (graph replay; > 1 means ours is faster).

Usage: ``python bench/bench_tree_attention.py [--quick] [--json PATH] [--sweep]``. ``--quick``: the acceptance
shapes only (< 90 s on an H200). ``--sweep``: also time every kernel config, and half / double the split count, on the acceptance shapes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import sys

import torch

from specverify.benchmarking import load_sglang_peer, bench_us, copy_bandwidth_gbps, git_commit, graph_us

MODELS = {
    "kimi-k2": dict(kind="mla", heads=8, r=512, dr=64, sm_scale=192 ** -0.5),
    "deepseek-v3": dict(kind="mla", heads=16, r=512, dr=64, sm_scale=192 ** -0.5),
    "llama-3.1-8b": dict(kind="gqa", hq=32, hkv=8, d=128, sm_scale=128 ** -0.5),
    "gqa-8to1": dict(kind="gqa", hq=8, hkv=1, d=128, sm_scale=128 ** -0.5),
}
PAGE_SIZE = 64
# (model, batch, context, k, tree) — the acceptance shapes: the <= 10 µs latency target and >= 256 MB of KV
QUICK_SHAPES = [
    ("kimi-k2", 1, 4096, 4, True),
    ("kimi-k2", 1, 4096, 1, False),
    ("kimi-k2", 1, 4096, 4, False),  # chains: what FlashInfer's MLA wrapper (SGLang's flashinfer backend) serves
    ("kimi-k2", 64, 4096, 4, False),
    ("kimi-k2", 64, 4096, 4, True),
    ("kimi-k2", 8, 32768, 4, True),
    ("deepseek-v3", 8, 4096, 8, True),
    ("llama-3.1-8b", 1, 4096, 4, True),
    ("llama-3.1-8b", 8, 32768, 4, True),
    ("gqa-8to1", 64, 4096, 16, False),
]


def full_shapes():
    for model in MODELS:
        for batch in (1, 8, 64):
            for ctx in (1024, 4096, 32768):
                for k in (1, 2, 4, 8, 16):
                    yield model, batch, ctx, k, False
                    if k >= 4:
                        yield model, batch, ctx, k, True


def _peer():
    return load_sglang_peer(__file__)


def _flashinfer():
    try:
        import flashinfer  # noqa: PLC0415

        return flashinfer, ""
    except Exception as exc:
        return None, f"flashinfer not importable ({exc.__class__.__name__})"


def make_inputs(model: str, batch: int, ctx: int, k: int, tree: bool, seed: int = 0):
    """Inputs for one shape: prefixes ``ctx - k`` (so every request reads ``ctx`` tokens), scattered pages."""
    from specverify.tree import DraftTree

    cfg = MODELS[model]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages_per_req = math.ceil(ctx / PAGE_SIZE)
    num_pages = batch * pages_per_req + 1
    table = torch.randperm(num_pages, device="cuda", generator=gen)[: batch * pages_per_req]
    table = table.view(batch, pages_per_req).int()
    prefix = torch.full((batch,), ctx - k, dtype=torch.int32, device="cuda")
    mask = DraftTree.topk_of_size(2, k).packed_mask().cuda() if tree else None
    dt = torch.bfloat16
    if cfg["kind"] == "mla":
        h, r, dr = cfg["heads"], cfg["r"], cfg["dr"]
        kv = torch.randn(num_pages, PAGE_SIZE, r + dr, device="cuda", dtype=dt, generator=gen)
        ql = torch.randn(batch, k, h, r, device="cuda", dtype=dt, generator=gen)
        qr = torch.randn(batch, k, h, dr, device="cuda", dtype=dt, generator=gen)
        tensors = dict(q_latent=ql, q_rope=qr, kv_cache=kv)
        kv_bytes = batch * ctx * (r + dr) * 2
        io_bytes = (ql.numel() + qr.numel() + batch * k * h * r) * 2
    else:
        hq, hkv, d = cfg["hq"], cfg["hkv"], cfg["d"]
        kc = torch.randn(num_pages, PAGE_SIZE, hkv, d, device="cuda", dtype=dt, generator=gen)
        vc = torch.randn(num_pages, PAGE_SIZE, hkv, d, device="cuda", dtype=dt, generator=gen)
        q = torch.randn(batch, k, hq, d, device="cuda", dtype=dt, generator=gen)
        tensors = dict(q=q, k_cache=kc, v_cache=vc)
        kv_bytes = batch * ctx * hkv * d * 2 * 2
        io_bytes = 2 * q.numel() * 2
    meta = dict(page_table=table, prefix_lens=prefix, tree_mask=mask, sm_scale=cfg["sm_scale"])
    return cfg, tensors, meta, kv_bytes + io_bytes


def _positional(cfg, tensors):
    return [tensors[n] for n in (("q_latent", "q_rope", "kv_cache") if cfg["kind"] == "mla" else
                                 ("q", "k_cache", "v_cache"))]


def triton_fn(cfg, tensors, meta, batch, k, ctx, config=None, num_splits=None):
    from specverify.attention import (
        plan_tree_attention,
        plan_tree_attention_mla,
        tree_attention,
        tree_attention_mla,
    )

    args = _positional(cfg, tensors)
    if cfg["kind"] == "mla":
        plan = plan_tree_attention_mla(max_batch=batch, num_draft_tokens=k, num_heads=cfg["heads"], max_context=ctx,
                                       device="cuda", config=config, num_splits=num_splits)
        out = torch.empty(batch, k, cfg["heads"], cfg["r"], dtype=torch.bfloat16, device="cuda")
        fn = lambda: tree_attention_mla(*args, **meta, out=out, plan=plan, validate=False)  # noqa: E731
    else:
        plan = plan_tree_attention(max_batch=batch, num_draft_tokens=k, num_q_heads=cfg["hq"],
                                   num_kv_heads=cfg["hkv"], head_dim=cfg["d"], max_context=ctx, device="cuda",
                                   config=config, num_splits=num_splits)
        out = torch.empty(batch, k, cfg["hq"], cfg["d"], dtype=torch.bfloat16, device="cuda")
        fn = lambda: tree_attention(*args, **meta, out=out, plan=plan, validate=False)  # noqa: E731
    return fn, plan


def reference_fn(cfg, tensors, meta):
    from specverify.reference.attention import tree_attention_mla_reference, tree_attention_reference

    args = _positional(cfg, tensors)
    ref = tree_attention_mla_reference if cfg["kind"] == "mla" else tree_attention_reference
    return lambda: ref(*args, meta["page_table"], meta["prefix_lens"], meta["tree_mask"], meta["sm_scale"])


def sglang_fn(peer, cfg, tensors, meta):
    args = _positional(cfg, tensors)
    if hasattr(peer, "prepare_tree_attention"):
        return peer.prepare_tree_attention(cfg["kind"], *args, **meta), ""
    name = "tree_attention_mla" if cfg["kind"] == "mla" else "tree_attention"
    if not hasattr(peer, name):
        return None, f"sglang_peer has no {name}()"
    f = getattr(peer, name)
    return (lambda: f(*args, **meta)), ""


def flashinfer_fn(fi, cfg, tensors, meta, batch, k, ctx):
    """FlashInfer: MLA chains and decode through ``BatchMLAPagedAttentionWrapper`` as SGLang's flashinfer MLA
    backend plans it (:mod:`specverify.peers.flashinfer`; it takes no tree mask), GQA through its paged prefill
    with a dense custom mask [k, ctx] per request."""
    if cfg["kind"] == "mla":
        if meta["tree_mask"] is not None:
            return None, "flashinfer: its MLA wrapper takes no tree mask (chains only)"
        from specverify.peers.flashinfer import prepare_mla_attention

        fn = prepare_mla_attention(*_positional(cfg, tensors), **meta, module=fi)
        return fn, f"BatchMLAPagedAttentionWrapper backend {fn.backend}"
    from specverify.reference.attention import _visible

    table = meta["page_table"]
    pages = table.shape[1]
    ws = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * k
    kv_indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * pages
    last = torch.full((batch,), ctx - (pages - 1) * PAGE_SIZE, dtype=torch.int32, device="cuda")
    visible = _visible(meta["prefix_lens"], meta["tree_mask"], k, ctx)  # [batch, k, ctx]
    wrapper.plan(qo_indptr, kv_indptr, table.reshape(-1), last, cfg["hq"], cfg["hkv"], cfg["d"], PAGE_SIZE,
                 custom_mask=visible.reshape(-1), sm_scale=meta["sm_scale"], q_data_type=torch.bfloat16,
                 kv_data_type=torch.bfloat16)
    q = tensors["q"].reshape(batch * k, cfg["hq"], cfg["d"])
    kv = (tensors["k_cache"], tensors["v_cache"])
    return (lambda: wrapper.run(q, kv).view(batch, k, cfg["hq"], cfg["d"])), "paged prefill, custom mask"


def max_err(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="acceptance shapes only (< 90 s on an H200)")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    ap.add_argument("--sweep", action="store_true", help="also time every kernel config on the acceptance shapes")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_tree_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    from specverify.kernels import tree_attention as kernels

    models = set(args.models.split(","))
    peer, peer_why = _peer()
    if peer is None:
        print(f"# sglang provider skipped: {peer_why}")
    fi, fi_why = _flashinfer()
    if fi is None:
        print(f"# flashinfer provider skipped: {fi_why}")
    bw = copy_bandwidth_gbps()
    print(f"# measured D2D copy bandwidth: {bw:.0f} GB/s")
    meta_run = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    commit=git_commit(__file__), date=datetime.datetime.now().isoformat(timespec="seconds"), copy_gbps=bw,
                    page_size=PAGE_SIZE)
    shapes = [s for s in (QUICK_SHAPES if args.quick else full_shapes()) if s[0] in models]
    rows = []
    for model, batch, ctx, k, tree in shapes:
        cfg, tensors, meta, nbytes = make_inputs(model, batch, ctx, k, tree)
        base = dict(model=model, batch=batch, context=ctx, k=k, tree=tree, bytes=nbytes)
        fn, plan = triton_fn(cfg, tensors, meta, batch, k, ctx)
        got = fn().clone()
        small = batch * ctx <= 8 * 4096
        ref = reference_fn(cfg, tensors, meta)
        if small:  # correctness before timing (the reference would need tens of GB beyond this)
            err = max_err(got, ref())
            if not err <= 0.05:
                print(f"# WRONG triton result {model} b{batch} ctx{ctx} k{k}: max err {err:.3g}")
                return 1
        providers = [("triton", fn, f"splits={plan.num_splits} {plan.config}")]
        if small and not args.quick:
            providers.append(("reference", ref, ""))
        if peer is not None:
            try:
                pf, why = sglang_fn(peer, cfg, tensors, meta)
                if pf is not None:
                    err = max_err(pf(), got)
                    providers.append(("sglang", pf, f"max|diff| vs triton {err:.3g}"))
                elif why:
                    print(f"# sglang skipped for {model}: {why}")
            except Exception as exc:
                print(f"# sglang failed on {model} b{batch} ctx{ctx} k{k}: {exc.__class__.__name__}: {exc}")
        if fi is not None:
            try:
                ff, fnote = flashinfer_fn(fi, cfg, tensors, meta, batch, k, ctx)
                if ff is not None:
                    err = max_err(ff(), got)
                    providers.append(("flashinfer", ff, f"max|diff| vs triton {err:.3g}; {fnote}"))
            except Exception as exc:
                print(f"# flashinfer failed on {model} b{batch} ctx{ctx} k{k}: {exc.__class__.__name__}: {exc}")
        if args.sweep and (model, batch, ctx, k, tree) in QUICK_SHAPES:
            for i, c in enumerate(kernels.MLA_CONFIGS if cfg["kind"] == "mla" else kernels.GQA_CONFIGS):
                sf, splan = triton_fn(cfg, tensors, meta, batch, k, ctx, config=c)
                err = max_err(sf(), got)
                providers.append((f"triton-cfg{i}", sf, f"splits={splan.num_splits} {c} diff {err:.3g}"))
            for splits in sorted({max(1, plan.num_splits // 2), min(64, plan.num_splits * 2)} - {plan.num_splits}):
                sf, splan = triton_fn(cfg, tensors, meta, batch, k, ctx, num_splits=splits)
                err = max_err(sf(), got)
                providers.append((f"triton-s{splits}", sf, f"splits={splits} {splan.config} diff {err:.3g}"))
        shape_rows = []
        for name, f, note in providers:
            try:
                us = bench_us(f, args.quick)
                gus = graph_us(f) if name != "reference" else float("nan")
            except Exception as exc:
                print(f"# {name} failed timing on {model} b{batch} ctx{ctx} k{k}: {exc.__class__.__name__}: {exc}")
                continue
            t = gus if gus == gus else us
            shape_rows.append(dict(base, provider=name, us=us, graph_us=gus,
                                   bw_frac=nbytes / (t * 1e-6) / (bw * 1e9), note=note))
        ours = next((r["graph_us"] for r in shape_rows if r["provider"] == "triton"), float("nan"))
        for r in shape_rows:
            r["vs_sglang"] = float("nan")
        sg = next((r["graph_us"] for r in shape_rows if r["provider"] == "sglang"), None)
        if sg is not None:
            for r in shape_rows:
                if r["provider"] == "triton":
                    r["vs_sglang"] = sg / ours
        rows.extend(shape_rows)
        del tensors, meta
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta_run, rows=rows), f, indent=1)
    hdr = (f"{'model':<13} {'b':>3} {'ctx':>6} {'k':>3} {'tree':>5} {'provider':<13} {'us':>9} {'graph_us':>9} "
           f"{'MB':>8} {'bw%':>6} {'vs_sgl':>7}  note")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['model']:<13} {r['batch']:>3} {r['context']:>6} {r['k']:>3} {str(r['tree']):>5} "
              f"{r['provider']:<13} {r['us']:>9.2f} {r['graph_us']:>9.2f} {r['bytes'] / 1e6:>8.1f} "
              f"{100 * r['bw_frac']:>5.1f}% {r['vs_sglang']:>7.2f}  {r['note']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
