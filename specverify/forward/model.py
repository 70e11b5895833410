"""The verify forward of a whole model (MLA+MoE, GQA+MoE, dense GQA), batched: the product's verify pass.

One pass takes ``k`` draft tokens per request (node 0 = the last verified token), writes their KV into a paged
cache at positions ``prefix_lens[b] + i``, attends over the prefix plus the tree (tree mask), runs the MLP / MoE
layers and the LM head, and returns the logits of every node. ``verify`` adds greedy acceptance; compaction of the
accepted path's KV is ``ops.compact_kv`` (the definition: :func:`specverify.reference.kv.compact_kv_reference`).

Every op goes through an :class:`~specverify.forward.ops.Ops` table, so one layer loop runs every provider: the
plain-torch references (the default table), specverify's kernels, or SGLang's (:mod:`specverify.forward.ops`).
Under tensor parallelism each rank holds its shard (heads, intermediate sizes and vocabulary split ``tp`` ways);
with a ``torch.distributed`` group of more than one rank the attention and MLP outputs are all-reduced and the
logits all-gathered. With ``tp > 1`` and no group (one GPU standing in for one rank, as ``verify-wall`` does) the
collectives are skipped and their cost is modelled by the caller.

Weight layout: tensors that read the same input are stacked so one GEMM serves them (MLA ``qkv_a``; GQA ``wqkv``;
``gate_up``; experts ``w13`` [E, 2I, H] and ``w2`` [E, H, I], the shared expert stored as expert E of ``w13_all`` /
``w2_all`` when its size is one expert's), with the per-matrix names kept as views. Dummy weights are drawn from a
seed with standard deviation ``1/sqrt(fan_in)`` so activations stay finite over 61 layers. RoPE is the rotate-half
form at each node's tree position ``prefix_len + depth``; long-context scaling (YaRN) is left out, as it changes no
shapes or bytes.

MLA's q_a RMSNorm is folded away where the op table can (:data:`FOLD_Q_NORM`, one launch fewer per layer): q_b's
weight times the norm weight along q_lora (``q_b_folded``, :func:`fold_q_norm`) projects the un-normed q_a, the
qkv_a GEMV's epilogue sums q_a's squares (``Ops.linear_sumsq``), and ``Ops.mla_prep_absorb`` applies the per-token
scale ``rsqrt(mean(q_a^2) + eps)`` to the absorbed query and the rope part (all linear in q per token).
"""
from __future__ import annotations

import math
import zlib
from contextlib import contextmanager

import torch

from specverify.configs import EXPERTS_QUANT, ModelConfig, RankShapes, get_config, per_rank_shapes
from specverify.forward.ops import Ops, RouteParams, provider_ops
from specverify.gemv import gemv_is_faster

#: Fold MLA's q_a RMSNorm into q_b where the op table can (``linear_sumsq`` and ``mla_prep_absorb`` set, the layer
#: holds ``q_b_folded`` and our GEMV runs qkv_a at this shape): the norm's launch leaves the pass. Read at each
#: forward, so an A/B can set it False (the unfolded chain: qkv_a, RMSNorm, q_b, prep_absorb).
FOLD_Q_NORM = True
#: Tokens (batch x draft tokens) up to which the fold runs. H100, ``bench/ab_verify_pass.py`` (fold against
#: ``no-q-fold``, both orders, 2026-12-06): Kimi-K2 b 1 5.501 / 7.622 against 5.557 / 7.643 ms at 1 / 2 tokens;
#: DeepSeek-V3 b 4 / 16k 12.521 against 12.541 ms at 4 tokens but 17.868 against 17.762 at 8: above 4 the
#: unfolded chain.
FOLD_Q_NORM_MAX_M = 4


#: The layout of int4 routed experts this forward stores (:class:`specverify.moe.MoEQuant` ``layout``): row quads
#: for the stream gate/up's layout-free reads; ``"rows"`` keeps the checkpoints' layout (A/B only).
INT4_LAYOUT = "quads"

#: Run the unquantised shared expert of quantised MoE layers inside the expert launches (``ops.experts_plus_shared``:
#: int4 quads' q4 stream kernels up to 8 tokens) instead of two matmuls and an add after them. Off until the GPU
#: A/B of the eighth session of 2026-12-07 runs (``ab_verify_pass.py --experts-quant int4 --variants
#: fused,shared-in-experts``): checked on the CPU (interpreter) and compiled offline only. Read at each forward.
SHARED_IN_EXPERTS = False


def quantise_experts(w: dict, e: int, fmt: str) -> dict:
    """Replace a MoE layer dict's expert weights by their ``fmt`` form (:data:`specverify.configs.EXPERTS_QUANT`) in
    place.

    After it: ``w13`` / ``w2`` hold the routed experts' stored values and ``quant`` their
    :class:`~specverify.moe.MoEQuant` (scales also as ``w13_scale`` / ``w2_scale``, so :meth:`VerifyModel.weight_bytes`
    counts them); int4 routed experts in row quads (:data:`INT4_LAYOUT`). A shared expert stacked as expert ``e``
    stays stacked when the format quantises it (``w13_all`` / ``w2_all`` quantised, ``quant_all`` their record; its
    slice also as ``shared_w13`` / ``shared_w2`` / ``quant_shared`` for tables without ``experts_with_shared``);
    otherwise it becomes the separate ``shared_gate_up`` / ``shared_down`` in the weights' dtype and the stacked
    tensors are dropped. Returns ``w``."""
    from specverify.moe import MoEQuant
    from specverify.reference.quant import int4_to_quads, quantize_experts

    p = EXPERTS_QUANT[fmt]
    if fmt == "int4":
        extra = dict(group_size=p["group_size"])
    else:  # a block row must not straddle gate and up rows: at most the largest power of two dividing I
        inter = w["w13"].shape[1] // 2
        bn, bk = p["block_shape"]
        extra = dict(block_shape=(math.gcd(bn, inter & -inter), bk))

    def quantise(t):
        return quantize_experts(t, fmt, **extra)

    if "w13_all" in w and p["shared"]:
        q13, s13 = quantise(w.pop("w13_all"))
        q2, s2 = quantise(w.pop("w2_all"))
        w["w13_all"], w["w2_all"] = q13, q2
        w["quant_all"] = MoEQuant(fmt, s13, s2, **extra)
        # tables without experts_with_shared run the shared expert as one more expert call on its slice
        w.pop("shared_gate_up", None), w.pop("shared_down", None)
        w["shared_w13"], w["shared_w2"] = q13[e:], q2[e:]
        w["quant_shared"] = MoEQuant(fmt, s13[e:], s2[e:], **extra)
        q13, q2, s13, s2 = q13[:e], q2[:e], s13[:e], s2[:e]
    else:
        if "w13_all" in w:  # the shared expert leaves the stack in the weights' dtype (its own storage)
            w13_all, w2_all = w.pop("w13_all"), w.pop("w2_all")
            w["shared_gate_up"], w["shared_down"] = w13_all[e].clone(), w2_all[e].clone()
            del w13_all, w2_all
        q13, s13 = quantise(w["w13"])
        q2, s2 = quantise(w["w2"])
        if fmt == "int4" and INT4_LAYOUT == "quads":
            q13, s13 = int4_to_quads(q13, s13)
            q2, s2 = int4_to_quads(q2, s2)
            extra["layout"] = "quads"
    w["w13"], w["w2"], w["w13_scale"], w["w2_scale"] = q13, q2, s13, s2
    w["quant"] = MoEQuant(fmt, s13, s2, **extra)
    return w


def q_norm_foldable(w: dict) -> bool:
    """Whether a layer dict gets ``q_b_folded`` (:func:`attach_folded_q_b`): the forward can fold its q_a RMSNorm
    only with a bf16 q_b (fp16's range is short for an un-normed q) and a qkv_a shape our GEMV serves, whose
    epilogue gives the sums of squares (:func:`specverify.gemv.gemv_is_faster` at one token); elsewhere the copy
    would never be read. Shared by the synthetic model and :class:`~specverify.forward.step.LoadedVerifyModel`."""
    q_b, qkv_a = w.get("q_b"), w.get("qkv_a")
    return (q_b is not None and qkv_a is not None and w.get("q_a_norm") is not None and q_b.dtype == torch.bfloat16
            and gemv_is_faster(1, qkv_a.shape[0], qkv_a.shape[1]))


def attach_folded_q_b(w: dict) -> dict:
    """Set ``w["q_b_folded"]`` (:func:`fold_q_norm` of the layer's ``q_b`` and ``q_a_norm``) and the two tensors'
    in-place versions it was made from; the forward refuses a stale fold (:func:`check_folded_q_b`). Returns ``w``."""
    w["q_b_folded"] = fold_q_norm(w["q_b"], w["q_a_norm"])
    w["q_b_folded_from"] = (w["q_b"]._version, w["q_a_norm"]._version)
    return w


def check_folded_q_b(w: dict) -> None:
    """Raise RuntimeError when ``q_b`` or ``q_a_norm`` changed in place after ``w``'s fold (a weight update): the
    fold path would run the old weights while the unfolded one (above :data:`FOLD_Q_NORM_MAX_M` tokens) runs the new.
    Fix: ``model.refold()`` after updating weights."""
    if w.get("q_b_folded_from") != (w["q_b"]._version, w["q_a_norm"]._version):
        raise RuntimeError("q_b or q_a_norm changed in place after q_b_folded was made (a weight update?): call "
                           "model.refold() after updating weights, or set specverify.forward.model.FOLD_Q_NORM = "
                           "False")


def fold_q_norm(q_b: torch.Tensor, q_a_norm: torch.Tensor) -> torch.Tensor:
    """q_b's weight [heads, qk, q_lora] times q_a's RMSNorm weight [q_lora] along q_lora: ``q_b(rmsnorm(a)) ==
    (q_b * g)(a) * rsqrt(mean(a^2) + eps)`` per token. Computed in fp32 (fp64 for fp64 weights) and rounded once
    into q_b's dtype; a new contiguous tensor (the inputs are not modified)."""
    ctype = torch.float64 if q_b.dtype == torch.float64 else torch.float32
    return (q_b.to(ctype) * q_a_norm.to(ctype)).to(q_b.dtype).contiguous()


class _ParamFactory:
    """Deterministic dummy weights: full tensors sliced per rank, or the rank's shard drawn directly."""

    def __init__(self, seed, device, dtype, tp, rank, full_weights):
        self.seed, self.device, self.dtype = seed, device, dtype
        self.tp, self.rank, self.full = tp, rank, full_weights

    def _gen(self, name, extra=0):
        g = torch.Generator(device=self.device)
        g.manual_seed((self.seed * 1000003 + zlib.crc32(name.encode()) + extra * 7919) % (2 ** 63))
        return g

    def rand(self, name, full_shape, shard_dim=None, fan_in=None, std=None, shard_index=None):
        """A weight of ``full_shape`` sharded on ``shard_dim`` (None: replicated)."""
        std = std if std is not None else 1.0 / math.sqrt(fan_in)
        if shard_dim is None or (self.tp == 1 and self.full):
            return (torch.randn(list(full_shape), generator=self._gen(name), device=self.device,
                                dtype=torch.float32) * std).to(self.dtype)
        n = full_shape[shard_dim]
        part = n // self.tp if n >= self.tp else 1
        index = self.rank if shard_index is None else shard_index
        if self.full:
            full = torch.randn(list(full_shape), generator=self._gen(name), device=self.device,
                               dtype=torch.float32) * std
            return full.narrow(shard_dim, index * part, part).contiguous().to(self.dtype)
        shape = list(full_shape)
        shape[shard_dim] = part
        return (torch.randn(shape, generator=self._gen(name, 1 + index), device=self.device, dtype=torch.float32)
                * std).to(self.dtype)

    def ones(self, shape):
        return torch.ones(shape, device=self.device, dtype=self.dtype)


class _GroupCollectives:
    """``all_reduce`` / ``all_gather`` over a ``torch.distributed`` group of ``tp`` ranks."""

    def __init__(self, group, tp: int):
        self.group, self.tp = group, tp

    def all_reduce(self, x):
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x, dim):
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.tp)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim)


class VerifyModel:
    """A model's verify forward on one tensor-parallel rank, with dummy weights.

    Parameters
    ----------
    config : ModelConfig or str
    tp, rank : int
        Tensor-parallel degree and this rank. ``group``: a ``torch.distributed`` group of ``tp`` ranks, or None
        (collectives skipped; one process stands in for one rank). The collectives go through
        :attr:`collectives` (``all_reduce(x)``, ``all_gather(x, dim)``; the group's, or an engine's in
        :class:`~specverify.forward.step.LoadedVerifyModel`).
    num_layers : int, optional
        Layers to run (default: the model's).
    distinct_layers : int, optional
        Weight sets to cycle through (``layer % distinct_layers``), so a many-layer model fits in memory while each
        layer still reads its weights from memory rather than cache when the sets are large. Default: one per layer.
    dtype, device, seed
        Weight/activation dtype (bf16 on GPU; fp32/fp64 for CPU exactness tests), device, weight seed.
    full_weights : bool
        Draw full tensors and slice this rank's shard (ranks then agree with a tp=1 model). Default: True when
        ``tp == 1`` or a group is given; otherwise each rank's shard is drawn directly (cheaper).
    ops : Ops
        The op table (default: all reference).
    experts_quant : {None, "int4", "fp8"}
        Store the MoE experts as the served checkpoints do (:class:`specverify.moe.MoEQuant`): ``"int4"`` as
        Kimi-K2.5 (routed experts int4, group 32, bf16 scales; the shared expert stays in ``dtype``), ``"fp8"`` as
        DeepSeek-V3 and Kimi-K2 (routed and shared experts float8_e4m3fn with fp32 128 x 128 block scales; where the
        rank's I is no multiple of 128, e.g. the tiny stand-ins, the block rows shrink to the largest power of two
        dividing I, so each stays all gate or all up). The dummy weights are drawn as usual and quantised. Default
        None: every weight in ``dtype``.
    """

    def __init__(self, config: ModelConfig | str, tp: int = 1, rank: int = 0, *, group=None,
                 num_layers: int | None = None, distinct_layers: int | None = None,
                 dtype=torch.bfloat16, device="cpu", seed: int = 0, full_weights: bool | None = None,
                 ops: Ops | None = None, experts_quant: str | None = None):
        if experts_quant is not None and experts_quant not in EXPERTS_QUANT:
            raise ValueError(f"experts_quant must be one of {[None, *EXPERTS_QUANT]}, got {experts_quant!r}")
        self.experts_quant = experts_quant
        self.config = get_config(config)
        self.shapes: RankShapes = per_rank_shapes(self.config, tp)
        self.tp, self.rank, self.group = tp, rank, group
        self.collectives = _GroupCollectives(group, tp) if group is not None else None
        self.num_layers = self.config.num_hidden_layers if num_layers is None else int(num_layers)
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        self.distinct_layers = self.num_layers if distinct_layers is None else max(1, int(distinct_layers))
        self.dtype, self.device = dtype, torch.device(device)
        self.ops = ops or Ops()
        self.section_hook = None  # callable(name, phase) for --breakdown
        full = (tp == 1 or group is not None) if full_weights is None else full_weights
        self._pf = _ParamFactory(seed, self.device, dtype, tp, rank, full)
        self._build_weights()

    # weights ----------------------------------------------------------------------------------------------
    def _build_weights(self):
        s, pf = self.shapes, self._pf
        h = s.hidden_size
        self.embed = pf.rand("embed", [s.vocab_size * self.tp, h], shard_dim=0, std=1.0)
        self.final_norm = pf.ones([h])
        self.lm_head = pf.rand("lm_head", [s.vocab_size * self.tp, h], shard_dim=0, fan_in=h)
        self._sets: dict[tuple, dict] = {}
        self.layers = []
        for layer in range(self.num_layers):
            dense = self.config.is_dense_layer(layer)
            key = ("dense" if dense else "moe", layer % self.distinct_layers)
            if key not in self._sets:
                self._sets[key] = self._layer_weights(f"{key[0]}{key[1]}", dense)
            self.layers.append(self._sets[key])

    def _layer_weights(self, tag, dense):
        s, pf, c = self.shapes, self._pf, self.config
        h = s.hidden_size
        w = {"dense": dense, "attn_norm": pf.ones([h]), "mlp_norm": pf.ones([h])}
        heads_full = c.num_attention_heads
        if c.attention == "mla":
            qk = c.qk_nope_head_dim + c.qk_rope_head_dim
            q_a = pf.rand(f"{tag}.q_a", [c.q_lora_rank, h], fan_in=h)
            w["q_a_norm"] = pf.ones([c.q_lora_rank])
            w["q_b"] = pf.rand(f"{tag}.q_b", [heads_full, qk, c.q_lora_rank], shard_dim=0, fan_in=c.q_lora_rank)
            kv_a = pf.rand(f"{tag}.kv_a", [c.kv_lora_rank + c.qk_rope_head_dim, h], fan_in=h)
            # q_a and kv_a read the same input: one stacked matrix, one GEMM (as serving engines fuse them)
            w["qkv_a"] = torch.cat([q_a, kv_a], 0)
            del q_a, kv_a
            w["q_a"], w["kv_a"] = w["qkv_a"][: c.q_lora_rank], w["qkv_a"][c.q_lora_rank:]
            if q_norm_foldable(w):
                attach_folded_q_b(w)  # q_b's input is then the un-normed q_a
            w["kv_a_norm"] = pf.ones([c.kv_lora_rank])
            w["w_uk"] = pf.rand(f"{tag}.w_uk", [heads_full, c.qk_nope_head_dim, c.kv_lora_rank], shard_dim=0,
                                fan_in=c.qk_nope_head_dim)
            w["w_uv"] = pf.rand(f"{tag}.w_uv", [heads_full, c.kv_lora_rank, c.v_head_dim], shard_dim=0,
                                fan_in=c.kv_lora_rank)
            w["o"] = pf.rand(f"{tag}.o", [h, heads_full * c.v_head_dim], shard_dim=1,
                             fan_in=heads_full * c.v_head_dim)
        else:
            d = c.head_dim
            kvh = c.num_key_value_heads
            parts = {"wq": pf.rand(f"{tag}.wq", [heads_full * d, h], shard_dim=0, fan_in=h)}
            kv_index = None if kvh >= self.tp else self.rank // (self.tp // kvh)
            for name in ("wk", "wv"):
                full_shape = [kvh * d, h]
                if kvh >= self.tp:
                    parts[name] = pf.rand(f"{tag}.{name}", full_shape, shard_dim=0, fan_in=h)
                else:  # replicated KV heads: this rank keeps head kv_index whole
                    full = pf.rand(f"{tag}.{name}", full_shape, fan_in=h)
                    parts[name] = full[kv_index * d:(kv_index + 1) * d]
            # q, k and v read the same input: one stacked matrix, one GEMM
            w["wqkv"] = torch.cat([parts["wq"], parts["wk"], parts["wv"]], 0)
            nq, nkv = parts["wq"].shape[0], parts["wk"].shape[0]
            del parts
            w["wq"], w["wk"], w["wv"] = (w["wqkv"][:nq], w["wqkv"][nq:nq + nkv], w["wqkv"][nq + nkv:])
            w["wo"] = pf.rand(f"{tag}.wo", [h, heads_full * d], shard_dim=1, fan_in=heads_full * d)
            if c.qk_norm:
                w["q_norm"], w["k_norm"] = pf.ones([d]), pf.ones([d])
        if dense:
            inter = c.intermediate_size
            gate = pf.rand(f"{tag}.mlp_gate", [inter, h], shard_dim=0, fan_in=h)
            up = pf.rand(f"{tag}.mlp_up", [inter, h], shard_dim=0, fan_in=h)
            w["gate_up"] = torch.cat([gate, up], 0)
            w["down"] = pf.rand(f"{tag}.mlp_down", [h, inter], shard_dim=1, fan_in=inter)
        else:
            e, inter = c.n_routed_experts, c.moe_intermediate_size
            w["router"] = pf.rand(f"{tag}.router", [e, h], fan_in=h)
            w["bias"] = (pf.rand(f"{tag}.bias", [e], std=0.05).float() if c.e_score_correction_bias else None)
            gate = pf.rand(f"{tag}.exp_gate", [e, inter, h], shard_dim=1, fan_in=h)
            up = pf.rand(f"{tag}.exp_up", [e, inter, h], shard_dim=1, fan_in=h)
            w13 = torch.cat([gate, up], 1)
            del gate, up
            w2 = pf.rand(f"{tag}.exp_down", [e, h, inter], shard_dim=2, fan_in=inter)
            if c.n_shared_experts:
                si = inter * c.n_shared_experts
                sg = pf.rand(f"{tag}.sh_gate", [si, h], shard_dim=0, fan_in=h)
                su = pf.rand(f"{tag}.sh_up", [si, h], shard_dim=0, fan_in=h)
                sd = pf.rand(f"{tag}.sh_down", [h, si], shard_dim=1, fan_in=si)
                if si == inter:
                    # stored as expert e of one [e + 1, ...] tensor, so an expert kernel can run the shared expert
                    # as one more always-chosen expert; the routed views below are unchanged
                    w13 = torch.cat([w13, torch.cat([sg, su], 0).unsqueeze(0)], 0)
                    w2 = torch.cat([w2, sd.unsqueeze(0)], 0)
                    w["w13_all"], w["w2_all"] = w13, w2
                    w["shared_gate_up"], w["shared_down"] = w13[e], w2[e]
                else:
                    w["shared_gate_up"], w["shared_down"] = torch.cat([sg, su], 0), sd
            w["w13"], w["w2"] = w13[:e], w2[:e]
            if self.experts_quant is not None:
                quantise_experts(w, e, self.experts_quant)
            w["route"] = RouteParams(c.num_experts_per_tok, c.scoring_func, w["bias"], c.n_group, c.topk_group,
                                     c.norm_topk_prob, c.routed_scaling_factor, e)
        return w

    def refold(self) -> None:
        """Remake every layer's ``q_b_folded`` from its current ``q_b`` and ``q_a_norm`` (after an in-place weight
        update; :func:`check_folded_q_b`). Allocates: not inside a CUDA-graph capture; recapture graphs after it."""
        for w in self._sets.values():
            if "q_b_folded" in w:
                attach_folded_q_b(w)

    def weight_bytes(self) -> int:
        seen, total = set(), 0
        tensors = [self.embed, self.final_norm, self.lm_head]
        for w in self._sets.values():
            # q_b_folded is left out: a pass reads q_b or its folded copy, never both
            tensors += [v for n, v in w.items() if isinstance(v, torch.Tensor) and n != "q_b_folded"]
        for t in tensors:  # views (q_a and kv_a of qkv_a, ...) share their storage: count each storage once
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        return total

    # KV cache ---------------------------------------------------------------------------------------------
    def allocate_kv(self, num_pages: int, page_size: int, fill: float | None = None):
        """One cache per layer, as views of ONE buffer: MLA ``[num_pages, page_size, kv_lora + rope]`` (layer l is
        ``buf[l]`` of ``[num_layers, num_pages, page_size, row]``); GQA a (k, v) pair of ``[num_pages, page_size,
        kv_heads, head_dim]`` (``buf[l, 0]``, ``buf[l, 1]`` of ``[num_layers, 2, ...]``). Each view is contiguous
        and the flattened list ``[c for layer in caches for c in layer]`` is equally spaced, so
        :func:`specverify.compact_kv` compacts every layer in one launch. ``fill`` (default 0; e.g. NaN) poisons
        every slot."""
        s = self.shapes
        if s.attention == "mla":
            buf = torch.empty(self.num_layers, num_pages, page_size, s.kv_lora_rank + s.qk_rope_head_dim,
                              device=self.device, dtype=self.dtype)
        else:
            buf = torch.empty(self.num_layers, 2, num_pages, page_size, s.num_kv_heads, s.head_dim,
                              device=self.device, dtype=self.dtype)
        buf.fill_(0.0 if fill is None else fill)
        return [[buf[layer]] if s.attention == "mla" else [buf[layer, 0], buf[layer, 1]]
                for layer in range(self.num_layers)]

    # collectives -------------------------------------------------------------------------------------------
    def allreduce(self, x):
        return self.collectives.all_reduce(x) if self.collectives is not None and self.tp > 1 else x

    def _gather_vocab(self, logits):
        if self.collectives is None or self.tp == 1:
            return logits
        return self.collectives.all_gather(logits.contiguous(), -1)[..., : self.config.vocab_size]

    def _vocab_shard(self) -> tuple[int, int] | None:
        """(start, end): the token ids of this rank's embedding rows ``embed[: end - start]`` when the vocabulary
        is sharded over real collectives; None at tp 1 or for one rank standing in without them."""
        if self.collectives is None or self.tp == 1:
            return None
        vr = self.shapes.vocab_size
        return self.rank * vr, (self.rank + 1) * vr

    @contextmanager
    def section(self, name):
        if self.section_hook is not None:
            self.section_hook(name, "start")
        yield
        if self.section_hook is not None:
            self.section_hook(name, "end")

    # forward ----------------------------------------------------------------------------------------------
    def embed_tokens(self, input_ids):
        if self.tp == 1:
            return self.embed[input_ids]
        shard = self._vocab_shard()
        if shard is None:  # one rank standing in: look up in the local shard
            return self.embed[input_ids % self.shapes.vocab_size]
        start, end = shard
        ok = (input_ids >= start) & (input_ids < end)  # other ranks' ids (and padding rows) look up zeros
        x = self.embed[(input_ids - start).clamp(0, self.embed.shape[0] - 1)] * ok.unsqueeze(-1).to(self.dtype)
        return self.allreduce(x)

    def _mla(self, w, x, positions, cache, page_table, prefix_lens, tree_mask):
        s, c, ops = self.shapes, self.config, self.ops
        eps = c.rms_norm_eps
        b, k, _ = x.shape
        heads = s.num_heads
        q_lora = c.q_lora_rank
        fold = None
        if (FOLD_Q_NORM and b * k <= FOLD_Q_NORM_MAX_M and ops.linear_sumsq is not None
                and ops.mla_prep_absorb is not None and "q_b_folded" in w and x.dtype == torch.bfloat16):
            check_folded_q_b(w)
            # None where our GEMV does not run qkv_a (above 8 tokens, other dtypes): then the unfolded chain
            fold = ops.linear_sumsq(x, w["qkv_a"], q_lora)
        if fold is not None:
            # q_a's RMSNorm folded: q_b's weight carries the norm weight, the qkv_a GEMV the per-token sums of squares
            # (q_sumsq [P, b * k] fp32), prep_absorb the scale; q_b reads the strided q_a columns of qkv
            qkv, q_sumsq = fold
            q = qkv[..., :q_lora]
            q_b = w["q_b_folded"]
        else:
            qkv = ops.linear(x, w["qkv_a"])  # [b, k, q_lora + kv_lora + rope]: q_a and kv_a in one GEMM
            q = ops.rmsnorm(qkv[..., :q_lora], w["q_a_norm"], eps)
            q_b = w["q_b"]  # [heads, nope + rope, q_lora]
        q = ops.linear(q, q_b.reshape(-1, q_b.shape[-1])).view(b, k, heads, q_b.shape[1])  # [b, k, heads, nope + rope]
        kv = qkv[..., q_lora:]  # [b, k, kv_lora + rope]
        # latent norm, rope of key and query rope part, KV written into the cache; the query into the latent space
        if ops.mla_prep_absorb is not None:  # with the fold, q_a's RMSNorm scale from the sums of squares
            scale = dict(q_sumsq=q_sumsq, q_dim=q_lora) if fold is not None else {}
            q_latent = ops.mla_prep_absorb(q, kv, positions, w["kv_a_norm"], w["w_uk"], cache[0], page_table,
                                           prefix_lens, eps, c.rope_theta, c.qk_nope_head_dim, **scale)
        else:
            ops.mla_prep(q, kv, positions, w["kv_a_norm"], cache[0], page_table, prefix_lens, eps, c.rope_theta,
                         c.qk_nope_head_dim)
            q_latent = ops.mla_absorb_q(q, w["w_uk"], c.qk_nope_head_dim)  # [b, k, heads, kv_lora]
        q_pe = q[..., c.qk_nope_head_dim:]  # a view: the attention kernels take strided queries
        sm_scale = 1.0 / math.sqrt(c.qk_nope_head_dim + c.qk_rope_head_dim)
        o_latent = ops.attention_mla(q_latent, q_pe, cache[0], page_table, prefix_lens, tree_mask, sm_scale)
        return ops.linear(ops.mla_up_v(o_latent, w["w_uv"]), w["o"])

    def _gqa(self, w, x, positions, cache, page_table, prefix_lens, tree_mask):
        s, c, ops = self.shapes, self.config, self.ops
        b, k, _ = x.shape
        d = c.head_dim
        qkv = x @ w["wqkv"].t()  # q, k and v in one GEMM; the views below are strided
        nq, nkv = s.num_heads * d, s.num_kv_heads * d
        q = qkv[..., :nq].view(b, k, s.num_heads, d)
        kk = qkv[..., nq:nq + nkv].view(b, k, s.num_kv_heads, d)
        v = qkv[..., nq + nkv:].view(b, k, s.num_kv_heads, d)
        ops.gqa_prep(q, kk, v, positions, w.get("q_norm"), w.get("k_norm"), cache[0], cache[1], page_table,
                     prefix_lens, c.rms_norm_eps, c.rope_theta)
        o = ops.attention_gqa(q, cache[0], cache[1], page_table, prefix_lens, tree_mask, 1.0 / math.sqrt(d))
        return o.reshape(b, k, s.num_heads * d) @ w["wo"].t()

    def _mlp(self, w, h):
        """MLP or MoE block on the already-normalised input ``h`` [b, k, H].

        A MoE layer whose weight dict carries ``experts_fn`` runs its routed experts through that callable instead of
        ``ops.experts``: ``experts_fn(hidden [M, H], ids int32 [M, top_k], weights fp32 [M, top_k], router_logits
        [M, E]) -> [M, H]``, given this table's routing (``weights`` with ``routed_scaling_factor`` applied) and
        owning its expert weights (the SGLang step hands a layer's quantised experts to SGLang's own module this
        way). Routing, the shared expert and everything around them stay the table's; such a layer has no
        ``w13_all``, so ``experts_with_shared`` (and ``route_shared``) do not serve it.

        With ``w13_all`` and ``experts_with_shared``, the shared expert is expert ``E`` of the stacked weights: with
        ``route_shared`` too the router writes its slot (ids [M, top_k + 1]) and ``experts`` runs over the stacks;
        otherwise ``route`` then ``experts_with_shared`` (which appends the slot). With ``w13_all`` and
        ``moe_block`` all of it is one op up to ``ops.moe_block_max_m`` tokens. Quantised routed experts with an
        unquantised shared expert (``shared_gate_up``) run both through ``experts_plus_shared`` where the table has it
        and :data:`SHARED_IN_EXPERTS` is set.
        """
        ops = self.ops
        flat = h.reshape(-1, h.shape[-1])
        if w["dense"]:
            with self.section("dense_mlp"):
                return (ops.silu_mul(flat @ w["gate_up"].t()) @ w["down"].t()).view_as(h)
        quant, quant_all = w.get("quant"), w.get("quant_all")
        if "w13_all" in w and quant is None and ops.moe_block is not None and flat.shape[0] <= ops.moe_block_max_m:
            with self.section("moe_block"):  # router, routing and every expert in one launch
                return ops.moe_block(flat, w["router"], w["route"], w["w13_all"], w["w2_all"]).view_as(h)
        stacked = "w13_all" in w and ops.experts_with_shared is not None
        shared_slot = stacked and ops.route_shared is not None  # the shared slot written by the router
        with self.section("moe_route"):
            logits = ops.linear(flat, w["router"])
            if shared_slot:
                ids, weights = ops.route_shared(logits, w["route"], w["w13_all"].shape[0] - 1)
            else:
                ids, weights = ops.route(logits, w["route"])
        if stacked:
            qk = {} if quant_all is None else {"quant": quant_all}
            with self.section("experts"):  # routed experts and the shared expert in one expert pass
                if shared_slot:
                    return ops.experts(flat, w["w13_all"], w["w2_all"], ids, weights, **qk).view_as(h)
                return ops.experts_with_shared(flat, w["w13_all"], w["w2_all"], ids, weights, **qk).view_as(h)
        with self.section("experts"):
            if "experts_fn" in w:  # the layer's own experts (see the docstring)
                out = w["experts_fn"](flat, ids, weights, logits)
            elif (quant is not None and "shared_gate_up" in w and SHARED_IN_EXPERTS
                  and ops.experts_plus_shared is not None):
                # the unquantised shared expert in the quantised experts' launches
                return ops.experts_plus_shared(flat, w["w13"], w["w2"], ids, weights, quant, w["shared_gate_up"],
                                               w["shared_down"]).view_as(h)
            elif quant is not None:
                out = ops.experts(flat, w["w13"], w["w2"], ids, weights, quant=quant)
            else:
                out = ops.experts(flat, w["w13"], w["w2"], ids, weights)
        if "quant_shared" in w:  # a quantised shared expert outside the stack: one more expert call
            with self.section("shared_expert"):
                m = flat.shape[0]
                ids0 = torch.zeros(m, 1, dtype=torch.int32, device=flat.device)
                ones = torch.ones(m, 1, dtype=torch.float32, device=flat.device)
                out = out + ops.experts(flat, w["shared_w13"], w["shared_w2"], ids0, ones, quant=w["quant_shared"])
        elif "shared_gate_up" in w:
            with self.section("shared_expert"):
                out = out + ops.silu_mul(flat @ w["shared_gate_up"].t()) @ w["shared_down"].t()
        return out.view_as(h)

    def forward(self, input_ids, positions, kv_caches, page_table, prefix_lens, tree_mask=None):
        """Logits of every node. input_ids, positions int [b, k]; page_table int32 [b, max_pages]; prefix_lens
        int32 [b]; tree_mask uint8 packed [k, ceil(k/8)] or [b, k, ceil(k/8)] or None (chain).

        Returns fp32 logits [b, k, vocab] (vocab = the full vocabulary with a group, else this rank's shard).
        Writes the k nodes' KV into ``kv_caches`` (one entry per layer).
        """
        return self.forward_captured(input_ids, positions, kv_caches, page_table, prefix_lens, tree_mask)[0]

    def forward_captured(self, input_ids, positions, kv_caches, page_table, prefix_lens, tree_mask=None,
                         capture_layers=()):
        """:meth:`forward` that also returns what EAGLE / EAGLE-3 drafters read: ``(logits, hidden, aux)`` with
        ``hidden`` the final normed hidden states [b, k, H] and ``aux`` the residual stream at the entry of each
        layer in ``capture_layers`` (each [b, k, H], in layer order)."""
        ops, eps = self.ops, self.config.rms_norm_eps
        with self.section("embedding"):
            residual = self.embed_tokens(input_ids)
            h = ops.rmsnorm(residual, self.layers[0]["attn_norm"], eps)
        attn = self._mla if self.config.attention == "mla" else self._gqa
        aux = []
        for layer in range(self.num_layers):
            if layer in capture_layers:
                aux.append(residual)
            w = self.layers[layer]
            with self.section("attention"):
                a = attn(w, h, positions, kv_caches[layer], page_table, prefix_lens, tree_mask)
            with self.section("allreduce"):  # allreduce, residual add and the next RMSNorm
                h, residual = ops.add_rmsnorm(self.allreduce(a), residual, w["mlp_norm"], eps)
            m = self._mlp(w, h)
            nxt = self.layers[layer + 1]["attn_norm"] if layer + 1 < self.num_layers else self.final_norm
            with self.section("allreduce"):
                h, residual = ops.add_rmsnorm(self.allreduce(m), residual, nxt, eps)
        with self.section("lm_head"):
            logits = self.ops.linear(h, self.lm_head)
            logits = logits if logits.dtype == torch.float64 else logits.float()
            logits = self._gather_vocab(logits)
        return logits, h, aux

    def check_verify_inputs(self, draft_tokens, parents, depth, tree_mask, kv_caches, page_table, prefix_lens):
        """Validate a verify call before any kernel runs (value checks skipped during graph capture).

        Raises
        ------
        TypeError
            Wrong dtypes (ids, parents, depth, page table and prefix lengths are integer; the mask is uint8).
        ValueError
            Shapes that disagree, token ids outside the vocabulary, parents that are not a tree, page ids
            outside the cache, or requests longer than their page-table rows.
        """
        from specverify.validation import capturing, check_depth, check_int_tensor, check_paged_kv, check_tree_mask

        op = "VerifyModel.verify"
        check_int_tensor(op, "draft_tokens", draft_tokens, (None, None))
        batch, k = draft_tokens.shape
        check_int_tensor(op, "parents", parents, (batch, k))
        check_int_tensor(op, "depth", depth, (batch, k))
        check_int_tensor(op, "page_table", page_table, (batch, None))
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"{op}: expected {self.num_layers} KV caches (one per layer), got {len(kv_caches)}; "
                             "allocate them with VerifyModel.allocate_kv")
        if tree_mask is not None:
            nbytes = (k + 7) // 8
            if not isinstance(tree_mask, torch.Tensor) or tree_mask.dtype != torch.uint8:
                raise TypeError(f"{op}: tree_mask must be uint8 of shape [{k}, {nbytes}] or [{batch}, {k}, "
                                f"{nbytes}] (bit-packed, DraftTree.packed_mask()), got "
                                f"{getattr(tree_mask, 'dtype', type(tree_mask).__name__)}")
            if tuple(tree_mask.shape) not in ((k, nbytes), (batch, k, nbytes)):
                raise ValueError(f"{op}: tree_mask must be uint8 of shape [{k}, {nbytes}] or [{batch}, {k}, "
                                 f"{nbytes}], got {list(tree_mask.shape)}")
        cache = kv_caches[0][0]
        check_paged_kv(op, page_table, prefix_lens, k, cache.shape[0], cache.shape[1])
        if capturing():
            return
        vocab = self.config.vocab_size
        if bool(((draft_tokens < 0) | (draft_tokens >= vocab)).any()):
            raise ValueError(f"{op}: draft_tokens must lie in [0, {vocab}), got min {int(draft_tokens.min())} "
                             f"max {int(draft_tokens.max())}")
        check_depth(op, depth, parents)
        if tree_mask is not None:
            check_tree_mask(op, tree_mask, k)

    def verify(self, draft_tokens, parents, depth, tree_mask, kv_caches, page_table, prefix_lens, max_depth,
               validate: bool = True):
        """Forward + greedy acceptance. draft_tokens int [b, k] (node 0 = last verified token); parents, depth
        int [b, k]. Returns (accepted_nodes, accept_len, accepted_tokens, logits); see
        :mod:`specverify.reference.accept`."""
        if validate:  # value checks synchronise with the device; callers that checked once pass False
            self.check_verify_inputs(draft_tokens, parents, depth, tree_mask, kv_caches, page_table, prefix_lens)
        positions = prefix_lens.long().unsqueeze(1) + depth.long()
        logits = self.forward(draft_tokens, positions, kv_caches, page_table, prefix_lens, tree_mask)
        with self.section("acceptance"):
            target = logits.argmax(-1)
            nodes, acc, tokens = self.ops.accept_greedy(target, draft_tokens, parents, max_depth)
        return nodes, acc, tokens, logits


class VerifyPassAdapter:
    """A verify pass with static buffers per (batch, k), in the form :class:`specverify.VerifyGraphPool` takes.

    ``make_inputs(batch, k)`` returns ``{"draft": int64 [batch, k], "prefix": int32 [batch], "page_table": int32
    [batch, pages_per_request]}`` (valid values: request b owns page-table row b of the adapter's pool);
    ``verify(inputs, k)`` runs forward + greedy acceptance on a chain of k nodes, writing the nodes' KV at
    ``prefix .. prefix + k - 1`` through the page table, and returns ``{"tokens": int64 [batch, k], "accept_len":
    int64 [batch]}``. All requests share one paged KV cache sized for ``max_batch`` requests of ``context + max_k``
    tokens (filled with random values) plus one scratch page (``scratch_page``) that no request owns:
    :attr:`padding` points padded graph rows at it, so they write only there.
    """

    def __init__(self, model: VerifyModel, *, max_batch: int = 32, max_k: int = 8, context: int = 256,
                 page_size: int = 64, seed: int = 0):
        self.model, self.context = model, context
        per = -(-(context + max_k) // page_size)
        self.caches = model.allocate_kv(max_batch * per + 1, page_size)
        for layer in self.caches:
            for c in layer:
                c.normal_()
        g = torch.Generator(device="cpu").manual_seed(seed)
        perm = torch.randperm(max_batch * per, generator=g)
        self.page_table = perm.view(max_batch, per).to(torch.int32).to(model.device)
        self.scratch_page = max_batch * per
        self.seed = seed

    @property
    def padding(self) -> dict:
        """Padding values for :class:`specverify.VerifyGraphPool`: prefix 0, every page id the scratch page."""
        return {"draft": 0, "prefix": 0, "page_table": self.scratch_page}

    def make_inputs(self, batch: int, k: int) -> dict:
        g = torch.Generator(device="cpu").manual_seed(self.seed + 131 * batch + k)
        draft = torch.randint(0, self.model.config.vocab_size, (batch, k), generator=g)
        prefix = torch.full((batch,), self.context, dtype=torch.int32)
        return {"draft": draft.to(self.model.device), "prefix": prefix.to(self.model.device),
                "page_table": self.page_table[:batch].clone()}

    def verify(self, inputs: dict, k: int) -> dict:
        draft = inputs["draft"]
        batch = draft.shape[0]
        dev = draft.device
        parents = (torch.arange(k, device=dev) - 1).expand(batch, k)
        depth = torch.arange(k, device=dev).expand(batch, k)
        _, acc, toks, _ = self.model.verify(draft, parents, depth, None, self.caches, inputs["page_table"],
                                            inputs["prefix"], k - 1)
        return {"tokens": toks, "accept_len": acc}


def build_verify_model(config, tp: int = 1, num_layers: int | None = None, device="cuda",
                       dtype=torch.bfloat16, provider: str = "auto", **kwargs) -> VerifyPassAdapter:
    """A :class:`VerifyPassAdapter` over a :class:`VerifyModel` with dummy weights.

    ``provider``: ``reference`` (torch ops), ``specverify`` (our kernels where they exist), ``sglang`` (SGLang's
    Triton kernels; see :func:`specverify.forward.ops.provider_ops`) or ``auto`` (specverify on CUDA, reference
    elsewhere). ``kwargs`` go to :class:`VerifyPassAdapter`.
    """
    model = VerifyModel(config, tp=tp, num_layers=num_layers, device=device, dtype=dtype)
    if provider == "auto":
        provider = "specverify" if model.device.type == "cuda" else "reference"
    model.ops, _ = provider_ops(provider, model)
    return VerifyPassAdapter(model, **kwargs)
