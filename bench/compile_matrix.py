"""Offline compile matrix: every Triton and Gluon kernel of specverify, compiled for sm_90a and sm_120 with no GPU.

What it does: runs the package's real launchers (``tree_attention_mla``, ``tree_attention``, ``moe_route``,
``fused_moe``, ``verify_greedy``, ``verify_sampling``, the fused ops, ``compact_kv``) on *fake* CUDA tensors
(``torch._subclasses.FakeTensorMode``: shapes, strides and dtypes, no memory) with ``torch.cuda`` answering as the
target GPU (capability, SM count), and records each ``kernel[grid](...)`` launch instead of running it. So the
tile configs, warp counts and constexprs are the ones the launchers choose on that GPU for these shapes: nothing is
copied from the launchers. Each distinct launch is then compiled with ``triton.compile(ASTSource(...),
target=GPUTarget("cuda", cc, 32))`` and its cubin read with the ``cuobjdump`` Triton ships
(``triton/backends/nvidia/bin``) and ptxas's ``-v`` report (Triton prints it with ``dump_ptxas_log``):
registers, spill stores (bytes per thread), the stack frame (local arrays, e.g. the slow path of ``sin``/``cos``'s
range reduction: reported, not a failure) and the shared memory Triton reserves (``metadata.shared``).

Shapes (Kimi-K2 at tp 8 per rank unless named): MLA 8 and 16 heads, kv_lora_rank 512 + rope 64, k 1, 2, 4, 8, 16,
batch 1 / 4k (latency) and batch 64 / 4k (bandwidth), on the ``tl.dot`` kernel and as the plan's default picks
(the capability gate, ``specverify.attention.mla_wgmma_support``: its answer per target goes into the JSON's
``gate``); the Gluon wgmma MLA kernel (sm_90a only, skipped where this Triton lacks its Gluon API);
GQA Llama 8:1 d 128 (8 q heads, 1 kv head per rank) at k 1, 4, 16; router 384 experts top-8 (sigmoid, bias) at
M 1, 8, 64 with and without alignment, and at M 1 writing the shared expert's slot (id 384); MoE 384 experts h 7168
inter 256 top-8 at M 1, 8, 64 (stream and aligned paths, the launcher decides), and with int4 (group 32; in rows
and in row quads) and fp8 (128 x 128 blocks) experts at M 1, 4, 8, 64; acceptance (greedy and sampling,
vocab 163840, k 4 and 16, batch 1 and 64); fused ops (rmsnorm h 7168 with/without residual, MLA kv prep, GQA
prep, silu_mul, absorb-q, up-v); KV compaction.

Fails (exit 1) on a compile error, a spill (ptxas spill stores > 0) or shared memory over the target's per-block
opt-in limit (sm_90: 232448 B; sm_120: 101376 B), except on targets named by ``--allow-fail`` (reported, exit 0).

Usage: ``python bench/compile_matrix.py [--targets sm_90a,sm_120] [--only attn,moe,...] [--allow-fail sm_120]
[--json PATH] [--quick] [--kernel NAME]``. ``--quick``: one or two shapes per group; ``--kernel``: compile only
kernels whose name contains NAME. Prints progress to stderr and a table on stdout.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field

import torch

#: target name -> (compute capability, per-block shared memory limit in bytes (opt-in maximum), SM count the fake
#: device reports (H200: 132; RTX PRO 6000 Blackwell: 188), device name)
TARGETS = {
    "sm_90a": (90, 232448, 132, "NVIDIA H200 (fake, offline)"),
    "sm_120": (120, 101376, 188, "NVIDIA RTX PRO 6000 Blackwell (fake, offline)"),
}
GROUPS = ("attn", "gqa", "route", "moe", "block", "accept", "fused", "kv", "gemv")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ launch capture

#: Spills accepted on one Triton release because the spilling config measured faster there than the spill-free one
#: (kernel, "major.minor") -> why; the row is reported, not failed.
KNOWN_SPILLS = {
    ("_accept_select_kernel", "3.6"): "8 warps spill on Triton 3.6 yet measured faster than the spill-free 16 (H200, "
                                      "bench/sweep_accept.py --quick, 2026-12-02: 18.98 against 19.74 us at vocab "
                                      "163840, 17.21 against 18.59 at 32000, batch 1, k 4)",
}


def _triton_minor() -> str:
    import triton

    return ".".join(triton.__version__.split(".")[:2])

@dataclass
class Launch:
    fn: object            # the JITFunction (or GluonJITFunction)
    grid: tuple
    args: tuple
    kw: dict
    scenario: str = ""
    group: str = ""


@dataclass
class Row:
    kernel: str
    config: str
    target: str
    scenarios: list = field(default_factory=list)
    regs: int | None = None
    smem_bytes: int | None = None
    spill_bytes: int | None = None
    stack_bytes: int | None = None
    status: str = "ok"
    note: str = ""
    compile_s: float = 0.0


class _Props(types.SimpleNamespace):
    pass


@contextlib.contextmanager
def fake_cuda(target: str, sink: list):
    """Fake CUDA tensors, ``torch.cuda`` answering as ``target``, kernel launches recorded into ``sink``."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from triton.runtime.jit import JITFunction, KernelInterface

    from specverify import fit, moe_layer

    cc, smem, sms, name = TARGETS[target]
    major, minor = cc // 10, cc % 10
    props = _Props(name=name, major=major, minor=minor, multi_processor_count=sms, total_memory=96 << 30,
                   shared_memory_per_block_optin=smem, shared_memory_per_multiprocessor=smem + 1024,
                   warp_size=32, L2_cache_size=60 << 20)
    patches = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "get_device_capability": lambda *a, **k: (major, minor),
        "get_device_properties": lambda *a, **k: props,
        "get_device_name": lambda *a, **k: name,
        "is_current_stream_capturing": lambda: False,
        "synchronize": lambda *a, **k: None,
    }
    saved = {n: getattr(torch.cuda, n) for n in patches}
    saved_getitem = KernelInterface.__getitem__
    saved_warmup = JITFunction.warmup

    def getitem(self, grid):
        return lambda *args, **kw: sink.append(Launch(self, grid, args, kw))

    def warmup(self, *args, grid=None, **kw):
        """``specverify.fit`` compiles candidates to read their shared memory: compile them for ``target``."""
        res = compile_cached(self, args, kw, target)
        if res.get("error"):
            raise RuntimeError(res["error"])
        return types.SimpleNamespace(metadata=types.SimpleNamespace(shared=res["smem"]), n_regs=res["regs"],
                                     n_spills=res["spill"])

    for n, f in patches.items():
        setattr(torch.cuda, n, f)
    KernelInterface.__getitem__ = getitem
    JITFunction.warmup = warmup
    FakeTensor.__getitem__, FakeTensor.__setitem__ = _fake_getitem, _fake_setitem
    caches = _package_caches()  # per-device answers cached inside the package: another target's must not leak
    for c in caches:
        c.cache_clear()
    fit._CHOSEN.clear()
    moe_layer._CHOSEN.clear()
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            yield
    finally:
        KernelInterface.__getitem__ = saved_getitem
        JITFunction.warmup = saved_warmup
        del FakeTensor.__getitem__, FakeTensor.__setitem__
        for n, f in saved.items():
            setattr(torch.cuda, n, f)
        for c in caches:
            c.cache_clear()
        fit._CHOSEN.clear()
        moe_layer._CHOSEN.clear()


def _basic_index(t, idx):
    """``t[idx]`` for ints, slices, None and Ellipsis through select / slice / unsqueeze: Python indexing of a
    fake CUDA tensor takes a CUDA device guard, which a CPU-only torch does not have."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    if any(i is Ellipsis for i in idx):
        e = idx.index(Ellipsis)
        real = sum(1 for i in idx if i is not None and i is not Ellipsis)
        idx = idx[:e] + (slice(None),) * (t.dim() - real) + idx[e + 1:]
    out, dim = t, 0
    for i in idx:
        if i is None:
            out, dim = out.unsqueeze(dim), dim + 1
        elif isinstance(i, bool) or not isinstance(i, (int, slice)):
            raise TypeError(f"compile_matrix: fake-tensor index {i!r} is not supported (ints, slices, None, ...)")
        elif isinstance(i, int):
            out = out.select(dim, i)
        else:
            start, stop, step = i.indices(out.shape[dim])
            out, dim = torch.ops.aten.slice.Tensor(out, dim, start, max(start, stop), step), dim + 1
    return out


def _fake_getitem(self, idx):
    return _basic_index(self, idx)


def _fake_setitem(self, idx, value):
    view = _basic_index(self, idx)
    if isinstance(value, torch.Tensor):
        view.copy_(value)
    else:
        view.fill_(value)


def _package_caches():
    import specverify.attention as att
    import specverify.fit as fit
    import specverify.moe as moe
    import specverify.moe_layer as moe_layer

    out = []
    for mod in (att, fit, moe, moe_layer):
        for v in vars(mod).values():
            if callable(getattr(v, "cache_clear", None)) and getattr(v, "__module__", "") == mod.__name__:
                out.append(v)
    return out


# ------------------------------------------------------------------------------------------------ scenarios
def _cuda(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="cuda")


def _paged(batch: int, ctx: int, k: int, ps: int = 64):
    pages = math.ceil(ctx / ps)
    table = _cuda(batch, pages, dtype=torch.int32)
    prefix = _cuda(batch, dtype=torch.int32)
    return pages, table, prefix


def _mask(k: int):
    from specverify.tree import DraftTree

    if k <= 1:
        return None
    m = DraftTree.topk_of_size(2, k).packed_mask()  # real CPU tensor: only its shape and dtype travel
    return _cuda(*m.shape, dtype=m.dtype)


@contextlib.contextmanager
def _env(name: str, value: str):
    """``os.environ[name] = value`` for the block (the package reads its knobs live)."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def scen_attn(quick: bool, target: str):
    """MLA tree attention as ``tree_attention_mla`` plans and launches it (Kimi-K2 per rank): the ``tl.dot`` kernel
    (``SPECVERIFY_MLA_WGMMA=0``: on sm_90 it serves where the Gluon kernel is off), the plan's own choice (the
    capability gate: the Gluon kernel on sm_90a where it compiles), and the Gluon wgmma kernel asked for explicitly
    (sm_90a; skipped only where this Triton lacks its Gluon API)."""
    import specverify.attention as att

    def mla(batch, ctx, k, heads, config=None):
        pages, table, prefix = _paged(batch, ctx, k)
        plan = att.plan_tree_attention_mla(max_batch=batch, num_draft_tokens=k, num_heads=heads, max_context=ctx,
                                           device="cuda", config=config)
        ql, qr = _cuda(batch, k, heads, 512), _cuda(batch, k, heads, 64)
        kv = _cuda(batch * pages, 64, 576)
        att.tree_attention_mla(ql, qr, kv, page_table=table, prefix_lens=prefix, tree_mask=_mask(k), sm_scale=0.1,
                               plan=plan, validate=False, impl="triton")

    shapes = [(1, 4096, 4, 8), (64, 4096, 4, 8)] if quick else \
        [(b, 4096, k, h) for h in (8, 16) for k in (1, 2, 4, 8, 16) for b in (1, 64)]
    for batch, ctx, k, heads in shapes:
        def run(batch=batch, ctx=ctx, k=k, heads=heads):
            with _env("SPECVERIFY_MLA_WGMMA", "0"):
                mla(batch, ctx, k, heads)
        yield f"mla h{heads} b{batch} c{ctx} k{k}", run
    for batch, k in ((1, 4), (64, 4)):  # the default plan: whichever kernel the gate picks (rows merge with it)
        yield f"mla-auto h8 b{batch} c4096 k{k}", lambda batch=batch, k=k: mla(batch, 4096, k, 8)
    if target == "sm_90a":
        for batch, k in ([(1, 4)] if quick else [(1, 1), (1, 4), (64, 4), (1, 16)]):
            def run_wg(batch=batch, k=k):
                wg = att._wgmma_kernels()
                if not wg.AVAILABLE:
                    raise _Skip(wg.UNAVAILABLE_REASON)
                mla(batch, 4096, k, 8, config=dict(wg.MLA_WGMMA_DEFAULT))
            yield f"mla-wgmma h8 b{batch} c4096 k{k}", run_wg


def gate(target: str) -> dict:
    """What the MLA capability gate (``specverify.attention.mla_wgmma_support``) answers on the fake ``target``
    GPU: its probe compile goes through the patched ``warmup``, so it compiles for ``target``."""
    import specverify.attention as att

    with fake_cuda(target, []):
        ok, reason = att.mla_wgmma_support("cuda")
    return dict(mla_wgmma=ok, reason=reason)


def scen_gqa(quick: bool, target: str):
    """GQA tree attention (Llama 8:1 per rank: 8 q heads, 1 kv head, d 128)."""
    import specverify.attention as att

    shapes = [(8, 32768, 4)] if quick else [(b, c, k) for k in (1, 4, 16) for b, c in ((1, 4096), (8, 32768))]
    for batch, ctx, k in shapes:
        def run(batch=batch, ctx=ctx, k=k):
            pages, table, prefix = _paged(batch, ctx, k)
            plan = att.plan_tree_attention(max_batch=batch, num_draft_tokens=k, num_q_heads=8, num_kv_heads=1,
                                           head_dim=128, max_context=ctx, device="cuda")
            q = _cuda(batch, k, 8, 128)
            kc = _cuda(batch * pages, 64, 1, 128)
            att.tree_attention(q, kc, kc, page_table=table, prefix_lens=prefix, tree_mask=_mask(k), sm_scale=0.1,
                               plan=plan, validate=False, impl="triton")
        yield f"gqa 8:1 d128 b{batch} c{ctx} k{k}", run


def scen_route(quick: bool, target: str):
    """Kimi-K2 router: 384 experts, top-8, sigmoid + correction bias, scale 2.827; with and without alignment."""
    import specverify.moe as moe

    for m in ((1, 64) if quick else (1, 8, 64)):
        for bs in (None, 16):
            def run(m=m, bs=bs):
                logits = _cuda(m, 384, dtype=torch.float32)
                bias = _cuda(384, dtype=torch.float32)
                moe.moe_route(logits, top_k=8, scoring="sigmoid", correction_bias=bias,
                              routed_scaling_factor=2.827, block_size=bs, impl="triton")
            yield f"route e384 top8 M{m} bs{bs}", run

    def run_route_shared():  # the router writing the shared expert's slot (expert 384): ids / weights [1, 9]
        logits = _cuda(1, 384, dtype=torch.float32)
        bias = _cuda(384, dtype=torch.float32)
        moe.moe_route(logits, top_k=8, scoring="sigmoid", correction_bias=bias, routed_scaling_factor=2.827,
                      shared_expert_id=384, impl="triton")
    yield "route e384 top8 M1 +shared384", run_route_shared

    def run_shared():
        ids, w = _cuda(8, 8, dtype=torch.int32), _cuda(8, 8, dtype=torch.float32)
        moe.append_shared_expert(ids, w, 384, impl="triton")
    yield "append_shared M8 top8", run_shared


def scen_moe(quick: bool, target: str):
    """Kimi-K2 routed experts per rank: 384 experts, h 7168, inter 256, top-8 (the launcher picks the path)."""
    import specverify.moe as moe

    for m in ((1, 64) if quick else (1, 8, 64)):
        def run(m=m):
            e, h, inter, top = 384, 7168, 256, 8
            hidden = _cuda(m, h)
            w13, w2 = _cuda(e, 2 * inter, h), _cuda(e, h, inter)
            ids, w = _cuda(m, top, dtype=torch.int32), _cuda(m, top, dtype=torch.float32)
            moe.fused_moe(hidden, w13, w2, ids, w, impl="triton")
        yield f"moe e384 h7168 i256 top8 M{m}", run
    # the quantised experts (Kimi-K2.5's int4, group 32, bf16 scales; DeepSeek-V3 / Kimi-K2's fp8 128 x 128 blocks)
    # on each path the launcher picks: split-K gate/up at M 1, the FMA programs at M 4, the dot path at M 8 and 64
    # int4q: int4 in row quads (our forward's layout; the q4 stream kernels up to M 8); int4q+shared: with Kimi-K2.5's
    # bf16 shared expert in the same launches
    for fmt in ("int4", "int4q", "int4q+shared", "fp8"):
        for m in ((1, 8) if quick else (1, 4, 8, 64)):
            def run_q(m=m, fmt=fmt):
                e, h, inter, top = 384, 7168, 256, 8
                if fmt.startswith("int4"):
                    u8 = torch.uint8
                    w13, w2 = _cuda(e, 2 * inter, h // 2, dtype=u8), _cuda(e, h, inter // 2, dtype=u8)
                    q = moe.MoEQuant("int4", _cuda(e, 2 * inter, h // 32), _cuda(e, h, inter // 32), group_size=32,
                                     layout="quads" if fmt.startswith("int4q") else "rows")
                else:
                    f8 = torch.float8_e4m3fn
                    w13, w2 = _cuda(e, 2 * inter, h, dtype=f8), _cuda(e, h, inter, dtype=f8)
                    f32 = torch.float32
                    q = moe.MoEQuant("fp8", _cuda(e, 4, 56, dtype=f32), _cuda(e, 56, 2, dtype=f32))
                ids, w = _cuda(m, top, dtype=torch.int32), _cuda(m, top, dtype=torch.float32)
                shared = (_cuda(2 * inter, h), _cuda(h, inter)) if fmt.endswith("+shared") else None
                moe.fused_moe(_cuda(m, h), w13, w2, ids, w, quant=q, shared_expert=shared, impl="triton")
            yield f"moe {fmt} e384 h7168 i256 top8 M{m}", run_q


def scen_block(quick: bool, target: str):
    """The one-launch MoE block (router, routing, shared + routed experts) at Kimi-K2 / DeepSeek-V3 rank shapes, the
    pipeline depth and grid its launcher picks for the target."""
    import specverify.moe_layer as mb  # its launch choice is reset per target by fake_cuda

    shapes = [("kimi-k2", 384, 1, 1, 1, 256)] if quick else [
        ("kimi-k2", 384, 1, 1, 1, 256), ("kimi-k2", 384, 1, 1, 2, 256), ("deepseek-v3", 256, 8, 4, 2, 256),
        ("tiny I32", 64, 1, 1, 1, 32)]  # an expert narrower than one 128-byte line of its down rows
    for model, e, n_group, topk_group, m, inter in shapes:
        def run(e=e, n_group=n_group, topk_group=topk_group, m=m, inter=inter):
            h = 7168
            mb.moe_block(_cuda(m, h), _cuda(e, h), _cuda(e + 1, 2 * inter, h), _cuda(e + 1, h, inter), top_k=8,
                         correction_bias=_cuda(e, dtype=torch.float32), n_group=n_group, topk_group=topk_group,
                         routed_scaling_factor=2.5)
        yield f"moe_block {model} M{m}", run

    def run_timeline():  # the phase stamps of bench_moe_block.py --timeline (a kernel compiled apart)
        mb._TIMELINE = _cuda(16 * 2 * 188, dtype=torch.int64)
        try:
            mb.moe_block(_cuda(1, 7168), _cuda(384, 7168), _cuda(385, 512, 7168), _cuda(385, 7168, 256), top_k=8,
                         correction_bias=_cuda(384, dtype=torch.float32), routed_scaling_factor=2.5)
        finally:
            mb._TIMELINE = None
    yield "moe_block kimi-k2 M1 timeline", run_timeline


def scen_accept(quick: bool, target: str):
    """Acceptance: greedy (from logits) and sampling, Kimi-K2 vocab 163840."""
    import specverify.accept as acc

    shapes = [(1, 4)] if quick else [(1, 4), (1, 16), (64, 4)]
    vocab = 163840
    for batch, k in shapes:
        # the tree as a parents tensor [batch, k] (its values are not read: validate=False)
        def greedy(batch=batch, k=k):
            acc.verify_greedy(_cuda(batch, k, dtype=torch.int64), _cuda(batch, k, dtype=torch.int32),
                              logits=_cuda(batch, k, vocab), impl="triton", validate=False)

        def greedy_ids(batch=batch, k=k):
            acc.verify_greedy(_cuda(batch, k, dtype=torch.int64), _cuda(batch, k, dtype=torch.int32),
                              target_ids=_cuda(batch, k, dtype=torch.int64), impl="triton", validate=False)

        def sampling(batch=batch, k=k, **params):
            acc.verify_sampling(_cuda(batch, k, vocab), _cuda(batch, k, dtype=torch.int32),
                                _cuda(batch, k, dtype=torch.int64),
                                uniform_samples=_cuda(batch, k, dtype=torch.float32), impl="triton",
                                validate=False, **params)

        yield f"greedy b{batch} k{k} v{vocab}", greedy
        yield f"greedy ids b{batch} k{k}", greedy_ids
        yield f"sampling t0.7 b{batch} k{k} v{vocab}", lambda f=sampling: f(temperature=0.7)
        yield f"sampling t0.7 top_k 20 top_p 0.9 b{batch} k{k}", \
            lambda f=sampling: f(temperature=0.7, top_k=20, top_p=0.9)


def scen_fused(quick: bool, target: str):
    """Fused ops at Kimi-K2 / Llama per-rank sizes."""
    import specverify.fused_ops as fo

    for t in ((4,) if quick else (4, 64)):  # tokens = batch x k
        def rms(t=t, res=False):
            x = _cuda(t, 7168)
            fo.rmsnorm(x, _cuda(7168), 1e-6, _cuda(t, 7168) if res else None, impl="triton")
        yield f"rmsnorm h7168 T{t}", rms
        yield f"rmsnorm+residual h7168 T{t}", lambda f=rms: f(res=True)

        def silu(t=t):
            fo.silu_mul(_cuda(t, 2 * 256), impl="triton")
        yield f"silu_mul inter256 T{t}", silu

        def absorb(t=t):  # Kimi-K2: q nope 128 -> latent 512 per head, 8 heads per rank
            fo.mla_absorb_q(_cuda(1, t, 8, 192), _cuda(8, 128, 512), 128, impl="triton")
        yield f"mla_absorb_q h8 T{t}", absorb

        def upv(t=t):
            fo.mla_up_v(_cuda(1, t, 8, 512), _cuda(8, 512, 128), impl="triton")
        yield f"mla_up_v h8 T{t}", upv
    for batch, k in ((1, 4),) if quick else ((1, 4), (64, 16)):
        def kvprep(batch=batch, k=k):
            pages, table, prefix = _paged(batch, 4096, k)
            fo.mla_kv_prep(_cuda(batch, k, 8, 192), _cuda(batch, k, 576), _cuda(batch, k, dtype=torch.int64),
                           _cuda(512), _cuda(batch * pages, 64, 576), table, prefix, eps=1e-6, theta=50000.0,
                           nope_dim=128, impl="triton")
        yield f"mla_kv_prep h8 b{batch} k{k}", kvprep

        def prep_absorb(batch=batch, k=k):  # the preparation and the query absorption in one grid
            pages, table, prefix = _paged(batch, 4096, k)
            fo.mla_prep_absorb(_cuda(batch, k, 8, 192), _cuda(batch, k, 576), _cuda(batch, k, dtype=torch.int64),
                               _cuda(512), _cuda(8, 128, 512), _cuda(batch * pages, 64, 576), table, prefix, eps=1e-6,
                               theta=50000.0, nope_dim=128, impl="triton")
        yield f"mla_prep_absorb h8 b{batch} k{k}", prep_absorb

        def prep_absorb_scaled(batch=batch, k=k):  # with q_a's RMSNorm scale (24 partials of gemv_sumsq)
            pages, table, prefix = _paged(batch, 4096, k)
            fo.mla_prep_absorb(_cuda(batch, k, 8, 192), _cuda(batch, k, 576), _cuda(batch, k, dtype=torch.int64),
                               _cuda(512), _cuda(8, 128, 512), _cuda(batch * pages, 64, 576), table, prefix, eps=1e-6,
                               theta=50000.0, nope_dim=128, q_sumsq=_cuda(24, batch * k, dtype=torch.float32),
                               q_dim=1536, impl="triton")
        yield f"mla_prep_absorb q_scale h8 b{batch} k{k}", prep_absorb_scaled

        def gqaprep(batch=batch, k=k):
            pages, table, prefix = _paged(batch, 4096, k)
            kc = _cuda(batch * pages, 64, 1, 128)
            fo.gqa_prep(_cuda(batch, k, 8, 128), _cuda(batch, k, 1, 128), _cuda(batch, k, 1, 128),
                        _cuda(batch, k, dtype=torch.int64), _cuda(128), _cuda(128), kc, torch.empty_like(kc),
                        table, prefix, eps=1e-6, theta=500000.0, impl="triton")
        yield f"gqa_prep 8:1 d128 b{batch} k{k}", gqaprep


def scen_kv(quick: bool, target: str):
    """KV compaction after acceptance: the MLA latent cache (576 wide) and GQA k/v caches."""
    from specverify.kv_cache import compact_kv

    for batch, k in ((1, 4),) if quick else ((1, 4), (64, 16)):
        def run(batch=batch, k=k, mla=True):
            pages, table, prefix = _paged(batch, 4096, k)
            caches = [_cuda(batch * pages, 64, 576)] if mla else [_cuda(batch * pages, 64, 1, 128)] * 2
            compact_kv(caches, table, prefix, _cuda(batch, k, dtype=torch.int32), _cuda(batch, dtype=torch.int32),
                       impl="triton", validate=False)
        yield f"compact_kv mla b{batch} k{k}", run
        yield f"compact_kv gqa b{batch} k{k}", lambda f=run: f(mla=False)


def scen_gemv(quick: bool, target: str):
    """The skinny GEMM at the pass's projections (Kimi-K2 rank): split K, each shape's launch config."""
    from specverify.gemv import gemv

    shapes = ((2112, 7168),) if quick else ((2112, 7168), (1536, 1536), (7168, 1024), (384, 7168))
    for n, k in shapes:
        for m in (1,) if quick else (1, 4, 8):  # M = 4: the per-shape configs (qkv_a 4 stages, q_b 8 warps)
            yield f"gemv m{m} {k}->{n}", lambda m=m, n=n, k=k: gemv(_cuda(m, k), _cuda(n, k), impl="triton")
    from specverify.gemv import gemv_sumsq

    for m in (1,) if quick else (1, 4, 8):  # qkv_a with q_a's sums of squares (q_lora 1536): both reduce forms
        yield f"gemv_sumsq m{m} 7168->2112 cols1536", \
            lambda m=m: gemv_sumsq(_cuda(m, 7168), _cuda(2112, 7168), 1536, impl="triton")
    if quick:
        return
    import specverify.gemv as gm

    def run_rr(n, k, over, cols=0):  # a row-range candidate of bench/sweep_gemv.py (one range of rows a program)
        saved = dict(gm._CONFIG)
        gm._CONFIG.update(over)
        try:
            if cols:
                gemv_sumsq(_cuda(1, k), _cuda(n, k), cols, impl="triton")
            else:
                gemv(_cuda(1, k), _cuda(n, k), impl="triton")
        finally:
            gm._CONFIG.clear()
            gm._CONFIG.update(saved)
    for n, k, cands in ((2112, 7168, ((256, 4), (512, 3))), (7168, 1024, ((128, 4), (256, 3)))):
        for bk, st in cands:
            over = {"ROW_RANGE": True, "WAVES": 1, "BLOCK_K": bk, "num_stages": st}
            yield f"gemv rr m1 {k}->{n} k{bk} s{st}", lambda n=n, k=k, over=over: run_rr(n, k, over)
    over = {"ROW_RANGE": True, "WAVES": 1, "BLOCK_K": 256, "num_stages": 4}  # qkv_a's row ranges with the sums
    yield "gemv_sumsq rr m1 7168->2112 k256 s4", lambda: run_rr(2112, 7168, over, cols=1536)


SCENARIOS = dict(attn=scen_attn, gqa=scen_gqa, route=scen_route, moe=scen_moe, block=scen_block, accept=scen_accept,
                 fused=scen_fused, kv=scen_kv, gemv=scen_gemv)


class _Skip(Exception):
    """A scenario that does not apply here (the Gluon kernel on a Triton without its API)."""


def capture(target: str, groups, quick: bool):
    """(launches, problems): every kernel launch the scenarios make on the fake ``target`` GPU."""
    launches, problems = [], []
    for g in groups:
        for name, run in SCENARIOS[g](quick, target):
            sink: list[Launch] = []
            try:
                with fake_cuda(target, sink):
                    run()
            except _Skip as exc:
                problems.append(dict(group=g, scenario=name, status="skip", note=str(exc)))
                continue
            except Exception as exc:  # noqa: BLE001 - a launcher that cannot be driven is a failure row
                problems.append(dict(group=g, scenario=name, status="launcher-error",
                                     note=f"{type(exc).__name__}: {str(exc)[:300]}"))
                continue
            if not sink:
                problems.append(dict(group=g, scenario=name, status="no-launch",
                                     note="the launcher made no Triton launch"))
            for ln in sink:
                ln.scenario, ln.group = name, g
                launches.append(ln)
    return launches, problems


# ------------------------------------------------------------------------------------------------ compile
_TDTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
           torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16",
           torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv"}


def launch_spec(fn, args, kw):
    """(signature, constexprs, attrs, options) of one launch, specialised the way Triton's launcher does it
    (ints equal to 1 become constants, ints and pointers divisible by 16 get ``tt.divisibility``, except the
    ``do_not_specialize`` parameters; ``None`` and constexpr parameters are constants)."""
    kw = dict(kw)
    opts = {o: kw.pop(o) for o in ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl") if o in kw}
    names = list(fn.arg_names)
    values = dict(zip(names, args))
    values.update(kw)
    dns = set()
    for p in getattr(fn, "do_not_specialize", ()) or ():
        dns.add(names[p] if isinstance(p, int) else p)
    sig, const, attrs = {}, {}, {}
    for i, name in enumerate(names):
        param = fn.params[i]
        # a kernel may take a launch option as a constexpr parameter (the Gluon kernel's num_warps)
        v = values[name] if name in values else opts[name] if name in opts else param.default
        if param.is_constexpr:
            sig[name], const[name] = "constexpr", v
        elif v is None:
            sig[name], const[name] = "constexpr", None
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + _TDTYPE[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 256-B aligned; views here start at 0
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, float):
            sig[name] = "fp32"
        elif isinstance(v, int):
            sig[name] = "i32" if -2**31 <= v < 2**31 else "i64"
            if name not in dns:
                if v == 1:
                    sig[name], const[name] = "constexpr", 1
                elif v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(v).__name__} is not handled")
    return sig, const, attrs, opts


def _config_label(fn, sig, const, opts):
    skip = {n for n, s in sig.items() if s == "constexpr" and const.get(n) is None}
    parts = [f"{n}={const[n]}" for n in sig if sig[n] == "constexpr" and n not in skip and n.isupper()]
    parts += [f"{k}={v}" for k, v in sorted(opts.items())]
    return " ".join(parts)


def _tool(name):
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def ptxas_available() -> bool:
    try:
        return subprocess.run([_tool("ptxas"), "--version"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


_PTXAS_USAGE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas_log_dir() -> str:
    import triton

    return os.path.join(triton.knobs.cache.dir, "specverify-ptxas")


def _compile_logged(src, gpu, options: dict):
    """``triton.compile`` with ptxas's ``-v`` report (Triton prints it with ``dump_ptxas_log``): (kernel, report).
    A cache hit runs no ptxas, so the report is kept beside Triton's cache under the kernel's hash; a hit without
    one compiles again."""
    import triton

    knobs = triton.knobs
    saved = knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile
    try:
        for always in (False, True):
            knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = True, always
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                ck = triton.compile(src, target=gpu, options=options)
            path = os.path.join(_ptxas_log_dir(), f"{ck.hash}.log")
            if _PTXAS_USAGE.search(out.getvalue()):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as fh:
                    fh.write(out.getvalue())
                return ck, out.getvalue()
            if os.path.exists(path):
                with open(path) as fh:
                    return ck, fh.read()
    finally:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = saved
    return ck, ""


def compile_launch(fn, sig, const, attrs, opts, target: str):
    """Compile for ``target`` offline; returns dict(regs, spill (ptxas's spill stores, bytes per thread), stack
    (ptxas's stack frame: local arrays such as the slow path of ``sin``/``cos``'s range reduction, not spills),
    local (cuobjdump's local memory), smem (the shared memory Triton reserves))."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cc = TARGETS[target][0]
    gpu = GPUTarget("cuda", cc, 32)
    src_cls = ASTSource
    if type(fn).__name__ == "GluonJITFunction":
        from triton.experimental.gluon._runtime import GluonASTSource as src_cls
    backend = triton.compiler.make_backend(gpu)
    options = backend.parse_options(dict(opts))
    ck, report = _compile_logged(src_cls(fn=fn, signature=sig, constexprs=const, attrs=attrs), gpu,
                                 options.__dict__)
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(ck.asm["cubin"])
    try:
        info = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                              text=True).stdout
    finally:
        os.unlink(f.name)
    regs = int(m.group(1)) if (m := re.search(r"REG:(\d+)", info)) else getattr(ck, "n_regs", -1)
    local = sum(int(x) for x in re.findall(r"LOCAL:(\d+)", info))
    usage = [tuple(int(x) for x in m) for m in _PTXAS_USAGE.findall(report)]
    if usage:
        stack, spill = max(u[0] for u in usage), sum(u[1] for u in usage)
    else:  # no ptxas report: count every local and stack byte as a spill (the conservative reading)
        stack, spill = 0, local + sum(int(x) for x in re.findall(r"STACK:(\d+)", info))
    return dict(regs=regs, spill=spill, stack=stack, local=local, smem=int(ck.metadata.shared))


_COMPILED: dict = {}


def _spec_key(fn, sig, const, attrs, opts):
    return (id(fn), repr(sorted(sig.items())), repr(sorted(const.items(), key=lambda x: x[0])),
            repr(sorted(attrs.items())), repr(sorted(opts.items())))


def compile_cached(fn, args, kw, target: str) -> dict:
    """Compile one launch for ``target`` once: dict(regs, spill, smem, error, compile_s)."""
    sig, const, attrs, opts = launch_spec(fn, args, kw)
    key = _spec_key(fn, sig, const, attrs, opts) + (target,)
    if key not in _COMPILED:
        t0 = time.time()
        try:
            res = dict(compile_launch(fn, sig, const, attrs, opts, target), error=None)
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            msg = str(exc).strip().splitlines()
            res = dict(regs=None, spill=None, stack=None, local=None, smem=None,
                       error=f"{type(exc).__name__}: {(msg[-1] if msg else '')[:300]}")
        res["compile_s"] = round(time.time() - t0, 1)
        _COMPILED[key] = res
    return _COMPILED[key]


def build_rows(target: str, launches, problems) -> list[Row]:
    smem_limit = TARGETS[target][1]
    rows, seen = [], {}
    for ln in launches:
        kname = getattr(ln.fn, "__name__", str(ln.fn))
        try:
            sig, const, attrs, opts = launch_spec(ln.fn, ln.args, ln.kw)
        except Exception as exc:  # noqa: BLE001
            rows.append(Row(kname, "?", target, [ln.scenario], status="error", note=f"spec: {exc}"))
            continue
        key = _spec_key(ln.fn, sig, const, attrs, opts)
        if key in seen:
            seen[key].scenarios.append(ln.scenario)
            continue
        row = Row(kname, _config_label(ln.fn, sig, const, opts), target, [ln.scenario])
        seen[key] = row
        rows.append(row)
        res = compile_cached(ln.fn, ln.args, ln.kw, target)
        row.regs, row.spill_bytes, row.stack_bytes, row.smem_bytes, row.compile_s = \
            res["regs"], res["spill"], res["stack"], res["smem"], res["compile_s"]
        if res["error"]:
            row.status, row.note = "error", res["error"]
        else:
            bad = []
            known = KNOWN_SPILLS.get((kname, _triton_minor()))
            if row.spill_bytes and known:
                row.note = f"known spill {row.spill_bytes} B/thread: {known}"
            elif row.spill_bytes:
                bad.append(f"spills {row.spill_bytes} B/thread")
            if row.smem_bytes > smem_limit:
                bad.append(f"shared {row.smem_bytes} B > {smem_limit} B")
            if bad:
                row.status, row.note = "FAIL", "; ".join(bad)
        log(f"  [{target}] {kname:<34} {row.status:<6} regs {row.regs!s:>4} smem {row.smem_bytes!s:>7} "
            f"spill {row.spill_bytes!s:>4} stack {row.stack_bytes!s:>3}  {row.compile_s:.1f} s  {row.config}")
    for p in problems:
        rows.append(Row(f"<{p['group']}>", p["scenario"], target, [p["scenario"]],
                        status="skip" if p["status"] == "skip" else "error", note=p["note"]))
    return rows


def print_table(rows) -> None:
    def cell(v):
        return "-" if v is None else v

    print(f"{'kernel':<34} {'target':<7} {'regs':>5} {'smem B':>7} {'spill':>6} {'stack':>5} {'status':<6} "
          "config / note")
    for r in rows:
        tail = r.config + (f"  [{r.note}]" if r.note else "")
        print(f"{r.kernel:<34} {r.target:<7} {cell(r.regs):>5} {cell(r.smem_bytes):>7} {cell(r.spill_bytes):>6} "
              f"{cell(r.stack_bytes):>5} {r.status:<6} {tail}")


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        return ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="sm_90a,sm_120", help=f"comma list of {', '.join(TARGETS)}")
    ap.add_argument("--only", default=",".join(GROUPS), help=f"comma list of {', '.join(GROUPS)}")
    ap.add_argument("--allow-fail", action="append", default=[], metavar="TARGET",
                    help="report failures on TARGET without a non-zero exit (repeatable or comma list)")
    ap.add_argument("--quick", action="store_true", help="one or two shapes per group")
    ap.add_argument("--kernel", action="append", default=[], metavar="NAME",
                    help="compile only kernels whose name contains NAME (repeatable)")
    ap.add_argument("--json", metavar="PATH", help="write the rows (and versions, commit, date) as JSON")
    args = ap.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    groups = [g for g in args.only.split(",") if g]
    allow = {t for a in args.allow_fail for t in a.split(",") if t}
    for t in targets + sorted(allow):
        if t not in TARGETS:
            ap.error(f"unknown target {t!r}; expected one of {', '.join(TARGETS)}")
    for g in groups:
        if g not in GROUPS:
            ap.error(f"unknown group {g!r}; expected one of {', '.join(GROUPS)}")
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: the interpreter changes the launchers' configs and compiles nothing")
    import triton

    if not ptxas_available():
        log(f"ptxas not runnable at {_tool('ptxas')}: cannot compile to cubin")
        return 2
    t_start = time.time()
    rows: list[Row] = []
    gates: dict = {}
    for target in targets:
        log(f"== {target}: capturing launches ({', '.join(groups)})")
        launches, problems = capture(target, groups, args.quick)
        if "attn" in groups:
            gates[target] = gate(target)
            log(f"== {target}: MLA gate: {'Gluon wgmma' if gates[target]['mla_wgmma'] else 'tl.dot'} "
                f"({gates[target]['reason']})")
        if args.kernel:
            launches = [ln for ln in launches if any(k in ln.fn.__name__ for k in args.kernel)]
        log(f"== {target}: {len(launches)} launches, compiling the distinct ones")
        rows += build_rows(target, launches, problems)
    wall = time.time() - t_start
    print_table(rows)
    failing = [r for r in rows if r.status in ("FAIL", "error")]
    fatal = [r for r in failing if r.target not in allow]
    summary = {t: dict(rows=sum(r.target == t for r in rows), failing=sum(r.target == t for r in failing),
                       allowed=t in allow) for t in targets}
    print(f"\ntriton {triton.__version__}, torch {torch.__version__}: {len(rows)} rows in {wall:.0f} s; " +
          "; ".join(f"{t}: {s['failing']} failing of {s['rows']}{' (allowed)' if s['allowed'] else ''}"
                    for t, s in summary.items()))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(dict(triton=triton.__version__, torch=torch.__version__, python=platform.python_version(),
                           commit=_git_commit(), date=datetime.datetime.now().isoformat(timespec="seconds"),
                           wall_s=round(wall, 1), targets={t: dict(cc=TARGETS[t][0], smem_limit_bytes=TARGETS[t][1])
                                                             for t in targets},
                           allow_fail=sorted(allow), summary=summary, gate=gates,
                           rows=[r.__dict__ for r in rows]), fh, indent=1)
    return 1 if fatal else 0


if __name__ == "__main__":
    sys.exit(main())
