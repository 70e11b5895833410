"""The torch references against brute-force loops written straight from the definitions."""
import math
import random

import pytest
import torch

from specverify.reference.accept import greedy_accept_reference
from specverify.reference.attention import tree_attention_mla_reference, tree_attention_reference
from specverify.reference.kv import compact_kv_reference, write_draft_kv
from specverify.reference.moe import align_reference, route_reference
from specverify.tree import BatchedDraftTree, DraftTree


def _paged(batch, prefix_lens, k, page_size, pool_pages, g):
    need = max(prefix_lens) + k
    per = -(-need // page_size)
    pt = torch.randperm(pool_pages, generator=g)[: batch * per].view(batch, per).to(torch.int32)
    return pt


def test_tree_attention_reference_by_loop():
    g = torch.Generator().manual_seed(0)
    trees = [DraftTree([-1, 0, 0, 1, 2]), DraftTree.chain(5)]
    mask = BatchedDraftTree(trees).packed_mask
    prefix = [0, 7]  # an empty prefix and one ending inside a page
    ps, P, hkv, hq, d = 4, 12, 2, 4, 8
    pt = _paged(2, prefix, 5, ps, P, g)
    kc = torch.full((P, ps, hkv, d), float("nan"), dtype=torch.float64)
    vc = kc.clone()
    for b in range(2):
        write_draft_kv(kc, pt[b:b + 1], torch.tensor([0]), torch.randn(1, prefix[b] + 5, hkv, d, generator=g,
                                                                        dtype=torch.float64))
        write_draft_kv(vc, pt[b:b + 1], torch.tensor([0]), torch.randn(1, prefix[b] + 5, hkv, d, generator=g,
                                                                        dtype=torch.float64))
    q = torch.randn(2, 5, hq, d, generator=g, dtype=torch.float64)
    out, lse = tree_attention_reference(q, kc, vc, pt, torch.tensor(prefix, dtype=torch.int32), mask, 0.5,
                                        return_lse=True)
    assert not torch.isnan(out).any()
    for b in range(2):
        anc = trees[b].ancestor_mask()
        for i in range(5):
            pos = list(range(prefix[b])) + [prefix[b] + j for j in range(5) if anc[i, j]]
            for h in range(hq):
                ks = torch.stack([kc[pt[b, p // ps], p % ps, h // 2] for p in pos])
                vs = torch.stack([vc[pt[b, p // ps], p % ps, h // 2] for p in pos])
                s = ks @ q[b, i, h] * 0.5
                torch.testing.assert_close(out[b, i, h], torch.softmax(s, 0) @ vs)
                assert math.isclose(float(lse[b, i, h]), float(torch.logsumexp(s, 0)), rel_tol=1e-6)


def test_mla_reference_equals_gqa_with_one_kv_head():
    g = torch.Generator().manual_seed(1)
    P, ps, r, dr, h, k = 6, 4, 16, 8, 3, 3
    cache = torch.randn(P, ps, r + dr, generator=g, dtype=torch.float64)
    pt = torch.randperm(P, generator=g)[:4].view(1, 4).to(torch.int32)
    prefix = torch.tensor([9], dtype=torch.int32)
    ql = torch.randn(1, k, h, r, generator=g, dtype=torch.float64)
    qr = torch.randn(1, k, h, dr, generator=g, dtype=torch.float64)
    mla = tree_attention_mla_reference(ql, qr, cache, pt, prefix, None, 0.3)
    kcache = cache.unsqueeze(2)
    vpad = torch.cat([cache[..., :r], torch.zeros(P, ps, dr, dtype=torch.float64)], -1).unsqueeze(2)
    gqa = tree_attention_reference(torch.cat([ql, qr], -1), kcache, vpad, pt, prefix, None, 0.3)
    torch.testing.assert_close(mla, gqa[..., :r])


def _pool_of(seqs, page_size, g):
    """A NaN-filled paged pool holding one sequence [n_b, ...] per request on scattered pages, and its page table."""
    per = max(-(-s.shape[0] // page_size) for s in seqs)
    num_pages = len(seqs) * per + 2  # two spare pages stay NaN
    pool = torch.full((num_pages, page_size, *seqs[0].shape[1:]), float("nan"), dtype=seqs[0].dtype)
    table = torch.randperm(num_pages, generator=g)[: len(seqs) * per].view(len(seqs), per).to(torch.int32)
    for b, seq in enumerate(seqs):
        write_draft_kv(pool, table[b:b + 1], torch.tensor([0]), seq.unsqueeze(0))
    return pool, table


@pytest.mark.parametrize("kind", ["mla", "gqa"])
@pytest.mark.parametrize("prefix_lens", [[37], [37, 0, 70]], ids=["batch1", "batch3"])
def test_verify_rows_equal_decode_rows_bitwise(kind, prefix_lens):
    """The reference is batch-invariant: verify row i of a tree equals, bit for bit (out and lse), a k = 1 decode
    call whose query is that row and whose prefix is the request's prefix followed by the ancestors row i sees (its
    own KV last), whatever the tree, k and batch. Kimi-K2 rank sizes for MLA (8 heads, 512 + 64): fp32 products
    there sum in an order that follows the row count and missed by a bf16 ulp. Prefix 37 ends inside a page,
    prefix 0 leaves only the tree, 70 spans five pages of 16; bf16."""
    g = torch.Generator().manual_seed(11)
    trees = [DraftTree([-1, 0, 0, 1, 1, 2, 4, 0]), DraftTree.chain(8), DraftTree.topk_of_size(2, 8)]
    trees = trees[: len(prefix_lens)]
    batch, k, ps = len(prefix_lens), 8, 16
    mask = BatchedDraftTree(trees).packed_mask
    if kind == "mla":
        h, tail, qdims, scale = 8, (512 + 64,), ((512,), (64,)), 192 ** -0.5
    else:
        h, tail, qdims, scale = 8, (2, 128), ((128,),), 128 ** -0.5
    seqs = [torch.randn(n + k, *tail, generator=g).bfloat16() for n in prefix_lens]
    vseqs = [torch.randn(n + k, *tail, generator=g).bfloat16() for n in prefix_lens]
    qs = [torch.randn(batch, k, h, *d, generator=g).bfloat16() for d in qdims]

    def attend(queries, keys, values, prefix, tree_mask):
        kc, table = _pool_of(keys, ps, g)
        pre = torch.tensor(prefix, dtype=torch.int32)
        if kind == "mla":
            return tree_attention_mla_reference(*queries, kc, table, pre, tree_mask, scale, return_lse=True)
        vc = torch.full_like(kc, float("nan"))
        for b, v in enumerate(values):
            write_draft_kv(vc, table[b:b + 1], torch.tensor([0]), v.unsqueeze(0))
        return tree_attention_reference(*queries, kc, vc, table, pre, tree_mask, scale, return_lse=True)

    out, lse = attend(qs, seqs, vseqs, prefix_lens, mask)
    assert torch.isfinite(out.float()).all()
    for b, (tree, n) in enumerate(zip(trees, prefix_lens)):
        for i in range(k):
            seen = list(range(n)) + [n + j for j in tree.path_to(i)]  # prefix, ancestors, node i itself last
            one, one_lse = attend([q[b:b + 1, i:i + 1] for q in qs], [seqs[b][seen]], [vseqs[b][seen]],
                                  [len(seen) - 1], None)
            assert torch.equal(one[0, 0], out[b, i]), f"request {b} node {i}: out differs from its decode row"
            assert torch.equal(one_lse[0, 0], lse[b, i]), f"request {b} node {i}: lse differs from its decode row"


def test_route_reference_by_loop():
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    for e, top_k, n_group, topk_group in [(16, 4, 4, 2), (12, 3, 1, 1), (10, 2, 1, 1)]:
        logits = torch.randn(6, e, generator=g)
        logits[0, :] = logits[0, 0]  # all tied: lowest ids win
        logits[1, 3] = float("nan")  # NaN never wins
        bias = torch.randn(e, generator=g) * 0.1
        ids, w = route_reference(logits, top_k, "sigmoid", bias, n_group, topk_group, True, 2.0)
        for m in range(6):
            s = torch.sigmoid(logits[m].double()).tolist()
            c = [x + float(bias[i]) if not math.isnan(x) else -math.inf for i, x in enumerate(s)]
            allowed = set(range(e))
            if n_group > 1:
                gs = e // n_group
                score = [sum(sorted(c[j * gs:(j + 1) * gs], reverse=True)[:2]) for j in range(n_group)]
                best = sorted(range(n_group), key=lambda j: (-score[j], j))[:topk_group]
                allowed = {i for j in best for i in range(j * gs, (j + 1) * gs)}
            chosen = sorted(allowed, key=lambda i: (-c[i], i))[:top_k]
            assert ids[m].tolist() == chosen
            ws = [s[i] for i in chosen]
            torch.testing.assert_close(w[m].double(), torch.tensor([x / sum(ws) * 2.0 for x in ws],
                                                                   dtype=torch.float64), rtol=1e-5, atol=1e-6)
    del rng


def test_route_fills_rows_without_finite_scores():
    logits = torch.full((2, 8), float("-inf"))
    logits[1, 2] = 0.0  # softmax gives 1 to expert 2 and a finite 0 to the rest: lowest id fills slot 2
    ids, w = route_reference(logits, 2, "softmax")
    assert ids.tolist() == [[0, 1], [2, 0]]  # row 0: no finite score -> fillers 0, 1 (lowest ids, weight 0)
    assert w.tolist() == [[0.0, 0.0], [1.0, 0.0]]
    s_ids, e_ids, n = align_reference(ids, 8, 4)  # the fillers are aligned like any slot
    assert s_ids.tolist() == [0, 3, 4, 4, 1, 4, 4, 4, 2, 4, 4, 4] and e_ids.tolist() == [0, 1, 2] and n.tolist() == [12]


def test_greedy_accept_reference_by_walk():
    g = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    for _ in range(30):
        k = rng.randrange(1, 9)
        tree = DraftTree([-1] + [rng.randrange(i) for i in range(1, k)])
        draft = torch.randint(0, 3, (1, k), generator=g)  # 3 tokens: many matches and duplicate siblings
        target = torch.randint(0, 3, (1, k), generator=g)
        nodes, acc, toks = greedy_accept_reference(target, draft, tree.parents_tensor().unsqueeze(0))
        cur, path = 0, [0]
        while True:
            nxt = [c for c in tree.children(cur) if int(draft[0, c]) == int(target[0, cur])]
            if not nxt:
                break
            cur = nxt[0]
            path.append(cur)
        assert nodes[0, : len(path)].tolist() == path and int(acc[0]) == len(path) - 1
        assert toks[0, : len(path)].tolist() == [int(draft[0, n]) for n in path[1:]] + [int(target[0, cur])]


def test_compact_reference_moves_only_the_path():
    g = torch.Generator().manual_seed(0)
    P, ps = 10, 2
    cache = torch.randn(P, ps, 3, generator=g)
    before = cache.clone()
    pt = torch.tensor([[3, 1, 7, 5], [0, 9, 2, 8]], dtype=torch.int32)
    prefix = torch.tensor([1, 2], dtype=torch.int32)
    nodes = torch.tensor([[0, 2, 3, -1], [0, -1, -1, -1]])
    acc = torch.tensor([2, 0])
    compact_kv_reference([cache], pt, prefix, nodes, acc)
    flat, fb = cache.view(-1, 3), before.view(-1, 3)

    def slot(b, t):
        return int(pt[b, t // ps]) * ps + t % ps

    assert torch.equal(flat[slot(0, 2)], fb[slot(0, 3)]) and torch.equal(flat[slot(0, 3)], fb[slot(0, 4)])
    changed = (flat != fb).any(-1).nonzero().flatten().tolist()
    assert set(changed) <= {slot(0, 2), slot(0, 3)}


def test_fused_moe_by_expert_matches_the_per_token_loop():
    # the sweeps' fp64 truth (one expert at a time) against the per-token loop; an id of -1 adds nothing
    from specverify.reference.moe import fused_moe_by_expert_reference, fused_moe_loop_reference

    g = torch.Generator().manual_seed(3)
    m, h, inter, e, top_k = 5, 16, 8, 6, 3
    hidden = torch.randn(m, h, generator=g)
    w13, w2 = torch.randn(e, 2 * inter, h, generator=g), torch.randn(e, h, inter, generator=g)
    ids = torch.randint(0, e, (m, top_k), generator=g)
    ids[1, 2] = -1
    w = torch.rand(m, top_k, generator=g)
    want = fused_moe_loop_reference(hidden, w13, w2, ids, w)
    got = fused_moe_by_expert_reference(hidden, w13, w2, ids, w)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
