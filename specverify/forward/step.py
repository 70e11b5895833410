"""The verify step as a serving engine hands it over, with no engine imported: token-slot page tables from CSR
attention metadata, tree masks from EAGLE's tree links, a model's own rotary table and softmax scale, and the
verify forward over weights the engine loaded.

SGLang's whole-step plugin (:mod:`specverify.integrations.sglang_step`) is a thin adapter from SGLang's objects
(``ForwardBatch``, the binding's pool view, ``EagleVerifyInput``) onto the functions here, and
``specverify bench verify-wall --impl sglang-step`` drives the same functions over its own weights and KV on a GPU
where SGLang cannot be imported, so the step SGLang runs and the step we time are one code path::

    kv_indptr / kv_indices / out_cache_loc  ->  page_table_from_metadata  ->  token-slot page table [b, width]
    retrieve_next_token / _sibling          ->  tree_mask_from_links      ->  packed ancestor mask [b, k, k/8]
    the model's cos_sin_cache and scaling   ->  model_ops                 ->  the op table's mla_prep / attention
                                            ->  LoadedVerifyModel.forward_captured (logits, hidden, EAGLE-3 aux)

Every function here is capturable in a CUDA graph: fixed shapes per width, fixed-count loops, no host sync.
"""
from __future__ import annotations

import dataclasses

import torch

from specverify.configs import ModelConfig, RankShapes
from specverify.forward.model import VerifyModel, attach_folded_q_b, q_norm_foldable
from specverify.forward.ops import Ops
from specverify.reference.attention import gather_positions
from specverify.tree import pack_mask


def tree_mask_from_links(next_token: torch.Tensor, next_sibling: torch.Tensor) -> torch.Tensor:
    """Our packed ancestor mask uint8 [b, k, ceil(k/8)] from an EAGLE verify input's tree links.

    next_token / next_sibling int [b, k]: first child / next sibling of each node (local ids, -1 none), as
    ``EagleVerifyInput.retrieve_next_token`` / ``retrieve_next_sibling`` hold them (and
    :meth:`specverify.DraftTree.retrieve_links` gives them). Fixed-count loops over k, no host sync: capturable.
    Bit j of row i is set when node j is node i or one of its ancestors.
    """
    b, k = next_token.shape
    dev = next_token.device
    nodes = torch.arange(k, device=dev).expand(b, k)
    sink = torch.full((b, 1), k, dtype=torch.long, device=dev)  # column k absorbs the writes of "-1" links
    parent = torch.full((b, k + 1), -1, dtype=torch.long, device=dev)
    child = torch.where(next_token >= 0, next_token.long(), sink)
    sibling = torch.where(next_sibling >= 0, next_sibling.long(), sink)
    parent.scatter_(1, child, nodes)
    for _ in range(k):  # a sibling's parent is its left sibling's; chains are at most k long
        parent.scatter_(1, sibling, parent[:, :k].clone())
    parent[:, k] = -1
    anc = torch.zeros(b, k, k + 1, dtype=torch.bool, device=dev)
    cur = nodes.clone()
    for _ in range(k):  # walk every node up to the root
        anc.scatter_(2, torch.where(cur >= 0, cur, sink).unsqueeze(-1), True)
        cur = torch.gather(parent, 1, torch.where(cur >= 0, cur, sink))
    return pack_mask(anc[..., :k])


def page_table_from_metadata(kv_indptr, kv_indices, out_cache_loc, prefix_lens, k: int, width: int):
    """int32 [b, width] token slots (a page table of page size 1 over the cache viewed as ``[slots, 1, D]``).

    The prefix of request b is ``kv_indices[kv_indptr[b] : kv_indptr[b] + prefix_lens[b]]`` (the CSR rows of the
    attention metadata), then its k draft slots ``out_cache_loc[b * k : (b + 1) * k]`` at ``prefix_lens[b] + i``.
    Columns past a request's length are 0 (SGLang's padding slot). Capturable: fixed width, no host sync.
    """
    b = prefix_lens.shape[0]
    dev = prefix_lens.device
    col = torch.arange(width, device=dev).view(1, width)
    lens = prefix_lens.long().view(b, 1)
    idx = (kv_indptr[:b].long().view(b, 1) + col).clamp(max=max(kv_indices.numel() - 1, 0))
    table = torch.where(col < lens, kv_indices[idx].long() if kv_indices.numel() else torch.zeros_like(idx), 0)
    draft = (lens + torch.arange(k, device=dev).view(1, k)).clamp(max=width - 1)
    table.scatter_(1, draft, out_cache_loc.view(b, k).long())
    return table.to(torch.int32)


def slot_table_width(tokens: int) -> int:
    """Columns of a token-slot page table for requests of up to ``tokens`` tokens: rounded up to a multiple of 64,
    so eager steps of growing requests reuse a few shapes."""
    return -(-max(tokens, 1) // 64) * 64


def model_ops(base: Ops, cos_sin: torch.Tensor, neox: bool, sm_scale: float) -> Ops:
    """``base`` with the model's RoPE in ``mla_prep`` (and ``mla_prep_absorb``) and ``attention_mla`` at the model's
    softmax scale.

    cos_sin : float [max_position, rope_dim]
        The model's rotary table (cos half, then sin half; SGLang's ``rotary_emb.cos_sin_cache``): DeepSeek-V3 and
        Kimi-K2 use YaRN tables, which the generic theta RoPE of :class:`~specverify.forward.model.VerifyModel`
        does not model.
    neox : bool
        Rotate halves (``is_neox_style``); else interleaved pairs (GPT-J, DeepSeek's checkpoints).
    sm_scale : float
        The model's softmax scale (``self_attn.scaling``: mscale-corrected for YaRN).

    ``mla_prep`` stays one fused launch when ``base`` runs Triton small ops (``pieces["small_ops"] ==
    "triton"``: :func:`specverify.fused_ops.mla_kv_prep` reads the table), else the torch reference. The routing
    and expert slots (``route``, ``route_shared``, ``experts``, ``experts_with_shared``) read no model table and stay
    as ``base`` has them. Mutates and returns ``base``.
    """
    from specverify.fused_ops import mla_kv_prep, mla_prep_absorb

    impl = "triton" if base.pieces.get("small_ops") == "triton" else "reference"
    attention_mla = base.attention_mla

    def mla_prep(q, kv, positions, norm_w, cache, page_table, prefix_lens, eps, _theta, nope):
        return mla_kv_prep(q, kv, positions, norm_w, cache, page_table, prefix_lens, eps=eps, theta=1.0,
                           nope_dim=nope, cos_sin=cos_sin, interleaved=not neox, impl=impl)

    def prep_absorb(q, kv, positions, norm_w, w_uk, cache, page_table, prefix_lens, eps, _theta, nope, q_sumsq=None,
                    q_dim=None):
        return mla_prep_absorb(q, kv, positions, norm_w, w_uk, cache, page_table, prefix_lens, eps=eps, theta=1.0,
                               nope_dim=nope, cos_sin=cos_sin, interleaved=not neox, q_sumsq=q_sumsq, q_dim=q_dim,
                               impl=impl)

    def attention(q_latent, q_rope, cache, page_table, prefix_lens, tree_mask, _generic_scale):
        return attention_mla(q_latent, q_rope, cache, page_table, prefix_lens, tree_mask, sm_scale)

    base.mla_prep, base.attention_mla = mla_prep, attention
    # the fused slot reads the same table (a table without it keeps composing mla_prep and mla_absorb_q)
    base.mla_prep_absorb = prep_absorb if base.mla_prep_absorb is not None else None
    base.pieces["rope"] = f"model table ({impl}, {'halves' if neox else 'interleaved pairs'})"
    return base


class LoadedVerifyModel(VerifyModel):
    """:class:`~specverify.forward.model.VerifyModel` over given weights (no dummy weights drawn), at tp = 1 or as
    one rank of a tensor-parallel group whose collectives the engine owns.

    ``weights``: ``{"embed", "lm_head", "final_norm", "layers": [per-layer dicts]}`` in VerifyModel's layout
    (SGLang's come from :func:`specverify.integrations.sglang_step.read_weights`). :meth:`forward_captured`
    counts its calls (the tests' proof that ours ran).

    Tensor parallel (``tp > 1``): the weights are this rank's shards (heads of ``q_b`` / ``w_uk`` / ``w_uv`` /
    ``o``, the intermediate dimension of the dense MLP, the shared expert and the routed experts, a vocabulary
    shard of ``embed`` / ``lm_head``), the rest replicated. ``weights["vocab_range"] = (start, end)`` names the token
    ids whose rows ``embed[: end - start]`` holds, any further rows being padding (an engine may pad its vocabulary, so
    the shards need not be ``ceil(vocab / tp)``); ``lm_head`` is the rank's whole (padded) shard, and the gathered
    logits are cut to the config's vocabulary, which assumes the engine pads at the end (SGLang's
    ``VocabParallelEmbedding`` does).
    MLA layers get ``q_b_folded`` (a copy of q_b times q_a's norm weight, :attr:`folded_bytes` in all) so the forward
    folds q_a's RMSNorm away where our kernels run qkv_a (see :data:`~specverify.forward.model.FOLD_Q_NORM`).
    ``collectives`` does every collective, so the engine's own paths (custom all-reduce, graph-capture buffers)
    serve ours: ``collectives.all_reduce(x) -> x summed over the group`` (in place or a new tensor) and
    ``collectives.all_gather(x, dim) -> the ranks' x concatenated along dim`` (SGLang's
    ``tensor_model_parallel_all_reduce`` / ``tensor_model_parallel_all_gather``, or its TP ``GroupCoordinator``).
    The forward all-reduces the embedding, each attention output and each MLP / MoE output (routed plus shared
    expert, summed before the reduce) and all-gathers the logits. :attr:`shapes` are read from the shards.

    Raises
    ------
    ValueError
        ``tp > 1`` without ``collectives`` or ``vocab_range``, or ``rank`` outside ``[0, tp)``.
    """

    def __init__(self, config: ModelConfig, weights: dict, *, dtype, device, ops: Ops, tp: int = 1, rank: int = 0,
                 collectives=None):
        tp, rank = int(tp), int(rank)
        if tp < 1 or not 0 <= rank < tp:
            raise ValueError(f"tp must be >= 1 and rank in [0, tp), got tp={tp}, rank={rank}")
        if tp > 1 and (collectives is None or weights.get("vocab_range") is None):
            raise ValueError("tp > 1 needs collectives (all_reduce, all_gather: the engine's TP group) and "
                             "weights['vocab_range'] (the token ids of this rank's embedding rows), got "
                             f"collectives={collectives!r}, vocab_range={weights.get('vocab_range')!r}")
        self._given = weights
        super().__init__(config, tp=1, dtype=dtype, device=device, ops=ops)  # the shards need no shape table
        self.tp, self.rank, self.collectives = tp, rank, collectives
        if tp > 1:
            self.shapes = self._shard_shapes()
        self.calls = 0

    def _build_weights(self):
        w = self._given
        self.embed, self.lm_head, self.final_norm = w["embed"], w["lm_head"], w["final_norm"]
        self.vocab_range = w.get("vocab_range")
        self.layers = [self._with_folded_q_b(lw) for lw in w["layers"]]
        self._sets = {("layer", i): lw for i, lw in enumerate(self.layers)}
        self.folded_bytes = sum(lw["q_b_folded"].numel() * lw["q_b_folded"].element_size() for lw in self.layers
                                if "q_b_folded" in lw)

    @staticmethod
    def _with_folded_q_b(lw: dict) -> dict:
        """A layer dict with ``q_b_folded`` (q_b times q_a's norm weight,
        :func:`~specverify.forward.model.attach_folded_q_b`) added: a copy of ours, made once here, so the forward can
        fold q_a's RMSNorm away (one launch fewer per layer; :data:`~specverify.forward.model.FOLD_Q_NORM`). The
        engine's tensors and the given dict are not modified. Made only where the fold can run
        (:func:`~specverify.forward.model.q_norm_foldable`); else the forward keeps the RMSNorm. The copy is a
        snapshot: after an in-place weight update call :meth:`refold` (the forward raises on a stale one)."""
        if "q_b_folded" in lw or not q_norm_foldable(lw):
            return lw
        return attach_folded_q_b(dict(lw))

    def _shard_shapes(self) -> RankShapes:
        """This rank's shapes, read from the shards (an engine's padding may differ from ``per_rank_shapes``)."""
        s, c = self.shapes, self.config
        first = self.layers[0]
        heads = first["q_b"].shape[0] if c.attention == "mla" else s.num_heads // self.tp
        dense = next((w for w in self.layers if w["dense"]), None)
        moe = next((w for w in self.layers if not w["dense"]), None)
        inter = dense["down"].shape[1] if dense is not None else 0
        moe_inter = shared = 0
        if moe is not None:
            moe_inter = moe["w13"].shape[1] // 2 if moe.get("w13") is not None else -(-c.moe_intermediate_size //
                                                                                      self.tp)
            shared = moe["shared_down"].shape[1] if moe.get("shared_down") is not None else 0
        return dataclasses.replace(s, tp=self.tp, num_heads=heads, intermediate_size=inter,
                                   moe_intermediate_size=moe_inter, shared_intermediate_size=shared,
                                   vocab_size=self.lm_head.shape[0])

    def _vocab_shard(self):
        """The engine's vocabulary shard (``weights["vocab_range"]``; its padding need not follow ours)."""
        return self.vocab_range if self.tp > 1 else None

    def forward_captured(self, input_ids, positions, kv_caches, page_table, prefix_lens, tree_mask=None,
                         capture_layers=()):
        """:meth:`VerifyModel.forward_captured`, counted in :attr:`calls`."""
        self.calls += 1
        return super().forward_captured(input_ids, positions, kv_caches, page_table, prefix_lens, tree_mask,
                                        capture_layers)


def token_slot_caches(kv_caches) -> list:
    """Each layer's cache viewed as token slots ``[pages * page_size, 1, D]`` (the layout the CSR metadata's
    token ids address). Views, no copy; the caches must be contiguous."""
    out = []
    for layer in kv_caches:
        out.append([c.view(c.shape[0] * c.shape[1], 1, *c.shape[2:]) for c in layer])
    return out


def csr_metadata(page_table: torch.Tensor, prefix_lens: torch.Tensor, k: int, page_size: int):
    """What a serving engine's Triton attention backend holds for TARGET_VERIFY over our paged cache:
    ``(kv_indptr int32 [b + 1], kv_indices int64 [sum(prefix_lens)], out_cache_loc int64 [b * k])`` in token
    slots (``page * page_size + offset``), the prefix of each request in CSR rows and its k draft slots after it.

    Built once per batch shape (host sync: not for captured regions); benchmarks and tests use it to hand the
    step the inputs SGLang would.
    """
    b = prefix_lens.shape[0]
    lens = prefix_lens.long().cpu()
    pt = page_table.long().cpu()
    rows, draft = [], []
    for i in range(b):
        n = int(lens[i])
        pos = torch.arange(n + k)
        slots = gather_positions(pt[i:i + 1], pos.view(1, -1), page_size)[0]
        rows.append(slots[:n])
        draft.append(slots[n:])
    dev = page_table.device
    indptr = torch.zeros(b + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(lens, 0).to(torch.int32)
    indices = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
    return indptr.to(dev), indices.to(dev), torch.cat(draft).to(dev)


def rope_table(theta: float, rope_dim: int, max_position: int, device=None) -> torch.Tensor:
    """float32 [max_position, rope_dim]: the plain (theta) RoPE as a rotary table (cos half, then sin half), the
    layout of SGLang's ``cos_sin_cache``; with ``neox=True`` in :func:`model_ops` it rotates exactly as the
    theta RoPE of :class:`~specverify.forward.model.VerifyModel` (benchmarks compare the two paths' logits)."""
    inv = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim))
    ang = torch.arange(max_position, dtype=torch.float64).unsqueeze(1) * inv
    return torch.cat([ang.cos(), ang.sin()], -1).to(torch.float32).to(device)
