"""Helpers the benchmarks share: config restore, the --ms parser and the random expert pool."""
from __future__ import annotations

import argparse
import math

import pytest
import torch

from specverify.benchmarking import dict_restorer, token_counts
from specverify.reference.moe import random_expert_weights


def test_dict_restorer_restores_in_place():
    a, b = {"x": 1}, {"y": 2, "z": 3}
    held = a  # a module would hold the same object
    restore = dict_restorer(a, b)
    a["x"], a["new"] = 5, 6
    b.clear()
    restore()
    assert a == {"x": 1} and b == {"y": 2, "z": 3} and held is a
    a["x"] = 7
    restore()  # reusable: back to the contents at creation again
    assert a == {"x": 1}


def test_token_counts_parses_and_rejects():
    assert token_counts("1,4, 16,") == [1, 4, 16]
    for bad, why in (("2,x", "comma-separated integers"), ("0,2", ">= 1"), ("", ">= 1")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            token_counts(bad)


def test_random_expert_weights_shapes_scale_and_seed():
    # 3 experts, H 64, I 16: [E, 2I, H] and [E, H, I] in the asked dtype, entries ~ N(0, 1 / fan-in), seeded
    w13, w2 = random_expert_weights(3, 64, 16, seed=4, dtype=torch.float32)
    assert w13.shape == (3, 32, 64) and w2.shape == (3, 64, 16) and w13.dtype == torch.float32
    assert abs(w13.std().item() * math.sqrt(64) - 1) < 0.1 and abs(w2.std().item() * math.sqrt(16) - 1) < 0.1
    again = random_expert_weights(3, 64, 16, seed=4, dtype=torch.float32)
    assert torch.equal(w13, again[0]) and torch.equal(w2, again[1])
    assert not torch.equal(w13[0], w13[1]), "each expert gets its own draw"
    g = torch.Generator().manual_seed(4)
    assert torch.equal(random_expert_weights(3, 64, 16, generator=g, dtype=torch.float32)[0], w13)
    assert random_expert_weights(1, 8, 4)[0].dtype == torch.bfloat16


def _bench_script(name):
    """A script of the checkout's bench/ folder as a module (bench/ is not a package)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_route_stages_increments(tmp_path, capsys):
    # the stage prices are differences of the sweep's rows, per model and M, for the chosen variant's cuts; random
    # figures, so a wrong pairing of rows cannot pass; a missing row leaves NaN, not a wrong number
    import json

    rs = _bench_script("route_stages")
    g = torch.Generator().manual_seed(7)
    rows, want = [], {}
    for m in (3, 16):
        us = (torch.rand(6, generator=g) * 5 + 0.5).tolist()
        labels = ["empty kernel (launch floor)", "router only", "fast no mask cut route", "fast no mask cut ticket",
                  "fast no mask cut loads", "fast no mask"]
        for lab, u in zip(labels, us):
            rows.append(dict(model="kimi-k2", m=m, op="route" if lab in labels[:2] else "route+align", variant=lab,
                             us=u))
        rows.append(dict(model="kimi-k2", m=m, op="route+align", variant="fast cut route", us=99.0))  # another prefix
        want[m] = dict(atomics=us[2] - us[1], ticket=us[3] - us[2], loads=us[4] - us[3], finish=us[5] - us[4])
    rows = [r for r in rows if not (r["m"] == 16 and r["variant"] == "fast no mask cut ticket")]
    table = rs.stage_table(rows, "fast no mask")
    assert [t["m"] for t in table] == [3, 16]
    for name, v in want[3].items():
        assert table[0]["steps"][name] == pytest.approx(v, abs=1e-12)
    s16 = table[1]["steps"]
    assert math.isnan(s16["ticket"]) and math.isnan(s16["loads"])
    assert s16["atomics"] == pytest.approx(want[16]["atomics"]) and s16["finish"] == pytest.approx(want[16]["finish"])
    path = tmp_path / "route.json"
    path.write_text(json.dumps(dict(meta={}, rows=rows)))
    assert rs.main([str(path), "--prefix", "fast no mask", "--markdown"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| model | M |") and len(out) == 4
    assert rs.main([str(path), "--prefix", "nothing"]) == 1
