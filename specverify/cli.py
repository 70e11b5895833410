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
import sys

from specverify.env_report import collect_env, package_version


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
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {package_version('specverify-kernels')}")
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
