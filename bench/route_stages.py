"""The router's stage prices from ``bench/sweep_moe.py --ops route`` JSON: where the alignment's time goes.

Reads the rows of one or more sweep JSON files and, per model and M, prints the graph µs of the launch floor (an
empty kernel), the router alone, the three timing-only cuts of the router + alignment (``fast cut route``: the
routing programs with their atomics; ``fast cut ticket``: + the ticket; ``fast cut loads``: + the last program's
loads) and the whole default (``fast``), then the increments between them:

    atomics = cut route - router only      ticket = cut ticket - cut route
    loads   = cut loads - cut ticket       finish = fast - cut loads   (the last program's compute and stores)

``--prefix "fast no mask"`` reads the same cuts of that variant instead. The one-program path (M <= 2 at top-8) has
no stages: its cut rows equal its whole rows. A missing row leaves its cells blank.

Usage: ``python bench/route_stages.py RUN.json [RUN.json ...] [--prefix LABEL] [--markdown]``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

STAGES = ("empty kernel (launch floor)", "router only", "{p} cut route", "{p} cut ticket", "{p} cut loads", "{p}")
STEPS = (("atomics", 2, 1), ("ticket", 3, 2), ("loads", 4, 3), ("finish", 5, 4))


def stage_table(rows: list[dict], prefix: str = "fast") -> list[dict]:
    """One dict per (model, M) that has a row of the variant, in the order first seen: ``us`` (the stage labels to
    µs; NaN where missing) and ``steps`` (the increments of ``STEPS`` to µs)."""
    labels = [s.format(p=prefix) for s in STAGES]
    found: dict[tuple, dict] = {}
    for r in rows:
        if r.get("variant") in labels and r.get("op") in ("route", "route+align"):
            found.setdefault((r["model"], r["m"]), {})[r["variant"]] = float(r["us"])
    out = []
    for (model, m), got in found.items():
        if not any(lab in got for lab in labels[2:]):  # none of this variant's rows at this M
            continue
        us = [got.get(lab, math.nan) for lab in labels]
        steps = {name: us[a] - us[b] for name, a, b in STEPS}
        out.append(dict(model=model, m=m, us=dict(zip(labels, us)), steps=steps))
    return out


def _fmt(v: float) -> str:
    return "" if math.isnan(v) else f"{v:.2f}"


def render(table: list[dict], prefix: str, markdown: bool) -> str:
    cols = ["model", "M", "empty", "router", "cut route", "cut ticket", "cut loads", prefix] + [s[0] for s in STEPS]
    lines = []
    if markdown:
        lines.append("| " + " | ".join(cols) + " |")
        lines.append("| " + " | ".join("---" for _ in cols) + " |")
    else:
        lines.append("  ".join(f"{c:>10}" for c in cols))
    for t in table:
        cells = [t["model"], str(t["m"])] + [_fmt(v) for v in t["us"].values()] + [_fmt(v) for v in t["steps"].values()]
        lines.append("| " + " | ".join(cells) + " |" if markdown else "  ".join(f"{c:>10}" for c in cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", help="sweep_moe.py --json outputs")
    ap.add_argument("--prefix", default="fast", help='router variant whose cuts are read (default: "fast")')
    ap.add_argument("--markdown", action="store_true", help="a Markdown table (for bench/RESULTS.md)")
    args = ap.parse_args(argv)
    rows = []
    for path in args.json:
        with open(path) as f:
            rows += json.load(f)["rows"]
    table = stage_table(rows, args.prefix)
    if not table:
        print(f"route_stages: no router rows of {args.prefix!r} in {', '.join(args.json)}", file=sys.stderr)
        return 1
    print(render(table, args.prefix, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
