"""Helpers the benchmarks share: config restore, the --ms parser, the random expert pool, the GPU state log."""
from __future__ import annotations

import argparse
import math

import pytest
import torch

from specverify.benchmarking import GpuStateLog, dict_restorer, token_counts
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


def test_gpu_state_log_summarises_each_interval():
    log = GpuStateLog.__new__(GpuStateLog)  # no nvidia-smi here: feed samples as its reader thread would
    log.samples, log.marks, log._proc, log.available = [], [], None, True
    log.marks = [(0.0, "first"), (10.0, "second")]
    rows = [(1.0, "1980", "3201", "650.5", "61", "0x0"), (2.0, "1900", "3201", "699.0", "63", "0x4"),
            (11.0, "1600", "3201", "[N/A]", "70", "0x4"), (12.0, "1700", "3201", "690.0", "71", "0x4")]
    log.samples = [(t, list(v)) for t, *v in rows]
    got = log.summary()
    assert got["first"] == {"sm_mhz_median": 1940.0, "sm_mhz_min": 1900.0, "mem_mhz_median": 3201.0,
                            "power_w_max": 699.0, "temp_c_max": 63.0, "throttle_reasons": ["0x0", "0x4"],
                            "samples": 2}
    assert got["second"]["sm_mhz_min"] == 1600.0 and got["second"]["power_w_max"] == 690.0  # "[N/A]" skipped
    assert got["second"]["samples"] == 2
    log.close()  # no process: nothing to stop


def test_graph_us_refuses_an_unknown_statistic():
    from specverify.benchmarking import graph_us

    with pytest.raises(ValueError, match="stat must be 'min' or 'median'"):
        graph_us(lambda: None, stat="mean")  # refused before any CUDA call


def test_write_rows_json(tmp_path):
    import json

    from specverify.benchmarking import write_rows_json

    path = tmp_path / "rows.json"
    write_rows_json(str(path), __file__, [{"k": 1, "us": 2.5}], copy_bw_gbps=4200.0)
    got = json.loads(path.read_text())
    assert got["rows"] == [{"k": 1, "us": 2.5}] and got["meta"]["copy_bw_gbps"] == 4200.0
