"""Tree attention for the verify pass: k draft tokens per request attend to a paged KV prefix and their tree ancestors.

Public functions: :func:`tree_attention` (GQA/MHA), :func:`tree_attention_mla` (absorbed MLA), and the plan
builders :func:`plan_tree_attention` / :func:`plan_tree_attention_mla` that fix the split count and workspace from
maxima so a call can be captured in a CUDA graph. Kernels: ``specverify/kernels/tree_attention.py`` (Triton).
Reference (the definition of correct): ``specverify/reference/attention.py``.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass, field

import torch

from specverify import envvars
from specverify.fit import launch_fitting, pdl_launch, shared_memory_limit_bytes, sm_count, spill_bytes
from specverify.validation import capturing, check_tree_mask

logger = logging.getLogger("specverify")

__all__ = [
    "TreeAttentionPlan",
    "plan_tree_attention",
    "plan_tree_attention_mla",
    "tree_attention",
    "tree_attention_mla",
]

_IMPLS = ("auto", "triton", "reference")
_FLOAT_DTYPES = (torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)
#: Upper bound on a forced split count (the merge kernel reads all splits of a row in one tile).
MAX_SPLITS = 128
#: Upper bound on the split count the heuristic picks. At batch 1 and 32k context with one program per split (k <= 4
#: on the Kimi-K2 rank: 8-32 query rows) a cap of 64 filled 64 of the H200's 132 SMs; 128 splits took 19.99 / 21.51
#: / 29.60 us at k = 1 / 2 / 4 against 33.47 / 34.39 / 46.32 (bench/sweep_attention.py --only long, run 29).
HEURISTIC_MAX_SPLITS = 128
#: Keys a config may carry (see :func:`plan_tree_attention`).
_CONFIG_KEYS = ("BLOCK_N", "BLOCK_DV", "BLOCK_M", "num_warps", "num_stages", "KERNEL", "PAGE_AHEAD", "PDL")
#: Kernels a config may name with ``KERNEL``: the ``tl.dot`` kernel of ``kernels/tree_attention.py`` and the Gluon MLA
#: kernel of ``kernels/tree_attention_wgmma.py`` (CUDA sm_90 where it compiles: :func:`mla_wgmma_support`).
_KERNELS = ("default", "mla_wgmma")
#: A split should read at least this many KV bytes per program, or the merge costs more than the split saves.
MIN_SPLIT_BYTES = 64 * 1024


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------
def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _desc(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)} on {t.device}"


@functools.lru_cache(maxsize=None)
def _log_once(message: str) -> None:
    logger.info(message)


@functools.lru_cache(maxsize=1)
def _wgmma_kernels():
    from specverify.kernels import tree_attention_wgmma as kernels  # imports triton.experimental.gluon

    return kernels


@functools.lru_cache(maxsize=1)
def _kernels():
    from specverify.kernels import tree_attention as kernels  # imports triton

    return kernels


def _triton_usable(device: torch.device) -> tuple[bool, str]:
    try:
        _kernels()
    except Exception as exc:  # noqa: BLE001 - any import failure means no Triton path
        return False, f"Triton could not be imported ({type(exc).__name__}: {exc})"
    if device.type == "cuda":
        return True, ""
    if device.type == "cpu" and envvars.triton_interpret():
        return True, ""
    return False, f"tensors are on {device} and TRITON_INTERPRET is not 1 (Triton runs on CUDA devices)"


def _resolve_impl(impl: str, device: torch.device, op: str) -> str:
    if impl not in _IMPLS:
        raise ValueError(f"{op}: impl must be one of {_IMPLS}, got {impl!r}; use 'auto' unless you need one path")
    if impl == "reference":
        return "reference"
    ok, why = _triton_usable(device)
    if impl == "triton":
        if not ok:
            raise ValueError(f"{op}: impl='triton' cannot run: {why}; pass CUDA tensors, set TRITON_INTERPRET=1 "
                             "for the CPU interpreter, or use impl='auto'/'reference'")
        return "triton"
    if envvars.get_flag("SPECVERIFY_DISABLE_TRITON"):
        _log_once(f"{op}: impl='auto' uses the torch reference because SPECVERIFY_DISABLE_TRITON=1")
        return "reference"
    if not ok:
        _log_once(f"{op}: impl='auto' falls back to the torch reference: {why}")
        return "reference"
    return "triton"


# ----------------------------------------------------------------------------------------------------------------
# plan: launch geometry and workspace fixed from maxima
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class TreeAttentionPlan:
    """Launch geometry and split-KV workspace for tree attention, fixed from maxima (CUDA-graph safe).

    Build it with :func:`plan_tree_attention` or :func:`plan_tree_attention_mla` once per (max batch, max context,
    draft length) and pass it as ``plan=`` to every call; the split count, tile sizes and workspace addresses then
    never depend on the values of ``prefix_lens``, so the call can be captured and replayed. A call may use any
    batch up to ``max_batch`` and any context (longer contexts just make each split's chunk longer).

    Attributes
    ----------
    max_batch, num_draft_tokens, num_q_heads, num_kv_heads, head_dim, rope_dim, head_dim_v, max_context : int
        The sizes the plan was built for (MLA: ``num_kv_heads = 1``, ``head_dim`` = latent rank, ``rope_dim`` 64).
    num_splits : int
        KV splits per (request, KV head); 1 means no workspace and no merge kernel.
    config : dict
        ``BLOCK_M, M_TILES, BLOCK_N, BLOCK_DV, DV_TILES, BLOCK_K, num_warps, num_stages, KERNEL, PAGE_AHEAD, PDL``
        (``KERNEL`` ``"default"`` (the ``tl.dot`` kernel) or ``"mla_wgmma"`` (the Gluon kernel; ``num_stages`` is
        its KV buffer count, ``PDL`` launches it and the split merge as programmatic dependents); ``PAGE_AHEAD``
        (``tl.dot`` kernel): each tile loads the next tile's page ids, so with ``num_stages`` >= 3 Triton's
        pipeliner multi-buffers the KV tile; set by ``MLA_BANDWIDTH_CONFIG``).
    workspace_out : torch.Tensor or None
        fp32 [max_batch, num_splits, num_draft_tokens, num_q_heads, head_dim_v] (None when ``num_splits == 1``).
    workspace_lse : torch.Tensor or None
        fp32 [max_batch, num_splits, num_draft_tokens, num_q_heads].
    """

    max_batch: int
    num_draft_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rope_dim: int
    head_dim_v: int
    max_context: int
    num_splits: int
    config: dict
    device: torch.device
    workspace_out: torch.Tensor | None = field(default=None, repr=False)
    workspace_lse: torch.Tensor | None = field(default=None, repr=False)

    @property
    def is_mla(self) -> bool:
        return self.rope_dim > 0

    @property
    def workspace_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.workspace_out, self.workspace_lse) if t is not None)


def _choose_config(*, mla: bool, rows: int, head_dim: int, head_dim_v: int, interpret: bool,
                   config: dict | None, bandwidth: bool = False, device: torch.device | None = None) -> dict:
    """The launch config: ``config`` if given, else the default for the kernel family (MLA: ``MLA_BANDWIDTH_CONFIG``
    when ``bandwidth``, i.e. the splits walk two or more KV tiles, else ``MLA_CONFIGS[0]``)."""
    kernels = _kernels()
    if config is not None:
        base = dict(config)
    elif interpret:
        base = dict(kernels.INTERPRETER_CONFIG)
    elif mla:
        # 16 or 32 rows per program (more rows use M tiles): the [BLOCK_M, 512] fp32 accumulator stays in registers
        base = dict(kernels.MLA_BANDWIDTH_CONFIG if bandwidth else kernels.MLA_CONFIGS[0])
        base["BLOCK_M"] = min(base["BLOCK_M"], _next_pow2(max(16, rows)))
    else:
        base = dict(kernels.GQA_CONFIGS[0] if head_dim <= 128 else
                    {"BLOCK_N": 32, "BLOCK_DV": None, "num_warps": 4, "num_stages": 2})
    unknown = set(base) - set(_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"config has unknown keys {sorted(unknown)}; expected " + ", ".join(_CONFIG_KEYS))
    kernel = base.get("KERNEL", "default")
    if kernel not in _KERNELS:
        raise ValueError(f"config KERNEL must be one of {_KERNELS}, got {kernel!r}")
    if kernel == "mla_wgmma":
        return _choose_wgmma_config(base, mla=mla, rows=rows, head_dim=head_dim, head_dim_v=head_dim_v,
                                    interpret=interpret, device=device)
    if base.get("PDL"):
        raise ValueError("config PDL is a key of KERNEL='mla_wgmma' (the Gluon MLA kernel and its split merge), got "
                         "it with the tl.dot kernel; drop PDL")
    block_m = base.get("BLOCK_M") or min(kernels.MAX_BLOCK_M, _next_pow2(max(16, rows)))
    block_dv = base.get("BLOCK_DV") or _next_pow2(max(16, head_dim_v))
    block_dv = min(block_dv, _next_pow2(max(16, head_dim_v)))
    block_n = int(base["BLOCK_N"])
    for name, value in (("BLOCK_M", block_m), ("BLOCK_N", block_n), ("BLOCK_DV", block_dv)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"config {name} must be a power of two >= 16 (tl.dot tiles), got {value}")
    return {
        "BLOCK_M": block_m,
        "M_TILES": _cdiv(rows, block_m),
        "BLOCK_N": block_n,
        "BLOCK_DV": block_dv,
        "DV_TILES": _cdiv(head_dim_v, block_dv),
        "num_warps": int(base.get("num_warps", 4)),
        "num_stages": int(base.get("num_stages", 2)),
        "KERNEL": "default",
        "PAGE_AHEAD": bool(base.get("PAGE_AHEAD", False)),
        "PDL": False,
    }


#: Row tile of the Gluon MLA kernel where a program holds 33-64 query rows (DeepSeek-V3 k 3 / 4, Kimi-K2 k 5-8): two
#: tiles of this many rows, not one 64-row tile. The split count halves with the doubled M tiles, so the fp32 partials
#: halve in all; their store, which every program makes at its end with no KV stream left to overlap, and the merge are
#: the largest costs above the KV read at these rows. H100, attention + merge, µs (`bench/probe_mla_parts.py`,
#: bench/results/HISTORY.md): DeepSeek-V3 b 4 / 16k / page 1 / top-2 tree k 4 42.9 against 47.0 (the split kernel
#: alone 38.3 / 39.1, the merge 4.6 / 7.9); Kimi-K2 b 1 / 4k k 8 11.7 / 13.0. In the pass (`ab_verify_pass.py`,
#: variant `mla-m64`): 26.470 against 26.520 ms at DeepSeek-V3 k 4, 16.891 against 17.016 at Kimi-K2 k 8; at 40-48
#: rows (commit 70eaee3) 13.206 against 13.304 at Kimi-K2 k 5, 15.159 against 15.317 at k 6, 22.531 against 22.707
#: at DeepSeek-V3 k 3 (bench/results/HISTORY.md). At 128 rows two 64-row tiles stay (`sweep_attention.py --only
#: dsv3`, DeepSeek-V3 k 8: 63.4 against 71.5 µs for four 32-row tiles). Read at plan time (the A/B clears the plan
#: cache).
MLA_WGMMA_64_ROW_TILE = 32


def _choose_wgmma_config(base: dict, *, mla: bool, rows: int, head_dim: int, head_dim_v: int,
                         interpret: bool, device: torch.device | None = None) -> dict:
    """Geometry of the Gluon wgmma MLA kernel: 64 KV tokens (wgmma M) x BLOCK_M query rows (wgmma N, 16..64; 33-64
    rows take two tiles of ``MLA_WGMMA_64_ROW_TILE``), ``num_stages`` KV buffers (2: 188 KiB of shared memory at
    32 rows). Warps unless the config names them: 4 up to 32 rows, 8 for 64; a 32-row tile takes 8 on a CUDA
    ``device`` where 4 spill (:func:`_wgmma_warps_32`)."""
    if not mla or head_dim != head_dim_v or head_dim % 64:
        raise ValueError("config KERNEL='mla_wgmma' is for tree_attention_mla with a kv_lora_rank that is a multiple "
                         f"of 64 (value = latent), got head_dim {head_dim}, head_dim_v {head_dim_v}; drop KERNEL")
    if interpret:
        raise ValueError("config KERNEL='mla_wgmma' is a Gluon kernel for CUDA sm_90+ and has no CPU interpreter; "
                         "drop KERNEL under TRITON_INTERPRET=1")
    wg = _wgmma_kernels()
    if not wg.AVAILABLE:
        raise ValueError(f"config KERNEL='mla_wgmma' is written in Gluon for Triton's Hopper API, which cannot be "
                         f"used here: {wg.UNAVAILABLE_REASON}; drop KERNEL")
    extra = {key for key in ("PAGE_AHEAD", "BLOCK_DV") if base.get(key)}
    if extra:
        raise ValueError(f"config KERNEL='mla_wgmma' does not take {sorted(extra)} (one value tile, its own "
                         "double-buffered copies); drop them")
    block_m = int(base.get("BLOCK_M") or (MLA_WGMMA_64_ROW_TILE if 32 < rows <= 64 else
                                          min(64, _next_pow2(max(16, rows)))))
    block_n = int(base.get("BLOCK_N", 64))
    stages = int(base.get("num_stages", 2))
    if block_m not in (16, 32, 64) or block_n != 64 or stages != 2:
        raise ValueError(f"config KERNEL='mla_wgmma' takes BLOCK_M 16, 32 or 64, BLOCK_N 64 and num_stages 2, got "
                         f"{block_m}, {block_n}, {stages}")
    return {
        "BLOCK_M": block_m,
        "M_TILES": _cdiv(rows, block_m),
        "BLOCK_N": block_n,
        "BLOCK_DV": head_dim,
        "DV_TILES": 1,
        "num_warps": int(base.get("num_warps") or (8 if block_m > 32 else
                                                    _wgmma_warps_32(device) if block_m == 32 else 4)),
        "num_stages": stages,
        "KERNEL": "mla_wgmma",
        "PAGE_AHEAD": False,
        "PDL": bool(base.get("PDL", False)),
    }


#: Longest split (tokens) a small program (<= 16 query rows) should walk alone; longer ones get more splits.
SMALL_PROGRAM_SPLIT_TOKENS = 2048


def _choose_num_splits(*, batch: int, programs_per_split: int, max_prefix: int, bytes_per_token: int,
                       block_n: int, num_sms: int, small_programs: bool = False) -> int:
    """Splits so that batch x programs x splits is about one wave of SMs, each split reading >= 64 KiB of KV.

    H200 sweep (bench/sweep_verify_kernels.py): at batch 1 more, shorter splits win (Kimi-K2 at 4k: 27 us at 31
    splits, 14 us at 63); where the batch already gives about a wave, two waves were slower for MLA (Kimi-K2
    batch 64: 190 us at 2 splits, 229 us at 5) and for GQA 8:1 batch 64 (102 us at 2, 149 us at 3). The split
    count is the most that still fits in one wave (floor of SMs / programs): rounding up spilled a few programs
    into a second wave (Kimi-K2 batch 8 at 32k: 272 us at 17 splits, 213 us at 16; batch 64 at 4k: 251 us at 3
    splits, 191 us at 2). Small programs (<= 16 query rows, several resident per SM) over long prefixes do better
    with more, shorter splits than one wave gives (Llama-3.1-8B batch 8 at 32k: 467 us = 55% of copy bandwidth at
    3 splits of 11k tokens, 314 us = 81% at 16 splits of 2k): their splits are shortened to at most
    ``SMALL_PROGRAM_SPLIT_TOKENS`` tokens, up to 8 waves.
    """
    base = batch * programs_per_split
    if base >= num_sms or max_prefix <= 0:
        return 1
    min_tokens = _cdiv(max(block_n, MIN_SPLIT_BYTES // max(1, bytes_per_token)), block_n) * block_n
    by_length = max(1, max_prefix // min_tokens)
    splits = max(1, min(num_sms // base, by_length, HEURISTIC_MAX_SPLITS))
    if small_programs:
        cap = max(1, min(8 * num_sms // base, by_length, HEURISTIC_MAX_SPLITS))
        while splits < cap and _cdiv(max_prefix, splits) > SMALL_PROGRAM_SPLIT_TOKENS:
            splits = min(cap, splits * 2)
    # The kernel gives each split ceil(ceil(prefix / splits) / block_n) tiles, which can leave the last splits
    # empty (Kimi-K2 at 4k: 63 splits of 2 tiles = 32 working splits, 17.8 us; 64 splits of 1 tile: 13.7 us on
    # the H200). Round up to whole tiles per split when that adds at most 10% more splits, else drop the empty
    # splits (same work per split, fewer partial results to merge).
    tiles = _cdiv(max_prefix, block_n)
    working = _cdiv(tiles, _cdiv(tiles, splits))
    if working == splits:  # no empty split
        return splits
    more = _cdiv(tiles, max(1, tiles // splits))
    return more if more <= min(HEURISTIC_MAX_SPLITS, splits + max(1, splits // 10)) else working


def _make_plan(*, max_batch, k, hq, hkv, d, dr, dv, max_context, device, dtype_bytes, v_is_k, num_splits,
               config, allocate=True, allow_wgmma=True) -> TreeAttentionPlan:
    device = torch.device(device)
    interpret = device.type == "cpu"
    max_prefix = max(0, max_context - k)

    if config is None and allow_wgmma and _wgmma_default(device, d=d, dr=dr, dv=dv):
        config = dict(_wgmma_kernels().MLA_WGMMA_DEFAULT)

    def plan_for(bandwidth: bool):
        """(config, split count) for the default or the bandwidth tile."""
        c = _choose_config(mla=dr > 0, rows=(hq // hkv) * k, head_dim=d, head_dim_v=dv, interpret=interpret,
                           config=config, bandwidth=bandwidth, device=device)
        if config is None and dr > 0 and c["KERNEL"] == "default" and c["BLOCK_M"] > 16 and \
                _small_shared_memory(device):
            # sm_120 (RTX PRO 6000, RTX 5090: 99 KiB a block): the [32, 512] query and accumulator tiles of the
            # tl.dot MLA kernel need more than that even at one stage (offline compile matrix); 16 rows a tile fit
            # (92-94 KiB), the rows go to more M tiles
            c = dict(c, BLOCK_M=16, M_TILES=_cdiv((hq // hkv) * k, 16))
        if config is None and dr == 0 and not interpret and 64 < d <= 128 and c["num_warps"] == 4 and \
                (c["BLOCK_M"] == 64 or (c["BLOCK_M"] == 32 and _small_shared_memory(device))):
            # GQA d 128, 64 query rows a tile (Llama 8:1 at k >= 8; offline compile matrix, spill stores per thread
            # at 255 registers on 4 warps -> 8 warps): sm_90a 0 / 192 / 300 / 328 B -> 0 on Triton 3.6 / 3.7 / 3.8
            # / 3.9 (3.6: 220 -> 167 registers), sm_120 196 / 248 / 276 B -> 0 on 3.7 / 3.8 / 3.9; 32 rows (k 4)
            # on sm_120 spilled 68 B on 3.7 (0 on 8 warps, 190 registers). Same tiles and shared memory. Only where
            # the 4-warp kernel spills (the launch compiles it first): on Triton 3.6 it does not, and 8 warps measured
            # slower there (H200, GQA 8:1 b 64 / 4k / k 16: 158.0 us against 132.2 us on 4).
            c = dict(c, SPILL_WARPS=8)
        if num_splits is not None:
            return c, num_splits
        return c, _choose_num_splits(batch=max_batch, programs_per_split=_programs_per_split(c, hkv),
                                     small_programs=c["BLOCK_M"] <= 16 and c["KERNEL"] != "mla_wgmma",
                                     max_prefix=max_prefix,
                                     bytes_per_token=(d + dr + (0 if v_is_k else dv)) * dtype_bytes,
                                     block_n=c["BLOCK_N"], num_sms=sm_count(device.type, device.index))

    cfg, num_splits = plan_for(False)
    if config is None and dr > 0 and not interpret and _splits_walk_tiles(
            max_prefix=max_prefix, num_splits=int(num_splits), block_n=cfg["BLOCK_N"]):
        cfg, num_splits = plan_for(True)
        if cfg["PAGE_AHEAD"] and cfg["BLOCK_M"] == 32 and int(num_splits) == 1:
            # the page-ahead tile with one split per request (batch >= SMs / row tiles: Kimi-K2 batch 64 at k 8 / 16,
            # batch 132 at k 4) spilled 12 B/thread at 255 registers on Triton 3.9, sm_90a (4 B at k 4; 0 on 3.6-3.8,
            # 252-255 registers); 32 KV tokens a tile keep the 3-stage pipeline: 0 B, 184-224 registers on 3.6-3.9
            # (offline compile matrix). Only the tl.dot fallback on sm_90 (the Gluon kernel is the default there).
            cfg = dict(cfg, BLOCK_N=32)
    cfg["BLOCK_K"] = _next_pow2(max(16, k))
    num_splits = int(num_splits)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}; pass None for the heuristic")
    plan = TreeAttentionPlan(max_batch=max_batch, num_draft_tokens=k, num_q_heads=hq, num_kv_heads=hkv,
                             head_dim=d, rope_dim=dr, head_dim_v=dv, max_context=max_context,
                             num_splits=num_splits, config=cfg, device=device)
    if cfg["KERNEL"] == "mla_wgmma" and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] != 9:
        raise ValueError(f"config KERNEL='mla_wgmma' uses Hopper's wgmma (sm_90), but {device} is sm_"
                         f"{''.join(map(str, torch.cuda.get_device_capability(device)))}; drop KERNEL")
    if num_splits > 1 and allocate:
        plan.workspace_out = torch.empty(max_batch, num_splits, k, hq, dv, dtype=torch.float32, device=device)
        plan.workspace_lse = torch.empty(max_batch, num_splits, k, hq, dtype=torch.float32, device=device)
    return plan


#: Per-block shared memory under which the MLA plan keeps 16 query rows a tile (sm_120 gives 99 KiB, sm_90 227 KiB).
SMALL_SHARED_MEMORY_BYTES = 160 * 1024


def _small_shared_memory(device: torch.device) -> bool:
    """Whether ``device`` (CUDA) lets a block use less than :data:`SMALL_SHARED_MEMORY_BYTES` of shared memory."""
    return device.type == "cuda" and shared_memory_limit_bytes(device) < SMALL_SHARED_MEMORY_BYTES


def _wgmma_default(device: torch.device, *, d: int, dr: int, dv: int) -> bool:
    """True where an MLA plan without a config takes the Gluon wgmma kernel (``MLA_WGMMA_DEFAULT``): a 64-dim rope
    part, a latent of whole 64-column blocks and :func:`mla_wgmma_support` says yes (a CUDA sm_90 device whose
    Triton has the Gluon API and compiles the kernel for it). H200 (run 31, Kimi-K2 rank, k 4): 84 us (84% of copy
    bandwidth) at batch 64 / 4k and batch 8 / 32k against 151-152 us for the Triton page-ahead kernel; 11.3 against
    13.4 us at batch 1 / 4k."""
    if dr != 64 or d != dv or d % 64:
        return False
    return mla_wgmma_support(device)[0]


def mla_wgmma_support(device) -> tuple[bool, str]:
    """Whether the Gluon wgmma MLA kernel (``kernels/tree_attention_wgmma.py``) can be the default on ``device``,
    and why (or why not), as ``(ok, reason)``.

    A capability test, not a version list: the interpreter and CPUs say no; ``SPECVERIFY_MLA_WGMMA=0`` says no;
    else Gluon's Hopper API must import in this Triton, the device must be sm_90 (wgmma: H100 / H200; sm_100 and
    sm_120 have none) and the kernel must compile for the device's target (once per device, at Kimi-K2's sizes;
    the answer is cached, like :mod:`specverify.fit`'s shared-memory check). Host only; it compiles, it launches
    nothing.
    """
    device = torch.device(device)
    if envvars.triton_interpret():
        return False, "TRITON_INTERPRET=1 (Gluon has no CPU interpreter)"
    if device.type != "cuda":
        return False, f"no CUDA device (tensors on {device.type})"
    if envvars.get("SPECVERIFY_MLA_WGMMA") == "0":
        return False, "SPECVERIFY_MLA_WGMMA=0"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _wgmma_probe(index, tuple(torch.cuda.get_device_capability(index)))[:2]


@functools.lru_cache(maxsize=None)
def _wgmma_probe(index: int, capability: tuple[int, int]) -> tuple[bool, str, int]:
    """The device part of :func:`mla_wgmma_support`, cached per (device index, capability): (ok, reason, warps of a
    32-row tile)."""
    import triton

    try:
        wg = _wgmma_kernels()
    except Exception as exc:  # noqa: BLE001 - any import failure means no Gluon path
        return False, f"the Gluon kernel does not import on Triton {triton.__version__} ({type(exc).__name__}: " \
                      f"{exc})", 4
    if not wg.AVAILABLE:
        return False, wg.UNAVAILABLE_REASON, 4
    arch = f"sm_{capability[0]}{capability[1]}"
    if capability[0] != 9:
        return False, f"{arch} has no wgmma (the Gluon kernel is for sm_90: H100 / H200)", 4
    err, spill = _wgmma_compile(wg, index, num_warps=4)
    if err:
        return False, f"the Gluon kernel does not compile for {arch}a on Triton {triton.__version__} ({err})", 4
    why = f"Triton {triton.__version__} has Gluon and the kernel compiles for {arch}a"
    if spill:
        # Triton 3.9 (offline compile matrix): a [512, 32] fp32 accumulator on one warpgroup spills 56 B/thread
        # (255 registers); on two, 156 registers and no spill. Triton 3.6 (the H200 figures): 4 warps, no spill.
        err8, spill8 = _wgmma_compile(wg, index, num_warps=8)
        if not err8 and spill8 < spill:
            return True, f"{why} (32-row tiles on 8 warps: 4 spill {spill} B/thread, 8 spill {spill8})", 8
    return True, why, 4


def _wgmma_warps_32(device: torch.device | None) -> int:
    """Warps of the Gluon kernel's 32-row tile on ``device``: 4 (one warpgroup, the H200 figures), or 8 where this
    Triton's 4-warp kernel spills registers on that device (the probe of :func:`mla_wgmma_support` compiled both)."""
    if device is None or device.type != "cuda" or envvars.triton_interpret():
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _wgmma_probe(index, tuple(torch.cuda.get_device_capability(index)))[2]


def _wgmma_compile(wg, index: int, *, num_warps: int) -> tuple[str, int]:
    """Compile (``warmup``: no launch) the Gluon kernel for device ``index`` at the Kimi-K2 rank's sizes (8 heads,
    k 4 = 32 query rows, latent 512 + rope 64, 64-token pages, 2 splits, a tree mask, PDL) with ``num_warps``:
    ('', local bytes per thread (spills)) when it compiles, else (the error's last line, 0). The compiled kernel
    stays in Triton's cache."""
    heads, k, d, dr, ps, splits = 8, 4, 512, 64, 64, 2
    cfg = dict(wg.MLA_WGMMA_DEFAULT)
    # Triton compiles for the current device: make it ``index`` (only switched when it differs)
    with torch.cuda.device(index) if index != torch.cuda.current_device() else contextlib.nullcontext():
        buf = torch.empty(1 << 12, dtype=torch.float32, device="cuda")  # every pointer a 16-byte aligned view
        q, i32, u8 = buf.view(torch.bfloat16), buf.view(torch.int32), buf.view(torch.uint8)
        try:
            compiled = wg._tree_attention_mla_wgmma_kernel.warmup(
                q, q, q, i32, i32, u8, q, buf, buf, buf, 0.1,
                k * heads * d, heads * d, d, k * heads * dr, heads * dr, dr, ps * (d + dr), d + dr,
                64, 0, 1, k * heads * d, heads * d, d,
                NUM_DRAFT=k, NUM_Q_HEADS=heads, PAGE_SIZE=ps, NUM_SPLITS=splits, D=d, DR=dr, BLOCK_R=heads * k,
                BLOCK_N=cfg["BLOCK_N"], NUM_BUF=cfg["num_stages"], HAS_MASK=True, STORE_LSE=False, PDL=cfg["PDL"],
                EARLY_KV=wg.EARLY_KV, num_warps=num_warps, grid=(1, splits, 1))
        except Exception as exc:  # noqa: BLE001 - a compile failure is the answer
            lines = str(exc).strip().splitlines()
            return f"{type(exc).__name__}: {(lines[-1] if lines else '')[:200]}", 0
        try:  # the spill count is read when the kernel is loaded (on a GPU: no launch)
            spill = spill_bytes(compiled)
        except Exception:  # noqa: BLE001 - unknown: keep the default warps
            spill = 0
    return "", spill


def _splits_walk_tiles(*, max_prefix: int, num_splits: int, block_n: int) -> bool:
    """True when a split walks two or more KV tiles of ``block_n`` tokens, so the next tile can be prefetched while
    one is used: the MLA plan then takes ``MLA_BANDWIDTH_CONFIG`` (page ids one tile ahead, KV multi-buffered)."""
    return _cdiv(_cdiv(max_prefix, max(1, num_splits)), block_n) >= 2


def _programs_per_split(cfg: dict, hkv: int) -> int:
    """Grid axis 0: KV heads x row tiles x value tiles (MLA has one KV head)."""
    return hkv * cfg["M_TILES"] * cfg["DV_TILES"]


def _check_plan_sizes(**sizes) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "max_context" else 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def plan_tree_attention(*, max_batch: int, num_draft_tokens: int, num_q_heads: int, num_kv_heads: int,
                        head_dim: int, max_context: int, device, dtype: torch.dtype = torch.bfloat16,
                        num_splits: int | None = None, config: dict | None = None) -> TreeAttentionPlan:
    """Fix the launch geometry and workspace of :func:`tree_attention` (GQA/MHA) from maxima.

    Parameters
    ----------
    max_batch : int
        Largest batch a call will pass.
    num_draft_tokens : int
        k, the draft tokens per request (tree nodes, root included).
    num_q_heads, num_kv_heads, head_dim : int
        Model sizes per rank; ``num_q_heads % num_kv_heads == 0``.
    max_context : int
        Largest ``prefix_len + num_draft_tokens``; the split count is chosen for it (never from run-time lengths).
    device : torch.device or str
    dtype : torch.dtype
        Cache dtype (bf16 or fp16); used for the bytes-per-split heuristic.
    num_splits : int, optional
        Force the split count (1..128); default: a heuristic from batch, context and the SM count (at most 128).
    config : dict, optional
        Tile override (``BLOCK_N``, ``BLOCK_DV``, ``BLOCK_M``, ``num_warps``, ``num_stages``, ``PAGE_AHEAD``), for
        benchmarks (``GQA_CONFIGS`` / ``MLA_CONFIGS`` / ``MLA_BANDWIDTH_CONFIG`` in
        ``specverify/kernels/tree_attention.py``); for :func:`plan_tree_attention_mla` also ``KERNEL="mla_wgmma"``
        (the Gluon kernel of ``specverify/kernels/tree_attention_wgmma.py``: both products on wgmma with the KV
        tokens as M; CUDA sm_90 (H100 / H200) only; ``BLOCK_M`` 16/32/64, ``PDL``). Without a config an MLA plan
        on an sm_90 GPU where :func:`mla_wgmma_support` says yes (this Triton has Gluon's Hopper API and compiles the
        kernel for the device: Triton 3.6-3.9 offline) takes ``MLA_WGMMA_DEFAULT`` (Triton 3.6 on the H200: 88-90%
        of copy bandwidth at Kimi-K2 batch 64 / 4k and batch 8 / 32k, 9.5 us at batch 1 / 4k / k 4; set
        ``SPECVERIFY_MLA_WGMMA=0`` to keep the ``tl.dot`` kernel); elsewhere (sm_80, sm_100, sm_120: ``tl.dot`` on
        mma.sync; on sm_120's 99 KiB a block 16 query rows a tile) one whose splits walk two or more KV tiles takes
        ``MLA_BANDWIDTH_CONFIG`` (the page ids one tile ahead, the KV tile multi-buffered), else
        ``MLA_CONFIGS[0]``.

    Returns
    -------
    TreeAttentionPlan
        Holds the workspace (allocated here, on ``device``); pass it as ``plan=``.

    Raises
    ------
    ValueError
        Non-positive sizes, heads that do not divide, a split count out of range or a bad config.
    """
    _check_plan_sizes(max_batch=max_batch, num_draft_tokens=num_draft_tokens, num_q_heads=num_q_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, max_context=max_context)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return _make_plan(max_batch=max_batch, k=num_draft_tokens, hq=num_q_heads, hkv=num_kv_heads, d=head_dim, dr=0,
                      dv=head_dim, max_context=max_context, device=device,
                      dtype_bytes=torch.empty((), dtype=dtype).element_size(), v_is_k=False,
                      num_splits=num_splits, config=config)


def plan_tree_attention_mla(*, max_batch: int, num_draft_tokens: int, num_heads: int, max_context: int, device,
                            kv_lora_rank: int = 512, rope_dim: int = 64, dtype: torch.dtype = torch.bfloat16,
                            num_splits: int | None = None, config: dict | None = None) -> TreeAttentionPlan:
    """Fix the launch geometry and workspace of :func:`tree_attention_mla` from maxima.

    Same as :func:`plan_tree_attention` with ``num_heads`` query heads sharing one latent KV of ``kv_lora_rank``
    (the value dim too) plus ``rope_dim`` rope key columns.
    """
    _check_plan_sizes(max_batch=max_batch, num_draft_tokens=num_draft_tokens, num_heads=num_heads,
                      max_context=max_context, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)
    return _make_plan(max_batch=max_batch, k=num_draft_tokens, hq=num_heads, hkv=1, d=kv_lora_rank, dr=rope_dim,
                      dv=kv_lora_rank, max_context=max_context, device=device,
                      dtype_bytes=torch.empty((), dtype=dtype).element_size(), v_is_k=True,
                      num_splits=num_splits, config=config)


# ----------------------------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------------------------
def _check_tensor(op, name, t, *, ndim, dtypes, what):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor ({what}), got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = "/".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{op}: {name} must be {names} ({what}), got {_desc(t)}; convert it with .to(...)")
    if t.dim() != ndim:
        raise ValueError(f"{op}: {name} must be {ndim}-D ({what}), got {_desc(t)}")


def _check_common(op, *, q, device, page_table, prefix_lens, tree_mask, page_size, batch, k):
    _check_tensor(op, "page_table", page_table, ndim=2, dtypes=_INDEX_DTYPES, what="[batch, max_pages] page ids")
    _check_tensor(op, "prefix_lens", prefix_lens, ndim=1, dtypes=_INDEX_DTYPES, what="[batch] prefix lengths")
    for name, t in (("page_table", page_table), ("prefix_lens", prefix_lens)):
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device} but q is on {device}; move it with .to(q.device)")
    if page_table.shape[0] != batch:
        raise ValueError(f"{op}: page_table must have one row per request, [batch={batch}, max_pages], got "
                         f"{list(page_table.shape)}")
    if prefix_lens.shape[0] != batch:
        raise ValueError(f"{op}: prefix_lens must be [batch={batch}], got {list(prefix_lens.shape)}")
    if page_table.shape[1] * page_size < k:
        raise ValueError(f"{op}: page_table has {page_table.shape[1]} pages of {page_size} tokens per request, "
                         f"fewer than the {k} draft tokens; widen the page table")
    if tree_mask is not None:
        nb = _cdiv(k, 8)
        if not isinstance(tree_mask, torch.Tensor) or tree_mask.dtype != torch.uint8 or \
                tuple(tree_mask.shape) not in ((k, nb), (batch, k, nb)):
            got = _desc(tree_mask) if isinstance(tree_mask, torch.Tensor) else type(tree_mask).__name__
            raise ValueError(f"{op}: tree_mask must be uint8 of shape [num_draft_tokens, ceil(num_draft_tokens/8)] "
                             f"= [{k}, {nb}] (shared) or [batch, {k}, {nb}] (per request), got {got}; build it with "
                             "DraftTree.packed_mask() / BatchedDraftTree.packed_mask, or pass None for a chain")
        if tree_mask.device != device:
            raise ValueError(f"{op}: tree_mask is on {tree_mask.device} but q is on {device}; move it with "
                             ".to(q.device)")


def _check_out(op, out, shape, dtype, device):
    if out is None:
        return
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(shape) or out.dtype != dtype \
            or out.device != device:
        got = _desc(out) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"{op}: out must be {str(dtype).replace('torch.', '')} {list(shape)} on {device}, got {got};"
                         " allocate it with torch.empty_like on the expected shape or pass None")
    if out.stride(-1) != 1:
        raise ValueError(f"{op}: out must have a contiguous last dim (stride 1), got strides {out.stride()}")


def _check_data(op, *, page_table, prefix_lens, k, page_size, num_pages) -> None:
    """Value checks: needs a host sync, so callers skip it under graph capture or with validate=False."""
    lens = prefix_lens.long()
    total = lens + k
    max_pages = page_table.shape[1]
    n_used = (total + page_size - 1) // page_size  # pages each request reads
    used = torch.arange(max_pages, device=page_table.device).view(1, -1) < n_used.clamp(max=max_pages).view(-1, 1)
    ids = page_table.long()
    bad_page = used & ((ids < 0) | (ids >= num_pages))
    stats = torch.stack([lens.min(), total.max(), bad_page.any().long()]).tolist()
    if stats[0] < 0:
        b = int(torch.nonzero(lens < 0)[0, 0])
        raise ValueError(f"{op}: prefix_lens must be >= 0, got prefix_lens[{b}] = {int(lens[b])}")
    capacity = max_pages * page_size
    if stats[1] > capacity:
        b = int(torch.argmax(total))
        raise ValueError(f"{op}: request {b} needs prefix_lens + num_draft_tokens = {stats[1]} KV tokens but the page "
                         f"table holds {max_pages} pages x {page_size} = {capacity}; widen the page table or shorten "
                         "the prefix")
    if stats[2]:
        b, p = (int(x) for x in torch.nonzero(bad_page)[0])
        raise ValueError(f"{op}: page_table[{b}, {p}] = {int(ids[b, p])} is out of range [0, {num_pages}) and request "
                         f"{b} reads that page; every page a request reads must be a page of the cache")


def _check_plan(op, plan, *, batch, k, hq, hkv, d, dr, dv, device):
    if not isinstance(plan, TreeAttentionPlan):
        raise TypeError(f"{op}: plan must be a TreeAttentionPlan from plan_tree_attention(_mla), got "
                        f"{type(plan).__name__}")
    want = dict(num_draft_tokens=k, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, rope_dim=dr, head_dim_v=dv)
    have = {name: getattr(plan, name) for name in want}
    if want != have:
        raise ValueError(f"{op}: plan was built for {have} but the call has {want}; build a plan for these sizes")
    if batch > plan.max_batch:
        raise ValueError(f"{op}: batch {batch} exceeds the plan's max_batch {plan.max_batch}; build a larger plan")
    if plan.device != device and not (plan.device.type == device.type and plan.device.index is None):
        raise ValueError(f"{op}: plan lives on {plan.device} but the inputs are on {device}")


# ----------------------------------------------------------------------------------------------------------------
# launch
# ----------------------------------------------------------------------------------------------------------------
def _launch(*, q, qr, kc, vc, k_strides, v_strides, page_table, prefix_lens, tree_mask, sm_scale, out, lse,
            plan, page_size, v_is_k):
    kernels = _kernels()
    batch, k, hq, d = q.shape
    dr = plan.rope_dim
    dv = plan.head_dim_v
    hkv = plan.num_kv_heads
    cfg = plan.config
    splits = plan.num_splits
    store_lse = lse is not None
    if tree_mask is not None:
        tree_mask = tree_mask.contiguous()
        smb, smt = (0, tree_mask.stride(0)) if tree_mask.dim() == 2 else (tree_mask.stride(0), tree_mask.stride(1))
    else:
        smb, smt = 0, 0
    # programmatic dependent launch (the Gluon kernel's config): only on CUDA sm_90+ with SPECVERIFY_PDL on (the
    # interpreter has no grid dependency control)
    pdl = {"launch_pdl": True} if cfg.get("PDL", False) and pdl_launch(q.device) else {}
    if splits > 1:
        ws_o, ws_lse = plan.workspace_out, plan.workspace_lse
        if ws_o is None:  # a plan made without allocation (no plan passed): the graph pool serves this under capture
            ws_o = torch.empty(batch, splits, k, hq, dv, dtype=torch.float32, device=q.device)
            ws_lse = torch.empty(batch, splits, k, hq, dtype=torch.float32, device=q.device)
    else:
        ws_o = ws_lse = out
    qr_t = qr if qr is not None else q
    grid = (_programs_per_split(cfg, hkv), splits, batch)
    mask_arg = tree_mask if tree_mask is not None else page_table
    # arguments both kernels take in the same order: scale (log2 domain), q / q_rope strides, after the cache
    # strides the page table, tree mask and output strides
    scale = float(sm_scale) * 1.4426950408889634
    q_strides = (q.stride(0), q.stride(1), q.stride(2), qr_t.stride(0), qr_t.stride(1), qr_t.stride(2))
    tail = (page_table.stride(0), smb, smt, out.stride(0), out.stride(1), out.stride(2))
    lse_arg = lse if store_lse else out
    if cfg.get("KERNEL") == "mla_wgmma":  # Gluon
        _wgmma_kernels()._tree_attention_mla_wgmma_kernel[grid](
            q, qr_t, kc, page_table, prefix_lens, mask_arg, out, lse_arg, ws_o, ws_lse, scale, *q_strides,
            k_strides[0], k_strides[1], *tail,
            NUM_DRAFT=k, NUM_Q_HEADS=hq, PAGE_SIZE=page_size, NUM_SPLITS=splits, D=d, DR=dr, BLOCK_R=cfg["BLOCK_M"],
            BLOCK_N=cfg["BLOCK_N"], NUM_BUF=cfg["num_stages"], HAS_MASK=tree_mask is not None, STORE_LSE=store_lse,
            PDL=bool(pdl), EARLY_KV=_wgmma_kernels().EARLY_KV, num_warps=cfg["num_warps"], **pdl)
    else:
        launch_fitting(kernels._tree_attention_fwd_kernel, grid, (
            q, qr_t, kc, vc, page_table, prefix_lens, mask_arg, out, lse_arg, ws_o, ws_lse, scale, *q_strides,
            *k_strides, *v_strides, *tail),
            dict(NUM_DRAFT=k, GROUP=hq // hkv, NUM_Q_HEADS=hq, PAGE_SIZE=page_size, NUM_SPLITS=splits, D=d, DR=dr,
                 DV=dv, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=_next_pow2(max(16, d)),
                 BLOCK_DR=_next_pow2(max(16, dr)), BLOCK_DV=cfg["BLOCK_DV"], BLOCK_K=cfg["BLOCK_K"],
                 M_TILES=cfg["M_TILES"], DV_TILES=cfg["DV_TILES"], HAS_MASK=tree_mask is not None, V_IS_K=v_is_k,
                 STORE_LSE=store_lse, DOT_FP32=q.device.type == "cpu", PAGE_AHEAD=cfg.get("PAGE_AHEAD", False),
                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
            what="tree_attention_mla" if dr else "tree_attention",
            spill_fallback={"num_warps": cfg["SPILL_WARPS"]} if cfg.get("SPILL_WARPS") else None)
    if splits > 1:
        _launch_merge(kernels, ws_o, ws_lse, out, lse, batch=batch, k=k, hq=hq, dv=dv, splits=splits, pdl=pdl)


def _launch_merge(kernels, ws_o, ws_lse, out, lse, *, batch, k, hq, dv, splits, pdl):
    """The split-KV merge launch (one program per output row and value tile of up to 4096 / splits columns)."""
    store_lse = lse is not None
    block_s = _next_pow2(max(2, splits))
    block_dv = min(_next_pow2(max(16, dv)), max(16, 4096 // block_s))
    kernels._tree_attention_merge_kernel[(batch * k * hq, _cdiv(dv, block_dv))](
        ws_o, ws_lse, out, lse if store_lse else out,
        out.stride(0), out.stride(1), out.stride(2),
        NUM_DRAFT=k, NUM_Q_HEADS=hq, NUM_SPLITS=splits, DV=dv, BLOCK_S=block_s, BLOCK_DV=block_dv,
        STORE_LSE=store_lse, PDL=bool(pdl), num_warps=4, num_stages=1, **pdl,
    )


@functools.lru_cache(maxsize=256)
def _cached_plan(max_batch, k, hq, hkv, d, dr, dv, max_context, device_type, device_index, dtype_bytes, v_is_k,
                 allow_wgmma=True):
    device = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    return _make_plan(max_batch=max_batch, k=k, hq=hq, hkv=hkv, d=d, dr=dr, dv=dv, max_context=max_context,
                      device=device, dtype_bytes=dtype_bytes, v_is_k=v_is_k, num_splits=None, config=None,
                      allocate=False, allow_wgmma=allow_wgmma)


def _wgmma_copy_aligned(*tensors: torch.Tensor) -> bool:
    """Whether the Gluon MLA kernel can copy these tensors' rows in 16-byte ``cp.async`` pieces: every base address
    16-byte aligned and every stride but the last a multiple of 16 elements (the divisibility Triton specialises on;
    with less it cannot prove the alignment and the copy does not compile)."""
    return all(t.data_ptr() % 16 == 0 and all(st % 16 == 0 for st in t.stride()[:-1]) for t in tensors)


def _finish(out_ref, out, lse_ref, return_lse):
    if out is not None:
        out.copy_(out_ref)
        out_ref = out
    return (out_ref, lse_ref) if return_lse else out_ref


# ----------------------------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------------------------
def tree_attention(q, k_cache, v_cache, *, page_table, prefix_lens, tree_mask=None, sm_scale, out=None,
                   return_lse=False, impl="auto", plan=None, validate=True):
    """Tree attention (GQA/MHA) of k draft tokens per request over a paged KV cache.

    Request b's KV sequence is ``prefix_lens[b] + k`` tokens read through ``page_table[b]`` (token t at page
    ``page_table[b, t // page_size]``, slot ``t % page_size``); the draft tokens' KV is already written at
    positions ``prefix_lens[b] .. prefix_lens[b] + k - 1``. Every draft token sees the whole prefix; draft token
    i sees draft token j iff bit j of row i of ``tree_mask`` is set. Slots past a request's length are never read.
    Source: tree attention of SpecInfer (Miao et al., 2024) / EAGLE-2 verification, as a split-KV decode kernel.

    Parameters
    ----------
    q : torch.Tensor
        Shape: (batch, num_draft_tokens, num_q_heads, head_dim); bf16 or fp16; last dim contiguous.
    k_cache, v_cache : torch.Tensor
        Shape: (num_pages, page_size, num_kv_heads, head_dim); q's dtype; last dim contiguous (other strides free,
        so views into a larger pool work). ``num_q_heads % num_kv_heads == 0``.
    page_table : torch.Tensor
        Shape: (batch, max_pages); int32 or int64 page ids. Only the pages a request reads must be valid.
    prefix_lens : torch.Tensor
        Shape: (batch,); int32 or int64; tokens before the draft tokens (0 allowed).
    tree_mask : torch.Tensor or None
        Shape: (num_draft_tokens, ceil(num_draft_tokens / 8)) shared, or (batch, num_draft_tokens,
        ceil(num_draft_tokens / 8)) per request; uint8, little-endian bits, diagonal included
        (:meth:`specverify.tree.DraftTree.packed_mask`). None: a chain (causal).
    sm_scale : float
        Softmax scale, usually ``head_dim ** -0.5``.
    out : torch.Tensor, optional
        Shape: (batch, num_draft_tokens, num_q_heads, head_dim); q's dtype; mutated in place and returned.
    return_lse : bool
        Also return the log-sum-exp (natural log) of the scaled visible scores, fp32 (batch, k, num_q_heads).
    impl : {"auto", "triton", "reference"}
        ``auto`` runs Triton on CUDA (or under TRITON_INTERPRET=1) and otherwise falls back to the reference,
        logging why once; ``triton`` and ``reference`` never fall back.
    plan : TreeAttentionPlan, optional
        From :func:`plan_tree_attention`: fixes split count and workspace from maxima. Without one, both are
        derived from the shapes (batch and ``page_table.shape[1] * page_size``), never from values.
    validate : bool
        Check page ids in range, lengths against the page table and that ``tree_mask`` is the ancestor mask of a
        tree (every row sees its own node, no later node, and its parent's nodes plus itself; a host sync).
        Skipped automatically under CUDA-graph capture; shape/dtype/device checks always run.

    Returns
    -------
    torch.Tensor or (torch.Tensor, torch.Tensor)
        ``out`` (batch, num_draft_tokens, num_q_heads, head_dim) in q's dtype, and with ``return_lse`` the lse.

    Raises
    ------
    TypeError
        A dtype is wrong (q/caches not bf16/fp16 or different, page_table/prefix_lens not int32/int64).
    ValueError
        Shapes disagree, tree_mask has the wrong shape, devices differ, ``out`` or ``plan`` do not fit, an unknown
        ``impl``; with validation: a negative prefix, a request longer than its page table, a page id out of range,
        a tree-mask row that does not see its own node, sees a later node or is not its parent's row plus itself.

    Notes
    -----
    Graph safety: the Triton path does no host sync when validation is skipped (``validate=False`` or under
    capture) and its launch geometry depends only on shapes and the plan, so it can be captured; pass a ``plan``
    so the workspace address is fixed outside the graph's pool. The reference path is not capturable.
    Validation refuses a tree-mask row that does not see its own node; with ``validate=False`` such a row with
    ``prefix_lens[b] == 0`` sees nothing: the kernel gives output 0 and lse -inf (the reference NaN).

    Examples
    --------
    >>> import torch
    >>> from specverify.tree import DraftTree
    >>> q = torch.randn(1, 3, 4, 64, dtype=torch.bfloat16)
    >>> kc = torch.randn(4, 16, 2, 64, dtype=torch.bfloat16); vc = torch.randn_like(kc)
    >>> o = tree_attention(q, kc, vc, page_table=torch.tensor([[2, 0]]), prefix_lens=torch.tensor([20]),
    ...                    tree_mask=DraftTree([-1, 0, 0]).packed_mask(), sm_scale=64 ** -0.5, impl="reference")
    >>> o.shape
    torch.Size([1, 3, 4, 64])
    """
    op = "tree_attention"
    _check_tensor(op, "q", q, ndim=4, dtypes=_FLOAT_DTYPES, what="[batch, num_draft_tokens, num_q_heads, head_dim]")
    _check_tensor(op, "k_cache", k_cache, ndim=4, dtypes=_FLOAT_DTYPES,
                  what="[num_pages, page_size, num_kv_heads, head_dim]")
    _check_tensor(op, "v_cache", v_cache, ndim=4, dtypes=_FLOAT_DTYPES,
                  what="[num_pages, page_size, num_kv_heads, head_dim]")
    batch, k, hq, d = q.shape
    num_pages, page_size, hkv, dk = k_cache.shape
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"{op}: q, k_cache and v_cache must share a dtype, got q {q.dtype}, k_cache {k_cache.dtype}, "
                        f"v_cache {v_cache.dtype}; cast the queries to the cache dtype")
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"{op}: v_cache must have k_cache's shape {list(k_cache.shape)}, got {list(v_cache.shape)}")
    if dk != d:
        raise ValueError(f"{op}: q head_dim {d} != cache head_dim {dk}; q must be [batch, k, num_q_heads, {dk}]")
    if batch < 1 or k < 1 or hq < 1 or d < 1 or num_pages < 1 or page_size < 1 or hkv < 1:
        raise ValueError(f"{op}: every size must be >= 1, got q {list(q.shape)}, k_cache {list(k_cache.shape)}")
    if hq % hkv:
        raise ValueError(f"{op}: num_q_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
    device = q.device
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device} but q is on {device}; keep every input on one device")
        if t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must have a contiguous head_dim (stride 1), got strides {t.stride()}")
    _check_common(op, q=q, device=device, page_table=page_table, prefix_lens=prefix_lens, tree_mask=tree_mask,
                  page_size=page_size, batch=batch, k=k)
    _check_out(op, out, (batch, k, hq, d), q.dtype, device)
    if plan is not None:
        _check_plan(op, plan, batch=batch, k=k, hq=hq, hkv=hkv, d=d, dr=0, dv=d, device=device)
    which = _resolve_impl(impl, device, op)
    if validate and not capturing():
        _check_data(op, page_table=page_table, prefix_lens=prefix_lens, k=k, page_size=page_size,
                    num_pages=num_pages)
        if tree_mask is not None:
            check_tree_mask(op, tree_mask, k)
    if which == "reference":
        from specverify.reference.attention import tree_attention_reference

        res = tree_attention_reference(q, k_cache, v_cache, page_table, prefix_lens, tree_mask, sm_scale,
                                       return_lse=True)
        return _finish(res[0], out, res[1], return_lse)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if plan is None:
        plan = _cached_plan(batch, k, hq, hkv, d, 0, d, page_table.shape[1] * page_size, device.type, device.index,
                            q.element_size(), False)
    if out is None:
        out = torch.empty(batch, k, hq, d, dtype=q.dtype, device=device)
    lse = torch.empty(batch, k, hq, dtype=torch.float32, device=device) if return_lse else None
    _launch(q=q, qr=None, kc=k_cache, vc=v_cache, k_strides=k_cache.stride()[:3], v_strides=v_cache.stride()[:3],
            page_table=page_table, prefix_lens=prefix_lens, tree_mask=tree_mask, sm_scale=sm_scale, out=out, lse=lse,
            plan=plan, page_size=page_size, v_is_k=False)
    return (out, lse) if return_lse else out


def tree_attention_mla(q_latent, q_rope, kv_cache, *, page_table, prefix_lens, tree_mask=None, sm_scale, out=None,
                       return_lse=False, impl="auto", plan=None, validate=True):
    """Absorbed-MLA tree attention (DeepSeek-V3 / Kimi-K2): every head attends to one latent KV per token.

    ``score = sm_scale * (q_latent . c + q_rope . k_rope)`` with ``c = kv_cache[..., :R]`` (the latent, also the
    value) and ``k_rope = kv_cache[..., R:]``; the output stays in the latent space (apply W_UV after). Paging,
    tree-mask and length semantics are those of :func:`tree_attention`.
    Source: DeepSeek-V2 (MLA with weight absorption) and FlashMLA's decode formulation, with a tree mask.

    Parameters
    ----------
    q_latent : torch.Tensor
        Shape: (batch, num_draft_tokens, num_heads, R), R = kv_lora_rank (512); bf16 or fp16; last dim contiguous.
    q_rope : torch.Tensor
        Shape: (batch, num_draft_tokens, num_heads, Dr), Dr = rope dim (64); q_latent's dtype.
    kv_cache : torch.Tensor
        Shape: (num_pages, page_size, R + Dr) or (num_pages, page_size, 1, R + Dr); q_latent's dtype; last dim
        contiguous.
    page_table, prefix_lens, tree_mask, return_lse, impl, validate
        As in :func:`tree_attention`.
    sm_scale : float
        Softmax scale of the un-absorbed head dim (``(qk_nope_dim + qk_rope_dim) ** -0.5``, 192 ** -0.5 for
        DeepSeek-V3), not of R + Dr.
    out : torch.Tensor, optional
        Shape: (batch, num_draft_tokens, num_heads, R); q_latent's dtype; mutated in place and returned.
    plan : TreeAttentionPlan, optional
        From :func:`plan_tree_attention_mla`.

    Returns
    -------
    torch.Tensor or (torch.Tensor, torch.Tensor)
        out (batch, num_draft_tokens, num_heads, R) and, with ``return_lse``, fp32 lse (batch, k, num_heads).

    Raises
    ------
    TypeError, ValueError
        As in :func:`tree_attention`; also ValueError when ``plan`` was built for the Gluon kernel
        (``KERNEL="mla_wgmma"``) and q_latent, q_rope or kv_cache are not 16-byte aligned with strides (but the last)
        that are multiples of 16 elements (its copies move 16 bytes); without a plan such tensors take the ``tl.dot``
        kernels.

    Notes
    -----
    Graph safety as in :func:`tree_attention`. On an sm_90 GPU where the Gluon kernel compiles
    (:func:`mla_wgmma_support`; Triton 3.6-3.9) the kernel is the Gluon wgmma one
    (``specverify/kernels/tree_attention_wgmma.py``: s^T = K q^T and o^T += V^T p^T, so the 64 KV tokens of a tile
    are wgmma's M however few the query rows), launched with programmatic dependent launch before its split merge;
    elsewhere (other GPUs, a Triton without that Gluon API, the CPU interpreter, ``SPECVERIFY_MLA_WGMMA=0``) the
    ``tl.dot`` kernels of ``specverify/kernels/tree_attention.py``. Both read only the slots below each request's
    length.

    Examples
    --------
    >>> import torch
    >>> ql = torch.randn(1, 2, 8, 512, dtype=torch.bfloat16); qr = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
    >>> kv = torch.randn(3, 16, 576, dtype=torch.bfloat16)
    >>> o = tree_attention_mla(ql, qr, kv, page_table=torch.tensor([[1, 2]]), prefix_lens=torch.tensor([17]),
    ...                        sm_scale=192 ** -0.5, impl="reference")
    >>> o.shape
    torch.Size([1, 2, 8, 512])
    """
    op = "tree_attention_mla"
    _check_tensor(op, "q_latent", q_latent, ndim=4, dtypes=_FLOAT_DTYPES,
                  what="[batch, num_draft_tokens, num_heads, kv_lora_rank]")
    _check_tensor(op, "q_rope", q_rope, ndim=4, dtypes=_FLOAT_DTYPES,
                  what="[batch, num_draft_tokens, num_heads, rope_dim]")
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"{op}: kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dim() == 4 and kv_cache.shape[2] == 1:
        kv_cache = kv_cache.squeeze(2)
    _check_tensor(op, "kv_cache", kv_cache, ndim=3, dtypes=_FLOAT_DTYPES,
                  what="[num_pages, page_size, kv_lora_rank + rope_dim]")
    batch, k, h, r = q_latent.shape
    num_pages, page_size, width = kv_cache.shape
    if q_rope.dtype != q_latent.dtype or kv_cache.dtype != q_latent.dtype:
        raise TypeError(f"{op}: q_latent, q_rope and kv_cache must share a dtype, got {q_latent.dtype}, "
                        f"{q_rope.dtype}, {kv_cache.dtype}; cast the queries to the cache dtype")
    if tuple(q_rope.shape[:3]) != (batch, k, h):
        raise ValueError(f"{op}: q_rope must be [batch={batch}, k={k}, num_heads={h}, rope_dim], got "
                         f"{list(q_rope.shape)}")
    dr = q_rope.shape[3]
    if width != r + dr:
        raise ValueError(f"{op}: kv_cache last dim must be kv_lora_rank + rope_dim = {r} + {dr} = {r + dr}, got "
                         f"{width}")
    if batch < 1 or k < 1 or h < 1 or r < 1 or dr < 1 or num_pages < 1 or page_size < 1:
        raise ValueError(f"{op}: every size must be >= 1, got q_latent {list(q_latent.shape)}, q_rope "
                         f"{list(q_rope.shape)}, kv_cache {list(kv_cache.shape)}")
    device = q_latent.device
    for name, t in (("q_rope", q_rope), ("kv_cache", kv_cache)):
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device} but q_latent is on {device}; keep inputs on one device")
    if kv_cache.stride(-1) != 1:
        raise ValueError(f"{op}: kv_cache must have a contiguous last dim (stride 1), got strides {kv_cache.stride()}")
    _check_common(op, q=q_latent, device=device, page_table=page_table, prefix_lens=prefix_lens,
                  tree_mask=tree_mask, page_size=page_size, batch=batch, k=k)
    _check_out(op, out, (batch, k, h, r), q_latent.dtype, device)
    if plan is not None:
        _check_plan(op, plan, batch=batch, k=k, hq=h, hkv=1, d=r, dr=dr, dv=r, device=device)
    which = _resolve_impl(impl, device, op)
    if validate and not capturing():
        _check_data(op, page_table=page_table, prefix_lens=prefix_lens, k=k, page_size=page_size,
                    num_pages=num_pages)
        if tree_mask is not None:
            check_tree_mask(op, tree_mask, k)
    if which == "reference":
        from specverify.reference.attention import tree_attention_mla_reference

        res = tree_attention_mla_reference(q_latent, q_rope, kv_cache, page_table, prefix_lens, tree_mask,
                                           sm_scale, return_lse=True)
        return _finish(res[0], out, res[1], return_lse)
    if q_latent.stride(-1) != 1:
        q_latent = q_latent.contiguous()
    if q_rope.stride(-1) != 1:
        q_rope = q_rope.contiguous()
    # the Gluon kernel copies q, q_rope and KV rows in 16-byte pieces: without that alignment the automatic plan
    # takes the tl.dot kernels, and a plan built for the Gluon kernel is refused
    if plan is None:
        plan = _cached_plan(batch, k, h, 1, r, dr, r, page_table.shape[1] * page_size, device.type, device.index,
                            q_latent.element_size(), True, _wgmma_copy_aligned(q_latent, q_rope, kv_cache))
    elif plan.config["KERNEL"] == "mla_wgmma" and not _wgmma_copy_aligned(q_latent, q_rope, kv_cache):
        raise ValueError(
            f"{op}: the plan's KERNEL='mla_wgmma' copies rows in 16-byte pieces, so q_latent, q_rope and kv_cache need "
            "16-byte aligned data and strides (but the last) that are multiples of 16 elements; got strides "
            f"{tuple(q_latent.stride())}, {tuple(q_rope.stride())}, {tuple(kv_cache.stride())}; pass contiguous "
            "tensors or build the plan with SPECVERIFY_MLA_WGMMA=0 (or a tl.dot config)")
    if out is None:
        out = torch.empty(batch, k, h, r, dtype=q_latent.dtype, device=device)
    lse = torch.empty(batch, k, h, dtype=torch.float32, device=device) if return_lse else None
    strides = (kv_cache.stride(0), kv_cache.stride(1), 0)
    _launch(q=q_latent, qr=q_rope, kc=kv_cache, vc=kv_cache, k_strides=strides, v_strides=strides,
            page_table=page_table, prefix_lens=prefix_lens, tree_mask=tree_mask, sm_scale=sm_scale, out=out, lse=lse,
            plan=plan, page_size=page_size, v_is_k=True)
    return (out, lse) if return_lse else out
