#!/usr/bin/env bash
# The one-endo measurements of docs/results.md ("One endo: hybrid candidates, one reader"), on a device machine of
# two GPUs, one model per GPU: for each model, `endo calibrate-pipeline --first-stage hybrid` on fit300 and
# SciFact train (written into the installed profile), then `endo bench corpus` on dev300 and on SciFact test with
# every row side by side (the new default `endo`, today's `endo@bm25` and `endo-2hop@bm25`, the rerankers after
# BM25 and MiniLM, the first stages alone), the two sets side by side on the model's GPU.
#
# Needs, carried: .whl (tools/device-wheels.sh), .device-data (a copy of ../shared/data), and under /root/parts
# (tools/device-parts.sh): q15.file (Qwen2.5-Coder-1.5B GGUF), smollm/ and minilm/ (the two model packages).
#   start:   setsid nohup bash tools/device-one-endo.sh run > /root/one-endo.log 2>&1 &   (MODELS=default: 135M only)
# The machine goes back 30 s after a call ends, background work or not: keep a call waiting on the run in flight.
#   collect: bash tools/device-one-endo.sh collect   (packs /root/res into $OUT/one-endo.tgz)
set -uo pipefail
res=/root/res
if [ "${1:-run}" = collect ]; then tar -C /root -czf "$OUT/one-endo.tgz" res one-endo.log; ls -la "$OUT"; exit 0; fi
mkdir -p "$res"
python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site .whl/*.whl || exit 1
cp -rn /root/parts/minilm/minilm/* /root/parts/smollm/smollm/* /root/site/
[ ! -e /root/parts/q15.file ] || mv /root/parts/q15.file /root/parts/qwen2.5-coder-1.5b-instruct.gguf
export PYTHONPATH=/root/site PATH=/root/site/bin:$PATH PYTHONUNBUFFERED=1 TQDM_DISABLE=1 OMP_NUM_THREADS=8
export TIKTOKEN_CACHE_DIR=/root/site/llama_index/core/_static/tiktoken_cache JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1
data=$PWD/.device-data; hot=$data/hotpotqa; sci=$data/scifact/scifact.json.gz
# rows in three runs, each written when it ends (tools/merge_corpus_results.py joins them, paired by question)
groups=("endo,endo@bm25,llamaindex-bm25,minilm,stage1@hybrid,stage1@dense,stage1@bm25" "endo-2hop,endo-2hop@bm25"
        "bm25+reranker,minilm+reranker")
benches() {  # NAME DATA TAG MODEL_ARGS...
  local name=$1 d=$2 tag=$3 g; shift 3
  for g in 0 1 2; do
    endo bench corpus --data "$d" --systems "${groups[$g]}" "$@" --out "$res/${tag}_${name}_g$g.json" \
      > "$res/${tag}_${name}_g$g.log" 2>&1
  done
}
one_model() {  # NAME GPU GPU2 MODEL_ARGS...: the fit, then dev300 on GPU and SciFact test on GPU2, side by side
  local name=$1 gpu=$2 gpu2=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpu endo calibrate-pipeline --first-stage hybrid --data "$hot/fit300.json" \
    --data "$sci:train" "$@" > "$res/fit_$name.log" 2>&1
  CUDA_VISIBLE_DEVICES=$gpu benches "$name" "$hot/dev300.json" dev300 "$@" &
  CUDA_VISIBLE_DEVICES=$gpu2 benches "$name" "$sci:test" scifact "$@" &
  wait
}
# MODELS=default: the default model alone, on both GPUs
if [ "${MODELS:-both}" = default ]; then one_model default 0 1; else
  one_model q15 0 0 --model /root/parts/qwen2.5-coder-1.5b-instruct.gguf &
  one_model default 1 1 &
  wait
fi
cp /root/site/endo_retrieval/assets/heads/*.json "$res/"
echo finished
