"""Timing helpers shared by the microbenchmarks in ``bench/`` (GPU only).

* :func:`bench_us`: ``triton.testing.do_bench`` median in µs (eager launches, L2 not flushed between calls).
* :func:`graph_us`: µs per call inside a CUDA graph of ``calls`` back-to-back calls, replayed ``replays`` times;
  ``repeats`` > 1 keeps the best of several such measurements (less host noise).
* :func:`copy_bandwidth_gbps`: device-to-device copy bandwidth, read + write bytes over the median time — the
  ceiling the bandwidth fractions are quoted against.
* :func:`git_commit`: the short commit of the checkout a script runs from (``"?"`` outside a git checkout).
* :func:`dict_restorer`: put module-level config dicts that a sweep edits in place back as they were.
* :func:`token_counts`: the argparse type of the scripts' ``--ms`` (comma-separated token counts M >= 1).
* :class:`GpuStateLog`: SM / memory clocks, power, temperature and throttle reasons sampled by ``nvidia-smi`` in
  the background, summarised per interval (providers timed one after another compare only at equal clocks).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import threading
import time

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


def graph_us(fn, calls: int = 20, replays: int = 10, repeats: int = 1, stat: str = "min") -> float:
    """µs a call of ``fn``: ``calls`` calls captured in one CUDA graph, replayed ``replays`` times per repeat; the
    ``min`` or ``median`` over ``repeats``."""
    if stat not in ("min", "median"):
        raise ValueError(f"graph_us: stat must be 'min' or 'median', got {stat!r}")
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
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (calls * replays))
    return min(times) if stat == "min" else sorted(times)[len(times) // 2]


def copy_bandwidth_gbps(nbytes: int = 1 << 30) -> float:
    from triton.testing import do_bench

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()  # never time on zeros
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9


def write_rows_json(path: str, script: str, rows: list, **meta) -> None:
    """Write a benchmark's ``{"meta": run_meta(script, **meta), "rows": rows}`` to ``path`` (indent 1)."""
    import json

    with open(path, "w") as f:
        json.dump({"meta": run_meta(script, **meta), "rows": rows}, f, indent=1)


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


class GpuStateLog:
    """Background samples of one GPU's state from ``nvidia-smi --query-gpu ... -lms`` (every ``period_ms``), so a
    run that times providers one after another can show whether they ran at the same clocks.

    ``mark(name)`` opens an interval (closing the previous one); :meth:`summary` gives per interval the median and
    minimum SM clock (MHz), the median memory clock, the largest power draw (W) and temperature (C), and the
    throttle-reason bitmasks seen (``clocks_throttle_reasons.active``: 0x1 idle, 0x4 software power cap, 0x20
    software thermal, 0x40 hardware thermal, 0x80 hardware power brake; see ``nvidia-smi -h``).
    Without ``nvidia-smi`` or a CUDA device :attr:`available` is False and every call does nothing.
    """

    FIELDS = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"

    def __init__(self, device=None, period_ms: int = 200):
        self.samples: list[tuple[float, list[str]]] = []
        self.marks: list[tuple[float, str]] = []
        self._proc = None
        self.available = False
        if not torch.cuda.is_available():
            return
        dev = torch.device(device if device is not None else "cuda")
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        uuid = getattr(torch.cuda.get_device_properties(idx), "uuid", None)
        target = f"GPU-{uuid}" if uuid is not None else str(idx)
        try:
            self._proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.FIELDS}", "--format=csv,noheader,nounits",
                                           "-i", target, f"-lms={period_ms}"], stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return
        self.available = True
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        for line in self._proc.stdout:
            vals = [v.strip() for v in line.split(",")]
            if len(vals) == 5:
                self.samples.append((time.monotonic(), vals))

    def mark(self, name: str) -> None:
        self.marks.append((time.monotonic(), name))

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()

    def summary(self) -> dict:
        """{interval name: {"sm_mhz_median", "sm_mhz_min", "mem_mhz_median", "power_w_max", "temp_c_max",
        "throttle_reasons", "samples"}} over the samples inside each marked interval (the last runs to now)."""
        out: dict = {}
        ends = [t for t, _ in self.marks[1:]] + [time.monotonic()]
        for (t0, name), t1 in zip(self.marks, ends):
            rows = [v for t, v in self.samples if t0 <= t < t1]

            def num(i, rows=rows):
                vals = []
                for v in rows:
                    try:
                        vals.append(float(v[i]))
                    except ValueError:  # "[N/A]" on GPUs that do not report a field
                        pass
                return vals

            sm, mem, pw, tc = num(0), num(1), num(2), num(3)
            out[name] = {"sm_mhz_median": statistics.median(sm) if sm else None, "sm_mhz_min": min(sm) if sm else None,
                         "mem_mhz_median": statistics.median(mem) if mem else None,
                         "power_w_max": max(pw) if pw else None, "temp_c_max": max(tc) if tc else None,
                         "throttle_reasons": sorted({v[4] for v in rows}), "samples": len(rows)}
        return out
