"""Quality metrics of the bench (GUIDE, 'How we judge quality').

Text metrics follow the SQuAD v1.1 evaluation script's definitions (normalisation, token F1, exact match, the
maximum over gold answers). Evidence metrics match at word boundaries of the normalised text, so "1" is not found
inside "1994" and "ed wood" is not found inside "red wood".
"""
from __future__ import annotations

import re
import string
from collections import Counter

import numpy as np
import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
YES_NO = frozenset({"yes", "no"})


def normalize_answer(text: str) -> str:
    """SQuAD v1.1: lowercase, drop punctuation, drop the articles a/an/the, collapse whitespace."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def _golds(golds: str | list[str]) -> list[str]:
    golds = [golds] if isinstance(golds, str) else list(golds)
    if not golds:
        raise ValueError("no gold answers given: pass at least one answer string")
    return golds


def _token_f1(prediction: str, gold: str) -> float:
    pred_tokens, gold_tokens = normalize_answer(prediction).split(), normalize_answer(gold).split()
    overlap = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred_tokens), overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, golds: str | list[str]) -> float:
    """Token-level F1 of the normalised answer, best over the gold answers."""
    return max(_token_f1(prediction, gold) for gold in _golds(golds))


def exact_match(prediction: str, golds: str | list[str]) -> float:
    """1.0 when the normalised prediction equals some normalised gold answer."""
    return float(any(normalize_answer(prediction) == normalize_answer(gold) for gold in _golds(golds)))


def _contains(haystack: str, needle: str) -> bool:
    """Both already normalised: the needle's words occur as a run of whole words in the haystack."""
    return f" {needle} " in f" {haystack} "


def answer_recall(selected_text: str, golds: str | list[str]) -> float | None:
    """1.0 when some normalised gold answer appears (as whole words) in the normalised selected text (S3 paper,
    Table 3). None when every gold answer is 'yes'/'no' (HotpotQA comparison questions) or normalises to nothing:
    finding the word 'yes' in a context is no evidence for the answer, so such items are left out of the mean."""
    answers = [a for a in map(normalize_answer, _golds(golds)) if a and a not in YES_NO]
    if not answers:
        return None
    selected = normalize_answer(selected_text)
    return float(any(_contains(selected, answer) for answer in answers))


def sp_recall(selected_text: str, supporting_sentences: list[str]) -> float | None:
    """Share of gold supporting sentences covered by the selected text. Covered means strictly the whole sentence:
    its normalised text is a whole-word run of the normalised selected text (so a sentence split across two
    non-adjacent kept spans does not count). None when there are no (non-empty) gold sentences."""
    sentences = [s for s in map(normalize_answer, supporting_sentences) if s]
    if not sentences:
        return None
    selected = normalize_answer(selected_text)
    return sum(_contains(selected, sentence) for sentence in sentences) / len(sentences)


def _check_logits(*logits: torch.Tensor) -> list[torch.Tensor]:
    tensors = [torch.as_tensor(x).to(torch.float64) for x in logits]
    if any(t.ndim != 2 or t.shape[0] == 0 for t in tensors):
        raise ValueError(f"logits must be (T, V) with T >= 1 answer positions, got {[tuple(t.shape) for t in tensors]}")
    if len({t.shape for t in tensors}) > 1:
        raise ValueError(f"logits shapes differ: {[tuple(t.shape) for t in tensors]}; score the same answer tokens")
    return tensors


def kl_divergence(logits_full: torch.Tensor, logits_comp: torch.Tensor) -> float:
    """Mean over the T answer positions of KL(P_full || P_comp) = sum_v P_full (log P_full - log P_comp), the
    teacher-forced next-token distributions with the full and the compressed context (S3 paper, section 4.5).
    Computed in float64; tiny negative rounding is clipped to 0 per position."""
    full, comp = _check_logits(logits_full, logits_comp)
    log_p, log_q = torch.log_softmax(full, dim=-1), torch.log_softmax(comp, dim=-1)
    per_position = (log_p.exp() * (log_p - log_q)).sum(dim=-1).clamp_min(0.0)
    return float(per_position.mean())


def nll(logits: torch.Tensor, target_ids: torch.Tensor) -> float:
    """Mean negative log-likelihood of the gold answer tokens; logits[t] is the prediction for target_ids[t]."""
    (scores,) = _check_logits(logits)
    targets = torch.as_tensor(target_ids, dtype=torch.long)
    if targets.shape != scores.shape[:1]:
        raise ValueError(f"target_ids must be ({scores.shape[0]},) to match logits, got {tuple(targets.shape)}")
    return float(torch.nn.functional.cross_entropy(scores, targets))


def retention(score_method: float | None, score_full: float | None) -> float | None:
    """score(method) / score(full); None when either is missing or full scored 0 (the ratio is undefined)."""
    if score_method is None or score_full is None or score_full == 0:
        return None
    return score_method / score_full


def compression(n_context_tokens: int, n_selected_tokens: int) -> float | None:
    """Compression ratio n_context / n_selected (LLMLingua's 'Nx'): 8192 -> 1024 tokens is 8.0. None when nothing
    was selected (the ratio is unbounded)."""
    if n_context_tokens < 0 or n_selected_tokens < 0:
        raise ValueError(f"token counts must be >= 0, got {n_context_tokens} and {n_selected_tokens}")
    return None if n_selected_tokens == 0 else n_context_tokens / n_selected_tokens


# ---------------------------------------------------------------- bootstrap intervals over questions

BOOTSTRAP_LEVEL = 0.95


def bootstrap_ci(values, seed: int, n: int = 1000) -> tuple[float | None, float | None, float | None]:
    """(mean, lo, hi): the mean of per-question values and its 95% percentile bootstrap interval, the questions
    resampled with replacement `n` times (one row of indices per resample). (None, None, None) for no values."""
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    if x.size == 0:
        return None, None, None
    if not np.isfinite(x).all():
        raise ValueError("bootstrap values must be finite numbers; leave undefined items out first")
    means = x[np.random.default_rng(seed).integers(0, x.size, size=(n, x.size))].mean(axis=1)
    tail = 100 * (1 - BOOTSTRAP_LEVEL) / 2
    lo, hi = np.percentile(means, [tail, 100 - tail])
    mean = float(x.mean())
    # the resampled means are summed in another order than the mean itself: keep rounding from putting the
    # point a hair outside its own interval
    return mean, min(float(lo), mean), max(float(hi), mean)


def paired_diff_ci(a, b, seed: int, n: int = 1000) -> tuple[float | None, float | None, float | None]:
    """(mean(a - b), lo, hi) for two systems scored on the same questions: each resample draws the same questions
    for both, so the interval of the difference is that of the per-question differences. Questions that differ
    little between the two systems then narrow the interval, as they should."""
    a, b = np.asarray(a, dtype=np.float64).reshape(-1), np.asarray(b, dtype=np.float64).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"paired values must cover the same questions, got {a.size} and {b.size}")
    return bootstrap_ci(a - b, seed, n)
