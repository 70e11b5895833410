"""GPU tests of the IPC allreduce: several processes share ONE GPU through CUDA IPC and stand in for 2, 4, 8 ranks.

NCCL refuses two ranks on one GPU, so the handle exchange runs over gloo and NCCL itself is tested only in the
``multigpu`` test (one process per GPU). Every spawn has a wall-clock limit and is killed past it, and the
kernels' own flag timeout (20 s here) turns a lost peer into an error rather than a hang.

On one GPU the ranks' kernels time-slice (no two contexts run at once without MPS), so a call costs several
milliseconds here: these tests check correctness only; timings come from bench/bench_allreduce.py on a machine
with several GPUs.
"""
from __future__ import annotations

import os
import queue
import tempfile
import time
import traceback

import pytest
import torch

SPAWN_TIMEOUT_S = 75.0
KERNEL_TIMEOUT_S = 20.0
MAX_BYTES = 64 * 1024  # small staging slots so "above the buffer" sizes stay small

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Element counts (all dtypes): each has a reason to be here.
SIZES = (
    1,  # a single element: no whole 16-byte pack, only the scalar tail
    7,  # fewer elements than one bf16 pack (8): tail only
    8,  # exactly one bf16/fp16 pack, two fp32 packs
    1000,  # packs not divisible by 3 or 8 ranks: short last shard in two-shot
    12345,  # odd: whole packs plus a tail of 1 (bf16) / 1 (fp32)
    7168 * 4,  # the verify-pass shape: 4 tokens of hidden 7168
)
# Above the 64 KiB slot: chunked. 3 full fp32 chunks (16384 elements each) plus a ragged one with a tail.
CHUNKED = 3 * 16384 + 1001


def _inputs(rank: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(-4, 5, (n,), generator=g).to(dtype)  # |sum| <= 32: exact in bf16, fp16, fp32


def _expected(world: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    total = torch.zeros(n, dtype=torch.float64)
    for r in range(world):
        total += _inputs(r, n, dtype, seed).double()
    return total.to(dtype)


def _check_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got = got.cpu()
    if not torch.equal(got, want):
        bad = (got != want) | got.isnan()
        idx = bad.nonzero()[:5].flatten().tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} wrong elements, first at {idx}: got "
                             f"{got[idx].tolist()} want {want[idx].tolist()}")


def _scenario_sums(ar, rank, world):
    # Ranks sharing one GPU time-slice, so every call costs milliseconds: the full grid at 2 ranks, a subset beyond.
    sizes = (*SIZES, CHUNKED) if world <= 2 else (7, 1000, 12345, CHUNKED)
    algos = ("oneshot", "twoshot", "auto") if world <= 2 else ("oneshot", "twoshot")
    seed = 0
    for dtype in DTYPES:
        for n in sizes:
            for algo in algos:
                seed += 1
                x = _inputs(rank, n, dtype, seed).cuda()
                out = torch.full_like(x, float("nan"))
                ar.all_reduce(x, out=out, algo=algo)
                torch.cuda.synchronize()
                ar.check()
                _check_equal(out, _expected(world, n, dtype, seed), f"{algo} {dtype} n={n} world={world}")
    # in place (out is the input) works too
    x = _inputs(rank, 4096, torch.bfloat16, 999).cuda()
    ar.all_reduce(x, out=x, algo="oneshot")
    torch.cuda.synchronize()
    _check_equal(x, _expected(world, 4096, torch.bfloat16, 999), "in-place one-shot")


def _fused_tolerance(x_sum, residual, weight, eps):
    """2x torch's own low-precision error against an fp64 computation of the same formula, plus a floor."""
    from specverify.comm import residual_rmsnorm_reference

    ref, _ = residual_rmsnorm_reference(x_sum, residual, weight, eps)
    y = (x_sum.double() + residual.double()).to(residual.dtype).double()
    exact = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return ref, 2 * (ref.double() - exact).abs().max().item() + 1e-3 * exact.abs().max().item()


def _scenario_fused(ar, rank, world):
    from specverify.comm import residual_rmsnorm_reference

    eps = 1e-6
    seed = 5000
    # (rows, hidden): one row; the verify shape; more rows than blocks; rows above the 64 KiB slot (chunked)
    for dtype in DTYPES:
        for rows, hidden in ((1, 64), (4, 7168), (37, 256), (9, 4096)) if world <= 4 else ((1, 64), (9, 4096)):
            seed += 1
            n = rows * hidden
            x = _inputs(rank, n, dtype, seed).view(rows, hidden).cuda()
            res_host = _inputs(world + 1, n, dtype, seed).view(rows, hidden)  # same residual on every rank
            g = torch.Generator().manual_seed(seed)
            w_host = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
            residual = res_host.cuda()
            out = torch.full_like(x, float("nan"))
            ar.all_reduce_residual_rmsnorm(x, residual, w_host.cuda(), eps=eps, out=out)
            torch.cuda.synchronize()
            ar.check()
            x_sum = _expected(world, n, dtype, seed).view(rows, hidden).float()
            ref, tol = _fused_tolerance(x_sum, res_host, w_host, eps)
            _, new_res = residual_rmsnorm_reference(x_sum, res_host, w_host, eps)
            _check_equal(residual, new_res, f"fused residual {dtype} {rows}x{hidden}")
            err = (out.cpu().double() - ref.double()).abs().max().item()
            if not (err <= tol):  # NaN fails too
                raise AssertionError(f"fused out {dtype} {rows}x{hidden}: max error {err} > tolerance {tol}")


def _scenario_graph(ar, rank, world):
    n, dtype = 5000, torch.bfloat16
    x = _inputs(rank, n, dtype, 7001).cuda()
    out1 = torch.full_like(x, float("nan"))
    out2 = torch.full_like(x, float("nan"))
    rows, hidden = 3, 512
    xf = _inputs(rank, rows * hidden, dtype, 7002).view(rows, hidden).cuda()
    residual = torch.zeros(rows, hidden, dtype=dtype, device="cuda")
    weight = torch.ones(hidden, dtype=dtype, device="cuda")
    outf = torch.full_like(xf, float("nan"))
    # eager warm-up (the kernels are loaded at construction; this checks the eager path once more)
    ar.all_reduce(x, out=out1, algo="oneshot")
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with ar.capture():
        with torch.cuda.graph(g):
            ar.all_reduce(x, out=out1, algo="oneshot")
            ar.all_reduce(x, out=out2, algo="twoshot")
            ar.all_reduce_residual_rmsnorm(xf, residual, weight, out=outf)
    for step, seed in enumerate((7003, 7004)):
        x.copy_(_inputs(rank, n, dtype, seed).cuda())  # overwrite the captured inputs in place
        xf.copy_(_inputs(rank, rows * hidden, dtype, seed + 100).view(rows, hidden).cuda())
        residual.zero_()
        out1.fill_(float("nan"))
        out2.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ar.check()
        want = _expected(world, n, dtype, seed)
        _check_equal(out1, want, f"graph replay {step} one-shot")
        _check_equal(out2, want, f"graph replay {step} two-shot")
        _check_equal(residual, _expected(world, rows * hidden, dtype, seed + 100).view(rows, hidden),
                     f"graph replay {step} fused residual")


SCENARIOS = {"sums": _scenario_sums, "fused": _scenario_fused, "graph": _scenario_graph}


def _worker(rank, world, init_file, scenarios, results, kwargs):
    try:
        import torch.distributed as dist

        torch.cuda.set_device(kwargs.get("device") or 0)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        from specverify.comm import CustomAllReduce

        ar = CustomAllReduce(dist.group.WORLD, **kwargs)
        if ar.disabled:
            raise RuntimeError(f"custom allreduce disabled: {ar.disabled_reason}")
        for name in scenarios:
            SCENARIOS[name](ar, rank, world)
        ar.close()
        dist.destroy_process_group()
        results.put((rank, "ok", repr(ar)))
    except BaseException:
        results.put((rank, "fail", traceback.format_exc()))


def spawn(world, scenarios, wall_s=SPAWN_TIMEOUT_S, target=_worker, per_rank_kwargs=None, **kwargs):
    """Run ``target`` in ``world`` processes; returns {rank: (status, message)}; kills everything past the limit."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="sv_ar_init_")
    os.close(fd)
    os.unlink(init_file)  # the file store creates it
    procs = []
    for r in range(world):
        kw = dict(kwargs)
        if per_rank_kwargs:
            kw.update(per_rank_kwargs(r))
        procs.append(ctx.Process(target=target, args=(r, world, init_file, scenarios, results, kw), daemon=True))
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + wall_s
    try:
        while len(got) < world and time.monotonic() < deadline:
            try:
                rank, status, msg = results.get(timeout=1.0)
                got[rank] = (status, msg)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and len(got) + len(dead) >= world:
                    break
    finally:
        for p in procs:
            p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if os.path.exists(init_file):
            os.unlink(init_file)
    for r, p in enumerate(procs):
        if r not in got:
            got[r] = ("fail", f"rank {r} reported nothing (exit code {p.exitcode}; killed after {wall_s:.0f} s?)")
    return got


def _assert_all_ok(got):
    failures = {r: msg for r, (status, msg) in got.items() if status != "ok"}
    assert not failures, "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in sorted(failures.items()))


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4, 8])
def test_allreduce_processes_share_one_gpu(world):
    got = spawn(world, ("sums", "fused", "graph"), max_bytes=MAX_BYTES, timeout_s=KERNEL_TIMEOUT_S)
    _assert_all_ok(got)


@pytest.mark.multigpu
def test_allreduce_one_process_per_gpu_with_nccl():
    world = min(torch.cuda.device_count(), 8)
    got = spawn(world, ("sums", "fused", "graph", "nccl"), max_bytes=MAX_BYTES, timeout_s=KERNEL_TIMEOUT_S,
                nccl=True, per_rank_kwargs=lambda r: {"device": r})
    _assert_all_ok(got)


def _scenario_nccl(ar, rank, world):
    if ar.nccl is None:
        raise AssertionError("expected an NCCL communicator with one process per GPU")
    for dtype in DTYPES:
        x = _inputs(rank, 70001, dtype, 42).cuda()
        out = ar.all_reduce(x, algo="nccl")
        torch.cuda.synchronize()
        _check_equal(out, _expected(world, 70001, dtype, 42), f"nccl {dtype}")


SCENARIOS["nccl"] = _scenario_nccl
