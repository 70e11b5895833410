"""Tensor parallelism of the verify forward: 2 ranks over gloo equal one rank, on the CPU."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specverify.forward.model import VerifyModel
from specverify.tree import BatchedDraftTree, DraftTree


def _inputs(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    tree = DraftTree([-1, 0, 0, 1, 2])
    bt = BatchedDraftTree.repeat(tree, 2)
    num_pages, page_size = 16, 4
    page_table = torch.randperm(num_pages, generator=g)[:12].view(2, 6).to(torch.int32)
    prefix = torch.tensor([5, 9], dtype=torch.int32)
    draft = torch.randint(0, model.config.vocab_size, (2, 5), generator=g)
    caches = model.allocate_kv(num_pages, page_size)
    # a prefix written through the model itself so every rank holds its own heads' KV
    for b in range(2):
        ids = torch.randint(0, model.config.vocab_size, (1, int(prefix[b])), generator=g)
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        model.forward(ids, pos, caches, page_table[b:b + 1], torch.zeros(1, dtype=torch.int32), None)
    return draft, bt, caches, page_table, prefix


def _logits(model):
    draft, bt, caches, page_table, prefix = _inputs(model)
    pos = prefix.long().unsqueeze(1) + bt.depth
    return model.forward(draft, pos, caches, page_table, prefix, bt.packed_mask)


def _worker(rank, world, port, name, q):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = VerifyModel(name, tp=world, rank=rank, group=dist.group.WORLD, dtype=torch.float64, seed=7)
        out = _logits(model)
        if rank == 0:  # by value: a tensor would travel as a shared-memory handle that dies with this process, and
            q.put(out.numpy())  # the parent reading it after the exit got "connection reset by peer" (CI, 2026-12-02)
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name", ["tiny-mla-moe", "tiny-gqa"])
def test_two_ranks_equal_one(name):
    expected = _logits(VerifyModel(name, dtype=torch.float64, seed=7))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, name, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = torch.from_numpy(q.get(timeout=600))  # two spawned interpreters import torch on a busy 2-core machine
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode} (None: still running after 120 s)"
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)
