"""Benchmark: what one dependent step of the verify pass costs when it moves almost no bytes, as separate kernels
(a CUDA graph of launches, with and without programmatic dependent launch) and inside one persistent kernel (one
program an SM, a grid barrier between steps) (issue 22).

Every step reads a value another program wrote in the step before (program ``p`` reads slot ``(p + 1) % P``), so
each step needs all of the previous one: the dependency of a norm, a projection or a routing step on the whole of
its input. With ``--step-kib`` > 0 each program also reads its own constant slice of a weight (``step_kib`` KiB a
step in all), loaded before the step's wait (the PDL prologue, or before the barrier), as a projection would:
``--load-bytes`` a round trip (default 2048: a slice takes several dependent round trips), or 0 for the whole slice
in one load (8 warps a program).

Rows (µs a step, CUDA-graph replay of ``--steps`` steps):

* ``graph``: one kernel a step, plain graph edges;
* ``pdl``: one kernel a step, launched as programmatic dependents (``gdc_launch_dependents`` / ``gdc_wait``);
* ``persistent``: one kernel of ``--steps`` steps; between steps every program arrives on a counter (release) and
  spins until all have (acquire).
* ``flags-F`` (``--fan-in``): one kernel of ``--steps`` steps; each program publishes a flag a step (release) and
  waits only on the ``F`` programs of the step before whose output it could read (acquire): the per-tile dependency
  of a megakernel, where a split-K consumer needs only the producer tiles of its K chunk, not the whole grid.

Usage: ``python bench/bench_chain_latency.py [--steps 64] [--programs 132] [--step-kib 0,1024,4096]
[--load-bytes 2048] [--fan-in 1,4,16] [--json PATH]``.
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from specverify.benchmarking import copy_bandwidth_gbps, graph_us, write_rows_json


@triton.jit
def _slice_sum(W, base, w_elems, BLOCK: tl.constexpr, WEIGHT: tl.constexpr):
    """The sum of this program's constant weight slice (0.0 without one): the bytes a step reads."""
    acc = 0.0
    if WEIGHT:
        offs = tl.arange(0, BLOCK)
        for i in range(0, w_elems, BLOCK):
            acc += tl.sum(tl.load(W + base + i + offs).to(tl.float32))
    return acc


@triton.jit
def _step_kernel(X, Y, W, w_elems, P, PDL: tl.constexpr, BLOCK: tl.constexpr, WEIGHT: tl.constexpr):
    pid = tl.program_id(0)
    acc = _slice_sum(W, pid * w_elems, w_elems, BLOCK, WEIGHT)  # the constant slice, before the wait
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    v = tl.load(X + (pid + 1) % P)
    tl.store(Y + pid, v + 1.0 + acc * 0.0)


@triton.jit
def _load_acquire(ptrs):
    """``ld.acquire.gpu`` of int32 flags: a plain acquire load, as Triton lowers the barrier row's scalar
    ``atomic_add(ptr, 0, sem="acquire")``, so the two rows poll alike (no read-modify-write against the producer's
    exchange)."""
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptrs], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _persistent_kernel(X, SYNC, W, w_elems, P, STEPS: tl.constexpr, FAN_IN: tl.constexpr, BLOCK: tl.constexpr,
                       WEIGHT: tl.constexpr):
    """``FAN_IN`` 0: a grid barrier between steps (``SYNC`` one counter); else each program waits only on the
    ``FAN_IN`` programs of the step before whose output it could read, the first being the one it does read
    (``SYNC`` a flag per step and program)."""
    pid = tl.program_id(0)
    for s in range(STEPS):
        acc = _slice_sum(W, (s * P + pid).to(tl.int64) * w_elems, w_elems, BLOCK, WEIGHT)
        if s > 0:
            if FAN_IN == 0:  # until every program finished step s - 1
                seen = tl.atomic_add(SYNC, 0, sem="acquire")
                while seen < s * P:
                    seen = tl.atomic_add(SYNC, 0, sem="acquire")
            else:  # until its FAN_IN producers of step s - 1 did
                src = SYNC + (s - 1) * P + (pid + 1 + tl.arange(0, FAN_IN)) % P
                seen = tl.min(_load_acquire(src), axis=0)
                while seen == 0:
                    seen = tl.min(_load_acquire(src), axis=0)
        v = tl.load(X + s * P + (pid + 1) % P, volatile=True)
        tl.store(X + (s + 1) * P + pid, v + 1.0 + acc * 0.0)
        tl.debug_barrier()
        if FAN_IN == 0:
            tl.atomic_add(SYNC, 1, sem="release")
        else:
            tl.atomic_xchg(SYNC + s * P + pid, 1, sem="release")


def _graph_us(fn) -> float:
    return graph_us(fn, calls=1, replays=20, repeats=5, stat="median")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--programs", type=int, default=132)
    ap.add_argument("--step-kib", default="0,1024,4096", help="weight KiB read a step (all programs together)")
    ap.add_argument("--load-bytes", type=int, default=2048, help="weight bytes a program loads a round trip "
                    "(0: its whole slice at once)")
    ap.add_argument("--fan-in", default="1,4,16", help="producers a program waits on in the flags rows (powers of 2)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    steps, p = args.steps, args.programs

    def ints(text, what):
        vals = [v.strip() for v in text.split(",") if v.strip()]
        if not vals or not all(v.isdecimal() for v in vals):
            ap.error(f"{what}: expected comma-separated non-negative integers, got {text!r}")
        return [int(v) for v in vals]

    fan_ins = ints(args.fan_in, "--fan-in")
    kibs = ints(args.step_kib, "--step-kib")
    if steps < 1 or p < 1:
        ap.error(f"--steps and --programs: expected at least 1, got {steps} and {p}")
    if any(f < 1 or f & (f - 1) or f > p for f in fan_ins):
        ap.error(f"--fan-in: expected powers of 2 from 1 to --programs ({p}), got {args.fan_in!r}")
    if args.load_bytes and (args.load_bytes < 2 or (args.load_bytes // 2) & (args.load_bytes // 2 - 1)
                            or args.load_bytes % 2):
        ap.error(f"--load-bytes: expected 0 or twice a power of 2 (a bf16 block), got {args.load_bytes}")
    if not torch.cuda.is_available():
        print("bench_chain_latency: needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    if p > sms:  # the persistent rows spin on programs that must all be resident: one an SM at most, to be sure
        ap.error(f"--programs: the persistent rows need every program resident, expected at most {sms} (the SMs "
                 f"of this GPU), got {p}")
    bw = copy_bandwidth_gbps()
    rows = []
    for kib in kibs:
        want = -(-kib * 512 // p)  # bf16 elements a program
        if args.load_bytes == 0:
            block = w_elems = triton.next_power_of_2(max(want, 1024))
        else:
            block = args.load_bytes // 2
            w_elems = max(block, want // block * block) if kib else block
        w = torch.randn(steps * p * w_elems, device=dev, dtype=torch.bfloat16) if kib else torch.zeros(
            block, device=dev, dtype=torch.bfloat16)
        x = torch.zeros((steps + 1) * p, device=dev)
        counter = torch.zeros(1, device=dev, dtype=torch.int32)
        flags = torch.zeros(steps * p, device=dev, dtype=torch.int32)
        wk = dict(BLOCK=block, WEIGHT=kib > 0, num_warps=8 if args.load_bytes == 0 else 4)

        def chain(pdl):
            def fn():
                for s in range(steps):
                    ws = w[s * p * w_elems:] if kib else w
                    _step_kernel[(p,)](x[s * p:], x[(s + 1) * p:], ws, w_elems, p, PDL=pdl, **wk,
                                       **({"launch_pdl": True} if pdl else {}))
            return fn

        def persistent(sync, fan_in):
            def fn():
                sync.zero_()
                _persistent_kernel[(p,)](x, sync, w, w_elems if kib else 0, p, STEPS=steps, FAN_IN=fan_in, **wk)
            return fn

        # (name, replay, µs of its reset taken off its time: the persistent rows' counter or flags)
        counter_us, flags_us = _graph_us(counter.zero_), _graph_us(flags.zero_)
        variants = [("graph", chain(False), 0.0), ("pdl", chain(True), 0.0),
                    ("persistent", persistent(counter, 0), counter_us)]
        variants += [(f"flags-{f}", persistent(flags, f), flags_us) for f in fan_ins]
        expected = torch.arange(steps + 1, device=dev, dtype=x.dtype)[:, None]  # step s's value in every program
        for name, fn, reset_us in variants:
            for _ in range(3):  # every step's output unwritten (-1e9): a program that read early shows at once
                x[p:].fill_(-1e9)
                fn()
                got = x.view(steps + 1, p)
                if not bool((got == expected).all()):
                    bad = int((got != expected).any(dim=1).nonzero()[0])
                    print(f"bench_chain_latency: {name}: a program read before its producer wrote (step {bad}: "
                          f"expected {bad}, got {got[bad].min().item():.0f}..{got[bad].max().item():.0f})",
                          file=sys.stderr)
                    return 1
            us = _graph_us(fn) - reset_us
            rows.append({"row": name, "step_kib": kib, "slice_bytes": w_elems * 2 if kib else 0,
                         "load_bytes": block * 2, "us_per_step": us / steps, "total_us": us})
            floor = p * w_elems * 2 / (bw * 1e3) if kib else 0.0
            print(f"{name:>10} step {kib:5d} KiB ({w_elems * 2 if kib else 0} B a program): {us / steps:6.2f} us a "
                  f"step (floor {floor:5.2f})", flush=True)
    if args.json:
        write_rows_json(args.json, __file__, rows, copy_bw_gbps=bw, args=vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
