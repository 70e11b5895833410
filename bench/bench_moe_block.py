"""Benchmark: a verify layer's MoE block at a few tokens, one persistent launch (``specverify.moe_block``) against the
four launches the pass otherwise runs (router GEMV by ``specverify.gemv.linear``, routing with the shared slot,
stream experts), at Kimi-K2 / DeepSeek-V3 rank shapes (tp 8), each timed by CUDA-graph replay over ``--sets``
weight sets in turn (so weights come from HBM, not L2), with the bytes floor (router + the distinct experts read,
shared included, over a copy bandwidth of the same run) (issue 22).

``--configs`` times the block at each launch config given (``BNxBK:SK.SD.W``: gate / up rows of a tile, K chunk,
K-loop and down-loop pipeline depths, warps; ``specverify.moe_layer._BN`` / ``_BK`` / ``_CANDIDATES``, at every
token count: ``_TILES`` emptied) after
today's, each checked against today's output (same routing; outputs within a few bf16 rounding steps).

``--timeline`` also replays the block's graph with the kernel's phase stamps on (a build of its own: ``TIMING``)
and gives, for the last launch of each replay, when the programs reached each point (µs from the first program's
start; median and last program over the grid, each the median over ``--replays``): after the PDL wait, phase 1
(router + shared gate/up), barrier 1, the routing, phase 2 (routed gate/up), the down prefetch, barrier 2, phase 3
(down).

Usage: ``python bench/bench_moe_block.py [--models kimi-k2,deepseek-v3] [--tokens 1,2,4,8] [--sets 4]
[--configs 16x256:6.3.4,...] [--timeline] [--replays 50] [--json PATH]``.
"""
from __future__ import annotations

import argparse
import sys

import torch

from specverify.benchmarking import copy_bandwidth_gbps, graph_us, write_rows_json

_RANK = {"kimi-k2": dict(h=7168, inter=256, e=384, top_k=8, n_group=1, topk_group=1, scale=2.827),
         "deepseek-v3": dict(h=7168, inter=256, e=256, top_k=8, n_group=8, topk_group=4, scale=2.5)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="kimi-k2,deepseek-v3")
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--sets", type=int, default=4, help="weight sets cycled through (HBM, not L2)")
    ap.add_argument("--timeline", action="store_true", help="also the phase timeline of the block")
    ap.add_argument("--replays", type=int, default=50, help="graph replays the timeline is the median of")
    ap.add_argument("--configs", default="", help="launch configs BNxBK:SK.SD.W to time after today's")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    try:
        configs = [_parse_config(c) for c in args.configs.split(",") if c]
    except ValueError as exc:
        ap.error(str(exc))
    if not torch.cuda.is_available():
        print("bench_moe_block: needs a CUDA device", file=sys.stderr)
        return 2
    from specverify.gemv import linear
    from specverify.moe import fused_moe, moe_route
    from specverify.moe_layer import moe_block

    dev = torch.device("cuda")
    bw = copy_bandwidth_gbps()
    rows = []
    for model in args.models.split(","):
        c = _RANK[model]
        h, inter, e, top_k = c["h"], c["inter"], c["e"], c["top_k"]
        g = torch.Generator(device=dev).manual_seed(0)
        sets = []
        for _ in range(args.sets):
            sets.append(dict(router=torch.randn(e, h, device=dev, generator=g).mul_(h ** -0.5).bfloat16(),
                             w13=torch.randn(e + 1, 2 * inter, h, device=dev, generator=g).mul_(h ** -0.5).bfloat16(),
                             w2=torch.randn(e + 1, h, inter, device=dev, generator=g).mul_(inter ** -0.5).bfloat16(),
                             bias=torch.randn(e, device=dev, generator=g) * 0.05))
        rk = dict(top_k=top_k, scoring="sigmoid", n_group=c["n_group"], topk_group=c["topk_group"],
                  renormalize=True, routed_scaling_factor=c["scale"])
        for m in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(m, h, device=dev).bfloat16()

            def block():
                for s in sets:
                    moe_block(x, s["router"], s["w13"], s["w2"], correction_bias=s["bias"], **rk)

            def composed():
                for s in sets:
                    logits = linear(x, s["router"])
                    ids, w = moe_route(logits, correction_bias=s["bias"], shared_expert_id=e, impl="triton", **rk)
                    fused_moe(x, s["w13"], s["w2"], ids, w, impl="triton")

            res = moe_block(x, sets[0]["router"], sets[0]["w13"], sets[0]["w2"], correction_bias=sets[0]["bias"], **rk)
            experts = len(set(res.topk_ids.flatten().tolist()))  # distinct experts read, shared included
            nbytes = 2 * (e * h + experts * 3 * inter * h)
            floor = nbytes / (bw * 1e3)
            row = {"model": model, "m": m, "distinct_experts": experts, "bytes": nbytes, "floor_us": floor}
            for name, fn in (("block", block), ("composed", composed)):
                row[f"{name}_us"] = graph_us(fn, calls=2, replays=10, repeats=5, stat="median") / len(sets)
            if configs:
                row["configs"] = _sweep(configs, block, lambda: moe_block(
                    x, sets[0]["router"], sets[0]["w13"], sets[0]["w2"], correction_bias=sets[0]["bias"], **rk),
                    res, len(sets), args.timeline, args.replays)
            if args.timeline:
                row["timeline"] = _timeline(block, args.replays)
            rows.append(row)
            print(f"{model:>12} M={m}: block {row['block_us']:6.1f} us, four launches {row['composed_us']:6.1f} us, "
                  f"floor {floor:5.1f} us ({experts} experts): {floor / row['block_us']:4.0%} / "
                  f"{floor / row['composed_us']:4.0%} of it", flush=True)
            if args.timeline:
                print("    " + ", ".join(f"{k} {v[0]:.2f} / {v[1]:.2f}" for k, v in row["timeline"].items()),
                      flush=True)
            for c in row.get("configs", ()):
                if "error" in c:
                    continue
                line = (f"    {c['config']:>16}: block {c['block_us']:6.1f} us ({floor / c['block_us']:4.0%}), "
                        f"max |diff| {c['max_abs_diff']:.3g} (tol {c['tol']:.3g})")
                if "timeline" in c:
                    line += "; " + ", ".join(f"{k} {v[1]:.1f}" for k, v in c["timeline"].items())
                print(line, flush=True)
    if args.json:
        write_rows_json(args.json, __file__, rows, copy_bw_gbps=bw, args=vars(args))
    return 0


def _parse_config(text: str) -> tuple[int, int, tuple[int, int, int]]:
    """``BNxBK:SK.SD.W`` -> (BN, BK, (SK, SD, W))."""
    try:
        tiles, cand = text.split(":")
        bn, bk = (int(v) for v in tiles.split("x"))
        sk, sd, w = (int(v) for v in cand.split("."))
    except ValueError:
        raise ValueError(f"--configs: expected BNxBK:SK.SD.W (e.g. 16x256:6.3.4), got {text!r}") from None
    return bn, bk, (sk, sd, w)


def _sweep(configs, block, once, res, n_sets: int, timeline: bool, replays: int) -> list[dict]:
    """Each config's block time (and timeline), checked against today's result ``res``: the same routing, and
    outputs within 4 bf16 rounding steps of today's largest (summation order and the rounded act differ); a config
    that fails the check, or whose launch is not resident, is recorded with its reason and not timed."""
    from specverify import moe_layer

    saved = (moe_layer._BN, moe_layer._BK, moe_layer._TILES, moe_layer._CANDIDATES)
    out = []
    try:
        for bn, bk, cand in configs:
            moe_layer._BN, moe_layer._BK, moe_layer._TILES, moe_layer._CANDIDATES = bn, bk, {}, (cand,)
            name = f"{bn}x{bk}:{'.'.join(map(str, cand))}"
            try:
                got = once()
            except RuntimeError as exc:  # no launch of this config is resident (shared memory, registers)
                print(f"    {name}: {exc}", flush=True)
                out.append({"config": name, "error": str(exc)})
                continue
            diff = float((got.out.float() - res.out.float()).abs().max())
            tol = 4 * 2.0 ** -8 * float(res.out.float().abs().max())
            # another K split may flip a near-tie of the routing (then the outputs differ by design): not timed
            why = ("routing differs from today's" if not torch.equal(got.topk_ids, res.topk_ids)
                   else f"max |diff| {diff} above {tol}" if not diff <= tol else None)
            if why:
                print(f"    {name}: {why}; not timed", flush=True)
                out.append({"config": name, "error": why})
                continue
            c = {"config": name, "max_abs_diff": diff, "tol": tol,
                 "block_us": graph_us(block, calls=2, replays=10, repeats=5, stat="median") / n_sets}
            if timeline:
                c["timeline"] = _timeline(block, replays)
            out.append(c)
    finally:
        moe_layer._BN, moe_layer._BK, moe_layer._TILES, moe_layer._CANDIDATES = saved
    return out


_POINTS = ("wait", "phase1", "barrier1", "routing", "phase2", "prefetch", "barrier2", "phase3")


def _timeline(block, replays: int) -> dict:
    """{point: (median over programs, last program)} in µs from the first program's start, medians over replays of
    a graph of ``block`` (stamps of its last launch)."""
    from specverify import moe_layer

    dev = torch.device("cuda")
    buf = torch.zeros(16 * 4 * torch.cuda.get_device_properties(dev).multi_processor_count, dtype=torch.int64,
                      device=dev)
    moe_layer._TIMELINE = buf
    try:
        block()  # compiles the stamped kernel outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            block()
        per = []
        for _ in range(replays + 3):
            buf.zero_()
            graph.replay()
            torch.cuda.synchronize()
            ts = buf.view(-1, 16)[:, :9].double()
            ts = ts[ts[:, 0] > 0]  # the launch's programs
            rel = (ts - ts[:, 0].min()) / 1e3
            per.append(torch.stack([rel[:, 1:].median(dim=0).values, rel[:, 1:].max(dim=0).values]))
    finally:
        moe_layer._TIMELINE = None
    med = torch.stack(per[3:]).median(dim=0).values
    return {name: (float(med[0, i]), float(med[1, i])) for i, name in enumerate(_POINTS)}


if __name__ == "__main__":
    sys.exit(main())
