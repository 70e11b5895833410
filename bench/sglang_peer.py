"""SGLang 0.5.23's own Triton kernels as peer baselines for the bench scripts (GPU machine or CPU interpreter).

The wrappers with specverify's semantics (paged KV + bit-packed tree mask in, SGLang's metadata built the way its
Triton backend builds it) live in :mod:`specverify.peers.sglang`; this module re-exports them for
``bench/bench_tree_attention.py``, ``bench/bench_moe.py`` and ``bench/bench_accept.py`` and adds :func:`raw`, the
SGLang kernels themselves. Importing it imports nothing from SGLang; :func:`available` does, after registering an
import-only ``IPython`` / ``IPython.display`` stand-in (``sglang.utils`` imports it at module level).

On the GPU machine (no network, Python 3.12): ``../shared/tools/gpu-wheels.sh .whl`` here, then there
``pip install --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site``.

SGLang kernel signatures, as found in the 0.5.23 wheel
-----------------------------------------------------

``sglang.kernels.ops.attention.extend_attention.extend_attention_fwd(q_extend, k_extend, v_extend, o_extend,
k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, is_causal, mask_indptr, max_len_extend,
k_scale, v_scale, sm_scale=None, logit_cap=0.0, skip_prefix_custom_mask=True, sliding_window_size=-1, sinks=None,
window_kv_offsets=None, xai_temperature_len=-1, lse_extend=None, skip_prefix=False, skip_extend=False,
page_size=1, score_mod=None, aux_tensors=None, extend_seq_lens_cpu=None, identity_kv_indices=False)``
    Tree verify (TARGET_VERIFY) with a custom mask, GQA and MLA. ``q_extend`` [tokens, Hq, Dq]; ``k_extend`` /
    ``v_extend`` the draft tokens' K/V [tokens, Hkv, D]; ``k_buffer`` / ``v_buffer`` the pool [slots, Hkv, D] (MLA:
    [slots, 1, 576] and its [..., :512] view); ``qo_indptr`` [b+1]; ``kv_indptr`` [b+1] over the prefix only;
    ``kv_indices`` int64 token slots; ``custom_mask`` flat uint8/bool, ``k * (prefix_b + k)`` per request (FULL
    layout), ``mask_indptr`` int64 [b+1]; ``k_scale`` / ``v_scale`` floats (1.0). Writes ``o_extend``.

``sglang.kernels.ops.attention.decode_attention.decode_attention_fwd(q, k_buffer, v_buffer, o, kv_indptr,
kv_indices, attn_logits, attn_lse, num_kv_splits, max_kv_splits, sm_scale, k_scale, v_scale, logit_cap=0.0,
sinks=None, xai_temperature_len=-1, has_mla=False, use_pdl=False, page_size=1, score_mod=None, aux_tensors=None,
enable_lean=None, lean_Mp=None, lean_Lp=None, lean_Op=None, lean_locks=None, ...)``
    Split-KV decode (one query per request, no tree). ``attn_logits`` fp32 [b, Hq, max_kv_splits, Dv],
    ``attn_lse`` fp32 [b, Hq, max_kv_splits], ``num_kv_splits`` int32 [b]. (The keyword tail past ``lean_locks``
    varies; pass everything after ``v_scale`` by keyword.)

``sglang.kernels.ops.moe.moe_fused_gate.moe_fused_gate(scores, bias, topk, scoring_func="sigmoid",
num_fused_shared_experts=0, renormalize=True, routed_scaling_factor=1.0, apply_routed_scaling_factor_on_output=False,
moe_softcapping=0.0, num_expert_group=1, topk_group=1, *, bias_alt=None, input_ids=None, bias_alt_token_id=None,
num_token_non_padded=None, renormalize_epsilon=0.0, packed_out=None, sqrtsoftplus_log1p=False)``
    -> ``(topk_weights fp32 [M, topk], topk_ids int32 [M, topk])``; raw logits in; grouped (DeepSeek-V3) when
    ``num_expert_group > 1``.

``sglang.kernels.ops.moe.moe_align_small_numel.moe_align_small_numel(topk_ids, num_experts, block_size,
sorted_token_ids, expert_ids, num_tokens_post_pad, *, write_inactive_prefix_count=False)`` -> None
    One launch, meant for ``topk_ids.numel() <= SMALL_NUMEL_LIMIT`` (64). ``num_experts`` is the bucket count
    E + 1 ("+1 offset": id -1 goes to bucket 0, its blocks get expert id -1); outputs int32, written in place;
    pad slots hold ``numel``; nothing past ``num_tokens_post_pad`` is written.

``sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size.moe_align_block_size(topk_ids, block_size,
num_experts, ignore_invalid_expert=False, *, return_inactive_prefix_count=False, pad_expert_ids=False)``
    -> ``(sorted_ids, expert_ids, num_tokens_post_pad)``, SGLang's dispatcher (small-numel Triton kernel, else the
    CUDA ``sgl_kernel`` one, which the GPU machine lacks: use :func:`specverify.peers.sglang.align`).

``sglang.kernels.ops.moe.fused_moe_triton_kernels.invoke_fused_moe_kernel(A, B, bias, C, A_scale, B_scale, B_zp,
topk_weights, topk_ids, sorted_token_ids, expert_ids, num_tokens_post_padded, mul_routed_weight, top_k, config,
compute_type, use_fp8_w8a8, use_int8_w8a8, use_int8_w8a16, use_int4_w4a16, per_channel_quant, block_shape=None,
no_combine=False, a_use_tma=False, b_use_tma=False, c_sorted=False, filter_expert=True, fuse_sum_all_reduce=False,
router_topk=1, fuse_add_to_output=False, add_output_mask=None, mask_output=False, lora_preserve_base=False,
fuse_swiglu=False, a_output_slices=1)`` -> None
    One expert GEMM of the Triton fused MoE (``fused_moe_kernel``); ``config`` holds BLOCK_SIZE_M/N/K, GROUP_SIZE_M,
    num_warps, num_stages; ``compute_type`` ``tl.bfloat16``.

``sglang.kernels.ops.speculative.spec_tree.sgl_build_tree_kernel_triton(parent_list, selected_index,
verified_seq_len, tree_mask, positions, retrieve_index, retrieve_next_token, retrieve_next_sibling, topk, depth,
draft_token_num, tree_mask_mode=TreeMaskMode.FULL_MASK)`` and ``verify_tree_greedy_triton(predicts, accept_index,
accept_token_num, candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, target_predict)``
    EAGLE tree construction and greedy acceptance (in place).
"""
from __future__ import annotations

import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: dotted name of each raw SGLang kernel this module can hand out
RAW_KERNELS = {
    "extend_attention_fwd": "sglang.kernels.ops.attention.extend_attention.extend_attention_fwd",
    "decode_attention_fwd": "sglang.kernels.ops.attention.decode_attention.decode_attention_fwd",
    "moe_fused_gate": "sglang.kernels.ops.moe.moe_fused_gate.moe_fused_gate",
    "moe_align_small_numel": "sglang.kernels.ops.moe.moe_align_small_numel.moe_align_small_numel",
    "moe_align_block_size": "sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size.moe_align_block_size",
    "invoke_fused_moe_kernel": "sglang.kernels.ops.moe.fused_moe_triton_kernels.invoke_fused_moe_kernel",
    "build_tree_triton": "sglang.kernels.ops.speculative.spec_tree.sgl_build_tree_kernel_triton",
    "verify_tree_greedy_triton": "sglang.kernels.ops.speculative.spec_tree.verify_tree_greedy_triton",
}


class Availability(tuple):
    """``(ok, reason)``; also usable as a bool (``if not available(): ...``)."""

    def __new__(cls, ok: bool, reason: str):
        return super().__new__(cls, (bool(ok), str(reason)))

    def __bool__(self) -> bool:
        return self[0]

    @property
    def reason(self) -> str:
        return self[1]


def _peers():
    return importlib.import_module("specverify.peers.sglang")


def _install_standins() -> None:
    """Import-only IPython and torchvision stand-ins (tests/sglang/standins.py) where the real ones do not load.

    SGLang's ``srt`` modules (the MoE alignment dispatcher, the fused-MoE config) import torchvision through a config
    module at import time; neither machine has a torchvision that loads beside its torch.
    """
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "sglang")
    if here not in sys.path:
        sys.path.insert(0, here)
    importlib.import_module("standins").install()


def available() -> Availability:
    """Whether SGLang's Triton kernels import here: ``(ok, reason)``, truthy only when ok. Never raises."""
    try:
        _install_standins()
        ok, reason = _peers().available()
    except Exception as exc:
        return Availability(False, f"specverify.peers.sglang failed: {exc.__class__.__name__}: {exc}")
    return Availability(ok, reason)


def raw(name: str):
    """The SGLang kernel ``name`` (a key of :data:`RAW_KERNELS`), imported on demand.

    Raises
    ------
    KeyError
        Unknown name; the message lists the known ones.
    RuntimeError
        SGLang or the kernel's module does not import here (the message has the import error).
    """
    if name not in RAW_KERNELS:
        raise KeyError(f"unknown SGLang kernel {name!r}; known: {sorted(RAW_KERNELS)}")
    ok, reason = available()
    if not ok:
        raise RuntimeError(f"SGLang kernels unavailable: {reason}")
    module, _, attr = RAW_KERNELS[name].rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception as exc:
        raise RuntimeError(f"{RAW_KERNELS[name]} does not import: {exc.__class__.__name__}: {exc}") from exc


def __getattr__(name: str):
    # Everything else (prepare_tree_attention, tree_attention, tree_attention_mla, route, route_and_align, align,
    # align_path, fused_experts, prepare_fused_experts, VerifyAttention, ...) comes from specverify.peers.sglang.
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(_peers(), name)


def _main() -> None:
    ok, reason = available()
    print(f"SGLang peer kernels available: {ok} ({reason})")
    rows = []
    for name in RAW_KERNELS:
        try:
            raw(name)
            rows.append((name, "ok"))
        except Exception as exc:
            rows.append((name, f"{exc.__class__.__name__}: {str(exc)[:80]}"))
    width = max(len(n) for n, _ in rows)
    print(f"{'kernel'.ljust(width)}  status")
    for n, s in rows:
        print(f"{n.ljust(width)}  {s}")


if __name__ == "__main__":
    _main()
