"""Which allreduce algorithm to run for a message size, world size and link: the one table, and how to refit it.

The table is a list of :class:`Rule`; the first rule whose link matches, whose world-size range holds the world
size and whose ``max_bytes`` is at least the message size names the algorithm. A message larger than every rule
of its link goes to NCCL.

Default figures (to be refit on the machine with ``bench/bench_allreduce.py --refit PATH``):

| link        | world | one-shot up to | two-shot up to | above   | why                                                        |
| ----------- | ----- | -------------- | -------------- | ------- | ---------------------------------------------------------- |
| nvlink      | 2-4   | 512 KiB        | 4 MiB          | NCCL    | one-shot reads (world-1)x the message, cheap on NVLink      |
| nvlink      | 5-8   | 128 KiB        | 2 MiB          | NCCL    | 56 KiB (TP 8, hidden 7168, k=4) stays one-shot              |
| pcie        | 2     | 64 KiB         | 512 KiB        | NCCL    | one-shot stops paying at ~64 KiB on PCIe (issue 7)          |
| pcie        | 3-8   | 32 KiB         | 256 KiB        | NCCL    | reads of (world-1)x the message share one PCIe switch        |
| same_device | 2-8   | 512 KiB        | 64 MiB         | NCCL    | ranks sharing one GPU (tests): NCCL cannot run there at all   |

These are starting points from public figures (see :mod:`specverify.comm.cost_model`), not measurements of ours.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

#: Algorithms a rule may name.
ALGOS = ("oneshot", "twoshot", "nccl")
#: Link types: NVLink (NVSwitch or direct), PCIe peer-to-peer, or several processes on one GPU.
LINKS = ("nvlink", "pcie", "same_device")

KiB = 1024
MiB = 1024 * 1024


@dataclass(frozen=True)
class Rule:
    """Run ``algo`` for messages of at most ``max_bytes`` on ``link`` with ``min_world <= world <= max_world``."""

    link: str
    min_world: int
    max_world: int
    max_bytes: int
    algo: str

    def __post_init__(self):
        if self.link not in LINKS:
            raise ValueError(f"Rule.link must be one of {LINKS}, got {self.link!r}")
        if self.algo not in ALGOS:
            raise ValueError(f"Rule.algo must be one of {ALGOS}, got {self.algo!r}")
        if not (1 <= self.min_world <= self.max_world):
            raise ValueError(
                f"Rule needs 1 <= min_world <= max_world, got min_world={self.min_world}, max_world={self.max_world}"
            )
        if self.max_bytes < 0:
            raise ValueError(f"Rule.max_bytes must be >= 0, got {self.max_bytes}")


DEFAULT_RULES: tuple[Rule, ...] = (
    Rule("nvlink", 2, 4, 512 * KiB, "oneshot"),
    Rule("nvlink", 2, 4, 4 * MiB, "twoshot"),
    Rule("nvlink", 5, 8, 128 * KiB, "oneshot"),
    Rule("nvlink", 5, 8, 2 * MiB, "twoshot"),
    Rule("pcie", 2, 2, 64 * KiB, "oneshot"),
    Rule("pcie", 2, 2, 512 * KiB, "twoshot"),
    Rule("pcie", 3, 8, 32 * KiB, "oneshot"),
    Rule("pcie", 3, 8, 256 * KiB, "twoshot"),
    Rule("same_device", 2, 8, 512 * KiB, "oneshot"),
    Rule("same_device", 2, 8, 64 * MiB, "twoshot"),
)


class ThresholdTable:
    """The algorithm table: ordered rules, first match wins (see the module docstring)."""

    def __init__(self, rules: Iterable[Rule] = DEFAULT_RULES, source: str = "defaults from public figures"):
        self.rules: tuple[Rule, ...] = tuple(rules)
        self.source = source

    def choose(self, nbytes: int, world_size: int, link: str) -> str:
        """``"oneshot"``, ``"twoshot"`` or ``"nccl"`` for a message of ``nbytes`` over ``world_size`` ranks on ``link``.

        Raises
        ------
        ValueError
            ``link`` unknown, ``nbytes < 0`` or ``world_size < 1``.
        """
        if link not in LINKS:
            raise ValueError(f"link must be one of {LINKS}, got {link!r}")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        for rule in self.rules:
            if rule.link == link and rule.min_world <= world_size <= rule.max_world and nbytes <= rule.max_bytes:
                return rule.algo
        return "nccl"

    def to_json(self) -> str:
        return json.dumps({"source": self.source, "rules": [asdict(r) for r in self.rules]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "ThresholdTable":
        data = json.loads(text)
        return cls((Rule(**r) for r in data["rules"]), source=data.get("source", "json"))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "ThresholdTable":
        return cls.from_json(Path(path).read_text())

    def __repr__(self) -> str:
        return f"ThresholdTable({len(self.rules)} rules, source={self.source!r})"


def refit(
    measurements: Sequence[dict], link: str, world_size: int, base: ThresholdTable | None = None
) -> ThresholdTable:
    """A table whose rules for (``link``, ``world_size``) come from measured latencies; other rules kept from ``base``.

    Parameters
    ----------
    measurements : sequence of dict
        Rows ``{"nbytes": int, "algo": "oneshot"|"twoshot"|"nccl", "us": float}`` (what
        ``bench/bench_allreduce.py --json`` writes). Every size should have a row for each algorithm that ran;
        a size where NCCL did not run is decided between the custom algorithms.
    link, world_size
        Which rows of the table to replace.
    base : ThresholdTable, optional
        The table to start from (defaults).

    Returns
    -------
    ThresholdTable
        For each size the fastest algorithm wins; the new rules are the largest size each algorithm won before a
        faster one took over, walking sizes upward (a custom algorithm never returns after NCCL wins).

    Raises
    ------
    ValueError
        No usable rows, or an unknown algorithm in a row.
    """
    base = base or ThresholdTable()
    best: dict[int, tuple[float, str]] = {}
    for row in measurements:
        algo = row["algo"]
        if algo not in ALGOS:
            raise ValueError(f"measurement algo must be one of {ALGOS}, got {algo!r}")
        nbytes, us = int(row["nbytes"]), float(row["us"])
        if nbytes not in best or us < best[nbytes][0]:
            best[nbytes] = (us, algo)
    if not best:
        raise ValueError("refit needs at least one measurement row {'nbytes', 'algo', 'us'}, got none")
    new_rules: list[Rule] = []
    current, last_size = None, 0
    for nbytes in sorted(best):
        algo = best[nbytes][1]
        if current is not None and algo != current:
            new_rules.append(Rule(link, world_size, world_size, last_size, current))
        if algo == "nccl":
            current = None
            break
        current, last_size = algo, nbytes
    if current is not None:  # custom won up to the largest size measured: keep it up to there
        new_rules.append(Rule(link, world_size, world_size, last_size, current))
    new_rules = [r for r in new_rules if r.algo != "nccl"]
    kept = [r for r in base.rules if not (r.link == link and r.min_world <= world_size <= r.max_world)]
    # The refit rows go first so they win over wider rules of the base that still cover this world size.
    others = [r for r in base.rules if r.link == link and r.min_world <= world_size <= r.max_world]
    split = []
    for r in others:  # keep the base's rules for the other world sizes of a range that included this one
        if r.min_world < world_size:
            split.append(Rule(r.link, r.min_world, world_size - 1, r.max_bytes, r.algo))
        if r.max_world > world_size:
            split.append(Rule(r.link, world_size + 1, r.max_world, r.max_bytes, r.algo))
    return ThresholdTable([*new_rules, *split, *kept], source=f"refit from {len(measurements)} measurements")


_TABLE = ThresholdTable()


def get_table() -> ThresholdTable:
    """The table in use by :class:`~specverify.comm.CustomAllReduce` (the defaults unless :func:`set_table` ran)."""
    return _TABLE


def set_table(table: ThresholdTable) -> None:
    """Replace the table in use (for example with one refit by the benchmark and loaded from JSON)."""
    global _TABLE
    if not isinstance(table, ThresholdTable):
        raise TypeError(f"set_table expects a ThresholdTable, got {type(table).__name__}")
    _TABLE = table


def choose(nbytes: int, world_size: int, link: str) -> str:
    """Shorthand for ``get_table().choose(nbytes, world_size, link)``."""
    return _TABLE.choose(nbytes, world_size, link)
