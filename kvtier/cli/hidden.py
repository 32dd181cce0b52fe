"""``kvtier hidden export``: the command line of `kvtier.hidden.export`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvtier.core.config import load_config
from kvtier.hidden.export import ExportCounts, export, from_lmdb, listed_refs, read_refs
from kvtier.hidden.reader import HiddenStatesError, HiddenStatesReader


def _export(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from kvtier.client import InProcessClient
    from kvtier.tiering.manager import TierManager

    namespace = bytes.fromhex(args.namespace) if args.namespace else None
    if namespace is None and args.refs is None:
        raise HiddenStatesError("give --namespace, --refs or both")
    manager = TierManager(load_config(args.config))
    # manifests straight from lmdb: the arena's hidden pool is left to the states
    reader = HiddenStatesReader(
        InProcessClient(manager), timeout_s=args.timeout, below=from_lmdb(manager)
    )
    counts = ExportCounts()
    try:
        if args.refs is not None:
            refs = read_refs(args.refs, namespace)
        else:
            assert namespace is not None
            refs, counts.failed = listed_refs(manager, reader, namespace, args.tenant)
        with Progress(transient=True) as progress:
            task = progress.add_task("exporting", total=len(refs))
            for step in export(reader, refs, args.to):
                counts = step
                progress.advance(task)
    finally:
        reader.close()
        manager.close()
    print(
        f"{counts.written} written ({counts.bytes / 2**20:.1f} MiB of states), {counts.kept} "
        f"kept from an earlier run, {counts.failed} failed, in {args.to}"
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
    p.set_defaults(func=_export)
