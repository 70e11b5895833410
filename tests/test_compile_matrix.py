"""bench/compile_matrix.py: one small kernel captured from its real launcher and compiled offline for sm_90a, and the
MLA capability gate on fake sm_90a / sm_120 GPUs.

CPU only: the launch is captured on a fake CUDA device and compiled with the ptxas in Triton's wheel, in a
subprocess without ``TRITON_INTERPRET`` (conftest sets it on CPU-only machines; the interpreter would change the
launcher's config and compile nothing). Skipped where Triton's ptxas cannot run. Under a minute (the gate compiles
the Gluon kernel once or twice).
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "compile_matrix.py")


def _ptxas():
    triton = pytest.importorskip("triton")
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    try:
        ok = subprocess.run([path, "--version"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    if not ok:
        pytest.skip(f"Triton's ptxas is not runnable here ({path})")


def _run(tmp_path, *extra):
    _ptxas()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # a fresh compile, not a cache hit
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--targets", "sm_90a", "--only", "fused", "--quick",
                           "--kernel", "_silu_mul_kernel", "--json", str(out), *extra],
                          capture_output=True, text=True, env=env, timeout=300)
    return proc, json.loads(out.read_text()) if out.exists() else None


def test_silu_mul_compiles_for_sm90(tmp_path):
    proc, data = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [r for r in data["rows"] if r["kernel"] == "_silu_mul_kernel"]
    assert len(rows) == 1, data["rows"]
    r = rows[0]
    assert (r["target"], r["status"]) == ("sm_90a", "ok"), r
    assert "BLOCK=" in r["config"]  # the constexprs the launcher chose
    assert isinstance(r["regs"], int) and 0 < r["regs"] <= 255
    assert isinstance(r["smem_bytes"], int) and 0 <= r["smem_bytes"] <= 232448
    assert r["spill_bytes"] == 0
    assert r["scenarios"][0].startswith("silu_mul")
    assert data["triton"] and data["summary"]["sm_90a"]["failing"] == 0
    assert "_silu_mul_kernel" in proc.stdout  # the table


def test_unknown_target_is_a_usage_error(tmp_path):
    _ptxas()
    proc = subprocess.run([sys.executable, SCRIPT, "--targets", "sm_75"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "unknown target" in proc.stderr


def test_mla_gate_compiles_the_gluon_kernel_for_sm90_only(tmp_path):
    """The MLA capability gate on fake GPUs: on sm_90a it compiles the Gluon kernel (for that target, offline) and
    says yes where this Triton has Gluon's Hopper API; on sm_120 it says no, naming why."""
    _ptxas()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import compile_matrix as cm; "
            "print(json.dumps({t: cm.gate(t) for t in ('sm_90a', 'sm_120')}))")
    proc = subprocess.run([sys.executable, "-c", code, os.path.dirname(SCRIPT)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    gates = json.loads(proc.stdout.strip().splitlines()[-1])
    assert gates["sm_120"] == {"mla_wgmma": False, "reason": "sm_120 has no wgmma (the Gluon kernel is for sm_90: "
                                                             "H100 / H200)"}
    from specverify.kernels import tree_attention_wgmma as wg

    if wg.AVAILABLE:
        assert gates["sm_90a"]["mla_wgmma"], gates["sm_90a"]
        assert "compiles for sm_90a" in gates["sm_90a"]["reason"]
    else:
        assert gates["sm_90a"] == {"mla_wgmma": False, "reason": wg.UNAVAILABLE_REASON}
