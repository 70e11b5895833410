"""``specverify bench verify-wall``: what a verify pass of k draft tokens costs, against what its bytes demand.

For a model architecture (dummy weights, per tensor-parallel rank) and each draft length k, it times the verify
pass — forward over the k tree nodes, LM head, greedy acceptance, compaction of the accepted path's KV — per
provider, and reports:

* ``verify_ms`` median / p20 / p80 (CUDA events around each pass; CUDA-graph replay with ``--graph on``);
* ``decode_ms``: the same provider's k = 1 pass (no tree);
* ``bytes``: what one pass must read per rank (:func:`specverify.configs.verify_bytes`), and the **bytes floor**
  ``floor_ms = bytes / bandwidth``, the bandwidth measured in the same run by a device-to-device copy
  (``2 * copy_bytes / time``: read plus write);
* ``efficiency = floor_ms / verify_ms`` and ``overhead_ms = verify_ms - floor_ms``;
* the floor counts the routed experts a MoE layer reads as the expectation under uniform routing
  (``distinct_experts_modelled``); one eager pass after the timing records the experts this pass's routing chose
  (``distinct_experts_routed``, the mean over MoE layers of the distinct routed ids) and gives the floor and
  efficiency with that count (``floor_ms_routed``, ``efficiency_routed``, the table's ``eff rt``): the dummy
  weights' routing need not be uniform (a correction bias favours some experts), and where it reads fewer experts
  the uniform floor overstates the bytes;
* with ``tp > 1`` on one GPU, the allreduces one rank would make (``2 * layers + 1`` of ``batch * k * hidden``
  elements) are modelled from :mod:`specverify.comm.cost_model` and added: ``total_ms = verify_ms + allreduce_ms``;
* ``break_even = total_ms(k) / total_ms(1)``: the tokens a cycle must emit for speculation at this k to match
  plain decoding, before draft cost: SGLang's logged accept length (accepted drafts + the bonus token);
  ``break_even_accepted_drafts = break_even - 1`` the same in accepted draft tokens.

Providers: ``reference`` (the torch path), ``specverify`` (our kernels where they exist, the reference elsewhere; the
``pieces`` column says which), ``sglang`` (SGLang's own Triton kernels composed as SGLang composes them, where they
import). All run in one process and one run so ratios hold on a noisy machine. Without a GPU the command runs a
tiny stand-in config through the reference path (and the Triton interpreter) and says that the figures are not
performance figures.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from specverify.benchmarking import git_commit
from specverify.configs import get_config, list_configs, per_rank_shapes, verify_bytes
from specverify.env_report import collect_env
from specverify.forward.model import VerifyModel
from specverify.benchmarking import GpuStateLog
from specverify.forward import step as step_inputs
from specverify.forward.ops import PROVIDERS, provider_ops, specverify_ops
from specverify.graph_pool import VerifyGraphPool
from specverify.output_paths import check_output_paths
from specverify.tree import BatchedDraftTree, DraftTree

log = logging.getLogger("specverify")

CPU_STAND_INS = {"mla": "tiny-mla-moe", "gqa-moe": "tiny-gqa-moe", "gqa": "tiny-gqa"}


# ------------------------------------------------------------------------------------------------------------
# settings


@dataclass
class WallSettings:
    model: str = "kimi-k2"
    tp: int = 8
    batch: int = 1
    context: int = 4096
    draft_tokens: list = field(default_factory=lambda: [1, 2, 3, 4, 6, 8])
    tree: str = "chain"
    layers: int | None = None
    distinct_layers: int | None = None
    impl: list = field(default_factory=lambda: ["reference", "specverify", "sglang"])
    graph: bool = True
    warmup: int = 5
    iters: int = 30
    page_size: int = 64
    breakdown: bool = False
    kernels: bool = False
    switch: bool = False
    seed: int = 0
    json_path: str | None = None
    plot_path: str | None = None
    link: str = "nvlink"
    experts_quant: str | None = None


def make_tree(spec: str, k: int) -> DraftTree:
    """``chain`` or ``topk:K`` (the first k nodes, breadth first, of a K-ary tree)."""
    if spec == "chain":
        return DraftTree.chain(k)
    if spec.startswith("topk:"):
        try:
            branching = int(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"--tree topk:K needs an integer K, got {spec!r}") from None
        return DraftTree.topk_of_size(branching, k)
    raise ValueError(f"--tree must be 'chain' or 'topk:K', got {spec!r}")


def tp_problem(cfg, tp: int) -> str | None:
    """Why ``tp`` cannot shard ``cfg`` the way :class:`specverify.forward.model.VerifyModel` shards it, or None.

    The rules of :func:`specverify.configs.per_rank_shapes`: ``tp`` divides the attention heads, the dense and MoE
    intermediate sizes and the shared experts' (routed experts are not split: every rank holds a slice of each);
    GQA KV heads are split when there are at least ``tp`` of them (``tp`` divides them) and replicated otherwise,
    which needs ``tp`` to be a multiple of them so that each rank's query heads share one KV head.
    """
    try:
        per_rank_shapes(cfg, tp)
    except ValueError as exc:
        return str(exc).split(";")[0]
    kvh = cfg.num_key_value_heads
    if cfg.attention == "gqa" and 0 < kvh < tp and tp % kvh:
        return f"num_key_value_heads = {kvh} is fewer than tp {tp} (replicated) but does not divide it"
    return None


def valid_tp_values(cfg) -> list[int]:
    """The tensor-parallel degrees that shard ``cfg`` (:func:`tp_problem`), 1 .. the number of attention heads."""
    return [t for t in range(1, cfg.num_attention_heads + 1) if tp_problem(cfg, t) is None]


def _check_tp(cfg, tp: int) -> None:
    """``ValueError`` naming the model, its sharded sizes and the valid ``--tp`` values when ``tp`` cannot shard it."""
    problem = tp_problem(cfg, tp)
    if problem is None:
        return
    sizes = [f"{cfg.num_attention_heads} attention heads"]
    if cfg.attention == "gqa":
        sizes.append(f"{cfg.num_key_value_heads} KV heads")
    if cfg.intermediate_size:
        sizes.append(f"intermediate_size {cfg.intermediate_size}")
    if cfg.is_moe:
        sizes.append(f"moe_intermediate_size {cfg.moe_intermediate_size}")
    valid = ", ".join(str(t) for t in valid_tp_values(cfg))
    raise ValueError(f"--tp {tp} cannot shard {cfg.name} ({', '.join(sizes)}): {problem}; valid --tp values for "
                     f"{cfg.name}: {valid}")


def _parse_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"draft lengths must be >= 1, got {text!r}")
    return values


# ------------------------------------------------------------------------------------------------------------
# measurement


def measure_copy_bandwidth(device) -> float:
    """Bytes per second of a device-to-device copy, counting the bytes read and written (NaN without a GPU)."""
    if device.type != "cuda":
        return float("nan")
    from specverify.benchmarking import copy_bandwidth_gbps

    return copy_bandwidth_gbps() * 1e9


def _quantile(values, q):
    s = sorted(values)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _time_calls(fn, warmup: int, iters: int, device) -> list[float]:
    """Milliseconds per call of ``fn`` (CUDA events per call on GPU; wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    out = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        out = [s.elapsed_time(e) for s, e in events]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


class VerifyCase:
    """Static buffers and the pass for one (batch, k): draft tokens, tree tensors, prefix lengths."""

    def __init__(self, model, caches, page_table, batch, k, context, tree_spec, seed):
        self.model, self.caches, self.page_table = model, caches, page_table
        dev = model.device
        self.tree = make_tree(tree_spec, k)
        bt = BatchedDraftTree.repeat(self.tree, batch)
        g = torch.Generator(device="cpu").manual_seed(seed + k)
        self.draft = torch.randint(0, model.config.vocab_size, (batch, k), generator=g).to(dev)
        self.parents = bt.parents.to(dev)
        self.depth = bt.depth.to(dev)
        self.mask = None if self.tree.is_chain else bt.packed_mask.to(dev)
        self.prefix = torch.full((batch,), context, dtype=torch.int32, device=dev)
        self.flat_caches = [c for layer in caches for c in layer]
        self.validate = True

    def pass_inputs(self):
        """(caches, flat caches, page table, tree mask) the pass runs on: the case's own buffers."""
        return self.caches, self.flat_caches, self.page_table, self.mask

    def check_logits(self, layers: int = 2):
        """Logits of a pass through the first ``layers`` layers only: deep enough to exercise every piece, shallow
        enough that bf16 rounding cannot flip MoE routing decisions across many layers and hide a real error."""
        m = self.model
        saved = m.num_layers
        m.num_layers = min(layers, saved)
        try:
            caches, _, table, mask = self.pass_inputs()
            positions = self.prefix.long().unsqueeze(1) + self.depth.long()
            return m.forward(self.draft, positions, caches, table, self.prefix, mask).float()
        finally:
            m.num_layers = saved

    def run(self):
        m = self.model
        caches, flat, table, mask = self.pass_inputs()
        nodes, acc, toks, self.logits = m.verify(self.draft, self.parents, self.depth, mask, caches, table,
                                                 self.prefix, self.tree.max_depth, validate=self.validate)
        self.validate = False  # checked once; the timed passes carry no host synchronisation
        with m.section("kv_compaction"):
            m.ops.compact_kv(flat, table, self.prefix, nodes, acc)
        return toks, acc


class StepCase(VerifyCase):
    """:class:`VerifyCase` as SGLang's whole-step plugin runs it (``--impl sglang-step``): the static inputs are
    what SGLang hands the step (the Triton backend's CSR prefix rows in token slots, ``out_cache_loc``, the EAGLE
    tree links), and every pass first turns them into our inputs with the adapter's own functions
    (:func:`~specverify.forward.step.page_table_from_metadata`, :func:`~specverify.forward.step.tree_mask_from_links`)
    over the cache viewed as token slots, as :class:`specverify.integrations.sglang_step.VerifyStep` does. The
    acceptance and KV compaction after the forward are ours here (SGLang runs its own), so the pass does the same
    work as the other providers' passes."""

    def __init__(self, model, caches, page_table, batch, k, context, tree_spec, seed, page_size):
        super().__init__(model, caches, page_table, batch, k, context, tree_spec, seed)
        self.kv_indptr, self.kv_indices, self.out_cache_loc = step_inputs.csr_metadata(page_table, self.prefix, k,
                                                                                       page_size)
        self.slot_caches = step_inputs.token_slot_caches(caches)
        self.flat_slot_caches = [c for layer in self.slot_caches for c in layer]
        self.width = step_inputs.slot_table_width(context + k)
        _, nt, ns = self.tree.retrieve_links()
        self.next_token = nt.expand(batch, k).contiguous().to(model.device)
        self.next_sibling = ns.expand(batch, k).contiguous().to(model.device)

    def pass_inputs(self):
        """The token-slot caches, and the page table and tree mask the adapter makes from SGLang's inputs (inside
        the pass: its cost is the ``step_inputs`` section)."""
        with self.model.section("step_inputs"):
            table = step_inputs.page_table_from_metadata(self.kv_indptr, self.kv_indices, self.out_cache_loc,
                                                         self.prefix, self.tree.num_nodes, self.width)
            mask = None if self.tree.is_chain else step_inputs.tree_mask_from_links(self.next_token,
                                                                                    self.next_sibling)
        return self.slot_caches, self.flat_slot_caches, table, mask


class SectionTimer:
    """Records CUDA events at section boundaries of one pass (no host sync inside); sums them afterwards.

    With ``external=True`` the events become event-record nodes when the pass is captured in a CUDA graph, so the
    components are timed inside graph replay, where launch gaps are what a served pass really has.
    """

    def __init__(self, external: bool = False):
        self.external = external
        self.records = []
        self.stack = []

    def event(self):
        if self.external:
            return torch.cuda.Event(enable_timing=True, external=True)
        return torch.cuda.Event(enable_timing=True)

    def __call__(self, name, phase):
        ev = self.event()
        ev.record()
        if phase == "start":
            self.stack.append((name, ev))
        else:
            start_name, start = self.stack.pop()
            self.records.append((start_name, start, ev))

    def totals_ms(self) -> dict:
        torch.cuda.synchronize()
        out: dict = {}
        for name, s, e in self.records:
            out[name] = out.get(name, 0.0) + s.elapsed_time(e)
        return out

    def counts(self) -> dict:
        """Sections recorded per name (a name recurs once per layer)."""
        out: dict = {}
        for name, _, _ in self.records:
            out[name] = out.get(name, 0) + 1
        return out


#: Sections in the calibration that measures what one pair of event nodes adds inside a timed section.
_CALIBRATION_SECTIONS = 64


def _calibration(timer: SectionTimer, probe: torch.Tensor):
    """Record, inside the capture, a run of tiny kernels without events and the same run with each kernel in its
    own section; returns the events that bound the plain run. Read with :func:`_section_overhead_ms`."""
    a, b = timer.event(), timer.event()
    a.record()
    for _ in range(_CALIBRATION_SECTIONS):
        probe.add_(1.0)
    b.record()
    for _ in range(_CALIBRATION_SECTIONS):
        timer("__calibration__", "start")
        probe.add_(1.0)
        timer("__calibration__", "end")
    return a, b


def _section_overhead_ms(totals: dict, plain_events) -> float:
    """ms that one timed section gains from its two event nodes: (sum of the sectioned tiny kernels - the same
    kernels back to back) / count, never negative."""
    plain = plain_events[0].elapsed_time(plain_events[1])
    return max(0.0, (totals.pop("__calibration__") - plain) / _CALIBRATION_SECTIONS)


def breakdown(case: VerifyCase, device, plain_fn, iters: int = 5) -> dict:
    """GPU ms per component of one verify pass, timed inside a CUDA graph of the pass (events as graph nodes),
    median over ``iters`` replays.

    Event-record nodes cost time themselves (about 1.5 us each on the H200, against sections of a few us), so the
    same graph also times 64 tiny kernels back to back and then each in its own section; the difference per section
    (``section_overhead_us``) is subtracted from every section (``components_ms``; ``raw_components_ms`` keeps the
    uncorrected sums). ``pass_ms`` is the pass without section events (``plain_fn``, the provider's own graph),
    ``profiled_pass_ms`` the pass with them, and ``gap`` the relative difference between the components' sum and
    ``pass_ms``. Falls back to eager timing (``mode: eager``, no correction) where events cannot be captured."""
    model = case.model
    per_iter, counts = [], {}
    mode = "graph"
    try:
        timer = SectionTimer(external=True)
        whole_s, whole_e = timer.event(), timer.event()
        probe = torch.zeros(1, device=device)
        graph = torch.cuda.CUDAGraph()
        model.section_hook = timer
        try:
            with torch.cuda.graph(graph):
                plain_events = _calibration(timer, probe)
                whole_s.record()
                case.run()
                whole_e.record()
        finally:
            model.section_hook = None
        counts = timer.counts()
        for _ in range(iters + 1):
            graph.replay()
            totals = timer.totals_ms()
            totals["__overhead__"] = _section_overhead_ms(totals, plain_events)
            totals["__pass__"] = whole_s.elapsed_time(whole_e)
            per_iter.append(totals)
        del graph
    except Exception as exc:  # events as graph nodes unsupported here: time the sections eagerly instead
        log.warning("breakdown inside a CUDA graph failed (%s); timing sections eagerly", exc)
        mode, per_iter, counts = f"eager ({type(exc).__name__})", [], {}
        for _ in range(iters + 1):
            timer = SectionTimer()
            model.section_hook = timer
            try:
                whole_s, whole_e = timer.event(), timer.event()
                whole_s.record()
                case.run()
                whole_e.record()
            finally:
                model.section_hook = None
            totals = timer.totals_ms()
            totals["__pass__"] = whole_s.elapsed_time(whole_e)
            totals["__overhead__"] = 0.0
            per_iter.append(totals)
    per_iter = per_iter[1:]
    names = sorted({n for t in per_iter for n in t})
    med = {n: statistics.median(t.get(n, 0.0) for t in per_iter) for n in names}
    whole = med.pop("__pass__")
    overhead = med.pop("__overhead__")
    comp = {n: max(0.0, v - counts.get(n, 0) * overhead) for n, v in med.items()}
    plain = statistics.median(_time_calls(plain_fn, 2, iters, device))
    total = sum(comp.values())
    return {"mode": mode, "components_ms": comp, "raw_components_ms": med, "section_counts": counts,
            "section_overhead_us": overhead * 1e3, "sum_ms": total, "raw_sum_ms": sum(med.values()),
            "profiled_pass_ms": whole, "pass_ms": plain,
            "gap": abs(total - plain) / plain if plain else float("nan")}


def kernel_profile(plain_fn, layers: int, iters: int = 5) -> dict:
    """Every kernel of one verify pass (``plain_fn``: a graph replay), from the CUDA activity of torch.profiler
    over ``iters`` replays, each its own profiled pass (synchronised between). Per kernel name: launches a pass,
    ``exclusive_us`` a pass (from the later of its start and the previous kernel's end to its end: with PDL a
    kernel starts while its predecessor runs, and that overlap is the predecessor's), the mean exclusive µs a
    launch; per pass: ``span_us`` (first start to last end), ``busy_us`` (the union of kernel intervals) and
    ``idle_us`` (span - busy: the bubbles between kernels). Medians over the passes; ``per_layer`` divides the
    launch counts by ``layers``."""
    from torch.profiler import ProfilerActivity, profile

    plain_fn()
    torch.cuda.synchronize()
    passes = []
    for _ in range(iters):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            plain_fn()
            torch.cuda.synchronize()
        ev = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
        if ev:
            passes.append(ev)
    if not passes:
        return {"error": "the profiler saw no CUDA kernels (CUPTI unavailable?)"}
    return kernel_table(passes, layers)


def kernel_table(passes: list, layers: int) -> dict:
    """:func:`kernel_profile`'s figures from ``passes``: one list per pass of (start_us, end_us, name), sorted by
    start (one stream: kernels run in launch order)."""
    per_name: dict = {}
    spans, busys, counts = [], [], []
    for ev in passes:
        busy, prev_end, seen = 0.0, ev[0][0], {}
        for start, end, name in ev:
            excl = max(0.0, end - max(start, prev_end))
            busy += excl
            prev_end = max(prev_end, end)
            c = seen.setdefault(name, [0, 0.0])
            c[0] += 1
            c[1] += excl
        for name, (n, t) in seen.items():
            per_name.setdefault(name, []).append((n, t))
        spans.append(prev_end - ev[0][0])
        busys.append(busy)
        counts.append(len(ev))
    rows = []
    for name, vals in per_name.items():
        n = statistics.median(v[0] for v in vals)
        t = statistics.median(v[1] for v in vals)
        rows.append({"name": name[:120], "launches": n, "per_layer": n / layers, "exclusive_us": t,
                     "mean_us": t / n if n else 0.0})
    rows.sort(key=lambda r: -r["exclusive_us"])
    span, busy = statistics.median(spans), statistics.median(busys)
    return {"passes": len(passes), "span_us": span, "busy_us": busy, "idle_us": span - busy,
            "kernels_per_pass": statistics.median(counts), "kernels_per_layer": statistics.median(counts) / layers,
            "kernels": rows}


def section_floors(b: dict, vb, bandwidth: float, layers: int) -> dict:
    """Adds to a :func:`breakdown` result each section's bytes (from :func:`~specverify.configs.verify_bytes`), its
    floor (bytes / the run's copy bandwidth, ms) and its efficiency (floor / measured ms): ``section_bytes``,
    ``section_floor_ms``, ``section_efficiency``. Sections: attention = attention weights + KV cache read,
    moe_route = router weights, experts = routed experts (+ the shared expert when no ``shared_expert`` section
    times it apart), moe_block = router + routed + shared experts (the one-launch MoE block), dense_mlp, shared_expert, lm_head; the rest (norms, acceptance, compaction, embedding rows)
    move almost no bytes and get 0. Also ``graph_nodes_per_layer`` where ``graph_nodes`` is known. Returns ``b``."""
    comp = b["components_ms"]
    shared_apart = "shared_expert" in comp
    by = {"attention": vb.attention_weights + vb.kv_cache, "moe_route": vb.router,
          "experts": vb.routed_experts + (0.0 if shared_apart else vb.shared_experts),
          "shared_expert": vb.shared_experts if shared_apart else 0.0, "dense_mlp": vb.dense_mlp,
          "lm_head": vb.lm_head, "moe_block": vb.router + vb.routed_experts + vb.shared_experts}
    sb = {n: float(by.get(n, 0.0)) for n in comp}
    ok = bandwidth == bandwidth and bandwidth > 0
    fl = {n: v / bandwidth * 1e3 if ok else float("nan") for n, v in sb.items()}
    b["section_bytes"] = sb
    b["section_floor_ms"] = fl
    b["section_efficiency"] = {n: fl[n] / comp[n] if comp[n] > 0 and sb[n] > 0 else float("nan") for n in comp}
    if b.get("graph_nodes"):
        b["graph_nodes_per_layer"] = b["graph_nodes"] / layers
    return b


# ------------------------------------------------------------------------------------------------------------
# allreduce model


def modelled_allreduce_ms(s: WallSettings, cfg, layers: int, k: int) -> tuple[float, str]:
    if s.tp == 1:
        return 0.0, "none (tp 1)"
    count = 2 * layers + 1
    nbytes = s.batch * k * cfg.hidden_size * 2
    try:
        from specverify.comm.cost_model import allreduce_cost_us, source

        per = allreduce_cost_us(nbytes, s.tp, link=s.link)
        src = source() if callable(source) else str(source)
    except Exception as exc:  # cost model missing: say so, model nothing
        return 0.0, f"not modelled ({exc})"
    return count * per / 1e3, f"{count} x {nbytes} B modelled: {src}"


# ------------------------------------------------------------------------------------------------------------
# the run


def experts_quant_note(model) -> str:
    """What ``VerifyModel(experts_quant=...)`` stored and how its MoE layers run (the table's note)."""
    moe = next(w for w in model._sets.values() if not w["dense"])
    q = moe["quant"]
    if q.format == "int4":
        layout = "row quads" if q.layout == "quads" else "rows"
        what = f"routed experts int4 (group {q.group_size}, bf16 scales, {layout})"
    else:
        what = f"routed experts fp8 ({q.block_shape[0]} x {q.block_shape[1]} blocks, fp32 scales)"
        if tuple(q.block_shape) != (128, 128):
            what += (f": I = {moe['w13'].shape[1] // 2} is no multiple of 128, so the block rows shrink to stay all "
                     "gate or all up (the floor counts 128 x 128 scales; they are under 0.1% of the bytes either way)")
    if "quant_shared" in moe:
        what += "; the shared expert stacked with them, fp8 too"
    elif moe.get("shared_gate_up") is not None:
        from specverify.forward import model as fm
        what += ("; the shared expert unquantised, in the stream experts' two launches with int4 quads (up to 8 "
                 "tokens; else two matmuls beside the experts)" if fm.SHARED_IN_EXPERTS else
                 "; the shared expert unquantised, apart (two matmuls and an add)")
    return (f"experts: {what}. The pieces line's one-launch MoE block and fused shared expert do not apply: "
            "quantised MoE layers run the router, the routing and the expert kernels at every k")


def _auto_distinct_layers(cfg, s, device, layers) -> int:
    """The most weight sets that fit in 45% of free GPU memory (at least 1); all layers on CPU."""
    if device.type != "cuda":
        return layers
    from specverify.configs import per_rank_shapes

    shapes = per_rank_shapes(cfg, s.tp)
    e = cfg.n_routed_experts
    per_layer = verify_bytes(cfg, s.tp, 1, 0, 1, distinct_experts=e, num_layers=1,
                             experts_quant=s.experts_quant).total
    fixed = (shapes.vocab_size * cfg.hidden_size * 2) * 2
    if s.experts_quant is not None:  # a set is drawn in bf16, then quantised: room for one bf16 set at a time
        fixed += verify_bytes(cfg, s.tp, 1, 0, 1, distinct_experts=e, num_layers=1).total
    free, _ = torch.cuda.mem_get_info(device)
    n = int((0.45 * free - fixed) // max(per_layer, 1))
    return max(1, min(layers, n))


def _cpu_changes(s: WallSettings) -> dict:
    """The settings a CPU run changes, and to what (a short, eager, one-rank run of the tiny stand-in)."""
    return {"tp": 1, "graph": False, "page_size": min(s.page_size, 16), "warmup": min(s.warmup, 1),
            "iters": min(s.iters, 3)}


def _flag_value(v) -> str:
    return ("on" if v else "off") if isinstance(v, bool) else str(v)


def cpu_notes(s: WallSettings) -> list[str]:
    """One note per flag a CPU run changes or ignores (the model, context and layers are noted with the stand-in)."""
    why = {"tp": "one rank of the stand-in; no allreduce modelled, so --link is unused",
           "graph": "CUDA graphs need a GPU; timing eager passes",
           "page_size": "small KV pages on the CPU",
           "warmup": "CPU figures are not performance figures",
           "iters": "CPU figures are not performance figures"}
    notes = []
    for name, new in _cpu_changes(s).items():
        old = getattr(s, name)
        if old != new:
            flag = "--" + name.replace("_", "-")
            notes.append(f"no GPU: {flag} {_flag_value(old)} -> {_flag_value(new)} ({why[name]})")
    if s.breakdown:
        notes.append("no GPU: --breakdown needs CUDA events; ignored")
    if s.kernels:
        notes.append("no GPU: --kernels needs CUDA kernel activity; ignored")
    if s.switch:
        notes.append("no GPU: --switch needs CUDA-graph replay; ignored")
    return notes


#: verify-wall's providers: the op tables of :data:`specverify.forward.ops.PROVIDERS`, and ``sglang-step``.
WALL_PROVIDERS = PROVIDERS + ("sglang-step",)


def distinct_routed(ids: torch.Tensor, top_k: int) -> int:
    """The distinct experts among the first ``top_k`` columns of routing ids ``[M, >= top_k]`` (a shared slot after
    them left out; negative ids, rows routed nowhere, not counted)."""
    routed = ids[:, :top_k]
    return int(routed[routed >= 0].unique().numel())


def routed_distinct_experts(model, run) -> float | None:
    """The mean over MoE layers of the distinct routed experts one pass of ``run()`` chose (its shared slot left
    out), from one eager call with the model's routing slots recorded: the ids ``route`` / ``route_shared`` return,
    and for ``moe_block`` (which returns no ids) the reference routing of the block's own inputs (fp32 logits, as
    the block routes). None when the pass routed nothing. Runs outside CUDA-graph capture (the slots are wrapped
    for the call and restored)."""
    from specverify.forward.ops import _route_with_config  # the reference routing of a layer's RouteParams

    ops = model.ops
    counts: list[int] = []

    def wrap_route(real):
        def recorded(logits, p, *rest):
            ids, weights = real(logits, p, *rest)
            counts.append(distinct_routed(ids, p.num_experts_per_tok))
            return ids, weights
        return recorded

    def wrap_block(real):
        def recorded(hidden, router, p, *rest):
            ids, _ = _route_with_config(hidden.float() @ router.float().t(), p)
            counts.append(distinct_routed(ids, p.num_experts_per_tok))
            return real(hidden, router, p, *rest)
        return recorded

    saved = {name: getattr(ops, name) for name in ("route", "route_shared", "moe_block")}
    try:
        for name, wrap in (("route", wrap_route), ("route_shared", wrap_route), ("moe_block", wrap_block)):
            if saved[name] is not None:
                setattr(ops, name, wrap(saved[name]))
        run()
    finally:
        for name, fn in saved.items():
            setattr(ops, name, fn)
    return sum(counts) / len(counts) if counts else None


def _wall_ops(provider: str, model, max_position: int):
    """(Ops, note) of a verify-wall provider. ``sglang-step``: specverify's op table as SGLang's whole-step plugin
    sets it up (:func:`specverify.forward.step.model_ops`: RoPE read from a rotary table, here the theta RoPE as
    a table in the halves layout so its logits compare with the other providers'; the model's softmax scale)."""
    if provider != "sglang-step":
        return provider_ops(provider, model)
    cfg = model.config
    if cfg.attention != "mla":
        raise RuntimeError(f"the SGLang whole step serves DeepseekV3ForCausalLM (MLA) models; {cfg.name} is "
                           f"{cfg.attention}")
    ops, note = specverify_ops(model)
    table = step_inputs.rope_table(cfg.rope_theta, cfg.qk_rope_head_dim, max_position, model.device)
    ops = step_inputs.model_ops(ops, table, neox=True,
                                sm_scale=1.0 / math.sqrt(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim))
    ops.pieces["step_inputs"] = "adapter (token-slot page table, tree mask from links)"
    return ops, ("; ".join(x for x in (note, "the SGLang step's inputs adapted each pass; acceptance and KV "
                                       "compaction are ours (SGLang runs its own)") if x))


def run_verify_wall(s: WallSettings, progress=None) -> dict:
    """Run the whole measurement; returns {"rows": [...], "meta": {...}, "breakdown": {...}}."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = get_config(s.model)
    notes = []
    context, layers = s.context, s.layers
    if device.type == "cpu":
        notes.append("no CUDA device: CPU figures are not performance figures (no bandwidth, floor or efficiency "
                     "either; break-even ratios of CPU times, even below 1, mean nothing)")
        if not cfg.name.startswith("tiny-"):
            kind = "mla" if cfg.attention == "mla" else ("gqa-moe" if cfg.is_moe else "gqa")
            notes.append(f"running the tiny stand-in {CPU_STAND_INS[kind]!r} for {cfg.name!r} on the CPU")
            cfg = get_config(CPU_STAND_INS[kind])
            if context > 64:
                notes.append(f"--context {context} lowered to 64 for the stand-in")
                context = 64
            if layers is not None:
                notes.append(f"--layers {layers} ignored: the stand-in has {cfg.num_hidden_layers}")
            layers = None
        notes += cpu_notes(s)
        s = dataclasses.replace(s, **_cpu_changes(s), breakdown=False, kernels=False, switch=False)
    elif s.switch and not s.graph:
        notes.append("--switch times CUDA-graph replays and needs --graph on; ignored")
    tp = s.tp
    layers = cfg.num_hidden_layers if layers is None else layers
    if s.distinct_layers is not None and s.distinct_layers > layers:
        notes.append(f"--distinct-layers {s.distinct_layers} -> {layers}: the run has {layers} layers")
    distinct = min(s.distinct_layers or _auto_distinct_layers(cfg, s, device, layers), layers)
    dtype = torch.bfloat16  # the kernels' dtype, on the CPU too
    torch.manual_seed(s.seed)
    model = VerifyModel(cfg, tp=tp, rank=0, num_layers=layers, distinct_layers=distinct, dtype=dtype,
                        device=device, seed=s.seed, experts_quant=s.experts_quant)
    if s.experts_quant is not None:
        notes.append(experts_quant_note(model))
    ks = sorted(set(s.draft_tokens) | {1})
    max_k = max(ks)
    per = -(-(context + max_k) // s.page_size)
    num_pages = s.batch * per + 1
    caches = model.allocate_kv(num_pages, s.page_size)
    for layer in caches:
        for c in layer:
            c.normal_()  # never time on zeros
    g = torch.Generator(device="cpu").manual_seed(s.seed)
    page_table = torch.randperm(num_pages, generator=g)[: s.batch * per].view(s.batch, per).to(torch.int32)
    page_table = page_table.to(device)
    gpu_log = GpuStateLog(device)  # clocks / power / throttling per provider (nothing without nvidia-smi)
    gpu_log.mark("copy bandwidth")
    bandwidth = measure_copy_bandwidth(device)
    env = collect_env()
    commit = git_commit(__file__)
    commit = None if commit == "?" else commit
    meta = {"model": cfg.name, "requested_model": s.model, "tp": tp, "batch": s.batch, "context": context,
            "layers": layers, "distinct_layers": distinct, "tree": s.tree, "graph": s.graph,
            "experts_quant": s.experts_quant,
            "page_size": s.page_size, "copy_bandwidth_gbps": bandwidth / 1e9, "notes": notes,
            "weight_bytes": model.weight_bytes(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "commit": commit, "gpu": env.get("gpu"), "versions": {k: env.get(k) for k in (
                "specverify", "torch", "triton", "cuda_runtime", "cupy", "nccl")}}
    rows, breakdowns, kernel_profiles = [], {}, {}
    ref_logits: dict = {}  # k -> logits of the first provider, the correctness yardstick of the others
    total_steps = len(s.impl) * len(ks)
    step = 0
    try:
        for n, provider in enumerate(s.impl):
            repeat = s.impl[:n].count(provider)
            gpu_log.mark(provider if s.impl.count(provider) == 1 else f"{provider} #{repeat + 1}")
            try:
                ops, note = _wall_ops(provider, model, context + max_k)
            except Exception as exc:
                notes.append(f"provider {provider!r} skipped: {exc}")
                step += len(ks)
                if progress:
                    progress(step, total_steps, f"{provider}: skipped")
                continue
            if note:
                notes.append(f"{provider}: {note}")
            if ops.pieces.get("incomplete"):
                # a piece the peer runs for this pass could not be had and our reference stands in: timing that mix
                # would print a total that is neither the peer's nor ours, so the provider is skipped, saying why
                notes.append(f"{provider}: not SGLang's whole pass ({ops.pieces['incomplete']}); no total "
                             "(provider skipped)")
                step += len(ks)
                if progress:
                    progress(step, total_steps, f"{provider}: skipped (incomplete)")
                continue
            model.ops = ops
            results = {}
            routed: dict = {}
            cases: dict = {}

            def make_inputs(bucket, k):
                if provider == "sglang-step":
                    case = StepCase(model, caches, page_table[:bucket], bucket, k, context, s.tree, s.seed, s.page_size)
                else:
                    case = VerifyCase(model, caches, page_table[:bucket], bucket, k, context, s.tree, s.seed)
                cases[k] = case
                return {"draft": case.draft, "parents": case.parents, "depth": case.depth, "prefix": case.prefix}

            def forward(inputs, k):  # the inputs are the case's own buffers
                return cases[k].run()

            use_graphs = s.graph and device.type == "cuda"
            pool = VerifyGraphPool(forward, make_inputs, batch_buckets=[s.batch], draft_lengths=ks, capture="lazy",
                                   use_graphs=use_graphs, warmup_iters=2, device=device)
            failed: dict = {}

            def nodes_of(k):
                return next((g.get("node_count") for g in pool.report() if g.get("k") == k), None)

            for k in sorted(ks, reverse=True):  # largest first: smaller graphs reuse its pool memory
                try:
                    pool.static_inputs(s.batch, k)
                except Exception as exc:
                    failed[k] = exc
                    log.exception("verify-wall %s k=%d capture failed", provider, k)
            for k in ks:
                host_us, gpu_us, check, times = float("nan"), float("nan"), float("nan"), []
                try:
                    if k in failed:
                        raise failed[k]
                    case = cases[k]
                    logits = case.check_logits()  # correctness before timing: against the first provider's
                    if k not in ref_logits:
                        ref_logits[k] = logits.clone()
                    else:
                        check = float((logits - ref_logits[k]).norm() / ref_logits[k].norm())
                    if use_graphs:
                        tr = pool.time_replay(s.batch, k, iters=20)
                        host_us, gpu_us = tr["host_us"], tr["gpu_us"]
                    times = _time_calls(lambda: pool.replay(s.batch, k), s.warmup, s.iters, device)
                    try:  # after the timing, one eager pass; a probe that fails leaves the uniform floor only
                        routed[k] = routed_distinct_experts(model, case.run)
                    except Exception as exc:
                        notes.append(f"{provider} k={k}: routed experts not recorded ({type(exc).__name__}: {exc})")
                except Exception as exc:
                    notes.append(f"{provider} k={k} failed: {type(exc).__name__}: {exc}")
                    log.exception("verify-wall %s k=%d failed", provider, k)
                results[k] = (times, host_us, None, check, gpu_us)
                step += 1
                if progress:
                    med = statistics.median(times) if times else float("nan")
                    progress(step, total_steps, f"{provider} k={k}: {med:.3f} ms")
                if s.breakdown and device.type == "cuda" and k in (1, 4) and times:
                    b = breakdown(cases[k], device, lambda: pool.replay(s.batch, k))
                    b["graph_nodes"] = nodes_of(k)
                    breakdowns[f"{provider}/k={k}"] = section_floors(
                        b, verify_bytes(cfg, tp, k, context, s.batch, num_layers=layers,
                                        experts_quant=s.experts_quant), bandwidth, layers)
                if s.kernels and device.type == "cuda" and k in (1, 4) and times:
                    kernel_profiles[f"{provider}/k={k}"] = kernel_profile(lambda: pool.replay(s.batch, k), layers)
            if use_graphs:
                meta.setdefault("graph_pools", {})[provider] = {
                    "graphs": [g.as_dict() if hasattr(g, "as_dict") else g for g in pool.report()],
                    "pool_bytes": pool.pool_bytes(), "largest_graph_bytes": pool.largest_graph_bytes()}
            if s.switch and use_graphs and not failed:
                # every k appears once per round, in a new order each round (seeded), so k changes on every pass
                rng = __import__("random").Random(s.seed)
                order = []
                for _ in range(8):
                    perm = list(ks)
                    rng.shuffle(perm)
                    if order and perm[0] == order[-1]:
                        perm.reverse()
                    order += perm
                ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in order]
                for kk, (a, b) in zip(order, ev):
                    a.record()
                    pool.replay(s.batch, kk)
                    b.record()
                torch.cuda.synchronize()
                sw: dict = {}
                for kk, (a, b) in zip(order, ev):
                    sw.setdefault(kk, []).append(a.elapsed_time(b))
                for k in ks:
                    times, host_us, _, check, gpu_us = results[k]
                    results[k] = (times, host_us, statistics.median(sw[k]), check, gpu_us)
            nodes = {k: nodes_of(k) for k in ks} if use_graphs else {}
            pool.invalidate()
            del pool, cases
            decode = statistics.median(results[1][0]) if results.get(1) and results[1][0] else float("nan")
            decode_ar, _ = modelled_allreduce_ms(s, cfg, layers, 1)
            for k in ks:
                res = results[k]
                times, host_us, switch_ms, check, gpu_us = res
                vb = verify_bytes(cfg, tp, k, context, s.batch, num_layers=layers, experts_quant=s.experts_quant)
                floor_ms = vb.total / bandwidth * 1e3 if bandwidth == bandwidth else float("nan")
                med = statistics.median(times) if times else float("nan")
                d_routed = routed.get(k)
                if d_routed is not None:
                    vb_routed = verify_bytes(cfg, tp, k, context, s.batch, distinct_experts=d_routed,
                                             num_layers=layers, experts_quant=s.experts_quant)
                    floor_routed = vb_routed.total / bandwidth * 1e3 if bandwidth == bandwidth else float("nan")
                elif vb.distinct_experts_per_layer == 0:  # no MoE layer: nothing routed, the one floor
                    floor_routed = floor_ms
                else:  # the probe failed or saw no routing (a note says why): no routed floor
                    floor_routed = float("nan")
                ar_ms, ar_src = modelled_allreduce_ms(s, cfg, layers, k)
                total = med + ar_ms
                rows.append({
                    "provider": provider, "k": k, "tree": s.tree if k > 1 else "decode",
                    "verify_ms_median": med, "verify_ms_p20": _quantile(times, 0.2),
                    "verify_ms_p80": _quantile(times, 0.8), "decode_ms": decode,
                    "host_launch_us": host_us, "gpu_pass_us_back_to_back": gpu_us,
                    "launch_bound": (host_us > gpu_us) if host_us == host_us and gpu_us == gpu_us else None,
                    "switch_ms_median": switch_ms,
                    "bytes": vb.total, "bytes_by_component": vb.as_dict(), "floor_ms": floor_ms,
                    "efficiency": floor_ms / med if med == med and med > 0 else float("nan"),
                    "overhead_ms": med - floor_ms, "distinct_experts_modelled": vb.distinct_experts_per_layer,
                    "distinct_experts_routed": d_routed, "floor_ms_routed": floor_routed,
                    "efficiency_routed": floor_routed / med if med == med and med > 0 else float("nan"),
                    "allreduce_ms_modelled": ar_ms, "allreduce_source": ar_src,
                    "total_ms": total, "break_even": total / (decode + decode_ar) if decode == decode else float("nan"),
                    "break_even_accepted_drafts": (total / (decode + decode_ar) - 1.0) if decode == decode
                    else float("nan"),
                    "pieces": dict(ops.pieces), "iters": len(times), "logits_rel_err_vs_first": check,
                    "graph_nodes": nodes.get(k),
                })
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if s.json_path:  # after every provider, so a run stopped part-way still leaves its figures
                try:
                    _write_json({"rows": rows, "meta": meta, "breakdown": breakdowns,
                                 "kernel_profiles": kernel_profiles, "partial": True}, s.json_path)
                except OSError as exc:  # the path was checked up front; keep measuring, the final write reports it
                    log.warning("verify-wall: partial --json write to %s failed: %s", s.json_path, exc)
    finally:
        gpu_log.close()
    if gpu_log.available:
        meta["gpu_state"] = gpu_log.summary()
    for r in rows:
        r.update({k2: meta[k2] for k2 in ("model", "tp", "batch", "context", "layers", "distinct_layers", "graph",
                                          "gpu", "commit", "date")})
        r["versions"] = meta["versions"]
    return {"rows": rows, "meta": meta, "breakdown": breakdowns, "kernel_profiles": kernel_profiles}


# ------------------------------------------------------------------------------------------------------------
# output


def format_table(result: dict) -> str:
    rows = result["rows"]
    meta = result["meta"]
    head = (f"verify wall: {meta['model']} tp={meta['tp']} batch={meta['batch']} context={meta['context']} "
            f"layers={meta['layers']} (weight sets {meta['distinct_layers']}) tree={meta['tree']} "
            f"graph={'on' if meta['graph'] else 'off'}"
            f"{' experts=' + meta['experts_quant'] if meta.get('experts_quant') else ''} on {meta['gpu']}; "
            f"copy bandwidth "
            f"{meta['copy_bandwidth_gbps']:.0f} GB/s")
    cols = ["provider", "k", "verify ms", "p20", "p80", "floor ms", "eff", "eff rt", "overhead", "AR ms", "total",
            "break-even", "host us", "nodes", "rel err"]
    lines = [head, "  ".join(f"{c:>10}" for c in cols)]
    for r in rows:
        bound = "*" if r.get("launch_bound") else ""
        vals = [r["provider"], r["k"], f"{r['verify_ms_median']:.3f}", f"{r['verify_ms_p20']:.3f}",
                f"{r['verify_ms_p80']:.3f}", f"{r['floor_ms']:.3f}", f"{r['efficiency']:.2f}",
                f"{r.get('efficiency_routed', float('nan')):.2f}", f"{r['overhead_ms']:.3f}",
                f"{r['allreduce_ms_modelled']:.3f}", f"{r['total_ms']:.3f}",
                f"{r['break_even']:.2f}", f"{r['host_launch_us']:.0f}{bound}",
                "-" if r.get("graph_nodes") is None else r["graph_nodes"], f"{r['logits_rel_err_vs_first']:.1e}"]
        lines.append("  ".join(f"{str(v):>10}" for v in vals))
    pieces = {}
    for r in rows:
        pieces.setdefault(r["provider"], r["pieces"])
    for prov, p in pieces.items():
        lines.append(f"{prov} pieces: " + ", ".join(f"{k}={v}" for k, v in p.items()))
    ar = {r["allreduce_source"] for r in rows}
    lines.append("allreduce: " + "; ".join(sorted(ar)))
    if any(r.get("switch_ms_median") for r in rows):
        lines.append("switch mode (k alternates every pass) vs fixed k, median ms:")
        for r in rows:
            if r.get("switch_ms_median"):
                lines.append(f"  {r['provider']} k={r['k']}: fixed {r['verify_ms_median']:.3f} switch "
                             f"{r['switch_ms_median']:.3f} ({r['switch_ms_median'] / r['verify_ms_median']:.3f}x)")
    if any(r.get("launch_bound") for r in rows):
        lines.append("* host launch time of one replay exceeds the pass's GPU time: launch-bound")
    for name, b in result.get("breakdown", {}).items():
        eff = b.get("section_efficiency", {})
        floor = b.get("section_floor_ms", {})

        def part(n, v, eff=eff, floor=floor):
            e = eff.get(n, float("nan"))
            return f"{n}={v:.3f}" + (f" (floor {floor[n]:.3f}, {e * 100:.0f}%)" if e == e else "")

        comp = ", ".join(part(n, v) for n, v in sorted(b["components_ms"].items(), key=lambda kv: -kv[1]))
        nodes = b.get("graph_nodes")
        per = f"; {nodes} graph nodes, {b['graph_nodes_per_layer']:.1f} a layer" if nodes else ""
        lines.append(f"breakdown {name} ({b['mode']}): pass {b['pass_ms']:.3f} ms, components sum "
                     f"{b['sum_ms']:.3f} ms (gap {b['gap'] * 100:.1f}%; uncorrected {b['raw_sum_ms']:.3f} ms, "
                     f"{b['section_overhead_us']:.2f} us of event nodes per section subtracted{per}): {comp}")
    for name, kp in result.get("kernel_profiles", {}).items():
        if "error" in kp:
            lines.append(f"kernels {name}: {kp['error']}")
            continue
        top = "; ".join(f"{r['name'][:48]} {r['per_layer']:.2f}/layer {r['exclusive_us']:.0f} us ({r['mean_us']:.2f})"
                        for r in kp["kernels"][:12])
        lines.append(f"kernels {name}: {kp['kernels_per_pass']:.0f} a pass ({kp['kernels_per_layer']:.1f} a layer), "
                     f"span {kp['span_us']:.0f} us, busy {kp['busy_us']:.0f}, idle {kp['idle_us']:.0f}; by exclusive "
                     f"time (launches a layer, us a pass, mean us): {top}")
    for name, g in result["meta"].get("gpu_state", {}).items():
        if g.get("samples"):
            f = {key: "n/a" if v is None else f"{v:.0f}" for key, v in g.items() if key != "throttle_reasons"}
            lines.append(f"gpu state {name}: SM clock median {f['sm_mhz_median']} (min {f['sm_mhz_min']}) MHz, "
                         f"memory {f['mem_mhz_median']} MHz, power max {f['power_w_max']} W, {f['temp_c_max']} C, "
                         f"throttle reasons {', '.join(g['throttle_reasons']) or 'none'}")
    lines.append("break-even: total(k) / total(1), before draft cost: the tokens a cycle at k must emit to match "
                 "plain decoding, i.e. the accept length as SGLang logs it (accepted drafts + the bonus token); in "
                 "accepted drafts, break-even - 1 (JSON: break_even, break_even_accepted_drafts)")
    lines.append("rel err: ||logits - first provider's logits|| / ||first provider's logits||, same inputs, "
                 "first 2 layers + LM head")
    for note in meta["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def write_plot(result: dict, path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # the object API, not pyplot: no GUI backend or interactive-shell detection in a headless benchmark
    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    rows = result["rows"]
    for prov in dict.fromkeys(r["provider"] for r in rows):
        rs = [r for r in rows if r["provider"] == prov]
        ax.plot([r["k"] for r in rs], [r["total_ms"] for r in rs], marker="o", label=f"{prov}")
    base = [r for r in rows if r["provider"] == rows[0]["provider"]] if rows else []
    floor = [(r["k"], r["floor_ms"]) for r in base if r["floor_ms"] == r["floor_ms"]]  # no floor (NaN) on a CPU
    if floor:
        ax.plot([k for k, _ in floor], [f for _, f in floor], "k--", label="bytes floor")
    meta = result["meta"]
    ax.set_xticks(sorted({r["k"] for r in rows}))
    ax.set_xlabel("draft tokens per request (k; 1 = decode)")
    ax.set_ylabel("ms per verify pass (per rank)")
    cpu = any("not performance figures" in str(n) for n in meta.get("notes", []))
    ax.set_title(f"verify wall: {meta['model']} tp={meta['tp']} bs={meta['batch']} ctx={meta['context']}"
                 + (" (CPU: not performance figures)" if cpu else ""))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _json_safe(obj):
    """NaN and infinities become null, so the JSON is strict (jq, JavaScript)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _progress_printer():
    def show(step, total, text):
        print(f"[{step}/{total}] {text}", file=sys.stderr, flush=True)
    return show


def _cmd(args) -> int:
    if not torch.cuda.is_available() and "triton" not in sys.modules:
        # no GPU: Triton kernels can only run in the interpreter, which must be chosen before triton is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    tp = args.tp if args.tp is not None else (1 if args.model.startswith("tiny-") else 8)
    s = WallSettings(model=args.model, tp=tp, batch=args.batch, context=args.context,
                     draft_tokens=args.draft_tokens, tree=args.tree, layers=args.layers,
                     distinct_layers=args.distinct_layers, impl=[p for p in args.impl.split(",") if p],
                     graph=args.graph == "on", warmup=args.warmup, iters=args.iters, page_size=args.page_size,
                     breakdown=args.breakdown, kernels=args.kernels, switch=args.switch, seed=args.seed,
                     json_path=args.json, plot_path=args.plot, link=args.link,
                     experts_quant=None if args.experts_quant == "none" else args.experts_quant)
    # every check before any work: a run of many minutes must not end in a traceback at its last step
    try:
        make_tree(s.tree, 2)
        cfg = get_config(s.model)
        unknown = [p for p in s.impl if p not in WALL_PROVIDERS]
        if unknown or not s.impl:
            raise ValueError(f"--impl takes a comma-separated list of {', '.join(WALL_PROVIDERS)}, got {args.impl!r}")
        peers = [p for p in s.impl if p in ("sglang", "sglang-flashinfer")]
        if s.experts_quant is not None and peers:
            raise ValueError(f"--experts-quant {s.experts_quant} runs with --impl specverify, reference and "
                             f"sglang-step ({', '.join(peers)}: SGLang's unquantised fused MoE), got --impl "
                             f"{args.impl}; SGLang's quantised fused MoE is timed by bench/bench_moe.py --quant")
        if s.experts_quant is not None and not cfg.n_routed_experts:
            raise ValueError(f"--experts-quant {s.experts_quant} quantises MoE experts, and {cfg.name} has none; drop "
                             "it or pick a MoE model")
        for name in ("tp", "batch", "context", "iters", "page_size", "layers", "distinct_layers"):
            value = getattr(args, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if args.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
        _check_tp(cfg, s.tp)  # against the model asked for, also on a CPU where a stand-in runs
        check_output_paths({"--json": s.json_path, "--plot": s.plot_path})
        if s.plot_path:
            _check_plot(s.plot_path)
    except ValueError as exc:
        print(f"specverify bench verify-wall: error: {exc}", file=sys.stderr)
        return 2
    result = run_verify_wall(s, progress=_progress_printer())
    print(format_table(result))
    status = 0
    for flag, path, write in (("--json", s.json_path, _write_json), ("--plot", s.plot_path, write_plot)):
        if not path:
            continue
        try:  # checked up front, but the folder can still go away or fill up during the run
            write(result, path)
            print(f"wrote {path}")
        except OSError as exc:
            print(f"specverify bench verify-wall: error: could not write {flag} {path!r}: {exc}", file=sys.stderr)
            status = 1
    if not any(r["iters"] for r in result["rows"]):
        print("specverify bench verify-wall: no provider produced a measurement (see the notes above)",
              file=sys.stderr)
        return 1
    return status


def _write_json(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(_json_safe(result), f, indent=1, default=str, allow_nan=False)


def _check_plot(path: str) -> None:
    """``ValueError`` when ``--plot`` cannot be honoured: matplotlib missing, or a file type it cannot write."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ValueError(f"--plot {path!r} needs matplotlib, which is not installed ({exc}); pip install "
                         "'specverify-kernels[bench]' (or matplotlib), or drop --plot") from None
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    formats = FigureCanvasAgg(Figure()).get_supported_filetypes()
    if suffix and suffix not in formats:
        raise ValueError(f"--plot {path!r}: matplotlib cannot write .{suffix} files; end the path in one of "
                         f"{', '.join('.' + f for f in sorted(formats))} (e.g. .png)")


def register_cli(bench_sub) -> None:
    p = bench_sub.add_parser("verify-wall", help="the verify pass cost per draft length, against the bytes floor",
                             description=__doc__.split("\n\n")[0].replace("``", ""),
                             epilog="Every argument, output paths included, is checked before any work. "
                                    "Without a CUDA GPU the model, context, tp and graph settings give way to a "
                                    "tiny stand-in (tiny-mla-moe for kimi-k2, for example), context 64, tp 1, "
                                    "eager, through the Triton interpreter, with at most 1 warm-up and 3 timed "
                                    "passes and pages of at most 16 tokens (--breakdown and --switch need a GPU); "
                                    "the table notes each such change and says that CPU figures are not "
                                    "performance figures.")
    p.add_argument("--model", default="kimi-k2", help=f"one of {', '.join(list_configs())} (default: kimi-k2)")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel degree; one rank's shapes are run; it must shard the model (divide its "
                        "attention heads and intermediate sizes) (default: 8; 1 for the tiny-* stand-ins)")
    p.add_argument("--batch", type=int, default=1, help="requests per pass (default: 1)")
    p.add_argument("--context", type=int, default=4096, help="prefix tokens per request (default: 4096)")
    p.add_argument("--draft-tokens", type=_parse_ints, default=[1, 2, 3, 4, 6, 8],
                   help="comma-separated k values (tree nodes incl. the last verified token; 1 = decode); sorted, "
                        "duplicates dropped, k = 1 always added as the decode baseline (default: 1,2,3,4,6,8)")
    p.add_argument("--tree", default="chain", help="chain or topk:K (default: chain)")
    p.add_argument("--layers", type=int, default=None, help="layers to run (default: the model's)")
    p.add_argument("--distinct-layers", type=int, default=None,
                   help="weight sets cycled over the layers (default: as many as fit in 45%% of free memory)")
    p.add_argument("--impl", default="reference,specverify,sglang",
                   help="comma-separated providers: reference, specverify, sglang, sglang-flashinfer, sglang-step "
                        "(default: the first three; sglang is skipped with its reason when SGLang's kernels cannot "
                        "be imported, and when a piece SGLang runs for the pass (its decode or extend attention, router, alignment, "
                        "fused MoE) cannot be had: the table then notes \"sglang: not SGLang's whole pass (<piece>: "
                        "<why>); no total\" instead of timing a mix; pieces ours by design (acceptance, KV "
                        "compaction, small ops) are named in the sglang note; sglang-flashinfer is the same pass "
                        "with SGLang's flashinfer MLA attention backend (FlashInfer's MLA wrapper; chains and "
                        "decode, MLA models; needs flashinfer importable); sglang-step is specverify's forward fed as SGLang's whole-step plugin feeds it: CSR "
                        "token-slot metadata and tree links adapted every pass, MLA models only)")
    p.add_argument("--graph", choices=["on", "off"], default="on",
                   help="time CUDA-graph replay (on) or eager launches (default: on)")
    p.add_argument("--warmup", type=int, default=5, help="untimed passes per provider and k (default: 5)")
    p.add_argument("--iters", type=int, default=30, help="timed passes per provider and k (default: 30)")
    p.add_argument("--page-size", type=int, default=64, help="KV cache page size in tokens (default: 64)")
    p.add_argument("--breakdown", action="store_true", help="GPU time per component at k = 1 and 4")
    p.add_argument("--kernels", action="store_true",
                   help="every kernel of the pass at k = 1 and 4 from torch.profiler: launches a layer, exclusive "
                        "time, idle time between kernels")
    p.add_argument("--switch", action="store_true", help="also time replays that change k every pass")
    p.add_argument("--link", choices=["nvlink", "pcie"], default="nvlink",
                   help="link of the modelled tp allreduce (default: nvlink)")
    p.add_argument("--experts-quant", choices=["none", "int4", "fp8"], default="none",
                   help="store the MoE experts as the served checkpoints do: int4 (Kimi-K2.5: routed experts int4, "
                        "group 32; shared expert bf16) or fp8 (DeepSeek-V3, Kimi-K2: 128 x 128 blocks); the floor "
                        "counts their bytes (MoE models; providers specverify, reference, sglang-step) "
                        "(default: none)")
    p.add_argument("--seed", type=int, default=0, help="seed of the dummy weights and inputs (default: 0)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every figure as JSON (after each provider)")
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="plot ms per pass against k, with the floor (needs matplotlib: the [bench] extra)")
    p.set_defaults(func=_cmd)
