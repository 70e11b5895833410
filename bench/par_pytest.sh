#!/usr/bin/env bash
# The marked tests of FILES in $SHARDS pytest processes (default 6, round-robin over the test ids) on one GPU:
# compilation is what takes the time. Tests that fail or error there are run again, alone, in one process after the
# shards end (six processes can hold more than one card's memory: an out-of-memory failure under that contention is
# not the test's), and the exit status is that rerun's. Both logs are printed: the shards' first, then the rerun's.
# Usage: bash bench/par_pytest.sh FILE [FILE ...]   ($PAR_MARK: the -m expression, default gpu; $PAR_TMP: scratch)
set -uo pipefail
mark=${PAR_MARK:-gpu}
tmp=${PAR_TMP:-$(mktemp -d)}
mkdir -p "$tmp"
rm -f "$tmp"/shard.* "$tmp"/ids "$tmp"/failed "$tmp"/rerun.log
pytest_q=(python3 -P -m pytest -q -p no:cacheprovider --rootdir=. -m "$mark")
"${pytest_q[@]}" --co "$@" > "$tmp/collect.log" 2>&1
grep :: "$tmp/collect.log" > "$tmp/ids"
if [ ! -s "$tmp/ids" ]; then cat "$tmp/collect.log"; echo "par_pytest: no test marked '$mark' in $*"; exit 5; fi
split -n "r/${SHARDS:-6}" "$tmp/ids" "$tmp/shard."
for f in "$tmp"/shard.??; do
  xargs -r -a "$f" -d '\n' "${pytest_q[@]}" -rf --durations=5 > "$f.log" 2>&1 &
done
wait
cat "$tmp"/shard.??.log
# "FAILED tests/x.py::test_y[id] - reason" and "ERROR tests/x.py::test_y[id] - reason" give the ids to run again
grep -h -E '^(FAILED|ERROR) ' "$tmp"/shard.??.log | sed -E 's/^(FAILED|ERROR) //; s/ - .*$//' | sort -u > "$tmp/failed"
if [ ! -s "$tmp/failed" ]; then exit 0; fi
echo "=== par_pytest: $(wc -l < "$tmp/failed") failed or errored in the shards; run again alone:"
cat "$tmp/failed"
xargs -a "$tmp/failed" -d '\n' "${pytest_q[@]}" -rf > "$tmp/rerun.log" 2>&1
rc=$?
cat "$tmp/rerun.log"
exit $rc
