"""Greedy and speculative generation loops over :class:`~specverify.forward.model.VerifyModel`.

They exist to prove that speculative decoding through the verify path is exact: with greedy acceptance, the tokens
generated speculatively equal plain greedy decoding token for token. State per request: the KV cache holds tokens
``0 .. L-2``; the last token ``L-1`` is node 0 of the next pass.

The drafter is a noisy copy of the target (same weights plus Gaussian noise), run without a cache: cheap on tiny
configs, and it proposes both agreeing and disagreeing tokens so acceptance paths of every length occur.
"""
from __future__ import annotations

import copy

import torch

from specverify.tree import BatchedDraftTree, DraftTree


class PagedRequests:
    """Paged KV for a batch of requests: each request owns ``pages_per_request`` pages scattered in the pool."""

    def __init__(self, model, batch, max_len, page_size, seed=0):
        self.page_size = page_size
        per = -(-max_len // page_size)
        num_pages = batch * per + 3  # a few pages nobody owns
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(num_pages, generator=g)[: batch * per]
        self.page_table = perm.view(batch, per).to(torch.int32).to(model.device)
        self.caches = model.allocate_kv(num_pages, page_size, fill=float("nan"))


def _prefill(model, req, prompts):
    """Run each prompt except its last token through the model as a chain; returns nothing (fills the cache)."""
    for b, prompt in enumerate(prompts):
        ids = torch.tensor([prompt[:-1]], device=model.device)
        if ids.shape[1] == 0:
            continue
        pos = torch.arange(ids.shape[1], device=model.device).unsqueeze(0)
        zero = torch.zeros(1, dtype=torch.int32, device=model.device)
        caches_b = [[c for c in layer] for layer in req.caches]
        model.forward(ids, pos, caches_b, req.page_table[b:b + 1], zero, None)


def greedy_generate(model, prompts, num_tokens, page_size=4, seed=0):
    """Plain greedy decoding, one token per pass (k = 1), batched over prompts of any lengths."""
    batch = len(prompts)
    req = PagedRequests(model, batch, max(len(p) for p in prompts) + num_tokens + 1, page_size, seed)
    _prefill(model, req, prompts)
    seqs = [list(p) for p in prompts]
    for _ in range(num_tokens):
        last = torch.tensor([[s[-1]] for s in seqs], device=model.device)
        prefix = torch.tensor([len(s) - 1 for s in seqs], dtype=torch.int32, device=model.device)
        logits = model.forward(last, prefix.long().unsqueeze(1), req.caches, req.page_table, prefix, None)
        nxt = logits[:, 0].argmax(-1).tolist()
        for s, t in zip(seqs, nxt):
            s.append(int(t))
    return [s[len(p):] for s, p in zip(seqs, prompts)]


class NoisyCopyDrafter:
    """A drafter that is the target model with Gaussian noise of relative size ``noise`` on every weight."""

    def __init__(self, model, noise=0.1, seed=1):
        self.model = copy.copy(model)
        self.model.ops = model.ops
        g = torch.Generator(device=model.device).manual_seed(seed)
        self.model._sets = {}
        self.model.layers = []
        mapping = {}
        for key, w in model._sets.items():
            nw = {}
            for name, t in w.items():
                if name == "q_b_folded":  # follows the noisy q_b below: no draw of its own (the stream stays as it was)
                    continue
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2:
                    nw[name] = t + noise * t.std() * torch.randn(t.shape, generator=g, device=t.device,
                                                                 dtype=t.dtype)
                else:
                    nw[name] = t
            if "q_b_folded" in w:  # q_b's folded copy follows the noisy q_b (not noise of its own)
                from specverify.forward.model import attach_folded_q_b

                attach_folded_q_b(nw)
            mapping[id(w)] = nw
            self.model._sets[key] = nw
        self.model.layers = [mapping[id(w)] for w in model.layers]

    def next_logits(self, seq):
        m = self.model
        ids = torch.tensor([seq], device=m.device)
        pos = torch.arange(len(seq), device=m.device).unsqueeze(0)
        req = PagedRequests(m, 1, len(seq), 8)
        zero = torch.zeros(1, dtype=torch.int32, device=m.device)
        return m.forward(ids, pos, req.caches, req.page_table, zero, None)[0, -1]

    def propose(self, seq, tree: DraftTree):
        """Tokens for every node of ``tree``: node 0 is ``seq[-1]``; a node's children take the drafter's best
        tokens after the path to that node, in order."""
        tokens = [seq[-1]] + [0] * (tree.num_nodes - 1)
        for node in range(tree.num_nodes):
            kids = tree.children(node)
            if not kids:
                continue
            path = [tokens[i] for i in tree.path_to(node)]
            logits = self.next_logits(seq[:-1] + path)
            best = torch.topk(logits, len(kids)).indices.tolist()
            for kid, tok in zip(kids, best):
                tokens[kid] = int(tok)
        return tokens


def speculative_generate(model, drafter, prompts, num_tokens, tree: DraftTree, page_size=4, seed=0):
    """Speculative decoding with greedy tree acceptance and KV compaction; returns (tokens, accept lengths)."""
    batch = len(prompts)
    k = tree.num_nodes
    req = PagedRequests(model, batch, max(len(p) for p in prompts) + num_tokens + 2 * k + 1, page_size, seed)
    _prefill(model, req, prompts)
    seqs = [list(p) for p in prompts]
    bt = BatchedDraftTree.repeat(tree, batch)
    parents = bt.parents.to(model.device)
    depth = bt.depth.to(model.device)
    mask = bt.packed_mask.to(model.device)
    accept_lens = []
    while min(len(s) - len(p) for s, p in zip(seqs, prompts)) < num_tokens:
        draft = torch.tensor([drafter.propose(s, tree) for s in seqs], device=model.device)
        prefix = torch.tensor([len(s) - 1 for s in seqs], dtype=torch.int32, device=model.device)
        nodes, acc, toks, _ = model.verify(draft, parents, depth, mask, req.caches, req.page_table, prefix,
                                           tree.max_depth)
        flat = [c for layer in req.caches for c in layer]
        model.ops.compact_kv(flat, req.page_table, prefix, nodes, acc)
        for b, s in enumerate(seqs):
            n = int(acc[b]) + 1
            s.extend(int(t) for t in toks[b, :n].tolist())
        accept_lens += acc.tolist()
    return [s[len(p):len(p) + num_tokens] for s, p in zip(seqs, prompts)], accept_lens
