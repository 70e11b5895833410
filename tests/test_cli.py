"""The command line: env, the CPU run of the main job, and argument errors."""
import json
import subprocess
import sys
import tempfile

import pytest


def _run(*args, timeout=300, cwd=None):
    # run from a scratch folder: the command under test is the installed one, not the checkout's
    return subprocess.run([sys.executable, "-m", "specverify", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or tempfile.gettempdir())


def test_env_json():
    r = _run("env", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    for key in ("specverify", "torch", "triton", "cupy", "nccl", "gpu", "backends", "cache_dir", "env_vars"):
        assert key in info
    assert set(info["env_vars"]) >= {"SPECVERIFY_CACHE_DIR", "SPECVERIFY_ALLREDUCE"}


def test_verify_wall_runs_on_this_machine(tmp_path):
    out = tmp_path / "wall.json"
    r = _run("bench", "verify-wall", "--draft-tokens", "1,3", "--impl", "reference,specverify", "--tree", "topk:2",
             "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "verify wall:" in r.stdout and "break-even" in r.stdout
    rows = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))["rows"]
    assert {(row["provider"], row["k"]) for row in rows} == {(p, k) for p in ("reference", "specverify")
                                                              for k in (1, 3)}
    for row in rows:
        assert row["bytes"] > 0 and row["verify_ms_median"] > 0
        # accept length both ways: tokens a cycle as SGLang logs it, and accepted drafts
        assert row["break_even_accepted_drafts"] == pytest.approx(row["break_even"] - 1.0)
    assert "accept length as SGLang logs it" in r.stdout
    from specverify.configs import get_config

    cfg = get_config(rows[0]["model"])
    for row in rows:  # the routed experts this pass chose, beside the uniform model the floor assumes
        m = row["batch"] * row["k"]
        d = row["distinct_experts_routed"]
        assert cfg.num_experts_per_tok <= d <= min(cfg.n_routed_experts, m * cfg.num_experts_per_tok), row
        assert row["distinct_experts_modelled"] > 0
    import torch

    if not torch.cuda.is_available():
        assert "CPU figures are not performance figures" in r.stdout
        # the specverify provider agrees with the reference on the same inputs (bf16, 2 layers)
        assert all(row["logits_rel_err_vs_first"] < 5e-2 for row in rows if row["provider"] == "specverify")


@pytest.mark.parametrize("args, words", [
    (["bench", "verify-wall", "--tree", "star"], "--tree must be"),
    (["bench", "verify-wall", "--model", "gpt-5"], "unknown model"),
    (["bench", "verify-wall", "--draft-tokens", "0,2"], "draft lengths must be >= 1"),
    (["bench", "verify-wall", "--impl", "cuda"], "--impl takes a comma-separated list"),
    (["bench", "verify-wall", "--tree", "topk:0"], "branching >= 1"),  # used to loop forever
    (["bench", "verify-wall", "--iters", "0"], "--iters must be >= 1"),
])
def test_bad_arguments(args, words):
    r = _run(*args)
    assert r.returncode == 2
    assert words in r.stderr
