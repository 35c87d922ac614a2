"""The local language model, driven the way the papers need it; `Backbone` is the one face of its parts, each
kept by the module of its concern:

- loading: a causal LM of a registered family (families/: one module per family says where its layers, norms,
  windows and rotary embeddings are) from a local Hugging Face folder or GGUF file, a Hugging Face hub id, or by
  default SmolLM2-135M-Instruct (finding and converting it: locate.py; onto its device: loading.py), once it is known
  to fit (memory.py);
- tokenising long texts in pieces, on several cores (`tokens`: tokens.py);
- reading: the layers, windows, masks and rotary embeddings (`layout`: layout.py), the truncated and hooked forward
  (`capture`: capture.py), streaming chunked prefill with early exit (streaming.py) and its CUDA graphs
  (`chunk_graphs`, `parts_graphs`);
- chat-template generation, greedy by default, optionally streamed token by token (`chat`: chat.py, generation.py).
"""
from __future__ import annotations

import os
import threading
from typing import Iterator, Sequence

import torch

from endo_retrieval.files import cache_dir
from endo_retrieval.model.capture import Capture, Projections  # noqa: F401 (public here)
from endo_retrieval.model.chat import Chat
from endo_retrieval.model.chunk_graph import ChunkGraphs
from endo_retrieval.model.layout import Layout
from endo_retrieval.model.loading import Placement, build_random, load_folder, tokenizer_of
from endo_retrieval.model.parts_graph import PartsGraphs
from endo_retrieval.model.streaming import Chunk, StreamOptions, stream_chunks
from endo_retrieval.model.tokens import (KEPT_ENCODINGS, PIECE_CHARS, PIECES_PER_BATCH, SHORT_TEXT,  # noqa: F401
                                         Encoding, Tokens, as_text)
from endo_retrieval.model.locate import (DEFAULT_MODEL, SUPPORTED_FAMILIES, BackboneError,  # noqa: F401 (public here)
                                         ModelNotFoundError, UnsupportedModelError, check_family, convert_gguf,
                                         family_of_config,
                                         default_gguf, file_sha256, is_hub_id, locate_model, model_source,
                                         quiet_transformers)


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
    Its parts: `tokens`, `layout` (its `layers` and `decoder` are here too), `capture`, `chat`, `chunk_graphs`
    and `parts_graphs`.
    """

    _shared: dict[tuple, "Backbone"] = {}
    _shared_lock = threading.Lock()

    def __init__(self, model: str | os.PathLike | None = None, device: str | None = None, dtype=None):
        folder, self.model_hash, self.model_id = locate_model(model)
        self.source = model_source(model)
        config, placed, tokenizer, self.model = load_folder(folder, self.model_id, device, dtype)
        self.folder = folder
        self._assemble(config, placed, tokenizer)

    @classmethod
    def random(cls, config, tokenizer_from: str | os.PathLike | None = None, device: str | None = None,
               dtype=None) -> "Backbone":
        """A model of `config`'s shape with random weights, built on the device (benchmarks of large shapes, e.g.
        an 8B Llama at 1M tokens, without its weights). Text goes through the tokenizer of `tokenizer_from`
        (default: the default model's), whose ids must fit the config's vocabulary."""
        self = cls.__new__(cls)
        tokenizer = cls.default(device).tokenizer if tokenizer_from is None else \
            tokenizer_of(locate_model(tokenizer_from)[0])  # a GGUF file: its converted folder
        placed, self.model = build_random(config, tokenizer, device, dtype)
        self.folder, self.source, self.model_hash = None, None, f"random-{config.model_type}"
        self.model_id = f"random {config.model_type} ({sum(p.numel() for p in self.model.parameters()) / 1e9:.1f}B)"
        self._assemble(config, placed, tokenizer)
        return self

    def _assemble(self, config, placed: Placement, tokenizer) -> None:
        """The shape the config gives and the parts over the loaded model and tokenizer."""
        self.config, self.spec, self.device, self.dtype = config, placed.spec, placed.device, placed.dtype
        self.family, self.tokenizer = self.spec.name, tokenizer
        text = config.get_text_config()  # a multimodal model's language model
        self.n_layers = text.num_hidden_layers
        self.n_heads = text.num_attention_heads
        self.n_kv_heads = getattr(text, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // self.n_heads
        self.max_position = getattr(text, "max_position_embeddings", None)
        self.prefix: list[int] = list(self.spec.prefix_ids(tokenizer))
        self.tokens = Tokens(tokenizer)
        self.layout = Layout(self.spec, self.model, config, self.dtype)
        self.layers, self.decoder, self.windows = self.layout.layers, self.layout.decoder, self.layout.windows
        self.capture = Capture(self.spec, self.model, self.head_dim, self.dtype)
        self.chat = Chat(self)
        # held by whoever runs the model (a forward, generation, a reading in segments): one use at a time
        self.lock = threading.RLock()
        # on CUDA, stream() replays repeated chunk shapes from CUDA graphs (chunk_graph.py) and the batched reads'
        # forwards replay from CUDA graphs over bucketed shapes (parts_graph.py); `.enabled = False` runs them eagerly
        self.chunk_graphs = ChunkGraphs(self)
        self.parts_graphs = PartsGraphs()

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

    # ---- text (tokens.py) -------------------------------------------------------------------------------------
    def encode(self, text: str | bytes, piece_chars: int | None = None) -> Encoding:
        """Token ids and character offsets of `text` (no special tokens), all pieces tokenised in one batch. A short
        text's encoding is kept and shared: its arrays are read-only."""
        return self.tokens.encode(text, piece_chars)

    def encode_pieces(self, text: str | bytes, piece_chars: int | None = None, batch: int | None = None
                      ) -> Iterator[tuple[int, int, Encoding]]:
        """(first char, end char, encoding) of consecutive pieces of `text`, each yielded once final
        (`Tokens.encode_pieces`)."""
        return self.tokens.encode_pieces(text, piece_chars, batch)

    def count_tokens(self, text: str) -> int:
        return self.tokens.count_tokens(text)

    def decode(self, ids) -> str:
        return self.tokens.decode(ids)

    # ---- reading ----------------------------------------------------------------------------------------------
    def run_to(self, last_layer: int, layers: Sequence[int], capture: Sequence[str], int8: bool = False,
               compiled: bool = False, projections_only: bool = False):
        """Truncate the decoder to layers 0..last_layer (early exit) and hook the K/Q projections of `layers`,
        yielding {"k"|"q": {layer: pre-RoPE states (batch, heads, T, head_dim)}} that fills as the model runs;
        int8: run the int8-quantized copy of the layers instead; compiled: the layers not hooked run through
        torch.compile; projections_only: of the last layer only its input norm and the captured projections run
        (its attention and MLP would feed layers that never run; for forwards that want only the states, not a
        cache). Public for readers that drive the model themselves (reading a context in segments with its
        cache, `model.reading.read`); hold `lock` around it."""
        return self.capture.run_to(last_layer, layers, capture, int8, compiled, projections_only)

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
        `compiled`: the layers that are not captured run through torch.compile (`Capture.compiled_layers`; the
        first forward of each shape compiles, about 20 s for an 8B model; no CUDA graphs then): for a large model on a
        GPU, where eager elementwise passes cost a quarter of the time.
        """
        yield from stream_chunks(self, ids, layers, StreamOptions(chunk_size, mode, sink, window, capture, split_at,
                                                                  positions, int8, start, batch_tokens, frames,
                                                                  compiled))


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
        `layer` rotates by [ILRe Eq. 1, 3] (`Layout.apply_rope`)."""
        return self.layout.apply_rope(x, positions, layer)

    # ---- generation (chat.py, generation.py) ------------------------------------------------------------------
    def chat_ids(self, prompt_or_messages, system: str | None = None) -> torch.Tensor:
        return self.chat.ids(prompt_or_messages, system)

    def generate(self, prompt_or_messages, max_new_tokens: int = 64, stream: bool = False,
                 system: str | None = None, do_sample: bool = False, attention=None, **gen_kwargs):
        """Chat-template generation, greedy by default. stream=True returns an iterator of text pieces. On CUDA,
        plain greedy generation (no stream, no extra options) replays CUDA-graph steps over a static cache
        (`decode.py`: 3-4x faster; bf16 near-ties may pick other tokens than `model.generate`).

        attention: None (Hugging Face's own attention) or a decode-time backend object, e.g. `ReAttention(top_k=8)`
        or `get_backend("reattention")` (endo_retrieval.attention); backends decode greedily. The backbone does not
        know the backends: it hands the prompt to the object's own `generate`."""
        return self.chat.generate(prompt_or_messages, max_new_tokens, stream, system, do_sample, attention,
                                  **gen_kwargs)

    def eos_ids(self) -> set[int]:
        """The ids that end generation: the model's generation config, else the tokenizer's end-of-sequence."""
        return self.chat.eos_ids()

    def info(self) -> dict:
        windows = None if all(w is None for w in self.windows) else list(self.windows)
        return {"model": self.model_id, "model_hash": self.model_hash, "family": self.family,
                "layers": self.n_layers, "heads": self.n_heads, "kv_heads": self.n_kv_heads, "windows": windows,
                "head_dim": self.head_dim, "max_position": self.max_position,
                "device": self.device.type, "dtype": str(self.dtype).removeprefix("torch."),
                "cache_dir": str(cache_dir())}
