"""`endo bench quality`: every method at matched budgets on long-context QA (GUIDE, 'How we judge quality').

Per example, context length, method and budget: the method hands the generator at most `budget` context tokens
(the kvpress peers keep `budget` context KV pairs instead); one prompt template for all, the gold answer appended
as assistant text and teacher-forced. The full context's answer logits are computed once per example and cached,
so every method's KL(P_full || P_comp) reuses them; that one prefill of the whole prompt also serves every kvpress
peer at every budget (`score_prompt`). Each finished record is appended to a JSONL file beside the
output, so an interrupted run picks up where it stopped; the rows are aggregated at the end.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from endo_bench import metrics
from endo_retrieval.calibration.datasets import Example, load_examples
from endo_bench.measure import accel_mb, clock, peak_accel_mb, peak_rss_mb, reset_peak
from endo_retrieval.methods import REGISTRY

logger = logging.getLogger(__name__)

SCHEMA = "endo-bench-quality/1"
_BASELINES = "endo_bench.baselines"
# bench row name -> "module:Class". "bm25" is the chunk baseline of the papers; the engine's sentence-window
# BM25 (the one inside s3-hybrid) is the row "bm25-sent".
METHODS = {
    "full": f"{_BASELINES}:Full",
    "s3": REGISTRY["s3"],
    "s3-hybrid": REGISTRY["s3-hybrid"],
    "ilre": REGISTRY["ilre"],
    "heads": REGISTRY["heads"],
    "endo": REGISTRY["endo"],
    "endo-context": "endo_retrieval.methods.endo:Endo",  # endo reading the whole context (one forward per window)
    "endo-2stage": "endo_bench.two_stage:TwoStageEndo",  # endo reading only BM25's candidate windows
    "bm25": f"{_BASELINES}:BM25Chunks",
    "bm25-sent": REGISTRY["bm25"],
    "dense": f"{_BASELINES}:Dense",
    "longllmlingua": f"{_BASELINES}:LongLLMLingua",
    "snapkv": f"{_BASELINES}:SnapKV",
    "streamingllm": f"{_BASELINES}:StreamingLLM",
    "pyramidkv": f"{_BASELINES}:PyramidKV",
}
USER_TEMPLATE = "Answer the question from the context in a few words.\n\nContext:\n{context}\n\nQuestion: {question}"
MAX_NEW_TOKENS = 32
METRIC_KEYS = ("sp_recall", "answer_recall", "kl", "nll", "f1", "em", "compression")
CI_KEYS = ("sp_recall", "answer_recall")  # given a bootstrap interval and a paired difference to bm25
RETAINED = ("sp_recall", "answer_recall", "f1", "em")
_PLACEHOLDER = "\x00CONTENT\x00"


def parse_methods(spec: str | list[str] | None) -> list[str]:
    """'a,b' -> ['a', 'b'] (all methods when empty); an unknown name is a ValueError listing the known ones."""
    names = [m.strip() for m in (spec.split(",") if isinstance(spec, str) else spec or []) if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise ValueError(f"Unknown method(s) {', '.join(map(repr, unknown))}; known methods: {', '.join(METHODS)}.")
    return list(dict.fromkeys(names)) or list(METHODS)


@dataclass
class QualityConfig:
    data: str
    out: Path
    context_tokens: list[int]
    budgets: list[int]
    methods: list[str]
    limit: int | None = None
    seed: int = 0
    skip_bad: bool = False
    generate: bool = True
    max_new_tokens: int = MAX_NEW_TOKENS
    reference: bool = True  # False: no full-context pass per example, so no kl (`--no-reference`)
    cuda_graphs: bool = True  # False: the batched reads run eagerly on CUDA (`--eager`; timing beside the replay)
    progress: bool | None = None  # None: a bar on a terminal only

    def __post_init__(self):
        self.out = Path(self.out)
        if self.out.suffix != ".json":
            raise ValueError(f"--out must name a .json file, got {self.out}")
        for name, values in (("context tokens", self.context_tokens), ("budgets", self.budgets)):
            if not values or min(values) <= 0:
                raise ValueError(f"{name} must be positive numbers of tokens, got {values}")
        self.methods = parse_methods(self.methods)


# ---------------------------------------------------------------- the prompt, scored and decoded


@dataclass
class Prompt:
    prefill: torch.Tensor  # (n,) chat prefix and user turn: instruction, context, question
    suffix: torch.Tensor   # end of the user turn and the assistant header
    answer: torch.Tensor   # the gold answer, as assistant text


class Prompter:
    """One chat template for every method; the pieces are tokenized apart so the answer tokens never differ."""

    def __init__(self, bb):
        rendered = bb.tokenizer.apply_chat_template([{"role": "user", "content": _PLACEHOLDER}],
                                                    add_generation_prompt=True, tokenize=False)
        prefix, suffix = rendered.split(_PLACEHOLDER)
        self.bb = bb
        self.prefix, self.suffix = self._ids(prefix), self._ids(suffix)

    def _ids(self, text: str) -> torch.Tensor:
        return torch.as_tensor(self.bb.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)

    def answer_ids(self, answer: str) -> torch.Tensor:
        return self._ids(answer)

    def __call__(self, context: str, question: str, answer: str) -> Prompt:
        user = self._ids(USER_TEMPLATE.format(context=context, question=question))
        return Prompt(torch.cat([self.prefix, user]), self.suffix, self.answer_ids(answer))


@dataclass
class Scored:
    answer_logits: torch.Tensor  # (T, V): the prediction of each gold answer token, teacher-forced
    prediction: str | None       # greedy answer (None without generation)
    kv_kept: int                 # KV pairs in layer 0's cache after the prefill
    prefill_ms: float
    generate_ms: float           # prefill plus greedy decoding (prefill alone without generation)


def score_prompt(bb, prompt: Prompt, presses: Sequence = (None,), max_new_tokens: int = MAX_NEW_TOKENS
                 ) -> list[Scored]:
    """Prefill the prompt once; each entry of `presses` gets its own cache from it (None: the full cache, else a
    kvpress press, see `_fan_out`). For each cache: feed the assistant header and the gold answer, rewind to the
    header and decode greedily. Positions continue from the uncompressed length, as kvpress's own pipeline does.
    Times: the shared prefill plus the entry's own compression, header, and (generate) decoding."""
    from transformers import DynamicCache

    model, device = bb.model, bb.device
    full = DynamicCache()
    caches = [full if press is None else DynamicCache() for press in presses]
    own_ms = [0.0] * len(presses)
    with bb.lock, torch.inference_mode():
        start = time.perf_counter()
        with _fan_out(model, presses, caches, own_ms):
            model.model(input_ids=prompt.prefill[None].to(device), past_key_values=full)
        shared_ms = (time.perf_counter() - start) * 1e3 - sum(own_ms)
        # every press copied its layers out of the full cache during the prefill: the caches share no storage
        return [_answer_and_decode(bb, prompt, cache, shared_ms + ms, max_new_tokens)
                for cache, ms in zip(caches, own_ms)]


@contextlib.contextmanager
def _fan_out(model, presses: Sequence, caches: list, own_ms: list[float]):
    """kvpress compresses the cache in a hook after each attention layer (BasePress.__call__); the layer's output,
    and so every later layer's input, does not depend on the press. So one prefill serves several presses: after
    each attention layer, each press's own `forward_hook` compresses its own copy of that layer's full keys and
    values, exactly as under `with press(model)`. `own_ms[i]` collects press i's hook time."""
    peers = [(i, press, caches[i]) for i, press in enumerate(presses) if press is not None]
    if not peers:
        yield
        return
    layers = model.model.layers
    for _, press, _ in peers:
        press.post_init_from_model(model)

    def hook(module, args, kwargs, output):
        full = kwargs["past_key_values"].layers[module.layer_idx]
        for i, press, cache in peers:
            start = time.perf_counter()
            cache.update(full.keys, full.values, module.layer_idx)
            press.forward_hook(module, args, {**kwargs, "past_key_values": cache}, output)
            own_ms[i] += (time.perf_counter() - start) * 1e3
        return output

    handles = []
    try:
        for layer in layers:
            layer.self_attn.rotary_emb = model.model.rotary_emb  # as kvpress does: SnapKV re-rotates its window
            handles.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def feed(model, cache, ids: torch.Tensor, position: int) -> torch.Tensor:
    """Next-token logits (len(ids), V) after each of `ids`, appended to `cache` from RoPE position `position` on.
    One forward when every layer holds the same number of pairs (the causal mask is built from layer 0's length);
    one token at a time otherwise (PyramidKV's layers differ), since a single token needs no mask."""
    device = model.device
    lengths = {layer.keys.shape[-2] for layer in cache.layers}
    steps = [ids] if len(lengths) <= 1 else ids.split(1)
    rows = []
    for part in steps:
        positions = torch.arange(position, position + len(part), device=device)[None]
        out = model(input_ids=part[None].to(device), past_key_values=cache, position_ids=positions)
        rows.append(out.logits[0].float().cpu())
        position += len(part)
    return torch.cat(rows)


def _answer_and_decode(bb, prompt: Prompt, cache, prefill_ms: float, max_new_tokens: int) -> Scored:
    model = bb.model
    kv_kept = cache.get_seq_length()
    position = len(prompt.prefill)
    start = time.perf_counter()
    first = feed(model, cache, prompt.suffix, position)[-1]
    prefill_ms += (time.perf_counter() - start) * 1e3
    position += len(prompt.suffix)
    lengths = [layer.keys.shape[-2] for layer in cache.layers]
    answer_logits = torch.cat([first[None], feed(model, cache, prompt.answer[:-1], position)]) \
        if len(prompt.answer) > 1 else first[None]
    for layer, n in zip(cache.layers, lengths):  # rewind: generation starts right after the header
        layer.keys, layer.values = layer.keys[..., :n, :], layer.values[..., :n, :]
    prediction, decode_ms = None, 0.0
    if max_new_tokens > 0:
        start = time.perf_counter()
        stop = _eos_ids(bb)
        tokens = [int(first.argmax())]
        while tokens[-1] not in stop and len(tokens) < max_new_tokens:
            tokens.append(int(feed(model, cache, torch.tensor(tokens[-1:]), position + len(tokens) - 1)[-1].argmax()))
        prediction = bb.tokenizer.decode([t for t in tokens if t not in stop], skip_special_tokens=True).strip()
        decode_ms = (time.perf_counter() - start) * 1e3
    return Scored(answer_logits, prediction, kv_kept, prefill_ms, prefill_ms + decode_ms)


def _eos_ids(bb) -> set[int]:
    eos = bb.model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids | ({bb.tokenizer.eos_token_id} if bb.tokenizer.eos_token_id is not None else set())


# ---------------------------------------------------------------- records (resumable) and one evaluation


class RecordStore:
    """Finished (example, method, budget, context_tokens) records, one JSON line each; the first line holds the
    settings they depend on, so a restart with other settings cannot mix its records in."""

    def __init__(self, path: Path, fingerprint: dict):
        self.path, self.records = path, {}
        if path.exists() and path.stat().st_size:
            text = path.read_text(encoding="utf-8")
            if not text.endswith("\n"):  # cut short mid-line: end that line so the next record starts afresh
                with path.open("a", encoding="utf-8") as f:
                    f.write("\n")
            lines = text.splitlines()
            header = json.loads(lines[0]).get("fingerprint")
            if header != fingerprint:
                raise ValueError(f"{path} holds records made with other settings ({header} != {fingerprint}): "
                                 "delete it to start over, or choose another --out")
            for line in lines[1:]:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by the interruption: computed again
                    continue
                self.records[self.key(record)] = record
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"fingerprint": fingerprint}) + "\n", encoding="utf-8")

    @staticmethod
    def key(record: dict) -> tuple:
        return record["example"], record["method"], record["budget"], record["context_tokens"]

    def __contains__(self, key: tuple) -> bool:
        return key in self.records

    def add(self, record: dict) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        self.records[self.key(record)] = record


class Evaluator:
    """Runs one method on one example at one budget and scores it against the cached full-context logits.
    Work that several rows of one example share is done once: the whole prompt's prefill (for `full` and every
    kvpress peer at every budget, see `score_prompt`) and a context index shared by methods of one `index_kind`
    (S3 and S3-Hybrid); each row still reports what its own method would take alone."""

    def __init__(self, bb, config: QualityConfig, cache_dir: Path, methods: dict | None = None):
        self.bb, self.config, self.cache_dir = bb, config, cache_dir
        self.prompter = Prompter(bb)
        self.longest_prompt = 0
        self.presses = {m.name: m for m in (methods or {}).values() if hasattr(m, "make_press")}
        self._whole: tuple | None = None     # ((example id, context tokens), prompt, {(method, budget): Scored})
        self._prepared: tuple | None = None  # ((module, index kind, example id, context tokens), prepared, ms)

    def _score(self, prompt: Prompt, presses=(None,)) -> list[Scored]:
        self.longest_prompt = max(self.longest_prompt, len(prompt.prefill) + len(prompt.suffix) + len(prompt.answer))
        return score_prompt(self.bb, prompt, presses, self.config.max_new_tokens if self.config.generate else 0)

    def full_logits(self, example: Example, context_tokens: int, scored: Scored | None = None) -> torch.Tensor:
        """The full context's answer logits, computed once per example (`scored`: already computed) and kept."""
        path = self.cache_dir / f"{hashlib.sha1(example.id.encode()).hexdigest()[:16]}-{context_tokens}.pt"
        if path.exists():
            return torch.load(path, weights_only=True)  # tensors only: a cached file cannot run code
        scored = scored or self.whole_prompt(example, context_tokens)[1]["full", None]
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(scored.answer_logits, tmp)
        tmp.replace(path)  # atomic: an interrupted write is never read back
        return scored.answer_logits

    def whole_prompt(self, example: Example, context_tokens: int) -> tuple[Prompt, dict]:
        """The whole context's prompt and its Scored for `full` and for every kvpress peer at every budget, from
        one prefill; kept for the example's later rows."""
        key = (example.id, context_tokens)
        if self._whole is None or self._whole[0] != key:
            prompt = self.prompter(example.context, example.question, example.answers[0])
            overhead = len(prompt.prefill) - self.bb.count_tokens(example.context)  # instruction, question, template
            entries = [("full", None)] + [(name, b) for name in self.presses for b in self.config.budgets]
            # kvpress keeps int(n * (1 - ratio)) pairs: the half token makes that exactly budget + overhead
            presses = [None] + [self.presses[name].make_press(
                max(0.0, 1.0 - (budget + overhead + 0.5) / len(prompt.prefill))) for name, budget in entries[1:]]
            self._whole = key, prompt, dict(zip(entries, self._score(prompt, presses)))
        return self._whole[1:]

    def prepared(self, method, example: Example, context_tokens: int) -> tuple[object, float]:
        """`method.prepare(context)` and the ms it took; reused by the next method of the same `index_kind`."""
        kind = getattr(method, "index_kind", None)
        key = (type(method).__module__, kind, example.id, context_tokens)
        if kind is not None and self._prepared is not None and self._prepared[0] == key:
            return self._prepared[1:]
        # clocks that wait for the accelerator: a read's kernels still running when prepare() returns belong to the
        # index, not to the query after it
        start = clock(self.bb.device)
        prepared = method.prepare(example.context)
        elapsed = (clock(self.bb.device) - start) * 1e3
        if kind is not None:
            self._prepared = key, prepared, elapsed
        return prepared, elapsed

    def evaluate(self, method, example: Example, budget: int | None, context_tokens: int) -> dict:
        n_context = self.bb.count_tokens(example.context)
        record = {"example": example.id, "budget": budget, "context_tokens": context_tokens, "n_context": n_context}
        latency = {"index": 0.0, "query": 0.0, "generate": 0.0}
        if hasattr(method, "make_press"):  # KV-cache peer: whole text, `budget` context KV pairs kept
            prompt, scored = self.whole_prompt(example, context_tokens)
            scored = scored[method.name, budget]
            overhead = len(prompt.prefill) - n_context
            selected_text, n_selected = None, max(scored.kv_kept - overhead, 1)
        else:
            reset_peak(self.bb.device)  # the method's own peak (index and query) over what the run holds already
            held = accel_mb(self.bb.device)
            start = clock(self.bb.device)
            if hasattr(method, "prepare"):  # two stages: index the context, then answer the question
                prepared, latency["index"] = self.prepared(method, example, context_tokens)
                start = clock(self.bb.device)
                compressed = method.select(prepared, example.question, budget)
            else:
                compressed = method.compress(example.context, example.question, budget)
            latency["query"] = (clock(self.bb.device) - start) * 1e3
            if held is not None:
                record["method_accel_mb"] = peak_accel_mb(self.bb.device) - held
            selected_text, n_selected = compressed.text, compressed.n_tokens
            if getattr(method, "name", None) == "full":
                scored = self.whole_prompt(example, context_tokens)[1]["full", None]
            else:
                (scored,) = self._score(self.prompter(selected_text, example.question, example.answers[0]))
        latency["generate"] = scored.generate_ms
        reference = self.full_logits(example, context_tokens, scored if selected_text == example.context else None) \
            if self.config.reference else None
        record.update(
            sp_recall=metrics.sp_recall(selected_text, example.supporting) if selected_text is not None else None,
            answer_recall=metrics.answer_recall(selected_text, example.answers) if selected_text is not None
            else None,
            kl=metrics.kl_divergence(reference, scored.answer_logits) if reference is not None else None,
            nll=metrics.nll(scored.answer_logits, self.prompter.answer_ids(example.answers[0])),
            f1=metrics.f1_score(scored.prediction, example.answers) if scored.prediction is not None else None,
            em=metrics.exact_match(scored.prediction, example.answers) if scored.prediction is not None else None,
            compression=metrics.compression(n_context, n_selected),
            selected_tokens=n_selected, prediction=scored.prediction, latency_ms=latency, peak_rss_mb=peak_rss_mb())
        return record


# ---------------------------------------------------------------- the run


WARM_UP = ("Ada Lovelace wrote the first published program. She worked with Charles Babbage on his engine. "
           "The engine was never finished.", "Who wrote the first published program?")


def _load_method(name: str, bb):
    """An instance of the bench method `name`, warmed up on a short text so that loading its models and
    artefacts (SAEs, embedders) is not timed as the first question's latency."""
    module, cls = METHODS[name].split(":")
    method = getattr(importlib.import_module(module), cls)(backbone=bb)
    if hasattr(method, "compress"):
        method.compress(*WARM_UP, 16)
    if hasattr(method, "make_press"):  # imports kvpress now: a missing peer library is reported by its row
        method.make_press(0.5)
    return method


def fingerprint(bb, config: QualityConfig) -> dict:
    return {"model_hash": bb.model_hash, "data": str(config.data), "seed": config.seed,
            "generate": config.generate, "max_new_tokens": config.max_new_tokens, "template": USER_TEMPLATE,
            "limit": config.limit} | ({} if config.reference else {"reference": False}) \
        | ({} if config.cuda_graphs else {"cuda_graphs": False})  # records with kl or not; timed eagerly or not


def run_quality(config: QualityConfig, backbone=None) -> dict:
    """Run the bench; returns the report (also written as JSON, Markdown and PNG plots beside config.out)."""
    from tqdm import tqdm

    from endo_retrieval.model.backbone import Backbone
    wall = time.perf_counter()
    bb = backbone or Backbone.default()
    bb.parts_graphs.enabled = config.cuda_graphs
    store = RecordStore(config.out.with_suffix(".records.jsonl"), fingerprint(bb, config))
    methods, unavailable = {}, {}
    for name in config.methods:
        try:
            methods[name] = _load_method(name, bb)
        except Exception as err:  # noqa: BLE001 - a method that cannot run here: its row says why
            unavailable[name] = f"cannot run here: {err}"
            logger.warning("%s: %s", name, unavailable[name])
    evaluator = Evaluator(bb, config, config.out.with_suffix(".cache"), methods)
    datasets = {L: load_examples(config.data, count_tokens=bb.count_tokens, context_tokens=L, limit=config.limit,
                                 seed=config.seed, skip_bad=config.skip_bad) for L in config.context_tokens}
    jobs = [(L, example, name, None if name == "full" else b)
            for L, dataset in datasets.items() for example in dataset for name in methods
            for b in (config.budgets[:1] if name == "full" else config.budgets)]
    todo = [job for job in jobs if (job[1].id, job[2], job[3], job[0]) not in store]
    bar = tqdm(todo, desc="bench quality", unit="run", disable=None if config.progress is None else not config.progress)
    for L, example, name, budget in bar:
        bar.set_postfix_str(f"{name} {L}/{budget}", refresh=False)
        try:
            record = evaluator.evaluate(methods[name], example, budget, L)
        except Exception as err:  # noqa: BLE001 - one failing peer must not stop the bench; the row reports it
            logger.warning("%s on %s (budget %s, %d tokens) failed: %s", name, example.id, budget, L, err)
            record = {"example": example.id, "budget": budget, "context_tokens": L,
                      "error": f"{type(err).__name__}: {err}"}
        record["method"] = name
        store.add(record)
    notes = _notes(bb, evaluator, methods)
    skipped = sorted({message for dataset in datasets.values() for message in dataset.skipped})
    result = {
        "schema": SCHEMA,
        "config": {"model": bb.model_id, "model_hash": bb.model_hash, "data": str(config.data),
                   "context_tokens": config.context_tokens[0] if len(config.context_tokens) == 1
                   else config.context_tokens,
                   "budget": config.budgets[0] if len(config.budgets) == 1 else config.budgets,
                   "seed": config.seed, "limit": config.limit, "methods": config.methods,
                   "n_examples": {str(L): len(d) for L, d in datasets.items()}, "generate": config.generate,
                   "reference": config.reference, "max_new_tokens": config.max_new_tokens,
                   "cuda_graphs": bb.device.type == "cuda" and config.cuda_graphs,
                   "prompt_template": USER_TEMPLATE,
                   "device": bb.device.type, "torch_threads": torch.get_num_threads(), "skipped_rows": skipped,
                   "notes": notes, "wall_s": round(time.perf_counter() - wall, 1)},
        "rows": aggregate(list(store.records.values()), config, unavailable,
                          {name: m.note for name, m in methods.items() if getattr(m, "note", None)}),
    }
    write_outputs(result, config.out)
    return result


def _notes(bb, evaluator: Evaluator, methods: dict) -> list[str]:
    one_stage = [n for n, m in methods.items() if not hasattr(m, "prepare") and not hasattr(m, "make_press")
                 and n != "full"]
    notes = ["kl/nll: teacher-forced over the gold answer tokens with one chat template for every method; "
             "kl = KL(P_full || P_method), full's logits computed once per example and reused",
             "latency_ms.generate: prefill of the prompt plus greedy decoding (prefill only with --no-generate); "
             "index/query: the method's own work; methods without separate stages put all of it in 'query' "
             f"({', '.join(one_stage) or 'none'})",
             "kvpress peers (snapkv, streamingllm, pyramidkv) compress the KV cache of the prompt's prefill (question "
             "included, so SnapKV's window sees it) to `budget` context pairs plus the instruction/question/template; "
             "they select no text, so sp_recall/answer_recall are null and compression counts kept KV pairs",
             "full and the kvpress peers share one prefill of the whole prompt per example (each peer's press "
             "compresses its own copy of every layer's keys and values, as under its own `with press(model)`); "
             "their latency_ms.generate counts that prefill, their own compression and their own decoding. S3 and "
             "S3-Hybrid share the context's index; each row's latency_ms.index is the time it took to build",
             "peak_rss_mb: the process's peak resident memory (ru_maxrss) when the row's last record finished; "
             "it never goes down during a run",
             "full ignores the budget: computed once per example and repeated under each budget",
             "sp_recall_ci/answer_recall_ci: 95% percentile bootstrap of the mean over examples (1000 resamples, "
             "the run's seed); diff_to_bm25: the row minus bm25 at the same context length and budget, the same "
             "resampled examples for both"]
    if evaluator.longest_prompt > (bb.max_position or float("inf")):
        notes.append(f"the longest prompt ({evaluator.longest_prompt} tokens) exceeds the model's "
                     f"{bb.max_position}-token window: it ran as is and RoPE extrapolates past the trained length")
    return notes


def aggregate(records: list[dict], config: QualityConfig, unavailable: dict[str, str],
              method_notes: dict[str, str] | None = None) -> list[dict]:
    """One row per (context length, budget, method): means over examples (None-valued metrics left out);
    retention = row mean / full's mean at the same context length; bootstrap intervals over the examples and,
    where bm25 ran, the paired difference to it (`_intervals`)."""
    method_notes = method_notes or {}
    rows = []
    for L in config.context_tokens:
        full_means = _means([r for r in records if r["method"] == "full" and r["context_tokens"] == L
                             and "error" not in r])
        for budget in config.budgets:
            bm25 = [r for r in records if r["method"] == "bm25" and r["context_tokens"] == L
                    and r["budget"] == budget and "error" not in r] if "bm25" not in unavailable else []
            for name in config.methods:
                if name in unavailable:
                    rows.append({"method": name, "n": 0, "budget": budget, "context_tokens": L,
                                 **dict.fromkeys(METRIC_KEYS),
                                 "latency_ms": dict.fromkeys(("index", "query", "generate")),
                                 "peak_rss_mb": None, "retention": dict.fromkeys(RETAINED),
                                 **{f"{k}_ci": None for k in CI_KEYS}, "note": unavailable[name]})
                    continue
                mine = [r for r in records if r["method"] == name and r["context_tokens"] == L
                        and r["budget"] == (None if name == "full" else budget)]
                good = [r for r in mine if "error" not in r]
                means = _means(good)
                row = {"method": name, "n": len(good), "budget": budget, "context_tokens": L,
                       **{k: means.get(k) for k in METRIC_KEYS},
                       "latency_ms": {stage: _mean([r["latency_ms"][stage] for r in good])
                                      for stage in ("index", "query", "generate")},
                       "peak_rss_mb": max((r["peak_rss_mb"] for r in good), default=None),
                       "retention": {k: metrics.retention(means.get(k), full_means.get(k)) for k in RETAINED},
                       **_intervals(good, bm25, config.seed)}
                failed = [r for r in mine if "error" in r]
                notes = [method_notes.get(name)] + [
                    f"{len(failed)} of {len(mine)} examples failed, e.g. {failed[0]['error']}" if failed else None]
                if any(notes):
                    row["note"] = "; ".join(filter(None, notes))
                rows.append(row)
    return rows


def _intervals(good: list[dict], bm25: list[dict], seed: int) -> dict:
    """`<metric>_ci`: the 95% bootstrap interval of the row's mean over its examples; given bm25's records at the
    same context length and budget, `diff_to_bm25`: the row minus bm25, paired over the examples both scored
    (None-valued items left out, as in the means)."""
    out = {}
    for k in CI_KEYS:
        _, lo, hi = metrics.bootstrap_ci([r[k] for r in good if r.get(k) is not None], seed)
        out[f"{k}_ci"] = None if lo is None else [lo, hi]
    if bm25:
        theirs = {r["example"]: r for r in bm25}
        out["diff_to_bm25"] = {k: _paired(good, theirs, k, seed) for k in CI_KEYS}
    return out


def _paired(good: list[dict], theirs: dict[str, dict], key: str, seed: int) -> dict | None:
    pairs = [(r[key], theirs[r["example"]][key]) for r in good
             if r.get(key) is not None and theirs.get(r["example"], {}).get(key) is not None]
    if not pairs:
        return None
    mine, reference = zip(*pairs)
    return dict(zip(("value", "lo", "hi"), metrics.paired_diff_ci(mine, reference, seed)))


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def _means(records: list[dict]) -> dict:
    return {k: _mean([r.get(k) for r in records]) for k in METRIC_KEYS}


# ---------------------------------------------------------------- outputs: JSON, Markdown table, PNG plots


def write_outputs(result: dict, out: Path) -> list[Path]:
    """`out` (JSON), `out` with .md (the table, retention vs full) and three plots `<stem>-{recall,kl,latency}.png`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    tmp.replace(out)
    out.with_suffix(".md").write_text(markdown_table(result), encoding="utf-8")
    return [out, out.with_suffix(".md"), *plot(result, out)]


def _fmt(value, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _with_ci(row: dict, key: str) -> str:
    ci = row.get(f"{key}_ci")
    return _fmt(row[key]) if row[key] is None or ci is None else f"{_fmt(row[key])} [{_fmt(ci[0])}, {_fmt(ci[1])}]"


def _diff(row: dict, key: str) -> str:
    d = (row.get("diff_to_bm25") or {}).get(key)
    return "–" if d is None else f"{d['value']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]"


def markdown_table(result: dict) -> str:
    cfg = result["config"]
    lines = [f"Model {cfg['model']}, data `{cfg['data']}`, seed {cfg['seed']}, examples {cfg['n_examples']}, "
             f"generation {'on' if cfg['generate'] else 'off'}; wall time {cfg['wall_s']} s. "
             "ret. = retention vs `full` at the same context length; recall cells: mean [95% bootstrap interval "
             "over examples]; Δ: the row minus bm25, paired bootstrap over the examples both scored.", ""]
    head = ("| context | budget | method | n | sp_recall | answer_recall | Δ sp_recall vs bm25 | Δ answer_recall "
            "vs bm25 | KL | NLL | F1 | EM | compression | ret. ans. | ret. F1 | index ms | query ms | generate ms "
            "| peak RSS MB |")
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    notes = []
    for row in result["rows"]:
        lat, ret = row["latency_ms"], row["retention"]
        lines.append(
            f"| {row['context_tokens']} | {row['budget'] if row['method'] != 'full' else 'all'} | {row['method']} "
            f"| {row['n']} | {_with_ci(row, 'sp_recall')} | {_with_ci(row, 'answer_recall')} "
            f"| {_diff(row, 'sp_recall')} | {_diff(row, 'answer_recall')} | {_fmt(row['kl'])} "
            f"| {_fmt(row['nll'])} | {_fmt(row['f1'])} | {_fmt(row['em'])} | {_fmt(row['compression'], 1)} "
            f"| {_fmt(ret['answer_recall'], 2)} | {_fmt(ret['f1'], 2)} | {_fmt(lat['index'], 0)} "
            f"| {_fmt(lat['query'], 0)} | {_fmt(lat['generate'], 0)} | {_fmt(row['peak_rss_mb'], 0)} |")
        if row.get("note"):
            notes.append(f"- {row['method']} ({row['context_tokens']}/{row['budget']}): {row['note']}")
    lines += ["", *dict.fromkeys(notes), *[f"- {note}" for note in cfg["notes"]]]
    return "\n".join(lines) + "\n"


def plot(result: dict, out: Path) -> list[Path]:
    """Recall vs budget, KL vs budget (one panel per context length; full as a dashed line) and the latency of
    each method's stages at the largest budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["n"]]
    lengths = sorted({r["context_tokens"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    paths = []
    for metric, label in (("sp_recall", "supporting-sentence recall"), ("kl", "KL(P_full || P_method)")):
        path = out.with_name(f"{out.stem}-{'recall' if metric == 'sp_recall' else metric}.png")
        fig, axes = plt.subplots(1, max(len(lengths), 1), figsize=(5 * max(len(lengths), 1), 4), squeeze=False)
        for ax, L in zip(axes[0], lengths):
            for name in methods:
                mine = sorted((r["budget"], r[metric]) for r in rows
                              if r["method"] == name and r["context_tokens"] == L and r[metric] is not None)
                if not mine:
                    continue
                if name == "full":
                    ax.axhline(mine[0][1], linestyle="--", color="gray", label="full")
                else:
                    ax.plot(*zip(*mine), marker="o", label=name)
            ax.set(title=f"{L}-token contexts", xlabel="budget (tokens)", ylabel=label)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    path = out.with_name(f"{out.stem}-latency.png")
    fig, axes = plt.subplots(1, max(len(lengths), 1), figsize=(6 * max(len(lengths), 1), 4), squeeze=False)
    for ax, L in zip(axes[0], lengths):
        top = max(r["budget"] for r in rows if r["context_tokens"] == L)
        mine = [r for r in rows if r["context_tokens"] == L and r["budget"] == top]
        bottom = np.zeros(len(mine))
        for stage in ("index", "query", "generate"):
            ms = np.array([r["latency_ms"][stage] or 0.0 for r in mine])
            ax.bar([r["method"] for r in mine], ms, bottom=bottom, label=stage)
            bottom += ms
        ax.set(title=f"{L}-token contexts, budget {top}", ylabel="ms per question")
        ax.tick_params(axis="x", labelrotation=45)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return paths + [path]
