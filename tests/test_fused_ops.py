"""Fused small ops (RMSNorm+residual, MLA/GQA KV preparation, SiLU-mul) against their torch references."""
import pytest
import torch

from specverify import fused_ops
from specverify.reference import fused_ops as ref

DTYPES = [torch.bfloat16, torch.float16]


def _tol(dtype):
    # one rounding of the output in the activation dtype, plus fp32 reduction-order noise
    eps = torch.finfo(dtype).eps
    return dict(rtol=2 * eps, atol=2 * eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, n", [(1, 64), (5, 96), (3, 7168)])  # 96: not a power of two; 7168: Kimi hidden
def test_rmsnorm(device, dtype, rows, n, poison):
    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, n, generator=g).to(dtype).to(device)
    r = torch.randn(rows, n, generator=g).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).to(device)
    y = fused_ops.rmsnorm(x, w, 1e-6, impl="triton")
    torch.testing.assert_close(y, ref.rmsnorm_reference(x, w, 1e-6), **_tol(dtype))
    y2, s2 = fused_ops.rmsnorm(x, w, 1e-6, residual=r, impl="triton")
    ey, es = ref.add_rmsnorm_reference(x, r, w, 1e-6)
    # one rounding of the fp32 sum; the CPU interpreter's bf16 conversion may truncate instead of rounding
    torch.testing.assert_close(s2, es, **_tol(dtype))
    torch.testing.assert_close(y2, ey, **_tol(dtype))


def _paged(batch, k, prefix, page_size, pool, g, device):
    per = -(-(max(prefix) + k) // page_size)
    pt = torch.randperm(pool, generator=g)[: batch * per].view(batch, per).to(torch.int32).to(device)
    return pt, torch.tensor(prefix, dtype=torch.int32, device=device)


def _mla_prep_inputs(g, device, b, k, h, nope, dr, r, ps, prefix, pool, dtype=torch.bfloat16):
    """(page_table, prefix_lens, cache, cache_ref, q, q_ref, kv, norm_w) of an MLA preparation: a NaN-poisoned paged
    cache and its reference copy, queries [b, k, h, nope + dr] and their copy, latent kv [b, k, r + dr], a norm
    weight near 1; drawn from ``g`` in that order."""
    pt, prefix = _paged(b, k, prefix, ps, pool, g, device)
    cache = torch.full((pt.max().item() + 2, ps, r + dr), float("nan"), dtype=dtype, device=device)
    q = torch.randn(b, k, h, nope + dr, generator=g).to(dtype).to(device)
    kv = torch.randn(b, k, r + dr, generator=g).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(r, generator=g)).to(dtype).to(device)
    return pt, prefix, cache, cache.clone(), q, q.clone(), kv, w


def _assert_same_cache_writes(cache, cache_ref, dtype):
    """The kernel wrote the slots the reference wrote, nothing else (NaN poison elsewhere), with close values."""
    written = ~torch.isnan(cache_ref.float())
    assert torch.equal(written, ~torch.isnan(cache.float()))
    torch.testing.assert_close(cache[written], cache_ref[written], **_tol(dtype))


@pytest.mark.parametrize("page_size", [1, 16])
def test_mla_kv_prep(device, page_size):
    g = torch.Generator().manual_seed(page_size)
    b, k, h, nope, dr, r = 2, 3, 5, 16, 8, 32  # 5 heads: not a power of two
    dtype = torch.bfloat16
    pt, prefix, cache, cache_ref, q, q_ref, kv, w = _mla_prep_inputs(g, device, b, k, h, nope, dr, r, page_size,
                                                                     [4, 15], 64 // page_size * 2 + 8)
    pos = prefix.long().unsqueeze(1) + torch.tensor([0, 1, 1], device=device)  # a tree: two nodes at depth 1
    fused_ops.mla_kv_prep(q, kv, pos, w, cache, pt, prefix, eps=1e-6, theta=50000.0, nope_dim=nope,
                          impl="triton")
    ref.mla_kv_prep_reference(q_ref, kv, pos, w, cache_ref, pt, prefix, 1e-6, 50000.0, nope)
    torch.testing.assert_close(q, q_ref, **_tol(dtype))
    _assert_same_cache_writes(cache, cache_ref, dtype)


@pytest.mark.parametrize("interleaved", [False, True])
def test_mla_kv_prep_rotary_table(device, interleaved):
    """RoPE read from a model's rotary table (SGLang's cos_sin_cache layout), interleaved pairs or halves."""
    g = torch.Generator().manual_seed(100 + int(interleaved))
    b, k, h, nope, dr, r, ps = 2, 4, 3, 16, 8, 32, 4
    dtype = torch.bfloat16
    pt, prefix, cache, cache_ref, q, q_ref, kv, w = _mla_prep_inputs(g, device, b, k, h, nope, dr, r, ps, [3, 9], 12)
    angles = 6.0 * torch.rand(32, dr // 2, generator=g)  # no theta could give these: the table must be read
    table = torch.cat([angles.cos(), angles.sin()], -1).to(device)
    pos = prefix.long().unsqueeze(1) + torch.tensor([0, 1, 1, 2], device=device)
    fused_ops.mla_kv_prep(q, kv, pos, w, cache, pt, prefix, eps=1e-6, theta=1e4, nope_dim=nope, cos_sin=table,
                          interleaved=interleaved, impl="triton")
    ref.mla_kv_prep_reference(q_ref, kv, pos, w, cache_ref, pt, prefix, 1e-6, 1e4, nope, cos_sin=table,
                              interleaved=interleaved)
    torch.testing.assert_close(q, q_ref, **_tol(dtype))
    _assert_same_cache_writes(cache, cache_ref, dtype)


def test_table_rope_reference_against_closed_forms():
    """The table reference is the theta RoPE for a theta table (halves) and a complex rotation (pairs)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 4, 8, generator=g, dtype=torch.float64)
    pos = torch.randint(0, 50, (2, 3), generator=g)
    inv = 1.0 / (1e4 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    ang = torch.arange(50, dtype=torch.float64).unsqueeze(1) * inv
    table = torch.cat([ang.cos(), ang.sin()], -1)
    torch.testing.assert_close(ref.apply_table_rope(x, pos, table, False), ref.apply_rope(x, pos, 1e4))
    rot = torch.polar(torch.ones_like(ang), ang)[pos].unsqueeze(2)  # [2, 3, 1, 4]
    pairs = torch.view_as_real(torch.view_as_complex(x.reshape(2, 3, 4, 4, 2).contiguous()) * rot).flatten(-2)
    torch.testing.assert_close(ref.apply_table_rope(x, pos, table, True), pairs)


def test_mla_kv_prep_rejects_a_table_of_the_wrong_width():
    q, kv = torch.zeros(1, 1, 2, 24), torch.zeros(1, 1, 40)
    cache = torch.zeros(4, 1, 40)
    with pytest.raises(ValueError, match=r"rope_dim = 8"):
        fused_ops.mla_kv_prep(q, kv, torch.zeros(1, 1, dtype=torch.long), torch.ones(32), cache,
                              torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), eps=1e-6,
                              theta=1e4, nope_dim=16, cos_sin=torch.zeros(8, 16))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_gqa_prep(device, qk_norm):
    g = torch.Generator().manual_seed(int(qk_norm))
    b, k, hq, hkv, d, ps = 2, 4, 4, 2, 16, 4
    dtype = torch.bfloat16
    pt, prefix = _paged(b, k, [0, 6], ps, 12, g, device)  # prefix 0; prefix ending inside a page
    kc = torch.full((12, ps, hkv, d), float("nan"), dtype=dtype, device=device)
    vc = kc.clone()
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q = torch.randn(b, k, hq, d, generator=g).to(dtype).to(device)
    q_ref = q.clone()
    kk = torch.randn(b, k, hkv, d, generator=g).to(dtype).to(device)
    v = torch.randn(b, k, hkv, d, generator=g).to(dtype).to(device)
    qn = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(device) if qk_norm else None
    kn = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(device) if qk_norm else None
    pos = prefix.long().unsqueeze(1) + torch.arange(k, device=device)
    fused_ops.gqa_prep(q, kk, v, pos, qn, kn, kc, vc, pt, prefix, eps=1e-6, theta=1e6, impl="triton")
    ref.gqa_prep_reference(q_ref, kk, v, pos, qn, kn, kc_ref, vc_ref, pt, prefix, 1e-6, 1e6)
    torch.testing.assert_close(q, q_ref, **_tol(dtype))
    for got, exp in ((kc, kc_ref), (vc, vc_ref)):
        written = ~torch.isnan(exp.float())
        assert torch.equal(written, ~torch.isnan(got.float()))
        torch.testing.assert_close(got[written], exp[written], **_tol(dtype))


@pytest.mark.parametrize("t, inter", [(1, 256), (3, 100)])  # 100: a partial block
def test_silu_mul(device, t, inter):
    g = torch.Generator().manual_seed(t)
    gu = torch.randn(t, 2 * inter, generator=g).to(torch.bfloat16).to(device)
    torch.testing.assert_close(fused_ops.silu_mul(gu, impl="triton"), ref.silu_mul_reference(gu),
                               **_tol(torch.bfloat16))


def test_bad_input(device):
    with pytest.raises(ValueError, match="impl must be"):
        fused_ops.silu_mul(torch.zeros(1, 4, device=device), impl="cuda")
    with pytest.raises(ValueError, match="weight must have shape"):
        fused_ops.rmsnorm(torch.zeros(2, 8, dtype=torch.bfloat16, device=device),
                          torch.ones(4, dtype=torch.bfloat16, device=device), 1e-6, impl="triton")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, k", [(1, 1), (2, 3), (3, 7)])  # 21 tokens: two row tiles of 16 with a ragged end
def test_mla_absorb_q_and_up_v(device, dtype, batch, k, poison):
    # Kimi-K2 per-rank sizes cut down: 2 heads, nope 32, rope 16, latent 64, v 32 (every tile path of the kernel)
    g = torch.Generator().manual_seed(batch * 10 + k)
    h, nope, rope, r, v = 2, 32, 16, 64, 32
    full = torch.randn(batch, k, h, nope + rope + 8, generator=g).to(dtype).to(device)
    q = full[..., : nope + rope]  # strided like the q_b output's views
    w_uk = (torch.randn(h, nope, r, generator=g) / nope ** 0.5).to(dtype).to(device)
    w_uv = (torch.randn(h, r, v, generator=g) / r ** 0.5).to(dtype).to(device)
    o_latent = torch.randn(batch, k, h, r, generator=g).to(dtype).to(device)
    out_q = poison(torch.empty(batch, k, h, r, dtype=dtype, device=device))
    out_o = poison(torch.empty(batch, k, h * v, dtype=dtype, device=device))
    got_q = fused_ops.mla_absorb_q(q, w_uk, nope, out=out_q, impl="triton")
    got_o = fused_ops.mla_up_v(o_latent, w_uv, out=out_o, impl="triton")
    assert got_q.data_ptr() == out_q.data_ptr() and got_o.data_ptr() == out_o.data_ptr()
    want_q = ref.mla_absorb_q_reference(q.double(), w_uk.double(), nope)
    want_o = ref.mla_up_v_reference(o_latent.double(), w_uv.double())
    assert got_q.shape == (batch, k, h, r) and got_q.is_contiguous()
    assert got_o.shape == (batch, k, h * v) and got_o.is_contiguous()
    # fp32 accumulation, one rounding: within 2 ulp of the fp64 result plus accumulation-order noise
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got_q.double(), want_q, rtol=2 * eps, atol=4 * eps)
    torch.testing.assert_close(got_o.double(), want_o, rtol=2 * eps, atol=4 * eps)


# tokens over two pages (page size 4), a tree (two nodes at depth 1), 3 heads (not a power of two), the rotary table
# read as interleaved pairs or theta angles
@pytest.mark.parametrize("table, interleaved", [(False, False), (True, True)])
def test_mla_prep_absorb_is_the_two_ops(device, table, interleaved, poison):
    g = torch.Generator().manual_seed(300 + 2 * table + interleaved)
    b, k, h, nope, dr, r, ps = 2, 3, 3, 32, 16, 64, 4
    dtype = torch.bfloat16
    pt, prefix, cache, cache_ref, q, q_ref, kv, nw = _mla_prep_inputs(g, device, b, k, h, nope, dr, r, ps, [2, 9], 12)
    w_uk = (torch.randn(h, nope, r, generator=g) / nope ** 0.5).to(dtype).to(device)
    angles = 6.0 * torch.rand(32, dr // 2, generator=g)
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1).to(device) if table else None
    pos = prefix.long().unsqueeze(1) + torch.tensor([0, 1, 1], device=device)
    out = poison(torch.empty(b, k, h, r, dtype=dtype, device=device))
    got = fused_ops.mla_prep_absorb(q, kv, pos, nw, w_uk, cache, pt, prefix, eps=1e-6, theta=1e4, nope_dim=nope,
                                    cos_sin=cos_sin, interleaved=interleaved, out=out, impl="triton")
    assert got.data_ptr() == out.data_ptr()
    ref.mla_kv_prep_reference(q_ref, kv, pos, nw, cache_ref, pt, prefix, 1e-6, 1e4, nope, cos_sin=cos_sin,
                              interleaved=interleaved)
    torch.testing.assert_close(q, q_ref, **_tol(dtype))  # the rope part rotated in place, the nope part untouched
    assert torch.equal(q[..., :nope], q_ref[..., :nope])
    _assert_same_cache_writes(cache, cache_ref, dtype)
    want = ref.mla_absorb_q_reference(q_ref.double(), w_uk.double(), nope)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got.double(), want, rtol=2 * eps, atol=4 * eps)


# q_a's RMSNorm folded away: q from the folded q_b over the un-normed q_a, the per-token scale from partial sums of
# squares (3 partials: not a power of two) against the normed chain; 2 x 3 tokens over two pages, 3 heads; q_a of
# magnitude ~8 so the scale is far from 1; theta angles and an interleaved rotary table
@pytest.mark.parametrize("table, interleaved", [(False, False), (True, True)])
def test_mla_prep_absorb_scaled_is_the_normed_chain(device, table, interleaved, poison):
    g = torch.Generator().manual_seed(400 + 2 * table + interleaved)
    b, k, h, nope, dr, r, ps, q_lora, eps_norm = 2, 3, 3, 32, 16, 64, 4, 48, 1e-6
    dtype = torch.bfloat16
    pt, prefix, cache, cache_chain, _, _, kv, nw = _mla_prep_inputs(g, device, b, k, h, nope, dr, r, ps, [2, 9], 12)
    cache_plain = cache.clone()
    w_uk = (torch.randn(h, nope, r, generator=g) / nope ** 0.5).to(dtype).to(device)
    a = (8 * torch.randn(b, k, q_lora, generator=g)).to(dtype).to(device)  # q_a as the qkv_a GEMV stored it
    gq = (1 + 0.3 * torch.randn(q_lora, generator=g)).to(dtype).to(device)  # q_a's norm weight
    q_b = (torch.randn(h * (nope + dr), q_lora, generator=g) / q_lora ** 0.5).to(dtype).to(device)
    angles = 6.0 * torch.rand(32, dr // 2, generator=g)
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1).to(device) if table else None
    pos = prefix.long().unsqueeze(1) + torch.tensor([0, 1, 1], device=device)
    kw = dict(cos_sin=cos_sin, interleaved=interleaved)
    sq = a.float().pow(2).reshape(b * k, q_lora)
    q_sumsq = torch.stack([sq[:, :20].sum(-1), sq[:, 20:40].sum(-1), sq[:, 40:].sum(-1)])  # [3, T]
    folded = (q_b.float() * gq.float()).to(dtype)
    q = (a.float() @ folded.float().t()).to(dtype).view(b, k, h, nope + dr)
    q_ref = q.clone()
    out = poison(torch.empty(b, k, h, r, dtype=dtype, device=device))
    got = fused_ops.mla_prep_absorb(q, kv, pos, nw, w_uk, cache, pt, prefix, eps=eps_norm, theta=1e4, nope_dim=nope,
                                    out=out, q_sumsq=q_sumsq, q_dim=q_lora, impl="triton", **kw)
    assert got.data_ptr() == out.data_ptr() and not torch.isnan(got).any()
    # the KV written is the unscaled op's, bit for bit
    fused_ops.mla_prep_absorb(q_ref.clone(), kv, pos, nw, w_uk, cache_plain, pt, prefix, eps=eps_norm, theta=1e4,
                              nope_dim=nope, impl="triton", **kw)
    assert torch.equal(cache.isnan(), cache_plain.isnan()) and torch.equal(cache.nan_to_num(), cache_plain.nan_to_num())
    # the reference of the scaled op: the kernel within its rounding
    ref_latent = fused_ops.mla_prep_absorb(q_ref, kv, pos, nw, w_uk, cache_chain.clone(), pt, prefix, eps=eps_norm,
                                           theta=1e4, nope_dim=nope, q_sumsq=q_sumsq, q_dim=q_lora, impl="reference",
                                           **kw)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got, ref_latent, rtol=2 * eps, atol=2 * eps * float(ref_latent.abs().max()))
    torch.testing.assert_close(q, q_ref, rtol=2 * eps, atol=2 * eps * float(q_ref.abs().max()))
    assert torch.equal(q[..., :nope], q_ref[..., :nope])  # the nope part is read, never written

    def chain(ctype):  # rmsnorm, q_b, then the unfused prep and absorption, all in ctype
        qn = ref.rmsnorm_reference(a.to(ctype), gq.to(ctype), eps_norm)
        qc = (qn @ q_b.to(ctype).t()).view(b, k, h, nope + dr)
        c = cache_chain.to(ctype)
        ref.mla_kv_prep_reference(qc, kv.to(ctype), pos, nw.to(ctype), c, pt, prefix, eps_norm, 1e4, nope, **kw)
        return ref.mla_absorb_q_reference(qc, w_uk.to(ctype), nope), qc

    lat64, q64 = chain(torch.float64)
    lat16, q16 = chain(dtype)
    # the fold moves where bf16 rounds (q_b * g once, the scale after q_b), nothing else: at most twice the bf16
    # chain's own error against fp64, plus two ulp of the largest value
    for mine, theirs, truth in ((got, lat16, lat64), (q[..., nope:], q16[..., nope:], q64[..., nope:])):
        e_fold = float((mine.double() - truth).abs().max())
        e_chain = float((theirs.double() - truth).abs().max())
        assert e_fold <= 2 * e_chain + 2 * eps * float(truth.abs().max()), (e_fold, e_chain)


def test_mla_prep_absorb_errors():
    q = torch.zeros(1, 2, 2, 48, dtype=torch.bfloat16)
    kv, nw = torch.zeros(1, 2, 80, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    args = (kv, torch.zeros(1, 2, dtype=torch.long), nw)
    tail = (torch.zeros(4, 4, 80, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="w_uk must be"):
        fused_ops.mla_prep_absorb(q, *args, torch.zeros(3, 32, 64, dtype=torch.bfloat16), *tail, eps=1e-6,
                                  theta=1e4, nope_dim=32)
    with pytest.raises(ValueError, match="cos_sin must be"):
        fused_ops.mla_prep_absorb(q, *args, torch.zeros(2, 32, 64, dtype=torch.bfloat16), *tail, eps=1e-6,
                                  theta=1e4, nope_dim=32, cos_sin=torch.zeros(8, 7))
    w_uk = torch.zeros(2, 32, 64, dtype=torch.bfloat16)
    cases = ((torch.zeros(3, 2, dtype=torch.bfloat16), 64, TypeError, "q_sumsq must be float32"),
             (torch.zeros(3, 4), 64, ValueError, r"q_sumsq must be float32 \[P >= 1, batch \* k = 2\]"),
             (torch.zeros(0, 2), 64, ValueError, r"\[P >= 1"),
             ([[1.0, 2.0]], 64, TypeError, "q_sumsq must be None or a tensor"),
             (torch.zeros(3, 2), None, TypeError, "q_dim must be the int q_lora_rank"),
             (torch.zeros(3, 2), 2.0, TypeError, "q_dim must be the int q_lora_rank"),
             (torch.zeros(3, 2), 0, ValueError, "q_dim must be the int q_lora_rank"),
             (None, 64, ValueError, "q_dim is read only with q_sumsq"))
    for bad, q_dim, err, match in cases:
        with pytest.raises(err, match=match):
            fused_ops.mla_prep_absorb(q, *args, w_uk, *tail, eps=1e-6, theta=1e4, nope_dim=32, q_sumsq=bad,
                                      q_dim=q_dim)


def test_mla_projection_errors(device):
    q = torch.zeros(1, 2, 2, 48)
    with pytest.raises(ValueError, match="w_uk must be"):
        fused_ops.mla_absorb_q(q, torch.zeros(3, 32, 64), 32)
    with pytest.raises(TypeError, match="w_uk must be a tensor"):
        fused_ops.mla_absorb_q(q, None, 32)
    with pytest.raises(ValueError, match="w_uv must be"):
        fused_ops.mla_up_v(torch.zeros(1, 2, 2, 64), torch.zeros(2, 32, 16))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        fused_ops.mla_up_v(torch.zeros(1, 2, 2, 64), torch.zeros(2, 64, 16), out=torch.zeros(1, 2, 16))
    with pytest.raises(ValueError, match="K a power of two"):
        fused_ops.mla_absorb_q(torch.zeros(1, 1, 2, 40, device=device), torch.zeros(2, 24, 64, device=device), 24,
                               impl="triton")
