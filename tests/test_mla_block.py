"""mla_block: a verify layer's MLA attention (qkv_a ... o_proj) in one persistent launch (issue 22).

Each stage is checked against its definition applied to the kernel's own previous stage (from the launcher's
intermediates), so every tolerance is one stage's rounding: a bf16 result is within U = 2^-7 of its value (one ulp:
the interpreter's casts truncate; the GPU's round to nearest) plus the fp32 sums' order (K * 2^-23 * sum
|products|); where the op chain rounds an input (q_a's norm, the attention output) a different rounding adds
U * sum |products|; RoPE adds its fp32 angle's error (~pos * 2^-21 rad) times the pair's magnitude. The written KV rows are compared with
the reference preparation (same formula), the rest of the cache bit for bit (nothing else written). Every
torch.empty of the launcher is NaN / -7 poisoned and its workspace is rebuilt; the cache's unused rows are NaN.
The end-to-end output is also compared with the op chain on the references (`mla_block_reference`). CPU runs use
the Triton interpreter (six launches, one a phase); the GPU tests run the persistent grid at Kimi-K2 and
DeepSeek-V3 rank shapes, deterministic, and replayed in a CUDA graph with new inputs.
"""
from __future__ import annotations

import math

import pytest
import torch

from test_moe import _poison_torch_empty

import specverify.mla_layer as mla_mod
from specverify.mla_layer import mla_block, mla_block_reference
from specverify.reference.attention import tree_attention_mla_reference
from specverify.reference.fused_ops import apply_rope, mla_kv_prep_reference, rmsnorm_reference
from specverify.tree import DraftTree

# (H, Q, R, DR, NOPE, NH, V): small shapes for the interpreter; H and Q not multiples of the 128-column chunk, Q not
# a power of two, three heads (rows of the attention tile not a power of two)
SMALL = (160, 48, 32, 16, 16, 3, 16)
EPS, THETA = 1e-6, 10000.0
U = 2.0 ** -7  # one bf16 ulp (relative)


def _inputs(dims, batch, kq, seed, device, page_size=4, prefix=None, tree=False):
    h, q, r, dr, nope, nh, v = dims
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16).to(device)

    w = {"qkv_a": rnd(q + r + dr, h, std=h ** -0.5), "q_a_norm": (1 + rnd(q, std=0.1).float()).bfloat16(),
         "q_b": rnd(nh * (nope + dr), q, std=q ** -0.5), "kv_a_norm": (1 + rnd(r, std=0.1).float()).bfloat16(),
         "w_uk": rnd(nh, nope, r, std=nope ** -0.5), "w_uv": rnd(nh, r, v, std=r ** -0.5),
         "o_proj": rnd(h, nh * v, std=(nh * v) ** -0.5)}
    if prefix is None:
        prefix = torch.randint(3, 4 * page_size + 3, (batch,), generator=g)
    prefix = torch.as_tensor(prefix, dtype=torch.int32)
    pages_per = -(-(int(prefix.max()) + kq) // page_size) + 1
    num_pages = batch * pages_per + 2
    cache = rnd(num_pages, page_size, r + dr)
    page_table = torch.randperm(num_pages, generator=g)[: batch * pages_per].view(batch, pages_per).to(torch.int32)
    for bi in range(batch):  # rows past a request's length hold NaN: they must never be read
        for p in range(int(prefix[bi]) + kq, pages_per * page_size):
            cache[page_table[bi, p // page_size], p % page_size] = math.nan
    if tree:
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, kq)]
        t = DraftTree(parents)
        mask, depth = t.packed_mask().to(device), torch.as_tensor(t.depth).to(device)
    else:
        mask, depth = None, torch.arange(kq, device=device)
    positions = prefix.long().to(device)[:, None] + depth.long()[None, :]
    x = rnd(batch, kq, h)
    return x, w, cache, page_table.to(device), prefix.to(device), positions, mask


def _sm_scale(dims):
    return 1.0 / math.sqrt(dims[4] + dims[3])


def _rope_tol(x, positions):
    """RoPE's angle error: the fp32 angle pos * theta^(-2j/d) (and its sin / cos) is off by up to ~pos * 2^-21 rad on
    either side, which moves an output by that times the pair's magnitude. x [b, k, heads, d]; positions [b, k]."""
    half = x.shape[-1] // 2
    pair = x[..., :half].double().abs() + x[..., half:].double().abs()
    angle = 2.0 ** -20 * positions.double()[:, :, None, None]
    return torch.cat([pair, pair], -1) * angle + 1e-6


def _bound(a, w):
    """sum |a_j| |w_nj| over the dot, fp64: [..., N]."""
    return a.double().abs() @ w.double().abs().T


def _close(got, want, tol, what):
    got, want = got.double(), want.double()
    assert not torch.isnan(got).any(), f"{what}: NaN (an unwritten element)"
    bad = (got - want).abs() > tol
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off; max error {(got - want).abs().max():.3g}"


def check_stages(dims, x, w, cache_before, cache, page_table, prefix, positions, mask, out, mid):
    h, q, r, dr, nope, nh, v = dims
    b, kq, _ = x.shape
    m = b * kq
    xf = x.reshape(m, h)
    eps23 = 2.0 ** -23
    # qkv_a
    want = xf.double() @ w["qkv_a"].double().T
    _close(mid["qkv"], want, U * want.abs() + h * eps23 * _bound(xf, w["qkv_a"]) + 1e-30, "qkv")
    qkv = mid["qkv"]
    # q_a's norm (rounded) and q_b
    qn = rmsnorm_reference(qkv[:, :q].float(), w["q_a_norm"].float(), EPS)
    want = qn.double() @ w["q_b"].double().T
    bound = _bound(qn, w["q_b"])
    _close(mid["qb"], want, U * (want.abs() + bound) + q * eps23 * bound, "q_b")
    qb = mid["qb"].view(b, kq, nh, nope + dr)
    # the KV write: latent norm and rope key of the kernel's qkv, at prefix + node; every other row untouched
    q_ref = qb.clone()
    ref_cache = cache_before.clone()
    mla_kv_prep_reference(q_ref, qkv.view(b, kq, -1)[..., q:], positions, w["kv_a_norm"], ref_cache, page_table,
                          prefix, EPS, THETA, nope)
    written = torch.zeros(cache.shape[:2], dtype=torch.bool, device=cache.device)
    for bi in range(b):
        for i in range(kq):
            p = int(prefix[bi]) + i
            written[page_table[bi, p // cache.shape[1]], p % cache.shape[1]] = True
    assert torch.equal(cache[~written].view(-1).nan_to_num(7.0), cache_before[~written].view(-1).nan_to_num(7.0)), \
        "rows other than the draft tokens' were written"
    got_rows, want_rows = cache[written].double(), ref_cache[written].double()
    rope_tol = torch.zeros_like(ref_cache)
    rope_tol[..., r:] = 2.0 ** -20 * float(positions.max()) * ref_cache[..., r:].abs().amax(-1, keepdim=True)
    _close(got_rows, want_rows, 2 * U * want_rows.abs() + rope_tol[written] + 1e-6, "KV rows")
    # absorbed and rope queries of the kernel's q
    want = torch.einsum("bkhd,hdr->bkhr", qb[..., :nope].double(), w["w_uk"].double())
    bound = torch.einsum("bkhd,hdr->bkhr", qb[..., :nope].double().abs(), w["w_uk"].double().abs())
    _close(mid["q_latent"].view(b, kq, nh, r), want, U * want.abs() + nope * eps23 * bound + 1e-30,
           "q_latent")
    want = apply_rope(qb[..., nope:].float(), positions, THETA)
    _close(mid["q_pe"].view(b, kq, nh, dr), want, U * want.float().abs() + _rope_tol(qb[..., nope:], positions), "q_pe")
    # attention of the kernel's queries over the kernel's cache (fp64), rounded, then W_uv
    o_lat = tree_attention_mla_reference(mid["q_latent"].view(b, kq, nh, r), mid["q_pe"].view(b, kq, nh, dr), cache,
                                         page_table, prefix, mask, _sm_scale(dims), compute_dtype=torch.float64)
    want = torch.einsum("bkhr,hrv->bkhv", o_lat.double(), w["w_uv"].double())
    bound = torch.einsum("bkhr,hrv->bkhv", o_lat.double().abs(), w["w_uv"].double().abs())
    _close(mid["v"].view(b, kq, nh, v), want, U * (want.abs() + 2 * bound) + 1e-6, "v")
    # o_proj of the kernel's v
    vo = mid["v"]
    want = vo.double() @ w["o_proj"].double().T
    _close(out.reshape(m, h), want, U * want.abs() + nh * v * eps23 * _bound(vo, w["o_proj"]) + 1e-30,
           "out")


def _run_checked(dims, batch, kq, seed, device, **kw):
    x, w, cache, page_table, prefix, positions, mask = _inputs(dims, batch, kq, seed, device, **kw)
    before = cache.clone()
    dd = (x.shape[0], kq, dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6])
    out, mid = mla_mod._launch(x, w, cache, page_table, prefix, positions, mask, EPS, THETA, _sm_scale(dims), dd)
    assert out.shape == x.shape and out.dtype == x.dtype
    check_stages(dims, x, w, before, cache, page_table, prefix, positions, mask, out, mid)
    # and the public call against the op chain on the references (a fresh copy of the cache)
    c2, c3 = before.clone(), before.clone()
    got = mla_block(x, *w.values(), c2, page_table, prefix, positions, mask, eps=EPS, rope_theta=THETA,
                    sm_scale=_sm_scale(dims))
    ref = mla_block_reference(x, *w.values(), c3, page_table, prefix, positions, mask, eps=EPS, rope_theta=THETA,
                              sm_scale=_sm_scale(dims))
    scale = ref.float().abs().max()
    assert (got.float() - ref.float()).abs().max() <= 2.0 ** -4 * scale, "far from the op chain"
    return x, w, before, page_table, prefix, positions, mask, out


@pytest.fixture
def fresh_workspace(monkeypatch):
    _poison_torch_empty(monkeypatch, mla_mod)
    monkeypatch.setattr(mla_mod, "_WS", {})


@pytest.mark.parametrize("batch,kq", [(1, 1), (1, 2), (2, 1), (2, 3), (1, 5)])
def test_mla_block_chain(batch, kq, fresh_workspace):
    _run_checked(SMALL, batch, kq, seed=10 * batch + kq, device="cpu")


@pytest.mark.parametrize("shared", [True, False])
def test_mla_block_tree(shared, fresh_workspace):
    """A random tree (bit-packed mask, tree depths as positions); shared [k, nb] or per-request [b, k, nb] mask."""
    x, w, cache, page_table, prefix, positions, mask = _inputs(SMALL, 2, 4, 7, "cpu", tree=True)
    if not shared:
        mask = mask.unsqueeze(0).expand(2, *mask.shape).contiguous()
    before = cache.clone()
    out, mid = mla_mod._launch(x, w, cache, page_table, prefix, positions, mask, EPS, THETA, _sm_scale(SMALL),
                               (2, 4) + SMALL)
    check_stages(SMALL, x, w, before, cache, page_table, prefix, positions, mask, out, mid)


@pytest.mark.parametrize("programs", [3, 12])
def test_mla_block_grid_sizes(programs, monkeypatch, fresh_workspace):
    """Fewer programs than items (each takes several, round-robin) and more: K split into unequal whole-chunk parts
    (H = 640 is 5 chunks), several attention splits of 16-token tiles, one of them empty (prefix 5 of a 48-position
    page-table row) and one whose last split holds only the draft tokens."""
    monkeypatch.setattr(mla_mod, "sm_count", lambda *a: programs)
    monkeypatch.setattr(mla_mod, "_ATT_BN", 16)
    monkeypatch.setattr(mla_mod, "_TA", 32)
    dims = (640,) + SMALL[1:]
    plan = mla_mod._plan((4, 2, 640, 48, 32, 16, 16, 3, 16, 48), programs)
    if programs == 12:
        assert 5 % plan["SPLIT_A"] and plan["NSPLIT"] == 3
    _run_checked(dims, 2, 2, seed=programs, device="cpu", prefix=[40, 5])


def test_mla_block_short_prefix_and_page_size(fresh_workspace):
    """A prefix of 0 (only the draft tokens) and of one token, with 16-token pages."""
    _run_checked(SMALL, 2, 2, seed=5, device="cpu", page_size=16, prefix=[0, 1])


def test_mla_block_workspace_sized_once(fresh_workspace):
    x, w, cache, page_table, prefix, positions, mask = _inputs(SMALL, 1, 1, 3, "cpu")
    kw = dict(eps=EPS, rope_theta=THETA, sm_scale=_sm_scale(SMALL))
    mla_block(x, *w.values(), cache, page_table, prefix, positions, **kw)
    (part, ticket, _), = mla_mod._WS.values()
    x2, w2, cache2, pt2, prefix2, pos2, _ = _inputs(SMALL, 2, 2, 4, "cpu")
    mla_block(x2, *w.values(), cache2, pt2, prefix2, pos2, **kw)
    (part2, ticket2, _), = mla_mod._WS.values()
    assert (part.data_ptr(), ticket.data_ptr()) == (part2.data_ptr(), ticket2.data_ptr())


def _bad_calls():
    x, w, cache, pt, prefix, pos, _ = _inputs(SMALL, 1, 2, 1, "cpu")
    kw = dict(eps=EPS, rope_theta=THETA, sm_scale=0.2)
    base = dict(x=x, **w, kv_cache=cache, page_table=pt, prefix_lens=prefix, positions=pos)

    def with_(**over):
        return dict(base, **over)

    return kw, [
        (with_(x=x.float()), TypeError, "bfloat16 or float16"),
        (with_(q_b=w["q_b"].half()), TypeError, "x's dtype"),
        (with_(x="x"), TypeError, "must be a torch.Tensor"),
        (with_(x=x[0]), ValueError, "batch, draft tokens, hidden"),
        (with_(qkv_a=w["qkv_a"][:-1]), ValueError, "shapes disagree"),
        (with_(o_proj=w["o_proj"].t().contiguous()), ValueError, "shapes disagree"),
        (with_(w_uk=w["w_uk"][:, :, :24].contiguous(), kv_a_norm=w["kv_a_norm"][:24],
               qkv_a=w["qkv_a"][:-8].contiguous(), w_uv=w["w_uv"][:, :24].contiguous()), ValueError, "power of two"),
        (with_(x=torch.zeros(1, 17, SMALL[0], dtype=torch.bfloat16)), ValueError, "1..16"),
        (with_(x=x.transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "unit stride"),
        (with_(q_b=w["q_b"].t().contiguous().t()), ValueError, "contiguous"),
        (with_(kv_cache=cache[..., :-1]), ValueError, "kv_cache must be"),
        (with_(page_table=pt.float()), TypeError, "page_table"),
        (with_(positions=pos[:, :1]), ValueError, "positions"),
        (with_(prefix_lens=prefix.float()), TypeError, "prefix_lens"),
        (with_(page_table=pt.clone().fill_(10 ** 6)), ValueError, "outside the cache"),
        (with_(prefix_lens=prefix + 10 ** 3), ValueError, "page-table row"),
        (with_(tree_mask=torch.ones(2, 1, dtype=torch.int32)), TypeError, "uint8"),
        (with_(tree_mask=torch.ones(3, 1, dtype=torch.uint8)), ValueError, "uint8 \\[2, 1\\]"),
        (with_(tree_mask=torch.tensor([[1], [2]], dtype=torch.uint8)), ValueError, "own node|sees"),
    ]


@pytest.mark.parametrize("case", range(19))
def test_mla_block_bad_input(case):
    kw, cases = _bad_calls()
    args, err, msg = cases[case]
    with pytest.raises(err, match=msg):
        mla_block(**args, **kw)


def test_mla_block_bad_input_count():
    assert len(_bad_calls()[1]) == 19


# ---- GPU: the persistent grid with its barriers, at the verify pass's rank shapes -------------------------------
_RANK = {"kimi-k2": (7168, 1536, 512, 64, 128, 8, 128), "deepseek-v3": (7168, 1536, 512, 64, 128, 16, 128)}


@pytest.mark.gpu
@pytest.mark.parametrize("model,batch,kq,tree", [("kimi-k2", 1, 1, False), ("kimi-k2", 1, 2, False),
                                                 ("deepseek-v3", 1, 2, True), ("deepseek-v3", 4, 1, False)])
def test_mla_block_rank_shapes_gpu(model, batch, kq, tree):
    from conftest import check_graph_replay, warm_up_for_capture

    dims = _RANK[model]
    x, w, cache, pt, prefix, pos, mask = _inputs(dims, batch, kq, kq + batch, "cuda", page_size=64,
                                                 prefix=[4000 + 37 * i for i in range(batch)], tree=tree)
    before = cache.clone()
    dd = (batch, kq) + dims
    out, mid = warm_up_for_capture(lambda: mla_mod._launch(x, w, cache, pt, prefix, pos, mask, EPS, THETA,
                                                           _sm_scale(dims), dd))
    check_stages(dims, x, w, before, cache, pt, prefix, pos, mask, out, mid)
    again, _ = mla_mod._launch(x, w, cache, pt, prefix, pos, mask, EPS, THETA, _sm_scale(dims), dd)
    assert torch.equal(again, out), "not deterministic"

    def step():
        return mla_block(x, *w.values(), cache, pt, prefix, pos, mask, eps=EPS, rope_theta=THETA,
                         sm_scale=_sm_scale(dims), validate=False)

    check_graph_replay(step, [x])
