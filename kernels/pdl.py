"""Programmatic dependent launch (PDL, sm_90+): the one entry sequence of the verify pass's kernels that trigger
their successor before they wait.

``pdl_enter(PDL)`` is called by every program once it has loaded its constant data (weights, which the kernel may
read while its predecessor still runs)::

    PDL false: nothing (no programmatic edge: the launch waited for the predecessor)
    PDL 1 / True: gdc_launch_dependents, then gdc_wait   (the successor may launch before this grid's own wait)
    PDL 2:        gdc_wait, then gdc_launch_dependents   (it launches only once this grid's predecessor is done)

With 1 a chain of small grids can have several successors resident at once, each waiting on the one before; with 2
at most one successor is resident beside a running grid. ``specverify.fit.PDL_TRIGGER_AFTER_WAIT`` (all launch
families, or the ones it names) gives 2 through :func:`specverify.fit.pdl_kwargs` to the launchers that name their
family; kernels with their own trigger (the MoE block, attention, experts) pass none and keep theirs.
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    if PDL == 2:
        gdc_wait()
        gdc_launch_dependents()
    elif PDL:
        gdc_launch_dependents()
        gdc_wait()
