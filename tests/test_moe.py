"""moe_route (routing + alignment in one launch) and fused_moe against the torch references.

CPU: Triton interpreter, tiny token counts (routing runs at the real expert counts: it is cheap). GPU-marked tests
run the real per-rank sizes and a CUDA-graph capture.
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import warm_up_for_capture

from specverify.moe import MoEAlignment, fused_moe, max_num_tokens_padded, moe_route
from specverify.reference.moe import (align_reference, fused_moe_loop_reference, fused_moe_reference,
                                      random_expert_weights, route_reference)

GAP = 1e-5  # biased scores closer than this (but not equal) may order differently under fp32 rounding


def _softmax64(x):
    """fp64 softmax under moe_route's contract: a NaN logit is -inf; +inf logits share the probability evenly."""
    x = torch.where(torch.isnan(x), -math.inf, x)
    pos_inf = x == math.inf
    x = torch.where(pos_inf.any(-1, keepdim=True), torch.where(pos_inf, 0.0, -math.inf).double(), x)
    return torch.softmax(x, -1)


def _choice64(x, scoring, bias, n_group, topk_group):
    """Biased scores in fp64 after the group mask (the reference's recipe, fp64), and the group scores."""
    x = x.double()
    s = torch.sigmoid(x) if scoring == "sigmoid" else _softmax64(x)
    c = s if bias is None else s + bias.double()
    c = torch.where(torch.isfinite(c), c, torch.full_like(c, -math.inf))
    m, e = c.shape
    gs = None
    if n_group > 1:
        g = c.view(m, n_group, e // n_group)
        gs = g.sort(dim=-1, descending=True, stable=True).values[..., :2].sum(-1)
        keep = torch.zeros(m, n_group, dtype=torch.bool)
        keep.scatter_(1, gs.sort(dim=-1, descending=True, stable=True).indices[:, :topk_group], True)
        c = torch.where(keep.repeat_interleave(e // n_group, 1), c, torch.full_like(c, -math.inf))
    return s, c, gs


def _near_tie(v, count):
    """Rows whose first ``count`` sorted values hold a pair closer than GAP without being equal."""
    top = v.sort(-1, descending=True).values[:, :count]
    d = (top[:, :-1] - top[:, 1:]).abs()
    finite = torch.isfinite(top[:, :-1]) & torch.isfinite(top[:, 1:])
    return ((d > 0) & (d < GAP) & finite).any(-1)


def check_route(x, top_k, scoring="sigmoid", bias=None, n_group=1, topk_group=1, renormalize=True, scale=1.0,
                block_size=None):
    """Runs the Triton path and checks ids, weights and alignment against the reference; returns the outputs."""
    res = moe_route(x, top_k=top_k, scoring=scoring, correction_bias=bias, n_group=n_group, topk_group=topk_group,
                    renormalize=renormalize, routed_scaling_factor=scale, block_size=block_size, impl="triton")
    ids, w = res[0], res[1]
    rid, rw = route_reference(x, top_k, scoring, bias, n_group, topk_group, renormalize, scale)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert ids.shape == (x.shape[0], top_k) and w.shape == ids.shape
    ids_c, w_c, rid_c, rw_c = ids.cpu(), w.cpu(), rid.cpu(), rw.cpu()
    s64, c64, gs = _choice64(x.cpu(), scoring, None if bias is None else bias.cpu(), n_group, topk_group)
    ambiguous = _near_tie(c64, min(top_k + 1, c64.shape[1]))
    if gs is not None:
        ambiguous |= _near_tie(gs, min(topk_group + 1, n_group))
    exact = ~ambiguous
    assert torch.equal(ids_c[exact], rid_c[exact]), "expert ids differ from route_reference"
    for r in ambiguous.nonzero().flatten().tolist():  # near-ties: the chosen biased scores must match in value
        got = torch.where(ids_c[r] >= 0, c64[r][ids_c[r].clamp(min=0).long()], -math.inf)
        want = torch.where(rid_c[r] >= 0, c64[r][rid_c[r].clamp(min=0).long()], -math.inf)
        assert torch.allclose(got.sort().values, want.sort().values, atol=2 * GAP, rtol=0)
    # every id a distinct expert in [0, E); a slot whose biased score is not finite is a filler of weight 0
    e = x.shape[1]
    assert int(ids_c.min()) >= 0 and int(ids_c.max()) < e, "ids must stay in [0, E)"
    srt = ids_c.sort(-1).values
    assert bool((srt[:, 1:] != srt[:, :-1]).all()), "an expert chosen twice in one row"
    # weights: fp64 weights of the reference's ids; the kernel may err twice as much as the fp32 reference + floor
    valid = torch.isfinite(c64.gather(1, rid_c.long()))
    w64 = torch.where(valid, s64.gather(1, rid_c.long()), torch.zeros((), dtype=torch.float64))
    if renormalize:
        tot = w64.sum(-1, keepdim=True)
        w64 = torch.where(tot > 0, w64 / torch.where(tot > 0, tot, torch.ones_like(tot)), w64)
    w64 = w64 * scale
    ref_err = (rw_c[exact].double() - w64[exact]).abs().max().item() if exact.any() else 0.0
    tol = 2 * ref_err + 1e-6 * max(1.0, abs(scale))
    assert (w_c[exact].double() - w64[exact]).abs().max().item() <= tol if exact.any() else True
    filler = ~torch.isfinite(c64.gather(1, ids_c.long()))
    assert torch.equal(w_c[filler], torch.zeros_like(w_c[filler])), "fillers (no finite candidate) weigh 0"
    if block_size is not None:
        check_alignment(ids, x.shape[1], block_size, res[2])
    else:
        assert len(res) == 2
    return res


def _poison_torch_empty(monkeypatch, moe_mod):
    """Every torch.empty the MoE launchers make comes back filled with NaN (floats) or -7 (integers), so an output
    element a kernel forgets to write cannot pass (monkeypatch restores torch.empty)."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(math.nan) if t.is_floating_point() else t.fill_(-7)

    monkeypatch.setattr(moe_mod.torch, "empty", poisoned)


def check_alignment(ids, num_experts, block_size, al):
    """Counts, padding and expert blocks exact; slots compared as a set per expert (their order is free); entries
    of sorted_token_ids past the used part are unspecified."""
    assert isinstance(al, MoEAlignment) and al.block_size == block_size
    m, top_k = ids.shape
    size = max_num_tokens_padded(m, top_k, num_experts, block_size)
    assert al.sorted_token_ids.shape == (size,) and al.expert_ids.shape == (size // block_size,)
    rs, re, rn = align_reference(ids, num_experts, block_size)
    n = int(al.num_tokens_post_padded.item())
    assert n == int(rn.item()) and n % block_size == 0
    got_s, got_e = al.sorted_token_ids.cpu(), al.expert_ids.cpu()
    assert torch.equal(got_e[: n // block_size], re.cpu()), "expert of each used block"
    assert (got_e[n // block_size:] == -1).all(), "unused blocks must be -1"
    rs = rs.cpu()
    for e in re.unique().tolist():
        blocks = (re.cpu() == e).nonzero().flatten()
        lo, hi = int(blocks[0]) * block_size, (int(blocks[-1]) + 1) * block_size
        assert sorted(got_s[lo:hi].tolist()) == sorted(rs[lo:hi].tolist()), f"slots of expert {e}"


# --------------------------------------------------------------------------------------------- routing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kimi_k2(device, dtype):
    # Kimi-K2: 384 experts (not a power of two), one group, sigmoid + bias, top-8, scale 2.827
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 384, generator=g).to(dtype).to(device)
    bias = (torch.randn(384, generator=g) * 0.05).to(device)
    check_route(x, 8, bias=bias, scale=2.827, block_size=16)


def test_deepseek_v3_groups(device):
    # DeepSeek-V3: 256 experts in 8 groups, the best 4 groups compete, top-8, scale 2.5
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 256, generator=g).to(device)
    bias = (torch.randn(256, generator=g) * 0.05).to(device)
    check_route(x, 8, bias=bias, n_group=8, topk_group=4, scale=2.5, block_size=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_softmax(device, dtype):
    # Qwen3-30B-A3B: softmax over 128 experts, no bias, top-8
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 128, generator=g) * 2).to(dtype).to(device)
    check_route(x, 8, scoring="softmax", block_size=16)


def test_160_experts_groups_of_20(device):
    # 160 experts in 8 groups of 20: a group size that is not a power of two
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 160, generator=g).to(device)
    bias = (torch.randn(160, generator=g) * 0.05).to(device)
    check_route(x, 6, bias=bias, n_group=8, topk_group=3, block_size=16)


def test_257_experts(device):
    # 257 experts: one past a power of two (padding to 512), n_group = 1
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 257, generator=g).to(device)
    bias = (torch.randn(257, generator=g) * 0.05).to(device)
    check_route(x, 8, bias=bias, block_size=16)


def test_deliberate_ties(device):
    # integer logits on a tiny range: most experts tie; ties must go to the lowest expert id
    g = torch.Generator().manual_seed(6)
    x = torch.randint(-2, 3, (6, 64), generator=g).float().to(device)
    ids, _ = check_route(x, 8)
    for r in range(6):
        chosen = ids[r].cpu().tolist()
        kth = x[r, chosen[-1]].item()
        above = [e for e in range(64) if x[r, e].item() == kth and e not in chosen]
        assert all(e > max(c for c in chosen if x[r, c].item() == kth) for e in above)


def test_group_ties(device):
    # every group has the same score: the lowest group ids must be kept
    x = torch.arange(16, dtype=torch.float32).remainder(4).view(1, 16).repeat(2, 1).to(device) / 4
    ids, _ = check_route(x, 4, n_group=4, topk_group=2)
    assert ids.max().item() < 8


def test_nan_and_inf_rows(device):
    # row 0: NaNs scattered (never win); row 1: all NaN (fillers: the lowest ids, weight 0); row 2: all but two NaN
    # (two real slots, then the lowest ids as fillers); row 3: all -inf under sigmoid (scores 0: finite, ties to the
    # lowest ids)
    x = torch.randn(4, 24, generator=torch.Generator().manual_seed(7))
    x[0, ::3] = math.nan
    x[1] = math.nan
    x[2] = math.nan
    x[2, 5], x[2, 17] = 0.5, 1.5
    x[3] = -math.inf
    ids, w, al = check_route(x.to(device), 4, block_size=4)
    ids = ids.cpu()
    assert (ids[0] % 3 != 0).all()
    assert ids[1].tolist() == [0, 1, 2, 3] and (w[1].cpu() == 0).all()
    assert ids[2].tolist() == [17, 5, 0, 1] and (w[2, 2:].cpu() == 0).all()
    assert ids[3].tolist() == [0, 1, 2, 3]


def test_softmax_nan_and_inf_rows(device):
    # softmax: a NaN logit has probability 0 and the rest route normally; a row of -inf has no finite score
    # (fillers 0..3, weight 0)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(8))
    x[0, 3] = math.nan
    x[1] = -math.inf
    ids, w, _ = check_route(x.to(device), 4, scoring="softmax", block_size=8)
    assert 3 not in ids[0].tolist() and bool((w[0].cpu() > 0).all())
    assert ids[1].tolist() == [0, 1, 2, 3] and (w[1].cpu() == 0).all()


def test_one_token(device):
    # M = 1: a single program routes and aligns
    x = torch.randn(1, 384, generator=torch.Generator().manual_seed(9)).to(device)
    check_route(x, 8, block_size=16)


def test_every_token_one_expert(device):
    # all 13 tokens pick expert 5 first: one expert spans several blocks; 13 * 3 is not a multiple of 8
    x = torch.randn(13, 32, generator=torch.Generator().manual_seed(10))
    x[:, 5] = 20.0
    ids, _, al = check_route(x.to(device), 3, block_size=8)
    assert (ids[:, 0] == 5).all()


def test_no_renormalize_and_scale(device):
    # weights straight from the scores, scaled; block_size 1 (no padding)
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(11)).to(device)
    check_route(x, 5, renormalize=False, scale=0.5, block_size=1)


def test_without_alignment_returns_two(device):
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(12)).to(device)
    res = moe_route(x, top_k=2, impl="triton")
    assert len(res) == 2


def test_many_tokens_one_launch(device):
    # past the fast router's 1024 slots (65 x 16 = 1040) the general kernel still routes and aligns in one launch
    # (one program per token, the last by ticket aligns); top-16 of 16 experts: every expert gets every token, 65
    # slots over 5 blocks of 16
    import specverify.moe as moe_mod

    assert 65 * 16 > moe_mod._FAST_MAX_SLOTS
    x = torch.randn(65, 16, generator=torch.Generator().manual_seed(13)).to(device)
    check_route(x, 16, block_size=16)


# default thresholds at top-4: 6 x 4 = 24 slots, the sorted path (<= 32); 9 tokens (36 slots), the row masks; 65
# tokens, the smallest M past the row masks' 64: atomic ranks. 16 experts: the interpreter's cost grows with them
@pytest.mark.parametrize("m", [6, 9, 65])
def test_repeat_calls_reuse_clean_workspace(device, m):
    # the per-device workspace (counters, ticket, row masks) must be back at zero after each call: calls on
    # different logits each match the reference, and the workspace reads zero after every one of them
    import specverify.moe as moe_mod

    assert moe_mod._fast_align_path(m, 4 * m, True) == {6: "sorted", 9: "mask", 65: "atomic"}[m]
    g = torch.Generator().manual_seed(14 + m)
    for _ in range(3 if m < 64 else 2):
        x = torch.randn(m, 16, generator=g).to(device)
        ids, _, al = check_route(x, 4, block_size=4)
        if m <= 64:
            check_alignment_exact(ids, 16, 4, al)
        ws, stride = moe_mod._workspace(x.device), moe_mod._WS_STRIDE
        # counters, ticket and row masks (the offsets between them are scratch, rewritten by every call)
        for part in (ws[:stride], ws[2 * stride: moe_mod._WS_MASKS], ws[moe_mod._WS_MASKS: moe_mod._WS_END]):
            assert int(part.count_nonzero()) == 0, "the workspace was not reset"


def test_reference_impl_same_buffers(device):
    x = torch.randn(3, 20, generator=torch.Generator().manual_seed(15)).to(device)
    ids, w, al = moe_route(x, top_k=3, block_size=4, impl="reference")
    check_alignment(ids, 20, 4, al)


# --------------------------------------------------------------------------------------------- experts
def check_experts(hidden, w13, w2, ids, w, **kw):
    out = fused_moe(hidden, w13, w2, ids, w, impl="triton", **kw)
    want = fused_moe_loop_reference(hidden, w13, w2, ids, w)
    torch_err = (fused_moe_reference(hidden, w13, w2, ids, w, compute_dtype=hidden.dtype).double() - want)
    tol = 2 * torch_err.abs().max().item() + 1e-2 * want.abs().max().item() * 2 ** -8 + 1e-6
    err = (out.double() - want).abs().max().item()
    assert out.dtype == hidden.dtype and out.shape == hidden.shape
    assert err <= tol, f"fused_moe error {err:.3g} > tolerance {tol:.3g}"
    return out


@pytest.mark.parametrize("variant", ["dot", "auto"])  # the three-launch tl.dot path and the default (stream at M 5)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_moe_with_alignment(device, dtype, poison, variant, monkeypatch):
    # H = 48 and I = 24: neither a multiple of the K/N tiles (masked edges); 5 tokens x top-3 over 8 experts
    import specverify.moe as moe_mod

    monkeypatch.setitem(moe_mod._VARIANT, "experts", variant)
    m, e, h, inter = 5, 8, 48, 24
    w13, w2 = random_expert_weights(e, h, inter, dtype=dtype, device=device, seed=20)
    hidden = torch.randn(m, h, generator=torch.Generator().manual_seed(21)).to(dtype).to(device)
    logits = torch.randn(m, e, generator=torch.Generator().manual_seed(22)).to(device)
    ids, w, al = moe_route(logits, top_k=3, block_size=16, impl="triton")
    out = poison(hidden)
    res = check_experts(hidden, w13, w2, ids, w, alignment=al, out=out)
    assert res.data_ptr() == out.data_ptr()


def test_fused_moe_aligns_itself_and_skips_missing(device):
    # alignment=None (aligned inside), int64 ids, a slot with -1 and every token sharing expert 2 (2 blocks)
    m, e, h, inter = 20, 6, 32, 16
    w13, w2 = random_expert_weights(e, h, inter, dtype=torch.bfloat16, device=device, seed=23)
    g = torch.Generator().manual_seed(24)
    hidden = torch.randn(m, h, generator=g).bfloat16().to(device)
    ids = torch.stack([torch.full((m,), 2), torch.randint(3, 6, (m,), generator=g)], 1)
    ids[4, 1] = -1
    w = torch.rand(m, 2, generator=g).to(device)
    a = check_experts(hidden, w13, w2, ids.to(device), w)
    b = fused_moe(hidden, w13, w2, ids.to(device), w, impl="triton")
    assert torch.equal(a, b), "fused_moe must be deterministic"


def test_fused_moe_reference_impl(device):
    m, e, h, inter = 3, 4, 16, 8
    w13, w2 = random_expert_weights(e, h, inter, dtype=torch.float32, device=device, seed=25)
    hidden = torch.randn(m, h, generator=torch.Generator().manual_seed(26)).to(device)
    ids, w = moe_route(torch.randn(m, e).to(device), top_k=2, impl="reference")
    out = fused_moe(hidden, w13, w2, ids, w, impl="reference")
    assert torch.allclose(out.double(), fused_moe_loop_reference(hidden, w13, w2, ids, w), atol=1e-5)


# --------------------------------------------------------------------------------------------- GPU, real sizes
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 64, 256, 1000])
@pytest.mark.parametrize("model", ["kimi_k2", "deepseek_v3", "qwen3"])
def test_route_real_sizes_gpu(m, model):
    g = torch.Generator().manual_seed(m)
    if model == "kimi_k2":
        x = torch.randn(m, 384, generator=g).bfloat16().cuda()
        bias = (torch.randn(384, generator=g) * 0.05).cuda()
        check_route(x, 8, bias=bias, scale=2.827, block_size=16)
    elif model == "deepseek_v3":
        x = torch.randn(m, 256, generator=g).cuda()
        bias = (torch.randn(256, generator=g) * 0.05).cuda()
        check_route(x, 8, bias=bias, n_group=8, topk_group=4, scale=2.5, block_size=16)
    else:
        check_route(torch.randn(m, 128, generator=g).bfloat16().cuda(), 8, scoring="softmax", block_size=16)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16, 64])
def test_fused_moe_kimi_k2_per_rank_gpu(m):
    # Kimi-K2 per rank at tp 8: H 7168, I 256, 384 experts, top-8
    e, h, inter = 384, 7168, 256
    w13, w2 = random_expert_weights(e, h, inter, dtype=torch.bfloat16, device="cuda", seed=30)
    g = torch.Generator().manual_seed(31 + m)
    hidden = torch.randn(m, h, generator=g).bfloat16().cuda()
    ids, w, al = moe_route(torch.randn(m, e, generator=g).cuda(), top_k=8, block_size=16, routed_scaling_factor=2.827)
    out = fused_moe(hidden, w13, w2, ids, w, alignment=al)
    want = fused_moe_reference(hidden, w13, w2, ids, w, compute_dtype=torch.float64)
    torch_err = (fused_moe_reference(hidden, w13, w2, ids, w, compute_dtype=torch.bfloat16).double() - want)
    tol = 2 * torch_err.abs().max().item() + 1e-6
    assert (out.double() - want).abs().max().item() <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("m", [8, 12])  # 32 slots at top-4: the sorted alignment; 48: the row masks
def test_cuda_graph_capture_gpu(graph_replay, m):
    # eager -> capture -> replay -> change the inputs in place -> replay -> compare with eager
    e, h, inter = 64, 256, 64
    w13, w2 = random_expert_weights(e, h, inter, dtype=torch.bfloat16, device="cuda", seed=40)
    logits = torch.randn(m, e, device="cuda")
    hidden = torch.randn(m, h, device="cuda").bfloat16()
    bias = torch.randn(e, device="cuda") * 0.05

    def step():
        ids, w, al = moe_route(logits, top_k=4, correction_bias=bias, block_size=16)
        return ids, fused_moe(hidden, w13, w2, ids, w, alignment=al)

    warm_up_for_capture(step)
    graph_replay(step, (logits, hidden))


# --------------------------------------------------------------------------------------------- exact order
def check_alignment_exact(ids, num_experts, block_size, al):
    """The one-program, sorted and row-mask alignments order slots by slot id inside an expert: the used part and the
    expert ids match align_reference exactly."""
    m, top_k = ids.shape
    size = max_num_tokens_padded(m, top_k, num_experts, block_size)
    rs, re, rn = align_reference(ids, num_experts, block_size)
    n = int(rn.item())
    assert al.sorted_token_ids.shape == (size,) and al.expert_ids.shape == (size // block_size,)
    assert int(al.num_tokens_post_padded.item()) == n
    want_e = torch.full((size // block_size,), -1, dtype=torch.int32)
    want_e[: n // block_size] = re.cpu()
    assert torch.equal(al.sorted_token_ids.cpu()[:n], rs.cpu()), "sorted_token_ids (used part, exact order)"
    assert torch.equal(al.expert_ids.cpu(), want_e), "expert_ids (whole buffer)"


# --------------------------------------------------------------------------------------------- router + alignment
@pytest.fixture
def fast_route(monkeypatch):
    """The router + alignment (M * top_k <= 1024) with a copy of its config that a test may edit and every
    torch.empty poisoned (NaN / -7), so an element of the used part that the kernel forgets to write cannot pass."""
    import specverify.moe as moe_mod

    monkeypatch.setattr(moe_mod, "_FAST_ROUTE_CONFIG", dict(moe_mod._FAST_ROUTE_CONFIG))
    _poison_torch_empty(monkeypatch, moe_mod)
    return moe_mod


@pytest.mark.parametrize("case", [
    # Kimi-K2: 384 experts, bias, top-8; 5 x 8 = 40 slots in one program (5 rows padded to 8)
    dict(m=5, e=384, top_k=8, bias=True, block=16),
    # DeepSeek-V3 groups; top-6 pads to 8 lanes per row (lanes 6, 7 must be ignored)
    dict(m=3, e=256, top_k=6, bias=True, n_group=8, topk_group=4, block=16),
    # one token (the verify pass's smallest step), 257 experts (prime, one past a power of two), block 1
    dict(m=1, e=257, top_k=8, bias=True, block=1),
    # 16 x 8 = 128 slots, many per expert; block 4
    dict(m=16, e=10, top_k=8, block=4),
    # 10 experts (padded to 16) at the default one-program size: the flat read-back hand-off (_RESHAPE_MIN_EXPERTS;
    # the reshape hand-off double-counted slots here on the H200)
    dict(m=4, e=10, top_k=8, block=16),
    # Kimi-K2 size with the read-back hand-off forced
    dict(m=4, e=384, top_k=8, bias=True, block=16, reload=True),
])
def test_fast_route_one_program_exact(device, fast_route, case):
    # each case is held on the one-program path (slot order inside an expert is then exact); above the default
    # one_max_slots the launcher would take the atomic path, whose order inside an expert is free on a GPU
    fast_route._FAST_ROUTE_CONFIG.update(one_max_slots=max(fast_route._FAST_ROUTE_CONFIG["one_max_slots"],
                                                           case["m"] * case["top_k"]), RELOAD=case.get("reload", False))
    g = torch.Generator().manual_seed(90 + case["m"] + case["e"])
    x = torch.randn(case["m"], case["e"], generator=g).to(device)
    bias = (torch.randn(case["e"], generator=g) * 0.05).to(device) if case.get("bias") else None
    ids, w, al = check_route(x, case["top_k"], bias=bias, n_group=case.get("n_group", 1),
                             topk_group=case.get("topk_group", 1), block_size=case["block"])
    check_alignment_exact(ids, case["e"], case["block"], al)


@pytest.mark.parametrize("mode", [
    dict(one_max_slots=32),  # one program, pairwise alignment in registers
    dict(one_max_slots=0, sorted_max_slots=1024, mask_max_rows=0),  # a program per row, the last aligns by one sort
    dict(one_max_slots=0, sorted_max_slots=0),  # a program per row, the last aligns from the row masks
])
def test_fast_route_nan_rows_and_one_expert(device, fast_route, mode):
    # a NaN row (fillers 0, 1, 2 of weight 0, aligned like any slot), every other token's first choice expert 5 (one
    # expert over two blocks of 8), experts with no tokens; 7 x 3 = 21 slots, not a multiple of the block
    fast_route._FAST_ROUTE_CONFIG.update(mode)
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(95))
    x[:, 5] = 20.0
    x[2] = math.nan
    ids, w, al = check_route(x.to(device), 3, block_size=8)
    assert ids[2].tolist() == [0, 1, 2] and (w[2].cpu() == 0).all()
    check_alignment_exact(ids, 32, 8, al)


@pytest.mark.parametrize("rows", [1, 2])
def test_fast_route_multi_program(device, fast_route, rows):
    # more slots than one program takes (limit 8): one program per ROWS rows, atomic ranks (sorted alignment off),
    # the last program aligns (expert starts gathered from registers); 9 tokens (odd: the last program of ROWS=2 has
    # one row) x top-3 over 11 experts (prime); repeated calls must find the workspace clean
    fast_route._FAST_ROUTE_CONFIG.update(one_max_slots=8, ROWS=rows, sorted_max_slots=0, mask_max_rows=0)
    g = torch.Generator().manual_seed(96 + rows)
    x = torch.randn(9, 11, generator=g).to(device)
    bias = (torch.randn(11, generator=g) * 0.05).to(device)
    for _ in range(2):
        check_route(x, 3, bias=bias, block_size=4)


@pytest.mark.parametrize("mode", [
    # one program per row, the last program aligns by one sort of the slots (no atomic ranks)
    dict(sorted_max_slots=1024, one_max_slots=0, mask_max_rows=0),
    # one program per row, the last program aligns from the per-expert row masks (bit counts, no atomic ranks)
    dict(one_max_slots=0, sorted_max_slots=0),
    # one program for every row, aligned in registers
    dict(),
], ids=["sorted", "mask", "one"])
@pytest.mark.parametrize("case", [
    # Kimi-K2-like: bias, top-8, 96 experts (not a power of two; 384 costs the interpreter 4x: the [512] masks of
    # Kimi-K2 itself are test_fast_route_mask_kimi's and test_fast_route_sorted_kimi's); 6 tokens (48 slots: not a
    # power of two, not a multiple of the block)
    dict(m=6, e=96, top_k=8, bias=True, block=16),
    # DeepSeek-V3 groups; top-6 pads to 8 lanes per row (lanes 6, 7 must be ignored)
    dict(m=3, e=256, top_k=6, bias=True, n_group=8, topk_group=4, block=16),
    # 9 tokens x top-3 over 11 experts (prime), many slots per expert, block 4
    dict(m=9, e=11, top_k=3, bias=True, block=4),
    # Qwen3: softmax over 128 experts, top-8, no bias
    dict(m=5, e=128, top_k=8, scoring="softmax", block=16),
])
def test_fast_route_sorted_exact(device, fast_route, mode, case):
    # the sorted and the row-mask alignments order the slots inside an expert by slot id on every program layout
    # (no atomic ranks): exact against align_reference, on a GPU too; on the 11-expert case (the cheapest in the
    # interpreter) a second call must find the ticket and the masks reset, in every mode (the other cases call once:
    # the reset itself is the same code for them, and test_repeat_calls_reuse_clean_workspace reads the workspace)
    fast_route._FAST_ROUTE_CONFIG.update(mode)
    if mode.get("one_max_slots") != 0:  # the one-program path must hold the case
        fast_route._FAST_ROUTE_CONFIG.update(one_max_slots=max(32, case["m"] * case["top_k"]))
    g = torch.Generator().manual_seed(120 + case["m"] + case["e"])
    x = torch.randn(case["m"], case["e"], generator=g).to(device)
    bias = (torch.randn(case["e"], generator=g) * 0.05).to(device) if case.get("bias") else None
    for _ in range(2 if case["e"] == 11 or device == "cuda" else 1):
        ids, w, al = check_route(x, case["top_k"], case.get("scoring", "sigmoid"), bias=bias,
                                 n_group=case.get("n_group", 1), topk_group=case.get("topk_group", 1),
                                 block_size=case["block"])
        check_alignment_exact(ids, case["e"], case["block"], al)


def test_fast_route_atomic_kimi(device, fast_route):
    # Kimi-K2 at M = 64 on the atomic-rank multi-program path (the expert starts gathered in registers)
    fast_route._FAST_ROUTE_CONFIG.update(mask_max_rows=0)
    m = 64 if device == "cuda" else 5  # interpreter: 40 slots, past the sorted path's 32 (so atomic ranks)
    g = torch.Generator().manual_seed(142)
    x = torch.randn(m, 384, generator=g).bfloat16().to(device)
    bias = (torch.randn(384, generator=g) * 0.05).to(device)
    for _ in range(2):
        check_route(x, 8, bias=bias, scale=2.827, block_size=16)


def test_fast_route_sorted_kimi(device, fast_route):
    # Kimi-K2 at M = 64 (512 slots: the largest verify batch the router targets) on the sorted multi-program path
    fast_route._FAST_ROUTE_CONFIG.update(sorted_max_slots=1024, mask_max_rows=0)
    m = 64 if device == "cuda" else 5  # interpreter: 40 slots, past the default sorted limit of 32
    g = torch.Generator().manual_seed(141)
    x = torch.randn(m, 384, generator=g).bfloat16().to(device)
    bias = (torch.randn(384, generator=g) * 0.05).to(device)
    ids, _, al = check_route(x, 8, bias=bias, scale=2.827, block_size=16)
    check_alignment_exact(ids, 384, 16, al)


@pytest.mark.parametrize("m, e", [
    # Kimi-K2 (384 experts: the [512] masks of the last program) at 3 tokens, the smallest M past the one program
    (3, 384),
    # 64 tokens, the mask's last bit: row 63 sets bit 63, the int64 sign bit, in the bit counts of the last program;
    # 16 experts and one call in the interpreter (its cost grows with the experts; the bits do not depend on them,
    # and the hand-over of the workspace between calls is checked at M = 3, two calls); Kimi-K2's 384 and 3 calls
    # on a GPU
    (64, 16),
])
def test_fast_route_mask_kimi(device, fast_route, m, e):
    # the row-mask path (bias, top-8, bf16 logits): exact slot order; the calls after the first must find the masks
    # and the ticket zero again (M = 3, 24 slots, would take the sorted path without sorted_max_slots=0)
    fast_route._FAST_ROUTE_CONFIG.update(sorted_max_slots=0)
    e = 384 if device == "cuda" else e
    g = torch.Generator().manual_seed(143 + m)
    x = torch.randn(m, e, generator=g).bfloat16().to(device)
    x[m - 1, 11] = 30.0  # the last row chooses expert 11: its bit is the highest one set in expert 11's mask
    bias = (torch.randn(e, generator=g) * 0.05).to(device)
    for i in range(3 if device == "cuda" else 2 if m < 64 else 1):
        if i:  # new logits each call: stale bits from the call before would show
            x = torch.randn(m, e, generator=g).bfloat16().to(device)
            x[m - 1, 11] = 30.0
        ids, _, al = check_route(x, 8, bias=bias, scale=2.827, block_size=16)
        check_alignment_exact(ids, e, 16, al)
        assert 11 in ids[m - 1].tolist()


_SM90_PTX_SCRIPT = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from specverify.kernels.moe_route import _moe_route_align_fast_kernel as K
ptr = dict(logits_ptr="*bf16", bias_ptr="*fp32", ids_ptr="*i32", w_ptr="*fp32", rank_ptr="*i32", sorted_ptr="*i32",
           eids_ptr="*i32", npad_ptr="*i32", count_ptr="*i64", offs_ptr="*i32", ticket_ptr="*i32")
const = dict(E=384, EP=512, ROWS=1, TOP_K=8, TOPK_P=8, N_GROUP=1, NG_P=2, GSIZE=384, TOPK_GROUP=1, SOFTMAX=False,
             HAS_BIAS=True, RENORM=True, DO_ROUTE=True, EA=384, EAP=512, B=16, SP=512, ONE=False, PJ=16, CHUNK=1024,
             RELOAD=False, SORTED=False, MASK=True)
sig = {n: "constexpr" if n in const else ptr.get(n, "fp32" if n == "scale" else "i32") for n in K.arg_names}
k = triton.compile(ASTSource(fn=K, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=4))
print(json.dumps(k.asm["ptx"]))
"""


def test_router_mask_ptx_sm90():
    # what the interpreter cannot show, read in the sm_90 PTX of the row-mask path (Kimi-K2, compiled on the CPU in a
    # process without the interpreter): the row masks are set by an OR reduction (no value returned) and the ticket
    # is an acq_rel add
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _SM90_PTX_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=600)
    if run.returncode != 0 and "ptxas" in run.stderr:
        pytest.skip(f"no ptxas for sm_90 in this Triton: {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stderr[-2000:]
    ptx = [ln.strip() for ln in json.loads(run.stdout.strip().splitlines()[-1]).splitlines()]
    assert any("red.global.gpu.relaxed.or.b64" in ln for ln in ptx), "the row-mask bits"
    assert any("atom.global.gpu.acq_rel.add.u32" in ln for ln in ptx), "the ticket"


def test_fast_align_path_defaults(fast_route):
    # Kimi-K2 (top-8) under the default thresholds: one program for 1-2 tokens, the sorted last program for 3-4,
    # the row masks for 5-64 (the mask holds 64 rows: one bit each), atomic ranks above
    want = {1: "one", 2: "one", 3: "sorted", 4: "sorted", 5: "mask", 8: "mask", 64: "mask", 65: "atomic",
            128: "atomic"}
    got = {m: fast_route._fast_align_path(m, m * 8, True) for m in want}
    assert got == want
    fast_route._FAST_ROUTE_CONFIG.update(mask_max_rows=1000)  # never more rows than one int64 holds
    assert fast_route._fast_align_path(65, 65 * 8, True) == "atomic"


def test_fast_route_mask_hot_expert_block_1(device, fast_route):
    # every token's first choice is expert 0 (a mask with every row's bit) and block 1 (no padding); a -inf row
    # (sigmoid 0 everywhere: the bias alone ranks its experts); 13 tokens x top-4 over 37 experts (prime)
    fast_route._FAST_ROUTE_CONFIG.update(sorted_max_slots=0)
    g = torch.Generator().manual_seed(148)
    x = torch.randn(13, 37, generator=g)
    x[:, 0] = 25.0
    x[6] = -math.inf
    bias = (torch.randn(37, generator=g) * 0.05)
    ids, _, al = check_route(x.to(device), 4, bias=bias.to(device), block_size=1)
    check_alignment_exact(ids, 37, 1, al)


def test_router_only_topk(device):
    # the router without alignment (one program per row); a NaN score, and a -inf row (sigmoid scores 0: the bias
    # alone ranks its experts, ties to the lowest id among equal biases)
    g = torch.Generator().manual_seed(150)
    x = torch.randn(5, 384, generator=g)
    x[1, 7] = math.nan
    x[3] = -math.inf
    bias = torch.randn(384, generator=g) * 0.05
    check_route(x.to(device), 8, bias=bias.to(device), scale=2.827)


def test_fast_align_only(device, fast_route):
    # alignment of given ids (fused_moe's own alignment): -1 and ids >= E skipped, experts 4..6 empty, 7 experts
    g = torch.Generator().manual_seed(99)
    ids = torch.randint(0, 4, (5, 3), generator=g, dtype=torch.int32)
    ids[1, 1], ids[3, 0], ids[4, 2] = -1, -1, 7
    ids = ids.to(device)
    _, _, al = fast_route._launch_route_align(None, None, 3, False, 1, 1, False, 1.0, 4, topk_ids=ids,
                                              num_experts=7)
    check_alignment_exact(ids, 7, 4, al)


# --------------------------------------------------------------------------------------------- shared expert
@pytest.mark.parametrize("m, top_k", [(1, 8), (5, 3), (40, 8)])  # 40*9 = 360 slots: two programs with a ragged end
def test_append_shared_expert(device, m, top_k):
    from specverify.moe import append_shared_expert

    g = torch.Generator().manual_seed(m + top_k)
    ids = torch.randint(0, 50, (m, top_k), generator=g).to(torch.int32).to(device)
    w = torch.rand(m, top_k, generator=g).to(device)
    got_i, got_w = append_shared_expert(ids, w, 50, impl="triton")
    want_i, want_w = append_shared_expert(ids.cpu(), w.cpu(), 50, impl="reference")
    assert got_i.dtype == torch.int32 and got_w.dtype == torch.float32
    assert torch.equal(got_i.cpu(), want_i) and torch.equal(got_w.cpu(), want_w)
    assert torch.equal(want_i[:, -1], torch.full((m,), 50, dtype=torch.int32)) and bool((want_w[:, -1] == 1).all())


def test_append_shared_expert_errors():
    from specverify.moe import append_shared_expert

    ids, w = torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="shared_id must be"):
        append_shared_expert(ids, w, -1)
    with pytest.raises(ValueError, match="must both be"):
        append_shared_expert(ids, w[:, :2], 4)
    with pytest.raises(TypeError, match="topk_ids must be"):
        append_shared_expert(ids.float(), w, 4)
