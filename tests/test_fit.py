"""specverify.fit on the CPU: the first candidate whose compiled kernel fits the device's shared memory is chosen,
the choice is cached per key, and a shape nothing fits gets a clear error (the GPU path runs in tests/test_shapes.py,
where mla_up_v at 64 rows needs fewer pipeline stages than Triton's default on an H200)."""
from __future__ import annotations

import types

import pytest
import torch

from specverify import fit


class FakeKernel:
    """Compiles to a kernel whose shared memory is ``shared(candidate)``; counts compiles and launches."""

    def __init__(self, shared):
        self.shared, self.compiles, self.launched = shared, [], []

    def warmup(self, *args, grid, **kw):
        self.compiles.append(kw)
        return types.SimpleNamespace(metadata=types.SimpleNamespace(shared=self.shared(kw)))

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launched.append(kw)


@pytest.fixture
def gpu_like(monkeypatch):
    monkeypatch.setattr(fit, "_limit", lambda index: 232448)  # an H200's per-block opt-in limit
    monkeypatch.setattr(fit.envvars, "triton_interpret", lambda: False)
    monkeypatch.setattr(fit, "_CHOSEN", {})
    return torch.device("cuda", 0)


def test_first_fitting_lowers_stages_until_it_fits(gpu_like):
    # weight tile 64 KiB + stages x 64 KiB of rows (the mla_up_v case): 3 stages do not fit, 2 do
    kern = FakeKernel(lambda kw: 65536 + kw["num_stages"] * 65536)
    cands = [{"num_stages": s} for s in (3, 2, 1)]
    got = fit.first_fitting(kern, (1,), (), cands, device=gpu_like, key="a", what="op")
    assert got == {"num_stages": 2} and len(kern.compiles) == 2
    again = fit.first_fitting(kern, (1,), (), cands, device=gpu_like, key="a", what="op")
    assert again == got and len(kern.compiles) == 2, "the choice is cached per key"
    fit.first_fitting(kern, (1,), (), cands, device=gpu_like, key="b", what="op")
    assert len(kern.compiles) == 4, "another key is checked again"


def test_nothing_fits_names_the_op_and_the_limit(gpu_like):
    kern = FakeKernel(lambda kw: 300000)
    with pytest.raises(ValueError, match=r"mla_up_v: no launch config fits the 232448 B .*300000 B"):
        fit.first_fitting(kern, (1,), (), [{"num_stages": 2}, {"num_stages": 1}], device=gpu_like, key="c",
                          what="mla_up_v")


def test_launch_fitting_launches_the_chosen_config(gpu_like, monkeypatch):
    kern = FakeKernel(lambda kw: 100000 * kw["num_stages"])
    x = types.SimpleNamespace(device=gpu_like, dtype=torch.bfloat16)
    monkeypatch.setattr(fit.torch, "Tensor", types.SimpleNamespace)  # the fake tensor stands in for a CUDA one
    fit.launch_fitting(kern, (4,), (x,), {"BLOCK": 64, "num_stages": 4}, what="op")
    assert kern.launched == [{"BLOCK": 64, "num_stages": 2}]


def test_cpu_tensors_launch_unchanged():
    kern = FakeKernel(lambda kw: 10 ** 9)
    fit.launch_fitting(kern, (1,), (torch.zeros(1),), {"num_stages": 3}, what="op")
    assert kern.launched == [{"num_stages": 3}] and kern.compiles == []


class SpillingKernel(FakeKernel):
    """Fits everywhere; spills ``spills(candidate)`` bytes a thread (read after the module loads)."""

    def __init__(self, spills):
        super().__init__(lambda kw: 1024)
        self.spills = spills

    def warmup(self, *args, grid, **kw):
        compiled = super().warmup(*args, grid=grid, **kw)
        compiled._init_handles = lambda: None
        compiled.n_spills = self.spills(kw)
        return compiled


def test_spill_fallback_only_where_the_asked_tile_spills(gpu_like, monkeypatch):
    x = types.SimpleNamespace(device=gpu_like, dtype=torch.bfloat16)
    monkeypatch.setattr(fit.torch, "Tensor", types.SimpleNamespace)
    spills_on_4 = SpillingKernel(lambda kw: 192 if kw["num_warps"] == 4 else 0)  # a Triton where 4 warps spill
    fit.launch_fitting(spills_on_4, (4,), (x,), {"num_warps": 4, "num_stages": 3}, what="op",
                       spill_fallback={"num_warps": 8})
    assert spills_on_4.launched == [{"num_warps": 8, "num_stages": 3}]
    clean = SpillingKernel(lambda kw: 0)  # a Triton where 4 warps do not spill: the asked tile stays
    fit.launch_fitting(clean, (4,), (x,), {"num_warps": 4, "num_stages": 3}, what="op2",
                       spill_fallback={"num_warps": 8})
    assert clean.launched == [{"num_warps": 4, "num_stages": 3}] and len(clean.compiles) == 1
    always = SpillingKernel(lambda kw: 64)  # every candidate spills: the first fitting one is still launched
    fit.launch_fitting(always, (4,), (x,), {"num_warps": 4, "num_stages": 2}, what="op3",
                       spill_fallback={"num_warps": 8})
    assert always.launched == [{"num_warps": 4, "num_stages": 2}]


class FakePersistent:
    """A persistent kernel's compiles: ``res(kw)`` gives (registers, shared memory, spills, raises at load)."""

    def __init__(self, res):
        self.res, self.compiles = res, []

    def warmup(self, *args, grid, **kw):
        regs, shared, spills, too_big = self.res(kw)
        self.compiles.append((grid[0], kw["STAGES"], kw["num_warps"]))

        def load():
            if too_big:
                raise fit.OutOfResources(shared, 232448, "shared memory")
        return types.SimpleNamespace(metadata=types.SimpleNamespace(shared=shared), n_regs=regs, n_spills=spills,
                                     _init_handles=load)


def _plan(nprog, cand):
    return {"NPROG": nprog, "STAGES": cand[0], "num_warps": cand[1]}


@pytest.fixture
def sm_like(gpu_like, monkeypatch):
    monkeypatch.setattr(fit, "_sm_resources", lambda index: (65536, 233472))  # an H200 SM's registers and memory
    return gpu_like


def test_persistent_grid_needs_every_program_resident(sm_like):
    """Two programs an SM are tried first; a candidate whose module does not load (OutOfResources) or needs more
    shared memory than the SM holds at that count is passed over; the choice is cached."""
    def res(kw):
        stages, warps = kw["STAGES"], kw["num_warps"]
        if stages == 6:
            return 128, 240000, 0, True  # over a block's shared memory: the module does not load
        if stages == 4:
            return 168, 120000, 0, False  # two programs' shared memory exceed the SM's: one an SM only
        return 128, 60000, 8 if warps == 4 else 0, False  # 4 warps spill

    kern = FakePersistent(res)
    chosen = {}
    cands = ((6, 4), (4, 4), (3, 4), (3, 8))
    got = fit.persistent_grid(kern, (), {}, sm_like, 132, "k", cands, _plan, chosen, "op")
    assert got == {"NPROG": 132, "STAGES": 4, "num_warps": 4}
    assert kern.compiles == [(264, 6, 4), (132, 6, 4), (264, 4, 4), (132, 4, 4)]
    assert fit.persistent_grid(kern, (), {}, sm_like, 132, "k", cands, _plan, chosen, "op") == got
    assert len(kern.compiles) == 4  # cached


def test_persistent_grid_registers_and_spills(sm_like):
    """Registers: 8 warps x 160 registers fit one program an SM (40960), not two; spilling candidates are passed
    over while a later one is spill-free."""
    kern = FakePersistent(lambda kw: (160, 50000, 4 if kw["STAGES"] == 3 else 0, False))
    got = fit.persistent_grid(kern, (), {}, sm_like, 132, "r", ((3, 8), (2, 8)), _plan, {}, "op")
    assert got == {"NPROG": 132, "STAGES": 2, "num_warps": 8}


def test_persistent_grid_spilling_fallback_and_error(sm_like):
    spill = FakePersistent(lambda kw: (128, 60000, 16, False))
    got = fit.persistent_grid(spill, (), {}, sm_like, 132, "s", ((3, 4), (2, 4)), _plan, {}, "op")
    assert got == {"NPROG": 264, "STAGES": 3, "num_warps": 4}  # the first resident one, though it spills
    never = FakePersistent(lambda kw: (255, 240000, 0, True))
    with pytest.raises(RuntimeError, match="op: no launch config lets the persistent grid be resident"):
        fit.persistent_grid(never, (), {}, sm_like, 132, "n", ((3, 4),), _plan, {}, "op")
