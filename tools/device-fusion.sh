#!/usr/bin/env bash
# The signals the adaptive fusion is fitted and judged on (endo_retrieval/calibration/signals.py), on one GPU: every
# labelled set's train split (at most 200 questions each) and test split (at most 300), four processes side by side.
#
# Needs, carried: .whl (tools/device-wheels.sh), .device-data (a copy of ../shared/data), and under $MODELS
# (tools/device-parts.sh, default /root/parts/models/models): smollm/ and minilm/ (the two model packages); MODEL=PATH
# for another model (one process a GPU, GPUS=2 on two); DATA: the data folder (default .device-data); TRAIN, TEST: questions per split (200, 300); PARTS=pipe,cpu,... the parts of each record to collect (signals.py's PARTS; default all).
# BASE=only: the bench rows alone, no signals: SYSTEMS (default llamaindex-bm25,minilm) on each test split, written
# as $res/${PREFIX:-base}_DOMAIN.json (SYSTEMS=endo,minilm+reranker,bm25+reranker PREFIX=run: the shipped fusions run).
#   start:   setsid nohup bash tools/device-fusion.sh run > /root/fusion.log 2>&1 &
#   collect: bash tools/device-fusion.sh collect   (packs /root/sig into $OUT/signals.tgz)
# The machine goes back 30 s after a call ends, background work or not: keep a call waiting on the run in flight.
set -uo pipefail
res=/root/sig
if [ "${1:-run}" = collect ]; then tar -C /root -czf "$OUT/signals.tgz" sig fusion.log; ls -la "$OUT"; exit 0; fi
mkdir -p "$res"
if [ ! -x /root/site/bin/endo ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site .whl/*.whl || exit 1
fi
models=${MODELS:-/root/parts/models/models}
cp -rn "$models"/minilm/* "$models"/smollm/* /root/site/ 2>/dev/null
export PYTHONPATH=/root/site PATH=/root/site/bin:$PATH PYTHONUNBUFFERED=1 TQDM_DISABLE=1 OMP_NUM_THREADS=4
export HF_HUB_OFFLINE=1 JAX_PLATFORMS=cpu
d=${DATA:-$PWD/.device-data}; dom=$d/domains; sci=$d/scifact/scifact.json.gz; hot=$d/hotpotqa
model=(${MODEL:+--model "$MODEL"} ${PARTS:+--parts "$PARTS"})
signals=1; [ "${BASE:-1}" != only ] || signals=0
collect() { (cd /root && python3 -m endo_retrieval.calibration.signals "$res/${TAG:-default}" "$@" "${model[@]}"); }  # the installed wheels, not the tree
tr=${TRAIN:-200}; te=${TEST:-300}
groups=("$dom/arguana.json.gz:train@$tr $dom/arguana.json.gz:test@$te $hot/dev300.json"
        "$dom/fiqa2018_pooled.json.gz:train@$tr $dom/fiqa2018_pooled.json.gz:test@$te $hot/fit300.json@$tr"
        "$dom/stackfaq.json.gz:train@$tr $sci:train@$tr $dom/stackfaq.json.gz:test@$te $sci:test"
        "$dom/csn_style_python.json.gz:train@$tr $dom/conala.json.gz:train@$tr $dom/csn_style_python.json.gz:test@$te $dom/conala.json.gz:test@$te")
if [ $signals = 1 ] && [ -n "${MODEL:-}" ]; then  # a larger model: one process a GPU, the groups in turn on each
  gpus=${GPUS:-1}
  (cd /root && python3 -c "import sys; from endo_retrieval.model.locate import locate_model; locate_model(sys.argv[1])" \
    "$MODEL") > "$res/convert.log" 2>&1 || { cat "$res/convert.log"; exit 1; }  # converted once, before they start
  for g in $(seq 0 $((gpus - 1))); do
    for i in "${!groups[@]}"; do
      [ $((i % gpus)) = "$g" ] && CUDA_VISIBLE_DEVICES=$g collect ${groups[$i]} > "$res/g$((i + 1)).log" 2>&1
    done &
  done
elif [ $signals = 1 ]; then  # the 135M: the four groups side by side on one GPU
  for i in "${!groups[@]}"; do collect ${groups[$i]} > "$res/g$((i + 1)).log" 2>&1 & done
fi
if [ -z "${MODEL:-}" ] && [ "${BASE:-1}" != 0 ]; then  # the first stages alone, as a user builds them: LlamaIndex BM25, a MiniLM store
  export TIKTOKEN_CACHE_DIR=/root/site/llama_index/core/_static/tiktoken_cache
  for s in "$dom/arguana.json.gz" "$dom/fiqa2018_pooled.json.gz" "$dom/stackfaq.json.gz" "$dom/conala.json.gz" \
           "$dom/csn_style_python.json.gz" "$sci" "$hot/dev300.json"; do
    name=$(basename "$s" | cut -d. -f1); spec=$s; [ "${s%.json}" != "$s" ] || spec="$s:test"
    [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $name "* ]] || continue  # ONLY="scifact dev300": those domains
    endo bench corpus --data "$spec" --limit 300 --systems "${SYSTEMS:-llamaindex-bm25,minilm}" \
      --out "$res/${PREFIX:-base}_$name.json" > "$res/${PREFIX:-base}_$name.log" 2>&1 &
  done
fi
wait
echo finished
