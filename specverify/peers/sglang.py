"""SGLang's own Triton kernels as a peer baseline, with specverify's semantics.

Source: SGLang 0.5.23 (``pip install --no-deps sglang==0.5.23`` plus its small pure-Python dependencies; see
``shared/gpu-machine.md``). Every wrapper here calls SGLang's kernels with the metadata SGLang itself would build,
so a benchmark against them compares kernels, not semantics. Metadata is built in a ``prepare_*`` step (or, inside
:class:`VerifyAttention`, once per forward into static buffers), never from host copies of tensor values. The
verify forward's ``sglang`` op table (:func:`specverify.forward.ops.sglang_ops`) is composed from these wrappers.

Call paths (module : function, and the SGLang code whose call it reproduces)

================  ================================================================================================
piece             SGLang kernel and how it is called
================  ================================================================================================
tree attention    ``sglang.kernels.ops.attention.extend_attention : extend_attention_fwd``, called as
(k > 1)           ``TritonAttnBackend.forward_extend`` does for ``ForwardMode.TARGET_VERIFY``
                  (``srt/layers/attention/triton_backend.py``): ``qo_indptr = arange(0, (b+1)k, k)``,
                  ``kv_indptr = cumsum(prefix_lens)`` over the *prefix* only, token-level ``kv_indices`` (slot
                  ``page * page_size + offset``, SGLang's ``page_size = 1`` addressing), the draft tokens' K/V passed
                  as ``k_extend``/``v_extend``, ``custom_mask`` a flat uint8 buffer (its ``VerifyMask``, FULL_MASK
                  layout) of ``k * (prefix_b + k)`` entries per request (prefix columns true, draft columns the
                  tree; chains too get the mask, as on a GPU SGLang always reads it) with ``mask_indptr = cumsum``,
                  ``is_causal = True``, ``max_len_extend = k``. Every step the whole mask buffer is memset to true
                  and the draft cells rewritten (``speculative/eagle_utils.py : build_tree_kernel_efficient``, which
                  SGLang runs before each verify); :class:`VerifyAttention` does that inside the pass. MLA:
                  ``k_buffer`` is the 576-wide latent+rope cache viewed ``[slots, 1, 576]``, ``v_buffer`` its first
                  512 columns, ``q = cat(q_latent, q_rope)``.
decode attention  ``sglang.kernels.ops.attention.decode_attention : decode_attention_fwd``, called as
(k = 1)           ``TritonAttnBackend.forward_decode`` does for ``ForwardMode.DECODE``: ``kv_indptr =
                  cumsum(seq_lens)`` with ``seq_lens = prefix + 1`` (the token's KV is written first), token-level
                  ``kv_indices``, persistent zeroed split-KV scratch ``attn_logits`` fp32 [b, H, max_kv_splits, Dv] /
                  ``attn_lse`` fp32 [b, H, max_kv_splits], ``num_kv_splits`` int32 [b] from
                  ``kernels/ops/attention/metadata.py : get_num_kv_splits_triton`` (SM count, heads, lengths) every
                  step, ``max_kv_splits`` 8 (``--triton-attention-num-kv-splits``) raised for MLA by
                  ``_mla_decode_kv_splits_cap`` (256 on an H200), ``has_mla`` for MLA, ``use_pdl`` on sm_90+.
routing           ``sglang.kernels.ops.moe.moe_fused_gate : moe_fused_gate`` (its Triton router), which is what
                  ``srt/layers/moe/topk.py`` reaches on CUDA for Kimi-K2 (``biased_grouped_topk_gpu``, one group),
                  DeepSeek-V3 grouped routing when FlashInfer is absent, sigmoid ``fused_topk`` and softmax
                  ``fused_topk`` (Qwen3). ``apply_routed_scaling_factor_on_output=True`` folds the scaling factor
                  into the weights (specverify's semantics; SGLang may apply it at the expert sum instead, the same
                  product).
alignment         ``sglang.kernels.ops.moe.moe_align_small_numel : moe_align_small_numel`` under SGLang's own gate
                  (``srt/layers/moe/moe_runner/triton_utils/moe_align_block_size.py``): ``numel <= 64`` and more
                  than 63 experts. Outside that gate SGLang calls ``sgl_kernel.moe_align_block_size`` (CUDA); it is
                  used when installed, otherwise the Triton kernel runs there too and the note says so.
experts           ``sglang.kernels.ops.moe.fused_moe_triton_kernels : invoke_fused_moe_kernel`` twice (gate/up with
                  ``top_k``, down with the router weights), as ``_fused_moe_kernel_sequence`` in
                  ``triton_utils/fused_moe.py`` does, with the block config SGLang picks
                  (``get_moe_configs`` tuned JSON for the device, else ``get_default_config``); activation
                  ``act_and_mul_triton`` (SGLang's Triton SiLU-and-mul; its CUDA path uses a JIT-CUDA
                  ``silu_and_mul`` that needs ``tvm_ffi``); combine as ``moe_combine_topk``: direct write for
                  top-1, ``torch.add`` for top-2, ``moe_sum_reduce_triton`` otherwise (SGLang's choice up to 32
                  tokens on Hopper; above that it calls ``sgl_kernel.moe_sum_reduce``, used when installed).
                  Quantised experts (``quant=MoEQuant(...)``): the same sequence with SGLang's int4 W4A16 flags
                  (``fused_moe_kernel_gptq_awq``; on Hopper SGLang's default for int4 is Marlin, not this) or block
                  fp8 W8A8 flags and its config for them; block fp8 activations are quantised per token group by
                  SGLang's JIT-CUDA kernel on CUDA when it builds here, else by its Triton kernel (a stand-in on
                  CUDA, named in ``fn.not_sglang``); see :func:`prepare_fused_experts`.
================  ================================================================================================

Not provided: tree greedy verification and tree speculative sampling. On CUDA SGLang 0.5.23 runs
``verify_tree_greedy`` and ``tree_speculative_sampling_target_only`` as JIT-compiled CUDA (``tvm_ffi``) or
``sgl_kernel`` ops, not Triton; its Triton ``verify_tree_greedy_triton`` (``kernels/ops/speculative/spec_tree.py``)
is the XPU path only, and that module imports ``sgl_kernel`` at import time on CPU;
``chain_speculative_sampling_triton`` handles chains only. Acceptance therefore stays on specverify's reference
in :func:`specverify.forward.ops.sglang_ops`.

Stand-ins: ``sglang.utils`` imports ``IPython.display`` at import time; when IPython is missing an import-only
stand-in module (``HTML``, ``display``) is registered in ``sys.modules`` before SGLang is imported. Nothing else of
SGLang's is patched: the MoE config lookup module is loaded privately from its file (its package ``__init__``
imports ``sgl_kernel`` on CUDA), and where SGLang's server context is not published its ``get_exec`` is replaced in
that private copy only, by one reporting deterministic inference off (SGLang's default).

Import chain of the experts piece: ``fused_moe_triton_kernels`` imports ``sglang.kernels.jit.utils`` (``tvm_ffi``,
the ``apache-tvm-ffi`` wheel), ``dill``, and through ``sglang.srt.batch_invariant_ops`` reaches
``sglang.srt.configs`` and so ``transformers`` and ``torchvision``. Where one of them does not import, the experts
piece is reported missing with the exact error; :func:`specverify.forward.ops.sglang_ops` then keeps specverify's
reference experts, names the gap in its note and marks its table incomplete (``pieces["incomplete"]``), so
``verify-wall`` prints no total for a pass that is not SGLang's.

Graph safety: the wrappers allocate with torch (captured into the graph's pool), never synchronise with the host
and never branch on tensor values. SGLang's kernels are launched with ``launch_pdl`` on Hopper, as SGLang does.
"""
from __future__ import annotations

import dataclasses

import importlib
import importlib.util
import sys
import threading
import types

import torch

from specverify.reference.attention import gather_positions

__all__ = ["available", "pieces", "csr_token_slots", "prepare_tree_attention", "tree_attention", "tree_attention_mla",
           "route", "route_and_align", "align", "prepare_fused_experts", "fused_experts", "VerifyAttention",
           "SGLANG_VERSION"]

SGLANG_VERSION = "0.5.23"  # the version these call paths were read from

_LOCK = threading.Lock()
_STATE: dict = {}


# ------------------------------------------------------------------------------------------------------------
# import


def _install_ipython_standin() -> None:
    """Register an import-only ``IPython`` / ``IPython.display`` when IPython is not importable."""
    try:
        importlib.import_module("IPython.display")
        return
    except Exception:
        for name in ("IPython.display", "IPython"):
            sys.modules.pop(name, None)
    ipython = types.ModuleType("IPython")
    display = types.ModuleType("IPython.display")

    class HTML:  # noqa: D401 - import-only placeholder
        """Placeholder for ``IPython.display.HTML`` (sglang.utils imports it; kernels never call it)."""

        def __init__(self, *args, **kwargs):
            self.data = args[0] if args else kwargs.get("data")

    def _display(*args, **kwargs):
        return None

    display.HTML, display.display = HTML, _display
    ipython.display = display
    # other libraries probe a present IPython (matplotlib reads version_info and calls get_ipython)
    ipython.version_info = (0, 0, 0)
    ipython.get_ipython = lambda: None
    ipython.__path__ = []
    ipython.__specverify_standin__ = True
    display.__specverify_standin__ = True
    sys.modules["IPython"], sys.modules["IPython.display"] = ipython, display


def _load_private(relpath: str, name: str):
    """Load one SGLang source file as a private module (its package ``__init__`` is not executed)."""
    spec = importlib.util.find_spec("sglang")
    root = spec.submodule_search_locations[0]
    path = f"{root}/{relpath}"
    mspec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(mod)
    return mod


class _ExecDefaults:
    """What ``get_exec()`` reports without a server: deterministic inference off (SGLang's default)."""

    class deterministic:  # noqa: N801 - mirrors the attribute path SGLang reads
        enable_deterministic_inference = False


def _load() -> dict:
    """Import the SGLang pieces once; returns {piece: namespace or None} and {piece: reason}."""
    with _LOCK:
        if _STATE:
            return _STATE
        mods, why = {}, {}
        try:
            _install_ipython_standin()
            importlib.import_module("sglang")
        except Exception as exc:
            why["sglang"] = f"import sglang failed: {type(exc).__name__}: {exc}"
            _STATE.update(mods=mods, why=why)
            return _STATE

        def attempt(piece, fn):
            try:
                mods[piece] = fn()
            except Exception as exc:
                mods[piece] = None
                why[piece] = f"{type(exc).__name__}: {exc}"

        def _attn():
            m = importlib.import_module("sglang.kernels.ops.attention.extend_attention")
            return types.SimpleNamespace(extend_attention_fwd=m.extend_attention_fwd)

        def _decode():
            m = importlib.import_module("sglang.kernels.ops.attention.decode_attention")
            meta = importlib.import_module("sglang.kernels.ops.attention.metadata")
            return types.SimpleNamespace(decode_attention_fwd=m.decode_attention_fwd,
                                         get_num_kv_splits_triton=meta.get_num_kv_splits_triton)

        def _router():
            m = importlib.import_module("sglang.kernels.ops.moe.moe_fused_gate")
            return types.SimpleNamespace(moe_fused_gate=m.moe_fused_gate)

        def _align():
            m = importlib.import_module("sglang.kernels.ops.moe.moe_align_small_numel")
            ns = types.SimpleNamespace(small=m.moe_align_small_numel, limit=int(m.SMALL_NUMEL_LIMIT), large=None)
            try:  # SGLang's AOT CUDA alignment (its kernel registry's "moe.moe_align_block_size" AOT target)
                ns.large = importlib.import_module("sgl_kernel").moe_align_block_size
            except Exception:
                ns.large = None
            return ns

        def _experts():
            k = importlib.import_module("sglang.kernels.ops.moe.fused_moe_triton_kernels")
            cfg = _load_private("srt/layers/moe/moe_runner/triton_utils/fused_moe_triton_config.py",
                                "_specverify_sglang_moe_config")
            try:
                cfg.get_exec()
            except Exception:  # no server context published: report SGLang's defaults
                cfg.get_exec = lambda: _ExecDefaults
            ns = types.SimpleNamespace(invoke=k.invoke_fused_moe_kernel, act_and_mul=k.act_and_mul_triton,
                                       sum_reduce=k.moe_sum_reduce_triton, config=cfg, cuda_sum=None)
            # block fp8: invoke_fused_moe_kernel quantises its activations itself, with the JIT-CUDA
            # sglang_per_token_group_quant_fp8 where SGLang's platform probe (``_is_cuda``) says CUDA, else with the
            # Triton kernel behind fp8_kernel.per_token_group_quant_fp8 (``_per_token_group_quant_8bit_raw``)
            fp8 = importlib.import_module("sglang.kernels.ops.quantization.fp8_kernel")
            ns.sees_cuda = bool(getattr(k, "_is_cuda", False))
            ns.group_quant_triton = fp8._per_token_group_quant_8bit_raw
            ns.group_quant_cuda = getattr(fp8, "sglang_per_token_group_quant_fp8", None)
            try:
                ns.cuda_sum = importlib.import_module("sgl_kernel").moe_sum_reduce
            except Exception:
                ns.cuda_sum = None
            return ns

        attempt("attention", _attn)
        attempt("decode", _decode)
        attempt("router", _router)
        attempt("align", _align)
        attempt("experts", _experts)
        try:
            from importlib.metadata import version

            mods["version"] = version("sglang")
        except Exception:
            mods["version"] = getattr(sys.modules.get("sglang"), "__version__", "unknown")
        _STATE.update(mods=mods, why=why)
        return _STATE


def available() -> tuple[bool, str]:
    """Whether SGLang's kernel modules import here, and why not (or which pieces are missing). Never raises.

    Returns
    -------
    ok : bool
        True when at least SGLang's tree/extend attention kernel imports.
    reason : str
        The exact import error when not available; otherwise the version and any missing pieces.
    """
    try:
        st = _load()
    except Exception as exc:  # pragma: no cover - _load already catches; belt and braces for "never raise"
        return False, f"SGLang peer: unexpected {type(exc).__name__}: {exc}"
    mods, why = st["mods"], st["why"]
    if "sglang" in why:
        return False, why["sglang"]
    if mods.get("attention") is None:
        return False, f"sglang.kernels.ops.attention.extend_attention: {why.get('attention')}"
    missing = [f"{p}: {why[p]}" for p in ("decode", "router", "align", "experts") if mods.get(p) is None]
    text = f"sglang {mods.get('version')} Triton kernels importable"
    if missing:
        text += "; missing: " + "; ".join(missing)
    return True, text


def pieces() -> tuple[dict, dict]:
    """The SGLang pieces this process imported (importing them on the first call; never raises).

    Returns
    -------
    mods : dict
        ``attention`` (extend kernel), ``decode`` (decode kernel and its split-count kernel), ``router``,
        ``align`` (``small``, ``limit``, ``large`` or None), ``experts`` (``cuda_sum`` or None, ...): a namespace,
        or None when the piece does not import; ``version``: SGLang's version.
        Empty when SGLang itself does not import.
    why : dict
        piece (or ``sglang``) -> the import error of each missing one.
    """
    st = _load()
    return st["mods"], st["why"]


def _need(piece: str):
    st = _load()
    mod = st["mods"].get(piece)
    if mod is None:
        raise RuntimeError(f"SGLang peer piece {piece!r} unavailable: "
                           f"{st['why'].get(piece) or st['why'].get('sglang')}")
    return mod


# ------------------------------------------------------------------------------------------------------------
# tree attention


def _unpack_tree(tree_mask: torch.Tensor, k: int) -> torch.Tensor:
    """bool [..., k, k] from the bit-packed little-endian uint8 mask [..., k, ceil(k/8)] (no host sync)."""
    j = torch.arange(k, device=tree_mask.device)
    byte = tree_mask.long().index_select(-1, j // 8)  # [..., k, k]
    return ((byte >> (j % 8)) & 1).bool()


def csr_token_slots(page_table, lengths, page_size, pos, out):
    """Token-level ``kv_indices`` as SGLang's backends build them: request b's positions ``0 .. lengths[b] - 1``, each
    as slot ``page * page_size + offset`` (:func:`~specverify.reference.attention.gather_positions`), packed back to
    back into ``out`` from ``starts[b] - lengths[b]``.

    page_table int [b, W]; lengths int64 [b] (at most W * page_size); pos int64 ``arange(W * page_size)``; out any
    integer dtype [b * W * page_size + 1], whose last entry is the dump slot the positions past a length are written
    to. Returns ``starts = cumsum(lengths)`` int64 [b]. Device ops only (graph capturable, no host sync).
    """
    b, L = page_table.shape[0], pos.numel()
    starts = torch.cumsum(lengths, 0)
    p = pos.view(1, L).expand(b, L)
    dest = torch.where(p < lengths.view(b, 1), (starts - lengths).view(b, 1) + p, torch.full_like(p, b * L))
    out.scatter_(0, dest.reshape(-1), gather_positions(page_table, p, page_size).to(out.dtype).reshape(-1))
    return starts


class _AttnPlan:
    """SGLang TARGET_VERIFY metadata for one (batch, k, page-table shape, page size), in static buffers that
    :meth:`refresh` rewrites in place from the current page table, prefix lengths and tree mask.

    Buffers: ``qo_indptr`` int32 [b+1]; ``kv_indptr`` int32 [b+1] (prefix only); ``kv_indices`` int64
    [b * L + 1] (L = pages per row * page_size; the last entry is a dump slot for masked writes);
    ``draft_slots`` int64 [b * k]; ``custom_mask`` uint8 [b * k * (L + k)] (SGLang's ``VerifyMask`` buffer in
    FULL_MASK layout, sized for a captured batch of b and a context of L) and ``mask_indptr`` int64 [b+1].

    A chain gets the full custom mask too (its draft block lower-triangular): on a GPU SGLang's Triton backend reads
    the mask in FULL_MASK mode (``default_tree_mask_mode``), so ``build_tree_kernel_efficient`` builds one for
    every verify, chains included (its QLEN_ONLY ``build_chain_tree`` path is for backends that do not read it).
    """

    def __init__(self, batch, k, max_pages, page_size, device):
        self.b, self.k, self.page_size = batch, k, page_size
        self.L = max_pages * page_size
        dev = device
        self.qo_indptr = torch.arange(0, (batch + 1) * k, k, dtype=torch.int32, device=dev)
        self.kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=dev)
        self.kv_indices = torch.zeros(batch * self.L + 1, dtype=torch.int64, device=dev)
        self.draft_slots = torch.zeros(batch * k, dtype=torch.int64, device=dev)
        self.pos = torch.arange(self.L, device=dev)
        self.jk = torch.arange(k, device=dev)
        self.chain = (self.jk.view(k, 1) >= self.jk.view(1, k)).to(torch.uint8)  # [k, k], draft i sees 0..i
        self.custom_mask = torch.zeros(batch * k * (self.L + k), dtype=torch.uint8, device=dev)
        self.mask_indptr = torch.zeros(batch + 1, dtype=torch.int64, device=dev)
        self.first_cache_ptr = None

    def refresh(self, page_table, prefix_lens, tree_mask, num_head=None, num_kv_head=None):
        """One step's metadata, as SGLang rebuilds it every verify step (heads are not needed here).

        ``kv_indptr`` / ``kv_indices`` over the prefix (``_update_target_verify_buffers``), ``mask_indptr`` the
        cumsum of ``k * (prefix + k)``, and the mask itself: ``custom_mask.fill_(1)`` over the whole buffer (what
        ``build_tree_kernel_efficient`` does with a preallocated FULL_MASK buffer, ``tree_mask.fill_(True)``), then
        the ``k * k`` draft cells of each request written (SGLang's build-tree kernel writes them; here a scatter).
        """
        b, k = self.b, self.k
        prefix = prefix_lens.long()
        self.kv_indptr[1:].copy_(csr_token_slots(page_table, prefix, self.page_size, self.pos, self.kv_indices))
        dpos = prefix.view(b, 1) + self.jk.view(1, k)
        self.draft_slots.copy_(gather_positions(page_table, dpos, self.page_size).reshape(-1))
        rowlen = prefix + k  # [b]
        mstarts = torch.cumsum(k * rowlen, 0)
        self.mask_indptr[1:].copy_(mstarts)
        self.custom_mask.fill_(1)  # the per-step memset of the whole buffer (prefix columns true)
        tree = self.chain if tree_mask is None else _unpack_tree(tree_mask, k).to(torch.uint8)
        if tree.dim() == 2:
            tree = tree.unsqueeze(0).expand(b, k, k)
        mbegin = (mstarts - k * rowlen).view(b, 1, 1)
        cells = (mbegin + self.jk.view(1, k, 1) * rowlen.view(b, 1, 1) + prefix.view(b, 1, 1)
                 + self.jk.view(1, 1, k))  # row i, draft column j of request b
        self.custom_mask.scatter_(0, cells.reshape(-1), tree.reshape(-1))

    def run(self, q3, k_buffer, v_buffer, sm_scale, v_dim):
        """q3 [b*k, H, Lq]; k_buffer/v_buffer [slots, Hkv, *]; returns o [b*k, H, v_dim]."""
        fwd = _need("attention").extend_attention_fwd
        k_ext = k_buffer[self.draft_slots]  # the draft tokens' K (SGLang passes the freshly projected k)
        v_ext = v_buffer[self.draft_slots].contiguous()
        o = q3.new_empty((q3.shape[0], q3.shape[1], v_dim))
        fwd(q3, k_ext, v_ext, o, k_buffer, v_buffer, self.qo_indptr, self.kv_indptr, self.kv_indices,
            self.custom_mask, True, self.mask_indptr, self.k, 1.0, 1.0, sm_scale)
        return o


#: SGLang's ``--triton-attention-num-kv-splits`` default (``srt/arg_groups/fields/exec_.py``)
SGLANG_NUM_KV_SPLITS = 8
_MLA_DECODE_MIN_BLOCK_KV = 32  # triton_backend.py's constant of the same name


def _core_count(device) -> int:
    """``get_device_core_count``: the SM count on CUDA, 0 elsewhere (SGLang then uses the static split count)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_max_kv_splits(mla: bool, core_count: int, max_context_len: int) -> int:
    """``TritonAttnBackend.max_kv_splits``: 8, and for MLA ``_mla_decode_kv_splits_cap`` (off XPU) raises it to
    ``min(next_pow2(SMs), next_pow2(cdiv(max_context_len, 32)))`` when that is larger (256 on an H200 from a context
    of 4065 tokens on)."""
    base = SGLANG_NUM_KV_SPLITS
    if not mla or core_count <= 0:
        return base
    import triton

    sm_cap = triton.next_power_of_2(core_count)
    ctx_cap = triton.next_power_of_2(-(-max_context_len // _MLA_DECODE_MIN_BLOCK_KV))
    return max(base, min(sm_cap, ctx_cap))


class _DecodePlan:
    """SGLang decode metadata (``ForwardMode.DECODE``, one token per request) for one (batch, page-table shape, page
    size, MLA or not), in static buffers :meth:`refresh` rewrites in place, as SGLang's Triton backend fills its
    CUDA-graph buffers before every decode replay (``_apply_cuda_graph_metadata`` for decode).

    Buffers: ``kv_indptr`` int32 [b+1] over ``seq_lens = prefix + 1`` (SGLang writes the token's KV before the
    kernel, so the sequence includes it); ``kv_indices`` int64 [b * L + 1] token slots (last entry a dump slot);
    ``seq_lens`` int32 [b]; ``num_kv_splits`` int32 [b] (``get_num_kv_splits``: the Triton
    ``get_num_kv_splits_triton`` from the SM count, or ``max_kv_splits`` everywhere without one); ``uneven_batch``
    int32 [1]; per (heads, Dv) the split-KV scratch ``attn_logits`` fp32 [b, H, max_kv_splits, Dv] and ``attn_lse``
    fp32 [b, H, max_kv_splits], persistent and zero-initialised like ``cuda_graph_attn_logits`` /
    ``cuda_graph_attn_lse``.
    """

    def __init__(self, batch, max_pages, page_size, device, *, mla, core_count=None, max_context_len=None):
        self.b, self.k, self.page_size, self.mla = batch, 1, page_size, mla
        self.L = max_pages * page_size
        dev = device
        self.core_count = _core_count(dev) if core_count is None else core_count
        self.max_kv_splits = decode_max_kv_splits(mla, self.core_count, max_context_len or self.L)
        self.kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=dev)
        self.kv_indices = torch.zeros(batch * self.L + 1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(batch, dtype=torch.int32, device=dev)
        self.num_kv_splits = torch.full((batch,), self.max_kv_splits, dtype=torch.int32, device=dev)
        self.uneven_batch = torch.zeros(1, dtype=torch.int32, device=dev)
        self.pos = torch.arange(self.L, device=dev)
        self.scratch: dict = {}
        # SGLang launches its decode kernels with PDL where the architecture has it (is_arch_support_pdl: sm_90+)
        self.use_pdl = dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 9
        self.first_cache_ptr = None

    def refresh(self, page_table, prefix_lens, tree_mask=None, num_head=None, num_kv_head=None):
        """One decode step's metadata: ``kv_indptr = cumsum(seq_lens)``, the token slots of positions
        ``0 .. prefix`` (the token's own included), and ``num_kv_splits`` as ``TritonAttnBackend.get_num_kv_splits``
        computes it (``num_head`` / ``num_kv_head`` are the layer's query and KV heads). ``tree_mask`` is unused: a
        one-node tree is the token alone."""
        b = self.b
        seq = prefix_lens.long() + 1
        self.seq_lens.copy_(seq)
        self.kv_indptr[1:].copy_(csr_token_slots(page_table, seq, self.page_size, self.pos, self.kv_indices))
        if self.core_count <= 0:  # SGLang: no device core count -> the static split count
            self.num_kv_splits.fill_(self.max_kv_splits)
            return
        import triton

        kern = _need("decode").get_num_kv_splits_triton
        kern[(1,)](self.num_kv_splits, self.seq_lens, b, 1, num_head, num_kv_head, self.max_kv_splits,
                   self.core_count, MAX_NUM_SEQ=256 if b < 256 else triton.next_power_of_2(b),
                   uneven_batch_ptr=self.uneven_batch)

    def run(self, q3, k_buffer, v_buffer, sm_scale, v_dim):
        """q3 [b, H, Lq]; k_buffer/v_buffer [slots, Hkv, *]; returns o [b, H, v_dim] (``forward_decode``'s call)."""
        fwd = _need("decode").decode_attention_fwd
        heads = q3.shape[1]
        scratch = self.scratch.get((heads, v_dim))
        if scratch is None:
            scratch = self.scratch[(heads, v_dim)] = (
                torch.zeros(self.b, heads, self.max_kv_splits, v_dim, dtype=torch.float32, device=q3.device),
                torch.zeros(self.b, heads, self.max_kv_splits, dtype=torch.float32, device=q3.device))
        attn_logits, attn_lse = scratch
        o = q3.new_empty((q3.shape[0], heads, v_dim))
        fwd(q3, k_buffer, v_buffer, o, self.kv_indptr, self.kv_indices, attn_logits, attn_lse, self.num_kv_splits,
            self.max_kv_splits, sm_scale, 1.0, 1.0, has_mla=self.mla and _mla_layout(k_buffer.shape[-1], v_dim),
            use_pdl=self.use_pdl, page_size=1, uneven_batch=self.uneven_batch)
        return o


def _mla_layout(lk: int, lv: int) -> bool:
    """Whether SGLang's MLA decode variant (``has_mla``: V read back from the K tile) fits this latent layout: its
    stage 1 splits K into ``BLOCK_DMODEL`` + ``BLOCK_DPE`` only for 576 = 512 + 64 and 288 = 256 + 32, and V must be
    that ``BLOCK_DMODEL``. Kimi-K2 and DeepSeek-V3 (576) always take it; other widths (the tiny test stand-ins) run
    the same kernel's GQA variant with one KV head, V read from its view, as SGLang cannot run them otherwise."""
    return (lk, lv) in ((576, 512), (288, 256))


def _check_paged(op, page_table, prefix_lens, batch):
    if not isinstance(page_table, torch.Tensor) or page_table.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: page_table must be int32/int64 [batch, max_pages], got "
                        f"{getattr(page_table, 'dtype', type(page_table).__name__)}")
    if page_table.dim() != 2 or page_table.shape[0] != batch:
        raise ValueError(f"{op}: page_table must have shape [{batch}, max_pages], got {list(page_table.shape)}")
    if not isinstance(prefix_lens, torch.Tensor) or prefix_lens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: prefix_lens must be int32/int64 [{batch}], got "
                        f"{getattr(prefix_lens, 'dtype', type(prefix_lens).__name__)}")
    if tuple(prefix_lens.shape) != (batch,):
        raise ValueError(f"{op}: prefix_lens must have shape [{batch}], got {list(prefix_lens.shape)}")


def _check_tree(op, tree_mask, batch, k):
    if tree_mask is None:
        return
    nb = (k + 7) // 8
    if not isinstance(tree_mask, torch.Tensor) or tree_mask.dtype != torch.uint8:
        raise TypeError(f"{op}: tree_mask must be uint8 of shape [{k}, {nb}] or [{batch}, {k}, {nb}] "
                        f"(bit-packed), got {getattr(tree_mask, 'dtype', type(tree_mask).__name__)}")
    if tuple(tree_mask.shape) not in ((k, nb), (batch, k, nb)):
        raise ValueError(f"{op}: tree_mask must be uint8 of shape [{k}, {nb}] or [{batch}, {k}, {nb}], "
                         f"got {list(tree_mask.shape)}")


def _mla_views(q_latent, q_rope, kv_cache):
    b, k, h, r = q_latent.shape
    q3 = torch.cat([q_latent, q_rope], dim=-1).reshape(b * k, h, -1)  # SGLang's MLA q: [tokens, H, 576]
    k_buffer = kv_cache.view(-1, 1, kv_cache.shape[-1])
    v_buffer = k_buffer[..., :r]
    return q3, k_buffer, v_buffer, r


def _gqa_views(q, k_cache, v_cache):
    b, k, hq, d = q.shape
    return (q.reshape(b * k, hq, d), k_cache.view(-1, k_cache.shape[2], k_cache.shape[3]),
            v_cache.view(-1, v_cache.shape[2], v_cache.shape[3]), v_cache.shape[3])


def prepare_tree_attention(kind, *tensors, page_table, prefix_lens, tree_mask=None, sm_scale):
    """Build SGLang's TARGET_VERIFY metadata once and return a zero-argument callable running the attention.

    Parameters
    ----------
    kind : {"gqa", "mla"}
    *tensors
        ``gqa``: ``q`` [batch, k, Hq, D], ``k_cache``, ``v_cache`` [num_pages, page_size, Hkv, D].
        ``mla``: ``q_latent`` [batch, k, H, R], ``q_rope`` [batch, k, H, Dr], ``kv_cache`` [num_pages, page_size,
        R + Dr]. fp16/bf16 (fp32 works too); caches contiguous.
    page_table : torch.Tensor
        int32 [batch, max_pages]. prefix_lens: int32 [batch]; request b's draft KV is at positions
        ``prefix_lens[b] .. prefix_lens[b] + k - 1`` already.
    tree_mask : torch.Tensor, optional
        uint8 [k, ceil(k/8)] or [batch, k, ceil(k/8)], bit j of row i = draft i sees draft j. None: a chain.
    sm_scale : float

    Returns
    -------
    callable
        ``fn()`` returns the output [batch, k, H, Dv] (Dv = D, or R for MLA) from the tensors' current values;
        the metadata is that of ``page_table`` / ``prefix_lens`` / ``tree_mask`` at prepare time.

    Notes
    -----
    Per call the callable gathers the draft tokens' K/V rows from the cache (SGLang hands the freshly projected
    K/V to the kernel instead; this is ``b * k`` rows) and, for MLA, concatenates ``q_latent`` and ``q_rope``.
    The custom mask is SGLang's full ``[k, prefix + k]`` layout per request, for chains too (``tree_mask=None``
    becomes the lower-triangular draft block), as SGLang's Triton backend receives it on a GPU.
    Graph-capturable after the first call.
    """
    if kind == "mla":
        q_latent, q_rope, kv_cache = tensors
        batch, k = q_latent.shape[:2]
        page_size, num_pages = kv_cache.shape[1], kv_cache.shape[0]
    elif kind == "gqa":
        q, k_cache, v_cache = tensors
        batch, k = q.shape[:2]
        page_size, num_pages = k_cache.shape[1], k_cache.shape[0]
    else:
        raise ValueError(f"prepare_tree_attention: kind must be 'gqa' or 'mla', got {kind!r}")
    op = f"sglang peer tree_attention ({kind})"
    _check_paged(op, page_table, prefix_lens, batch)
    _check_tree(op, tree_mask, batch, k)
    plan = _AttnPlan(batch, k, page_table.shape[1], page_size, page_table.device)
    plan.refresh(page_table, prefix_lens, tree_mask)
    if kind == "mla":
        def fn():
            q3, kb, vb, r = _mla_views(q_latent, q_rope, kv_cache)
            return plan.run(q3, kb, vb, sm_scale, r).view(batch, k, q_latent.shape[2], r)
    else:
        def fn():
            q3, kb, vb, dv = _gqa_views(q, k_cache, v_cache)
            return plan.run(q3, kb, vb, sm_scale, dv).view(batch, k, q.shape[2], dv)
    return fn


def prepare_decode_attention(kind, *tensors, page_table, prefix_lens, sm_scale, core_count=None,
                             max_context_len=None):
    """Build SGLang's decode metadata once and return a zero-argument callable running its decode kernel.

    Source: ``sglang.kernels.ops.attention.decode_attention : decode_attention_fwd`` (split-KV flash decoding, no
    tree), called as ``TritonAttnBackend.forward_decode`` calls it, with the metadata of :class:`_DecodePlan`.

    Parameters
    ----------
    kind : {"gqa", "mla"}
    *tensors
        As :func:`prepare_tree_attention` with ``k = 1``: ``gqa``: ``q`` [batch, 1, Hq, D], ``k_cache``,
        ``v_cache`` [num_pages, page_size, Hkv, D]; ``mla``: ``q_latent`` [batch, 1, H, R], ``q_rope``
        [batch, 1, H, Dr], ``kv_cache`` [num_pages, page_size, R + Dr].
    page_table, prefix_lens
        As :func:`prepare_tree_attention`; the token's own KV is at position ``prefix_lens[b]`` already, and it
        attends to positions ``0 .. prefix_lens[b]``.
    sm_scale : float
    core_count : int, optional
        SM count for SGLang's split heuristic (default: the device's; 0 off CUDA, where SGLang uses the static
        split count). max_context_len: the context SGLang's MLA split cap is derived from (default: the page table's
        span).

    Returns
    -------
    callable
        ``fn()`` returns [batch, 1, H, Dv]. Graph-capturable after the first call.

    Raises
    ------
    ValueError
        ``k != 1``, or malformed paged inputs.
    """
    if kind == "mla":
        q_latent, q_rope, kv_cache = tensors
        batch, k = q_latent.shape[:2]
        page_size = kv_cache.shape[1]
    elif kind == "gqa":
        q, k_cache, v_cache = tensors
        batch, k = q.shape[:2]
        page_size = k_cache.shape[1]
    else:
        raise ValueError(f"prepare_decode_attention: kind must be 'gqa' or 'mla', got {kind!r}")
    op = f"sglang peer decode_attention ({kind})"
    if k != 1:
        raise ValueError(f"{op}: decode takes one token per request, q of shape [batch, 1, H, D], got k = {k}; "
                         "use prepare_tree_attention for k > 1")
    _check_paged(op, page_table, prefix_lens, batch)
    plan = _DecodePlan(batch, page_table.shape[1], page_size, page_table.device, mla=kind == "mla",
                       core_count=core_count, max_context_len=max_context_len)
    if kind == "mla":
        plan.refresh(page_table, prefix_lens, None, q_latent.shape[2], 1)

        def fn():
            q3, kb, vb, r = _mla_views(q_latent, q_rope, kv_cache)
            return plan.run(q3, kb, vb, sm_scale, r).view(batch, 1, q_latent.shape[2], r)
    else:
        plan.refresh(page_table, prefix_lens, None, q.shape[2], k_cache.shape[2])

        def fn():
            q3, kb, vb, dv = _gqa_views(q, k_cache, v_cache)
            return plan.run(q3, kb, vb, sm_scale, dv).view(batch, 1, q.shape[2], dv)
    fn.plan = plan
    return fn


def tree_attention(q, k_cache, v_cache, *, page_table, prefix_lens, tree_mask=None, sm_scale):
    """GQA/MHA tree attention through SGLang's ``extend_attention_fwd`` (TARGET_VERIFY call).

    Same semantics as :func:`specverify.reference.attention.tree_attention_reference`; see
    :func:`prepare_tree_attention` for shapes. Returns [batch, k, Hq, D] in q's dtype.

    Examples
    --------
    >>> ok, why = available()  # doctest: +SKIP
    >>> out = tree_attention(q, kc, vc, page_table=pt, prefix_lens=pl, tree_mask=None, sm_scale=0.125)  # doctest: +SKIP
    """
    return prepare_tree_attention("gqa", q, k_cache, v_cache, page_table=page_table, prefix_lens=prefix_lens,
                                  tree_mask=tree_mask, sm_scale=sm_scale)()


def tree_attention_mla(q_latent, q_rope, kv_cache, *, page_table, prefix_lens, tree_mask=None, sm_scale):
    """Absorbed-MLA tree attention through SGLang's ``extend_attention_fwd`` (MLA TARGET_VERIFY call).

    Same semantics as :func:`specverify.reference.attention.tree_attention_mla_reference`. Returns
    [batch, k, H, R] in q_latent's dtype.
    """
    return prepare_tree_attention("mla", q_latent, q_rope, kv_cache, page_table=page_table,
                                  prefix_lens=prefix_lens, tree_mask=tree_mask, sm_scale=sm_scale)()


# ------------------------------------------------------------------------------------------------------------
# routing and alignment


def route(logits, bias, *, top_k, scoring, n_group, topk_group, renormalize, routed_scaling_factor):
    """SGLang's Triton router (``moe_fused_gate``) with specverify's semantics: the routed scaling factor folded into
    the weights. Arguments as :func:`specverify.reference.moe.route_reference` (``bias`` its ``correction_bias``).

    Returns
    -------
    (topk_ids int32 [M, top_k], topk_weights fp32 [M, top_k])
    """
    gate = _need("router").moe_fused_gate
    if scoring == "softmax":
        if bias is not None:
            raise ValueError("sglang peer route: softmax routing takes no correction_bias in SGLang, got a bias; "
                             "pass correction_bias=None")
        w, ids = gate(logits, None, top_k, scoring_func="softmax", renormalize=renormalize,
                      routed_scaling_factor=routed_scaling_factor, apply_routed_scaling_factor_on_output=True,
                      num_expert_group=n_group, topk_group=topk_group)
    elif scoring == "sigmoid":
        b = (bias.to(torch.float32) if bias is not None
             else torch.zeros(logits.shape[1], dtype=torch.float32, device=logits.device))
        scores = logits.to(torch.float32) if (n_group > 1 or logits.dtype != torch.bfloat16) else logits
        w, ids = gate(scores, b, top_k, scoring_func="sigmoid", renormalize=renormalize,
                      routed_scaling_factor=routed_scaling_factor, apply_routed_scaling_factor_on_output=True,
                      num_expert_group=n_group, topk_group=topk_group)
    else:
        raise ValueError(f"sglang peer route: scoring must be 'sigmoid' or 'softmax', got {scoring!r}")
    return ids, w


def _align_buffers(numel, num_experts, block_size, device):
    """Buffers sized as SGLang's ``moe_align_block_size`` wrapper sizes them ("+1 offset" buckets)."""
    if numel < num_experts + 1:
        max_pad = numel * block_size
    else:
        max_pad = numel + (num_experts + 1) * (block_size - 1)
    max_pad = (max_pad + 3) // 4 * 4
    sorted_ids = torch.empty(max_pad, dtype=torch.int32, device=device)
    expert_ids = torch.empty(-(-max_pad // block_size), dtype=torch.int32, device=device)
    ntpp = torch.empty(1, dtype=torch.int32, device=device)
    return sorted_ids, expert_ids, ntpp


def align_path(numel: int, num_experts: int) -> str:
    """Which alignment kernel runs: ``"small_numel"`` (SGLang's Triton kernel, under SGLang's own gate),
    ``"sgl_kernel"`` (SGLang's CUDA kernel), or ``"small_numel_outside_gate"`` (SGLang would call sgl_kernel,
    which is not installed here)."""
    al = _need("align")
    if numel <= al.limit and num_experts + 1 > 64:
        return "small_numel"
    return "sgl_kernel" if al.large is not None else "small_numel_outside_gate"


def align(topk_ids, num_experts, block_size):
    """SGLang's token→expert alignment. Returns (sorted_token_ids int32, expert_ids int32, ntpp int32 [1]).

    Only the first ``ntpp`` entries of ``sorted_token_ids`` (and ``ntpp // block_size`` of ``expert_ids``) are
    defined; padding slots hold ``topk_ids.numel()``; experts come in increasing order, stable inside an expert.
    """
    al = _need("align")
    numel = topk_ids.numel()
    sorted_ids, expert_ids, ntpp = _align_buffers(numel, num_experts, block_size, topk_ids.device)
    if align_path(numel, num_experts) == "sgl_kernel":
        cumsum = torch.empty(num_experts + 2, dtype=torch.int32, device=topk_ids.device)
        al.large(topk_ids, num_experts + 1, block_size, sorted_ids, expert_ids, ntpp, cumsum, True)
    else:
        al.small(topk_ids, num_experts + 1, block_size, sorted_ids, expert_ids, ntpp)
    return sorted_ids, expert_ids, ntpp


def route_and_align(logits, bias, block_size, *, top_k, scoring="sigmoid", n_group=1, topk_group=1,
                    routed_scaling_factor=1.0, renormalize=True):
    """Route with SGLang's Triton router, then align with SGLang's alignment.

    Parameters
    ----------
    logits : torch.Tensor
        Router logits [M, E]; fp32/bf16/fp16.
    bias : torch.Tensor or None
        Correction bias [E] (sigmoid routing only).
    block_size : int
        Alignment block (the expert GEMM's BLOCK_SIZE_M).
    top_k, scoring, n_group, topk_group, routed_scaling_factor, renormalize
        As :func:`specverify.reference.moe.route_reference`.

    Returns
    -------
    (topk_ids int32 [M, top_k], topk_weights fp32 [M, top_k], sorted_token_ids, expert_ids,
    num_tokens_post_padded) — the last three as :func:`align`.
    """
    ids, w = route(logits, bias, top_k=top_k, scoring=scoring, n_group=n_group, topk_group=topk_group,
                    renormalize=renormalize, routed_scaling_factor=routed_scaling_factor)
    return (ids, w) + align(ids, logits.shape[1], block_size)


# ------------------------------------------------------------------------------------------------------------
# experts


_NO_QUANT = dict(use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False,
                 per_channel_quant=False)
_ACT_QUANT = ("auto", "sglang", "triton")
_INT4_NOTE = ("int4 backend: SGLang's Triton W4A16 path (CompressedTensorsWNA16TritonMoE: --moe-runner-backend "
              "triton, its default on SM100); on Hopper its default for these checkpoints is Marlin "
              "(fused_marlin_moe, sgl_kernel CUDA)")
_FP8_ACT_NOTE = ("fp8 activation quantisation: SGLang's Triton per_token_group_quant_fp8 kernel "
                 "(_per_token_group_quant_8bit_raw) standing in for the JIT-CUDA sglang_per_token_group_quant_fp8 "
                 "SGLang calls on CUDA")


def _quant_call(quant):
    """``invoke_fused_moe_kernel``'s quantisation flags and ``block_shape`` for ``quant`` (None or a
    :class:`specverify.moe.MoEQuant`), as SGLang's layers set them: int4 ``use_int4_w4a16`` with ``[0, group_size]``
    (``CompressedTensorsWNA16TritonMoE.get_triton_quant_info``), block fp8 ``use_fp8_w8a8`` with the checkpoint's
    ``weight_block_size`` (``Fp8MoEMethod``)."""
    flags = dict(_NO_QUANT)
    if quant is None:
        return flags, None
    if quant.format == "int4":
        flags["use_int4_w4a16"] = True
        return flags, [0, int(quant.group_size)]
    flags["use_fp8_w8a8"] = True
    return flags, [int(b) for b in quant.block_shape]


def _moe_configs(w13_shape, w2_shape, top_k, dtype, m, on_cuda, flags=None, block_shape=None):
    """SGLang's block config choice (``try_get_optimal_moe_config``): (config, down_config or None).

    Tuned files are keyed by E, the *stored* last dimension of w2 (SGLang passes ``w2.shape``: for int4 the packed
    I / 2), the dtype string (``get_config_dtype_str``: None for fp16/bf16, ``"int4_w4a16"``, ``"fp8_w8a8"``), the
    block shape (named only when both entries are non-zero) and the CUDA device name. Off CUDA there is none, and
    SGLang's ``get_default_config`` applies (block fp8: BLOCK_SIZE_N / BLOCK_SIZE_K = the block shape).
    """
    cfg = _need("experts").config
    e, _, n = w2_shape
    quant_flags = {k: v for k, v in (flags or {}).items() if k != "per_channel_quant"}
    dtype_str = cfg.get_config_dtype_str(dtype, **quant_flags)
    block_n, block_k = block_shape if block_shape else (0, 0)

    def lookup(down):
        if not on_cuda:
            return None
        return cfg.get_moe_configs(e, n, dtype_str, block_n, block_k, per_channel_quant=False, down_moe=down)

    configs = lookup(False)
    if configs:
        config = dict(configs[min(configs.keys(), key=lambda x: abs(x - m))])
    else:
        config = dict(cfg.get_default_config(m, e, n, w13_shape[2], top_k, dtype_str, False, block_shape))
    down = None
    down_configs = lookup(True)
    if down_configs:
        down = dict(down_configs[min(down_configs.keys(), key=lambda x: abs(x - m))])
        down["BLOCK_SIZE_M"] = config["BLOCK_SIZE_M"]  # one alignment serves both GEMMs, as in SGLang
        down.pop("USE_TMA", None)
    config.pop("USE_TMA", None)  # TMA is opt-in through tuned files; left off (SGLang's default files lack it)
    return config, down


_CONFIG_CACHE: dict = {}


def _config_for(hidden, w13, w2, top_k, flags=None, block_shape=None):
    on_cuda = hidden.is_cuda
    key = (tuple(w13.shape), tuple(w2.shape), top_k, hidden.dtype, hidden.shape[0], on_cuda,
           tuple(sorted((flags or {}).items())), tuple(block_shape or ()))
    got = _CONFIG_CACHE.get(key)
    if got is None:
        got = _CONFIG_CACHE[key] = _moe_configs(tuple(w13.shape), tuple(w2.shape), top_k, hidden.dtype,
                                                hidden.shape[0], on_cuda, flags, block_shape)
    return got


def _check_experts(hidden, w13, w2, topk_weights, topk_ids):
    op = "sglang peer fused_experts"
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"{op}: expected hidden [M, H], w13 [E, 2I, H], w2 [E, H, I], got "
                         f"{list(hidden.shape)}, {list(w13.shape)}, {list(w2.shape)}")
    m, h = hidden.shape
    e, two_i, h2 = w13.shape
    if h2 != h or tuple(w2.shape) != (e, h, two_i // 2) or two_i % 2:
        raise ValueError(f"{op}: expected w13 [E, 2I, {h}] and w2 [E, {h}, I], got {list(w13.shape)} and "
                         f"{list(w2.shape)}")
    if hidden.dtype not in (torch.float16, torch.bfloat16) or w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise TypeError(f"{op}: hidden, w13 and w2 must share dtype float16 or bfloat16 (SGLang's unquantised "
                        f"Triton MoE), got {hidden.dtype}, {w13.dtype}, {w2.dtype}; cast them")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != m:
        raise ValueError(f"{op}: topk_ids and topk_weights must both be [{m}, top_k], got "
                         f"{list(topk_ids.shape)} and {list(topk_weights.shape)}")


def _check_experts_quant(hidden, w13, w2, topk_weights, topk_ids, quant, act_quant):
    """Quantised experts: what :func:`specverify.moe.fused_moe` checks (format, storage dtype, shapes, scales), then
    what SGLang's call adds."""
    from specverify.moe import _check_moe_args

    _check_moe_args(hidden, w13, w2, topk_ids, topk_weights, None, "silu", None, quant)
    if act_quant not in _ACT_QUANT:
        raise ValueError(f"sglang peer fused_experts: act_quant must be one of {_ACT_QUANT}, got {act_quant!r}")
    if quant.format == "fp8":
        bk, h, inter = quant.block_shape[1], hidden.shape[1], w2.shape[2]
        if h % bk or inter % bk:
            raise ValueError(f"sglang peer fused_experts: block fp8 quantises the activations per group of "
                             f"block_shape[1]={bk} columns (SGLang's per_token_group_quant_fp8 takes whole groups "
                             f"only), so H={h} and I={inter} must be multiples of it; use a block_shape whose second "
                             "entry divides both")


_ACT_PROBES: dict = {}


def _fp8_act_quant(ex, hidden, inter, block_k, act_quant):
    """(mode, note or "") for block fp8's activation quantisation (see :func:`prepare_fused_experts`)."""
    if not ex.sees_cuda:
        note = ("" if not hidden.is_cuda else "fp8 activation quantisation: SGLang's non-CUDA Triton path (its "
                "platform probe sees no CUDA here), not the JIT-CUDA kernel it calls on CUDA")
        return ("sglang" if act_quant != "triton" else "triton"), note
    if act_quant == "sglang":
        return "sglang", ""
    if act_quant == "triton":
        return "triton", _FP8_ACT_NOTE
    key = (hidden.dtype, hidden.shape[1], inter, block_k, str(hidden.device))
    why = _ACT_PROBES.get(key)
    if why is None:
        try:  # compiles SGLang's JIT kernel for both activation widths (a whole-row group takes its per-token kernel)
            if ex.group_quant_cuda is None:
                raise RuntimeError("sglang.kernels.ops.quantization.fp8_kernel has no sglang_per_token_group_quant_fp8")
            for width in (hidden.shape[1], inter):
                ex.group_quant_cuda(hidden.new_zeros((1, width)), block_k)
            if hidden.is_cuda:
                torch.cuda.synchronize(hidden.device)
            why = ""
        except Exception as exc:
            why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
        _ACT_PROBES[key] = why
    return ("sglang", "") if not why else ("triton", f"{_FP8_ACT_NOTE} ({why})")


def _combine(cache3, out, topk, sum_reduce, cuda_sum):
    m = cache3.shape[0]
    if topk == 2:
        torch.add(cache3[:, 0], cache3[:, 1], out=out)
    elif m <= 32 or cuda_sum is None:
        sum_reduce(cache3, out, 1.0)
    else:
        cuda_sum(cache3, out, 1.0)


def prepare_fused_experts(hidden, w13, w2, topk_weights, topk_ids, *, quant=None, act_quant="auto"):
    """Resolve SGLang's config for these shapes and return ``fn()`` running align + the two expert GEMMs.

    Unquantised, ``invoke_fused_moe_kernel`` runs with every quantisation flag off. With ``quant``, it runs as
    SGLang's quantised MoE layers call it on its Triton runner (``srt/layers/moe/moe_runner/triton.py :
    fused_experts_none_to_triton`` -> ``triton_utils/fused_moe.py : _fused_moe_kernel_sequence``), with SGLang's
    config for the format (``get_config_dtype_str`` / ``get_moe_configs`` / ``get_default_config``):

    * int4: ``use_int4_w4a16=True``, ``block_shape=[0, group_size]``, ``B`` the packed uint8 weights [E, N, K / 2],
      ``B_scale`` the group scales [E, N, K / group_size] (any float dtype: the kernel reads them as fp32), no zero
      point. That call goes to ``fused_moe_kernel_gptq_awq``, which takes byte ``k // 2`` of row n, code ``(byte >>
      4 * (k % 2)) & 0xF``, and ``(code - 8) * scale[e, n, k // group_size]`` in fp32 rounded to hidden's dtype
      before the dot (W4A16): :class:`specverify.moe.MoEQuant`'s int4 layout. It is what
      ``CompressedTensorsWNA16TritonMoE`` passes after loading (``weight_packed`` int32 transposed to [E, N, K / 8]
      and viewed as uint8; scales transposed to [E, N, K / g]). **Not what SGLang runs by default on Hopper**:
      there its default for these checkpoints is Marlin (``fused_marlin_moe``, CUDA from ``sgl_kernel``); this
      Triton path is its ``--moe-runner-backend triton`` and its SM100 default. ``fn.not_sglang`` says so.
    * block fp8: ``use_fp8_w8a8=True``, ``block_shape=[bn, bk]``, ``B`` float8_e4m3fn [E, N, K], ``B_scale`` fp32
      [E, ceil(N / bn), ceil(K / bk)] (the checkpoints' ``weight_scale_inv``), as ``Fp8MoEMethod`` passes them (its
      Triton runner is SGLang's default on Hopper without DeepEP). Both GEMMs' activations are quantised to fp8 per
      token and group of bk columns (scale ``max|x| / 448``; W8A8), which SGLang does inside
      ``invoke_fused_moe_kernel``: with the JIT-CUDA ``sglang_per_token_group_quant_fp8`` where its platform probe
      sees CUDA, else with the Triton kernel of ``fp8_kernel.per_token_group_quant_fp8``. ``act_quant`` picks:
      ``"sglang"``: activations go in in hidden's dtype and ``invoke_fused_moe_kernel`` quantises them, as in
      SGLang. ``"triton"``: this wrapper quantises them with SGLang's Triton kernel and passes fp8 activations and
      their row-major fp32 scales (the kernel's pre-quantised branch); **on CUDA not SGLang's** (a Triton stand-in
      for its JIT-CUDA kernel), elsewhere the same kernel SGLang calls. ``"auto"``: ``"sglang"`` where SGLang sees
      no CUDA, and on CUDA when one probe call of its JIT kernel per activation width (which compiles it; a host
      sync, here in the prepare step) succeeds; otherwise ``"triton"``, with the reason in ``fn.not_sglang``.

    The activation (``act_and_mul_triton``), the alignment and the expert sum are those of the unquantised call;
    the module notes say where those are not SGLang's.

    Parameters
    ----------
    hidden : torch.Tensor
        [M, H], fp16/bf16. w13: [E, 2I, H] (gate rows then up rows, SGLang's ``w13_weight`` layout);
        w2: [E, H, I] (SGLang's ``w2_weight``). topk_weights fp32 [M, top_k] (already scaled); topk_ids int32.
        With ``quant`` the weights hold the stored values: int4 uint8 [E, 2I, H / 2] / [E, H, I / 2], fp8
        float8_e4m3fn [E, 2I, H] / [E, H, I].
    quant : specverify.moe.MoEQuant, optional
        Format and scales of quantised experts, checked as :func:`specverify.moe.fused_moe` checks them; block fp8
        also needs H and I to be multiples of ``block_shape[1]`` (whole activation groups).
    act_quant : {"auto", "sglang", "triton"}
        Block fp8 only: who quantises the activations (above).

    Returns
    -------
    callable
        ``fn()`` returns [M, H] in hidden's dtype: ``sum_j w[m, j] * W2[e] silu(W1_gate[e] x) * (W1_up[e] x)``
        over the dequantised weights (block fp8: with fp8-rounded activations into each GEMM). ``fn.act_quant``
        is the activation-quantisation mode used (None unless block fp8); ``fn.not_sglang`` lists where this
        quantised call is not what SGLang runs here (empty unquantised: the module notes cover that call).

    Raises
    ------
    TypeError, ValueError
        Inputs that do not fit, an unknown ``act_quant``.
    RuntimeError
        SGLang's experts piece does not import here.
    """
    if quant is None:
        _check_experts(hidden, w13, w2, topk_weights, topk_ids)
    else:
        _check_experts_quant(hidden, w13, w2, topk_weights, topk_ids, quant, act_quant)
        if quant.layout == "quads":  # SGLang reads int4 in rows: a copy back, made here, outside the timed call
            from specverify.reference.quant import int4_from_quads

            w13, s13_rows = int4_from_quads(w13, quant.w13_scale)
            w2, s2_rows = int4_from_quads(w2, quant.w2_scale)
            quant = dataclasses.replace(quant, w13_scale=s13_rows, w2_scale=s2_rows, layout="rows")
    ex = _need("experts")
    import triton.language as tl

    flags, block_shape = _quant_call(quant)
    config, down = _config_for(hidden, w13, w2, topk_ids.shape[1], flags, block_shape)
    m, h = hidden.shape
    e, n, _ = w13.shape
    topk = topk_ids.shape[1]
    compute_type = tl.bfloat16 if hidden.dtype == torch.bfloat16 else tl.float16
    kw = dict(compute_type=compute_type, **flags, block_shape=block_shape, filter_expert=False)
    s13, s2 = (None, None) if quant is None else (quant.w13_scale, quant.w2_scale)
    not_sglang, mode = [], None
    if quant is not None and quant.format == "int4":
        not_sglang.append(_INT4_NOTE)
    if flags["use_fp8_w8a8"]:
        mode, note = _fp8_act_quant(ex, hidden, w2.shape[2], block_shape[1], act_quant)
        if note:
            not_sglang.append(note)
    quantise = ex.group_quant_triton if mode == "triton" else None
    block_k = block_shape[1] if block_shape else 0

    def gemm(a, b, b_scale, c, route, mul_routed_weight, top_k, cfg, **extra):
        a_scale = None
        if quantise is not None:
            a, a_scale = quantise(a, block_k)
        wts, ids, sorted_ids, expert_ids, ntpp = route
        ex.invoke(a, b, None, c, a_scale, b_scale, None, wts, ids, sorted_ids, expert_ids, ntpp, mul_routed_weight,
                  top_k, cfg, **kw, **extra)

    def fn():
        ids = topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)
        wts = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.float()
        route = (wts, ids) + align(ids, e, config["BLOCK_SIZE_M"])
        cache1 = hidden.new_empty((m * topk, n))
        gemm(hidden, w13, s13, cache1, route, False, topk, config)
        cache2 = hidden.new_empty((m * topk, n // 2))
        ex.act_and_mul(cache1, cache2, config)
        out = torch.empty_like(hidden)
        direct = topk == 1  # routed scaling is folded into the weights, so SGLang's "scale == 1" case applies
        dst = out.unsqueeze(0) if direct else hidden.new_empty((m, topk, w2.shape[1]))
        gemm(cache2, w2, s2, dst, route, True, 1, down or config, router_topk=topk)
        if not direct:
            _combine(dst, out, topk, ex.sum_reduce, ex.cuda_sum)
        return out

    fn.act_quant, fn.not_sglang = mode, not_sglang
    return fn


def fused_experts(hidden, w13, w2, topk_weights, topk_ids, *, quant=None, act_quant="auto"):
    """SGLang's Triton fused-MoE sequence (see :func:`prepare_fused_experts`). Returns [M, H]."""
    return prepare_fused_experts(hidden, w13, w2, topk_weights, topk_ids, quant=quant, act_quant=act_quant)()


# ------------------------------------------------------------------------------------------------------------
# attention for the verify forward's op table


class VerifyAttention:
    """Attention in the verify forward's op-table signature (``mla`` and ``gqa``, see :mod:`specverify.forward.ops`),
    as SGLang's Triton attention backend runs each mode:

    * ``k = 1`` (plain decode, ``ForwardMode.DECODE``): ``decode_attention_fwd`` with a :class:`_DecodePlan`
      (split-KV buffers, ``num_kv_splits`` from SGLang's split heuristic);
    * ``k > 1`` (``ForwardMode.TARGET_VERIFY``): ``extend_attention_fwd`` with an :class:`_AttnPlan` (the full
      ``[k, prefix + k]`` custom mask, chains included).

    One plan per (mode, shapes, page table, inputs), refreshed in place at the first layer of every forward (detected
    by that layer's cache): the per-step work SGLang does before each replay (index fill, split counts, the mask's
    memset and rebuild) is inside the pass, so a captured graph redoes it on every replay and a timed pass pays it.

    Parameters
    ----------
    core_count : int, optional
        SM count for the decode split heuristic (default: the device's). max_context_len: see
        :func:`prepare_decode_attention`.
    """

    def __init__(self, *, core_count=None, max_context_len=None):
        self.plans: dict = {}
        self.core_count, self.max_context_len = core_count, max_context_len

    def plan(self, kind, batch, k, cache, page_table, prefix_lens, tree_mask, num_head, num_kv_head):
        key = (kind, batch, k, tuple(page_table.shape), page_table.data_ptr(), prefix_lens.data_ptr(),
               None if tree_mask is None else (tree_mask.data_ptr(), tuple(tree_mask.shape)), cache.shape[1],
               str(page_table.device))
        plan = self.plans.get(key)
        if plan is None:
            if k == 1:
                plan = _DecodePlan(batch, page_table.shape[1], cache.shape[1], page_table.device, mla=kind == "mla",
                                   core_count=self.core_count, max_context_len=self.max_context_len)
            else:
                plan = _AttnPlan(batch, k, page_table.shape[1], cache.shape[1], page_table.device)
            plan.first_cache_ptr = cache.data_ptr()
            self.plans[key] = plan
            plan.refresh(page_table, prefix_lens, tree_mask, num_head, num_kv_head)
        elif cache.data_ptr() == plan.first_cache_ptr:
            plan.refresh(page_table, prefix_lens, tree_mask, num_head, num_kv_head)
        return plan

    def mla(self, q_latent, q_rope, cache, page_table, prefix_lens, tree_mask, sm_scale):
        b, k, h, _ = q_latent.shape
        plan = self.plan("mla", b, k, cache, page_table, prefix_lens, tree_mask, h, 1)
        q3, kb, vb, r = _mla_views(q_latent, q_rope, cache)
        return plan.run(q3, kb, vb, sm_scale, r).view(b, k, h, r)

    def gqa(self, q, k_cache, v_cache, page_table, prefix_lens, tree_mask, sm_scale):
        b, k, h, _ = q.shape
        plan = self.plan("gqa", b, k, k_cache, page_table, prefix_lens, tree_mask, h, k_cache.shape[2])
        q3, kb, vb, dv = _gqa_views(q, k_cache, v_cache)
        return plan.run(q3, kb, vb, sm_scale, dv).view(b, k, h, dv)
