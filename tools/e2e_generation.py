"""End-to-end generation on the local model: LlamaIndex's `RetrieverQueryEngine` over `EndoRetriever` with `EndoLLM`,
one small corpus per HotpotQA question (its two gold paragraphs and a few distractors), timed per question.

    .venv/bin/python tools/e2e_generation.py --questions 8 --distractors 3 --json e2e.json

Reports per question the seconds of `query_engine.query(question)` (retrieval and generation; building the index is
not counted) and the CPU seconds the process spent in it (less sensitive to other processes on the cores), the
answer's token F1 against the gold answer, its length in tokens and whether it repeats a sentence or line (or a run
of 8 words); then p50 seconds, mean F1, the longest answer and the count of answers that repeat themselves.
`--long-chars N` also times one `EndoLLM.complete` of an N-character prompt (the question's ten paragraphs, repeated
to length) with 64 new tokens; `--compress-to T` (`--compress-method M`) passes `compress_to=T`
(`compress_method=M`) to that call's EndoLLM (where the EndoLLM imported has them). `--table JSON...` prints a
Markdown table of earlier runs.

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


def repeated_sentence(answer: str, run: int = 8) -> bool:
    """Whether the answer repeats itself: a sentence or line of two words or more (normalised) twice, or a run of
    `run` words twice (a loop with no sentence end: "the spouse of the spouse of the spouse of ...")."""
    from endo_bench.metrics import normalize_answer

    seen = set()
    for sentence in SENTENCE_END.split(answer.strip()):
        norm = normalize_answer(sentence)
        if len(norm.split()) < 2:
            continue
        if norm in seen:
            return True
        seen.add(norm)
    words = normalize_answer(answer).split()
    runs = [tuple(words[i:i + run]) for i in range(len(words) - run + 1)]
    return len(set(runs)) < len(runs)


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
           "answers at max_new_tokens | answers that repeat a sentence (or 8 words) | "
           "16,000-character prompt, 64 new tokens: s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for path in paths:
        run = json.loads(path.read_text())
        if not run["rows"]:
            continue
        s = summarise([r | {"max_new_tokens": run["max_new_tokens"]} for r in run["rows"]])
        long = run.get("long_prompt")
        long_s = "" if long is None else f"{long['seconds']}" + (
            f" ({', '.join(f'{k}={v}' for k, v in long['kwargs'].items() if k != 'max_new_tokens')})"
            if len(long["kwargs"]) > 1 else "")
        out.append(f"| {path.stem} (max_new_tokens={run['max_new_tokens']}) | {s['questions']} | {s['p50_s']} | "
                   f"{s['mean_s']} | {s['p50_cpu_s']} | {s['f1']:.3f} | {s['longest_answer_tokens']} | "
                   f"{s['answers_at_max_new_tokens']} | {s['repeated_sentence_answers']} | {long_s} |")
    return "\n".join(out)


def long_prompt(item: dict, chars: int) -> str:
    """The question's ten paragraphs, repeated to `chars` characters less the question's line, then the question."""
    gold, other = paragraphs(item)
    text = "\n\n".join(f"{t}\n{x}" for t, x in gold + other)
    context = (text + "\n\n") * (chars // (len(text) + 2) + 1)
    question = f"\n\nAnswer the question using the context.\nQuestion: {item['question']}"
    return context[: chars - len(question)] + question


def prefill(args) -> int:
    """Seconds to prefill the long prompt in one forward and in chunks into a DynamicCache, at 1 and 2 threads."""
    import torch
    from transformers import DynamicCache

    from endo_retrieval.model.backbone import Backbone

    bb = Backbone.default()
    item = json.loads(args.data.read_text())[0]
    ids = bb.chat_ids(long_prompt(item, args.long_chars or 16000))
    print(f"prompt tokens {ids.shape[1]}, dtype {bb.dtype}, load average {os.getloadavg()}")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for chunk in (int(c) for c in args.prefill.split(",")):
            start = time.perf_counter()
            with torch.inference_mode():
                if chunk == 0:
                    bb.model(ids, logits_to_keep=1)
                else:
                    cache = DynamicCache(config=bb.model.config)
                    for part in ids.split(chunk, dim=1):
                        bb.model(part, past_key_values=cache, use_cache=True, logits_to_keep=1)
            print(f"threads {threads}  chunk {chunk or 'whole'}: {time.perf_counter() - start:.2f} s", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--distractors", type=int, default=3)
    p.add_argument("--long-chars", type=int, default=0, help="also time one complete() of a prompt this long")
    p.add_argument("--compress-to", type=int, default=None, help="EndoLLM(compress_to=...) for the long prompt")
    p.add_argument("--compress-method", default=None, help="EndoLLM(compress_method=...) with --compress-to")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--prefill", default=None, metavar="CHUNKS",
                   help="only time the prefill of a --long-chars prompt: in one forward (0) and in chunks of these "
                        "sizes into a cache, e.g. 0,2048,512, at 1 and 2 threads (nothing else is run)")
    p.add_argument("--table", type=Path, nargs="+", default=None, metavar="JSON",
                   help="print a Markdown table of earlier runs' JSON files (nothing is run)")
    args = p.parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0
    if args.prefill:
        return prefill(args)

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
        if args.json:  # after each question: a run cut short keeps what it measured
            args.json.write_text(json.dumps({"code": code, "max_new_tokens": llm.max_new_tokens, "rows": rows},
                                            indent=1) + "\n")
        print(f"{row['seconds']:7.1f} s  F1 {row['f1']:.2f}  {row['answer_tokens']:4d} tok  "
              f"rep {int(row['repeated_sentence'])}  {answer[:100]!r}", flush=True)
    summary = summarise([r | {"max_new_tokens": llm.max_new_tokens} for r in rows]) if rows else {}
    print(json.dumps(summary), flush=True)
    out = {"code": code, "max_new_tokens": llm.max_new_tokens, "summary": summary, "rows": rows}
    if args.long_chars:
        item = json.loads(args.data.read_text())[0]
        prompt = long_prompt(item, args.long_chars)
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
