"""`endo prepare`: everything the default pipeline needs for a model, in one command, from the user's own documents
and no labels.

Phases, each skipped when what it makes exists (`--force` makes it again):
  load      the model (a GGUF file is converted once, into the cache)
  tasks     zero-label tasks made from the documents (zero_label.py): single-hop ones and, a third of them,
            two-hop ones joined by a rare bridge, their questions made by rules or written by the model
            (`--questions-by model`); kept beside the profile
  sae       the SAEs, only when `--methods` names s3 or s3-hybrid (`endo train-sae` on the documents)
  ilre      ILRe's layer, only when `--methods` names ilre (`endo calibrate-ilre` with passkeys in the documents)
  heads     the retrieval heads and the fused ranking's weights, on the tasks' haystacks (`endo calibrate-heads`'s
            calibration; the fusion by zero_label.fit_fusion, as made haystacks saturate every signal)
  pipeline  the corpus pipeline's settings and weights, every chunk of the documents one candidate
            (`endo calibrate-pipeline`'s fit)
Each finished phase is written atomically and recorded in a small state file; within `heads` and `pipeline` each
finished item is kept, so a run stopped part way resumes where it stopped. One progress bar covers both
calibrations, with its estimate of the time left.
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from endo_retrieval.methods import REGISTRY, S3_METHODS
from endo_retrieval.model.profiles import (ASSETS, ProfileError, _read_profile, heads_profile, heads_profile_path,
                                           ilre_profile, sae_card, user_artefacts)

METHODS = tuple(REGISTRY)  # prepare makes every one-context method ready

# `--questions-by auto`: the model writes the questions from this size on. Measured against the labelled profiles on
# dev300 (docs/results.md): the 1.5B model's written questions took the zero-label gap at corpus recall@5 from -7.2
# to -2.0 and -5.2 (two runs) and at sp_recall 8k from -4.5 to -1.2 and -2.4; the 0.5B's moved it within the noise
WRITER_PARAMS = 1_000_000_000
# sizes of the calibration per device kind: a CPU reads about a hundred times fewer tokens per second
SIZES = {"cpu": {"tasks": 40, "passkeys": 4, "questions": 40, "context_tokens": [1024]},
         "cuda": {"tasks": 128, "passkeys": 8, "questions": 200, "context_tokens": [4096]}}


def _ready(bb, profile: Path) -> None:
    """What the model is ready for with the profile just written, and how to use it where the library would not
    find it by itself."""
    elsewhere = profile.resolve() != heads_profile_path(bb).resolve()
    print(f"[prepare] {bb.model_id} is ready for: {', '.join(ready_methods(bb, profile))}"
          + (f" (set ENDO_HEADS_PROFILE={profile} to use it)" if elsewhere else ""))


def ready_methods(backbone, heads_path: Path | None = None) -> list[str]:
    """The methods whose per-model files the model has (bm25 needs none); `heads_path`: the heads profile to judge
    by (default: the one the library finds)."""
    out = ["bm25"]
    if sae_card(backbone):
        out += sorted(S3_METHODS)
    try:
        ilre = ilre_profile(backbone)
        heads = _read_profile(backbone, heads_path, "heads") if heads_path else heads_profile(backbone)
    except ProfileError:
        return out
    if ilre:
        out.append("ilre")
    if heads:
        out.append("heads")
        weights = (heads.get("fusion") or {}).get("weights") or {}
        if ilre or not weights.get("ilre"):
            out.append("endo" if heads.get("pipeline") else "endo (corpus pipeline on general settings)")
    return out


def _state(path: Path, model_hash: str) -> dict:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) and state.get("model_hash") == model_hash else {}


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def run(args, command_args: Callable[[str, list[str]], argparse.Namespace]) -> int:
    """`endo prepare`; `command_args(command, argv)` reads another command's arguments as its parser does."""
    # torch: `endo prepare --help` and its argument errors answer before these load
    from endo_retrieval.calibration import ilre as ilre_calibrate, train_sae
    from endo_retrieval.model.backbone import Backbone  # torch, as above

    start = time.perf_counter()
    timings: dict[str, float] = {}
    methods = {m.strip() for m in args.methods.split(",") if m.strip()}
    if methods - set(METHODS):
        raise ValueError(f"Unknown method(s) {sorted(methods - set(METHODS))}; prepare knows {', '.join(METHODS)}.")
    bb = Backbone.of(args.model, device=args.device)
    timings["load"] = time.perf_counter() - start
    out, state_dir, need = _plan(args, bb, methods)
    state_path = state_dir / "state.json"
    if not any(need.values()):
        _ready(bb, out)
        _finish(args, timings, start, state_path if state_path.exists() else None, bb)
        return 0
    if not args.documents:
        raise ValueError("prepare makes its calibration tasks from your documents: pass --documents DIR (a folder "
                         "of .txt/.md files, the kind of text you will search).")

    sizes = _sizes(args, bb)
    made, state = _tasks(args, bb, sizes, state_dir, timings)
    if need["sae"]:
        t = time.perf_counter()
        train_sae.run(command_args("train-sae", ["--corpus", args.documents, "--heldout", "none"]
                                + _model_args(args)))
        _phase_done(state, state_path, "sae", time.perf_counter() - t, timings)
    if need["ilre"]:
        t = time.perf_counter()
        ilre_calibrate.run(command_args("calibrate-ilre", ["--data", args.documents] + _model_args(args)))
        _phase_done(state, state_path, "ilre", time.perf_counter() - t, timings)
    _calibrate(args, bb, need, sizes, made, out, state, state_dir, timings)
    print(f"[prepare] wrote {out}")
    _ready(bb, out)
    _finish(args, timings, start, state_path, bb)
    return 0


def _plan(args, bb, methods: set[str]) -> tuple[Path, Path, dict[str, bool]]:
    """(the profile to write, the folder of this run's state, which phases to run): a phase runs when it is asked
    for and what it makes is missing or `--force`; the asked-for phases already made are said to be skipped."""
    out = Path(args.profile) if args.profile else heads_profile_path(bb)
    shipped = ASSETS.resolve() in out.resolve().parents
    state_dir = (user_artefacts(bb) if shipped else out.parent) / f"{out.stem}.prepare"
    try:
        existing = _read_profile(bb, out, "heads")
    except ProfileError:  # damaged: made again
        existing = None
    need = {"sae": bool(methods & set(S3_METHODS)) and (args.force or sae_card(bb) is None),
            "ilre": "ilre" in methods and (args.force or ilre_profile(bb) is None),
            "heads": bool(methods & {"endo", "heads"}) and (args.force or existing is None)}
    need["pipeline"] = "endo" in methods and (need["heads"] or "pipeline" not in (existing or {}))
    if shipped and (need["heads"] or need["pipeline"]):
        raise ValueError(f"The package ships {out.name} for {bb.model_id}; to make another, pass --profile PATH "
                         "(and set ENDO_HEADS_PROFILE=PATH to use it).")
    asked = {"sae": bool(methods & set(S3_METHODS)), "ilre": "ilre" in methods,
             "heads": bool(methods & {"endo", "heads"}), "pipeline": "endo" in methods}
    for phase in need:
        if asked[phase] and not need[phase]:
            print(f"[prepare] {phase}: already made, skipped")
    return out, state_dir, need


def _sizes(args, bb) -> dict:
    """The calibration's sizes: the arguments given, SIZES of the device kind for the rest."""
    sizes = SIZES["cuda" if bb.device.type == "cuda" else "cpu"]
    return {"tasks": sizes["tasks"] if args.tasks is None else args.tasks,
            "passkeys": sizes["passkeys"] if args.passkeys is None else args.passkeys,
            "questions": sizes["questions"] if args.questions is None else args.questions,
            "context_tokens": args.context_tokens or sizes["context_tokens"]}


@dataclass
class _Made:
    """What the tasks phase made, for the calibrations: the documents' chunks, the tasks of each calibration."""

    documents: int
    chunks: list
    heads_tasks: list
    pipeline_tasks: list
    questions_by: str


def _tasks(args, bb, sizes: dict, state_dir: Path, timings: dict) -> tuple[_Made, dict]:
    """The tasks phase: zero-label tasks from the documents (kept beside the profile, and read back while the
    documents and settings are the same), and this run's state (a fresh one when they changed)."""
    from tqdm import tqdm

    from endo_retrieval.calibration import zero_label  # torch, as in run

    t = time.perf_counter()
    n_tasks, n_questions = sizes["tasks"], sizes["questions"]
    documents = zero_label.read_documents(args.documents)
    share = zero_label.TWO_HOP_SHARE
    settings = [n_tasks, sizes["passkeys"], n_questions, sizes["context_tokens"], args.seed, round(share, 4),
                zero_label.HARD_SHARE]
    questions_by = args.questions_by
    if questions_by == "auto":
        questions_by = "model" if sum(p.numel() for p in bb.model.parameters()) >= WRITER_PARAMS else "rules"
    settings += [questions_by] if questions_by != "rules" else []  # earlier rules runs' states still apply
    fingerprint = f"{zero_label.fingerprint(documents)}/{settings}"
    state_path = state_dir / "state.json"
    state = {} if args.force else _state(state_path, bb.model_hash)
    if state.get("fingerprint") != fingerprint:  # other documents or sizes: nothing of an earlier run applies
        shutil.rmtree(state_dir, ignore_errors=True)
        state = {"model_hash": bb.model_hash, "fingerprint": fingerprint, "phases": {}}
    chunks = zero_label.chunk_documents(documents, bb.count_tokens)
    tasks_path = state_dir / "tasks.json"
    if "tasks" in state["phases"] and tasks_path.exists():
        tasks = [zero_label.Task(**t) for t in json.loads(tasks_path.read_text())]
    else:
        made = zero_label.make_tasks(chunks, 8 * (n_tasks + n_questions), args.seed)
        linked = zero_label.two_hop_tasks(chunks, 8 * round(share * (n_tasks + n_questions)), args.seed)
        if questions_by == "model":  # three times the tasks needed written, for `mixed` to balance
            made = made[: 3 * round((1 - share) * (n_tasks + n_questions))]
            linked = linked[: 3 * round(share * (n_tasks + n_questions))]
            asked = len(made) + len(linked)
            with tqdm(total=asked, desc="writing questions", unit="task", disable=None) as bar:
                made = zero_label.written_tasks(made, bb.chat.generate_many, bar)
                linked = zero_label.written_tasks(linked, bb.chat.generate_many, bar)
            if len(made) + len(linked) < asked // 4:
                raise ValueError(f"{bb.model_id} wrote {len(made) + len(linked)} usable questions of {asked} "
                                 "asked (a usable one is a question about its sentence); such a model "
                                 "calibrates better on made questions: pass --questions-by rules.")
        tasks = zero_label.mixed(made, linked, chunks, n_tasks + n_questions, share, depth=max(args.depths))
        _write(tasks_path, [vars(t) for t in tasks])
    if len(tasks) < 4:
        raise ValueError(f"{args.documents}: too little text to make calibration tasks from ({len(tasks)} made); "
                         "give a few pages of sentences at least.")
    n_heads = min(n_tasks, max(1, len(tasks) * n_tasks // max(1, n_tasks + n_questions)))  # fewer made: shared
    _phase_done(state, state_path, "tasks", time.perf_counter() - t, timings,
                {"documents": len(documents), "chunks": len(chunks), "tasks": len(tasks),
                 "forms": zero_label.forms(tasks)})
    return _Made(len(documents), chunks, tasks[:n_heads], tasks[n_heads:], questions_by), state


def _calibrate(args, bb, need: dict, sizes: dict, made: _Made, out: Path, state: dict, state_dir: Path,
               timings: dict) -> None:
    """The heads and pipeline phases, under one progress bar: each finished item is kept under the state folder,
    so a stopped run resumes at the item where it stopped."""
    from tqdm import tqdm

    # torch, as in run
    from endo_retrieval.calibration import fusion_rule, heads as heads_calibrate, pipeline as pipeline_calibrate, \
        zero_label

    state_path, lengths, share = state_dir / "state.json", sizes["context_tokens"], zero_label.TWO_HOP_SHARE
    cells = []
    if need["heads"]:
        for L in lengths:
            examples = zero_label.haystacks(made.heads_tasks, made.chunks, bb.count_tokens, L, args.seed)
            examples += zero_label.passkey_tasks(made.chunks, sizes["passkeys"], L, bb.count_tokens, args.seed)
            cells.append((L // 8, examples))
    n_settings = len(args.depths) * len(args.read_tokens) * len(args.orders)
    total = 2 * sum(len(e) for _, e in cells) + (len(made.pipeline_tasks) * n_settings if need["pipeline"] else 0)
    items = state_dir / "items"
    with tqdm(total=total, desc="calibrating", unit="item", disable=None) as bar:
        if need["heads"]:
            t = time.perf_counter()
            profile, _ = heads_calibrate.calibrate(bb, cells, progress=bar, cache=items,
                                                   fit_fusion=zero_label.fit_fusion, choose_count=zero_label.most_heads)
            scale = profile["fusion"]["budget_scale"]
            profile |= {"data": ["zero-label"], "distractors": "zero-label", "context_tokens": lengths,
                        "budgets": [int(b * scale) for b, _ in cells], "seed": args.seed,
                        "zero_label": {"documents": made.documents, "chunks": len(made.chunks),
                                       "tasks": len(made.heads_tasks), "passkeys": sizes["passkeys"] * len(lengths),
                                       "forms": zero_label.forms(made.heads_tasks), "two_hop_share": round(share, 4),
                                       "questions_by": made.questions_by,
                                       "head_count": "the most heads near the best"},
                        "wall_s": round(time.perf_counter() - t, 1)}
            heads_calibrate.write_profile(profile, out)
            _phase_done(state, state_path, "heads", time.perf_counter() - t, timings)
        if need["pipeline"]:
            t = time.perf_counter()
            profile = json.loads(out.read_text())
            titles, texts, questions = zero_label.corpus_questions(made.pipeline_tasks, made.chunks)
            best, table, _ = pipeline_calibrate.fit_settings(
                bb, titles, texts, questions, args.depths, args.read_tokens, args.orders, heads=profile["heads"],
                progress=bar, cache=items, choose_weights=zero_label.flattest,
                choose_setting=zero_label.cheapest_setting)
            profile["pipeline"] = pipeline_calibrate.section(best, table, "zero-label", len(questions),
                                                             time.perf_counter() - t)
            profile["pipeline"]["fit"] |= {"forms": zero_label.forms(made.pipeline_tasks),
                                           "rule": "zero-label: the flattest near-best weights, the cheapest "
                                                   "near-best setting"}
            fusion_rule.transferred(profile)  # the hybrid first stage: its share and fusion, fitted across domains
            pipeline_calibrate.write_json(profile, out)
            _phase_done(state, state_path, "pipeline", time.perf_counter() - t, timings)
    shutil.rmtree(items, ignore_errors=True)  # every phase is written; the items are not needed again


def _model_args(args) -> list[str]:
    return (["--model", args.model] if args.model else []) + (["--device", args.device] if args.device else [])


def _phase_done(state: dict, path: Path, phase: str, seconds: float, timings: dict, extra: dict | None = None):
    state["phases"][phase] = {"s": round(seconds, 1), **(extra or {})}
    _write(path, state)
    timings[phase] = seconds
    print(f"[prepare] {phase}: {seconds:.1f} s" + (f" {json.dumps(extra)}" if extra else ""))


def _finish(args, timings: dict, start: float, state_path: Path | None, bb) -> None:
    timings["total"] = time.perf_counter() - start
    report = {"model": bb.model_id, "device": str(bb.device),
              "phases_s": {k: round(v, 1) for k, v in timings.items()}}
    print(json.dumps(report))
    if args.timings:
        _write(Path(args.timings), report)
