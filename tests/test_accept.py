"""verify_greedy / verify_sampling against the torch references (exact integer outputs)."""
from __future__ import annotations

import random

import pytest
import torch

from specverify.accept import verify_greedy, verify_sampling
from specverify.reference.accept import greedy_accept_reference
from specverify.reference.sampling import process_logits_reference, verify_sampling_reference
from specverify.tree import BatchedDraftTree, DraftTree


def _random_tree(rng: random.Random, k: int) -> DraftTree:
    return DraftTree([-1] + [rng.randrange(i) for i in range(1, k)])


def _trees(seed: int, batch: int, k: int) -> BatchedDraftTree:
    rng = random.Random(seed)
    pool = [DraftTree.chain(k), DraftTree.topk_of_size(2, k), _random_tree(rng, k)]
    return BatchedDraftTree([pool[i % 3] if i < 3 else _random_tree(rng, k) for i in range(batch)])


def _drafts_following(logits, trees, rng_gen, p_follow=0.7):
    """Draft tokens that often equal the target's argmax along the tree (so paths get accepted)."""
    batch, k, vocab = logits.shape
    tgt = logits.float().argmax(-1)
    draft = torch.randint(0, vocab, (batch, k), generator=rng_gen)
    par = trees.parents
    follow = torch.rand(batch, k, generator=rng_gen) < p_follow
    for b in range(batch):
        for i in range(1, k):
            if follow[b, i]:
                draft[b, i] = tgt[b, par[b, i]]
    return draft


def _outs_equal(a, b):
    return all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))


@pytest.mark.parametrize("seed,batch,k,vocab,chunk", [
    (0, 5, 6, 37, 16),     # prime vocab: the last chunk is partial; 3 chunks merged
    (1, 3, 1, 20, None),   # k = 1: plain decode, only the bonus
    (2, 4, 9, 64, 16),     # k not a power of two, 4 full chunks
])
def test_greedy_logits_matches_reference(seed, batch, k, vocab, chunk, device, poison):
    g = torch.Generator().manual_seed(seed)
    trees = _trees(seed, batch, k)
    # integer logits make ties common: argmax must pick the lowest index like torch.argmax
    logits = torch.randint(-3, 4, (batch, k, vocab), generator=g).float()
    draft = _drafts_following(logits, trees, g)
    if k > 1:
        draft[0, 1:] = draft[0, 1]  # duplicate tokens among siblings: the first matching child wins
    ref_nodes, ref_len, ref_tok = greedy_accept_reference(logits.argmax(-1), draft, trees.parents, trees.max_depth)
    length = trees.max_depth + 1
    out = tuple(poison(t) for t in (torch.empty(batch, length, dtype=torch.int64, device=device),
                                    torch.empty(batch, dtype=torch.int64, device=device),
                                    torch.empty(batch, length, dtype=torch.int64, device=device)))
    res = verify_greedy(draft.to(device), trees, logits=logits.to(device), out=out, impl="triton", _chunk=chunk)
    assert res[0] is out[0]
    assert _outs_equal(res, (ref_tok, ref_len, ref_nodes))


def test_greedy_target_ids_and_parents_tensor(device):
    g = torch.Generator().manual_seed(3)
    batch, k, vocab = 4, 5, 11
    trees = _trees(3, batch, k)
    tgt = torch.randint(0, vocab, (batch, k), generator=g)
    logits = torch.nn.functional.one_hot(tgt, vocab).float()
    draft = _drafts_following(logits, trees, g, 0.8)
    ref_nodes, ref_len, ref_tok = greedy_accept_reference(tgt, draft, trees.parents, k - 1)
    res = verify_greedy(draft.to(device), trees.parents.to(device), target_ids=tgt.to(device), impl="triton")
    assert res[0].shape == (batch, k)  # parents tensor: L = k
    assert _outs_equal(res, (ref_tok, ref_len, ref_nodes))


def test_greedy_accept_all_and_reject_all(device):
    batch, k, vocab = 2, 4, 9
    trees = BatchedDraftTree.repeat(DraftTree.chain(k), batch)
    tgt = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])
    draft = torch.tensor([[0, 1, 2, 3], [0, 5, 5, 5]])  # request 0 accepts all, request 1 rejects at once
    tok, ln, nodes = verify_greedy(draft.to(device), trees, target_ids=tgt.to(device), impl="triton")
    assert ln.tolist() == [3, 0]
    assert tok.tolist() == [[1, 2, 3, 4], [1, -1, -1, -1]]
    assert nodes.tolist() == [[0, 1, 2, 3], [0, -1, -1, -1]]


# per-request settings: each request of one launch exercises a different filter
_SETTINGS = dict(
    temperature=[0.0, 1.0, 1.0, 0.5, 0.8, 1.3],
    top_k=[0, 1, 0, 0, 5, 3],
    top_p=[1.0, 1.0, 0.05, 1.0, 0.8, 0.9],
    min_p=[0.0, 0.0, 0.0, 0.3, 0.05, 0.0],
)


@pytest.mark.parametrize("cap", [4, None])  # cap 4: most rows overflow and take the exact full-row fallback
def test_sampling_matches_reference(cap, device, poison):
    g = torch.Generator().manual_seed(7)
    batch, k, vocab = 6, 4, 40
    trees = _trees(7, batch, k)
    logits = torch.randn(batch, k, vocab, generator=g) * 2.0
    draft = _drafts_following(logits, trees, g, 0.6)
    u = torch.rand(batch, trees.max_depth + 1, generator=g)
    params = {n: torch.tensor(v, dtype=torch.int64 if n == "top_k" else torch.float32) for n, v in _SETTINGS.items()}
    ref = verify_sampling_reference(logits, draft, trees.parents, u, max_depth=trees.max_depth, **params)
    dev = {n: v.to(device) for n, v in params.items()}
    res = verify_sampling(logits.to(device), trees, draft.to(device), uniform_samples=u.to(device), impl="triton",
                          _chunk=16, _cap=cap, **dev)
    assert _outs_equal(res, ref)


def test_sampling_edge_cases_reference_and_triton(device):
    """Zero-probability sibling, duplicate siblings, top-k = 1, tiny top-p, reject all, accept a full path."""
    vocab = 8
    # node 0 favours token 3; its children: token 5 (probability 0 under top-k = 1), token 3, token 3 again
    tree = DraftTree([-1, 0, 0, 0, 2])
    trees = BatchedDraftTree.repeat(tree, 4)
    base = torch.full((4, 5, vocab), -2.0)
    base[:, 0, 3] = 3.0
    base[:, 2, 6] = 3.0   # after accepting node 2 (token 3), the target prefers token 6
    base[:, 1, 1] = 3.0
    base[:, 3, 1] = 3.0
    base[:, 4, 2] = 3.0
    draft = torch.tensor([[0, 5, 3, 3, 6]] * 4)
    draft[3] = torch.tensor([0, 5, 4, 4, 6])   # request 3: every child has probability 0 → reject everything
    u = torch.zeros(4, 3)
    u[2] = 0.999  # top-p tiny keeps only token 3: the walk still accepts it (u < 1)
    temperature = torch.tensor([1.0, 0.0, 1.0, 1.0])
    top_k = torch.tensor([1, 0, 0, 1])
    top_p = torch.tensor([1.0, 1.0, 1e-4, 1.0])
    ref = verify_sampling_reference(base, draft, trees.parents, u, temperature, top_k, top_p, 0.0, trees.max_depth)
    tok, ln, nodes = ref
    # top-k = 1 and temperature 0 both accept the full path 0 -> 2 -> 4 (node 1's token has probability 0)
    assert ln.tolist() == [2, 2, 2, 0]
    assert nodes[0].tolist() == [0, 2, 4]
    assert tok[0].tolist() == [3, 6, 2]
    assert tok[3].tolist() == [3, -1, -1]
    res = verify_sampling(base.to(device), trees, draft.to(device), uniform_samples=u.to(device),
                          temperature=temperature.to(device), top_k=top_k.to(device), top_p=top_p.to(device),
                          impl="triton", _chunk=8)
    assert _outs_equal(res, ref)


def test_duplicate_sibling_never_double_counts():
    """Siblings with the same token: the duplicate adds no mass, so it is never accepted (reference rule)."""
    probs = torch.tensor([[[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3], [1 / 3, 1 / 3, 1 / 3]]])
    parents = torch.tensor([[-1, 0, 0]])
    draft = torch.tensor([[0, 1, 1]])
    from specverify.reference.sampling import tree_sampling_walk_reference

    tok, ln, nodes = tree_sampling_walk_reference(probs, draft, parents, torch.tensor([[0.7, 0.0]]), max_depth=1)
    assert ln.tolist() == [0]  # u = 0.7 > 0.5: neither copy of token 1 is accepted
    assert tok[0, 0].item() == 0  # bonus from the rest: only token 0 has mass


def test_process_logits_reference_filters():
    x = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert torch.allclose(process_logits_reference(x, top_k=2), torch.tensor([[4 / 7, 3 / 7, 0, 0]]))
    assert torch.allclose(process_logits_reference(x, top_p=0.65), torch.tensor([[4 / 7, 3 / 7, 0, 0]]))
    assert torch.allclose(process_logits_reference(x, min_p=0.4), torch.tensor([[4 / 9, 3 / 9, 2 / 9, 0]]))
    assert torch.equal(process_logits_reference(x, temperature=0.0), torch.tensor([[1.0, 0, 0, 0]]))


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 163840])
def test_large_vocab_gpu(vocab):
    g = torch.Generator().manual_seed(11)
    batch, k = 8, 4
    trees = _trees(11, batch, k)
    logits = (torch.randn(batch, k, vocab, generator=g) * 4).to(torch.bfloat16)
    draft = _drafts_following(logits, trees, g, 0.6)
    ref_nodes, ref_len, ref_tok = greedy_accept_reference(logits.float().argmax(-1), draft, trees.parents,
                                                          trees.max_depth)
    res = verify_greedy(draft.cuda(), trees, logits=logits.cuda(), impl="triton")
    assert _outs_equal(res, (ref_tok, ref_len, ref_nodes))
    u = torch.rand(batch, trees.max_depth + 1, generator=g)
    for kw in (dict(top_p=0.9), dict(top_k=50, top_p=0.95, temperature=0.7), dict(min_p=0.1), dict()):
        ref = verify_sampling_reference(logits.float(), draft, trees.parents, u, max_depth=trees.max_depth, **kw)
        res = verify_sampling(logits.cuda(), trees, draft.cuda(), uniform_samples=u.cuda(), impl="triton", **kw)
        assert _outs_equal(res, ref), kw


@pytest.mark.gpu
def test_sampling_graph_capture_gpu():
    g = torch.Generator().manual_seed(12)
    batch, k, vocab = 4, 4, 4096
    trees = BatchedDraftTree.repeat(DraftTree.topk_of_size(2, k), batch)
    logits = (torch.randn(batch, k, vocab, generator=g) * 3).cuda()
    draft = torch.randint(0, vocab, (batch, k), generator=g).cuda()
    u = torch.rand(batch, trees.max_depth + 1, generator=g).cuda()
    top_p = torch.full((batch,), 0.9, device="cuda")
    out = tuple(t.cuda() for t in (torch.empty(batch, 3, dtype=torch.int64), torch.empty(batch, dtype=torch.int64),
                                   torch.empty(batch, 3, dtype=torch.int64)))
    parents = trees.parents.cuda()
    verify_sampling(logits, trees, draft, uniform_samples=u, top_p=top_p, out=None)  # warm-up, counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        verify_sampling(logits, trees, draft, uniform_samples=u, top_p=top_p, out=out)
    for step in range(2):
        logits.copy_(torch.randn(batch, k, vocab, generator=g) * 3)
        u.copy_(torch.rand(batch, 3, generator=g))
        draft.copy_(logits.argmax(-1).roll(1, 1) if step else draft)
        graph.replay()
        ref = verify_sampling_reference(logits.cpu(), draft.cpu(), trees.parents, u.cpu(), top_p=0.9, max_depth=2)
        assert _outs_equal(out, ref)
