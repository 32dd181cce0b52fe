"""The one typed configuration tree, loaded once from YAML and ``KVTIER_`` environment variables.

Environment variables override the file: ``KVTIER_ARENA__SIZE_BYTES=8GiB`` sets ``arena.size_bytes``
(sections and keys joined by a double underscore). Values are parsed as YAML scalars. Every key has
a default and a description; `describe()` lists them. The sections are in `config_sections`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError

from kvtier.core.config_fleet import EventsConfig
from kvtier.core.config_sections import (
    Admission,
    ArenaConfig,
    ConfigSection,
    DemoteMode,
    Durability,
    LMDBConfig,
    ManagerConfig,
    ObjectStoreConfig,
    PoolConfig,
    default_state_dir,
)
from kvtier.core.config_server import ServerConfig
from kvtier.core.errors import ConfigError
from kvtier.core.kvcodec import Codec

__all__ = [
    "ENV_PREFIX",
    "Admission",
    "ArenaConfig",
    "DemoteMode",
    "Durability",
    "EventsConfig",
    "KVTierConfig",
    "LMDBConfig",
    "ManagerConfig",
    "ObjectStoreConfig",
    "PoolConfig",
    "ServerConfig",
    "default_state_dir",
    "describe",
    "from_mapping",
    "load_config",
]

ENV_PREFIX = "KVTIER_"


class KVTierConfig(ConfigSection):
    arena: ArenaConfig = Field(default_factory=ArenaConfig, description="The cpu tier.")
    lmdb: LMDBConfig = Field(default_factory=LMDBConfig, description="The lmdb tier.")
    manager: ManagerConfig = Field(default_factory=ManagerConfig, description="Tier movers.")
    object: ObjectStoreConfig = Field(
        default_factory=ObjectStoreConfig, description="The object tier."
    )
    server: ServerConfig = Field(default_factory=ServerConfig, description="kvtierd's APIs.")
    events: EventsConfig = Field(
        default_factory=EventsConfig, description="The object tier's KV events, for routers."
    )

    @property
    def lower_codecs(self) -> tuple[Codec, ...]:
        """The codecs of the tiers below the arena that run."""
        lmdb = (self.lmdb.codec,) if self.lmdb.enabled else ()
        return lmdb + ((self.object.codec,) if self.object.url is not None else ())


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        path = name[len(ENV_PREFIX) :].lower().split("__")
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(name, "conflicts with another KVTIER_ variable")
        node[path[-1]] = yaml.safe_load(raw) if raw else raw
    return tree


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def from_mapping(data: Mapping[str, Any]) -> KVTierConfig:
    try:
        return KVTierConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(p) for p in first["loc"]) or "<root>"
        raise ConfigError(key, first["msg"]) from exc


def load_config(path: Path | None = None, env: Mapping[str, str] | None = None) -> KVTierConfig:
    """Load YAML (if given), apply ``KVTIER_`` overrides, validate once."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ConfigError("--config", f"cannot read {path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError("--config", f"{path} is not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError("--config", f"{path} must hold a mapping at the top level")
        data = loaded or {}
    data = _merge(data, _env_overrides(os.environ if env is None else env))
    return from_mapping(data)


def describe(model: type[BaseModel] = KVTierConfig, prefix: str = "") -> Iterator[tuple[str, str]]:
    """Yield ``(dotted key, description)`` for every leaf key, for docs and `kvtier config`."""
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from describe(annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field.description or ""
