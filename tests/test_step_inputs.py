"""The SGLang whole step's inputs without SGLang (:mod:`specverify.forward.step`): tree masks from EAGLE's tree
links, token-slot page tables from CSR metadata, and the verify forward fed that way (a model's rotary table, the
cache viewed as token slots) against the same forward over our own paged inputs."""
from __future__ import annotations

import math

import pytest
import torch

from specverify.forward import step
from specverify.forward.model import VerifyModel
from specverify.forward.ops import Ops
from specverify.tree import BatchedDraftTree, DraftTree
from specverify.verify_wall import _wall_ops


@pytest.mark.parametrize("parents", [
    [-1, 0, 0, 1],                      # siblings and a grandchild
    [-1, 0, 1, 2, 3],                   # a chain
    [-1, 0, 0, 0, 1, 1, 2, 3, 4],       # 9 nodes: two mask bytes per row
    [-1],                               # one node (decode-like)
])
def test_tree_mask_from_links_matches_draft_tree(parents):
    tree = DraftTree(parents)
    other = DraftTree.chain(len(parents))  # a second request with another shape
    _, nt, ns = tree.retrieve_links()
    _, nt2, ns2 = other.retrieve_links()
    got = step.tree_mask_from_links(torch.stack([nt, nt2]), torch.stack([ns, ns2]))
    assert torch.equal(got, torch.stack([tree.packed_mask(), other.packed_mask()]))


def _paged(batch, prefix, k, page_size, g):
    per = -(-(max(prefix) + k) // page_size)
    pages = batch * per + 1
    table = torch.randperm(pages, generator=g)[: batch * per].view(batch, per).to(torch.int32)
    return table, torch.tensor(prefix, dtype=torch.int32), pages


@pytest.mark.parametrize("page_size", [1, 4])
def test_page_table_from_metadata_names_every_token_slot(page_size):
    g = torch.Generator().manual_seed(page_size)
    k, prefix = 3, [5, 0, 9]  # an empty prefix; prefixes ending inside a page
    table, lens, _ = _paged(3, prefix, k, page_size, g)
    indptr, indices, out_loc = step.csr_metadata(table, lens, k, page_size)
    assert indptr.tolist() == [0, 5, 5, 14] and out_loc.shape == (3 * k,)
    width = 16
    got = step.page_table_from_metadata(indptr, indices, out_loc, lens, k, width)
    assert got.dtype == torch.int32 and got.shape == (3, width)
    for b, n in enumerate(prefix):
        pos = torch.arange(n + k)
        want = table[b, pos // page_size].long() * page_size + pos % page_size
        assert torch.equal(got[b, : n + k].long(), want)
        assert (got[b, n + k:] == 0).all()  # SGLang's padding slot


@pytest.mark.parametrize("tree", [DraftTree([-1, 0, 0, 1]), DraftTree.chain(4)])
def test_step_forward_matches_the_paged_forward(tree):
    """The forward fed as the SGLang step feeds it (token-slot table from the metadata, mask from the links, the
    theta RoPE as a rotary table) gives the logits and KV of the forward over our paged inputs."""
    g = torch.Generator().manual_seed(len(tree.parents))
    torch.manual_seed(int(torch.randint(0, 2 ** 31, (1,), generator=g)))
    m = VerifyModel("tiny-mla-moe", dtype=torch.float32, device="cpu", seed=int(torch.randint(0, 1000, (1,))))
    c = m.config
    b, k, ps = 2, tree.num_nodes, 4
    prefix = [6, 13]
    table, lens, pages = _paged(b, prefix, k, ps, g)
    caches = m.allocate_kv(pages, ps)
    for layer in caches:
        for cache in layer:
            cache.normal_(generator=g)
    slot_caches = [[cc.clone() for cc in layer] for layer in caches]
    bt = BatchedDraftTree.repeat(tree, b)
    draft = torch.randint(0, c.vocab_size, (b, k), generator=g)
    pos = lens.long().unsqueeze(1) + bt.depth.long()
    mask = None if tree.is_chain else bt.packed_mask
    want = m.forward(draft, pos, caches, table, lens, mask)

    m.ops = step.model_ops(Ops(), step.rope_table(c.rope_theta, c.qk_rope_head_dim, 64), neox=True,
                           sm_scale=1.0 / math.sqrt(c.qk_nope_head_dim + c.qk_rope_head_dim))
    indptr, indices, out_loc = step.csr_metadata(table, lens, k, ps)
    slot_table = step.page_table_from_metadata(indptr, indices, out_loc, lens, k, 64)
    _, nt, ns = tree.retrieve_links()
    links_mask = None if tree.is_chain else step.tree_mask_from_links(nt.expand(b, k), ns.expand(b, k))
    got = m.forward(draft, pos, step.token_slot_caches(slot_caches), slot_table, lens, links_mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    for layer_got, layer_want in zip(slot_caches, caches):
        torch.testing.assert_close(layer_got[0], layer_want[0], rtol=1e-6, atol=1e-6)

    # control: the interleaved layout rotates other pairs, so the table really decides the logits
    m.ops = step.model_ops(Ops(), step.rope_table(c.rope_theta, c.qk_rope_head_dim, 64), neox=False,
                           sm_scale=1.0 / math.sqrt(c.qk_nope_head_dim + c.qk_rope_head_dim))
    other = m.forward(draft, pos, step.token_slot_caches(slot_caches), slot_table, lens, links_mask)
    assert float((other - want).abs().max()) > 1e-3 * float(want.abs().max())


def test_wall_step_provider_refuses_gqa_models():
    m = VerifyModel("tiny-gqa", dtype=torch.float32, device="cpu")
    with pytest.raises(RuntimeError, match="MLA"):
        _wall_ops("sglang-step", m, 64)


@pytest.mark.parametrize("tree_spec", ["chain", "topk:2"])
def test_wall_step_case_does_the_verify_cases_work(tree_spec):
    """verify-wall's sglang-step pass (adapted inputs, token-slot caches) accepts the same tokens and leaves the
    same KV as its specverify pass on the same inputs (reference op tables: exact up to the RoPE table)."""
    from specverify.verify_wall import StepCase, VerifyCase

    g = torch.Generator().manual_seed(11)
    m = VerifyModel("tiny-mla-moe", dtype=torch.float32, device="cpu", seed=3)
    b, k, ps, ctx = 2, 4, 4, 10
    table, _, pages = _paged(b, [ctx] * b, k, ps, g)
    caches = m.allocate_kv(pages, ps)
    for layer in caches:
        for cache in layer:
            cache.normal_(generator=g)
    twin = [[cc.clone() for cc in layer] for layer in caches]
    want = VerifyCase(m, caches, table, b, k, ctx, tree_spec, seed=5)
    toks, acc = want.run()
    c = m.config
    m.ops = step.model_ops(Ops(), step.rope_table(c.rope_theta, c.qk_rope_head_dim, ctx + k), neox=True,
                           sm_scale=1.0 / math.sqrt(c.qk_nope_head_dim + c.qk_rope_head_dim))
    got = StepCase(m, twin, table, b, k, ctx, tree_spec, seed=5, page_size=ps)
    toks2, acc2 = got.run()
    assert torch.equal(acc2, acc) and torch.equal(toks2, toks)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4 * float(want.logits.abs().max()))
    for a, c in zip(twin, caches):
        torch.testing.assert_close(a[0], c[0], rtol=1e-5, atol=1e-5)


def test_loaded_model_folds_q_b_into_a_copy_of_its_own(device, monkeypatch):
    """LoadedVerifyModel adds q_b_folded (q_b times q_a's norm weight) to copies of the engine's layer dicts; the
    given dicts and tensors stay as they were, and the folded forward gives the synthetic model's logits."""
    from specverify import gemv as gemv_mod
    from specverify.forward.model import attach_folded_q_b, fold_q_norm
    from specverify.forward.ops import specverify_ops

    monkeypatch.setattr(gemv_mod, "LINEAR_RULES", ((16, (1, 1 << 30), (1, 1 << 30)),))  # our GEMV at tiny sizes
    src = VerifyModel("tiny-mla-moe", dtype=torch.bfloat16, seed=2, device=device)
    g = torch.Generator().manual_seed(3)
    layers = []
    for w in src.layers:
        w["q_a_norm"].copy_((1 + 0.5 * torch.randn(w["q_a_norm"].shape, generator=g)).to(w["q_a_norm"]))
        attach_folded_q_b(w)
        layers.append({n: t for n, t in w.items() if not n.startswith("q_b_folded")})  # as an engine hands them
    q_b_before = [lw["q_b"].clone() for lw in layers]
    given = {"embed": src.embed, "lm_head": src.lm_head, "final_norm": src.final_norm, "layers": layers}
    ops, _ = specverify_ops(src)
    loaded = step.LoadedVerifyModel(src.config, given, dtype=torch.bfloat16, device=device, ops=ops)
    assert all("q_b_folded" not in lw for lw in layers)  # the given dicts are not modified
    assert all(torch.equal(lw["q_b"], before) for lw, before in zip(layers, q_b_before))
    for lw, mine in zip(layers, loaded.layers):
        assert mine["q_b"] is lw["q_b"] and torch.equal(mine["q_b_folded"], fold_q_norm(lw["q_b"], lw["q_a_norm"]))
    assert loaded.folded_bytes == sum(lw["q_b"].numel() * 2 for lw in layers)
    src.ops = ops
    b, k, ps = 1, 3, 4
    table = torch.arange(3, dtype=torch.int32, device=device).view(1, 3)
    prefix = torch.tensor([5], dtype=torch.int32, device=device)
    ids = torch.randint(0, src.config.vocab_size, (b, k), generator=g).to(device)
    pos = prefix.long()[:, None] + torch.arange(k, device=device)
    out = []
    for m in (src, loaded):
        caches = m.allocate_kv(4, ps)
        for layer in caches:
            for c in layer:
                c.copy_(torch.randn(c.shape, generator=torch.Generator().manual_seed(8)))
        out.append(m.forward(ids, pos, caches, table, prefix))
    assert not torch.isnan(out[0]).any() and torch.equal(out[0], out[1])  # the same weights, the same launches
    # an in-place weight update makes the fold stale: the forward refuses it until refold()
    layers[0]["q_a_norm"].mul_(2)
    caches = loaded.allocate_kv(4, ps)
    with pytest.raises(RuntimeError, match="refold"):
        loaded.forward(ids, pos, caches, table, prefix)
    loaded.refold()
    assert torch.equal(loaded.layers[0]["q_b_folded"], fold_q_norm(layers[0]["q_b"], layers[0]["q_a_norm"]))
    assert not torch.isnan(loaded.forward(ids, pos, caches, table, prefix)).any()
