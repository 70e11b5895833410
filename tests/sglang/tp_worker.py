"""One tensor-parallel rank of ``test_sglang_step.py::test_tp2_*``: SGLang's real DeepseekV3ForCausalLM at TP
``world`` (``dsv3_harness.Dsv3Harness(tp_size=..., tp_rank=...)``, a gloo world over 127.0.0.1), the spec installed
through SGLang's binding, SGLang's own TARGET_VERIFY forward and ours on the same batch.

Run as ``python tp_worker.py RANK WORLD PORT OUT_JSON [KEY=VALUE ...]`` (``dtype=float32|bfloat16``, ``topk=2`` (1: a
chain server), ``vocab=500``, ``prefix=5,11``, ``provider=auto|specverify`` and ``experts=auto|sglang``, the
:func:`~specverify.integrations.sglang_step.build_step` arguments); writes what the parent test asserts on: the logits /
KV / hidden-state errors relative to SGLang's, the greedy tokens of both, and how many all-reduces and all-gathers went
through SGLang's TP group coordinator (``get_tp_group().all_reduce`` / ``.all_gather``) during our forward.
"""
from __future__ import annotations

import json
import os
import sys


def main(argv):
    rank, world, port, out_path = int(argv[1]), int(argv[2]), argv[3], argv[4]
    opts = dict(a.split("=", 1) for a in argv[5:])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    os.environ.setdefault("TRITON_INTERPRET", "1")
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.dirname(os.path.dirname(here))]  # the harness, then specverify from source
    import standins

    standins.install()
    standins.hide_cuda_from_sglang()
    for name in ("SPECVERIFY_SGLANG_ATTENTION", "SPECVERIFY_SGLANG_ROUTING", "SPECVERIFY_SGLANG_ALLREDUCE"):
        os.environ.setdefault(name, "1")
    os.environ.pop("SGLANG_PLUGINS", None)
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import contextlib
    import functools

    import msgspec
    import torch

    from dsv3_harness import Dsv3Harness, interpreter_bf16_dot
    from specverify.integrations import sglang_step
    from specverify.tree import DraftTree

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[opts.get("dtype", "float32")]
    topk = int(opts.get("topk", 2))
    prefix = tuple(int(n) for n in opts.get("prefix", "5,11").split(","))
    trees = ((DraftTree([-1, 0, 0, 1]), DraftTree([-1, 0, 1, 0])) if topk > 1
             else (DraftTree.chain(4), DraftTree.chain(4)))
    build = {k: opts[k] for k in ("provider", "experts") if k in opts}
    if build:  # the spec SGLang's registry imports, built with these arguments
        sglang_step.SPEC = msgspec.structs.replace(sglang_step.SPEC,
                                                   build=functools.partial(sglang_step.build_step, **build))
    bf16 = interpreter_bf16_dot() if dtype == torch.bfloat16 else contextlib.nullcontext()
    with bf16:
        _compare(rank, out_path, dtype, topk, prefix, trees, int(opts.get("vocab", 500)), world)


def _separate_routing(model):
    """bf16 runs: each MoE layer's experts ranked mostly by a correction bias of distinct steps (0.02 apart, the
    same on every rank), the router weight shrunk so its logits stay far under those steps. With the dummy router
    the 4th and 5th biased scores were 0.003-0.005 apart, under what one bf16 rounding of a router logit moves a
    sigmoid score, so a rounding difference anywhere before the router (SGLang's torch ops against our kernels, or
    the CPU's bf16 matmul) could swap an expert and move the logits by 16% (an AMD EPYC CI machine, 2026-12-02).
    The routing weights still come from the scores."""
    import torch

    g = torch.Generator().manual_seed(17)
    for layer in getattr(model, "language_model", model).model.layers:
        gate = getattr(layer.mlp, "gate", None)
        bias = getattr(gate, "e_score_correction_bias", None)
        if bias is None:
            continue
        gate.weight.data.mul_(0.01 / max(float(gate.weight.float().abs().max()), 1e-6) / gate.weight.shape[1] ** 0.5)
        bias.data.copy_((torch.randperm(bias.numel(), generator=g).float() * 0.02).to(bias.dtype))


def _compare(rank, out_path, dtype, topk, prefix, trees, vocab, world):
    import torch

    from dsv3_harness import Dsv3Harness

    h = Dsv3Harness(dtype=dtype, tokens=4, topk=topk, tp_size=world, tp_rank=rank, vocab=vocab,
                    prepare=_separate_routing if dtype == torch.bfloat16 else None)
    result = {"rank": rank, "built": type(h.built).__name__}
    try:
        h.prefill(prefix)
        fb = h.verify_batch(prefix, trees)
        locs = fb.out_cache_loc.tolist()
        ref = h.run(fb, h.sglang_forward)
        kv_ref = h.kv_rows(locs)
        h.poison(locs)

        from sglang.srt.distributed import get_tp_group

        group = get_tp_group()
        counts = {"all_reduce": 0, "all_gather": 0}
        originals = {name: getattr(group, name) for name in counts}

        def counting(name):
            def call(*args, **kwargs):
                counts[name] += 1
                return originals[name](*args, **kwargs)
            return call

        layer_calls, calls = h.layer_calls, sum(h.built.calls.values())
        for name in counts:
            setattr(group, name, counting(name))
        try:
            out = h.run(fb)
        finally:
            for name in counts:
                setattr(group, name, originals[name])
        kv = h.kv_rows(locs)
        a, b = ref.next_token_logits.float(), out.next_token_logits.float()
        hs = ref.hidden_states.float()
        result.update(
            sglang_layer_loop_ran=h.layer_calls != layer_calls, ours_ran=sum(h.built.calls.values()) - calls,
            shape=list(b.shape), sglang_shape=list(a.shape), kv_nan=bool(torch.isnan(kv).any()),
            logits=(a - b).abs().max().item() / a.abs().max().item(),
            kv=(kv_ref.float() - kv.float()).abs().max().item() / kv_ref.float().abs().max().item(),
            hidden=(hs - out.hidden_states.float()).abs().max().item() / hs.abs().max().item(),
            greedy=b.argmax(-1).tolist(), sglang_greedy=a.argmax(-1).tolist(), counts=counts,
            tp=h.built.verify_model.tp, rank_of_model=h.built.verify_model.rank, summary=h.built.summary(),
            layers=h.cfg["num_hidden_layers"], vocab_range=list(h.built.verify_model.vocab_range),
            embed_rows=h.lm.model.embed_tokens.weight.shape[0], provider=h.built.provider,
            sglang_expert_layers=sorted(h.built.sglang_expert_layers), copied_tensors=h.built.weights.copied_tensors)
        # the TP refusals read this rank's modules: none for the model as built, one for a replicated shared expert
        from specverify.integrations import sglang_step

        hf = h.model_config.hf_config
        result["model_reasons"] = sglang_step.model_disable_reasons(h.model, hf)
        mlp = h.lm.model.layers[1].mlp
        mlp._shared_expert_tp1 = True
        try:
            result["shared_tp1_reasons"] = sglang_step.model_disable_reasons(h.model, hf)
        finally:
            mlp._shared_expert_tp1 = False
    finally:
        h.close()
        with open(out_path, "w") as f:
            json.dump(result, f)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv)
