"""Wall and CPU seconds of `endo` commands run as a user runs them, each a fresh process, with the load average
beside every run (a single-threaded command costs about its CPU time on an idle machine).

    python tools/cli_wall.py INDEX --out FILE [--runs 5]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

QUESTION = "how to configure the logging handler"


def timed(argv: list[str]) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load, clock = os.getloadavg(), time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - clock
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "rc": done.returncode, "load_before": round(load[0], 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("index")
    p.add_argument("--out", required=True)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    endo = shutil.which("endo") or sys.exit("endo is not on PATH: run inside the project's venv")
    commands = {"query --method bm25": [endo, "query", args.index, QUESTION, "--k", "5", "--method", "bm25"],
                "remove (a missing file)": [endo, "remove", args.index, "missing_file.rst"],
                "query (default, cold)": [endo, "query", args.index, QUESTION, "--k", "5"]}
    runs = {name: [timed(argv) for _ in range(args.runs if "default" not in name else 2)]
            for name, argv in commands.items()}
    record = {"command": f"python tools/cli_wall.py INDEX --out {args.out} --runs {args.runs}",
              "index": args.index, "question": QUESTION, "cpus": os.cpu_count(), "runs": runs,
              "median_wall_s": {n: sorted(r["wall_s"] for r in rs)[len(rs) // 2] for n, rs in runs.items()}}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(record["median_wall_s"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
