#!/usr/bin/env bash
# `make test [TEST_JOBS=N]`: the tests of tests/, in one pytest run (N = 1) or in N pytest
# processes at once. A fresh GPU machine spends most of a serial run compiling kernel variants
# on one core (over 10 minutes); the tests are dealt round robin over the processes, so each
# file's variants compile on all cores at once (the disk cache's lock builds each variant
# once). Prints every process's log, then the counts summed as one run would give them; the
# exit status is the worst process's. A run that collects no test fails, unless pytest options
# were given (a -k that selects nothing passes, and says so).
set -uo pipefail
python=$1 jobs=$2
shift 2  # the rest: pytest options (PYTEST_ARGS)
cd "$(dirname "$0")/.."
passed_if_empty() {  # pytest's exit status; "no test collected" (5) a pass only with options
  local rc=$1
  if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests"
    [ $# -gt 1 ] && rc=0
  fi
  return "$rc"
}
if [ "$jobs" -le 1 ]; then
  "$python" -m pytest -q -rs "$@" tests
  passed_if_empty $? "$@"
  exit
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m pytest --collect-only -q -p no:cacheprovider "$@" tests > "$work/collected" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  cat "$work/collected"
  passed_if_empty $rc "$@"
  exit
fi
grep '::' "$work/collected" | awk -v n="$jobs" -v dir="$work" '{print > (dir "/shard" (NR - 1) % n)}'
pids=()
shards=("$work"/shard*)
for shard in "${shards[@]}"; do
  mapfile -t ids < "$shard"
  "$python" -m pytest -q -rs -p no:cacheprovider "$@" "${ids[@]}" > "$shard.log" 2>&1 &
  pids+=($!)
done
rc=0
for i in "${!shards[@]}"; do
  wait "${pids[i]}"
  code=$?
  [ $code -ne 0 ] && rc=$code
  echo "== ${shards[i]##*/} (exit $code) =="
  cat "${shards[i]}.log"
done
tail -qn 1 "$work"/shard*.log | grep -oE '[0-9]+ (passed|failed|skipped|deselected|errors?)' \
  | awk '{n[$2] += $1} END {for (k in n) printf "%d %s, ", n[k], k; print "all processes"}'
exit $rc
