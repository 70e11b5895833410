"""The sampling kernels of ``verify_sampling`` ("select") against the torch reference: exact integer outputs on the
same uniforms, through the candidate fast path, the full-row fallback and the walker's full-row bonus; plus the
candidate invariants of the chunk kernel."""
from __future__ import annotations

import pytest
import torch

import specverify.accept as acc
from specverify.accept import verify_sampling
from specverify.reference.sampling import verify_sampling_reference
from specverify.tree import BatchedDraftTree, DraftTree

VOCAB = 1200  # several chunks of 256 with a partial last one (1200 = 4 * 256 + 176)

# one request per setting: greedy, top-k, top-p, top-k + top-p, min-p, temperature only (no filter: the kept set is
# not inside the candidates, so the walker draws the bonus with passes over the row)
_SETTINGS = dict(
    temperature=[0.0, 1.0, 1.0, 0.7, 1.0, 1.0],
    top_k=[0, 20, 0, 50, 0, 0],
    top_p=[1.0, 1.0, 0.9, 0.95, 1.0, 1.0],
    min_p=[0.0, 0.0, 0.0, 0.0, 0.2, 0.0],
)


def _case(seed: int, integer_logits: bool):
    g = torch.Generator().manual_seed(seed)
    batch, k = len(_SETTINGS["top_k"]), 4
    trees = BatchedDraftTree([DraftTree.chain(k), DraftTree.topk_of_size(2, k)] * (batch // 2))
    if integer_logits:
        # few distinct values: long runs of ties at every top-k / top-p cut (all kept or all dropped)
        logits = torch.randint(-6, 7, (batch, k, VOCAB), generator=g).float()
    else:
        logits = (torch.randn(batch, k, VOCAB, generator=g) * 4).to(torch.bfloat16).float()
    tgt = logits.argmax(-1)
    draft = torch.randint(0, VOCAB, (batch, k), generator=g)
    follow = torch.rand(batch, k, generator=g) < 0.7
    par = trees.parents
    for b in range(batch):
        for i in range(1, k):
            if follow[b, i]:
                draft[b, i] = tgt[b, par[b, i]]
    u = torch.rand(batch, trees.max_depth + 1, generator=g)
    params = {n: torch.tensor(v, dtype=torch.int64 if n == "top_k" else torch.float32) for n, v in _SETTINGS.items()}
    return logits, trees, draft, u, params


@pytest.mark.parametrize("cap,integer_logits", [
    (None, False),  # adaptive capacity (128 per chunk of 256): every filtered row on the candidate path
    (32, True),     # ties at the cuts; some chunks keep fewer than their capacity
    (4, False),     # capacity 4: thresholds fall below the floors, rows take the exact full-row fallback
])
def test_select_matches_reference(cap, integer_logits, device, poison):
    logits, trees, draft, u, params = _case(3 if integer_logits else 4, integer_logits)
    ref = verify_sampling_reference(logits, draft, trees.parents, u, max_depth=trees.max_depth, **params)
    batch, length = u.shape
    out = tuple(poison(t) for t in (torch.empty(batch, length, dtype=torch.int64, device=device),
                                    torch.empty(batch, dtype=torch.int64, device=device),
                                    torch.empty(batch, length, dtype=torch.int64, device=device)))
    res = verify_sampling(logits.to(device), trees, draft.to(device), uniform_samples=u.to(device), out=out,
                          impl="triton", _chunk=256, _cap=cap, **{n: v.to(device) for n, v in params.items()})
    for got, want in zip(res, ref):
        assert torch.equal(got.cpu(), want), cap


@pytest.fixture
def fused_config(monkeypatch):
    monkeypatch.setattr(acc, "_SELECT_CONFIG", dict(acc._SELECT_CONFIG))  # a copy the test may edit
    return acc._SELECT_CONFIG


@pytest.mark.parametrize("vocab,chunk,cap,k", [
    (37, None, None, 1),  # 37: prime, one partial chunk, no floor; k = 1: only the bonus
    (100, 32, 8, 3),      # 4 chunks of 32 (last one 4 long) with 8 candidates each
])
def test_select_fused_reductions(vocab, chunk, cap, k, fused_config, device):
    """The multi-operand reductions the GPU runs (the interpreter defaults to plain ones), at tiny sizes."""
    fused_config["fused"] = True
    g = torch.Generator().manual_seed(9)
    batch = 3
    logits = torch.randn(batch, k, vocab, generator=g) * 3
    trees = BatchedDraftTree.repeat(DraftTree.chain(k), batch)
    draft = torch.randint(0, vocab, (batch, k), generator=g)
    draft[:, 1:] = logits.argmax(-1)[:, :-1]
    u = torch.rand(batch, k, generator=g)
    kw = dict(top_p=torch.tensor([0.8, 1.0, 0.5]), top_k=torch.tensor([5, 0, 0]), min_p=torch.tensor([0.0, 0.0, 0.1]))
    ref = verify_sampling_reference(logits, draft, trees.parents, u, max_depth=trees.max_depth, **kw)
    res = verify_sampling(logits.to(device), trees, draft.to(device), uniform_samples=u.to(device), impl="triton",
                          _chunk=chunk, _cap=cap, **{n: v.to(device) for n, v in kw.items()})
    assert all(torch.equal(a.cpu(), b) for a, b in zip(res, ref))


@pytest.mark.parametrize("fused", [False, True])
def test_scan_kernel_candidates(fused, device):
    """Per chunk: at most CAP candidates, exactly the elements at or above the floor, in vocabulary order, the
    remaining slots padded with -inf; chunk max / first argmax / sum exp as in torch."""
    from specverify.kernels import accept as ka

    g = torch.Generator().manual_seed(5)
    rows, vocab, chunk, cap = 3, 1000, 256, 16  # 1000: a partial last chunk of 232
    x = torch.randint(-20, 21, (rows, vocab), generator=g).float() / 4  # ties at the floor
    x[1, 300:600] = -float("inf")  # a chunk almost entirely masked out: fewer finite values than its capacity
    S = -(-vocab // chunk)
    f32, i32 = torch.float32, torch.int32
    bufs = [torch.full((rows, S), float("nan"), dtype=f32) for _ in range(4)]
    c_max, c_arg, c_sum, c_floor = bufs[0], torch.zeros(rows, S, dtype=i32), bufs[2], bufs[3]
    cand_z = torch.full((rows, S, cap), float("nan"), dtype=f32)
    cand_i = torch.full((rows, S, cap), -7, dtype=i32)
    dev = [t.to(device) for t in (x, c_max, c_arg, c_sum, c_floor, cand_z, cand_i)]
    ka._accept_scan_kernel[(rows, S)](dev[0], vocab, vocab, S, 1, dev[1], 1.0, *dev[1:],
                                      TEMP_T=False, CHUNK=chunk, CAP=cap, CAP_BLOCK=cap, FLOOR_ITERS=10,
                                      FUSED=fused)
    x, c_max, c_arg, c_sum, c_floor, cand_z, cand_i = (t.cpu() for t in dev)
    for r in range(rows):
        for c in range(S):
            seg = x[r, c * chunk:(c + 1) * chunk]
            assert c_max[r, c] == seg.max() and c_arg[r, c] == c * chunk + int(seg.argmax())
            fin = seg > -float("inf")
            expect_sum = torch.exp(seg[fin] - seg.max()).sum()
            assert torch.allclose(c_sum[r, c], expect_sum, rtol=1e-5)
            idx = torch.nonzero(fin & (seg >= c_floor[r, c])).flatten()
            assert idx.numel() <= cap
            n = idx.numel()
            assert torch.equal(cand_i[r, c, :n], (idx + c * chunk).to(i32))
            assert torch.equal(cand_z[r, c, :n], seg[idx])
            assert bool((cand_z[r, c, n:] == -float("inf")).all())
            if int(fin.sum()) <= cap:
                assert c_floor[r, c] == -float("inf")  # every finite element is a candidate
            else:  # the floor is tight to its 1/16 nat probe grid: one probe lower keeps more than CAP
                assert int((fin & (seg >= c_floor[r, c] - 64 / 2 ** 10)).sum()) > cap


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 163840])
def test_select_large_vocab_gpu(vocab):
    g = torch.Generator().manual_seed(21)
    batch, k = 8, 4
    trees = BatchedDraftTree.repeat(DraftTree.chain(k), batch)
    logits = (torch.randn(batch, k, vocab, generator=g) * 4).to(torch.bfloat16)
    draft = torch.randint(0, vocab, (batch, k), generator=g)
    draft[:, 1:] = logits.float().argmax(-1)[:, :-1]
    u = torch.rand(batch, k, generator=g)
    for kw in (dict(top_p=0.9), dict(top_k=50, top_p=0.95, temperature=0.7), dict(min_p=0.1), dict()):
        ref = verify_sampling_reference(logits.float(), draft, trees.parents, u, max_depth=trees.max_depth, **kw)
        res = verify_sampling(logits.cuda(), trees, draft.cuda(), uniform_samples=u.cuda(), impl="triton", **kw)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(res, ref)), kw
