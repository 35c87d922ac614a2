"""The local language model, driven the way the papers need it; `Backbone` is the one face of its parts:

- loading: a causal LM of a registered family (families/: one module per family says where its layers, norms,
  windows and rotary embeddings are) from a local Hugging Face folder or GGUF file, a Hugging Face hub id, or by
  default SmolLM2-135M-Instruct (finding and converting it: locate.py), once it is known to fit (memory.py);
- tokenising long texts in pieces, on several cores (here);
- streaming chunked prefill with early exit, handing out each chunk's pre-RoPE key (and query) states: `run_to`
  (here) truncates and hooks the model, `stream` runs the chunks (streaming.py);
- chat-template generation, greedy by default, optionally streamed token by token (generation.py).
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
from collections import OrderedDict
from itertools import chain
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from endo_retrieval.files import cache_dir
from endo_retrieval.model.chunk_graph import KEEP, ChunkGraph
from endo_retrieval.model.parts_graph import PartsGraphs
from endo_retrieval.model import generation
from endo_retrieval.model.families import Family
from endo_retrieval.model.memory import check_fits, safetensors_parameters
from endo_retrieval.model.streaming import Chunk, StreamOptions, stream_chunks
from endo_retrieval.model.threads import cpu_dtype
from endo_retrieval.model.locate import (DEFAULT_MODEL, SUPPORTED_FAMILIES, BackboneError,  # noqa: F401 (public here)
                                         ModelNotFoundError, UnsupportedModelError, check_family, convert_gguf,
                                         family_of_config,
                                         default_gguf, file_sha256, is_hub_id, locate_model, model_source,
                                         quiet_transformers)

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


class Projections(torch.nn.Module):
    """A decoder layer cut down to its input norm and the K and/or Q projections: the deepest layer of a forward
    that wants only those states (`Backbone.run_to`'s hooks capture them), whose attention and MLP would feed
    layers that never run. The hidden states pass through unchanged."""

    def __init__(self, layer: torch.nn.Module, capture: Sequence[str], family: Family):
        super().__init__()
        self.layer, self.capture = layer, tuple(capture)
        self.norm, attention = family.input_norm(layer), family.attention(layer)
        self.projections = [attention.k_proj if kind == "k" else attention.q_proj for kind in self.capture]
        if hasattr(layer, "attention_type"):  # Qwen2/3 and Gemma 3 pick each layer's mask by it
            self.attention_type = layer.attention_type

    def forward(self, hidden_states, *args, **kwargs):
        x = self.norm(hidden_states)
        for projection in self.projections:
            projection(x)
        return hidden_states


class Backbone:
    """A local causal LM with streaming K/Q capture and generation.

    `Backbone()` loads the default model; `Backbone("path/to/hf-folder")`, `Backbone("path/to/model.gguf")` or
    `Backbone("owner/name")` (a Hugging Face hub id) a model of a supported family (SUPPORTED_FAMILIES).
    `Backbone.of(...)` shares one instance per model.
    device: None picks CUDA when available, else CPU. dtype: None picks bfloat16 on CUDA; on a CPU, bfloat16 where it
    has bf16 units and float32 elsewhere (threads.cpu_dtype; ENDO_CPU_DTYPE fixes it). A model that would not fit
    the device's free memory in that dtype fails before loading, with the size it needs (memory.py).
    `spec` is the model's family (families/), `windows` each layer's attention window (None: the whole past) and
    `prefix` the ids every sequence it reads begins with (Gemma's <bos>; none for most families).
    """

    _shared: dict[tuple, "Backbone"] = {}
    _shared_lock = threading.Lock()

    def __init__(self, model: str | os.PathLike | None = None, device: str | None = None, dtype=None):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        quiet_transformers()
        folder, self.model_hash, self.model_id = locate_model(model)
        self.source = model_source(model)
        config = AutoConfig.from_pretrained(folder)
        self._set_device(config, device, dtype)
        check_fits(self.model_id, safetensors_parameters(folder), self.dtype, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=self.dtype).to(self.device).eval()
        self.folder = folder
        self._init_shape_and_lock(config)

    @classmethod
    def random(cls, config, tokenizer_from: str | os.PathLike | None = None, device: str | None = None,
               dtype=None) -> "Backbone":
        """A model of `config`'s shape with random weights, built on the device (benchmarks of large shapes, e.g.
        an 8B Llama at 1M tokens, without its weights). Text goes through the tokenizer of `tokenizer_from`
        (default: the default model's), whose ids must fit the config's vocabulary."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self = cls.__new__(cls)
        self._set_device(config, device, dtype)
        self.tokenizer = cls.default(device).tokenizer if tokenizer_from is None else \
            AutoTokenizer.from_pretrained(locate_model(tokenizer_from)[0])  # a GGUF file: its converted folder
        vocab = config.get_text_config().vocab_size
        if len(self.tokenizer) > vocab:
            raise UnsupportedModelError(f"The tokenizer has {len(self.tokenizer)} ids; the config's vocabulary "
                                        f"holds {vocab}. Raise vocab_size.")
        with torch.device(self.device):
            self.model = AutoModelForCausalLM.from_config(config, dtype=self.dtype).eval()
        self.folder, self.source, self.model_hash = None, None, f"random-{config.model_type}"
        self.model_id = f"random {config.model_type} ({sum(p.numel() for p in self.model.parameters()) / 1e9:.1f}B)"
        self._init_shape_and_lock(config)
        return self

    def _set_device(self, config, device, dtype) -> None:
        self.spec = family_of_config(config.model_type, getattr(config, "_name_or_path", None) or "this model")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else getattr(torch, cpu_dtype()))
        if self.device.type == "cuda":
            # cuDNN's SDPA builds a new plan for every key length, i.e. at every decode step and chunk, which made
            # ReAttention's decoding an order of magnitude slower (docs/papers.md); flash / mem-efficient SDPA remain.
            torch.backends.cuda.enable_cudnn_sdp(False)

    def _init_shape_and_lock(self, config) -> None:
        self.config = config
        text = config.get_text_config()  # a multimodal model's language model
        self.family = self.spec.name
        self.n_layers = text.num_hidden_layers
        self.n_heads = text.num_attention_heads
        self.n_kv_heads = getattr(text, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // self.n_heads
        self.max_position = getattr(text, "max_position_embeddings", None)
        self.windows: tuple[int | None, ...] = tuple(self.spec.windows(text))
        self.prefix: list[int] = list(self.spec.prefix_ids(self.tokenizer))
        self._rope_groups = [self.spec.rope_group(text, l) for l in range(self.n_layers)]
        # held by whoever runs the model (a forward, generation, a reading in segments): one use at a time
        self.lock = threading.RLock()
        self.chunk_graphs = True  # on CUDA, stream() replays repeated chunk shapes from CUDA graphs (chunk_graph.py)
        self._graphs: OrderedDict[tuple, ChunkGraph] = OrderedDict()
        # on CUDA, the batched reads' forwards replay from CUDA graphs over bucketed shapes (parts_graph.py);
        # `parts_graphs.enabled = False` runs them eagerly
        self.parts_graphs = PartsGraphs()
        self._encode_short = functools.lru_cache(maxsize=KEPT_ENCODINGS)(self._encode_whole)

    @classmethod
    def default(cls, device: str | None = None) -> "Backbone":
        """One process-wide instance of the default model, shared by retrievers, compressors and LLM wrappers."""
        return cls.of(None, device)

    @classmethod
    def of(cls, model=None, device: str | None = None) -> "Backbone":
        """The backbone a caller means by `model`: a loaded backbone as it is; None the default model; a folder,
        GGUF path or hub id loaded once per process, so adapters and methods given the same model share one copy."""
        if model is not None and not isinstance(model, (str, os.PathLike)):
            return model
        name = model_source(model)
        with cls._shared_lock:
            if (name, device) not in cls._shared:
                cls._shared[name, device] = cls(name, device=device)
            return cls._shared[name, device]

    # ---- text -------------------------------------------------------------------------------------------
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

    # ---- the model's layers, as its family lays them out ------------------------------------------------
    @property
    def decoder(self) -> torch.nn.Module:
        """The decoder stack under the LM head (`spec.decoder`): what the streaming and reading forwards run."""
        return self.spec.decoder(self.model)

    @property
    def layers(self) -> torch.nn.ModuleList:
        """The decoder layers (`spec.layers`)."""
        return self.spec.layers(self.model)

    def attention_module(self, layer: int) -> torch.nn.Module:
        """Layer `layer`'s attention module (q_proj, k_proj, v_proj, o_proj, scaling)."""
        return self.spec.attention(self.layers[layer])

    def layers_seeing(self, n_tokens: int) -> list[int]:
        """The layers whose queries see all of a read of `n_tokens` (no window, or one at least that long)."""
        return [l for l, w in enumerate(self.windows) if w is None or w >= n_tokens]

    def window_binds(self, n_keys: int) -> bool:
        """Whether a query that could see `n_keys` keys sees fewer at some layer, its window being shorter."""
        return any(w is not None and w < n_keys for w in self.windows)

    def window_masks(self, query_positions: torch.Tensor, key_positions: torch.Tensor, visible: torch.Tensor):
        """The decoder's `attention_mask` when some layer's window binds: each layer's is `visible` (bool,
        (..., queries, keys)) and, in a windowed layer, keys fewer than its window positions behind the query
        (`query_positions` (..., queries), `key_positions` (..., keys): the tokens' places in the stream). Handed
        to the model as its family takes per-layer masks (`spec.mask_argument`)."""
        behind = query_positions[..., :, None] - key_positions[..., None, :]
        visible = visible.expand(torch.broadcast_shapes(visible.shape, behind.shape))

        def mask_for(window):
            return visible if window is None else visible & (behind < window)

        return self.spec.mask_argument(self.config.get_text_config(), mask_for)

    # ---- streaming prefill with early exit and capture ---------------------------------------------------
    def check_layers(self, layers: Sequence[int]) -> list[int]:
        layers = sorted({int(l) for l in layers})
        if not layers:
            raise BackboneError("Ask for at least one layer.")
        bad = [l for l in layers if not 0 <= l < self.n_layers]
        if bad:
            raise BackboneError(f"Layer index {bad[0]} is out of range: this model has layers 0..{self.n_layers - 1}.")
        return layers

    def _int8_layers(self, last_layer: int) -> list[torch.nn.Module]:
        """Decoder layers 0..last_layer (at least) with dynamically int8-quantized linear maps (weights 4x smaller
        than fp32): a CPU forward of a short text reads every weight once per token batch, so it runs ~2x faster.
        Each layer is quantized once, and only as deep as a forward asks (questions stop at the deepest SAE layer)."""
        if self.dtype != torch.float32:
            raise BackboneError(f"int8 layers quantize fp32 linear maps; this backbone is {self.dtype} (already "
                                "faster on its CPU): leave int8 off, or load it with dtype=torch.float32.")
        done = getattr(self, "_q8_layers", [])
        if len(done) <= last_layer:
            import copy
            import warnings

            more = torch.nn.ModuleList(self.layers[len(done): last_layer + 1])
            with warnings.catch_warnings():  # torch.ao's dynamic quantization warns that it moves to torchao
                warnings.simplefilter("ignore")
                more = torch.ao.quantization.quantize_dynamic(copy.deepcopy(more), {torch.nn.Linear}, dtype=torch.qint8)
            self._q8_layers = done + list(more)
        return self._q8_layers

    def _compiled_layers(self, last_layer: int, captured: Sequence[int]) -> list[torch.nn.Module]:
        """Decoder layers 0..last_layer, each through torch.compile except the `captured` ones (their K/Q hooks
        stay outside the compiled code): the compiled layers fuse the norms, RoPE and the MLP's gate into a few
        kernels, where eager runs a dozen elementwise passes per layer (a quarter of an 8B forward's time at 16k
        tokens a batch; docs/ilre.md). Compiled once per layer and process; they share the model's weights."""
        twins = self.__dict__.setdefault("_compiled", {})
        full = self.layers
        for l in range(last_layer + 1):
            if l not in twins and l not in captured:
                twins[l] = torch.compile(full[l])
        return [full[l] if l in captured else twins[l] for l in range(last_layer + 1)]

    @contextlib.contextmanager
    def run_to(self, last_layer: int, layers: Sequence[int], capture: Sequence[str], int8: bool = False,
               compiled: bool = False, projections_only: bool = False):
        """Truncate the decoder to layers 0..last_layer (early exit) and hook the K/Q projections of `layers`,
        yielding {"k"|"q": {layer: pre-RoPE states (batch, heads, T, head_dim)}} that fills as the model runs;
        int8: run the int8-quantized copy of the layers instead; compiled: the layers not hooked run through
        torch.compile; projections_only: of the last layer only its input norm and the captured projections run
        (its attention and MLP would feed layers that never run; for forwards that want only the states, not a
        cache). Public for readers that drive the model themselves (reading a context in segments with its
        cache, `model.reading.read`); hold `lock` around it."""
        store: dict[str, dict[int, torch.Tensor]] = {"k": {}, "q": {}}
        full = self.layers
        run = self._int8_layers(last_layer) if int8 else \
            self._compiled_layers(last_layer, layers) if compiled else full
        hooks = []
        for l in layers:
            attn = self.spec.attention(run[l])
            q_norm, k_norm = self.spec.qk_norms(attn)
            for kind in capture:
                proj, norm = (attn.k_proj, k_norm) if kind == "k" else (attn.q_proj, q_norm)

                def hook(_m, _i, out, l=l, kind=kind, norm=norm):
                    x = out.unflatten(-1, (-1, self.head_dim))  # (B, T, heads, d)
                    if norm is not None:  # Qwen3 and Gemma 3 normalise q/k per head before RoPE
                        x = norm(x)
                    store[kind][l] = x.transpose(1, 2).float()

                hooks.append(proj.register_forward_hook(hook))
        run = list(run)[: last_layer + 1]
        if projections_only:
            run[-1] = Projections(run[-1], capture, self.spec)
        self.spec.set_layers(self.model, torch.nn.ModuleList(run))
        try:
            yield store
        finally:
            self.spec.set_layers(self.model, full)
            for h in hooks:
                h.remove()

    def stream(self, ids, layers: Sequence[int], *, chunk_size: int = 1024, mode: str = "independent",
               sink: int = 4, window: int = 512, capture: Sequence[str] = ("k",),
               split_at: int | None = None, positions: str = "frame", int8: bool = False, start: int = 0,
               batch_tokens: int | None = None, frames: str = "recompute", compiled: bool = False
               ) -> Iterator[Chunk]:
        """Forward `ids` chunk by chunk up to max(layers) only, yielding each chunk's pre-RoPE states.

        mode="independent": every chunk alone at positions 0..T-1 (S3-Attention appendix I).
        mode="sink_window": every chunk attends to the first `sink` tokens and the last `window` tokens before it
        (ILRe section 3.3, the Lambda-shaped mask); they are recomputed with the chunk rather than cached, so
        memory stays bounded by sink + window + chunk. Their RoPE positions (sink_window only):
          "frame"    sink, window and chunk at 0..S+W+T-1: every distance stays inside the trained window;
          "absolute" every token at its own index (ILRe without DCA);
          "dca"      absolute, but from the third chunk on the sink moves up by (i-2) chunk sizes [ILRe Eq. 6].
        `ids`: the token ids, or an iterator over consecutive pieces of them, read as they arrive (`ArrivingIds`:
        tokenising overlaps the forwards).
        `split_at`: no chunk crosses this position (e.g. context | query part); a negative one counts from the end.
        `start`: chunks that begin before it are not run (a worker's share of one stream: a sink_window chunk
        needs only its frame, which it recomputes).
        `int8`: forward through int8-quantized linear maps (CPU only; see `query_states`).
        `batch_tokens` (sink_window): consecutive chunks of one length are forwarded together, as a batch of at
        most this many tokens (a small model is bound by launches, not arithmetic, at one chunk per forward);
        None: BATCH_TOKENS on CUDA, one chunk per forward elsewhere (a CPU gains nothing); 0: one chunk per forward.
        `frames` (sink_window): "recompute" forwards each chunk behind its frame; "cache" keeps the frame's keys and
        values per layer, as ILRe section 3.4 does (frame_cache.py): 1/1.5 of the tokens at 1024-token chunks.
        `compiled`: the layers that are not captured run through torch.compile (`_compiled_layers`; the first
        forward of each shape compiles, about 20 s for an 8B model; no CUDA graphs then): for a large model on a
        GPU, where eager elementwise passes cost a quarter of the time.
        """
        yield from stream_chunks(self, ids, layers, StreamOptions(chunk_size, mode, sink, window, capture, split_at,
                                                                  positions, int8, start, batch_tokens, frames,
                                                                  compiled))

    @staticmethod
    def _graph_key(shape: tuple[int, int], layers: list[int], capture: Sequence[str]) -> tuple:
        return shape, tuple(layers), tuple(sorted(capture))

    def has_chunk_graph(self, shape: tuple[int, int], layers: list[int], capture: Sequence[str]) -> bool:
        """Whether a forward of this shape was captured as a CUDA graph (chunk_graph.py) and is kept."""
        return self._graph_key(shape, layers, capture) in self._graphs

    def chunk_graph(self, shape: tuple[int, int], layers: list[int], capture: Sequence[str]) -> ChunkGraph:
        """The CUDA graph of a forward of this shape, captured on first use (hold `lock`); the least recently used
        of more than KEEP is dropped."""
        key = self._graph_key(shape, layers, capture)
        if key not in self._graphs:
            if len(self._graphs) >= KEEP:
                self._graphs.popitem(last=False)
            self._graphs[key] = ChunkGraph(self, shape, layers, key[2])
        self._graphs.move_to_end(key)
        return self._graphs[key]

    def query_states(self, ids_or_text, layers: Sequence[int], int8: bool = False) -> dict[int, torch.Tensor]:
        """Pre-RoPE query states of a text forwarded alone: layer -> (n_heads, T, head_dim).
        int8 (CPU only): through dynamically int8-quantized linear maps, ~2x faster for a short question."""
        if int8 and self.device.type != "cpu":
            raise BackboneError("int8 question forwards run on the CPU only; on a GPU the bf16 forward is faster")
        ids = self.encode(ids_or_text).ids if isinstance(ids_or_text, (str, bytes)) else ids_or_text
        out: dict[int, torch.Tensor] = {}
        for ch in self.stream(ids, layers, chunk_size=max(1, len(ids)), capture=("q",), int8=int8):
            out.update(ch.queries)
        return out

    def apply_rope(self, x: torch.Tensor, positions: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """Rotate x (..., T, head_dim) by the model's own rotary embedding at `positions` (T,), the one layer
        `layer` rotates by (None: the full-attention layers'; they differ where the family gives sliding layers a
        rotary embedding of their own, as Gemma 3 does)."""
        pos = torch.as_tensor(positions, device=x.device).view(1, -1)
        rotary, _ = self.spec.rotary(self.model, layer)
        # the rotary module reads only its input's dtype and device: an empty tensor says both without a copy of x
        cos, sin = rotary(torch.empty(0, dtype=self.dtype, device=x.device), pos)
        cos, sin = cos[0].to(x.dtype), sin[0].to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def apply_rope_layers(self, x: torch.Tensor, layers: Sequence[int], positions: torch.Tensor) -> torch.Tensor:
        """`apply_rope` of x (len(layers), ..., T, head_dim), row i rotated as layer layers[i] rotates: one call
        where all of them rotate alike, one per group of layers that do otherwise."""
        groups: dict[str, list[int]] = {}
        for i, l in enumerate(layers):
            groups.setdefault(self._rope_groups[l], []).append(i)
        if len(groups) == 1:
            return self.apply_rope(x, positions, layers[0])
        out = torch.empty_like(x)
        for rows in groups.values():
            index = torch.tensor(rows, device=x.device)
            out[index] = self.apply_rope(x[index], positions, layers[rows[0]])
        return out

    # ---- generation (generation.py) ----------------------------------------------------------------------
    def chat_ids(self, prompt_or_messages, system: str | None = None) -> torch.Tensor:
        return generation.chat_ids(self, prompt_or_messages, system)

    def generate(self, prompt_or_messages, max_new_tokens: int = 64, stream: bool = False,
                 system: str | None = None, do_sample: bool = False, attention=None, **gen_kwargs):
        """Chat-template generation, greedy by default. stream=True returns an iterator of text pieces. On CUDA,
        plain greedy generation (no stream, no extra options) replays CUDA-graph steps over a static cache
        (`decode.py`: 3-4x faster; bf16 near-ties may pick other tokens than `model.generate`).

        attention: None (Hugging Face's own attention) or a decode-time backend object, e.g. `ReAttention(top_k=8)`
        or `get_backend("reattention")` (endo_retrieval.attention); backends decode greedily. The backbone does not
        know the backends: it hands the prompt to the object's own `generate`."""
        return generation.generate(self, prompt_or_messages, max_new_tokens, stream, system, do_sample, attention,
                                   **gen_kwargs)

    def generate_many(self, prompts: list[str], max_new_tokens: int = 48, batch: int = 32) -> list[str]:
        """Greedy answers to many chat prompts, in batches (left-padded): for work that asks the model many short
        things at once, as `endo prepare --questions-by model` does."""
        return generation.generate_many(self, prompts, max_new_tokens, batch)

    def eos_ids(self) -> set[int]:
        """The ids that end generation: the model's generation config, else the tokenizer's end-of-sequence."""
        return generation.eos_ids(self)

    def info(self) -> dict:
        windows = None if all(w is None for w in self.windows) else list(self.windows)
        return {"model": self.model_id, "model_hash": self.model_hash, "family": self.family,
                "layers": self.n_layers, "heads": self.n_heads, "kv_heads": self.n_kv_heads, "windows": windows,
                "head_dim": self.head_dim, "max_position": self.max_position,
                "device": self.device.type, "dtype": str(self.dtype).removeprefix("torch."),
                "cache_dir": str(cache_dir())}
