"""``specverify env``'s per-op kernel report and the MLA capability gate behind it, on the CPU.

The gate's device part is exercised with ``torch.cuda`` answering as a fake GPU and the probe compile replaced
(the real offline compile for sm_90a is in tests/test_compile_matrix.py).
"""
import pytest
import torch

from specverify import attention
from specverify.env_report import OPS, collect_env, kernel_choices

OP_NAMES = [op for op, _ in OPS]


def _split(line: str) -> tuple[str, str]:
    kernel, _, why = line.partition(": ")
    return kernel, why


def test_names_each_op_with_a_kernel_and_a_reason():
    kernels = collect_env()["kernels"]
    assert list(kernels) == OP_NAMES
    assert OP_NAMES == ["MLA tree attention", "GQA tree attention", "MoE routing", "fused experts", "acceptance",
                        "KV compaction", "small fused ops"]
    for op, line in kernels.items():
        kernel, why = _split(line)
        assert kernel and why, f"{op}: {line!r} is not 'kernel: reason'"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only rule")
def test_cpu_without_interpreter_is_the_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for op, line in kernel_choices().items():
        assert line == "reference (torch): no CUDA device and TRITON_INTERPRET is not 1", op


def test_interpreter_runs_the_triton_kernels_and_never_gluon(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("SPECVERIFY_DISABLE_TRITON", raising=False)
    kernels = kernel_choices()
    for op, path in OPS:
        kernel, why = _split(kernels[op])
        assert path in kernel and "in the interpreter" in kernel and "TRITON_INTERPRET=1" in why, kernels[op]
    assert kernels["MLA tree attention"].startswith("tl.dot kernel")
    assert "Gluon wgmma kernel has no interpreter" in kernels["MLA tree attention"]
    ok, why = attention.mla_wgmma_support("cuda")
    assert not ok and "TRITON_INTERPRET=1" in why


def test_disable_triton_is_the_reference_everywhere(monkeypatch):
    monkeypatch.setenv("SPECVERIFY_DISABLE_TRITON", "1")
    assert set(kernel_choices().values()) == {"reference (torch): SPECVERIFY_DISABLE_TRITON=1"}


def test_gate_says_no_on_the_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ok, why = attention.mla_wgmma_support("cpu")
    assert (ok, why) == (False, "no CUDA device (tensors on cpu)")
    assert not attention._wgmma_default(torch.device("cpu"), d=512, dr=64, dv=512)


@pytest.fixture
def fake_gpu(monkeypatch):
    """``torch.cuda`` answering as one GPU of the capability the test sets; the gate's cache cleared around it."""
    cap = {"value": (9, 0)}
    try:  # import the Gluon module under the environment Triton was imported with (conftest: the interpreter)
        attention._wgmma_kernels()
    except Exception:  # noqa: BLE001 - the gate reports it
        pass
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("SPECVERIFY_MLA_WGMMA", raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: cap["value"])
    attention._wgmma_probe.cache_clear()
    yield cap
    attention._wgmma_probe.cache_clear()


def test_gate_capability_rules(fake_gpu, monkeypatch):
    """sm_90 with Gluon and a compiling kernel: yes; the compile failing, another arch or the knob: no, with why."""
    pytest.importorskip("triton")
    if not attention._wgmma_kernels().AVAILABLE:
        ok, why = attention.mla_wgmma_support("cuda")
        assert not ok and why == attention._wgmma_kernels().UNAVAILABLE_REASON
        return
    calls = []

    def compiles(wg, index, *, num_warps):
        calls.append((index, num_warps))
        return "", 0

    monkeypatch.setattr(attention, "_wgmma_compile", compiles)
    ok, why = attention.mla_wgmma_support("cuda")
    assert ok and "has Gluon and the kernel compiles for sm_90a" in why
    assert attention.mla_wgmma_support(torch.device("cuda", 0))[0] and calls == [(0, 4)]  # cached per device
    assert attention._wgmma_warps_32(torch.device("cuda")) == 4

    # a Triton whose 4-warp kernel spills (3.9 offline: 56 B/thread) gives 32-row tiles 8 warps
    attention._wgmma_probe.cache_clear()
    monkeypatch.setattr(attention, "_wgmma_compile", lambda wg, index, *, num_warps: ("", 56 if num_warps == 4 else 0))
    ok, why = attention.mla_wgmma_support("cuda")
    assert ok and "32-row tiles on 8 warps" in why
    cfg = attention._choose_wgmma_config(dict(attention._wgmma_kernels().MLA_WGMMA_DEFAULT), mla=True, rows=32,
                                         head_dim=512, head_dim_v=512, interpret=False, device=torch.device("cuda"))
    assert (cfg["BLOCK_M"], cfg["num_warps"]) == (32, 8)
    cfg16 = attention._choose_wgmma_config({"KERNEL": "mla_wgmma"}, mla=True, rows=8, head_dim=512, head_dim_v=512,
                                           interpret=False, device=torch.device("cuda"))
    assert (cfg16["BLOCK_M"], cfg16["num_warps"]) == (16, 4)

    attention._wgmma_probe.cache_clear()
    monkeypatch.setattr(attention, "_wgmma_compile",
                        lambda wg, index, *, num_warps: ("CompilationError: no async_load", 0))
    ok, why = attention.mla_wgmma_support("cuda")
    assert not ok and "does not compile for sm_90a" in why and "no async_load" in why

    fake_gpu["value"] = (12, 0)
    ok, why = attention.mla_wgmma_support("cuda")
    assert not ok and why.startswith("sm_120 has no wgmma")

    monkeypatch.setenv("SPECVERIFY_MLA_WGMMA", "0")
    assert attention.mla_wgmma_support("cuda") == (False, "SPECVERIFY_MLA_WGMMA=0")
