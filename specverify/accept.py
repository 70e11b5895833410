"""Tree acceptance after the target forward: greedy and speculative sampling with fused logit processing.

Both functions return ``(accepted_tokens, accept_len, accepted_nodes)`` in the layout of
:func:`specverify.reference.accept.greedy_accept_reference`: ``accepted_nodes`` int64 [batch, L] is the accepted
path (node 0 first, then -1), ``accept_len`` int64 [batch] counts accepted proposed tokens (tokens emitted =
``accept_len + 1``), ``accepted_tokens`` int64 [batch, L] holds the accepted draft tokens then the bonus token at
index ``accept_len``, then -1. ``L = max_depth + 1`` (``k`` when the tree is given as a parents tensor).
"""
from __future__ import annotations

import logging
from typing import Union

import torch

from specverify import envvars
from specverify.tree import BatchedDraftTree
from specverify.validation import check_parents

log = logging.getLogger("specverify")
_WARNED: set[str] = set()
_COUNTERS: dict[str, torch.Tensor] = {}

_IMPLS = ("auto", "triton", "reference")
Number = Union[int, float]


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        log.warning(msg)


def _choose_impl(impl: str, device: torch.device, op: str = "verify") -> str:
    if impl not in _IMPLS:
        raise ValueError(f"specverify.{op}: impl must be one of {_IMPLS}, got {impl!r}")
    if impl != "auto":
        if impl == "triton" and device.type != "cuda" and not envvars.triton_interpret():
            raise ValueError(f"specverify.{op}: impl='triton' needs CUDA tensors or TRITON_INTERPRET=1 (the CPU "
                             f"interpreter), got tensors on {device}; move the inputs to a GPU or use "
                             "impl='auto'/'reference'")
        return impl
    if envvars.get_flag("SPECVERIFY_DISABLE_TRITON"):
        _warn_once("verify: SPECVERIFY_DISABLE_TRITON=1, using the torch reference")
        return "reference"
    if device.type == "cuda" or envvars.triton_interpret():
        return "triton"
    _warn_once(f"verify: tensors on {device} without TRITON_INTERPRET=1, using the torch reference")
    return "reference"


def _parents_on(tree: BatchedDraftTree, device) -> torch.Tensor:
    """The tree's parents on ``device``, copied once and kept on the tree: a host-to-device copy cannot happen
    while a CUDA graph is being captured, so the first call (eager) makes the copy and captures reuse it."""
    device = torch.device(device)
    cache = tree.__dict__.setdefault("_parents_by_device", {})
    key = str(device)
    if key not in cache:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("verify: the BatchedDraftTree's parents are not on the GPU yet and cannot be copied "
                               "during CUDA-graph capture; call once eagerly before capturing, or pass a parents "
                               "tensor already on the GPU")
        cache[key] = tree.parents.to(device)
    return cache[key]


def _tree_parents(tree, batch: int, k: int, device, op: str, validate: bool) -> tuple[torch.Tensor, int]:
    if isinstance(tree, BatchedDraftTree):
        if tree.batch != batch or tree.num_nodes != k:
            raise ValueError(f"tree must describe [batch, k] = [{batch}, {k}] nodes, got a BatchedDraftTree of "
                             f"[{tree.batch}, {tree.num_nodes}]; build it from one DraftTree per request")
        return _parents_on(tree, device), tree.max_depth
    if not isinstance(tree, torch.Tensor):
        raise TypeError(f"tree must be a BatchedDraftTree or an int parents tensor [batch, k], got "
                        f"{type(tree).__name__}")
    if tree.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"parents must be int32 or int64 [batch, k], got {tree.dtype}")
    if tuple(tree.shape) != (batch, k):
        raise ValueError(f"parents must have shape [batch, k] = [{batch}, {k}], got {list(tree.shape)}")
    if tree.device != device:
        raise ValueError(f"parents must be on {device} with the other inputs, got {tree.device}")
    if validate:  # a BatchedDraftTree was checked when it was built; a tensor is checked here (skipped in capture)
        check_parents(f"specverify.{op}", tree)
    return tree, k - 1


def _check_tokens(name: str, t: torch.Tensor, shape=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}; cast with .to(torch.int64)")
    if t.dim() != 2 or (shape is not None and tuple(t.shape) != tuple(shape)):
        want = "[batch, k]" if shape is None else str(list(shape))
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")


def _check_logits(logits: torch.Tensor, batch: int, k: int) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"logits must be float32, bfloat16 or float16 [batch, k, vocab], got {logits.dtype}")
    if logits.dim() != 3 or logits.shape[0] != batch or logits.shape[1] != k:
        raise ValueError(f"logits must have shape [batch, k, vocab] = [{batch}, {k}, vocab], got "
                         f"{list(logits.shape)}")
    if logits.shape[2] < 1:
        raise ValueError("logits need a vocabulary of at least 1 token, got 0")


def _out_buffers(out, batch: int, length: int, device):
    if out is None:
        return (torch.empty(batch, length, dtype=torch.int64, device=device),
                torch.empty(batch, dtype=torch.int64, device=device),
                torch.empty(batch, length, dtype=torch.int64, device=device))
    if len(out) != 3:
        raise ValueError(f"out must be (accepted_tokens, accept_len, accepted_nodes), got {len(out)} tensors")
    shapes = [(batch, length), (batch,), (batch, length)]
    for name, t, s in zip(("accepted_tokens", "accept_len", "accepted_nodes"), out, shapes):
        if t.dtype != torch.int64 or tuple(t.shape) != s or t.device != device or not t.is_contiguous():
            raise ValueError(f"out {name} must be a contiguous int64 tensor of shape {list(s)} on {device}, got "
                             f"{t.dtype} {list(t.shape)} on {t.device}")
    return out


def _counter(device: torch.device, batch: int) -> torch.Tensor:
    """Zeroed int32 counters, one per request, reset by the kernel itself (allocated once per device)."""
    key = str(device)
    c = _COUNTERS.get(key)
    if c is None or c.numel() < batch:
        c = torch.zeros(max(batch, 64), dtype=torch.int32, device=device)
        _COUNTERS[key] = c
    return c


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _split(vocab: int, chunk: int | None) -> tuple[int, int]:
    from specverify.kernels import accept as ka

    c = chunk if chunk is not None else min(ka.CHUNK, _pow2(vocab))
    return c, -(-vocab // c)


def verify_greedy(draft_tokens: torch.Tensor, tree, *, logits: torch.Tensor | None = None,
                  target_ids: torch.Tensor | None = None, out=None, impl: str = "auto", validate: bool = True,
                  _chunk: int | None = None):
    """Greedy tree acceptance, with the target's argmax fused in when given logits.

    Walking down from node 0, the first child (in node order) whose draft token equals the target's argmax at
    the current node is accepted; the argmax at the last accepted node is the bonus token. The argmax matches
    ``torch.argmax`` (first maximum). Same rule as SGLang's greedy ``verify_tree_greedy``.

    Parameters
    ----------
    draft_tokens : torch.Tensor
        Shape: (batch, k); int32 or int64. Token of each node (node 0 is ignored).
    tree : BatchedDraftTree or torch.Tensor
        The trees, or their parents as an int tensor of shape (batch, k) on the inputs' device (then
        ``L = k``, which keeps the call free of host syncs).
    logits : torch.Tensor, optional
        Shape: (batch, k, vocab); float32, bfloat16 or float16. Exactly one of ``logits`` and ``target_ids``.
    target_ids : torch.Tensor, optional
        Shape: (batch, k); int32 or int64. Precomputed argmax per node.
    out : tuple of torch.Tensor, optional
        (accepted_tokens [batch, L], accept_len [batch], accepted_nodes [batch, L]) int64, mutated.
    impl : {"auto", "triton", "reference"}
        ``auto`` uses Triton on CUDA (or under ``TRITON_INTERPRET=1``), otherwise the torch reference.
    validate : bool
        Check the values of a parents tensor (one host sync): node 0 the root (-1), every other parent a node
        before its child. Skipped automatically under CUDA-graph capture; a ``BatchedDraftTree`` was checked when
        it was built.

    Returns
    -------
    accepted_tokens, accept_len, accepted_nodes : torch.Tensor
        int64 [batch, L], [batch], [batch, L] as described in the module docstring.

    Raises
    ------
    ValueError
        Shapes that disagree, both or neither of ``logits`` / ``target_ids``, an unknown ``impl``; with
        validation, a parents tensor that is not a tree (wrong root, a parent out of range or not before its
        child); the message names the request and the node.
    TypeError
        Wrong dtypes.

    Notes
    -----
    Two launches with logits (split argmax over chunks of the vocabulary, then one program per request walks the
    tree), one with ``target_ids``. No host sync (but the eager check of a parents tensor, see ``validate``), no
    data-dependent host branching: CUDA-graph capturable (pass ``out`` so the output addresses are fixed). Rows
    containing NaN give an unspecified argmax.

    Examples
    --------
    >>> import torch
    >>> from specverify import DraftTree, BatchedDraftTree
    >>> tree = BatchedDraftTree([DraftTree([-1, 0, 0, 1])])
    >>> draft = torch.tensor([[0, 5, 7, 9]])
    >>> target = torch.tensor([[7, 1, 2, 3]])
    >>> verify_greedy(draft, tree, target_ids=target, impl="reference")[1].tolist()
    [1]
    """
    _check_tokens("draft_tokens", draft_tokens)
    batch, k = draft_tokens.shape
    device = draft_tokens.device
    parents, max_depth = _tree_parents(tree, batch, k, device, "verify_greedy", validate)
    if (logits is None) == (target_ids is None):
        raise ValueError("verify_greedy needs exactly one of logits [batch, k, vocab] and target_ids [batch, k], got "
                         f"{'both' if logits is not None else 'neither'}")
    if logits is not None:
        _check_logits(logits, batch, k)
        if logits.device != device:
            raise ValueError(f"logits must be on {device} with draft_tokens, got {logits.device}")
    else:
        _check_tokens("target_ids", target_ids, (batch, k))
    length = max_depth + 1
    outs = _out_buffers(out, batch, length, device)
    which = _choose_impl(impl, device, "verify_greedy")
    if which == "reference":
        from specverify.reference.accept import greedy_accept_reference

        tgt = target_ids if target_ids is not None else logits.argmax(dim=-1)
        nodes, lens, toks = greedy_accept_reference(tgt, draft_tokens, parents, max_depth)
        outs[0].copy_(toks)
        outs[1].copy_(lens)
        outs[2].copy_(nodes)
        return outs
    from specverify.kernels import accept as ka

    draft_c = draft_tokens.contiguous()
    par_c = parents.contiguous()
    k_block = max(2, _pow2(max(k, length)))
    if target_ids is not None:
        ka._greedy_walk_kernel[(batch,)](par_c, draft_c, target_ids.contiguous(), draft_c, draft_c, k, length, 1,
                                         outs[0], outs[1], outs[2], HAS_TARGET=True, K_BLOCK=k_block, S_BLOCK=2)
        return outs
    vocab = logits.shape[2]
    lg = logits if logits.stride(2) == 1 and logits.stride(0) == k * logits.stride(1) else logits.contiguous()
    chunk, splits = _split(vocab, _chunk)
    rows = batch * k
    c_max = torch.empty(rows, splits, dtype=torch.float32, device=device)
    c_arg = torch.empty(rows, splits, dtype=torch.int32, device=device)
    ka._accept_chunk_kernel[(rows, splits)](lg, lg.stride(1), vocab, splits, c_max, c_arg, CHUNK=chunk,
                                            num_warps=4 if chunk >= 2048 else 2)
    ka._greedy_walk_kernel[(batch,)](par_c, draft_c, draft_c, c_max, c_arg, k, length, splits,
                                     outs[0], outs[1], outs[2], HAS_TARGET=False, K_BLOCK=k_block,
                                     S_BLOCK=max(2, _pow2(splits)))
    return outs


def _param(name: str, value, batch: int, device, kind: str):
    """(tensor or dummy, scalar, is_tensor). kind 'f' → fp32, 'i' → int32."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.shape[0] != batch:
            raise ValueError(f"{name} must be a scalar or a tensor of shape [batch] = [{batch}], got "
                             f"{list(value.shape)}")
        if value.device != device:
            raise ValueError(f"{name} must be on {device} with the logits, got {value.device}")
        if kind == "i" and value.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be an int32/int64 tensor, got {value.dtype}")
        if kind == "f" and not value.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {value.dtype}")
        return value.contiguous(), (0 if kind == "i" else 0.0), True
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number or a [batch] tensor, got {type(value).__name__}")
    if kind == "i" and not float(value).is_integer():
        raise ValueError(f"{name} must be an integer, got {value}")
    return None, (int(value) if kind == "i" else float(value)), False


def verify_sampling(logits: torch.Tensor, tree, draft_tokens: torch.Tensor, *, temperature=1.0, top_k=0,
                    top_p=1.0, min_p=0.0, uniform_samples: torch.Tensor | None = None,
                    generator: torch.Generator | None = None, out=None, impl: str = "auto", validate: bool = True,
                    _chunk: int | None = None, _cap: int | None = None):
    """Tree speculative sampling (target-only rule) with temperature / top-k / top-p / min-p fused in.

    Walking down from node 0, the children of the current node are tried in node order; a child is accepted
    when the level's uniform sample is strictly below the target probability mass of the distinct tokens of the
    siblings tried so far. A token of probability 0 is never accepted. The bonus token is drawn from the target
    distribution at the last accepted node with the tokens of its children removed and renormalised. Every
    emitted token is distributed as the processed target distribution (drafts from a deterministic drafter).
    The rule of SGLang's ``tree_speculative_sampling_target_only`` with its thresholds at 1; logit processing as
    in :func:`specverify.reference.sampling.process_logits_reference`.

    Parameters
    ----------
    logits : torch.Tensor
        Shape: (batch, k, vocab); float32, bfloat16 or float16. Target logits at every node.
    tree : BatchedDraftTree or torch.Tensor
        The trees, or their int parents tensor (batch, k) on the logits' device (then ``L = k``).
    draft_tokens : torch.Tensor
        Shape: (batch, k); int32 or int64.
    temperature, top_p, min_p : float or torch.Tensor
        Scalars or fp32 tensors of shape (batch,). ``temperature <= 0`` makes that request greedy;
        ``top_p >= 1`` and ``min_p <= 0`` switch the filter off.
    top_k : int or torch.Tensor
        Scalar or int tensor of shape (batch,); ``<= 0`` or ``>= vocab`` switches it off.
    uniform_samples : torch.Tensor, optional
        Shape: (batch, L); float32 in [0, 1). Column d is the acceptance sample among the children of the node at
        depth d, column L - 1 the bonus draw. Drawn with ``generator`` when not given (one more launch).
    generator : torch.Generator, optional
    out : tuple of torch.Tensor, optional
        (accepted_tokens [batch, L], accept_len [batch], accepted_nodes [batch, L]) int64, mutated.
    impl : {"auto", "triton", "reference"}
    validate : bool
        Check the values of a parents tensor (one host sync), as in :func:`verify_greedy`. Skipped automatically
        under CUDA-graph capture.

    Returns
    -------
    accepted_tokens, accept_len, accepted_nodes : torch.Tensor
        int64 [batch, L], [batch], [batch, L].

    Raises
    ------
    ValueError, TypeError
        Shapes, devices or dtypes that disagree; parameters of the wrong shape; with validation, a parents tensor
        that is not a tree (as in :func:`verify_greedy`).

    Notes
    -----
    Two launches when ``uniform_samples`` is given: statistics and candidates per chunk of the vocabulary, then
    one program per row finds its thresholds exactly without sorting (snapped searches over the candidates, or a
    bisection over the row for flat distributions), the acceptance mass of its children's tokens and its bonus
    draw, and the last row program of each request walks the tree. Graph capturable after one eager call on the
    device (which allocates the self-resetting counters); pass ``out`` for fixed output addresses.

    Examples
    --------
    >>> import torch
    >>> from specverify import DraftTree, BatchedDraftTree
    >>> tree = BatchedDraftTree([DraftTree.chain(3)])
    >>> logits = torch.tensor([[[0.0, 9.0, 0.0], [0.0, 0.0, 9.0], [9.0, 0.0, 0.0]]])
    >>> draft = torch.tensor([[0, 1, 2]])
    >>> u = torch.zeros(1, 3)
    >>> verify_sampling(logits, tree, draft, uniform_samples=u, impl="reference")[0].tolist()
    [[1, 2, 0]]
    """
    _check_tokens("draft_tokens", draft_tokens)
    batch, k = draft_tokens.shape
    _check_logits(logits, batch, k)
    device = logits.device
    if draft_tokens.device != device:
        raise ValueError(f"draft_tokens must be on {device} with the logits, got {draft_tokens.device}")
    parents, max_depth = _tree_parents(tree, batch, k, device, "verify_sampling", validate)
    length = max_depth + 1
    temp = _param("temperature", temperature, batch, device, "f")
    topk = _param("top_k", top_k, batch, device, "i")
    topp = _param("top_p", top_p, batch, device, "f")
    minp = _param("min_p", min_p, batch, device, "f")
    if uniform_samples is None:
        uniform_samples = torch.rand(batch, length, generator=generator, device=device, dtype=torch.float32)
    else:
        if not isinstance(uniform_samples, torch.Tensor) or uniform_samples.dtype != torch.float32:
            raise TypeError(f"uniform_samples must be a float32 tensor [batch, L] = [{batch}, {length}], got "
                            f"{getattr(uniform_samples, 'dtype', type(uniform_samples).__name__)}")
        if tuple(uniform_samples.shape) != (batch, length):
            raise ValueError(f"uniform_samples must have shape [batch, L] = [{batch}, {length}] (L = max_depth + 1: "
                             f"one per level plus the bonus), got {list(uniform_samples.shape)}")
        if uniform_samples.device != device:
            raise ValueError(f"uniform_samples must be on {device}, got {uniform_samples.device}")
    outs = _out_buffers(out, batch, length, device)
    which = _choose_impl(impl, device, "verify_sampling")
    if which == "reference":
        from specverify.reference.sampling import verify_sampling_reference

        def val(p):
            return p[0] if p[2] else p[1]

        toks, lens, nodes = verify_sampling_reference(logits, draft_tokens, parents, uniform_samples, val(temp),
                                                      val(topk), val(topp), val(minp), max_depth)
        outs[0].copy_(toks)
        outs[1].copy_(lens)
        outs[2].copy_(nodes)
        return outs
    for launch in _sampling_launches(logits, parents, draft_tokens, uniform_samples, temp, topk, topp, minp, length,
                                     outs, _chunk, _cap):
        launch()
    return outs


#: Sizes of the sampling kernels ("select": adaptive candidate capacity, snapped threshold searches, bonus drawn by
#: every row program): vocabulary chunk per program and its warps, the candidate slots per row (the capacity per
#: chunk is ``slots // chunks``, at least 8 and at most chunk / 2), the row kernel's warps, and the floor probes per
#: chunk (64 / 2**floor_iters nat resolution). Optional key "fused": multi-operand reductions (one barrier round
#: each; default on CUDA, off under the interpreter, which runs custom combines element by element).
_SELECT_CONFIG: dict = {"chunk": 2048, "chunk_warps": 4, "slots": 4096, "row_warps": 8, "floor_iters": 10}


def _select_sizes(vocab: int, chunk: int | None, cap: int | None) -> tuple[int, int, int]:
    """(chunk, chunks, capacity per chunk) of the sampling kernels."""
    cfg = _SELECT_CONFIG
    c = chunk if chunk is not None else min(int(cfg["chunk"]), _pow2(vocab))
    splits = -(-vocab // c)
    if cap is None:
        cap = max(8, min(c // 2, int(cfg["slots"]) // splits))
    return c, splits, int(cap)


def _sampling_launches(logits, parents, draft_tokens, uniform_samples, temp, topk, topp, minp, length, outs,
                       chunk, cap):
    """The two launches of the Triton sampling path as argument-free callables (buffers allocated here), so
    benchmarks can time each one alone. ``temp`` .. ``minp``: ``_param`` triples."""
    from specverify.kernels import accept as ka

    batch, k, vocab = logits.shape
    device = logits.device
    lg = logits if logits.stride(2) == 1 and logits.stride(0) == k * logits.stride(1) else logits.contiguous()
    rows = batch * k
    f32, i32 = torch.float32, torch.int32
    counter = _counter(device, batch)
    par_c, draft_c, u_c = parents.contiguous(), draft_tokens.contiguous(), uniform_samples.contiguous()
    k_block = max(2, _pow2(max(k, length)))
    block = min(2048, max(16, _pow2(vocab)))
    chunk, splits, cap = _select_sizes(vocab, chunk, cap)
    c_max = torch.empty(rows, splits, dtype=f32, device=device)
    c_sum = torch.empty(rows, splits, dtype=f32, device=device)
    c_floor = torch.empty(rows, splits, dtype=f32, device=device)
    c_arg = torch.empty(rows, splits, dtype=i32, device=device)
    cand_z = torch.empty(rows, splits, cap, dtype=f32, device=device)
    cand_i = torch.empty(rows, splits, cap, dtype=i32, device=device)
    t_t = temp[0] if temp[2] else c_max
    params = (t_t, temp[1], topk[0] if topk[2] else c_arg, topk[1], topp[0] if topp[2] else c_max, topp[1],
              minp[0] if minp[2] else c_max, minp[1])
    flags = dict(TEMP_T=temp[2], TOPK_T=topk[2], TOPP_T=topp[2], MINP_T=minp[2])
    cfg = _SELECT_CONFIG
    r_f = torch.empty(2, rows, dtype=f32, device=device)
    r_i = torch.empty(4, rows, dtype=i32, device=device)
    n_slots = splits * cap
    n_block = max(2, _pow2(n_slots))
    # multi-operand reductions (one barrier round each) on GPUs; the interpreter runs custom combines element by
    # element, so it gets plain reductions unless told otherwise (tests of the fused code at tiny sizes)
    fused = bool(cfg.get("fused", device.type == "cuda"))

    def launch1():
        ka._accept_scan_kernel[(rows, splits)](lg, lg.stride(1), vocab, splits, k, t_t, temp[1],
                                               c_max, c_arg, c_sum, c_floor, cand_z, cand_i,
                                               TEMP_T=temp[2], CHUNK=chunk, CAP=cap, CAP_BLOCK=max(2, _pow2(cap)),
                                               FLOOR_ITERS=int(cfg["floor_iters"]), FUSED=fused,
                                               num_warps=min(int(cfg["chunk_warps"]), max(1, chunk // 256)))

    def launch2():
        ka._accept_select_kernel[(rows,)](
            lg, lg.stride(1), vocab, splits, k, length, par_c, draft_c, u_c, *params,
            c_max, c_arg, c_sum, c_floor, cand_z, cand_i,
            r_f[0], r_i[0], r_i[1], r_i[2], r_i[3], r_f[1], counter, outs[0], outs[1], outs[2], **flags,
            S_BLOCK=max(2, _pow2(splits)), N_SLOTS=n_slots, N_BLOCK=n_block, K_BLOCK=k_block, BLOCK=block,
            FUSED=fused, num_warps=int(cfg["row_warps"]) if n_block >= 2048 else 4)

    return launch1, launch2
