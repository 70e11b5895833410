"""Reference logit processing (temperature, top-k, top-p, min-p; sort based) and tree speculative sampling.

This is the definition the fused kernels (``specverify.kernels.accept``) must match.

Logit processing of one row ``x`` (``[V]``) with temperature ``T``:

1. ``T <= 0``: the distribution is one-hot on ``argmax(x)`` (lowest index on ties) and the filters are ignored.
2. ``z = x / T``, ``w = exp(z - max z)``, ``p = w / sum(w)``.
3. top-k (``0 < top_k < V``): keep ``p >= s[top_k - 1]`` (``s`` = p sorted descending; ties at the cut are kept).
4. top-p (``top_p < 1``), on the top-k survivors renormalised (``q``): with ``s`` = q sorted descending and ``c`` its
   cumulative sum, ``i`` = the first index with ``c[i] >= top_p``; keep ``q >= s[i]``.
5. min-p (``min_p > 0``): keep ``w >= min_p`` (probability at least ``min_p`` times the largest).
6. The kept set is the intersection; renormalise.

Tree speculative sampling (target-only rule, deterministic drafter), request by request with uniforms ``u``
``[L]`` (``L = max_depth + 1``): at the node at depth ``d`` its children are tried in node order; child ``j`` is
accepted when ``u[d] < q(tokens of the children tried so far, j included, each distinct token once)``. When no
child is accepted (or the node is a leaf) the bonus token is drawn by inverse CDF in vocabulary order with
``u[L - 1]`` from ``q`` at that node with the tokens of all its children set to 0 and renormalised: the first
token whose cumulative mass exceeds ``u[L - 1]`` times the remaining mass.
"""
from __future__ import annotations

import torch


def _per_row(value, rows: int, dtype, device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype).reshape(-1).expand(rows) if value.numel() == 1 else \
            value.to(device=device, dtype=dtype).reshape(rows)
    return torch.full((rows,), value, dtype=dtype, device=device)


def process_logits_reference(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """Processed probabilities fp32 ``[rows, V]`` from logits ``[rows, V]`` and per-row (or scalar) parameters."""
    x = logits.float()
    rows, vocab = x.shape
    dev = x.device
    t = _per_row(temperature, rows, torch.float32, dev)
    tk = _per_row(top_k, rows, torch.int64, dev)
    tp = _per_row(top_p, rows, torch.float32, dev)
    mp = _per_row(min_p, rows, torch.float32, dev)
    out = torch.empty_like(x)
    for r in range(rows):
        if float(t[r]) <= 0.0:
            out[r] = 0.0
            out[r, int(torch.argmax(x[r]))] = 1.0
            continue
        z = x[r] / t[r]
        w = torch.exp(z - z.max())
        w = torch.where(torch.isfinite(z), w, torch.zeros_like(w))
        keep = w > 0
        p = w / w.sum()
        k = int(tk[r])
        if 0 < k < vocab:
            s = torch.sort(p, descending=True).values
            keep &= p >= s[k - 1]
        if float(tp[r]) < 1.0:
            q = torch.where(keep, p, torch.zeros_like(p))
            q = q / q.sum()
            s = torch.sort(q, descending=True).values
            c = torch.cumsum(s, 0)
            hit = torch.nonzero(c >= tp[r])
            i = int(hit[0]) if hit.numel() else int((s > 0).sum()) - 1
            keep &= q >= s[i]
        if float(mp[r]) > 0.0:
            keep &= w >= mp[r]
        q = torch.where(keep, w, torch.zeros_like(w))
        out[r] = q / q.sum()
    return out


def tree_sampling_walk_reference(probs, draft_tokens, parents, uniform_samples, max_depth=None):
    """Tree speculative sampling over processed probabilities ``probs`` fp32 ``[batch, k, V]``.

    ``draft_tokens``, ``parents`` int ``[batch, k]``; ``uniform_samples`` fp32 ``[batch, L]`` (``L = max_depth + 1``;
    column ``d`` for the choice among the children of the depth-``d`` node, column ``L - 1`` for the bonus).
    Returns ``(accepted_tokens [batch, L], accept_len [batch], accepted_nodes [batch, L])``, int64, in the layout of
    :func:`specverify.reference.accept.greedy_accept_reference`.
    """
    batch, k, vocab = probs.shape
    if max_depth is None:
        max_depth = k - 1
    length = max_depth + 1
    dev = probs.device
    tokens = torch.full((batch, length), -1, dtype=torch.int64, device=dev)
    nodes = torch.full((batch, length), -1, dtype=torch.int64, device=dev)
    lens = torch.zeros(batch, dtype=torch.int64, device=dev)
    par = parents.long().cpu().tolist()
    drf = draft_tokens.long().cpu().tolist()
    uni = uniform_samples.float().cpu()
    for b in range(batch):
        cur, acc = 0, 0
        nodes[b, 0] = 0
        for d in range(1, length):
            children = [j for j in range(1, k) if par[b][j] == cur]
            seen, mass, chosen = set(), 0.0, -1
            u = float(uni[b, d - 1])
            for j in children:
                t = drf[b][j]
                if t not in seen:
                    seen.add(t)
                    mass += float(probs[b, cur, t])
                if u < mass:
                    chosen = j
                    break
            if chosen < 0:
                break
            tokens[b, acc] = drf[b][chosen]
            acc += 1
            nodes[b, acc] = chosen
            cur = chosen
        r = probs[b, cur].clone().double()
        for j in range(1, k):
            if par[b][j] == cur:
                r[drf[b][j]] = 0.0
        c = torch.cumsum(r, 0)
        target = float(uni[b, length - 1]) * float(c[-1])
        hit = torch.nonzero((c > target) & (r > 0))
        if hit.numel():
            bonus = int(hit[0])
        else:
            pos = torch.nonzero(r > 0)
            bonus = int(pos[-1]) if pos.numel() else int(torch.argmax(probs[b, cur]))
        tokens[b, acc] = bonus
        lens[b] = acc
    return tokens, lens, nodes


def verify_sampling_reference(logits, draft_tokens, parents, uniform_samples, temperature=1.0, top_k=0,
                              top_p=1.0, min_p=0.0, max_depth=None):
    """Process ``logits`` ``[batch, k, V]`` per request, then :func:`tree_sampling_walk_reference`."""
    batch, k, vocab = logits.shape

    def rows(v):
        if isinstance(v, torch.Tensor) and v.numel() > 1:
            return v.reshape(batch, 1).expand(batch, k).reshape(-1)
        return v

    probs = process_logits_reference(logits.reshape(batch * k, vocab), rows(temperature), rows(top_k), rows(top_p),
                                     rows(min_p)).reshape(batch, k, vocab)
    return tree_sampling_walk_reference(probs, draft_tokens, parents, uniform_samples, max_depth)
