"""The kernels as a pytest-benchmark suite: ``pytest bench/ --benchmark-only`` on a GPU.

Each benchmark captures the op in a CUDA graph and times replay + synchronise, so figures include one graph launch
(a few µs); the per-op scripts (``bench/bench_*.py``) give device-event timings and bandwidth fractions.
"""
import math

import pytest
import torch

pytestmark = pytest.mark.gpu


def _graph(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()

    def replay():
        g.replay()
        torch.cuda.synchronize()
    return replay


@pytest.mark.parametrize("k", [1, 4, 8])
def test_tree_attention_mla_kimi(benchmark, k):
    import specverify as sv

    ctx, heads, page = 4096, 8, 64
    pages = -(-(ctx + k) // page)
    cache = torch.randn(pages + 1, page, 576, device="cuda", dtype=torch.bfloat16)
    pt = torch.randperm(pages + 1, device="cuda")[:pages].view(1, pages).int()
    pl = torch.tensor([ctx], device="cuda", dtype=torch.int32)
    ql = torch.randn(1, k, heads, 512, device="cuda", dtype=torch.bfloat16)
    qr = torch.randn(1, k, heads, 64, device="cuda", dtype=torch.bfloat16)
    mask = sv.DraftTree.topk_of_size(2, k).packed_mask().cuda()
    benchmark(_graph(lambda: sv.tree_attention_mla(ql, qr, cache, page_table=pt, prefix_lens=pl, tree_mask=mask,
                                                   sm_scale=1 / math.sqrt(192), impl="triton")))


@pytest.mark.parametrize("m", [1, 4, 16, 64])
def test_moe_route_kimi(benchmark, m):
    import specverify as sv

    logits = torch.randn(m, 384, device="cuda", dtype=torch.float32)
    bias = torch.randn(384, device="cuda") * 0.1
    sv.moe_route(logits, top_k=8, correction_bias=bias, routed_scaling_factor=2.827, block_size=16)
    benchmark(_graph(lambda: sv.moe_route(logits, top_k=8, correction_bias=bias, routed_scaling_factor=2.827,
                                          block_size=16, impl="triton")))


@pytest.mark.parametrize("m", [1, 4, 16])
def test_fused_moe_kimi(benchmark, m):
    import specverify as sv
    from specverify.reference.moe import random_expert_weights

    e, h, i = 384, 7168, 256
    w13, w2 = random_expert_weights(e, h, i, device="cuda")
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    ids, w = sv.moe_route(torch.randn(m, e, device="cuda"), top_k=8)
    benchmark(_graph(lambda: sv.fused_moe(x, w13, w2, ids, w, impl="triton")))


@pytest.mark.parametrize("k", [1, 4])
def test_verify_greedy_kimi_vocab(benchmark, k):
    import specverify as sv

    tree = sv.BatchedDraftTree.repeat(sv.DraftTree.chain(k), 1)
    logits = torch.randn(1, k, 163840, device="cuda", dtype=torch.float32)
    draft = torch.randint(0, 163840, (1, k), device="cuda")
    parents = tree.parents.cuda()
    sv.verify_greedy(draft, parents, logits=logits)
    benchmark(_graph(lambda: sv.verify_greedy(draft, parents, logits=logits, impl="triton")))
