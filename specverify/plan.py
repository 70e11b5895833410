"""Planning draft lengths: expected accept length, tokens per second and break-even, from measured costs.

The math shared by :class:`specverify.DraftLengthController` (online) and ``specverify plan`` (offline).

Conventions (the project's, after SGLang's): a verify pass holds ``k`` = ``num_draft_tokens`` tree nodes, node 0
being the last verified token, so a chain of k nodes proposes k - 1 tokens and k = 1 is a plain decode step.
``accept_length`` counts accepted *proposed* tokens (0..k-1 for a chain); every verify pass also emits one token
of its own (the target's choice after the last accepted node, the "bonus" token), so

    emitted tokens per cycle = accept_length + 1.

One cycle costs ``draft_ms * draft_steps(k) + verify_ms(k)``, with ``draft_steps(k) = k - 1`` for a chain (one
draft step per proposed token) and the tree depth for a tree (one draft step per level). Plain decoding costs
``decode_ms`` per token, so speculation pays when

    E[emitted] / cycle_ms(k)  >  1 / decode_ms,   i.e.   E[emitted] > cycle_ms(k) / decode_ms.

``cycle_ms(k) / decode_ms`` is the *break-even emitted count*; minus one, the *break-even accept length*. A metric
that counts the bonus token with the accepted ones compares with the emitted figure.

Formulas
--------
Chain (Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative Decoding", eq. 1, there
for an i.i.d. rate; here with a conditional rate ``a_i`` per position, the probability that proposed token i is
accepted given tokens 1..i-1 were):

    E[emitted](k) = 1 + sum_{i=1}^{k-1} prod_{j=1}^{i} a_j

which for a constant rate a is (1 - a^k) / (1 - a), Leviathan et al.'s (1 - a^(gamma+1)) / (1 - a) with
gamma = k - 1 proposed tokens.

Tree (the expected-length count of SpecInfer, Miao et al. 2024, and Medusa, Cai et al. 2024): a node's token is
accepted only if every node on its path from the root is, and siblings are mutually exclusive, so

    E[emitted](tree) = 1 + sum_{n != root} prod_{m in path(root -> n), m != root} p_m

where ``p_m`` is the probability node m is accepted given its parent was (for siblings, the marginal probability
that this sibling is the one accepted). A chain is the tree whose nodes each have one child.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from specverify.output_paths import check_output_paths

__all__ = [
    "PlanRow",
    "best_k",
    "break_even_emitted",
    "expected_emitted_chain",
    "expected_emitted_tree",
    "expected_emitted_depths",
    "parse_accept",
    "parse_verify_ms",
    "plan_draft_lengths",
    "load_verify_wall_json",
    "register_cli",
    "run_plan_cli",
]


# ----------------------------------------------------------------------------------------------------------- math
def _check_rate(name: str, value: float) -> float:
    v = float(value)
    if not (0.0 <= v <= 1.0) or math.isnan(v):
        raise ValueError(f"{name} must be an acceptance probability in [0, 1], got {value!r}; pass a rate such "
                         "as 0.7")
    return v


def _rates(accept: float | Sequence[float], name: str = "accept") -> list[float]:
    if isinstance(accept, (int, float)):
        return [_check_rate(name, accept)]
    rates = [_check_rate(f"{name}[{i}]", a) for i, a in enumerate(accept)]
    if not rates:
        raise ValueError(f"{name} must hold at least one acceptance rate, got an empty sequence; pass e.g. [0.7] "
                         "or 0.7")
    return rates


def _check_k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k (num_draft_tokens, root included) must be an int >= 1, got {k!r}; k = 1 is a plain "
                         "decode step")
    return k


def expected_emitted_depths(accept: float | Sequence[float], depth: int) -> float:
    """Expected tokens emitted by one verify pass whose deepest accepted path has ``depth`` proposed tokens.

    ``1 + sum_{i=1}^{depth} prod_{j<=i} a_j``. Rates past the end of ``accept`` repeat its last rate (a single
    float is a constant rate).

    Parameters
    ----------
    accept : float or sequence of float
        Conditional acceptance per position (chain) or per depth (tree), each in [0, 1].
    depth : int
        Number of proposed positions, ``k - 1`` for a chain of k nodes; >= 0.

    Returns
    -------
    float
        Expected emitted tokens (accept length + the bonus token), in [1, depth + 1].

    Raises
    ------
    ValueError
        A rate outside [0, 1], an empty rate list, or a negative depth.

    Examples
    --------
    >>> round(expected_emitted_depths([0.5, 0.5], 2), 6)
    1.75
    """
    rates = _rates(accept)
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"depth must be an int >= 0, got {depth!r}")
    total, prod = 1.0, 1.0
    for i in range(depth):
        prod *= rates[min(i, len(rates) - 1)]
        total += prod
    return total


def expected_emitted_chain(accept: float | Sequence[float], k: int) -> float:
    """Expected tokens emitted per verify pass of a chain of ``k`` nodes (Leviathan et al. 2023).

    ``E[emitted] = 1 + sum_{i=1}^{k-1} prod_{j=1}^{i} a_j``; the expected accept length is this minus one. For a
    constant rate ``a`` it equals ``(1 - a**k) / (1 - a)``.

    Parameters
    ----------
    accept : float or sequence of float
        Per-position conditional acceptance ``a_1, a_2, ...`` (position i accepted given 1..i-1 were). A single
        float is a constant rate; a list shorter than k - 1 repeats its last rate.
    k : int
        Nodes in the chain, the last verified token included (k - 1 proposed tokens); k = 1 is plain decode.

    Returns
    -------
    float
        Expected emitted tokens, in [1, k].

    Raises
    ------
    ValueError
        ``k < 1``, a rate outside [0, 1], or an empty rate list.

    Examples
    --------
    >>> expected_emitted_chain(0.5, 3)  # 1 + 0.5 + 0.25
    1.75
    >>> expected_emitted_chain([0.63, 0.40, 0.26], 1)
    1.0
    """
    return expected_emitted_depths(accept, _check_k(k) - 1)


def expected_emitted_tree(parents: Sequence[int] | object, node_accept: Sequence[float]) -> float:
    """Expected tokens emitted per verify pass of a draft tree (SpecInfer / Medusa expected length).

    ``E[emitted] = 1 + sum_{n != 0} prod_{m on the path 0 -> n, m != 0} p_m``: a node counts when every node on
    its path is accepted; siblings exclude each other, so ``p`` of siblings should sum to at most 1.

    Parameters
    ----------
    parents : sequence of int or DraftTree
        ``parents[i]`` is node i's parent, ``parents[0] == -1``, parents before children (a
        :class:`specverify.DraftTree` is accepted as is).
    node_accept : sequence of float
        Length ``num_nodes``; ``node_accept[i]`` is the probability node i is accepted given its parent was
        (entry 0, the root, is ignored: the root is already verified).

    Returns
    -------
    float
        Expected emitted tokens, in [1, tree depth + 1] when sibling probabilities sum to at most 1.

    Raises
    ------
    ValueError
        Malformed parents, a length mismatch, a rate outside [0, 1], or siblings whose rates sum above 1.

    Examples
    --------
    >>> expected_emitted_tree([-1, 0, 1], [1.0, 0.5, 0.5])  # the chain of 3 at rate 0.5
    1.75
    >>> expected_emitted_tree([-1, 0, 0], [1.0, 0.5, 0.3])  # two alternatives for one position
    1.8
    """
    par = list(getattr(parents, "parents", parents))
    n = len(par)
    if n == 0 or par[0] != -1:
        raise ValueError(f"parents must start with the root (-1), got {par!r}; pass e.g. [-1, 0, 0]")
    for i in range(1, n):
        if not 0 <= par[i] < i:
            raise ValueError(f"node {i} has parent {par[i]}; parents must come before their children")
    if len(node_accept) != n:
        raise ValueError(f"node_accept must have one rate per node ({n}), got {len(node_accept)}")
    p = [1.0] + [_check_rate(f"node_accept[{i}]", node_accept[i]) for i in range(1, n)]
    sibling_sum: dict[int, float] = {}
    for i in range(1, n):
        sibling_sum[par[i]] = sibling_sum.get(par[i], 0.0) + p[i]
    for parent, s in sibling_sum.items():
        if s > 1.0 + 1e-9:
            raise ValueError(f"the children of node {parent} have acceptance rates summing to {s:.4g} > 1; "
                             "siblings are mutually exclusive, pass marginal rates that sum to at most 1")
    reach = [1.0] * n  # probability the whole path root -> i is accepted
    for i in range(1, n):
        reach[i] = reach[par[i]] * p[i]
    return 1.0 + sum(reach[1:])


def break_even_emitted(cycle_ms: float, decode_ms: float) -> float:
    """Emitted tokens per cycle at which speculation ties with plain decoding: ``cycle_ms / decode_ms``.

    Subtract one for the break-even accept length (accepted proposed tokens).

    Examples
    --------
    >>> round(break_even_emitted(25.6, 11.1), 4)
    2.3063
    """
    if not decode_ms > 0:
        raise ValueError(f"decode_ms must be > 0, got {decode_ms!r}")
    return float(cycle_ms) / float(decode_ms)


@dataclass(frozen=True)
class PlanRow:
    """One draft length's plan. Times in ms, rates in tokens per second; ``pays`` is speed-up > 1 at k > 1 (k = 1 is
    plain decoding and never pays)."""

    k: int
    draft_steps: int
    verify_ms: float
    draft_ms: float          # total draft time of the cycle: draft_ms per step * draft_steps
    cycle_ms: float          # draft_ms + verify_ms
    expected_accept_length: float
    expected_emitted: float  # expected_accept_length + 1
    tokens_per_s: float      # 1000 * expected_emitted / cycle_ms
    speedup: float           # tokens_per_s / (1000 / decode_ms)
    break_even_emitted: float
    break_even_accept_length: float
    pays: bool

    def as_dict(self) -> dict:
        return asdict(self)


def plan_draft_lengths(decode_ms: float, verify_ms: Mapping[int, float], accept: float | Sequence[float],
                       draft_ms: float = 0.0, *, draft_steps: Mapping[int, int] | None = None,
                       expected_emitted: Mapping[int, float] | None = None,
                       draft_cycle_ms: Mapping[int, float] | None = None) -> list[PlanRow]:
    """Expected accept length, tokens/s, speed-up and break-even for each draft length k.

    For each k in ``verify_ms`` (ascending): ``cycle_ms = draft_ms * draft_steps(k) + verify_ms[k]``,
    ``E[emitted]`` by :func:`expected_emitted_chain` (or taken from ``expected_emitted``, e.g. a tree's),
    ``tokens_per_s = 1000 * E[emitted] / cycle_ms``, ``speedup = tokens_per_s * decode_ms / 1000``,
    ``break_even_emitted = cycle_ms / decode_ms`` and ``break_even_accept_length = max(0, break_even_emitted - 1)``
    (0 when a cycle costs no more than a decode step, which only noisy or CPU measurements give).

    Parameters
    ----------
    decode_ms : float
        Time of one plain decode step (k = 1, no drafter), > 0.
    verify_ms : mapping int -> float
        Verify pass time per k (root included). Include k = 1 to plan plain decoding with the verify path's cost;
        otherwise no k = 1 row is made.
    accept : float or sequence of float
        Per-position conditional acceptance (a single float is a constant rate; a short list repeats its last).
    draft_ms : float, default 0.0
        Drafter time per draft step.
    draft_steps : mapping int -> int, optional
        Draft steps per cycle for each k; default ``k - 1`` (a chain). For a tree pass its depth.
    expected_emitted : mapping int -> float, optional
        Overrides the chain formula per k (e.g. :func:`expected_emitted_tree` of the tree used at that k, or the
        tokens per cycle a server logged: SGLang's "accept len").
    draft_cycle_ms : mapping int -> float, optional
        The drafter's whole time per cycle for each k (draft steps plus, e.g., the draft model's re-extend over the
        accepted tokens), overriding ``draft_ms * draft_steps(k)`` where given.

    Returns
    -------
    list of PlanRow
        One row per k, ascending.

    Raises
    ------
    ValueError
        Non-positive times, an empty ``verify_ms``, k < 1, or a rate outside [0, 1].

    Examples
    --------
    The motivating case (decode 11.1 ms; verify 25.6 ms for 3 drafts, 28.7 ms for 6):

    >>> rows = plan_draft_lengths(11.1, {4: 25.6, 7: 28.7}, [0.63, 0.40, 0.26])
    >>> [round(r.break_even_emitted, 3) for r in rows]
    [2.306, 2.586]
    >>> [r.pays for r in rows]
    [False, False]
    """
    if not decode_ms > 0 or math.isinf(decode_ms):
        raise ValueError(f"decode_ms must be a finite time > 0, got {decode_ms!r}")
    if not verify_ms:
        raise ValueError("verify_ms must hold at least one k -> ms entry, got none; pass e.g. {1: 11.1, 4: 25.6}")
    if not draft_ms >= 0 or math.isinf(draft_ms):
        raise ValueError(f"draft_ms must be a finite time >= 0, got {draft_ms!r}")
    rates = _rates(accept)
    rows = []
    for k in sorted(verify_ms):
        _check_k(k)
        v = float(verify_ms[k])
        if not v > 0 or math.isinf(v):
            raise ValueError(f"verify_ms[{k}] must be a finite time > 0, got {verify_ms[k]!r}")
        steps = (k - 1) if draft_steps is None else int(draft_steps[k])
        d = float(draft_ms) * steps if draft_cycle_ms is None or k not in draft_cycle_ms else \
            float(draft_cycle_ms[k])
        if not d >= 0 or math.isinf(d):
            raise ValueError(f"the draft time of k = {k} must be a finite time >= 0, got {d!r}")
        cycle = d + v
        e = expected_emitted_chain(rates, k) if expected_emitted is None else float(expected_emitted[k])
        tps = 1000.0 * e / cycle
        be = break_even_emitted(cycle, decode_ms)
        rows.append(PlanRow(k=k, draft_steps=steps, verify_ms=v, draft_ms=d, cycle_ms=cycle,
                            expected_accept_length=e - 1.0, expected_emitted=e, tokens_per_s=tps,
                            speedup=tps * decode_ms / 1000.0, break_even_emitted=be,
                            break_even_accept_length=be - 1.0 if be - 1.0 > 1e-9 else 0.0,
                            pays=k > 1 and e > be))  # k = 1 is plain decoding: nothing to pay for
    return rows


def best_k(rows: Sequence[PlanRow]) -> int:
    """The k with the highest tokens per second (the smaller k on a tie).

    Raises
    ------
    ValueError
        No rows.
    """
    if not rows:
        raise ValueError("best_k needs at least one plan row, got none")
    return max(rows, key=lambda r: (r.tokens_per_s, -r.k)).k


# ---------------------------------------------------------------------------------------------------- parsing
def parse_verify_ms(text: str, name: str = "--verify-ms") -> dict[int, float]:
    """``"1:11.1,4:25.6"`` -> ``{1: 11.1, 4: 25.6}``.

    Raises
    ------
    ValueError
        An entry that is not ``k:ms`` with int k >= 1 and a time > 0, or a k given twice.
    """
    out: dict[int, float] = {}
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            ks, ms = part.split(":")
            k, v = int(ks), float(ms)
        except ValueError:
            raise ValueError(f"{name} entries must be k:ms, e.g. 1:11.1,4:25.6; got {part!r}") from None
        if k < 1 or not (v > 0 or (v == 0 and name != "--verify-ms")):
            raise ValueError(f"{name} entry {part!r} needs k >= 1 and ms {'>= 0' if name != '--verify-ms' else '> 0'}")
        if k in out:
            raise ValueError(f"{name} gives k = {k} twice; give each k once")
        out[k] = v
    if not out:
        raise ValueError(f"{name} must hold at least one k:ms entry, got {text!r}")
    return out


def parse_accept(text: str) -> list[float]:
    """``"0.63,0.40,0.26"`` or ``"0.7"`` -> list of rates in [0, 1]."""
    try:
        rates = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--accept must be rates like 0.63,0.40,0.26 or one rate like 0.7, got {text!r}") from None
    return _rates(rates, "--accept")


def load_verify_wall_json(path: str, provider: str | None = None, batch: int | None = None
                          ) -> tuple[dict[int, float], float | None, str]:
    """Verify times per k and the decode time from a ``specverify bench verify-wall`` JSON file.

    Reads rows (a list, or a dict holding ``"rows"``) with keys ``provider``, ``k``, ``verify_ms_median`` and
    ``decode_ms``; keeps one provider (``provider``, else ``specverify`` when present, else the first) and, when
    rows carry ``batch``, one batch size.

    Returns
    -------
    (verify_ms, decode_ms, provider)
        ``decode_ms`` is None when the rows carry none.

    Raises
    ------
    ValueError
        No usable rows, an unknown provider, rows for several batch sizes without ``batch``, a k twice, or rows
        that disagree on ``decode_ms``.
    """
    not_wall = f"{path} is not a verify-wall JSON"
    with open(path) as f:
        try:
            data = json.load(f)
        except ValueError as exc:  # JSONDecodeError, or UnicodeDecodeError for a binary file
            raise ValueError(f"{not_wall}: {exc}") from None
    rows = data.get("rows", data) if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise ValueError(f"{not_wall}: expected a list of verify-wall rows or a dict with 'rows', got "
                         f"{type(rows).__name__}")
    rows = [r for r in rows if isinstance(r, dict) and "k" in r and "verify_ms_median" in r]
    if not rows:
        raise ValueError(f"{not_wall}: no rows with keys 'k' and 'verify_ms_median' (write one with "
                         "specverify bench verify-wall --json PATH)")
    for r in rows:
        try:
            int(r["k"])
            if r.get("decode_ms") is not None:
                float(r["decode_ms"])
        except (TypeError, ValueError):
            raise ValueError(f"{not_wall}: a row has k = {r['k']!r}, decode_ms = {r.get('decode_ms')!r}; expected "
                             "an integer k and a number of ms") from None
    providers = list(dict.fromkeys(str(r.get("provider")) for r in rows))
    if provider is None:
        provider = "specverify" if "specverify" in providers else providers[0]
    if provider not in providers:
        raise ValueError(f"{path}: no rows for provider {provider!r}; the file holds {providers}")
    rows = [r for r in rows if str(r.get("provider")) == provider]
    batches = sorted({r["batch"] for r in rows if "batch" in r})
    if batch is not None:
        rows = [r for r in rows if r.get("batch", batch) == batch]
        if not rows:
            raise ValueError(f"{path}: provider {provider!r} has no rows for batch {batch}; it has {batches}")
    elif len(batches) > 1:
        raise ValueError(f"{path}: provider {provider!r} has rows for batch sizes {batches}; pick one with "
                         "--batch")
    verify: dict[int, float] = {}
    decodes = set()
    for r in rows:
        k = int(r["k"])
        if k in verify:
            raise ValueError(f"{path}: provider {provider!r} has two rows for k = {k}; filter the file to one "
                             "configuration")
        try:
            verify[k] = float(r["verify_ms_median"])
        except (TypeError, ValueError):  # null: verify-wall writes a failed measurement's NaN as null
            raise ValueError(f"{path}: provider {provider!r} has no verify time at k = {k} (verify_ms_median = "
                             f"{r['verify_ms_median']!r}: that measurement failed, see the file's notes); pick "
                             "another --provider or re-run verify-wall") from None
        if r.get("decode_ms") is not None:
            decodes.add(round(float(r["decode_ms"]), 9))
    if len(decodes) > 1:
        raise ValueError(f"{path}: rows disagree on decode_ms ({sorted(decodes)}); pass --decode-ms")
    return verify, (decodes.pop() if decodes else None), provider


# ------------------------------------------------------------------------------------------------------- CLI
_COLUMNS = [("k", "k", "{:d}"), ("verify ms", "verify_ms", "{:.3f}"), ("draft ms", "draft_ms", "{:.3f}"),
            ("cycle ms", "cycle_ms", "{:.3f}"), ("accepted drafts", "expected_accept_length", "{:.3f}"),
            ("tokens/cycle (SGLang's accept len)", "expected_emitted", "{:.3f}"), ("tokens/s", "tokens_per_s", "{:.1f}"),
            ("speed-up", "speedup", "{:.3f}x"), ("break-even drafts", "break_even_accept_length", "{:.3f}"),
            ("break-even tokens/cycle", "break_even_emitted", "{:.3f}"), ("pays", "pays", "{}")]


def _format_table(rows: Sequence[PlanRow], title: str) -> str:
    cells = [[c[0] for c in _COLUMNS]]
    for r in rows:
        d = r.as_dict()
        cells.append([fmt.format("yes" if d[key] is True else "no" if d[key] is False else d[key])
                      if key == "pays" else fmt.format(d[key]) for _, key, fmt in _COLUMNS])
    widths = [max(len(row[i]) for row in cells) for i in range(len(_COLUMNS))]
    lines = [title, "  ".join(h.rjust(w) for h, w in zip(cells[0], widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells[1:]]
    return "\n".join(lines)


def _print_table(rows: Sequence[PlanRow], title: str, file=None) -> None:
    file = file or sys.stdout
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(_format_table(rows, title), file=file)
        return
    table = Table(title=title)
    for head, _, _ in _COLUMNS:
        table.add_column(head, justify="right")
    for r in rows:
        d = r.as_dict()
        table.add_row(*[("yes" if d[key] else "no") if key == "pays" else fmt.format(d[key])
                        for _, key, fmt in _COLUMNS])
    Console(file=file, width=160, markup=False).print(table)


def register_cli(subparsers) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to an ``argparse`` subparsers object; its handler is ``args.func``."""
    p = subparsers.add_parser(
        "plan", help="expected accept length, tokens/s, speed-up and break-even per draft length",
        description="Plan draft lengths from measured decode and verify times and an acceptance model. "
                    "E[emitted](k) = 1 + sum_{i<k} prod_{j<=i} a_j (Leviathan et al. 2023); cycle = draft_ms * "
                    "(k - 1) + verify_ms(k); speculation pays when E[emitted] > cycle / decode_ms.")
    p.add_argument("--decode-ms", type=float, default=None,
                   help="plain decode step time in ms (required unless --from-json rows carry decode_ms)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--verify-ms", default=None, help='verify time per k, e.g. "1:11.1,4:25.6,7:28.7"')
    src.add_argument("--from-json", default=None, metavar="PATH",
                     help="verify-wall JSON rows (keys provider, k, verify_ms_median, decode_ms)")
    p.add_argument("--provider", default=None, help="provider to read from --from-json (default: specverify, "
                                                     "else the first)")
    p.add_argument("--batch", type=int, default=None, help="batch size to read from --from-json")
    acc = p.add_mutually_exclusive_group(required=True)
    acc.add_argument("--accept",
                     help="per-position acceptance, e.g. 0.63,0.40,0.26 (last repeats), or one rate, e.g. 0.7")
    acc.add_argument("--sglang-accept-length", type=float, default=None, metavar="TOKENS",
                     help="SGLang's logged accept length (tokens emitted per verify cycle, bonus token included), "
                          "e.g. 2.1: taken as measured for every k given, instead of an acceptance model")
    p.add_argument("--draft-ms", type=float, default=0.0, help="drafter time per draft step in ms (default 0)")
    p.add_argument("--draft-cycle-ms", default=None, metavar="K:MS,...",
                   help='the drafter\'s whole time per cycle for each k, e.g. "3:1.37,6:1.2" (draft steps plus its '
                        're-extend); overrides --draft-ms where given')
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write JSON rows to PATH (or stdout with no PATH) instead of the table")
    p.set_defaults(func=run_plan_cli)
    return p


def _measured_on_cpu(path: str) -> bool:
    """Whether a verify-wall JSON says it ran without a GPU (its notes carry the CPU caveat)."""
    try:
        with open(path) as f:
            meta = json.load(f).get("meta", {})
    except (OSError, ValueError, AttributeError):
        return False
    return any("not performance figures" in str(n) for n in meta.get("notes", []))


def run_plan_cli(args: argparse.Namespace) -> int:
    """Handler of ``specverify plan``; returns the exit status (2 on a bad input, with the reason on stderr)."""
    try:
        check_output_paths({"--json": None if args.json in (None, "-") else args.json})  # before any work
        provider = None
        decode_ms = args.decode_ms
        if args.from_json:
            try:
                loaded = load_verify_wall_json(args.from_json, args.provider, args.batch)
            except OSError as exc:
                raise ValueError(f"cannot read --from-json {args.from_json!r}: {exc.strerror or exc}") from None
            verify, json_decode, provider = loaded
            if decode_ms is None:
                decode_ms = json_decode
        else:
            verify = parse_verify_ms(args.verify_ms)
        if decode_ms is None:
            raise ValueError("--decode-ms is required (the JSON rows carry no decode_ms)" if args.from_json else
                             "--decode-ms is required with --verify-ms (ms of one plain decode step)")
        cycle_draft = parse_verify_ms(args.draft_cycle_ms, name="--draft-cycle-ms") if args.draft_cycle_ms \
            else None
        emitted = None
        if args.sglang_accept_length is not None:
            tokens = args.sglang_accept_length
            if not 1.0 <= tokens or math.isinf(tokens):
                raise ValueError(f"--sglang-accept-length must be >= 1 (SGLang counts the bonus token: tokens "
                                 f"emitted per verify cycle), got {tokens!r}")
            if tokens > max(verify):
                raise ValueError(f"--sglang-accept-length {tokens:g} is more tokens than a cycle of k = "
                                 f"{max(verify)} can emit")
            accept, emitted = [], {k: (1.0 if k == 1 else min(tokens, float(k))) for k in verify}
        else:
            accept = parse_accept(args.accept)
        rows = plan_draft_lengths(decode_ms, verify, accept or 0.0, args.draft_ms, expected_emitted=emitted,
                                  draft_cycle_ms=cycle_draft)
    except (ValueError, OSError) as e:
        print(f"specverify plan: error: {e}", file=sys.stderr)
        return 2
    k_best = best_k(rows)
    if args.json is not None:
        payload = {"decode_ms": decode_ms, "draft_ms_per_step": args.draft_ms, "accept": accept,
                   "provider": provider, "best_k": k_best, "rows": [r.as_dict() for r in rows]}
        text = json.dumps(payload, indent=2)
        if args.json == "-":
            print(text)
        else:
            try:  # checked up front, but the folder can still have gone away
                with open(args.json, "w") as f:
                    f.write(text + "\n")
            except OSError as exc:
                print(f"specverify plan: error: could not write --json {args.json!r}: {exc}", file=sys.stderr)
                return 1
            print(f"wrote {args.json}")
        return 0
    src = f" ({provider} from {args.from_json})" if provider else ""
    draft = f"draft {args.draft_cycle_ms} ms a cycle" if args.draft_cycle_ms else f"draft {args.draft_ms:g} ms/step"
    rate = (f"{args.sglang_accept_length:g} tokens a cycle (SGLang's accept length)"
            if args.sglang_accept_length is not None else f"accept {accept}")
    title = f"plan: decode {decode_ms:g} ms{src}, {draft}, {rate}"
    _print_table(rows, title)
    if args.from_json and _measured_on_cpu(args.from_json):
        print(f"note: {args.from_json} was measured without a GPU: its times are not performance figures, so "
              "neither is this plan")
    max_k = max(verify)
    if accept and len(accept) < max_k - 1 and len(accept) > 1:
        print(f"note: positions beyond {len(accept)} use the last rate {accept[-1]:g}")
    best = next(r for r in rows if r.k == k_best)
    if best.speedup > 1.0:
        print(f"best k = {k_best}: {best.tokens_per_s:.1f} tokens/s, {best.speedup:.3f}x over decode")
    else:
        print(f"no draft length pays at these rates: plain decoding (k = 1) is as fast or faster (closest: k = "
              f"{k_best}, {best.tokens_per_s:.1f} tokens/s, {best.speedup:.3f}x)")
    return 0
