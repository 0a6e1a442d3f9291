#!/usr/bin/env bash
# `make test TEST_JOBS=N`: the test files of `make test`, one pytest process each, N at a time
# (a fresh GPU machine spends most of a serial run compiling kernel variants on one core; its
# 16 cores cut the whole suite from over 10 minutes to about 7). The slowest files start first;
# every file's log is printed whole, then one line per file and the exit status of the worst.
set -uo pipefail
python=$1 jobs=$2
shift 2  # the rest: pytest options (PYTEST_ARGS)
cd "$(dirname "$0")/.."
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
slow_first=(tests/test_stacked_kv_proj_gpu.py tests/test_compile.py)
mapfile -t files < <({ printf '%s\n' "${slow_first[@]}"; ls -S tests/test_*.py; } | awk '!seen[$0]++')
export python logs
# shellcheck disable=SC2016  # expanded by the inner shell
printf '%s\n' "${files[@]}" | xargs -P "$jobs" -I {} bash -c '
  log="$logs/$(basename {} .py).log"
  "$python" -m pytest -q -rs -p no:cacheprovider "$@" {} > "$log" 2>&1
  rc=$?; [ $rc -eq 5 ] && rc=0  # no test collected
  echo $rc > "$log.rc"' _ "$@"

for f in "${files[@]}"; do cat "$logs/$(basename "$f" .py).log"; done
echo "== per file =="
rc=0
for f in "${files[@]}"; do
  log="$logs/$(basename "$f" .py).log"
  code=$(cat "$log.rc" 2>/dev/null || echo 1)
  [ "$code" -ne 0 ] && rc=$code
  echo "$f (rc $code): $(tail -n 1 "$log")" | tee -a "$logs/summary"
done
# the files' counts summed, as one pytest run over tests/ would give them
grep -oE '[0-9]+ (passed|failed|skipped|deselected|errors?)' "$logs/summary" \
  | awk '{n[$2] += $1} END {for (k in n) printf "%d %s, ", n[k], k; print "all files"}'
exit $rc
