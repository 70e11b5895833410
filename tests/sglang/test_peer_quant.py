"""The ``sglang`` peer's quantised experts (``specverify.peers.sglang.prepare_fused_experts(..., quant=...)``):
SGLang's Triton fused MoE on int4 (W4A16, ``fused_moe_kernel_gptq_awq``) and block-fp8 (W8A8) weights in
:class:`specverify.moe.MoEQuant`'s layouts, against fp64 torch references.

SGLang's kernels run under the Triton interpreter on CPU (fp16 activations: the interpreter's bf16 ``tl.dot`` is
broken here). Tolerances: twice what torch errs computing the same thing in fp16 against the fp64 truth, plus the
floor of the unquantised peer test. int4's truth is the fp64 MoE over the dequantised weights. Block fp8 also rounds
both GEMMs' activations to fp8 per token and group of ``block_shape[1]`` columns (scale ``max|x| / 448``; W8A8): one
fp8 step of one activation moves the output more than fp16 rounding does, so each GEMM is checked on the fp8
activation it was actually given.

The interpreter's fp32 -> fp8 conversion (``triton/runtime/interpreter.py : _convert_float``) is not a GPU's
round-to-nearest-even: it rounds ties away from zero, and a round-up across a power of two may keep the exponent (126.8
becomes 64, not 128). So the W8A8 GEMMs are checked with the activations quantised by a torch copy of SGLang's
quantiser (``quantise_like_sglang``), SGLang's own Triton quantiser is checked against that copy away from those
two artifacts, and its two call paths (inside ``invoke_fused_moe_kernel`` or in the wrapper) must agree exactly.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang is not installed: run in the venv made by .ci/sglang_env.sh")

pytestmark = pytest.mark.sglang

# CPU tensors under the interpreter; on a GPU machine run this file with TRITON_INTERPRET=1.
interpreter = pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU-tensor interpreter check: set TRITON_INTERPRET=1 to run it here")

import standins  # noqa: E402  (tests/sglang is on sys.path: conftest.py)

standins.transformers_sees_no_torchvision()

from specverify.moe import MoEQuant  # noqa: E402
from specverify.peers import sglang as peer  # noqa: E402
from specverify.reference.moe import fused_moe_reference, route_reference  # noqa: E402
from specverify.reference.quant import FP8_MAX, quantize_fp8_block, quantize_int4  # noqa: E402


def _experts():
    st = peer._load()
    for piece in ("experts", "align"):
        if st["mods"].get(piece) is None:
            pytest.skip(f"SGLang piece {piece} does not import here: {st['why'].get(piece) or st['why'].get('sglang')}")
    return st["mods"]["experts"]


def _case(seed, m, e, top_k, h, inter):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(m, h, generator=gen) * 0.5).half()
    w13 = torch.randn(e, 2 * inter, h, generator=gen) / h ** 0.5
    w2 = torch.randn(e, h, inter, generator=gen) / inter ** 0.5
    ids, w = route_reference(torch.randn(m, e, generator=gen), top_k, "sigmoid", routed_scaling_factor=1.5)
    return hidden, w13, w2, ids, w


def quantise_like_sglang(x, group_size):
    """SGLang's per-token-group fp8 quantisation (``fp8_kernel._per_token_group_quant_8bit``) in torch: per row and
    group, ``s = max(max|x|, 1e-10) / 448`` and ``q = fp8(clamp(x * (1 / s), -448, 448))``, all in fp32.
    Returns (q float8_e4m3fn [R, C], s fp32 [R, C / group_size])."""
    r, c = x.shape
    g = x.float().reshape(r, c // group_size, group_size)
    s = g.abs().amax(-1, keepdim=True).clamp_min(1e-10) / FP8_MAX
    q = (g * (1.0 / s)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(r, c).contiguous(), s.reshape(r, c // group_size).contiguous()


def _fake_quant(x, group_size):
    """fp64 values of :func:`quantise_like_sglang`'s result."""
    q, s = quantise_like_sglang(x, group_size)
    return (q.double().view(x.shape[0], -1, group_size) * s.double().unsqueeze(-1)).view(x.shape)


def _slots(ids):
    """(slot, token, expert) for every routed slot, slot = token * top_k + j (SGLang's row of its caches)."""
    top_k = ids.shape[1]
    return [(t * top_k + j, t, int(ids[t, j])) for t in range(ids.shape[0]) for j in range(top_k)]


def gate_up_act_reference(hidden, d13, ids, group_size, dtype=torch.float64):
    """``silu(gate) * up`` of each slot [M * top_k, I] from the fp8-rounded hidden states, computed in ``dtype``
    (fp64: the truth; fp16: torch's own error). Returns fp64."""
    inter = d13.shape[1] // 2
    xq = _fake_quant(hidden, group_size).to(dtype)
    out = torch.empty(hidden.shape[0] * ids.shape[1], inter, dtype=torch.float64)
    for s, t, e in _slots(ids):
        gu = d13[e].to(dtype) @ xq[t]
        out[s] = (torch.nn.functional.silu(gu[:inter]) * gu[inter:]).double()
    return out


def down_reference(act_q, d2, ids, w, dtype=torch.float64):
    """``sum_j w[t, j] * W2[e] @ act_q[slot]`` [M, H] in ``dtype`` (act_q: the fp8-rounded activation). fp64."""
    out = torch.zeros(ids.shape[0], d2.shape[1], dtype=dtype)
    for s, t, e in _slots(ids):
        out[t] += (d2[e].to(dtype) @ act_q[s].to(dtype)) * w[t, s % ids.shape[1]].to(dtype)
    return out.double()


def _check(out, truth, torch_out, what):
    err = (out.double() - truth).abs().max().item()
    torch_err = (torch_out.double() - truth).abs().max().item()
    tol = 2 * torch_err + 2e-3 * truth.abs().max().item()
    assert torch.isfinite(out).all(), what
    assert err <= tol, f"{what}: error {err:.3g} > tolerance {tol:.3g} (torch's own fp16 error {torch_err:.3g})"


# ------------------------------------------------------------------------------------------------ int4

# (M, E, top_k, group, H, I): top-1 writes the expert output directly (M <= E: SGLang's small-M default config);
# top-3 with 7 experts (prime, some left empty) goes through its sum-reduce kernel with group 128 (two groups in
# w13's reduced dimension, one in w2's); M = 6 > E = 4 takes SGLang's other default config (BLOCK_SIZE_M 64).
@pytest.mark.parametrize("m, e, top_k, group, h, inter", [(2, 4, 1, 32, 128, 64), (5, 7, 3, 128, 256, 128),
                                                          (6, 4, 2, 32, 128, 64)])
@interpreter
def test_int4_experts_match_reference(m, e, top_k, group, h, inter):
    _experts()
    hidden, w13, w2, ids, w = _case(200 + m, m, e, top_k, h, inter)
    p13, s13 = quantize_int4(w13, group)
    p2, s2 = quantize_int4(w2, group)
    q = MoEQuant("int4", s13.to(torch.bfloat16), s2.to(torch.bfloat16), group_size=group)
    fn = peer.prepare_fused_experts(hidden, p13, p2, w, ids, quant=q)
    out = fn()
    assert out.shape == (m, h) and out.dtype == torch.float16
    assert fn.act_quant is None and any(n.startswith("int4 backend") for n in fn.not_sglang)
    d13, d2 = q.dequantize(p13, p2, torch.float64)
    truth = fused_moe_reference(hidden.double(), d13, d2, ids, w.double())
    # the kernel rounds each dequantised weight to hidden's dtype before the dot, as this does
    torch16 = fused_moe_reference(hidden, d13.half(), d2.half(), ids, w, compute_dtype=torch.float16)
    _check(out, truth, torch16, "int4")


@interpreter
def test_int4_reads_the_low_nibble_first():
    # one expert whose codes differ between the two nibbles of every byte: swapped nibbles would change the output
    _experts()
    m, e, h, inter = 1, 2, 128, 64
    hidden, w13, w2, ids, w = _case(7, m, e, 1, h, inter)
    p13, s13 = quantize_int4(w13, 32)
    p2, s2 = quantize_int4(w2, 32)
    q = MoEQuant("int4", s13, s2, group_size=32)
    out = peer.fused_experts(hidden, p13, p2, w, ids, quant=q)
    swapped = ((p13 >> 4) | (p13 << 4)).to(torch.uint8), ((p2 >> 4) | (p2 << 4)).to(torch.uint8)
    d13, d2 = q.dequantize(p13, p2, torch.float64)
    s13_, s2_ = q.dequantize(*swapped, torch.float64)
    truth = fused_moe_reference(hidden.double(), d13, d2, ids, w.double())
    wrong = fused_moe_reference(hidden.double(), s13_, s2_, ids, w.double())
    err = (out.double() - truth).abs().max().item()
    assert err < 0.1 * (wrong - truth).abs().max().item()


# ------------------------------------------------------------------------------------------------ block fp8

# (M, E, top_k, block_shape, H, I): DeepSeek-V3 / Kimi-K2's (128, 128) blocks at the smallest shapes that hold two
# of them along H and along 2I (top-3: SGLang's sum-reduce); (32, 64) blocks make several blocks in every dimension
# and a BLOCK_SIZE_N (= bn, SGLang's default config) smaller than the 64-row token block; top-1 writes directly.
FP8_CASES = [(3, 5, 3, (128, 128), 256, 128), (4, 6, 2, (32, 64), 128, 64), (2, 3, 1, (32, 64), 192, 64)]


def _fp8(m, e, top_k, block, h, inter):
    hidden, w13, w2, ids, w = _case(300 + m, m, e, top_k, h, inter)
    p13, s13 = quantize_fp8_block(w13, block)
    p2, s2 = quantize_fp8_block(w2, block)
    return hidden, p13, p2, MoEQuant("fp8", s13, s2, block_shape=block), ids, w


@pytest.mark.parametrize("m, e, top_k, block, h, inter", FP8_CASES)
@interpreter
def test_fp8_experts_match_reference_gemm_by_gemm(m, e, top_k, block, h, inter, monkeypatch):
    ex = _experts()
    hidden, p13, p2, q, ids, w = _fp8(m, e, top_k, block, h, inter)
    # "triton" mode: the wrapper quantises each GEMM's activations. Handing it torch's copy of SGLang's quantiser
    # keeps the interpreter's fp8 rounding bug out and shows the activation SGLang's gate/up GEMM and SiLU-and-mul
    # made, so each GEMM is checked on its own input (one fp8 step of one activation moves the output more than
    # fp16 rounding does, so a chained reference would compare roundings, not kernels).
    seen = []

    def quantise(x, group_size):
        seen.append(x.clone())
        return quantise_like_sglang(x, group_size)

    monkeypatch.setattr(ex, "group_quant_triton", quantise)
    fn = peer.prepare_fused_experts(hidden, p13, p2, w, ids, quant=q, act_quant="triton")
    out = fn()
    assert out.shape == (m, h) and out.dtype == torch.float16 and fn.act_quant == "triton"
    assert len(seen) == 2 and torch.equal(seen[0], hidden)
    act = seen[1]
    assert act.shape == (m * top_k, inter) and act.dtype == torch.float16
    d13, d2 = q.dequantize(p13, p2, torch.float64)
    g = block[1]
    _check(act, gate_up_act_reference(hidden, d13, ids, g), gate_up_act_reference(hidden, d13, ids, g, torch.half),
           f"fp8 {block} gate/up + SiLU-and-mul")
    act_q = _fake_quant(act, g)
    _check(out, down_reference(act_q, d2, ids, w), down_reference(act_q, d2, ids, w, torch.half),
           f"fp8 {block} down + expert sum")


@pytest.mark.parametrize("m, e, top_k, block, h, inter", FP8_CASES[1:])
@interpreter
def test_fp8_activation_quantisation_in_or_before_the_kernel_agree(m, e, top_k, block, h, inter):
    # off CUDA invoke_fused_moe_kernel quantises with the same Triton kernel the wrapper calls in "triton" mode
    ex = _experts()
    assert not ex.sees_cuda  # the interpreter machines: SGLang takes its non-CUDA path
    hidden, p13, p2, q, ids, w = _fp8(m, e, top_k, block, h, inter)
    auto = peer.prepare_fused_experts(hidden, p13, p2, w, ids, quant=q)
    assert auto.act_quant == "sglang" and auto.not_sglang == []
    wrapper = peer.prepare_fused_experts(hidden, p13, p2, w, ids, quant=q, act_quant="triton")
    assert torch.equal(auto(), wrapper())


def _interpreter_rounding(v, q_torch, q_kernel):
    """Codes the interpreter's fp8 conversion rounds differently from round-to-nearest-even (``v``: the fp32 value
    converted): a round-up across a power of two that kept the exponent (half the value), or a tie rounded away from
    zero."""
    qt, qk = q_torch.float(), q_kernel.float()
    carry = ((q_torch.view(torch.uint8) & 0x7) == 0) & (qk * 2 == qt)
    tie = ((qt + qk) / 2 == v) & (qk.abs() > qt.abs())
    return carry | tie


@interpreter
def test_sglang_group_quant_matches_torch_copy():
    ex = _experts()
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(6, 256, generator=gen).half() * torch.logspace(-3, 2, 6).half()[:, None]  # rows of 5 decades
    x[2, 64:128] = 0  # an all-zero group: the 1e-10 floor of its scale
    q, s = ex.group_quant_triton(x, 64)
    q_ref, s_ref = quantise_like_sglang(x, 64)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and tuple(s.shape) == (6, 4)
    assert torch.equal(s, s_ref)
    v = (x.float().view(6, 4, 64) * (1.0 / s_ref).unsqueeze(-1)).view(6, 256)  # the kernel's fp32 x * (1 / s)
    bad = (q.view(torch.uint8) != q_ref.view(torch.uint8)) & ~_interpreter_rounding(v, q_ref, q)
    assert not bad.any(), f"{int(bad.sum())} codes differ beyond the interpreter's rounding artifacts"


# ------------------------------------------------------------------------------------------------ bad inputs

def test_quant_inputs_are_checked():
    hidden, w13, w2, ids, w = _case(1, 2, 3, 1, 128, 64)
    p13, s13 = quantize_fp8_block(w13, (32, 64))
    p2, s2 = quantize_fp8_block(w2, (32, 64))
    q = MoEQuant("fp8", s13, s2, block_shape=(32, 64))
    with pytest.raises(ValueError, match="act_quant"):
        peer.prepare_fused_experts(hidden, p13, p2, w, ids, quant=q, act_quant="cuda")
    with pytest.raises(TypeError, match="float8_e4m3fn"):  # fused_moe's own checks run first
        peer.prepare_fused_experts(hidden, w13.half(), w2.half(), w, ids, quant=q)
    # H = 96: two 64-column weight blocks (the last one partial), but not whole 64-column activation groups
    hidden96, w13, w2, ids, w = _case(1, 2, 3, 1, 96, 64)
    p13, s13 = quantize_fp8_block(w13, (32, 64))
    p2, s2 = quantize_fp8_block(w2, (32, 64))
    with pytest.raises(ValueError, match="multiples of it"):
        peer.prepare_fused_experts(hidden96, p13, p2, w, ids, quant=MoEQuant("fp8", s13, s2, block_shape=(32, 64)))
