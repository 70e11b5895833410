"""Benchmark: a verify layer's MLA attention at a few tokens, one persistent launch (``specverify.mla_block``)
against the op chain the pass otherwise runs (qkv_a and q_b on ``gemv.linear``, q_a's RMSNorm, the fused KV
preparation + absorption, tree attention with its split merge, W_UV, o_proj), at Kimi-K2 / DeepSeek-V3 rank shapes
(tp 8), batch 1, a chain of k draft tokens over ``--context`` tokens; each timed by CUDA-graph replay over
``--sets`` weight sets and KV caches in turn (so bytes come from HBM, not L2), with the bytes floor (weights + the
KV read, over a copy bandwidth of the same run) (issue 22).

``--tune`` takes JSON objects (``;``-separated) of launch overrides (``specverify.mla_layer._TUNE``: NPROG,
STAGES, num_warps, PF_O, PREFETCH, ATT_BN), each timed as one more row; ``--phases`` also times each phase alone
(six launches without barriers).

Usage: ``python bench/bench_mla_block.py [--models kimi-k2,deepseek-v3] [--tokens 1,2] [--context 4096]
[--sets 4] [--tune '{"PF_O": 0};{"NPROG": 264}'] [--phases] [--json PATH]``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import types

import torch

from specverify.benchmarking import copy_bandwidth_gbps, graph_us, write_rows_json


def _layer(cfg, shapes, dev, g):
    def rnd(*shape, fan_in):
        return torch.randn(*shape, device=dev, generator=g).mul_(fan_in ** -0.5).bfloat16()

    h, nh = cfg.hidden_size, shapes.num_heads
    q, r, dr, nope, v = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    w = {"qkv_a": rnd(q + r + dr, h, fan_in=h), "q_a_norm": torch.ones(q, device=dev).bfloat16(),
         "q_b": rnd(nh, nope + dr, q, fan_in=q), "kv_a_norm": torch.ones(r, device=dev).bfloat16(),
         "w_uk": rnd(nh, nope, r, fan_in=nope), "w_uv": rnd(nh, r, v, fan_in=r), "o": rnd(h, nh * v, fan_in=nh * v)}
    w["q_a"], w["kv_a"] = w["qkv_a"][:q], w["qkv_a"][q:]
    return w


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="kimi-k2,deepseek-v3")
    ap.add_argument("--tokens", default="1,2")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--sets", type=int, default=4, help="weight sets and caches cycled through (HBM, not L2)")
    ap.add_argument("--tune", default="", help="';'-separated JSON launch overrides, one row each")
    ap.add_argument("--phases", action="store_true", help="also time each phase alone")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_mla_block: needs a CUDA device", file=sys.stderr)
        return 2
    from specverify import mla_layer
    from specverify.configs import get_config, per_rank_shapes
    from specverify.forward.model import VerifyModel
    from specverify.forward.ops import specverify_ops

    dev = torch.device("cuda")
    bw = copy_bandwidth_gbps()
    tunes = [json.loads(t) for t in args.tune.split(";") if t.strip()]
    rows = []
    for model in args.models.split(","):
        cfg = get_config(model)
        shapes = per_rank_shapes(cfg, 8)
        g = torch.Generator(device=dev).manual_seed(0)
        sets = [_layer(cfg, shapes, dev, g) for _ in range(args.sets)]
        wbytes = sum(t.numel() * 2 for n, t in sets[0].items() if n in ("qkv_a", "q_b", "w_uk", "w_uv", "o"))
        chain_ops, _ = specverify_ops(None)
        chain_ops.mla_block = None
        fused_ops, _ = specverify_ops(None)
        for k in (int(t) for t in args.tokens.split(",")):
            pages = -(-(args.context + k) // args.page_size)
            caches = [torch.randn(pages + 1, args.page_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, device=dev
                                  ).bfloat16() for _ in sets]
            pt = torch.randperm(pages, device=dev).to(torch.int32).view(1, pages)
            prefix = torch.full((1,), args.context, dtype=torch.int32, device=dev)
            pos = prefix.long()[:, None] + torch.arange(k, device=dev)[None, :]
            x = torch.randn(1, k, cfg.hidden_size, device=dev).bfloat16()
            nbytes = wbytes + (args.context + k) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
            floor = nbytes / (bw * 1e3)

            def run(ops):
                me = types.SimpleNamespace(shapes=shapes, config=cfg, ops=ops)

                def step():
                    for w, c in zip(sets, caches):
                        VerifyModel._mla(me, w, x, pos, [c], pt, prefix, None)
                return step

            variants = [("chain", run(chain_ops), None), ("block", run(fused_ops), {})]
            variants += [(json.dumps(t, sort_keys=True), run(fused_ops), t) for t in tunes]
            if args.phases:
                variants += [(f"phase {p}", run(fused_ops), {"PHASES": [p]}) for p in range(1, 7)]
            for name, step, tune in variants:
                mla_layer._TUNE.clear()
                mla_layer._TUNE.update(tune or {})
                try:
                    us = graph_us(step, calls=2, replays=10, repeats=5, stat="median") / len(sets)
                except Exception as exc:  # noqa: BLE001 - a sweep point that does not compile is reported, not fatal
                    print(f"{model:>12} k={k} {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                finally:
                    mla_layer._TUNE.clear()
                rows.append({"model": model, "k": k, "variant": name, "us": us, "bytes": nbytes, "floor_us": floor})
                print(f"{model:>12} k={k} {name:>40}: {us:6.1f} us  floor {floor:5.1f} us ({floor / us:4.0%})",
                      flush=True)
    chosen = {str(key): val for key, val in mla_layer._CHOSEN.items()}
    if args.json:
        write_rows_json(args.json, __file__, rows, copy_bw_gbps=bw, args=vars(args), chosen=chosen)
    print("chosen launch configs:", chosen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
