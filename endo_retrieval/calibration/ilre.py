"""`endo calibrate-ilre`: find ILRe's retrieval layer l_R with the passkey task of ILRe's appendix A.1.

Numeric passkeys of several lengths sit behind 'key id' phrases ("blue-cup-red-33") at the start of each of 20
equal segments of a filler text; the query part asks for that key id. A sample counts when every token of the
passkey is kept at budget 1024 (exact match). One streaming pass per sample captures all candidate layers at
once; each layer is scored with the default kernels and with one max + one avg kernel (Table 5's One-Max-Avg).
l_R is the smallest layer with the highest default-kernel recall (section 3.2); it goes into the model's profile.

With `--data FILE.json` (HotpotQA layout) the task is evidence instead (our deviation): each question's haystack of
`--lengths` tokens built as the quality bench builds it, a sample scoring the share of its gold sentences kept
whole. Passkeys saturate on larger models (recall 1.0 at 10 of Qwen2.5-1.5B's 28 layers, so the smallest, layer 2,
is chosen), and a layer that finds a copied number need not find the sentences a question needs.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from endo_retrieval.calibration.datasets import load_examples
from endo_retrieval.methods.ilre import (DEFAULT_AVG_KERNELS, DEFAULT_MAX_KERNELS, ILRe, ILReError, allocate,
                                         check_global_layers, context_scores, prefill)
from endo_retrieval.model.profiles import ilre_profile_path
from endo_retrieval.model.backbone import Backbone

DEFAULT_FILLER = Path(__file__).resolve().parents[3] / "shared" / "data" / "pg_essays"
KEY_WORDS = ("dog", "cat", "yellow", "red", "blue", "cup", "green", "tree", "house", "apple", "river", "stone",
             "bird", "moon", "sun", "book", "chair", "lamp", "fish", "road", "cloud", "horse", "salt", "door")
N_SEGMENTS = 20
KERNEL_SETS = {"default": (DEFAULT_MAX_KERNELS, DEFAULT_AVG_KERNELS), "one-max-avg": ((4,), (5,))}


@dataclass
class PasskeySample:
    context: str
    query: str
    passkey: str
    key_id: str
    value_chars: tuple[int, int]  # where the passkey digits sit in `context`
    length: int  # target context tokens
    key_length: int  # digits
    segment: int  # 0..19: the key opens this segment


def key_id(rng: random.Random) -> str:
    """Three common words and a two-digit number joined by hyphens, e.g. blue-cup-red-33 (appendix A.1)."""
    return "-".join(rng.sample(KEY_WORDS, 3) + [f"{rng.randrange(100):02d}"])


def load_filler(folder: Path) -> str:
    files = sorted(Path(folder).glob("*.txt"))
    if not files:
        raise ILReError(f"No .txt files in {folder}: give --data a folder of plain-text filler (e.g. essays).")
    return "\n\n".join(f.read_text(encoding="utf-8", errors="replace").strip() for f in files)


def make_sample(backbone, filler_ids: np.ndarray, filler_offsets: np.ndarray, filler: str, length: int,
                key_length: int, segment: int, rng: random.Random) -> PasskeySample:
    """A context of about `length` tokens: filler with the passkey phrase at the start of segment `segment`."""
    kid = key_id(rng)
    passkey = f"{rng.randrange(10 ** key_length):0{key_length}d}"  # zero-padded to exactly key_length digits
    needle_head = f"\n\nThe {kid} magic passkey is "
    needle = f"{needle_head}{passkey}.\n"
    n_filler = length - backbone.count_tokens(needle)
    if n_filler > len(filler_ids):
        raise ILReError(f"The filler has {len(filler_ids)} tokens, fewer than the {length} asked for: "
                        "give --data a larger folder or ask for shorter --lengths.")
    start = rng.randrange(len(filler_ids) - n_filler + 1)
    cut = start + (segment * n_filler) // N_SEGMENTS  # the segment's first filler token
    c0, c_cut, c1 = filler_offsets[start, 0], filler_offsets[cut, 0], filler_offsets[start + n_filler - 1, 1]
    before, after = filler[c0:c_cut], filler[c_cut:c1]
    context = before + needle + after
    value_start = len(before) + len(needle_head)
    query = f"\n\n# What's the {kid} magic passkey?\n\nThe {kid} magic passkey is "
    return PasskeySample(context, query, passkey, kid, (value_start, value_start + key_length), length,
                         key_length, segment)


def tokens_in(offsets: np.ndarray, chars: tuple[int, int]) -> np.ndarray:
    """Indices of the tokens that overlap the characters [chars[0], chars[1]) (a passkey, a gold sentence)."""
    return np.flatnonzero((offsets[:, 0] < chars[1]) & (offsets[:, 1] > chars[0]))


def segments_for(n_depths: int) -> list[int]:
    """`n_depths` of the 20 segment starts, evenly spread (all 20 by default)."""
    return sorted({round(i * N_SEGMENTS / n_depths) for i in range(n_depths)})


def parse_ints(text: str, upper: int | None = None) -> list[int]:
    """'8192,32768' or '0-14,20' -> sorted unique ints; 'all' -> range(upper)."""
    if text == "all":
        return list(range(upper))
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return sorted(out)


def calibrate(backbone, filler: str, lengths: list[int], layers: list[int], key_lengths: list[int],
              n_depths: int = N_SEGMENTS, budget: int = 1024, seed: int = 0, progress: bool = True,
              positions: str = "frame") -> dict:
    """Run the passkey task; returns {"layer": l_R, "recall": {layer: x}, ...} (the profile's body).
    `positions`: the prefill's RoPE layout (ILRe.positions; "dca" adds [ILRe Eq. 7] at every layer scored)."""
    filler_enc = backbone.encode(filler)
    rng = random.Random(seed)
    jobs = [(n, k, s) for n in lengths for k in key_lengths for s in segments_for(n_depths)]

    def samples():
        for length, key_length, segment in jobs:
            s = make_sample(backbone, filler_enc.ids, filler_enc.offsets, filler, length, key_length, segment, rng)
            yield f"{length}/{key_length}", s.context, s.query, [s.value_chars]

    task = {"kind": "passkey", "lengths": lengths, "key_lengths": key_lengths, "segments": segments_for(n_depths)}
    return _calibrate(backbone, samples(), len(jobs), layers, budget, seed, task, progress, positions)


def calibrate_evidence(backbone, data: str, lengths: list[int], layers: list[int], limit: int = 100,
                       budget: int = 1024, seed: int = 0, progress: bool = True, positions: str = "frame") -> dict:
    """The same search over layers with evidence for the needle: the first `limit` questions of the HotpotQA-layout
    `data`, each in a haystack of each length; a sample scores the share of its gold sentences kept whole."""
    sets = [load_examples(data, count_tokens=backbone.count_tokens, context_tokens=n, limit=limit, seed=seed)
            for n in lengths]

    def samples():
        for n, examples in zip(lengths, sets):
            for e in examples:
                spans = [(at, at + len(s)) for s in e.supporting if (at := e.context.find(s)) >= 0]
                if spans:
                    yield f"{n}/evidence", e.context, ILRe.query_template.format(question=e.question.strip()), spans

    task = {"kind": "evidence", "data": Path(data).name, "lengths": lengths, "limit": limit}
    return _calibrate(backbone, samples(), sum(map(len, sets)), layers, budget, seed, task, progress, positions)


def _calibrate(backbone, samples, total: int, layers, budget, seed, task, progress, positions) -> dict:
    """Score every layer on every (setting, context, query, needle spans) sample with one streaming pass each: a
    sample's hit is the share of its needle spans whose tokens are all kept at `budget`."""
    from tqdm.auto import tqdm

    hits = {name: {l: [] for l in layers} for name in KERNEL_SETS}  # name -> layer -> [(setting, hit)]
    started = time.time()
    for setting, context, query, spans in tqdm(samples, total=total, desc="calibrate-ilre", disable=not progress):
        enc = backbone.encode(context)
        needles = [tokens_in(enc.offsets, chars) for chars in spans]
        states = prefill(backbone, enc.ids, backbone.encode(query).ids, layers, positions=positions)
        for layer in layers:
            scores = context_scores(backbone, states[layer], dca=positions == "dca")
            for name, (max_k, avg_k) in KERNEL_SETS.items():
                kept = allocate(scores, budget, 4, max_k, avg_k)
                hit = float(np.mean([np.isin(needed, kept).all() for needed in needles]))
                hits[name][layer].append((setting, hit))
        del states
    task |= {"budget": budget, "seed": seed, "seconds": round(time.time() - started, 1)}
    return summarise(backbone, hits, task) | {"positions": positions}


def summarise(backbone, hits: dict, task: dict) -> dict:
    def recall(rows, setting=None):
        return round(float(np.mean([h for s, h in rows if setting in (None, s)])), 4)

    default = hits["default"]
    overall = {str(l): recall(rows) for l, rows in default.items()}
    best = max(overall.values())
    layer = min(int(l) for l, r in overall.items() if r == best)  # smallest layer with the highest recall
    settings = list(dict.fromkeys(s for rows in default.values() for s, _ in rows))
    return {
        "model": backbone.model_id, "model_hash": backbone.model_hash, "layer": layer, "recall": overall,
        "recall_by_setting": {name: {s: {str(l): recall(rows, s) for l, rows in per_layer.items()} for s in settings}
                              for name, per_layer in hits.items()},
        "task": task | {"samples": len(next(iter(default.values()))),
                        "kernel_sets": {k: [list(m), list(a)] for k, (m, a) in KERNEL_SETS.items()},
                        "device": str(backbone.device)},
    }


def plot(profile: dict, path: Path) -> bool:
    """Recall per layer, one line per (kernel set, length/key length), as Figure 2. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, settings in profile["recall_by_setting"].items():
        for setting, per_layer in settings.items():
            layers = sorted(per_layer, key=int)
            ax.plot([int(l) for l in layers], [per_layer[l] for l in layers], marker="o", markersize=3,
                    linestyle="-" if name == "default" else "--", label=f"{name} {setting}")
    ax.axvline(profile["layer"], color="grey", linewidth=0.8)
    ax.set(xlabel="layer", ylabel=f"{profile['task'].get('kind', 'passkey')} recall", ylim=(-0.02, 1.02),
           title=f"ILRe layer calibration, {profile['model']} (l_R = {profile['layer']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run(args: argparse.Namespace) -> int:
    backbone = Backbone.default() if args.model is None else Backbone(args.model)
    if not 1 <= args.depths <= N_SEGMENTS:
        raise ILReError(f"--depths must lie in 1..{N_SEGMENTS}, got {args.depths}.")
    if args.budget <= 4:
        raise ILReError(f"--budget must exceed the 4 sink tokens, got {args.budget}.")
    try:
        lengths, key_lengths = parse_ints(args.lengths), parse_ints(args.key_lengths)
        layers = parse_ints(args.layers, backbone.n_layers)
    except ValueError:
        raise ILReError("--lengths, --key-lengths and --layers take comma lists of ints or ranges (0-14), "
                        "--layers also 'all'.") from None
    if not layers or min(layers) < 0 or max(layers) >= backbone.n_layers:
        raise ILReError(f"--layers must lie in 0..{backbone.n_layers - 1}.")
    if args.layers == "all":  # l_R is searched among the layers that see the whole past
        layers = [l for l in layers if backbone.windows[l] is None]
    check_global_layers(backbone, layers)
    if min(lengths) <= args.budget:
        raise ILReError(f"Every --lengths value must exceed the budget {args.budget}.")
    if args.positions != "frame" and not args.out:
        raise ILReError("--positions other than 'frame' needs --out FILE: the shipped profile is calibrated "
                        "with 'frame' and ILRe reads it with that layout.")
    progress = not args.no_progress and sys.stderr.isatty()
    if Path(args.data).suffix == ".json":
        profile = calibrate_evidence(backbone, args.data, lengths, layers, args.limit, args.budget, args.seed,
                                     progress, args.positions)
    else:
        profile = calibrate(backbone, load_filler(Path(args.data)), lengths, layers, key_lengths, args.depths,
                            args.budget, args.seed, progress, args.positions)
    out = Path(args.out) if args.out else ilre_profile_path(backbone)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=1) + "\n")
    png = Path(args.plot) if args.plot else out.with_suffix(".png")
    plotted = plot(profile, png)
    print(f"l_R = {profile['layer']} (recall {profile['recall'][str(profile['layer'])]:.2f}); profile: {out}"
          + (f"; plot: {png}" if plotted else "; no plot (pip install matplotlib)"))
    for layer, r in profile["recall"].items():
        print(f"  layer {layer:>3}: {r:.2f}")
    return 0

