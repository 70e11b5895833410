"""The FlashInfer MLA peer (specverify/peers/flashinfer.py) against the torch reference, through a CPU stand-in of
FlashInfer's wrapper that computes from exactly the metadata we plan (tests/flashinfer_standin.py). The real
FlashInfer runs on the GPU machine (bench_tree_attention.py's flashinfer provider, verify-wall's
sglang-flashinfer)."""
from __future__ import annotations

import sys

import pytest
import torch

import flashinfer_standin
from specverify.peers import flashinfer as fi_peer
from specverify.reference.attention import tree_attention_mla_reference


def _inputs(gen, prefix, k, heads=3, r=32, dr=8, page_size=4, dtype=torch.float16):
    """A scattered page table (pages in random order, one spare page per row) and a random latent + rope cache."""
    b = len(prefix)
    pages_a_row = -(-(max(prefix) + k) // page_size) + 1
    num_pages = b * pages_a_row + 3
    table = torch.randperm(num_pages, generator=gen)[: b * pages_a_row].view(b, pages_a_row).to(torch.int32)
    cache = torch.randn(num_pages, page_size, r + dr, generator=gen).to(dtype)
    q = torch.randn(b, k, heads, r + 16 + dr, generator=gen).to(dtype)  # the rope part as a strided view
    return q[..., :r].contiguous(), q[..., r + 16:], cache, table, torch.tensor(prefix, dtype=torch.int32)


@pytest.fixture
def standin(monkeypatch):
    flashinfer_standin.BatchMLAPagedAttentionWrapper.instances.clear()
    return flashinfer_standin.module()


# prefix 0 (only the draft tokens), a page boundary (prefix + k = 8 at page size 4), uneven lengths; k = 1 is
# SGLang's decode planning (not causal), k > 1 its TARGET_VERIFY planning (causal)
@pytest.mark.parametrize("k, prefix", [(1, [5, 0, 11]), (3, [5, 0, 11]), (4, [4, 9]), (5, [1])])
def test_chain_matches_reference(standin, k, prefix):
    gen = torch.Generator().manual_seed(100 + k)
    q_latent, q_rope, cache, table, lens = _inputs(gen, prefix, k)
    scale = 0.17
    attn = fi_peer.MLAChainAttention(module=standin)
    got = attn.mla(q_latent, q_rope, cache, table, lens, None, scale)
    ref = tree_attention_mla_reference(q_latent, q_rope, cache, table, lens, None, scale)
    assert _close(got, ref)
    (w,) = flashinfer_standin.BatchMLAPagedAttentionWrapper.instances
    assert w.use_cuda_graph and w.backend == "auto"
    assert w.plans[-1]["causal"] == (k > 1) and w.plans[-1]["page_size"] == 1
    assert torch.equal(w.plans[-1]["lens"], lens + k)


def _close(got, ref):
    # both round an fp64 result once to fp16: at most one fp16 ulp apart
    return (got.double() - ref.double()).abs().max().item() <= 2 ** -10 * max(1.0, ref.abs().max().item())


def test_replans_when_the_metadata_changes_and_only_then(standin):
    gen = torch.Generator().manual_seed(7)
    k = 3
    q_latent, q_rope, cache, table, lens = _inputs(gen, [6, 2], k)
    other_layer = torch.randn(cache.shape, generator=gen).to(cache.dtype)
    attn = fi_peer.MLAChainAttention(module=standin)
    for prefix in ([6, 2], [6, 2], [1, 7]):  # a step with the same lengths, then lengths changed in place
        lens.copy_(torch.tensor(prefix, dtype=torch.int32))
        for layer_cache in (cache, other_layer):  # a forward: layer 0, layer 1
            got = attn.mla(q_latent, q_rope, layer_cache, table, lens, None, 0.2)
            assert _close(got, tree_attention_mla_reference(q_latent, q_rope, layer_cache, table, lens, None, 0.2))
    (w,) = flashinfer_standin.BatchMLAPagedAttentionWrapper.instances
    assert len(w.plans) == 2 and w.runs == 6  # planned when first seen and when the lengths changed
    # the page table's contents change under the same pointer (pages swapped), and the caches are reallocated
    table.copy_(table.flip(1))
    fresh = torch.randn(cache.shape, generator=gen).to(cache.dtype)
    got = attn.mla(q_latent, q_rope, fresh, table, lens, None, 0.2)
    assert _close(got, tree_attention_mla_reference(q_latent, q_rope, fresh, table, lens, None, 0.2))
    assert len(w.plans) == 3 and len(attn.plans) == 1  # one plan per shape, not one per tensor


def test_prepared_attention_plans_once(standin):
    gen = torch.Generator().manual_seed(11)
    q_latent, q_rope, cache, table, lens = _inputs(gen, [3, 8], 4)
    fn = fi_peer.prepare_mla_attention(q_latent, q_rope, cache, page_table=table, prefix_lens=lens, sm_scale=0.3,
                                       module=standin)
    for _ in range(2):
        assert _close(fn(), tree_attention_mla_reference(q_latent, q_rope, cache, table, lens, None, 0.3))
    (w,) = flashinfer_standin.BatchMLAPagedAttentionWrapper.instances
    assert len(w.plans) == 1 and w.runs == 2 and fn.backend == "standin"


def test_tree_mask_is_refused(standin):
    gen = torch.Generator().manual_seed(3)
    q_latent, q_rope, cache, table, lens = _inputs(gen, [4], 2)
    tree = torch.tensor([[1], [3]], dtype=torch.uint8)
    with pytest.raises(ValueError, match="no tree mask"):
        fi_peer.MLAChainAttention(module=standin).mla(q_latent, q_rope, cache, table, lens, tree, 0.1)


def test_available_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer -> ImportError
    ok, why = fi_peer.available()
    assert not ok and "flashinfer not importable" in why
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_standin.module("9.9"))
    assert fi_peer.available() == (True, "9.9")
