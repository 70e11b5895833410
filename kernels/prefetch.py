"""L2 prefetch of constant tensors (the next projections' weights), run by a small grid beside the verify pass's
latency-bound kernels so that HBM keeps streaming while they run: ``specverify.prefetch.prefetch_l2``.

Up to four byte regions a launch; program ``p`` of ``P`` takes the ``p``-th of ``P`` contiguous slices of every
region, region by region (region 0, the weight needed first, is requested first everywhere)::

    units of region r:   u = 0 .. ceil(N_r / UNIT) - 1,  unit u covers bytes [u * UNIT, min((u + 1) * UNIT, N_r))
    program p:           units [p * per_r, min((p + 1) * per_r, units_r)),  per_r = ceil(units_r / P)

``MODE``: 0 counts instead of prefetching (``COUNTS[r, u] += bytes of unit u``: the coverage, checked on the CPU
interpreter, which cannot run PTX); 1 ``prefetch.global.L2`` per 128-byte line (``UNIT`` 128), one line per lane;
2 ``cp.async.bulk.prefetch.L2`` of ``UNIT`` bytes per lane (the copy engine; addresses and sizes multiples of 16).

Tensors: A0..A3 uint8 [N0..N3] (byte views; an unused region has N = 0); COUNTS int32 [4, max_units] (MODE 0).
No output: a prefetch only moves lines into L2 and never faults, so the launch is safe beside any kernel.
"""
import triton
import triton.language as tl


@triton.jit
def _prefetch_l2(ptrs):
    # prefetch.global.L2 of every address (one per 128-byte line); no result, no fault on the lanes given the base
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _prefetch_l2_bulk(ptrs, sizes):
    # one bulk L2 prefetch of sizes[i] bytes (a multiple of 16) from ptrs[i] (16-byte aligned) per lane
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                              [ptrs, sizes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_region(A, nbytes, region, COUNTS, max_units, UNIT: tl.constexpr, BLOCK: tl.constexpr,
                     MODE: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    units = tl.cdiv(nbytes, UNIT)
    per = tl.cdiv(units, programs)
    lo = pid * per
    hi = tl.minimum(lo + per, units)
    for u0 in range(lo, hi, BLOCK):
        u = u0 + tl.arange(0, BLOCK)
        live = u < hi
        off = u.to(tl.int64) * UNIT
        size = tl.minimum(nbytes - off, UNIT).to(tl.int32)
        if MODE == 0:
            tl.atomic_add(COUNTS + region * max_units + u, size, mask=live)
        elif MODE == 1:
            _prefetch_l2(tl.where(live, A + off, A))
        else:
            _prefetch_l2_bulk(tl.where(live, A + off, A), tl.where(live, size, 16))


@triton.jit(do_not_specialize=["N0", "N1", "N2", "N3", "max_units"])
def _prefetch_l2_kernel(A0, N0, A1, N1, A2, N2, A3, N3, COUNTS, max_units, UNIT: tl.constexpr,
                        BLOCK: tl.constexpr, MODE: tl.constexpr):
    _prefetch_region(A0, N0, 0, COUNTS, max_units, UNIT, BLOCK, MODE)
    _prefetch_region(A1, N1, 1, COUNTS, max_units, UNIT, BLOCK, MODE)
    _prefetch_region(A2, N2, 2, COUNTS, max_units, UNIT, BLOCK, MODE)
    _prefetch_region(A3, N3, 3, COUNTS, max_units, UNIT, BLOCK, MODE)
