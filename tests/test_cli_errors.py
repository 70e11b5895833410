"""Bad command lines are refused before any work, in one line that names the flag, the value and the fix; flags a
CPU run changes or ignores are each noted.

In-process (``specverify.cli.main``), with the measurement replaced by one that fails the test, so a check that
comes after the work shows up as that failure instead of as a slow test.
"""
import dataclasses
import json
import os
import shutil
import sys

import pytest
import torch

from specverify import plan as plan_mod
from specverify import verify_wall as vw
from specverify.cli import main
from specverify.configs import get_config
from specverify.output_paths import output_path_problem

#: the smallest verify-wall run: one tiny model, one provider, decode only
SMALL = ["bench", "verify-wall", "--model", "tiny-gqa", "--impl", "reference", "--draft-tokens", "1"]
PLAN = ["plan", "--decode-ms", "10", "--verify-ms", "1:10,4:20", "--accept", "0.7"]


class _Reached(Exception):
    """Raised by the stand-in measurement: the checks passed and the work would start here."""


@pytest.fixture
def no_work(monkeypatch):
    """Make any measurement or planning fail the test: the command must exit before it."""
    def forbidden(*args, **kwargs):
        pytest.fail("the work started before the command line was checked")
    monkeypatch.setattr(vw, "run_verify_wall", forbidden)
    monkeypatch.setattr(plan_mod, "plan_draft_lengths", forbidden)


@pytest.fixture
def reached(monkeypatch):
    """The measurement raises _Reached with the settings it was given (the checks passed)."""
    def stop(s, progress=None):
        raise _Reached(s)
    monkeypatch.setattr(vw, "run_verify_wall", stop)


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err  # one line, no traceback
    assert "Traceback" not in err
    return lines[0]


# --------------------------------------------------------------------------------------------- output paths
@pytest.mark.parametrize("cmd", [SMALL, PLAN], ids=["verify-wall", "plan"])
def test_json_in_missing_directory_refused_before_work(cmd, no_work, capsys):
    path = "/nonexistent/specverify-test-dir/x.json"
    assert main([*cmd, "--json", path]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--json" in line and path in line and "does not exist" in line and "mkdir -p" in line


@pytest.mark.parametrize("cmd", [SMALL, PLAN], ids=["verify-wall", "plan"])
def test_json_that_is_a_directory_refused(cmd, no_work, tmp_path, capsys):
    assert main([*cmd, "--json", str(tmp_path)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--json" in line and "is a directory" in line


def test_json_whose_parent_is_a_file_refused(no_work, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert main([*SMALL, "--json", str(blocker / "x.json")]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--json" in line and "is not a directory" in line


def test_plot_in_missing_directory_refused_before_work(no_work, capsys):
    path = "/nonexistent/specverify-test-dir/wall.png"
    assert main([*SMALL, "--plot", path]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--plot" in line and path in line and "does not exist" in line


def test_plot_without_matplotlib_said_up_front(no_work, monkeypatch, tmp_path, capsys):
    for name in ("matplotlib", "matplotlib.backends", "matplotlib.backends.backend_agg", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)  # import of any of them now fails: matplotlib "missing"
    assert main([*SMALL, "--plot", str(tmp_path / "wall.png")]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--plot" in line and "needs matplotlib" in line and "pip install" in line


def test_plot_file_type_matplotlib_cannot_write_refused(no_work, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main([*SMALL, "--plot", str(tmp_path / "wall.xyz")]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--plot" in line and ".xyz" in line and ".png" in line


def test_good_paths_pass_the_checks(reached, tmp_path):
    with pytest.raises(_Reached):
        main([*SMALL, "--json", str(tmp_path / "new.json")])


def test_plan_json_to_stdout_needs_no_path(capsys):
    assert main([*PLAN, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["best_k"] in (1, 4)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_unwritable_directory_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert "not writable" in output_path_problem(str(locked / "x.json"))
    finally:
        locked.chmod(0o700)


def test_json_directory_removed_during_run_reports_not_crashes(monkeypatch, tmp_path, capsys):
    """The path is checked up front; if its folder goes away during the run, the table still prints and the failed
    write is one error line with exit status 1."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    real = vw.run_verify_wall

    def run_then_remove(s, progress=None):
        result = real(s, progress)
        shutil.rmtree(out_dir)
        return result
    monkeypatch.setattr(vw, "run_verify_wall", run_then_remove)
    # --json is also written after each provider, into the folder that is still there then
    assert main([*SMALL, "--iters", "1", "--warmup", "0", "--json", str(out_dir / "x.json")]) == 1
    cap = capsys.readouterr()
    assert "verify wall:" in cap.out
    assert "could not write --json" in cap.err and "Traceback" not in cap.err


# ------------------------------------------------------------------------------------------- tensor parallel
@pytest.mark.parametrize("model, heads, valid", [
    ("kimi-k2", 64, "1, 2, 4, 8, 16, 32, 64"),
    ("deepseek-v3", 128, "1, 2, 4, 8, 16, 32, 64, 128"),
    ("tiny-gqa", 4, "1, 2, 4"),
    ("tiny-mla-moe", 4, "1, 2, 4"),
])
def test_tp_that_does_not_shard_the_model_refused(model, heads, valid, no_work, capsys):
    assert main(["bench", "verify-wall", "--model", model, "--tp", "3"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"--tp 3 cannot shard {model}" in line and f"{heads} attention heads" in line
    assert f"valid --tp values for {model}: {valid}" in line


@pytest.mark.parametrize("argv, tp", [
    (["--model", "kimi-k2", "--tp", "4"], 4),
    (["--model", "kimi-k2"], 8),      # the default for the full-size models
    (["--model", "tiny-gqa"], 1),     # the default for the stand-ins, whose 4 heads 8 does not divide
])
def test_tp_that_shards_the_model_accepted(argv, tp, reached):
    with pytest.raises(_Reached) as info:
        main(["bench", "verify-wall", *argv])
    assert info.value.args[0].tp == tp


def test_tp_rules_for_kv_heads():
    base = get_config("tiny-gqa")
    # 6 KV heads, tp 4: enough KV heads to split, but 4 does not divide 6
    split = dataclasses.replace(base, name="kv6", num_attention_heads=12, num_key_value_heads=6)
    assert "num_key_value_heads" in vw.tp_problem(split, 4)
    # 8 KV heads, tp 12: fewer than tp, so replicated, but 12 ranks cannot share 8 heads evenly
    replicated = dataclasses.replace(base, name="kv8", num_attention_heads=24, num_key_value_heads=8)
    assert "num_key_value_heads" in vw.tp_problem(replicated, 12)
    assert vw.tp_problem(replicated, 8) is None and vw.tp_problem(replicated, 24) is None
    assert vw.valid_tp_values(replicated) == [1, 2, 4, 8, 24]


# ------------------------------------------------------------------------------------------------ CPU notes
@pytest.mark.skipif(torch.cuda.is_available(), reason="the notes are those of a run without a GPU")
def test_cpu_notes_every_changed_or_ignored_flag(capsys):
    assert main([*SMALL, "--iters", "5", "--warmup", "2", "--page-size", "32", "--breakdown", "--switch"]) == 0
    out = capsys.readouterr().out
    for note in ("note: no GPU: --iters 5 -> 3 (CPU figures are not performance figures)",
                 "note: no GPU: --warmup 2 -> 1",
                 "note: no GPU: --page-size 32 -> 16",
                 "note: no GPU: --graph on -> off",
                 "note: no GPU: --breakdown needs CUDA events; ignored",
                 "note: no GPU: --switch needs CUDA-graph replay; ignored"):
        assert sum(line.startswith(note) for line in out.splitlines()) == 1, (note, out)


def test_cpu_notes_name_only_what_changed():
    s = vw.WallSettings(model="tiny-gqa", tp=1, graph=False, warmup=1, iters=2, page_size=8)
    assert vw.cpu_notes(s) == []
    notes = vw.cpu_notes(dataclasses.replace(s, tp=8))
    assert notes == ["no GPU: --tp 8 -> 1 (one rank of the stand-in; no allreduce modelled, so --link is unused)"]


# ---------------------------------------------------------------------------------------------- plan inputs
def test_plan_from_json_on_a_text_file_names_the_file(tmp_path, capsys):
    path = tmp_path / "notes.txt"
    path.write_text("these are not verify-wall figures\n")
    assert main(["plan", "--from-json", str(path), "--accept", "0.7"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"{path} is not a verify-wall JSON: Expecting value" in line


@pytest.mark.parametrize("content, words", [
    ({"rows": [{"k": 1, "provider": "reference"}]}, "no rows with keys 'k' and 'verify_ms_median'"),
    ({"meta": {}}, "expected a list of verify-wall rows"),
    ([{"k": "one", "verify_ms_median": 1.0}], "a row has k = 'one'"),
])
def test_plan_from_json_without_the_expected_keys_names_the_file(content, words, tmp_path, capsys):
    path = tmp_path / "other.json"
    path.write_text(json.dumps(content))
    assert main(["plan", "--from-json", str(path), "--accept", "0.7"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"{path} is not a verify-wall JSON" in line and words in line


def test_plan_from_json_with_a_failed_measurement_names_it(tmp_path, capsys):
    # verify-wall writes a failed measurement's NaN as null
    rows = [{"provider": "specverify", "k": 1, "verify_ms_median": 10.0, "decode_ms": 10.0},
            {"provider": "specverify", "k": 4, "verify_ms_median": None, "decode_ms": 10.0}]
    path = tmp_path / "wall.json"
    path.write_text(json.dumps({"rows": rows}))
    assert main(["plan", "--from-json", str(path), "--accept", "0.7"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert str(path) in line and "k = 4" in line and "failed" in line


def test_plan_from_json_missing_file_names_the_flag(tmp_path, capsys):
    path = tmp_path / "absent.json"
    assert main(["plan", "--from-json", str(path), "--accept", "0.7"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--from-json" in line and str(path) in line and "No such file" in line


@pytest.mark.parametrize("args, words", [
    # SGLang's own providers run its unquantised fused MoE: refused, with where the quantised peer is timed
    (["--model", "tiny-mla-moe", "--impl", "sglang", "--experts-quant", "int4"],
     ["--experts-quant int4", "sglang: SGLang's unquantised fused MoE", "bench/bench_moe.py --quant"]),
    (["--model", "tiny-mla-moe", "--impl", "specverify,sglang-flashinfer", "--experts-quant", "fp8"],
     ["sglang-flashinfer: SGLang's unquantised fused MoE"]),
    # a model without experts has nothing to quantise
    (["--model", "tiny-gqa", "--impl", "reference", "--experts-quant", "int4"], ["tiny-gqa has none"]),
])
def test_experts_quant_refusals(args, words, no_work, capsys):
    assert main(["bench", "verify-wall", *args, "--draft-tokens", "1"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert all(w in line for w in words), line
