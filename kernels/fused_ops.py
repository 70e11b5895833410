"""Fused small ops of the verify forward: each replaces a string of tiny torch kernels with one launch.

At verify sizes (a few tokens per rank) these ops move kilobytes; their cost is the launch, so the number of
launches per layer is what matters.

1. RMSNorm with an optional residual add::

       s = x + r            (when HAS_RES; s is written back to RES_OUT in the activation dtype)
       y = s * rsqrt(mean(s^2) + eps) * w

2. MLA KV preparation (absorbed MLA, one program per draft token t of request b, node i = t % k)::

       latent = rmsnorm(kv[t, :R]) * w                 R = kv_lora_rank
       k_pe   = rope(kv[t, R:R+Dr], pos[t])            rotate-half RoPE, inv_freq_j = theta^(-2j/Dr)
       cache[page_table[b, p // S], p % S] = [latent, k_pe]      p = prefix_lens[b] + i
       q[t, h, NOPE:NOPE+Dr] = rope(q[t, h, NOPE:NOPE+Dr], pos[t])   for every head h (in place)

3. GQA preparation (one program per (token, head)): optional per-head RMSNorm of q and k (Qwen3's qk-norm), RoPE
   of q in place, RoPE of k, then k and v written into their paged caches at ``prefix_lens[b] + i``.

4. SiLU-and-multiply: ``act[t, j] = silu(gu[t, j]) * gu[t, I + j]``.

5. Per-head projections of absorbed MLA (one program per (head, column tile), all tokens in row tiles)::

       q_latent[t, h, :] = q[t, h, :NOPE] @ W_uk[h]          W_uk [H, NOPE, R]   (query into the latent space)
       o[t, h * V + :]   = o_latent[t, h, :] @ W_uv[h]       W_uv [H, R, V]      (attention output out of it)

   fp32 accumulation, one rounding to the activation dtype; each weight element is loaded once per call.

6. MLA preparation and query absorption in one launch (items 2 and 5 side by side in one grid; the absorbed
   query reads q's nope columns, the preparation rotates its rope columns). With ``Q_SCALE`` q is q_b's output
   over a folded weight (q_b * q_a_norm along q_lora) from the un-normed q_a, and each program applies q_a's
   RMSNorm scale per token from the qkv_a GEMV's sums of squares (``specverify.gemv.gemv_sumsq``)::

       s_t = rsqrt(sum_p QSS[p, t] / q_dim + eps)
       q_latent[t, h, :] = s_t * (q[t, h, :NOPE] @ W_uk[h])                  (on the fp32 accumulator)
       q[t, h, NOPE:]    = rope(s_t * q[t, h, NOPE:], pos[t])                (in place, one rounding)

   q_b, the absorption and RoPE are linear in q per token, so this is the normed chain; q_a's RMSNorm kernel is
   gone from the pass. The partials are one [BLOCK_P, tokens] load beside each program's first activation load.

``PDL`` (every kernel here; programmatic dependent launch, sm_90+): the grid may start while the previous kernel
finishes; it loads only constant weights before ``gdc_wait`` and lets the next kernel launch at once
(``specverify.kernels.pdl``).

Tensors (T = batch * k tokens):

| name        | shape                         | dtype      | meaning                                      |
|-------------|-------------------------------|------------|----------------------------------------------|
| X, R        | [T, N]                        | bf16/fp16  | activations, residual                        |
| W           | [N]                           | bf16/fp16  | RMSNorm weight                               |
| KV          | [T, R + Dr]                   | bf16/fp16  | kv_a projection output (latent + rope key)   |
| Q           | [T, H, NOPE + Dr] (strided)   | bf16/fp16  | MLA query; rope part rotated in place        |
| POS         | [T]                           | int64      | RoPE position (prefix_len + depth)           |
| PAGE_TABLE  | [B, max_pages]                | int32      | page ids per request                         |
| PREFIX      | [B]                           | int32      | prefix length per request                    |
| CACHE       | [num_pages, S, ...]           | bf16/fp16  | paged KV cache                               |
| GU, ACT     | [T, 2I], [T, I]               | bf16/fp16  | gate/up projection, activation               |
| QSS         | [P, T] (strided)              | fp32       | per-tile sums of squares of q_a (Q_SCALE)    |
"""
import triton
import triton.language as tl

from specverify.kernels.pdl import pdl_enter


@triton.jit
def _rmsnorm_kernel(X, R, W, Y, RES_OUT, stride_x, stride_r, stride_y, stride_ro, N, eps,
                    HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait
    pdl_enter(PDL)
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(RES_OUT.dtype.element_ty)
        tl.store(RES_OUT + row * stride_ro + offs, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / N
    y = x * tl.rsqrt(var + eps) * w
    tl.store(Y + row * stride_y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rope_half(x1, x2, pos, j, half, log2_theta):
    # rotate-half RoPE of the pair (x1[j], x2[j]) with inv_freq_j = theta^(-2j / (2 * half))
    inv = tl.exp2(-(2.0 * j.to(tl.float32) / (2.0 * half)) * log2_theta)
    ang = pos.to(tl.float32) * inv
    c = tl.cos(ang)
    s = tl.sin(ang)
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _rope_pair(x1, x2, pos, j, half, log2_theta, COS_SIN, stride_cos_sin, TABLE: tl.constexpr):
    # RoPE of the pairs (x1[j], x2[j]): angles from a [max_pos, 2 * half] table (cos half, then sin half) when
    # TABLE, else inv_freq_j = theta^(-2j / (2 * half))
    if TABLE:
        row = COS_SIN + pos.to(tl.int64) * stride_cos_sin
        c = tl.load(row + j).to(tl.float32)
        s = tl.load(row + half + j).to(tl.float32)
        return x1 * c - x2 * s, x2 * c + x1 * s
    else:
        return _rope_half(x1, x2, pos, j, half, log2_theta)


@triton.jit
def _mla_kv_prep_kernel(KV, W, Q, POS, PAGE_TABLE, PREFIX, CACHE, COS_SIN,
                        stride_kv, stride_qt, stride_qh, stride_pt, stride_cp, stride_cs, stride_cos_sin,
                        k, page_size, num_heads, eps, log2_theta,
                        R: tl.constexpr, DR: tl.constexpr, NOPE: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, TABLE: tl.constexpr,
                        INTERLEAVED: tl.constexpr, PDL: tl.constexpr = False):
    _mla_kv_prep_token(tl.program_id(0), KV, W, Q, POS, PAGE_TABLE, PREFIX, CACHE, COS_SIN,
                       stride_kv, stride_qt, stride_qh, stride_pt, stride_cp, stride_cs, stride_cos_sin,
                       k, page_size, num_heads, eps, log2_theta, KV, 0, 0, 1, 1, R, DR, NOPE, BLOCK_R, BLOCK_H, TABLE,
                       INTERLEAVED, PDL, False, 1)


@triton.jit
def _q_scale_of(ss, q_dim, eps):
    # item 6's formula: rsqrt(sum over axis 0 of the parts' sums of squares ss / q_dim + eps), per token
    return tl.rsqrt(tl.sum(ss, axis=0) / q_dim + eps)


@triton.jit
def _q_scale(QSS, stride_sp, stride_st, offs_t, tmask, n_part, q_dim, eps, BLOCK_P: tl.constexpr):
    # item 6: s_t = rsqrt(sum_p QSS[p, t] / q_dim + eps) for the tokens offs_t [BLOCK_T] (masked ones: rsqrt(eps))
    rp = tl.arange(0, BLOCK_P)
    ss = tl.load(QSS + rp[:, None] * stride_sp + offs_t[None, :] * stride_st,
                 mask=(rp < n_part)[:, None] & tmask[None, :], other=0.0)
    return _q_scale_of(ss, q_dim, eps)


@triton.jit
def _mla_kv_prep_token(t, KV, W, Q, POS, PAGE_TABLE, PREFIX, CACHE, COS_SIN,
                       stride_kv, stride_qt, stride_qh, stride_pt, stride_cp, stride_cs, stride_cos_sin,
                       k, page_size, num_heads, eps, log2_theta, QSS, stride_sp, stride_st, n_part, q_dim,
                       R: tl.constexpr, DR: tl.constexpr, NOPE: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, TABLE: tl.constexpr,
                       INTERLEAVED: tl.constexpr, PDL: tl.constexpr, Q_SCALE: tl.constexpr, BLOCK_P: tl.constexpr):
    # item 2 of the docstring for draft token t (with Q_SCALE, item 6's scale of q's rope part)
    b = t // k
    i = t % k
    HALF: tl.constexpr = DR // 2
    offs = tl.arange(0, BLOCK_R)
    rmask = offs < R
    w = tl.load(W + offs, mask=rmask, other=0.0).to(tl.float32)  # a weight: before the wait
    pdl_enter(PDL)
    pos = tl.load(POS + t)
    if Q_SCALE:  # q_a's RMSNorm scale of this token, loaded beside its position
        rp = tl.arange(0, BLOCK_P)
        qs = _q_scale_of(tl.load(QSS + rp * stride_sp + t * stride_st, mask=rp < n_part, other=0.0), q_dim, eps)
    # latent: RMSNorm
    lat = tl.load(KV + t * stride_kv + offs, mask=rmask, other=0.0).to(tl.float32)
    var = tl.sum(lat * lat, axis=0) / R
    lat = lat * tl.rsqrt(var + eps) * w
    # rope pairs: (2j, 2j + 1) interleaved (GPT-J layout), else (j, j + DR / 2) (rotate-half)
    j = tl.arange(0, HALF)
    if INTERLEAVED:
        o1 = 2 * j
        o2 = 2 * j + 1
    else:
        o1 = j
        o2 = HALF + j
    x1 = tl.load(KV + t * stride_kv + R + o1).to(tl.float32)
    x2 = tl.load(KV + t * stride_kv + R + o2).to(tl.float32)
    y1, y2 = _rope_pair(x1, x2, pos, j, HALF, log2_theta, COS_SIN, stride_cos_sin, TABLE)
    # paged slot of node i
    p = tl.load(PREFIX + b) + i
    page = tl.load(PAGE_TABLE + b * stride_pt + p // page_size)
    base = CACHE + page.to(tl.int64) * stride_cp + (p % page_size) * stride_cs
    tl.store(base + offs, lat.to(CACHE.dtype.element_ty), mask=rmask)
    tl.store(base + R + o1, y1.to(CACHE.dtype.element_ty))
    tl.store(base + R + o2, y2.to(CACHE.dtype.element_ty))
    # query rope, every head (in place)
    h = tl.arange(0, BLOCK_H)
    hmask = h < num_heads
    qbase = Q + t * stride_qt + h[:, None] * stride_qh + NOPE
    q1 = tl.load(qbase + o1[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(qbase + o2[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
    if Q_SCALE:
        q1 = q1 * qs
        q2 = q2 * qs
    r1, r2 = _rope_pair(q1, q2, pos, j[None, :], HALF, log2_theta, COS_SIN, stride_cos_sin, TABLE)
    tl.store(qbase + o1[None, :], r1.to(Q.dtype.element_ty), mask=hmask[:, None])
    tl.store(qbase + o2[None, :], r2.to(Q.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def _norm_rope_head(base, NW, pos, j, eps, log2_theta, D: tl.constexpr, QK_NORM: tl.constexpr):
    # one head's vector at ``base``: optional RMSNorm (weight NW, rounded to the activation dtype as the
    # reference does), then rotate-half RoPE; returns the two halves in fp32
    HALF: tl.constexpr = D // 2
    x1 = tl.load(base + j).to(tl.float32)
    x2 = tl.load(base + HALF + j).to(tl.float32)
    if QK_NORM:
        rs = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
        x1 = (x1 * rs * tl.load(NW + j).to(tl.float32)).to(base.dtype.element_ty).to(tl.float32)
        x2 = (x2 * rs * tl.load(NW + HALF + j).to(tl.float32)).to(base.dtype.element_ty).to(tl.float32)
    return _rope_half(x1, x2, pos, j, HALF, log2_theta)


@triton.jit
def _gqa_prep_kernel(Q, K, V, QW, KW, POS, PAGE_TABLE, PREFIX, K_CACHE, V_CACHE,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pt,
                     stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch,
                     k, page_size, num_q_heads, eps, log2_theta,
                     D: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr = False):
    t = tl.program_id(0)
    head = tl.program_id(1)
    pdl_enter(PDL)
    HALF: tl.constexpr = D // 2
    j = tl.arange(0, HALF)
    pos = tl.load(POS + t)
    if head < num_q_heads:
        base = Q + t * stride_qt + head * stride_qh
        y1, y2 = _norm_rope_head(base, QW, pos, j, eps, log2_theta, D, QK_NORM)
        tl.store(base + j, y1.to(Q.dtype.element_ty))
        tl.store(base + HALF + j, y2.to(Q.dtype.element_ty))
    else:
        kh = head - num_q_heads
        b = t // k
        i = t % k
        y1, y2 = _norm_rope_head(K + t * stride_kt + kh * stride_kh, KW, pos, j, eps, log2_theta, D, QK_NORM)
        p = tl.load(PREFIX + b) + i
        page = tl.load(PAGE_TABLE + b * stride_pt + p // page_size).to(tl.int64)
        kc = K_CACHE + page * stride_kcp + (p % page_size) * stride_kcs + kh * stride_kch
        tl.store(kc + j, y1.to(K_CACHE.dtype.element_ty))
        tl.store(kc + HALF + j, y2.to(K_CACHE.dtype.element_ty))
        d = tl.arange(0, D)
        v = tl.load(V + t * stride_vt + kh * stride_vh + d)
        vc = V_CACHE + page * stride_vcp + (p % page_size) * stride_vcs + kh * stride_vch
        tl.store(vc + d, v.to(V_CACHE.dtype.element_ty))


@triton.jit
def _silu_mul_kernel(GU, ACT, stride_gu, stride_act, inter, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    t = tl.program_id(0)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(GU + t * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + t * stride_gu + inter + offs, mask=mask, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))) * u
    tl.store(ACT + t * stride_act + offs, a.to(ACT.dtype.element_ty), mask=mask)


@triton.jit
def _head_matmul_kernel(A, W, OUT, T, stride_at, stride_ah, stride_wh, stride_wk, stride_ot, stride_oh,
                        KDIM: tl.constexpr, NDIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                        UPCAST: tl.constexpr, PDL: tl.constexpr = False):
    """OUT[t, h, n] = sum_j A[t, h, j] * W[h, j, n] for one head and one tile of n (item 5 of the docstring).
    UPCAST (fp32 inputs, and the interpreter, whose bf16 ``tl.dot`` returns garbage) multiplies in full fp32."""
    _head_matmul_tile(tl.program_id(0), tl.program_id(1), A, W, OUT, T, stride_at, stride_ah, stride_wh, stride_wk,
                      stride_ot, stride_oh, A, 0, 0, 1, 1, 0.0, KDIM, NDIM, BLOCK_T, BLOCK_N, UPCAST, PDL, False, 1)


@triton.jit
def _mla_prep_absorb_kernel(A, W, OUT, T, stride_at, stride_ah, stride_wh, stride_wk, stride_ot, stride_oh,
                            KV, NW, POS, PAGE_TABLE, PREFIX, CACHE, COS_SIN,
                            stride_kv, stride_pt, stride_cp, stride_cs, stride_cos_sin,
                            k, page_size, num_heads, eps, log2_theta, QSS, stride_sp, stride_st, n_part, q_dim,
                            KDIM: tl.constexpr, NDIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                            UPCAST: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_H: tl.constexpr, TABLE: tl.constexpr, INTERLEAVED: tl.constexpr,
                            Q_SCALE: tl.constexpr = False, BLOCK_P: tl.constexpr = 1, PDL: tl.constexpr = False):
    """Items 2 and 5 in one grid: programs [0, heads * column tiles) absorb the query (q_nope @ W_uk), the T
    programs after them prepare one draft token each (latent norm, rope key, KV write, query rope). The two read
    disjoint parts of Q (nope / rope columns), so they need no order between them. ``Q_SCALE``: item 6 (QSS [P, T]
    with strides (stride_sp, stride_st), P = n_part; both kinds of program scale by q_a's RMSNorm)."""
    pid = tl.program_id(0)
    tiles: tl.constexpr = NDIM // BLOCK_N
    if pid < num_heads * tiles:
        _head_matmul_tile(pid // tiles, pid % tiles, A, W, OUT, T, stride_at, stride_ah, stride_wh, stride_wk,
                          stride_ot, stride_oh, QSS, stride_sp, stride_st, n_part, q_dim, eps, KDIM, NDIM, BLOCK_T,
                          BLOCK_N, UPCAST, PDL, Q_SCALE, BLOCK_P)
    else:
        _mla_kv_prep_token(pid - num_heads * tiles, KV, NW, A, POS, PAGE_TABLE, PREFIX, CACHE, COS_SIN,
                           stride_kv, stride_at, stride_ah, stride_pt, stride_cp, stride_cs, stride_cos_sin,
                           k, page_size, num_heads, eps, log2_theta, QSS, stride_sp, stride_st, n_part, q_dim,
                           R, DR, KDIM, BLOCK_R, BLOCK_H, TABLE, INTERLEAVED, PDL, Q_SCALE, BLOCK_P)


@triton.jit
def _head_matmul_tile(h, nb, A, W, OUT, T, stride_at, stride_ah, stride_wh, stride_wk, stride_ot, stride_oh,
                      QSS, stride_sp, stride_st, n_part, q_dim, eps,
                      KDIM: tl.constexpr, NDIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                      UPCAST: tl.constexpr, PDL: tl.constexpr, Q_SCALE: tl.constexpr, BLOCK_P: tl.constexpr):
    offs_k = tl.arange(0, KDIM)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    w = tl.load(W + h * stride_wh + offs_k[:, None] * stride_wk + offs_n[None, :])
    if UPCAST:
        w = w.to(tl.float32)
    pdl_enter(PDL)  # the weight tile above is constant: loaded while the previous kernel finishes
    for t0 in range(0, T, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        tm = offs_t < T
        a = tl.load(A + offs_t[:, None] * stride_at + h * stride_ah + offs_k[None, :], mask=tm[:, None], other=0.0)
        if Q_SCALE:  # item 6: the rows' q_a RMSNorm scales, loaded beside their activations
            qs = _q_scale(QSS, stride_sp, stride_st, offs_t, tm, n_part, q_dim, eps, BLOCK_P)
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), w, input_precision="ieee")
        else:
            acc = tl.dot(a, w)
        if Q_SCALE:
            acc = acc * qs[:, None]
        tl.store(OUT + offs_t[:, None] * stride_ot + h * stride_oh + offs_n[None, :],
                 acc.to(OUT.dtype.element_ty), mask=tm[:, None])
