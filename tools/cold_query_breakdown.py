"""Where a cold default `endo query` spends its time, part by part in the order it does them: wall seconds and this
process's CPU seconds (user + system, all threads; a single-threaded part such as an import costs about its CPU time
on an idle machine, whatever the load when measured).

    python tools/cold_query_breakdown.py INDEX_DIR "a question"      # prints one JSON line
"""
from __future__ import annotations

import json
import os
import sys
import time

marks: list[tuple[str, float, float]] = []
_last = [time.perf_counter(), time.process_time()]


def mark(what: str) -> None:
    now, cpu = time.perf_counter(), time.process_time()
    marks.append((what, round(now - _last[0], 2), round(cpu - _last[1], 2)))
    _last[:] = [now, cpu]


def main() -> int:
    index_dir, question = sys.argv[1], sys.argv[2]
    load_before = os.getloadavg()
    import torch
    mark("import torch")
    import transformers.models.llama.modeling_llama  # noqa: F401
    mark("import transformers (llama)")
    import sentence_transformers  # noqa: F401
    mark("import sentence_transformers")
    from endo_retrieval import integrations
    from endo_retrieval.cli import main as _  # noqa: F401
    mark("import endo_retrieval (the CLI, the adapters' search)")
    from endo_retrieval.model.backbone import Backbone
    Backbone.of(None)
    mark("Backbone() (locate, config, tokenizer, weights)")
    from endo_retrieval.index.dense import load_embedder
    load_embedder()
    mark("MiniLM load")
    index = integrations.EndoIndex.load(index_dir, None)
    mark("EndoIndex.load (the rest)")
    integrations.search_hits(index, question, 4, None, None)
    mark("search (first question)")
    integrations.search_hits(index, question + " again", 4, None, None)
    mark("search (second question)")
    record = {"load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
              "torch_threads": torch.get_num_threads(), "parts": [{"part": w, "wall_s": s, "cpu_s": c}
                                                                 for w, s, c in marks]}
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
