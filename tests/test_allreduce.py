"""CPU tests of the IPC allreduce: the eligibility gate, the algorithm table and its refit, the cost model, the JIT
helper's cache keys, and (``cuda_compile``) that csrc/allreduce.cu compiles with nvcc for sm_90.

The kernels themselves run in tests/test_allreduce_gpu.py (several processes on one GPU).
"""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch

from specverify import jit
from specverify.comm import CustomAllReduce, cost_model, thresholds
from specverify.comm.thresholds import KiB, MiB, Rule, ThresholdTable

KERNELS = [f"specverify_ar_{k}_{d}" for k in ("one_shot", "two_shot", "one_shot_rmsnorm") for d in ("bf16", "f16", "f32")]


def _gate(world=8, link="nvlink", nccl=None, mode="auto", disabled=False):
    """A CustomAllReduce with its state set by hand (no process group, no GPU): only the gate logic runs."""
    ar = CustomAllReduce.__new__(CustomAllReduce)
    ar.disabled, ar.disabled_reason = disabled, ("test" if disabled else "")
    ar.device = torch.device("cpu")  # stands in for this rank's GPU: tensors on it pass the device check
    ar.world_size, ar.link, ar.nccl, ar.mode = world, link, nccl, mode
    ar._closed = False
    return ar


# ---- the gate --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gate_accepts_small_aligned_contiguous(dtype):
    x = torch.zeros(7168 * 4, dtype=dtype)  # the verify-pass message: 4 tokens x hidden 7168
    ar = _gate()
    assert ar.should_use(x)
    assert ar.algorithm(x) == "oneshot"


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda: torch.zeros(64, dtype=torch.float64), "dtype"),
        (lambda: torch.zeros(64, dtype=torch.int32), "dtype"),
        (lambda: torch.zeros(8, 16, dtype=torch.bfloat16).t(), "contiguous"),
        (lambda: torch.zeros(65, dtype=torch.bfloat16)[1:], "aligned"),  # 2-byte offset: not 16-byte aligned
        (lambda: torch.zeros(0, dtype=torch.bfloat16), "empty"),
        (lambda: [1.0, 2.0], "torch.Tensor"),
    ],
)
def test_gate_rejects_with_a_reason(make, why):
    ar = _gate()
    x = make()
    assert not ar.should_use(x)
    assert why in ar._ineligible_reason(x)


def test_gate_rejects_other_device():
    ar = _gate()
    ar.device = torch.device("cuda", 0)
    assert "must be on cuda:0" in ar._ineligible_reason(torch.zeros(8))


def test_gate_disabled_says_why():
    ar = _gate(disabled=True)
    assert not ar.should_use(torch.zeros(64, dtype=torch.bfloat16))
    assert "disabled: test" in ar._ineligible_reason(torch.zeros(64))


def test_gate_large_message_goes_to_nccl_when_there_is_one():
    x = torch.zeros(16 * MiB // 2, dtype=torch.bfloat16)  # 16 MiB: beyond every NVLink rule
    assert _gate(nccl=object()).algorithm(x) == "nccl"
    assert not _gate(nccl=object()).should_use(x)
    # ranks sharing a GPU have no NCCL: the custom two-shot takes everything
    assert _gate(nccl=None).algorithm(x) == "twoshot"


def test_gate_forced_algorithm():
    x = torch.zeros(8 * MiB, dtype=torch.bfloat16)
    assert _gate(mode="oneshot", nccl=object()).algorithm(x) == "oneshot"
    assert _gate(mode="twoshot", nccl=object()).algorithm(x) == "twoshot"


def test_world_size_one_is_disabled_and_copies(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ar = CustomAllReduce(dist.group.WORLD, nccl=False)
        assert ar.disabled and "world size 1" in ar.disabled_reason
        x = torch.arange(10, dtype=torch.float32)
        y = ar.all_reduce(x)
        assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
        ar.close()
        assert "closed" in repr(ar)
    finally:
        dist.destroy_process_group()


# ---- the table -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "nbytes, world, link, algo",
    [
        (14 * KiB, 8, "nvlink", "oneshot"),  # one token, hidden 7168, bf16, TP 8
        (56 * KiB, 8, "nvlink", "oneshot"),  # k = 4
        (128 * KiB, 8, "nvlink", "oneshot"),  # the boundary itself is inclusive
        (128 * KiB + 16, 8, "nvlink", "twoshot"),
        (2 * MiB + 16, 8, "nvlink", "nccl"),
        (512 * KiB, 2, "nvlink", "oneshot"),
        (64 * KiB, 2, "pcie", "oneshot"),
        (64 * KiB + 16, 2, "pcie", "twoshot"),
        (1 * MiB, 2, "pcie", "nccl"),
        (40 * KiB, 4, "pcie", "twoshot"),
        (0, 8, "nvlink", "oneshot"),
        (1 * KiB, 1, "nvlink", "nccl"),  # no rule for one rank
        (32 * MiB, 8, "same_device", "twoshot"),
    ],
)
def test_table_choices(nbytes, world, link, algo):
    assert thresholds.choose(nbytes, world, link) == algo


def test_table_rejects_bad_queries_and_rules():
    with pytest.raises(ValueError, match="link must be one of"):
        thresholds.choose(1, 2, "infiniband")
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        thresholds.choose(-1, 2, "nvlink")
    with pytest.raises(ValueError, match="algo must be one of"):
        Rule("nvlink", 2, 8, 10, "threeshot")
    with pytest.raises(ValueError, match="min_world <= max_world"):
        Rule("nvlink", 4, 2, 10, "oneshot")


def test_table_json_round_trip(tmp_path):
    t = ThresholdTable()
    t.save(tmp_path / "t.json")
    u = ThresholdTable.load(tmp_path / "t.json")
    assert u.rules == t.rules
    for nbytes in (1, 100 * KiB, 3 * MiB, 100 * MiB):
        assert u.choose(nbytes, 8, "nvlink") == t.choose(nbytes, 8, "nvlink")


def test_refit_moves_the_boundaries():
    rows = []
    for kib, one, two, nccl in ((1, 5, 8, 20), (64, 7, 9, 21), (256, 14, 11, 23), (4096, 90, 60, 40)):
        rows += [
            {"nbytes": kib * KiB, "algo": "oneshot", "us": one},
            {"nbytes": kib * KiB, "algo": "twoshot", "us": two},
            {"nbytes": kib * KiB, "algo": "nccl", "us": nccl},
        ]
    t = thresholds.refit(rows, "nvlink", 8)
    assert t.choose(64 * KiB, 8, "nvlink") == "oneshot"
    assert t.choose(64 * KiB + 16, 8, "nvlink") == "twoshot"
    assert t.choose(256 * KiB, 8, "nvlink") == "twoshot"
    assert t.choose(256 * KiB + 16, 8, "nvlink") == "nccl"
    # other world sizes and links keep the defaults
    for nbytes, world, link in ((300 * KiB, 4, "nvlink"), (100 * KiB, 6, "nvlink"), (50 * KiB, 2, "pcie")):
        assert t.choose(nbytes, world, link) == thresholds.choose(nbytes, world, link)
    with pytest.raises(ValueError, match="at least one measurement"):
        thresholds.refit([], "nvlink", 8)


def test_set_table_swaps_and_type_checks():
    old = thresholds.get_table()
    try:
        thresholds.set_table(ThresholdTable([Rule("nvlink", 2, 8, 1 * KiB, "twoshot")], source="test"))
        assert thresholds.choose(1 * KiB, 8, "nvlink") == "twoshot"
        assert thresholds.choose(2 * KiB, 8, "nvlink") == "nccl"
        with pytest.raises(TypeError, match="ThresholdTable"):
            thresholds.set_table([])
    finally:
        thresholds.set_table(old)


# ---- the cost model --------------------------------------------------------------------------------------------


def test_cost_model_cited_figures():
    cost_model.reset()
    assert cost_model.source == "cited"
    # the cited ranges: NCCL ~20 us on NVLink for small messages, custom one-shot 6-8 us at <= 64 KiB, TP 8
    assert 19 <= cost_model.allreduce_cost_us(14 * KiB, 8, "nvlink", "nccl") <= 22
    assert 6 <= cost_model.allreduce_cost_us(56 * KiB, 8, "nvlink", "oneshot") <= 8
    assert cost_model.allreduce_cost_us(56 * KiB, 8, "nvlink") == cost_model.allreduce_cost_us(
        56 * KiB, 8, "nvlink", "oneshot"
    )
    assert 24 <= cost_model.allreduce_cost_us(14 * KiB, 8, "pcie", "nccl") <= 27
    assert cost_model.allreduce_cost_us(14 * KiB, 1) == 0.0
    assert cost_model.allreduce_cost_us(14 * KiB, 8, algo="fused") == cost_model.allreduce_cost_us(
        14 * KiB, 8, algo="oneshot"
    )
    with pytest.raises(ValueError, match="link must be one of"):
        cost_model.allreduce_cost_us(1, 8, "same_device")
    with pytest.raises(ValueError, match="algo must be one of"):
        cost_model.allreduce_cost_us(1, 8, algo="ring")


def test_cost_model_measured_rows_replace_cited(tmp_path):
    import json

    rows = [
        {"link": "nvlink", "world_size": 8, "algo": "oneshot", "nbytes": 1024, "us": 4.0},
        {"link": "nvlink", "world_size": 8, "algo": "oneshot", "nbytes": 3072, "us": 6.0},
        {"link": "same_device", "world_size": 8, "algo": "oneshot", "nbytes": 1024, "us": 900.0,
         "correctness_only": True},
    ]
    (tmp_path / "m.json").write_text(json.dumps({"rows": rows}))
    try:
        assert cost_model.load_measured(tmp_path / "m.json") == 2
        assert cost_model.source.startswith("measured: ")
        assert cost_model.allreduce_cost_us(2048, 8, "nvlink", "oneshot") == pytest.approx(5.0)
        # sizes and world sizes with no measured row use the cited fit
        assert cost_model.allreduce_cost_us(2048, 4, "nvlink", "oneshot") == pytest.approx(
            cost_model._CITED[("nvlink", "oneshot")](2048, 4)
        )
    finally:
        cost_model.reset()
    assert cost_model.source == "cited"


# ---- the JIT helper --------------------------------------------------------------------------------------------


def test_jit_cache_key_has_version_arch_cuda_and_source(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECVERIFY_CACHE_DIR", str(tmp_path))
    p = jit.cache_path("allreduce", "sm_90", (13, 0))
    import specverify

    assert p.parts[-4:-1] == ("jit", specverify.__version__, "sm_90-nvrtc13.0")
    assert re.fullmatch(r"allreduce-[0-9a-f]{16}\.cubin", p.name)
    assert p.is_relative_to(tmp_path)
    assert jit.compile_options("sm_90")[:2] == ("-arch=sm_90", "-std=c++17")
    with pytest.raises(ValueError, match="arch must look like 'sm_90'"):
        jit.compile_options("90")
    with pytest.raises(ValueError, match="unknown CUDA module"):
        jit.source_hash("nope")


def test_jit_sources_are_installed_with_the_package():
    d = jit.csrc_dir()
    assert (d / "allreduce.cu").is_file() and (d / "allreduce.cuh").is_file()
    src = (d / "allreduce.cu").read_text()
    for name in KERNELS:  # every name the Python side launches is defined
        algo, dtype = name[len("specverify_ar_"):].rsplit("_", 1)
        assert (f"SV_DEFINE_ALLREDUCE({algo}, {dtype}," in src) or (
            algo == "one_shot_rmsnorm" and f"SV_DEFINE_RMSNORM({dtype}," in src
        ), name


def test_jit_clear_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECVERIFY_CACHE_DIR", str(tmp_path))
    p = jit.cache_path("allreduce", "sm_90", (13, 0))
    p.parent.mkdir(parents=True)
    p.write_bytes(b"x")
    assert jit.clear_cache() == 1
    assert not (tmp_path / "jit").exists()
    assert jit.clear_cache() == 0


def test_jit_without_cupy_says_what_to_install(monkeypatch, tmp_path):
    import sys

    monkeypatch.setenv("SPECVERIFY_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    with pytest.raises(jit.JitUnavailableError, match=r"specverify-kernels\[cu13\]"):
        jit.build_all("sm_90")


# ---- nvcc compiles the sources for sm_90 ------------------------------------------------------------------------


def _nvcc():
    path = shutil.which("nvcc")
    if path is None:
        for cand in sorted(__import__("glob").glob("/usr/local/cuda*/bin/nvcc")):
            return cand
    return path


@pytest.mark.cuda_compile
def test_allreduce_compiles_with_nvcc_sm90(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found on PATH or under /usr/local/cuda*/bin; install the CUDA toolkit to run this")
    obj = tmp_path / "allreduce.o"
    proc = subprocess.run(
        [nvcc, "-arch=sm_90", "-std=c++17", "-Xptxas", "-v", "-c", str(jit.csrc_dir() / "allreduce.cu"),
         "-o", str(obj)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    data = obj.read_bytes()
    for name in KERNELS:
        assert name.encode() in data, f"{name} missing from the object file"
    # no spills: the kernels are latency-bound, local memory would add a round trip per access
    assert "spill" not in proc.stderr or re.search(r"[1-9]\d* bytes spill", proc.stderr) is None, proc.stderr
