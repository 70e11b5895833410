"""MoE routing with token→expert alignment in one launch, and SwiGLU experts at the weight-bytes floor.

Public API: :func:`moe_route`, :func:`fused_moe`, and the :class:`MoEAlignment` / :class:`MoEQuant` records they
exchange. Kernels: ``specverify.kernels.moe_route`` and ``specverify.kernels.fused_moe``. Definition of correct:
``specverify.reference.moe``.
"""
from __future__ import annotations

import logging
import numbers
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch

from specverify import envvars
from specverify.fit import launch_fitting, pdl_kwargs, pdl_launch, sm_count
from specverify.workspace import grown_workspace

__all__ = ["MoEAlignment", "MoEQuant", "moe_route", "fused_moe", "max_num_tokens_padded", "append_shared_expert"]

logger = logging.getLogger("specverify")

_IMPLS = ("auto", "triton", "reference")
_MAX_EXPERTS = 1024
_WS_STRIDE = 1024  # workspace layout (int32): counters [0, 1024), offsets [1024, 2048), ticket at 2048,
_WS_MASKS = 2 * _WS_STRIDE + 32  # then 1024 int64 row masks (the MASK alignment) from int32 offset 2080
_WS_END = _WS_MASKS + 2 * _WS_STRIDE
_LOGGED: set[str] = set()
_WS: dict[tuple[str, int | None], torch.Tensor] = {}
_WS_LOCK = threading.Lock()


class MoEAlignment(NamedTuple):
    """Slots grouped by expert in blocks of ``block_size``: the expert GEMM's input.

    Fixed-size buffers (their sizes depend only on ``M``, ``top_k``, the expert count and ``block_size``), so the
    alignment can be produced and consumed inside a CUDA graph.

    Attributes
    ----------
    sorted_token_ids : torch.Tensor
        int32, shape ``(max_num_tokens_padded,)``: slot ids ``s = m * top_k + k`` grouped by expert in increasing
        expert order, each expert's run padded to a multiple of ``block_size`` with the sentinel ``M * top_k``.
        Entries at or past ``num_tokens_post_padded`` are unspecified (up to 1024 slots the router leaves them
        unwritten; consumers read only the used part).
    expert_ids : torch.Tensor
        int32, shape ``(max_num_tokens_padded // block_size,)``: expert of each block, -1 for unused blocks.
    num_tokens_post_padded : torch.Tensor
        int32, shape ``(1,)``: the used length of ``sorted_token_ids``.
    block_size : int
        Slots per block.
    """

    sorted_token_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_tokens_post_padded: torch.Tensor
    block_size: int


@dataclass(frozen=True)
class MoEQuant:
    """Quantised expert weights for :func:`fused_moe`: the weight arguments hold the stored values, this record their
    format and scales. Activations stay in hidden's dtype and the kernels dequantise in registers (W4A16 / W8A16).

    Formats (definitions and converters: :mod:`specverify.reference.quant`):

    * ``"int4"`` (Kimi-K2.5's routed experts; compressed-tensors ``pack-quantized``, symmetric, group 32): ``w13``
      uint8 ``[E, 2I, H / 2]`` and ``w2`` uint8 ``[E, H, I / 2]``, two 4-bit codes a byte along the reduced
      dimension (column ``2j`` in the low nibble); code ``q`` stands for ``(q - 8) * scale``. ``w13_scale [E, 2I, H
      / group_size]``, ``w2_scale [E, H, I / group_size]`` (bf16, fp16 or fp32). The checkpoints' int32
      ``weight_packed`` ``[N, K / 8]`` is this layout after ``.view(torch.uint8)``.
    * ``"fp8"`` (DeepSeek-V3, Kimi-K2; block FP8): ``w13`` / ``w2`` float8_e4m3fn of the unquantised shapes,
      ``w13_scale`` fp32 ``[E, ceil(2I / bn), ceil(H / bk)]`` and ``w2_scale`` ``[E, ceil(H / bn), ceil(I / bk)]``
      (the checkpoints' ``weight_scale_inv``), ``(bn, bk) = block_shape``; the value is ``w * scale``. With gate and
      up stacked in ``w13``, I must be a multiple of bn (each block row is all gate or all up).

    ``layout`` (int4 only): ``"rows"`` (default, the layout above) or ``"quads"``: both weights and their scales
    keep their shapes but hold their bytes in row quads (:func:`specverify.reference.quant.int4_to_quads`). Each 16
    bytes then hold one 32-bit code word (8 columns) of 4 rows, which the stream experts (up to 8 tokens) read with
    their activations without a layout change; the other paths read it too. Our verify forward stores its int4
    experts so (:data:`specverify.forward.model.INT4_LAYOUT`); weights shared with SGLang stay in rows.

    ``group_size`` and both ``block_shape`` entries are powers of two (>= 2); quads need ``group_size`` >= 8 and
    H and I multiples of 8. Checked by :func:`fused_moe` (:meth:`dequantize` checks only format and layout).
    """

    format: str
    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    group_size: int = 32
    block_shape: tuple[int, int] = (128, 128)
    layout: str = "rows"

    def dequantize(self, w13: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype = torch.float32):
        """``(w13, w2)`` as plain ``dtype`` tensors ``[E, 2I, H]`` / ``[E, H, I]`` (the references use this)."""
        from specverify.reference import quant as q

        if self.format not in ("int4", "fp8"):
            raise ValueError(f"MoEQuant.format must be 'int4' or 'fp8', got {self.format!r}")
        _check_layout(self)
        if self.format == "int4":
            s13, s2 = self.w13_scale, self.w2_scale
            if self.layout == "quads":
                w13, s13 = q.int4_from_quads(w13, s13)
                w2, s2 = q.int4_from_quads(w2, s2)
            return (q.dequantize_int4(w13, s13, self.group_size, dtype),
                    q.dequantize_int4(w2, s2, self.group_size, dtype))
        return (q.dequantize_fp8_block(w13, self.w13_scale, self.block_shape, dtype),
                q.dequantize_fp8_block(w2, self.w2_scale, self.block_shape, dtype))


def max_num_tokens_padded(num_tokens: int, top_k: int, num_experts: int, block_size: int) -> int:
    """Length of ``sorted_token_ids``: an upper bound on the aligned length, rounded up to a whole block.

    At most ``min(M * top_k, E)`` experts have tokens and each pads fewer than ``block_size`` slots, so the used
    length is at most ``M * top_k + min(M * top_k, E) * (block_size - 1)``.
    """
    s = num_tokens * top_k
    bound = s + min(s, num_experts) * (block_size - 1)
    return max(-(-bound // block_size), 1) * block_size


# --------------------------------------------------------------------------------------------- helpers
def _log_once(key: str, msg: str, level: int = logging.INFO) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.log(level, msg)


def _check_impl(impl: str, name: str) -> None:
    if impl not in _IMPLS:
        raise ValueError(f"{name}: impl must be one of {_IMPLS}, got {impl!r}")


def _triton_usable(t: torch.Tensor) -> tuple[bool, str]:
    if envvars.get_flag("SPECVERIFY_DISABLE_TRITON"):
        return False, "SPECVERIFY_DISABLE_TRITON=1"
    try:
        import triton  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the install
        return False, f"triton cannot be imported ({exc})"
    if t.is_cuda or envvars.triton_interpret():
        return True, ""
    return False, f"tensors are on {t.device.type} and TRITON_INTERPRET is not set"


def _choose(impl: str, t: torch.Tensor, name: str) -> str:
    if impl == "triton":
        ok, why = _triton_usable(t)
        if not ok:
            raise ValueError(f"specverify.{name}: impl='triton' cannot run: {why}; pass CUDA tensors, set "
                             "TRITON_INTERPRET=1 (before importing specverify) for the CPU interpreter, or use "
                             "impl='auto'/'reference'")
    if impl != "auto":
        return impl
    ok, why = _triton_usable(t)
    if ok:
        return "triton"
    _log_once(name + why, f"specverify.{name}: impl='auto' uses the torch reference because {why}")
    return "reference"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _pdl(flag, dev: torch.device) -> bool:
    """Whether a kernel configured with PDL ``flag`` is launched as a programmatic dependent on ``dev``: CUDA sm_90+
    with ``SPECVERIFY_PDL`` on (:func:`specverify.fit.pdl_launch`; elsewhere the flag is ignored)."""
    return bool(flag) and pdl_launch(dev)


def _workspace(device: torch.device) -> torch.Tensor:
    """Per-device workspace that the routing kernel leaves at zero after every call: int32 counters, offsets and
    ticket, then int64 per-expert row masks (layout at ``_WS_STRIDE``)."""
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:<current>" are one workspace
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device.type, device.index)
    ws = _WS.get(key)
    if ws is not None:
        return ws
    with _WS_LOCK:
        ws = _WS.get(key)
        if ws is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("moe_route: the first call on a device must run outside CUDA-graph capture (it "
                                   "allocates the zeroed per-device workspace); run one eager warm-up call first")
            ws = torch.zeros(_WS_END, dtype=torch.int32, device=device)
            _WS[key] = ws
    return ws


# --------------------------------------------------------------------------------------------- routing
def _check_route_args(router_logits, top_k, scoring, correction_bias, n_group, topk_group, renormalize,
                      routed_scaling_factor, block_size):
    if not isinstance(router_logits, torch.Tensor):
        raise TypeError(f"router_logits must be a torch.Tensor of shape [M, E], got {type(router_logits).__name__}")
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must have shape [M, E], got {router_logits.dim()}-d shape "
                         f"{list(router_logits.shape)}; flatten the token dimensions first")
    if router_logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"router_logits must be float32, bfloat16 or float16, got {router_logits.dtype}; cast it "
                        "with .float()")
    m, e = router_logits.shape
    if e < 1 or e > _MAX_EXPERTS:
        raise ValueError(f"router_logits must have 1..{_MAX_EXPERTS} experts (columns), got {e}")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int in [1, num_experts={e}], got {type(top_k).__name__} {top_k!r}; "
                        "pass a Python int")
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be an int in [1, num_experts={e}], got {top_k!r}")
    if scoring not in ("sigmoid", "softmax"):
        raise ValueError(f"scoring must be 'sigmoid' or 'softmax', got {scoring!r}")
    if correction_bias is not None:
        if not isinstance(correction_bias, torch.Tensor):
            raise TypeError(f"correction_bias must be a torch.Tensor of shape [{e}] or None, got "
                            f"{type(correction_bias).__name__}")
        if tuple(correction_bias.shape) != (e,):
            raise ValueError(f"correction_bias must have shape [{e}] (one per expert), got "
                             f"{list(correction_bias.shape)}")
        if not correction_bias.is_floating_point():
            raise TypeError(f"correction_bias must be a floating-point tensor, got {correction_bias.dtype}")
        if correction_bias.device != router_logits.device:
            raise ValueError(f"correction_bias is on {correction_bias.device} but router_logits on "
                             f"{router_logits.device}; move them to one device")
    if isinstance(n_group, bool) or not isinstance(n_group, int) or n_group < 1 or e % n_group:
        raise ValueError(f"n_group must be a positive int dividing num_experts={e}, got {n_group!r}")
    if n_group > 64:
        raise ValueError(f"n_group must be at most 64, got {n_group}")
    if isinstance(topk_group, bool) or not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be an int in [1, n_group={n_group}], got {topk_group!r}")
    if n_group > 1 and top_k > topk_group * (e // n_group):
        raise ValueError(f"top_k={top_k} exceeds the experts of the kept groups (topk_group={topk_group} x "
                         f"{e // n_group} experts per group); raise topk_group or lower top_k")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float)):
        raise TypeError(f"routed_scaling_factor must be a Python float, got {type(routed_scaling_factor).__name__}")
    if block_size is not None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1 \
                or block_size & (block_size - 1) or block_size > 256:
            raise ValueError(f"block_size must be a power of two in [1, 256] or None, got {block_size!r}")


def _check_shared_expert_id(shared_expert_id, block_size):
    if shared_expert_id is None:
        return
    if isinstance(shared_expert_id, bool) or not isinstance(shared_expert_id, int):
        raise TypeError(f"shared_expert_id must be a Python int >= 0 or None, got {type(shared_expert_id).__name__} "
                        f"{shared_expert_id!r}; pass the shared expert's index in the stacked expert weights (the "
                        "routed expert count when it is stored after them)")
    # with block_size the alignment counts every expert in the per-device workspace (_MAX_EXPERTS counters)
    limit = _MAX_EXPERTS if block_size is not None else 2 ** 31
    if not 0 <= shared_expert_id < limit:
        why = (f" with block_size (the alignment counts at most {_MAX_EXPERTS} experts)" if block_size is not None
               else "")
        raise ValueError(f"shared_expert_id must be an int in [0, {limit - 1}]{why}, got {shared_expert_id}; pass the "
                         "shared expert's index in the stacked expert weights")


def _pad_alignment(sorted_ids, expert_ids, npad, m, top_k, num_experts, block_size):
    """Reference alignment (exact size) copied into the fixed-size buffers of the kernel path."""
    dev = sorted_ids.device
    size = max_num_tokens_padded(m, top_k, num_experts, block_size)
    out_sorted = torch.full((size,), m * top_k, dtype=torch.int32, device=dev)
    out_eids = torch.full((size // block_size,), -1, dtype=torch.int32, device=dev)
    out_sorted[: sorted_ids.numel()] = sorted_ids
    out_eids[: expert_ids.numel()] = expert_ids
    return MoEAlignment(out_sorted, out_eids, npad, block_size)


def _alignment_buffers(m: int, top_k: int, e: int, block_size: int, dev):
    """(size, sorted_token_ids, expert_ids, num_tokens_post_padded) of an alignment, unwritten: the padded worst case
    for ``m * top_k`` slots over ``e`` experts."""
    size = max_num_tokens_padded(m, top_k, e, block_size)
    return (size, torch.empty((size,), dtype=torch.int32, device=dev),
            torch.empty((size // block_size,), dtype=torch.int32, device=dev),
            torch.empty((1,), dtype=torch.int32, device=dev))


def _launch_route_align(logits, bias, top_k, softmax, n_group, topk_group, renormalize, scale, block_size,
                        topk_ids=None, num_experts=None, shared_expert_id=None):
    """One launch: routing (unless ``topk_ids`` is given) and, with ``block_size``, the alignment.

    ``shared_expert_id`` (routing without alignment only): the outputs are [M, top_k + 1], the last column the
    shared expert (that id, weight 1.0), written by the routing kernel itself."""
    from specverify.kernels.moe_route import _moe_route_align_kernel

    do_route = topk_ids is None
    do_align = block_size is not None
    shared = shared_expert_id is not None
    if shared and (do_align or not do_route):  # one launch never writes the shared slot and aligns
        raise ValueError("_launch_route_align: shared_expert_id is for the routing alone (topk_ids None, block_size "
                         "None); align the [M, top_k + 1] ids with a second, alignment-only call")
    out_k = top_k + 1 if shared else top_k
    dev = logits.device if do_route else topk_ids.device
    if do_route:
        m, e = logits.shape
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        ids = torch.empty((m, out_k), dtype=torch.int32, device=dev)
        weights = torch.empty((m, out_k), dtype=torch.float32, device=dev)
    else:
        m, top_k = topk_ids.shape
        e = num_experts
        ids = topk_ids.contiguous()
        weights = ids  # unused
    s = m * top_k
    if do_align and 0 < s <= _FAST_MAX_SLOTS and (do_route or s <= _FAST_ROUTE_CONFIG["align_one_max_slots"]):
        return _launch_route_align_fast(logits, bias, ids, weights, m, e, top_k, softmax, n_group, topk_group,
                                        renormalize, scale, block_size, do_route)
    if do_align:
        size, sorted_ids, expert_ids, npad = _alignment_buffers(m, top_k, e, block_size, dev)
        rank = torch.empty((max(s, 1),), dtype=torch.int32, device=dev)
        ws = _workspace(dev)
        count, offs, ticket = ws[:_WS_STRIDE], ws[_WS_STRIDE: 2 * _WS_STRIDE], ws[2 * _WS_STRIDE: _WS_MASKS]
        max_blocks = size // block_size
    else:
        sorted_ids = expert_ids = npad = rank = count = offs = ticket = ids
        max_blocks = 0
    ep = max(_next_pow2(e), 16)
    gsize = e // n_group
    bias_arg = bias if bias is not None else (logits if do_route else ids)
    rows = 1  # one token row per program: the top-k reductions stay inside one row
    grid = (_cdiv(m, rows),) if do_route else (1,)
    launch = {"num_warps": _ROUTE_CONFIG["num_warps"]} if dev.type == "cuda" else {}
    launch.update(pdl_kwargs(dev))
    if m == 0 or (not do_route and not do_align):
        pass
    else:
        _moe_route_align_kernel[grid](
            logits if do_route else ids, bias_arg, ids, weights, rank, sorted_ids, expert_ids, npad,
            count, offs, ticket, m, s, max_blocks, logits.stride(0) if do_route else 0, float(scale),
            shared_expert_id if shared else 0,
            E=e, EP=ep, ROWS=rows, TOP_K=top_k, OUT_K=out_k, TOPK_P=max(_next_pow2(top_k), 2), N_GROUP=n_group,
            NG_P=max(_next_pow2(n_group), 2), GSIZE=gsize, TOPK_GROUP=topk_group, SOFTMAX=softmax,
            HAS_BIAS=bias is not None, RENORM=renormalize, DO_ROUTE=do_route, DO_ALIGN=do_align, EA=e,
            EAP=max(_next_pow2(e), 16), B=block_size or 1, CHUNK=512 if dev.type == "cuda" else 64, **launch)
    if m == 0 and do_align:
        sorted_ids.fill_(s)
        expert_ids.fill_(-1)
        npad.zero_()
    alignment = MoEAlignment(sorted_ids, expert_ids, npad, block_size) if do_align else None
    return ids, weights, alignment


def _fast_align_path(m: int, s: int, do_route: bool) -> str:
    """How the router + alignment (M * top_k <= 1024) aligns ``m`` tokens of ``s`` slots under
    ``_FAST_ROUTE_CONFIG``: ``"one"`` (one program, in registers), ``"sorted"`` (the last program sorts the slots),
    ``"mask"`` (the last program reads the per-expert row masks) or ``"atomic"`` (atomic ranks). Alignment-only calls
    (``do_route`` False) reach the fast kernel only on the one-program path."""
    cfg = _FAST_ROUTE_CONFIG
    if s <= (cfg["one_max_slots"] if do_route else cfg["align_one_max_slots"]):
        return "one"
    if s <= cfg["sorted_max_slots"]:
        return "sorted"
    if m <= min(cfg["mask_max_rows"], 64):
        return "mask"
    return "atomic"


def _launch_route_align_fast(logits, bias, ids, weights, m, e, top_k, softmax, n_group, topk_group, renormalize,
                             scale, block_size, do_route):
    """The router + alignment for 0 < M * top_k <= 1024.

    Up to ``_FAST_ROUTE_CONFIG["one_max_slots"]`` slots (M <= 2 at top-8; ``align_one_max_slots`` for alignment-only
    calls): one program routes every row at once and aligns in registers (no atomics, no workspace, no global round
    trip; slots in increasing slot id inside an expert, exactly as ``align_reference``). Beyond: one program per
    ``ROWS`` rows, and the last program (ticket) aligns: up to ``sorted_max_slots`` slots by one sort of every
    slot's id (exact order); above, up to ``mask_max_rows`` rows (at most 64), from per-expert int64 row masks that
    the routing programs set by atomic OR (counts and ranks by bit counts: exact order again, no atomic that returns
    a value); above that with atomic ranks taken by the routing programs, after one load of ids, ranks and counters
    (order inside an expert then free). Either way ``sorted_token_ids`` past ``num_tokens_post_padded`` is left
    unwritten (consumers read only the used part); ``expert_ids`` past the used blocks is always -1.
    """
    from specverify.kernels.moe_route import _moe_route_align_fast_kernel

    cfg = _FAST_ROUTE_CONFIG
    dev = ids.device
    on_gpu = dev.type == "cuda"
    s = m * top_k
    size, sorted_ids, expert_ids, npad = _alignment_buffers(m, top_k, e, block_size, dev)
    topk_p = max(_next_pow2(top_k), 2)
    eap = max(_next_pow2(e), 16)
    path = _fast_align_path(m, s, do_route)
    one, sort_align, mask_align = path == "one", path == "sorted", path == "mask"
    if one:
        rows = max(_next_pow2(m), 1)
        sp = rows * topk_p if do_route else max(_next_pow2(s), 2)
        rank = count = offs = ticket = ids
        grid = (1,)
        warps = cfg["one_small_warps"] if s <= cfg["one_small_slots"] else cfg["one_num_warps"]
    else:  # routing on (the launcher sends alignment-only calls this large elsewhere)
        rows = cfg["ROWS"]
        sp = max(_next_pow2(s), 2)
        rank = ids if sort_align or mask_align else torch.empty((s,), dtype=torch.int32, device=dev)
        ws = _workspace(dev)
        count, offs, ticket = ws[:_WS_STRIDE], ws[_WS_STRIDE: 2 * _WS_STRIDE], ws[2 * _WS_STRIDE: _WS_MASKS]
        if mask_align:  # the int64 row masks take the counters' place
            count = ws[_WS_MASKS: _WS_END].view(torch.int64)
        grid = (_cdiv(m, rows),)
        warps = cfg["wide_warps"] if s > cfg["wide_slots"] and not mask_align else cfg["num_warps"]
    extra = {"num_warps": warps} if on_gpu else {}
    extra.update(pdl_kwargs(dev))
    bias_arg = bias if bias is not None else (logits if do_route else ids)
    _moe_route_align_fast_kernel[grid](
        logits if do_route else ids, bias_arg, ids, weights, rank, sorted_ids, expert_ids, npad, count, offs,
        ticket, m, s, size // block_size, logits.stride(0) if do_route else 0, float(scale),
        E=e, EP=eap, ROWS=rows, TOP_K=top_k, TOPK_P=topk_p, N_GROUP=n_group, NG_P=max(_next_pow2(n_group), 2),
        GSIZE=e // n_group, TOPK_GROUP=topk_group, SOFTMAX=softmax, HAS_BIAS=bias is not None,
        RENORM=renormalize, DO_ROUTE=do_route, EA=e, EAP=eap, B=block_size, SP=sp, ONE=one,
        PJ=min(block_size, 16), CHUNK=cfg["CHUNK"] if on_gpu else 64,
        RELOAD=one and do_route and (eap < _RESHAPE_MIN_EXPERTS or bool(cfg["RELOAD"])), SORTED=sort_align,
        MASK=mask_align, **extra)
    return ids, weights, MoEAlignment(sorted_ids, expert_ids, npad, block_size)


def moe_route(router_logits, *, top_k, scoring="sigmoid", correction_bias=None, n_group=1, topk_group=1,
              renormalize=True, routed_scaling_factor=1.0, block_size=None, shared_expert_id=None, impl="auto"):
    """Choose each token's experts and weights, and (with ``block_size``) align the slots for the expert GEMM.

    DeepSeek-V3 "noaux_tc" routing and its relatives (Kimi-K2: sigmoid, 384 experts, one group; Qwen3: softmax,
    no bias). Source: DeepSeek-V3 technical report (auxiliary-loss-free balancing, node-limited routing).

    Semantics: scores ``sigmoid(logits)`` or ``softmax(logits)`` in fp32; ``correction_bias`` is added only to
    choose experts; with ``n_group > 1`` groups rank by the sum of their two best biased scores and only the best
    ``topk_group`` groups compete; the ``top_k`` best biased scores win (ties: lowest expert id; NaN and
    infinite biased scores never win); weights are the unbiased scores of the winners, renormalised when asked
    (only where their sum is > 0), times ``routed_scaling_factor``. Rows with NaN or infinite logits are routed,
    not raised, and every returned id is a distinct expert in ``[0, E)``: see Notes.

    Parameters
    ----------
    router_logits : torch.Tensor
        Shape: (M, E); float32, bfloat16 or float16. ``E`` ≤ 1024, any count (384, 160, 257, ...).
    top_k : int
        Experts per token, 1 ≤ top_k ≤ E.
    scoring : {"sigmoid", "softmax"}
    correction_bias : torch.Tensor, optional
        Shape: (E,); floating point, same device. Added to the scores to choose experts only.
    n_group, topk_group : int
        Expert groups (``n_group`` divides ``E``) and how many of them stay.
    renormalize : bool
    routed_scaling_factor : float
    block_size : int, optional
        Power of two ≤ 256. When given, also returns the alignment (16 suits :func:`fused_moe` at small M).
    shared_expert_id : int, optional
        ≥ 0 (≤ 1023 with ``block_size``; it may be ≥ E). When given, every token gets one more slot after its
        ``top_k`` routed ones: the shared expert, id ``shared_expert_id`` with weight 1.0 (not scaled by
        ``routed_scaling_factor``, not renormalised), the layout :func:`fused_moe` takes over expert weights that
        store the shared expert as expert ``shared_expert_id`` (what :func:`append_shared_expert` builds, here
        written by the router itself: one launch less). The routed columns are exactly those of the call without it.
    impl : {"auto", "triton", "reference"}
        ``auto`` uses Triton on CUDA tensors (or under ``TRITON_INTERPRET=1``), else the reference, logging why
        once. An explicit choice never falls back.

    Returns
    -------
    topk_ids : torch.Tensor
        int32, shape (M, top_k), in decreasing order of biased score (weight-0 fillers last); always in
        ``[0, E)`` and distinct within a row. With ``shared_expert_id``: shape (M, top_k + 1), the last column
        ``shared_expert_id``.
    topk_weights : torch.Tensor
        float32, shape (M, top_k); with ``shared_expert_id`` (M, top_k + 1), the last column 1.0.
    alignment : MoEAlignment
        Only when ``block_size`` is given. ``sorted_token_ids`` has length
        :func:`max_num_tokens_padded` ``(M, K, EA, block_size)`` (``K`` = top_k, or top_k + 1 with the shared slot;
        ``EA`` = E, or ``max(E, shared_expert_id + 1)``); its used part holds each expert's slots
        ``s = m * K + k`` (increasing slot id, as the reference, for M <= 64 with M * top_k <= 1024; above, the
        order of atomic updates) padded with the sentinel ``M * K``; unused ``expert_ids`` are -1;
        ``sorted_token_ids`` past ``num_tokens_post_padded`` is unspecified (not written).

    Raises
    ------
    TypeError
        Non-tensor or non-float logits or bias, non-int ``top_k`` or ``shared_expert_id`` (a bool is not an int),
        non-bool ``renormalize``, non-float scale.
    ValueError
        Wrong shapes, ``top_k`` out of range, ``n_group`` not dividing ``E``, ``topk_group`` out of range, bad
        ``block_size``, negative (or, with ``block_size``, > 1023) ``shared_expert_id``, unknown ``scoring`` or
        ``impl``.
    RuntimeError
        The first ``impl="triton"`` call with ``block_size`` on a device happens during CUDA-graph capture.

    Notes
    -----
    Non-finite logits (the same contract for sigmoid and softmax, grouped or not, with or without
    ``correction_bias``, every logit dtype, ``impl="reference"`` and every Triton path):

    * A NaN score is the lowest possible score: it never wins a weighted slot. Under softmax a NaN logit is read as
      -inf: that expert's probability is 0 and the others are normalised over the remaining logits as usual.
    * A +inf logit takes the whole weight: sigmoid(+inf) = 1 (finite, routed as usual); under softmax the +inf
      logits of a row share the probability evenly (one +inf: 1 for it; n of them: 1 / n each, the lowest ids
      winning the ties) and every other expert gets 0.
    * Candidates are the experts with a finite biased score (``score + correction_bias``; a NaN or infinite bias
      entry makes its expert no candidate), inside the kept groups. When fewer than ``top_k`` remain (an all-NaN
      row, all -inf logits under softmax, NaN scores in the kept groups), the slots left are *fillers*: the lowest
      expert ids the row has not chosen yet, in increasing order, with weight 0; a row with no finite score gets
      ``0 .. top_k - 1``, all weight 0 (renormalisation leaves a zero sum at 0). So a consumer that indexes by id
      (SGLang's expert kernels, gathers by expert) stays in range; the alignment places the fillers like any slot
      and :func:`fused_moe` adds ``0 * expert(x)`` for them, so the output is the one of the weighted slots alone.
    * A -inf logit scores 0 (sigmoid and softmax alike): a finite candidate of weight 0, chosen only by ties
      (lowest ids) or the bias. Rows of finite logits are routed as if these rules did not exist.

    ``impl="triton"`` is one kernel launch for any M (up to M * top_k = 16 slots one program routes every row
    and aligns in registers; beyond, one program per token and the last program to finish aligns: by one sort up
    to 32 slots, from per-expert row masks up to 64 tokens (with M * top_k <= 1024), by atomic ranks above) and is
    CUDA-graph capturable: output sizes depend only on the shapes, there is no host sync, and
    the per-device workspace (zeroed counters the kernel resets itself) is allocated on the first call, which must
    therefore run outside capture. Calls on different streams must not overlap in time (they share that
    workspace). ``impl="reference"`` synchronises with the host when aligning and is not capturable.

    With ``shared_expert_id`` and no ``block_size`` the router writes the shared slot itself: still one launch (one
    program per token, no workspace), capturable from the first call. With ``block_size`` too it is two launches:
    the routing, then the alignment of the ``M * (top_k + 1)`` slots (the launch :func:`fused_moe` aligns with;
    above 32 slots it uses the per-device workspace, so an eager call must come first, as above).

    Examples
    --------
    >>> import torch, specverify
    >>> logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    >>> ids, w = specverify.moe_route(logits, top_k=2, impl="reference")
    >>> ids.tolist()
    [[1, 2]]
    >>> ids, w = specverify.moe_route(logits, top_k=2, shared_expert_id=4, impl="reference")
    >>> ids.tolist(), w[:, 2].tolist()
    ([[1, 2, 4]], [1.0])
    """
    _check_impl(impl, "moe_route")
    _check_route_args(router_logits, top_k, scoring, correction_bias, n_group, topk_group, renormalize,
                      routed_scaling_factor, block_size)
    _check_shared_expert_id(shared_expert_id, block_size)
    m, e = router_logits.shape
    shared = shared_expert_id is not None
    k_all = top_k + 1 if shared else top_k  # slots per token
    e_all = max(e, shared_expert_id + 1) if shared else e  # experts the alignment counts: the shared id included
    which = _choose(impl, router_logits, "moe_route")
    if which == "reference":
        from specverify.reference.moe import align_reference, route_reference

        ids, weights = route_reference(router_logits, top_k, scoring, correction_bias, n_group, topk_group,
                                       renormalize, routed_scaling_factor)
        if shared:
            ids, weights = append_shared_expert(ids, weights, shared_expert_id, impl="reference")
        if block_size is None:
            return ids, weights
        return ids, weights, _pad_alignment(*align_reference(ids, e_all, block_size), m, k_all, e_all, block_size)
    bias = None if correction_bias is None else correction_bias.float().contiguous()
    if not shared:
        ids, weights, alignment = _launch_route_align(router_logits, bias, top_k, scoring == "softmax", n_group,
                                                      topk_group, renormalize, routed_scaling_factor, block_size)
        return (ids, weights) if block_size is None else (ids, weights, alignment)
    # the router writes the shared slot (no alignment in that launch); the alignment then covers all k_all slots
    ids, weights, _ = _launch_route_align(router_logits, bias, top_k, scoring == "softmax", n_group, topk_group,
                                          renormalize, routed_scaling_factor, None, shared_expert_id=shared_expert_id)
    if block_size is None:
        return ids, weights
    _, _, alignment = _launch_route_align(None, None, k_all, False, 1, 1, False, 1.0, block_size, topk_ids=ids,
                                          num_experts=e_all)
    return ids, weights, alignment


# --------------------------------------------------------------------------------------------- experts
def append_shared_expert(topk_ids, topk_weights, shared_id: int, *, impl: str = "auto"):
    """The shared expert as one more slot of every token: ``[topk_ids, shared_id]`` and ``[topk_weights, 1.0]``.

    DeepSeek-V3 / Kimi-K2 add one shared expert to the routed ones; stacking its weights as expert ``shared_id``
    (= the routed count) after the routed experts lets one :func:`fused_moe` pass serve both, reading the shared
    expert's weights once for all tokens.

    Parameters
    ----------
    topk_ids : Tensor [M, top_k], int32/int64
    topk_weights : Tensor [M, top_k], float
    shared_id : int
        Expert index of the shared expert in the stacked weights (>= 0).
    impl : "auto" | "triton" | "reference"

    Returns
    -------
    (ids, weights) : int32 [M, top_k + 1], fp32 [M, top_k + 1], new contiguous tensors.

    Raises
    ------
    TypeError, ValueError
        Dtypes or shapes that do not match, a negative ``shared_id``.

    One launch on the Triton path (instead of two fills and two concatenations); CUDA-graph capturable.
    """
    _check_impl(impl, "append_shared_expert")
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"append_shared_expert: topk_ids must be an int32/int64 tensor, got "
                        f"{getattr(topk_ids, 'dtype', type(topk_ids).__name__)}")
    if not isinstance(topk_weights, torch.Tensor) or not topk_weights.is_floating_point():
        raise TypeError("append_shared_expert: topk_weights must be a float tensor")
    if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"append_shared_expert: topk_ids and topk_weights must both be [M, top_k], got "
                         f"{list(topk_ids.shape)} and {list(topk_weights.shape)}")
    if not isinstance(shared_id, int) or isinstance(shared_id, bool) or shared_id < 0:
        raise ValueError(f"append_shared_expert: shared_id must be an int >= 0, got {shared_id!r}")
    m, k = topk_ids.shape
    if _choose(impl, topk_ids, "append_shared_expert") != "triton" or m == 0:
        shared = torch.full_like(topk_ids[:, :1], shared_id, dtype=torch.int32)
        ids = torch.cat([topk_ids.to(torch.int32), shared], 1)
        w = torch.cat([topk_weights.float(), torch.ones_like(topk_weights[:, :1], dtype=torch.float32)], 1)
        return ids, w
    from specverify.kernels.moe_route import _append_shared_kernel

    ids = torch.empty(m, k + 1, dtype=torch.int32, device=topk_ids.device)
    w = torch.empty(m, k + 1, dtype=torch.float32, device=topk_ids.device)
    block = 256
    _append_shared_kernel[(_cdiv(m * (k + 1), block),)](topk_ids, topk_weights, ids, w, m, shared_id,
                                                         topk_ids.stride(0), topk_weights.stride(0), TOP_K=k,
                                                         BLOCK=block, **pdl_kwargs(topk_ids.device))
    return ids, w


def _check_shared_expert(hidden, shared) -> None:
    """fused_moe's ``shared_expert``: a pair (w13 [2I', H], w2 [H, I']) in hidden's dtype on its device, rows
    contiguous."""
    if not isinstance(shared, (tuple, list)) or len(shared) != 2 or not all(
            isinstance(t, torch.Tensor) for t in shared):
        raise TypeError(f"shared_expert must be a pair of tensors (w13 [2I, H], w2 [H, I]), got "
                        f"{type(shared).__name__}")
    w13, w2 = shared
    h = hidden.shape[1]
    if w13.dim() != 2 or w2.dim() != 2 or w13.shape[0] % 2 or w13.shape[1] != h or tuple(w2.shape) != (
            h, w13.shape[0] // 2):
        raise ValueError(f"shared_expert must be (w13 [2I, H={h}], w2 [H={h}, I]) with the same I, got "
                         f"{list(w13.shape)} and {list(w2.shape)}")
    if w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise TypeError(f"shared_expert's weights must have hidden's dtype {hidden.dtype} (an unquantised shared "
                        f"expert), got {w13.dtype} and {w2.dtype}; cast them with .to({hidden.dtype})")
    if w13.device != hidden.device or w2.device != hidden.device:
        raise ValueError(f"shared_expert's weights must be on hidden's device {hidden.device}, got {w13.device} "
                         f"and {w2.device}")
    if w13.stride(1) != 1 or w2.stride(1) != 1:
        raise ValueError(f"shared_expert's weights need contiguous rows (stride 1 on the last dimension), got "
                         f"strides {w13.stride()} and {w2.stride()}; pass .contiguous() copies")


def _check_moe_args(hidden, w13, w2, topk_ids, topk_weights, alignment, activation, out, quant):
    for name, t in (("hidden", hidden), ("w13", w13), ("w2", w2), ("topk_ids", topk_ids),
                    ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must have shape [M, H], got shape {list(hidden.shape)}")
    m, h = hidden.shape
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 must be [E, 2I, H] and w2 [E, H, I], got w13 {list(w13.shape)} and w2 "
                         f"{list(w2.shape)}")
    if quant is not None:
        _check_quant_format(quant, w13, w2)
    elif w13.dtype in (torch.uint8, torch.float8_e4m3fn) or w2.dtype in (torch.uint8, torch.float8_e4m3fn):
        raise TypeError(f"w13 / w2 are {w13.dtype} / {w2.dtype}: quantised experts (int4 codes as uint8, fp8) need "
                        "their scales, quant=MoEQuant('int4' or 'fp8', w13_scale, w2_scale, ...); casting them to "
                        "hidden's dtype would drop the scales")
    # int4 holds two codes a byte along the reduced dimension: the shapes below are the unpacked ones
    pk = 2 if quant is not None and quant.format == "int4" else 1
    packed_note = " (int4: the last dimension holds two codes a byte, so it is half of this)" if pk == 2 else ""
    e, two_i, h13 = w13.shape[0], w13.shape[1], w13.shape[2] * pk
    if two_i % 2 or two_i == 0:
        raise ValueError(f"w13 must hold gate rows then up rows, [E, 2I, H] with an even second dimension, got "
                         f"{list(w13.shape)}")
    inter = two_i // 2
    if h13 != h:
        raise ValueError(f"hidden [M={m}, H={h}] and w13 {list(w13.shape)} disagree on H: w13 must be [E, 2I, H={h}]"
                         f"{packed_note} (or hidden [M, H={h13}]); pass the hidden states and gate/up weights of one "
                         "layer")
    if (w2.shape[0], w2.shape[1], w2.shape[2] * pk) != (e, h, inter):
        raise ValueError(f"with hidden [M={m}, H={h}] and w13 {list(w13.shape)} (E={e}, I={inter}), w2 must be "
                         f"[E={e}, H={h}, I={inter}]{packed_note}, got w2 {list(w2.shape)}; pass the down weights of "
                         "the same experts")
    if hidden.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"hidden must be bfloat16, float16 or float32, got {hidden.dtype}; cast it with "
                        ".bfloat16()")
    if quant is None and (w13.dtype != hidden.dtype or w2.dtype != hidden.dtype):
        raise TypeError(f"w13 and w2 must have hidden's dtype {hidden.dtype}, got {w13.dtype} and {w2.dtype}; cast "
                        f"them with .to({hidden.dtype})")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != m or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        fix = (f"reshape them with .view({m}, -1), as moe_route returns them" if topk_ids.numel() % max(m, 1) == 0
               and topk_ids.dim() == 1 and topk_ids.numel() == topk_weights.numel()
               else "route the same tokens as hidden holds")
        raise ValueError(f"topk_ids and topk_weights must both have shape [M={m}, top_k], got "
                         f"{list(topk_ids.shape)} and {list(topk_weights.shape)}; {fix}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}; cast it with .int()")
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be floating point, got {topk_weights.dtype}; cast it with .float()")
    for name, t in (("w13", w13), ("w2", w2), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden on {hidden.device}; move them to one device")
    if activation != "silu":
        raise ValueError(f"activation must be 'silu' (SwiGLU), got {activation!r}")
    if quant is not None:
        _check_quant(quant, hidden, w13, w2, e, h, inter)
    if alignment is not None:
        if not isinstance(alignment, MoEAlignment):
            raise TypeError(f"alignment must be the MoEAlignment that moe_route(..., block_size=...) returns, got "
                            f"{type(alignment).__name__}")
        bs = alignment.block_size
        size = max_num_tokens_padded(m, topk_ids.shape[1], e, bs)
        if alignment.sorted_token_ids.numel() < size or alignment.expert_ids.numel() < size // bs:
            raise ValueError(f"alignment buffers are too small for M={m}, top_k={topk_ids.shape[1]}, E={e}, "
                             f"block_size={bs}: need sorted_token_ids >= {size} and expert_ids >= {size // bs}, "
                             f"got {alignment.sorted_token_ids.numel()} and {alignment.expert_ids.numel()}; "
                             "make it with moe_route(..., block_size=...) on the same tokens")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
        if tuple(out.shape) != (m, h) or out.dtype != hidden.dtype or out.device != hidden.device:
            raise ValueError(f"out must be {hidden.dtype} [M={m}, H={h}] on {hidden.device}, got {out.dtype} "
                             f"{list(out.shape)} on {out.device}")


def _is_pow2(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 2 and int(v) & (int(v) - 1) == 0


_QUANT_DTYPES = {"int4": (torch.uint8, "pass compressed-tensors int32 weight_packed as .view(torch.uint8); pack "
                                      "others with specverify.reference.quant.quantize_int4"),
                 "fp8": (torch.float8_e4m3fn, "quantise with specverify.reference.quant.quantize_fp8_block")}


def _check_layout(quant) -> None:
    if quant.layout not in ("rows", "quads"):
        raise ValueError(f"MoEQuant.layout must be 'rows' or 'quads', got {quant.layout!r}")
    if quant.layout == "quads" and quant.format != "int4":
        raise ValueError(f"MoEQuant.layout='quads' is an int4 layout, got format {quant.format!r}; use "
                         "layout='rows'")


def _check_quant_format(quant, w13, w2) -> None:
    """The record's type, format and layout and the weights' storage dtype (before any shape is read from them)."""
    if not isinstance(quant, MoEQuant):
        raise TypeError(f"quant must be a specverify.moe.MoEQuant or None, got {type(quant).__name__}")
    if quant.format not in _QUANT_DTYPES:
        raise ValueError(f"MoEQuant.format must be 'int4' or 'fp8', got {quant.format!r}")
    _check_layout(quant)
    want, fix = _QUANT_DTYPES[quant.format]
    if w13.dtype != want or w2.dtype != want:
        raise TypeError(f"{quant.format} experts must be {want}, got w13 {w13.dtype} and w2 {w2.dtype}; {fix}")


def _check_quant(quant: MoEQuant, hidden, w13, w2, e: int, h: int, inter: int) -> None:
    """The scales and the group or block sizes (format and storage dtype: :func:`_check_quant_format`; the weights'
    shapes: the caller)."""
    if hidden.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"quantised experts take bfloat16 or float16 hidden states, got {hidden.dtype}; cast it with "
                        ".bfloat16()")
    for name, t in (("w13_scale", quant.w13_scale), ("w2_scale", quant.w2_scale)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"MoEQuant.{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"MoEQuant.{name} must be float32, bfloat16 or float16, got {t.dtype}")
        if t.device != hidden.device:
            raise ValueError(f"MoEQuant.{name} is on {t.device} but hidden on {hidden.device}; move them to one "
                             "device")
    if quant.format == "int4":
        g = quant.group_size
        if not _is_pow2(g):
            raise ValueError(f"MoEQuant.group_size must be a power of two >= 2, got {g!r}")
        if h % g or inter % g:
            raise ValueError(f"int4 experts need H={h} and I={inter} to be multiples of group_size={g}")
        if quant.layout == "quads" and (g < 8 or h % 8 or inter % 8):
            raise ValueError(f"int4 experts in row quads need group_size >= 8 (got {g}) and H={h} and I={inter} "
                             "multiples of 8 (a 32-bit code word of 8 columns, gate and up rows in whole quads); "
                             "keep such weights in layout='rows'")
        quads_kept = (all(t.is_contiguous() for t in (w13, w2, quant.w13_scale, quant.w2_scale))
                      and w13.storage_offset() % 16 == 0 and w2.storage_offset() % 16 == 0)
        if quant.layout == "quads" and not quads_kept:
            raise ValueError("int4 experts in row quads must be the contiguous, 16-byte aligned tensors "
                             "specverify.reference.quant.int4_to_quads returns (weights and scales): a view or a "
                             "slice of rows does not keep the quads (whole experts do); repack what you need")
        s13, s2 = (e, 2 * inter, h // g), (e, h, inter // g)
    else:
        bs = tuple(quant.block_shape) if isinstance(quant.block_shape, (tuple, list)) else ()
        if len(bs) != 2 or not all(_is_pow2(b) for b in bs):
            raise ValueError(f"MoEQuant.block_shape must be two powers of two (bn, bk) >= 2, got "
                             f"{quant.block_shape!r}")
        bn, bk = bs
        if inter % bn:
            raise ValueError(f"fp8 experts need I={inter} to be a multiple of block_shape[0]={bn}: w13 stacks gate "
                             "and up rows, and each scale block row must be all gate or all up; pass the "
                             "checkpoint's block_shape (its weight_block_size), quantised with the same one")
        s13, s2 = (e, _cdiv(2 * inter, bn), _cdiv(h, bk)), (e, _cdiv(h, bn), _cdiv(inter, bk))
    sizes = (f"group_size={quant.group_size}" if quant.format == "int4" else f"block_shape={tuple(quant.block_shape)}")
    for name, t, want in (("w13_scale", quant.w13_scale, s13), ("w2_scale", quant.w2_scale, s2)):
        if tuple(t.shape) != want:
            raise ValueError(f"MoEQuant.{name} must have shape {list(want)} for {quant.format} experts with E={e}, "
                             f"H={h}, I={inter} and {sizes}, got {list(t.shape)}; is {sizes} the one the scales "
                             "were made with?")


#: The routing kernel of the router alone (no alignment; one token row per program), of calls past 1024 slots and of
#: alignment-only calls past ``align_one_max_slots``: its warps. The winners by one bitonic top-k (tl.topk): the
#: router alone took 2.29-2.43 us against 2.96-3.26 us with top_k rounds of argmax (H200, Kimi-K2, run 23).
_ROUTE_CONFIG: dict = {"num_warps": 4}
#: Expert path (benchmarks and sweeps may force one): ``"auto"`` (default: ``"stream"`` at M <=
#: _STREAM_CONFIG["max_m"] (6), else ``"dot"``; H200 sweeps, Kimi-K2 per rank, routed experts (runs 21-22): stream
#: 1.15 / 1.18 / 1.21 / 1.24x the bytes floor at M = 4 / 6 / 7 / 8 against dot 1.26 / 1.20 / 1.19x at M = 6 / 7 /
#: 8), ``"stream"`` (weight streaming for M <= ``_STREAM_CONFIG["max_m"]``: small FMA programs, one down gather over
#: every slot with the top-k sum; two launches, the second a programmatic dependent) or ``"dot"`` (block-aligned
#: tl.dot GEMMs, three launches).
_VARIANT: dict = {"experts": "auto"}
_FAST_MAX_SLOTS = 1024
#: Launch config of the router + alignment (M * top_k <= 1024): largest M * top_k routed and aligned by one program
#: in registers, that program's warps; rows per program and warps beyond it (``wide_warps`` above ``wide_slots``
#: slots); up to ``sorted_max_slots`` slots the multi-program path's last program aligns by one sort (SORTED in the
#: kernel), above it from row masks up to ``mask_max_rows`` tokens (see below), then by atomic ranks; fill chunk.
#: H200 sweeps (Kimi-K2, bench/sweep_moe.py --ops route, graph replay; an empty kernel takes 0.58-0.76 us there):
#: run 23 (commit ebf4c0c), route + align at M = 1 / 4 / 8 / 16 / 64: one program with top-k rounds (the previous
#: default) 3.81 / 5.78 / - / - / -, one program per row with atomic ranks 6.38 / 6.43 / 6.40 / 6.50 / 8.49 (run 21);
#: with the bitonic top-k: one program 3.14 at M = 1 (6.05 at M = 4), one program per row with the sorted
#: alignment 4.68 at M = 4 (5.80 at M = 8, 9.28 at M = 64), with atomic ranks 5.58 / 5.69 / 7.61 at M = 8 / 16 / 64.
#: Run 24 (commit 2eb7238) with those defaults, M = 1 / 2 / 4 / 8 / 16 / 32 / 64: 3.08 / 4.25 / 4.49 / 5.38 / 5.66 /
#: 6.43 / 7.57 us; one program at M = 2 took 4.00, 8 warps per row program 5.79 / 6.38 at M = 32 / 64 (the same at
#: M = 8 and 16, slower at 2 and 4): hence one_max_slots 16 and wide_warps above 128 slots.
#: On the atomic-rank path the last program takes each slot's expert start from the offsets in registers
#: (tl.gather) instead of storing and reloading them: run 37 (commit 1f2254a) 5.45 / 5.49 / 6.26 -> 5.31 / 5.39 /
#: 6.03 us at M = 8 / 16 / 64.
#: The one-program router hands its [rows, top-k] winners to the in-register alignment by a reshape to one slot
#: vector. On the H200 (run 18, Triton 3.6) that reshape double-counted slots when the padded expert count was 16
#: (10 experts: num_tokens_post_padded 2x too large at 1, 4 and 8 warps) and was exact at 256 and 512 (DeepSeek-V3,
#: Kimi-K2: M = 1..16, all warp counts, rows with identical routing). Below this padded expert count the program
#: stores the winners and reads them back as a flat vector instead (one barrier and one L2 round trip); RELOAD
#: forces that read-back at any expert count (tests).
_RESHAPE_MIN_EXPERTS = 256
#: mask_max_rows: past sorted_max_slots, the multi-program path aligns from per-expert row masks up to this many rows
#: (64 at most: one int64 per expert), with num_warps (not wide_warps); ranks and counts are bit counts, so no atomic
#: returns a value before the ticket and the slot order is exact. Run 48 (H200, sweep_moe.py, Kimi-K2): 5.23 / 5.29 /
#: 5.59 / 5.80 us at M = 8 / 16 / 32 / 64 against 5.42 / 5.46 / 5.51 / 5.96 with atomic ranks (wide_warps above
#: 128 slots); at M = 3 / 4 the masks took 5.15 / 5.22 and the sorted path 4.76 / 4.83, so the sorted path stays first.
_FAST_ROUTE_CONFIG: dict = {"one_max_slots": 16, "align_one_max_slots": 32, "one_num_warps": 8,
                            "one_small_slots": 8, "one_small_warps": 4, "ROWS": 1, "num_warps": 4, "wide_slots": 128,
                            "wide_warps": 8, "CHUNK": 1024, "RELOAD": False, "sorted_max_slots": 32,
                            "mask_max_rows": 64}
#: Stream experts (the default at 1 <= M <= ``max_m``; see _fused_moe_stream): gate/up programs of ``R`` gate +
#: ``R`` up rows of one routed slot over H in [R, BK] tiles with ``num_warps`` / ``num_stages``; down programs of
#: ``BH`` output rows x every slot x ``BI`` of I (BH lowered so the gather stays <= ``TILE`` elements) with
#: ``down_warps``; ``PDL``: the down kernel as a programmatic dependent launch (CUDA sm_90+ only). Sized by Little's
#: law: at M = 1 with the shared expert 1152 gate/up programs (~8.7 per SM), each keeping an 8 KB gate+up tile in
#: flight, and 3584 down programs of one ~9 KB gather each. H200 sweeps (Kimi-K2 per rank, bench/sweep_experts.py):
#: per-slot units 30.4 / 56.9 us at M = 1 / 2 with the shared expert against 35.6 / 66.2 with alignment blocks
#: (run 16); R 4, BK 512 without the prefetch: 1.26 / 1.32 / 1.19 / 1.27x the bytes floor at M = 1 / 2 / 4 / 8 with
#: the shared expert, the most even of the configs swept (run 17). Up to ``small_m`` tokens the gate/up programs take
#: ``small_R`` rows instead (twice the programs, each with half the rows in flight): routed experts at M = 1 / 2,
#: R 2 against R 4: 1.25 / 1.18 against 1.35 / 1.25 (run 17), 1.263 / - against 1.27 (run 18), 1.245 / 1.19
#: against 1.25 / 1.23 (run 22); from M = 4 R 4 wins (1.15 against 1.20 at M = 4, run 21). From M = 7 the dot
#: path is faster (``max_m`` 6, see _VARIANT).
#: ``gate_up``: ``"auto"`` (``"splitk"`` up to ``splitk_max_m`` tokens, else ``"fma"``), ``"fma"`` (the FMA programs
#: above) or ``"splitk"`` (``_moe_splitk_gate_up_kernel``: MMA tiles of ``SBN`` gate + ``SBN`` up rows over ``SBK``
#: columns, ``split_stages`` / ``split_warps``, H split until the grid has ``split_waves`` programs per SM). H200,
#: verify-wall Kimi-K2 b 1 / 4k chain, same run (2026-12-02): FMA 5.160 / 6.763 / 9.169 ms at k = 1 / 2 / 4, split-K
#: 2 waves 5.250 / 6.709 / 9.412, 4 waves 5.006 / 6.686 / 9.383; alone (sweep_experts, M = 1 + shared) SBN 16 / 64,
#: SBK 256, 8 warps and 2 stages were 5-20% slower than SBN 32, SBK 128, 4 warps, 3 stages. Tried on 2026-12-03 and
#: removed (bench/RESULTS.md, "Verify pass"): a stream-K gate/up (the units cut evenly over one wave) and TMA weight
#: tiles for both MMA kernels: alone (M = 1 / 2 / 4 + shared) stream-K with TMA, 64-row tiles, one program an SM
#: took 20.76 / 33.44 / 59.25 us against split-K 22.11 / 36.26 / 63.33, but in the pass 4.974 / 6.630 / 9.485 ms at
#: k = 1 / 2 / 4 against 4.975 / 6.644 / 9.253 (up to 4 tokens), and DeepSeek-V3 b 4 k = 1 10.611 against 10.428.
#: Quantised weights (H100, 2026-12-07, commit ef17f19, bench/results/HISTORY.md): the down kernel takes up to 8 rows
#: a program within 16384 elements (``qBH`` / ``qTILE``: 8 / 4 / 2 / 1 rows at 1 / 2 / 3-4 / 5-6 tokens of top-8,
#: bf16's tile 2 / 2 / 1 / 1; ``ab_verify_pass.py --experts-quant int4``: Kimi-K2 5.127 / 6.169 / 8.695 ms at k = 1 /
#: 2 / 4 against 5.178 / 6.249 / 9.100 on bf16's tile; fp8 DeepSeek-V3 b 4 / 16k k = 1, 16 tokens, equal), and the
#: int4 gate/up loads its next tile before this tile's arithmetic (``QPF``: 8.695 against 8.849 ms at k = 4, equal at
#: 1 and 2; fp8 lost with it, 10.458 against 10.272 ms at DeepSeek-V3 k = 1, so fp8 runs without). Above ``max_m``
#: tokens (Kimi-K2 k = 8, DeepSeek-V3 b 4 k >= 2) the dot path runs and neither applies.
#: ``LS`` > 1: the FMA gate/up loop as a ``tl.range`` of LS stages (Triton's pipeliner copies the code, scale and
#: activation tiles into shared memory LS - 1 steps ahead; 0: a plain loop). fp8 takes ``fp8_LS`` from
#: ``fp8_LS_min_m`` tokens. H100, 2026-12-07 (commits 6dcacc7 / 443761e, bench/results/HISTORY.md): fp8 alone 67.80
#: against 72.27 us at M = 4; in the pass (``ab_verify_pass.py --experts-quant fp8``, both orders) DeepSeek-V3 b 4 /
#: 16k k = 1 10.142 against 10.304 ms, Kimi-K2 k = 1 / 2 / 4 4.553 / 5.851 / 8.504 against 4.448 / 5.831 / 8.677.
#: int4 and bf16 lost with it at every M (int4 alone 25.61 against 23.06 us at M = 1; bf16 at M = 4 / 6 119.28 /
#: 176.15 against 117.41 / 169.28; in the pass int4 5.346 / 9.060 against 5.093 / 8.708 ms at k = 1 / 4, bf16
#: 11.395 / 15.364 against 10.903 / 14.553 at k = 4 / 6): their loops stay plain.
#: int4 in row quads (``MoEQuant(layout="quads")``, the ``_q4`` kernels): ``q4RQ`` row quads of gate and of up rows a
#: gate/up program (``q4RQ_m2`` at 2 tokens), ``q4BKW`` code words a step, ``q4_warps``, ``q4LS`` pipeline stages (0:
#: plain loop), ``q4dTILE`` code words of the down tile (``q4dTILE_m1`` at one token: 4 row quads of 8 slots),
#: ``q4_maxnreg`` (ptxas then issues a step's loads together). H100, 2026-12-07, commit 0c646be
#: (``sweep_quant_experts.py --formats int4q --configs ...``, bench/RESULTS.md): defaults 17.76 / 32.84 / 59.03 us at
#: M = 1 / 2 / 4 against rows 22.91 / 38.34 / 79.60; down tile 4096 17.19 / 33.89 / 58.99; 2 gate/up quads 18.58 /
#: 29.60 / 59.52; 256 words a step 18.36 / 32.26 / 61.93; 3 stages 17.80 / 32.43 / 61.32; 64 words on 2 warps 20.49 /
#: 30.80 / 60.94. ``q4_max_m``: the stream path for int4 quads up to 8 tokens (the dot path reads quads with 4-byte
#: loads): H100, commit 3d5f7ed, alone 127.58 against 162.96 us at M = 8 (98.93 / 98.76 at M = 6), in the pass (Kimi-K2
#: int4, ``ab_verify_pass.py --variants fused,stream-m8``) 12.146 against 14.082 ms at k = 8; fp8 lost with it (150.53
#: against 135.90 us at M = 8; 15.365 against 11.697 ms), so fp8 and rows keep ``max_m``. ``q4d_warps_sp64``: the q4
#: down kernel's warps at 64 slot lanes (M 5-8; 4 warps spill 32 B a thread at 128 registers, offline sm_90a). An
#: unquantised shared expert in the q4 gate/up grid (``fused_moe(..., shared_expert=)``): ``q4sR`` gate + up rows a
#: program (1: a program reads 28 KB, as a q4 program of one row quad does), ``q4sBK`` columns a step.
#: ``q4d_one_sum``: the q4 down kernel's top-k sums (and the shared expert's rows) as one reduction over [tokens,
#: top_k] where top_k is a power of two, instead of one masked reduction a token and row (4 x M cross-warp sums). The
#: shared expert's tiles, the warps at 64 lanes and this epilogue are not yet timed on a GPU (compiled offline for
#: sm_90a / sm_120 without spills; the next device call's sweeps decide them).
_STREAM_CONFIG: dict = {"max_m": 6, "small_m": 2, "small_R": 2, "R": 4, "BK": 512, "num_warps": 4, "num_stages": 1,
                        "BH": 2, "BI": 256, "TILE": 8192, "down_warps": 4, "PDL": True, "gate_up": "auto",
                        "splitk_max_m": 2, "SBN": 32, "SBK": 128, "split_stages": 3, "split_warps": 4,
                        "split_waves": 4, "qBH": 8, "qTILE": 16384, "QPF": 1, "LS": 0,
                        "fp8_LS": 4, "fp8_LS_min_m": 4, "q4RQ": 1, "q4RQ_m2": 2, "q4BKW": 128, "q4_warps": 4,
                        "q4LS": 0, "q4dTILE": 2048, "q4dTILE_m1": 4096, "q4_maxnreg": 128, "q4_max_m": 8,
                        "q4d_warps_sp64": 8, "q4sR": 1, "q4sBK": 512, "q4d_one_sum": 0}
#: Overrides merged into the stream config (benchmarks and sweeps only; empty in normal use).
_STREAM_OVERRIDE: dict = {}
#: Tile overrides for benchmarks and sweeps only: keys ``g1`` / ``g2`` (dicts merged into the gate/up and down
#: configs of the dot path, e.g. ``{"g1": {"BLOCK_N": 64, "num_stages": 5}}``). Empty in normal use.
_CONFIG_OVERRIDE: dict = {}


def _gemm_configs(m: int, h: int, inter: int, block_m: int, on_gpu: bool):
    """Pinned tile shapes of the dot path (no autotuning, so the first call compiles once and graphs stay stable)."""
    def fit(b, n):
        return max(16, min(b, _next_pow2(n)))
    if not on_gpu:  # interpreter: few programs, few iterations; its bf16 tl.dot is wrong, so multiply in fp32
        g1 = dict(BLOCK_N=fit(16, inter), BLOCK_K=fit(64, h), UPCAST=True)
        g2 = dict(BLOCK_N=fit(32, h), BLOCK_K=fit(32, inter), UPCAST=True)
    else:
        # gate/up: 32 columns of I per program and 3 stages up to M = 64 (H200, Kimi-K2 per rank, sweep_moe.py
        # DOT_GRID, run 45: 153 / 208 / 250 / 389 / 546 us at M = 8 / 12 / 16 / 32 / 64, 1.05-1.00x the bytes floor,
        # against 175 / 228 / 277 / 429 / 597 us with 16 columns and 4 stages; SGLang's fused experts in the same
        # graphs: 155 / 224 / 284 / 731 / 1643 us)
        small = m <= 64
        g1 = dict(BLOCK_N=fit(32 if small else 64, inter), BLOCK_K=fit(256 if block_m <= 16 else 128, h),
                  num_warps=4, num_stages=3 if small else 4, UPCAST=False)
        g2 = dict(BLOCK_N=fit(64 if m <= 64 else 128, h), BLOCK_K=fit(128, inter), num_warps=4, num_stages=3,
                  UPCAST=False)
    g1.update(_CONFIG_OVERRIDE.get("g1", {}))
    g2.update(_CONFIG_OVERRIDE.get("g2", {}))
    return g1, g2


def _used_blocks_bound(alignment, slots: int) -> int:
    """Blocks the expert grids cover: every used block holds at least one routed slot (each expert's run is its
    slot count rounded up to whole blocks, and used blocks come first), so at most ``slots`` blocks are used. Our own
    alignments are already sized to that (``max_num_tokens_padded`` counts at most ``min(slots, E)`` padded runs);
    the bound matters for alignments a caller allocated for a larger worst case (every expert padded, as SGLang
    sizes its buffers), whose extra blocks would only launch programs that exit at once."""
    return max(1, min(alignment.expert_ids.numel(), slots))


def _expert_operands(hidden, w13, w2, topk_ids, topk_weights):
    """The expert kernels' operands: unit stride along the reduced dimension, int32 ids, fp32 weights."""
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    w13 = w13 if w13.stride(2) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
    return hidden, w13, w2, topk_ids.to(torch.int32).contiguous(), topk_weights.float().contiguous()


def _scale_operands(quant, w, which: str):
    """One expert weight's scale operands for the kernels: ``(scale, stride_se, stride_sn)`` and the constexprs
    ``QUANT`` / ``QG`` / ``QN`` (``which``: ``"w13"`` or ``"w2"``). Unquantised, the weight stands in for its scale
    (never read) with strides 0."""
    if quant is None:
        return (w, 0, 0), dict(QUANT=0, QG=1, QN=1)
    sc = getattr(quant, f"{which}_scale")
    sc = sc if sc.stride(2) == 1 else sc.contiguous()
    if quant.format == "int4":  # in row quads: QUANT 3
        consts = dict(QUANT=3 if quant.layout == "quads" else 1, QG=quant.group_size, QN=1)
    else:
        consts = dict(QUANT=2, QG=quant.block_shape[1], QN=quant.block_shape[0])
    return (sc, sc.stride(0), sc.stride(1)), consts


def _expert_setup(hidden, w13, w2, topk_ids, topk_weights, out):
    """Operands (:func:`_expert_operands`), the sizes every expert launcher uses, and ``out`` (allocated if None):
    ``(hidden, w13, w2, ids32, weights32, M, H, E, I, top_k, slots, out)``."""
    hidden, w13, w2, ids32, tw = _expert_operands(hidden, w13, w2, topk_ids, topk_weights)
    m, h = hidden.shape
    e, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    if out is None:
        out = torch.empty((m, h), dtype=hidden.dtype, device=hidden.device)
    return hidden, w13, w2, ids32, tw, m, h, e, two_i // 2, top_k, m * top_k, out


def _fused_moe_triton(hidden, w13, w2, topk_ids, topk_weights, alignment, out, quant=None):
    from specverify.kernels.fused_moe import _moe_down_kernel, _moe_gate_up_kernel, _moe_topk_sum_kernel

    hidden, w13, w2, ids32, tw, m, h, e, inter, top_k, s, out = _expert_setup(hidden, w13, w2, topk_ids,
                                                                               topk_weights, out)
    q13, qc = _scale_operands(quant, w13, "w13")
    q2, qc2 = _scale_operands(quant, w2, "w2")
    dev = hidden.device
    if alignment is None:
        bs = 16
        _, _, alignment = _launch_route_align(None, None, top_k, False, 1, 1, False, 1.0, bs, topk_ids=ids32,
                                              num_experts=e)
    bs = alignment.block_size
    if bs < 16:
        raise ValueError(f"fused_moe (impl='triton') needs alignment.block_size >= 16 (tensor-core tiles), got {bs};"
                         " align with block_size=16")
    if out is None:
        out = torch.empty((m, h), dtype=hidden.dtype, device=dev)
    if m == 0:
        return out
    part = torch.empty((s, h), dtype=torch.float32, device=dev)
    nblocks = _used_blocks_bound(alignment, s)
    g1, g2 = _gemm_configs(m, h, inter, bs, dev.type == "cuda")
    act = torch.empty((s, inter), dtype=hidden.dtype, device=dev)
    n1 = -(-inter // g1["BLOCK_N"])
    launch_fitting(_moe_gate_up_kernel, (nblocks * n1,), (
        hidden, w13, q13[0], act, alignment.sorted_token_ids, alignment.expert_ids, alignment.num_tokens_post_padded,
        s, hidden.stride(0), w13.stride(0), w13.stride(1), q13[1], q13[2], act.stride(0)),
        dict(H=h, I=inter, TOP_K=top_k, BLOCK_M=bs, **g1, **qc), what="fused_moe")
    n2 = -(-h // g2["BLOCK_N"])
    launch_fitting(_moe_down_kernel, (nblocks * n2,), (
        act, w2, q2[0], part, tw, alignment.sorted_token_ids, alignment.expert_ids, alignment.num_tokens_post_padded,
        s, act.stride(0), w2.stride(0), w2.stride(1), q2[1], q2[2], part.stride(0)),
        dict(H=h, I=inter, BLOCK_M=bs, **g2, **qc2), what="fused_moe")
    bn = min(1024, max(16, _next_pow2(h)))
    _moe_topk_sum_kernel[(m, -(-h // bn))](part, ids32, out, part.stride(0), out.stride(0), E=e, H=h, TOP_K=top_k,
                                          BLOCK_N=bn)
    return out


def _stream_max_m(quant=None) -> int:
    """The most tokens the stream experts take (above them the dot path): ``q4_max_m`` for int4 in row quads, else
    ``max_m``; ``_STREAM_OVERRIDE["max_m"]`` wins (sweeps)."""
    quads = quant is not None and quant.layout == "quads"
    return _STREAM_OVERRIDE.get("max_m", _STREAM_CONFIG["q4_max_m" if quads else "max_m"])


def _stream_config(m: int, h: int, inter: int, top_k: int, on_gpu: bool, quant_format: str | None = None) -> dict:
    """Tiles of the stream experts for ``m`` tokens: ``_STREAM_CONFIG`` with ``_STREAM_OVERRIDE`` merged, clamped to
    the shapes. The down tile [SP, BH, BI] is kept to at most ``TILE`` elements by lowering BH (M = 2 at top-9 needs
    SP = 32 slot lanes against 16 at M = 1). Quantised weights (``quant_format`` "int4" or "fp8") take ``qBH`` /
    ``qTILE``: a stored element is 1 or 1/2 byte, so a program needs more of them for the same bytes in flight; fp8
    from ``fp8_LS_min_m`` tokens also takes ``fp8_LS`` pipeline stages. A key in ``_STREAM_OVERRIDE`` still wins
    (sweeps)."""
    cfg = dict(_STREAM_CONFIG)
    if m <= cfg["small_m"]:
        cfg["R"] = cfg["small_R"]
    if quant_format == "fp8" and m >= cfg["fp8_LS_min_m"]:
        cfg["LS"] = cfg["fp8_LS"]
    if m == 1:
        cfg["q4dTILE"] = cfg["q4dTILE_m1"]
    if m == 2:
        cfg["q4RQ"] = cfg["q4RQ_m2"]
    cfg.update(_STREAM_OVERRIDE)
    if quant_format is not None:
        cfg["BH"] = _STREAM_OVERRIDE.get("BH", cfg["qBH"])
        cfg["TILE"] = _STREAM_OVERRIDE.get("TILE", cfg["qTILE"])
    cfg["R"] = max(1, min(cfg["R"], _next_pow2(inter)))
    cfg["BK"] = max(16, min(cfg["BK"], _next_pow2(h)))
    cfg["BI"] = max(16, min(cfg["BI"], _next_pow2(inter)))
    sp = max(_next_pow2(m * top_k), 2)
    cfg["SP"] = sp
    cfg["BH"] = max(1, min(cfg["BH"], _next_pow2(h), _next_pow2(max(cfg["TILE"] // (sp * cfg["BI"]), 1))))
    if not on_gpu:  # interpreter: no programmatic dependent launch
        cfg["PDL"] = False
    return cfg


def splitk_plan(tiles: int, h: int, bk: int, programs: int) -> tuple[int, int]:
    """(split count, H columns a split) of the split-K gate/up: whole ``bk`` chunks a split, as many splits as
    ``programs`` programs over ``tiles`` (slot, row tile) pairs need, at least one chunk a split."""
    chunks = _cdiv(h, bk)
    want = max(1, _cdiv(programs, tiles))
    per = max(1, chunks // want) * bk
    return _cdiv(h, per), per


#: Workspaces of the split-K gate/up per device: (fp32 partials, int32 tickets that every launch leaves at zero).
_SPLITK_WS: dict = {}


def _splitk_workspace(device, part_elems: int, tickets: int):
    return grown_workspace(_SPLITK_WS, device, (part_elems, tickets), lambda n: (
        torch.empty(n[0], dtype=torch.float32, device=device), torch.zeros(n[1], dtype=torch.int32, device=device)),
        "fused_moe (split-K gate/up)")


def _splitk_gate_up(hidden, w13, act, ids32, s, h, e, inter, top_k, cfg, pdl, quant=None):
    """Launch ``_moe_splitk_gate_up_kernel`` into ``act`` [s, inter]. The workspace is sized for every token count
    up to ``max_m`` on the first call, so a graph captured later at another M needs no allocation."""
    from specverify.kernels.fused_moe import _moe_splitk_gate_up_kernel

    dev = hidden.device
    on_gpu = dev.type == "cuda"
    bn = max(16, min(cfg["SBN"], _next_pow2(inter)))
    bk = max(16, min(cfg["SBK"], _next_pow2(h)))
    nt = _cdiv(inter, bn)
    programs = cfg["split_waves"] * sm_count(dev.type, dev.index)
    need_p, need_t = 0, 0
    for mm in range(1, max(cfg["max_m"], s // top_k) + 1):
        sp, _ = splitk_plan(mm * top_k * nt, h, bk, programs)
        need_p = max(need_p, (sp * mm * top_k * 2 * inter) if sp > 1 else 0)
        need_t = max(need_t, mm * top_k * nt)
    split, per = splitk_plan(s * nt, h, bk, programs)
    part, ticket = _splitk_workspace(dev, max(need_p, 1), need_t)
    launch = {"num_warps": cfg["split_warps"], "num_stages": cfg["split_stages"]} if on_gpu else {}
    if pdl:
        launch["launch_pdl"] = True
    q13, qc = _scale_operands(quant, w13, "w13")
    _moe_splitk_gate_up_kernel[(s * nt, split)](
        hidden, w13, q13[0], act, part, ticket, ids32, hidden.stride(0), w13.stride(0), w13.stride(1), q13[1], q13[2],
        act.stride(0), per, s, E=e, H=h, I=inter, TOP_K=top_k, BN=bn, BK=bk, SPLIT_K=split,
        SPLIT_PAD=max(2, _next_pow2(split)), DOT_FP32=not on_gpu, PDL=pdl, **qc, **launch)


def stream_gate_up(hidden, w13, ids32, cfg: dict, pdl: bool, quant: MoEQuant | None = None,
                   shared_w13: torch.Tensor | None = None) -> torch.Tensor:
    """Launch 1 of the stream experts alone: ``act`` [M * top_k, I] = silu(gate) * up of every routed slot, by the
    kernel ``cfg["gate_up"]`` names (``"auto"``: split-K up to ``splitk_max_m`` tokens, else the FMA programs).
    Operands as :func:`_expert_setup` leaves them (int32 ids [M, top_k]); ``cfg`` from :func:`_stream_config`. Used
    by the stream experts and by ``bench/sweep_experts.py --gate-up-only``. ``quant``: the weights' format and
    scales (:class:`MoEQuant`, as checked by :func:`fused_moe`), or None. ``shared_w13`` (int4 quads only): the
    unquantised shared expert's [2I, H], its act in M more rows (act [M * top_k + M, I])."""
    from specverify.kernels.fused_moe import _moe_stream_gate_up_kernel

    m, h = hidden.shape
    e, two_i, _ = w13.shape
    inter, top_k = two_i // 2, ids32.shape[1]
    s = m * top_k
    act = torch.empty((s + (0 if shared_w13 is None else m), inter), dtype=hidden.dtype, device=hidden.device)
    # quantised weights take the FMA programs at every M: split-K's MMA tiles lost to them at M = 1 and 2 (H100,
    # sweep_quant_experts.py, 2026-12-07: int4 23.1 / 40.0 us against 37.6 / 66.5, fp8 21.2 / 39.1 against 26.5 /
    # 46.3)
    if shared_w13 is not None and (quant is None or quant.layout != "quads"):
        raise ValueError("stream_gate_up runs a shared expert beside int4 experts in row quads only (quant layout "
                         f"'quads'), got {None if quant is None else (quant.format, quant.layout)}")
    splitk = cfg["gate_up"] == "splitk" or (cfg["gate_up"] == "auto" and m <= cfg["splitk_max_m"] and quant is None)
    if splitk and shared_w13 is None:  # a shared expert rides in the q4 grid only (the FMA programs)
        _splitk_gate_up(hidden, w13, act, ids32, s, h, e, inter, top_k, cfg, pdl, quant)
        return act
    q13, qc = _scale_operands(quant, w13, "w13")
    if qc["QUANT"] == 3:
        return _stream_gate_up_quads(hidden, w13, q13, qc, act, ids32, e, inter, top_k, cfg, pdl, shared_w13)
    launch = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]} if hidden.is_cuda else {}
    if pdl:
        launch["launch_pdl"] = True
    nt = _cdiv(inter, cfg["R"])
    _moe_stream_gate_up_kernel[(s * nt,)](
        hidden, w13, q13[0], act, ids32, hidden.stride(0), w13.stride(0), w13.stride(1), q13[1], q13[2],
        act.stride(0), E=e, H=h, I=inter, TOP_K=top_k, R=cfg["R"], BK=cfg["BK"], PDL=pdl, **qc,
        QPF=bool(cfg["QPF"]) and cfg["LS"] <= 1 and quant is not None and quant.format == "int4",
        LSTAGES=cfg["LS"] if cfg["LS"] > 1 else None, **launch)
    return act


def _stream_gate_up_quads(hidden, w13, q13, qc, act, ids32, e, inter, top_k, cfg, pdl, shared_w13=None):
    """``_moe_stream_gate_up_q4_kernel`` into ``act``: int4 gate/up rows in row quads (QUANT 3), ``q4RQ`` quads of
    gate and of up rows a program over ``q4BKW`` code words a step, ``q4_warps`` warps, ``q4LS`` pipeline stages
    (0: a plain loop). ``shared_w13`` [2I, H] (hidden's dtype): the shared expert's programs ride in the same grid
    (``q4sR`` gate and up rows a program, ``q4sBK`` columns a step) into act rows M * top_k + token."""
    from specverify.kernels.fused_moe import _moe_stream_gate_up_q4_kernel

    if hidden.stride(0) % 8 or hidden.storage_offset() % 8:  # the kernel reads activations as 16-byte pairs of 4
        # (torch's allocations are aligned: an offset of whole 16-byte units keeps the rows aligned)
        hidden = hidden.clone()
    m, h = hidden.shape
    on_gpu = hidden.is_cuda
    rq = max(1, min(_next_pow2(cfg["q4RQ"]), _next_pow2(inter // 4)))
    bkw = max(16, min(_next_pow2(cfg["q4BKW"]), _next_pow2(h // 8)))
    # maxnreg: with it ptxas issues a step's loads together at the loop's top (without, it sinks the up rows' and
    # the down's activation loads next to their arithmetic, a round trip each: offline sm_90a SASS)
    launch = {"num_warps": cfg["q4_warps"], "num_stages": 1, "maxnreg": cfg["q4_maxnreg"]} if on_gpu else {}
    if pdl:
        launch["launch_pdl"] = True
    programs = m * top_k * _cdiv(inter // 4, rq)
    if shared_w13 is not None:
        sr = max(1, min(_next_pow2(cfg["q4sR"]), _next_pow2(inter)))
        sbk = max(16, min(_next_pow2(cfg["q4sBK"]), _next_pow2(h)))
        programs += m * _cdiv(inter, sr)
        launch.update(sw_ptr=shared_w13, stride_sw=shared_w13.stride(0), S=m * top_k, SHARED=True, SR=sr, SBK=sbk)
    _moe_stream_gate_up_q4_kernel[(programs,)](
        hidden, w13, q13[0], act, ids32, hidden.stride(0), w13.stride(0), w13.stride(1), q13[1], q13[2],
        act.stride(0), E=e, H=h, I=inter, TOP_K=top_k, RQ=rq, BKW=bkw, PDL=pdl, QG=qc["QG"], ASM=on_gpu,
        F16=hidden.dtype == torch.float16, LSTAGES=cfg["q4LS"] if cfg["q4LS"] > 1 else None, **launch)
    return act


def _stream_down_quads(act, w2, q2, qc, ids32, tw, out, e, h, inter, m, top_k, cfg, launch, pdl, shared_w2=None):
    """``_moe_stream_down_q4_kernel`` into ``out``: int4 w2 in row quads, every slot's code words of as many row
    quads a program as fit ``q4dTILE`` words ([SP, RQ, BW, 4], BW the words of I up to 64). ``shared_w2`` [H, I]
    (act's dtype): the shared expert's output (act rows M * top_k + token) added on the program's rows."""
    from specverify.kernels.fused_moe import _moe_stream_down_q4_kernel

    bw = max(1, min(64, _next_pow2(inter // 8)))
    sp = cfg["SP"]
    rq = 1  # the most row quads (a power of two, at most H / 4 rounded up) whose tile fits q4dTILE words
    while 2 * rq <= _next_pow2(h // 4) and 2 * rq * sp * bw * 4 <= cfg["q4dTILE"]:
        rq *= 2
    if act.is_cuda:
        launch = dict(launch, maxnreg=cfg["q4_maxnreg"])
        if sp >= 64:  # 64 slot lanes (M 5-8): 4 warps spill at 128 registers (sm_90a, sm_120), 8 do not
            launch["num_warps"] = cfg["q4d_warps_sp64"]
    if shared_w2 is not None:
        launch = dict(launch, sw2_ptr=shared_w2, stride_sw2=shared_w2.stride(0), SHARED=True,
                      BIS=max(16, _next_pow2(inter)))
    # one reduction for every token's top-k sum where slot m * top_k + k folds as [SP / top_k, top_k]
    one_sum = bool(cfg["q4d_one_sum"]) and top_k & (top_k - 1) == 0 and top_k <= sp
    _moe_stream_down_q4_kernel[(_cdiv(h // 4, rq),)](
        act, w2, q2[0], ids32, tw, out, act.stride(0), w2.stride(0), w2.stride(1), q2[1], q2[2], out.stride(0), E=e,
        H=h, I=inter, TOP_K=top_k, MT=m, SP=sp, RQ=rq, BW=bw, PDL=pdl, QG=qc["QG"], ASM=act.is_cuda,
        F16=act.dtype == torch.float16, ONE_SUM=one_sum, **launch)
    return out


def _fused_moe_stream(hidden, w13, w2, topk_ids, topk_weights, out, quant=None, shared=None):
    """The weight-streaming experts (the default at M <= ``_STREAM_CONFIG["max_m"]``, ``q4_max_m`` for int4 quads, or
    ``_VARIANT["experts"] == "stream"``): two launches (see "Stream experts" in ``specverify.kernels.fused_moe``).

    Launch 1: program = (routed slot, R gate rows + the same R up rows) over all of H with an FMA loop, SiLU·up
    fused, ``act`` [M·top_k, I] in the input dtype (no alignment needed). Launch 2: program = BH output rows; one
    gather of w2[e_s][rows, :] for every slot, the routed weight and the top-k (+ shared) sum in one fixed-order
    reduction (deterministic, no atomics, no ``part`` buffer). With ``PDL`` (CUDA, sm_90+) both launch as
    programmatic dependents: launch 1 waits for the routing, then lets launch 2 start, which issues its w2 gather
    before waiting for ``act``.
    CUDA-graph capturable: grids depend only on shapes, slots without an expert exit at once, no host sync.
    ``shared`` (int4 in row quads only): the unquantised shared expert's (w13 [2I, H], w2 [H, I]) in the same two
    launches.
    """
    from specverify.kernels.fused_moe import _moe_stream_down_kernel

    hidden, w13, w2, ids32, tw, m, h, e, inter, top_k, s, out = _expert_setup(hidden, w13, w2, topk_ids,
                                                                               topk_weights, out)
    dev = hidden.device
    if m == 0:
        return out
    cfg = _stream_config(m, h, inter, top_k, dev.type == "cuda", None if quant is None else quant.format)
    pdl = _pdl(cfg["PDL"], dev)
    act = stream_gate_up(hidden, w13, ids32, cfg, pdl, quant, None if shared is None else shared[0])
    launch2 = {"num_warps": cfg["down_warps"], "num_stages": 1} if dev.type == "cuda" else {}
    if pdl:  # gate/up waits for the routing, down for gate/up
        launch2["launch_pdl"] = True
    q2, qc = _scale_operands(quant, w2, "w2")
    if qc["QUANT"] == 3:
        return _stream_down_quads(act, w2, q2, qc, ids32, tw, out, e, h, inter, m, top_k, cfg, launch2, pdl,
                                  None if shared is None else shared[1])
    _moe_stream_down_kernel[(_cdiv(h, cfg["BH"]),)](
        act, w2, q2[0], ids32, tw, out, act.stride(0), w2.stride(0), w2.stride(1), q2[1], q2[2], out.stride(0), E=e,
        H=h, I=inter, TOP_K=top_k, MT=m, SP=cfg["SP"], BH=cfg["BH"], BI=cfg["BI"], PDL=pdl, **qc, **launch2)
    return out


def fused_moe(hidden, w13, w2, topk_ids, topk_weights, *, alignment=None, activation="silu", out=None,
              quant=None, shared_expert=None, impl="auto"):
    """SwiGLU mixture of experts: ``out[m] = sum_k w[m,k] * w2[e] @ (silu(gate) * up)``, ``e = topk_ids[m, k]``.

    Built for the verify pass (1–64 tokens per rank), where the cost is reading the activated experts' weights:
    at M <= 6 each routed slot streams its expert's weights (top-8 of hundreds of experts: nearly every slot has its
    own), above that a program owns one block of one expert's slots so each activated expert is read once however
    many tokens chose it. Source: SwiGLU (Shazeer 2020); the block alignment follows the grouped-GEMM layout common
    to MoE kernels.

    Parameters
    ----------
    hidden : torch.Tensor
        Shape: (M, H); bfloat16 or float16 for Triton (float32 only with ``impl="reference"``).
    w13 : torch.Tensor
        Shape: (E, 2 * I, H); hidden's dtype. Rows 0..I-1 gate, I..2I-1 up. With ``quant``: int4 uint8 (E, 2 * I,
        H / 2) or fp8 float8_e4m3fn (E, 2 * I, H) (:class:`MoEQuant`).
    w2 : torch.Tensor
        Shape: (E, H, I); hidden's dtype (with ``quant``: uint8 (E, H, I / 2) or float8_e4m3fn (E, H, I)).
    topk_ids : torch.Tensor
        Shape: (M, top_k); int32 or int64; -1 = no expert (adds nothing). Not range-checked (that would need a
        host sync): the Triton path skips any id outside [0, E) like -1, the reference raises IndexError.
    topk_weights : torch.Tensor
        Shape: (M, top_k); floating point.
    alignment : MoEAlignment, optional
        From ``moe_route(..., block_size=16)`` on these ``topk_ids`` (block_size ≥ 16 for the Triton paths above
        M = 6); its sizes are checked, its contents are not. Unused at M <= 6 (the stream path works per slot);
        when None above that it is computed here (one extra launch).
    activation : {"silu"}
    out : torch.Tensor, optional
        Shape: (M, H); hidden's dtype. Mutated: receives the result.
    quant : MoEQuant, optional
        Quantised weights (int4 group-wise, as Kimi-K2.5 ships its experts, or block fp8, as DeepSeek-V3 and
        Kimi-K2 do): the format and the scales of ``w13`` / ``w2``. hidden must then be bf16 or fp16; every path
        dequantises the weight tiles in registers (W4A16 / W8A16: activations are not quantised).
    shared_expert : tuple of torch.Tensor, optional
        ``(w13 [2I', H], w2 [H, I'])`` in hidden's dtype, last dimension contiguous: an unquantised shared expert
        every token takes with weight 1, added to the routed output (Kimi-K2.5 keeps its shared expert in bf16
        beside INT4 routed experts). With int4 experts in row quads and I' = I it runs inside the stream experts'
        two launches (M <= 8); elsewhere as two matmuls and an add after the routed experts.
    impl : {"auto", "triton", "reference"}

    Returns
    -------
    torch.Tensor
        Shape: (M, H), hidden's dtype (``out`` when given).

    Raises
    ------
    TypeError
        Non-tensor inputs, unsupported or mismatched dtypes (quantised weights of the wrong storage dtype, or uint8 /
        fp8 weights without ``quant``), a wrong ``alignment`` or ``quant`` type, a ``shared_expert`` that is not a pair
        of tensors in hidden's dtype.
    ValueError
        Shapes that do not fit ``[E, 2I, H]`` / ``[E, H, I]`` / ``[M, top_k]``, scales of the wrong shape, group or
        block sizes that are not powers of two, an int4 group that does not divide H and I, an fp8 block row that
        does not divide I (edge blocks along H and I are fine), too-small alignment buffers, a wrong ``out``,
        unknown ``activation``, ``impl`` or quantised format, ``shared_expert`` weights of the wrong shape, on
        another device or without contiguous rows.

    Notes
    -----
    Triton path, M <= 6 (``_STREAM_CONFIG["max_m"]``; 8 for int4 in row quads, ``q4_max_m``): two weight-streaming
    launches: small FMA programs each compute a few rows of one slot's gate/up over all of H, then one gather per
    output tile does the down projection of every slot and the top-k sum, on sm_90+ as a programmatic dependent
    launch; each slot reads its expert's weights (at M <= 6 and top-8 of 384 nearly every slot has its own expert).
    Other M: three launches (gate/up GEMM with fused SiLU·up into a [M·top_k, I] buffer; down GEMM with the routed
    weight applied into a fp32 [M·top_k, H] buffer; a sum over top_k in fixed order). Every path is deterministic.
    bf16/fp16 inputs, fp32 accumulation, the SwiGLU output rounded to the input dtype. CUDA-graph capturable: grids
    depend only on shapes (at most one block per routed slot), unused blocks exit early, no host sync. The reference
    path is capturable too but computes in fp32 with gathered weight copies (slow, memory-hungry).

    Examples
    --------
    >>> import torch, specverify
    >>> x = torch.randn(2, 8); w13 = torch.randn(3, 8, 8); w2 = torch.randn(3, 8, 4)
    >>> ids = torch.tensor([[0, 2], [1, -1]], dtype=torch.int32); w = torch.ones(2, 2)
    >>> specverify.fused_moe(x, w13, w2, ids, w, impl="reference").shape
    torch.Size([2, 8])
    """
    _check_impl(impl, "fused_moe")
    _check_moe_args(hidden, w13, w2, topk_ids, topk_weights, alignment, activation, out, quant)
    if shared_expert is not None:
        _check_shared_expert(hidden, shared_expert)
    which = _choose(impl, hidden, "fused_moe")
    if which == "triton" and hidden.dtype == torch.float32:
        if impl == "triton":
            raise TypeError("fused_moe(impl='triton') needs bfloat16 or float16 hidden/weights, got float32; use "
                            "impl='reference' or cast the inputs")
        # a warning: on a GPU this is the slow path, and the caller can fix it by casting
        _log_once("fused_moe-fp32", "specverify.fused_moe: impl='auto' uses the torch reference for float32 inputs "
                  "(the Triton experts take bfloat16/float16; cast hidden, w13 and w2 to run them)", logging.WARNING)
        which = "reference"
    if which == "reference":
        from specverify.reference.moe import fused_moe_reference

        res = fused_moe_reference(hidden, w13, w2, topk_ids, topk_weights, quant=quant, shared_expert=shared_expert)
        if out is None:
            return res
        out.copy_(res)
        return out
    m = hidden.shape[0]
    stream = _VARIANT["experts"] in ("stream", "auto") and 0 < m <= _stream_max_m(quant)
    fuse = (stream and shared_expert is not None and quant is not None and quant.layout == "quads"
            and shared_expert[1].shape[1] == w13.shape[1] // 2)
    apart = None
    if shared_expert is not None and not fuse:  # beside the routed launches: two matmuls (cuBLAS) in hidden's
        # dtype, then an add; computed first, so an ``out`` that aliases ``hidden`` cannot change its input
        from specverify.reference.moe import shared_expert_reference

        apart = shared_expert_reference(hidden, *shared_expert, compute_dtype=hidden.dtype)
    if stream:
        out = _fused_moe_stream(hidden, w13, w2, topk_ids, topk_weights, out, quant, shared_expert if fuse else None)
    else:
        out = _fused_moe_triton(hidden, w13, w2, topk_ids, topk_weights, alignment, out, quant)
    return out if apart is None else out.add_(apart)
