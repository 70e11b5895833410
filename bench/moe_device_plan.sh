#!/usr/bin/env bash
# The MoE measurements issue 5 still owes (bench/RESULTS.md, "Not yet measured"), as two device calls of under ten
# minutes each, in the repository root of the device machine:
#   bash bench/moe_device_plan.sh 1    # GPU tests of the router and the PDL chains, router sweep at M = 1-4
#   bash bench/moe_device_plan.sh 2    # router sweep at M = 8-64, stream experts with PDL_GATE at M = 1, 2
# Each part ends its router sweep with the stage prices (bench/route_stages.py: atomics, ticket, loads, finish).
# Carry .whl (bash ../shared/tools/gpu-wheels.sh .whl) for SGLang's router row in part 1. Logs and JSON under $OUT.
set -uo pipefail
part=${1:?usage: bash bench/moe_device_plan.sh 1|2}
OUT=${OUT:-/tmp/out}
export OUT DEADLINE=${DEADLINE:-560} TAILN=${TAILN:-45}
# every router configuration the sweep times is first checked against the references (the CUT rows: ids only);
# up to M = 4 the default takes the one-program or the sorted path, so the row-mask variants only count from M = 8
base="router only pdl,fast,fast no mask,fast pdl,fast cut*"
masks="fast mask slot writes,fast mask flat pads,fast mask barrier,fast pdl mask barrier"

route_sweep() {  # NAME MS VARIANTS BUDGET_S: the router sweep as step cmd-NAME, its stage prices as cmd-stages
  export CMD_$1="python3 bench/sweep_moe.py --ops route --models kimi-k2 --ms $2 --route-variants '$3' --budget-s $4 --json $OUT/$1.json"
  export LIMIT_$1=$(( $4 + 30 ))
  export CMD_stages="python3 bench/route_stages.py $OUT/$1.json --markdown"
}

case $part in
  1)
    export CMD_tests='python3 -P -m pytest -q -p no:cacheprovider --rootdir=. tests/test_moe.py -k "pdl or cut_stages or mask or sorted_exact or cuda_graph or repeat or fast_route or route_real"'
    export LIMIT_tests=260
    route_sweep route_small 1,2,3,4 "$base,sglang (peer)" 200
    exec bash bench/device_run.sh cmd-tests cmd-route_small cmd-stages ;;
  2)
    # SGLang's router + alignment takes 7-240 us from M = 8 and compiles slowly: left out here (runs 47-48 have it)
    route_sweep route_large 8,16,32,64 "$base,$masks" 250
    export CMD_experts="python3 bench/sweep_experts.py --ms 1,2 --routed-only --variants 'default (auto),stream default,stream PDL_GATETrue' --budget-s 200 --json $OUT/experts.json"
    export LIMIT_experts=240
    exec bash bench/device_run.sh cmd-route_large cmd-stages cmd-experts ;;
  *) echo "unknown part $part (1 or 2)" >&2; exit 2 ;;
esac
