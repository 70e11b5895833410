"""What ``specverify env`` reports (versions, GPU, backends, cache directory, environment knobs), as a dict that
benchmark JSON rows also carry (``specverify bench verify-wall`` writes it into its ``meta``).

Cheap to import: torch, Triton and the kernels are imported only inside :func:`collect_env`.
"""
from __future__ import annotations

import importlib
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
    backends["gluon wgmma MLA attention (sm_90, Triton 3.6)"] = gluon_ok
    try:
        importlib.import_module("sglang")
        backends["sglang peer kernels"] = True
    except Exception:
        backends["sglang peer kernels"] = False
    info["backends"] = backends
    info["cache_dir"] = str(envvars.cache_dir())
    info["env_vars"] = envvars.snapshot()
    return info
