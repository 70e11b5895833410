"""Emitted tokens of tree speculative sampling are distributed as the processed target distribution.

Many seeded trials (the batch dimension carries the trials, all with the same logits and drafts, different
uniforms); chi-square test per emitted position against the exact processed probabilities. The torch reference
runs the full statistics on the CPU; the Triton path runs a reduced set (exact agreement with the reference on the
same uniforms) in the interpreter and the full statistics on a GPU.
"""
from __future__ import annotations

import pytest
import torch

from specverify.accept import verify_sampling
from specverify.reference.sampling import process_logits_reference, tree_sampling_walk_reference
from specverify.tree import BatchedDraftTree, DraftTree

VOCAB = 6
# chi-square 99.99% quantile for up to 5 degrees of freedom (fixed seeds make the test deterministic anyway)
CHI2_LIMIT = 25.8

CASES = {
    # draft of node i = the token of rank ranks[i] (0 = likeliest) under the processed target at its parent.
    # chain: likeliest, second likeliest, then the least likely token (probability 0 after top-k)
    "chain_topk": (DraftTree.chain(4), [0, 0, 1, 5], dict(temperature=0.8, top_k=4)),
    # tree: root children of rank 1, 1 (a duplicate) and 0; two children of node 1
    "tree_topp_minp": (DraftTree([-1, 0, 0, 0, 1, 1]), [0, 1, 1, 0, 0, 1], dict(top_p=0.8, min_p=0.1)),
}


def _logits():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, VOCAB, generator=g) * 1.5
    x[:, 2] += 1.0
    return x


def _chi2(samples: torch.Tensor, probs: torch.Tensor) -> float:
    n = samples.numel()
    counts = torch.bincount(samples, minlength=VOCAB).double()
    expect = probs.double() * n
    assert (counts[expect == 0] == 0).all(), "a token of probability 0 was emitted"
    keep = expect > 0
    return float(((counts[keep] - expect[keep]) ** 2 / expect[keep]).sum())


def _check(tree: DraftTree, probs: torch.Tensor, tokens: torch.Tensor, nodes: torch.Tensor, lens: torch.Tensor):
    # first emitted token ~ q at the root
    assert _chi2(tokens[:, 0], probs[0]) < CHI2_LIMIT
    # second emitted token, given the first was accepted as child j, ~ q at node j
    for j in tree.children(0):
        sel = (nodes[:, 1] == j) & (lens >= 1)
        if int(sel.sum()) >= 200:
            assert _chi2(tokens[sel, 1], probs[j]) < CHI2_LIMIT


def _draft_row(tree, ranks, probs):
    order = torch.argsort(probs, dim=-1, descending=True, stable=True)
    return [0] + [int(order[tree.parents[i], ranks[i]]) for i in range(1, tree.num_nodes)]


def _run_reference(tree, ranks, params, trials, seed):
    k = tree.num_nodes
    logits = _logits()[:k]
    probs = process_logits_reference(logits, **params)
    draft_row = _draft_row(tree, ranks, probs)
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(trials, tree.max_depth + 1, generator=g)
    draft = torch.tensor([draft_row] * trials)
    parents = tree.parents_tensor().expand(trials, k)
    tok, ln, nodes = tree_sampling_walk_reference(probs.expand(trials, k, VOCAB), draft, parents, u, tree.max_depth)
    return probs, tok, ln, nodes, u, draft_row


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_distribution(case):
    tree, draft_row, params = CASES[case]
    probs, tok, ln, nodes, _, _ = _run_reference(tree, draft_row, params, 4000, 1)
    _check(tree, probs, tok, nodes, ln)
    assert 0 < float(ln.float().mean()) < tree.max_depth  # some acceptance, some rejection


@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_reduced_trials_match_reference(case, device):
    tree, draft_row, params = CASES[case]
    trials = 6  # the interpreter is slow; exact agreement with the reference on the same uniforms instead
    probs, tok, ln, nodes, u, draft_row = _run_reference(tree, draft_row, params, trials, 2)
    k = tree.num_nodes
    logits = _logits()[:k].expand(trials, k, VOCAB).contiguous()
    res = verify_sampling(logits.to(device), BatchedDraftTree.repeat(tree, trials),
                          torch.tensor([draft_row] * trials, device=device), uniform_samples=u.to(device),
                          impl="triton", **params)
    assert torch.equal(res[0].cpu(), tok) and torch.equal(res[1].cpu(), ln) and torch.equal(res[2].cpu(), nodes)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_distribution_gpu(case):
    tree, draft_row, params = CASES[case]
    trials = 20000
    k = tree.num_nodes
    logits = _logits()[:k]
    probs = process_logits_reference(logits, **params)
    draft_row = _draft_row(tree, draft_row, probs)
    g = torch.Generator(device="cuda").manual_seed(3)
    tok, ln, nodes = verify_sampling(logits.expand(trials, k, VOCAB).contiguous().cuda(),
                                     BatchedDraftTree.repeat(tree, trials),
                                     torch.tensor([draft_row] * trials, device="cuda"), generator=g,
                                     impl="triton", **params)
    _check(tree, probs, tok.cpu(), nodes.cpu(), ln.cpu())
