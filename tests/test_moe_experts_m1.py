"""The weight-streaming experts for one or two tokens (``specverify.moe._VARIANT["experts"] = "stream"``).

CPU: the Triton interpreter on tiny shapes (10 experts, hidden 64, intermediate 32) with tiles small enough that
every loop runs several steps and every tile has a masked edge somewhere. GPU (``-m gpu``): Kimi-K2 per rank with
the default tiles, the shared expert, programmatic dependent launch on and off (off is the path of GPUs before
sm_90), CUDA-graph replay bit for bit.
"""
from __future__ import annotations

import pytest
import torch

import specverify.moe as moe_mod
from specverify.moe import append_shared_expert, fused_moe
from specverify.reference.moe import fused_moe_loop_reference, fused_moe_reference, random_expert_weights


def _tolerance(hidden, w13, w2, ids, w):
    """fp64 truth, and twice torch's own error in the inputs' dtype against it plus a floor."""
    want = fused_moe_loop_reference(hidden, w13, w2, ids, w)
    torch_err = (fused_moe_reference(hidden, w13, w2, ids, w, compute_dtype=hidden.dtype).double() - want)
    return want, 2 * torch_err.abs().max().item() + 1e-2 * want.abs().max().item() * 2 ** -8 + 1e-6


def check(hidden, w13, w2, ids, w, **kw):
    out = fused_moe(hidden, w13, w2, ids, w, impl="triton", **kw)
    want, tol = _tolerance(hidden, w13, w2, ids, w)
    err = (out.double() - want).abs().max().item()
    assert out.dtype == hidden.dtype and out.shape == hidden.shape
    assert not torch.isnan(out).any(), "an output element was left unwritten (NaN poison survived)"
    assert err <= tol, f"stream experts error {err:.3g} > tolerance {tol:.3g}"
    return out


def _align(ids, e, block=16):
    _, _, al = moe_mod._launch_route_align(None, None, ids.shape[1], False, 1, 1, False, 1.0, block, topk_ids=ids,
                                           num_experts=e)
    return al


@pytest.fixture(params=["fma", "splitk"])
def stream(monkeypatch, request):
    """The stream experts with interpreter-sized tiles, both gate/up kernels: FMA with R = 8 gate rows (I = 20 leaves
    a 4-row tail) and BK = 32 (H = 72 leaves an 8-column tail); split-K with 16-row MMA tiles (I = 20: a 4-row tail)
    over BK = 16 columns, H split 4-5 ways (64 programs wanted), so the ticket's last program sums several
    partials; down: BI = 16 (I = 20: two I steps, the second mostly masked), BH = 16 (H = 72: a ragged last tile)."""
    monkeypatch.setitem(moe_mod._VARIANT, "experts", "stream")
    monkeypatch.setattr(moe_mod, "_STREAM_OVERRIDE", {"R": 8, "BK": 32, "BI": 16, "BH": 16, "TILE": 1 << 14,
                                                      "gate_up": request.param, "SBN": 16, "SBK": 16,
                                                      "split_waves": 16})
    return moe_mod


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("h, inter", [(64, 32), (72, 20)])  # (72, 20): tails in H (BK, BH) and in I (R, BI)
def test_stream_experts(device, stream, poison, m, h, inter):
    # top-3 over 10 experts; a -1 slot with a nonzero weight adds nothing; result deterministic and written in place;
    # one gate/up unit per slot, no alignment needed (M = 2 passes one, which the stream path ignores)
    e = 10
    w13, w2 = random_expert_weights(e, h, inter, dtype=torch.bfloat16, device=device, seed=300 + h)
    g = torch.Generator().manual_seed(301 + m)
    hidden = torch.randn(m, h, generator=g).bfloat16().to(device)
    ids = torch.stack([torch.randperm(e, generator=g)[:3] for _ in range(m)]).to(torch.int32)
    ids[m - 1, 1] = -1
    w = torch.rand(m, 3, generator=g)
    w[m - 1, 1] = 0.7
    ids, w = ids.to(device), w.to(device)
    al = _align(ids, e) if m == 2 else None
    out = poison(hidden)
    a = check(hidden, w13, w2, ids, w, alignment=al, out=out)
    assert a.data_ptr() == out.data_ptr()
    b = fused_moe(hidden, w13, w2, ids, w, alignment=al, impl="triton")
    assert torch.equal(a, b), "stream experts must be deterministic"
    if stream._STREAM_OVERRIDE["gate_up"] == "splitk":  # the tickets reset themselves (graph replay needs it)
        assert not stream._SPLITK_WS[(hidden.device.type, hidden.device.index)][1].any()


def test_splitk_plan():
    # Kimi-K2 per rank at M = 1 with the shared expert: 9 slots x 8 row tiles of 32, 2 x 132 programs wanted:
    # H = 7168 in 4 splits of 14 chunks; M = 4 (288 tiles) needs no split; a split is at least one chunk
    assert moe_mod.splitk_plan(72, 7168, 128, 264) == (4, 1792)
    assert moe_mod.splitk_plan(288, 7168, 128, 264) == (1, 7168)
    assert moe_mod.splitk_plan(1, 256, 128, 1000) == (2, 128)


def test_stream_repeated_and_shared_expert(device, stream, poison):
    # M = 2 with the shared expert appended as expert 9 (both tokens), token 0 listing expert 1 twice and token 1 once:
    # expert 1 holds 3 slots (each its own gate/up unit); experts 3..8 get no token
    e, h, inter = 10, 64, 32
    w13, w2 = random_expert_weights(e, h, inter, dtype=torch.bfloat16, device=device, seed=310)
    g = torch.Generator().manual_seed(311)
    hidden = torch.randn(2, h, generator=g).bfloat16().to(device)
    ids, w = append_shared_expert(torch.tensor([[1, 1, 0], [2, 1, 0]], dtype=torch.int32).to(device),
                                  torch.rand(2, 3, generator=g).to(device), 9)
    for al in (_align(ids, e), None):
        out = poison(hidden)
        check(hidden, w13, w2, ids, w, alignment=al, out=out)


def test_stream_one_token_top8_plus_shared(device, stream, poison):
    # the Kimi-K2 slot layout at M = 1: top-8 + the shared expert = 9 slots in 16 down-kernel lanes; fp16 as well
    e, h, inter = 10, 64, 32
    for dtype in (torch.bfloat16, torch.float16):
        w13, w2 = random_expert_weights(e, h, inter, dtype=dtype, device=device, seed=320)
        g = torch.Generator().manual_seed(321)
        hidden = torch.randn(1, h, generator=g).to(dtype).to(device)
        ids, w = append_shared_expert(torch.randperm(9, generator=g)[:8].view(1, 8).to(torch.int32).to(device),
                                      torch.rand(1, 8, generator=g).to(device), 9)
        check(hidden, w13, w2, ids, w, alignment=_align(ids, e), out=poison(hidden))


def test_stream_above_max_m_falls_through(device, stream):
    # M = 3 > max_m = 2: the next path runs, and must still be right
    stream._STREAM_OVERRIDE["max_m"] = 2
    e, h, inter = 10, 64, 32
    w13, w2 = random_expert_weights(e, h, inter, dtype=torch.bfloat16, device=device, seed=330)
    g = torch.Generator().manual_seed(331)
    hidden = torch.randn(3, h, generator=g).bfloat16().to(device)
    ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(3)]).to(torch.int32).to(device)
    check(hidden, w13, w2, ids, torch.rand(3, 2, generator=g).to(device))


def test_stream_config_shapes(monkeypatch):
    # Kimi-K2 per rank (H 7168, I 256, top-8 + shared): the down tile stays within TILE by lowering BH as the slot
    # lanes grow; tiles are clamped to tiny shapes; the interpreter never asks for programmatic dependent launch
    base = dict(moe_mod._STREAM_CONFIG)
    c1 = moe_mod._stream_config(1, 7168, 256, 9, on_gpu=True)
    c2 = moe_mod._stream_config(2, 7168, 256, 9, on_gpu=True)
    assert (c1["SP"], c2["SP"]) == (16, 32)
    assert c1["SP"] * c1["BH"] * c1["BI"] <= base["TILE"] and c2["SP"] * c2["BH"] * c2["BI"] <= base["TILE"]
    assert c2["BH"] <= c1["BH"] and c1["PDL"] == base["PDL"]
    # quantised weights: the down tile of qBH rows within qTILE elements (8 rows at M = 1, top-8 routed only)
    q1 = moe_mod._stream_config(1, 7168, 256, 8, on_gpu=True, quant_format="int4")
    assert q1["BH"] == min(base["qBH"], base["qTILE"] // (q1["SP"] * q1["BI"])) and q1["TILE"] == base["qTILE"]
    assert q1["BH"] > moe_mod._stream_config(1, 7168, 256, 8, on_gpu=True)["BH"]
    monkeypatch.setitem(moe_mod._STREAM_OVERRIDE, "BH", 1)  # a sweep's explicit down tile wins for them too
    assert moe_mod._stream_config(1, 7168, 256, 8, on_gpu=True, quant_format="int4")["BH"] == 1
    # fp8 takes the pipelined gate/up loop from fp8_LS_min_m tokens; int4 and bf16 never by default
    fp8 = {m: moe_mod._stream_config(m, 7168, 256, 8, on_gpu=True, quant_format="fp8")["LS"] for m in (4, 6)}
    low = base["fp8_LS_min_m"] - 1
    assert fp8[4] == fp8[6] == base["fp8_LS"] > 1 and moe_mod._stream_config(low, 7168, 256, 8, True, "fp8")["LS"] == 0
    assert moe_mod._stream_config(4, 7168, 256, 8, True, "int4")["LS"] == moe_mod._stream_config(4, 7168, 256, 8,
                                                                                                 True)["LS"] == 0
    monkeypatch.setitem(moe_mod._STREAM_OVERRIDE, "LS", 0)
    assert moe_mod._stream_config(4, 7168, 256, 8, True, "fp8")["LS"] == 0
    tiny = moe_mod._stream_config(1, 24, 6, 3, on_gpu=False)
    assert tiny["BK"] == 32 and tiny["BI"] == 16 and tiny["R"] <= 8 and tiny["PDL"] is False


# --------------------------------------------------------------------------------------------- GPU, real sizes
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("shared", [True, False])
def test_stream_kimi_k2_gpu(m, shared, monkeypatch, graph_replay):
    # Kimi-K2 per rank (384 routed experts + the shared one as expert 384, H 7168, I 256, top-8): the default tiles
    # with and without programmatic dependent launch (off: GPUs before sm_90) within the derived tolerance, PDL on
    # and off bit-identical (same arithmetic), and replayed from a CUDA graph bit for bit after the inputs change in
    # place
    monkeypatch.setitem(moe_mod._VARIANT, "experts", "stream")
    e, h, inter = 385, 7168, 256
    w13, w2 = random_expert_weights(e, h, inter, dtype=torch.bfloat16, device="cuda", seed=340)
    g = torch.Generator().manual_seed(341 + m)
    hidden = torch.randn(m, h, generator=g).bfloat16().cuda()
    logits = torch.randn(m, e - 1, generator=g).cuda()

    def route():
        ids, w, al = moe_mod.moe_route(logits, top_k=8, block_size=16, routed_scaling_factor=2.827)
        if shared:  # the routed alignment does not hold the shared slots: realign (alignment-only launch)
            ids, w = append_shared_expert(ids, w, e - 1)
            al = _align(ids, e)
        return ids, w, al

    ids, w, al = route()
    want = fused_moe_reference(hidden, w13, w2, ids, w, compute_dtype=torch.float64)
    torch_err = (fused_moe_reference(hidden, w13, w2, ids, w, compute_dtype=torch.bfloat16).double() - want)
    tol = 2 * torch_err.abs().max().item() + 1e-6
    outs = []
    variants = ({}, {"PDL": False}, {"gate_up": "splitk"}, {"gate_up": "splitk", "PDL": False},
                {"gate_up": "fma"})
    for ov in variants:
        monkeypatch.setattr(moe_mod, "_STREAM_OVERRIDE", ov)
        outs.append(fused_moe(hidden, w13, w2, ids, w, alignment=al))
        assert (outs[-1].double() - want).abs().max().item() <= tol, ov
    assert torch.equal(outs[0], outs[1]), "programmatic dependent launch must not change the result"
    assert torch.equal(outs[2], outs[3]), "programmatic dependent launch must not change the split-K result"
    assert not moe_mod._SPLITK_WS[("cuda", hidden.device.index)][1].any(), "split-K tickets must reset"
    monkeypatch.setattr(moe_mod, "_STREAM_OVERRIDE", {})

    def step():
        i, ww, aa = route()
        return fused_moe(hidden, w13, w2, i, ww, alignment=aa)

    step()
    graph_replay(step, (logits, hidden))
