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
    (dict(quant=MoEQuant()), NotImplementedError, "not implemented yet"),
    (dict(impl="cuda"), ValueError, "impl must be one of"),
])
def test_fused_moe_errors(change, exc, words):
    args = _moe_args()
    args.update(change)
    with pytest.raises(exc) as info:
        fused_moe(args.pop("hidden"), args.pop("w13"), args.pop("w2"), args.pop("topk_ids"),
                  args.pop("topk_weights"), **args)
    assert words in str(info.value)


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
