"""Model architectures as data, their per-rank shapes under tensor parallelism, and the bytes a verify pass reads.

Values are the published ``config.json`` fields of each model (source line per entry). Only the fields the verify
forward needs are kept. ``tiny-*`` configs are small stand-ins with the same structure for CPU tests and the CPU
run of ``specverify bench verify-wall``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only model (MLA+MoE, GQA+MoE or dense GQA).

    Field names follow the Hugging Face ``config.json`` keys where one exists.
    """

    name: str
    source: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    num_attention_heads: int
    attention: str = "gqa"  # "mla" or "gqa"
    # GQA
    num_key_value_heads: int = 0
    head_dim: int = 0
    qk_norm: bool = False
    # MLA
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # MLP / MoE
    intermediate_size: int = 0
    first_k_dense_replace: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    scoring_func: str = "softmax"
    e_score_correction_bias: bool = False
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0

    @property
    def kv_width(self) -> int:
        """Elements of KV per token per layer on one rank's cache *before* sharding (MLA: latent + rope)."""
        if self.attention == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_key_value_heads * self.head_dim

    def is_dense_layer(self, layer: int) -> bool:
        return not self.is_moe or layer < self.first_k_dense_replace


_CONFIGS: dict[str, ModelConfig] = {}


def _register(cfg: ModelConfig) -> ModelConfig:
    _CONFIGS[cfg.name] = cfg
    return cfg


KIMI_K2 = _register(ModelConfig(
    name="kimi-k2",
    source="moonshotai/Kimi-K2-Instruct config.json (DeepseekV3ForCausalLM architecture); Kimi-K2.5's text model "
           "has the same shapes",
    hidden_size=7168, num_hidden_layers=61, vocab_size=163840, num_attention_heads=64, attention="mla",
    num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, intermediate_size=18432, first_k_dense_replace=1, n_routed_experts=384, n_shared_experts=1,
    num_experts_per_tok=8, moe_intermediate_size=2048, n_group=1, topk_group=1, routed_scaling_factor=2.827,
    scoring_func="sigmoid", e_score_correction_bias=True, norm_topk_prob=True, rms_norm_eps=1e-6,
    rope_theta=50000.0,
))

DEEPSEEK_V3 = _register(ModelConfig(
    name="deepseek-v3",
    source="deepseek-ai/DeepSeek-V3 config.json",
    hidden_size=7168, num_hidden_layers=61, vocab_size=129280, num_attention_heads=128, attention="mla",
    num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, intermediate_size=18432, first_k_dense_replace=3, n_routed_experts=256, n_shared_experts=1,
    num_experts_per_tok=8, moe_intermediate_size=2048, n_group=8, topk_group=4, routed_scaling_factor=2.5,
    scoring_func="sigmoid", e_score_correction_bias=True, norm_topk_prob=True, rms_norm_eps=1e-6,
    rope_theta=10000.0,
))

QWEN3_30B_A3B = _register(ModelConfig(
    name="qwen3-30b-a3b",
    source="Qwen/Qwen3-30B-A3B config.json",
    hidden_size=2048, num_hidden_layers=48, vocab_size=151936, num_attention_heads=32, attention="gqa",
    num_key_value_heads=4, head_dim=128, qk_norm=True, intermediate_size=6144, first_k_dense_replace=0,
    n_routed_experts=128, n_shared_experts=0, num_experts_per_tok=8, moe_intermediate_size=768,
    scoring_func="softmax", norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1000000.0,
))

LLAMA_31_8B = _register(ModelConfig(
    name="llama-3.1-8b",
    source="meta-llama/Llama-3.1-8B config.json",
    hidden_size=4096, num_hidden_layers=32, vocab_size=128256, num_attention_heads=32, attention="gqa",
    num_key_value_heads=8, head_dim=128, intermediate_size=14336, rms_norm_eps=1e-5, rope_theta=500000.0,
))

# Small stand-ins with the same structure (CPU tests, CPU verify-wall). Expert counts deliberately not powers of
# two where the real model's are not.
TINY_MLA_MOE = _register(dataclasses.replace(
    KIMI_K2, name="tiny-mla-moe", source="specverify test stand-in shaped like kimi-k2",
    hidden_size=64, num_hidden_layers=3, vocab_size=97, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    intermediate_size=96, first_k_dense_replace=1, n_routed_experts=12, n_shared_experts=1, num_experts_per_tok=3,
    moe_intermediate_size=32, n_group=1, topk_group=1,
))
TINY_MLA_GROUPED = _register(dataclasses.replace(
    DEEPSEEK_V3, name="tiny-mla-grouped", source="specverify test stand-in shaped like deepseek-v3",
    hidden_size=64, num_hidden_layers=3, vocab_size=101, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    intermediate_size=96, first_k_dense_replace=1, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
    moe_intermediate_size=32, n_group=4, topk_group=2,
))
TINY_GQA_MOE = _register(dataclasses.replace(
    QWEN3_30B_A3B, name="tiny-gqa-moe", source="specverify test stand-in shaped like qwen3-30b-a3b",
    hidden_size=64, num_hidden_layers=2, vocab_size=89, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, n_routed_experts=10, num_experts_per_tok=2, moe_intermediate_size=32,
))
TINY_GQA = _register(dataclasses.replace(
    LLAMA_31_8B, name="tiny-gqa", source="specverify test stand-in shaped like llama-3.1-8b",
    hidden_size=64, num_hidden_layers=2, vocab_size=83, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96,
))


def list_configs(include_tiny: bool = True) -> list[str]:
    """Names of the known configs."""
    return [n for n in _CONFIGS if include_tiny or not n.startswith("tiny-")]


def get_config(name: str) -> ModelConfig:
    """The config called ``name`` (see :func:`list_configs`).

    Raises
    ------
    ValueError
        Unknown name; the message lists the known ones.
    """
    if isinstance(name, ModelConfig):
        return name
    if name not in _CONFIGS:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(_CONFIGS)}")
    return _CONFIGS[name]


@dataclass(frozen=True)
class RankShapes:
    """The shapes one tensor-parallel rank holds. Replicated projections keep their full size.

    ``num_heads`` / ``num_kv_heads`` are per rank (KV heads are replicated when fewer than ``tp``),
    ``intermediate_size`` / ``moe_intermediate_size`` / ``vocab_size`` are per-rank shards (rounded up).
    """

    config: ModelConfig
    tp: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    moe_intermediate_size: int
    shared_intermediate_size: int
    vocab_size: int

    def __getattr__(self, item):  # everything not sharded reads through to the config
        return getattr(self.config, item)


def _shard(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"{what} = {n} is not divisible by the tensor-parallel degree {tp}; choose a tp that "
                         f"divides it")
    return n // tp


def per_rank_shapes(config: ModelConfig | str, tp: int = 1) -> RankShapes:
    """Per-rank shapes for tensor parallelism ``tp`` (heads, intermediate sizes and vocabulary split ``tp`` ways).

    Raises
    ------
    ValueError
        ``tp < 1`` or a sharded size not divisible by ``tp``.
    """
    cfg = get_config(config)
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    heads = _shard(cfg.num_attention_heads, tp, "num_attention_heads")
    if cfg.attention == "gqa":
        kv_heads = cfg.num_key_value_heads // tp if cfg.num_key_value_heads >= tp else 1
        if cfg.num_key_value_heads >= tp and cfg.num_key_value_heads % tp:
            raise ValueError(f"num_key_value_heads = {cfg.num_key_value_heads} is not divisible by tp {tp}")
    else:
        kv_heads = 1  # MLA: one latent KV shared by all heads
    return RankShapes(
        config=cfg, tp=tp, num_heads=heads, num_kv_heads=kv_heads,
        intermediate_size=_shard(cfg.intermediate_size, tp, "intermediate_size") if cfg.intermediate_size else 0,
        moe_intermediate_size=_shard(cfg.moe_intermediate_size, tp, "moe_intermediate_size") if cfg.is_moe else 0,
        shared_intermediate_size=(_shard(cfg.moe_intermediate_size * cfg.n_shared_experts, tp, "shared expert")
                                  if cfg.n_shared_experts else 0),
        vocab_size=math.ceil(cfg.vocab_size / tp),
    )


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts hit by ``tokens`` tokens each choosing ``top_k`` of ``num_experts`` uniformly.

    ``E * (1 - C(E-1, k)/C(E, k) ** tokens)`` = ``E * (1 - (1 - top_k / E) ** tokens)``.
    """
    if num_experts == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


@dataclass(frozen=True)
class VerifyBytes:
    """Bytes one verify pass of ``tokens`` tokens reads on one rank, by component."""

    attention_weights: float
    kv_cache: float
    dense_mlp: float
    router: float
    routed_experts: float
    shared_experts: float
    lm_head: float
    distinct_experts_per_layer: float

    @property
    def total(self) -> float:
        return (self.attention_weights + self.kv_cache + self.dense_mlp + self.router + self.routed_experts
                + self.shared_experts + self.lm_head)

    def as_dict(self) -> dict[str, float]:
        d = dataclasses.asdict(self)
        d["total"] = self.total
        return d


def attention_weight_elems(s: RankShapes) -> int:
    """Weight elements of one attention block on one rank (norm weights included)."""
    h = s.hidden_size
    if s.attention == "mla":
        qk_head = s.qk_nope_head_dim + s.qk_rope_head_dim
        q_a = h * s.q_lora_rank if s.q_lora_rank else 0
        q_b = (s.q_lora_rank or h) * s.num_heads * qk_head
        kv_a = h * (s.kv_lora_rank + s.qk_rope_head_dim)
        kv_b = s.kv_lora_rank * s.num_heads * (s.qk_nope_head_dim + s.v_head_dim)  # W_UK and W_UV, absorbed
        o = s.num_heads * s.v_head_dim * h
        norms = h + s.q_lora_rank + s.kv_lora_rank
        return q_a + q_b + kv_a + kv_b + o + norms
    qkv = h * (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    o = s.num_heads * s.head_dim * h
    norms = h + (2 * s.head_dim if s.qk_norm else 0)
    return qkv + o + norms


#: How ``VerifyModel(experts_quant=...)`` stores MoE experts, as the served checkpoints do: int4 as Kimi-K2.5 (codes
#: of half a byte, a bf16 scale per group of 32, the shared expert left unquantised), fp8 as DeepSeek-V3 and Kimi-K2
#: (a byte, an fp32 scale per 128 x 128 block, the shared expert quantised too when it is one expert's size).
EXPERTS_QUANT = {"int4": dict(code_bytes=0.5, group_size=32, scale_bytes=2, shared=False),
                 "fp8": dict(code_bytes=1, block_shape=(128, 128), scale_bytes=4, shared=True)}


def expert_param_bytes(experts_quant: str | None, dtype_bytes: int = 2) -> tuple[float, float]:
    """Bytes a weight of a routed and of a shared expert takes, scales included (:data:`EXPERTS_QUANT`):
    unquantised ``dtype_bytes``. A shared expert counted quantised here is one expert's size, stacked with the
    routed ones; :func:`verify_bytes` counts a larger one unquantised, as ``VerifyModel`` stores it. Edge blocks are
    counted as whole fractions (exact when the sizes divide the block)."""
    if experts_quant is None:
        return float(dtype_bytes), float(dtype_bytes)
    p = EXPERTS_QUANT.get(experts_quant)
    if p is None:
        raise ValueError(f"experts_quant must be None, 'int4' or 'fp8', got {experts_quant!r}")
    per_scale = p["group_size"] if "group_size" in p else p["block_shape"][0] * p["block_shape"][1]
    routed = p["code_bytes"] + p["scale_bytes"] / per_scale
    return routed, routed if p["shared"] else float(dtype_bytes)


def verify_bytes(config: ModelConfig | str, tp: int = 1, tokens: int = 1, context: int = 4096, batch: int = 1,
                 dtype_bytes: int = 2, distinct_experts: float | None = None,
                 num_layers: int | None = None, experts_quant: str | None = None) -> VerifyBytes:
    """Bytes one verify pass must read per rank: the weights actually touched plus the KV cache.

    Parameters
    ----------
    config, tp
        Model and tensor-parallel degree (per-rank shapes from :func:`per_rank_shapes`).
    tokens
        Draft tokens per request in the pass (k; 1 = decode).
    context
        Prefix length per request (tokens already in the KV cache).
    batch
        Requests in the pass; weights are read once, KV once per request.
    dtype_bytes
        Bytes per weight and KV element (2 for bf16).
    distinct_experts
        Distinct routed experts one MoE layer touches. Default: the expectation under uniform routing of
        ``batch * tokens`` tokens (:func:`expected_distinct_experts`).
    num_layers
        Layers in the pass (default: the model's).
    experts_quant
        None, ``"int4"`` or ``"fp8"``: the experts as ``VerifyModel(experts_quant=...)`` stores them
        (:func:`expert_param_bytes`: codes plus scales; int4 leaves the shared expert in ``dtype_bytes``).

    Notes
    -----
    Counted: attention weights (MLA with W_UK/W_UV absorbed, or GQA q/k/v/o), per-layer KV of ``context + tokens``
    positions per request, dense MLP layers (gate, up, down), the router's weight and bias, the distinct routed
    experts (gate, up, down each), the shared experts, the final norm and LM head. Not counted: the embedding rows
    (k rows) and activations, which are small next to these.
    """
    s = per_rank_shapes(config, tp)
    layers = s.num_hidden_layers if num_layers is None else num_layers
    dense_layers = min(layers, s.first_k_dense_replace) if s.is_moe else layers
    moe_layers = layers - dense_layers
    h = s.hidden_size
    b = dtype_bytes
    attn = attention_weight_elems(s) * b * layers
    if s.attention == "mla":
        kv_per_token = (s.kv_lora_rank + s.qk_rope_head_dim) * b
    else:
        kv_per_token = 2 * s.num_kv_heads * s.head_dim * b
    kv = kv_per_token * (context + tokens) * batch * layers
    dense = (3 * h * s.intermediate_size + h) * b * dense_layers
    if s.is_moe:
        e = s.n_routed_experts
        distinct = (expected_distinct_experts(e, s.num_experts_per_tok, tokens * batch)
                    if distinct_experts is None else float(distinct_experts))
        router = (h * e * b + (e * 4 if s.e_score_correction_bias else 0) + h * b) * moe_layers
        routed_b, shared_b = expert_param_bytes(experts_quant, b)
        if s.shared_intermediate_size != s.moe_intermediate_size:  # stored apart from the stack: unquantised
            shared_b = b
        routed = distinct * 3 * h * s.moe_intermediate_size * routed_b * moe_layers
        shared = 3 * h * s.shared_intermediate_size * shared_b * moe_layers
    else:
        distinct, router, routed, shared = 0.0, 0.0, 0.0, 0.0
    lm_head = (h * s.vocab_size + h) * b
    return VerifyBytes(attention_weights=attn, kv_cache=kv, dense_mlp=dense, router=router, routed_experts=routed,
                       shared_experts=shared, lm_head=lm_head, distinct_experts_per_layer=distinct)
