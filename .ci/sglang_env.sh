#!/usr/bin/env bash
# Make the virtual environment the SGLang plugin tests run in: CPU torch, Triton, sglang==0.5.23 WITHOUT its
# dependencies (they pull ~11 GB of CUDA packages), the small pure-Python packages its imports need, and our
# package from a built wheel. No torchvision: tests/sglang/standins.py provides an import-only stand-in.
# Usage: bash .ci/sglang_env.sh VENV_DIR WHEEL          (about 2 minutes on a CI machine; fails if CUDA got in)
set -euo pipefail
venv=${1:?usage: sglang_env.sh VENV_DIR WHEEL}
wheel=${2:?usage: sglang_env.sh VENV_DIR WHEEL}
py=${PYTHON:-python3}
repo=$(cd "$(dirname "$0")/.." && pwd)
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1

rm -rf "$venv"
"$py" -m venv "$venv"
pip() { "$venv/bin/python" -m pip install -q "$@" 2>&1 | grep -v -E "^WARNING: Location|^ERROR: pip's dependency resolver|requires .*, which is not installed|but you have .* which is incompatible" || true; }

# 1. CPU torch (a local file on these machines) and Triton, pinned so nothing later can swap them.
pip "torch==2.13.0" "triton==3.9.0" numpy filelock packaging pytest
# 2. SGLang and the packages its module-level imports need, all without dependency resolution (every one
#    listed, versions that were seen to work together), so no CUDA wheel can be pulled in.
pip --no-deps "sglang==0.5.23" "apache-tvm-ffi==0.1.11" \
  aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 annotated-types==0.8.0 \
  anyio==4.16.0 attrs==26.1.0 certifi charset-normalizer click compressed-tensors==0.20.1 dill einops \
  fastapi==0.165.0 frozenlist gguf==0.19.0 h11 hf-xet huggingface_hub==2.4.0 idna jiter loguru markdown-it-py \
  mdurl msgspec==0.22.0 multidict openai==3.57.0 orjson partial-json-parser pillow propcache psutil pybase64 \
  pydantic==2.14.4 pydantic_core==2.50.5 PyYAML pyzmq regex requests rich safetensors sentencepiece shellingham \
  sniffio starlette==1.10.0 tokenizers==0.23.3 tqdm transformers==5.24.0 typer typing-inspection \
  typing_extensions urllib3 uvicorn==0.54.0 yarl httpx2 httpcore2 truststore opentelemetry-api==1.45.2 \
  importlib-metadata zipp
# 3. Our package (its torch/triton/numpy requirements are already met).
pip --no-deps "$wheel"

# Guards: the wrong torch, a CUDA package or a missing import fail here, not halfway through the tests.
"$venv/bin/python" - <<'PY'
import importlib.metadata as md, sys
bad = sorted(d.metadata["Name"] for d in md.distributions()
             if d.metadata["Name"].lower().startswith(("nvidia-", "cuda-", "torchvision")))
torch_v = md.version("torch")
if bad or "+cpu" not in torch_v:
    sys.exit(f"sglang venv: CUDA packages or a non-CPU torch got in: torch {torch_v}, {bad}")
PY
(cd /tmp && TRITON_INTERPRET=1 "$venv/bin/python" - <<PY
import sys
sys.path.insert(0, "$repo/tests/sglang")
import standins; standins.install()
import sglang.srt.plugins, sglang.srt.layers.attention.triton_backend, sglang.srt.layers.moe.topk
import sglang.test.kits.attention_unittest.runner_modes.speculative_target_verify_runner
import specverify.integrations.sglang as p
print("sglang venv ready:", p.SGLANG_VERSION, "plugin at", p.__file__)
PY
)
