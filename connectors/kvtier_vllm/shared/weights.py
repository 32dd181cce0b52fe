"""Which weights computed a chunk: a fingerprint of the checkpoint the engine loaded.

A chunk's namespace names the weights behind it, not the model's name. vLLM's
``--revision`` is only a name, often a branch, and a local path says nothing about what was
written there last, so without an explicit ``model_revision`` the connector reads the checkpoint
itself. It takes, per file, the name, the size and a fixed sample of the bytes; reads are bounded
per file, so this stays cheap for checkpoints of hundreds of GiB:

- config files (``config.json``, Mistral's ``params.json``, quantisation configs, safetensors and
  bin index files), hashed whole, as canonical JSON;
- every weight file (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``): files up to
  1 MiB whole; larger ones by their first and last 64 KiB and 16 evenly spaced 4 KiB windows,
  plus the whole safetensors header and 256 bytes from the middle of each tensor (at most 4096
  tensors per checkpoint, and at least 64 per file), or, for torch zip archives, each record's
  name, size and CRC-32 from the central directory;
- with ``trust_remote_code``, the model code beside them (``*.py``);
- what else decides the weights' values in vLLM: the quantisation method and config (the HF
  config's and vLLM's own), the model dtype, the load format, ``hf_overrides`` and model class
  overrides.

Left out: the tokenizer (a chunk's KV depends on token ids, which the block hash carries),
``generation_config.json`` (sampling defaults change no KV), and where the files are (the same
bytes in another directory or cache are the same weights). It is a sample, not a hash: a rewrite
that keeps every size and header and changes no sampled byte goes unseen (a fine-tune changes
every tensor it trains); name such weights with ``model_revision``. A checkpoint kvtier cannot
find or read (object storage, dummy or tensorizer weights) gets no fingerprint, and kvtier
refuses to cache that engine unless ``model_revision`` names its weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import struct
import threading
import time
import zipfile
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NoReturn

from kvtier_vllm.shared.shapes import UnsupportedGroupError

log = logging.getLogger(__name__)

PREFIX = "fp-"
DIGEST_HEX = 16
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CONFIG_FILES = (
    "config.json",
    "params.json",
    "quantize_config.json",
    "quant_config.json",
    "quantization_config.json",
    "hf_quant_config.json",
)
INDEX_SUFFIX = ".index.json"
# metadata transformers writes that never changes a value
_UNUSED_CONFIG_KEYS = ("_name_or_path", "transformers_version")
# load formats whose weights are the checkpoint's files; the others (dummy, tensorizer,
# object-storage streamers, IPC caches, plugins) load weights kvtier cannot read
FILE_LOAD_FORMATS = frozenset(
    {
        "auto",
        "hf",
        "pt",
        "safetensors",
        "fastsafetensors",
        "instanttensor",
        "npcache",
        "mistral",
        "sharded_state",
        "bitsandbytes",
        "gguf",
    }
)

WHOLE_FILE_BYTES = 1 << 20
EDGE_BYTES = 64 << 10
WINDOW_BYTES = 4 << 10
WINDOWS = 16
TENSOR_WINDOW_BYTES = 256
TENSOR_BUDGET = 4096
MIN_TENSORS_PER_FILE = 64
_SAFETENSORS_HEADER_MAX = 100 << 20  # the format's own bound
_READERS = 8  # files read at once: network filesystems answer many small reads slowly


class WeightsUnknownError(Exception):
    """No checkpoint to fingerprint: not found, not readable, or not loaded from files."""


@dataclasses.dataclass(frozen=True, slots=True)
class Checkpoint:
    root: Path
    configs: tuple[Path, ...]
    weights: tuple[Path, ...]


# -- finding the checkpoint -------------------------------------------------------------------


def locate(model: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    """The directory (or GGUF file) of ``model``: a local path, else its Hugging Face cache
    snapshot at ``revision``, looked up without the network."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    from huggingface_hub import snapshot_download

    try:
        found = snapshot_download(
            model, revision=revision, cache_dir=download_dir, local_files_only=True
        )
    except (OSError, ValueError) as exc:  # not cached, or not a repo id
        raise WeightsUnknownError(
            f"{model!r} is neither a local path nor in the Hugging Face cache "
            f"(revision {revision or 'main'}): {exc}"
        ) from exc
    return Path(str(found))


def checkpoint_files(path: Path, *, code: bool = False) -> Checkpoint:
    """The files of the checkpoint at ``path`` that decide its weights: those vLLM loads from
    (its top level), and, with ``code``, the model code shipped beside them."""
    if path.is_file():
        return Checkpoint(path.parent, (), (path,))
    try:
        entries = sorted(p for p in path.iterdir() if p.is_file())
    except OSError as exc:
        raise WeightsUnknownError(f"cannot list the checkpoint at {path}: {exc}") from exc
    configs = [
        p
        for p in entries
        if p.name in CONFIG_FILES or p.name.endswith(INDEX_SUFFIX) or (code and p.suffix == ".py")
    ]
    weights = [p for p in entries if p.suffix in WEIGHT_SUFFIXES]
    if not weights:
        raise WeightsUnknownError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {path}")
    return Checkpoint(path, tuple(configs), tuple(weights))


# -- what else decides the values -----------------------------------------------------------


def plain_json(value: Any) -> Any:
    """``value`` as JSON types, the same in every process (no object addresses)."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): plain_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = [plain_json(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, set | frozenset) else items
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain_json(dataclasses.asdict(value))
    for method in ("to_dict", "model_dump"):
        if callable(getattr(value, method, None)):
            return plain_json(getattr(value, method)())
    if callable(value):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
    return str(value) if " at 0x" not in repr(value) else type(value).__qualname__


def settings_of(model_config: Any, load_config: Any) -> dict[str, Any]:
    """What besides the files decides the weights' values as vLLM runs them."""
    hf_config = getattr(model_config, "hf_config", None)
    return {
        "quantization": getattr(model_config, "quantization", None),
        "quantization_config": plain_json(getattr(model_config, "quantization_config", None)),
        "hf_quantization_config": plain_json(getattr(hf_config, "quantization_config", None)),
        "dtype": str(getattr(model_config, "dtype", "")),
        "load_format": str(getattr(load_config, "load_format", "auto")),
        "hf_overrides": plain_json(getattr(model_config, "hf_overrides", None)),
        "model_class_overrides": plain_json(getattr(model_config, "model_class_overrides", None)),
    }


# -- reading ----------------------------------------------------------------------------------


def read_exact(fd: int, offset: int, length: int) -> bytes:
    out = bytearray()
    while len(out) < length:
        got = os.pread(fd, length - len(out), offset + len(out))
        if not got:
            raise WeightsUnknownError("a weight file shrank while it was read")
        out += got
    return bytes(out)


def _windows(size: int) -> list[tuple[int, int]]:
    """(offset, length) of the fixed sample of a file of ``size`` bytes."""
    if size <= WHOLE_FILE_BYTES:
        return [(0, size)]
    spots = [(0, EDGE_BYTES), (size - EDGE_BYTES, EDGE_BYTES)]
    span = size - WINDOW_BYTES
    spots += [(span * (i + 1) // (WINDOWS + 1), WINDOW_BYTES) for i in range(WINDOWS)]
    return spots


def _pick(regions: list[tuple[int, int]], most: int) -> list[tuple[int, int]]:
    """At most ``most`` regions, evenly spaced in file order."""
    regions = sorted(regions)
    if len(regions) <= most:
        return regions
    return [regions[i * len(regions) // most] for i in range(most)]


def _middle(start: int, length: int) -> tuple[int, int]:
    width = min(length, TENSOR_WINDOW_BYTES)
    return start + (length - width) // 2, width


def _safetensors_parts(fd: int, size: int) -> tuple[bytes, list[tuple[int, int]]] | None:
    """The header and every tensor's (offset, length), or None if not a safetensors file."""
    if size < 8:
        return None
    (length,) = struct.unpack("<Q", read_exact(fd, 0, 8))
    if not 2 <= length <= min(_SAFETENSORS_HEADER_MAX, size - 8):
        return None
    header = read_exact(fd, 8, length)
    try:
        entries = json.loads(header)
    except ValueError:
        return None
    base = 8 + length
    regions = []
    for name, entry in entries.items() if isinstance(entries, dict) else ():
        if name == "__metadata__" or not isinstance(entry, dict):
            continue
        begin, end = entry.get("data_offsets", (0, 0))
        if 0 <= begin < end and base + end <= size:
            regions.append((base + int(begin), int(end) - int(begin)))
    return header, regions


def _zip_records(path: Path) -> tuple[bytes, list[tuple[int, int]]] | None:
    """A torch zip archive's records: their names, sizes and CRC-32s (a checksum of every
    record, from the central directory), and their (offset, length)."""
    try:
        if not zipfile.is_zipfile(path):
            return None
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
    except (OSError, zipfile.BadZipFile):
        return None
    listing = ";".join(f"{i.filename}:{i.file_size}:{i.CRC:08x}" for i in infos).encode()
    return listing, [(i.header_offset, i.compress_size) for i in infos if i.compress_size]


def _file_digest(path: Path, tensors_most: int) -> tuple[bytes, int]:
    """The digest of one weight file's sample, and the bytes read."""
    digest = hashlib.blake2b(digest_size=32)
    read = 0
    with open(path, "rb", buffering=0) as file:
        fd = file.fileno()
        size = os.fstat(fd).st_size
        digest.update(struct.pack("<Q", size))
        spots = _windows(size)
        if size > WHOLE_FILE_BYTES:
            parts = _safetensors_parts(fd, size)
            if parts is None and path.suffix in (".bin", ".pt", ".pth"):
                parts = _zip_records(path)
            if parts is not None:
                listing, regions = parts
                digest.update(struct.pack("<Q", len(listing)) + listing)
                read += len(listing)
                spots += [_middle(*r) for r in _pick(regions, tensors_most)]
        for offset, length in spots:
            digest.update(struct.pack("<QQ", offset, length))
            digest.update(read_exact(fd, offset, length))
            read += length
    return digest.digest(), read


def _config_bytes(path: Path) -> bytes:
    raw = path.read_bytes()
    if path.suffix != ".json":
        return raw
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    if isinstance(value, dict):
        for key in _UNUSED_CONFIG_KEYS:
            value.pop(key, None)
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def fingerprint(checkpoint: Checkpoint, settings: Mapping[str, Any] | None = None) -> str:
    """``fp-`` and 16 hex digits of the checkpoint's sample and ``settings``."""
    return _fingerprint(checkpoint, settings or {})[0]


def _fingerprint(checkpoint: Checkpoint, settings: Mapping[str, Any]) -> tuple[str, int]:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(b"kvtier-weights-1;")
    digest.update(json.dumps(plain_json(settings), sort_keys=True).encode() + b";")
    read = 0
    try:
        for path in checkpoint.configs:
            body = _config_bytes(path)
            digest.update(f"config:{path.name}:{len(body)};".encode() + body)
            read += len(body)
        most = max(MIN_TENSORS_PER_FILE, TENSOR_BUDGET // len(checkpoint.weights))
        with ThreadPoolExecutor(min(_READERS, len(checkpoint.weights))) as pool:
            sampled = list(pool.map(lambda p: _file_digest(p, most), checkpoint.weights))
    except OSError as exc:
        raise WeightsUnknownError(
            f"cannot read the checkpoint at {checkpoint.root}: {exc}"
        ) from exc
    for path, (file_digest, file_read) in zip(checkpoint.weights, sampled, strict=True):
        digest.update(f"weights:{path.name};".encode() + file_digest)
        read += file_read
    return PREFIX + digest.hexdigest()[:DIGEST_HEX], read


# -- once per process -------------------------------------------------------------------------

_lock = threading.Lock()
_known: dict[tuple[Any, ...], str] = {}


def _state(checkpoint: Checkpoint) -> tuple[tuple[str, int, int, int, int], ...]:
    """What changes when a file is rewritten (ctime, whatever the writer did to mtime)."""
    out = []
    for path in (*checkpoint.configs, *checkpoint.weights):
        st = path.stat()
        out.append((str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
    return tuple(out)


def weights_fingerprint(model_config: Any, load_config: Any) -> str:
    """The fingerprint of the weights ``model_config`` loaded; taken once per process for each
    state of the files (the scheduler and every worker read the same files, so they agree, and
    a checkpoint rewritten under a running process is read again by the next engine)."""
    load_format = str(getattr(load_config, "load_format", "auto"))
    if load_format not in FILE_LOAD_FORMATS:
        raise WeightsUnknownError(f"load_format={load_format} does not load the checkpoint's files")
    model = str(model_config.model)
    pulled = str(getattr(model_config, "model_weights", "") or "")
    if pulled and pulled != model:
        raise WeightsUnknownError(f"the weights are streamed from {pulled}")
    path = locate(model, model_config.revision, getattr(load_config, "download_dir", None))
    checkpoint = checkpoint_files(path, code=bool(getattr(model_config, "trust_remote_code", 0)))
    settings = settings_of(model_config, load_config)
    try:
        key = (json.dumps(plain_json(settings), sort_keys=True), _state(checkpoint))
    except OSError as exc:
        raise WeightsUnknownError(f"cannot read the checkpoint at {path}: {exc}") from exc
    with _lock:
        found = _known.get(key)
        if found is not None:
            return found
        start = time.perf_counter()
        found, read = _fingerprint(checkpoint, settings)
        _known[key] = found
    log.info(
        "kvtier: weights of %s are %s (%d files, %.1f MiB read in %.2f s)",
        model,
        found,
        len(checkpoint.configs) + len(checkpoint.weights),
        read / (1 << 20),
        time.perf_counter() - start,
    )
    return found


# -- the namespaces' revisions ----------------------------------------------------------------


def _refuse(model_config: Any, exc: Exception) -> NoReturn:
    raise UnsupportedGroupError(
        f"kvtier cannot fingerprint the weights of {model_config.model} ({exc}); chunks are "
        "named after the weights that computed them, so set kv_connector_extra_config."
        "model_revision to a name that changes whenever the weights do"
    ) from exc


def target_revision(vllm_config: Any, explicit: str = "") -> str:
    """The target pool's revision: ``model_revision`` when set (the operator's word), else the
    fingerprint of the checkpoint loaded; raises `shapes.UnsupportedGroupError` when there is
    neither."""
    if explicit:
        return explicit
    model = vllm_config.model_config
    try:
        return weights_fingerprint(model, vllm_config.load_config)
    except WeightsUnknownError as exc:
        _refuse(model, exc)


def draft_revision(vllm_config: Any, draft_config: Any, explicit: str = "") -> str:
    """The draft pool's revision: the fingerprint of the draft checkpoint, so that two drafts of
    one name never share KV. With ``model_revision`` set, which names the whole deployment's
    weights, a draft kvtier cannot read keeps vLLM's name for it."""
    spec = vllm_config.speculative_config
    load = getattr(spec, "draft_load_config", None) or vllm_config.load_config
    try:
        return weights_fingerprint(draft_config, load)
    except WeightsUnknownError as exc:
        if explicit:
            return str(draft_config.revision or "none")
        _refuse(draft_config, exc)


# -- LoRA -------------------------------------------------------------------------------------

_lora_said = False


def adapter_uncached(request: Any) -> bool:
    """Whether ``request`` runs a LoRA adapter, whose KV kvtier neither loads nor stores.

    vLLM's block hash names an adapter by its name and path only, and an adapter rewritten at
    that path (or reloaded in place, ``load_inplace``) keeps both: its chunks would be served
    for other weights. The scheduler cannot prove which adapter weights a worker runs."""
    global _lora_said
    if getattr(request, "lora_request", None) is None:
        return False
    if not _lora_said:
        _lora_said = True
        log.warning(
            "kvtier: requests with a LoRA adapter are not cached (vLLM names an adapter's KV "
            "by the adapter's name and path, not its weights); requests without one are"
        )
    return True
