"""Probe: the routed experts a verify pass of the dummy model reads, against the uniform-routing count the bytes
floor of ``verify-wall`` assumes (issue 22).

Builds the model of ``--model`` at one tp rank's shapes with its first ``--layers`` layers (dense layers first, as
the model has them; every layer its own weight set), fills the KV cache with normals, and runs one eager pass per
draft length through the reference op table, recording the distinct routed experts of each MoE layer
(``specverify.verify_wall.routed_distinct_experts``, the probe the wall runs after its timing). Runs on the CPU
(the real shapes fit in ~10 GB for a few layers) or a GPU.

``--compare-logits``: each MoE layer's routing also redone from the router's logits in fp32 and in bf16 (the fp32
product rounded, as a bf16 GEMM stores it) and the distinct experts of each printed beside the pass's own: whether
the logits' precision (a bf16 router GEMM against an fp32 one) changes the experts a pass reads.

Usage: ``python bench/routing_probe.py --model deepseek-v3 --batch 4 --context 16384 --tree topk:2
--draft-tokens 4,8 --layers 6 [--device cpu] [--compare-logits] [--json PATH]``.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from specverify import verify_wall as vw
from specverify.benchmarking import write_rows_json
from specverify.configs import expected_distinct_experts, get_config, per_rank_shapes
from specverify.forward.model import VerifyModel
from specverify.forward.ops import _route_with_config, provider_ops


def compare_logits(model, run, n_routed_experts: int) -> list[tuple[int, int, int]]:
    """(pass, fp32, bf16) distinct routed experts of each MoE layer routed by ``route`` in one call of ``run()``:
    the pass's own logits, the router's product in fp32, and that product rounded to bf16. The op table's
    ``linear`` and ``route`` are wrapped for the call and restored."""
    ops, rows, product = model.ops, [], {}
    linear, route = ops.linear, ops.route

    def recorded_linear(x, w, *rest, **kw):
        if w.shape[0] == n_routed_experts:  # the router
            product["fp32"] = x.float() @ w.float().t()
        return linear(x, w, *rest, **kw)

    def recorded_route(logits, p, *rest):
        fp32 = product.pop("fp32")
        rows.append(tuple(vw.distinct_routed(_route_with_config(x, p)[0], p.num_experts_per_tok)
                          for x in (logits.float(), fp32, fp32.bfloat16().float())))
        return route(logits, p, *rest)

    ops.linear, ops.route = recorded_linear, recorded_route
    try:
        run()
    finally:
        ops.linear, ops.route = linear, route
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="kimi-k2")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--tree", default="chain")
    ap.add_argument("--draft-tokens", type=vw._parse_ints, default=[2, 4, 8])
    ap.add_argument("--layers", type=int, default=2, help="first layers built (dense ones included)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compare-logits", action="store_true",
                    help="also route each MoE layer from fp32 and bf16 router logits and print both counts")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    cfg = get_config(args.model)
    s = per_rank_shapes(cfg, args.tp)
    if not s.is_moe or args.layers <= min(s.first_k_dense_replace, s.num_hidden_layers):
        print(f"routing_probe: {args.model} has no MoE layer in its first {args.layers} layers "
              f"(first_k_dense_replace {s.first_k_dense_replace}); pass a larger --layers", file=sys.stderr)
        return 2
    t0 = time.time()
    model = VerifyModel(cfg, tp=args.tp, rank=0, num_layers=args.layers, distinct_layers=args.layers,
                        dtype=torch.bfloat16, device=args.device)
    model.ops, _ = provider_ops("reference", model)
    per = -(-(args.context + max(args.draft_tokens)) // args.page_size)
    caches = model.allocate_kv(args.batch * per + 1, args.page_size)
    g = torch.Generator().manual_seed(args.seed)
    for layer in caches:
        for c in layer:
            c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))
    page_table = torch.arange(args.batch * per, dtype=torch.int32).view(args.batch, per).to(args.device)
    print(f"built {args.model} ({args.layers} layers) in {time.time() - t0:.1f} s", flush=True)
    rows = []
    for k in args.draft_tokens:
        case = vw.VerifyCase(model, caches, page_table, args.batch, k, args.context, args.tree, seed=args.seed)
        routed = vw.routed_distinct_experts(model, case.run)
        uniform = expected_distinct_experts(s.n_routed_experts, s.num_experts_per_tok, args.batch * k)
        rows.append({"model": args.model, "batch": args.batch, "k": k, "tree": args.tree, "layers": args.layers,
                     "distinct_experts_routed": routed, "distinct_experts_uniform": uniform})
        print(f"{args.model} b {args.batch} k {k} {args.tree}: {routed:.2f} distinct routed experts a MoE layer, "
              f"uniform routing {uniform:.2f} ({routed / uniform:.0%})", flush=True)
        if args.compare_logits:
            per_layer = compare_logits(model, case.run, s.n_routed_experts)
            rows[-1]["distinct_experts_pass_fp32_bf16"] = per_layer
            print(f"  distinct experts a MoE layer (pass, fp32 logits, bf16 logits): {per_layer}", flush=True)
    if args.json:
        write_rows_json(args.json, __file__, rows, args=vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
