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
declare -A RESULT
status=0
for v in "${VERSIONS[@]}"; do
  venv=$SCRATCH/triton-$v
  log=$OUT/triton-$v.log
  echo "=== Triton $v: venv $venv" | tee "$log"
  if ! { "$PY" -m venv "$venv" &&
         "$venv/bin/pip" install -q "$TORCH_SPEC" "triton==$v" &&
         "$venv/bin/pip" install -q --no-deps "$ROOT"; } >>"$log" 2>&1; then
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
[ "${KEEP_VENVS:-0}" = 1 ] || rm -rf "$SCRATCH"
echo "=== compile matrix summary"
for v in "${VERSIONS[@]}"; do echo "  triton $v: ${RESULT[$v]}"; done
exit $status
