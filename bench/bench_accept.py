"""Benchmark: tree acceptance (greedy, and sampling with top-p 0.9) against a sort-based torch pipeline.

Providers: ``reference`` (torch: argmax / softmax + full sort + cumsum top-p + a vectorised tree walk and an
inverse-CDF bonus), ``triton`` (``specverify.verify_greedy`` / ``verify_sampling``: two launches), ``sglang``
(through ``bench/sglang_peer.py`` when that module, SGLang and a ``tree_sampling`` / ``tree_greedy`` entry exist).
Shapes: batch 1, 8, 64; k = 1, 4, 8 (top-2 trees); vocab 32000, 128256, 163840. Logits are bf16
``randn * 4`` (peaked like an LLM's: top-p 0.9 keeps a few hundred tokens of 163840).

Metrics: µs per call by ``triton.testing.do_bench`` (median, L2 flushed) and by CUDA-graph replay (20 calls per
graph). ``speedup = reference_us / triton_us`` (same run, same inputs). Correctness is checked before timing
(greedy: exact; sampling: identical outputs on the same uniforms, reported as ``match``).

Usage: ``python bench/bench_accept.py [--quick] [--json PATH]``.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from specverify.benchmarking import run_meta, load_sglang_peer, bench_us, graph_us


def _peer():
    return load_sglang_peer(__file__)


def torch_walk(probs, parents, draft, u, length):
    """Vectorised sampling walk + inverse-CDF bonus in torch (the reference pipeline's second half)."""
    batch, k, vocab = probs.shape
    rows = torch.arange(batch, device=probs.device)
    idx = torch.arange(k, device=probs.device).expand(batch, k)
    cur = torch.zeros(batch, dtype=torch.long, device=probs.device)
    alive = torch.ones(batch, dtype=torch.bool, device=probs.device)
    nodes = torch.full((batch, length), -1, dtype=torch.long, device=probs.device)
    nodes[:, 0] = 0
    lens = torch.zeros(batch, dtype=torch.long, device=probs.device)
    for d in range(1, length):
        child = (parents == cur[:, None]) & alive[:, None]
        q = torch.where(child, probs[rows[:, None], cur[:, None], draft], 0.0)
        hit = child & (u[:, d - 1:d] < q.cumsum(1))
        first = torch.where(hit, idx, k).min(1).values
        found = first < k
        cur = torch.where(found, first, cur)
        nodes[:, d] = torch.where(found, first, -1)
        lens += found.long()
        alive &= found
    res = probs[rows, cur].clone()
    child = parents == cur[:, None]
    res.scatter_(1, torch.where(child, draft, 0), torch.where(child, 0.0, res.gather(1, torch.where(child, draft, 0))))
    cdf = res.cumsum(1)
    bonus = torch.searchsorted(cdf, (u[:, length - 1] * cdf[:, -1])[:, None], right=True).clamp(max=vocab - 1)
    return nodes, lens, bonus


def torch_sampling(logits, parents, draft, u, length, temperature, top_p):
    p = torch.softmax(logits.float() / temperature, dim=-1)
    s, order = torch.sort(p, dim=-1, descending=True)
    c = s.cumsum(-1)
    s = torch.where(c - s < top_p, s, 0.0)
    probs = torch.zeros_like(p).scatter_(-1, order, s)
    probs /= probs.sum(-1, keepdim=True)
    return torch_walk(probs, parents, draft, u, length)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repeats (< 90 s on an H200)")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_accept needs a CUDA GPU")
        return 1

    from specverify.accept import verify_greedy, verify_sampling
    from specverify.reference.accept import greedy_accept_reference
    from specverify.tree import BatchedDraftTree, DraftTree

    peer, why = _peer()
    batches = (1, 8, 64)
    ks = (4, 8) if args.quick else (1, 4, 8)
    vocabs = (32000, 163840) if args.quick else (32000, 128256, 163840)
    top_p, temperature = 0.9, 1.0
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for vocab in vocabs:
        for k in ks:
            tree = DraftTree.topk_of_size(2, k)
            for batch in batches:
                trees = BatchedDraftTree.repeat(tree, batch)
                parents = trees.parents.cuda()
                length = trees.max_depth + 1
                logits = (torch.randn(batch, k, vocab, device="cuda", generator=g) * 4).to(torch.bfloat16)
                tgt = logits.float().argmax(-1)
                draft = torch.where(torch.rand(batch, k, device="cuda", generator=g) < 0.7,
                                    tgt.gather(1, parents.clamp(min=0)),
                                    torch.randint(0, vocab, (batch, k), device="cuda", generator=g))
                u = torch.rand(batch, length, device="cuda", generator=g)
                outs = (torch.empty(batch, length, dtype=torch.int64, device="cuda"),
                        torch.empty(batch, dtype=torch.int64, device="cuda"),
                        torch.empty(batch, length, dtype=torch.int64, device="cuda"))
                # correctness before timing
                ref_g = greedy_accept_reference(tgt, draft, parents, trees.max_depth)
                got_g = verify_greedy(draft, trees, logits=logits, out=outs)
                ok_g = torch.equal(got_g[2], ref_g[0]) and torch.equal(got_g[1], ref_g[1])
                got_s = verify_sampling(logits, trees, draft, uniform_samples=u, top_p=top_p,
                                        temperature=temperature, out=outs)
                ref_s = torch_sampling(logits, parents, draft, u, length, temperature, top_p)
                match_s = float((got_s[2] == ref_s[0]).all(1).float().mean())
                cases = {
                    ("greedy", "reference"): lambda: greedy_accept_reference(logits.argmax(-1), draft, parents,
                                                                             trees.max_depth),
                    ("greedy", "triton"): lambda: verify_greedy(draft, trees, logits=logits, out=outs),
                    ("sampling", "reference"): lambda: torch_sampling(logits, parents, draft, u, length,
                                                                      temperature, top_p),
                    ("sampling", "triton"): lambda: verify_sampling(logits, trees, draft, uniform_samples=u,
                                                                    top_p=top_p, temperature=temperature, out=outs),
                }
                if peer is not None:
                    for op, name in (("greedy", "tree_greedy"), ("sampling", "tree_sampling")):
                        fn = getattr(peer, name, None)
                        if fn is not None:
                            cases[(op, "sglang")] = (lambda fn=fn, op=op: fn(logits, trees, draft, u, top_p=top_p,
                                                                            temperature=temperature))
                base = dict(vocab=vocab, k=k, batch=batch)
                for (op, provider), fn in cases.items():
                    try:
                        us = bench_us(fn, args.quick)
                        gus = graph_us(fn)
                    except Exception as exc:  # a provider that fails is reported, the run goes on
                        print(f"# {op}/{provider} at {base} failed: {exc}", file=sys.stderr)
                        us = gus = float("nan")
                    rows.append(dict(base, op=op, provider=provider, us=us, graph_us=gus,
                                     correct=(ok_g if op == "greedy" else match_s) if provider == "triton" else None))
    for r in rows:
        if r["provider"] == "triton":
            ref = next(x for x in rows if x["provider"] == "reference" and x["op"] == r["op"] and x["vocab"] == r["vocab"]
                       and x["k"] == r["k"] and x["batch"] == r["batch"])
            r["speedup"] = ref["us"] / r["us"] if r["us"] == r["us"] and r["us"] > 0 else float("nan")
    meta = run_meta(__file__, sglang=("yes" if peer is not None else f"no: {why}"), logits="bf16 randn*4", top_p=top_p)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"# {meta}")
    print(f"{'vocab':>7} {'k':>2} {'batch':>5} {'op':<9} {'provider':<10} {'us':>9} {'graph_us':>9} {'speedup':>8} "
          f"{'correct':>8}")
    for r in rows:
        sp = r.get("speedup")
        print(f"{r['vocab']:>7} {r['k']:>2} {r['batch']:>5} {r['op']:<9} {r['provider']:<10} {r['us']:>9.2f} "
              f"{r['graph_us']:>9.2f} {'' if sp is None else f'{sp:8.2f}':>8} "
              f"{'' if r['correct'] is None else str(r['correct']):>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
