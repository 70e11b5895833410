"""Triton kernels for tree acceptance: greedy (split argmax + walk) and speculative sampling with fused
temperature / top-k / top-p / min-p (chunk statistics + per-row thresholds + walk), two launches each.

Math (per row r = (request b, node n), scaled logits z = x / T_b, w = exp(z - M_r), M_r = max z):

* Greedy: target_r = argmax_v x_r[v] (ties: lowest v). Walking from node 0, the first child c of the current
  node with draft[c] == target_cur is accepted; the bonus is target at the last accepted node.
* Processed distribution: q_r(v) ∝ w_v · [key(z_v) >= tau_r] · [w_v >= min_p_b]. tau_r = max(tau_k, tau_p):
  tau_k = the top_k-th largest z (ties kept), tau_p = the largest t with sum_{z >= max(t, tau_k)} w >= top_p · Z_k,
  Z_k = sum_{z >= tau_k} w. key() is the order-preserving int32 image of an fp32 value.
* No sort: each chunk of CHUNK logits keeps (in registers) the elements with z >= floor_c, floor_c found by an
  in-register bisection so at most CAP survive; every element with z >= F = max_c floor_c is then a candidate,
  so thresholds >= F are exact from the candidates (snapped searches over int keys, below); otherwise (flat rows,
  huge top-k) the row program falls back to an exact bisection with passes over the whole row.
* Sampling walk: at the node at depth d the children are tried in node order; child j is accepted when
  u[b, d] < sum of q over the distinct tokens of the siblings tried so far (j included). The bonus is drawn by
  inverse CDF in vocabulary order with u[b, L-1] from q at the last accepted node with the tokens of all its
  children removed and the rest renormalised. T_b <= 0 makes request b greedy.

Sampling kernels (``_accept_scan_kernel`` + ``_accept_select_kernel``): the capacity per chunk adapts so every row
has about ``slots`` (4096) candidate slots (``cap = slots // S``: 51 per chunk of 2048 at V = 163840, 256 at
V = 32000), which keeps the floor F low and the full-row fallbacks rare; unused slots hold z = -inf (no counts to
load first). Thresholds by *snapped* searches: each probe is one multi-operand reduction returning the sum above the
probe and the nearest candidate keys on both sides, and the interval snaps to those keys, so a search ends when no
candidate key lies strictly inside (about log2 of the distinct candidate keys: ~8 probes for bf16 logits, not the 33
of a plain bisection over int32 keys). Each row program also computes the acceptance mass q of its children's tokens
and its own bonus draw (inverse CDF over its candidates), so the walk after the counter loads a few [k] vectors and
never touches the logits (unless the kept set is not inside the candidates: then the walker draws the bonus with
passes over the row).

Tensors (rows = batch * k, S = cdiv(V, CHUNK)):

| name            | shape          | dtype            | meaning                                              |
| --------------- | -------------- | ---------------- | ---------------------------------------------------- |
| logits          | [rows, V]      | fp32/bf16/fp16   | target logits, row stride ``stride_row``               |
| parents         | [batch, k]     | int32/int64      | tree parents, -1 for node 0                            |
| draft           | [batch, k]     | int32/int64      | draft token of each node (node 0 ignored)              |
| target_ids      | [batch, k]     | int32/int64      | greedy only: precomputed argmax per node               |
| temperature     | [batch]        | fp32             | per request (or a scalar argument)                     |
| top_k           | [batch]        | int32            | <= 0 or >= V: off                                      |
| top_p, min_p    | [batch]        | fp32             | top_p >= 1: off; min_p <= 0: off                       |
| uniforms        | [batch, L]     | fp32             | [:, d]: acceptance sample at depth d; [:, L-1] bonus   |
| c_max, c_sum    | [rows, S]      | fp32             | chunk max of z, sum exp(z - c_max)                     |
| c_arg           | [rows, S]      | int32            | first argmax in the chunk                              |
| c_floor         | [rows, S]      | fp32             | candidate floor of the chunk                           |
| cand_z, cand_i  | [rows, S, CAP] | fp32, int32      | candidates (z, vocab id), in vocabulary order; slots   |
|                 |                |                  | past the count hold z = -inf                           |
| r_max           | [rows]         | fp32             | M_r                                                    |
| r_tau, r_arg    | [rows]         | int32            | key threshold tau_r, argmax                            |
| r_full          | [rows]         | int32            | 1: every kept element is a candidate                   |
| r_bonus, r_q    | [rows]         | int32, fp32      | bonus if the walk ends at the row's node; q of         |
|                 |                |                  | the node's token under its parent (0 for node 0)       |
| counter         | [batch]        | int32            | zero between launches; last row program walks, resets |
| out_tokens      | [batch, L]     | int64            | accepted draft tokens, bonus at accept_len, then -1    |
| out_len         | [batch]        | int64            | accepted proposed tokens                               |
| out_nodes       | [batch, L]     | int64            | accepted node path (0 first), then -1                  |
"""
from __future__ import annotations

import triton
import triton.language as tl

#: Default chunk of the vocabulary per program of the greedy argmax.
CHUNK = 4096


@triton.jit
def _okey(z):
    """Order-preserving int32 key of an fp32 value (monotone: a < b  <=>  key(a) < key(b), -0 normalised)."""
    b = (z + 0.0).to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _load_param_f(ptr, b, scalar, IS_TENSOR: tl.constexpr):
    if IS_TENSOR:
        return tl.load(ptr + b).to(tl.float32)
    else:
        return scalar


@triton.jit
def _load_param_i(ptr, b, scalar, IS_TENSOR: tl.constexpr):
    if IS_TENSOR:
        return tl.load(ptr + b).to(tl.int32)
    else:
        return scalar


@triton.jit
def _request_params(b, temp_ptr, temp_s, topk_ptr, topk_s, topp_ptr, topp_s, minp_ptr, minp_s, TEMP_T: tl.constexpr,
                    TOPK_T: tl.constexpr, TOPP_T: tl.constexpr, MINP_T: tl.constexpr):
    """Request b's sampling parameters: (temperature, 1 / temperature or 1 when greedy, top_k, top_p, min_p)."""
    t = _load_param_f(temp_ptr, b, temp_s, TEMP_T)
    inv_t = tl.where(t > 0.0, 1.0 / t, 1.0)
    top_k = _load_param_i(topk_ptr, b, topk_s, TOPK_T)
    top_p = _load_param_f(topp_ptr, b, topp_s, TOPP_T)
    min_p = _load_param_f(minp_ptr, b, minp_s, MINP_T)
    return t, inv_t, top_k, top_p, min_p


@triton.jit(do_not_specialize=["V", "stride_row", "S"])
def _accept_chunk_kernel(logits_ptr, stride_row, V, S, c_max_ptr, c_arg_ptr, CHUNK: tl.constexpr):
    """Greedy: max and first argmax of each chunk of the row."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    valid = offs < V
    z = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=valid, other=float("-inf")).to(tl.float32)
    m = tl.max(z, axis=0)
    arg = tl.min(tl.where(z == m, offs, 2147483647), axis=0)
    sidx = row * S + c
    tl.store(c_max_ptr + sidx, m)
    tl.store(c_arg_ptr + sidx, arg)


@triton.jit
def _row_count_mass(logits_ptr, row_off, V, inv_t, M, kthr, BLOCK: tl.constexpr):
    """Count and mass (sum exp(z - M)) of the finite elements of a row whose key is >= kthr (int64)."""
    cnt = tl.zeros((), tl.int32)
    mass = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        vm = offs < V
        z = tl.load(logits_ptr + row_off + offs, mask=vm, other=float("-inf")).to(tl.float32) * inv_t + 0.0
        sel = vm & (z > float("-inf")) & (_okey(z).to(tl.int64) >= kthr)
        cnt += tl.sum(sel.to(tl.int32), axis=0)
        mass += tl.sum(tl.where(sel, tl.exp(z - M), 0.0), axis=0)
    return cnt, mass


@triton.jit
def _row_kept_mass(logits_ptr, row_off, V, inv_t, M, kthr, min_p, BLOCK: tl.constexpr):
    mass = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        vm = offs < V
        z = tl.load(logits_ptr + row_off + offs, mask=vm, other=float("-inf")).to(tl.float32) * inv_t + 0.0
        w = tl.exp(z - M)
        sel = vm & (z > float("-inf")) & (_okey(z).to(tl.int64) >= kthr) & (w >= min_p)
        mass += tl.sum(tl.where(sel, w, 0.0), axis=0)
    return mass


@triton.jit(do_not_specialize=["K", "L", "S"])
def _greedy_walk_kernel(parents_ptr, draft_ptr, target_ptr, c_max_ptr, c_arg_ptr, K, L, S,
                        out_tokens_ptr, out_len_ptr, out_nodes_ptr,
                        HAS_TARGET: tl.constexpr, K_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr):
    b = tl.program_id(0)
    offs_k = tl.arange(0, K_BLOCK)
    kmask = offs_k < K
    par = tl.load(parents_ptr + b * K + offs_k, mask=kmask, other=-2).to(tl.int32)
    tok = tl.load(draft_ptr + b * K + offs_k, mask=kmask, other=-1).to(tl.int32)
    if HAS_TARGET:
        tgt = tl.load(target_ptr + b * K + offs_k, mask=kmask, other=-1).to(tl.int32)
    else:
        cs = tl.arange(0, S_BLOCK)
        m2 = kmask[:, None] & (cs[None, :] < S)
        idx = (b * K + offs_k[:, None]) * S + cs[None, :]
        cmax = tl.load(c_max_ptr + idx, mask=m2, other=float("-inf"))
        carg = tl.load(c_arg_ptr + idx, mask=m2, other=2147483647)
        rmax = tl.max(cmax, axis=1)
        tgt = tl.min(tl.where(cmax == rmax[:, None], carg, 2147483647), axis=1)
    cur = tl.zeros((), tl.int32)
    alive = tl.zeros((), tl.int32) + 1
    acc = tl.zeros((), tl.int32)
    nodes = tl.where(offs_k == 0, 0, -1)
    toks = tl.zeros((K_BLOCK,), tl.int32) - 1
    for d in range(1, L):
        want = tl.sum(tl.where(offs_k == cur, tgt, 0), axis=0)
        hit = kmask & (par == tl.where(alive != 0, cur, -7)) & (tok == want)
        first = tl.min(tl.where(hit, offs_k, K_BLOCK), axis=0)
        found = first < K_BLOCK
        nodes = tl.where(offs_k == d, tl.where(found, first, -1), nodes)
        toks = tl.where(offs_k == d - 1, tl.where(found, want, -1), toks)
        cur = tl.where(found, first, cur)
        acc += found.to(tl.int32)
        alive = alive * found.to(tl.int32)
    bonus = tl.sum(tl.where(offs_k == cur, tgt, 0), axis=0)
    toks = tl.where(offs_k == acc, bonus, toks)
    lmask = offs_k < L
    tl.store(out_tokens_ptr + b * L + offs_k, toks.to(tl.int64), mask=lmask)
    tl.store(out_nodes_ptr + b * L + offs_k, nodes.to(tl.int64), mask=lmask)
    tl.store(out_len_ptr + b, acc.to(tl.int64))


# ==== sampling: adaptive candidate capacity, snapped threshold searches, per-row bonus ===========================


@triton.jit
def _sum2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _sum3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _max_arg_max(m1, a1, f1, m2, a2, f2):
    """(max of m with the smallest payload a among the maxima, max of f)."""
    take1 = (m1 > m2) | ((m1 == m2) & (a1 < a2))
    return tl.where(take1, m1, m2), tl.where(take1, a1, a2), tl.maximum(f1, f2)


@triton.jit
def _stats_combine(c1, n1, x1, s1, c2, n2, x2, s2):
    return c1 + c2, tl.minimum(n1, n2), tl.maximum(x1, x2), s1 + s2


@triton.jit
def _snap_combine(s1, n1, p1, s2, n2, p2):
    """(sum, smallest key at or above the probe, largest key below it)."""
    return s1 + s2, tl.minimum(n1, n2), tl.maximum(p1, p2)


@triton.jit
def _first_last(f1, i1, l1, j1, f2, i2, l2, j2):
    """(smallest f with its payload, largest l with its payload)."""
    a = f1 < f2
    c = l1 > l2
    return tl.where(a, f1, f2), tl.where(a, i1, i2), tl.where(c, l1, l2), tl.where(c, j1, j2)


@triton.jit
def _snap_search(ck, val, sel, lo, hi, need, FUSED: tl.constexpr):
    """Largest key t with sum(val over sel & ck >= t) >= need, for lo, hi keys of selected elements, lo satisfying.

    The answer is always a key of a selected element (the sum only changes at element keys), so each probe
    reports the nearest selected keys on both sides and the interval snaps to them: the search ends when no
    selected key lies strictly between lo and hi (about log2 of the distinct keys, at most 32 probes), one block
    reduction per probe. ``ck`` int32 keys; ``lo``, ``hi`` int64 scalars. FUSED: one multi-operand reduction per
    probe (GPU); otherwise three plain ones (the interpreter runs custom combines element by element).
    """
    while lo < hi:
        mid = (lo + (hi - lo + 1) // 2).to(tl.int32)
        above = sel & (ck >= mid)
        if FUSED:
            s, nxt, prv = tl.reduce((tl.where(above, val, 0), tl.where(above, ck, 2147483647),
                                     tl.where(sel & (ck < mid), ck, -2147483648)), 0, _snap_combine)
        else:
            s = tl.sum(tl.where(above, val, 0), axis=0)
            nxt = tl.min(tl.where(above, ck, 2147483647), axis=0)
            prv = tl.max(tl.where(sel & (ck < mid), ck, -2147483648), axis=0)
        go = s >= need
        lo = tl.where(go, nxt.to(tl.int64), lo)
        hi = tl.where(go, hi, prv.to(tl.int64))
    return lo


@triton.jit(do_not_specialize=["V", "stride_row", "S", "K", "temp_s"])
def _accept_scan_kernel(logits_ptr, stride_row, V, S, K, temp_ptr, temp_s,
                        c_max_ptr, c_arg_ptr, c_sum_ptr, c_floor_ptr, cand_z_ptr, cand_i_ptr,
                        TEMP_T: tl.constexpr, CHUNK: tl.constexpr, CAP: tl.constexpr, CAP_BLOCK: tl.constexpr,
                        FLOOR_ITERS: tl.constexpr, FUSED: tl.constexpr = True):
    """Chunk statistics and at most CAP candidates per chunk; unused candidate slots are padded with z = -inf so
    the row kernel loads the slots without a count. Reductions: (max, argmax), (sum exp, finite count, window
    count) and FLOOR_ITERS floor probes (64 / 2**FLOOR_ITERS nat resolution), then one scan."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    loc = tl.arange(0, CHUNK)
    offs = c * CHUNK + loc
    valid = offs < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=valid, other=float("-inf")).to(tl.float32)
    t = _load_param_f(temp_ptr, row // K, temp_s, TEMP_T)
    inv_t = tl.where(t > 0.0, 1.0 / t, 1.0)
    z = x * inv_t + 0.0
    if FUSED:
        m, a_loc = tl.max(z, axis=0, return_indices=True, return_indices_tie_break_left=True)
    else:
        m = tl.max(z, axis=0)
        a_loc = tl.min(tl.where(z == m, loc, CHUNK), axis=0)
    fin = valid & (z > float("-inf"))
    m_safe = tl.where(m > float("-inf"), m, 0.0)
    lo = m_safe - 64.0
    e = tl.where(fin, tl.exp(z - m_safe), 0.0)
    if FUSED:
        s, n_fin, c_lo = tl.reduce((e, fin.to(tl.int32), (fin & (z >= lo)).to(tl.int32)), 0, _sum3)
    else:
        s = tl.sum(e, axis=0)
        n_fin = tl.sum(fin.to(tl.int32), axis=0)
        c_lo = tl.sum((fin & (z >= lo)).to(tl.int32), axis=0)
    # floor: lowest probe in [m - 64, m] with at most CAP elements at or above it (c_hi: that count)
    hi = tl.where(c_lo <= CAP, lo, m_safe)
    c_hi = tl.where(c_lo <= CAP, c_lo, CHUNK + 1)
    if c_lo > CAP:
        for _ in range(FLOOR_ITERS):
            mid = (lo + hi) * 0.5
            cnt = tl.sum((fin & (z >= mid)).to(tl.int32), axis=0)
            ok = cnt <= CAP
            hi = tl.where(ok, mid, hi)
            c_hi = tl.where(ok, cnt, c_hi)
            lo = tl.where(ok, lo, mid)
    small = n_fin <= CAP
    have = small | (c_hi <= CAP)
    floor = tl.where(small, float("-inf"), tl.where(have, hi, float("inf")))
    cnt = tl.where(small, n_fin, tl.where(have, c_hi, 0))
    keep = tl.where(have, fin & (z >= floor), loc < 0)  # (a block & a scalar bool trips the interpreter)
    pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    sidx = row * S + c
    base = sidx.to(tl.int64) * CAP
    tl.store(cand_z_ptr + base + pos, z, mask=keep)
    tl.store(cand_i_ptr + base + pos, offs, mask=keep)
    jj = tl.arange(0, CAP_BLOCK)
    tl.store(cand_z_ptr + base + jj, tl.zeros((CAP_BLOCK,), tl.float32) + float("-inf"), mask=(jj >= cnt) & (jj < CAP))
    tl.store(c_max_ptr + sidx, m)
    tl.store(c_arg_ptr + sidx, c * CHUNK + a_loc)
    tl.store(c_sum_ptr + sidx, s)
    tl.store(c_floor_ptr + sidx, floor)


@triton.jit
def _fallback_tau(logits_ptr, row_off, V, inv_t, M, top_k, k_on, top_p, p_on, BLOCK: tl.constexpr):
    """Exact thresholds by bisection with passes over the whole row (rows whose threshold lies below the
    candidate floor). Same definition as the candidate path."""
    NEG_KEY: tl.constexpr = -2147483649
    tau_k = tl.zeros((), tl.int64) + NEG_KEY
    lo0 = _okey(tl.zeros((), tl.float32) - 3.4028234663852886e38).to(tl.int64)
    hi0 = _okey(M).to(tl.int64) + 1
    if k_on:
        c0, _m0 = _row_count_mass(logits_ptr, row_off, V, inv_t, M, lo0, BLOCK)
        if c0 >= top_k:
            lo = lo0
            hi = hi0
            for _ in range(33):
                mid = lo + (hi - lo) // 2
                cnt, _ms = _row_count_mass(logits_ptr, row_off, V, inv_t, M, mid, BLOCK)
                go = cnt >= top_k
                lo = tl.where(go, mid, lo)
                hi = tl.where(go, hi, mid)
            tau_k = lo
    tau_p = tl.zeros((), tl.int64) + NEG_KEY
    if p_on:
        _ck0, zk = _row_count_mass(logits_ptr, row_off, V, inv_t, M, tau_k, BLOCK)
        target = top_p * zk
        lo = tl.maximum(lo0, tau_k)
        hi = hi0
        for _ in range(33):
            mid = lo + (hi - lo) // 2
            cnt, msum = _row_count_mass(logits_ptr, row_off, V, inv_t, M, tl.maximum(mid, tau_k), BLOCK)
            go = (msum >= target) & (cnt > 0)
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        tau_p = lo
    return tl.maximum(tau_k, tau_p)


@triton.jit
def _row_bonus_scan(logits_ptr, parents_ptr, draft_ptr, b, K, crow, stride_row, V, inv_t, m_c, t_c, min_p, ub,
                    fallback, BLOCK: tl.constexpr):
    """Inverse-CDF bonus draw with two passes over row ``crow`` (kept set given by m_c, t_c, min_p), the tokens of
    the children of node ``crow - b * K`` removed; ``fallback`` when nothing is kept."""
    cur = crow - b * K
    roff = crow.to(tl.int64) * stride_row
    W = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        vm = offs < V
        z = tl.load(logits_ptr + roff + offs, mask=vm, other=float("-inf")).to(tl.float32) * inv_t + 0.0
        w = tl.exp(z - m_c)
        keep = vm & (z > float("-inf")) & (_okey(z) >= t_c) & (w >= min_p)
        for j in range(K):
            pj = tl.load(parents_ptr + b * K + j).to(tl.int32)
            tj = tl.load(draft_ptr + b * K + j).to(tl.int32)
            keep = keep & (offs != tl.where((pj == cur) & (j > 0), tj, -5))
        W += tl.sum(tl.where(keep, w, 0.0), axis=0)
    target = ub * W
    run = tl.zeros((), tl.float32)
    pick = tl.zeros((), tl.int32) - 1
    lastpos = tl.zeros((), tl.int32) - 1
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        vm = offs < V
        z = tl.load(logits_ptr + roff + offs, mask=vm, other=float("-inf")).to(tl.float32) * inv_t + 0.0
        w = tl.exp(z - m_c)
        keep = vm & (z > float("-inf")) & (_okey(z) >= t_c) & (w >= min_p)
        for j in range(K):
            pj = tl.load(parents_ptr + b * K + j).to(tl.int32)
            tj = tl.load(draft_ptr + b * K + j).to(tl.int32)
            keep = keep & (offs != tl.where((pj == cur) & (j > 0), tj, -5))
        w = tl.where(keep, w, 0.0)
        pre = run + tl.cumsum(w, axis=0)
        hit = keep & (pre > target)
        fh = tl.min(tl.where(hit, offs, 2147483647), axis=0)
        pick = tl.where((pick < 0) & (fh < 2147483647), fh, pick)
        lastpos = tl.maximum(lastpos, tl.max(tl.where(keep, offs, -1), axis=0))
        run += tl.sum(w, axis=0)
    pick = tl.where(pick >= 0, pick, lastpos)
    return tl.where(pick >= 0, pick, fallback)


@triton.jit(do_not_specialize=["V", "stride_row", "S", "K", "L", "temp_s", "topk_s", "topp_s", "minp_s"])
def _accept_select_kernel(logits_ptr, stride_row, V, S, K, L,
                          parents_ptr, draft_ptr, unif_ptr,
                          temp_ptr, temp_s, topk_ptr, topk_s, topp_ptr, topp_s, minp_ptr, minp_s,
                          c_max_ptr, c_arg_ptr, c_sum_ptr, c_floor_ptr, cand_z_ptr, cand_i_ptr,
                          r_max_ptr, r_tau_ptr, r_arg_ptr, r_full_ptr, r_bonus_ptr, r_q_ptr, counter_ptr,
                          out_tokens_ptr, out_len_ptr, out_nodes_ptr,
                          TEMP_T: tl.constexpr, TOPK_T: tl.constexpr, TOPP_T: tl.constexpr, MINP_T: tl.constexpr,
                          S_BLOCK: tl.constexpr, N_SLOTS: tl.constexpr, N_BLOCK: tl.constexpr,
                          K_BLOCK: tl.constexpr, BLOCK: tl.constexpr, FUSED: tl.constexpr = True):
    """One program per row: thresholds from the candidates by snapped searches, the acceptance mass of each
    child's token and the row's own bonus draw (so the walk needs no loads from the logits), then the last row
    program of the request walks the tree."""
    row = tl.program_id(0)
    b = row // K
    node = row - b * K
    t, inv_t, top_k, top_p, min_p = _request_params(b, temp_ptr, temp_s, topk_ptr, topk_s, topp_ptr, topp_s, minp_ptr,
                                                    minp_s, TEMP_T, TOPK_T, TOPP_T, MINP_T)
    row_off = row.to(tl.int64) * stride_row
    NEG_KEY: tl.constexpr = -2147483649  # below every int32 key: "no threshold"

    # ---- every load that does not depend on another one, issued first -------------------------------------------
    offs_k = tl.arange(0, K_BLOCK)
    kmask = offs_k < K
    par = tl.load(parents_ptr + b * K + offs_k, mask=kmask, other=-2).to(tl.int32)
    tok = tl.load(draft_ptr + b * K + offs_k, mask=kmask, other=-1).to(tl.int32)
    uvec = tl.load(unif_ptr + b * L + offs_k, mask=offs_k < L, other=1.0)
    ub = tl.load(unif_ptr + b * L + L - 1)
    mine = kmask & (offs_k > 0) & (par == node)
    zt = tl.load(logits_ptr + row_off + tok, mask=mine, other=float("-inf")).to(tl.float32) * inv_t + 0.0
    cs = tl.arange(0, S_BLOCK)
    cm_mask = cs < S
    cmax = tl.load(c_max_ptr + row * S + cs, mask=cm_mask, other=float("-inf"))
    carg = tl.load(c_arg_ptr + row * S + cs, mask=cm_mask, other=2147483647)
    cfl = tl.load(c_floor_ptr + row * S + cs, mask=cm_mask, other=float("-inf"))
    csum = tl.load(c_sum_ptr + row * S + cs, mask=cm_mask, other=0.0)
    f = tl.arange(0, N_BLOCK)
    fm = f < N_SLOTS
    slot = row.to(tl.int64) * N_SLOTS + f
    cz = tl.load(cand_z_ptr + slot, mask=fm, other=float("-inf"))
    ci = tl.load(cand_i_ptr + slot, mask=fm, other=-1)
    # earlier sibling with the same token (same parent): its mass was counted already
    same = (tok[:, None] == tok[None, :]) & (par[:, None] == par[None, :]) & (offs_k[None, :] < offs_k[:, None])
    dup = tl.max(same.to(tl.int32), axis=1) > 0

    if FUSED:
        M, arg, F = tl.reduce((cmax, carg, cfl), 0, _max_arg_max)
    else:
        M = tl.max(cmax, axis=0)
        arg = tl.min(tl.where(cmax == M, carg, 2147483647), axis=0)
        F = tl.max(cfl, axis=0)
    tau = tl.zeros((), tl.int64) + NEG_KEY
    norm = tl.zeros((), tl.float32) + 1.0
    full = tl.zeros((), tl.int32)
    bonus = arg
    if t > 0.0:
        Z = tl.sum(tl.where(cmax > float("-inf"), csum * tl.exp(cmax - M), 0.0), axis=0)
        all_cap = F == float("-inf")
        kF = _okey(F).to(tl.int64)
        cvalid = cz > float("-inf")
        cw = tl.where(cvalid, tl.exp(cz - M), 0.0)
        ck = _okey(cz)
        if FUSED:
            n_c, kmin32, kmax32, m_all = tl.reduce((cvalid.to(tl.int32), tl.where(cvalid, ck, 2147483647),
                                                    tl.where(cvalid, ck, -2147483648), cw), 0, _stats_combine)
        else:
            n_c = tl.sum(cvalid.to(tl.int32), axis=0)
            kmin32 = tl.min(tl.where(cvalid, ck, 2147483647), axis=0)
            kmax32 = tl.max(tl.where(cvalid, ck, -2147483648), axis=0)
            m_all = tl.sum(cw, axis=0)
        kmin = kmin32.to(tl.int64)
        kmax = kmax32.to(tl.int64)
        ok = n_c >= 0
        # top-k: the top_k-th largest key among the candidates
        tau_k = tl.zeros((), tl.int64) + NEG_KEY
        k_on = (top_k > 0) & (top_k < V)
        if k_on:
            if n_c >= top_k:
                tau_k = _snap_search(ck, 1, cvalid, kmin, kmax, top_k, FUSED)
                ok = ok & ((tau_k >= kF) | all_cap)
            else:
                ok = ok & all_cap
        # top-p over the candidates (on the top-k set)
        tau_p = tl.zeros((), tl.int64) + NEG_KEY
        p_on = top_p < 1.0
        if p_on:
            inset = cvalid & (ck >= tau_k)
            m_lo = m_all
            zk = Z
            if k_on:
                m_lo = tl.sum(tl.where(inset, cw, 0.0), axis=0)
                zk = m_lo
            target = top_p * zk
            if m_lo >= target:
                tau_p = _snap_search(ck, cw, inset, tl.maximum(kmin, tau_k), kmax, target, FUSED)
                ok = ok & ((tau_p >= kF) | all_cap)
            else:
                tau_p = kmin
                ok = ok & all_cap
        if ok:
            tau = tl.maximum(tau_k, tau_p)
            # every kept element is a candidate when the threshold or the min-p cut lies at or above F
            full_b = all_cap | (tau >= kF) | (tl.exp(F - M) < min_p)
            kept = cvalid & (ck >= tau) & (cw >= min_p)
            keepw = kept
            for j in tl.static_range(1, K_BLOCK):
                pj = tl.load(parents_ptr + b * K + j, mask=j < K, other=-2).to(tl.int32)
                tj = tl.load(draft_ptr + b * K + j, mask=j < K, other=-1).to(tl.int32)
                keepw = keepw & (ci != tl.where(pj == node, tj, -5))
            if FUSED:
                norm_c, W = tl.reduce((tl.where(kept, cw, 0.0), tl.where(keepw, cw, 0.0)), 0, _sum2)
            else:
                norm_c = tl.sum(tl.where(kept, cw, 0.0), axis=0)
                W = tl.sum(tl.where(keepw, cw, 0.0), axis=0)
            norm = tl.where(full_b, norm_c, Z)
            if (full_b == 0) & (min_p > 0.0):
                norm = _row_kept_mass(logits_ptr, row_off, V, inv_t, M, tau, min_p, BLOCK)
            full = full_b.to(tl.int32)
            if full_b:
                # the bonus if the walk ends here: inverse CDF in vocabulary order (slots are in vocabulary order)
                pre = tl.cumsum(tl.where(keepw, cw, 0.0), axis=0)
                hit = keepw & (pre > ub * W)
                if FUSED:
                    fh, ih, fl, il = tl.reduce((tl.where(hit, f, 2147483647), ci, tl.where(keepw, f, -1), ci), 0,
                                               _first_last)
                else:
                    fh = tl.min(tl.where(hit, f, 2147483647), axis=0)
                    fl = tl.max(tl.where(keepw, f, -1), axis=0)
                    ih = tl.sum(tl.where(f == fh, ci, 0), axis=0)
                    il = tl.sum(tl.where(f == fl, ci, 0), axis=0)
                bonus = tl.where(fh < 2147483647, ih, tl.where(fl >= 0, il, arg))
        else:
            tau = _fallback_tau(logits_ptr, row_off, V, inv_t, M, top_k, k_on, top_p, p_on, BLOCK)
            norm = _row_kept_mass(logits_ptr, row_off, V, inv_t, M, tau, min_p, BLOCK)
            full = tl.zeros((), tl.int32)
        # acceptance mass of each child's token (0 for a repeated sibling token)
        wt = tl.exp(zt - M)
        keptc = mine & (~dup) & (zt > float("-inf")) & (_okey(zt).to(tl.int64) >= tau) & (wt >= min_p)
        tl.store(r_q_ptr + b * K + offs_k, tl.where(keptc, wt / norm, 0.0), mask=mine)
    tl.store(r_max_ptr + row, M)
    tl.store(r_tau_ptr + row, tl.maximum(tau, -2147483648).to(tl.int32))
    tl.store(r_arg_ptr + row, arg)
    tl.store(r_full_ptr + row, full)
    tl.store(r_bonus_ptr + row, bonus)

    # ---- the last row program of request b walks the tree (no loads from the logits unless a row is not full) ----
    done = tl.atomic_add(counter_ptr + b, 1, sem="acq_rel")
    if done == K - 1:
        tl.atomic_xchg(counter_ptr + b, 0, sem="relaxed")
        rows_b = b * K + offs_k
        v_arg = tl.load(r_arg_ptr + rows_b, mask=kmask, other=0, volatile=True)
        v_full = tl.load(r_full_ptr + rows_b, mask=kmask, other=0, volatile=True)
        v_bonus = tl.load(r_bonus_ptr + rows_b, mask=kmask, other=0, volatile=True)
        v_q = tl.load(r_q_ptr + rows_b, mask=kmask & (offs_k > 0), other=0.0, volatile=True)
        cur = tl.zeros((), tl.int32)
        alive = tl.zeros((), tl.int32) + 1
        acc = tl.zeros((), tl.int32)
        nodes = tl.where(offs_k == 0, 0, -1)
        toks = tl.zeros((K_BLOCK,), tl.int32) - 1
        for d in range(1, L):
            is_child = kmask & (par == tl.where(alive != 0, cur, -7))
            if t <= 0.0:
                want = tl.sum(tl.where(offs_k == cur, v_arg, 0), axis=0)
                hit = is_child & (tok == want)
            else:
                u = tl.sum(tl.where(offs_k == d - 1, uvec, 0.0), axis=0)
                acc_q = tl.cumsum(tl.where(is_child, v_q, 0.0), axis=0)
                hit = is_child & (u < acc_q)
            first = tl.min(tl.where(hit, offs_k, K_BLOCK), axis=0)
            found = first < K_BLOCK
            ftok = tl.sum(tl.where(offs_k == first, tok, 0), axis=0)
            nodes = tl.where(offs_k == d, tl.where(found, first, -1), nodes)
            toks = tl.where(offs_k == d - 1, tl.where(found, ftok, -1), toks)
            cur = tl.where(found, first, cur)
            acc += found.to(tl.int32)
            alive = alive * found.to(tl.int32)
        sel_cur = offs_k == cur
        bonus_w = tl.sum(tl.where(sel_cur, tl.where(t <= 0.0, v_arg, v_bonus), 0), axis=0)
        if t > 0.0:
            f_c = tl.sum(tl.where(sel_cur, v_full, 0), axis=0)
            if f_c == 0:
                v_max = tl.load(r_max_ptr + rows_b, mask=kmask, other=0.0, volatile=True)
                v_tau = tl.load(r_tau_ptr + rows_b, mask=kmask, other=0, volatile=True)
                m_c = tl.sum(tl.where(sel_cur, v_max, 0.0), axis=0)
                t_c = tl.sum(tl.where(sel_cur, v_tau, 0), axis=0)
                a_c = tl.sum(tl.where(sel_cur, v_arg, 0), axis=0)
                bonus_w = _row_bonus_scan(logits_ptr, parents_ptr, draft_ptr, b, K, b * K + cur, stride_row, V,
                                          inv_t, m_c, t_c, min_p, ub, a_c, BLOCK)
        toks = tl.where(offs_k == acc, bonus_w, toks)
        lmask = offs_k < L
        tl.store(out_tokens_ptr + b * L + offs_k, toks.to(tl.int64), mask=lmask)
        tl.store(out_nodes_ptr + b * L + offs_k, nodes.to(tl.int64), mask=lmask)
        tl.store(out_len_ptr + b, acc.to(tl.int64))
