#!/usr/bin/env bash
# Offline compile matrix (issue 23 item 2): for each supported Triton, a scratch venv with CPU torch + that Triton
# + specverify (non-editable), then bench/compile_matrix.py for sm_90a and sm_120. No GPU needed.
#
# Usage: .ci/compile_matrix.sh [TRITON_VERSION ...]          (default: 3.6.0 3.7.1 3.8.0 3.9.0)
# Env:   TORCH_SPEC      torch requirement (default torch==2.13.0, CPU wheel)
#        MATRIX_ARGS     extra arguments for the script (e.g. "--allow-fail sm_120" while sm_120 is known short,
#                        "--quick")
#        MATRIX_OUT      folder for the per-version JSON and logs (default bench/out/compile_matrix)
#        KEEP_VENVS=1    keep the scratch venvs (default: removed after each version)
#        MATRIX_VENVS    folder of reusable venvs, one per version (kept; a venv that already has that Triton and
#                        torch only gets specverify reinstalled): for re-runs while fixing a kernel
# Exit:  non-zero when any version fails to install or its matrix fails (a version's failure does not stop the
#        others; the summary at the end names each).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
VERSIONS=("$@")
[ ${#VERSIONS[@]} -eq 0 ] && VERSIONS=(3.6.0 3.7.1 3.8.0 3.9.0)
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
OUT=${MATRIX_OUT:-$ROOT/bench/out/compile_matrix}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
SCRATCH=$(mktemp -d -t specverify-matrix.XXXXXX)
VENVS=${MATRIX_VENVS:-$SCRATCH}
[ -n "${MATRIX_VENVS:-}" ] && { mkdir -p "$VENVS"; KEEP_VENVS=1; }
declare -A RESULT
status=0
for v in "${VERSIONS[@]}"; do
  venv=$VENVS/triton-$v
  log=$OUT/triton-$v.log
  echo "=== Triton $v: venv $venv" | tee "$log"
  # a kept venv that already has this Triton and the torch asked for skips the (large) installs
  have=$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('triton'), m.version('torch'))" \
         2>/dev/null)
  want_torch=${TORCH_SPEC#torch==}
  if [ "${have%% *}" = "$v" ] && [[ "${have#* }" == "$want_torch"* ]]; then
    echo "reusing $venv (triton ${have%% *}, torch ${have#* })" >>"$log"
    deps_ok=1
  else
    deps_ok=0
  fi
  # torch's CPU wheel needs no Triton, so both resolve together; where pip only finds a CUDA torch (which pins its
  # own Triton) the Triton under test goes over it without dependencies (the matrix uses torch's fake tensors only)
  if ! { { [ $deps_ok = 1 ] || { "$PY" -m venv --clear "$venv" &&
                                 { "$venv/bin/pip" install -q "$TORCH_SPEC" "triton==$v" ||
                                   { echo "joint install failed: torch first, then triton==$v --no-deps" &&
                                     "$venv/bin/pip" install -q "$TORCH_SPEC" &&
                                     "$venv/bin/pip" install -q --no-deps --force-reinstall "triton==$v"; }; }; }; } &&
         "$venv/bin/pip" install -q --no-deps --force-reinstall "$ROOT"; } >>"$log" 2>&1; then
    echo "Triton $v: install failed (see $log)"; RESULT[$v]="install-failed"; status=1
  else
    # run from outside the checkout so the installed package (not the source tree) is imported
    got=$(cd "$SCRATCH" && "$venv/bin/python" -c "import triton; print(triton.__version__)")
    start=$(date +%s)
    (cd "$SCRATCH" && env -u TRITON_INTERPRET TRITON_CACHE_DIR="$venv/triton-cache" \
        "$venv/bin/python" "$ROOT/bench/compile_matrix.py" --json "$OUT/triton-$v.json" ${MATRIX_ARGS:-}) \
        > "$OUT/triton-$v.txt" 2>>"$log"
    rc=$?
    echo "Triton $v (imported $got): exit $rc in $(( $(date +%s) - start )) s; table $OUT/triton-$v.txt" | tee -a "$log"
    tail -n 1 "$OUT/triton-$v.txt"
    RESULT[$v]="exit $rc"
    [ $rc -ne 0 ] && status=1
  fi
  [ "${KEEP_VENVS:-0}" = 1 ] || rm -rf "$venv"
done
{ [ "${KEEP_VENVS:-0}" = 1 ] && [ "$VENVS" = "$SCRATCH" ]; } || rm -rf "$SCRATCH"
echo "=== compile matrix summary"
for v in "${VERSIONS[@]}"; do echo "  triton $v: ${RESULT[$v]}"; done
exit $status
