"""``kvtier hidden export``: the command line of `kvtier.hidden.export`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.core.config import KVTierConfig, load_config
from kvtier.hidden.export import (
    ExportCounts,
    export,
    from_lmdb,
    listed_refs,
    read_refs,
    refs_of_manifests,
)
from kvtier.hidden.reader import (
    HiddenStatesError,
    HiddenStatesReader,
    HiddenStatesRef,
    manifest_spec,
)


def _export(args: argparse.Namespace) -> int:
    namespace = bytes.fromhex(args.namespace) if args.namespace else None
    if namespace is None and args.refs is None:
        raise HiddenStatesError("give --namespace, --refs or both")
    config = load_config(args.config)
    if args.through_daemon:
        return _export_through_daemon(args, config, namespace)
    from kvtier.client import InProcessClient
    from kvtier.tiering.manager import TierManager

    manager = TierManager(config)
    # manifests straight from lmdb: the arena's hidden pool is left to the states
    reader = HiddenStatesReader(
        InProcessClient(manager), timeout_s=args.timeout, below=from_lmdb(manager)
    )
    try:
        return _write(
            reader, args, namespace, lambda ns: listed_refs(manager, reader, ns, args.tenant)
        )
    finally:
        reader.close()
        manager.close()


def _export_through_daemon(
    args: argparse.Namespace, config: KVTierConfig, namespace: bytes | None
) -> int:
    """Beside a running kvtierd: every chunk is read through it (its arena, leased), and a
    pool's manifests are listed from its lmdb, opened to read only."""
    from kvtier.rpc import GrpcTierClient
    from kvtier.tiers.lmdb_env import stored_keys_read_only

    client = GrpcTierClient(config.server.socket_path, "export")
    reader = HiddenStatesReader(client, timeout_s=args.timeout)

    def listed(namespace: bytes) -> tuple[list[HiddenStatesRef], int]:
        manifests = manifest_spec(namespace, args.tenant).digest()
        keys = stored_keys_read_only(config.lmdb.path, manifests)
        return refs_of_manifests(reader, namespace, keys, args.tenant)

    try:
        return _write(reader, args, namespace, listed)
    finally:
        reader.close()
        client.close()


def _write(
    reader: HiddenStatesReader,
    args: argparse.Namespace,
    namespace: bytes | None,
    listed: Callable[[bytes], tuple[list[HiddenStatesRef], int]],
) -> int:
    """Export the references of ``--refs``, or those ``listed`` for ``--namespace``."""
    from rich.progress import Progress

    if args.refs is not None:
        refs, failed = read_refs(args.refs, namespace), 0
    else:
        assert namespace is not None  # checked by _export
        refs, failed = listed(namespace)
    to: Path = args.to
    counts = ExportCounts()
    with Progress(transient=True) as progress:
        task = progress.add_task("exporting", total=len(refs))
        for step in export(reader, refs, to):
            counts = step
            progress.advance(task)
    counts.failed += failed  # manifests that could not be read
    print(
        f"{counts.written} written ({counts.bytes / 2**20:.1f} MiB of states), {counts.kept} "
        f"kept from an earlier run, {counts.failed} failed, in {to}"
    )
    return 1 if counts.failed else 0


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    hidden = sub.add_parser("hidden", help="captured hidden states")
    verbs = hidden.add_subparsers(dest="hidden_command", required=True)
    p = verbs.add_parser(
        "export",
        parents=[common],
        help="write captured hidden states as safetensors files, one per request",
    )
    p.add_argument(
        "--namespace",
        help="the hidden pool (16 bytes, hex; a reference's 'namespace'): every request whose "
        "manifest the tiers hold, or with --refs, only this pool's",
    )
    p.add_argument(
        "--refs",
        type=Path,
        help="JSON lines: each a request's kv_transfer_params['kvtier_hidden_states']",
    )
    p.add_argument("--tenant", default="default", help="the pool's tenant (default: default)")
    p.add_argument("--to", type=Path, required=True, help="directory of the files")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds a chunk may take to arrive")
    p.add_argument(
        "--through-daemon",
        action="store_true",
        help="beside a running kvtierd with this --config: read through it (server.socket_path), "
        "listing manifests from its lmdb opened to read only",
    )
    p.set_defaults(func=_export)
