"""The ``specverify`` command line (also ``python -m specverify``).

Subcommands: ``env`` (versions, GPU, backends, cache dir), ``build`` (compile the CUDA sources ahead of time),
``clear-cache``, ``bench verify-wall`` (the main job), ``bench <op>`` (kernel microbenchmarks when run from a
checkout), ``plan`` (pick the draft length from measured costs).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys


def _version(mod: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return None


def collect_env() -> dict:
    """Everything ``specverify env`` reports, as a dict (also written into benchmark JSON rows)."""
    import specverify
    from specverify import envvars

    info: dict = {"specverify": specverify.__version__, "python": platform.python_version(),
                  "platform": platform.platform()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda_runtime"] = torch.version.cuda
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info["gpu"] = props.name
            info["compute_capability"] = f"{props.major}.{props.minor}"
            info["gpu_count"] = torch.cuda.device_count()
            info["sm_count"] = props.multi_processor_count
            info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        else:
            info["gpu"] = "no CUDA device"
    except Exception as exc:  # torch is a hard dependency; report rather than crash
        info["torch"] = f"unavailable ({exc})"
        info["gpu"] = "no CUDA device"
    info["triton"] = _version("triton")
    info["triton_interpret"] = envvars.triton_interpret()
    cupy = None
    for name in ("cupy-cuda13x", "cupy-cuda12x", "cupy"):
        cupy = cupy or _version(name)
    info["cupy"] = cupy
    nccl = None
    for name in ("nvidia-nccl-cu13", "nvidia-nccl-cu12"):
        nccl = nccl or _version(name)
    info["nccl"] = nccl
    has_gpu = info.get("gpu") != "no CUDA device"
    triton_runs = info["triton"] is not None and (has_gpu or info["triton_interpret"])
    backends = {"reference": True,
                "triton" + ("" if has_gpu else " (CPU: only with TRITON_INTERPRET=1)"): triton_runs,
                "cuda (NVRTC through CuPy)": cupy is not None and has_gpu}
    # the Gluon MLA kernel: the rule an MLA plan applies (Kimi-K2 / DeepSeek-V3 sizes: latent 512, rope 64)
    gluon_ok = False
    if has_gpu:
        from specverify.attention import _wgmma_default

        gluon_ok = _wgmma_default(torch.device("cuda", 0), d=512, dr=64, dv=512)
    backends["gluon wgmma MLA attention (sm_90, Triton 3.6)"] = gluon_ok
    try:
        importlib.import_module("sglang")
        backends["sglang peer kernels"] = True
    except Exception:
        backends["sglang peer kernels"] = False
    info["backends"] = backends
    info["cache_dir"] = str(envvars.cache_dir())
    info["env_vars"] = envvars.snapshot()
    return info


def output_path_problem(path: str) -> str | None:
    """Why a file cannot be written at ``path`` (one clause that names the fix), or None when it can.

    The rule every subcommand applies to its output flags (``--json``, ``--plot``, ``--csv``) before any work, so a
    long run never ends in a traceback at its last step: the path is not empty and not a directory, its parent
    directory exists and is writable, and an existing file there is writable.
    """
    if not path:
        return "the path is empty; name a file, e.g. out.json"
    if os.path.isdir(path):
        return f"{path} is a directory; name a file inside it, e.g. {os.path.join(path, 'out.json')}"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(parent):
        return f"directory {parent} does not exist; create it (mkdir -p {parent}) or choose another path"
    if not os.path.isdir(parent):
        return f"{parent} is not a directory; choose another path"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"directory {parent} is not writable; choose another path"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return f"{path} exists and is not writable; choose another path or make it writable"
    return None


def check_output_paths(paths: dict) -> None:
    """Raise ``ValueError`` for the first ``{flag: path}`` entry that cannot be written (None entries: flag not
    given), naming the flag, the path and the fix (:func:`output_path_problem`)."""
    for flag, path in paths.items():
        if path is None:
            continue
        problem = output_path_problem(path)
        if problem:
            raise ValueError(f"{flag} {path!r}: {problem}")


def _print_env(info: dict) -> None:
    width = max(len(k) for k in info)
    for key, value in info.items():
        if isinstance(value, dict):
            print(f"{key:<{width}} :")
            inner = max((len(k2) for k2 in value), default=0)
            for k2, v2 in value.items():
                print(f"  {k2:<{inner}} {v2}")
        else:
            print(f"{key:<{width}} : {value}")


def _cmd_env(args) -> int:
    info = collect_env()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_env(info)
    return 0


def _cmd_build(args) -> int:
    try:
        jit = importlib.import_module("specverify.jit")
    except ImportError as exc:
        print(f"specverify build: the JIT module is not available ({exc})", file=sys.stderr)
        return 1
    try:
        built = jit.build_all()
    except Exception as exc:
        print(f"specverify build: {exc}", file=sys.stderr)
        return 1
    for item in built or []:
        print(f"built {item}")
    return 0


def _cmd_clear_cache(args) -> int:
    from specverify import envvars

    try:
        jit = importlib.import_module("specverify.jit")
        removed = jit.clear_cache()
    except ImportError:
        import shutil

        path = envvars.cache_dir()
        removed = path.exists()
        shutil.rmtree(path, ignore_errors=True)
    print(f"cleared {envvars.cache_dir()}" if removed else f"nothing to clear at {envvars.cache_dir()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specverify", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version('specverify-kernels')}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    text = "versions, GPU, backends and the JIT cache directory"
    p = sub.add_parser("env", help=text, description=text)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_env)
    text = "compile the CUDA sources into the JIT cache ahead of time"
    p = sub.add_parser("build", help=text, description=text)
    p.set_defaults(func=_cmd_build)
    p = sub.add_parser("clear-cache", help="delete the JIT cache", description="delete the JIT cache")
    p.set_defaults(func=_cmd_clear_cache)
    bench = sub.add_parser("bench", help="benchmarks: verify-wall (the main job)")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    from specverify import verify_wall

    verify_wall.register_cli(bench_sub)
    try:
        from specverify.plan import register_cli as register_plan

        register_plan(sub)
    except ImportError:  # pragma: no cover - plan ships with the package
        pass
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # e.g. `specverify env --json | head`: the reader left; stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
