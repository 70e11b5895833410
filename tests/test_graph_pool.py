"""VerifyGraphPool: input checks and refusals on the CPU; capture/replay/padding/memory on a GPU."""
from __future__ import annotations

import pytest
import torch

from specverify.graph_pool import VerifyGraphPool, make_toy_verify

BUCKETS = [1, 2, 4, 8, 16, 32]
KS = [1, 2, 3, 4, 6, 8]


class FakeForward:
    """Row-wise forward that records how it was called (CPU, no graphs)."""

    def __init__(self):
        self.calls, self.made = [], []

    def make_inputs(self, bucket, k):
        self.made.append((bucket, k))
        return {"x": torch.full((bucket, k, 3), -7.0), "ids": torch.zeros(bucket, k, dtype=torch.int64)}

    def forward(self, inputs, k):
        self.calls.append(k)
        return {"y": inputs["x"] * 2 + inputs["ids"].unsqueeze(-1), "k": torch.tensor(k)}


def _cpu_pool(fake=None, **kw):
    fake = fake or FakeForward()
    kw = {"batch_buckets": [1, 4], "draft_lengths": [1, 3], "use_graphs": False, "device": "cpu", **kw}
    return VerifyGraphPool(fake.forward, fake.make_inputs, **kw), fake


# ------------------------------------------------------------------------------------------------------ CPU
def test_eager_path_pads_and_slices():
    pool, fake = _cpu_pool()
    x = torch.randn(3, 3, 3, generator=torch.Generator().manual_seed(0))
    ids = torch.arange(9).reshape(3, 3)
    out = pool.run({"x": x, "ids": ids}, k=3)
    assert out["y"].shape == (3, 3, 3) and out["k"].item() == 3  # 0-d output is not sliced
    torch.testing.assert_close(out["y"], x * 2 + ids.unsqueeze(-1), rtol=0, atol=0)
    static = pool.static_inputs(3, 3)
    assert (static["x"][3] == -7.0).all()  # padding row 3 of bucket 4 keeps the factory's values
    assert fake.made == [(4, 3)]  # made once, lazily, for the bucket that holds batch 3
    pool.run({"x": x[:1, :1], "ids": ids[:1, :1]}, k=1)
    assert fake.made == [(4, 3), (1, 1)]


def test_eager_capture_builds_every_key_largest_first():
    pool, fake = _cpu_pool(capture="eager")
    assert fake.made == [(4, 3), (4, 1), (1, 3), (1, 1)]  # by bucket * k, then bucket
    assert pool.captured() == fake.made


def test_refuses_unknown_k_listing_held_keys():
    pool, _ = _cpu_pool()
    with pytest.raises(ValueError, match=r"no graph for k = 2; it holds \(batch_bucket, k\) = \[\(1, 1\), \(1, 3\), "
                                         r"\(4, 1\), \(4, 3\)\]"):
        pool.run({"x": torch.zeros(1, 2, 3), "ids": torch.zeros(1, 2, dtype=torch.int64)}, k=2)


def test_refuses_batch_above_largest_bucket():
    pool, _ = _cpu_pool()
    with pytest.raises(ValueError, match="batch 5 exceeds the largest batch bucket 4"):
        pool.run({"x": torch.zeros(5, 3, 3), "ids": torch.zeros(5, 3, dtype=torch.int64)}, k=3)


@pytest.mark.parametrize("inputs, exc, match", [
    ({"x": torch.zeros(2, 3, 3)}, ValueError, "exactly the names"),
    ({"x": torch.zeros(2, 3, 3), "ids": torch.zeros(2, 3, dtype=torch.int64), "z": torch.zeros(2)}, ValueError,
     "exactly the names"),
    ({"x": torch.zeros(2, 3, 4), "ids": torch.zeros(2, 3, dtype=torch.int64)}, ValueError, r"shape \(batch, 3, 3\)"),
    ({"x": torch.zeros(2, 3, 3), "ids": torch.zeros(3, 3, dtype=torch.int64)}, ValueError, "same batch size"),
    ({"x": torch.zeros(2, 3, 3), "ids": torch.zeros(2, 3, dtype=torch.int32)}, TypeError, "must be torch.int64"),
    ({"x": torch.zeros(2, 3, 3), "ids": [[0]]}, TypeError, "must be a tensor"),
    ({"x": torch.zeros(()), "ids": torch.zeros(2, 3, dtype=torch.int64)}, ValueError, "0-d"),
    ({}, TypeError, "non-empty dict"),
])
def test_bad_inputs(inputs, exc, match):
    pool, _ = _cpu_pool()
    with pytest.raises(exc, match=match):
        pool.run(inputs, k=3)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(batch_buckets=[]), ValueError, "batch_buckets"),
    (dict(batch_buckets=[0, 2]), ValueError, "batch_buckets"),
    (dict(draft_lengths=[1.5]), ValueError, "draft_lengths"),
    (dict(capture="sometimes"), ValueError, "'lazy' or 'eager'"),
    (dict(warmup_iters=-1), ValueError, "warmup_iters"),
])
def test_bad_construction(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        _cpu_pool(**kwargs)


def test_not_callable_and_cpu_graphs_refused():
    fake = FakeForward()
    with pytest.raises(TypeError, match="forward must be callable"):
        VerifyGraphPool(None, fake.make_inputs, batch_buckets=[1], draft_lengths=[1], use_graphs=False,
                        device="cpu")
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        VerifyGraphPool(fake.forward, fake.make_inputs, batch_buckets=[1], draft_lengths=[1], device="cpu")


def test_bad_static_buffers_and_timing_without_graphs():
    pool = VerifyGraphPool(lambda i, k: i["x"], lambda b, k: {"x": torch.zeros(b + 1, k)}, batch_buckets=[2],
                           draft_lengths=[1], use_graphs=False, device="cpu")
    with pytest.raises(ValueError, match="leading dimension 2"):
        pool.run({"x": torch.zeros(2, 1)}, k=1)
    with pytest.raises(ValueError, match="use_graphs=False"):
        pool.time_replay(1, 1)


def test_invalidate_drops_buffers():
    pool, fake = _cpu_pool(capture="eager")
    pool.invalidate()
    assert pool.captured() == [] and pool.report() == []
    pool.rebuild()  # eager: everything again
    assert len(pool.captured()) == 4 and len(fake.made) == 8


def test_toy_forward_cpu_accepts_matching_drafts():
    fwd, make = make_toy_verify(hidden=16, vocab=64, layers=1, prefix=4, device="cpu", dtype=torch.float32)
    make(2, 4)
    ids = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(1))
    out = fwd({"input_ids": ids}, 4)
    # feed the target's own greedy picks as drafts: every draft must then be accepted (causal mask)
    chained = ids.clone()
    for i in range(1, 4):
        chained[:, i] = fwd({"input_ids": chained}, 4)["tokens"][:, i - 1]
    assert fwd({"input_ids": chained}, 4)["accept_length"].tolist() == [3, 3]
    assert out["accept_length"].shape == (2,)


# ------------------------------------------------------------------------------------------------------ GPU
def _toy(**kw):
    torch.manual_seed(0)
    return make_toy_verify(device="cuda", **kw)


def _ids(gen, b, k, vocab):
    return torch.randint(0, vocab, (b, k), device="cuda", generator=gen)


@pytest.mark.gpu
def test_replay_equals_eager_bit_for_bit_every_key():
    vocab = 4096
    fwd, make = _toy(hidden=256, vocab=vocab)
    pool = VerifyGraphPool(fwd, make, batch_buckets=BUCKETS, draft_lengths=KS, capture="eager")
    gen = torch.Generator(device="cuda").manual_seed(0)
    keys = pool.keys()
    for round_keys in (keys, keys[::-1]):  # second round: inputs changed in place, other graphs replayed between
        for b, k in round_keys:
            ids = _ids(gen, b, k, vocab)
            got = {n: t.clone() for n, t in pool.run({"input_ids": ids}, k).items()}
            want = fwd({"input_ids": ids.clone()}, k)
            for name in want:
                assert torch.equal(got[name], want[name]), f"{name} differs at (batch {b}, k {k})"


@pytest.mark.gpu
def test_padding_rows_never_change_real_rows():
    vocab = 4096
    fwd, make = _toy(hidden=256, vocab=vocab)
    pool = VerifyGraphPool(fwd, make, batch_buckets=[4, 16], draft_lengths=[3, 8])
    gen = torch.Generator(device="cuda").manual_seed(1)
    # batch 3 in bucket 4 (one pad row), batch 9 in bucket 16 (seven pad rows)
    for batch, k in [(3, 3), (9, 8), (3, 8)]:
        ids = _ids(gen, batch, k, vocab)
        bucket = pool.bucket_of(batch)
        static = pool.static_inputs(batch, k)["input_ids"]
        static[batch:] = _ids(gen, bucket - batch, k, vocab)
        first = {n: t.clone() for n, t in pool.run({"input_ids": ids}, k).items()}
        full_first = pool.replay(batch, k)["logit_max"][batch:].clone()
        static[batch:] = _ids(gen, bucket - batch, k, vocab)  # different padding, same real rows
        second = pool.run({"input_ids": ids}, k)
        full_second = pool.replay(batch, k)["logit_max"][batch:]
        assert not torch.equal(full_first, full_second)  # the padding really changed what the pad rows compute
        for name in first:
            assert first[name].shape[0] == batch
            assert torch.equal(first[name], second[name]), f"{name}: padding changed real rows at {batch, k}"


@pytest.mark.gpu
def test_pool_memory_close_to_largest_graph():
    # sized so the largest graph (32 x 8 rows) needs tens of MiB: logits alone are 256 x 32768 x (2 + 4) bytes
    fwd, make = _toy(hidden=1024, vocab=32768, prefix=256)
    pool = VerifyGraphPool(fwd, make, batch_buckets=BUCKETS, draft_lengths=KS, capture="eager")
    records = pool.report()
    assert (records[0]["batch_bucket"], records[0]["k"]) == (32, 8)
    largest = pool.largest_graph_bytes()
    assert largest == records[0]["pool_growth_bytes"] and largest > 32 * 2 ** 20
    assert pool.pool_bytes() <= 1.2 * largest, f"pool {pool.pool_bytes()} B vs largest graph {largest} B"
    for r in records:
        assert r["capture_ms"] > 0
        if hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph"):
            assert isinstance(r["node_count"], int) and r["node_count"] > 0


@pytest.mark.gpu
def test_rebuild_after_weights_move_and_timing():
    vocab = 1024
    fwd, make = _toy(hidden=128, vocab=vocab)
    pool = VerifyGraphPool(fwd, make, batch_buckets=[1, 8], draft_lengths=[1, 4], capture="eager")
    pool.rebuild()
    assert len(pool.captured()) == 4
    ids = _ids(torch.Generator(device="cuda").manual_seed(2), 8, 4, vocab)
    got = pool.run({"input_ids": ids}, 4)["logit_max"].clone()
    assert torch.equal(got, fwd({"input_ids": ids}, 4)["logit_max"])
    t = pool.time_replay(8, 4, iters=20)
    assert t["host_us"] > 0 and t["gpu_us"] > 0 and t["launch_bound"] == (t["host_us"] > t["gpu_us"])


def _verify_model_forward():
    """The verify forward (kimi-k2 per-rank shapes, 2 layers) through the pool protocol of its adapter."""
    from specverify.configs import get_config
    from specverify.forward.model import build_verify_model

    model = build_verify_model(get_config("kimi-k2"), tp=8, num_layers=2, device="cuda", dtype=torch.bfloat16)
    return model.verify, model.make_inputs


@pytest.mark.gpu
def test_verify_model_replay_equals_eager():
    fwd, make = _verify_model_forward()
    pool = VerifyGraphPool(fwd, make, batch_buckets=[1, 4], draft_lengths=[1, 4], capture="eager")
    for b, k in pool.keys():
        static = pool.static_inputs(b, k)
        inputs = {n: t.clone() for n, t in static.items()}
        got = pool.run(inputs, k)
        got = {n: t.clone() for n, t in got.items()} if isinstance(got, dict) else got.clone()
        want = fwd({n: t.clone() for n, t in inputs.items()}, k)
        if isinstance(want, dict):
            for n in want:
                assert torch.equal(got[n], want[n]), f"{n} differs at (batch {b}, k {k})"
        else:
            assert torch.equal(got, want)


# ------------------------------------------------------------------------------------------- padded graph rows
def _padded_replay(device, use_graphs, padding):
    """Capture at bucket 8, run 8 requests with ~4000-token prefixes, then 3 requests with ~10-token prefixes
    whose page-table rows are other requests' (5, 6, 7). Returns (KV caches before the second run, after it, the
    three live rows' page table and prefixes, the pool's outputs, an eager run's outputs, the adapter)."""
    from specverify.configs import get_config
    from specverify.forward.model import build_verify_model

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    ad = build_verify_model(get_config("tiny-mla-moe"), tp=1, num_layers=2, device=device, dtype=dtype,
                            provider="reference" if device == "cpu" else "specverify", max_batch=8, max_k=4,
                            context=4000, page_size=16, seed=3)
    pool = VerifyGraphPool(ad.verify, ad.make_inputs, batch_buckets=[8], draft_lengths=[4], use_graphs=use_graphs,
                           device=device, padding=ad.padding if padding else None)
    gen = torch.Generator().manual_seed(11)
    vocab = ad.model.config.vocab_size
    full = {"draft": torch.randint(0, vocab, (8, 4), generator=gen).to(device),
            "prefix": torch.randint(3990, 4001, (8,), generator=gen).int().to(device),
            "page_table": ad.page_table.clone()}
    pool.run(full, 4)
    before = [c.clone() for layer in ad.caches for c in layer]
    live = {"draft": torch.randint(0, vocab, (3, 4), generator=gen).to(device),
            "prefix": torch.randint(8, 13, (3,), generator=gen).int().to(device),
            "page_table": ad.page_table[5:8].clone()}
    got = {n: t.clone() for n, t in pool.run(live, 4).items()}
    after = [c.clone() for layer in ad.caches for c in layer]
    want = ad.verify({n: t.clone() for n, t in live.items()}, 4)
    return before, after, live, got, want, ad


def _changed_outside_live(before, after, live, scratch_page, k=4):
    """Number of KV elements that changed outside the live requests' draft slots and the scratch page."""
    allowed = torch.zeros(before[0].shape[:2], dtype=torch.bool)
    ps = before[0].shape[1]
    for b in range(live["prefix"].shape[0]):
        for pos in range(int(live["prefix"][b]), int(live["prefix"][b]) + k):
            allowed[int(live["page_table"][b, pos // ps]), pos % ps] = True
    allowed[scratch_page] = True
    changed = 0
    for x, y in zip(before, after):
        diff = (x != y).reshape(x.shape[0], x.shape[1], -1).any(-1).cpu()
        changed += int((diff & ~allowed).sum())
    return changed


@pytest.mark.parametrize("padding", [True, False])
def test_padded_rows_write_only_the_scratch_page_cpu(padding):
    before, after, live, got, want, ad = _padded_replay("cpu", False, padding)
    changed = _changed_outside_live(before, after, live, ad.scratch_page)
    if padding:
        assert changed == 0, f"{changed} KV slots outside the live requests and the scratch page changed"
        for name in want:
            assert torch.equal(got[name], want[name]), f"{name} of the live rows differs from the eager run"
    else:  # the hazard the padding removes: stale rows write into other requests' slots
        assert changed > 0


def test_padding_refuses_unknown_names_and_values():
    fake = FakeForward()
    with pytest.raises(ValueError, match="padding.*must be an int or float"):
        VerifyGraphPool(fake.forward, fake.make_inputs, batch_buckets=[2], draft_lengths=[1], use_graphs=False,
                        device="cpu", padding={"x": "zero"})
    pool = VerifyGraphPool(fake.forward, fake.make_inputs, batch_buckets=[2], draft_lengths=[1], use_graphs=False,
                           device="cpu", padding={"nope": 0})
    with pytest.raises(ValueError, match=r"padding names \['nope'\]"):
        pool.run({"x": torch.zeros(1, 1, 3), "ids": torch.zeros(1, 1, dtype=torch.int64)}, 1)


def test_padding_fills_only_padded_rows():
    fake = FakeForward()
    pool = VerifyGraphPool(fake.forward, fake.make_inputs, batch_buckets=[4], draft_lengths=[2], use_graphs=False,
                           device="cpu", padding={"ids": 5})
    x = torch.randn(4, 2, 3)
    pool.run({"x": x, "ids": torch.ones(4, 2, dtype=torch.int64)}, 2)
    pool.run({"x": x[:1], "ids": torch.full((1, 2), 2, dtype=torch.int64)}, 2)
    static = pool.static_inputs(4, 2)
    assert torch.equal(static["ids"][0], torch.full((2,), 2)) and bool((static["ids"][1:] == 5).all())
    assert torch.equal(static["x"][1:], x[1:]), "inputs without a padding value keep what they held"


@pytest.mark.gpu
def test_padded_rows_write_only_the_scratch_page_gpu():
    before, after, live, got, want, ad = _padded_replay("cuda", True, True)
    assert _changed_outside_live(before, after, live, ad.scratch_page) == 0
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} of the live rows differs from the eager run"
