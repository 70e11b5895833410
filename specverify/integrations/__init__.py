"""Integrations with serving engines.

- :mod:`specverify.integrations.sglang` — the SGLang plugin (entry point ``sglang.srt.plugins: specverify``): the
  ``specverify`` attention backend, MoE routing/alignment hooks and the custom-allreduce chooser. Importing it
  imports nothing from SGLang or from our kernels; :func:`~specverify.integrations.sglang.register` does the work.
- :mod:`specverify.integrations.sglang_backend` — the attention backend the plugin registers (imported on first
  use, inside SGLang's worker processes).
- :mod:`specverify.integrations.sglang_stats` — the counters and log-once messages both of them report through.
"""
