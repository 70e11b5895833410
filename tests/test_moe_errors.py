"""Bad inputs to moe_route and fused_moe raise TypeError/ValueError naming what was expected and what came."""
from __future__ import annotations

import pytest
import torch

from specverify.moe import MoEQuant, fused_moe, moe_route


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(router_logits=torch.zeros(4)), ValueError, "shape [M, E]"),
    (dict(router_logits=torch.zeros(2, 8, dtype=torch.int32)), TypeError, "float32, bfloat16 or float16"),
    (dict(router_logits=torch.zeros(2, 1025)), ValueError, "1..1024 experts"),
    (dict(top_k=0), ValueError, "top_k must be an int in [1, num_experts=8]"),
    (dict(top_k=9), ValueError, "top_k must be an int in [1, num_experts=8]"),
    (dict(top_k=2.0), TypeError, "pass a Python int"),
    (dict(scoring="relu"), ValueError, "'sigmoid' or 'softmax'"),
    (dict(correction_bias=torch.zeros(7)), ValueError, "correction_bias must have shape [8]"),
    (dict(correction_bias=torch.zeros(8, dtype=torch.int64)), TypeError, "floating-point"),
    (dict(n_group=3), ValueError, "dividing num_experts=8"),
    (dict(n_group=4, topk_group=5), ValueError, "topk_group must be an int in [1, n_group=4]"),
    (dict(n_group=4, topk_group=1, top_k=3), ValueError, "exceeds the experts of the kept groups"),
    (dict(renormalize=1), TypeError, "renormalize must be a bool"),
    (dict(routed_scaling_factor="2"), TypeError, "routed_scaling_factor"),
    (dict(block_size=12), ValueError, "power of two"),
    (dict(impl="cuda"), ValueError, "impl must be one of"),
    # the shared expert's slot: a Python int >= 0 (a bool is not one); below 1024 when aligning (the workspace's
    # expert counters); it may be >= E (the shared expert stacked after the routed ones)
    (dict(shared_expert_id=True), TypeError, "shared_expert_id must be a Python int >= 0 or None, got bool True"),
    (dict(shared_expert_id=8.0), TypeError, "shared_expert_id must be a Python int >= 0 or None, got float"),
    (dict(shared_expert_id=torch.tensor(8)), TypeError, "got Tensor"),
    (dict(shared_expert_id=-1), ValueError, "shared_expert_id must be an int in [0, 2147483647], got -1"),
    (dict(shared_expert_id=2 ** 31), ValueError, "shared_expert_id must be an int in [0, 2147483647]"),
    (dict(shared_expert_id=1024, block_size=16), ValueError, "in [0, 1023] with block_size (the alignment counts at "
                                                             "most 1024 experts), got 1024"),
    (dict(shared_expert_id=-1, impl="reference"), ValueError, "shared_expert_id must be an int in [0,"),
])
def test_moe_route_errors(kwargs, exc, words):
    args = dict(router_logits=torch.zeros(2, 8), top_k=2)
    args.update(kwargs)
    logits = args.pop("router_logits")
    with pytest.raises(exc) as info:
        moe_route(logits, **args)
    assert words in str(info.value)


def _moe_args():
    m, e, h, i = 2, 4, 16, 8
    return dict(hidden=torch.zeros(m, h, dtype=torch.bfloat16), w13=torch.zeros(e, 2 * i, h, dtype=torch.bfloat16),
                w2=torch.zeros(e, h, i, dtype=torch.bfloat16), topk_ids=torch.zeros(m, 2, dtype=torch.int32),
                topk_weights=torch.zeros(m, 2))


@pytest.mark.parametrize("change, exc, words", [
    (dict(hidden=torch.zeros(2, 3, 16, dtype=torch.bfloat16)), ValueError, "hidden must have shape [M, H]"),
    (dict(w13=torch.zeros(4, 15, 16, dtype=torch.bfloat16)), ValueError, "even second dimension"),
    (dict(w2=torch.zeros(4, 16, 4, dtype=torch.bfloat16)), ValueError, "w2 must be [E=4, H=16, I=8], got w2"),
    # hidden's width disagrees with w13's: the message names H, not w2
    (dict(hidden=torch.zeros(2, 32, dtype=torch.bfloat16)), ValueError, "disagree on H"),
    (dict(w2=torch.zeros(4, 16, 8)), TypeError, "must have hidden's dtype"),
    (dict(topk_ids=torch.zeros(3, 2, dtype=torch.int32)), ValueError, "topk_ids and topk_weights must both"),
    (dict(topk_ids=torch.zeros(2, 2)), TypeError, "topk_ids must be int32 or int64"),
    (dict(activation="gelu"), ValueError, "activation must be 'silu'"),
    (dict(out=torch.zeros(2, 16)), ValueError, "out must be torch.bfloat16 [M=2, H=16]"),
    (dict(alignment=(1, 2, 3)), TypeError, "MoEAlignment"),
    (dict(quant="w4a16"), TypeError, "MoEQuant"),
    (dict(impl="cuda"), ValueError, "impl must be one of"),
])
def test_fused_moe_errors(change, exc, words):
    args = _moe_args()
    args.update(change)
    with pytest.raises(exc) as info:
        fused_moe(args.pop("hidden"), args.pop("w13"), args.pop("w2"), args.pop("topk_ids"),
                  args.pop("topk_weights"), **args)
    assert words in str(info.value)


def _quant_args(fmt):
    """int4 (group 8) or fp8 (blocks of 8 x 8) experts of E 4, H 16, I 8, quantised from zeros."""
    m, e, h, i = 2, 4, 16, 8
    args = dict(hidden=torch.zeros(m, h, dtype=torch.bfloat16), topk_ids=torch.zeros(m, 2, dtype=torch.int32),
                topk_weights=torch.zeros(m, 2))
    if fmt == "int4":
        args.update(w13=torch.zeros(e, 2 * i, h // 2, dtype=torch.uint8),
                    w2=torch.zeros(e, h, i // 2, dtype=torch.uint8),
                    quant=MoEQuant("int4", torch.ones(e, 2 * i, h // 8), torch.ones(e, h, i // 8), group_size=8))
    else:
        args.update(w13=torch.zeros(e, 2 * i, h, dtype=torch.float8_e4m3fn),
                    w2=torch.zeros(e, h, i, dtype=torch.float8_e4m3fn),
                    quant=MoEQuant("fp8", torch.ones(e, 2, 2), torch.ones(e, 2, 1), block_shape=(8, 8)))
    return args


def _requant(args, **fields):
    q = args["quant"]
    return MoEQuant(**{**dict(format=q.format, w13_scale=q.w13_scale, w2_scale=q.w2_scale, group_size=q.group_size,
                              block_shape=q.block_shape), **fields})


@pytest.mark.parametrize("fmt, change, exc, words", [
    ("int4", lambda a: dict(quant=_requant(a, format="int8")), ValueError, "'int4' or 'fp8', got 'int8'"),
    ("int4", lambda a: dict(hidden=a["hidden"].float()), TypeError, "bfloat16 or float16 hidden states"),
    # compressed-tensors' int32 words: the message says how to pass them
    ("int4", lambda a: dict(w13=torch.zeros(4, 16, 2, dtype=torch.int32), w2=torch.zeros(4, 16, 1, dtype=torch.int32)),
     TypeError, "pass compressed-tensors int32 weight_packed as .view(torch.uint8)"),
    ("int4", lambda a: dict(w13=a["w13"][..., :4]), ValueError, "int4: the last dimension holds two codes a byte"),
    ("int4", lambda a: dict(w13=torch.zeros(4, 16, 16, dtype=torch.uint8)), ValueError, "disagree on H"),
    ("int4", lambda a: dict(quant=_requant(a, group_size=6)), ValueError, "group_size must be a power of two"),
    ("int4", lambda a: dict(quant=_requant(a, group_size=16)), ValueError, "multiples of group_size=16"),
    ("int4", lambda a: dict(quant=_requant(a, w13_scale=torch.ones(4, 16, 3))), ValueError,
     "MoEQuant.w13_scale must have shape [4, 16, 2]"),
    ("int4", lambda a: dict(quant=_requant(a, w2_scale=torch.ones(4, 16, 1, dtype=torch.int32))), TypeError,
     "MoEQuant.w2_scale must be float32, bfloat16 or float16"),
    ("int4", lambda a: dict(quant=_requant(a, w2_scale=None)), TypeError, "MoEQuant.w2_scale must be a torch.Tensor"),
    ("fp8", lambda a: dict(w2=a["w2"].bfloat16()), TypeError, "fp8 experts must be torch.float8_e4m3fn"),
    ("fp8", lambda a: dict(quant=_requant(a, block_shape=(16, 8))), ValueError, "I=8 to be a multiple of block_shape"),
    ("fp8", lambda a: dict(quant=_requant(a, block_shape=(8,))), ValueError, "block_shape must be two powers of two"),
    ("fp8", lambda a: dict(quant=_requant(a, w2_scale=torch.ones(4, 2, 2))), ValueError,
     "MoEQuant.w2_scale must have shape [4, 2, 1]"),
])
def test_fused_moe_quant_errors(fmt, change, exc, words):
    args = _quant_args(fmt)
    args.update(change(args))
    with pytest.raises(exc) as info:
        fused_moe(args.pop("hidden"), args.pop("w13"), args.pop("w2"), args.pop("topk_ids"),
                  args.pop("topk_weights"), **args)
    assert words in str(info.value)


def test_quantised_storage_without_quant_is_refused():
    # uint8 codes or fp8 values passed as plain weights: the message asks for their scales, not for a cast
    args = _quant_args("fp8")
    args.pop("quant")
    with pytest.raises(TypeError, match=r"need their scales, quant=MoEQuant.*would drop the scales"):
        fused_moe(args.pop("hidden"), args.pop("w13"), args.pop("w2"), args.pop("topk_ids"), args.pop("topk_weights"))


def test_scale_shape_message_names_the_group_size():
    args = _quant_args("int4")
    args["quant"] = _requant(args, group_size=4, w13_scale=torch.ones(4, 16, 2), w2_scale=torch.ones(4, 16, 1))
    with pytest.raises(ValueError, match=r"and group_size=4, got \[4, 16, 2\]; is group_size=4 the one"):
        fused_moe(args.pop("hidden"), args.pop("w13"), args.pop("w2"), args.pop("topk_ids"),
                  args.pop("topk_weights"), **args)


def test_dequantize_checks_the_format():
    q = MoEQuant("INT4", torch.ones(1, 2, 1), torch.ones(1, 2, 1))
    with pytest.raises(ValueError, match="must be 'int4' or 'fp8', got 'INT4'"):
        q.dequantize(torch.zeros(1, 2, 4, dtype=torch.uint8), torch.zeros(1, 2, 4, dtype=torch.uint8))


def test_fused_moe_quant_valid_args_run():
    # the base arguments of the error cases above are valid: each error comes from its one change
    for fmt in ("int4", "fp8"):
        args = _quant_args(fmt)
        out = fused_moe(args.pop("hidden"), args.pop("w13"), args.pop("w2"), args.pop("topk_ids"),
                        args.pop("topk_weights"), impl="reference", **args)
        assert out.shape == (2, 16)


def test_fused_moe_alignment_too_small():
    from specverify.moe import MoEAlignment

    args = _moe_args()
    al = MoEAlignment(torch.zeros(4, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                      torch.zeros(1, dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="alignment buffers are too small"):
        fused_moe(args["hidden"], args["w13"], args["w2"], args["topk_ids"], args["topk_weights"], alignment=al)


def test_triton_fp32_experts_refused():
    args = _moe_args()
    args = {k: (v.float() if v.is_floating_point() else v) for k, v in args.items()}
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        fused_moe(args["hidden"], args["w13"], args["w2"], args["topk_ids"], args["topk_weights"], impl="triton")


def test_dot_experts_refuse_small_alignment_blocks(device):
    # M = 9, above the stream path: the tl.dot path needs blocks of >= 16 rows and says so
    m, e, h, i = 9, 4, 16, 8
    hidden = torch.zeros(m, h, dtype=torch.bfloat16, device=device)
    w13 = torch.zeros(e, 2 * i, h, dtype=torch.bfloat16, device=device)
    w2 = torch.zeros(e, h, i, dtype=torch.bfloat16, device=device)
    ids = torch.zeros(m, 2, dtype=torch.int32, device=device)
    _, _, al = moe_route(torch.zeros(m, e, device=device), top_k=2, block_size=4, impl="triton")
    with pytest.raises(ValueError, match="block_size >= 16"):
        fused_moe(hidden, w13, w2, ids, torch.zeros(m, 2, device=device), alignment=al, impl="triton")
