"""Programmatic dependent launch (PDL) across the verify pass: when it is on, and that it changes no bit.

Every kernel of the chain waits (``gdc_wait``) before it reads or writes anything but its weights, so a pass with
PDL must give exactly the logits, tokens and KV of the same pass without it (the kernels are deterministic). A
kernel that read its input before the wait would race with its predecessor and differ here.
"""
import pytest
import torch

from specverify import fit


def test_pdl_launch_needs_cuda_sm90_and_the_knob(monkeypatch):
    monkeypatch.setattr(fit, "_capability_major", lambda index: 9)
    monkeypatch.setattr(fit, "_index", lambda device: 0)
    monkeypatch.delenv("SPECVERIFY_PDL", raising=False)
    assert fit.pdl_launch(torch.device("cuda", 0))
    assert not fit.pdl_launch(torch.device("cpu"))  # the interpreter: no grid dependency control
    monkeypatch.setenv("SPECVERIFY_PDL", "0")
    assert not fit.pdl_launch(torch.device("cuda", 0))
    monkeypatch.setenv("SPECVERIFY_PDL", "1")
    monkeypatch.setattr(fit, "_capability_major", lambda index: 8)  # Ampere has no griddepcontrol
    assert not fit.pdl_launch(torch.device("cuda", 0))


def test_kernels_launch_without_pdl_off_the_gpu():
    assert fit.pdl_kwargs(torch.device("cpu")) == {"PDL": False}


def test_kernels_launch_with_pdl_on_sm90(monkeypatch):
    monkeypatch.setattr(fit, "_capability_major", lambda index: 9)
    monkeypatch.setattr(fit, "_index", lambda device: 0)
    monkeypatch.delenv("SPECVERIFY_PDL", raising=False)
    assert fit.pdl_kwargs(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}


_PTX_ORDER = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from specverify.kernels.pdl import pdl_enter

@triton.jit
def _k(X, PDL: tl.constexpr):
    pdl_enter(PDL)
    tl.store(X, 1.0)

for pdl in (True, False):
    src = ASTSource(fn=_k, signature={"X": "*fp32", "PDL": "constexpr"}, constexprs={"PDL": pdl})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    print(pdl, [w for line in ptx.splitlines() for w in line.split() if w.startswith("griddepcontrol")])
"""


def test_pdl_enter_orders_the_trigger_and_the_wait(tmp_path):
    """Compiled for sm_90 without a GPU (a process without the interpreter): PDL True triggers then waits, False
    emits neither."""
    import os
    import subprocess
    import sys

    script = tmp_path / "ptx_order.py"  # a file: Triton reads a kernel's source
    script.write_text(_PTX_ORDER)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    launch, wait = "griddepcontrol.launch_dependents", "griddepcontrol.wait"
    assert run.stdout.split("\n")[:2] == [f"True {[launch, wait]}", "False []"], run.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["kimi-k2", "deepseek-v3"])  # 8 / 16 heads a rank; 4 layers: dense and MoE
def test_the_chained_pass_equals_the_unchained_one(monkeypatch, name):
    """Graph replays with PDL against eager calls without it, at k = 1 and 4, batch 1 and 4, then again after the
    inputs changed in place: logits argmax tokens and accept lengths identical, and the forward's logits bitwise."""
    from specverify.configs import get_config
    from specverify.forward.model import build_verify_model
    from specverify.graph_pool import VerifyGraphPool

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    ad = build_verify_model(get_config(name), tp=8, num_layers=4, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setenv("SPECVERIFY_PDL", "1")
    pool = VerifyGraphPool(ad.verify, ad.make_inputs, batch_buckets=[1, 4], draft_lengths=[1, 4], capture="eager")
    model = ad.model
    for b, k in pool.keys():
        for trial in range(2):
            static = pool.static_inputs(b, k)
            inputs = {n: t.clone() for n, t in static.items()}
            if trial:  # new draft tokens: the replay must read them, not the captured ones
                inputs["draft"] = torch.randint_like(inputs["draft"], model.config.vocab_size)
            monkeypatch.setenv("SPECVERIFY_PDL", "1")
            got = {n: t.clone() for n, t in pool.run(inputs, k).items()}
            monkeypatch.setenv("SPECVERIFY_PDL", "0")
            want = ad.verify({n: t.clone() for n, t in inputs.items()}, k)
            for n in want:
                assert torch.equal(got[n], want[n]), f"{n} differs at (batch {b}, k {k}, trial {trial})"
    # the forward's logits, eager with and without PDL
    inputs = ad.make_inputs(4, 4)
    pos = inputs["prefix"].long()[:, None] + torch.arange(4, device="cuda")
    out = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("SPECVERIFY_PDL", flag)
        out[flag] = model.forward(inputs["draft"], pos, ad.caches, inputs["page_table"], inputs["prefix"])
    assert torch.equal(out["1"], out["0"])
