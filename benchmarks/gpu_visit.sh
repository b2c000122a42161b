#!/usr/bin/env bash
# The one call of a lent GPU machine's visit (benchmarks/results/gpu_visits/README.md: preparing it):
# install Transformer Engine (.te/) and the wheels the image lacks (.gpu/), run benchmarks/gpu_suite.py
# in what is left of BUDGET_S, then bring its folder back under $OUT: the summaries first, then an
# archive without files over 20 MB (the 2026-11-27 visit's archive of 7 GB of resume checkpoints did
# not fit its call), naming what it left out.
#   BUDGET_S=540 COMMIT=$(git rev-parse --short HEAD) bash benchmarks/gpu_visit.sh [suite flags, e.g. --stages ...]
# Give the call's timeout ~45 s more than BUDGET_S (the archive and the copy back).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${BUDGET_S:?seconds for the whole visit, set-up included}" "${COMMIT:?the commit the tree is at (its copy may have no git history)}"
OUT=${OUT:-/tmp/out}; SUITE=${SUITE_DIR:-/tmp/suite}
mkdir -p "$OUT"
T0=$(date +%s)
if [[ -f .te/te_install.sh ]]; then
  bash .te/te_install.sh > /tmp/te_install.log 2>&1
  echo "te_install rc=$? ($(tail -1 /tmp/te_install.log)) $(( $(date +%s) - T0 ))s"
fi
LEFT=$(( BUDGET_S - ($(date +%s) - T0) - 15 ))
MEGATRON_EXT_COMMIT=$COMMIT bash .gpu/run.sh python3 -m benchmarks.gpu_suite --budget-s "$LEFT" --reserve-s 5 \
  --output-dir "$SUITE" --data-dir .gpu/demo "$@"
echo "suite rc=$? at $(( $(date +%s) - T0 ))s"
cp /tmp/te_install.log "$SUITE/" 2>/dev/null
cp "$SUITE/summary.md" "$SUITE/summary.json" "$OUT/" 2>/dev/null
(cd "$SUITE" && find . -type f -size +20M) > /tmp/left_out.txt
[[ -s /tmp/left_out.txt ]] && { echo "left out of the archive (over 20 MB):"; cat /tmp/left_out.txt; cp /tmp/left_out.txt "$OUT/"; }
timeout 60 tar -czf "$OUT/suite.tgz" -C "$SUITE" -X /tmp/left_out.txt . || echo "archive failed or cut (rc=$?)"
head -60 "$SUITE/summary.md" 2>/dev/null
