"""A CPU stand-in for ``flashinfer`` (``BatchMLAPagedAttentionWrapper`` only), computing FlashInfer's documented
semantics from exactly what ``plan`` and ``run`` receive, so a test checks the metadata our peer builds.

Semantics (FlashInfer's MLA wrapper, page size 1): request b owns query rows ``qo_indptr[b]:qo_indptr[b+1]`` and
KV rows ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` of the caches ([slots, 1, D]); ``kv_len_arr[b]`` equals that
count; with ``causal`` query i of a request with q_len rows sees KV j <= kv_len - q_len + i (bottom-right aligned).
score = (q_nope · ckv + q_pe · kpe) * sm_scale, out = softmax(score) @ ckv, computed in fp64.
"""
from __future__ import annotations

import types

import torch


class BatchMLAPagedAttentionWrapper:
    """Records every plan and run; ``use_cuda_graph`` buffers must be the ones planned (as FlashInfer's graph mode
    needs fixed addresses)."""

    instances: list = []

    def __init__(self, workspace, use_cuda_graph=False, qo_indptr=None, kv_indptr=None, kv_indices=None,
                 kv_len_arr=None, backend="auto"):
        assert workspace.dtype == torch.uint8
        self.use_cuda_graph, self.backend = use_cuda_graph, backend
        self.buffers = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        self.plans, self.runs = [], 0
        self._planned_backend_name = "standin"
        BatchMLAPagedAttentionWrapper.instances.append(self)

    def plan(self, *, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe,
             page_size, causal, sm_scale, q_data_type, kv_data_type):
        if self.use_cuda_graph:
            for given, fixed in zip((qo_indptr, kv_indptr, kv_indices, kv_len_arr), self.buffers):
                assert given.data_ptr() == fixed.data_ptr(), "graph-mode plan with other buffers"
        for t in (qo_indptr, kv_indptr, kv_indices, kv_len_arr):
            assert t.dtype == torch.int32, t.dtype
        self.plans.append(dict(qo=qo_indptr.clone(), kv=kv_indptr.clone(), idx=kv_indices.clone(),
                               lens=kv_len_arr.clone(), heads=num_heads, ckv=head_dim_ckv, kpe=head_dim_kpe,
                               page_size=page_size, causal=causal, sm_scale=sm_scale))

    def run(self, *, q_nope, q_pe, ckv_cache, kpe_cache, out):
        p = self.plans[-1]  # the plan in force: what a graph replay or a later run reads
        self.runs += 1
        assert p["page_size"] == 1 and ckv_cache.shape[1] == 1 and kpe_cache.shape[1] == 1
        assert q_nope.shape[1] == p["heads"] and q_nope.shape[2] == p["ckv"] and q_pe.shape[2] == p["kpe"]
        res = torch.empty(q_nope.shape, dtype=torch.float64)
        for b in range(p["lens"].numel()):
            q0, q1 = int(p["qo"][b]), int(p["qo"][b + 1])
            k0, k1 = int(p["kv"][b]), int(p["kv"][b + 1])
            assert k1 - k0 == int(p["lens"][b])
            # graph mode reads the fixed index buffer at run time (the plan copied the offsets and lengths only)
            idx = (self.buffers[2] if self.use_cuda_graph else p["idx"])[k0:k1].long()
            c = ckv_cache[idx, 0].double()  # [L, R]
            kr = kpe_cache[idx, 0].double()
            qn, qp = q_nope[q0:q1].double(), q_pe[q0:q1].double()  # [q, H, *]
            s = (torch.einsum("qhr,lr->hql", qn, c) + torch.einsum("qhd,ld->hql", qp, kr)) * p["sm_scale"]
            if p["causal"]:
                i = torch.arange(q1 - q0).view(-1, 1)
                j = torch.arange(k1 - k0).view(1, -1)
                s = s.masked_fill(j > (k1 - k0) - (q1 - q0) + i, float("-inf"))
            res[q0:q1] = torch.einsum("hql,lr->qhr", torch.softmax(s, -1), c)
        out.copy_(res.to(out.dtype))
        return out


def module(version: str = "0.7.2.post1"):
    """A ``flashinfer`` module object holding the stand-in wrapper."""
    mod = types.ModuleType("flashinfer")
    mod.__version__ = version
    mod.BatchMLAPagedAttentionWrapper = BatchMLAPagedAttentionWrapper
    return mod
