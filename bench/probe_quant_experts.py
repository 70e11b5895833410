"""Probe: a few calls of the experts on one fixed routing, for a profiler (``ncu``) to look at the expert kernels.

Experts: 64 of Kimi-K2's rank shape (H 7168, I 256, top-8), drawn at random and stored as ``int4`` (group 32, bf16
scales), ``fp8`` (128 x 128 blocks) or ``bf16``; M tokens routed at random. Four calls of ``fused_moe``, then a
sync; nothing is timed or printed (the profiler reports).

Usage: ``ncu --kernel-name regex:_moe_stream --launch-skip 2 --launch-count 2 --section SpeedOfLight
--section InstructionStats --section WarpStateStats --section ComputeWorkloadAnalysis python3
bench/probe_quant_experts.py int4 1``. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import sys

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("format", choices=("int4", "fp8", "bf16"))
    ap.add_argument("m", type=int, help="tokens")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_quant_experts: needs a CUDA GPU", file=sys.stderr)
        return 2
    import specverify.moe as moe
    from specverify.reference.moe import random_expert_weights
    from specverify.reference.quant import quantize_fp8_block, quantize_int4

    e, h, inter = 64, 7168, 256
    w13, w2 = random_expert_weights(e, h, inter, dtype=torch.float32, device="cuda", seed=1)
    if args.format == "int4":
        (p13, s13), (p2, s2) = quantize_int4(w13, 32), quantize_int4(w2, 32)
        q = moe.MoEQuant("int4", s13.bfloat16(), s2.bfloat16())
    elif args.format == "fp8":
        (p13, s13), (p2, s2) = quantize_fp8_block(w13), quantize_fp8_block(w2)
        q = moe.MoEQuant("fp8", s13, s2)
    else:
        p13, p2, q = w13.bfloat16(), w2.bfloat16(), None
    x = torch.randn(args.m, h, device="cuda").bfloat16()
    ids, w = moe.moe_route(torch.randn(args.m, e, device="cuda"), top_k=8)
    for _ in range(4):
        moe.fused_moe(x, p13, p2, ids, w, quant=q)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
