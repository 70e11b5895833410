"""Quantised expert weights, in plain torch: the two formats the served MoE checkpoints use, packed and unpacked.

* **int4** (W4A16, group-wise, symmetric; Kimi-K2.5's routed experts, compressed-tensors ``pack-quantized``):
  a weight ``W [N, K]`` is stored as ``packed`` uint8 ``[N, K / 2]``, two 4-bit codes a byte along K with column
  ``2j`` in the low nibble and ``2j + 1`` in the high one, and ``scale [N, K / group]``. Code ``q`` in ``[0, 15]``
  stands for ``(q - 8) * scale[n, k // group]``. A compressed-tensors ``weight_packed`` int32 ``[N, K / 8]`` (code
  ``k`` at bits ``4 * (k % 8)``) is the same bytes: ``weight_packed.view(torch.uint8)`` on a little-endian machine.
* **fp8** (W8A16, block-wise; DeepSeek-V3 and Kimi-K2): ``W`` stored as float8_e4m3fn ``[N, K]`` and a float32
  ``scale [ceil(N / bn), ceil(K / bk)]`` (the checkpoints' ``weight_scale_inv``) with ``(bn, bk) = (128, 128)``;
  the value is ``w[n, k] * scale[n // bn, k // bk]``.

Every function works on the last two dimensions and keeps any leading ones (experts ``[E, N, K]``).
"""
from __future__ import annotations

import torch

from specverify.configs import EXPERTS_QUANT

FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Round ``w [..., N, K]`` to int4 codes with one scale per ``group_size`` columns (``max |w| / 7`` a group, so
    codes 1..15 are used and 0 (-8) never is). Returns ``(packed uint8 [..., N, K / 2], scale fp32 [..., N, K /
    group_size])``. K must be a multiple of ``group_size`` (even)."""
    *lead, n, k = w.shape
    if group_size < 2 or group_size & (group_size - 1):
        raise ValueError(f"quantize_int4: group_size must be a power of two >= 2 (what fused_moe takes), got "
                         f"{group_size}")
    if k % group_size:
        raise ValueError(f"quantize_int4: K={k} must be a multiple of group_size={group_size}")
    g = w.float().reshape(*lead, n, k // group_size, group_size)
    scale = g.abs().amax(-1) / 7.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (torch.round(g / scale.unsqueeze(-1)).clamp(-8, 7) + 8).to(torch.uint8).reshape(*lead, n, k)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous(), scale


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, group_size: int = 32,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``packed`` uint8 ``[..., N, K / 2]`` and ``scale [..., N, K / group_size]`` to ``[..., N, K]`` in ``dtype``
    (computed in fp32, or fp64 for an fp64 ``dtype``)."""
    ctype = torch.float64 if dtype == torch.float64 else torch.float32
    lo = (packed & 0xF).to(ctype) - 8
    hi = (packed >> 4).to(ctype) - 8
    q = torch.stack([lo, hi], -1).flatten(-2)  # [..., N, K]
    s = scale.to(ctype).repeat_interleave(group_size, dim=-1)
    return (q * s).to(dtype)


def _quads_shapes(name: str, packed: torch.Tensor, scale: torch.Tensor) -> tuple[int, ...]:
    """``(*lead, N, K / 2, groups)`` of int4 weights going to or from row quads, or a ValueError."""
    *lead, n, kb = packed.shape
    if n % 4 or kb % 4 or scale.shape[-2] != n:
        raise ValueError(f"{name}: need N a multiple of 4 and K a multiple of 8, with scales of N rows; got packed "
                         f"{list(packed.shape)} and scale {list(scale.shape)}")
    return (*lead, n, kb, scale.shape[-1])


def int4_to_quads(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 ``packed`` uint8 ``[..., N, K / 2]`` and ``scale [..., N, K / group]`` in rows to row quads
    (``MoEQuant(layout="quads")``): new contiguous tensors of the same shapes whose memory holds, for each quad of
    rows ``4i..4i+3``, code word ``w`` (bytes ``4w..4w+3``, columns ``8w..8w+7``) of the 4 rows one after the other
    (16 bytes), then word ``w + 1``; the scales likewise, group ``g`` of the 4 rows side by side. N must be a
    multiple of 4 and K of 8."""
    *lead, n, kb, g = _quads_shapes("int4_to_quads", packed, scale)
    q = packed.reshape(*lead, n // 4, 4, kb // 4, 4).transpose(-3, -2).reshape(*lead, n, kb)
    s = scale.reshape(*lead, n // 4, 4, g).transpose(-2, -1).reshape(*lead, n, g)
    return q.contiguous(), s.contiguous()


def int4_from_quads(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`int4_to_quads`: row-quad tensors back to rows (new contiguous tensors)."""
    *lead, n, kb, g = _quads_shapes("int4_from_quads", packed, scale)
    q = packed.reshape(*lead, n // 4, kb // 4, 4, 4).transpose(-3, -2).reshape(*lead, n, kb)
    s = scale.reshape(*lead, n // 4, g, 4).transpose(-2, -1).reshape(*lead, n, g)
    return q.contiguous(), s.contiguous()


def quantize_fp8_block(w: torch.Tensor, block_shape: tuple[int, int] = (128, 128)
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Round ``w [..., N, K]`` to float8_e4m3fn with one fp32 scale per ``block_shape`` block (``max |w| / 448`` a
    block). Returns ``(w8 float8_e4m3fn [..., N, K], scale fp32 [..., ceil(N / bn), ceil(K / bk)])``; edge blocks
    may be partial."""
    bn, bk = block_shape
    *lead, n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    pad = torch.zeros(*lead, nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    pad[..., :n, :k] = w.float()
    blocks = pad.reshape(*lead, nb, bn, kb, bk)
    scale = blocks.abs().amax(dim=(-3, -1)) / FP8_MAX  # [..., nb, kb]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (blocks / scale[..., :, None, :, None]).reshape(*lead, nb * bn, kb * bk)[..., :n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale


def dequantize_fp8_block(w8: torch.Tensor, scale: torch.Tensor, block_shape: tuple[int, int] = (128, 128),
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``w8`` float8_e4m3fn ``[..., N, K]`` times its block ``scale [..., ceil(N / bn), ceil(K / bk)]``, in
    ``dtype`` (computed in fp32, or fp64 for an fp64 ``dtype``)."""
    bn, bk = block_shape
    n, k = w8.shape[-2:]
    ctype = torch.float64 if dtype == torch.float64 else torch.float32
    s = scale.to(ctype).repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return (w8.to(ctype) * s).to(dtype)


def quantize_experts(w: torch.Tensor, fmt: str, *, group_size: int = 32, block_shape: tuple[int, int] = (128, 128),
                     scale_dtype: torch.dtype | None = None, chunk: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E, N, K]`` as ``fmt`` (``"int4"``: :func:`quantize_int4`; ``"fp8"``: :func:`quantize_fp8_block`),
    ``chunk`` experts at a time, so no E-sized fp32 temporary exists. Returns ``(stored, scale)``, the scales in
    ``scale_dtype`` (default: the served checkpoints', :data:`specverify.configs.EXPERTS_QUANT`'s scale bytes: bf16
    for int4, fp32 for fp8)."""
    if scale_dtype is None and fmt in EXPERTS_QUANT:
        scale_dtype = torch.bfloat16 if EXPERTS_QUANT[fmt]["scale_bytes"] == 2 else torch.float32
    parts = []
    for i in range(0, w.shape[0], chunk):
        if fmt == "int4":
            q, sc = quantize_int4(w[i:i + chunk], group_size)
        elif fmt == "fp8":
            q, sc = quantize_fp8_block(w[i:i + chunk], block_shape)
        else:
            raise ValueError(f"quantize_experts: fmt must be 'int4' or 'fp8', got {fmt!r}")
        parts.append((q, sc.to(scale_dtype)))
    return torch.cat([q for q, _ in parts]), torch.cat([sc for _, sc in parts])
