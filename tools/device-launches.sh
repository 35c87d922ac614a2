#!/usr/bin/env bash
# The default pipeline's time, forwards and CUDA launches per question on the device, one process at a time with
# nothing beside it: `endo bench corpus` on dev300's first 100 questions beside LlamaIndex's BM25, for the default
# model and, when its file is there, Qwen2.5-Coder-1.5B, in each of MODES (default "eager graphs"):
#   plain   one query part per forward (`--plain-reads --eager`, as before the parts were batched)
#   eager   the parts batched, two forwards a question, run eagerly (`--eager`)
#   graphs  the same two forwards replayed from CUDA graphs (the default)
#
# Needs, carried: .whl (tools/device-wheels.sh REV), .device-data (a copy of ../shared/data); the default model's
# package unpacked under /root/parts/smollm/smollm and the 1.5B file at /root/parts/qwen2.5-coder-1.5b-instruct.gguf
# or /root/parts/q15.file (tools/device-parts.sh smollm|q15 ...), as for tools/device-real-models.sh.
#
#   bash tools/device-launches.sh [LIMIT]        (default 100 questions)
# SITE=DIR TAG=_x: run another build of the core package installed under DIR (e.g. an earlier commit's wheel:
# pip install --no-deps --target DIR endo_retrieval-*.whl) in front of the carried wheels, its files named *_x,
# so that two builds are timed on one machine, one after the other.
# Writes $OUT/launches.md (p50, forwards and launches per question, one row per model and mode) and $OUT/launches.tgz
# (every run's JSON, Markdown and log). Each run stops after RUN_S seconds (default 240). DEPTH: the candidates read
# per question (default: each model's profile).
set -uo pipefail
limit=${1:-100}
data=$PWD/.device-data; res=/root/res/launches; mkdir -p "$res" "${OUT:-/tmp/out}"
out=${OUT:-/tmp/out}
# the carried wheels, installed afresh when they differ from what an earlier call on this machine installed
stamp=$(cat .whl/*.whl | md5sum | cut -c1-16)
if [ "$(cat /root/site/.wheels 2>/dev/null)" != "$stamp" ]; then
  rm -rf /root/site
  python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site .whl/*.whl || exit 1
  echo "$stamp" > /root/site/.wheels; rm -rf "$res"  # results of other wheels are not reused
  mkdir -p "$res"
fi
cp -rn /root/parts/smollm/smollm/* /root/site/ 2>/dev/null || true  # the default model's package
export PYTHONPATH=${SITE:+$SITE:}/root/site PATH=/root/site/bin:$PATH PYTHONUNBUFFERED=1 TQDM_DISABLE=1
# LlamaIndex uses its shipped tiktoken encodings only when TIKTOKEN_CACHE_DIR is unset (the image sets it); bm25s
# imports JAX, which would take 75% of the GPU's memory: JAX stays on the CPU
export TIKTOKEN_CACHE_DIR=/root/site/llama_index/core/_static/tiktoken_cache JAX_PLATFORMS=cpu
models=(default)
q15=/root/parts/qwen2.5-coder-1.5b-instruct.gguf  # named as users have it: the file's stem is the model's id
[ -f /root/parts/q15.file ] && mv /root/parts/q15.file "$q15"  # as tools/device-parts.sh q15 leaves it
[ -f "$q15" ] && models+=(q15)
for m in "${models[@]}"; do
  margs=(); [ "$m" = q15 ] && margs=(--model "$q15")
  for mode in ${MODES:-eager graphs}; do
    case $mode in plain) flag=(--plain-reads --eager) ;; eager) flag=(--eager) ;; *) flag=() ;; esac
    name=corpus_${m}_${mode}${DEPTH:+_d$DEPTH}${TAG:-}
    [ -f "$res/$name.json" ] && continue  # a finished run is not run again
    timeout "${RUN_S:-240}" endo bench corpus "${margs[@]}" "${flag[@]}" --data "$data/hotpotqa/dev300.json" \
      --limit "$limit" --systems endo,llamaindex-bm25 ${DEPTH:+--depth $DEPTH} --out "$res/$name.json" > "$res/$name.log" 2>&1 \
      || echo "$name: exit $?" >> "$res/failed.txt"
  done
done
# compress() of one 8192-token dev300 haystack to 1024 tokens (`endo`), eager against replayed, COMPRESS_LIMIT
# questions (default 50; 0 leaves it out): the quality bench's index and query times
for m in "${models[@]}"; do
  [ "${COMPRESS_LIMIT:-50}" = 0 ] && break
  margs=(); [ "$m" = q15 ] && margs=(--model "$q15")
  for mode in ${COMPRESS_MODES:-eager graphs}; do
    flag=(); [ "$mode" = eager ] && flag=(--eager)
    name=compress_${m}_${mode}${TAG:-}
    [ -f "$res/$name.json" ] && continue
    timeout "${RUN_S:-240}" endo bench quality "${margs[@]}" "${flag[@]}" --data "$data/hotpotqa/dev300.json" \
      --context-tokens 8192 --budget 1024 --limit "${COMPRESS_LIMIT:-50}" --no-generate --no-reference \
      --methods endo,bm25-sent --out "$res/$name.json" > "$res/$name.log" 2>&1 || echo "$name: exit $?" >> "$res/failed.txt"
  done
done
python3 - "$res" > "$out/launches.md" <<'PY'
import glob, json, os, sys
res = sys.argv[1]
print("| model | reads | graphs | device | n | endo p50 ms | p95 ms | read | question | hop2 | forwards | CUDA launches |"
      " kernels | recall@5 | BM25 p50 ms |")
print("|" + "---|" * 15)
for path in sorted(glob.glob(f"{res}/corpus_*.json")):
    result = json.load(open(path))
    rows = {r["system"]: r for r in result["rows"] if "skipped" not in r}
    endo, bm25 = rows.get("endo"), rows.get("llamaindex-bm25")
    if endo is None:
        continue
    lat, cuda = endo["latency_ms"], endo.get("cuda_per_question") or {}
    stage = lambda s: f"{lat[s]['p50']:.1f}" if s in lat else "-"
    print(f"| {result['config']['model']} | {result['config']['reads']} | {result['config'].get('cuda_graphs', False)} "
          f"| {result['config']['device']} | {endo['n']} "
          f"| {lat['query']['p50']:.1f} | {lat['query']['p95']:.1f} | {stage('read')} | {stage('question')} "
          f"| {stage('hop2')} | {endo.get('forwards_per_question', '-')} | {cuda.get('launches', '-')} "
          f"| {cuda.get('kernels', '-')} | {endo['recall@5']['value']:.3f} "
          f"| {bm25['latency_ms']['query']['p50'] if bm25 else '-'} |")
print("\n| compress 8192/1024 | graphs | n | index mean ms | select mean ms | sp_recall | bm25-sent select mean ms |")
print("|" + "---|" * 7)
for path in sorted(glob.glob(f"{res}/compress_*.json")):
    result = json.load(open(path))
    rows = {r["method"]: r for r in result["rows"]}
    endo, bm25 = rows.get("endo"), rows.get("bm25-sent")
    if endo is None or "latency_ms" not in endo:
        continue
    lat = endo["latency_ms"]
    print(f"| {result['config']['model']} | {result['config'].get('cuda_graphs')} | {endo['n']} | {lat.get('index')} "
          f"| {lat.get('query')} | {endo.get('sp_recall')} | {(bm25 or {}).get('latency_ms', {}).get('query')} |")
if os.path.exists(f"{res}/failed.txt"):
    print("\nfailed: " + open(f"{res}/failed.txt").read().strip().replace("\n", "; "))
PY
nvidia-smi --query-gpu=name --format=csv,noheader >> "$out/launches.md" 2>/dev/null
tar -czf "$out/launches.tgz" -C "$res" .
cat "$out/launches.md"
