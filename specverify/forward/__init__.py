"""The verify forward: the product's verify pass (what ``specverify bench verify-wall`` times and SGLang's verify
step runs), one layer loop over an op table per provider.

- :mod:`specverify.forward.model` — :class:`~specverify.forward.model.VerifyModel` (layer loop, weight layout,
  paged KV, tensor-parallel shards, input checks, ``verify``), :class:`~specverify.forward.model.VerifyPassAdapter`
  (static buffers for :class:`specverify.VerifyGraphPool`) and
  :func:`~specverify.forward.model.build_verify_model`.
- :mod:`specverify.forward.ops` — the :class:`~specverify.forward.ops.Ops` table (plain-torch references as
  defaults), :func:`~specverify.forward.ops.specverify_ops`, :func:`~specverify.forward.ops.sglang_ops` and
  :func:`~specverify.forward.ops.provider_ops`.

The definitions of correct every table is held to stay in :mod:`specverify.reference`.
"""
