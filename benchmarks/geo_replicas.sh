#!/usr/bin/env bash
# Geo: a 3-region skewed diurnal workload. skymesh (dualmap + cross-region offload) with R
# replicas per region, vs region-local (dualmap@local, no offload) with R..R+4; each
# result dir holds results.json with the goodput.
set -euo pipefail
R=${R:-3}
OUT=${OUT:-bench-out/geo}
COMMON=(--regions 3 --skew 0.5 --diurnal-period-s 1200 --duration-s 1200 --rates 1,2,3,4 --slo 2)
.venv/bin/skymesh sim "${COMMON[@]}" --systems dualmap --replicas "$R" --out "$OUT/mesh-r$R"
for n in $(seq "$R" $((R + 4))); do
  .venv/bin/skymesh sim "${COMMON[@]}" --systems dualmap@local --replicas "$n" --out "$OUT/local-r$n"
done
for d in "$OUT"/*/; do
  python3 -c "import json,sys; d=json.load(open('$d/results.json')); [print('$d', k, v['goodput'], v['slo_attainment']) for k,v in d['systems'].items()]"
done
