"""`KVTierBackend`: the ``kvtier`` entry of Speculators' `HiddenStatesBackend` registry, which
``speculators`` training and launch scripts find by name."""

from __future__ import annotations

import argparse
from typing import Any

from hs_connectors.transfer import HiddenStatesBackend

from kvtier_speculators.samples import MAX_SAMPLES
from kvtier_speculators.transfer import KVTierHiddenStates

NAME = "kvtier"


def _add(parser: argparse.ArgumentParser, flag: str, **kwargs: Any) -> None:
    """Add ``flag`` unless another backend added it (they share one parser)."""
    dest = flag.lstrip("-").replace("-", "_")
    if not any(action.dest == dest for action in parser._actions):
        parser.add_argument(flag, **kwargs)


def _add_config(parser: argparse.ArgumentParser) -> None:
    _add(parser, "--kvtier-config", type=str, default=None, help="kvtier's YAML config")


@HiddenStatesBackend.register(NAME)
class KVTierBackend(HiddenStatesBackend):
    """Hidden states captured by kvtier's connector and read from kvtier's tiers."""

    @staticmethod
    def add_train_args(parser: argparse.ArgumentParser) -> None:
        _add_config(parser)
        _add(
            parser,
            "--kvtier-namespace",
            type=str,
            default=None,
            help="the hidden pool (hex, a reference's 'namespace'); default: the first "
            "generated sample's",
        )
        _add(parser, "--kvtier-tenant", type=str, default="default", help="the pool's tenant")
        _add(
            parser,
            "--kvtier-embedded",
            action="store_true",
            help="open the tiers in the trainer (lmdb, object store) instead of reading "
            "through kvtierd",
        )
        _add(
            parser,
            "--kvtier-max-samples",
            type=int,
            default=MAX_SAMPLES,
            help="the samples kept known by their token ids; past it the least recently read "
            "is looked up again when asked for",
        )

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        _add_config(parser)

    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> KVTierHiddenStates:
        if not args.kvtier_config:
            raise ValueError("the kvtier backend needs --kvtier-config")
        return KVTierHiddenStates(
            args.kvtier_config,
            args.kvtier_namespace,
            data_path=data_path,
            tenant=args.kvtier_tenant,
            through_daemon=not args.kvtier_embedded,
            max_samples=args.kvtier_max_samples,
        )

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
        """kvtier's connector beside a kvtierd, capturing hidden states."""
        extra: dict[str, Any] = {"mode": "sidecar"}
        if args.kvtier_config:
            extra["kvtier_config"] = args.kvtier_config
        return {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier_vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
