"""specverify.plan: hand-computed expected lengths, tokens/s, break-even, and the `specverify plan` command."""
from __future__ import annotations

import argparse
import json

import pytest

from specverify.plan import (best_k, expected_emitted_chain, expected_emitted_tree, parse_accept, parse_verify_ms,
                             plan_draft_lengths, register_cli)


def _cli(argv):
    parser = argparse.ArgumentParser(prog="specverify")
    register_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_chain_hand_case():
    # decode 10 ms; k = 3 (2 drafts) at a constant 0.5: E = 1 + 0.5 + 0.25 = 1.75; cycle = 2 * 1 + 12 = 14 ms
    rows = plan_draft_lengths(10.0, {1: 10.0, 3: 12.0}, 0.5, draft_ms=1.0)
    r1, r3 = rows
    assert (r1.k, r1.expected_emitted, r1.cycle_ms, r1.speedup) == (1, 1.0, 10.0, 1.0)
    assert r3.draft_steps == 2 and r3.cycle_ms == pytest.approx(14.0)
    assert r3.expected_accept_length == pytest.approx(0.75)
    assert r3.tokens_per_s == pytest.approx(1000 * 1.75 / 14)  # 125 tokens/s vs 100 decoding
    assert r3.speedup == pytest.approx(1.25)
    assert r3.break_even_emitted == pytest.approx(1.4) and r3.break_even_accept_length == pytest.approx(0.4)
    assert r3.pays and best_k(rows) == 3


def test_motivating_case_speculation_loses():
    # decode 11.1 ms, verify 25.6 ms for 3 drafts; E = 1 + .63 + .63*.40 + .63*.40*.26 = 1.94752 < 25.6/11.1
    rows = plan_draft_lengths(11.1, {1: 11.1, 4: 25.6}, [0.63, 0.40, 0.26])
    r4 = rows[1]
    assert r4.expected_emitted == pytest.approx(1.94752)
    assert r4.break_even_emitted == pytest.approx(25.6 / 11.1)
    assert r4.speedup == pytest.approx(1.94752 * 11.1 / 25.6)  # 0.844: speculation loses
    assert not r4.pays
    assert best_k(rows) == 1


def test_draft_cost_moves_best_k():
    # a = 0.8: E(2) = 1.8, E(4) = 2.952. No draft cost: 1.8/11 < 2.952/13 -> k = 4.
    # 5 ms per draft step: 1.8/16 = 0.1125 > 2.952/28 = 0.1054 -> k = 2.
    verify = {1: 10.0, 2: 11.0, 4: 13.0}
    assert best_k(plan_draft_lengths(10.0, verify, 0.8)) == 4
    rows = plan_draft_lengths(10.0, verify, 0.8, draft_ms=5.0)
    assert [r.cycle_ms for r in rows] == pytest.approx([10.0, 16.0, 28.0])
    assert best_k(rows) == 2


@pytest.mark.parametrize("a", [0.0, 0.3, 0.9, 1.0])
@pytest.mark.parametrize("k", [1, 2, 5, 8])
def test_constant_rate_matches_closed_form(a, k):
    closed = float(k) if a == 1.0 else (1 - a ** k) / (1 - a)  # Leviathan et al. 2023 with gamma = k - 1
    assert expected_emitted_chain(a, k) == pytest.approx(closed)


def test_short_rate_list_repeats_last_rate():
    assert expected_emitted_chain([0.5, 0.2], 5) == pytest.approx(1 + 0.5 + 0.1 + 0.02 + 0.004)


def test_tree_formula():
    # root with children 1 (p .6) and 2 (p .3); node 3 under node 1 (p .5): 1 + .6 + .3 + .6 * .5 = 2.2
    assert expected_emitted_tree([-1, 0, 0, 1], [1.0, 0.6, 0.3, 0.5]) == pytest.approx(2.2)
    # a chain written as a tree gives the chain formula
    assert expected_emitted_tree([-1, 0, 1, 2], [1, 0.7, 0.5, 0.4]) == pytest.approx(
        expected_emitted_chain([0.7, 0.5, 0.4], 4))
    # a depth-1 tree (root only) emits exactly the bonus token
    assert expected_emitted_tree([-1], [1.0]) == 1.0


def test_tree_accepts_a_draft_tree_object():
    from specverify.tree import DraftTree
    assert expected_emitted_tree(DraftTree.chain(3), [1, 0.5, 0.5]) == pytest.approx(1.75)


@pytest.mark.parametrize("call, match", [
    (lambda: expected_emitted_chain(1.2, 3), r"\[0, 1\]"),
    (lambda: expected_emitted_chain(0.5, 0), "k .* >= 1"),
    (lambda: expected_emitted_chain([], 3), "at least one"),
    (lambda: expected_emitted_tree([-1, 0, 0], [1, 0.7, 0.6]), "summing to 1.3"),
    (lambda: expected_emitted_tree([-1, 2, 0], [1, 0.5, 0.5]), "before their children"),
    (lambda: expected_emitted_tree([-1, 0], [1.0]), "one rate per node"),
    (lambda: plan_draft_lengths(0.0, {1: 1.0}, 0.5), "decode_ms"),
    (lambda: plan_draft_lengths(10.0, {}, 0.5), "at least one"),
    (lambda: plan_draft_lengths(10.0, {2: -1.0}, 0.5), r"verify_ms\[2\]"),
    (lambda: plan_draft_lengths(10.0, {2: 1.0}, 0.5, draft_ms=-1), "draft_ms"),
    (lambda: best_k([]), "at least one"),
    (lambda: parse_verify_ms("1=11.1"), "k:ms"),
    (lambda: parse_verify_ms("1:11,1:12"), "twice"),
    (lambda: parse_accept("0.5,x"), "rates like"),
])
def test_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_parsers():
    assert parse_verify_ms("1:11.1, 4:25.6") == {1: 11.1, 4: 25.6}
    assert parse_accept("0.63,0.40,0.26") == [0.63, 0.40, 0.26]
    assert parse_accept("0.7") == [0.7]


def test_cli_table_names_best_k(capsys):
    assert _cli(["plan", "--decode-ms", "11.1", "--verify-ms", "1:11.1,4:25.6,7:28.7",
                 "--accept", "0.63,0.40,0.26"]) == 0
    out = capsys.readouterr().out
    assert "no draft length pays" in out and "closest: k = 1" in out


def test_cli_nothing_pays_names_plain_decoding(capsys):
    # the motivating measurement without a k = 1 row: k = 4 is the closest, and the verdict is still plain decoding
    assert _cli(["plan", "--decode-ms", "11.1", "--verify-ms", "4:25.6,7:28.7", "--accept", "0.63,0.40,0.26",
                 "--draft-ms", "0.8"]) == 0
    out = capsys.readouterr().out
    assert "plain decoding (k = 1) is as fast or faster" in out and "closest: k = 4" in out


def test_break_even_accept_never_negative():
    # a verify pass timed below the decode step (noise, CPU runs) gives break-even 0, not a negative length
    rows = plan_draft_lengths(10.0, {1: 9.0, 2: 9.5}, 0.7)
    assert [r.break_even_accept_length for r in rows] == [0.0, 0.0]
    assert rows[1].break_even_emitted == pytest.approx(0.95)


def test_cli_json_from_verify_wall(tmp_path, capsys):
    rows = [{"provider": "reference", "k": k, "verify_ms_median": v, "decode_ms": 10.0}
            for k, v in [(1, 10.0), (2, 11.0), (4, 13.0)]]
    rows += [{"provider": "specverify", "k": 1, "verify_ms_median": 9.0, "decode_ms": 9.0}]
    path = tmp_path / "wall.json"
    path.write_text(json.dumps({"rows": rows}))
    assert _cli(["plan", "--from-json", str(path), "--provider", "reference", "--accept", "0.8", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["best_k"] == 4 and got["decode_ms"] == 10.0
    assert [r["k"] for r in got["rows"]] == [1, 2, 4]
    assert got["rows"][2]["expected_emitted"] == pytest.approx(2.952)


def test_cli_bad_input_exit_code(capsys):
    assert _cli(["plan", "--verify-ms", "2:11", "--accept", "0.5"]) == 2  # no --decode-ms
    assert "--decode-ms is required" in capsys.readouterr().err


def test_motivating_case_from_sglang_numbers(capsys):
    """SGLang's own figures of the motivating deployment (decode 11.1 ms; verify 25.6 ms at 3 draft tokens and
    28.7 ms at 6, SGLang's count with the root; draft 1.03 ms for 2 steps plus 0.34 ms re-extend; 2.1 tokens a cycle
    as SGLang logs its accept length): break-even 2.43 tokens a cycle at 3 (26.97 / 11.1), 2.69 at 6 (29.9 ms),
    about 78 tok/s (the practitioner measured 75.9)."""
    from specverify.cli import main

    assert main(["plan", "--decode-ms", "11.1", "--verify-ms", "3:25.6,6:28.7", "--draft-cycle-ms",
                 f"3:{1.03 + 0.34},6:1.2", "--sglang-accept-length", "2.1", "--json"]) == 0
    rows = {r["k"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows[3]["cycle_ms"] == pytest.approx(26.97) and rows[6]["cycle_ms"] == pytest.approx(29.9)
    assert rows[3]["break_even_emitted"] == pytest.approx(26.97 / 11.1)
    assert rows[6]["break_even_emitted"] == pytest.approx(29.9 / 11.1)
    assert rows[3]["tokens_per_s"] == pytest.approx(1000 * 2.1 / 26.97) and round(rows[3]["tokens_per_s"]) == 78
    assert rows[3]["expected_emitted"] == 2.1 and rows[3]["expected_accept_length"] == pytest.approx(1.1)
    assert not rows[3]["pays"] and not rows[6]["pays"]


@pytest.mark.parametrize("args, words", [
    (["--sglang-accept-length", "0.5"], "must be >= 1"),
    (["--sglang-accept-length", "9"], "more tokens than a cycle"),
    (["--sglang-accept-length", "2", "--accept", "0.5"], "not allowed with"),
    (["--sglang-accept-length", "2", "--draft-cycle-ms", "3:x"], "--draft-cycle-ms entries must be k:ms"),
])
def test_sglang_accept_length_errors(args, words, capsys):
    from specverify.cli import main

    try:
        rc = main(["plan", "--decode-ms", "11.1", "--verify-ms", "3:25.6,6:28.7", *args])
    except SystemExit as exc:  # argparse's own refusals
        rc = exc.code
    assert rc == 2 and words in capsys.readouterr().err
