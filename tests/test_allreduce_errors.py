"""Bad inputs and failures of the IPC allreduce: every error names what was expected, what came, and the fix; a
peer that never arrives becomes an AllReduceTimeoutError, not a hang."""
from __future__ import annotations

import ctypes
import traceback

import pytest
import torch

from specverify.comm import AllReduceTimeoutError, CustomAllReduce


def _fake(world=2, disabled=False, nccl=None):
    """A communicator with hand-set state (no GPU, no group): only the Python checks run."""
    ar = CustomAllReduce.__new__(CustomAllReduce)
    ar.disabled, ar.disabled_reason = disabled, ("CuPy missing" if disabled else "")
    ar.device = torch.device("cpu")
    ar.world_size, ar.link, ar.nccl, ar.mode = world, "nvlink", nccl, "auto"
    ar._closed, ar._host_err, ar.rank, ar.timeout_s, ar.max_bytes = False, 0, 0, 10.0, 1 << 20
    return ar


@pytest.fixture
def group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_constructor_rejects_bad_arguments(group):
    with pytest.raises(TypeError, match="ProcessGroup"):
        CustomAllReduce("world")
    with pytest.raises(ValueError, match="positive multiple of 16"):
        CustomAllReduce(group, max_bytes=1000)
    with pytest.raises(ValueError, match=r"num_blocks must be in \[1, 64\]"):
        CustomAllReduce(group, num_blocks=65)
    with pytest.raises(ValueError, match="link must be one of"):
        CustomAllReduce(group, link="infiniband")


def test_constructor_rejects_bad_mode(group, monkeypatch):
    monkeypatch.setenv("SPECVERIFY_ALLREDUCE", "fastest")
    with pytest.raises(ValueError, match="SPECVERIFY_ALLREDUCE must be auto, off, oneshot or twoshot"):
        CustomAllReduce(group)


@pytest.mark.parametrize("algo", ["oneshot", "twoshot"])
def test_explicit_algo_never_falls_back(algo):
    ar = _fake()
    with pytest.raises(TypeError, match="dtype must be bfloat16, float16 or float32, got torch.float64"):
        ar.all_reduce(torch.zeros(8, dtype=torch.float64), algo=algo)
    with pytest.raises(ValueError, match=r"contiguous \(call .contiguous\(\)\)"):
        ar.all_reduce(torch.zeros(8, 16).t(), algo=algo)
    with pytest.raises(ValueError, match="16-byte aligned, got address % 16 = 4"):
        ar.all_reduce(torch.zeros(9)[1:], algo=algo)


def test_auto_without_nccl_raises_instead_of_falling_back():
    with pytest.raises(TypeError, match="got torch.int64"):
        _fake().all_reduce(torch.zeros(8, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="disabled: CuPy missing, and there is no NCCL communicator"):
        _fake(disabled=True).all_reduce(torch.zeros(8))


def test_unknown_algo_and_missing_nccl():
    with pytest.raises(ValueError, match="algo must be one of"):
        _fake().all_reduce(torch.zeros(8), algo="ring")
    with pytest.raises(RuntimeError, match="no NCCL communicator"):
        _fake().all_reduce(torch.zeros(8), algo="nccl")


def test_out_mismatch():
    ar = _fake()
    x = torch.zeros(16)
    with pytest.raises(TypeError, match="out must have dtype torch.float32, got torch.float16"):
        ar._check_out(x, torch.zeros(16, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"shape \(16,\).*got shape \(15,\)"):
        ar._check_out(x, torch.zeros(15))


def test_fused_input_checks():
    ar = _fake()
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="share one dtype"):
        ar.all_reduce_residual_rmsnorm(x, x.float(), torch.zeros(64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"weight of shape \(hidden,\).*weight \(63,\)"):
        ar.all_reduce_residual_rmsnorm(x, x.clone(), torch.zeros(63, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="x must be bfloat16, float16 or float32"):
        ar.all_reduce_residual_rmsnorm(x.long(), x.long(), torch.zeros(64).long())


def test_error_word_becomes_a_clear_exception():
    ar = _fake()
    word = ctypes.c_int32(0)
    ar._host_err = ctypes.addressof(word)
    ar.check()  # 0: fine
    word.value = 1
    with pytest.raises(AllReduceTimeoutError, match="did not reach the barrier within 10 s.*close\\(\\) it"):
        ar.check()
    word.value = 2
    with pytest.raises(RuntimeError, match="bad arguments"):
        ar.check()
    ar._host_err = 0  # not ours to free


def test_use_after_close():
    ar = _fake()
    ar._closed = True
    with pytest.raises(RuntimeError, match="after close"):
        ar.all_reduce(torch.zeros(8))


# ---- a peer that never arrives (GPU: two processes on one GPU) -------------------------------------------------


def _timeout_worker(rank, world, init_file, scenarios, results, kwargs):
    try:
        import time

        import torch.distributed as dist

        torch.cuda.set_device(0)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        ar = CustomAllReduce(dist.group.WORLD, timeout_s=2.0, max_bytes=1 << 16)
        if ar.disabled:
            raise RuntimeError(f"custom allreduce disabled: {ar.disabled_reason}")
        msg = "skipped the call"
        if rank == 0:  # rank 1 "hangs": it never makes the call
            x = torch.ones(1024, dtype=torch.bfloat16, device="cuda")
            t0 = time.monotonic()
            ar.all_reduce(x, algo="oneshot")
            torch.cuda.synchronize()  # returns: the kernel gave up instead of spinning forever
            waited = time.monotonic() - t0
            try:
                ar.check()
                raise AssertionError("check() did not raise after a peer never arrived")
            except AllReduceTimeoutError:
                pass
            try:  # the next call refuses at once
                ar.all_reduce(x, algo="oneshot")
                raise AssertionError("a call after a timeout did not raise")
            except AllReduceTimeoutError:
                pass
            if not (1.5 <= waited <= 30):
                raise AssertionError(f"timeout of 2 s took {waited:.1f} s")
            msg = f"timed out after {waited:.1f} s"
        dist.barrier()
        ar.close(barrier=False)
        dist.destroy_process_group()
        results.put((rank, "ok", msg))
    except BaseException:
        results.put((rank, "fail", traceback.format_exc()))


@pytest.mark.gpu
def test_missing_peer_times_out_instead_of_hanging():
    from test_allreduce_gpu import _assert_all_ok, spawn

    got = spawn(2, (), wall_s=60.0, target=_timeout_worker)
    _assert_all_ok(got)


def _no_cupy_worker(rank, world, init_file, scenarios, results, kwargs):
    try:
        import sys

        import torch.distributed as dist

        sys.modules["cupy"] = None  # as on a machine without CuPy, whatever this one has
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        ar = CustomAllReduce(dist.group.WORLD, device=0, nccl=False)
        if not ar.disabled or "specverify-kernels[cu13]" not in ar.disabled_reason:
            raise AssertionError(f"expected disabled with an install hint, got {ar!r}")
        try:
            ar.all_reduce(torch.zeros(8))
            raise AssertionError("all_reduce on a disabled communicator without NCCL did not raise")
        except RuntimeError as exc:
            if "no NCCL communicator" not in str(exc):
                raise
        ar.close()
        dist.destroy_process_group()
        results.put((rank, "ok", ar.disabled_reason))
    except BaseException:
        results.put((rank, "fail", traceback.format_exc()))


def test_two_ranks_without_cupy_disable_together():
    """Both ranks take the same decision (no rank waits in a collective the other skipped), with a reason."""
    from test_allreduce_gpu import _assert_all_ok, spawn

    got = spawn(2, (), wall_s=90.0, target=_no_cupy_worker)
    _assert_all_ok(got)
