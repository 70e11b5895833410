"""Quantised experts: the int4 (W4A16, group-wise) and fp8 (W8A16, block) formats of ``specverify.reference.quant``
and ``fused_moe(..., quant=MoEQuant(...))`` on every expert path, against the fp64 loop over the dequantised
weights."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import spy_launches, warm_up_for_capture

import specverify.moe as moe_mod
from specverify.moe import MoEQuant, fused_moe, moe_route
from specverify.reference.moe import (fused_moe_loop_reference, fused_moe_reference, random_expert_weights,
                                      shared_expert_reference)
from specverify.reference.quant import (dequantize_fp8_block, dequantize_int4, int4_from_quads, int4_to_quads,
                                        quantize_fp8_block, quantize_int4)


# ---------------------------------------------------------------------------------------------- the formats
def test_int4_packing_and_rounding():
    w = torch.randn(3, 6, 64, generator=torch.Generator().manual_seed(1))
    packed, scale = quantize_int4(w, 32)
    assert packed.dtype == torch.uint8 and list(packed.shape) == [3, 6, 32] and list(scale.shape) == [3, 6, 2]
    codes = torch.stack([packed & 0xF, packed >> 4], -1).flatten(-2).long()  # column 2j low nibble, 2j + 1 high
    want = (torch.round(w.view(3, 6, 2, 32) / scale[..., None]).clamp(-8, 7) + 8).view(3, 6, 64).long()
    assert torch.equal(codes, want)
    back = dequantize_int4(packed, scale, 32)
    assert ((back - w).abs() <= scale.repeat_interleave(32, -1) / 2 + 1e-7).all()  # half a step at most


def test_int4_is_compressed_tensors_int32_bytes():
    # compressed-tensors packs code k of a row at bits 4 * (k % 8) of int32 word k // 8: the same bytes as ours
    w = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    packed, _ = quantize_int4(w, 32)
    codes = torch.stack([packed & 0xF, packed >> 4], -1).flatten(-2).to(torch.int64)  # [5, 64]
    words = (codes.view(5, 8, 8) << (4 * torch.arange(8))).sum(-1)  # [5, 8], values < 2^32
    int32 = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    assert torch.equal(int32.view(torch.uint8), packed)


def test_int4_quads_layout():
    # quads: for rows 4i..4i+3, word w (bytes 4w..4w+3) of the 4 rows side by side, then word w + 1; the scales of
    # a group side by side; the inverse gives the rows back
    g = torch.Generator().manual_seed(4)
    packed = torch.randint(0, 256, (3, 8, 12), generator=g, dtype=torch.uint8)  # E 3, N 8 rows, K 24 columns
    scale = torch.rand(3, 8, 3, generator=g)
    pq, sq = int4_to_quads(packed, scale)
    assert pq.shape == packed.shape and sq.shape == scale.shape and pq.is_contiguous()
    flat, sflat = pq.flatten(), sq.flatten()
    for e in range(3):
        for n in range(8):
            for j in range(12):
                at = e * 96 + (n // 4) * 48 + (j // 4) * 16 + (n % 4) * 4 + j % 4
                assert flat[at] == packed[e, n, j]
            for grp in range(3):
                assert sflat[e * 24 + (n // 4) * 12 + grp * 4 + n % 4] == scale[e, n, grp]
    back, sback = int4_from_quads(pq, sq)
    assert torch.equal(back, packed) and torch.equal(sback, scale)
    with pytest.raises(ValueError, match="multiple of 4"):
        int4_to_quads(packed[:, :6], scale[:, :6])


def test_fp8_block_rounding():
    w = torch.randn(2, 40, 72, generator=torch.Generator().manual_seed(3))  # partial edge blocks both ways
    w8, scale = quantize_fp8_block(w, (16, 32))
    assert w8.dtype == torch.float8_e4m3fn and list(scale.shape) == [2, 3, 3]
    back = dequantize_fp8_block(w8, scale, (16, 32))
    s = scale.repeat_interleave(16, -2)[:, :40].repeat_interleave(32, -1)[..., :72]
    # e4m3 keeps 3 mantissa bits: half a unit in the last place is at most 2^-4 of the value; subnormals 2^-10 * s
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + s * 2 ** -10).all()


# ---------------------------------------------------------------------------------------------- the experts
def _quantised(fmt, w13, w2, shape):
    """``fmt`` "int4", "int4q" (int4 in row quads) or "fp8"."""
    if fmt in ("int4", "int4q"):
        p13, s13 = quantize_int4(w13, shape)
        p2, s2 = quantize_int4(w2, shape)
        s13, s2 = s13.to(torch.bfloat16), s2.to(torch.bfloat16)
        if fmt == "int4q":
            p13, s13 = int4_to_quads(p13, s13)
            p2, s2 = int4_to_quads(p2, s2)
        return p13, p2, MoEQuant("int4", s13, s2, group_size=shape, layout="quads" if fmt == "int4q" else "rows")
    p13, s13 = quantize_fp8_block(w13, shape)
    p2, s2 = quantize_fp8_block(w2, shape)
    return p13, p2, MoEQuant("fp8", s13, s2, block_shape=shape)


def check_quant_experts(hidden, p13, p2, q, ids, w, **kw):
    """The kernel against the fp64 loop over the dequantised weights (plus the shared expert's in fp64 with
    ``shared_expert=``); tolerance: twice what torch errs computing in hidden's dtype from the dequantised weights
    rounded to it, plus a floor; with a shared expert also what a one-ulp flip of each rounded activation (bf16:
    2^-7 of it) moves the output, and half an ulp of the output (its rounding may go the other way than torch's)."""
    d13, d2 = q.dequantize(p13, p2, torch.float64)
    want = fused_moe_loop_reference(hidden, d13, d2, ids, w)
    shared = kw.get("shared_expert")
    if shared is not None:
        want = want + shared_expert_reference(hidden, *shared, compute_dtype=torch.float64)
    torch_out = fused_moe_reference(hidden, d13.to(hidden.dtype), d2.to(hidden.dtype), ids, w,
                                    compute_dtype=hidden.dtype, shared_expert=shared)
    tol = 2 * (torch_out.double() - want).abs().max().item() + 2 ** -8 * 1e-2 * want.abs().max().item() + 1e-6
    if shared is not None:
        gu = hidden.double() @ shared[0].double().t()
        act = torch.nn.functional.silu(gu[:, :gu.shape[1] // 2]) * gu[:, gu.shape[1] // 2:]
        tol += ((act.abs() * 2 ** -7) @ shared[1].double().abs().t()).max().item() + 2 ** -8 * want.abs().max().item()
    out = fused_moe(hidden, p13, p2, ids, w, quant=q, impl="triton", **kw)
    err = (out.double() - want).abs().max().item()
    assert out.dtype == hidden.dtype and out.shape == hidden.shape
    assert err <= tol, f"quantised fused_moe error {err:.3g} > tolerance {tol:.3g}"
    return out


# (format, group or block, H, I): H = 64 / I = 32 hold whole groups in every tile; H = 256 with 128-column groups
# puts two groups in a stream tile and a dot tile inside one group; fp8 at H = 192 / I = 64 with (32, 128) blocks has
# a partial last block column.
QUANT_CASES = [("int4", 16, 64, 32), ("int4", 128, 256, 128), ("fp8", (16, 32), 64, 32), ("fp8", (32, 128), 192, 64),
               ("int4q", 16, 64, 32), ("int4q", 128, 256, 128)]


@pytest.mark.parametrize("path", ["fma", "splitk", "dot"])
@pytest.mark.parametrize("fmt, shape, h, inter", QUANT_CASES)
def test_fused_moe_quant_paths(device, poison, monkeypatch, path, fmt, shape, h, inter):
    # 3 tokens x top-3 over 8 experts (stream paths) or forced to the block-aligned dot path; a slot with -1 and
    # two tokens sharing an expert
    m, e = 3, 8
    monkeypatch.setitem(moe_mod._VARIANT, "experts", "dot" if path == "dot" else "stream")
    monkeypatch.setitem(moe_mod._STREAM_OVERRIDE, "gate_up", "fma" if path == "dot" else path)
    w13, w2 = random_expert_weights(e, h, inter, dtype=torch.float32, seed=40)
    p13, p2, q = _quantised(fmt, w13, w2, shape)
    g = torch.Generator().manual_seed(41)
    hidden = torch.randn(m, h, generator=g).bfloat16()
    ids = torch.tensor([[1, 5, 2], [5, -1, 7], [0, 3, 6]], dtype=torch.int32)
    w = torch.rand(m, 3, generator=g)
    p13, p2 = p13.to(device), p2.to(device)
    q = dataclasses.replace(q, w13_scale=q.w13_scale.to(device), w2_scale=q.w2_scale.to(device))
    out = poison(hidden.to(device))
    res = check_quant_experts(hidden.to(device), p13, p2, q, ids.to(device), w.to(device), out=out)
    assert res.data_ptr() == out.data_ptr()


@pytest.mark.parametrize("qpf, ls", [(0, 0), (1, 0), (0, 3)])
@pytest.mark.parametrize("fmt, shape", [("int4", 16), ("int4", 64), ("fp8", (16, 32))])
def test_stream_gate_up_over_many_tiles(device, poison, monkeypatch, qpf, ls, fmt, shape):
    # H = 176 in 32-column tiles: six loop steps, the last one half past H, so the int4 next-tile loads (QPF, int4
    # only) rotate five times and the last prefetch lies wholly past H (fp8: a partial last block column); int4
    # groups of 64 (H = 192, I = 64) span two tiles each. 2 tokens x top-2: stream gate/up, the down tile of up to
    # qBH rows. LS 3: the loop pipelined by Triton (3 stages; the interpreter runs it as a plain loop).
    m, e, h, inter = 2, 6, *((192, 64) if shape == 64 else (176, 32))
    monkeypatch.setitem(moe_mod._VARIANT, "experts", "stream")
    monkeypatch.setitem(moe_mod._STREAM_OVERRIDE, "gate_up", "fma")
    monkeypatch.setitem(moe_mod._STREAM_OVERRIDE, "BK", 32)
    monkeypatch.setitem(moe_mod._STREAM_OVERRIDE, "QPF", qpf)
    monkeypatch.setitem(moe_mod._STREAM_OVERRIDE, "LS", ls)
    w13, w2 = random_expert_weights(e, h, inter, dtype=torch.float32, seed=50 + qpf + ls)
    p13, p2, q = _quantised(fmt, w13, w2, shape)
    q = MoEQuant(q.format, q.w13_scale.to(device), q.w2_scale.to(device), q.group_size, q.block_shape)
    g = torch.Generator().manual_seed(51)
    hidden = torch.randn(m, h, generator=g).bfloat16().to(device)
    ids = torch.tensor([[4, 1], [1, 5]], dtype=torch.int32, device=device)
    w = torch.rand(m, 2, generator=g).to(device)
    check_quant_experts(hidden, p13.to(device), p2.to(device), q, ids, w, out=poison(hidden))


@pytest.mark.parametrize("rq, bkw, ls, group, h, inter", [(1, 16, 0, 16, 176, 32), (2, 16, 3, 16, 176, 32),
                                                          (8, 16, 0, 16, 176, 48), (1, 16, 0, 256, 512, 256)])
def test_int4_quads_stream_gate_up(device, poison, monkeypatch, rq, bkw, ls, group, h, inter):
    # the row-quad gate/up over several steps of 16 code words (128 columns), the last one partly past H (176 = 22
    # words); RQ 8 over I = 48 (12 quads) leaves the second tile half empty; a group of 256 columns spans two steps
    # (H = 512); LS 3: pipelined by Triton on a GPU (a plain loop in the interpreter). 3 tokens x top-2, a -1 slot.
    m, e = 3, 6
    monkeypatch.setitem(moe_mod._VARIANT, "experts", "stream")
    monkeypatch.setitem(moe_mod._STREAM_OVERRIDE, "gate_up", "fma")
    for k, v in (("q4RQ", rq), ("q4BKW", bkw), ("q4LS", ls)):
        monkeypatch.setitem(moe_mod._STREAM_OVERRIDE, k, v)
    w13, w2 = random_expert_weights(e, h, inter, dtype=torch.float32, seed=60 + rq + ls)
    p13, p2, q = _quantised("int4q", w13, w2, group)
    q = dataclasses.replace(q, w13_scale=q.w13_scale.to(device), w2_scale=q.w2_scale.to(device))
    g = torch.Generator().manual_seed(61)
    hidden = torch.randn(m, h, generator=g).bfloat16().to(device)
    ids = torch.tensor([[4, 1], [1, -1], [0, 5]], dtype=torch.int32, device=device)
    w = torch.rand(m, 2, generator=g).to(device)
    check_quant_experts(hidden, p13.to(device), p2.to(device), q, ids, w, out=poison(hidden))


_SHARED_CASES = [("int4q", "stream", 1, 2, 32, 4096, 1), ("int4q", "stream", 3, 4, 64, 512, 1),
                 ("int4q", "stream", 2, 1, 512, 64, 1), ("int4q", "stream", 2, 32, 64, 4096, 1),
                 ("int4q", "stream", 2, 2, 32, 4096, 2), ("int4q", "dot", 3, 2, 32, 4096, 1),
                 ("int4", "stream", 2, 2, 32, 4096, 1), ("fp8", "stream", 2, 2, 32, 4096, 1)]


@pytest.mark.parametrize("one_sum", [0, 1])  # the q4 down kernel's top-k sums token by token or as one reduction
@pytest.mark.parametrize("fmt, path, m, r, bk, tile, si", _SHARED_CASES)
def test_fused_moe_shared_expert(device, poison, monkeypatch, fmt, path, m, r, bk, tile, si, one_sum):
    # an unquantised shared expert beside quantised routed experts: inside the q4 stream launches (int4 quads with
    # the shared I equal to the routed I: its gate/up programs of R rows over H = 176 in BK-column steps, the last
    # one partial, R 32 over I = 48 a second program half past I; the down tile of 1 to 8 row quads, I = 48 padded
    # to 64), else two matmuls and an add (I' = 2I, the dot path, rows, fp8). A -1 slot; the output poisoned.
    e, h, inter = 6, 176 if fmt != "fp8" else 192, 48 if fmt != "fp8" else 32
    import specverify.kernels.fused_moe as kern
    spies = [spy_launches(monkeypatch, kern, n)
             for n in ("_moe_stream_gate_up_q4_kernel", "_moe_stream_down_q4_kernel")]
    monkeypatch.setitem(moe_mod._VARIANT, "experts", path)
    monkeypatch.setitem(moe_mod._STREAM_OVERRIDE, "gate_up", "fma")
    for k, v in (("q4sR", r), ("q4sBK", bk), ("q4dTILE", tile), ("q4dTILE_m1", tile), ("q4d_one_sum", one_sum)):
        monkeypatch.setitem(moe_mod._STREAM_OVERRIDE, k, v)
    w13, w2 = random_expert_weights(e, h, inter, dtype=torch.float32, seed=70 + m + r)
    p13, p2, q = _quantised(fmt, w13, w2, (16, 32) if fmt == "fp8" else 16)
    q = dataclasses.replace(q, w13_scale=q.w13_scale.to(device), w2_scale=q.w2_scale.to(device))
    g = torch.Generator().manual_seed(71 + m)
    s13, s2 = random_expert_weights(1, h, si * inter, dtype=torch.float32, seed=72 + si)
    shared = (s13[0].bfloat16().to(device), s2[0].bfloat16().to(device))
    hidden = torch.randn(m, h, generator=g).bfloat16().to(device)
    ids = torch.tensor([[4, 1], [1, -1], [0, 5]][:m], dtype=torch.int32, device=device)
    w = torch.rand(m, 2, generator=g).to(device)
    out = poison(hidden)
    res = check_quant_experts(hidden, p13.to(device), p2.to(device), q, ids, w, out=out, shared_expert=shared)
    assert res.data_ptr() == out.data_ptr()
    # fused exactly where it should be: both q4 launches with SHARED and the shared programs in the gate/up grid
    fused = fmt == "int4q" and path == "stream" and si == 1
    shared_kw = [kw.get("SHARED", False) for spy in spies for kw in spy.kwargs]
    assert shared_kw == ([True, True] if fused else [False] * len(shared_kw))
    if fused:
        kw = spies[0].kwargs[0]
        assert spies[0].grids[0][0] == m * 2 * -(-inter // (4 * kw["RQ"])) + m * -(-inter // kw["SR"])
    ref = fused_moe(hidden, p13.to(device), p2.to(device), ids, w, quant=q, shared_expert=shared, impl="reference")
    d13, d2 = q.dequantize(p13.to(device), p2.to(device))
    assert torch.equal(ref, fused_moe_reference(hidden, d13, d2, ids, w, shared_expert=shared))


@pytest.mark.parametrize("m, r, bk, one_sum", [(1, 2, 32, 1), (2, 32, 64, 1), (3, 1, 512, 1), (3, 2, 64, 0)])
def test_int4_quads_shared_expert_rows_exact(device, monkeypatch, m, r, bk, one_sum):
    # the shared expert's own rows, tightly: its act rows (M * top_k + token) within one rounding of the fp64
    # SwiGLU, and with every routed weight 0 the output within one rounding of those act rows times its w2, so a
    # dropped row of I, a dropped column or a scaled term cannot hide under the whole layer's tolerance; the down
    # kernel's top-k sums as one reduction (top_k a power of two) and token by token
    e, h, inter, top = 6, 176, 48, 2
    for k, v in (("q4sR", r), ("q4sBK", bk), ("q4d_one_sum", one_sum)):
        monkeypatch.setitem(moe_mod._STREAM_OVERRIDE, k, v)
    w13, w2 = random_expert_weights(e, h, inter, dtype=torch.float32, seed=74 + m)
    p13, p2, q = _quantised("int4q", w13, w2, 16)
    q = dataclasses.replace(q, w13_scale=q.w13_scale.to(device), w2_scale=q.w2_scale.to(device))
    s13, s2 = random_expert_weights(1, h, inter, dtype=torch.float32, seed=75)
    s13, s2 = s13[0].bfloat16().to(device), s2[0].bfloat16().to(device)
    g = torch.Generator().manual_seed(76 + m)
    hidden = torch.randn(m, h, generator=g).bfloat16().to(device)
    ids = torch.tensor([[4, 1], [1, -1], [0, 5]][:m], dtype=torch.int32, device=device)
    cfg = moe_mod._stream_config(m, h, inter, top, device == "cuda", "int4")
    act = moe_mod.stream_gate_up(hidden, p13.to(device), ids, cfg, False, q, s13)
    assert act.shape == (m * top + m, inter)
    # bounds: one ulp of the bf16 result (the interpreter's fp32 -> bf16 truncates; a GPU rounds to nearest, half
    # of it), plus fp32 summation over n terms (n 2^-24 sum |terms|) carried through silu(g) * u (|silu'| <= 1.1)
    x = hidden.double()
    gu, gu_abs = x @ s13.double().t(), x.abs() @ s13.double().abs().t()
    g, u = gu[:, :inter], gu[:, inter:]
    want = torch.nn.functional.silu(g) * u
    eg, eu = h * 2 ** -24 * gu_abs[:, :inter], h * 2 ** -24 * gu_abs[:, inter:]
    bound = want.abs() * 2 ** -7 + 1.1 * u.abs() * eg + torch.nn.functional.silu(g).abs() * eu + 1e-30
    err = (act[m * top:].double() - want).abs()
    assert (err <= bound).all(), (err / bound).max()
    out = fused_moe(hidden, p13.to(device), p2.to(device), ids, torch.zeros(m, top, device=device), quant=q,
                    shared_expert=(s13, s2))
    a = act[m * top:].double()
    y = a @ s2.double().t()
    bound = y.abs() * 2 ** -7 + inter * 2 ** -24 * (a.abs() @ s2.double().abs().t()) + 1e-30
    err = (out.double() - y).abs()
    assert (err <= bound).all(), (err / bound).max()


def _one_token_int4q(seed):
    """A token routed to expert 1 of 2 int4 experts in row quads (H 64, I 32): the fp32 weights, the stored ones,
    their MoEQuant, hidden, ids and weights (CPU)."""
    w13, w2 = random_expert_weights(2, 64, 32, dtype=torch.float32, seed=seed)
    p13, p2, q = _quantised("int4q", w13, w2, 16)
    return w13, w2, p13, p2, q, torch.randn(1, 64).bfloat16(), torch.tensor([[1]], dtype=torch.int32), torch.ones(1, 1)


def test_fused_moe_shared_expert_refuses_bad_weights(device):
    w13, w2, p13, p2, q, hidden, ids, w = _one_token_int4q(73)
    s13, s2 = w13[0].bfloat16(), w2[0].bfloat16()
    with pytest.raises(TypeError, match="pair of tensors"):
        fused_moe(hidden, p13, p2, ids, w, quant=q, shared_expert=s13)
    with pytest.raises(ValueError, match="same I"):
        fused_moe(hidden, p13, p2, ids, w, quant=q, shared_expert=(s13, s2[:, :16]))
    with pytest.raises(TypeError, match="hidden's dtype"):
        fused_moe(hidden, p13, p2, ids, w, quant=q, shared_expert=(s13.float(), s2))
    with pytest.raises(ValueError, match="contiguous rows"):
        fused_moe(hidden, p13, p2, ids, w, quant=q, shared_expert=(s13, s2.t().contiguous().t()))


def test_int4_quads_refuse_what_they_cannot_read(device):
    e, h, inter = 2, 64, 32
    w13, w2, p13, p2, q, hidden, ids, w = _one_token_int4q(62)
    with pytest.raises(ValueError, match="layout must be 'rows' or 'quads'"):
        fused_moe(hidden, p13, p2, ids, w, quant=dataclasses.replace(q, layout="cols"))
    f13, fs = quantize_fp8_block(w13, (16, 32))
    f2, fs2 = quantize_fp8_block(w2, (16, 32))
    with pytest.raises(ValueError, match="int4 layout"):
        fused_moe(hidden, f13, f2, ids, w, quant=MoEQuant("fp8", fs, fs2, block_shape=(16, 32), layout="quads"))
    with pytest.raises(ValueError, match="group_size >= 8"):
        r13, rs = quantize_int4(w13, 4)
        r2, rs2 = quantize_int4(w2, 4)
        fused_moe(hidden, r13, r2, ids, w, quant=MoEQuant("int4", rs, rs2, group_size=4, layout="quads"))
    # gate and up rows 0..31 of each expert without the last column bytes: a view, not quads
    view13 = torch.empty(e, 2 * inter, h // 2 + 4, dtype=torch.uint8)[..., :h // 2]
    view13.copy_(p13)
    with pytest.raises(ValueError, match="contiguous"):
        fused_moe(hidden, view13, p2, ids, w, quant=q)


@pytest.mark.parametrize("fmt, shape", [("int4", 16), ("fp8", (16, 32)), ("int4q", 16)])
def test_fused_moe_quant_fp16_and_reference_impl(device, fmt, shape):
    # fp16 hidden states with fp32 scales; impl="reference" dequantises and agrees with the kernel's definition
    m, e, h, inter = 2, 4, 64, 32
    w13, w2 = random_expert_weights(e, h, inter, dtype=torch.float32, seed=42)
    p13, p2, q = _quantised(fmt, w13, w2, shape)
    q = dataclasses.replace(q, w13_scale=q.w13_scale.float().to(device), w2_scale=q.w2_scale.float().to(device))
    hidden = torch.randn(m, h, generator=torch.Generator().manual_seed(43)).half().to(device)
    ids, w = moe_route(torch.randn(m, e).to(device), top_k=2, impl="reference")
    check_quant_experts(hidden, p13.to(device), p2.to(device), q, ids, w)
    ref = fused_moe(hidden, p13.to(device), p2.to(device), ids, w, quant=q, impl="reference")
    d13, d2 = q.dequantize(p13.to(device), p2.to(device))
    assert torch.equal(ref, fused_moe_reference(hidden, d13, d2, ids, w))


def test_fused_moe_quant_reads_the_scales(device):
    # a scale changed by 2x changes exactly its group's contribution: the kernel reads each group's own scale
    m, e, h, inter = 1, 2, 64, 32
    w13, w2 = random_expert_weights(e, h, inter, dtype=torch.float32, seed=44)
    p13, p2, q = _quantised("int4", w13, w2, 16)
    s13 = q.w13_scale.clone()
    s13[1, 3, 2] *= 2  # expert 1, gate row 3, columns 32..47
    q2 = MoEQuant("int4", s13.to(device), q.w2_scale.to(device), group_size=16)
    hidden = torch.randn(m, h, generator=torch.Generator().manual_seed(45)).bfloat16().to(device)
    ids = torch.tensor([[1]], dtype=torch.int32, device=device)
    w = torch.ones(1, 1, device=device)
    check_quant_experts(hidden, p13.to(device), p2.to(device), q2, ids, w)


# ---------------------------------------------------------------------------------------------- GPU, real sizes
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])  # split-K gate/up, FMA gate/up, then the dot path
@pytest.mark.parametrize("fmt, shape", [("int4", 32), ("fp8", (128, 128)), ("int4q", 32)])
def test_fused_moe_quant_kimi_k2_rank_gpu(fmt, shape, m):
    # a Kimi-K2 rank at tp 8 (H 7168, I 256, top-8) over 64 experts: Kimi-K2.5's int4 and Kimi-K2's fp8 formats
    e, h, inter = 64, 7168, 256
    w13, w2 = random_expert_weights(e, h, inter, dtype=torch.float32, device="cuda", seed=46)
    p13, p2, q = _quantised(fmt, w13, w2, shape)
    del w13, w2
    g = torch.Generator().manual_seed(47 + m)
    hidden = torch.randn(m, h, generator=g).bfloat16().cuda()
    ids, w, al = moe_route(torch.randn(m, e, generator=g).cuda(), top_k=8, block_size=16, routed_scaling_factor=2.827)
    d13, d2 = q.dequantize(p13, p2, torch.float64)
    want = fused_moe_reference(hidden, d13, d2, ids, w, compute_dtype=torch.float64).double()
    torch_out = fused_moe_reference(hidden, d13.bfloat16(), d2.bfloat16(), ids, w, compute_dtype=torch.bfloat16)
    tol = 2 * (torch_out.double() - want).abs().max().item() + 1e-6
    out = fused_moe(hidden, p13, p2, ids, w, alignment=al, quant=q)
    assert (out.double() - want).abs().max().item() <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4, 8, 12])  # the q4 stream launches with the shared expert, then beside them
def test_fused_moe_shared_expert_kimi_k2_rank_gpu(poison, m):
    # Kimi-K2.5 at tp 8: int4 routed experts in row quads (group 32) with the bf16 shared expert (I 256), 64 experts
    e, h, inter = 64, 7168, 256
    w13, w2 = random_expert_weights(e, h, inter, dtype=torch.float32, device="cuda", seed=49)
    p13, p2, q = _quantised("int4q", w13, w2, 32)
    s13, s2 = random_expert_weights(1, h, inter, dtype=torch.float32, device="cuda", seed=50)
    del w13, w2
    g = torch.Generator().manual_seed(51 + m)
    hidden = torch.randn(m, h, generator=g).bfloat16().cuda()
    ids, w = moe_route(torch.randn(m, e, generator=g).cuda(), top_k=8, routed_scaling_factor=2.827)
    check_quant_experts(hidden, p13, p2, q, ids, w, out=poison(hidden),
                        shared_expert=(s13[0].bfloat16(), s2[0].bfloat16()))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, shape", [("int4", 32), ("fp8", (128, 128)), ("int4q", 32), ("int4q+shared", 32)])
@pytest.mark.parametrize("m", [1, 4, 12])
def test_fused_moe_quant_cuda_graph_gpu(graph_replay, fmt, shape, m):
    # eager -> capture -> replay -> change the inputs in place -> replay -> compare with eager
    e, h, inter = 32, 512, 128
    w13, w2 = random_expert_weights(e, h, inter, dtype=torch.float32, device="cuda", seed=48)
    p13, p2, q = _quantised(fmt.removesuffix("+shared"), w13, w2, shape)
    shared = (w13[0].bfloat16(), w2[0].bfloat16()) if fmt.endswith("+shared") else None
    logits = torch.randn(m, e, device="cuda")
    hidden = torch.randn(m, h, device="cuda").bfloat16()

    def step():
        ids, w, al = moe_route(logits, top_k=4, block_size=16)
        return ids, fused_moe(hidden, p13, p2, ids, w, alignment=al, quant=q, shared_expert=shared)

    warm_up_for_capture(step)
    graph_replay(step, (logits, hidden))
