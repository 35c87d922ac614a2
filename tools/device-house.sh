#!/usr/bin/env bash
# On one GPU, side by side: dev300's rankings of the endo rows and both rerankers at two builds (tools/rankings_dump.py;
# the old build's project wheels under OLD), then, alone once the rankings are done, `endo bench ann --device cuda`
# (every passage of the shared data embedded on the GPU: its throughput and the cells' recall on real text).
# Needs, carried: .whl (tools/device-wheels.sh), $OLD (the other build's project wheels), .device-data, and the
# model packages under /root/parts/sm/models (tools/device-parts.sh sm: smollm/ and minilm/).
#   bash tools/device-house.sh          (writes into $OUT)
set -uo pipefail
OLD=${OLD:-.device-parts/oldwhl}
if [ ! -x /root/site/bin/endo ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site .whl/*.whl || exit 1
  cp -r /root/parts/sm/models/minilm/* /root/parts/sm/models/smollm/* /root/site/
fi
# the other build's own wheels in a folder of their own, first on its path (installed over /root/site with --upgrade,
# pip would replace the whole llama_index folder, llama_index.core with it)
[ -d /root/site_old ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site_old \
  "$OLD"/*.whl || exit 1
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 OMP_NUM_THREADS=4 HF_HUB_OFFLINE=1 JAX_PLATFORMS=cpu
export TIKTOKEN_CACHE_DIR=/root/site/llama_index/core/_static/tiktoken_cache
d=$PWD/.device-data; rows=endo,endo-2hop,minilm+reranker,bm25+reranker
for build in new old; do
  site=/root/site; [ $build = old ] && site=/root/site_old:/root/site
  (cd /root && PYTHONPATH=$site PATH=/root/site/bin:$PATH python3 "$OLDPWD/tools/rankings_dump.py" "$OUT/rankings_$build.json.gz" \
     --data "$d/hotpotqa/dev300.json" --systems $rows --out "$OUT/rankings_$build.json") > "$OUT/rankings_$build.log" 2>&1 &
done
wait
PYTHONPATH=/root/site PATH=/root/site/bin:$PATH endo bench ann --device cuda --data "$d" --questions 1000 \
  --probes 16,32,64,128,256 --synthetic-queries 200 --out "$OUT/ann_recall_h200.json" > "$OUT/ann.log" 2>&1
echo finished
