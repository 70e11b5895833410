"""The ``specverify`` SGLang attention backend: SGLang's Triton backend with our tree-attention verify kernel.

Every forward mode is SGLang's :class:`~sglang.srt.layers.attention.triton_backend.TritonAttnBackend` except
TARGET_VERIFY, which runs :func:`specverify.tree_attention` (MHA/GQA) or :func:`specverify.tree_attention_mla`
(absorbed MLA, DeepSeek-V3 / Kimi-K2) once SGLang has written the draft tokens' KV. The subclass reuses the Triton
backend's KV write, metadata and CUDA-graph machinery and adds three things:

* per batch: a page table (``req_to_token`` rows of the batch, as pages when the pool's page size allows),
  the prefix lengths (``forward_batch.seq_lens`` in verify mode) and the tree mask bit-packed to
  uint8 ``[batch, D, ceil(D/8)]``;
* the verify-mask layout: with CUDA graphs the backend asks SGLang's tree builder for the compact per-request
  ``[D, D]`` layout (``TreeMaskMode.QLEN_ONLY``) instead of the ``[D, prefix + D]`` one the Triton kernel reads, so
  the draft stage no longer writes a mask that grows with the context. In eager mode it reads whichever layout
  ``spec_info.custom_mask`` has;
* graph safety: static page-table / prefix / packed-mask buffers filled outside the graph
  (``init_forward_metadata_out_graph``) and the mask packed inside it (``init_forward_metadata_in_graph``), so a
  replay sees the mask the draft stage wrote just before it.

The backend declines to the Triton kernel (counted in ``specverify.integrations.sglang_stats.STATS``, which the
plugin shows as ``specverify.integrations.sglang.STATS``; logged once per reason) for anything our kernels do not
cover: sliding windows, logit caps, sinks, score mods, fp8/quantised KV, context parallelism (DCP), translated
(unified) KV pools, deterministic mode, head sizes the kernel does not support, or when ``specverify.attention``
cannot be imported.
"""
from __future__ import annotations

import inspect
import logging

import torch

from specverify.integrations.sglang_stats import STATS, log_once

logger = logging.getLogger("specverify.sglang")

_CLASS: list[type] = []


def make_backend(model_runner):
    """Build the backend for ``model_runner`` (SGLang's factory signature)."""
    return backend_class()(model_runner)


def backend_class() -> type:
    """The backend class (defined on first use: it subclasses SGLang's Triton backend, imported lazily)."""
    if not _CLASS:
        _CLASS.append(_define_class())
    return _CLASS[0]


def pack_bool_rows(mask: torch.Tensor) -> torch.Tensor:
    """bool/uint8 ``[..., D, D]`` (nonzero = visible) → uint8 ``[..., D, ceil(D/8)]``, bit ``j % 8`` of byte ``j // 8``.

    Shape-static torch ops only (no host sync), so it can run inside a CUDA graph.
    """
    d = mask.shape[-1]
    nbytes = (d + 7) // 8
    bits = (mask != 0).to(torch.int32)
    if nbytes * 8 != d:
        bits = torch.nn.functional.pad(bits, (0, nbytes * 8 - d))
    weights = torch.bitwise_left_shift(torch.ones(8, dtype=torch.int32, device=mask.device),
                                       torch.arange(8, dtype=torch.int32, device=mask.device))
    return (bits.view(*mask.shape[:-1], nbytes, 8) * weights).sum(-1).to(torch.uint8)


def _tree_block_of_full_mask(custom_mask: torch.Tensor, seq_lens: torch.Tensor, d: int) -> torch.Tensor:
    """The ``[bs, D, D]`` draft-to-draft block of SGLang's FULL_MASK layout (rows of ``prefix + D`` per request)."""
    bs = seq_lens.shape[0]
    seq = seq_lens.to(torch.int64)
    row = seq + d  # [bs]
    start = torch.cumsum(d * row, 0) - d * row  # exclusive prefix sum: where request b's mask starts
    i = torch.arange(d, device=seq.device, dtype=torch.int64)
    idx = start[:, None, None] + i[None, :, None] * row[:, None, None] + seq[:, None, None] + i[None, None, :]
    return custom_mask.reshape(-1)[idx.reshape(-1)].view(bs, d, d)


def _define_class() -> type:
    from sglang.kernels.ops.speculative.spec_tree import TreeMaskMode
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.layers.attention.verify_mask import VerifyMask

    stats = STATS

    class SpecverifyAttnBackend(TritonAttnBackend):
        """SGLang's Triton attention backend with TARGET_VERIFY through specverify's tree attention."""

        def __init__(self, model_runner, *args, **kwargs):
            super().__init__(model_runner, *args, **kwargs)
            self._sv_ops = None
            self._sv_runner_model = getattr(model_runner, "model", None)
            self._sv_reason = self._sv_static_reason(model_runner)
            if self._sv_reason:
                log_once("attn-static:" + self._sv_reason,
                         f"specverify attention: TARGET_VERIFY stays on SGLang's Triton kernel: {self._sv_reason}",
                         logging.WARNING)
            else:
                # SGLang's own verify fast paths would run before ours; ours replaces them.
                self.use_verify_shared_kv = False
                self.use_verify_splitkv = False
            self._sv_eager = None
            self._sv_graph_meta = None
            self._sv_meta = None  # (page_table, prefix_lens, packed mask or None, page_size) for this batch
            self._sv_graph = None  # static buffers for CUDA graphs
            self._sv_qlen_mask = False

        # ---- eligibility ------------------------------------------------------------------------------------
        def _sv_static_reason(self, model_runner) -> str:
            if self.dllm_attention is not None:
                return "diffusion-LM attention"
            if self.sliding_window_size is not None and self.sliding_window_size > 0:
                return "sliding-window model"
            if self.dcp_size > 1:
                return "decode context parallelism (DCP)"
            if getattr(self.kv_index_translator, "is_translating", False):
                return "translated (unified-memory) KV pool"
            if self.enable_deterministic:
                return "deterministic inference"
            kv_dtype = getattr(model_runner, "kv_cache_dtype", None)
            if kv_dtype not in (torch.bfloat16, torch.float16):
                return f"KV cache dtype {kv_dtype} (needs bf16/fp16)"
            try:
                from specverify import attention as ops
            except Exception as exc:
                return f"specverify.attention unavailable ({exc.__class__.__name__}: {exc})"
            self._sv_ops = ops
            self._sv_kwargs = set(inspect.signature(ops.tree_attention).parameters)
            return ""

        def _sv_layer_reason(self, layer, q, k_buffer, o, *, logit_cap, sliding_window_size, sinks, score_mod,
                             aux_tensors, xai_temperature_len, k_descale, v_descale) -> str:
            if logit_cap:
                return "logit cap"
            if sliding_window_size is not None and sliding_window_size > -1:
                return "sliding-window layer"
            if sinks is not None or score_mod is not None or aux_tensors is not None:
                return "sinks / score_mod"
            if xai_temperature_len is not None and xai_temperature_len > 0:
                return "xai temperature"
            if k_descale != 1.0 or v_descale != 1.0:
                return "scaled (quantised) KV"
            if q.dtype not in (torch.bfloat16, torch.float16) or k_buffer.dtype != q.dtype:
                return f"dtypes q {q.dtype} / kv {k_buffer.dtype}"
            return ""

        # ---- metadata -----------------------------------------------------------------------------------------
        def _sv_page_view(self, width_tokens: int) -> int:
            """The page size we present the pool with: SGLang's when its buffer splits into whole pages."""
            p = int(self.page_size)
            return p if p > 1 and width_tokens % p == 0 else 1

        def _sv_num_tokens(self, forward_batch) -> int:
            return self._target_verify_num_tokens_per_req(forward_batch.spec_info)

        def _sv_tree_bool(self, forward_batch, bs: int, d: int):
            custom_mask = getattr(forward_batch.spec_info, "custom_mask", None)
            if custom_mask is None:
                return None
            if custom_mask.numel() == bs * d * d or (
                    self._verify_mask is not None and self._sv_qlen_mask
                    and custom_mask.data_ptr() == self._verify_mask.buffer.data_ptr()):
                return custom_mask.reshape(-1)[: bs * d * d].view(bs, d, d)
            return _tree_block_of_full_mask(custom_mask, forward_batch.seq_lens[:bs], d)

        def init_forward_metadata(self, forward_batch):
            self._sv_meta = None
            self._sv_eager = None
            if self._sv_reason or not forward_batch.forward_mode.is_target_verify():
                return super().init_forward_metadata(forward_batch)
            super().init_forward_metadata(forward_batch)
            bs = len(forward_batch.req_pool_indices)
            d = self._sv_num_tokens(forward_batch)
            rows = self.req_to_token[forward_batch.req_pool_indices[:bs]]
            p = self._sv_page_view(self.token_to_kv_pool.get_key_buffer(
                self.token_to_kv_pool.start_layer).shape[0])
            page_table = rows[:, ::p] // p if p > 1 else rows
            tree = self._sv_tree_bool(forward_batch, bs, d)
            packed = None if tree is None else pack_bool_rows(tree)
            self._sv_meta = (page_table.to(torch.int32), forward_batch.seq_lens[:bs].to(torch.int32), packed, p)
            # A declined layer runs the Triton kernel, which reads the FULL layout: when the mask came compact
            # (and differs from FULL, i.e. some prefix is non-empty) keep what is needed to rebuild it.
            mask = getattr(forward_batch.spec_info, "custom_mask", None)
            prefix_sum = forward_batch.seq_lens_sum
            compact = tree is not None and mask.numel() == bs * d * d and (prefix_sum is None or prefix_sum > 0)
            self._sv_eager = (tree, forward_batch.seq_lens[:bs], d) if compact else None

        def _sv_full_mask(self):
            """Eager only: SGLang's FULL layout rebuilt from the compact tree block (for a declined layer)."""
            tree, seq_lens, d = self._sv_eager
            bs = seq_lens.shape[0]
            seq_lens_sum = int(seq_lens.sum())  # host sync: eager only
            full = torch.ones(seq_lens_sum * d + bs * d * d, dtype=torch.uint8, device=tree.device)
            seq = seq_lens.to(torch.int64)
            row = seq + d
            start = torch.cumsum(d * row, 0) - d * row
            i = torch.arange(d, device=seq.device, dtype=torch.int64)
            idx = start[:, None, None] + i[None, :, None] * row[:, None, None] + seq[:, None, None] + i[None, None, :]
            full[idx.reshape(-1)] = (tree != 0).to(torch.uint8).reshape(-1)
            return full

        def init_cuda_graph_state(self, max_bs, max_num_tokens, *args, **kwargs):
            super().init_cuda_graph_state(max_bs, max_num_tokens, *args, **kwargs)
            if self._sv_reason or not self.num_draft_tokens or self.is_draft_runner or self.skip_prefill:
                return
            d = int(self.num_draft_tokens)
            slots = self.token_to_kv_pool.get_key_buffer(self.token_to_kv_pool.start_layer).shape[0]
            p = self._sv_page_view(slots)
            width = -(-self.req_to_token.shape[1] // p)
            dev = self.device
            self._sv_graph = {
                "page_table": torch.zeros((max_bs, width), dtype=torch.int32, device=dev),
                "prefix": torch.zeros((max_bs,), dtype=torch.int32, device=dev),
                "mask": torch.zeros((max_bs, d, (d + 7) // 8), dtype=torch.uint8, device=dev),
                "page": p,
                "bs": 0,
                "has_mask": False,
            }
            if self._all_layers_eligible():
                # Ask the tree builder for the compact [D, D] layout: a mask that no longer grows with context.
                self._verify_mask = VerifyMask(
                    buffer=torch.zeros(max_bs * d * d, dtype=torch.uint8, device=dev),
                    mode=TreeMaskMode.QLEN_ONLY, max_bs=max_bs, is_read=True)
                self._sv_qlen_mask = True

        def _all_layers_eligible(self) -> bool:
            model = getattr(getattr(self, "_sv_runner_model", None), "modules", None)
            # Layers are checked at call time too; this only decides the mask layout. Without a model to scan
            # (unit-test runners) the compact layout is used.
            if model is None:
                return True
            for m in model():
                if m.__class__.__name__ == "RadixAttention":
                    if getattr(m, "logit_cap", 0) or (getattr(m, "sliding_window_size", -1) or -1) > -1:
                        return False
            return True

        def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
            super().init_forward_metadata_out_graph(forward_batch, in_capture)
            self._sv_meta = None
            g = self._sv_graph
            if g is None or not forward_batch.forward_mode.is_target_verify():
                return
            bs = len(forward_batch.req_pool_indices)
            p = g["page"]
            rows = self.req_to_token[forward_batch.req_pool_indices[:bs]]
            pt = rows[:, ::p] // p if p > 1 else rows
            g["page_table"][:bs, : pt.shape[1]].copy_(pt)
            g["prefix"][:bs].copy_(forward_batch.seq_lens[:bs])
            g["bs"] = bs
            g["has_mask"] = getattr(forward_batch.spec_info, "custom_mask", None) is not None
            self._sv_meta = (g["page_table"][:bs], g["prefix"][:bs], g["mask"][:bs] if g["has_mask"] else None, p)
            self._sv_graph_meta = self._sv_meta

        def init_forward_metadata_in_graph(self, forward_batch):
            super().init_forward_metadata_in_graph(forward_batch)
            g = self._sv_graph
            if g is None or not forward_batch.forward_mode.is_target_verify() or not g["has_mask"]:
                return
            bs, d = g["bs"], g["mask"].shape[1]
            src = self.forward_metadata.custom_mask
            if src is None:
                return
            if self._sv_qlen_mask:
                tree = src.reshape(-1)[: bs * d * d].view(bs, d, d)
            else:
                tree = _tree_block_of_full_mask(src, g["prefix"][:bs], d)
            g["mask"][:bs].copy_(pack_bool_rows(tree))

        # ---- the verify kernel ------------------------------------------------------------------------------
        def _forward_extend_kernel(self, layer, *args, **kwargs):
            meta = self._sv_meta
            if meta is not None and not self._sv_reason:
                (q, k, v, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, causal,
                 mask_indptr, max_extend_len, k_descale, v_descale, sm_scale) = args[:16]
                reason = self._sv_layer_reason(
                    layer, q, k_buffer, o, logit_cap=kwargs.get("logit_cap", 0.0),
                    sliding_window_size=kwargs.get("sliding_window_size", -1), sinks=kwargs.get("sinks"),
                    score_mod=kwargs.get("score_mod"), aux_tensors=kwargs.get("aux_tensors"),
                    xai_temperature_len=kwargs.get("xai_temperature_len", -1), k_descale=k_descale,
                    v_descale=v_descale)
                if not reason:
                    self._sv_run(q, o, k_buffer, v_buffer, sm_scale, meta)
                    stats["verify_ours"] += 1
                    return o
                stats["verify_declined"] += 1
                log_once("attn-layer:" + reason, f"specverify attention: layer {layer.layer_id} stays on SGLang's "
                         f"Triton kernel: {reason}")
                if self._sv_eager is not None:
                    args = args[:9] + (self._sv_full_mask(),) + args[10:]
                elif self._sv_qlen_mask and self._sv_graph is not None and self._sv_meta is self._sv_graph_meta:
                    raise RuntimeError(
                        f"specverify attention: layer {layer.layer_id} needs SGLang's Triton verify kernel ({reason}) "
                        "but the verify mask is in the compact layout it cannot read; start the server with "
                        "SPECVERIFY_SGLANG_ATTENTION=0 or --attention-backend triton")
            return super()._forward_extend_kernel(layer, *args, **kwargs)

        def _sv_run(self, q, o, k_buffer, v_buffer, sm_scale, meta):
            page_table, prefix, packed, p = meta
            bs = prefix.shape[0]
            d = q.shape[0] // bs
            extra = {"validate": False} if "validate" in self._sv_kwargs else {}
            slots = k_buffer.shape[0]
            if self.use_mla:
                dv = o.shape[-1]
                h = q.shape[1]
                qv = q.view(bs, d, h, q.shape[-1])
                kv = k_buffer.view(slots // p, p, k_buffer.shape[-1])
                out = o.view(bs, d, h, dv)
                self._sv_ops.tree_attention_mla(
                    qv[..., :dv].contiguous(), qv[..., dv:].contiguous(), kv, page_table=page_table,
                    prefix_lens=prefix, tree_mask=packed, sm_scale=float(sm_scale), out=out, **extra)
            else:
                hq, hkv = q.shape[1], k_buffer.shape[1]
                kc = k_buffer.view(slots // p, p, hkv, k_buffer.shape[-1])
                vc = v_buffer.view(slots // p, p, hkv, v_buffer.shape[-1])
                out = o.view(bs, d, hq, o.shape[-1])
                self._sv_ops.tree_attention(
                    q.view(bs, d, hq, q.shape[-1]), kc, vc, page_table=page_table, prefix_lens=prefix,
                    tree_mask=packed, sm_scale=float(sm_scale), out=out, **extra)

    SpecverifyAttnBackend.__module__ = __name__
    return SpecverifyAttnBackend
