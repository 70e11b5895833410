"""Bad inputs to verify_greedy / verify_sampling / compact_kv raise with expected, got and the fix."""
from __future__ import annotations

import pytest
import torch

from specverify.accept import verify_greedy, verify_sampling
from specverify.kv_cache import compact_kv
from specverify.tree import BatchedDraftTree, DraftTree

TREES = BatchedDraftTree.repeat(DraftTree.chain(3), 2)
DRAFT = torch.zeros(2, 3, dtype=torch.int64)
LOGITS = torch.zeros(2, 3, 10)


def test_greedy_needs_exactly_one_source():
    with pytest.raises(ValueError, match="exactly one of logits"):
        verify_greedy(DRAFT, TREES)
    with pytest.raises(ValueError, match="got both"):
        verify_greedy(DRAFT, TREES, logits=LOGITS, target_ids=DRAFT)


def test_bad_dtypes_and_shapes():
    with pytest.raises(TypeError, match="draft_tokens must be int32 or int64"):
        verify_greedy(DRAFT.float(), TREES, target_ids=DRAFT)
    with pytest.raises(ValueError, match=r"logits must have shape \[batch, k, vocab\] = \[2, 3, vocab\]"):
        verify_greedy(DRAFT, TREES, logits=torch.zeros(2, 4, 10))
    with pytest.raises(TypeError, match="logits must be float32"):
        verify_sampling(LOGITS.long(), TREES, DRAFT)
    with pytest.raises(ValueError, match=r"tree must describe \[batch, k\] = \[2, 3\]"):
        verify_greedy(DRAFT, BatchedDraftTree.repeat(DraftTree.chain(3), 3), target_ids=DRAFT)
    with pytest.raises(ValueError, match=r"parents must have shape \[batch, k\]"):
        verify_greedy(DRAFT, torch.zeros(2, 4, dtype=torch.int64), target_ids=DRAFT)


def test_bad_sampling_params():
    with pytest.raises(ValueError, match=r"top_p must be a scalar or a tensor of shape \[batch\] = \[2\]"):
        verify_sampling(LOGITS, TREES, DRAFT, top_p=torch.ones(3), impl="reference")
    with pytest.raises(TypeError, match="top_k must be an int32/int64 tensor"):
        verify_sampling(LOGITS, TREES, DRAFT, top_k=torch.ones(2), impl="reference")
    with pytest.raises(ValueError, match=r"uniform_samples must have shape \[batch, L\] = \[2, 3\]"):
        verify_sampling(LOGITS, TREES, DRAFT, uniform_samples=torch.zeros(2, 2), impl="reference")
    with pytest.raises(ValueError, match="impl must be one of"):
        verify_sampling(LOGITS, TREES, DRAFT, impl="cuda-fast")


def test_bad_out_buffer():
    bad = (torch.empty(2, 3, dtype=torch.int32), torch.empty(2, dtype=torch.int64), torch.empty(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="out accepted_tokens must be a contiguous int64"):
        verify_greedy(DRAFT, TREES, target_ids=DRAFT, out=bad, impl="reference")


def test_compact_kv_errors():
    pt = torch.zeros(2, 4, dtype=torch.int64)
    pre = torch.zeros(2, dtype=torch.int64)
    nodes = torch.zeros(2, 3, dtype=torch.int64)
    ln = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="same page_size"):
        compact_kv([torch.zeros(4, 2, 8), torch.zeros(4, 1, 8)], pt, pre, nodes, ln)
    with pytest.raises(ValueError, match="contiguous row dims"):
        compact_kv([torch.zeros(4, 2, 8, 4).transpose(2, 3)], pt, pre, nodes, ln)
    with pytest.raises(TypeError, match="prefix_lens must be int32 or int64"):
        compact_kv([torch.zeros(4, 2, 8)], pt, pre.float(), nodes, ln)
    with pytest.raises(ValueError, match=r"accept_len must have shape \[batch\] = \[2\]"):
        compact_kv([torch.zeros(4, 2, 8)], pt, pre, nodes, ln[:1])


def test_triton_on_cpu_without_interpreter_names_the_op(monkeypatch):
    # CPU tensors, impl='triton', interpreter off: each op says which call refused, why, and what to do
    import specverify.accept as acc

    monkeypatch.setattr(acc.envvars, "triton_interpret", lambda: False)
    calls = {
        "verify_greedy": lambda: verify_greedy(DRAFT, TREES, target_ids=DRAFT, impl="triton"),
        "verify_sampling": lambda: verify_sampling(LOGITS, TREES, DRAFT, impl="triton"),
        "compact_kv": lambda: compact_kv([torch.zeros(4, 1, 1)], torch.arange(4).view(1, 4), torch.tensor([0]),
                                         torch.tensor([[0, 1]]), torch.tensor([1]), impl="triton"),
    }
    for op, call in calls.items():
        with pytest.raises(ValueError, match=rf"specverify\.{op}: impl='triton' needs CUDA tensors or "
                                             r"TRITON_INTERPRET=1 .* use impl='auto'/'reference'"):
            call()
