"""Evaluation: data sets (`data`), metrics (`metrics`) and the bench runner."""
from endo_retrieval.eval.data import DataError, Dataset, Example, load_examples, make_passkey
from endo_retrieval.eval.metrics import (
    answer_recall,
    compression,
    exact_match,
    f1_score,
    kl_divergence,
    nll,
    normalize_answer,
    retention,
    sp_recall,
)

__all__ = [
    "DataError", "Dataset", "Example", "load_examples", "make_passkey",
    "answer_recall", "compression", "exact_match", "f1_score", "kl_divergence", "nll", "normalize_answer",
    "retention", "sp_recall",
]
