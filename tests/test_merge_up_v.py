"""tree_attention_mla_up_v: the absorbed-MLA attention with the split merge and each head's W_UV in one launch,
against the fp32 reference (attention, then W_UV) and against the two-launch chain it replaces (tree_attention_mla,
then mla_up_v).

CPU runs go through the Triton interpreter at small sizes; ``gpu`` tests run the Kimi-K2 / DeepSeek-V3 rank shapes on
the Gluon kernel. Every unused cache slot holds NaN (make_paged), every output starts as NaN.
"""
import pytest
import torch
from test_tree_attention import make_mask, make_paged

from specverify import attention as attn
from specverify.attention import plan_tree_attention_mla, tree_attention_mla, tree_attention_mla_up_v
from specverify.fused_ops import mla_up_v
from specverify.reference.attention import tree_attention_mla_reference
from specverify.reference.fused_ops import mla_up_v_reference


def _case(device, *, prefix_lens, k, h, r, dr, v, page_size, mask_kind, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    batch = len(prefix_lens)
    kv, table = make_paged(prefix_lens, k, page_size, (r + dr,), dtype, device, gen)
    ql = torch.randn(batch, k, h, r, generator=gen).to(dtype).to(device)
    qr = torch.randn(batch, k, h, dr, generator=gen).to(dtype).to(device)
    w_uv = (torch.randn(h, r, v, generator=gen) * r ** -0.5).to(dtype).to(device)
    prefix = torch.tensor(prefix_lens, dtype=torch.int64, device=device)
    mask = make_mask(mask_kind, k, batch, gen)
    return dict(ql=ql, qr=qr, kv=kv, table=table, prefix=prefix, mask=None if mask is None else mask.to(device),
                w_uv=w_uv)


def _check(device, poison, c, *, num_splits, config=None):
    ql, qr, kv, table, prefix, mask, w_uv = (c[n] for n in ("ql", "qr", "kv", "table", "prefix", "mask", "w_uv"))
    batch, k, h, r = ql.shape
    sm_scale = 192 ** -0.5
    plan = plan_tree_attention_mla(max_batch=batch, num_draft_tokens=k, num_heads=h, kv_lora_rank=r,
                                   rope_dim=qr.shape[3], max_context=table.shape[1] * kv.shape[1], device=device,
                                   dtype=ql.dtype, num_splits=num_splits, config=config)
    kw = dict(page_table=table, prefix_lens=prefix, tree_mask=mask, sm_scale=sm_scale, plan=plan)
    out = poison(torch.empty(batch, k, h * w_uv.shape[2], dtype=ql.dtype, device=device))
    got = tree_attention_mla_up_v(ql, qr, kv, w_uv, out=out, impl="triton", **kw)
    assert got is out and not torch.isnan(out).any()
    # the chain it replaces: the same split kernel and merge, the latent stored in ql's dtype, then W_UV
    chain = mla_up_v(tree_attention_mla(ql, qr, kv, impl="triton", **kw), w_uv, impl="triton")
    lat = tree_attention_mla_reference(ql.float(), qr.float(), kv.float(), table, prefix, mask, sm_scale)
    truth = mla_up_v_reference(lat, w_uv.float())
    err, err_chain = ((t.float() - truth).abs().max().item() for t in (out, chain))
    eps = torch.finfo(ql.dtype).eps
    # the same roundings as the chain but its sum order over the latent parts: the chain's error plus rounding of
    # the output (one ulp of the largest value) and fp32 reordering
    assert err <= err_chain + 2 * eps * truth.abs().max().item() + 1e-5, (err, err_chain)
    # a second launch reuses the self-reset tickets: the same bits
    again = tree_attention_mla_up_v(ql, qr, kv, w_uv, impl="triton", **kw)
    assert torch.equal(again, out)
    return plan


CASES = [
    # id, prefix_lens, k, heads, R, V, page size, mask, dtype, splits
    # Kimi-K2 rank dims (8 heads, 512 + 64, V 128), random trees, two splits: 16-column latent parts, 32 of them
    ("kimi-dims-random-split2", [16, 3], 2, 8, 512, 128, 16, "random", torch.bfloat16, 2),
    # small latent, top-k tree, page 1, a request with prefix 0 (empty splits: lse -inf) and one shorter than the
    # split count, fp16, V not a power of two (48)
    ("small-topk-ps1-empty-splits", [0, 3, 40], 3, 4, 64, 48, 1, "topk", torch.float16, 5),
    # one split: the attention writes the latent and mla_up_v follows (no merge kernel)
    ("one-split-chain", [21, 9], 2, 4, 64, 32, 4, "chain", torch.bfloat16, 1),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_merge_up_v_matches_reference(case, device, poison):
    _, prefix_lens, k, h, r, v, ps, mask, dtype, splits = case
    c = _case(device, prefix_lens=prefix_lens, k=k, h=h, r=r, dr=64, v=v, page_size=ps, mask_kind=mask,
              dtype=dtype, seed=sum(map(ord, case[0])))
    plan = _check(device, poison, c, num_splits=splits)
    assert plan.num_splits == splits


@pytest.mark.parametrize("splits, rows, want", [(64, 8, 32), (2, 8, 32), (2, 1, 16), (128, 512, 32), (4, 4096, 512)])
def test_latent_parts(splits, rows, want):
    # parts of [splits, columns] fp32 fit 4096 registers' worth; narrower parts until MERGE_UP_V_PROGRAMS programs
    assert attn._merge_up_v_block_j(512, splits, rows) == want


def test_bad_w_uv_and_out(device):
    c = _case(device, prefix_lens=[5], k=1, h=2, r=64, dr=64, v=32, page_size=4, mask_kind="chain",
              dtype=torch.bfloat16, seed=3)
    kw = dict(page_table=c["table"], prefix_lens=c["prefix"], sm_scale=0.1)
    with pytest.raises(ValueError, match=r"w_uv must be \[num_heads=2, kv_lora_rank=64, v_head_dim\]"):
        tree_attention_mla_up_v(c["ql"], c["qr"], c["kv"], c["w_uv"][:1], **kw)
    with pytest.raises(TypeError, match="w_uv must be torch.bfloat16"):
        tree_attention_mla_up_v(c["ql"], c["qr"], c["kv"], c["w_uv"].half(), **kw)
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.bfloat16 \[1, 1, 64\]"):
        tree_attention_mla_up_v(c["ql"], c["qr"], c["kv"], c["w_uv"], out=torch.empty(1, 1, 63, dtype=torch.bfloat16,
                                                                                       device=device), **kw)
    with pytest.raises(TypeError, match="w_uv must be a torch.Tensor"):
        tree_attention_mla_up_v(c["ql"], c["qr"], c["kv"], None, **kw)


def test_reference_impl(device):
    c = _case(device, prefix_lens=[7, 2], k=2, h=2, r=64, dr=64, v=16, page_size=4, mask_kind="chain",
              dtype=torch.bfloat16, seed=4)
    got = tree_attention_mla_up_v(c["ql"], c["qr"], c["kv"], c["w_uv"], page_table=c["table"],
                                  prefix_lens=c["prefix"], sm_scale=0.1, impl="reference")
    lat = tree_attention_mla_reference(c["ql"], c["qr"], c["kv"], c["table"], c["prefix"], None, 0.1)
    assert torch.equal(got, mla_up_v_reference(lat, c["w_uv"]))


GPU_CASES = [
    # Kimi-K2 rank at b 1 / 4k / k 1 as the verify pass plans it (64 splits), and k 4; DeepSeek-V3 rank (16 heads)
    # at b 4 / 16k, top-k tree of 2, page 1
    ("kimi-b1-k1", [4095], 1, 8, 64, "chain", None),
    ("kimi-b1-k4-ragged", [4092, 300], 4, 8, 64, "chain", None),
    ("dsv3-b4-k2-ps1", [16382, 16382, 9000, 5], 2, 16, 1, "topk", None),
    ("kimi-forced-128", [8000], 2, 8, 16, "random", 128),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_merge_up_v(case, poison, graph_replay):
    _, prefix_lens, k, h, ps, mask, splits = case
    c = _case("cuda", prefix_lens=prefix_lens, k=k, h=h, r=512, dr=64, v=128, page_size=ps, mask_kind=mask,
              dtype=torch.bfloat16, seed=sum(map(ord, case[0])))
    plan = _check("cuda", poison, c, num_splits=splits)
    assert plan.num_splits > 1
    kw = dict(page_table=c["table"], prefix_lens=c["prefix"], tree_mask=c["mask"], sm_scale=0.1, plan=plan,
              validate=False)
    graph_replay(lambda: tree_attention_mla_up_v(c["ql"], c["qr"], c["kv"], c["w_uv"], **kw), [c["ql"], c["qr"]])


@pytest.mark.gpu
def test_gpu_graph_keeps_its_buffers_across_draft_lengths():
    """A pass captured at one draft length replays right after eager calls at other lengths (each (token x head,
    parts) shape keeps its own partials and tickets; a buffer grown in place would leave the graph on freed memory)."""
    from conftest import warm_up_for_capture

    cases = {k: _case("cuda", prefix_lens=[4095, 2000], k=k, h=8, r=512, dr=64, v=128, page_size=64,
                      mask_kind="chain", dtype=torch.bfloat16, seed=k) for k in (1, 4, 8)}

    def step(k):
        c = cases[k]
        return tree_attention_mla_up_v(c["ql"], c["qr"], c["kv"], c["w_uv"], page_table=c["table"],
                                       prefix_lens=c["prefix"], sm_scale=0.1, validate=False)

    warm_up_for_capture(lambda: step(1))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(1)
    for k in (4, 8):  # other shapes after the capture
        step(k)
    for _ in range(2):
        cases[1]["ql"].copy_(torch.randn_like(cases[1]["ql"]))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, step(1))
