#!/usr/bin/env bash
# Gemma 3 270M made ready by `endo prepare` on each labelled set's own documents (no labels), then `endo` on the set's
# test questions (the first 300) and the signals of those reads, as a user who brings that model would run it; the seven
# sets side by side on one GPU (two CPU threads each).
# Needs what tools/device-fusion.sh needs (it installs the wheels), and $MODELS/gemma-3-270m.gguf.
#   start:   setsid nohup bash tools/device-gemma.sh > /root/gemma.log 2>&1 &     results: /root/sig/gemma/
set -uo pipefail
models=${MODELS:-/root/parts/models/models}; gguf=$models/gemma-3-270m.gguf; res=/root/sig/gemma
mkdir -p "$res" /root/gdocs
export PYTHONPATH=/root/site PATH=/root/site/bin:$PATH PYTHONUNBUFFERED=1 TQDM_DISABLE=1 OMP_NUM_THREADS=2
export HF_HUB_OFFLINE=1 JAX_PLATFORMS=cpu TIKTOKEN_CACHE_DIR=/root/site/llama_index/core/_static/tiktoken_cache
d=$PWD/.device-data; dom=$d/domains
one() {  # SPEC NAME: the set's documents as files, `endo prepare` on them, `endo info`, then the bench
  local spec=$1 name=$2 docs=/root/gdocs/$2 profile=$res/$2.profile.json
  (cd /root && python3 - "$spec" "$docs" <<'PY'
import sys
from pathlib import Path
from endo_retrieval.calibration.datasets import corpus_questions
titles, texts, _ = corpus_questions(sys.argv[1])
out = Path(sys.argv[2]); out.mkdir(parents=True, exist_ok=True)
for i, (t, x) in enumerate(zip(titles, texts)):
    (out / f"{i:05d}.txt").write_text(f"{t}\n\n{x}\n")
PY
  )
  (cd /root && endo prepare --model "$gguf" --documents "$docs" --profile "$profile" --timings "$res/$name.prepare.json") \
    > "$res/$name.log" 2>&1
  (cd /root && ENDO_HEADS_PROFILE=$profile endo info --model "$gguf") > "$res/$name.info.txt" 2>&1
  (cd /root && ENDO_HEADS_PROFILE=$profile endo bench corpus --data "$spec" --limit 300 --model "$gguf" --systems endo \
    --out "$res/$name.json") >> "$res/$name.log" 2>&1
  # its reads of the test questions, so that another fusion is judged on them without the model (fusion_report.py)
  (cd /root && ENDO_HEADS_PROFILE=$profile python3 -m endo_retrieval.calibration.signals "$res/signals" "$spec@300" \
    --model "$gguf" --parts pipe,dense,stage1) >> "$res/$name.log" 2>&1
  echo "done $name"
}
(cd /root && python3 -c "from endo_retrieval.model.backbone import Backbone; Backbone.of('$gguf')") > "$res/load.log" 2>&1
one "$d/hotpotqa/dev300.json" dev300 & one "$dom/stackfaq.json.gz:test" stackfaq & one "$dom/conala.json.gz:test" conala &
one "$d/scifact/scifact.json.gz:test" scifact & one "$dom/csn_style_python.json.gz:test" csn_style_python &
one "$dom/arguana.json.gz:test" arguana & one "$dom/fiqa2018_pooled.json.gz:test" fiqa2018_pooled &
wait
echo finished
