"""One CUDA graph per (batch bucket, draft length) for the verify pass, all sharing one memory pool.

Serving stacks capture one verify graph per batch size at a single draft length, so a run-time change of k means
running eagerly or recapturing. :class:`VerifyGraphPool` captures a graph per (batch bucket, k) on one capture
stream into one ``torch.cuda`` graph memory pool, largest first, so every smaller graph reuses the largest one's
activation memory and switching k between steps costs only the replay of another graph.
"""
from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

__all__ = ["GraphRecord", "VerifyGraphPool", "graph_node_count"]

logger = logging.getLogger("specverify")

Outputs = torch.Tensor | tuple | list | dict


@dataclass
class GraphRecord:
    """What capturing one graph cost. ``pool_growth_bytes``: bytes the shared pool grew by during this capture
    (the largest graph, captured first, shows its full footprint; later ones show only what they could not
    reuse). ``node_count`` is None where the platform does not expose it."""

    batch_bucket: int
    k: int
    capture_ms: float
    warmup_ms: float
    pool_growth_bytes: int
    node_count: int | None

    def as_dict(self) -> dict:
        return asdict(self)


_libcuda = None


def graph_node_count(graph: torch.cuda.CUDAGraph) -> int | None:
    """Number of nodes of a captured graph kept with ``keep_graph=True``, or None where that cannot be read.

    Reads the raw ``cudaGraph_t`` (``CUDAGraph.raw_cuda_graph()``, torch >= 2.7) and asks CUDA for its node count:
    through cuda-python's ``cudaGraphGetNodes`` when installed, else the driver's ``cuGraphGetNodes`` via ctypes
    (a ``cudaGraph_t`` is a ``CUgraph``). Returns None when torch, the graph or the driver does not allow it.
    """
    global _libcuda
    raw = getattr(graph, "raw_cuda_graph", None)
    if raw is None:
        return None
    try:
        handle = int(raw())
    except Exception:  # keep_graph=False or an older torch
        return None
    if not handle:
        return None
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6

        err, _, n = cudart.cudaGraphGetNodes(handle, 0)
        if int(err) == 0:
            return int(n)
    except Exception:
        pass
    try:
        if _libcuda is None:
            _libcuda = ctypes.CDLL("libcuda.so.1")
        n = ctypes.c_size_t(0)
        rc = _libcuda.cuGraphGetNodes(ctypes.c_void_p(handle), None, ctypes.byref(n))
        return int(n.value) if rc == 0 else None
    except Exception:
        return None


def _map_tensors(obj: Outputs, fn: Callable[[torch.Tensor], torch.Tensor]) -> Outputs:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {key: _map_tensors(v, fn) for key, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


class VerifyGraphPool:
    """CUDA graphs of a verify forward, one per (batch bucket, k), sharing one capture stream and memory pool.

    Parameters
    ----------
    forward : callable ``forward(inputs, k) -> outputs``
        The verify pass for draft length k (``num_draft_tokens``, root included). ``inputs`` is the dict of
        static input buffers of one (bucket, k) with leading dimension ``bucket``; the forward must be
        capturable (no host sync, no data-dependent Python branching, fixed addresses). ``outputs`` is a tensor,
        or a tuple/list/dict of tensors, allocated inside the forward (they then live in the pool) or static
        buffers it wrote into. Each graph keeps its outputs alive, so return what the caller needs after the pass
        (accepted tokens, accept lengths), not full logits, or the outputs of all graphs add up.
    make_inputs : callable ``make_inputs(batch_bucket, k) -> dict[str, Tensor]``
        Factory of the static input buffers of one graph: CUDA tensors, leading dimension ``batch_bucket``,
        filled with valid values.
    batch_buckets : sequence of int
        Batch sizes to capture; a batch runs in the smallest bucket that holds it.
    draft_lengths : sequence of int
        The k values to capture (k = 1 is plain decode).
    capture : {"lazy", "eager"}, default "lazy"
        ``eager`` captures every (bucket, k) now, largest ``bucket * k`` first; ``lazy`` captures a key on its
        first :meth:`run` (a later, larger capture may then grow the pool; call :meth:`capture_all` first for
        the tightest pool).
    use_graphs : bool, default True
        False runs ``forward`` eagerly on the same static buffers (same padding and output semantics): the
        ``--graph off`` path and CPU runs.
    warmup_iters : int, default 2
        Eager runs on the capture stream before each capture (lazy initialisation, autotuning, workspaces).
    device : torch.device or str, optional
        Default: the current CUDA device (``cpu`` when ``use_graphs=False`` and there is no CUDA).
    padding : dict of str -> int or float, optional
        The value every element of rows ``[batch:bucket]`` of the named static inputs gets on each :meth:`run`
        of a batch smaller than its bucket, before the replay. A padded row still runs the whole forward, so
        the inputs that decide what it reads and writes must make it harmless: for a verify pass over a paged KV
        cache, prefix length 0 and a page table that points only at a reserved scratch page (the draft KV of
        the padded rows then lands in that page, never in a live or a finished request's slots). Inputs not
        named keep what the previous run left there. Default: none (only for forwards without side effects).

    Raises
    ------
    ValueError
        Empty or non-positive buckets or draft lengths, an unknown ``capture`` mode, ``use_graphs`` on a device
        that is not CUDA, a ``padding`` value that is not a number (a name that is not an input is refused at the
        first capture).
    TypeError
        ``forward`` or ``make_inputs`` not callable.

    Notes
    -----
    Output lifetime: the tensors :meth:`run` returns are views into graph-owned memory, valid until the next
    :meth:`run` (or replay) of **any** graph of this pool; copy them to keep them. Replays are issued on the
    caller's current stream; do not run two graphs of one pool concurrently. When the weights or caches the
    forward reads move (reallocation, reload), call :meth:`rebuild` (or :meth:`invalidate` and capture again):
    graphs hold raw device addresses.

    Examples
    --------
    >>> import torch
    >>> w = torch.randn(8, 8)
    >>> pool = VerifyGraphPool(lambda inp, k: inp["x"] @ w, lambda b, k: {"x": torch.zeros(b, k, 8)},
    ...                        batch_buckets=[1, 4], draft_lengths=[1, 4], use_graphs=False, device="cpu")
    >>> pool.run({"x": torch.ones(3, 4, 8)}, k=4).shape
    torch.Size([3, 4, 8])
    """

    def __init__(self, forward: Callable[[dict[str, torch.Tensor], int], Outputs],
                 make_inputs: Callable[[int, int], dict[str, torch.Tensor]], *, batch_buckets: Sequence[int],
                 draft_lengths: Sequence[int], capture: str = "lazy", use_graphs: bool = True,
                 warmup_iters: int = 2, device: torch.device | str | None = None,
                 padding: Mapping[str, int | float] | None = None):
        if not callable(forward):
            raise TypeError(f"forward must be callable as forward(inputs, k), got {type(forward).__name__}")
        if not callable(make_inputs):
            raise TypeError(f"make_inputs must be callable as make_inputs(batch_bucket, k), got "
                            f"{type(make_inputs).__name__}")
        self.batch_buckets = self._check_sizes("batch_buckets", batch_buckets)
        self.draft_lengths = self._check_sizes("draft_lengths", draft_lengths)
        if capture not in ("lazy", "eager"):
            raise ValueError(f"capture must be 'lazy' or 'eager', got {capture!r}")
        if isinstance(warmup_iters, bool) or not isinstance(warmup_iters, int) or warmup_iters < 0:
            raise ValueError(f"warmup_iters must be an int >= 0, got {warmup_iters!r}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
                torch.device("cpu")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if use_graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got device {self.device}; pass use_graphs=False "
                             "to run the forward eagerly through the same buffers")
        self.forward, self.make_inputs = forward, make_inputs
        self.padding = self._check_padding(padding)
        self.capture_mode, self.use_graphs, self.warmup_iters = capture, bool(use_graphs), warmup_iters
        self._stream = torch.cuda.Stream(self.device) if self.use_graphs else None
        self._reset()
        if capture == "eager":
            self.capture_all()

    @staticmethod
    def _check_sizes(name: str, values: Sequence[int]) -> list[int]:
        try:
            out = sorted({int(v) for v in values})
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a sequence of ints >= 1, got {values!r}") from None
        if not out or out[0] < 1 or any(isinstance(v, bool) or float(v) != int(v) for v in values):
            raise ValueError(f"{name} must be a non-empty sequence of ints >= 1, got {list(values)!r}")
        return out

    @staticmethod
    def _check_padding(padding) -> dict[str, int | float]:
        if padding is None:
            return {}
        if not isinstance(padding, Mapping):
            raise ValueError(f"padding must be a dict of input name -> int or float, got {type(padding).__name__}")
        for name, value in padding.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"padding[{name!r}] must be an int or float (the value of every element of a "
                                 f"padded row), got {value!r}")
        return dict(padding)

    def _reset(self) -> None:
        self._mempool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._inputs: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._outputs: dict[tuple[int, int], Outputs] = {}
        self._records: dict[tuple[int, int], GraphRecord] = {}

    # ---------------------------------------------------------------------------------------------- queries
    def keys(self) -> list[tuple[int, int]]:
        """Every (batch_bucket, k) this pool holds (captured or not), largest ``bucket * k`` first."""
        return sorted(((b, k) for b in self.batch_buckets for k in self.draft_lengths),
                      key=lambda bk: (-bk[0] * bk[1], -bk[0], -bk[1]))

    def captured(self) -> list[tuple[int, int]]:
        """The (batch_bucket, k) keys with a live graph (or, eagerly, live buffers), in capture order."""
        return list(self._inputs)

    def bucket_of(self, batch: int) -> int:
        """The smallest held batch bucket >= batch.

        Raises
        ------
        ValueError
            batch < 1 or larger than the largest bucket.
        """
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be an int >= 1, got {batch!r}")
        for b in self.batch_buckets:
            if b >= batch:
                return b
        raise ValueError(f"batch {batch} exceeds the largest batch bucket {self.batch_buckets[-1]}; the pool "
                         f"holds buckets {self.batch_buckets}: add a larger bucket or split the batch")

    def _key(self, batch: int, k: int) -> tuple[int, int]:
        if k not in self.draft_lengths:
            raise ValueError(f"the pool holds no graph for k = {k}; it holds (batch_bucket, k) = "
                             f"{sorted(self.keys())}; add k to draft_lengths or pick a held k")
        return self.bucket_of(batch), k

    def report(self) -> list[dict]:
        """Per captured graph: batch_bucket, k, capture_ms, warmup_ms, pool_growth_bytes, node_count."""
        return [r.as_dict() for r in self._records.values()]

    def pool_bytes(self) -> int:
        """Bytes the shared graph memory pool grew by over all captures so far (0 without graphs)."""
        return sum(r.pool_growth_bytes for r in self._records.values())

    def largest_graph_bytes(self) -> int:
        """The biggest single capture's pool growth (the first graph's footprint under eager capture)."""
        return max((r.pool_growth_bytes for r in self._records.values()), default=0)

    # ---------------------------------------------------------------------------------------------- capture
    def capture_all(self) -> None:
        """Capture every held (bucket, k) not yet captured, largest ``bucket * k`` first."""
        for key in self.keys():
            if key not in self._inputs:
                self._capture(key)

    def _capture(self, key: tuple[int, int]) -> None:
        bucket, k = key
        inputs = self.make_inputs(bucket, k)
        self._check_static(inputs, key)
        if not self.use_graphs:
            self._inputs[key] = inputs
            return
        dev = self.device
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        self._stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(self._stream):
            for _ in range(self.warmup_iters):
                self.forward(inputs, k)
        torch.cuda.current_stream(dev).wait_stream(self._stream)
        torch.cuda.synchronize(dev)
        warmup_ms = (time.perf_counter() - t0) * 1e3
        try:
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            kept = True
        except TypeError:  # torch without keep_graph
            graph, kept = torch.cuda.CUDAGraph(), False
        t0 = time.perf_counter()
        with torch.cuda.graph(graph, pool=self._mempool, stream=self._stream):
            # read inside: entering the context empties the allocator cache (warmup blocks leave `reserved`)
            reserved0 = torch.cuda.memory_reserved(dev)
            outputs = self.forward(inputs, k)
        nodes = graph_node_count(graph) if kept else None
        if kept:
            graph.instantiate()
        torch.cuda.synchronize(dev)
        capture_ms = (time.perf_counter() - t0) * 1e3
        growth = torch.cuda.memory_reserved(dev) - reserved0
        self._graphs[key], self._inputs[key], self._outputs[key] = graph, inputs, outputs
        self._records[key] = GraphRecord(bucket, k, capture_ms, warmup_ms, int(growth), nodes)
        logger.debug("captured verify graph bucket=%d k=%d in %.1f ms (+%d pool bytes, %s nodes)", bucket, k,
                     capture_ms, growth, nodes)

    def _check_static(self, inputs, key) -> None:
        if not isinstance(inputs, Mapping) or not inputs:
            raise TypeError(f"make_inputs{key} must return a non-empty dict of tensors, got "
                            f"{type(inputs).__name__}")
        for name, t in inputs.items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != key[0]:
                raise ValueError(f"make_inputs{key}[{name!r}] must be a tensor with leading dimension "
                                 f"{key[0]} (the batch bucket), got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
            if t.device != self.device:
                raise ValueError(f"make_inputs{key}[{name!r}] is on {t.device}, the pool runs on {self.device}")
        unknown = sorted(set(self.padding) - set(inputs))
        if unknown:
            raise ValueError(f"padding names {unknown}, which are not inputs of the forward; its inputs are "
                             f"{sorted(inputs)}")

    def invalidate(self) -> None:
        """Drop every graph, static buffer and output and start a fresh memory pool (call when weights or
        caches the forward reads have moved). Outputs returned earlier become invalid."""
        self._reset()

    def rebuild(self) -> None:
        """:meth:`invalidate`, then capture again: every key under eager capture, else the keys captured
        before (largest first)."""
        before = set(self._inputs)
        self.invalidate()
        if self.capture_mode == "eager":
            self.capture_all()
        else:
            for key in self.keys():
                if key in before:
                    self._capture(key)

    # -------------------------------------------------------------------------------------------------- run
    def static_inputs(self, batch: int, k: int) -> dict[str, torch.Tensor]:
        """The static input buffers of the graph that serves (batch, k), capturing it if needed (advanced use:
        write inputs in place yourself, then :meth:`replay`)."""
        key = self._key(batch, k)
        if key not in self._inputs:
            self._capture(key)
        return self._inputs[key]

    def replay(self, batch: int, k: int) -> Outputs:
        """Replay the graph serving (batch, k) on its static inputs as they are; returns its full-bucket outputs
        (same lifetime as :meth:`run`'s)."""
        key = self._key(batch, k)
        if key not in self._inputs:
            self._capture(key)
        if self.use_graphs:
            self._graphs[key].replay()
            return self._outputs[key]
        return self.forward(self._inputs[key], k)

    def run(self, inputs: Mapping[str, torch.Tensor], k: int, *, slice_outputs: bool = True) -> Outputs:
        """Run the verify pass for ``inputs`` at draft length k through the graph of its batch bucket.

        Parameters
        ----------
        inputs : dict of str -> Tensor
            The same names as the static buffers; each ``Shape: (batch, *static.shape[1:])`` and the static
            buffer's dtype, batch <= the largest bucket. Copied into rows ``[:batch]`` of the static buffers (on
            the current stream, non-blocking); rows ``[batch:bucket]`` of the inputs named in ``padding`` are
            set to their padding values, the others keep what they held.
        k : int
            Draft length (``num_draft_tokens``, root included); must be in ``draft_lengths``.
        slice_outputs : bool, default True
            Return ``out[:batch]`` of every output tensor whose leading dimension is the bucket.

        Returns
        -------
        Tensor, tuple, list or dict
            The forward's outputs, views valid until the next run or replay of any graph of this pool.

        Raises
        ------
        ValueError
            k not held (the message lists the held keys), batch above the largest bucket, missing or extra
            input names, mismatched batch sizes or trailing shapes.
        TypeError
            An input that is not a tensor or has the wrong dtype.

        Notes
        -----
        No host synchronisation; the first run of a key captures it when the pool is lazy (slow, synchronises).
        """
        if not isinstance(inputs, Mapping) or not inputs:
            raise TypeError(f"inputs must be a non-empty dict of name -> tensor, got {type(inputs).__name__}")
        batches = set()
        for name, t in inputs.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"inputs[{name!r}] must be a tensor, got {type(t).__name__}")
            if t.dim() == 0:
                raise ValueError(f"inputs[{name!r}] must have a leading batch dimension, got a 0-d tensor")
            batches.add(t.shape[0])
        if len(batches) != 1:
            raise ValueError(f"every input must have the same batch size, got "
                             f"{ {n: t.shape[0] for n, t in inputs.items()} }")
        batch = batches.pop()
        key = self._key(batch, k)
        static = self.static_inputs(batch, k)
        if set(static) != set(inputs):
            raise ValueError(f"inputs must have exactly the names {sorted(static)}, got {sorted(inputs)}")
        for name, t in inputs.items():
            s = static[name]
            if t.shape[1:] != s.shape[1:]:
                raise ValueError(f"inputs[{name!r}] must have shape (batch, {', '.join(map(str, s.shape[1:]))}) "
                                 f"for k = {k}, got {tuple(t.shape)}")
            if t.dtype != s.dtype:
                raise TypeError(f"inputs[{name!r}] must be {s.dtype}, got {t.dtype}; convert with .to({s.dtype})")
        for name, t in inputs.items():
            static[name][:batch].copy_(t, non_blocking=True)
        if batch < key[0]:
            for name, value in self.padding.items():
                static[name][batch:].fill_(value)
        out = self.replay(batch, k)
        if slice_outputs and batch != key[0]:
            out = _map_tensors(out, lambda x: x[:batch] if x.dim() and x.shape[0] == key[0] else x)
        return out

    # ---------------------------------------------------------------------------------------------- timing
    def time_replay(self, batch: int, k: int, iters: int = 50) -> dict:
        """Host time to launch one replay vs GPU time of one pass, for the graph serving (batch, k).

        ``host_us``: wall time of ``iters`` back-to-back ``replay()`` calls divided by ``iters`` (no sync inside).
        ``gpu_us``: CUDA-event time of ``iters`` replays queued behind a spin kernel long enough to cover their
        launch, so the GPU runs them back to back, divided by ``iters``. ``launch_bound`` is
        ``host_us > gpu_us``: the host cannot issue passes as fast as the GPU runs them.

        Raises
        ------
        ValueError
            Unknown (batch, k), iters < 1, or a pool without graphs (no replays to time).
        """
        if not self.use_graphs:
            raise ValueError("time_replay needs CUDA graphs; this pool was built with use_graphs=False")
        if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
            raise ValueError(f"iters must be an int >= 1, got {iters!r}")
        key = self._key(batch, k)
        if key not in self._graphs:
            self._capture(key)
        graph, dev = self._graphs[key], self.device
        graph.replay()
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(iters):
            graph.replay()
        host_us = (time.perf_counter() - t0) * 1e6 / iters
        torch.cuda.synchronize(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # ~2 GHz SM clock: cycles for 1.5x the measured host launch time of the whole loop, plus 50 us
        torch.cuda._sleep(int((1.5 * host_us * iters + 50.0) * 2000))
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize(dev)
        gpu_us = start.elapsed_time(end) * 1e3 / iters
        return {"batch_bucket": key[0], "k": k, "iters": iters, "host_us": host_us, "gpu_us": gpu_us,
                "launch_bound": host_us > gpu_us}


def make_toy_verify(hidden: int = 256, vocab: int = 4096, layers: int = 2, prefix: int = 32, *,
                    device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0
                    ) -> tuple[Callable[[dict[str, torch.Tensor], int], dict[str, torch.Tensor]],
                               Callable[[int, int], dict[str, torch.Tensor]]]:
    """A small stand-in verify pass (for tests and ``bench/bench_graph_pool.py``): ``(forward, make_inputs)``.

    Per layer: attention of the k chain nodes over a fixed ``prefix`` of cached keys and the causally earlier
    nodes, then an MLP; an LM head; greedy chain acceptance. Every op is row-independent in the batch, so padding
    rows cannot change real rows.

    ``inputs = {"input_ids": int64 (batch, k)}`` (node 0 the last verified token, nodes 1.. the drafts);
    ``forward(inputs, k)`` returns ``{"tokens": int64 (batch, k), "logit_max": float32 (batch, k),
    "accept_length": int64 (batch,)}`` where ``accept_length`` counts leading drafts equal to the target's
    greedy choice.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)

    def param(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    emb = param(vocab, hidden, scale=1.0)
    weights = [(param(hidden, hidden, scale=hidden ** -0.5), param(hidden, 2 * hidden, scale=hidden ** -0.5),
                param(2 * hidden, hidden, scale=(2 * hidden) ** -0.5)) for _ in range(layers)]
    cache = param(prefix, hidden, scale=1.0)
    lm_head = param(hidden, vocab, scale=hidden ** -0.5)
    masks: dict[int, torch.Tensor] = {}

    def make_inputs(batch: int, k: int) -> dict[str, torch.Tensor]:
        if k not in masks:  # additive mask (k, prefix + k): node i sees the prefix and nodes 0..i
            m = torch.zeros(k, prefix + k)
            m[:, prefix:] = torch.triu(torch.full((k, k), float("-inf")), diagonal=1)
            masks[k] = m.to(device=device, dtype=torch.float32)
        return {"input_ids": torch.zeros(batch, k, dtype=torch.int64, device=device)}

    def forward(inputs: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
        ids = inputs["input_ids"]
        b = ids.shape[0]
        x = emb[ids]                                                         # (b, k, h)
        for wq, w1, w2 in weights:
            keys = torch.cat([cache.expand(b, prefix, hidden), x], dim=1)    # (b, prefix + k, h)
            s = (x @ wq) @ keys.transpose(1, 2)                              # (b, k, prefix + k)
            p = torch.softmax(s.float() * hidden ** -0.5 + masks[k], dim=-1).to(dtype)
            x = x + p @ keys
            x = x + torch.relu(x @ w1) @ w2
        logits = (x @ lm_head).float()                                       # (b, k, vocab)
        best, tokens = logits.max(dim=-1)
        match = (tokens[:, :-1] == ids[:, 1:]).to(torch.int64)               # draft i+1 vs target's pick at i
        return {"tokens": tokens, "logit_max": best, "accept_length": match.cumprod(dim=-1).sum(dim=-1)}

    return forward, make_inputs
