#!/usr/bin/env bash
# On one GPU: what the second pool's read costs (tools/pool_cost.py, side by side), then two and four processes
# each asking the same questions at once on the same GPU (all must finish; their wall time and throughput).
# Needs the wheels installed and the models copied as tools/device-fusion.sh does (it does both on its first run).
#   bash tools/device-pool-cost.sh   (results under $OUT)
# MODEL=PATH another model (e.g. a GGUF file); COUNTS="2 4" the processes at once; QUESTIONS=100 each asks; ALONE=0
# skips the first run (one process alone).
set -uo pipefail
export PYTHONPATH=/root/site PATH=/root/site/bin:$PATH PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1
export OMP_NUM_THREADS=4 JAX_PLATFORMS=cpu
spec=$PWD/.device-data/domains/conala.json.gz:test; tool=$PWD/tools/pool_cost.py
cd /root
q=${QUESTIONS:-100}; model=(${MODEL:+--model "$MODEL"})
if [ "${ALONE:-1}" != 0 ]; then
  python3 "$tool" "$spec" --docs 1000 --questions "$q" --device cuda "${model[@]}" --out "$OUT/pool_cost_h200.json" || exit 1
fi
for n in ${COUNTS-2 4}; do  # COUNTS="": none
  t0=$SECONDS
  for i in $(seq 1 "$n"); do
    python3 "$tool" "$spec" --docs 1000 --questions "$q" --device cuda "${model[@]}" --out "$OUT/together_${n}_$i.json" &
  done
  wait
  echo "{\"processes\": $n, \"wall_s\": $((SECONDS - t0)), \"finished\": $(ls "$OUT"/together_"$n"_*.json | wc -l)}"
done
