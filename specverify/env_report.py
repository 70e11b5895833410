"""What ``specverify env`` reports (versions, GPU, backends, the kernel each op runs here and why, cache directory,
environment knobs), as a dict that benchmark JSON rows also carry (``specverify bench verify-wall`` writes it into
its ``meta``).

Cheap to import: torch, Triton and the kernels are imported only inside :func:`collect_env`.
"""
from __future__ import annotations

import importlib
import importlib.util
import platform


def package_version(mod: str) -> str | None:
    """The installed version of distribution ``mod``, or None when it is not installed."""
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return None


def collect_env() -> dict:
    """Everything ``specverify env`` reports, as a dict (also written into benchmark JSON rows)."""
    import specverify
    from specverify import envvars

    info: dict = {"specverify": specverify.__version__, "python": platform.python_version(),
                  "platform": platform.platform()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda_runtime"] = torch.version.cuda
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info["gpu"] = props.name
            info["compute_capability"] = f"{props.major}.{props.minor}"
            info["gpu_count"] = torch.cuda.device_count()
            info["sm_count"] = props.multi_processor_count
            info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        else:
            info["gpu"] = "no CUDA device"
    except Exception as exc:  # torch is a hard dependency; report rather than crash
        info["torch"] = f"unavailable ({exc})"
        info["gpu"] = "no CUDA device"
    info["triton"] = package_version("triton")
    info["triton_interpret"] = envvars.triton_interpret()
    cupy = None
    for name in ("cupy-cuda13x", "cupy-cuda12x", "cupy"):
        cupy = cupy or package_version(name)
    info["cupy"] = cupy
    nccl = None
    for name in ("nvidia-nccl-cu13", "nvidia-nccl-cu12"):
        nccl = nccl or package_version(name)
    info["nccl"] = nccl
    has_gpu = info.get("gpu") != "no CUDA device"
    triton_runs = info["triton"] is not None and (has_gpu or info["triton_interpret"])
    backends = {"reference": True,
                "triton" + ("" if has_gpu else " (CPU: only with TRITON_INTERPRET=1)"): triton_runs,
                "cuda (NVRTC through CuPy)": cupy is not None and has_gpu}
    # the Gluon MLA kernel: the rule an MLA plan applies (Kimi-K2 / DeepSeek-V3 sizes: latent 512, rope 64)
    gluon_ok = False
    if has_gpu:
        from specverify.attention import _wgmma_default

        gluon_ok = _wgmma_default(torch.device("cuda", 0), d=512, dr=64, dv=512)
    backends["gluon wgmma MLA attention (sm_90, where it compiles)"] = gluon_ok
    try:
        importlib.import_module("sglang")
        backends["sglang peer kernels"] = True
    except Exception:
        backends["sglang peer kernels"] = False
    # found, not imported (FlashInfer imports slowly and JIT-compiles at first use): verify-wall's sglang-flashinfer
    backends["flashinfer MLA peer (installed)"] = importlib.util.find_spec("flashinfer") is not None
    info["backends"] = backends
    info["kernels"] = kernel_choices()
    info["cache_dir"] = str(envvars.cache_dir())
    info["env_vars"] = envvars.snapshot()
    return info


#: The ops :func:`kernel_choices` reports, in order, with the Triton kernel file each one runs.
OPS = (
    ("MLA tree attention", "kernels/tree_attention.py"),
    ("GQA tree attention", "kernels/tree_attention.py"),
    ("MoE routing", "kernels/moe_route.py"),
    ("fused experts", "kernels/fused_moe.py"),
    ("acceptance", "kernels/accept.py"),
    ("KV compaction", "kernels/kv_compact.py"),
    ("small fused ops", "kernels/fused_ops.py"),
)


def kernel_choices() -> dict[str, str]:
    """Per op, the kernel ``impl="auto"`` runs on this machine (CUDA device 0, or the CPU) and why, as
    ``{op: "kernel: reason"}`` (the ops of :data:`OPS`).

    The rules are the launchers': the torch reference where Triton cannot run (``SPECVERIFY_DISABLE_TRITON=1``, no
    importable Triton, no CUDA device without ``TRITON_INTERPRET=1``); Triton's CPU interpreter under
    ``TRITON_INTERPRET=1``; on a GPU the Triton kernels, and for MLA the Gluon wgmma kernel where
    ``specverify.attention.mla_wgmma_support`` says yes (it compiles the kernel for the device once; nothing runs).
    """
    import torch

    from specverify import envvars

    common = None
    try:
        import triton
    except Exception as exc:  # noqa: BLE001 - a broken install is reported, not raised
        common = f"reference (torch): Triton does not import ({type(exc).__name__}: {exc})"
    if envvars.get_flag("SPECVERIFY_DISABLE_TRITON"):
        common = "reference (torch): SPECVERIFY_DISABLE_TRITON=1"
    interpret = envvars.triton_interpret()
    cuda = torch.cuda.is_available() and not interpret
    if common is None and not cuda and not interpret:
        common = "reference (torch): no CUDA device and TRITON_INTERPRET is not 1"
    if common is not None:
        return {op: common for op, _ in OPS}
    if interpret:
        where = f"Triton {triton.__version__}'s CPU interpreter (TRITON_INTERPRET=1)"
        out = {op: f"Triton kernel of {path} in the interpreter: {where}" for op, path in OPS}
        out["MLA tree attention"] = (f"tl.dot kernel of kernels/tree_attention.py in the interpreter: {where}; the "
                                     "Gluon wgmma kernel has no interpreter")
        return out
    from specverify import attention, moe

    dev = torch.device("cuda", 0)
    major, minor = torch.cuda.get_device_capability(dev)
    here = f"Triton {triton.__version__} on {torch.cuda.get_device_name(dev)} (sm_{major}{minor})"
    out = {op: f"Triton kernel of {path}: {here}" for op, path in OPS}
    ok, why = attention.mla_wgmma_support(dev)
    if ok:
        out["MLA tree attention"] = f"gluon wgmma kernel of kernels/tree_attention_wgmma.py: {why}"
    else:
        rows = " with 16 query rows a tile (under 160 KiB of shared memory a block)" \
            if attention._small_shared_memory(dev) else ""
        out["MLA tree attention"] = f"tl.dot kernel of kernels/tree_attention.py{rows}: {here}; Gluon kernel off: {why}"
    out["fused experts"] = (f"Triton kernels of kernels/fused_moe.py (weight streaming at M <= "
                            f"{moe._STREAM_CONFIG['max_m']} tokens, {moe._STREAM_CONFIG['q4_max_m']} for int4 in row "
                            f"quads, block-aligned tl.dot GEMMs above): {here}")
    return out
