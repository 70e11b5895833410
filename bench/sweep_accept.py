"""Sweep: the sampling-kernel sizes of ``verify_sampling`` (and greedy), whole call and each launch alone.

Variants (overrides of ``specverify.accept._SELECT_CONFIG``): ``select`` (the defaults) and several sizes
(vocabulary chunk / warps of launch 1, candidate slots per row, warps of launch 2, floor probes). Shapes: vocab
32000 and 163840, batch 1 / 8 / 64, k = 4 and 8 (chain trees), bf16 ``randn * 4`` logits, temperature 1,
top-p 0.9 (issue 8's target: vocab 163840, batch 1, k 4, <= 20 us).

Metrics: µs per call by CUDA-graph replay (``specverify.benchmarking.graph_us``, 20 calls per graph) for the whole
call and for launch 1 and launch 2 alone (launch 2 replayed on launch 1's last candidates). ``match``: the
variant's outputs equal the torch reference's (``impl="reference"``, the same uniforms), checked before timing.

Usage: ``python bench/sweep_accept.py [--quick] [--json PATH] [--budget-s S]`` (about 4 min on an H200 with the
default budget, most of it compiling; ``--quick``: the target shapes only, about 1.5 min).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from specverify.benchmarking import run_meta, graph_us

# name -> _SELECT_CONFIG overrides
VARIANTS = {
    "select": {},
    "select-c2048w2": dict(chunk=2048, chunk_warps=2),
    "select-c1024w1": dict(chunk=1024, chunk_warps=1),
    "select-c4096w4": dict(chunk=4096, chunk_warps=4),
    "select-rw16": dict(row_warps=16),
    "select-slots8k": dict(slots=8192),
    "select-fi8": dict(floor_iters=8),
}
QUICK_VARIANTS = ("select", "select-c2048w2", "select-c1024w1", "select-rw16")
TOP_P, TEMPERATURE = 0.9, 1.0


def run_shape(vocab: int, k: int, batch: int, names, timer, device, g, t_start: float) -> list[dict]:
    """Rows for one shape: greedy, then every sampling variant in ``names`` (whole call, launch 1, launch 2)."""
    import specverify.accept as acc
    from specverify.benchmarking import dict_restorer
    from specverify.tree import BatchedDraftTree, DraftTree

    top_p, temperature = TOP_P, TEMPERATURE
    restore = dict_restorer(acc._SELECT_CONFIG)
    rows = []
    trees = BatchedDraftTree.repeat(DraftTree.chain(k), batch)
    parents = trees.parents.to(device)
    length = trees.max_depth + 1
    logits = (torch.randn(batch, k, vocab, device=device, generator=g) * 4).to(torch.bfloat16)
    tgt = logits.float().argmax(-1)
    # drafts follow the target's argmax often, so paths of several tokens get accepted
    draft = torch.where(torch.rand(batch, k, device=device, generator=g) < 0.7,
                        tgt.gather(1, parents.clamp(min=0)),
                        torch.randint(0, vocab, (batch, k), device=device, generator=g))
    u = torch.rand(batch, length, device=device, generator=g)
    outs = (torch.empty(batch, length, dtype=torch.int64, device=device),
            torch.empty(batch, dtype=torch.int64, device=device),
            torch.empty(batch, length, dtype=torch.int64, device=device))
    base = dict(vocab=vocab, k=k, batch=batch)
    ref_g = acc.verify_greedy(draft, trees, logits=logits, impl="reference")
    got_g = acc.verify_greedy(draft, trees, logits=logits, out=outs)
    ok_g = all(torch.equal(a, b) for a, b in zip(got_g, ref_g))
    rows.append(dict(base, op="greedy", variant="-", match=ok_g,
                     graph_us=timer(lambda: acc.verify_greedy(draft, trees, logits=logits, out=outs)),
                     launch1_us=float("nan"), launch2_us=float("nan")))
    ref_s = acc.verify_sampling(logits, trees, draft, uniform_samples=u, top_p=top_p, temperature=temperature,
                                impl="reference")
    ref_s = tuple(t.clone() for t in ref_s)
    pars = tuple(acc._param(n, v, batch, logits.device, kind) for n, v, kind in
                 (("temperature", temperature, "f"), ("top_k", 0, "i"), ("top_p", top_p, "f"),
                  ("min_p", 0.0, "f")))
    for name in names:
        restore()
        acc._SELECT_CONFIG.update(VARIANTS[name])
        try:
            def call():
                return acc.verify_sampling(logits, trees, draft, uniform_samples=u, top_p=top_p,
                                           temperature=temperature, out=outs)

            got = call()
            match = all(torch.equal(a, b) for a, b in zip(got, ref_s))
            whole = timer(call)
            l1, l2 = acc._sampling_launches(logits, parents, draft, u, *pars, length, outs, None, None)
            t1 = timer(l1)
            l1()
            t2 = timer(l2)
        except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, the sweep goes on
            print(f"# {name} at {base} failed: {exc.__class__.__name__}: {exc}", file=sys.stderr)
            match, whole, t1, t2 = False, float("nan"), float("nan"), float("nan")
        rows.append(dict(base, op="sampling", variant=name, match=match, graph_us=whole, launch1_us=t1,
                         launch2_us=t2))
        print(f"# {base} {name}: {whole:.2f} us (launch 1 {t1:.2f}, launch 2 {t2:.2f}) match={match} "
              f"[{time.time() - t_start:.0f} s]", file=sys.stderr, flush=True)
    restore()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="target shapes (batch 1, k 4) and four variants")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no new shape after this many seconds")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_accept needs a CUDA GPU")
        return 1

    import specverify.accept as acc

    t_start = time.time()
    select_config = dict(acc._SELECT_CONFIG)  # the defaults; run_shape restores them after each shape
    names = QUICK_VARIANTS if args.quick else tuple(VARIANTS)
    shapes = [(v, 4, 1) for v in (163840, 32000)] if args.quick else \
        [(v, k, b) for v in (163840, 32000) for k in (4, 8) for b in (1, 8, 64)]
    top_p, temperature = TOP_P, TEMPERATURE
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, skipped = [], []
    for vocab, k, batch in shapes:
        if time.time() - t_start > args.budget_s:
            skipped.append((vocab, k, batch))
            continue
        rows += run_shape(vocab, k, batch, names, graph_us, "cuda", g, t_start)
    meta = run_meta(__file__, logits="bf16 randn*4", tree="chain", top_p=top_p, temperature=temperature,
                select_config=select_config, variants={n: VARIANTS[n] for n in names},
                skipped_for_budget=skipped, wall_s=round(time.time() - t_start, 1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"# {meta}")
    print(f"{'vocab':>7} {'k':>2} {'batch':>5} {'op':<9} {'variant':<16} {'graph_us':>9} {'launch1':>8} "
          f"{'launch2':>8} {'match':>6}")
    for r in rows:
        print(f"{r['vocab']:>7} {r['k']:>2} {r['batch']:>5} {r['op']:<9} {r['variant']:<16} {r['graph_us']:>9.2f} "
              f"{r['launch1_us']:>8.2f} {r['launch2_us']:>8.2f} {r['match']!s:>6}")
    return 0 if all(r["match"] for r in rows) else 2


if __name__ == "__main__":
    sys.exit(main())
