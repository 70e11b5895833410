#!/usr/bin/env bash
# One device call: install the package (and the SGLang peer wheels if carried in .whl/), then run the named steps,
# writing logs and JSON under $OUT. Usage: bash bench/device_run.sh STEP [STEP ...]
# Steps: env, tests-<name>, gpu-<name> (GPU-marked tests of tests/test_<name>.py), par-<name> (the same in $SHARDS
# parallel processes on the one GPU, bench/par_pytest.sh: the shards' failures run again alone, which sets the status;
# par-all: every GPU test file), bench-<name>, script-<name>
# (bench/<name>.py with $ARGS_<name>), cmd-<name> (bash -c "$CMD_<name>", for arguments with spaces), sweep-<group>[+<group>...], wall-<name> ($WALL_ARGS_<name>, else $WALL_ARGS), sglwall-<name> (the same with SGLang's import-only stand-ins installed
# first: torchvision, IPython; for --impl ...,sglang with .whl/ carried), peer, sglang-tests,
# pack (tar everything under $OUT into results.tgz: the device tool brings back at most 8 files)
# Peer wheels: .whl/ is read in the folder this runs from (`cd .export && ...`: carry .export/.whl). The SGLang set
# and the FlashInfer set (../shared/tools/gpu-wheels.sh [--flashinfer]) go in two calls back to back: both stay
# installed in /tmp/peersite while the machine is warm, so the second call's steps see both.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
site=/tmp/svsite; rm -rf "$site"; mkdir -p "$site"
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target "$site" . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peersite .whl/*.whl >>"$OUT/install.log" 2>&1 \
    || { echo "!!! the carried wheels did not install (two versions of one package?):"; tail -n 3 "$OUT/install.log"; }
  export PYTHONPATH=$site:/tmp/peersite
else
  export PYTHONPATH=$site
fi
# FIRST_PYTHONPATH goes before everything (a carried Triton installed with --target shadows the machine's own)
[ -n "${FIRST_PYTHONPATH:-}" ] && export PYTHONPATH=$FIRST_PYTHONPATH:$PYTHONPATH
export SPECVERIFY_CACHE_DIR=/tmp/svcache
# a tree exported with `git archive` carries its commit in COMMIT (see the device notes in bench/RESULTS.md)
[ -f COMMIT ] && export SPECVERIFY_COMMIT=$(cat COMMIT)
start=$(date +%s)
# DEADLINE (seconds from the start of this script, default 560): a step gets at most the time left before it, and
# steps that would start with less than 15 s left are skipped, so the final `pack` always runs inside the call.
# A step's own limit: $LIMIT_<log name> (e.g. LIMIT_wall_k2), else $LIMIT, else 300 s.
run() {
  local name=$1; shift; local t0=$(date +%s); local left=$(( ${DEADLINE:-560} - (t0 - start) ))
  if (( left < 15 )); then echo "=== $name skipped: deadline"; return; fi
  local lv="LIMIT_$name"; local lim=${!lv:-${LIMIT:-300}}; (( lim > left )) && lim=$left
  echo "=== $name (limit ${lim}s): $*"; timeout "$lim" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $(( $(date +%s) - t0 ))s"; tail -n "${TAILN:-25}" "$OUT/$name.log"
}
for step in "$@"; do
  case $step in
    env) run env python3 -P -m specverify env ;;
    tests-*) n=${step#tests-}; run "tests_$n" python3 -P -m pytest -q -p no:cacheprovider -x --rootdir=. tests/test_$n*.py ;;
    bench-*) n=${step#bench-}; run "bench_$n" python3 bench/bench_$n.py --quick --json "$OUT/bench_$n.json" ${BENCH_ARGS:-} ;;
    wall-*) n=${step#wall-}; a="WALL_ARGS_$n"; run "wall_$n" python3 -P -m specverify bench verify-wall ${!a:-${WALL_ARGS:-}} --json "$OUT/wall_$n.json" --plot "$OUT/wall_$n.png" ;;
    sglwall-*) n=${step#sglwall-}; a="WALL_ARGS_$n"; run "sglwall_$n" python3 -P -c "import sys; sys.path.insert(0, 'tests/sglang'); import standins; standins.install(); standins.transformers_sees_no_torchvision(); from specverify.cli import main; sys.exit(main(['bench', 'verify-wall', *sys.argv[1:]]))" ${!a:-${WALL_ARGS:-}} --json "$OUT/sglwall_$n.json" ;;
    sweep-*) n=${step#sweep-}; run "sweep_$n" python3 bench/sweep_verify_kernels.py --only "${n//+/,}" --json "$OUT/sweep_$n.json" ${SWEEP_ARGS:-} ;;
    script-*) n=${step#script-}; a="ARGS_$n"; run "$n" python3 bench/$n.py --json "$OUT/$n.json" ${!a:-} ;;
    gpu-*) n=${step#gpu-}; a="ARGS_$n"; run "gpu_$n" python3 -P -m pytest -q -p no:cacheprovider --rootdir=. -m gpu tests/test_$n.py ${!a:-} ;;
    par-*) n=${step#par-}; f=tests/test_$n.py; [ "$n" = all ] && f=$(echo tests/test_*.py)
      run "par_$n" env PAR_TMP=/tmp/par_$n bash bench/par_pytest.sh $f ;;
    cmd-*) n=${step#cmd-}; a="CMD_$n"; run "$n" bash -c "${!a}" ;;
    peer) run peer python3 -P -c "from specverify.peers import sglang as p; print(p.available())" ;;
    sglang-tests) run sglang_tests python3 -P -m pytest -q -p no:cacheprovider --rootdir=. tests/sglang -m sglang ${ARGS_sglang:-} ;;
    pack) tar czf /tmp/results.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/results.tgz "$OUT/" ;;
    *) echo "unknown step $step" ;;
  esac
done
