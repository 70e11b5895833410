"""The verify-wall breakdown's event-cost correction (specverify.verify_wall), with stand-in events on the CPU; the
routed experts a pass reads, recorded from its routing (tiny MoE model, CPU).

On the GPU the events are CUDA event-record nodes inside the pass's graph; here a fake event returns the elapsed
times a graph replay would, so the arithmetic of the correction is checked without a GPU.
"""
import pytest

from specverify import verify_wall as vw


class _Event:
    """Stands for a recorded CUDA event: a timestamp in ms."""

    def __init__(self, t_ms):
        self.t = t_ms

    def elapsed_time(self, other):
        return other.t - self.t


class _Timer(vw.SectionTimer):
    """A SectionTimer whose events come from a scripted clock instead of CUDA."""

    def __init__(self, times):
        super().__init__()
        self.times = iter(times)

    def event(self):
        return _Scripted(self)

    def totals_ms(self):  # no CUDA synchronise on the CPU
        out = {}
        for name, s, e in self.records:
            out[name] = out.get(name, 0.0) + s.elapsed_time(e)
        return out


class _Scripted(_Event):
    def __init__(self, timer):
        super().__init__(None)
        self.timer = timer

    def record(self):
        self.t = next(self.timer.times)


def test_section_overhead_is_the_sectioned_excess_per_section():
    n = vw._CALIBRATION_SECTIONS
    kernel, overhead = 0.002, 0.0025  # ms: a tiny kernel back to back, and what two event nodes add around it
    plain_a, plain_b = _Event(0.0), _Event(n * kernel)
    totals = {"__calibration__": n * (kernel + overhead), "attention": 1.0}
    got = vw._section_overhead_ms(totals, (plain_a, plain_b))
    assert got == pytest.approx(overhead)
    assert "__calibration__" not in totals and totals["attention"] == 1.0  # the calibration entry is consumed


def test_section_overhead_never_negative():
    n = vw._CALIBRATION_SECTIONS
    totals = {"__calibration__": n * 0.001}
    assert vw._section_overhead_ms(totals, (_Event(0.0), _Event(n * 0.002))) == 0.0


def test_timer_counts_sections_per_name():
    # two layers, each with attention and experts sections: 4 sections, 8 event records
    timer = _Timer([0, 1, 1, 3, 3, 4, 4, 6])
    for _ in range(2):
        for name in ("attention", "experts"):
            timer(name, "start")
            timer(name, "end")
    assert timer.counts() == {"attention": 2, "experts": 2}
    assert timer.totals_ms() == {"attention": 2.0, "experts": 4.0}


def test_calibration_records_a_plain_run_then_one_section_per_kernel():
    import torch

    n = vw._CALIBRATION_SECTIONS
    kernel, overhead = 0.002, 0.0025
    times = [0.0, n * kernel]  # the plain run's bounds
    t = n * kernel
    for _ in range(n):  # each sectioned kernel: start, end
        times += [t, t + kernel + overhead]
        t += kernel + overhead + 0.001  # the gap between sections falls outside every section
    timer = _Timer(times)
    probe = torch.zeros(1)
    plain = vw._calibration(timer, probe)
    assert probe.item() == 2 * n  # the tiny kernel ran once per plain slot and once per section
    assert timer.counts() == {"__calibration__": n}
    assert vw._section_overhead_ms(timer.totals_ms(), plain) == pytest.approx(overhead)


def test_section_floors_put_each_sections_bytes_against_its_time():
    from specverify.configs import verify_bytes

    vb = verify_bytes("kimi-k2", tp=8, tokens=4, context=4096, batch=1)
    comp = {"attention": 3.0, "experts": 6.0, "moe_route": 0.6, "allreduce": 0.5, "lm_head": 0.08, "dense_mlp": 0.04}
    b = vw.section_floors({"components_ms": dict(comp), "graph_nodes": 1220}, vb, 4.0e12, 61)
    bw = 4.0e12
    assert b["section_bytes"]["attention"] == vb.attention_weights + vb.kv_cache
    assert b["section_bytes"]["experts"] == vb.routed_experts + vb.shared_experts  # shared expert fused in
    assert b["section_bytes"]["allreduce"] == 0.0 and b["section_efficiency"]["allreduce"] != \
        b["section_efficiency"]["allreduce"]  # no bytes: no efficiency (NaN)
    assert b["section_floor_ms"]["moe_route"] == pytest.approx(vb.router / bw * 1e3)
    assert b["section_efficiency"]["lm_head"] == pytest.approx(vb.lm_head / bw * 1e3 / 0.08)
    assert sum(b["section_bytes"].values()) == pytest.approx(vb.total)  # every byte of the pass has a section
    assert b["graph_nodes_per_layer"] == pytest.approx(1220 / 61)
    apart = vw.section_floors({"components_ms": dict(comp, shared_expert=0.2)}, vb, bw, 61)
    assert apart["section_bytes"]["experts"] == vb.routed_experts
    assert apart["section_bytes"]["shared_expert"] == vb.shared_experts
    assert "graph_nodes_per_layer" not in apart


def test_kernel_table_gives_overlap_to_the_predecessor_and_counts_bubbles():
    """--kernels: with PDL a kernel starts before its predecessor ends; the overlap is the predecessor's time, a gap
    between two kernels is idle, and the figures are medians over passes."""
    from specverify.verify_wall import kernel_table

    one = [(0.0, 10.0, "gemv"), (8.0, 12.0, "norm"), (15.0, 20.0, "gemv")]  # norm starts 2 us early; a 3 us bubble
    two = [(0.0, 12.0, "gemv"), (12.0, 14.0, "norm"), (14.0, 20.0, "gemv")]
    t = kernel_table([one, two, one], layers=2)
    assert t["passes"] == 3 and t["kernels_per_pass"] == 3 and t["kernels_per_layer"] == 1.5
    assert t["span_us"] == 20.0 and t["busy_us"] == 17.0 and t["idle_us"] == 3.0
    rows = {r["name"]: r for r in t["kernels"]}
    assert rows["gemv"]["launches"] == 2 and rows["gemv"]["exclusive_us"] == 15.0  # 10 + 5 in the median pass
    assert rows["norm"]["exclusive_us"] == 2.0 and rows["norm"]["mean_us"] == 2.0
    assert [r["name"] for r in t["kernels"]] == ["gemv", "norm"]  # by exclusive time


# ---- the routed experts a pass reads (``routed_distinct_experts``) ----------------------------------------------
def _probe_case(ops_name, b, k, device):
    import torch

    from specverify.forward.model import VerifyModel
    from specverify.forward.ops import provider_ops

    model = VerifyModel("tiny-mla-moe", dtype=torch.bfloat16, seed=5, device=device)
    model.ops, _ = provider_ops(ops_name, model)
    caches = model.allocate_kv(b * 4 + 2, 4)
    table = torch.arange(b * 4, dtype=torch.int32, device=device).view(b, 4)
    return model, vw.VerifyCase(model, caches, table, b, k, 5, "chain", seed=3)


@pytest.mark.parametrize("ops_name", ["reference", "specverify"])  # route; the MoE block / route_shared
@pytest.mark.parametrize("b, k", [(1, 1), (1, 2), (2, 3)])
def test_routed_distinct_experts_counts_what_the_routing_chose(ops_name, b, k, device):
    """The probe's count against the routing each path really ran: the ids route / route_shared returned, or, for
    the MoE block (whose op returns no ids; the probe routes its inputs by the reference), the block's own ids from
    a second call on the same inputs."""
    from specverify.moe_layer import moe_block

    model, case = _probe_case(ops_name, b, k, device)
    ops = model.ops
    seen = []  # (kind, record) of every routing call, recorded beneath the probe's wrappers
    real = {n: getattr(ops, n) for n in ("route", "route_shared", "moe_block")}

    def under_route(name):
        def rec(logits, p, *rest):
            ids, w = real[name](logits, p, *rest)
            seen.append(("ids", ids[:, :p.num_experts_per_tok].clone()))
            return ids, w
        return rec

    def under_block(hidden, router, p, w13_all, w2_all):
        seen.append(("block", (hidden.clone(), router, p, w13_all, w2_all)))
        return real["moe_block"](hidden, router, p, w13_all, w2_all)

    for name in ("route", "route_shared"):
        if real[name] is not None:
            setattr(ops, name, under_route(name))
    if real["moe_block"] is not None:
        ops.moe_block = under_block
    before = {n: getattr(ops, n) for n in real}
    got = vw.routed_distinct_experts(model, case.run)
    assert {n: getattr(ops, n) for n in before} == before  # the slots are restored
    counts = []
    for kind, rec in seen:
        if kind == "block":
            hidden, router, p, w13_all, w2_all = rec
            rec = moe_block(hidden, router, w13_all, w2_all, top_k=p.num_experts_per_tok, scoring=p.scoring_func,
                            correction_bias=p.correction_bias, n_group=p.n_group, topk_group=p.topk_group,
                            renormalize=p.norm_topk_prob,
                            routed_scaling_factor=p.routed_scaling_factor).topk_ids[:, :p.num_experts_per_tok]
        counts.append(int(rec.unique().numel()))
    assert counts and got == sum(counts) / len(counts)
    if b * k == 1:  # one token: exactly its top-k, whatever the path
        assert got == model.config.num_experts_per_tok


def test_routing_probe_script(tmp_path):
    """bench/routing_probe.py at a tiny grouped MoE on the CPU: one token reads exactly its top-k; the JSON holds
    the routed and the uniform counts, and with --compare-logits each MoE layer's counts from the pass's, fp32 and
    bf16 logits (the pass's the same routing as the routed count's)."""
    import json
    import os
    import subprocess
    import sys

    from specverify.configs import get_config

    out = tmp_path / "probe.json"
    script = os.path.join(os.path.dirname(__file__), "..", "bench", "routing_probe.py")
    r = subprocess.run([sys.executable, script, "--model", "tiny-mla-grouped", "--tp", "1", "--layers", "3",
                        "--context", "32", "--draft-tokens", "1,3", "--page-size", "16", "--device", "cpu",
                        "--compare-logits", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    top_k = get_config("tiny-mla-grouped").num_experts_per_tok
    assert [row["k"] for row in rows] == [1, 3]
    assert rows[0]["distinct_experts_routed"] == top_k and rows[0]["distinct_experts_uniform"] == pytest.approx(top_k)
    assert top_k <= rows[1]["distinct_experts_routed"] <= 3 * top_k
    for row, tokens in zip(rows, (1, 3)):
        layers = row["distinct_experts_pass_fp32_bf16"]
        assert layers and all(len(c) == 3 and top_k <= min(c) <= max(c) <= tokens * top_k for c in layers)
        assert sum(c[0] for c in layers) / len(layers) == pytest.approx(row["distinct_experts_routed"])
