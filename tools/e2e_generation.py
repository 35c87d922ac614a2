"""End-to-end generation on the local model: LlamaIndex's `RetrieverQueryEngine` over `EndoRetriever` with `EndoLLM`,
one small corpus per HotpotQA question (its two gold paragraphs and a few distractors), timed per question.

    .venv/bin/python tools/e2e_generation.py --questions 8 --distractors 3 --json e2e.json

Reports per question the seconds of `query_engine.query(question)` (retrieval and generation; building the index is
not counted) and the CPU seconds the process spent in it (less sensitive to other processes on the cores), the
answer's token F1 against the gold answer, its length in tokens and whether a sentence repeats; then p50 seconds,
mean F1, the longest answer and the count of answers with a repeated sentence. `--long-chars N` also times one
`EndoLLM.complete` of an N-character prompt (the question's ten paragraphs, repeated to length) with 64 new tokens;
`--compress-to T` (`--compress-method M`) passes `compress_to=T` (`compress_method=M`) to that call's EndoLLM
(where the EndoLLM imported has them).

Runs on whatever code `endo_retrieval` and `llama_index.llms.endo` import from: to time an earlier commit, make a
worktree of it and put its folders first on PYTHONPATH (docs/generation.md has the commands).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "hotpotqa" / "dev300.json"
SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")  # a sentence ends at . ! ? before a space, or at a line break


def paragraphs(item: dict) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(gold, distractor) paragraphs of a HotpotQA item as (title, text)."""
    gold_titles = {title for title, _ in item["supporting_facts"]}
    gold, other = [], []
    for title, sentences in item["context"]:
        (gold if title in gold_titles else other).append((title, "".join(sentences)))
    return gold, other


def repeated_sentence(answer: str) -> bool:
    """Whether some sentence or line of the answer (two words or more, normalised) occurs twice."""
    from endo_bench.metrics import normalize_answer

    seen = set()
    for sentence in SENTENCE_END.split(answer.strip()):
        norm = normalize_answer(sentence)
        if len(norm.split()) < 2:
            continue
        if norm in seen:
            return True
        seen.add(norm)
    return False


def summarise(rows: list[dict]) -> dict:
    return {"questions": len(rows), "p50_s": round(statistics.median(r["seconds"] for r in rows), 2),
            "mean_s": round(statistics.fmean(r["seconds"] for r in rows), 2),
            "p50_cpu_s": round(statistics.median(r["cpu_s"] for r in rows), 2),
            "f1": round(statistics.fmean(r["f1"] for r in rows), 3),
            "longest_answer_tokens": max(r["answer_tokens"] for r in rows),
            "answers_at_max_new_tokens": sum(r["answer_tokens"] >= r.get("max_new_tokens", 10**9) - 2 for r in rows),
            "repeated_sentence_answers": sum(repeated_sentence(r["answer"]) for r in rows)}


def table(paths: list[Path]) -> str:
    """One Markdown row per run (the repeated sentences counted again from the stored answers)."""
    out = ["| run | questions | p50 s / question | mean s | p50 CPU s | answer F1 | longest answer (tokens) | "
           "answers at max_new_tokens | answers with a repeated sentence | 16,000-character prompt, 64 new tokens: s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for path in paths:
        run = json.loads(path.read_text())
        s = summarise([r | {"max_new_tokens": run["max_new_tokens"]} for r in run["rows"]])
        long = run.get("long_prompt")
        long_s = "" if long is None else f"{long['seconds']}" + (
            f" ({', '.join(f'{k}={v}' for k, v in long['kwargs'].items() if k != 'max_new_tokens')})"
            if len(long["kwargs"]) > 1 else "")
        out.append(f"| {path.stem} (max_new_tokens={run['max_new_tokens']}) | {s['questions']} | {s['p50_s']} | "
                   f"{s['mean_s']} | {s['p50_cpu_s']} | {s['f1']:.3f} | {s['longest_answer_tokens']} | "
                   f"{s['answers_at_max_new_tokens']} | {s['repeated_sentence_answers']} | {long_s} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--distractors", type=int, default=3)
    p.add_argument("--long-chars", type=int, default=0, help="also time one complete() of a prompt this long")
    p.add_argument("--compress-to", type=int, default=None, help="EndoLLM(compress_to=...) for the long prompt")
    p.add_argument("--compress-method", default=None, help="EndoLLM(compress_method=...) with --compress-to")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--table", type=Path, nargs="+", default=None, metavar="JSON",
                   help="print a Markdown table of earlier runs' JSON files (nothing is run)")
    args = p.parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0

    from endo_bench.metrics import f1_score
    from llama_index.core import Document
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.llms.endo import EndoLLM
    from llama_index.retrievers.endo import EndoRetriever

    import endo_retrieval
    from endo_retrieval.model.backbone import Backbone

    llm = EndoLLM()
    tok = Backbone.default().tokenizer
    code = {"endo_retrieval": endo_retrieval.__file__,
            "llama_index.llms.endo": sys.modules[EndoLLM.__module__].__file__}
    print(f"code: {code}; EndoLLM max_new_tokens={llm.max_new_tokens}; load average {os.getloadavg()}", flush=True)
    items = json.loads(args.data.read_text())[: args.questions]
    rows = []
    for item in items:
        gold, other = paragraphs(item)
        docs = [Document(text=f"{title}\n{text}", metadata={"title": title})
                for title, text in gold + other[: args.distractors]]
        engine = RetrieverQueryEngine.from_args(EndoRetriever.from_documents(docs), llm=llm)
        start, cpu = time.perf_counter(), time.process_time()
        answer = str(engine.query(item["question"])).strip()
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        row = {"id": item["_id"], "question": item["question"], "gold": item["answer"], "answer": answer,
               "seconds": round(seconds, 2), "cpu_s": round(cpu, 2), "f1": round(f1_score(answer, item["answer"]), 3),
               "answer_tokens": len(tok.encode(answer, add_special_tokens=False)),
               "repeated_sentence": repeated_sentence(answer)}
        rows.append(row)
        print(f"{row['seconds']:7.1f} s  F1 {row['f1']:.2f}  {row['answer_tokens']:4d} tok  "
              f"rep {int(row['repeated_sentence'])}  {answer[:100]!r}", flush=True)
    summary = summarise([r | {"max_new_tokens": llm.max_new_tokens} for r in rows])
    print(json.dumps(summary), flush=True)
    out = {"code": code, "max_new_tokens": llm.max_new_tokens, "summary": summary, "rows": rows}
    if args.long_chars:
        item = items[0]
        gold, other = paragraphs(item)
        text = "\n\n".join(f"{t}\n{x}" for t, x in gold + other)
        context = (text + "\n\n") * (args.long_chars // (len(text) + 2) + 1)
        question = f"\n\nAnswer the question using the context.\nQuestion: {item['question']}"
        prompt = context[: args.long_chars - len(question)] + question
        kwargs = {"max_new_tokens": 64} | ({"compress_to": args.compress_to} if args.compress_to else {}) | (
            {"compress_method": args.compress_method} if args.compress_method else {})
        long_llm = EndoLLM(**kwargs)
        start = time.perf_counter()
        response = long_llm.complete(prompt)
        answer = response.text
        seconds = time.perf_counter() - start
        out["long_prompt"] = {"chars": len(prompt), "prompt_tokens": len(tok.encode(prompt, add_special_tokens=False)),
                              "kwargs": kwargs, "seconds": round(seconds, 2), "answer": answer,
                              "f1": round(f1_score(answer, item["answer"]), 3),
                              "generation": (response.additional_kwargs or {}).get("generation")}
        print(json.dumps(out["long_prompt"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
