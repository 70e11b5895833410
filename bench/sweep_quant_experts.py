"""Sweep: the quantised experts (``fused_moe(..., quant=...)``) by gate/up kernel and tile, against their bytes floor.

Shape: Kimi-K2 per rank (tp 8: H 7168, I 256, 384 routed experts, top-8; ``--experts`` to draw fewer), routed
experts only, M = 1, 2, 4, 8 tokens (``--ms``). Formats (``--formats``): int4 (group 32, bf16 scales; Kimi-K2.5),
int4q (the same in row quads, ``MoEQuant(layout="quads")``) and fp8 (128 x 128 blocks, fp32 scales; Kimi-K2 /
DeepSeek-V3), all from the same random bf16 weights.

Variants: the gate/up kernel the launcher picks (``auto``) and, up to M = 2, each stream gate/up (``fma`` /
``splitk``), or each of ``--configs`` (stream-config overrides). Every row is first checked against an fp64 loop
over the activated experts, dequantised (tolerance: twice torch's own bf16 error on the dequantised weights, plus
1e-6), then timed by CUDA-graph replay of ``SETS`` calls each with its own routing (so the weights come from HBM, not
L2).

``floor_us = mean over the sets of distinct experts * stored bytes an expert (codes + scales) / copy_bw``; ``x``
= us / floor_us.

``--split``: also the stream gate/up alone (without PDL), so the down kernel's share shows.

``--shared``: with Kimi-K2.5's unquantised (bf16) shared expert (I 256, its own weights for each of the ``SETS``
calls), passed as ``fused_moe(..., shared_expert=...)``; the floor counts its bytes. The config key ``"apart":
true`` (the sweep's, not the launcher's) runs it instead as our forward did before: the routed experts, then two
matmuls and an add.

Usage: ``python bench/sweep_quant_experts.py [--ms 1,2,4,8] [--formats int4,int4q,fp8] [--experts 384] [--split]
[--shared] [--configs JSON] [--json PATH]``.
Needs a CUDA GPU (exit code 2 otherwise).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from specverify.benchmarking import copy_bandwidth_gbps, graph_us, token_counts, write_rows_json

SETS = 20


def _formats(text: str) -> list:
    got = [t.strip() for t in text.split(",") if t.strip()]
    if not got or any(f not in ("int4", "int4q", "fp8") for f in got):
        raise argparse.ArgumentTypeError(f"--formats takes a comma-separated subset of int4,int4q,fp8, got {text!r}")
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", type=token_counts, default=[1, 2, 4, 8], help="token counts M (default: 1,2,4,8)")
    ap.add_argument("--formats", default="int4,fp8", type=_formats,
                    help="comma-separated subset of int4,int4q,fp8 (int4q: int4 in row quads, as our "
                         "forward stores it; default: int4,fp8)")
    ap.add_argument("--experts", type=int, default=384, help="experts drawn (default: 384, Kimi-K2's)")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    ap.add_argument("--configs", default=None,
                    help="JSON list of stream-config overrides (keys of specverify.moe._STREAM_CONFIG) to run instead "
                         "of the gate/up choices, e.g. '[{}, {\"R\": 8}, {\"BK\": 1024}]' ({}: the defaults; the "
                         "down tile of quantised weights is qBH / qTILE unless BH / TILE are given; QPF: int4's "
                         "next-tile loads)")
    ap.add_argument("--shared", action="store_true",
                    help="with a bf16 shared expert (fused_moe's shared_expert; config key \"apart\": true runs it "
                         "as two matmuls and an add after the experts)")
    ap.add_argument("--split", action="store_true",
                    help="also time the stream gate/up alone (gate_up_us; the rest is the down kernel), M <= 6")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_quant_experts: needs a CUDA GPU", file=sys.stderr)
        return 2
    import specverify.moe as moe
    from specverify.reference.moe import fused_moe_by_expert_reference as by_expert
    from specverify.reference.moe import random_expert_weights, shared_expert_reference
    from specverify.reference.quant import int4_to_quads, quantize_experts

    e, h, inter, top = args.experts, 7168, 256, 8
    bw = copy_bandwidth_gbps() * 1e9
    w13, w2 = random_expert_weights(e, h, inter, dtype=torch.bfloat16, device="cuda", seed=1)
    shared = [None] * SETS
    if args.shared:  # a shared expert a set (so each call reads its own from HBM)
        sh13, sh2 = random_expert_weights(SETS, h, inter, dtype=torch.bfloat16, device="cuda", seed=2)
        shared = [(sh13[i], sh2[i]) for i in range(SETS)]
    shared_bytes = 0 if not args.shared else (sh13[0].numel() + sh2[0].numel()) * 2

    def experts(xi, p13, p2, ids, w, q, sh, apart):
        if sh is None or not apart:
            return moe.fused_moe(xi, p13, p2, ids, w, quant=q, shared_expert=sh)
        return moe.fused_moe(xi, p13, p2, ids, w, quant=q) + shared_expert_reference(xi, *sh, compute_dtype=xi.dtype)

    rows, failed = [], 0
    for fmt in args.formats:
        stored = "int4" if fmt == "int4q" else fmt
        p13, s13 = quantize_experts(w13, stored)
        p2, s2 = quantize_experts(w2, stored)
        if fmt == "int4q":
            p13, s13 = int4_to_quads(p13, s13)
            p2, s2 = int4_to_quads(p2, s2)
        q = moe.MoEQuant(stored, s13, s2, layout="quads" if fmt == "int4q" else "rows")
        per_expert = sum(t[0].numel() * t.element_size() for t in (p13, p2, s13, s2))
        for m in args.ms:
            g = torch.Generator(device="cuda").manual_seed(m)
            x = torch.randn(SETS, m, h, device="cuda", generator=g).bfloat16()
            routed = [moe.moe_route(torch.randn(m, e, device="cuda", generator=g), top_k=top) for _ in range(SETS)]
            floor_us = (sum(len(torch.unique(i)) for i, _ in routed) / SETS * per_expert + shared_bytes) / bw * 1e6
            if args.configs:
                gus = [json.dumps(c, sort_keys=True) for c in json.loads(args.configs)]
            else:
                gus = ("auto", "fma", "splitk") if m <= 2 else ("auto",)
            for gu in gus:
                over = json.loads(gu) if args.configs else ({} if gu == "auto" else {"gate_up": gu})
                apart = bool(over.pop("apart", False))
                moe._STREAM_OVERRIDE.clear()
                moe._STREAM_OVERRIDE.update(over)
                ids, w = routed[0]
                out = experts(x[0], p13, p2, ids, w, q, shared[0], apart)
                want = by_expert(x[0], p13, p2, ids, w, torch.float64, quant=q)
                got_bf16 = by_expert(x[0], p13, p2, ids, w, torch.bfloat16, quant=q)
                if args.shared:  # + the shared expert, in fp64 and (for the tolerance) in bf16
                    want = want + shared_expert_reference(x[0], *shared[0], compute_dtype=torch.float64)
                    got_bf16 = got_bf16 + shared_expert_reference(x[0], *shared[0], compute_dtype=torch.bfloat16)
                tol = 2 * (got_bf16 - want).abs().max().item() + 2 ** -8 * want.abs().max().item() * args.shared + 1e-6
                err = (out.double() - want).abs().max().item()
                label = f"{fmt}{'+shared' * args.shared} {gu}"
                if not err <= tol:
                    print(f"FAIL {label} M={m}: error {err:.3g} > tolerance {tol:.3g}")
                    failed += 1
                    continue

                def calls():
                    for i in range(SETS):
                        experts(x[i], p13, p2, routed[i][0], routed[i][1], q, shared[i], apart)
                us = graph_us(calls, calls=1, replays=10, repeats=3) / SETS
                row = dict(format=fmt + "+shared" * args.shared, gate_up=gu, m=m, us=us, floor_us=floor_us,
                           x_floor=us / floor_us, err=err, tol=tol)
                split = ""
                if args.split and m <= moe._stream_max_m(q):
                    cfg = moe._stream_config(m, h, inter, top, True, q.format)

                    def gate_up_calls():
                        for i in range(SETS):
                            moe.stream_gate_up(x[i], p13, routed[i][0].int(), cfg, False, q)
                    row["gate_up_us"] = graph_us(gate_up_calls, calls=1, replays=10, repeats=3) / SETS
                    split = f"  gate/up alone {row['gate_up_us']:7.2f}"
                rows.append(row)
                print(f"{label:>18} M={m}: {us:8.2f} us  floor {floor_us:7.2f}  x{us / floor_us:5.2f}{split}",
                      flush=True)
    moe._STREAM_OVERRIDE.clear()
    if args.json:
        write_rows_json(args.json, __file__, rows, copy_bandwidth_gbps=bw / 1e9)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
