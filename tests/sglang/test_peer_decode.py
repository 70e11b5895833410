"""The ``sglang`` provider runs what SGLang runs for each mode: its decode kernel at k = 1, its extend kernel with the
full custom mask (rebuilt every forward) for k > 1, and a table that says when a piece SGLang runs is missing.

SGLang's kernels run under the Triton interpreter on CPU tensors, fp32 (the interpreter's bf16 ``tl.dot`` is broken
here). Attention outputs are held to twice torch's own fp32 error against an fp64 reference plus a floor, as in
``test_peer_ops.py``; every output buffer the kernels write (the output and the split-KV scratch) is NaN-filled right
before each call, so a value the kernel does not write cannot pass.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang is not installed: run in the venv made by .ci/sglang_env.sh")

pytestmark = pytest.mark.sglang

interpreter = pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU-tensor interpreter check: set TRITON_INTERPRET=1 to run it here")


import standins  # noqa: E402  (tests/sglang is on sys.path: conftest.py)

standins.transformers_sees_no_torchvision()

from specverify.peers import sglang as peer  # noqa: E402
from specverify.reference.attention import tree_attention_mla_reference, tree_attention_reference  # noqa: E402

PAGE = 4
NAN = float("nan")


def _piece(name):
    st = peer._load()
    if st["mods"].get(name) is None:
        pytest.skip(f"SGLang piece {name} does not import here: {st['why'].get(name) or st['why'].get('sglang')}")


def _paged_case(gen, prefix, width, pages_per_row, num_pages):
    """A NaN-poisoned paged cache where only the slots of positions 0 .. prefix_b (the token's own) hold values."""
    batch = len(prefix)
    perm = torch.randperm(num_pages, generator=gen)[: batch * pages_per_row]
    page_table = perm.view(batch, pages_per_row).to(torch.int32)
    prefix_lens = torch.tensor(prefix, dtype=torch.int32)
    cache = torch.full((num_pages, PAGE) + width, NAN, dtype=torch.float32)
    flat = cache.view(num_pages * PAGE, *width)
    for b in range(batch):
        for t in range(prefix[b] + 1):
            slot = int(page_table[b, t // PAGE]) * PAGE + t % PAGE
            flat[slot] = torch.randn(width, generator=gen, dtype=torch.float32)
    return cache, page_table, prefix_lens


def _tol(ref64, torch_out):
    """2x torch's own fp32 error against fp64, plus a floor."""
    torch_err = (torch_out.double() - ref64).abs().max().item()
    return 2 * torch_err + 1e-5 * max(1.0, ref64.abs().max().item())


class _Counter:
    """Wraps one SGLang entry point of a piece's namespace: counts calls and NaN-fills the buffers it writes."""

    def __init__(self, monkeypatch, piece, name, poison=()):
        self.ns = peer._load()["mods"][piece]
        self.real = getattr(self.ns, name)
        self.calls = 0
        self.poison = poison
        monkeypatch.setattr(self.ns, name, self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        for i in self.poison:
            args[i].fill_(NAN)
        return self.real(*args, **kwargs)


class _LaunchCounter:
    """Counts launches of a ``@triton.jit`` kernel called as ``kernel[grid](...)``."""

    def __init__(self, monkeypatch, piece, name):
        ns = peer._load()["mods"][piece]
        self.real = getattr(ns, name)
        self.calls = 0
        monkeypatch.setattr(ns, name, self)

    def __getitem__(self, grid):
        launch = self.real[grid]

        def run(*args, **kwargs):
            self.calls += 1
            return launch(*args, **kwargs)

        return run


# decode_attention_fwd(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, attn_logits, attn_lse, ...): o, attn_logits
# and attn_lse are written by the kernel
_DECODE_OUTPUTS = (3, 6, 7)

# (pages of 4 tokens, 16 a row) prefix 0: the token attends only to itself; 8: the token opens a new page; 11: it
# closes one; 45 with 8 splits: kv_len_per_split rounds up to 32, so the 46 positions spread over two splits that
# stage 2 merges; 63: the token takes the row's last slot; 2: a short request beside a long one (uneven batch).
_PREFIXES = [[0, 8], [11, 45], [63, 2]]


# core_count 0: SGLang's static split count (no device core count, as on a CPU); 132 (an H200's SMs): the split
# heuristic get_num_kv_splits_triton runs every forward
@pytest.mark.parametrize("prefix", _PREFIXES)
@pytest.mark.parametrize("hq, hkv", [(4, 2), (2, 2)])  # grouped (GQA) and per-head (MHA) variants of the kernel
@pytest.mark.parametrize("core_count", [0, 132])
@interpreter
def test_decode_attention_gqa_matches_reference(monkeypatch, prefix, hq, hkv, core_count):
    _piece("decode")
    dec = _Counter(monkeypatch, "decode", "decode_attention_fwd", poison=_DECODE_OUTPUTS)
    ext = _Counter(monkeypatch, "attention", "extend_attention_fwd")
    gen = torch.Generator().manual_seed(sum(prefix) + hq + core_count)
    d = 16
    kc, pt, pl = _paged_case(gen, prefix, (hkv, d), pages_per_row=16, num_pages=40)
    vc = kc.clone()
    vflat = vc.view(-1, hkv, d)
    finite = ~torch.isnan(vflat[:, 0, 0])
    vflat[finite] = torch.randn(int(finite.sum()), hkv, d, generator=gen)
    q = torch.randn(len(prefix), 1, hq, d, generator=gen)
    fn = peer.prepare_decode_attention("gqa", q, kc, vc, page_table=pt, prefix_lens=pl, sm_scale=0.25,
                                       core_count=core_count)
    out = fn()
    assert dec.calls == 1 and ext.calls == 0
    ref64 = tree_attention_reference(q.double(), kc.double(), vc.double(), pt, pl, None, 0.25)
    ref32 = tree_attention_reference(q, kc, vc, pt, pl, None, 0.25)
    assert out.shape == (len(prefix), 1, hq, d) and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    err = (out.double() - ref64).abs().max().item()
    assert err <= _tol(ref64, ref32), err
    splits = fn.plan.num_kv_splits
    assert int(splits.min()) >= 1 and int(splits.max()) <= fn.plan.max_kv_splits == 8


# (R, Dr) = (256, 32): SGLang's MLA variant of the kernel (has_mla, V read back from the K tile; it exists for 576 and
# 288 wide latents only); (32, 16): a width it has no MLA variant for, run as one-KV-head grouped decode
@pytest.mark.parametrize("prefix", _PREFIXES)
@pytest.mark.parametrize("r, dr", [(256, 32), (32, 16)])
@interpreter
def test_decode_attention_mla_matches_reference(monkeypatch, prefix, r, dr):
    _piece("decode")
    dec = _Counter(monkeypatch, "decode", "decode_attention_fwd", poison=_DECODE_OUTPUTS)
    gen = torch.Generator().manual_seed(3 * sum(prefix) + r)
    h = 3  # not a power of two
    kv, pt, pl = _paged_case(gen, prefix, (r + dr,), pages_per_row=16, num_pages=40)
    ql = torch.randn(len(prefix), 1, h, r, generator=gen)
    qr = torch.randn(len(prefix), 1, h, dr, generator=gen)
    fn = peer.prepare_decode_attention("mla", ql, qr, kv, page_table=pt, prefix_lens=pl, sm_scale=0.2,
                                       core_count=132)
    out = fn()
    assert dec.calls == 1
    assert peer._mla_layout(r + dr, r) == (r == 256)
    ref64 = tree_attention_mla_reference(ql.double(), qr.double(), kv.double(), pt, pl, None, 0.2)
    ref32 = tree_attention_mla_reference(ql, qr, kv, pt, pl, None, 0.2)
    assert out.shape == (len(prefix), 1, h, r)
    assert torch.isfinite(out).all()
    err = (out.double() - ref64).abs().max().item()
    assert err <= _tol(ref64, ref32), err


def test_decode_split_cap_follows_sglang():
    # TritonAttnBackend: 8 splits; MLA raises it to min(next_pow2(SMs), next_pow2(cdiv(context, 32)))
    assert peer.decode_max_kv_splits(False, 132, 131072) == 8
    assert peer.decode_max_kv_splits(True, 132, 131072) == 256  # Kimi-K2 / DeepSeek-V3 on an H200
    assert peer.decode_max_kv_splits(True, 132, 4160) == 256  # verify-wall's default context, 4096 + 8 in pages
    assert peer.decode_max_kv_splits(True, 132, 1000) == 32
    assert peer.decode_max_kv_splits(True, 0, 131072) == 8  # no core count: SGLang's static count


@interpreter
def test_decode_rejects_more_than_one_token():
    _piece("decode")
    q = torch.zeros(1, 3, 2, 16)
    kc = torch.zeros(4, PAGE, 1, 16)
    pt = torch.zeros(1, 2, dtype=torch.int32)
    pl = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="k = 3"):
        peer.prepare_decode_attention("gqa", q, kc, kc, page_table=pt, prefix_lens=pl, sm_scale=1.0)


# ------------------------------------------------------------------------------------------------ the op table

def _forward_inputs(model, gen, prefix, k):
    caches = model.allocate_kv(16, PAGE)
    page_table = torch.randperm(16, generator=gen).view(2, 8).to(torch.int32)
    prefix_lens = torch.tensor(prefix, dtype=torch.int32)
    ids = torch.randint(0, model.config.vocab_size, (2, k), generator=gen)
    return caches, page_table, prefix_lens, ids


# node 0 root; 1, 2 children of 0; 3 child of 1 (the tree of test_peer_ops' forward test)
_TREE4 = torch.tensor([[1], [3], [5], [11]], dtype=torch.uint8)
_TREE4_DEPTH = torch.tensor([[0, 1, 1, 2]] * 2)


@pytest.mark.parametrize("name", ["tiny-mla-moe", "tiny-gqa-moe"])
@interpreter
def test_sglang_ops_decode_at_k1_extend_above(monkeypatch, name):
    _piece("experts")
    _piece("decode")
    from specverify.forward.model import VerifyModel
    from specverify.forward.ops import Ops, sglang_ops

    dec = _Counter(monkeypatch, "decode", "decode_attention_fwd", poison=_DECODE_OUTPUTS)
    ext = _Counter(monkeypatch, "attention", "extend_attention_fwd", poison=(3,))  # o_extend
    splits = _LaunchCounter(monkeypatch, "decode", "get_num_kv_splits_triton")
    gen = torch.Generator().manual_seed(17)
    model = VerifyModel(name, dtype=torch.float16, num_layers=2)
    ops, note = sglang_ops(model)
    assert "incomplete" not in ops.pieces, ops.pieces
    assert "decode_attention_fwd at k = 1" in note and "extend_attention_fwd for k > 1" in note
    ops.attention_mla.__self__.core_count = 132  # an H200's SM count: SGLang's split heuristic runs (a kernel)
    for k, mask, depth in ((1, None, torch.zeros(2, 1, dtype=torch.long)), (4, _TREE4, _TREE4_DEPTH),
                           (4, None, torch.arange(4).repeat(2, 1))):
        caches, pt, pl, ids = _forward_inputs(model, gen, [9, 20], k)
        for prefix in ([9, 20], [13, 2]):  # the second pass changes prefix_lens in place: metadata must follow
            pl.copy_(torch.tensor(prefix, dtype=torch.int32))
            pos = pl.long().unsqueeze(1) + depth
            model.ops = Ops()
            ref = model.forward(ids, pos, caches, pt, pl, mask).double()
            before = (dec.calls, ext.calls, splits.calls)
            model.ops = ops
            out = model.forward(ids, pos, caches, pt, pl, mask).double()
            layers = model.num_layers
            if k == 1:
                assert (dec.calls - before[0], ext.calls - before[1]) == (layers, 0)
                assert splits.calls - before[2] == 1  # once per forward, not per layer
            else:
                assert (dec.calls - before[0], ext.calls - before[1]) == (0, layers)
                assert splits.calls == before[2]
            # fp16 end to end through two layers: a few fp16 ulps of the logits' scale
            assert (out - ref).abs().max().item() <= 4e-3 * max(1.0, ref.abs().max().item()), (k, prefix)


def _expected_mask(prefix, k, tree, size):
    """SGLang's FULL_MASK buffer after one step: request b's [k, prefix_b + k] rows back to back, prefix columns
    true, draft columns the tree; everything past the last request true (the whole-buffer memset)."""
    out = torch.ones(size, dtype=torch.uint8)
    at = 0
    for b, p in enumerate(prefix):
        t = tree[b] if tree.dim() == 3 else tree
        for i in range(k):
            for j in range(k):
                out[at + i * (p + k) + p + j] = int(t[i, j])
        at += k * (p + k)
    return out


@pytest.mark.parametrize("mask", ["tree", "chain"])
@interpreter
def test_custom_mask_is_rebuilt_every_forward(monkeypatch, mask):
    _piece("experts")
    from specverify.forward.model import VerifyModel
    from specverify.forward.ops import sglang_ops

    gen = torch.Generator().manual_seed(29)
    model = VerifyModel("tiny-mla-moe", dtype=torch.float16, num_layers=2)
    model.ops, _ = sglang_ops(model)
    attn = model.ops.attention_mla.__self__
    k = 4
    caches, pt, pl, ids = _forward_inputs(model, gen, [9, 20], k)
    tree_mask = _TREE4 if mask == "tree" else None
    depth = _TREE4_DEPTH if mask == "tree" else torch.arange(4).repeat(2, 1)
    tree = peer._unpack_tree(_TREE4, k) if mask == "tree" else torch.tril(torch.ones(k, k, dtype=torch.bool))
    model.forward(ids, pl.long().unsqueeze(1) + depth, caches, pt, pl, tree_mask)
    (plan,) = attn.plans.values()
    assert plan.custom_mask.dtype == torch.uint8 and plan.custom_mask.numel() == 2 * k * (plan.L + k)
    refreshes = []
    real_refresh = plan.refresh
    monkeypatch.setattr(plan, "refresh", lambda *a, **kw: (refreshes.append(1), real_refresh(*a, **kw))[1])
    for prefix in ([9, 20], [13, 2], [0, 27]):
        plan.custom_mask.fill_(7)  # poison: a step that does not rebuild the mask leaves 7s
        pl.copy_(torch.tensor(prefix, dtype=torch.int32))
        model.forward(ids, pl.long().unsqueeze(1) + depth, caches, pt, pl, tree_mask)
        expected = _expected_mask(prefix, k, tree, plan.custom_mask.numel())
        assert torch.equal(plan.custom_mask, expected), prefix
        rowlen = torch.tensor(prefix) + k
        assert torch.equal(plan.mask_indptr, torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(k * rowlen, 0)]))
    assert len(refreshes) == 3  # once per forward (the first layer's), not once per layer


# ------------------------------------------------------------------------------------------------ missing pieces

def _without(monkeypatch, piece, why):
    st = peer._load()
    monkeypatch.setitem(st["mods"], piece, None)
    monkeypatch.setitem(st["why"], piece, why)


@pytest.mark.parametrize("piece, label", [("experts", "experts (SGLang's Triton fused MoE)"),
                                          ("router", "routing (moe_fused_gate)"),
                                          ("align", "experts (SGLang's Triton fused MoE)"),
                                          ("decode", "decode attention (k = 1)")])
def test_missing_piece_marks_the_table_incomplete(monkeypatch, piece, label):
    _piece("attention")
    from specverify.forward.model import VerifyModel
    from specverify.forward.ops import sglang_ops

    _without(monkeypatch, piece, "ModuleNotFoundError: No module named 'tvm_ffi'")
    ops, note = sglang_ops(VerifyModel("tiny-mla-moe", dtype=torch.float16, num_layers=1))
    assert ops.pieces["incomplete"].startswith(label + ": ") and "tvm_ffi" in ops.pieces["incomplete"]
    assert "MISSING" in note and "tvm_ffi" in note
    assert "acceptance" in note and "kv compaction" in note  # ours by design, still named


def test_dense_model_needs_no_moe_pieces(monkeypatch):
    _piece("attention")
    from specverify.forward.model import VerifyModel
    from specverify.forward.ops import sglang_ops

    _without(monkeypatch, "experts", "ModuleNotFoundError: No module named 'tvm_ffi'")
    _without(monkeypatch, "router", "ModuleNotFoundError: No module named 'tvm_ffi'")
    ops, note = sglang_ops(VerifyModel("tiny-gqa", dtype=torch.float16, num_layers=1))
    assert "incomplete" not in ops.pieces and "MISSING" not in note


@interpreter
def test_verify_wall_refuses_a_total_for_an_incomplete_provider(monkeypatch):
    _piece("attention")
    from specverify.verify_wall import WallSettings, format_table, run_verify_wall

    _without(monkeypatch, "experts", "ModuleNotFoundError: No module named 'tvm_ffi'")
    s = WallSettings(model="tiny-mla-moe", tp=1, context=16, draft_tokens=[2], layers=None, impl=["sglang"],
                     graph=False, warmup=0, iters=1, page_size=4)
    result = run_verify_wall(s)
    assert not [r for r in result["rows"] if r["provider"] == "sglang"]
    notes = [n for n in result["meta"]["notes"] if n.startswith("sglang: not SGLang's whole pass")]
    assert len(notes) == 1 and "experts (SGLang's Triton fused MoE): ModuleNotFoundError" in notes[0]
    assert notes[0].endswith("no total (provider skipped)")
    assert "not SGLang's whole pass" in format_table(result)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-mla-moe", "tiny-gqa-moe"])
@pytest.mark.parametrize("k", [1, 4])
def test_sglang_ops_capture_and_replay_each_mode(name, k):
    """Eager -> capture -> replay -> change the prefix lengths in place -> replay: the decode plan's split counts
    and the verify plan's mask are rebuilt inside the graph."""
    from specverify.forward.model import VerifyModel
    from specverify.forward.ops import Ops, sglang_ops

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(31)
    model = VerifyModel(name, dtype=torch.bfloat16, num_layers=2, device=dev)
    caches = model.allocate_kv(16, PAGE)
    pt = torch.randperm(16, generator=gen).view(2, 8).to(torch.int32).to(dev)
    pl = torch.tensor([9, 20], dtype=torch.int32, device=dev)
    ids = torch.randint(0, model.config.vocab_size, (2, k), generator=gen).to(dev)
    mask = None if k == 1 else _TREE4.to(dev)
    depth = (torch.zeros(2, 1, dtype=torch.long) if k == 1 else _TREE4_DEPTH).to(dev)
    pos = pl.long().unsqueeze(1) + depth
    model.ops, _ = sglang_ops(model)
    eager = model.forward(ids, pos, caches, pt, pl, mask)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        model.forward(ids, pos, caches, pt, pl, mask)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured = model.forward(ids, pos, caches, pt, pl, mask)
    graph.replay()
    torch.testing.assert_close(captured, eager, rtol=0, atol=0)
    pl.copy_(torch.tensor([13, 2], dtype=torch.int32, device=dev))
    pos.copy_(pl.long().unsqueeze(1) + depth)
    graph.replay()
    ops = model.ops
    model.ops = Ops()
    ref = model.forward(ids, pos, caches, pt, pl, mask)
    assert (captured.float() - ref.float()).abs().max().item() <= 3e-2 * max(1.0, ref.abs().max().item())
    plans = list(ops.attention_mla.__self__.plans.values())
    assert len(plans) == 1 and (k == 1) == isinstance(plans[0], peer._DecodePlan)


# ------------------------------------------------------------------------------------------------ flashinfer attention

@interpreter
def test_sglang_flashinfer_table_runs_flashinfer_for_chains(monkeypatch):
    """``sglang-flashinfer``: SGLang's pass with FlashInfer's MLA wrapper as attention (a CPU stand-in computing
    FlashInfer's semantics from the planned metadata); the forward matches the reference at k = 1 (decode planning)
    and k = 4 (causal verify planning), trees are refused, GQA models are marked incomplete."""
    _piece("experts")
    import flashinfer_standin  # tests/ is on sys.path (its conftest.py)
    from specverify.forward.model import VerifyModel
    from specverify.forward.ops import Ops, provider_ops

    monkeypatch.setitem(__import__("sys").modules, "flashinfer", flashinfer_standin.module())
    flashinfer_standin.BatchMLAPagedAttentionWrapper.instances.clear()
    gen = torch.Generator().manual_seed(23)
    model = VerifyModel("tiny-mla-moe", dtype=torch.float16, num_layers=2)
    ops, note = provider_ops("sglang-flashinfer", model)
    assert "incomplete" not in ops.pieces and ops.pieces["attention"].startswith("flashinfer")
    assert "BatchMLAPagedAttentionWrapper" in note and "moe_fused_gate" in note
    for k in (1, 4):
        caches, pt, pl, ids = _forward_inputs(model, gen, [9, 20], k)
        pos = pl.long().unsqueeze(1) + torch.arange(k)
        model.ops = Ops()
        ref = model.forward(ids, pos, caches, pt, pl).double()
        model.ops = ops
        runs = sum(w.runs for w in flashinfer_standin.BatchMLAPagedAttentionWrapper.instances)
        out = model.forward(ids, pos, caches, pt, pl).double()
        assert sum(w.runs for w in flashinfer_standin.BatchMLAPagedAttentionWrapper.instances) - runs == 2
        assert (out - ref).abs().max().item() <= 4e-3 * max(1.0, ref.abs().max().item()), k
        with pytest.raises(ValueError, match="no tree mask"):
            model.forward(ids, pos, caches, pt, pl, _TREE4)
    gqa_ops, gqa_note = provider_ops("sglang-flashinfer", VerifyModel("tiny-gqa-moe", dtype=torch.float16,
                                                                       num_layers=1))
    assert "not wired" in gqa_ops.pieces["incomplete"] and "MISSING" in gqa_note
