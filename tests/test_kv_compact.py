"""compact_kv against the reference: bitwise, overlapping ranges, scattered pages, untouched pool elsewhere."""
from __future__ import annotations

import math

import pytest
import torch

from specverify.kv_cache import compact_kv
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
