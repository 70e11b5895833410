"""Programmatic dependent launch (PDL, sm_90+): the one entry sequence of the verify pass's kernels that trigger
their successor before they wait.

``pdl_enter(PDL)`` is called by every program once it has loaded its constant data (weights, which the kernel may
read while its predecessor still runs)::

    PDL false: nothing (no programmatic edge: the launch waited for the predecessor)
    PDL true:  gdc_launch_dependents, then gdc_wait   (the successor may launch before this grid's own wait)

A chain of small grids can have several successors resident at once, each waiting on the one before (the trigger
after the wait, at most one successor resident beside a running grid, was no faster in the pass on the H100:
bench/results/HISTORY.md). :func:`specverify.fit.pdl_kwargs` gives ``PDL``; kernels with their own trigger (the
MoE block, attention, experts) keep theirs.
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
