"""Every public op over the shapes SGLang can send, on a GPU: none may raise, each matches its reference on a sample.

SGLang sends up to 64 draft tokens per request (``--speculative-num-draft-tokens``, chains and trees) at batch sizes
up to its largest CUDA graph (160 and more), with 1 to 128 attention heads per rank, page sizes 1 to 64 and prefixes
up to 128k tokens; routers see up to thousands of rows (prefill of a chunk). Each list below covers every value of
every axis at least once (the other axes at a middle value), plus the corners where tiles grow together (most heads
x most draft tokens, largest batch x longest k). Launch failures (a tile that does not fit the device's shared
memory, a grid over its limits) are what this file exists to catch; the values are checked too, on a sample of the
batch where the reference would be slow. GPU only: the interpreter cannot reach these sizes.
"""
from __future__ import annotations

import math

import pytest
import torch

import specverify as sv
from specverify.fused_ops import mla_absorb_q, mla_kv_prep, mla_up_v, rmsnorm, silu_mul
from specverify.reference.accept import greedy_accept_reference
from specverify.reference.fused_ops import mla_absorb_q_reference, mla_up_v_reference, rmsnorm_reference
from specverify.reference.moe import align_reference, fused_moe_reference, route_reference
from specverify.tree import BatchedDraftTree, DraftTree
from test_tree_attention import check_gqa, check_mla, make_paged

pytestmark = pytest.mark.gpu

BATCHES = (1, 3, 17, 64, 160)
DRAFT_TOKENS = (1, 2, 7, 16, 33, 64)
HEADS = (1, 8, 16, 128)
PAGE_SIZES = (1, 16, 64)
PREFIXES = (0, 1, 4095, 32768, 131072)


def _tree(kind: str, k: int) -> DraftTree:
    return DraftTree.chain(k) if kind == "chain" else DraftTree.topk_of_size(2, k)


def _mask(kind: str, k: int):
    return None if kind == "chain" else _tree(kind, k).packed_mask().cuda()


def _prefixes(batch: int, prefix: int, gen: torch.Generator) -> list[int]:
    """``prefix`` for the first request, the rest spread below it (0 included), so lengths differ in a batch."""
    if batch == 1:
        return [prefix]
    rest = torch.randint(0, max(1, prefix), (batch - 1,), generator=gen).tolist()
    return [prefix] + rest


def _sample(batch: int) -> list[int]:
    """Requests compared with the reference: the first (longest prefix), one in the middle, the last."""
    return sorted({0, batch // 2, batch - 1})


def _slice_rows(rows, *tensors):
    idx = torch.tensor(rows, device="cuda")
    return [None if t is None else (t[idx] if t.dim() >= 3 and t.shape[0] > 1 else t) for t in tensors]


# ---------------------------------------------------------------------------------------------- tree attention
# (batch, k, heads, page_size, prefix, tree); the first line is the base, then one axis at a time, then corners
MLA_SHAPES = [
    (4, 4, 16, 16, 4095, "topk"),
    *[(b, 4, 16, 16, 4095, "topk") for b in BATCHES if b != 4],
    *[(4, k, 16, 16, 4095, t) for k in DRAFT_TOKENS for t in ("chain", "topk")],
    *[(4, 4, h, 16, 4095, "topk") for h in HEADS if h != 16],
    *[(4, 4, 16, ps, 4095, "topk") for ps in PAGE_SIZES if ps != 16],
    *[(3, 4, 16, 64, p, "topk") for p in PREFIXES],
    (3, 64, 128, 1, 4095, "topk"),        # most heads x most draft tokens: 8192 query rows a request
    (160, 64, 16, 16, 4095, "topk"),      # largest batch x longest k
    (160, 16, 8, 1, 32768, "chain"),      # largest batch, page size 1, long prefix (Kimi-K2 per rank)
    (1, 64, 128, 64, 131072, "topk"),     # everything large at once, batch 1
]


@pytest.mark.parametrize("shape", MLA_SHAPES, ids=lambda s: "b{}-k{}-h{}-ps{}-pre{}-{}".format(*s))
def test_tree_attention_mla_shapes(shape, poison):
    batch, k, heads, ps, prefix, kind = shape
    gen = torch.Generator().manual_seed(hash(shape) % 2 ** 31)
    r, dr = 512, 64
    lens = _prefixes(batch, prefix, gen)
    kv, table = make_paged(lens, k, ps, (r + dr,), torch.bfloat16, "cuda", gen)
    ql = torch.randn(batch, k, heads, r, generator=gen).bfloat16().cuda()
    qr = torch.randn(batch, k, heads, dr, generator=gen).bfloat16().cuda()
    pl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    mask = _mask(kind, k)
    out = poison(ql)
    res, lse = sv.tree_attention_mla(ql, qr, kv, page_table=table, prefix_lens=pl, tree_mask=mask,
                                     sm_scale=192 ** -0.5, out=out, return_lse=True)
    torch.cuda.synchronize()
    rows = _sample(batch)
    idx = torch.tensor(rows, device="cuda")
    check_mla(ql[idx], qr[idx], kv, table[idx], pl[idx], mask, 192 ** -0.5, res[idx], lse[idx])


# (batch, k, q_heads, kv_heads, page_size, prefix, tree)
GQA_SHAPES = [
    (4, 4, 8, 1, 16, 4095, "topk"),
    *[(b, 4, 8, 1, 16, 4095, "topk") for b in BATCHES if b != 4],
    *[(4, k, 8, 1, 16, 4095, t) for k in DRAFT_TOKENS for t in ("chain", "topk")],
    (4, 4, 1, 1, 16, 4095, "topk"),
    (4, 4, 16, 2, 16, 4095, "topk"),
    (4, 4, 128, 8, 16, 4095, "topk"),
    *[(4, 4, 8, 1, ps, 4095, "topk") for ps in PAGE_SIZES if ps != 16],
    *[(3, 4, 8, 1, 64, p, "topk") for p in PREFIXES],
    (3, 64, 128, 1, 1, 4095, "topk"),     # 128 query heads on one KV head x 64 draft tokens
    (160, 64, 8, 1, 16, 4095, "topk"),
    (1, 64, 16, 2, 64, 131072, "topk"),
]


@pytest.mark.parametrize("shape", GQA_SHAPES, ids=lambda s: "b{}-k{}-hq{}-hkv{}-ps{}-pre{}-{}".format(*s))
def test_tree_attention_gqa_shapes(shape, poison):
    batch, k, hq, hkv, ps, prefix, kind = shape
    gen = torch.Generator().manual_seed(hash(shape) % 2 ** 31)
    d = 128
    lens = _prefixes(batch, prefix, gen)
    kc, table = make_paged(lens, k, ps, (hkv, d), torch.bfloat16, "cuda", gen)
    vc = torch.randn(kc.shape, generator=gen).bfloat16().cuda()
    q = torch.randn(batch, k, hq, d, generator=gen).bfloat16().cuda()
    pl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    mask = _mask(kind, k)
    out = poison(q)
    res, lse = sv.tree_attention(q, kc, vc, page_table=table, prefix_lens=pl, tree_mask=mask, sm_scale=d ** -0.5,
                                 out=out, return_lse=True)
    torch.cuda.synchronize()
    idx = torch.tensor(_sample(batch), device="cuda")
    check_gqa(q[idx], kc, vc, table[idx], pl[idx], mask, d ** -0.5, res[idx], lse[idx])


# -------------------------------------------------------------------------------------------------------- MoE
# (rows M, experts, top_k, scoring, n_group, topk_group)
ROUTE_SHAPES = [
    *[(m, 384, 8, "sigmoid", 1, 1) for m in (1, 2, 7, 16, 33, 64, 160, 1024, 4096)],   # Kimi-K2
    *[(m, 256, 8, "sigmoid", 8, 4) for m in (1, 64, 4096)],                              # DeepSeek-V3
    *[(m, 160, 6, "sigmoid", 8, 3) for m in (1, 64, 4096)],                              # 160 experts in 8 groups
    *[(m, 8, 1, "softmax", 1, 1) for m in (1, 64, 4096)],                                # 8 experts, top-1
    *[(m, 257, 16, "softmax", 1, 1) for m in (1, 64, 4096)],                             # prime count, top-16
    *[(m, 384, 16, "sigmoid", 1, 1) for m in (1, 160, 4096)],
    *[(m, 128, 8, "softmax", 1, 1) for m in (1, 160, 4096)],                             # Qwen3-30B-A3B
]


@pytest.mark.parametrize("shape", ROUTE_SHAPES, ids=lambda s: "m{}-e{}-top{}-{}-g{}-{}".format(*s))
@pytest.mark.parametrize("block_size", [None, 16])
def test_moe_route_shapes(shape, block_size):
    m, e, top_k, scoring, n_group, topk_group = shape
    gen = torch.Generator().manual_seed(m * 1009 + e)
    logits = torch.randn(m, e, generator=gen).cuda()
    bias = (torch.randn(e, generator=gen) * 0.1).cuda() if scoring == "sigmoid" else None
    res = sv.moe_route(logits, top_k=top_k, scoring=scoring, correction_bias=bias, n_group=n_group,
                       topk_group=topk_group, routed_scaling_factor=2.5, block_size=block_size)
    torch.cuda.synchronize()
    ids, w = res[0], res[1]
    rid, rw = route_reference(logits, top_k, scoring, bias, n_group, topk_group, True, 2.5)
    # random fp32 logits: exact ties between the chosen and the next score are vanishingly rare; compare as sets
    assert torch.equal(ids.sort(-1).values.long(), rid.sort(-1).values.long()), "expert ids differ"
    order_got, order_ref = ids.long().argsort(-1), rid.long().argsort(-1)
    torch.testing.assert_close(w.gather(1, order_got), rw.float().gather(1, order_ref), rtol=1e-5, atol=1e-6)
    if block_size is not None:
        al = res[2]
        ref = align_reference(ids, e, block_size)
        npad = int(al.num_tokens_post_padded.reshape(-1)[0])
        assert npad == int(ref[2].reshape(-1)[0]), "padded slot count differs from align_reference"
        got_sorted = al.sorted_token_ids[:npad]
        for blk in range(npad // block_size):  # every block holds slots of its expert only, each slot once
            ex = int(al.expert_ids[blk])
            slots = got_sorted[blk * block_size:(blk + 1) * block_size]
            slots = slots[slots < m * top_k]
            assert bool((ids.reshape(-1)[slots.long()] == ex).all()), f"block {blk} mixes experts"
        valid = got_sorted[got_sorted < m * top_k]
        assert torch.equal(valid.sort().values.long(), torch.arange(m * top_k, device="cuda")), "slots lost"


# (rows M, experts, top_k, hidden, intermediate per rank)
EXPERT_SHAPES = [
    *[(m, 384, 8, 7168, 256) for m in (1, 2, 7, 16, 33, 64, 160, 1024)],   # Kimi-K2, tp 8
    *[(m, 256, 8, 7168, 256) for m in (1, 64, 1024)],                      # DeepSeek-V3, tp 8
    (64, 160, 6, 5120, 192),                                               # 160 experts
    *[(m, 8, 1, 4096, 1792) for m in (1, 64, 1024)],                       # 8 experts, top-1 (Mixtral, tp 8)
    *[(m, 257, 16, 2048, 128) for m in (1, 64, 4096)],                     # prime experts, top-16, many rows
    *[(m, 128, 8, 2048, 768) for m in (1, 160)],                           # Qwen3-30B-A3B
]


@pytest.mark.parametrize("shape", EXPERT_SHAPES, ids=lambda s: "m{}-e{}-top{}-h{}-i{}".format(*s))
def test_fused_moe_shapes(shape, poison):
    m, e, top_k, hidden, inter = shape
    gen = torch.Generator().manual_seed(m * 31 + e)
    x = (torch.randn(m, hidden, generator=gen) * 0.5).bfloat16().cuda()
    w13 = (torch.randn(e, 2 * inter, hidden, generator=gen) * hidden ** -0.5).bfloat16().cuda()
    w2 = (torch.randn(e, hidden, inter, generator=gen) * inter ** -0.5).bfloat16().cuda()
    ids, w = sv.moe_route(torch.randn(m, e, generator=gen).cuda(), top_k=top_k, scoring="softmax")
    out = sv.fused_moe(x, w13, w2, ids, w, out=poison(x))
    torch.cuda.synchronize()
    rows = torch.tensor(sorted({0, m // 2, m - 1}), device="cuda")
    want = fused_moe_reference(x[rows], w13, w2, ids[rows], w[rows], compute_dtype=torch.float64)
    low = fused_moe_reference(x[rows], w13, w2, ids[rows], w[rows], compute_dtype=torch.bfloat16).double()
    tol = 2 * (low - want).abs().max().item() + 2 ** -8 * want.abs().max().item() + 1e-6
    err = (out[rows].double() - want).abs().max().item()
    assert err <= tol, f"fused_moe error {err:.3g} > tolerance {tol:.3g}"


@pytest.mark.parametrize("m,top_k", [(1, 8), (160, 8), (4096, 16)])
def test_append_shared_expert_shapes(m, top_k):
    ids = torch.randint(0, 384, (m, top_k), device="cuda", dtype=torch.int32)
    w = torch.rand(m, top_k, device="cuda")
    ids2, w2 = sv.append_shared_expert(ids, w, 384)
    torch.cuda.synchronize()
    assert torch.equal(ids2[:, :top_k], ids) and bool((ids2[:, top_k] == 384).all())
    assert torch.equal(w2[:, :top_k], w) and bool((w2[:, top_k] == 1).all())


# -------------------------------------------------------------------------------------------- acceptance and KV
# (batch, k, tree, vocab)
ACCEPT_SHAPES = [
    *[(b, 4, "topk", 163840) for b in (1, 3, 17)],
    *[(b, 4, "topk", 32000) for b in (64, 160)],
    *[(3, k, t, 163840) for k in DRAFT_TOKENS for t in ("chain", "topk")],
    (160, 64, "topk", 32000),
    (17, 33, "chain", 129280),
]


def _accept_inputs(batch, k, kind, vocab, gen):
    tree = BatchedDraftTree([_tree(kind, k)] * batch)
    logits = torch.randn(batch, k, vocab, generator=gen).cuda()
    target = logits.argmax(-1)
    # drafts that match the target's pick at their parent about half of the time, so accept lengths vary
    parents = tree.parents.cuda().long()
    pick = target.gather(1, parents.clamp(min=0))
    noise = torch.randint(0, vocab, (batch, k), generator=gen).cuda()
    draft = torch.where(torch.rand(batch, k, generator=gen).cuda() < 0.6, pick, noise)
    return tree, logits, target, draft


@pytest.mark.parametrize("shape", ACCEPT_SHAPES, ids=lambda s: "b{}-k{}-{}-v{}".format(*s))
def test_verify_greedy_shapes(shape):
    batch, k, kind, vocab = shape
    gen = torch.Generator().manual_seed(batch * 131 + k)
    tree, logits, target, draft = _accept_inputs(batch, k, kind, vocab, gen)
    toks, acc, nodes = sv.verify_greedy(draft, tree, logits=logits)
    torch.cuda.synchronize()
    rn, racc, rtoks = greedy_accept_reference(target, draft, tree.parents.cuda(), tree.max_depth)
    assert torch.equal(acc.long(), racc.long()), "accept lengths differ from the reference"
    width = rtoks.shape[1]
    assert torch.equal(toks[:, :width].long(), rtoks.long()) and torch.equal(nodes[:, :width].long(), rn.long())


@pytest.mark.parametrize("shape", ACCEPT_SHAPES, ids=lambda s: "b{}-k{}-{}-v{}".format(*s))
def test_verify_sampling_shapes(shape):
    batch, k, kind, vocab = shape
    gen = torch.Generator().manual_seed(batch * 137 + k)
    tree, logits, _, draft = _accept_inputs(batch, k, kind, vocab, gen)
    u = torch.rand(batch, tree.max_depth + 1, generator=gen).cuda()
    toks, acc, nodes = sv.verify_sampling(logits, tree, draft, temperature=0.8, top_k=50, top_p=0.9, uniform_samples=u)
    ref = sv.verify_sampling(logits, tree, draft, temperature=0.8, top_k=50, top_p=0.9, uniform_samples=u,
                             impl="reference")
    torch.cuda.synchronize()
    assert torch.equal(acc, ref[1]), "accept lengths differ from the reference"
    assert torch.equal(toks, ref[0]) and torch.equal(nodes, ref[2])


# (batch, k, page_size, prefix)
COMPACT_SHAPES = [
    *[(b, 16, 16, 4095) for b in BATCHES],
    *[(17, k, ps, 4095) for k in DRAFT_TOKENS for ps in PAGE_SIZES],
    *[(3, 8, 16, p) for p in PREFIXES],
]


@pytest.mark.parametrize("shape", COMPACT_SHAPES, ids=lambda s: "b{}-k{}-ps{}-pre{}".format(*s))
def test_compact_kv_shapes(shape):
    batch, k, ps, prefix = shape
    gen = torch.Generator().manual_seed(batch * 7 + k * 3 + ps)
    lens = _prefixes(batch, prefix, gen)
    pages = sum(math.ceil((p + k) / ps) for p in lens) + 1
    cache = torch.randn(pages, ps, 576, generator=gen).bfloat16().cuda()
    perm = torch.randperm(pages, generator=gen)
    table = torch.zeros(batch, max(math.ceil((p + k) / ps) for p in lens), dtype=torch.int32)
    used = 0
    for b, p in enumerate(lens):
        n = math.ceil((p + k) / ps)
        table[b, :n] = perm[used:used + n].int()
        used += n
    table, pl = table.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")
    tree = BatchedDraftTree([DraftTree.topk_of_size(2, k)] * batch)
    draft = torch.randint(0, 50, (batch, k), generator=gen).cuda()
    _, acc, nodes = sv.verify_greedy(draft, tree, target_ids=torch.randint(0, 50, (batch, k), generator=gen).cuda())
    want = cache.clone()
    from specverify.reference.kv import compact_kv_reference

    compact_kv_reference([want], table, pl, nodes, acc)
    sv.compact_kv(cache, table, pl, nodes, acc)
    torch.cuda.synchronize()
    assert torch.equal(cache, want), "compact_kv differs from the reference"


# ------------------------------------------------------------------------------------------------- small ops
@pytest.mark.parametrize("tokens", [1, 3, 64, 1056, 10240])   # batch x k: 1 x 1 .. 160 x 64
@pytest.mark.parametrize("heads", HEADS)
def test_mla_head_matmuls_shapes(tokens, heads, poison):
    gen = torch.Generator().manual_seed(tokens * 5 + heads)
    r, nope, v = 512, 128, 128
    q = torch.randn(tokens, 1, heads, nope + 64, generator=gen).bfloat16().cuda()
    w_uk = (torch.randn(heads, nope, r, generator=gen) * nope ** -0.5).bfloat16().cuda()
    o = torch.randn(tokens, 1, heads, r, generator=gen).bfloat16().cuda()
    w_uv = (torch.randn(heads, r, v, generator=gen) * r ** -0.5).bfloat16().cuda()
    ql = mla_absorb_q(q, w_uk, nope, out=poison(torch.empty(tokens, 1, heads, r, dtype=torch.bfloat16,
                                                             device="cuda")))
    ov = mla_up_v(o, w_uv, out=poison(torch.empty(tokens, 1, heads * v, dtype=torch.bfloat16, device="cuda")))
    torch.cuda.synchronize()
    for got, want, low in ((ql, mla_absorb_q_reference(q.double(), w_uk.double(), nope),
                            mla_absorb_q_reference(q, w_uk, nope)),
                           (ov, mla_up_v_reference(o.double(), w_uv.double()), mla_up_v_reference(o, w_uv))):
        tol = 2 * (low.double() - want).abs().max().item() + 2 ** -8 * want.abs().max().item()
        assert (got.double() - want).abs().max().item() <= tol


@pytest.mark.parametrize("tokens", [1, 64, 10240])
@pytest.mark.parametrize("width", [512, 1536, 7168])
def test_norm_and_activation_shapes(tokens, width):
    gen = torch.Generator().manual_seed(tokens + width)
    x = torch.randn(tokens, width, generator=gen).bfloat16().cuda()
    res = torch.randn(tokens, width, generator=gen).bfloat16().cuda()
    wt = torch.rand(width, generator=gen).bfloat16().cuda()
    y = rmsnorm(x, wt, 1e-6)
    y2, s = rmsnorm(x, wt, 1e-6, residual=res)
    act = silu_mul(torch.cat([x, res], dim=1))
    torch.cuda.synchronize()
    torch.testing.assert_close(y.float(), rmsnorm_reference(x.float(), wt.float(), 1e-6), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(s.float(), (x.float() + res.float()), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(y2.float(), rmsnorm_reference(s.float(), wt.float(), 1e-6), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(act.float(), torch.nn.functional.silu(x.float()) * res.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("batch,k,heads,ps", [(1, 1, 8, 1), (160, 64, 16, 16), (3, 33, 128, 64), (17, 7, 1, 1)])
def test_mla_kv_prep_shapes(batch, k, heads, ps):
    from specverify.reference.fused_ops import mla_kv_prep_reference

    gen = torch.Generator().manual_seed(batch + k + heads)
    r, dr, nope = 512, 64, 128
    lens = [4095] * batch
    pages = sum(math.ceil((p + k) / ps) for p in lens) + 1
    table = torch.randperm(pages, generator=gen)[: pages - 1].view(batch, -1).int().cuda()
    pl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, k, heads, nope + dr, generator=gen).bfloat16().cuda()
    kv = torch.randn(batch, k, r + dr, generator=gen).bfloat16().cuda()
    pos = (pl.long()[:, None] + torch.arange(k, device="cuda")).contiguous()
    wt = torch.rand(r, generator=gen).bfloat16().cuda()
    cache = torch.randn(pages, ps, r + dr, generator=gen).bfloat16().cuda()
    q2, cache2 = q.clone(), cache.clone()
    mla_kv_prep(q, kv, pos, wt, cache, table, pl, eps=1e-6, theta=10000.0, nope_dim=nope)
    mla_kv_prep_reference(q2, kv, pos, wt, cache2, table, pl, 1e-6, 10000.0, nope)
    torch.cuda.synchronize()
    torch.testing.assert_close(q.float(), q2.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(cache.float(), cache2.float(), rtol=2e-2, atol=2e-2)
