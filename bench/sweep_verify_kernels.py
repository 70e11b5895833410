"""Sweep: tree attention tiles and split counts, and the router's warps, on the acceptance shapes, in one device call.

Checks every variant against the reference (or against the checked default) before timing it, then times it by
CUDA-graph replay (20 calls per graph, the convention of bench_tree_attention.py / bench_moe.py). Derived metric:
attention ``bw% = (KV + q + out bytes) / time / copy_bw`` with ``copy_bw`` a 1 GiB device-to-device copy
(``2 * bytes / time``) measured in the same run. The MoE experts' sweeps are ``bench/sweep_moe.py`` (dot-path tiles)
and ``bench/sweep_experts.py`` (stream experts).

Usage: ``python bench/sweep_verify_kernels.py [--quick] [--json PATH] [--only attn,route] [--resources]``; prints a
table last. ``--quick`` trims the variant lists (about half the compile time). ``attn``: the default plan against
each tile of ``GQA_CONFIGS`` / ``MLA_CONFIGS`` and other split counts; ``route``: the router alone and with its
alignment at each warp count of ``_ROUTE_CONFIG``. ``--resources`` needs no GPU: it compiles the tl.dot attention
configs for sm_90a on this machine and prints registers, spilled bytes (local + stack) and shared memory.
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


# ------------------------------------------------------------------------------------------------ offline resources
class _Capture:
    """Stands in for a Triton kernel: ``k[grid](*args, **kw)`` records the launch instead of running it."""

    def __init__(self, fn, sink):
        self.fn, self.sink = fn, sink

    def __getitem__(self, grid):
        return lambda *args, **kw: self.sink.append((self.fn, grid, args, kw))


def _captured_launches(mla, batch, k, ctx, config, num_splits, heads=8, hq=32, hkv=8, d=128):
    """The kernel launches ``specverify.attention`` would make for one call (CPU tensors, nothing runs)."""
    import specverify.attention as att
    from specverify.kernels import tree_attention as kernels
    from specverify.tree import DraftTree

    sink = []

    class _Proxy:
        def __getattr__(self, name):
            obj = getattr(kernels, name)
            return _Capture(obj, sink) if name.endswith("_kernel") else obj

    ps = 64
    pages = math.ceil(ctx / ps)
    table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
    prefix = torch.full((batch,), ctx - k, dtype=torch.int32)
    mask = DraftTree.topk_of_size(2, k).packed_mask() if k > 1 else None
    dt = torch.bfloat16
    if mla:
        plan = att._make_plan(max_batch=batch, k=k, hq=heads, hkv=1, d=512, dr=64, dv=512, max_context=ctx,
                              device="cpu", dtype_bytes=2, v_is_k=True, num_splits=num_splits, config=config)
        q, qr = torch.empty(batch, k, heads, 512, dtype=dt), torch.empty(batch, k, heads, 64, dtype=dt)
        kv = torch.empty(batch * pages, ps, 576, dtype=dt)
        out = torch.empty(batch, k, heads, 512, dtype=dt)
        strides = (kv.stride(0), kv.stride(1), 0)
        call = dict(q=q, qr=qr, kc=kv, vc=kv, k_strides=strides, v_strides=strides, v_is_k=True)
    else:
        plan = att._make_plan(max_batch=batch, k=k, hq=hq, hkv=hkv, d=d, dr=0, dv=d, max_context=ctx, device="cpu",
                              dtype_bytes=2, v_is_k=False, num_splits=num_splits, config=config)
        q = torch.empty(batch, k, hq, d, dtype=dt)
        kc = torch.empty(batch * pages, ps, hkv, d, dtype=dt)
        out = torch.empty_like(q)
        call = dict(q=q, qr=None, kc=kc, vc=kc, k_strides=kc.stride()[:3], v_strides=kc.stride()[:3], v_is_k=False)
    saved = att._kernels
    att._kernels = lambda: _Proxy()
    try:
        att._launch(**call, page_table=table, prefix_lens=prefix, tree_mask=mask, sm_scale=0.1, out=out, lse=None,
                    plan=plan, page_size=ps)
    finally:
        att._kernels = saved
    return sink, plan


def _compile_sm90(fn, args, kw):
    """Compile one captured launch for sm_90a offline; returns (registers, local+stack bytes per thread (spills),
    dynamic shared bytes, uses wgmma)."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kw = dict(kw, DOT_FP32=False) if "DOT_FP32" in kw else dict(kw)
    num_warps, num_stages = kw.pop("num_warps", 4), kw.pop("num_stages", 3)
    names = fn.arg_names
    values = dict(zip(names, args))
    values.update(kw)
    sig, const, attrs = {}, {}, {}
    tnames = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
              torch.int64: "*i64", torch.uint8: "*u8"}
    for i, name in enumerate(names):
        v = values.get(name, fn.params[i].default)
        if fn.params[i].is_constexpr or isinstance(v, bool):
            sig[name], const[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[name] = tnames[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        elif v == 1:
            sig[name], const[name] = "constexpr", 1
        else:
            sig[name] = "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    target = GPUTarget("cuda", 90, 32)
    backend = triton.compiler.make_backend(target)
    opts = backend.parse_options({"num_warps": num_warps, "num_stages": num_stages})
    ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs), target=target,
                        options=opts.__dict__)
    ptx = ck.asm["ptx"]
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(ck.asm["cubin"])
    try:
        info = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    regs = int(m.group(1)) if (m := re.search(r"REG:(\d+)", info)) else -1
    # local memory per thread (spilled registers live there) and the call stack
    spill = sum(int(x) for x in re.findall(r"(?:LOCAL|STACK):(\d+)", info))
    return regs, spill, ck.metadata.shared, "wgmma" in ptx


def resources(quick: bool) -> None:
    """Registers / spills / shared memory of each attention variant compiled for sm_90a here (no GPU needed)."""
    from specverify.kernels import tree_attention as kernels

    mla_cfgs = [("default", dict(kernels.MLA_CONFIGS[0], BLOCK_M=32)), ("bandwidth", kernels.MLA_BANDWIDTH_CONFIG),
                ("default s1", dict(kernels.MLA_CONFIGS[0], BLOCK_M=32, _splits=1))] + \
        [(f"cfg{i}", c) for i, c in enumerate(kernels.MLA_CONFIGS[1:], 1)]
    gqa_cfgs = [("default", kernels.GQA_CONFIGS[0])] + \
        [(f"cfg{i}", c) for i, c in enumerate(kernels.GQA_CONFIGS[1:], 1)]
    if quick:
        mla_cfgs, gqa_cfgs = mla_cfgs[:4], gqa_cfgs[:2]
    jobs = [("kimi-k2 b1 c4096 k4", True, name, c) for name, c in mla_cfgs] + \
        [("llama-3.1-8b b8 c32768 k4", False, name, c) for name, c in gqa_cfgs]
    for shape, mla, name, c in jobs:
        t0 = time.time()
        try:
            c = dict(c)
            sink, plan = _captured_launches(mla, 1 if mla else 8, 4, 4096 if mla else 32768, c,
                                            c.pop("_splits", 16))
            fn, grid, args, kw = sink[0]
            regs, spill, shared, wgmma = _compile_sm90(fn, args, kw)
        except Exception as exc:  # report and go on
            add("res", shape, name, float("nan"), "-", float("nan"), f"FAILED {exc.__class__.__name__}: "
                f"{str(exc)[:160]}")
            continue
        note = (f"regs {regs} spill {spill} B shared {shared} B {'wgmma' if wgmma else 'mma.sync'} grid {grid} "
                f"compile {time.time() - t0:.0f} s")
        add("res", shape, name, float("nan"), "SPILLS" if spill else "no spill", float("nan"), note)


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
            moe._ROUTE_CONFIG["num_warps"] = nw
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
        moe._ROUTE_CONFIG["num_warps"] = 4


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--only", default="attn,route", help="comma-separated groups: attn, route")
    ap.add_argument("--resources", action="store_true",
                    help="no GPU needed: compile the attention variants for sm_90a here and print registers/spills")
    args = ap.parse_args(argv)
    if args.resources:
        resources(args.quick)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(rows=ROWS), f, indent=1)
        log(f"\n{'shape':<26} {'variant':<20} {'spills':<9} resources")
        for r in ROWS:
            log(f"{r['shape']:<26} {r['variant']:<20} {r['metric']:<9} {r['note']}")
        return 0
    if not torch.cuda.is_available():
        print("sweep_verify_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    import bench_tree_attention as bta

    t0 = time.time()
    bw = bta.copy_bandwidth_gbps()
    log(f"# copy bandwidth {bw:.0f} GB/s; {torch.cuda.get_device_name()}")
    only = set(args.only.split(","))
    for name, fn in (("route", lambda: sweep_route(args.quick)), ("attn", lambda: sweep_attention(bw, args.quick))):
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
