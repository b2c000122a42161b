#!/usr/bin/env bash
# One GPU visit: install TE and the wheels the image lacks, run benchmarks/gpu_suite.py inside BUDGET_S,
# archive its folder into $OUT. Usage: BUDGET_S=... COMMIT=... bash .gpu/visit.sh [--stages ...]
cd "$(dirname "$0")/.."
T0=$(date +%s)
bash .te/te_install.sh > /tmp/te_install.log 2>&1; echo "te_install rc=$? ($(tail -1 /tmp/te_install.log)) $(( $(date +%s) - T0 ))s"
LEFT=$(( BUDGET_S - ($(date +%s) - T0) - 15 ))
MEGATRON_EXT_COMMIT=$COMMIT bash .gpu/run.sh python3 benchmarks/gpu_suite.py --budget-s $LEFT --reserve-s 5 \
  --output-dir /tmp/suite --data-dir .gpu/demo "$@"
echo "suite rc=$? at $(( $(date +%s) - T0 ))s"
cp /tmp/te_install.log /tmp/suite/ 2>/dev/null
tar -czf "$OUT/suite.tgz" -C /tmp suite; cp /tmp/suite/summary.md "$OUT/summary.md" 2>/dev/null
cat /tmp/suite/summary.md 2>/dev/null | head -60
