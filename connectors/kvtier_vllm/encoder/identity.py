"""Which encoder computed an output: the encoder pool's namespace for an engine.

The item's identifier names the item and the processor's per-request settings, never the
encoder that ran on it. The namespace adds the rest: the model, a fingerprint of the encoder's
own tensors (vision or audio tower and projector, not the language model, so a fine-tune of the
text model keeps the cache), the output's dtype and width, the processor's files and the
engine's ``mm_processor_kwargs``, and the modality.

The encoder's tensors are told from the language model's by name. A checkpoint whose tensors
cannot be told apart (not safetensors, or every name looks like the language model's) is
fingerprinted whole, as the KV connector does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from pathlib import Path
from typing import Any

from kvtier.core.encoder import DTYPE_BYTES, encoder_spec, rows_per_part
from kvtier.core.keys import NamespaceSpec
from kvtier_vllm.encoder.settings import EncoderCacheConfig
from kvtier_vllm.shared.shapes import UnsupportedGroupError
from kvtier_vllm.shared.weights import (
    PREFIX,
    WeightsUnknownError,
    checkpoint_files,
    locate,
    plain_json,
    read_exact,
    settings_of,
    weights_fingerprint,
)

log = logging.getLogger(__name__)

TEXT_MODEL_PARTS = (
    "language_model.",
    "text_model.",
    "lm_head.",
    "model.layers.",
    "model.embed_tokens.",
    "model.norm.",
)
"""Names of language-model tensors in the checkpoints of vision-language models."""
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
SAMPLE_BYTES = 4096
_TEXT_CONFIG_KEYS = ("text_config", "_name_or_path", "transformers_version")


def is_text_tensor(name: str) -> bool:
    return any(part in name for part in TEXT_MODEL_PARTS)


def _safetensors_entries(fd: int) -> tuple[int, dict[str, Any]] | None:
    size = os.fstat(fd).st_size
    if size < 8:
        return None
    (length,) = struct.unpack("<Q", read_exact(fd, 0, 8))
    if not 2 <= length <= size - 8:
        return None
    try:
        entries = json.loads(read_exact(fd, 8, length))
    except ValueError:
        return None
    return (8 + length, entries) if isinstance(entries, dict) else None


def _tensor_sample(fd: int, base: int, entry: dict[str, Any]) -> bytes:
    """The tensor's first and last bytes and a window from its middle."""
    begin, end = (int(v) for v in entry.get("data_offsets", (0, 0)))
    length = end - begin
    if length <= 3 * SAMPLE_BYTES:
        return read_exact(fd, base + begin, length)
    middle = begin + (length - SAMPLE_BYTES) // 2
    spots = (begin, middle, end - SAMPLE_BYTES)
    return b"".join(read_exact(fd, base + spot, SAMPLE_BYTES) for spot in spots)


def _config_without_text(root: Path) -> bytes:
    path = root / "config.json"
    if not path.is_file():
        return b""
    config = json.loads(path.read_text())
    for key in _TEXT_CONFIG_KEYS:
        config.pop(key, None)
    return json.dumps(config, sort_keys=True).encode()


def encoder_fingerprint(model_config: Any, load_config: Any) -> str:
    """``fp-`` and 16 hex digits of the encoder's tensors (names, shapes, dtypes and a sample of
    each one's bytes), its config and the settings that decide its values; raises
    `WeightsUnknownError` where there is no checkpoint to read."""
    path = locate(
        str(model_config.model), model_config.revision, getattr(load_config, "download_dir", None)
    )
    checkpoint = checkpoint_files(path)
    digest = hashlib.blake2b(digest_size=8)
    settings = settings_of(model_config, load_config)
    digest.update(json.dumps(plain_json(settings), sort_keys=True).encode())
    digest.update(_config_without_text(checkpoint.root))
    tensors = 0
    for weights in checkpoint.weights:
        with open(weights, "rb", buffering=0) as file:
            found = _safetensors_entries(file.fileno())
            if found is None:
                continue
            base, entries = found
            for name in sorted(entries):
                entry = entries[name]
                if name == "__metadata__" or is_text_tensor(name) or not isinstance(entry, dict):
                    continue
                head = json.dumps([name, entry.get("dtype"), entry.get("shape")]).encode()
                digest.update(struct.pack("<Q", len(head)) + head)
                digest.update(_tensor_sample(file.fileno(), base, entry))
                tensors += 1
    if not tensors:
        whole = weights_fingerprint(model_config, load_config)
        log.info("kvtier: no encoder tensors told apart in %s; its whole weights name it", path)
        return whole
    found_fp = PREFIX + digest.hexdigest()
    log.info("kvtier: encoder of %s is %s (%d tensors)", model_config.model, found_fp, tensors)
    return found_fp


def processor_fingerprint(model_config: Any) -> str:
    """16 hex digits of the processor's files and the engine's ``mm_processor_kwargs``."""
    digest = hashlib.blake2b(digest_size=8)
    try:
        root = locate(str(model_config.model), model_config.revision)
    except WeightsUnknownError:
        root = None
    for name in PROCESSOR_FILES:
        path = root / name if root is not None and root.is_dir() else None
        if path is not None and path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    mm = getattr(model_config, "multimodal_config", None)
    kwargs = plain_json(getattr(mm, "mm_processor_kwargs", None) or {})
    digest.update(json.dumps(kwargs, sort_keys=True).encode())
    return digest.hexdigest()


def output_dtype(model_config: Any) -> str:
    dtype = str(model_config.dtype).removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        raise UnsupportedGroupError(f"kvtier stores no encoder outputs of dtype {dtype}")
    return dtype


def output_widths(vllm_config: Any, cfg: EncoderCacheConfig) -> dict[str, int]:
    """Each modality's output width: set, measured by vLLM at start (producers), or the
    language model's embedding width."""
    measured = dict(getattr(vllm_config.ec_transfer_config, "mm_encoder_output_widths", {}) or {})
    model_config = vllm_config.model_config
    modalities = set(measured)
    mm = getattr(model_config, "multimodal_config", None)
    limits = getattr(mm, "limit_per_prompt", None) or {}
    modalities |= {m for m in limits if _allowed(limits[m])}
    modalities = modalities or {"image"}
    fallback = cfg.output_width or int(model_config.get_inputs_embeds_size())
    return {m: cfg.output_width or int(measured.get(m, fallback)) for m in sorted(modalities)}


def _allowed(limit: Any) -> bool:
    count = getattr(limit, "count", limit)
    return not isinstance(count, int) or count > 0


def encoder_specs(vllm_config: Any, cfg: EncoderCacheConfig) -> dict[str, NamespaceSpec]:
    """The encoder pool's namespace of each modality; raises `UnsupportedGroupError` where the
    encoder cannot be named."""
    model_config = vllm_config.model_config
    revision = cfg.encoder_revision
    if not revision:
        try:
            revision = encoder_fingerprint(model_config, vllm_config.load_config)
        except WeightsUnknownError as exc:
            raise UnsupportedGroupError(
                f"kvtier cannot fingerprint the encoder of {model_config.model} ({exc}); set "
                "ec_connector_extra_config.encoder_revision to a name that changes whenever "
                "its weights do"
            ) from exc
    dtype = output_dtype(model_config)
    processor = processor_fingerprint(model_config)
    return {
        modality: encoder_spec(
            model=str(model_config.model),
            encoder_revision=revision,
            dtype=dtype,
            width=width,
            rows_per_part=rows_per_part(width, dtype, cfg.part_kib << 10),
            processor=f"{modality}:{processor}",
            tenant=cfg.tenant,
        )
        for modality, width in output_widths(vllm_config, cfg).items()
    }
