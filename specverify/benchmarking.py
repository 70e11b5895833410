"""Timing helpers shared by the microbenchmarks in ``bench/`` (GPU only).

* :func:`bench_us`: ``triton.testing.do_bench`` median in µs (eager launches, L2 not flushed between calls).
* :func:`graph_us`: µs per call inside a CUDA graph of ``calls`` back-to-back calls, replayed ``replays`` times;
  ``repeats`` > 1 keeps the best of several such measurements (less host noise).
* :func:`copy_bandwidth_gbps`: device-to-device copy bandwidth, read + write bytes over the median time — the
  ceiling the bandwidth fractions are quoted against.
* :func:`git_commit`: the short commit of the checkout a script runs from (``"?"`` outside a git checkout).
* :func:`dict_restorer`: put module-level config dicts that a sweep edits in place back as they were.
* :func:`token_counts`: the argparse type of the scripts' ``--ms`` (comma-separated token counts M >= 1).
"""
from __future__ import annotations

import argparse
import os
import subprocess

import torch


def token_counts(text: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]``: the argparse type of ``--ms`` (token counts M, each >= 1)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 2,8, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"token counts must be >= 1, got {text!r}")
    return values


def label_matches(label: str, patterns: str) -> bool:
    """Whether ``label`` is one of the comma-separated ``patterns`` (a trailing * matches a prefix): the sweeps'
    ``--*-variants`` filters."""
    return any(label.startswith(p[:-1]) if p.endswith("*") else label == p for p in patterns.split(","))


def bench_us(fn, quick: bool) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10 if quick else 25, rep=20 if quick else 100, return_mode="median") * 1e3


def graph_us(fn, calls: int = 20, replays: int = 10, repeats: int = 1) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (calls * replays))
    return best


def copy_bandwidth_gbps(nbytes: int = 1 << 30) -> float:
    from triton.testing import do_bench

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()  # never time on zeros
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9


def run_meta(script: str, **extra) -> dict:
    """The header every benchmark JSON carries: GPU, torch, Triton, commit (of ``script``'s checkout), date, plus
    ``extra``."""
    import datetime

    import triton

    return dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", torch=torch.__version__,
                triton=triton.__version__, commit=git_commit(script),
                date=datetime.datetime.now().isoformat(timespec="seconds"), **extra)


def dict_restorer(*dicts: dict):
    """A function that puts each of ``dicts`` back to its contents at this call (clear + update, in place, so
    modules holding the same dict objects see the restored values). Sweeps edit kernel configs in place between
    variants and restore them before the next one."""
    saved = [dict(d) for d in dicts]

    def restore() -> None:
        for d, kept in zip(dicts, saved):
            d.clear()
            d.update(kept)
    return restore


def git_commit(path: str | None = None) -> str:
    """``SPECVERIFY_COMMIT`` when set (a runner that exported the tree names its commit: a git checkout around the
    export may be at another commit), else the short commit of the checkout holding ``path`` (default: this
    package), else ``"?"``."""
    from specverify import envvars

    named = envvars.get("SPECVERIFY_COMMIT")
    if named:
        return named
    try:
        here = os.path.dirname(os.path.abspath(path or __file__))
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here,
                             timeout=5).stdout.strip()
    except Exception:
        out = ""
    return out or "?"


def load_sglang_peer(script: str):
    """(module, "") for ``bench/sglang_peer.py`` (beside ``script``) when SGLang's kernels import, else
    (None, the reason)."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        import sglang_peer  # noqa: PLC0415
    except Exception as exc:
        return None, f"bench/sglang_peer.py not importable ({exc.__class__.__name__}: {exc})"
    try:
        if not sglang_peer.available():
            return None, "sglang_peer.available() is False"
    except Exception as exc:
        return None, f"sglang_peer.available() failed ({exc})"
    return sglang_peer, ""
