"""FlashInfer's MLA attention as SGLang's ``flashinfer`` attention backend runs it, as a peer baseline.

Source: FlashInfer 0.7.2.post1 (``flashinfer.mla.BatchMLAPagedAttentionWrapper``) and SGLang 0.5.23's
``srt/layers/attention/flashinfer_mla_backend.py``, the backend SGLang offers for MLA models on sm_90 beside its
default ``fa3`` (whose package needs torch 2.14.1 and cannot run on our GPU machine). That backend serves
speculative verify only for chains: it raises for EAGLE ``topk > 1`` ("Currently Flashinfer MLA only supports
topk=1"), so a tree mask is refused here too.

How SGLang calls it, and what :class:`MLAChainAttention` reproduces

================  ================================================================================================
mode              plan and run
================  ================================================================================================
TARGET_VERIFY     one ``BatchMLAPagedAttentionWrapper(workspace, use_cuda_graph=True, qo_indptr=, kv_indptr=,
(k > 1)           kv_indices=, kv_len_arr=, backend="auto")`` per captured shape; ``plan(qo_indptr = arange(0,
                  (b+1)k, k), kv_indptr = cumsum(prefix + k), kv_indices`` = token slots of the prefix and the k draft
                  tokens (their KV is written before attention), ``kv_len_arr = prefix + k``, heads,
                  ``kv_lora_rank``, ``qk_rope_head_dim``, page size 1, ``causal=True``, the layer's scale, bf16 /
                  bf16)``; ``run(q_nope, q_pe, ckv = kv_buffer[..., :512], kpe = kv_buffer[..., 512:], out=)``.
DECODE (k = 1)    the same wrapper class planned with ``qo_indptr = arange(b + 1)``, ``kv_len_arr = prefix + 1``,
                  ``causal=False`` (its decode indices updater).
================  ================================================================================================

SGLang plans on the host before every step (before each graph replay: ``fast_mla_prefill_plan`` from host-side
lengths); that is CPU time beside the GPU pass. Here a plan is made when a shape is first seen and again in any
eager call whose page table or lengths differ from the planned ones (compared on the host); a captured graph replays
the plan of the last eager forward, so the timed GPU pass holds FlashInfer's kernels only, as SGLang's replay does.
A replay is therefore right only for the page table and lengths of that last eager forward (what a benchmark
replays); a serving loop would have to re-plan on the host before each replay, as SGLang does.
Planning needs host copies of the lengths, so it cannot run inside a capture: the first forward of a shape must be
eager (verify-wall's graph pool warms up eagerly), else :meth:`MLAChainAttention.mla` raises.

FlashInfer JIT-compiles its kernels with the machine's ``nvcc`` at the first plan (minutes; set
``FLASHINFER_WORKSPACE_BASE`` to a writable folder).
"""
from __future__ import annotations

import importlib
import warnings

import torch

from specverify.peers.sglang import csr_token_slots

__all__ = ["available", "MLAChainAttention", "prepare_mla_attention", "FLASHINFER_VERSION"]

FLASHINFER_VERSION = "0.7.2.post1"  # the version these call paths were read from
#: SGLang's FlashInfer workspace (``SGLANG_FLASHINFER_WORKSPACE_SIZE``, 384 MiB, one buffer for every wrapper)
WORKSPACE_BYTES = 384 * 1024 * 1024


def _module():
    return importlib.import_module("flashinfer")


def available() -> tuple[bool, str]:
    """(True, version) when FlashInfer imports and offers ``BatchMLAPagedAttentionWrapper``; else (False, why)."""
    try:
        fi = _module()
    except Exception as exc:
        return False, f"flashinfer not importable ({type(exc).__name__}: {exc})"
    if _wrapper_class(fi) is None:
        return False, f"flashinfer {getattr(fi, '__version__', '?')} has no BatchMLAPagedAttentionWrapper"
    return True, str(getattr(fi, "__version__", "?"))


def _wrapper_class(fi):
    cls = getattr(fi, "BatchMLAPagedAttentionWrapper", None)
    if cls is None:
        mla = getattr(fi, "mla", None)
        cls = getattr(mla, "BatchMLAPagedAttentionWrapper", None)
    return cls


class _Plan:
    """One wrapper and its static CSR buffers for (batch, k, page-table width, page size): int32 ``qo_indptr``
    [b+1], ``kv_indptr`` [b+1], ``kv_len`` [b], ``kv_indices`` [b * L + 1] (L = pages a row * page size; the last
    entry is a dump slot for the scatter of positions past a request's length)."""

    def __init__(self, cls, workspace, batch, k, max_pages, page_size, device):
        self.b, self.k, self.page_size = batch, k, page_size
        self.L = max_pages * page_size
        i32 = torch.int32
        self.qo_indptr = torch.arange(0, (batch + 1) * k, k, dtype=i32, device=device)
        self.kv_indptr = torch.zeros(batch + 1, dtype=i32, device=device)
        self.kv_len = torch.zeros(batch, dtype=i32, device=device)
        self.kv_indices = torch.zeros(batch * self.L + 1, dtype=i32, device=device)
        self.pos = torch.arange(self.L, device=device)
        self.wrapper = cls(workspace, use_cuda_graph=True, qo_indptr=self.qo_indptr, kv_indptr=self.kv_indptr,
                           kv_indices=self.kv_indices, kv_len_arr=self.kv_len, backend="auto")
        self.planned = None  # (page table, lengths) the plan was made for

    def planned_for(self, page_table, prefix_lens) -> bool:
        """Whether the plan was made for these page-table and length values (host sync)."""
        pt, pl = self.planned
        return torch.equal(pt, page_table) and torch.equal(pl, prefix_lens)

    def refresh(self, page_table, prefix_lens, heads, kv_lora_rank, rope_dim, sm_scale, q_dtype, kv_dtype):
        """Rewrite the CSR buffers from the page table and lengths (device ops), then plan (host sync)."""
        self.planned = (page_table.clone(), prefix_lens.clone())
        lens = prefix_lens.long() + self.k  # the draft tokens' KV is in the cache before attention
        self.kv_len.copy_(lens)
        # token slots (page size 1 addressing, as SGLang's pool), packed as SGLang's Triton backend packs them
        self.kv_indptr[1:].copy_(csr_token_slots(page_table, lens, self.page_size, self.pos, self.kv_indices))
        with warnings.catch_warnings():  # SGLang's flat-argument plan form is deprecated in 0.7
            warnings.simplefilter("ignore", DeprecationWarning)
            self.wrapper.plan(qo_indptr=self.qo_indptr, kv_indptr=self.kv_indptr, kv_indices=self.kv_indices,
                              kv_len_arr=self.kv_len, num_heads=heads, head_dim_ckv=kv_lora_rank,
                              head_dim_kpe=rope_dim, page_size=1, causal=self.k > 1, sm_scale=sm_scale,
                              q_data_type=q_dtype, kv_data_type=kv_dtype)

    def run(self, q_nope, q_pe, ckv, kpe):
        out = q_nope.new_empty(q_nope.shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return self.wrapper.run(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv, kpe_cache=kpe, out=out)


class MLAChainAttention:
    """MLA attention in the verify forward's op-table signature (``attention_mla``, see
    :mod:`specverify.forward.ops`) through FlashInfer's ``BatchMLAPagedAttentionWrapper``, planned as SGLang's
    ``flashinfer`` MLA backend plans it (module docstring). Chains and decode only.

    Parameters
    ----------
    module : module, optional
        The ``flashinfer`` module (default: imported; tests pass a stand-in).
    """

    def __init__(self, module=None):
        self._fi = module
        self.plans: dict = {}
        self._workspace: dict = {}

    def _cls(self):
        if self._fi is None:
            self._fi = _module()
        cls = _wrapper_class(self._fi)
        if cls is None:
            raise RuntimeError("flashinfer has no BatchMLAPagedAttentionWrapper")
        return cls

    def _plan_for(self, q_latent, q_rope, cache, page_table, prefix_lens, tree_mask, sm_scale):
        if tree_mask is not None:
            raise ValueError("FlashInfer's MLA wrapper takes no tree mask (SGLang's flashinfer MLA backend serves "
                             "EAGLE topk = 1 only); use a chain (tree_mask=None) or the sglang provider")
        b, k, h, r = q_latent.shape
        dr = q_rope.shape[-1]
        # one plan per shape; it depends on the page table and lengths only (not on the layer's cache)
        key = (b, k, tuple(page_table.shape), cache.shape[1], h, str(page_table.device))
        capturing = cache.is_cuda and torch.cuda.is_current_stream_capturing()
        plan = self.plans.get(key)
        if plan is None:
            if capturing:
                raise RuntimeError("FlashInfer plans on the host (it reads the lengths): run one eager forward of "
                                   f"this shape (batch {b}, k {k}) before capturing it")
            ws = self._workspace.get(cache.device)
            if ws is None:
                ws = self._workspace[cache.device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8,
                                                                 device=cache.device)
            plan = _Plan(self._cls(), ws, b, k, page_table.shape[1], cache.shape[1], cache.device)
            self.plans[key] = plan
            plan.refresh(page_table, prefix_lens, h, r, dr, sm_scale, q_latent.dtype, cache.dtype)
        elif not capturing and not plan.planned_for(page_table, prefix_lens):
            # eager: re-plan when the page table or the lengths differ from the planned ones (a host comparison,
            # as planning itself reads them on the host); the first layer of a new step does it, later layers match
            plan.refresh(page_table, prefix_lens, h, r, dr, sm_scale, q_latent.dtype, cache.dtype)
        return plan

    @staticmethod
    def _views(q_latent, q_rope, cache):
        b, k, h, r = q_latent.shape
        flat = cache.view(-1, 1, cache.shape[-1])  # page size 1 view of the latent + rope cache
        return q_latent.reshape(b * k, h, r), q_rope.reshape(b * k, h, q_rope.shape[-1]), flat[..., :r], flat[..., r:]

    def mla(self, q_latent, q_rope, cache, page_table, prefix_lens, tree_mask, sm_scale):
        """Chain / decode MLA attention.

        q_latent bf16 [b, k, heads, kv_lora_rank]; q_rope bf16 [b, k, heads, rope_dim] (strided views allowed);
        cache [pages, page_size, kv_lora_rank + rope_dim] (latent then rope; the k tokens' KV already written);
        page_table int32 [b, max_pages]; prefix_lens int32 [b]; tree_mask must be None (a chain: draft i sees the
        prefix and drafts 0..i). Returns bf16 [b, k, heads, kv_lora_rank].

        Raises ValueError for a tree mask; RuntimeError when the first forward of a shape is being captured (plan
        it eagerly first).
        """
        plan = self._plan_for(q_latent, q_rope, cache, page_table, prefix_lens, tree_mask, sm_scale)
        return plan.run(*self._views(q_latent, q_rope, cache)).view(q_latent.shape)


def prepare_mla_attention(q_latent, q_rope, kv_cache, *, page_table, prefix_lens, tree_mask=None, sm_scale,
                          module=None):
    """Plan once (host sync; JIT-compiles FlashInfer's kernel on first use) and return a zero-argument callable that
    only runs FlashInfer's attention (graph capturable): for timing the kernel as SGLang's replay runs it. Arguments
    as :meth:`MLAChainAttention.mla`; raises ValueError for a tree mask."""
    attn = MLAChainAttention(module=module)
    plan = attn._plan_for(q_latent, q_rope, kv_cache, page_table, prefix_lens, tree_mask, sm_scale)
    views = MLAChainAttention._views(q_latent, q_rope, kv_cache)
    shape = q_latent.shape

    def run():
        return plan.run(*views).view(shape)

    run.backend = str(getattr(plan.wrapper, "_planned_backend_name", None) or "?")  # what backend="auto" chose
    return run
