"""Fail unless the wheel holds the Triton kernels and CUDA sources inside the package and no top-level kernels/."""
import sys
import zipfile

names = zipfile.ZipFile(sys.argv[1]).namelist()
tops = {n.split("/")[0] for n in names}
problems = []
if "kernels" in tops or "csrc" in tops:
    problems.append(f"top-level kernels/ or csrc/ in the wheel: {sorted(tops)}")
if not any(n.startswith("specverify/kernels/") and n.endswith(".py") and "__init__" not in n for n in names):
    problems.append("no Triton kernel under specverify/kernels/")
if not any(n.startswith("specverify/csrc/") and n.endswith((".cu", ".cuh")) for n in names):
    problems.append("no CUDA source under specverify/csrc/")
if problems:
    sys.exit("wheel check failed: " + "; ".join(problems))
print(f"wheel ok: {len(names)} files, top level {sorted(tops)}")
