#!/usr/bin/env bash
# The one-endo measurements of docs/results.md ("One endo: hybrid candidates, one reader"), on a device machine of
# four GPUs, one process per GPU: for each model, `endo calibrate-pipeline --first-stage hybrid` on fit300 and
# SciFact train (written into the installed profile), then `endo bench corpus` on dev300 and on SciFact test with
# every row side by side (the new default `endo`, today's `endo@bm25` and `endo-2hop@bm25`, the rerankers after
# BM25 and MiniLM, the first stages alone), each bench on a GPU of its own.
#
# Needs, carried: .whl (tools/device-wheels.sh), .device-data (a copy of ../shared/data), and under /root/parts
# (tools/device-parts.sh): q15.file (Qwen2.5-Coder-1.5B GGUF), smollm/ and minilm/ (the two model packages).
#   start:   setsid nohup bash tools/device-one-endo.sh run > /root/one-endo.log 2>&1 &
#   collect: bash tools/device-one-endo.sh collect   (packs /root/res into $OUT/one-endo.tgz)
set -uo pipefail
res=/root/res
if [ "${1:-run}" = collect ]; then tar -C /root -czf "$OUT/one-endo.tgz" res one-endo.log; ls -la "$OUT"; exit 0; fi
mkdir -p "$res"
python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site .whl/*.whl || exit 1
cp -rn /root/parts/minilm/minilm/* /root/parts/smollm/smollm/* /root/site/
[ -e /root/parts/q15.file ] && mv /root/parts/q15.file /root/parts/qwen2.5-coder-1.5b-instruct.gguf
export PYTHONPATH=/root/site PATH=/root/site/bin:$PATH PYTHONUNBUFFERED=1 TQDM_DISABLE=1 OMP_NUM_THREADS=8
export TIKTOKEN_CACHE_DIR=/root/site/llama_index/core/_static/tiktoken_cache JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1
data=$PWD/.device-data; hot=$data/hotpotqa; sci=$data/scifact/scifact.json.gz
systems=endo,endo-2hop,endo@bm25,endo-2hop@bm25,bm25+reranker,minilm+reranker,llamaindex-bm25,minilm
systems=$systems,stage1@hybrid,stage1@bm25,stage1@dense
one_model() {  # NAME GPU_A GPU_B MODEL_ARGS...
  local name=$1 a=$2 b=$3; shift 3
  CUDA_VISIBLE_DEVICES=$a endo calibrate-pipeline --first-stage hybrid --data "$hot/fit300.json" --data "$sci:train" \
    "$@" > "$res/fit_$name.log" 2>&1
  CUDA_VISIBLE_DEVICES=$a endo bench corpus --data "$hot/dev300.json" --systems "$systems" "$@" \
    --out "$res/dev300_$name.json" > "$res/dev300_$name.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=$b endo bench corpus --data "$sci:test" --systems "$systems" "$@" \
    --out "$res/scifact_$name.json" > "$res/scifact_$name.log" 2>&1 &
  wait
}
one_model q15 0 1 --model /root/parts/qwen2.5-coder-1.5b-instruct.gguf &
one_model default 2 3 &
wait
cp /root/site/endo_retrieval/assets/heads/*.json "$res/"
echo finished
