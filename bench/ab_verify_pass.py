"""A/B of the verify pass's fusions in one process: ``verify-wall``'s specverify provider with fusion slots of its op
table emptied or rule sets changed, each variant timed by the same measurement (CUDA-graph replay medians, bytes
floor from a copy bandwidth of the same run), in the order given and then in reverse, so a drift across the run
shows as a difference between the two passes over the same variant (issue 22).

Variants (``--variants``, comma-separated): ``chain`` (no fusion slot: MLA preparation and the query absorption in
two launches, the shared expert's slot appended by a launch of its own, no one-launch MoE block), ``fused`` (the
default table), ``no-<slot>`` (one slot of ``FUSIONS`` emptied); gate/up of the stream experts (merged into
``specverify.moe._STREAM_OVERRIDE``): ``fma`` (no split-K MMA gate/up), ``splitk-m4`` / ``splitk-m6`` (split-K up to
4 / 6 tokens); ``block-m3`` / ``block-m4`` (the one-launch MoE block up to 3 / 4 tokens instead of
``MOE_BLOCK_MAX_M``); ``w<1|4>-<router|qkv|qb>`` (that GEMV's grid at 1 or 4 programs an SM instead of 2);
``rr-<qkv|qb|o>-k..-s..`` (that projection on the row-range GEMV, see ``_RR_RULES``);
``mb-n<BN>-k<BK>-c<SK>.<SD>.<W>`` (the MoE block's tiles at every token count and its launch candidate, as
``bench_moe_block.py --configs``); ``qdown-bh2`` (with ``--experts-quant``: the stream down kernel on bf16's
tile) and ``no-qprefetch`` (with ``--experts-quant int4``: the gate/up without its next-tile loads); ``stream-m8`` /
``stream-m16`` (the stream experts up to 8 / 16 tokens, not the dot path); ``ls0`` (fp8's stream gate/up loop not
pipelined, as int4's and bf16's); ``cublas-o`` (o_proj on cuBLAS again);
``router-gemv-m8`` (the router on our GEMV up to 8 tokens); ``no-q-fold`` (q_a's RMSNorm a launch of its own again,
``forward.model.FOLD_Q_NORM``); ``fold-m8`` (the fold up to 8 tokens, ``FOLD_Q_NORM_MAX_M``); ``no-early-kv``
(the MLA attention's first prefix KV tile read after the PDL wait, not before); ``mla-m64`` (33-64 query rows a
program in one 64-row tile, not two of 32).
Measured and removed (bench/RESULTS.md, "Verify pass"): RMSNorm folded into the projections and
q_a's norm in the qkv_a GEMV's last tile (slower in the pass), the split merge fused with W_UV (slower alone; again
as latent parts a program summed by a ticket, `no-attention_mla_up_v` against it: 0.06 / 0.12 / 0.32 / 0.48 ms
slower at k = 1 / 2 / 4 / 8), the router on row-range GEMVs at 3-8 tokens (1.2 ms slower at k = 3), the residual
add and RMSNorm before the MoE block made by every program of the block (`no-moe-norm` against it: 0.11 / 0.38 ms
slower at k = 1 / 2 with a copy of the rows a program, 0.22 / 0.51 with one shared copy), a
stream-K gate/up and TMA weight tiles (no faster in the pass), an L2 prefetch of o_proj / router / shared expert on
a side stream (slower), GEMV weight slices loaded before the PDL wait and the split merge letting its successor
launch before its wait (no faster), the shared expert's rows sent to L2 before the gate/up's wait (slower at 2
tokens), one-shot q_b / o_proj GEMVs (whole slices before the wait, no split reduce: slower), the MoE block's
down tiles of every slot sent to L2 before its second barrier and its K split into as many parts as fill the grid
(slower), the whole MLA attention in one persistent launch (`no-mla_block` against it: 0.62 / 0.83 ms slower at k =
1 / 2), the router GEMV and the routing in one launch (one program routing every row: 0.86 / 1.11 / 2.63 ms slower at
k = 3 / 4 / 8; the MoE block's router phase with a program a row, 2026-12-06: 0.43 / 0.47 / 1.09 / 0.36 ms slower at
k = 3 / 4 / 6 / 8), the router on our split-K GEMV at 3-8 tokens (`router-gemv-m8`: 0.36 / 0.53 / 0.38 ms slower at
k = 3 / 4 / 8), the MoE block's shared-expert down computed while its programs route (`shared-early`: 0.06 / 0.08
ms slower at k = 1 / 2), the MoE block's routing waiting on the router tiles' count with the routing stored once
(`router-wait+store-last` 0.28 / 0.19 ms slower, `store-last` alone 0.04 / 0.13) and the shared expert's down rows
sent to L2 before the PDL wait or after phase 1 (0.08 / 0.03 and 0.02 / 0.03 ms slower), and on the fifth session of
2026-12-06 the closing add + RMSNorm inside the next qkv_a GEMV (`add-fold`: 0.13 / 0.12 ms slower at k = 1 / 2) and
the add + RMSNorm formed in the MoE block's K loops (`block-norm`: 0.60 / 1.14 ms slower; bench/results/HISTORY.md),
and on the sixth the split merge on 2048-element tiles and 2 warps (`merge-2k-w2`: 0.16 ms slower at Kimi-K2 k = 8,
0.01 ms at DeepSeek-V3 b 4 / 16k k = 4); on the seventh the MLA split count bound so that a split reads at least the
KV bytes of the fp32 partials it writes (Kimi-K2 k = 6 / 8 at 32 splits, not 64; `no-split-cover` against it:
within 0.04 ms either way at k = 8, 0.04 ms slower at k = 6 on one 64-row tile). 33-63 rows as two 32-row tiles
(first measured as `mla-48-m32`) became the rule on the eighth session; `mla-m64` measures against it. On the H100
(2026-12-07, bench/results/HISTORY.md): every kernel letting its successor launch after its own PDL wait, not
before (`pdl-late`; the GEMVs or the routing alone, `pdl-late-gemv` / `-route`), also with the router on our GEMV
up to 8 tokens, and that on 16-row tiles with its split reduce in one load (`router-gemv-m8-late`, `-late-3d`): no
faster in the pass.

Usage: ``python bench/ab_verify_pass.py [--model kimi-k2] [--batch 1] [--context 4096] [--tree chain]
[--draft-tokens 1,2,4,8] [--iters 10] [--page-size 64] [--variants ...] [--experts-quant int4|fp8] [--kernels]
[--json PATH]``.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys

from specverify import verify_wall as vw
from specverify.gemv import gemv_config

FUSIONS = ("mla_prep_absorb", "route_shared", "moe_block")
VARIANTS = {"chain": dict(off=FUSIONS), "fused": dict(off=()), "fma": dict(off=(), stream={"splitk_max_m": 0})}
VARIANTS.update({f"no-{slot}": dict(off=(slot,)) for slot in FUSIONS})
VARIANTS.update({f"splitk-m{m}": dict(off=(), stream={"splitk_max_m": m}) for m in (4, 6)})
VARIANTS.update({f"block-m{m}": dict(off=(), set={"moe_block_max_m": m}) for m in (3, 4)})
#: quantised experts (``--experts-quant``): the stream down kernel on bf16's tile (2 rows a program, 8192 elements)
VARIANTS["qdown-bh2"] = dict(off=(), stream={"qBH": 2, "qTILE": 8192})
#: quantised experts: the stream gate/up without the next tile's loads issued before this tile's arithmetic
VARIANTS["no-qprefetch"] = dict(off=(), stream={"QPF": 0})
#: the stream gate/up's plain loop for fp8 too (``LS`` 0; fp8 pipelines its loop 4 stages from 4 tokens)
VARIANTS["ls0"] = dict(off=(), stream={"LS": 0})
#: int4 experts in the checkpoints' rows instead of row quads (the stream gate/up of rows, ``--experts-quant int4``)
VARIANTS["i4-rows"] = dict(off=(), attrs=(("specverify.forward.model", "INT4_LAYOUT", "rows"),))
#: int4 quads: the q4 down kernel's top-k sums as one reduction (``q4d_one_sum``; token by token by default)
VARIANTS["q4-one-sum"] = dict(off=(), stream={"q4d_one_sum": 1})
#: quantised layers' bf16 shared expert inside the q4 stream launches (``ops.experts_plus_shared``)
VARIANTS["shared-in-experts"] = dict(off=(), attrs=(("specverify.forward.model", "SHARED_IN_EXPERTS", True),))
VARIANTS["shared-in-experts-one-sum"] = dict(off=(), stream={"q4d_one_sum": 1},
                                             attrs=(("specverify.forward.model", "SHARED_IN_EXPERTS", True),))
#: the stream experts up to 8 / 16 tokens (``max_m``; the dot path above 6 tokens today)
VARIANTS.update({f"stream-m{m}": dict(off=(), stream={"max_m": m}) for m in (8, 16)})
#: module attributes read at each launch: (module, attribute, value)
#: o_proj's rule (``specverify.gemv.LINEAR_RULES``, N 7168, K 1024 / 2048): the ``cublas-o`` and ``rr-o-*`` variants
_O_PROJ = (8, (7168, 7168), (1024, 2048))
VARIANTS["cublas-o"] = dict(off=(), linear_drop=(_O_PROJ,))
#: the router (7168 -> 384 / 256) on our split-K GEMV up to 8 tokens (cuBLAS's split-K and its reduce above one)
VARIANTS["router-gemv-m8"] = dict(off=(), linear=((8, (1, 512), (7168, 7168)),))
VARIANTS["router-gemv-m8-w1"] = dict(off=(), linear=((8, (1, 512), (7168, 7168)),), gemv=(
    ((8, (1, 512), (7168, 7168)), {**gemv_config(8, 384, 7168), "WAVES": 1}),))
VARIANTS["no-q-fold"] = dict(off=(), attrs=(("specverify.forward.model", "FOLD_Q_NORM", False),))
VARIANTS["fold-m8"] = dict(off=(), attrs=(("specverify.forward.model", "FOLD_Q_NORM_MAX_M", 8),))
VARIANTS["no-early-kv"] = dict(off=(), attrs=(("specverify.kernels.tree_attention_wgmma", "EARLY_KV", False),))
#: the Gluon MLA kernel's programs of 33-64 rows as one 64-row tile again (``MLA_WGMMA_64_ROW_TILE``, read at plan
#: time)
VARIANTS["mla-m64"] = dict(off=(), attrs=(("specverify.attention", "MLA_WGMMA_64_ROW_TILE", 64),))
#: GEMV launch rules tried in the pass ahead of ``specverify.gemv.SHAPE_CONFIGS``: the shape's own config (read
#: from ``gemv_config`` at the rule's largest M and smallest N, K) with the grid at ``WAVES`` programs an SM.
_GEMV_RULES = {"router": (1, (384, 384), (7168, 7168)), "qkv": (4, (2048, 4096), (7168, 7168)),
               "qb": (1, (1536, 1536), (1536, 1536))}
VARIANTS.update({f"w{w}-{name}": dict(off=(), gemv=((rule, {**gemv_config(rule[0], rule[1][0], rule[2][0]),
                                                             "WAVES": w}),))
                 for name, rule in _GEMV_RULES.items() for w in (1, 4)})
#: row-range GEMVs (``ROW_RANGE``: one range of weight rows a program over all K, no reduce), named
#: ``rr-<proj>-k<BLOCK_K>-s<stages>[-w<warps>][-x<waves>][-p<prefetch bytes>]`` and built on demand
#: (:func:`_variant`); ``o`` also adds o_proj's rule to ``LINEAR_RULES`` (already there since 2026-12-06)
_RR_RULES = {"qkv": (8, (2048, 4096), (7168, 7168)), "qb": (4, (1536, 1536), (1536, 1536)),
             "o": _O_PROJ}


def _variant(name: str) -> dict | None:
    """``VARIANTS[name]``, or the row-range variant that ``name`` spells (see ``_RR_RULES``), or None."""
    if name in VARIANTS:
        return VARIANTS[name]
    parts = name.split("-")
    if parts[0] == "mb":  # mb-n<BN>-k<BK>-c<SK>.<SD>.<W>: the MoE block's tiles and its one launch candidate
        try:
            bn, bk, cand = int(parts[1].removeprefix("n")), int(parts[2].removeprefix("k")), tuple(
                int(v) for v in parts[3].removeprefix("c").split("."))
        except (IndexError, ValueError):
            return None
        if len(parts) != 4 or len(cand) != 3:
            return None
        mod = "specverify.moe_layer"
        return dict(off=(), attrs=((mod, "_BN", bn), (mod, "_BK", bk), (mod, "_TILES", {}),
                                   (mod, "_CANDIDATES", (cand,))))
    if len(parts) < 4 or parts[0] != "rr" or parts[1] not in _RR_RULES:
        return None
    rule = _RR_RULES[parts[1]]
    over = {"ROW_RANGE": True, "WAVES": 1}
    keys = {"k": "BLOCK_K", "s": "num_stages", "w": "num_warps", "x": "WAVES", "p": "PREFETCH_BYTES"}
    for p in parts[2:]:
        if p[:1] not in keys or not p[1:].isdigit():
            return None
        over[keys[p[0]]] = int(p[1:])
    var = dict(off=(), gemv=((rule, {**gemv_config(rule[0], rule[1][0], rule[2][0]), **over}),))
    if parts[1] == "o":
        var["linear"] = (rule,)
    return var


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="kimi-k2")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--tree", default="chain")
    ap.add_argument("--draft-tokens", type=vw._parse_ints, default=[1, 2, 4, 8])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--distinct-layers", type=int, default=4)
    ap.add_argument("--variants", default="chain,fused")
    ap.add_argument("--experts-quant", choices=("int4", "fp8"), default=None,
                    help="the routed experts stored quantised (verify-wall --experts-quant)")
    ap.add_argument("--kernels", action="store_true", help="kernel profile of the last variant's second run")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    quant_only = {"qdown-bh2": ("int4", "fp8"), "no-qprefetch": ("int4",), "i4-rows": ("int4",)}
    idle = [v for v in names if v in quant_only and args.experts_quant not in quant_only[v]]
    if idle:
        print(f"ab_verify_pass: {idle} change nothing without --experts-quant "
              f"{' / '.join(sorted({f for v in idle for f in quant_only[v]}))}", file=sys.stderr)
        return 2
    unknown = [v for v in names if _variant(v) is None]
    if unknown:
        print(f"ab_verify_pass: unknown variants {unknown}; expected some of {list(VARIANTS)}", file=sys.stderr)
        return 2
    orig_ops = vw._wall_ops
    current = {}

    def ops_of_variant(provider, model, max_position):
        ops, note = orig_ops(provider, model, max_position)
        for slot in current["off"]:
            setattr(ops, slot, None)
        for slot, value in current["set"].items():
            setattr(ops, slot, value)
        return ops, note

    vw._wall_ops = ops_of_variant
    import specverify.attention as attention
    import specverify.gemv as gemv
    import specverify.moe as moe
    saved_attrs = {(mod, attr): getattr(importlib.import_module(mod), attr) for name in names
                   for mod, attr, _ in _variant(name).get("attrs", ())}
    saved_stream = dict(moe._STREAM_OVERRIDE)
    saved_rules = gemv.SHAPE_CONFIGS
    saved_linear = gemv.LINEAR_RULES
    results = []
    order = names + names[::-1]
    for i, name in enumerate(order):
        var = _variant(name)
        current["off"], current["set"] = var["off"], var.get("set", {})
        moe._STREAM_OVERRIDE.clear()
        moe._STREAM_OVERRIDE.update(saved_stream, **var.get("stream", {}))
        gemv.SHAPE_CONFIGS = tuple(var.get("gemv", ())) + saved_rules
        gemv.LINEAR_RULES = tuple(var.get("linear", ())) + tuple(r for r in saved_linear
                                                                if r not in var.get("linear_drop", ()))
        want = {(mod, attr): v for mod, attr, v in var.get("attrs", ())}
        for (mod, attr), v in saved_attrs.items():
            setattr(importlib.import_module(mod), attr, want.get((mod, attr), v))
        attention._cached_plan.cache_clear()  # plans read module attributes when made
        last = i == len(order) - 1
        s = vw.WallSettings(model=args.model, batch=args.batch, context=args.context, tree=args.tree,
                            draft_tokens=args.draft_tokens, distinct_layers=args.distinct_layers,
                            impl=["specverify"], iters=args.iters, page_size=args.page_size,
                            experts_quant=args.experts_quant, kernels=args.kernels and last,
                            breakdown=args.kernels and last)
        res = vw.run_verify_wall(s)
        results.append({"variant": name, "pass": 1 if i < len(names) else 2, **res})
        # the distinct routed experts a layer (d): a variant that rounds the logits differently may read others
        cells = " ".join(f"k{r['k']}={r['verify_ms_median']:.3f}({r['efficiency']:.0%},{r['graph_nodes']},"
                         f"d={r.get('distinct_experts_routed') or 0:.1f})" for r in res["rows"] if r.get("iters"))
        print(f"{name:>12} pass {results[-1]['pass']}: {cells}", flush=True)
    vw._wall_ops = orig_ops
    moe._STREAM_OVERRIDE.clear()
    moe._STREAM_OVERRIDE.update(saved_stream)
    gemv.SHAPE_CONFIGS = saved_rules
    gemv.LINEAR_RULES = saved_linear
    for (mod, attr), v in saved_attrs.items():
        setattr(importlib.import_module(mod), attr, v)
    attention._cached_plan.cache_clear()
    print("\nms (efficiency vs the bytes floor), mean of the two passes:")
    ks = args.draft_tokens
    print(f"{'variant':>12} " + " ".join(f"{'k=' + str(k):>16}" for k in ks))
    for name in names:
        cells = []
        for k in ks:
            v = [r for res in results if res["variant"] == name for r in res["rows"] if r["k"] == k and r.get("iters")]
            if v:
                ms = sum(r["verify_ms_median"] for r in v) / len(v)
                cells.append(f"{ms:8.3f} ({v[0]['floor_ms'] / ms:4.0%})")
            else:
                cells.append(f"{'-':>16}")
        print(f"{name:>12} " + " ".join(f"{c:>16}" for c in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(vw._json_safe({"args": vars(args), "results": results}), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
