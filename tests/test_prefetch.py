"""L2 weight prefetch (``specverify.prefetch``): the grid's coverage on the interpreter (every byte of the budget
requested exactly once, nothing outside it), bad input, and on a GPU the forward with the side-stream prefetch
equal to the forward without it, eager and graph-replayed."""
from __future__ import annotations

import pytest
import torch

from specverify import prefetch as pf


def _expected(n: int, unit: int, units: int) -> torch.Tensor:
    exp = torch.zeros(units, dtype=torch.int32)
    for u in range(-(-n // unit)):
        exp[u] = min(unit, n - u * unit)
    return exp


@pytest.mark.parametrize("mode", ["line", "bulk"])
@pytest.mark.parametrize("budget", [1 << 30, 9000, 4000, 130])
@pytest.mark.parametrize("programs", [1, 3])
def test_coverage_each_byte_once(mode, budget, programs):
    g = torch.Generator().manual_seed(budget + programs)
    # a region shorter than a line (130 bytes' budget), an odd byte count (bf16 [7, 33]: 462 bytes, not a multiple
    # of 16), a misaligned view (bulk mode trims it to 16-byte edges) and more regions than a launch takes (5 > 4)
    base = torch.randn(6000, generator=g)
    ts = [torch.randn(1000, generator=g), torch.randn(7, 33, generator=g).to(torch.bfloat16), base[3:5003],
          torch.randn(300, generator=g), torch.randn(77, generator=g)]
    counts = pf.coverage(ts, max_bytes=budget, programs=programs, mode=mode)
    regions = pf.plan_regions(ts, budget, align=16 if mode == "bulk" else 1)
    unit = pf._unit(mode)
    assert sum(n for _, n in regions) <= budget
    for r, (view, n) in enumerate(regions):
        assert torch.equal(counts[r], _expected(n, unit, counts.shape[1])), (r, n)
        if mode == "bulk":
            assert view.data_ptr() % 16 == 0 and n % 16 == 0
    assert not counts[len(regions):].any()


def test_plan_cuts_at_the_budget_in_order():
    ts = [torch.zeros(100), torch.zeros(100), torch.zeros(100)]  # 400 bytes each
    regions = pf.plan_regions(ts, 1000)
    assert [n for _, n in regions] == [400, 400, 200]
    assert regions[2][0].data_ptr() == ts[2].data_ptr()
    assert pf.plan_regions(ts, 0) == []


def test_cpu_tensors_prefetch_nothing():
    assert pf.prefetch_l2([torch.zeros(10)]) == 0
    assert pf.prefetch_l2([]) == 0


@pytest.mark.parametrize("call, exc, text", [
    (lambda: pf.prefetch_l2(torch.zeros(4)), TypeError, "list or tuple of tensors"),
    (lambda: pf.prefetch_l2([torch.zeros(4), 3]), TypeError, r"tensors\[1\] must be a tensor"),
    (lambda: pf.prefetch_l2([torch.zeros(4, 4).t()]), ValueError, "contiguous"),
    (lambda: pf.prefetch_l2([torch.zeros(4)], max_bytes=-1), ValueError, "max_bytes"),
    (lambda: pf.prefetch_l2([torch.zeros(4)], programs=0), ValueError, "programs"),
    (lambda: pf.prefetch_l2([torch.zeros(4)], mode="dram"), ValueError, "mode"),
])
def test_bad_input(call, exc, text):
    with pytest.raises(exc, match=text):
        call()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["line", "bulk"])
def test_prefetch_runs_and_changes_nothing(mode):
    ts = [torch.randn(1 << 20, device="cuda"), torch.randn(3, 1001, device="cuda").to(torch.bfloat16)]
    before = [t.clone() for t in ts]
    assert pf.prefetch_l2(ts, mode=mode, programs=8) == sum(n for _, n in pf.plan_regions(
        ts, int(pf.l2_bytes(ts[0].device) * pf._CONFIG["l2_fraction"]), 16 if mode == "bulk" else 1))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        pf.prefetch_l2(ts, mode=mode)
    g.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(ts, before))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_forward_with_prefetch_equals_without():
    from specverify.forward.model import VerifyModel
    from specverify.forward.ops import provider_ops

    model = VerifyModel("kimi-k2", tp=8, num_layers=3, device="cuda")
    model.ops, _ = provider_ops("specverify", model)
    assert model.ops.prefetch_weights is not None
    b, k, ctx, page = 1, 4, 300, 64
    pages = -(-(ctx + k) // page)
    gen = torch.Generator(device="cuda").manual_seed(7)
    ids = torch.randint(0, model.shapes.vocab_size, (b, k), device="cuda", generator=gen)
    pos = torch.arange(ctx, ctx + k, device="cuda").view(1, k)
    pt = torch.arange(pages, dtype=torch.int32, device="cuda").view(1, pages)
    prefix = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    caches = model.allocate_kv(pages, page, fill=0.0)
    for c in caches:
        c.normal_(generator=gen)

    def run():
        return model.forward(ids, pos, caches, pt, prefix).clone()

    with_pf = run()
    slot, model.ops.prefetch_weights = model.ops.prefetch_weights, None
    without = run()
    model.ops.prefetch_weights = slot
    assert torch.equal(with_pf, without)  # the same kernels on the same inputs: bit-equal
    out = torch.full_like(with_pf, float("nan"))
    g = torch.cuda.CUDAGraph()
    run()
    with torch.cuda.graph(g):
        out.copy_(model.forward(ids, pos, caches, pt, prefix))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, with_pf)
