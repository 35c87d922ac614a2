"""Scoring primitives every method shares: BM25 with one tokenizer rule, fusion of several signals, and the
density-and-peaks selection of spans."""
