"""SGLang 0.5.23's real ``DeepseekV3ForCausalLM`` on the CPU, built from a tiny config, with a KV pool, the Triton
attention backend and the EAGLE verify batches the step tests feed it (``tests/sglang/test_sglang_step.py``);
``kimi=True`` builds SGLang's real ``KimiK25ForConditionalGeneration`` instead (the same tiny language model as its
``text_config``, a one-layer MoonViT of width 32 as its vision tower).

What it needs around SGLang's code on a machine without CUDA or ``sgl_kernel`` (each is a read or a set-up SGLang's
own server would do, not a change of SGLang's behaviour):

* the stand-ins of ``standins.py`` (installed by ``conftest.py``) and, while the model is built, an import-only
  ``vllm._custom_ops`` (``RotaryEmbedding.__init__`` imports it on a platform that is none of CUDA/HIP/XPU/...;
  only ``forward_cuda`` calls it);
* a world-size-1 gloo process group and SGLang's runtime context published from the server arguments (SGLang's
  helper for it lives in ``sglang.test.test_utils``, which imports ``datasets``);
* a yarn ``rope_scaling`` in the config (the CPU rope factory asserts it; the real configs have it);
* weights redrawn at unit scale after the dummy load (SGLang's dummy weights are +-1e-3: logits ~1e-5), then
  ``post_load_weights`` (the absorbed ``w_kc`` / ``w_vc``); norm weights 1 + noise so a norm read from the wrong
  place shows;
* a model-runner stand-in holding what ``TritonAttnBackend`` reads (pools, page size, dtypes, server arguments);
* ``torch._dynamo`` disabled while the harness runs: SGLang's router is ``torch.compile``d, and Inductor on this CPU
  takes ~30 s for it; eager runs the same function.

``megakernel=True`` installs the spec through SGLang's own ``install_megakernel``; the CUDA-only reads it makes
(the device ISA, free memory, the SM count, stream capture) are answered as an H200 (sm_90) would.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import types
from types import SimpleNamespace
from unittest import mock

import torch

MAX_CTX = 64  # tokens per request slot of req_to_token


def tiny_config(*, dtype="float32", layers=3, hidden=256, heads=4, experts=16, top_k=4, kv_lora_rank=64,
                q_lora_rank=96, n_group=1, topk_group=1, vocab=512):
    """A DeepSeek-V3-shaped config.json dict: layer 0 dense, the rest MoE with one shared expert, sigmoid router with
    correction bias, yarn RoPE (interleaved) and MLA."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "torch_dtype": dtype,
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "moe_intermediate_size": hidden // 2,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
        "n_routed_experts": experts, "n_shared_experts": 1, "num_experts_per_tok": top_k, "n_group": n_group,
        "topk_group": topk_group, "first_k_dense_replace": 1, "moe_layer_freq": 1, "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "kv_lora_rank": kv_lora_rank, "q_lora_rank": q_lora_rank, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64,
        "v_head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "attention_bias": False, "tie_word_embeddings": False, "vocab_size": vocab, "bos_token_id": 0,
        "eos_token_id": 1, "num_nextn_predict_layers": 0,
    }


def kimi_config(text: dict) -> dict:
    """A Kimi-K2.5-shaped config.json dict around the language model config ``text``: a one-layer, 32-wide MoonViT
    (``vt_hidden_size`` is read by SGLang's projector; the real configs carry it)."""
    vision = dict(patch_size=14, init_pos_emb_height=4, init_pos_emb_width=4, init_pos_emb_time=1,
                  num_attention_heads=2, num_hidden_layers=1, hidden_size=32, vt_hidden_size=32, intermediate_size=64,
                  merge_kernel_size=[2, 2], text_hidden_size=text["hidden_size"])
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
            "vision_config": vision, "torch_dtype": text["torch_dtype"],
            "media_placeholder_token_id": text["vocab_size"] - 1}


@contextlib.contextmanager
def _vllm_rope_import_standin():
    if "vllm" in sys.modules:
        yield
        return
    vllm, ops = types.ModuleType("vllm"), types.ModuleType("vllm._custom_ops")

    def rotary_embedding(*args, **kwargs):
        raise RuntimeError("import-only stand-in (tests/sglang/dsv3_harness.py)")

    ops.rotary_embedding, vllm._custom_ops = rotary_embedding, ops
    sys.modules.update({"vllm": vllm, "vllm._custom_ops": ops})
    try:
        yield
    finally:
        sys.modules.pop("vllm", None)
        sys.modules.pop("vllm._custom_ops", None)


@contextlib.contextmanager
def interpreter_bf16_dot():
    """Triton 3.9.0's interpreter multiplies the uint16 bit patterns of bf16 ``tl.dot`` operands
    (``InterpreterBuilder.create_dot``: ``np.matmul`` on the storage dtype): a bf16 dot returns ~1e10. SGLang's
    Triton MLA attention and ours both use bf16 dots, so bf16 runs on the CPU need the operands widened to fp32
    first, which is what a GPU's bf16 MMA computes (exact products, fp32 accumulation)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            def widen(x):
                if x.dtype.scalar != tl.bfloat16:
                    return x
                data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
                return interpreter.TensorHandle(data, tl.float32)

            a, b = widen(a), widen(b)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    with mock.patch.object(interpreter.InterpreterBuilder, "create_dot", create_dot):
        yield


def _publish(server_args, tp_size=1, tp_rank=0):
    """A gloo world of ``tp_size`` ranks (once per process; this process is ``tp_rank``) and SGLang's runtime
    context for ``server_args`` (whose ``tp_size`` sets the TP group ``initialize_model_parallel`` builds)."""
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29641"), ("RANK", str(tp_rank)),
                       ("WORLD_SIZE", str(tp_size)), ("LOCAL_RANK", str(tp_rank))):
        os.environ.setdefault(key, value)
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context

    if not torch.distributed.is_initialized():
        ps.init_distributed_environment(world_size=tp_size, rank=tp_rank, local_rank=tp_rank, backend="gloo")
    if ps.model_parallel_is_initialized():  # a later harness: the fresh context needs the groups written again
        ps.destroy_model_parallel()
    reset_context()
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=tp_rank))
    get_parallel().override_permanently(world_group=ps._WORLD)
    ps.initialize_model_parallel(backend="gloo")


#: Parameters SGLang replicates on every TP rank (the rest are per-rank shards).
_REPLICATED = ("fused_qkv_a_proj_with_mqa", "norm", "mlp.gate.weight", "correction_bias")


def _redraw(model, seed, round_to=None, tp_size=1, tp_rank=0):
    """Unit-scale weights from ``seed``; ``round_to`` (a dtype) rounds them through it first, so an fp32 model can
    hold exactly the weights of a bf16 one (the correction bias stays fp32, as SGLang keeps it). Under TP every
    rank draws the replicated parameters alike and its shards from a seed of its own (``tp_rank``), so a shard read
    from the wrong place shows; at TP 1 one generator draws them all, as before."""
    g = torch.Generator().manual_seed(seed)
    for index, (name, p) in enumerate(model.named_parameters()):
        if tp_size > 1:
            own = 0 if any(part in name for part in _REPLICATED) else 1 + tp_rank
            g = torch.Generator().manual_seed(seed * 100003 + 7919 * own + index)
        if p.dim() >= 2:
            w = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
        elif "norm" in name:
            w = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        else:  # the router's correction bias
            w = 0.1 * torch.randn(p.shape, generator=g)
        if round_to is not None and "correction_bias" not in name:
            w = w.to(round_to)
        p.data.copy_(w)
    model.post_load_weights()


def _runner_class():
    from sglang.srt.model_executor.model_runner import ModelRunner

    class Runner(ModelRunner):
        """What TritonAttnBackend reads from a ModelRunner, without ModelRunner's GPU set-up."""

        hybrid_gdn_config = hybrid_lightning_config = kimi_linear_config = None
        linear_attn_model_spec = mamba2_config = mambaish_config = None

        def __init__(self, *, model, model_config, server_args, requests, page_size):
            from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
            from sglang.srt.model_executor.graph_shared_output import GraphSharedOutput
            from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

            hf = model_config.hf_text_config  # a wrapper's (Kimi-K2.5's) language model config
            self.device, self.gpu_id, self.model, self.model_config = "cpu", 0, model, model_config
            self.dtype = self.kv_cache_dtype = model_config.dtype
            self.kv_cache_dtype_str = "auto"
            self.prefill_attention_backend_str = self.decode_attention_backend_str = "triton"
            self.draft_attention_backend, self.canary_manager = None, None
            self.page_size = page_size
            self.spec_algorithm = (SpeculativeAlgorithm.EAGLE if server_args["speculative_algorithm"]
                                   else SpeculativeAlgorithm.NONE)
            self.is_draft_worker, self._kernel_warmed_up = False, True
            self.server_args = server_args["installed"]
            self.max_running_requests = requests
            self.req_to_token_pool = ReqToTokenPool(size=requests, max_context_len=MAX_CTX, device="cpu",
                                                    enable_memory_saver=False)
            slots = page_size + requests * MAX_CTX
            self.token_to_kv_pool = MLATokenToKVPool(
                size=slots, page_size=page_size, dtype=self.kv_cache_dtype, kv_lora_rank=hf.kv_lora_rank,
                qk_rope_head_dim=hf.qk_rope_head_dim, layer_num=hf.num_hidden_layers, device="cpu",
                enable_memory_saver=False)
            self.token_to_kv_pool_allocator = SimpleNamespace(page_size=page_size,
                                                              get_kvcache=lambda: self.token_to_kv_pool)
            self.init_kv_index_translator()
            self.attention_chunk_size = self.hisparse_coordinator = self.sliding_window_size = None
            self.init_new_workspace = self.is_hybrid_swa = False
            self.use_mla_backend = True
            self.graph_shared_output = GraphSharedOutput(device="cpu", max_rows=requests * MAX_CTX)

    return Runner


class Dsv3Harness:
    """SGLang's DeepseekV3ForCausalLM, its KV pool and Triton attention backend, and helpers that prefill request
    prefixes and build TARGET_VERIFY / DECODE batches. ``tokens``: draft tokens per request (None: no speculative
    decoding, the server decodes one token a step). ``megakernel``: install the spec through SGLang's binding.
    ``kimi``: build KimiK25ForConditionalGeneration around the same language model (``model`` is then the wrapper,
    ``lm`` its language model). ``prepare``: called with the loaded model before the spec is installed (a test swaps
    a module's quant method there)."""

    def __init__(self, *, dtype=torch.float32, tokens=4, topk=2, requests=4, megakernel=True, seed=1,
                 page_size=1, round_weights_to=None, kimi=False, prepare=None, tp_size=1, tp_rank=0, **config):
        from sglang.srt.configs.device_config import DeviceConfig
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
        from sglang.srt.model_executor.cuda_graph_config import Backend, CudaGraphConfig, PhaseConfig
        from sglang.srt.model_loader import get_model
        from sglang.srt.runtime_context import get_context
        from sglang.srt.server_args import ServerArgs

        torch.set_grad_enabled(False)
        self._dynamo = mock.patch.object(torch._dynamo.config, "disable", True)
        self._dynamo.start()
        name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
        self.cfg = tiny_config(dtype=name, **config)
        root = tempfile.mkdtemp(prefix="specverify_dsv3_")
        with open(os.path.join(root, "config.json"), "w") as f:
            json.dump(kimi_config(self.cfg) if kimi else self.cfg, f)
        self.tokens, self.topk, self.page_size, self.dtype = tokens, topk, page_size, dtype
        sa = ServerArgs(model_path=root, device="cpu", attention_backend="triton", load_format="dummy",
                        tp_size=tp_size, dtype=name, disable_cuda_graph=True, mem_fraction_static=0.5)
        self.tp_size, self.tp_rank = tp_size, tp_rank
        _publish(sa, tp_size, tp_rank)
        self.model_config = ModelConfig.from_server_args(sa)
        with _vllm_rope_import_standin():
            self.model = get_model(model_config=self.model_config, load_config=LoadConfig(load_format="dummy"),
                                   device_config=DeviceConfig("cpu"))
        _redraw(self.model, seed, round_weights_to, tp_size, tp_rank)
        self.lm = getattr(self.model, "language_model", self.model)  # the DeepseekV3ForCausalLM
        if prepare is not None:
            prepare(self.model)
        spec = dict(speculative_algorithm="EAGLE" if tokens else None,
                    speculative_num_draft_tokens=tokens, speculative_num_steps=(tokens - 1) if tokens else None,
                    speculative_eagle_topk=topk if tokens else None)
        graphs = CudaGraphConfig(decode=PhaseConfig(backend=Backend.DISABLED),
                                 prefill=PhaseConfig(backend=Backend.DISABLED))
        # one override with every field: a second override_server_args() starts again from the published args
        override = get_context().override_server_args(
            enable_nvidia_megakernel=megakernel, attention_backend="triton", chunked_prefill_size=-1,
            cuda_graph_config=graphs, disable_chunked_prefix_cache=True, disable_radix_cache=False, dp_size=1,
            enable_deterministic_inference=False, is_embedding=False, kv_cache_dtype="auto",
            max_running_requests=None, pp_size=1, tp_size=tp_size, triton_attention_num_kv_splits=8,
            triton_attention_split_tile_size=None, page_size=page_size, **spec)
        self.runner = _runner_class()(model=self.model, model_config=self.model_config,
                                      server_args={"installed": override.install(), **spec}, requests=requests,
                                      page_size=page_size)
        self.backend = ATTENTION_BACKENDS["triton"](self.runner)
        self.runner.attn_backend = self.backend
        self.pool = self.runner.token_to_kv_pool
        self.built = None
        self.sglang_forward = self.model.forward  # SGLang's own (bound) forward, as the binding wraps it
        if megakernel:
            self.built = self.install()
        # the installed dispatch asks torch.cuda.is_current_stream_capturing() on every call; the CPU torch raises
        self._capturing = mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: False)
        self._capturing.start()
        self.layer_calls = 0
        inner = self.lm.model.forward

        def counting(*args, **kwargs):  # DeepseekV2Model.forward: runs only when SGLang's own forward runs
            self.layer_calls += 1
            return inner(*args, **kwargs)

        self.lm.model.forward = counting

    def install(self):
        from sglang.srt.kernel_plugins.nvidia import binding

        props = SimpleNamespace(multi_processor_count=132, major=9, minor=0)
        with mock.patch.object(binding, "device_isa", lambda: "sm_90"), \
                mock.patch.object(torch.cuda, "mem_get_info", lambda *a: (0, 0)), \
                mock.patch.object(torch.cuda, "current_device", lambda: 0), \
                mock.patch.object(torch.cuda, "get_device_properties", lambda *a: props):
            binding.install_megakernel(model=self.model, hf_config=self.model_config.hf_config,
                                       capture_tail_hooks=[], is_draft=False)
        return binding.built_megakernel(self.model)

    def close(self):
        self._capturing.stop()
        self._dynamo.stop()

    # slots and batches -----------------------------------------------------------------------------------------
    def loc(self, slot: int, position: int) -> int:
        """KV slot of ``position`` of request slot ``slot`` (slot 0 .. page_size - 1 is SGLang's padding)."""
        return self.page_size + slot * MAX_CTX + position

    def run(self, fb, forward=None):
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        self.runner.kv_index_translator.bind_own_plan(fb)
        with forward_context(ForwardContext(attn_backend=self.backend), forward_batch=fb):
            self.backend.init_forward_metadata(fb)
            return (forward or self.model.forward)(fb.input_ids, fb.positions, fb)

    def prefill(self, prefix_lens, seed=0):
        """EXTEND of fresh prefixes for request slots 0..: fills every layer's KV; returns the token ids."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

        g = torch.Generator().manual_seed(seed)
        vocab = self.cfg["vocab_size"]
        ids = [torch.randint(2, vocab, (n,), generator=g) for n in prefix_lens]
        table = self.runner.req_to_token_pool.req_to_token
        for r, n in enumerate(prefix_lens):
            table[r, :n] = torch.tensor([self.loc(r, p) for p in range(n)], dtype=table.dtype)
        bs, lens = len(prefix_lens), torch.tensor(prefix_lens, dtype=torch.int32)
        fb = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=bs, input_ids=torch.cat(ids),
                          req_pool_indices=torch.arange(bs, dtype=torch.int32), seq_lens=lens, seq_lens_cpu=lens,
                          out_cache_loc=torch.tensor([self.loc(r, p) for r, n in enumerate(prefix_lens)
                                                      for p in range(n)], dtype=torch.int64),
                          seq_lens_sum=sum(prefix_lens), positions=torch.cat([torch.arange(n) for n in prefix_lens]))
        fb.extend_prefix_lens = torch.zeros(bs, dtype=torch.int32)
        fb.extend_prefix_lens_cpu = [0] * bs
        fb.extend_seq_lens, fb.extend_seq_lens_cpu = lens, list(prefix_lens)
        fb.extend_start_loc = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(lens, 0)[:-1].int()])
        fb.extend_num_tokens = sum(prefix_lens)
        fb.capture_hidden_mode = CaptureHiddenMode.NULL
        return ids, self.run(fb)

    def verify_batch(self, prefix_lens, trees, seed=0, capture="full"):
        """A TARGET_VERIFY batch: request r has ``prefix_lens[r]`` cached tokens (prefilled) and the draft tree
        ``trees[r]`` (a specverify DraftTree of ``tokens`` nodes); SGLang's EagleVerifyInput with its dense custom
        mask and tree links. Draft slots are assigned in req_to_token as SGLang's prepare_for_verify does."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
        from sglang.srt.speculative.eagle_info import EagleVerifyInput

        from specverify.tree import BatchedDraftTree

        k, bs = self.tokens, len(prefix_lens)
        bt = BatchedDraftTree(trees)
        g = torch.Generator().manual_seed(1000 + seed)
        draft = torch.randint(2, self.cfg["vocab_size"], (bs * k,), generator=g)
        table = self.runner.req_to_token_pool.req_to_token
        out_loc = []
        for r, n in enumerate(prefix_lens):
            locs = [self.loc(r, n + i) for i in range(k)]
            table[r, n:n + k] = torch.tensor(locs, dtype=table.dtype)
            out_loc += locs
        masks = []
        for r, n in enumerate(prefix_lens):
            rows = torch.ones(k, n + k, dtype=torch.bool)
            rows[:, n:] = bt.trees[r].ancestor_mask()
            masks.append(rows.reshape(-1))
        positions = (torch.tensor(prefix_lens).view(bs, 1) + bt.depth).reshape(-1)
        lens = torch.tensor(prefix_lens, dtype=torch.int32)
        mode = {"full": CaptureHiddenMode.FULL, "last": CaptureHiddenMode.LAST, None: CaptureHiddenMode.NULL}[capture]
        fb = ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=draft,
                          req_pool_indices=torch.arange(bs, dtype=torch.int32), seq_lens=lens, seq_lens_cpu=lens,
                          out_cache_loc=torch.tensor(out_loc, dtype=torch.int64), seq_lens_sum=sum(prefix_lens),
                          positions=positions)
        fb.spec_info = EagleVerifyInput(
            draft_token=draft, custom_mask=torch.cat(masks), positions=positions,
            retrieve_index=bt.retrieve_index, retrieve_next_token=bt.retrieve_next_token,
            retrieve_next_sibling=bt.retrieve_next_sibling, retrieve_cum_len=None, spec_steps=bt.max_depth,
            topk=self.topk, draft_token_num=k, capture_hidden_mode=mode, seq_lens_sum=sum(prefix_lens),
            seq_lens_cpu=lens)
        fb.capture_hidden_mode = mode
        return fb

    def decode_batch(self, prefix_lens, seed=0):
        """A DECODE batch: one new token per request after its prefilled prefix."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

        bs = len(prefix_lens)
        g = torch.Generator().manual_seed(2000 + seed)
        ids = torch.randint(2, self.cfg["vocab_size"], (bs,), generator=g)
        table = self.runner.req_to_token_pool.req_to_token
        for r, n in enumerate(prefix_lens):
            table[r, n] = self.loc(r, n)
        lens = torch.tensor(prefix_lens, dtype=torch.int32) + 1  # decode: seq_lens count the new token
        fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=ids,
                          req_pool_indices=torch.arange(bs, dtype=torch.int32), seq_lens=lens, seq_lens_cpu=lens,
                          out_cache_loc=torch.tensor([self.loc(r, n) for r, n in enumerate(prefix_lens)]),
                          seq_lens_sum=int(lens.sum()), positions=torch.tensor(prefix_lens, dtype=torch.int64))
        fb.capture_hidden_mode = CaptureHiddenMode.NULL
        return fb

    def kv_rows(self, locs):
        """Every layer's latent KV rows at ``locs`` (a copy): [layers, len(locs), kv_lora + rope]."""
        idx = torch.as_tensor(locs, dtype=torch.long)
        return torch.stack([self.pool.get_key_buffer(i)[idx, 0].clone()
                            for i in range(self.cfg["num_hidden_layers"])])

    def poison(self, locs):
        idx = torch.as_tensor(locs, dtype=torch.long)
        for i in range(self.cfg["num_hidden_layers"]):
            self.pool.get_key_buffer(i)[idx] = float("nan")
