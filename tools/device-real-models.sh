#!/usr/bin/env bash
# The real-model measurements on the device machine: calibration (labelled and zero-label) and the dev300 benches
# of docs/results.md "Quality by model size", for each model given, the models' processes side by side on one GPU
# (the work is launch-bound, so they share it well; latency figures come from a run with nothing beside it).
#
# Needs, carried: .whl (tools/device-wheels.sh), .device-data (a copy of ../shared/data), the models joined by
# tools/device-parts.sh under /root/parts/NAME.file, MiniLM unpacked under /root/parts/minilm/.
#
#   bash tools/device-real-models.sh PHASE NAME...
# PHASE: convert | calibrate | refit | zlswap | bench | latency | rerank | rerankers | stems | llmrerank | zero | twohop | s3 | s3probe |
#        s3corpus | settings | decode | attnlatency | reattention | reattentionqa | attnprofile | ilre128k | ilreevidence | passkeyilre | papers |
#        collect
# NAME: q15, q05 (the Qwen2.5-Coder 1.5B and 0.5B files), default (SmolLM2-135M, its package carried as smollm)
#
# Every phase stops its processes at DEADLINE seconds (default 550) and packs what they wrote, with their logs,
# into $OUT/PHASE.tgz (the device returns at most 8 files; PACK=0 leaves them for a later `collect`, so that several
# phases run side by side, e.g. one per GPU with CUDA_VISIBLE_DEVICES, return two files in all).
set -uo pipefail
phase=$1; shift
deadline=${DEADLINE:-550}
data=$PWD/.device-data; res=/root/res/$phase; mkdir -p "$res"
if [ ! -x /root/site/bin/endo ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site .whl/*.whl || exit 1
fi
cp -rn /root/parts/minilm/minilm/* /root/site/ 2>/dev/null || true
# one GPU shared by several processes: few CPU threads each (the device has 16 cores)
export PYTHONPATH=/root/site PATH=/root/site/bin:$PATH PYTHONUNBUFFERED=1 TQDM_DISABLE=1 OMP_NUM_THREADS=2
# LlamaIndex ships tiktoken's encodings, but uses them only when TIKTOKEN_CACHE_DIR is unset (the image sets it)
export TIKTOKEN_CACHE_DIR=/root/site/llama_index/core/_static/tiktoken_cache
# bm25s (LlamaIndex's BM25Retriever) imports JAX where it is installed, as on the device image, and JAX then takes
# 75% of the GPU's memory for itself: its top-k stays on the CPU
export JAX_PLATFORMS=cpu
cp -rn /root/parts/smollm/smollm/* /root/site/ 2>/dev/null || true  # the default model's package, when carried
assets=/root/site/endo_retrieval/assets
slug() { case $1 in q15) echo qwen2.5-coder-1.5b-instruct ;; q05) echo qwen2.5-coder-0.5b-instruct ;;
                   default) echo smollm2-135m-instruct ;; *) echo "$1" ;; esac; }
margs() { [ "$1" = default ] || echo "--model $(model "$1")"; }  # the default model needs no --model
model() { echo "/root/parts/$(slug "$1").gguf"; }  # named as users have it: the file's stem is the model's id
for f in /root/parts/*.file; do [ -e "$f" ] && mv "$f" "/root/parts/$(slug "$(basename "$f" .file)").gguf"; done
hot=$data/hotpotqa
pids=()
bg() { local log=$1; shift; ( "$@" ) > "$res/$log.log" 2>&1 & pids+=($!); }

calibrate_one() {  # labelled heads, then the pipeline's grid in three processes, merged; ILRe's layer
  local m=$1 s; s=$(slug "$1")
  endo calibrate-heads --model "$(model "$m")" --data "$hot/calib100.json" --distractors "$data/wikitext2" \
    --out "$res/heads_$m.json" || return 1
  local g=0
  for grid in "--depths 20 --read-tokens 128,256 --orders best-last first-stage" \
              "--depths 30 --read-tokens 128,256 --orders best-last" "--depths 10,40 --read-tokens 128,256 --orders best-last"; do
    g=$((g + 1)); cp "$res/heads_$m.json" "$res/grid${g}_$m.json"
    endo calibrate-pipeline --model "$(model "$m")" --data "$hot/fit300.json" $grid --out "$res/grid${g}_$m.json" \
      > "$res/grid${g}_$m.log" 2>&1 &
  done
  wait
  merge_pipeline "$m"
}

merge_pipeline() {  # the grids' rows (one JSON line per setting in their logs, also from a run stopped early)
  python3 - "${RES:-/root/res/calibrate}" "$1" <<'PY'
import glob, json, sys
res, m = sys.argv[1:]
table = [json.loads(line) for log in sorted(glob.glob(f"{res}/grid*_{m}.log")) for line in open(log)
         if line.startswith("{") and '"order"' in line]
from endo_retrieval.calibration.pipeline import choose
best = choose(table)
profile = json.load(open(f"{res}/heads_{m}.json"))
profile["pipeline"] = {"depth": best["depth"], "read_tokens": best["read_tokens"],
                       "best_last": best["order"] == "best-last", "weights": best["weights"],
                       "fit": {"data": "fit300.json", "n_questions": 296, "recall": best["recall"], "table": table,
                               "stage1": "stems" if "refit" in res else "words"}}
json.dump(profile, open(f"{res}/heads_{m}.json", "w"), indent=1)
print("pipeline", m, len(table), "settings", {k: v for k, v in profile["pipeline"].items() if k != "fit"})
PY
}

refit_one() {  # the pipeline's grid again on fit300 with the model's shipped heads (they do not depend on stage 1)
  local m=$1 s; s=$(slug "$1"); local g=0
  cp "$assets/heads/$s.json" "$res/heads_$m.json"
  for grid in "--depths 20 --read-tokens 128,256" "--depths 30 --read-tokens 128,256" "--depths 10,40 --read-tokens 128"; do
    g=$((g + 1)); cp "$res/heads_$m.json" "$res/grid${g}_$m.json"
    endo calibrate-pipeline $(margs "$m") --data "$hot/fit300.json" $grid --orders best-last first-stage \
      --out "$res/grid${g}_$m.json" > "$res/grid${g}_$m.log" 2>&1 &
  done
  wait
  refit_bench "$m"
}

refit_bench() {  # the refitted profile installed, then the dev300 corpus beside LlamaIndex's BM25
  local m=$1 s; s=$(slug "$1")
  RES=$res merge_pipeline "$m"  # the grids' rows so far (all of them once the grids finished)
  cp "$res/heads_$m.json" "$assets/heads/$s.json"
  [ -f "$res/refit_corpus_dev300_$m.json" ] || endo bench corpus $(margs "$m") --data "$hot/dev300.json" \
    --systems endo,llamaindex-bm25 --out "$res/refit_corpus_dev300_$m.json"
}

zero_label() {  # finish the zero-label profile if its pipeline fit was stopped, then its dev300 benches
  # QUESTIONS_BY=model: the model writes the tasks' questions (files named zero_label_written_*); ZL_GRID=labelled:
  # the pipeline grid the labelled fit chose from, depths 20 and 30 in both orders (files zero_label_grid_*)
  # ZL_TAG=name: files zero_label_name_*; SEED: the tasks' seed (another draw of tasks from the same documents)
  local m=$1 tag=${QUESTIONS_BY:+_written}; tag=${ZL_GRID:+_grid}${tag}${ZL_TAG:+_$ZL_TAG}
  local zl=/root/res/calibrate/zl${tag}_$1.json
  local grid="--depths 20 --read-tokens 128,256"
  [ -n "${ZL_GRID:-}" ] && grid="--depths 20,30 --read-tokens 128 --orders best-last first-stage"
  grep -q '"pipeline"' "$zl" 2>/dev/null || endo prepare --model "$(model "$m")" --documents /root/docs_fit300 \
    --profile "$zl" --tasks 100 --passkeys 4 --context-tokens 4096,8192 --questions 300 $grid \
    ${QUESTIONS_BY:+--questions-by $QUESTIONS_BY} ${SEED:+--seed $SEED} || return 1
  cp "$zl" "$res/zero_label${tag}_profile_$m.json"; cp "${zl%.json}.prepare/tasks.json" "$res/zero_label${tag}_tasks_$m.json"
  [ -f "$res/zero_label${tag}_corpus_dev300_$m.json" ] || ENDO_HEADS_PROFILE=$zl endo bench corpus \
    --model "$(model "$m")" --data "$hot/dev300.json" --systems endo --out "$res/zero_label${tag}_corpus_dev300_$m.json" &
  ENDO_HEADS_PROFILE=$zl endo bench quality --model "$(model "$m")" --data "$hot/dev300.json" --context-tokens 8192 \
    --budget 1024 --no-generate --methods endo --out "$res/zero_label${tag}_dev300_8192_$m.json" &
  wait
}

rerank_one() {  # the fit writes into the model's profile (a copy under $res, installed for the bench)
  local m=$1 s; s=$(slug "$1"); local prof=$assets/heads/$s.json
  endo bench fit-reranker $(margs "$m") --data "$hot/fit300.json" --first-stages minilm,bm25 --candidates 20 \
    --out "$prof" || return 1
  cp "$prof" "$res/heads_reranker_$m.json"
  endo bench corpus $(margs "$m") --data "$hot/dev300.json" \
    --systems minilm,minilm+reranker,minilm+heads,llamaindex-bm25,bm25+reranker --out "$res/rerank_dev300_$m.json"
}

model_saes() {  # the model's SAEs on its keys (WikiText-2, as the paper), trained where the package finds them
  local sae=$assets/sae/$(slug "$1")  # found by the model's hash in card.json
  [ -f "$sae/card.json" ] || endo train-sae --model "$(model "$1")" --corpus "$data/wikitext2/valid.txt" \
    --heldout "$data/wikitext2/test.txt" --out "$sae" > "$res/train_sae_$1.log" 2>&1 || return 1
  mkdir -p "$res/sae_$1" && cp "$sae/card.json" "$res/sae_$1/"
}

convert_models() {  # each GGUF file converted once (the cache), before processes that would race to convert it
  for m in "$@"; do endo info --model "$(model "$m")" --json > "$res/info_$m.json" 2>&1 & done; wait
}

fit300_documents() {  # fit300's paragraphs as plain files, one per question's ten: no question, answer or label
  mkdir /root/docs_fit300 2>/dev/null || return 0  # written once: another run may be reading them
  python3 -c "
import json
for i, it in enumerate(json.load(open('$hot/fit300.json'))):
    open(f'/root/docs_fit300/q{i:03d}.txt', 'w').write('\\n\\n'.join(t + ': ' + ' '.join(s) for t, s in it['context']))"
}

case $phase in
zero)  # zero-label: endo prepare from the fit300 documents, then its dev300 benches
  fit300_documents; mkdir -p /root/res/calibrate
  for m in "$@"; do bg "zero${ZL_TAG:+_$ZL_TAG}_$m" zero_label "$m"; done ;;
convert)  # each GGUF file converted once, before phases whose processes would race to convert it
  convert_models "$@" ;;
collect) ;;  # only pack what an earlier phase left (e.g. one stopped at the call's limit)
calibrate)
  convert_models "$@"
  for m in "$@"; do
    bg "labelled_$m" calibrate_one "$m"
    bg "ilre_$m" endo calibrate-ilre --model "$(model "$m")" --data "$data/pg_essays" --lengths 8192 \
      --out "$res/ilre_$m.json" --no-progress
    fit300_documents
    bg "zero_$m" endo prepare --model "$(model "$m")" --documents /root/docs_fit300 --profile "$res/zl_$m.json" \
      --tasks 100 --passkeys 4 --context-tokens 4096,8192 --questions 300 --depths 20,30 --read-tokens 128,256 \
      --timings "$res/zl_timings_$m.json"
  done ;;
refit)  # the pipeline's settings and weights fitted again on fit300 (stage 1 indexes stems), then dev300
  for m in "$@"; do bg "refit_$m" refit_one "$m"; done ;;
refitbench)  # what `refit` left unmeasured when it was stopped: merge the grids' rows, install, bench
  res=/root/res/refit; for m in "$@"; do bg "refitbench_$m" refit_bench "$m"; done ;;
zlswap)  # zero-label against labelled on the 1.5B, part by part: which of the heads and the weights loses the points
  # carried: zl-diag/ (untracked) with zl_asis_q15.json (bench/results/quality/sizes/zero_label_twohop_profile_qwen1.5b.json),
  # zl_q15.json (the same without "pipeline"), labelled_heads_q15.json (it with the shipped profile's heads, head_scores,
  # top, recall_by_count) and zl_heads_q15.json (the shipped profile with those four of the zero-label one)
  m=${1:-q15}; mkdir -p /root/docs_fit300; fit300_documents
  zl=$PWD/zl-diag; cp "$zl/zl_$m.json" "$res/zl_$m.json"
  zl_refit() {  # the zero-label pipeline section fitted again over the stemmed stage 1 (prepare resumes at it)
    endo prepare --model "$(model "$m")" --documents /root/docs_fit300 --profile "$res/zl_$m.json" \
      --tasks 100 --passkeys 4 --context-tokens 4096,8192 --questions 300 --depths 20 --read-tokens 128,256 || return 1
    ENDO_HEADS_PROFILE=$res/zl_$m.json endo bench corpus --model "$(model "$m")" --data "$hot/dev300.json" \
      --systems endo --out "$res/zl_corpus_dev300_$m.json"
  }
  bg "zl_refit_$m" zl_refit
  bg "swap_corpus_zl_$m" env ENDO_HEADS_PROFILE=$zl/zl_asis_$m.json endo bench corpus --model "$(model "$m")" \
    --data "$hot/dev300.json" --systems endo --out "$res/swap_corpus_dev300_zl_asis_$m.json"
  for v in labelled_heads zl_heads; do
    bg "swap_corpus_${v}_$m" env ENDO_HEADS_PROFILE=$zl/${v}_$m.json endo bench corpus --model "$(model "$m")" \
      --data "$hot/dev300.json" --systems endo --out "$res/swap_corpus_dev300_${v}_$m.json"
    bg "swap_quality_${v}_$m" env ENDO_HEADS_PROFILE=$zl/${v}_$m.json endo bench quality --model "$(model "$m")" \
      --data "$hot/dev300.json" --context-tokens 8192 --budget 1024 --no-generate --methods endo \
      --out "$res/swap_quality_dev300_8192_${v}_$m.json"
  done ;;
bench)  # labelled (the calibrate phase's profiles) and zero-label, every model's processes side by side
  for m in "$@"; do
    s=$(slug "$m"); cal=/root/res/calibrate
    grep -q '"pipeline"' $cal/heads_$m.json || merge_pipeline "$m"
    cp $cal/heads_$m.json $assets/heads/$s.json; cp $cal/ilre_$m.json $assets/ilre/$s.json
    # a run that finished is not run again; a quality run stopped early resumes from its records
    [ -f "$res/corpus_dev300_$m.json" ] || bg "corpus_$m" endo bench corpus --model "$(model "$m")" --data "$hot/dev300.json" \
      --systems endo,llamaindex-bm25,minilm,minilm+reranker --out "$res/corpus_dev300_$m.json"
    for cb in 8192:1024:300 4096:512:300 32768:2048:100; do IFS=: read c b n <<< "$cb"
      [ -f "$res/quality_dev300_${c}_$m.json" ] || bg "quality_${c}_$m" endo bench quality --model "$(model "$m")" --data "$hot/dev300.json" --context-tokens $c \
        --budget $b --limit $n --no-generate --methods endo,heads,bm25-sent,ilre --out "$res/quality_dev300_${c}_$m.json"
    done
    [ -f "$res/zero_label_dev300_8192_$m.json" ] || bg "zero_$m" zero_label "$m"
  done ;;
latency)  # one process at a time, nothing beside it: the times per query that the docs report
  for m in "$@"; do
    endo bench corpus $(margs "$m") --data "$hot/dev300.json" --limit 100 --systems endo,llamaindex-bm25 \
      --out "$res/latency_corpus_$m.json" > "$res/latency_corpus_$m.log" 2>&1
  done ;;
rerank)  # the reranker's fusion fitted on fit300 per first stage, then the rerankers users would pick, on dev300
  for m in "$@"; do
    bg "rerank_$m" rerank_one "$m"
    bg "llmrerank_$m" endo bench corpus $(margs "$m") --data "$hot/dev300.json" --limit ${LLM_LIMIT:-100} --choice-batch-size 20 \
      --systems llamaindex-bm25,bm25+llmrerank,minilm,minilm+llmrerank --out "$res/llmrerank_dev100_$m.json"
  done ;;
rerankers)  # the rerankers over MiniLM and BM25 first stages, the weights the shipped profile holds
  for m in "$@"; do
    bg "rerankers_$m" endo bench corpus $(margs "$m") --data "$hot/dev300.json" \
      --systems minilm,minilm+reranker,minilm+heads,llamaindex-bm25,bm25+reranker --out "$res/rerankers_dev300_$m.json"
  done ;;
stems)  # the pipeline's stage 1 over stems (the default) against over words, the same questions
  for m in "$@"; do
    bg "stems_$m" endo bench corpus $(margs "$m") --data "$hot/dev300.json" --systems endo,llamaindex-bm25 \
      --out "$res/stems_dev300_$m.json"
    bg "words_$m" endo bench corpus $(margs "$m") --data "$hot/dev300.json" --systems endo --unstemmed \
      --out "$res/words_dev300_$m.json"
  done ;;
llmrerank)  # LlamaIndex's LLMRerank driven by the same local model, after BM25 and after MiniLM
  for m in "$@"; do
    bg "llmrerank_$m" endo bench corpus $(margs "$m") --data "$hot/dev300.json" --limit ${LLM_LIMIT:-100} --choice-batch-size 20 \
      --systems llamaindex-bm25,bm25+llmrerank,minilm,minilm+llmrerank --out "$res/llmrerank_dev100_$m.json"
  done ;;
twohop)  # the second hop that retrieves, beside the default pipeline
  for m in "$@"; do
    bg "twohop_$m" endo bench corpus $(margs "$m") --data "$hot/dev300.json" --systems endo,endo-2hop,llamaindex-bm25 \
      --out "$res/twohop_dev300_$m.json"
  done ;;
s3)  # S3-Attention on a real model: SAEs on its keys (WikiText-2, as the paper), then S3 / S3-Hybrid beside BM25
  m=${1:-q15}
  s3_chain() {
    model_saes "$m" || return 1
    endo bench quality --model "$(model "$m")" --data "$hot/dev300.json" --context-tokens 8192 --budget 1024 \
      --limit ${S3_LIMIT:-300} --no-generate --methods s3,s3-hybrid,bm25-sent,endo --out "$res/s3_dev300_8192_$m.json" > "$res/s3_8192_$m.log" 2>&1 &
    endo bench quality --model "$(model "$m")" --data "$hot/dev300.json" --context-tokens 32768 --budget 2048 \
      --limit ${S3_LIMIT_32K:-100} --no-generate --methods s3,s3-hybrid,bm25-sent --out "$res/s3_dev300_32768_$m.json" \
      > "$res/s3_32768_$m.log" 2>&1 &
    endo bench quality --model "$(model "$m")" --data "$hot/dev300.json" --context-tokens 8192 --budget 1024 \
      --limit ${S3_LIMIT_KL:-100} --methods full,s3-hybrid,bm25-sent --out "$res/s3_kl_dev300_8192_$m.json" > "$res/s3_kl_$m.log" 2>&1 &
    wait
  }
  bg "s3_$m" s3_chain ;;
decode)  # retrieval-completion attention and PrHS on a real model: phi maps distilled (PHI=1), error (ERR=0: not),
  # accuracy: one process per ACC_RUNS entry "contexts:attentions:budget" (default both lengths, every backend, 5%),
  # ACC_LIMIT questions of ACC_QA (default 10 of dev30.json), and passkeys when ACC_PASSKEYS is set (default 1)
  m=${1:-q15}
  phi=${PHI:+,topk+phi}; ACC_PASSKEYS=${ACC_PASSKEYS-1}
  maps=$assets/phi/$(slug "$m")  # where `endo train-phi` puts a model's maps (what `--phi default` loads)
  phi_chain() {
    [ -z "$phi" ] || endo train-phi --model "$(model "$m")" --corpus "$data/pg_essays" --length 8192 --steps 300 \
      || return 1
    [ "${ERR:-1}" = 0 ] || endo bench attention --model "$(model "$m")" --measure error --attention dense,topk$phi,prhs \
      --context-tokens 8192,16384,32768 --budgets 0.01,0.02,0.03,0.05 --error-windows 4 --error-queries 16 \
      --error-text "$data/pg_essays" ${phi:+--phi $maps} --out "$res/error_8k-32k_$m.json" > "$res/error_$m.log" 2>&1 &
    [ "${ACC:-1}" = 0 ] || for run in ${ACC_RUNS:-8192,32768:dense,topk$phi,prhs:0.05}; do
      IFS=: read c att b <<< "$run"; local name=accuracy_${c/,/-}_${att//,/-}_b${b}_$m
      endo bench attention --model "$(model "$m")" --measure accuracy --attention $att --accuracy-budget $b \
        --context-tokens $c --depths 5 ${ACC_PASSKEYS:+--data passkey:$data/pg_essays} --data "$hot/${ACC_QA:-dev30.json}" \
        --limit ${ACC_LIMIT:-10} \
        ${phi:+--phi $maps --phi-tolerance 4.1} --out "$res/$name.json" > "$res/$name.log" 2>&1 &
    done
    wait
  }
  bg "phi_$m" phi_chain ;;  # its latency: `attnlatency`, with nothing beside it
attnlatency)  # the decode step at 32k cached keys, dense SDPA against the sparse backends, nothing beside it
  m=${1:-q15}
  # the decode step's operator only: the decode-throughput run after a 32k prompt did not finish in 5 minutes
  endo bench attention --model "$(model "$m")" --measure latency --attention dense,topk,prhs --accuracy-budget 0.125 \
    --latency-keys 32768 --latency-batch 4 --throughput-context 0 --error-text "$data/pg_essays" \
    --out "$res/attn_latency_32k_$m.json" > "$res/attn_latency_32k_$m.log" 2>&1 ;;
s3probe)  # S3 with the question encoded from its keys (tools/s3_key_probe.py), beside the shipped query encoding
  m=${1:-q15}
  s3_probe() {
    model_saes "$m" || return 1
    python3 tools/s3_key_probe.py bench quality --model "$(model "$m")" --data "$hot/dev300.json" --context-tokens 8192 \
      --budget 1024 --limit ${S3_LIMIT:-150} --no-generate --no-reference --methods s3,s3-hybrid \
      --out "$res/s3_keys_dev300_8192_$m.json"
  }
  bg "s3probe_$m" s3_probe ;;
passkeyilre)  # ILRe's passkeys at the CONTEXTS given (default 65536), beside endo and bm25-sent
  m=${1:-q15}
  bg "passkey_ilre_$m" endo bench quality $(margs "$m") --data passkey:$data/pg_essays --limit 10 --no-generate \
    --context-tokens ${CONTEXTS:-65536} --budget 1024 --methods ilre,endo,bm25-sent \
    --out "$res/passkey_ilre_${CONTEXTS:-65536}_$m.json" ;;
reattention)  # passkeys inside (32k) and past (64k, 128k) the 1.5B model's window, dense against ReAttention
  # RUNS: the attention:context pairs to run (default all six); DEPTHS: passkey depths per context (default 4)
  m=${1:-q15}
  for run in ${RUNS:-dense:32768 dense:65536 dense:131072 reattention:32768 reattention:65536 reattention:131072}; do
    IFS=: read att c <<< "$run"
    bg "passkey_${att}_${c}_$m" endo bench attention $(margs "$m") --data passkey:$data/pg_essays --depths ${DEPTHS:-4} \
      --measure accuracy --attention $att --context-tokens $c --out "$res/passkey_${att}_${c}_$m.json"
  done ;;
ilre128k)  # ILRe past the window: dev300 haystacks of 128k tokens (2048 kept) beside BM25 (ILRE_LIMIT questions)
  m=${1:-q15}
  bg "ilre128k_$m" endo bench quality $(margs "$m") --data "$hot/dev300.json" --context-tokens 131072 --budget 2048 \
    --limit ${ILRE_LIMIT:-50} --no-generate --no-reference --methods ilre,bm25-sent --out "$res/ilre_dev300_131072_$m.json" ;;
reattentionqa)  # dev300 haystacks inside (32k) and past (64k, 128k) the window, dense against ReAttention
  # RUNS: attention:context:questions (the first N of dev300; a 128k example takes minutes with the chunked prefill)
  m=${1:-q15}
  for run in ${RUNS:-dense:32768:10 reattention:32768:10 dense:65536:10 reattention:65536:10 dense:131072:4 reattention:131072:4}; do
    IFS=: read att c n <<< "$run"
    bg "qa_${att}_${c}_$m" endo bench attention $(margs "$m") --data "$hot/dev300.json" --limit $n --measure accuracy \
      --attention $att --context-tokens $c --out "$res/qa_${att}_${c}_$m.json"
  done ;;
attnprofile)  # one dev300 haystack's generation with BACKEND (default reattention) at TOKENS (default 65536),
  # timed and profiled alone (tools/attention_profile.py, from the carried tree)
  m=${1:-q15} b=${BACKEND:-reattention} n=${TOKENS:-65536}
  bg "attnprofile_${b}_${n}_$m" python3 tools/attention_profile.py "$(model "$m")" "$hot/dev300.json" "$b" "$n" \
    "$res/attnprofile_${b}_${n}_$m.json" ;;
ilreevidence)  # ILRe's layer chosen on evidence (calib100 haystacks), installed, then dev300 beside BM25
  m=${1:-q15}
  ilre_evidence() {
    endo calibrate-ilre $(margs "$m") --data "$hot/calib100.json" --limit 100 --lengths 8192 \
      --out "$res/ilre_evidence_$m.json" --no-progress || return 1
    cp "$res/ilre_evidence_$m.json" "$assets/ilre/$(slug "$m").json"
    endo bench quality $(margs "$m") --data "$hot/dev300.json" --context-tokens 8192 --budget 1024 --no-generate \
      --no-reference --methods ilre,bm25-sent --out "$res/ilre_evidence_dev300_8192_$m.json"
    endo bench quality $(margs "$m") --data "$hot/dev300.json" --context-tokens 32768 --budget 2048 --limit 100 \
      --no-generate --no-reference --methods ilre,bm25-sent --out "$res/ilre_evidence_dev300_32768_$m.json"
  }
  bg "ilreevidence_$m" ilre_evidence ;;
settings)  # the pipeline at other settings: per depth in DEPTHS, READ tokens (default 128) in the ORDERS given
  # (default best-last), its weights fitted on fit300 into a copy of the model's profile, then dev300 with that copy
  m=${1:-default} r=${READ:-128}
  setting_one() {
    local d=$1 p=$res/heads_d$1_r${r}_$m.json
    cp "$assets/heads/$(slug "$m").json" "$p"
    endo calibrate-pipeline $(margs "$m") --data "$hot/fit300.json" --depths "$d" --read-tokens "$r" \
      --orders ${ORDERS:-best-last} --out "$p" || return 1
    ENDO_HEADS_PROFILE=$p endo bench corpus $(margs "$m") --data "$hot/dev300.json" --systems endo \
      --out "$res/d${d}_r${r}_corpus_dev300_$m.json"
  }
  for d in ${DEPTHS:-12 14 16}; do bg "setting_${d}_${r}_$m" setting_one "$d"; done ;;
s3corpus)  # S3-Hybrid over the dev300 corpus (the model's SAEs trained first), beside LlamaIndex's BM25 and endo
  m=${1:-q15}
  s3_corpus() {
    model_saes "$m" || return 1
    endo bench corpus $(margs "$m") --data "$hot/dev300.json" --systems s3-hybrid,llamaindex-bm25,endo \
      --out "$res/s3_corpus_dev300_$m.json"
  }
  bg "s3corpus_$m" s3_corpus ;;
papers)  # the 1.5B model past its window: passkeys for the decode-time backends and ILRe
  m=${1:-q15}
  bg "passkey_dense_$m" endo bench attention $(margs "$m") --data passkey:$data/pg_essays --depths 4 --measure accuracy \
    --attention dense --context-tokens 32768,65536,131072 --out "$res/passkey_dense_$m.json"
  bg "passkey_re_$m" endo bench attention $(margs "$m") --data passkey:$data/pg_essays --depths 4 --measure accuracy \
    --attention reattention --context-tokens 32768,65536,131072 --out "$res/passkey_reattention_$m.json"
  bg "passkey_ilre_$m" endo bench quality $(margs "$m") --data passkey:$data/pg_essays --limit 10 --no-generate \
    --context-tokens 32768,131072 --budget 1024 --methods ilre,endo,bm25-sent --out "$res/passkey_ilre_$m.json" ;;
esac
# wait for the processes, at most until the deadline (the GPU's memory logged each minute); then stop the rest
end=$deadline  # seconds since the script began
while [ $SECONDS -lt $end ] && jobs -r | grep -q .; do
  [ $((SECONDS % 60)) -lt 5 ] && { echo "t=$SECONDS"; nvidia-smi --query-gpu=memory.used,utilization.gpu \
    --format=csv,noheader; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader; \
    ps -eo pid,etimes,args | grep '[b]in/endo' | cut -c1-160; } >> "$res/gpu_memory.log" 2>&1
  sleep 5
done
jobs -r | grep -q . && echo "deadline: stopping what still runs" && pkill -f /root/site/bin/endo; sleep 2
tail -n 3 "$res"/*.log
[ "$phase" = collect ] && res=/root/res
tail -n 3 "$res"/*/*.log 2>/dev/null | tail -n 60
# the results, then the per-example records apart (the device returns files of at most 16 MiB)
[ "${PACK:-1}" = 0 ] && [ "$phase" != collect ] && exit 0
(cd /root/res && find . -name '*.json' -o -name '*.md' -o -name '*.log' | grep -v '\.prepare/' | tar -czf "$OUT/$phase.tgz" -T -)
(cd /root/res && find . -name '*.records.jsonl' | tar -czf "$OUT/$phase-records.tgz" -T -)
ls -la "$res"
