"""moe_route on router rows with NaN / -inf / +inf logits (issue 19): the contract of moe_route's Notes.

* a NaN score never wins a weighted slot; under softmax a NaN logit is read as -inf (probability 0);
* +inf logits take the whole weight (softmax: shared evenly, lowest ids first among them);
* slots left once the finite candidates run out are fillers: the lowest ids not chosen yet, weight 0; a row with no
  finite score gets ``0 .. top_k - 1``; every id is a distinct expert in ``[0, E)``.

An fp64 loop (``_oracle``) states the contract row by row; the reference must match it and every Triton path that
``moe_route`` takes (router alone, the one-program router, the sorted, row-mask and atomic last programs up to
1024 slots, the general multi-program kernel past them) must match the reference: ids exactly
(value-compared only where biased scores nearly tie), weights within a derived tolerance, fillers weigh 0 exactly.
The alignment of the fillers and fused_moe on them are checked too. Logits are fresh seeded normals with the bad
values injected at random positions.
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import warm_up_for_capture

import specverify.moe as moe_mod
from specverify.moe import fused_moe, max_num_tokens_padded, moe_route
from specverify.reference.moe import (align_reference, fused_moe_loop_reference, fused_moe_reference,
                                      random_expert_weights, route_reference)

GAP = 1e-5  # biased scores closer than this (but not equal) may order differently under fp32 rounding
INF = math.inf

# the kinds of row the logits are made of; every test's first row is "all_nan" or "all_neg_inf" (no finite score
# under softmax; under sigmoid all -inf scores 0, finite), so every test checks the no-finite-score rule
KINDS = ["clean", "few_nan", "all_nan", "most_nan", "few_neg_inf", "all_neg_inf", "one_pos_inf", "two_pos_inf",
         "mixed", "group_nan"]


def _bad_logits(m, e, top_k, dtype, gen, n_group=1, first="all_nan"):
    """[m, e] normal logits (scaled by 2) in ``dtype``, row r of kind ``first`` for r = 0, else a seeded random kind
    from KINDS, its bad values at random positions."""
    x = torch.randn(m, e, generator=gen) * 2
    kinds = [first] + [KINDS[int(i)] for i in torch.randint(0, len(KINDS), (m - 1,), generator=gen)]
    for r, kind in enumerate(kinds):
        perm = torch.randperm(e, generator=gen)
        if kind == "few_nan":
            x[r, perm[: 1 + int(torch.randint(0, 3, (1,), generator=gen))]] = math.nan
        elif kind == "all_nan":
            x[r] = math.nan
        elif kind == "most_nan":  # fewer finite logits than top_k: winners, then fillers
            x[r, perm[int(torch.randint(0, top_k, (1,), generator=gen)):]] = math.nan
        elif kind == "few_neg_inf":
            x[r, perm[:3]] = -INF
        elif kind == "all_neg_inf":
            x[r] = -INF
        elif kind == "one_pos_inf":
            x[r, perm[0]] = INF
        elif kind == "two_pos_inf":
            x[r, perm[:2]] = INF
        elif kind == "mixed":
            x[r, perm[0]], x[r, perm[1]], x[r, perm[2]] = INF, math.nan, -INF
        elif kind == "group_nan":  # a whole group NaN (its group score -inf; without groups: the whole row)
            gsize = e // n_group
            g0 = int(perm[0]) // gsize
            x[r, g0 * gsize:(g0 + 1) * gsize] = math.nan
    return x.to(dtype), kinds


def _scores64(v, scoring):
    """fp64 scores of one logit row under the contract."""
    if scoring == "sigmoid":
        return torch.sigmoid(v)
    v = torch.where(torch.isnan(v), -INF, v)
    if (v == INF).any():
        return (v == INF).double() / int((v == INF).sum())
    if not torch.isfinite(v).any():
        return torch.full_like(v, math.nan)
    p = torch.exp(v - v.max())
    return p / p.sum()


def _oracle(x, top_k, scoring, bias, n_group, topk_group, renormalize, scale):
    """The contract in fp64, row by row: (ids [M, top_k] int64, weights [M, top_k] fp64, won [M, top_k] bool: a
    weighted slot, not a filler, ambiguous [M] bool: rows whose winners nearly tie, c [M, E]: biased scores)."""
    m, e = x.shape
    ids = torch.zeros(m, top_k, dtype=torch.long)
    w = torch.zeros(m, top_k, dtype=torch.float64)
    won = torch.zeros(m, top_k, dtype=torch.bool)
    ambiguous = torch.zeros(m, dtype=torch.bool)
    cs = torch.empty(m, e, dtype=torch.float64)
    for r in range(m):
        s = _scores64(x[r].double(), scoring)
        c = s if bias is None else s + bias.double()
        c = [float(v) if math.isfinite(v) else -INF for v in c.tolist()]
        cs[r] = torch.tensor(c, dtype=torch.float64)
        allowed = list(range(e))
        if n_group > 1:
            gs = e // n_group
            score = [sum(sorted(c[j * gs:(j + 1) * gs], reverse=True)[:2]) for j in range(n_group)]
            order = sorted(range(n_group), key=lambda j: (-score[j], j))
            best = order[:topk_group]
            allowed = [i for i in range(e) if i // gs in best]
            top = sorted((score[j] for j in order[: topk_group + 1]), reverse=True)
            ambiguous[r] |= any(0 < a - b < GAP for a, b in zip(top, top[1:]) if math.isfinite(b))
        cand = sorted((i for i in allowed if c[i] > -INF), key=lambda i: (-c[i], i))
        chosen = cand[:top_k]
        vals = [c[i] for i in cand[: top_k + 1]]
        ambiguous[r] |= any(0 < a - b < GAP for a, b in zip(vals, vals[1:]))
        fill = [i for i in range(e) if i not in chosen][: top_k - len(chosen)]
        ws = [float(s[i]) for i in chosen] + [0.0] * len(fill)
        if renormalize and sum(ws) > 0:
            ws = [v / sum(ws) for v in ws]
        ids[r] = torch.tensor(chosen + fill)
        w[r] = torch.tensor(ws, dtype=torch.float64) * scale
        won[r, : len(chosen)] = True
    return ids, w, won, ambiguous, cs


def _check_invariants(ids, w, e, top_k):
    """Every id a distinct expert in [0, E) per row; every weight finite."""
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == w.shape == (ids.shape[0], top_k)
    assert int(ids.min()) >= 0 and int(ids.max()) < e, "an id out of [0, E)"
    srt = ids.sort(-1).values
    assert bool((srt[:, 1:] != srt[:, :-1]).all()), "an expert chosen twice in one row"
    assert bool(torch.isfinite(w).all()), "a NaN or infinite weight"


def _check_against(ids, w, want_ids, want_w, want_won, ambiguous, c64, tol):
    """ids exactly where no near-tie (else the chosen biased scores as values), fillers weigh 0 exactly, weights
    within ``tol`` of ``want_w`` on the unambiguous rows."""
    ids, w = ids.cpu().long(), w.cpu().double()
    exact = ~ambiguous
    assert torch.equal(ids[exact], want_ids[exact]), "expert ids"
    for r in ambiguous.nonzero().flatten().tolist():
        got, want = c64[r][ids[r]].sort().values, c64[r][want_ids[r]].sort().values
        assert torch.allclose(got, want, atol=2 * GAP, rtol=0)
    assert torch.equal(w[exact][~want_won[exact]], torch.zeros_like(w[exact][~want_won[exact]])), "fillers weigh 0"
    if exact.any():
        err = (w[exact] - want_w[exact]).abs().max().item()
        assert err <= tol, f"weights err {err:.3g} > tolerance {tol:.3g}"


def check_bad_route(x, top_k, scoring="sigmoid", bias=None, n_group=1, topk_group=1, renormalize=True, scale=1.0,
                    block_size=None, impl="triton"):
    """Reference against the fp64 contract, ``impl`` against the reference; returns moe_route's outputs."""
    m, e = x.shape
    oid, ow, owon, amb, c64 = _oracle(x.cpu(), top_k, scoring, None if bias is None else bias.cpu(), n_group,
                                      topk_group, renormalize, scale)
    assert int((~amb).sum()) >= m // 2, "most rows must be compared exactly"
    rid, rw = route_reference(x, top_k, scoring, bias, n_group, topk_group, renormalize, scale)
    _check_invariants(rid, rw, e, top_k)
    ref_err = (rw.cpu().double() - ow)[~amb].abs().max().item() if (~amb).any() else 0.0
    floor = 1e-6 * max(1.0, abs(scale))
    _check_against(rid, rw, oid, ow, owon, amb, c64, 2 * ref_err + floor)  # the reference: fp32 against fp64
    # rows with no finite score: the lowest ids, weight 0
    nofinite = ~owon.any(-1)
    assert torch.equal(rid.cpu()[nofinite].long(), torch.arange(top_k).expand(int(nofinite.sum()), top_k))
    if impl == "reference":
        return rid, rw
    res = moe_route(x, top_k=top_k, scoring=scoring, correction_bias=bias, n_group=n_group, topk_group=topk_group,
                    renormalize=renormalize, routed_scaling_factor=scale, block_size=block_size, impl=impl)
    ids, w = res[0], res[1]
    _check_invariants(ids, w, e, top_k)
    _check_against(ids, w, rid.cpu().long(), ow, owon, amb, c64, 2 * ref_err + floor)
    if block_size is not None:
        check_alignment(ids, e, block_size, res[2], exact=m <= 64)
    return res


def check_alignment(ids, e, block_size, al, exact):
    """Fillers aligned like any slot: used length and blocks exact; slots exactly in reference order (``exact``:
    the paths with a deterministic order, M <= 64) or as a set per expert (atomic ranks)."""
    m, top_k = ids.shape
    rs, re_, rn = align_reference(ids, e, block_size)
    n = int(rn.item())
    size = max_num_tokens_padded(m, top_k, e, block_size)
    assert al.sorted_token_ids.shape == (size,) and int(al.num_tokens_post_padded.item()) == n
    assert n == int(rs.numel()) and n >= m * top_k, "every slot, fillers included, is aligned"
    got_s, got_e = al.sorted_token_ids.cpu()[:n], al.expert_ids.cpu()
    assert torch.equal(got_e[: n // block_size], re_.cpu()) and bool((got_e[n // block_size:] == -1).all())
    if exact:
        assert torch.equal(got_s, rs.cpu()), "sorted_token_ids (used part, exact order)"
    else:
        for b in range(n // block_size):
            lo = b * block_size
            if b == 0 or int(re_[b]) != int(re_[b - 1]):
                hi = lo + block_size * int((re_ == re_[b]).sum())
                assert sorted(got_s[lo:hi].tolist()) == sorted(rs.cpu()[lo:hi].tolist())


# (scoring, n_group, topk_group, dtype, bias): every combination, for the reference (cheap)
_ALL = [(sc, ng, tg, dt, b) for sc in ("sigmoid", "softmax") for ng, tg in ((1, 1), (8, 3))
        for dt in (torch.float32, torch.bfloat16) for b in (False, True)]
# for the interpreter, half of them: scoring x grouping x dtype, with the bias on where an odd number of those three
# is the second choice (softmax, grouped, bf16), so every pair of the four factors still meets in all 4 combinations
_HALF = [c for c in _ALL if c[4] == ((c[0] == "softmax") ^ (c[1] > 1) ^ (c[3] == torch.bfloat16))]


def _id(c):
    return f"{c[0]}-g{c[1]}-{str(c[3]).split('.')[-1]}-{'bias' if c[4] else 'nobias'}"


@pytest.mark.parametrize("case", _ALL, ids=_id)
def test_bad_rows_reference_contract(case):
    # the reference alone against the fp64 contract: every scoring x grouping x dtype x bias, 40 rows of every kind,
    # renormalised and not, scaled
    scoring, n_group, topk_group, dtype, has_bias = case
    g = torch.Generator().manual_seed(1900 + _ALL.index(case))
    e, top_k = 64, 6
    x, _ = _bad_logits(40, e, top_k, dtype, g, n_group, first="all_nan")
    bias = torch.randn(e, generator=g) * 0.05 if has_bias else None
    for renorm, scale in ((True, 2.5), (False, 1.0)):
        check_bad_route(x, top_k, scoring, bias, n_group, topk_group, renorm, scale, impl="reference")


@pytest.mark.parametrize("case", _HALF, ids=_id)
@pytest.mark.parametrize("path", ["router", "one"])
def test_bad_rows_routing(device, path, case):
    # the routing itself on both row layouts: the router without alignment (one program per row, the winners by
    # tl.topk: the default; 10 rows) and the one-program router + alignment (every row in one [rows, experts] tile;
    # 3 rows x top-4 = 12 slots, within its 16); 32 experts, grouped: 8 groups of 4, 3 kept
    scoring, n_group, topk_group, dtype, has_bias = case
    i = _HALF.index(case)
    g = torch.Generator().manual_seed(1920 + i + 10 * (path == "one"))
    e, m, top_k = (32, 10, 6) if path == "router" else (32, 3, 4)
    if path == "one":
        assert moe_mod._fast_align_path(m, m * top_k, True) == "one"
    # a row with no finite score first: all NaN, or (softmax, every other case) all -inf
    first = "all_neg_inf" if scoring == "softmax" and i % 2 else "all_nan"
    x, _ = _bad_logits(m, e, top_k, dtype, g, n_group, first=first)
    bias = (torch.randn(e, generator=g) * 0.05).to(device) if has_bias else None
    check_bad_route(x.to(device), top_k, scoring, bias, n_group, topk_group, scale=2.5,
                    block_size=None if path == "router" else 4)


# the other default route + align paths (the one-program one is in test_bad_rows_routing), each chosen by M under
# the default thresholds (asserted): (M, top_k, E, n_group, topk_group) with M * top_k <= 32: the sorted last
# program; M <= 64: the row masks; M = 65 (just past 64, <= 1024 slots): atomic ranks; past 1024 slots (65 x 16):
# the general multi-program kernel with its ticketed last program
_PATHS = {"sorted": (7, 4, 32, 8, 3), "mask": (12, 4, 32, 8, 3), "atomic": (65, 4, 16, 4, 2),
          "general": (65, 16, 16, 1, 1)}
_PATH_CASES = [("sorted", "sigmoid", True), ("sorted", "softmax", False), ("mask", "softmax", True),
               ("mask", "sigmoid", False), ("atomic", "sigmoid", True), ("general", "softmax", False)]


@pytest.mark.parametrize("path, scoring, grouped", _PATH_CASES)
def test_bad_rows_fast_paths(device, path, scoring, grouped):
    # every other default route + align path: grouped cases bf16 logits with bias, ungrouped fp32 without (the
    # routing itself is crossed in test_bad_rows_routing); fillers aligned, exact order where the path has one
    m, top_k, e, n_group, topk_group = _PATHS[path]
    s = m * top_k
    if path != "general":
        assert s <= moe_mod._FAST_MAX_SLOTS and moe_mod._fast_align_path(m, s, True) == path
    else:
        assert s > moe_mod._FAST_MAX_SLOTS
    if not grouped:
        n_group, topk_group = 1, 1
    dtype = torch.bfloat16 if grouped else torch.float32
    g = torch.Generator().manual_seed(1950 + _PATH_CASES.index((path, scoring, grouped)))
    x, _ = _bad_logits(m, e, top_k, dtype, g, n_group, first="all_neg_inf" if scoring == "softmax" else "all_nan")
    bias = (torch.randn(e, generator=g) * 0.05).to(device) if grouped else None
    check_bad_route(x.to(device), top_k, scoring, bias, n_group, topk_group, scale=2.5, block_size=16 if m > 12 else 4)


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
def test_bad_rows_experts(device, scoring):
    # fillers through fused_moe: the rows with no finite score add exactly nothing (output 0), the others match the
    # experts of their weighted slots alone (fillers turned into skipped -1 slots) within the derived tolerance
    m, e, h, inter, top_k = 6, 16, 32, 16, 4
    g = torch.Generator().manual_seed(1980 + len(scoring))
    x, _ = _bad_logits(m, e, top_k, torch.float32, g, first="all_nan")
    x[3] = -INF  # under softmax a second row with no finite score; under sigmoid scores 0, so weight 0 each
    x[4] = math.nan  # two winners (experts 14 and 15), then two fillers
    x[4, 14], x[4, 15] = 0.5, -0.3
    ids, w, al = moe_route(x.to(device), top_k=top_k, scoring=scoring, block_size=16, impl="triton")
    _check_invariants(ids, w, e, top_k)
    w13, w2 = random_expert_weights(e, h, inter, dtype=torch.bfloat16, device=device, seed=1981)
    hidden = torch.randn(m, h, generator=g).bfloat16().to(device)
    out = fused_moe(hidden, w13, w2, ids, w, alignment=al, impl="triton")
    weighted = torch.where(w != 0, ids, torch.full_like(ids, -1))  # the fillers as skipped slots
    want = fused_moe_loop_reference(hidden, w13, w2, weighted, w)
    torch_err = fused_moe_reference(hidden, w13, w2, weighted, w, compute_dtype=torch.bfloat16).double() - want
    tol = 2 * torch_err.abs().max().item() + 1e-2 * want.abs().max().item() * 2 ** -8 + 1e-6
    assert (out.double().cpu() - want.cpu()).abs().max().item() <= tol
    assert torch.equal(out[0].cpu(), torch.zeros(h, dtype=torch.bfloat16)), "a row of fillers adds nothing"
    assert (w[0] == 0).all() and ids[0].tolist() == list(range(top_k))
    assert ids[4].tolist() == [14, 15, 0, 1] and (w[4, 2:] == 0).all(), "fillers: the lowest ids not chosen yet"


@pytest.mark.gpu
@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("m", [2, 9, 65])  # the one-program router, the row masks, atomic ranks
def test_bad_rows_graph_gpu(m, scoring):
    # Kimi-K2 (384 experts, bias, top-8, bf16): routing with bad rows captured in a CUDA graph (no host sync on the
    # Triton path nor in route_reference), replayed after the logits change in place to other bad rows; each replay
    # equals the eager call bit for bit and satisfies the contract
    g = torch.Generator().manual_seed(1990 + m)
    bias = (torch.randn(384, generator=g) * 0.05).cuda()
    logits = _bad_logits(m, 384, 8, torch.bfloat16, g, first="all_nan")[0].cuda()

    def step():
        ids, w, al = moe_route(logits, top_k=8, scoring=scoring, correction_bias=bias, block_size=16)
        rid, rw = route_reference(logits, 8, scoring, bias)
        return ids, w, al.num_tokens_post_padded, rid, rw

    warm_up_for_capture(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(2):
        logits.copy_(_bad_logits(m, 384, 8, torch.bfloat16, g, first="all_neg_inf")[0].cuda())
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for i, (got, want) in enumerate(zip(captured, eager, strict=True)):
            assert torch.equal(got, want), f"graph replay output {i} differs from the eager call"
        check_bad_route(logits, 8, scoring, bias, scale=1.0, block_size=16)
