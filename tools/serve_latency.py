"""Per-question latency of `endo serve` against the same search in process, and the cold commands, on one index.

    python tools/serve_latency.py INDEX_DIR --out bench/results/perf/serve_latency_cpu.json [--questions 20]

In process: `EndoIndex.load` once, then each question through the search `endo serve` runs (`commands.model_query`),
timed around the call. Served: `endo serve INDEX_DIR` in a child process, each question a GET /query timed by the
client (HTTP and JSON included). The two alternate question by question, so a busy machine slows both alike, and the
paired difference (served minus in process, question by question) is reported beside the medians. The same again
with `method=bm25` (no model read: what is left is the server's own cost, HTTP, JSON and the header it reads to see a
new generation). Cold:
`endo query` (default method), `endo query --method bm25` and `endo remove` of an id the index does not hold, each a
fresh process timed from start to exit. The load average is recorded before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

QUESTIONS = ["How does endo serve answer a question?", "What does the dense first stage embed?",
             "Which model is the default?", "How are passages cut from Markdown files?",
             "What happens when an index folder is damaged?", "How many heads does the default model have?",
             "What does compress_to do?", "Why do startups need to grow fast?", "What is the hardest lesson?",
             "How do you get startup ideas?", "What is the value of a college degree?",
             "Which benchmark measures retrieval on HotpotQA?", "What does ILRe stand for?",
             "How are sparse autoencoders trained?", "What limits does the CPU have?",
             "How does the reranker fuse scores?", "What is a retrieval head?", "How do I remove a document?",
             "What does endo prepare make?", "How are the Qwen models loaded?"]
ENDO = [sys.executable, "-c", "import sys; from endo_retrieval.cli import main; sys.exit(main())"]


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def cold(args: list[str]) -> float:
    """Seconds of one `endo ARGS` in a fresh process, start to exit."""
    start = time.perf_counter()
    subprocess.run(ENDO + args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(index: str, port: int) -> subprocess.Popen:
    server = subprocess.Popen(ENDO + ["serve", index, "--port", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read()
            return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit("endo serve did not answer /health within 300 s")


def served_seconds(port: int, question: str, method: str | None = None) -> float:
    fields = {"q": question} | ({"method": method} if method else {})
    start = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/query?" + urllib.parse.urlencode(fields),
                                timeout=600) as response:
        json.loads(response.read())
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("index")
    p.add_argument("--out", required=True)
    p.add_argument("--questions", type=int, default=20)
    p.add_argument("--skip-cold", action="store_true", help="leave the cold commands out (a quick check of the tool)")
    args = p.parse_args()
    from endo_retrieval.cli.commands import bm25_query, engine, model_query
    from endo_retrieval.cli.saved import read_saved

    record = {"command": " ".join(["python", "tools/serve_latency.py", *sys.argv[1:]]), "index": args.index,
              "cpu_count": os.cpu_count(), "load_before": load_average()}
    timed = lambda command, runs: [round(cold(command), 2) for _ in range(0 if args.skip_cold else runs)]
    record["cold_s"] = {"query": timed(["query", args.index, QUESTIONS[0]], 2),
                        "query_bm25": timed(["query", args.index, QUESTIONS[0], "--method", "bm25"], 3),
                        "remove_missing": timed(["remove", args.index, "no-such-document.md"], 3)}
    index = engine().EndoIndex.load(args.index)
    query = lambda q, method=None: argparse.Namespace(index=args.index, model=None, question=q, k=4, budget=None,
                                                      method=method, depth=None, read_tokens=None, first_stage=None)
    saved = read_saved(Path(args.index), passages=True)
    model_query(query("warm-up question"), "document", index, progress=False)
    port = free_port()
    server = start_server(args.index, port)
    try:
        served_seconds(port, "warm-up question")
        inprocess, served, bm25_inprocess, bm25_served = [], [], [], []
        for q in (QUESTIONS * 2)[: args.questions]:
            start = time.perf_counter()
            model_query(query(q), "document", index, progress=False)
            inprocess.append(time.perf_counter() - start)
            served.append(served_seconds(port, q))
        for q in (QUESTIONS * 2)[: args.questions]:
            start = time.perf_counter()
            bm25_query(query(q, "bm25"), Path(args.index), "document", saved)
            bm25_inprocess.append(time.perf_counter() - start)
            bm25_served.append(served_seconds(port, q, "bm25"))
    finally:
        server.terminate()
        server.wait(30)
    ms = lambda xs: {"p50": round(1000 * statistics.median(xs), 1), "mean": round(1000 * statistics.mean(xs), 1),
                     "min": round(1000 * min(xs), 1), "max": round(1000 * max(xs), 1), "n": len(xs)}
    paired = lambda a, b: round(1000 * statistics.median(y - x for x, y in zip(a, b)), 1)
    record |= {"default": {"in_process_ms": ms(inprocess), "served_ms": ms(served),
                           "served_minus_in_process_p50_ms": round(1000 * (statistics.median(served)
                                                                            - statistics.median(inprocess)), 1),
                           "paired_median_difference_ms": paired(inprocess, served)},
               "bm25": {"in_process_ms": ms(bm25_inprocess), "served_ms": ms(bm25_served),
                        "paired_median_difference_ms": paired(bm25_inprocess, bm25_served)},
               "load_after": load_average()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
