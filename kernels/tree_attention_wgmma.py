r"""Absorbed-MLA tree attention for Hopper written in Gluon (Triton's layout-explicit language): wgmma on both products.

Math: as ``tree_attention.py`` (one latent KV, H query heads, online softmax in the exp2 domain, fp32 accumulation).
The products are computed transposed so the KV tokens are the MMA's M dimension (wgmma needs M >= 64, and a
Kimi-K2 rank has only 8 heads x k draft tokens = 8..64 query rows):

    s^T [BLOCK_N, R] = K_lat [BLOCK_N, D] . q_lat^T [D, R]  +  K_rope [BLOCK_N, DR] . q_rope^T [DR, R]
    o^T [D, R]      += V^T [D, BLOCK_N] . p^T [BLOCK_N, R]         (V = K_lat, read from the same shared tile)

with softmax statistics per column (query row). Both products are ``warpgroup_mma`` with operands in shared memory
(the tensor cores read them; no per-warp ``ldmatrix`` of q and K as the ``tl.dot`` kernels do). The KV tile is
gathered through the page table with ``cp.async`` into ``NUM_BUF`` shared buffers: tile i + NUM_BUF - 1 is copied
while tile i is used; the page ids of the next copy are loaded one tile earlier. q is copied by ``cp.async`` in
tile 0's group: before the prefix and page-table loads (so its latency overlaps theirs), or with ``EARLY_KV`` right
after the PDL wait. Every copy moves 16 bytes, so
Q, QR and KV need 16-byte aligned bases and strides (but the last) that are multiples of 16 elements (Triton's
divisibility specialisation; the launcher checks it). ``PDL``: the kernel waits for the previous kernel's writes
(``griddepcontrol.wait``) before its first load and lets the merge grid launch at once. With ``EARLY_KV`` (the
default with PDL) it reads the prefix length, the page table and its first KV tile before that wait when the tile
holds prefix tokens only, so the tile's HBM read overlaps the previous kernels. The prefix lengths, the page table
and the KV of prefix positions are then read before the wait, so they must be written before the last kernel
launched without PDL, or the last one that lets its successor launch only after its own wait, ahead of this one
(our GEMVs and MLA preparation let theirs launch before their wait, so the read may overlap several kernels back).
In the verify pass they are written before the pass (the KV compaction is launched without PDL).

Grid, split ranges, workspace and merge: the same as ``_tree_attention_fwd_kernel`` (axis 0: row tiles of
``BLOCK_R`` rows, axis 1: split, axis 2: batch; ``_tree_attention_merge_kernel`` merges the splits).

Tensors (B batch, k draft tokens, H heads, D latent dim (512), DR rope dim (64), P page size, S splits):

| name     | shape                              | dtype       | meaning                                           |
| -------- | ---------------------------------- | ----------- | ------------------------------------------------- |
| Q        | [B, k, H, D] (last stride 1)       | bf16 / fp16 | absorbed latent query                             |
| QR       | [B, k, H, DR] (last stride 1)      | as Q        | rope query                                        |
| KV       | [num_pages, P, D + DR] strided     | as Q        | latent + rope key cache (value = latent)          |
| PT       | [B, max_pages]                     | int32/int64 | page table                                        |
| PREFIX   | [B]                                | int32/int64 | prefix length                                     |
| MASK     | [k, ceil(k/8)] or [B, k, ceil(k/8)]| uint8       | ancestor mask, little-endian bits                 |
| OUT      | [B, k, H, D] (last stride 1)       | as Q        | output (NUM_SPLITS == 1)                          |
| LSE      | [B, k, H] contiguous               | fp32        | natural-log lse (STORE_LSE, NUM_SPLITS == 1)      |
| WS_O     | [>= B, S, k, H, D] contiguous      | fp32        | split partial outputs (normalised)                |
| WS_LSE   | [>= B, S, k, H] contiguous         | fp32        | split partial lse                                 |

Needs sm_90 (wgmma) and a CUDA device: Gluon has no CPU interpreter, so the launcher never picks it under
TRITON_INTERPRET=1; its tests are GPU tests. Shared memory: NUM_BUF x BLOCK_N x (D + DR) x 2 bytes of KV, R x
(D + DR) x 2 of q, BLOCK_N x R x 2 of p (NUM_BUF 2, BLOCK_N 64, R 32: 188 KiB).
"""
from __future__ import annotations

import triton

#: Whether this Triton has the Gluon API the kernel uses (``AVAILABLE``) and, where not, why
#: (``UNAVAILABLE_REASON``). Only a capability: ``specverify.attention`` also compiles the kernel for the device's
#: target before it takes it by default. Compiled offline for sm_90a with Triton 3.6, 3.7, 3.8 and 3.9
#: (``bench/compile_matrix.py``); run on the H200 with 3.6.
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    # cp.async of a tile into shared memory: ``async_copy_global_to_shared`` up to Triton 3.7, ``async_load`` from
    # 3.8 on (3.9 keeps the old name only to raise); same arguments (smem, pointer, mask=)
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    # the CTA-wide barrier: ``thread_barrier`` in Triton 3.6, ``barrier`` (cluster=False by default) from 3.7 on
    _thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    AVAILABLE, UNAVAILABLE_REASON = True, ""
except (ImportError, AttributeError) as _exc:  # the launcher refuses KERNEL="mla_wgmma" with this reason
    AVAILABLE = False
    UNAVAILABLE_REASON = (f"Triton {triton.__version__} lacks the Gluon Hopper API this kernel uses "
                          f"({type(_exc).__name__}: {_exc})")

#: The MLA default where this kernel can run (CUDA sm_90 and it compiles there): ``specverify.attention`` plans with it.
#: BLOCK_M (the row tile, wgmma N, a power of two 16..64) follows the rows; num_warps 4 (one warpgroup) holds a
#: [512, 32] fp32 accumulator in 128 registers, 64 rows take 8 warps. PDL (programmatic dependent launch: the merge
#: grid launches while the split grid runs) took batch 1 / 4k / k 4 from 10.33 to 9.90 us and k 1 from 7.88 to
#: 6.89 us on the H200 (run 32) and was neutral at batch 64 / 4k and batch 8 / 32k (81.4 / 81.9 against 81.3 /
#: 81.8 us); fp32 partials beat bf16 ones at batch 1 (9.90 / 10.22 us).
MLA_WGMMA_DEFAULT = {"KERNEL": "mla_wgmma", "BLOCK_N": 64, "num_stages": 2, "PDL": True}
#: With PDL, the first KV tile of prefix tokens copied before the wait (read at each launch, so an A/B can flip it)
EARLY_KV = True

if AVAILABLE:

    @gluon.constexpr_function
    def _score_warps(num_warps):
        """warps_per_cta of s^T [BLOCK_N = 64, R]: 4 warps span the 64 tokens; more warps split the rows."""
        return [4, num_warps // 4]

    @gluon.jit
    def _gdc_wait():
        """griddepcontrol.wait: the previous kernel's writes are visible after it (a no-op without PDL)."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)

    @gluon.jit
    def _gdc_launch_dependents():
        """griddepcontrol.launch_dependents: the next kernel (the merge) may launch now (a no-op without PDL)."""
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _issue_kv_tile(KV, row_off, valid, lat_buf, rope_buf, offs_d, offs_c, D: gl.constexpr):
        """cp.async one KV tile (rows at ``row_off``, zero-filled where not ``valid``) into shared memory in 16-byte
        copies: the latent in one op (one op per buffer: copies into slices of one buffer made the compiler put a
        CTA barrier between them), the rope part in another; the caller commits the group."""
        m = valid[:, None]
        _async_load(lat_buf, KV + row_off[:, None] + offs_d[None, :], mask=m)
        _async_load(rope_buf, KV + row_off[:, None] + D + offs_c[None, :], mask=m)

    @gluon.jit
    def _tree_attention_mla_wgmma_kernel(
        Q, QR, KV, PT, PREFIX, MASK, OUT, LSE, WS_O, WS_LSE,
        qk_scale,
        stride_qb, stride_qt, stride_qh,
        stride_qrb, stride_qrt, stride_qrh,
        stride_kp, stride_ks,
        stride_ptb,
        stride_mb, stride_mt,
        stride_ob, stride_ot, stride_oh,
        NUM_DRAFT: gl.constexpr, NUM_Q_HEADS: gl.constexpr, PAGE_SIZE: gl.constexpr, NUM_SPLITS: gl.constexpr,
        D: gl.constexpr, DR: gl.constexpr, BLOCK_R: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
        HAS_MASK: gl.constexpr, STORE_LSE: gl.constexpr, PDL: gl.constexpr, EARLY_KV: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        gl.static_assert(D % 64 == 0, "the latent dim is copied 64 columns at a time")
        gl.static_assert(DR == 64, "the rope part is one 64-column copy")
        gl.static_assert(BLOCK_N == 64, "one wgmma M tile of KV tokens")
        gl.static_assert(NUM_BUF >= 2 or not (PDL and EARLY_KV), "EARLY_KV copies q with the prologue's tile 0")
        dtype: gl.constexpr = Q.dtype.element_ty
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=_score_warps(num_warps), instr_shape=[16, BLOCK_R * 4 // num_warps, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_R, 16])
        ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                            warps_per_cta=[num_warps, 1], order=[1, 0])
        kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)
        kr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DR], dtype)
        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, D], dtype)
        qr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, DR], dtype)
        p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_R], dtype)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        col_o: gl.constexpr = gl.SliceLayout(0, o_layout)

        m_tile = gl.program_id(0)
        split = gl.program_id(1)
        b = gl.program_id(2)
        b64 = b.to(gl.int64)

        if PDL and not EARLY_KV:  # launched as a programmatic dependent: wait for the previous kernel's writes
            _gdc_wait()
            _gdc_launch_dependents()
        # ---- q tile -> shared memory by cp.async (rows m = token * H + head; padded rows are zero-filled): issued
        # first without EARLY_KV (its latency overlaps the prefix and page-table loads), else after the wait -------
        offs_qm = m_tile * BLOCK_R + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, ld))
        qm_valid = offs_qm < NUM_DRAFT * NUM_Q_HEADS
        q_tok = (offs_qm // NUM_Q_HEADS).to(gl.int64)
        q_head = (offs_qm % NUM_Q_HEADS).to(gl.int64)
        offs_c = gl.arange(0, 64, layout=gl.SliceLayout(0, ld))
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_R, D], q_sl)
        qr_smem = gl.allocate_shared_memory(dtype, [BLOCK_R, DR], qr_sl)
        offs_d_ld = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        q_ptr = Q + (b64 * stride_qb + q_tok * stride_qt + q_head * stride_qh)[:, None] + offs_d_ld[None, :]
        qr_ptr = QR + (b64 * stride_qrb + q_tok * stride_qrt + q_head * stride_qrh)[:, None] + offs_c[None, :]
        if not (PDL and EARLY_KV):
            _async_load(q_smem, q_ptr, mask=qm_valid[:, None])
            _async_load(qr_smem, qr_ptr, mask=qm_valid[:, None])

        kv_lat = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, D], kv_sl)
        kv_rope = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_N, DR], kr_sl)
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_R], p_sl)

        # ---- this split's KV range -------------------------------------------------------------------------------
        prefix = gl.load(PREFIX + b).to(gl.int32)
        chunk = gl.cdiv(gl.cdiv(prefix, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * chunk
        end = gl.minimum(start + chunk, prefix)
        if split == NUM_SPLITS - 1:
            start = gl.minimum(start, prefix)
            end = prefix + NUM_DRAFT
        n_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
        pt_row = PT + b64 * stride_ptb
        offs_t_ld = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))

        # prologue: copies of tiles 0 .. NUM_BUF - 2; page ids of tile NUM_BUF - 1 ahead. EARLY_KV: tile 0 is
        # copied before the PDL wait when it holds only prefix tokens (constant during the pass: written before
        # this kernel's predecessors started), so its HBM read overlaps the previous kernels; q and every later
        # tile come after the wait
        if PDL and EARLY_KV:
            if gl.minimum(start + BLOCK_N, end) > prefix:  # tile 0 holds draft tokens: the previous kernel's writes
                _gdc_wait()
        for j in gl.static_range(NUM_BUF - 1):
            pos_j = start + j * BLOCK_N + offs_t_ld
            ok = pos_j < end
            page = gl.load(pt_row + pos_j // PAGE_SIZE, mask=ok, other=0).to(gl.int64)
            row_off = page * stride_kp + (pos_j % PAGE_SIZE).to(gl.int64) * stride_ks
            _issue_kv_tile(KV, row_off, ok, kv_lat.index(j), kv_rope.index(j), offs_d_ld, offs_c, D)
            if PDL and EARLY_KV and j == 0:  # q joins tile 0's copy group
                _gdc_wait()
                _gdc_launch_dependents()
                _async_load(q_smem, q_ptr, mask=qm_valid[:, None])
                _async_load(qr_smem, qr_ptr, mask=qm_valid[:, None])
            async_copy.commit_group()
        pos_nxt = start + (NUM_BUF - 1) * BLOCK_N + offs_t_ld
        page_nxt = gl.load(pt_row + pos_nxt // PAGE_SIZE, mask=pos_nxt < end, other=0)

        # ---- query-row (column) indices in the score layout ------------------------------------------------------
        offs_r = m_tile * BLOCK_R + gl.arange(0, BLOCK_R, layout=col_s)
        r_valid = offs_r < NUM_DRAFT * NUM_Q_HEADS
        r_tok = offs_r // NUM_Q_HEADS
        offs_t = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))

        acc = gl.zeros([D, BLOCK_R], gl.float32, layout=o_layout)
        m_i = gl.full([BLOCK_R], float("-inf"), gl.float32, layout=col_s)
        l_i = gl.zeros([BLOCK_R], gl.float32, layout=col_s)
        s_zero = gl.zeros([BLOCK_N, BLOCK_R], gl.float32, layout=s_layout)

        for i in range(n_tiles):
            buf = i % NUM_BUF
            # copy tile i + NUM_BUF - 1 into the buffer tile i - 1 used (its PV product was waited for)
            ok_nxt = pos_nxt < end
            row_off = page_nxt.to(gl.int64) * stride_kp + (pos_nxt % PAGE_SIZE).to(gl.int64) * stride_ks
            nb = (i + NUM_BUF - 1) % NUM_BUF
            if start + (i + NUM_BUF - 1) * BLOCK_N < end:  # past the split's end: no copy (no zero-fill either)
                _issue_kv_tile(KV, row_off, ok_nxt, kv_lat.index(nb), kv_rope.index(nb), offs_d_ld, offs_c, D)
            async_copy.commit_group()  # always one group per tile (maybe empty), so the wait below counts tiles
            pos_nxt = pos_nxt + BLOCK_N
            page_nxt = gl.load(pt_row + pos_nxt // PAGE_SIZE, mask=pos_nxt < end, other=0)
            async_copy.wait_group(NUM_BUF - 1)  # this thread's copies of tile i have landed
            fence_async_shared()  # ... and are visible to the tensor cores' (async) reads
            _thread_barrier()  # every thread's copies of tile i

            k_lat = kv_lat.index(buf)
            s = warpgroup_mma(k_lat, q_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(kv_rope.index(buf), qr_smem.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s, ))

            start_n = start + i * BLOCK_N
            pos = start_n + offs_t
            vis = (pos < end)[:, None] & r_valid[None, :]
            if start_n + BLOCK_N > prefix:  # the tile holds draft tokens: tree (or chain) visibility
                jd = pos - prefix
                is_draft = (pos < end) & (jd >= 0)
                jd = gl.where(is_draft, jd, 0)
                if HAS_MASK:
                    byte = gl.load(MASK + b64 * stride_mb + r_tok[None, :] * stride_mt + (jd // 8)[:, None],
                                   mask=is_draft[:, None] & r_valid[None, :], other=0)
                    dvis = ((byte.to(gl.int32) >> (jd % 8)[:, None]) & 1) != 0
                else:
                    dvis = jd[:, None] <= r_tok[None, :]
                vis = vis & ((pos < prefix)[:, None] | dvis)
            s = gl.where(vis, s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=0))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(s - m_safe[None, :])
            l_i = l_i * alpha + gl.sum(p, axis=0)
            m_i = m_new
            p_smem.store(p.to(dtype))
            fence_async_shared()
            _thread_barrier()
            acc = acc * gl.convert_layout(alpha, col_o)[None, :]
            acc = warpgroup_mma(k_lat.permute((1, 0)), p_smem, acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
        async_copy.wait_group(0)

        # ---- epilogue: normalise; store out / lse, or the split's partial --------------------------------------
        has_any = l_i > 0.0
        lse = gl.where(has_any, (m_i + gl.log2(gl.where(has_any, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        inv = gl.convert_layout(1.0 / gl.where(has_any, l_i, 1.0), col_o)
        out = acc * inv[None, :]
        offs_ro = m_tile * BLOCK_R + gl.arange(0, BLOCK_R, layout=col_o)
        ro_valid = offs_ro < NUM_DRAFT * NUM_Q_HEADS
        ro_tok = (offs_ro // NUM_Q_HEADS).to(gl.int64)
        ro_head = (offs_ro % NUM_Q_HEADS).to(gl.int64)
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(1, o_layout))
        if NUM_SPLITS == 1:
            o_rows = b64 * stride_ob + ro_tok * stride_ot + ro_head * stride_oh
            gl.store(OUT + o_rows[None, :] + offs_d[:, None], out.to(OUT.dtype.element_ty), mask=ro_valid[None, :])
            if STORE_LSE:
                gl.store(LSE + (b64 * NUM_DRAFT + r_tok) * NUM_Q_HEADS + offs_r % NUM_Q_HEADS, lse, mask=r_valid)
        else:
            ws_rows = ((b64 * NUM_SPLITS + split) * NUM_DRAFT + ro_tok) * NUM_Q_HEADS + ro_head
            gl.store(WS_O + ws_rows[None, :] * D + offs_d[:, None], out.to(WS_O.dtype.element_ty),
                     mask=ro_valid[None, :])
            ws_rows_s = ((b64 * NUM_SPLITS + split) * NUM_DRAFT + r_tok) * NUM_Q_HEADS + offs_r % NUM_Q_HEADS
            gl.store(WS_LSE + ws_rows_s, lse, mask=r_valid)
