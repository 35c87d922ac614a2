"""`endo calibrate-heads`: choose the model's query-focused retrieval heads on labelled data (QRHead, section 3)
and fit the fused ranking's weights (`endo`), into the model's heads profile.

Labelled data is a HotpotQA-layout file (gold supporting sentences; `../shared/data/hotpotqa/calib100.json` is
meant for this) or `passkey:DIR`, turned into haystacks the same way the quality bench builds them. Per item the
model reads the haystack once with every layer's keys kept, and every head's calibrated attention (question minus
content-free question) is summed per sentence. A head's score is the share of gold sentences among its top
`--top` sentences (QRHead scores heads by the attention mass on gold evidence; the share in the top ranks is the
same idea, counted where retrieval uses it). The best `--heads` heads are kept; the fusion weights are then fitted
on the same items (`methods/endo.py`). Never calibrate on the data you report on.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from endo_retrieval.methods.endo import SIGNALS, fit_weights, recall_in_budget, signals
from endo_retrieval.methods.heads import HeadsError, Prepared, calibrated_scores, prepare_context
from endo_retrieval.model.profiles import heads_profile_path, ilre_profile
from endo_retrieval.scoring.bm25 import OkapiPostings, words
from endo_retrieval.calibration.datasets import Example, PARAGRAPH_SEPARATOR, load_examples
from endo_retrieval.model.backbone import Backbone

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
DEFAULT_DATA = SHARED / "hotpotqa" / "calib100.json"
DEFAULT_DISTRACTORS = SHARED / "wikitext2"


@dataclass
class Item:
    """One labelled haystack: every head's calibrated score per sentence, and which sentences are gold."""

    question: str
    table: np.ndarray  # (n_layers * n_heads, n_sentences), head index = layer * n_heads + head
    gold: np.ndarray  # bool (n_sentences,)
    lengths: np.ndarray  # tokens per sentence


def gold_sentences(prepared: Prepared, supporting: list[str]) -> np.ndarray:
    """Sentences (of the corpus map) that overlap a gold supporting sentence's characters in the context."""
    doc = prepared.corpus.doc("context")
    starts = prepared.sentence_starts - doc.start
    gold = np.zeros(len(starts), dtype=bool)
    for sentence in supporting:
        at = prepared.text.find(sentence.strip())
        if at < 0 or not sentence.strip():
            continue
        tokens = np.flatnonzero((doc.offsets[:, 1] > at) & (doc.offsets[:, 0] < at + len(sentence.strip())))
        if len(tokens):
            first = np.searchsorted(starts, tokens[0], side="right") - 1
            last = np.searchsorted(starts, tokens[-1], side="right") - 1
            gold[first: last + 1] = True
    return gold


def wikitext_paragraphs(folder: Path, max_sentences: int = 6) -> list[str]:
    """Wikipedia paragraphs of WikiText files ('= Title =' headers), de-tokenised and cut to a lead's length,
    rendered as HotpotQA renders its paragraphs ('Title: ...')."""
    import re

    out = []
    for path in sorted(Path(folder).glob("*.txt")):
        title = None
        for line in path.read_text(encoding="utf-8").splitlines():
            line = line.strip()
            head = re.fullmatch(r"= ([^=].*?) =", line)
            if head:
                title = head.group(1).strip()
            elif line and not line.startswith("=") and title and "<unk>" not in title:
                text = re.sub(r" @(.)@ ", r"\1", line).replace(" <unk>", "").replace("<unk> ", "")
                text = re.sub(r" ([.,;:!?)'])", r"\1", text).replace("( ", "(")
                sentences = re.split(r"(?<=[.!?]) (?=[A-Z])", text)
                if len(sentences) >= 2:
                    out.append(f"{title}: " + " ".join(sentences[:max_sentences]))
    return out


def hard_haystacks(examples, pool: list[str], count_tokens, context_tokens: int, seed: int, n_hard: int = 8):
    """Each question's own paragraphs, then the `n_hard` pool paragraphs BM25 ranks highest for the question (how
    HotpotQA chose its distractors: by similarity to the question), then random pool paragraphs up to
    `context_tokens`, shuffled. Same-topic distractors make the calibration see where BM25 goes wrong."""
    import random


    bm25 = OkapiPostings.build([words(p) for p in pool])
    cost = {}
    for e in examples:
        rng = random.Random(f"{seed}/{e.id}")
        own = e.context.split(PARAGRAPH_SEPARATOR)
        ranked = [i for i in np.argsort(-bm25.get_scores(words(e.question)), kind="stable")[: n_hard + len(own)]
                  if pool[i] not in own][:n_hard]
        rest = [i for i in rng.sample(range(len(pool)), min(len(pool), 400)) if i not in ranked]
        kept, total = list(own), sum(count_tokens(p) for p in own)
        for i in ranked + rest:
            n = cost.setdefault(i, count_tokens(PARAGRAPH_SEPARATOR + pool[i]))
            if pool[i] not in own and total + n <= context_tokens:
                kept.append(pool[i])
                total += n
        rng.shuffle(kept)
        yield Example(e.id, e.question, e.answers, PARAGRAPH_SEPARATOR.join(kept), e.supporting,
                      {"n_hard": n_hard, "n_paragraphs": len(kept)})


def all_heads(backbone) -> list[tuple[int, int]]:
    return [(l, h) for l in range(backbone.n_layers) for h in range(backbone.n_heads)]


def label(backbone, example, **read_options) -> Item:
    prepared = prepare_context(backbone, example.context, range(backbone.n_layers), **read_options)
    heads = all_heads(backbone)
    table = calibrated_scores(backbone, prepared, heads, example.question, per_head=True)
    lengths = np.diff(np.append(prepared.sentence_starts, prepared.corpus.n_positions))
    return Item(example.question, table, gold_sentences(prepared, example.supporting), lengths)


def top_share(scores: np.ndarray, gold: np.ndarray, top: int) -> np.ndarray:
    """Per row of `scores` (heads x sentences): the share of gold sentences among the row's `top` best."""
    best = np.argsort(-scores, axis=-1, kind="stable")[..., :top]
    return gold[best].sum(-1) / max(1, min(top, int(gold.sum())))


def rank_heads(items: list[Item], top: int = 10) -> np.ndarray:
    """Mean top-`top` gold share per head over the items (QRHead's head score, counted in ranks)."""
    return np.mean([top_share(it.table, it.gold, top) for it in items if it.gold.any()], axis=0)


# ---------------------------------------------------------------- the command


def run(args) -> dict:
    bb = Backbone.of(args.model, device=args.device)
    specs = args.data or [str(DEFAULT_DATA)]
    budgets = args.budgets or [L // 8 for L in args.context_tokens]
    if len(budgets) != len(args.context_tokens):
        raise HeadsError("give one --budgets value per --context-tokens value")
    start = time.perf_counter()
    cells = []  # (budget, examples) per haystack length
    for L, budget in zip(args.context_tokens, budgets):
        if args.distractors == "none":
            examples = [e for spec in specs for e in load_examples(
                spec, count_tokens=bb.count_tokens, context_tokens=L, limit=args.limit, seed=args.seed)]
        else:
            own = [e for spec in specs for e in load_examples(spec, count_tokens=bb.count_tokens, limit=args.limit)]
            pool = wikitext_paragraphs(Path(args.distractors)) + \
                [p for e in own for p in e.context.split(PARAGRAPH_SEPARATOR)]
            if len(pool) < 50:
                raise HeadsError(f"{args.distractors}: too few paragraphs for distractors; give a folder of .txt "
                                 "files, or --distractors none")
            examples = list(hard_haystacks(own, pool, bb.count_tokens, L, args.seed))
        cells.append((budget, examples))
    profile, fit_items = calibrate(bb, cells, top=args.top, n_heads=args.heads)
    profile |= {"data": [Path(s).name for s in specs], "distractors": Path(args.distractors).name,
                "context_tokens": args.context_tokens, "budgets": budgets, "seed": args.seed,
                "wall_s": round(time.perf_counter() - start, 1)}
    out = write_profile(profile, Path(args.out) if args.out else heads_profile_path(bb))
    if getattr(args, "dump", None):  # every item's signals, for analysis beside the profile
        np.savez_compressed(args.dump, **{f"{i}/{k}": v for i, (sig, gold, lengths, budget) in enumerate(fit_items)
                                          for k, v in {**sig, "gold": gold, "lengths": lengths,
                                                       "budget": np.array(budget)}.items()})
    print(json.dumps({k: profile[k] for k in ("heads", "recall_by_count", "fusion", "n_items", "wall_s")}))
    print(f"wrote {out}")
    return profile


def steps(iterable, desc: str, progress=None):
    """`iterable` under a progress bar of its own, or counted on `progress` (one tqdm bar that several steps share,
    so its estimate of the time left covers them all)."""
    if progress is None:
        from tqdm import tqdm

        yield from tqdm(iterable, desc=desc, disable=None)
        return
    progress.set_description(desc)
    for x in iterable:
        yield x
        progress.update(1)


def cached_arrays(cache: Path | None, key: str, make) -> dict[str, np.ndarray]:
    """A dict of arrays, read from `cache`/KEY.npz when an earlier run left it there, else made and written there
    atomically (so an interrupted calibration resumes at the first item it had not finished)."""
    import hashlib
    import os

    if cache is None:
        return make()
    path = Path(cache) / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.npz"
    if path.exists():
        try:
            with np.load(path) as z:
                return {k: z[k] for k in z.files}
        except (OSError, ValueError):  # a damaged file: made again
            pass
    out = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **out)
    os.replace(tmp, path)
    return out


def calibrate(bb, cells, *, top: int = 10, n_heads: int | None = None, progress=None, cache: Path | None = None,
              fit_fusion=None, choose_count=None) -> tuple[dict, list]:
    """The heads profile (without the fields that describe the data) and the fusion's fit items, from `cells` =
    [(budget, examples)]: labelled examples (HotpotQA, passkeys, or the zero-label tasks of zero_label.py) whose
    `supporting` sentences are the gold. Pass 1 scores every head on every example; the best heads are kept; pass
    2 computes the fusion's signals with them and fits the weights. `cache`: a folder where each example's
    result is kept, so a rerun skips the examples it has. `fit_fusion`: the fusion's fit on the items (default
    `fit_weights`; zero-label haystacks use zero_label.fit_fusion, since every signal saturates on them).
    `choose_count(counts, recall per count x item)`: how many of the best heads to keep (default: the best mean
    recall, the fewer on a tie; zero-label uses zero_label.most_heads)."""
    cells_items = []  # pass 1 labels every head
    for budget, examples in cells:
        items = []
        for e in steps(examples, f"heads, {len(cells_items) + 1}/{len(cells)}", progress):
            a = cached_arrays(cache, f"label/{bb.model_hash}/{e.question}/{e.context}/{e.supporting}",
                              lambda: vars(label(bb, e)) | {"question": np.array(e.question)})
            items.append(Item(e.question, a["table"], a["gold"].astype(bool), a["lengths"]))
        cells_items.append((budget, examples, items))
    labelled = [it for _, _, items in cells_items for it in items]
    if not any(it.gold.any() for it in labelled):
        raise HeadsError("No calibration item has its evidence in its haystack: check the calibration data.")
    ranked = rank_heads(labelled, top)
    order = np.argsort(-ranked, kind="stable")
    # heads of layers whose window is shorter than every haystack come after the others, in their rank order: past
    # its window a layer's query never attended to the keys it is scored on (Gemma 3's sliding layers, near chance
    # there: docs/models.md)
    seeing = set(bb.layout.layers_seeing(min(int(it.lengths.sum()) for it in labelled)))
    order = np.array(sorted(order, key=lambda i: int(i) // bb.n_heads not in seeing), dtype=np.int64)
    counts = [n_heads] if n_heads else [4, 8, 12, 16]
    per_item = np.array([[recall_in_budget(it.table[order[:n]].sum(0), it.gold, it.lengths, b)
                          for b, _, items in cells_items for it in items if it.gold.any()] for n in counts])
    recall_by_count = {n: float(r.mean()) for n, r in zip(counts, per_item)}
    n_best = (choose_count(counts, per_item) if choose_count else
              max(counts, key=lambda n: (recall_by_count[n], -n)))
    chosen = [divmod(int(i), bb.n_heads) for i in order[:n_best]]
    ilre = ilre_profile(bb)
    ilre_layer = int(ilre["layer"]) if ilre else None
    layers = sorted({l for l, _ in chosen} | ({ilre_layer} if ilre_layer is not None else set()))
    fit_items = []  # pass 2: the fusion's signals with the chosen heads
    for budget, examples, items in cells_items:
        for e, it in zip(steps(examples, "fusion signals", progress), items):
            sig = cached_arrays(cache, f"signals/{bb.model_hash}/{e.question}/{e.context}/{chosen}/{ilre_layer}",
                                lambda: signals(bb, prepare_context(bb, e.context, layers), e.question, chosen,
                                                ilre_layer))
            fit_items.append((sig, it.gold, it.lengths, budget))
    fit = (fit_fusion or fit_weights)(fit_items, SIGNALS)
    profile = {
        "model": bb.model_id, "model_hash": bb.model_hash, "heads": [list(h) for h in chosen],
        "head_scores": ranked.reshape(bb.n_layers, bb.n_heads).round(4).tolist(), "top": top,
        "recall_by_count": {str(k): round(v, 4) for k, v in recall_by_count.items()},
        "fusion": fit, "ilre_layer": ilre_layer, "n_items": len(labelled),
    }
    return profile, fit_items


def write_profile(profile: dict, out: Path) -> Path:
    """Write a heads profile atomically, with its head-score plot beside it."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile, indent=1))
    tmp.replace(out)
    scores = np.asarray(profile["head_scores"])
    plot_head_scores(scores, [tuple(h) for h in profile["heads"]], out.with_suffix(".png"))
    return out


def plot_head_scores(scores: np.ndarray, chosen: list[tuple[int, int]], path: Path) -> None:
    """Per-head scores as a layer x head heat map, the chosen heads circled."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the plot is a convenience; the profile holds the numbers
        return
    fig, ax = plt.subplots(figsize=(5, 7))
    im = ax.imshow(scores, aspect="auto", cmap="viridis")
    ax.scatter([h for _, h in chosen], [l for l, _ in chosen], s=80, facecolors="none", edgecolors="red")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title("retrieval-head score (gold share in top sentences)")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
