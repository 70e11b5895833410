"""Probe: where the Gluon MLA kernel's time goes at a shape, by timing copies of the kernel with one part removed.

Each probe is the installed ``tree_attention_wgmma.py`` with one edit, written to a temporary file and imported in
place of the package's module (the launcher in ``specverify.attention`` then launches it), so the package itself is
never changed:

- ``full``: the kernel as it is, split kernel and merge (``split-only``: the merge launch skipped);
- ``compute-only``: no KV copies after the prologue's first tile (the MMAs read stale tiles);
- ``copies-only``: no MMAs (the scores are zero; copies, softmax and stores stay);
- ``no-store``: no store of the split partial outputs (their lse still stored; the output is dead, so the compiler may
  also drop the value MMA; a plan of one split, which stores no partials, is unchanged);
- ``sum-store``: each partial row's sum over the latent stored instead of the row (one fp32 a row: the value MMA
  stays live, the store's bytes and instructions go), so ``split-only`` less this is what the partial store costs;
- ``bf16 ws``: bf16 split partials (the plan's fp32 workspace replaced; the merge sums in fp32);
- (removed after its run: bf16 partials stored from a row-contiguous layout in whole 32-byte sectors; the merge
  read them as slowly as ``bf16 ws``'s, bench/results/HISTORY.md, eighth session of 2026-12-06).

Outputs of probes other than ``full`` are wrong by construction; ``full`` rows record ``err`` = max |out - ref|
against the fp32 reference (recorded, not judged: ``sweep_attention.py`` checks these plans against its tolerance).
Time: µs per call by CUDA-graph replay (20 calls, best of 3, ``graph_us``); ``bw%`` = KV bytes / time / copy
bandwidth of the same run.

Shapes: DeepSeek-V3 b 4 / 16k / page size 1 / top-2 tree at k 4 and 8 (its verify pass), Kimi-K2 b 1 / 4k / page size
64 / chain at k 8, each at the plan's default row tile and at ``--tiles`` (default 64: one 64-row tile).

Usage: ``python bench/probe_mla_parts.py [--json PATH] [--tiles 64]``. Needs a CUDA sm_90 GPU and Gluon (Triton 3.6+).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_I = " " * 12  # the kernel loop's indent
#: the kernel's store of a split's partial rows, which two probes replace
_WS_STORE = (_I + "gl.store(WS_O + ws_rows[None, :] * D + offs_d[:, None], out.to(WS_O.dtype.element_ty),\n"
             + _I + "         mask=ro_valid[None, :])\n")
#: (marker text in the kernel source, replacement) for each probe; every marker must be found
_EDITS = {
    "compute-only": [(_I + "if start + (i + NUM_BUF - 1) * BLOCK_N < end:",
                      _I + "if (start + (i + NUM_BUF - 1) * BLOCK_N < end) and False:")],
    "copies-only": [(_I + "s = warpgroup_mma(k_lat, q_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)\n"
                     + _I + "s = warpgroup_mma(kv_rope.index(buf), qr_smem.permute((1, 0)), s, is_async=True)\n"
                     + _I + "s = warpgroup_mma_wait(0, deps=(s, ))\n",
                     _I + "s = s_zero\n"),
                    (_I + "acc = warpgroup_mma(k_lat.permute((1, 0)), p_smem, acc, is_async=True)\n"
                     + _I + "acc = warpgroup_mma_wait(0, deps=(acc, ))\n", "")],
    "no-store": [(_WS_STORE, "")],
    "sum-store": [(_WS_STORE,
                   _I + "gl.store(WS_O + ws_rows * D, gl.sum(out, axis=0), mask=ro_valid)\n")],
}


def _probe_module(name: str, source: str, tmp: str):
    """The kernel module with probe ``name``'s edits, imported from a file in ``tmp``."""
    for old, new in _EDITS.get(name, ()):
        if old not in source:
            raise RuntimeError(f"probe {name!r}: the kernel source no longer has the text it edits; update _EDITS")
        source = source.replace(old, new)
    path = os.path.join(tmp, f"mla_probe_{name.replace('-', '_')}.py")
    with open(path, "w") as fh:
        fh.write(source)
    spec = importlib.util.spec_from_file_location(f"mla_probe_{name.replace('-', '_')}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--tiles", type=int, default=64, help="the other row tile to probe beside the plan's default")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_mla_parts: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    import bench_tree_attention as bta
    import specverify.attention as attention
    from specverify.benchmarking import copy_bandwidth_gbps, git_commit, graph_us
    from specverify.kernels import tree_attention_wgmma as wg
    from specverify.reference.attention import tree_attention_mla_reference

    if not wg.AVAILABLE:
        print(f"probe_mla_parts: {wg.UNAVAILABLE_REASON}", file=sys.stderr)
        return 2
    source = open(wg.__file__).read()
    bw = copy_bandwidth_gbps()
    print(f"# copy bandwidth {bw:.0f} GB/s; {torch.cuda.get_device_name()}", flush=True)
    merge = attention._launch_merge
    rows = []
    other = {"KERNEL": "mla_wgmma", "PDL": True, "BLOCK_M": args.tiles}
    shapes = [("deepseek-v3", 4, 16384, 4, True, 1), ("deepseek-v3", 4, 16384, 8, True, 1),
              ("kimi-k2", 1, 4096, 8, False, 64)]
    probes = [("full", "full", True, False), ("split-only", "full", False, False),
              ("compute-only", "compute-only", False, False), ("copies-only", "copies-only", False, False),
              ("no-store", "no-store", False, False), ("sum-store", "sum-store", False, False),
              ("full bf16 ws", "full", True, True),
              ("split-only bf16 ws", "full", False, True)]
    original = attention._wgmma_kernels
    with tempfile.TemporaryDirectory() as tmp:
        mods = {name: _probe_module(name, source, tmp) for name in ("full", *_EDITS)}
        try:
            for model, batch, ctx, k, tree, page in shapes:
                bta.PAGE_SIZE = page
                cfg, tensors, meta, _ = bta.make_inputs(model, batch, ctx, k, tree)
                ref = tree_attention_mla_reference(tensors["q_latent"], tensors["q_rope"], tensors["kv_cache"],
                                                   meta["page_table"], meta["prefix_lens"], meta["tree_mask"],
                                                   meta["sm_scale"])
                kv_bytes = batch * ctx * (cfg["r"] + cfg["dr"]) * 2
                shape = f"{model} b{batch} c{ctx} p{page} k{k}{'t' if tree else ''}"
                tiles = [("default", None)]
                if bta.triton_fn(cfg, tensors, meta, batch, k, ctx)[1].config["BLOCK_M"] != args.tiles:
                    tiles.append((f"M{args.tiles}", other))
                for tile_label, config in tiles:
                    for label, mod, with_merge, bf16 in probes:
                        attention._wgmma_kernels = lambda m=mods[mod]: m
                        attention._launch_merge = merge if with_merge else (lambda *a, **kw: None)
                        fn, plan = bta.triton_fn(cfg, tensors, meta, batch, k, ctx, config=config)
                        if bf16:
                            if plan.workspace_out is None:
                                continue
                            plan.workspace_out = plan.workspace_out.to(torch.bfloat16)
                        err = float("nan")
                        if label.startswith("full"):
                            out = attention.tree_attention_mla(*bta._positional(cfg, tensors), **meta, plan=plan,
                                                               validate=False)
                            err = (out.float() - ref).abs().max().item()
                        us = graph_us(fn, calls=20, repeats=3)
                        pc = plan.config
                        rows.append(dict(shape=shape, tile=tile_label, probe=label, us=us, err=err,
                                         bw_pct=100.0 * kv_bytes / (us * 1e-6) / (bw * 1e9), splits=plan.num_splits,
                                         block_m=pc["BLOCK_M"], num_warps=pc["num_warps"]))
                        print(f"  {shape:<34} {tile_label:<8} {label:<20} {us:8.2f} us  bw {rows[-1]['bw_pct']:5.1f}%"
                              f"  err {err:.3g}  S{plan.num_splits} M{pc['BLOCK_M']} w{pc['num_warps']}", flush=True)
                del tensors, meta, ref
                torch.cuda.empty_cache()
        finally:
            attention._wgmma_kernels = original
            attention._launch_merge = merge
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           commit=git_commit(__file__), date=datetime.datetime.now().isoformat(timespec="seconds"),
                           copy_gbps=bw, rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
