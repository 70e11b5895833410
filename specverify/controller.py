"""Pick the draft length at run time from observed acceptance and measured verify and draft costs.

The controller keeps, per batch bucket, an exponential moving average (EMA) of the conditional acceptance at each
draft position (chain) or depth (tree): ``a_d`` = P(the token at depth d is accepted | depths 1..d-1 were). From
these it predicts, for every candidate k, the expected emitted tokens per cycle (:mod:`specverify.plan`):

    E[emitted](k) = 1 + sum_{d=1}^{D(k)} prod_{j<=d} a_j,      D(k) = k - 1 (chain) or the tree's depth,

and the cycle time ``draft_ms * D(k) + verify_ms(bucket, k)``, and chooses the k with the most tokens per second.
It moves off the current k only when another k is predicted faster by more than ``hysteresis`` (relative).

Observation model. A verify pass at k that accepted ``L`` tokens tells us depths 1..L were accepted and, when
``L < D(k)``, that depth L + 1 was rejected; deeper depths were not tried. Depths not tried in a cycle relax
toward the estimate of the depth above them (rate ``alpha``), so after the acceptance rises while a short k is
in use, the deep estimates follow the shallow ones and the controller lengthens k again instead of staying on
stale values. At k = 1 nothing is observed, so every ``probe_interval`` choices at k = 1 the controller tries the
smallest k > 1 once.

For trees the per-depth model pools all tree shapes: it assumes the acceptance at a depth does not depend on the
tree's width, which under-credits wide trees. Feed it accept lengths (accepted depth) of the trees you verify.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence

from specverify.plan import expected_emitted_depths

__all__ = ["DraftLengthController"]


def _as_int_list(accept_lengths) -> list[int]:
    if hasattr(accept_lengths, "tolist"):  # torch / numpy: one host copy (a sync for a CUDA tensor)
        accept_lengths = accept_lengths.tolist()
    if isinstance(accept_lengths, (int,)) and not isinstance(accept_lengths, bool):
        return [int(accept_lengths)]
    if isinstance(accept_lengths, Iterable):
        out = []
        for x in accept_lengths:
            if isinstance(x, float) and not x.is_integer():
                raise ValueError(f"accept lengths must be whole numbers of accepted tokens, got {x!r}")
            out.append(int(x))
        return out
    raise TypeError(f"accept_lengths must be an int, a sequence of ints or an integer tensor, got "
                    f"{type(accept_lengths).__name__}")


class DraftLengthController:
    """Choose k (``num_draft_tokens``, root included) per batch bucket to maximise expected tokens per second.

    Parameters
    ----------
    verify_ms : mapping
        Verify pass time in ms, either ``{k: ms}`` (same for every bucket) or ``{(batch_bucket, k): ms}``. The
        candidates are its k values (per bucket). Include k = 1 (its time is the decode step through the verify
        path) to let the controller fall back to plain decoding.
    draft_ms : float or mapping, default 0.0
        Drafter time per draft step in ms; a mapping ``{batch_bucket: ms}`` for per-bucket costs.
    batch_buckets : sequence of int, optional
        Buckets for the EMA state. Default: the buckets named in ``verify_ms``, else ``(1,)``. A batch maps to
        the smallest bucket >= it (the largest bucket beyond).
    tree_depths : mapping int -> int, optional
        Depth D(k) of the tree verified at each k (tree mode: per-depth acceptance). Default: chains, D = k - 1.
    alpha : float, default 0.05
        EMA weight of one observed request at one depth (a cycle with n requests reaching a depth weighs
        ``1 - (1 - alpha)**n``); also the relaxation rate of depths not tried.
    hysteresis : float, default 0.03
        Relative predicted gain a new k needs over the current one before the controller switches.
    initial_accept : float, default 0.7
        Starting acceptance at every depth (optimistic starts explore long drafts first).
    probe_interval : int, default 16
        While at k = 1, try the smallest k > 1 every this many choices (0 disables).

    Raises
    ------
    ValueError
        Empty ``verify_ms``, k < 1, non-positive times, a rate outside [0, 1], bad buckets or parameters.

    Notes
    -----
    Host-side bookkeeping only (no GPU work); :meth:`update` accepts a tensor but then copies it to the host.

    Examples
    --------
    >>> c = DraftLengthController({1: 10.0, 2: 11.0, 4: 12.0, 8: 14.0}, draft_ms=0.2, initial_accept=0.9)
    >>> c.choose(batch=1)
    8
    >>> for _ in range(200):
    ...     c.update([0], k=8, batch=1)   # every draft rejected at position 1
    >>> c.choose(batch=1) < 8
    True
    """

    def __init__(self, verify_ms: Mapping, draft_ms: float | Mapping[int, float] = 0.0, *,
                 batch_buckets: Sequence[int] | None = None, tree_depths: Mapping[int, int] | None = None,
                 alpha: float = 0.05, hysteresis: float = 0.03, initial_accept: float = 0.7,
                 probe_interval: int = 16):
        if not verify_ms:
            raise ValueError("verify_ms must hold at least one entry ({k: ms} or {(bucket, k): ms}), got none")
        per_bucket: dict[int | None, dict[int, float]] = {}
        for key, ms in verify_ms.items():
            if isinstance(key, tuple):
                if len(key) != 2:
                    raise ValueError(f"verify_ms keys must be k or (batch_bucket, k), got {key!r}")
                bucket, k = int(key[0]), int(key[1])
            else:
                bucket, k = None, int(key)
            if k < 1:
                raise ValueError(f"verify_ms has k = {k}; k counts the root and must be >= 1")
            if not float(ms) > 0 or math.isinf(float(ms)):
                raise ValueError(f"verify_ms[{key!r}] must be a finite time > 0, got {ms!r}")
            per_bucket.setdefault(bucket, {})[k] = float(ms)
        named = sorted(b for b in per_bucket if b is not None)
        if None in per_bucket and named:
            raise ValueError("verify_ms mixes k keys and (batch_bucket, k) keys; use one form")
        if batch_buckets is None:
            batch_buckets = named or [1]
        buckets = sorted({int(b) for b in batch_buckets})
        if not buckets or buckets[0] < 1:
            raise ValueError(f"batch_buckets must be ints >= 1, got {list(batch_buckets)!r}")
        if named and set(named) != set(buckets):
            raise ValueError(f"verify_ms covers buckets {named} but batch_buckets is {buckets}; make them match")
        self.buckets = buckets
        self._verify = {b: dict(per_bucket.get(b, per_bucket.get(None, {}))) for b in buckets}
        if isinstance(draft_ms, Mapping):
            missing = [b for b in buckets if b not in draft_ms]
            if missing:
                raise ValueError(f"draft_ms has no entry for buckets {missing}; give one per bucket or a float")
            self._draft = {b: float(draft_ms[b]) for b in buckets}
        else:
            self._draft = {b: float(draft_ms) for b in buckets}
        if any(not v >= 0 or math.isinf(v) for v in self._draft.values()):
            raise ValueError(f"draft_ms must be finite times >= 0, got {draft_ms!r}")
        all_k = sorted({k for v in self._verify.values() for k in v})
        if tree_depths is None:
            self._depth = {k: k - 1 for k in all_k}
        else:
            missing = [k for k in all_k if k not in tree_depths]
            if missing:
                raise ValueError(f"tree_depths has no depth for k = {missing}; give the tree depth of every k")
            self._depth = {int(k): int(d) for k, d in tree_depths.items()}
            for k in all_k:
                if not 0 <= self._depth[k] <= k - 1 or (k > 1 and self._depth[k] == 0):
                    raise ValueError(f"tree_depths[{k}] = {self._depth[k]} is impossible for a tree of {k} nodes; "
                                     f"expected 1..{k - 1} (0 only for k = 1)")
        self.tree_mode = tree_depths is not None
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        if not hysteresis >= 0:
            raise ValueError(f"hysteresis must be >= 0, got {hysteresis!r}")
        if not 0 <= initial_accept <= 1:
            raise ValueError(f"initial_accept must be in [0, 1], got {initial_accept!r}")
        if probe_interval < 0:
            raise ValueError(f"probe_interval must be >= 0, got {probe_interval!r}")
        self.alpha, self.hysteresis, self.probe_interval = float(alpha), float(hysteresis), int(probe_interval)
        self._max_depth = max(max(self._depth.values()), 1)
        self._accept = {b: [float(initial_accept)] * self._max_depth for b in buckets}
        self._current: dict[int, int | None] = {b: None for b in buckets}
        self._at_one: dict[int, int] = {b: 0 for b in buckets}

    # ------------------------------------------------------------------------------------------- construction
    @classmethod
    def from_verify_wall_json(cls, path: str, provider: str | None = None, draft_ms: float = 0.0,
                              **kwargs) -> "DraftLengthController":
        """Build from ``specverify bench verify-wall`` JSON rows (``provider``, ``k``, ``verify_ms_median``,
        optional ``batch``). Rows with ``batch`` give per-bucket costs; one provider is kept (``provider``, else
        ``specverify`` when present, else the first)."""
        with open(path) as f:
            data = json.load(f)
        rows = data.get("rows", data) if isinstance(data, dict) else data
        rows = [r for r in rows if isinstance(r, dict) and "k" in r and "verify_ms_median" in r]
        if not rows:
            raise ValueError(f"{path}: no rows with keys 'k' and 'verify_ms_median'; is this a verify-wall JSON?")
        providers = list(dict.fromkeys(str(r.get("provider")) for r in rows))
        provider = provider or ("specverify" if "specverify" in providers else providers[0])
        rows = [r for r in rows if str(r.get("provider")) == provider]
        if not rows:
            raise ValueError(f"{path}: no rows for provider {provider!r}; the file holds {providers}")
        if any("batch" in r for r in rows):
            verify = {(int(r.get("batch", 1)), int(r["k"])): float(r["verify_ms_median"]) for r in rows}
        else:
            verify = {int(r["k"]): float(r["verify_ms_median"]) for r in rows}
        return cls(verify, draft_ms, **kwargs)

    @classmethod
    def from_pool(cls, pool, draft_ms: float = 0.0, iters: int = 20, **kwargs) -> "DraftLengthController":
        """Build from a :class:`specverify.VerifyGraphPool`: each held (bucket, k) is captured if needed and timed
        with ``pool.time_replay``; its cost is ``max(host_us, gpu_us)`` (back-to-back replays run at the slower
        of launching and executing). Needs a CUDA device."""
        verify = {}
        for bucket, k in pool.keys():
            t = pool.time_replay(bucket, k, iters=iters)
            verify[(bucket, k)] = max(t["host_us"], t["gpu_us"]) / 1000.0
        return cls(verify, draft_ms, **kwargs)

    # ----------------------------------------------------------------------------------------------- queries
    def bucket_of(self, batch: int) -> int:
        """The bucket of a batch size: the smallest bucket >= batch (the largest bucket beyond them all)."""
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be an int >= 1, got {batch!r}")
        for b in self.buckets:
            if b >= batch:
                return b
        return self.buckets[-1]

    def candidates(self, batch: int = 1) -> list[int]:
        """The k values with a known verify cost for this batch's bucket."""
        return sorted(self._verify[self.bucket_of(batch)])

    def acceptance(self, batch: int = 1) -> list[float]:
        """Current per-position (per-depth) acceptance estimates ``[a_1, a_2, ...]`` for this batch's bucket."""
        return list(self._accept[self.bucket_of(batch)])

    def expected_tokens_per_s(self, batch: int = 1) -> dict[int, float]:
        """Predicted tokens per second for each candidate k at the current acceptance estimates.

        ``1000 * E[emitted](k) / (draft_ms * D(k) + verify_ms(bucket, k))`` (see :mod:`specverify.plan`).
        """
        b = self.bucket_of(batch)
        rates = self._accept[b]
        out = {}
        for k, v in self._verify[b].items():
            d = self._depth[k]
            out[k] = 1000.0 * expected_emitted_depths(rates, d) / (self._draft[b] * d + v)
        return out

    def choose(self, batch: int = 1) -> int:
        """The k to draft and verify next for a batch of this size (stateful: hysteresis and probing).

        Returns the predicted-fastest k unless the current k is within ``hysteresis`` of it; at k = 1 it returns
        the smallest k > 1 once every ``probe_interval`` calls so acceptance keeps being observed.
        """
        b = self.bucket_of(batch)
        rates = self.expected_tokens_per_s(batch)
        best = max(rates, key=lambda k: (rates[k], -k))
        cur = self._current[b]
        if cur is not None and cur in rates and rates[best] <= rates[cur] * (1.0 + self.hysteresis):
            best = cur
        self._current[b] = best
        if best == 1 and self.probe_interval:
            self._at_one[b] += 1
            longer = [k for k in rates if k > 1]
            if longer and self._at_one[b] % self.probe_interval == 0:
                return min(longer)
        else:
            self._at_one[b] = 0
        return best

    # ------------------------------------------------------------------------------------------------ update
    def update(self, accept_lengths, k: int, batch: int | None = None) -> None:
        """Fold one verify pass's outcome into the acceptance estimates.

        Parameters
        ----------
        accept_lengths : int, sequence of int, or integer tensor
            Accepted proposed tokens per request (the accepted depth for a tree), each in ``[0, D(k)]``; a CUDA
            tensor is copied to the host (a synchronisation).
        k : int
            The draft length that was verified (must have a known depth).
        batch : int, optional
            Batch size used to pick the bucket; default ``len(accept_lengths)``.

        Raises
        ------
        ValueError
            Unknown k, an accept length outside ``[0, D(k)]``, or no requests.
        """
        if k not in self._depth:
            raise ValueError(f"k = {k} is not a candidate; known k: {sorted(self._depth)}")
        lengths = _as_int_list(accept_lengths)
        if not lengths:
            raise ValueError("update needs at least one accept length, got none")
        depth = self._depth[k]
        bad = [x for x in lengths if not 0 <= x <= depth]
        if bad:
            raise ValueError(f"accept lengths must be in [0, {depth}] for k = {k} (depth {depth}), got {bad[:5]}")
        b = self.bucket_of(batch if batch is not None else len(lengths))
        a = self._accept[b]
        # per depth d (1-based): requests that tried it (reached d - 1 accepted) and those that accepted it
        for d in range(1, self._max_depth + 1):
            tried = sum(1 for x in lengths if x >= d - 1) if d <= depth else 0
            i = d - 1
            if tried:
                accepted = sum(1 for x in lengths if x >= d)
                w = 1.0 - (1.0 - self.alpha) ** tried
                a[i] += w * (accepted / tried - a[i])
            elif i > 0:
                a[i] += self.alpha * (a[i - 1] - a[i])  # untried: relax toward the depth above
