"""Reference MoE routing, token→expert alignment and SwiGLU experts, in plain torch.

Routing semantics (DeepSeek-V3 "noaux_tc" and relatives; Qwen3 softmax):

* ``scores = sigmoid(logits)`` or ``softmax(logits)`` in fp32.
* ``choice = scores + correction_bias`` (bias only chooses experts; weights use the unbiased scores).
* With ``n_group > 1`` the experts split into ``n_group`` equal groups; a group's rank is the sum of its two best
  choice scores; only the best ``topk_group`` groups compete (ties: lowest group id).
* Softmax reads a NaN logit as -inf (that expert's probability is 0, the rest are normalised over the others);
  when a row has +inf logits they share the whole probability evenly (each 1 / their count, every other expert 0).
  A row with no finite logit left (all NaN / -inf) has no finite score (NaN everywhere).
* The ``top_k`` best choice scores win (ties: lowest expert id). Only finite choice scores are candidates: a NaN
  never wins. The slots left once the finite candidates run out (a row with fewer than ``top_k`` of them, e.g. an
  all-NaN row, or all -inf logits under softmax) are *filled* with the lowest expert ids the row has not chosen yet
  (a row with none: ``0 .. top_k - 1``) with weight 0, so every id is a distinct expert in ``[0, E)``: a consumer
  that indexes by id stays in range, the alignment routes those slots like any other and the experts add 0 for them.
* ``weights = scores[chosen]``; with ``renormalize`` divided by their sum where the sum is > 0; then times
  ``routed_scaling_factor``.

Alignment (the expert GEMM's input): slots ``s = m * top_k + j`` grouped by expert in expert order, slots in
increasing order inside an expert, each expert's run padded with the sentinel ``M * top_k`` to a multiple of
``block_size``; ``expert_ids[blk]`` is the expert of block ``blk``; experts without tokens get no block.

Expert weights: ``w13`` [E, 2 * I, H] (rows 0..I-1 gate, I..2I-1 up), ``w2`` [E, H, I].
"""
from __future__ import annotations

import dataclasses
import math

import torch


def route_reference(router_logits, top_k, scoring="sigmoid", correction_bias=None, n_group=1, topk_group=1,
                    renormalize=True, routed_scaling_factor=1.0):
    """Returns (topk_ids int32 [M, top_k], topk_weights fp32 [M, top_k]). Capturable (no host sync).

    Every id is in ``[0, E)`` and distinct within its row; slots without a finite candidate weigh 0 (module notes).
    """
    logits = router_logits.double() if router_logits.dtype == torch.float64 else router_logits.float()
    m, e = logits.shape
    if scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    elif scoring == "softmax":
        # NaN logit: probability 0; +inf logits: the whole probability, shared evenly (Python scalars in the
        # where: no host-to-device copy, capturable); rows without either keep their logits bit for bit
        x = torch.where(torch.isnan(logits), float("-inf"), logits)
        pos_inf = x == float("inf")
        x = torch.where(pos_inf.any(-1, keepdim=True), torch.where(pos_inf, 0.0, float("-inf")), x)
        scores = torch.softmax(x, dim=-1)
    else:
        raise ValueError(f"scoring must be 'sigmoid' or 'softmax', got {scoring!r}")
    choice = scores if correction_bias is None else scores + correction_bias.to(scores.dtype).view(1, e)
    neg_inf = float("-inf")  # a Python scalar: no host-to-device copy, so the reference stays capturable
    choice = torch.where(torch.isfinite(choice), choice, neg_inf)
    if n_group > 1:
        gsize = e // n_group
        grouped = choice.view(m, n_group, gsize)
        best2 = torch.sort(grouped, dim=-1, descending=True, stable=True).values[..., : min(2, gsize)]
        group_score = best2.sum(-1)
        group_score = torch.where(torch.isnan(group_score), neg_inf, group_score)
        group_order = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[:, :topk_group]
        keep = torch.zeros(m, n_group, dtype=torch.bool, device=logits.device)
        keep.scatter_(1, group_order, True)
        choice = torch.where(keep.unsqueeze(-1).expand(m, n_group, gsize).reshape(m, e), choice, neg_inf)
    # every non-finite choice is -inf here and the sort is stable, so past the finite candidates the order goes on
    # with the lowest expert ids not chosen yet: those fill the slots, with weight 0
    order = torch.sort(choice, dim=-1, descending=True, stable=True)
    ids = order.indices[:, :top_k]
    valid = torch.isfinite(order.values[:, :top_k])
    weights = torch.gather(scores, 1, ids)
    weights = torch.where(valid, weights, torch.zeros_like(weights))
    if renormalize:
        total = weights.sum(-1, keepdim=True)
        weights = torch.where(total > 0, weights / torch.where(total > 0, total, torch.ones_like(total)), weights)
    weights = weights * routed_scaling_factor
    return ids.to(torch.int32), (weights if weights.dtype == torch.float64 else weights.float())


def align_reference(topk_ids, num_experts, block_size):
    """Returns (sorted_token_ids int32 [T], expert_ids int32 [T // block_size], num_tokens_post_padded int32 [1]).

    Exactly sized (``T`` = num_tokens_post_padded); host-synchronising, so not for graphs.
    """
    flat = topk_ids.reshape(-1).long().cpu()
    sentinel = flat.numel()
    sorted_ids, expert_ids = [], []
    for e in range(num_experts):
        slots = (flat == e).nonzero().flatten().tolist()
        if not slots:
            continue
        padded = -(-len(slots) // block_size) * block_size
        sorted_ids += slots + [sentinel] * (padded - len(slots))
        expert_ids += [e] * (padded // block_size)
    dev = topk_ids.device
    return (torch.tensor(sorted_ids, dtype=torch.int32, device=dev),
            torch.tensor(expert_ids, dtype=torch.int32, device=dev),
            torch.tensor([len(sorted_ids)], dtype=torch.int32, device=dev))


def _experts_as(w13, w2, idx, quant, dtype):
    """``(w13[idx], w2[idx])`` in ``dtype``; with ``quant`` (a :class:`specverify.moe.MoEQuant`) only those experts
    dequantised, with their scales."""
    if quant is None:
        return w13[idx].to(dtype), w2[idx].to(dtype)
    picked = dataclasses.replace(quant, w13_scale=quant.w13_scale[idx], w2_scale=quant.w2_scale[idx])
    return picked.dequantize(w13[idx], w2[idx], dtype)


def shared_expert_reference(hidden, w13, w2, compute_dtype=torch.float32):
    """An unquantised SwiGLU expert every token takes with weight 1 (a shared expert): hidden [M, H], w13 [2I, H]
    (gate rows then up rows), w2 [H, I]; returns [M, H] in ``compute_dtype``."""
    x = hidden.to(compute_dtype)
    gate_up = x @ w13.to(compute_dtype).t()
    inter = w13.shape[0] // 2
    return (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w2.to(compute_dtype).t()


def fused_moe_reference(hidden, w13, w2, topk_ids, topk_weights, compute_dtype=torch.float32, quant=None,
                        shared_expert=None):
    """SwiGLU experts. hidden [M, H]; returns [M, H] in hidden's dtype. Slots with id -1 add nothing.

    Gathers each slot's expert weights (fixed shapes, no host sync: capturable), computes in ``compute_dtype``.
    Quantised weights (``quant``, a :class:`specverify.moe.MoEQuant`) are dequantised slot by slot, as gathered.
    ``shared_expert``: (w13 [2I', H], w2 [H, I']) of an unquantised shared expert added to every token
    (:func:`shared_expert_reference`) before the one rounding.
    """
    if hidden.dtype == torch.float64:
        compute_dtype = torch.float64
    m, h = hidden.shape
    top_k = topk_ids.shape[1]
    ids = topk_ids.long().reshape(-1)
    valid = ids >= 0
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    x = hidden.to(compute_dtype).repeat_interleave(top_k, dim=0).unsqueeze(-1)  # [S, H, 1]
    w13s, w2s = _experts_as(w13, w2, safe, quant, compute_dtype)
    inter = w2s.shape[2]
    gate_up = torch.bmm(w13s, x).squeeze(-1)  # [S, 2I]
    act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    y = torch.bmm(w2s, act.unsqueeze(-1)).squeeze(-1)  # [S, H]
    w = torch.where(valid, topk_weights.reshape(-1).to(compute_dtype), torch.zeros((), dtype=compute_dtype,
                                                                                    device=hidden.device))
    y = y * w.unsqueeze(-1)
    y = y.view(m, top_k, h).sum(1)
    if shared_expert is not None:
        y = y + shared_expert_reference(hidden, *shared_expert, compute_dtype=compute_dtype)
    return y.to(hidden.dtype)


def fused_moe_by_expert_reference(hidden, w13, w2, topk_ids, topk_weights, dtype=torch.float64, quant=None):
    """SwiGLU experts one activated expert at a time, computed in ``dtype`` and returned as fp64 [M, H]: with fp64 the
    truth for large shapes (no per-slot weight copies), with bf16 the error of a plain bf16 computation, from which
    the sweeps derive their tolerances. Slots with id -1 add nothing. Quantised weights (``quant``) are dequantised
    one activated expert at a time (to fp32, then ``dtype``; fp64 directly)."""
    m, h = hidden.shape
    out = torch.zeros(m, h, dtype=dtype, device=hidden.device)
    x = hidden.to(dtype)
    for e in torch.unique(topk_ids[topk_ids >= 0]).tolist():
        rows, ks = (topk_ids == e).nonzero(as_tuple=True)
        w13e, w2e = _experts_as(w13, w2, slice(e, e + 1), quant, dtype)
        inter = w2e.shape[2]
        gu = x[rows] @ w13e[0].T
        act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        y = (act @ w2e[0].T) * topk_weights[rows, ks].to(dtype)[:, None]
        out.index_add_(0, rows, y)
    return out.double()


def fused_moe_loop_reference(hidden, w13, w2, topk_ids, topk_weights):
    """Per-token loop in fp64: the slow, obviously-correct check for the kernels' tests."""
    m, h = hidden.shape
    inter = w2.shape[2]
    out = torch.zeros(m, h, dtype=torch.float64, device=hidden.device)
    for i in range(m):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[i, j])
            if e < 0:
                continue
            x = hidden[i].double()
            gu = w13[e].double() @ x
            a = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            out[i] += float(topk_weights[i, j]) * (w2[e].double() @ a)
    return out


def random_expert_weights(num_experts, hidden, inter, *, generator=None, seed=0, dtype=torch.bfloat16, device="cpu"):
    """Random SwiGLU expert weights for tests and benchmarks: ``(w13 [E, 2I, H], w2 [E, H, I])`` in ``dtype``.

    Entries are normal / sqrt(fan-in) (H for w13, I for w2), drawn on ``device`` one expert at a time, so a
    Kimi-K2-sized pool (384 x 11 MB in bf16) needs no E-sized fp32 temporary and no host-side draw. ``generator``
    (on ``device``) continues a caller's stream; without it one is seeded with ``seed``.
    """
    g = generator if generator is not None else torch.Generator(device=device).manual_seed(seed)
    w13 = torch.empty(num_experts, 2 * inter, hidden, dtype=dtype, device=device)
    w2 = torch.empty(num_experts, hidden, inter, dtype=dtype, device=device)
    for i in range(num_experts):
        w13[i] = torch.randn(2 * inter, hidden, generator=g, device=device) / math.sqrt(hidden)
        w2[i] = torch.randn(hidden, inter, generator=g, device=device) / math.sqrt(inter)
    return w13, w2
