"""compact_kv against the reference: bitwise, overlapping ranges, scattered pages, untouched pool elsewhere."""
from __future__ import annotations

import math

import pytest
import torch

from specverify import kv_cache
from specverify.kv_cache import _compaction_runs, compact_kv
from specverify.reference.kv import compact_kv_reference


def _case(seed, page_size, row_shape, dtype, device):
    g = torch.Generator().manual_seed(seed)
    batch, length = 3, 5
    pages_per_req = -(-16 // page_size)
    num_pages = batch * pages_per_req + 3  # spare pages that belong to nobody
    pool = torch.randn(num_pages, page_size, *row_shape, generator=g).to(dtype)
    pool[num_pages - 1] = math.nan  # NaN page: must stay NaN bit for bit
    pool.view(-1)[::7] = math.nan    # NaN sprinkled everywhere (also inside moved rows)
    # scattered pages: a random permutation, not contiguous per request
    perm = torch.randperm(num_pages - 1, generator=g)[: batch * pages_per_req]
    page_table = perm.view(batch, pages_per_req)
    prefix = torch.tensor([0, 3, 7])          # 3, 7: the path crosses a page boundary for page_size 4/16 cases
    # accepted paths: strictly increasing nodes; request 1 overlaps heavily (node 1 -> pos 1, node 2 -> pos 2 ...)
    nodes = torch.tensor([[0, 2, 5, 7, -1], [0, 1, 2, 4, 8], [0, 3, -1, -1, -1]])
    alen = torch.tensor([3, 4, 1])
    return pool.to(device), page_table.to(device), prefix.to(device), nodes.to(device), alen.to(device)


@pytest.mark.parametrize("page_size,row_shape,dtype", [
    (1, (2, 8), torch.float32),     # page size 1, GQA-like [Hkv, D]
    (16, (2, 8), torch.bfloat16),   # page size 16: several positions per page
    (4, (36,), torch.float16),      # MLA-like flat latent row of odd width (576 / 16), page boundary crossing
])
def test_compact_matches_reference_and_touches_nothing_else(page_size, row_shape, dtype, device):
    pool, pt, prefix, nodes, alen = _case(0, page_size, row_shape, dtype, device)
    other = pool.clone() + 1  # a second cache (the "v" of the same layer)
    ref_pool, ref_other = pool.cpu().clone(), other.cpu().clone()
    compact_kv_reference([ref_pool, ref_other], pt.cpu(), prefix.cpu(), nodes.cpu(), alen.cpu())
    before = pool.cpu().clone()
    compact_kv([pool, other], pt, prefix, nodes, alen, impl="triton")
    for got, want in ((pool.cpu(), ref_pool), (other.cpu(), ref_other)):
        # bitwise: compare the raw bits (NaN payloads included)
        bits = torch.int16 if got.element_size() == 2 else torch.int32
        assert torch.equal(got.view(bits), want.view(bits))
    # the written slots are exactly the destinations d = 1..accept_len with node != d
    flat = pool.cpu().view(-1, *row_shape).view(pool.shape[0] * page_size, -1)
    flat_before = before.view(pool.shape[0] * page_size, -1)
    bits = torch.int16 if flat.element_size() == 2 else torch.int32
    changed = (flat.view(bits) != flat_before.view(bits)).any(-1).nonzero().view(-1).tolist()
    allowed = set()
    for b in range(3):
        for d in range(1, int(alen[b]) + 1):
            pos = int(prefix[b]) + d
            allowed.add(int(pt[b, pos // page_size]) * page_size + pos % page_size)
    assert set(changed) <= allowed


@pytest.mark.gpu
def test_compact_graph_capture_gpu():
    pool, pt, prefix, nodes, alen = _case(1, 16, (576,), torch.bfloat16, "cuda")
    compact_kv([pool], pt, prefix, nodes, alen)  # eager warm-up (compiles)
    pool2, *_ = _case(1, 16, (576,), torch.bfloat16, "cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compact_kv([pool2], pt, prefix, nodes, alen)
    fresh, *_ = _case(2, 16, (576,), torch.bfloat16, "cuda")
    pool2.copy_(fresh)
    nodes.copy_(torch.tensor([[0, 1, 3, -1, -1], [0, 2, 3, 4, 6], [0, 1, 2, 3, 4]], device="cuda"))
    alen.copy_(torch.tensor([2, 4, 4], device="cuda"))
    ref = fresh.cpu().clone()
    compact_kv_reference([ref], pt.cpu(), prefix.cpu(), nodes.cpu(), alen.cpu())
    graph.replay()
    assert torch.equal(pool2.cpu().view(torch.int16), ref.view(torch.int16))


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("nodes,alen,page_table,match", [
    # accept_len past the accepted_nodes columns
    ([[0, 1, 2]], [3], None, "accept_len\\[0\\] = 3 is outside \\[0, 2\\]"),
    ([[0, 1, 2]], [-1], None, "accept_len\\[0\\] = -1"),
    # a node below its depth (-1 inside the used part) and nodes out of order
    ([[0, -1, 2]], [2], None, "must strictly increase"),
    ([[0, 3, 2]], [2], None, "must strictly increase"),
    # a node past the page table: position 2 + 30 with 8 one-slot pages
    ([[0, 30, -1]], [1], None, "reads position 32"),
    # a page id outside the pool (page 99 of 8)
    ([[0, 3, -1]], [1], [[0, 1, 2, 3, 4, 99, 6, 7]], "page id 99"),
])
def test_compact_rejects_bad_values(impl, nodes, alen, page_table, match):
    # the kernel trusts its indices: every value it would misuse is caught at the public function, and the pool is
    # left as it was
    pool = torch.arange(8.0).view(8, 1, 1)
    pt = torch.tensor(page_table) if page_table is not None else torch.arange(8).view(1, 8)
    with pytest.raises(ValueError, match=match):
        compact_kv([pool], pt, torch.tensor([2]), torch.tensor(nodes), torch.tensor(alen), impl=impl)
    assert pool.view(-1).tolist() == [float(i) for i in range(8)]
    with pytest.raises(ValueError, match="prefix_lens\\[0\\] = -2"):
        compact_kv([pool], pt, torch.tensor([-2]), torch.tensor([[0, 1, 2]]), torch.tensor([1]), impl=impl)


# ------------------------------------------------------------------------------------- one launch per run of caches
def _paths(g, batch, length, k):
    """Random accepted paths: accept_len in [0, length - 1], nodes sorted distinct draft nodes 1..k-1 (so strictly
    increasing and never below their depth), -1 padding."""
    nodes = torch.full((batch, length), -1, dtype=torch.int64)
    nodes[:, 0] = 0
    alen = torch.randint(0, length, (batch,), generator=g)
    for b in range(batch):
        a = int(alen[b])
        nodes[b, 1:a + 1] = (torch.randperm(k - 1, generator=g)[:a] + 1).sort().values
    return nodes, alen


def _paged(g, batch, k, page_size):
    """Scattered pages for ``batch`` requests of prefix + k positions, two spare pages that belong to nobody."""
    prefix = torch.randint(0, 2 * page_size, (batch,), generator=g)
    per = -(-(int(prefix.max()) + k) // page_size)
    num_pages = batch * per + 2
    table = torch.randperm(num_pages, generator=g)[: batch * per].view(batch, per)
    return num_pages, table, prefix


def _randn_nan(g, shape, dtype):
    t = torch.randn(*shape, generator=g).to(dtype)
    t.view(-1)[::5] = math.nan  # NaN inside moved rows too: copies must carry them bit for bit
    return t


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


# each case: (buffers to allocate [shape, ...], caches made from those buffers, expected run lengths). Pages of
# num_pages P, page_size ps; rows are small (interpreter) with odd widths where it matters.
def _mla_layers(bufs):  # allocate_kv's MLA layout: buf[l] of [layers, P, ps, row]
    return list(bufs[0])


def _gqa_pairs(bufs):  # allocate_kv's GQA layout flattened as the verify pass does: buf[l, 0], buf[l, 1]
    return [c for layer in bufs[0] for c in layer]


def _separate(bufs):  # separate allocations: a run of one each (the old per-cache launches)
    return list(bufs)


def _mixed(bufs):  # a run of 3, a lone cache, a run of 2 (of another buffer), a lone narrower view of that buffer
    a, lone, b = bufs
    return [a[0], a[1], a[2], lone, b[1], b[2], b[0][:, :, :5]]


def _reversed(bufs):  # one buffer's layers last to first: a run with a negative step
    return list(bufs[0])[::-1]


def _repeated(bufs):  # the same tensor twice (compacted twice, in order, as before), then a run of 2 from it
    a = bufs[0]
    return [a[0], a[0], a[1], a[0]]


def _overlapping(bufs):  # views one page apart: overlapping, never one run; launched in list order
    a = bufs[0]
    return [a[:-1], a[1:], a[:-1]]


def _interleaved(bufs):  # k and v interleaved per slot ([P, ps, 2, H, D]): a step below the span, so no run
    a = bufs[0]
    return [a[:, :, 0], a[:, :, 1]]


_RUN_CASES = {
    "mla_layers": (lambda P, ps: [(4, P, ps, 36)], _mla_layers, [4]),
    "gqa_pairs": (lambda P, ps: [(3, 2, P, ps, 2, 8)], _gqa_pairs, [6]),
    "separate": (lambda P, ps: [(P, ps, 36)] * 3, _separate, [1, 1, 1]),
    "mixed": (lambda P, ps: [(3, P, ps, 12), (P, ps, 12), (3, P, ps, 12)], _mixed, [3, 1, 2, 1]),
    "reversed": (lambda P, ps: [(4, P, ps, 12)], _reversed, [4]),
    "repeated": (lambda P, ps: [(2, P, ps, 12)], _repeated, [1, 2, 1]),
    "overlapping": (lambda P, ps: [(P + 1, ps, 12)], _overlapping, [1, 1, 1]),
    "interleaved": (lambda P, ps: [(P, ps, 2, 2, 8)], _interleaved, [1, 1]),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", list(_RUN_CASES))
def test_compact_runs_match_reference(case, dtype, device):
    shapes, make, counts = _RUN_CASES[case]
    g = torch.Generator().manual_seed(list(_RUN_CASES).index(case) * 10 + dtype.itemsize)
    batch, length, k, page_size = 3, 4, 6, 4  # page size 4 with prefixes up to 7: paths cross page boundaries
    num_pages, table, prefix = _paged(g, batch, k, page_size)
    nodes, alen = _paths(g, batch, length, k)
    bufs = [_randn_nan(g, s, dtype) for s in shapes(num_pages, page_size)]
    ref_bufs = [b.clone() for b in bufs]
    compact_kv_reference(make(ref_bufs), table, prefix, nodes, alen)
    bufs = [b.to(device) for b in bufs]
    caches = make(bufs)
    assert [n for _, n, _ in _compaction_runs(caches)] == counts
    compact_kv(caches, table.to(device), prefix.to(device), nodes.to(device), alen.to(device), impl="triton")
    for got, want in zip(bufs, ref_bufs):  # whole buffers: nothing outside the views' written slots changes
        assert torch.equal(_bits(got.cpu()), _bits(want))


def test_compact_run_split_at_the_grid_limit(monkeypatch, device):
    # a run longer than grid axis 2 allows is served by several launches; the limit lowered to 3 so a tiny buffer
    # of 7 layers needs three (3 + 3 + 1)
    monkeypatch.setattr(kv_cache, "_GRID_Z_MAX", 3)
    g = torch.Generator().manual_seed(7)
    num_pages, table, prefix = _paged(g, 2, 5, 2)
    nodes, alen = _paths(g, 2, 4, 5)
    buf = _randn_nan(g, (7, num_pages, 2, 10), torch.float16)
    want = buf.clone()
    compact_kv_reference(list(want), table, prefix, nodes, alen)
    buf = buf.to(device)
    counter = _count_launches(monkeypatch)
    compact_kv(list(buf), table.to(device), prefix.to(device), nodes.to(device), alen.to(device), impl="triton")
    assert [grid[2] for grid in counter.grids] == [3, 3, 1]
    assert torch.equal(_bits(buf.cpu()), _bits(want))


def _count_launches(monkeypatch):
    from conftest import spy_launches
    from specverify.kernels import kv_compact

    return spy_launches(monkeypatch, kv_compact, "_kv_compact_kernel")


def test_compaction_runs_of_a_four_layer_buffer():
    buf = torch.zeros(4, 5, 2, 2, 3)  # [layers, P, ps, Hkv, D]
    (base, count, stride), = _compaction_runs(list(buf))
    assert base.data_ptr() == buf.data_ptr() and count == 4 and stride == buf.stride(0)
    # last to first: the same run, launched from its lowest cache
    (base, count, stride), = _compaction_runs(list(buf)[::-1])
    assert base.data_ptr() == buf.data_ptr() and count == 4 and stride == buf.stride(0)
    # GQA pairs [layers, 2, ...] flattened (k0, v0, k1, v1, ...): one run of 2 x layers
    pairs = torch.zeros(4, 2, 5, 2, 2, 3)
    (base, count, stride), = _compaction_runs([c for layer in pairs for c in layer])
    assert base.data_ptr() == pairs.data_ptr() and count == 8 and stride == pairs.stride(1)
    # every other layer: still equally spaced, one run with twice the step
    assert [(n, s) for _, n, s in _compaction_runs(list(buf)[::2])] == [(2, 2 * buf.stride(0))]
    # a gap breaks the step: layers 0, 1, 3 are a run of 2 and a lone cache
    assert [n for _, n, _ in _compaction_runs([buf[0], buf[1], buf[3]])] == [2, 1]
    # separate allocations of the same shape, even if the allocator happens to space them evenly
    assert [n for _, n, _ in _compaction_runs([torch.zeros(5, 2, 2, 3) for _ in range(4)])] == [1, 1, 1, 1]
    # one storage seen as another dtype of the same width: not one run
    assert [n for _, n, _ in _compaction_runs([buf[0], buf[1].view(torch.int32)])] == [1, 1]


def test_compact_one_launch_for_a_four_layer_buffer(monkeypatch, device):
    g = torch.Generator().manual_seed(11)
    num_pages, table, prefix = _paged(g, 2, 4, 4)
    nodes, alen = _paths(g, 2, 3, 4)
    buf = _randn_nan(g, (4, num_pages, 4, 20), torch.bfloat16).to(device)
    counter = _count_launches(monkeypatch)
    compact_kv(list(buf), table.to(device), prefix.to(device), nodes.to(device), alen.to(device), impl="triton")
    assert len(counter.grids) == 1 and counter.grids[0][2] == 4
    counter.grids.clear()
    compact_kv([b.clone() for b in buf], table.to(device), prefix.to(device), nodes.to(device), alen.to(device),
               impl="triton")
    assert len(counter.grids) == 4  # separate allocations: one launch each, as before


@pytest.mark.parametrize("model_name", ["tiny-mla-moe", "tiny-gqa"])
def test_allocate_kv_is_one_buffer_compacted_in_one_launch(model_name, monkeypatch, device):
    from specverify.forward.model import VerifyModel
    from specverify.forward.step import token_slot_caches

    m = VerifyModel(model_name, dtype=torch.float32, device=device, seed=0)
    g = torch.Generator().manual_seed(5)
    page_size = 4
    num_pages, table, prefix = _paged(g, 2, 4, page_size)
    nodes, alen = _paths(g, 2, 3, 4)
    caches = m.allocate_kv(num_pages, page_size, fill=math.nan)
    flat = [c for layer in caches for c in layer]  # as the verify pass hands them to compact_kv
    assert len(caches) == m.num_layers and all(len(layer) == (1 if "mla" in model_name else 2) for layer in caches)
    assert len({c.untyped_storage().data_ptr() for c in flat}) == 1
    assert all(c.is_contiguous() and tuple(c.shape[:2]) == (num_pages, page_size) for c in flat)
    assert all(torch.isnan(c).all() for c in flat)  # fill reaches every view
    g_dev = torch.Generator(device=device).manual_seed(6)
    for c in flat:  # the callers' per-view normal_() stays inside its view and gives each its own values
        c.normal_(generator=g_dev)
    assert not any(torch.isnan(c).any() for c in flat)
    assert not any(torch.equal(a, b) for a, b in zip(flat, flat[1:]))
    slots = token_slot_caches(caches)  # views of the views: the same memory as token slots
    assert all(s.data_ptr() == c.data_ptr() and s.shape[0] == num_pages * page_size
               for layer_s, layer_c in zip(slots, caches) for s, c in zip(layer_s, layer_c))
    assert len(_compaction_runs(flat)) == 1 and len(_compaction_runs([c for ls in slots for c in ls])) == 1

    want = [c.cpu().clone() for c in flat]
    compact_kv_reference(want, table, prefix, nodes, alen)
    counter = _count_launches(monkeypatch)
    compact_kv(flat, table.to(device), prefix.to(device), nodes.to(device), alen.to(device), impl="triton")
    assert len(counter.grids) == 1 and counter.grids[0][2] == len(flat)
    for got, ref in zip(flat, want):
        assert torch.equal(_bits(got.cpu()), _bits(ref))


@pytest.mark.gpu
def test_compact_graph_capture_of_a_run_gpu():
    # one launch over the 3 layers of one buffer, captured; replayed after the pool and the paths change in place
    g = torch.Generator().manual_seed(13)
    num_pages, table, prefix = _paged(g, 3, 5, 16)
    nodes, alen = _paths(g, 3, 4, 5)
    buf = _randn_nan(g, (3, num_pages, 16, 576), torch.bfloat16).cuda()
    table, prefix, nodes, alen = (t.cuda() for t in (table, prefix, nodes, alen))
    compact_kv(list(buf), table, prefix, nodes, alen)  # eager warm-up (compiles)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compact_kv(list(buf), table, prefix, nodes, alen)
    fresh = _randn_nan(g, tuple(buf.shape), torch.bfloat16)
    new_nodes, new_alen = _paths(g, 3, 4, 5)
    buf.copy_(fresh)
    nodes.copy_(new_nodes)
    alen.copy_(new_alen)
    compact_kv_reference(list(fresh), table.cpu(), prefix.cpu(), new_nodes, new_alen)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(_bits(buf.cpu()), _bits(fresh))
