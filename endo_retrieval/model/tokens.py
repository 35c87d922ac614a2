"""Tokenising for the backbone: token ids with each token's character span, for texts of any length (long ones in
pieces, on several cores, each piece yielded as soon as it is final), and the short texts asked again and again
(a question, its content-free twin) kept."""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from itertools import chain
from typing import Iterator, Sequence

import numpy as np

from endo_retrieval.model.locate import BackboneError

_SAFE_CUT = re.compile(r"\S\n(?=\S)")
PIECE_CHARS = 1 << 14  # longer texts are tokenised in pieces of about this many characters,
PIECES_PER_BATCH = 8  # this many at a time, on as many cores (docs/papers.md, indexing throughput)
# texts up to this many characters keep their encoding (the last KEPT_ENCODINGS of them): a question is tokenised
# for its read, its calibration and its second hop, the content-free question for every context
SHORT_TEXT, KEPT_ENCODINGS = 2048, 256


@dataclass
class Encoding:
    """Token ids of a text and each token's character span in it."""

    ids: np.ndarray  # int64 (n,)
    offsets: np.ndarray  # int64 (n, 2)

    def __len__(self) -> int:
        return len(self.ids)

    @staticmethod
    def join(pieces: Sequence["Encoding"]) -> "Encoding":
        """The encoding of consecutive pieces of one text (offsets already into the whole text)."""
        if len(pieces) == 1:
            return pieces[0]
        return Encoding(np.concatenate([p.ids for p in pieces]), np.concatenate([p.offsets for p in pieces]))


def _agree_near(cut: int, window: Encoding, left: Encoding, right: Encoding, reach: int) -> bool:
    """Whether the tokens within `reach` characters of `cut` are the same in `window` (tokenised across the cut)
    and in the two pieces on its sides."""
    ids, offsets = np.concatenate([left.ids, right.ids]), np.concatenate([left.offsets, right.offsets])
    near = lambda off: (off[:, 0] >= cut - reach) & (off[:, 1] <= cut + reach)
    w, p = near(window.offsets), near(offsets)
    return np.array_equal(window.ids[w], ids[p]) and np.array_equal(window.offsets[w], offsets[p])


def as_text(text: str | bytes) -> str:
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BackboneError(
                f"Input is not UTF-8 text (bad byte at offset {e.start}); decode it to str first, "
                "e.g. data.decode('latin-1'), or convert the file to UTF-8."
            ) from None
    if not isinstance(text, str):
        raise BackboneError(f"Expected text (str), got {type(text).__name__}.")
    if not text.strip():
        raise BackboneError("Input text is empty; give at least one non-blank character.")
    return text


class Tokens:
    """The tokenizer's encodings as the reads need them: ids and character offsets, no special tokens."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._encode_short = functools.lru_cache(maxsize=KEPT_ENCODINGS)(self._encode_whole)

    def encode(self, text: str | bytes, piece_chars: int | None = None) -> Encoding:
        """Token ids and character offsets of `text` (no special tokens): the pieces of `encode_pieces`, joined,
        all tokenised in one batch (nothing waits for the first ones). A short text's encoding is kept and shared
        (`_encode_short`): its arrays are read-only."""
        text = as_text(text)
        if len(text) > SHORT_TEXT or piece_chars:
            return self._encode_whole(text, piece_chars)
        return self._encode_short(text)

    def _encode_whole(self, text: str, piece_chars: int | None = None) -> Encoding:
        enc = Encoding.join([enc for *_, enc in self.encode_pieces(text, piece_chars, batch=max(1, len(text)))])
        enc.ids.setflags(write=False)  # shared where kept (`_encode_short`); no caller writes into an encoding
        enc.offsets.setflags(write=False)
        return enc

    def encode_pieces(self, text: str | bytes, piece_chars: int | None = None, batch: int | None = None
                      ) -> Iterator[tuple[int, int, Encoding]]:
        """(first char, end char, encoding) of consecutive pieces of `text`, offsets into the whole text, each
        yielded once final, so a consumer can start on the first pieces while the rest wait to be tokenised
        (the indexer streams each batch to the accelerator before tokenising the next).

        The text is cut about every `piece_chars` after a lone newline between two non-blank characters (BPE
        pre-tokenisers split there); the fast tokenizer encodes `batch` pieces at a time on all cores (one piece
        would tokenise on one core while the accelerator waits). By default (batch None) the
        batches grow 2, 4, 8, 8 ... pieces (PIECES_PER_BATCH), since a consumer waits for the first one. A cut
        stands only where a window tokenised across it agrees with the pieces on both sides; where it does not, the
        two pieces are tokenised again as one. So the pieces joined are always the one-pass encoding."""
        text = as_text(text)
        bounds = [0, *self._safe_cuts(text, piece_chars or PIECE_CHARS), len(text)]
        n, done, ramp, n_batches = len(bounds) - 1, 0, batch is None, 0
        batch = batch or PIECES_PER_BATCH
        held: list[tuple[int, int, Encoding]] = []  # tokenised; the cut after the last one is not checked yet
        while done < n:
            size = min(batch, max(1, batch // 4) * 2 ** n_batches) if ramp else batch
            take = range(done, min(done + size, n))
            n_batches += 1
            pieces = self._encode_batch([text[bounds[i]:bounds[i + 1]] for i in take], [bounds[i] for i in take])
            held = self._join_at_disagreeing_cuts(text, held + [(bounds[i], bounds[i + 1], e)
                                                               for i, e in zip(take, pieces)])
            done = take.stop
            final = held if done == n else held[:-1]
            yield from final
            held = held[len(final):]

    def arriving_ids(self, text: str | bytes, into: list[Encoding]) -> Iterator[np.ndarray]:
        """The ids of `text` piece by piece, as `encode_pieces` tokenises them (for `stream`, which reads them as they
        arrive); each piece's encoding goes to `into`, so Encoding.join(into) is the text's encoding once read."""
        for *_, piece in self.encode_pieces(text):
            into.append(piece)
            yield piece.ids

    @staticmethod
    def _safe_cuts(text: str, piece_chars: int) -> list[int]:
        cuts = []
        for target in range(piece_chars, len(text) - piece_chars // 2, piece_chars):
            m = _SAFE_CUT.search(text, target)
            if m and m.end() > (cuts[-1] if cuts else 0) and m.end() < len(text):
                cuts.append(m.end())
        return cuts

    def _join_at_disagreeing_cuts(self, text: str, held: list[tuple[int, int, Encoding]], margin: int = 256
                                  ) -> list[tuple[int, int, Encoding]]:
        while len(held) > 1:
            cuts = [b for _, b, _ in held[:-1]]
            starts = [max(p - margin, 0) for p in cuts]
            windows = self._encode_batch([text[a: p + margin] for a, p in zip(starts, cuts)], starts)
            bad = next((j for j, (p, w) in enumerate(zip(cuts, windows))
                        if not _agree_near(p, w, held[j][2], held[j + 1][2], margin // 2)), None)
            if bad is None:
                return held
            (a, _, _), (_, c, _) = held[bad], held[bad + 1]
            held[bad: bad + 2] = [(a, c, self._encode_batch([text[a:c]], [a])[0])]
        return held

    def _encode_batch(self, texts: list[str], starts: Sequence[int] | None = None) -> list[Encoding]:
        starts = starts or [0] * len(texts)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and backend.truncation is None and backend.padding is None:
            # the Rust tokenizer itself: encodes on all cores without the GIL, and skips the Python lists Hugging
            # Face's wrapper builds
            encs = backend.encode_batch(texts, add_special_tokens=False)
            pairs = [(e.ids, e.offsets) for e in encs]
        else:
            enc = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
            pairs = zip(enc["input_ids"], enc["offset_mapping"])
        # fromiter over the flattened pairs, not asarray on a list of tuples (a third of the time, docs/papers.md)
        return [Encoding(np.asarray(ids, dtype=np.int64).reshape(-1),
                         np.fromiter(chain.from_iterable(off), np.int64, 2 * len(off)).reshape(-1, 2) + a)
                for (ids, off), a in zip(pairs, starts)]

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(map(int, ids)), skip_special_tokens=True)
