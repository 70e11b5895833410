"""Tree attention (GQA and MLA) against the torch reference.

CPU runs go through the Triton interpreter at tiny sizes; ``gpu`` tests use real model sizes. Every pool is filled
with NaN and only the slots a request owns get values, every page-table entry a request does not read is garbage,
and outputs are NaN-poisoned, so a read past a length or an unwritten element fails the comparison.

Tolerance (derived): the kernel may err against an fp64 reference at most twice what torch's own low-precision
computation (the reference run with bf16/fp16 inputs and compute dtype) errs, plus one ulp of the output scale.
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import warm_up_for_capture

from specverify.attention import (
    HEURISTIC_MAX_SPLITS,
    MAX_SPLITS,
    _choose_num_splits,
    plan_tree_attention,
    plan_tree_attention_mla,
    tree_attention,
    tree_attention_mla,
)
from specverify.reference.attention import tree_attention_mla_reference, tree_attention_reference
from specverify.tree import BatchedDraftTree, DraftTree


# ----------------------------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------------------------
def random_tree(k: int, gen: torch.Generator) -> DraftTree:
    """A random tree of k nodes: node i's parent is uniform in [0, i)."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, k)]
    return DraftTree(parents)


def make_mask(kind: str, k: int, batch: int, gen: torch.Generator):
    """tree_mask for ``kind``: chain (None), topk (shared), random (per request)."""
    if kind == "chain":
        return None
    if kind == "chain_explicit":
        return DraftTree.chain(k).packed_mask()
    if kind == "topk":
        return DraftTree.topk_of_size(2, k).packed_mask()
    if kind == "random":
        return BatchedDraftTree([random_tree(k, gen) for _ in range(batch)]).packed_mask
    raise AssertionError(kind)


def make_paged(prefix_lens, k, page_size, tail, dtype, device, gen, *, extra_pages=3):
    """A NaN-filled pool with random values only in the slots the requests own, pages scattered (randperm).

    Returns (pool [num_pages, page_size, *tail], page_table int32 [batch, max_pages]); page-table entries a request
    does not read hold out-of-range garbage.
    """
    totals = [p + k for p in prefix_lens]
    need = [math.ceil(t / page_size) for t in totals]
    max_pages = max(need) + 1  # one more column: garbage every request must ignore
    num_pages = sum(need) + extra_pages  # spare pages stay all-NaN
    perm = torch.randperm(num_pages, generator=gen)
    pool = torch.full((num_pages, page_size, *tail), float("nan"), dtype=dtype)
    flat = pool.view(num_pages * page_size, *tail)
    table = torch.full((len(prefix_lens), max_pages), num_pages + 1000, dtype=torch.int32)
    table[:, -1] = -5
    used = 0
    for b, (total, n) in enumerate(zip(totals, need)):
        table[b, :n] = perm[used:used + n].int()
        used += n
        pos = torch.arange(total)
        slots = table[b, pos // page_size].long() * page_size + pos % page_size
        flat[slots] = torch.randn(total, *tail, generator=gen).to(dtype)
    return pool.to(device), table.to(device)


def assert_close(got, ref_low, ref64, dtype, what):
    """|got - ref64| <= 2 * |ref_low - ref64| + ulp(dtype) * scale, elementwise maximum."""
    got64 = got.double()
    ref64 = ref64.double().to(got.device)
    assert torch.isfinite(got64).all(), f"{what}: non-finite values (NaN leaked or an element was not written)"
    torch_err = (ref_low.double().to(got.device) - ref64).abs().max().item()
    scale = max(1.0, ref64.abs().max().item())
    tol = 2.0 * torch_err + torch.finfo(dtype).eps * scale
    err = (got64 - ref64).abs().max().item()
    assert err <= tol, f"{what}: max error {err:.3e} > tolerance {tol:.3e} (torch {dtype} error {torch_err:.3e})"


def check_gqa(q, kc, vc, table, prefix, mask, sm_scale, out, lse):
    dt = q.dtype
    ref64, lse64 = tree_attention_reference(q.double(), kc.double(), vc.double(), table, prefix, mask, sm_scale,
                                            return_lse=True, compute_dtype=torch.float64)
    low, lse_low = tree_attention_reference(q, kc, vc, table, prefix, mask, sm_scale, return_lse=True,
                                            compute_dtype=dt)
    assert_close(out, low, ref64, dt, "out")
    assert_close(lse, lse_low, lse64, dt, "lse")


def check_mla(ql, qr, kv, table, prefix, mask, sm_scale, out, lse):
    dt = ql.dtype
    ref64, lse64 = tree_attention_mla_reference(ql.double(), qr.double(), kv.double(), table, prefix, mask, sm_scale,
                                                return_lse=True, compute_dtype=torch.float64)
    low, lse_low = tree_attention_mla_reference(ql, qr, kv, table, prefix, mask, sm_scale, return_lse=True,
                                                compute_dtype=dt)
    assert_close(out, low, ref64, dt, "out")
    assert_close(lse, lse_low, lse64, dt, "lse")


def run_gqa(device, poison, *, prefix_lens, k, hq, hkv, d, page_size, mask_kind, dtype, num_splits, seed,
            combined_pool=False, config=None):
    gen = torch.Generator().manual_seed(seed)
    batch = len(prefix_lens)
    if combined_pool:
        # K and V as views of one [num_pages, page_size, 2, hkv, d] buffer: strides differ from a dense cache
        pool, table = make_paged(prefix_lens, k, page_size, (2, hkv, d), dtype, device, gen)
        kc, vc = pool[:, :, 0], pool[:, :, 1]
    else:
        kc, table = make_paged(prefix_lens, k, page_size, (hkv, d), dtype, device, gen)
        vc = torch.randn(kc.shape, generator=gen).to(dtype).to(device)
        vc[torch.isnan(kc)] = float("nan")
    q = torch.randn(batch, k, hq, d, generator=gen).to(dtype).to(device)
    prefix = torch.tensor(prefix_lens, dtype=torch.int32, device=device)
    mask = make_mask(mask_kind, k, batch, gen)
    mask = mask.to(device) if mask is not None else None
    plan = plan_tree_attention(max_batch=batch, num_draft_tokens=k, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                               max_context=table.shape[1] * page_size, device=device, dtype=dtype,
                               num_splits=num_splits, config=config)
    out = poison(q)
    res, lse = tree_attention(q, kc, vc, page_table=table, prefix_lens=prefix, tree_mask=mask, sm_scale=d ** -0.5,
                              out=out, return_lse=True, impl="triton", plan=plan)
    assert res is out
    check_gqa(q, kc, vc, table, prefix, mask, d ** -0.5, out, lse)
    return plan


def run_mla(device, poison, *, prefix_lens, k, h, r, dr, page_size, mask_kind, dtype, num_splits, seed,
            config=None, head_axis=False):
    gen = torch.Generator().manual_seed(seed)
    batch = len(prefix_lens)
    kv, table = make_paged(prefix_lens, k, page_size, (r + dr,), dtype, device, gen)
    ql = torch.randn(batch, k, h, r, generator=gen).to(dtype).to(device)
    qr = torch.randn(batch, k, h, dr, generator=gen).to(dtype).to(device)
    prefix = torch.tensor(prefix_lens, dtype=torch.int64, device=device)
    mask = make_mask(mask_kind, k, batch, gen)
    mask = mask.to(device) if mask is not None else None
    sm_scale = 192 ** -0.5
    plan = plan_tree_attention_mla(max_batch=batch, num_draft_tokens=k, num_heads=h, kv_lora_rank=r, rope_dim=dr,
                                   max_context=table.shape[1] * page_size, device=device, dtype=dtype,
                                   num_splits=num_splits, config=config)
    out = poison(ql)
    cache = kv.unsqueeze(2) if head_axis else kv  # SGLang keeps a head axis of size 1
    res, lse = tree_attention_mla(ql, qr, cache, page_table=table, prefix_lens=prefix, tree_mask=mask,
                                  sm_scale=sm_scale, out=out, return_lse=True, impl="triton", plan=plan)
    assert res is out
    check_mla(ql, qr, kv, table, prefix, mask, sm_scale, out, lse)
    return plan


# ----------------------------------------------------------------------------------------------------------------
# CPU (interpreter) cases: each line covers several of the requirements at once
# ----------------------------------------------------------------------------------------------------------------
GQA_CASES = [
    # id, prefix_lens, k, hq, hkv, d, page_size, mask, dtype, num_splits, extra
    # prefix 16 ends exactly on a page boundary; 5 is mid-page; chain given as None
    ("chain-ps16-boundary", [16, 5], 3, 4, 2, 64, 16, "chain", torch.bfloat16, 1, {}),
    # page size 1, a request with prefix 0, per-request random trees, split forced on, fp16
    ("random-ps1-prefix0-split", [0, 7, 12], 5, 4, 2, 64, 1, "random", torch.float16, 2, {}),
    # page size 64, prefix 64 ends on a page boundary, full top-k tree, head_dim 128, K/V views of one buffer
    ("topk-ps64-d128-views", [64, 70], 7, 2, 1, 128, 64, "topk", torch.bfloat16, 3, {"combined_pool": True}),
    # k = 1 is plain decode; MHA (group 1); split with a request shorter than the split count
    ("decode-k1-mha", [40, 2], 1, 2, 2, 64, 16, "chain", torch.float16, 2, {}),
    # k = 9 needs two mask bytes; 8 heads per KV head x 9 tokens = 72 rows > 64 forces two M tiles; page size 5
    # is not a power of two
    ("k9-two-bytes-mtiles-ps5", [11, 3], 9, 8, 1, 64, 5, "random", torch.bfloat16, 2, {}),
]


@pytest.mark.parametrize("case", GQA_CASES, ids=[c[0] for c in GQA_CASES])
def test_gqa_matches_reference(case, device, poison):
    _, prefix_lens, k, hq, hkv, d, ps, mask, dtype, splits, extra = case
    run_gqa(device, poison, prefix_lens=prefix_lens, k=k, hq=hq, hkv=hkv, d=d, page_size=ps, mask_kind=mask,
            dtype=dtype, num_splits=splits, seed=sum(map(ord, case[0])), **extra)


MLA_CASES = [
    # Kimi-K2 per-rank dims (8 heads, 512 + 64), per-request random trees, prefix 16 on a page boundary, split on
    ("kimi-dims-random-split", [16, 3], 4, 8, 512, 64, 16, "random", torch.bfloat16, 2, {}),
    # real dims, the latent value split over 4 programs (BLOCK_DV 128), page size 1, explicit chain mask, fp16,
    # cache passed with SGLang's head axis of 1
    ("dv-tiles-ps1-fp16", [9], 2, 8, 512, 64, 1, "chain_explicit", torch.float16, 1,
     {"config": {"BLOCK_N": 16, "BLOCK_DV": 128}, "head_axis": True}),
    # small latent so more shapes stay cheap: top-k tree, page size 64, three splits, prefix 0 in the batch
    ("small-latent-topk-ps64", [0, 64, 100], 6, 4, 64, 16, 64, "topk", torch.bfloat16, 3, {}),
]


@pytest.mark.parametrize("case", MLA_CASES, ids=[c[0] for c in MLA_CASES])
def test_mla_matches_reference(case, device, poison):
    _, prefix_lens, k, h, r, dr, ps, mask, dtype, splits, extra = case
    run_mla(device, poison, prefix_lens=prefix_lens, k=k, h=h, r=r, dr=dr, page_size=ps, mask_kind=mask,
            dtype=dtype, num_splits=splits, seed=sum(map(ord, case[0])), **extra)


def test_split_count_does_not_change_result(device, poison):
    """Splits 1, 2 and 4 agree to a few ulps: the merge is exact up to fp32 rounding."""
    gen = torch.Generator().manual_seed(7)
    prefix_lens, k, hq, hkv, d, ps = [45, 33], 4, 2, 1, 64, 16
    kc, table = make_paged(prefix_lens, k, ps, (hkv, d), torch.bfloat16, device, gen)
    vc = torch.randn(kc.shape, generator=gen).to(torch.bfloat16).to(device)
    q = torch.randn(2, k, hq, d, generator=gen).to(torch.bfloat16).to(device)
    prefix = torch.tensor(prefix_lens, device=device)
    mask = make_mask("random", k, 2, gen).to(device)
    outs = []
    for splits in (1, 2, 4):
        plan = plan_tree_attention(max_batch=2, num_draft_tokens=k, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                   max_context=64, device=device, num_splits=splits)
        outs.append(tree_attention(q, kc, vc, page_table=table, prefix_lens=prefix, tree_mask=mask,
                                   sm_scale=0.125, return_lse=True, impl="triton", plan=plan))
    for o, lse in outs[1:]:
        assert torch.isfinite(o.float()).all()
        # one bf16 ulp of outputs of magnitude < 4 is 2**-6; lse is fp32 throughout
        assert (o.float() - outs[0][0].float()).abs().max().item() <= 2 ** -6
        assert (lse - outs[0][1]).abs().max().item() <= 1e-5


def test_no_plan_and_auto(device):
    """Without a plan the geometry comes from shapes; impl='auto' runs the kernel and returns q's dtype."""
    gen = torch.Generator().manual_seed(3)
    kc, table = make_paged([20], 3, 16, (1, 64), torch.bfloat16, device, gen)
    vc = torch.randn(kc.shape, generator=gen).to(torch.bfloat16).to(device)
    q = torch.randn(1, 3, 2, 64, generator=gen).to(torch.bfloat16).to(device)
    prefix = torch.tensor([20], device=device)
    out = tree_attention(q, kc, vc, page_table=table, prefix_lens=prefix, sm_scale=0.125)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 3, 2, 64)
    ref = tree_attention_reference(q.cpu(), kc.cpu(), vc.cpu(), table.cpu(), prefix.cpu(), None, 0.125)
    assert (out.cpu().float() - ref.float()).abs().max().item() <= 2 ** -5


def test_reference_impl_and_disable_flag(device, monkeypatch):
    """impl='reference' is the reference; SPECVERIFY_DISABLE_TRITON=1 makes 'auto' choose it too (bit-exact)."""
    gen = torch.Generator().manual_seed(4)
    kv, table = make_paged([5], 2, 4, (48,), torch.bfloat16, device, gen)
    ql = torch.randn(1, 2, 2, 32, generator=gen).to(torch.bfloat16).to(device)
    qr = torch.randn(1, 2, 2, 16, generator=gen).to(torch.bfloat16).to(device)
    prefix = torch.tensor([5], device=device)
    ref, ref_lse = tree_attention_mla_reference(ql, qr, kv, table, prefix, None, 0.1, return_lse=True)
    got, lse = tree_attention_mla(ql, qr, kv, page_table=table, prefix_lens=prefix, sm_scale=0.1, return_lse=True,
                                  impl="reference")
    assert torch.equal(got, ref) and torch.equal(lse, ref_lse)
    monkeypatch.setenv("SPECVERIFY_DISABLE_TRITON", "1")
    got = tree_attention_mla(ql, qr, kv, page_table=table, prefix_lens=prefix, sm_scale=0.1)
    assert torch.equal(got, ref)


def test_split_heuristic():
    """Splits fill about one wave of SMs, never below ~64 KiB of KV per split, and stop when the batch fills it."""
    mla_token_bytes = 576 * 2
    # Kimi-K2 per rank, batch 1, prefix 4092 / 4096: splits of 64 tokens (>= 64 KiB of KV) -> 63, rounded to 64
    # so that every split gets a whole number of tiles and none is empty
    assert _choose_num_splits(batch=1, programs_per_split=1, max_prefix=4092, bytes_per_token=mla_token_bytes,
                              block_n=32, num_sms=132) == 64
    assert _choose_num_splits(batch=1, programs_per_split=2, max_prefix=4092, bytes_per_token=mla_token_bytes,
                              block_n=64, num_sms=132) == 64
    assert _choose_num_splits(batch=1, programs_per_split=1, max_prefix=4096, bytes_per_token=mla_token_bytes,
                              block_n=32, num_sms=132) == 64
    # batch 8, ctx 32k: the SM count limits (132 // 8 = 16: one wave; 17 would spill 4 programs into a second)
    assert _choose_num_splits(batch=8, programs_per_split=1, max_prefix=32768, bytes_per_token=mla_token_bytes,
                              block_n=32, num_sms=132) == 16
    # batch 1 at 32k, one program per split (k <= 4 on the Kimi-K2 rank): 128 splits of 256 tokens, one wave up to
    # the heuristic's cap (64 would leave half the SMs idle); two programs per split: 66 -> 64 (whole tiles)
    assert _choose_num_splits(batch=1, programs_per_split=1, max_prefix=32764, bytes_per_token=mla_token_bytes,
                              block_n=64, num_sms=132, small_programs=True) == 128
    assert _choose_num_splits(batch=1, programs_per_split=2, max_prefix=32764, bytes_per_token=mla_token_bytes,
                              block_n=64, num_sms=132) == 64
    # batch 64: two splits (128 programs), not three
    assert _choose_num_splits(batch=64, programs_per_split=1, max_prefix=4092, bytes_per_token=mla_token_bytes,
                              block_n=64, num_sms=132) == 2
    # batch 64 x 8 KV heads already fills the GPU
    assert _choose_num_splits(batch=64, programs_per_split=8, max_prefix=32768, bytes_per_token=512,
                              block_n=64, num_sms=132) == 1
    # small programs (<= 16 rows) over a long prefix: splits of at most 2k tokens, up to 8 waves (Llama-3.1-8B,
    # batch 8 x 8 KV heads at 32k: 2 -> 16); big programs keep one wave; short splits are left alone
    gqa_token_bytes = 2 * 128 * 2
    assert _choose_num_splits(batch=8, programs_per_split=8, max_prefix=32764, bytes_per_token=gqa_token_bytes,
                              block_n=64, num_sms=132, small_programs=True) == 16
    assert _choose_num_splits(batch=8, programs_per_split=8, max_prefix=32764, bytes_per_token=gqa_token_bytes,
                              block_n=64, num_sms=132) == 2
    assert _choose_num_splits(batch=1, programs_per_split=8, max_prefix=4092, bytes_per_token=gqa_token_bytes,
                              block_n=64, num_sms=132, small_programs=True) == 16
    # short context: no split
    assert _choose_num_splits(batch=1, programs_per_split=1, max_prefix=100, bytes_per_token=mla_token_bytes,
                              block_n=32, num_sms=132) == 1


def test_plan_workspace_shapes():
    plan = plan_tree_attention_mla(max_batch=3, num_draft_tokens=4, num_heads=8, max_context=4096, device="cpu",
                                   num_splits=5)
    assert plan.workspace_out.shape == (3, 5, 4, 8, 512) and plan.workspace_out.dtype == torch.float32
    assert plan.workspace_lse.shape == (3, 5, 4, 8)
    assert plan.workspace_bytes == 4 * (3 * 5 * 4 * 8 * 513)
    one = plan_tree_attention(max_batch=2, num_draft_tokens=1, num_q_heads=4, num_kv_heads=4, head_dim=64,
                              max_context=64, device="cpu", num_splits=1)
    assert one.workspace_out is None and one.workspace_bytes == 0


# ----------------------------------------------------------------------------------------------------------------
# per-shape choices of the default path: page ids one tile ahead (MLA_BANDWIDTH_CONFIG), many splits, GPU tiles
# ----------------------------------------------------------------------------------------------------------------
MLA_CONFIG_CASES = [
    # id, prefix_lens, k, h, r, dr, page_size, mask, dtype, num_splits, config
    # page ids one tile ahead: page size 1 (every token its own page), a prefix ending on a tile edge (48), a
    # prefix-0 request, splits whose ranges end mid-tile, per-request trees
    ("page-ahead-ps1", [48, 0, 29], 4, 4, 64, 16, 1, "random", torch.bfloat16, 3,
     {"BLOCK_N": 16, "PAGE_AHEAD": True}),
    # page ids one tile ahead with tiles spanning pages (page size 4 < BLOCK_N 16), no split, chain
    ("page-ahead-ps4-nosplit", [37, 5], 3, 4, 64, 16, 4, "chain", torch.float16, 1,
     {"BLOCK_N": 16, "PAGE_AHEAD": True}),
    # more than 64 splits (the heuristic goes up to 128; the merge tile is 128 splits x 32 columns): most splits hold
    # one 16-token tile or nothing, one request is shorter than the split count
    ("default-70-splits", [300, 5], 2, 4, 64, 16, 16, "chain_explicit", torch.bfloat16, 70, {"BLOCK_N": 16}),
]


@pytest.mark.parametrize("case", MLA_CONFIG_CASES, ids=[c[0] for c in MLA_CONFIG_CASES])
def test_mla_configs_match_reference(case, device, poison):
    _, prefix_lens, k, h, r, dr, ps, mask, dtype, splits, config = case
    plan = run_mla(device, poison, prefix_lens=prefix_lens, k=k, h=h, r=r, dr=dr, page_size=ps, mask_kind=mask,
                   dtype=dtype, num_splits=splits, seed=sum(map(ord, case[0])), config=config)
    assert plan.config["KERNEL"] == "default" and plan.num_splits == splits
    assert plan.config["PAGE_AHEAD"] == bool(config.get("PAGE_AHEAD"))


def test_heuristic_caps_at_128():
    """The heuristic picks at most HEURISTIC_MAX_SPLITS (128: batch 1 at 32k filled half the H200 under 64, run 29),
    the merge kernel's limit, however many SMs there are."""
    assert HEURISTIC_MAX_SPLITS == MAX_SPLITS == 128
    assert _choose_num_splits(batch=1, programs_per_split=1, max_prefix=1 << 20, bytes_per_token=1152, block_n=64,
                              num_sms=1000) == 128


def test_gqa_gpu_tile_matches_reference(device, poison):
    """The GPU's GQA tile (64 KV tokens, GQA_CONFIGS[0]) at interpreter size, chain, two splits."""
    run_gqa(device, poison, prefix_lens=[100, 33], k=3, hq=4, hkv=2, d=64, page_size=16, mask_kind="chain",
            dtype=torch.bfloat16, num_splits=2, seed=sum(map(ord, "bandwidth-cfg-chain")),
            config={"BLOCK_N": 64, "num_warps": 4, "num_stages": 4})


@pytest.mark.parametrize("config, match", [
    ({"KERNEL": "fast"}, "KERNEL must be"),
    ({"KERNEL": "mla_chunked"}, "KERNEL must be"),  # removed: the tl.dot and the Gluon kernel remain
    ({"BLOCK_N": 16, "FUSED_MERGE": True}, "unknown keys"),
])
def test_config_errors(config, match):
    with pytest.raises(ValueError, match=match):
        plan_tree_attention_mla(max_batch=1, num_draft_tokens=2, num_heads=8, max_context=64, device="cpu",
                                config=config)



@pytest.mark.parametrize("kwargs, match", [
    ({"mla": True, "interpret": True, "config": {"KERNEL": "mla_wgmma"}}, "no CPU interpreter"),
    ({"mla": False, "interpret": False, "config": {"KERNEL": "mla_wgmma"}}, "is for tree_attention_mla"),
    ({"mla": True, "interpret": False, "config": {"KERNEL": "mla_wgmma", "PAGE_AHEAD": True}}, "PAGE_AHEAD"),
    ({"mla": True, "interpret": False, "config": {"KERNEL": "mla_wgmma", "BLOCK_N": 32}}, "BLOCK_N 64"),
    ({"mla": True, "interpret": False, "config": {"KERNEL": "mla_wgmma", "BLOCK_M": 128}}, "BLOCK_M 16, 32 or 64"),
])
def test_mla_wgmma_config_errors(kwargs, match):
    """KERNEL='mla_wgmma' is refused where it cannot run or with keys it does not take, naming the fix."""
    from specverify.attention import _choose_config, _wgmma_kernels

    if not _wgmma_kernels().AVAILABLE and not kwargs["interpret"] and kwargs["mla"]:
        match = "written in Gluon for Triton"  # this Triton cannot build the kernel: that is said first
    with pytest.raises(ValueError, match=match):
        _choose_config(rows=32, head_dim=512, head_dim_v=512 if kwargs["mla"] else 128, **kwargs)


@pytest.mark.parametrize("rows, tile, block_m, m_tiles", [
    (64, 32, 32, 2),  # DeepSeek-V3 k 4 / Kimi-K2 k 8: two 32-row tiles
    (48, 32, 32, 2),  # Kimi-K2 k 6 / DeepSeek-V3 k 3: two 32-row tiles, the second half empty
    (33, 32, 32, 2),
    (48, 64, 64, 1),  # the A/B's `mla-m64` at 48 rows
    (64, 64, 64, 1),  # the A/B's `mla-m64`: one 64-row tile
    (128, 32, 64, 2),  # 128 rows keep 64-row tiles
    (32, 32, 32, 1),
    (16, 32, 16, 1),
])
def test_mla_wgmma_64_row_rule(monkeypatch, rows, tile, block_m, m_tiles):
    """33-64 query rows a program take two tiles of ``MLA_WGMMA_64_ROW_TILE`` rows; other row counts the next power
    of two up to 64 (128 rows: two 64-row tiles); a config's BLOCK_M wins."""
    import specverify.attention as attention

    if not attention._wgmma_kernels().AVAILABLE:
        pytest.skip(attention._wgmma_kernels().UNAVAILABLE_REASON)
    monkeypatch.setattr(attention, "MLA_WGMMA_64_ROW_TILE", tile)
    cfg = attention._choose_config(mla=True, interpret=False, config={"KERNEL": "mla_wgmma"}, rows=rows,
                                   head_dim=512, head_dim_v=512)
    assert (cfg["BLOCK_M"], cfg["M_TILES"]) == (block_m, m_tiles)
    assert cfg["num_warps"] == (8 if block_m == 64 else 4)
    cfg = attention._choose_config(mla=True, interpret=False, config={"KERNEL": "mla_wgmma", "BLOCK_M": 64},
                                   rows=rows, head_dim=512, head_dim_v=512)
    assert cfg["BLOCK_M"] == 64


def test_mla_wgmma_default_rule():
    """The wgmma kernel is the MLA default only on a CUDA device with a 64-dim rope and a latent of 64-col blocks."""
    from specverify.attention import _wgmma_default

    assert not _wgmma_default(torch.device("cpu"), d=512, dr=64, dv=512)
    plan = plan_tree_attention_mla(max_batch=2, num_draft_tokens=4, num_heads=8, max_context=4096, device="cpu")
    assert plan.config["KERNEL"] != "mla_wgmma"


@pytest.mark.parametrize("max_prefix, splits, block_n, walks", [
    (4096 - 4, 64, 64, False),  # batch 1 at 4k: 64 splits of one 64-token tile each, nothing to prefetch
    (4096 - 4, 32, 64, True),  # the same context in 32 splits: two tiles each
    (32768 - 4, 16, 64, True),  # batch 8 at 32k: 32 tiles per split
    (64, 1, 64, False),  # exactly one tile
    (65, 1, 64, True),  # one token past a tile
    (0, 1, 64, False),  # draft tokens only
])
def test_bandwidth_config_rule(max_prefix, splits, block_n, walks):
    """The MLA plan switches to the page-ahead (multi-buffered) config only when a split walks two or more tiles."""
    from specverify.attention import _splits_walk_tiles

    assert _splits_walk_tiles(max_prefix=max_prefix, num_splits=splits, block_n=block_n) is walks


# ----------------------------------------------------------------------------------------------------------------
# GPU: real sizes
# ----------------------------------------------------------------------------------------------------------------
GPU_GQA = [
    # Llama-3.1-8B (32/8, d 128), trees per request, ragged prefixes around 4k, page 16
    ("llama8b-b8-k8", [4096, 4000, 17, 0, 2048, 4095, 64, 1000], 8, 32, 8, 128, 16, "random", torch.bfloat16),
    # GQA 8:1, d 64, page 1, chain of 16
    ("gqa8-d64-ps1-k16", [3000, 100], 16, 8, 1, 64, 1, "chain", torch.float16),
    # head_dim 256, top-k tree, page 64
    ("d256-ps64-topk", [1024, 5000], 6, 8, 2, 256, 64, "topk", torch.bfloat16),
    # decode k = 1, batch 64 (no split by the heuristic)
    ("decode-b64", [1000 + 37 * i for i in range(64)], 1, 32, 8, 128, 16, "chain", torch.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_GQA, ids=[c[0] for c in GPU_GQA])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_gpu_gqa(case, num_splits, poison):
    _, prefix_lens, k, hq, hkv, d, ps, mask, dtype = case
    run_gqa("cuda", poison, prefix_lens=prefix_lens, k=k, hq=hq, hkv=hkv, d=d, page_size=ps, mask_kind=mask,
            dtype=dtype, num_splits=num_splits, seed=11)


GPU_MLA = [
    # Kimi-K2 per rank: batch 1, ctx 4096, k 4 tree (the latency target shape)
    ("kimi-b1-4k-k4", [4092], 4, 8, 1, "random", torch.bfloat16),
    # DeepSeek-V3 per rank (16 heads), batch 8 ragged, page 64, top-k tree of 16 (rows 256 -> M tiles)
    ("dsv3-b8-k16", [8000, 1, 4096, 300, 0, 12000, 64, 999], 16, 16, 64, "topk", torch.bfloat16),
    # Kimi-K2, 32k context, chain of 8, fp16
    ("kimi-32k-chain8", [32760, 20000], 8, 8, 16, "chain", torch.float16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_MLA, ids=[c[0] for c in GPU_MLA])
@pytest.mark.parametrize("num_splits", [None, 1])
def test_gpu_mla(case, num_splits, poison):
    _, prefix_lens, k, h, ps, mask, dtype = case
    run_mla("cuda", poison, prefix_lens=prefix_lens, k=k, h=h, r=512, dr=64, page_size=ps, mask_kind=mask,
            dtype=dtype, num_splits=num_splits, seed=12)


from specverify.kernels import tree_attention as _K  # noqa: E402 - the config lists the bench sweeps


@pytest.mark.gpu
@pytest.mark.parametrize("config", _K.MLA_CONFIGS + [_K.MLA_BANDWIDTH_CONFIG])
def test_gpu_mla_every_config(config, poison):
    """Every config the bench may pick is correct (the bench sweeps these)."""
    run_mla("cuda", poison, prefix_lens=[3000, 17], k=4, h=16, r=512, dr=64, page_size=16, mask_kind="random",
            dtype=torch.bfloat16, num_splits=None, seed=13, config=config)


GPU_MLA_WGMMA = [
    # id, prefix_lens, k, heads, page size, mask, dtype, num_splits
    # Kimi-K2 rank, k 4 tree: 32 rows, one warpgroup; ragged batch with a prefix of 0 and one ending on a page
    ("kimi-k4-ps64", [4092, 0, 128, 4000], 4, 8, 64, "random", torch.bfloat16, None),
    # k 1 (8 rows padded to a 16-row tile), page size 1 (every token its own page), fp16, forced splits with
    # requests shorter than a split
    ("kimi-k1-ps1-fp16", [3000, 17, 64], 1, 8, 1, "chain", torch.float16, 7),
    # k 2 chain, 16 rows; page 16; no split
    ("kimi-k2-ps16", [2500, 33], 2, 8, 16, "chain", torch.bfloat16, 1),
    # k 8 top-k tree: 64 rows as two 32-row tiles (MLA_WGMMA_64_ROW_TILE; one warpgroup each where 4 warps do not
    # spill); splits walk many tiles
    ("kimi-k8-topk", [20000, 7000], 8, 8, 64, "topk", torch.bfloat16, None),
    # k 6 chain: 48 rows as two 32-row tiles (the rule at 33-64 rows), the second with 16 valid rows
    ("kimi-k6-chain", [4090, 300], 6, 8, 64, "chain", torch.bfloat16, None),
    # DeepSeek-V3 rank (16 heads), k 16: 256 rows in four 64-row tiles (two warpgroups); two mask bytes; page 5 is
    # not a power of 2
    ("dsv3-k16-ps5", [1000, 64, 0], 16, 16, 5, "topk", torch.bfloat16, 3),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_MLA_WGMMA, ids=[c[0] for c in GPU_MLA_WGMMA])
def test_gpu_mla_wgmma(case, poison):
    """The Gluon wgmma kernel (KERNEL='mla_wgmma') against the reference: row tiles of 16, 32 and 64 rows, page sizes
    1, 5, 16 and 64, chains and trees, with and without splits; NaN in every unused cache slot."""
    _, prefix_lens, k, h, ps, mask, dtype, splits = case
    run_mla("cuda", poison, prefix_lens=prefix_lens, k=k, h=h, r=512, dr=64, page_size=ps, mask_kind=mask,
            dtype=dtype, num_splits=splits, seed=16, config={"KERNEL": "mla_wgmma"})


@pytest.mark.gpu
def test_gpu_mla_wgmma_two_tiles_of_48_rows(poison):
    """48 query rows (Kimi-K2 k 6, chain and tree) as two 32-row tiles, the second with 16 valid rows (the rule's
    tiles, see ``MLA_WGMMA_64_ROW_TILE``) against the reference, in the default config (PDL, the first KV
    tile before the wait) with BLOCK_M 32, with the plan's splits, 3, and one (the direct store to out / lse)."""
    from specverify.attention import _wgmma_kernels

    config = {**_wgmma_kernels().MLA_WGMMA_DEFAULT, "BLOCK_M": 32}
    for mask, splits in (("chain", None), ("topk", 3), ("chain", 1)):
        plan = run_mla("cuda", poison, prefix_lens=[4090, 300], k=6, h=8, r=512, dr=64, page_size=64,
                       mask_kind=mask, dtype=torch.bfloat16, num_splits=splits, seed=18, config=config)
        assert (plan.config["BLOCK_M"], plan.config["M_TILES"]) == (32, 2)


@pytest.mark.gpu
def test_gpu_mla_unaligned_cache(poison):
    """A KV cache whose rows are 584 elements apart (not a multiple of 16: the Gluon kernel's 16-byte copies cannot be
    proven aligned) runs without a plan on the tl.dot kernels and matches the reference."""
    gen = torch.Generator().manual_seed(17)
    prefix_lens, k, h, r, dr, ps = [3000, 17], 4, 8, 512, 64, 16
    kv, table = make_paged(prefix_lens, k, ps, (r + dr,), torch.bfloat16, "cuda", gen)
    pool = torch.full((*kv.shape[:2], r + dr + 8), float("nan"), dtype=kv.dtype, device="cuda")
    pool[..., : r + dr] = kv
    kv_u = pool[..., : r + dr]
    ql = torch.randn(2, k, h, r, generator=gen).bfloat16().cuda()
    qr = torch.randn(2, k, h, dr, generator=gen).bfloat16().cuda()
    prefix = torch.tensor(prefix_lens, device="cuda")
    mask = make_mask("random", k, 2, gen).cuda()
    out = poison(ql)
    _, lse = tree_attention_mla(ql, qr, kv_u, page_table=table, prefix_lens=prefix, tree_mask=mask,
                                sm_scale=192 ** -0.5, out=out, return_lse=True)
    check_mla(ql, qr, kv, table, prefix, mask, 192 ** -0.5, out, lse)


@pytest.mark.gpu
def test_gpu_mla_plan_picks_bandwidth_config(monkeypatch):
    """Without a config, an MLA plan takes the Gluon wgmma kernel on sm_90 (Triton 3.6); with it switched off
    (SPECVERIFY_MLA_WGMMA=0, or elsewhere) the plan (16 heads, DeepSeek-V3's rank) takes the page-ahead tile where
    splits walk several tiles (batch 8 at 32k) and keeps the one-tile default at batch 1 / 4k (64 splits of one
    tile)."""
    from specverify.attention import _wgmma_kernels

    plan = plan_tree_attention_mla(max_batch=8, num_draft_tokens=4, num_heads=8, max_context=32768, device="cuda")
    hopper = torch.cuda.get_device_capability()[0] == 9 and _wgmma_kernels().AVAILABLE
    assert (plan.config["KERNEL"] == "mla_wgmma") == hopper
    monkeypatch.setenv("SPECVERIFY_MLA_WGMMA", "0")
    long = plan_tree_attention_mla(max_batch=8, num_draft_tokens=4, num_heads=16, max_context=32768, device="cuda")
    assert long.config["PAGE_AHEAD"] and long.config["BLOCK_N"] == _K.MLA_BANDWIDTH_CONFIG["BLOCK_N"]
    short = plan_tree_attention_mla(max_batch=1, num_draft_tokens=4, num_heads=16, max_context=4096, device="cuda")
    assert not short.config["PAGE_AHEAD"] and short.num_splits == 64


@pytest.mark.gpu
@pytest.mark.parametrize("config", _K.GQA_CONFIGS)
def test_gpu_gqa_every_config(config, poison):
    run_gqa("cuda", poison, prefix_lens=[3000, 17], k=4, hq=32, hkv=8, d=128, page_size=16, mask_kind="random",
            dtype=torch.bfloat16, num_splits=None, seed=14, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["default", "tl.dot"])
@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
def test_gpu_cuda_graph(mla, variant):
    """Eager -> capture -> replay -> change every input in place -> replay -> compare with the reference. MLA: the
    default (the Gluon kernel on sm_90 with Triton 3.6) and the tl.dot kernel's page-ahead config (its default where
    the Gluon kernel cannot run)."""
    if variant == "tl.dot" and not mla:
        pytest.skip("the GQA default is the tl.dot kernel")
    device = "cuda"
    gen = torch.Generator().manual_seed(21)
    batch, k, page_size = 4, 4, 16
    lens_a, lens_b = [100, 2000, 4000, 0], [4000, 31, 777, 1500]
    max_pages = 4096 // page_size + 1
    num_pages = batch * max_pages
    table = torch.randperm(num_pages, generator=gen)[: batch * max_pages].view(batch, max_pages).int().to(device)
    if mla:
        h, r, dr = 8, 512, 64
        kv = torch.randn(num_pages, page_size, r + dr, generator=gen).bfloat16().to(device)
        ql = torch.randn(batch, k, h, r, generator=gen).bfloat16().to(device)
        qr = torch.randn(batch, k, h, dr, generator=gen).bfloat16().to(device)
        config = {"tl.dot": _K.MLA_BANDWIDTH_CONFIG}.get(variant)
        plan = plan_tree_attention_mla(max_batch=batch, num_draft_tokens=k, num_heads=h, max_context=4096 + k,
                                       device=device, config=config)
    else:
        hq, hkv, d = 32, 8, 128
        kc = torch.randn(num_pages, page_size, hkv, d, generator=gen).bfloat16().to(device)
        vc = torch.randn(num_pages, page_size, hkv, d, generator=gen).bfloat16().to(device)
        q = torch.randn(batch, k, hq, d, generator=gen).bfloat16().to(device)
        plan = plan_tree_attention(max_batch=batch, num_draft_tokens=k, num_q_heads=hq, num_kv_heads=hkv,
                                   head_dim=d, max_context=4096 + k, device=device)
    assert plan.num_splits > 1  # the graph must cover the split + merge path
    prefix = torch.tensor(lens_a, dtype=torch.int32, device=device)
    mask = make_mask("random", k, batch, gen).to(device)
    out = torch.empty((batch, k, h, r) if mla else (batch, k, hq, d), dtype=torch.bfloat16, device=device)
    lse = None

    def call():
        if mla:
            return tree_attention_mla(ql, qr, kv, page_table=table, prefix_lens=prefix, tree_mask=mask,
                                      sm_scale=192 ** -0.5, out=out, return_lse=True, plan=plan)
        return tree_attention(q, kc, vc, page_table=table, prefix_lens=prefix, tree_mask=mask, sm_scale=d ** -0.5,
                              out=out, return_lse=True, plan=plan)

    def check():
        if mla:
            check_mla(ql, qr, kv, table, prefix, mask, 192 ** -0.5, out, lse)
        else:
            check_gqa(q, kc, vc, table, prefix, mask, d ** -0.5, out, lse)

    _, lse_eager = warm_up_for_capture(call)  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = call()
    graph.replay()
    torch.cuda.synchronize()
    check()
    # change every input in place: queries, cache values, lengths, trees
    if mla:
        ql.copy_(torch.randn(ql.shape, generator=gen).bfloat16())
        kv.copy_(torch.randn(kv.shape, generator=gen).bfloat16())
    else:
        q.copy_(torch.randn(q.shape, generator=gen).bfloat16())
        kc.copy_(torch.randn(kc.shape, generator=gen).bfloat16())
    prefix.copy_(torch.tensor(lens_b, dtype=torch.int32))
    mask.copy_(make_mask("random", k, batch, gen))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check()
