"""The `kvtier` command line: `serve` runs the daemon, the rest call its admin API."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict
from pydantic import ByteSize, TypeAdapter
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from kvtier import __version__
from kvtier.api.v1 import admin_pb2
from kvtier.cli import locate
from kvtier.cli.connect import add_options as add_connection_options
from kvtier.cli.connect import connection
from kvtier.core.config import KVTierConfig, describe, load_config
from kvtier.core.errors import ConfigError, KVTierError
from kvtier.core.protocol import TierCode

_BYTES = TypeAdapter(ByteSize)


def _config(args: argparse.Namespace) -> KVTierConfig:
    return load_config(args.config)


def _show_config(args: argparse.Namespace) -> int:
    cfg = _config(args)
    if args.check:
        print("configuration is valid")
        return 0
    effective = cfg.model_dump(mode="json")
    for key, description in describe():
        value: object = effective
        for part in key.split("."):
            value = value[part] if isinstance(value, dict) else None
        print(f"{key} = {value!r}\n    {description}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from kvtier.server.daemon import serve

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return serve(_config(args))


# -- admin commands ---------------------------------------------------------------------------


def _admin(args: argparse.Namespace) -> Any:
    return connection(args).admin()


def _emit(args: argparse.Namespace, message: Any, table: Callable[[], None]) -> None:
    if args.json:
        print(json.dumps(MessageToDict(message, always_print_fields_with_no_presence=True)))
    else:
        table()


def _rows(header: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    table = Table(*header, box=None, pad_edge=False, header_style="bold")
    for row in rows:
        table.add_row(*(Text(str(c)) for c in row))  # Text: a pool name is never markup
    Console(highlight=False).print(table)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _locate(args: argparse.Namespace) -> int:
    return locate.run(args, _admin(args), _emit, _rows)


def _stats(args: argparse.Namespace) -> int:
    stats = _admin(args).stats()

    def table() -> None:
        print(f"kvtierd {stats.version or 'unknown'}")
        _rows(
            ("tier", "used", "capacity", "chunks", "corrupt"),
            [
                (
                    t.tier,
                    _gib(t.usage.used_bytes),
                    _gib(t.usage.capacity_bytes),
                    t.usage.chunks,
                    t.counters.get("corrupt", 0),  # failed verification: dropped, since start
                )
                for t in stats.tiers
            ],
        )
        print()
        _rows(
            ("tier", "replica", "pool", "used", "quota", "chunks"),
            [
                (
                    t.tier,
                    r.replica,
                    r.pool,
                    _gib(r.usage.used_bytes),
                    _gib(r.usage.capacity_bytes) if t.tier == TierCode.CPU.tier else "-",
                    r.usage.chunks,
                )
                for t in stats.tiers
                for r in t.replicas
            ],
        )
        if stats.draft_revisions:
            print()
            tiers = [t.tier for t in stats.tiers]
            _rows(
                ("draft model", "revision", "current", *tiers),
                [
                    (
                        d.draft_model,
                        d.revision,
                        "yes" if d.current else "no",
                        *(d.chunks.get(t, 0) for t in tiers),
                    )
                    for d in stats.draft_revisions
                ],
            )
        print(f"\nsessions {stats.sessions}, leases {stats.leases}")
        hits = {k: v for k, v in stats.counters.items() if k.startswith(("hit_", "lookup"))}
        print("  ".join(f"{k} {v}" for k, v in sorted(hits.items())))

    _emit(args, stats, table)
    return 0


def _evict(args: argparse.Namespace) -> int:
    namespace = bytes.fromhex(args.namespace) if args.namespace else b""
    evicted = _admin(args).evict(
        tier=args.tier or "", pool=args.pool or "", namespace=namespace, replica=args.replica or ""
    )
    if args.json:
        print(json.dumps(evicted))
    else:
        _rows(("tier", "evicted"), sorted(evicted.items()))
    return 0


def _keys(args: argparse.Namespace) -> list[bytes]:
    hexes = list(args.keys)
    if args.keys_file:
        hexes += Path(args.keys_file).read_text().split()
    return [bytes.fromhex(h) for h in hexes]


def _pin(args: argparse.Namespace) -> int:
    client = _admin(args)
    n = (client.unpin if args.command == "unpin" else client.pin)(_keys(args))
    print(json.dumps({"keys": n}) if args.json else f"{args.command}ned {n} keys")
    return 0


def _quota(args: argparse.Namespace) -> int:
    nbytes = int(_BYTES.validate_python(args.bytes))
    _admin(args).set_quota(args.replica, args.pool, nbytes)
    what = "cleared" if nbytes == 0 else f"set to {nbytes} bytes"
    print(json.dumps({"ok": True}) if args.json else f"quota of {args.replica}/{args.pool} {what}")
    return 0


def _drain(args: argparse.Namespace) -> int:
    result = _admin(args).drain(args.timeout)
    _emit(
        args,
        result,
        lambda: print(
            "drained: every arena chunk is in lmdb"
            if result.complete
            else f"drain incomplete: {result.pending} chunks still pending"
        ),
    )
    return 0 if result.complete else 1


def _follow(
    args: argparse.Namespace, stream: Iterable[Any], where: Callable[[Any], tuple[str, int, int]]
) -> Any:
    """Draw a progress bar per phase from (label, done, total), on stderr; without a total yet,
    a count. Off a terminal, each phase's last state is printed once at the end."""
    last = None
    if args.json:
        for item in stream:
            last = item
    else:
        columns = (
            TextColumn("{task.description}", markup=False),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        console = Console(stderr=True, highlight=False)
        with Progress(*columns, console=console) as progress:
            tasks: dict[str, TaskID] = {}
            for last in stream:
                label, done, total = where(last)
                if not (label or total):
                    continue  # nothing to show yet
                if label not in tasks:
                    tasks[label] = progress.add_task(label.strip(), total=None)
                progress.update(tasks[label], completed=done, total=total or None)
    if last is None:
        raise KVTierError("the daemon ended the stream without a result")
    return last


def _verify(args: argparse.Namespace) -> int:
    last = _follow(
        args, _admin(args).verify(args.tier or ""), lambda p: ("verify", p.checked, p.total)
    )
    _emit(
        args,
        last,
        lambda: print(f"verified {last.checked} chunks, {last.corrupt} corrupt (quarantined)"),
    )
    return 0 if last.corrupt == 0 else 1


def _warmup_where(p: Any) -> tuple[str, int, int]:
    if p.phase == "list":
        return "listing objects ", p.objects_listed, 0
    if p.phase in ("index", "fetch"):
        return f"{p.phase} objects ", p.objects_checked, p.objects_total
    return ("promote " if p.phase else ""), p.promoted, p.total


def _warmup(args: argparse.Namespace) -> int:
    namespace = bytes.fromhex(args.namespace) if args.namespace else b""
    stream = _admin(args).warmup(
        namespace, args.max_chunks, object_index=args.object_index, fetch=args.fetch
    )
    last = _follow(args, stream, _warmup_where)

    def table() -> None:
        if args.object_index:
            print(
                f"indexed {last.chunks_indexed} chunks in {last.objects_indexed} objects "
                f"({last.objects_listed} listed)"
            )
        if args.fetch:
            print(f"fetched {last.chunks_fetched} chunks in {last.objects_fetched} objects")
        if last.objects_corrupt or last.objects_failed:
            print(
                f"{last.objects_corrupt} corrupt objects (quarantined), "
                f"{last.objects_failed} not handled (run again)"
            )
        print(f"promoted {last.promoted} of {last.total} chunks")

    _emit(args, last, table)
    return 0 if last.objects_failed == 0 else 1


def _gc_where(p: Any) -> tuple[str, int, int]:
    if p.total:
        return "checked ", p.checked, p.total
    return "listing objects ", p.listed, 0


def _gc(args: argparse.Namespace) -> int:
    stream = _admin(args).gc(args.retention_s, args.dry_run)
    last = _follow(args, stream, _gc_where)

    def table() -> None:
        verb = "would delete" if last.dry_run else "deleted"
        print(
            f"{verb} {last.deleted} of {last.total} objects ({_gib(last.deleted_bytes)}) "
            f"older than {last.retention_s:g} s"
        )
        if last.pinned or last.failed:
            print(f"kept {last.pinned} holding pinned chunks; {last.failed} failed (run again)")

    _emit(args, last, table)
    return 0 if last.failed == 0 else 1


def _draft_swap(args: argparse.Namespace) -> int:
    client = _admin(args)
    if args.commit:
        done = client.draft_swap_commit(args.commit)
        _emit(args, done, lambda: print(f"draft revision is now {done.revision}"))
        return 0
    if not args.revision:
        raise ValueError("draft-swap needs --revision (or --commit SWAP_ID)")
    begun = client.draft_swap_begin(args.revision, args.draft_model or "")
    if args.begin:  # the caller swaps vLLM's draft weights, then commits
        _emit(
            args,
            begun,
            lambda: print(
                f"draft swap {begun.swap_id} begun (was {begun.previous_revision}); "
                f"commit it with: kvtier draft-swap --commit {begun.swap_id}"
            ),
        )
        return 0
    done = client.draft_swap_commit(begun.swap_id)
    _emit(args, done, lambda: print(f"draft revision is now {done.revision}"))
    return 0


def _quarantine(args: argparse.Namespace) -> int:
    client = _admin(args)
    if args.lift:
        lifted = client.lift_quarantine(bytes.fromhex(args.lift))
        response = admin_pb2.LiftQuarantineResponse(lifted=lifted)
        _emit(args, response, lambda: print("lifted" if lifted else "not quarantined"))
        return 0 if lifted else 1
    listed = admin_pb2.ListQuarantinesResponse(quarantined=client.quarantines())

    def lines() -> None:  # whole lines: a namespace is copied from here to --lift
        for q in listed.quarantined:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(q.since_unix_s))
            print(f"{q.namespace.hex()}  since {since} UTC  by {q.source or '?'}  {q.reason}")
        if not listed.quarantined:
            print("no namespace is quarantined")

    _emit(args, listed, lines)
    return 0


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", type=Path, help="YAML file; KVTIER_ variables override it")
    parser = argparse.ArgumentParser(prog="kvtier", description="Tiered KV-cache offload.")
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    config = sub.add_parser(
        "config", parents=[common], help="show every configuration key, or check a file"
    )
    config.add_argument("--check", action="store_true", help="only validate")
    config.set_defaults(func=_show_config)

    serve = sub.add_parser("serve", parents=[common], help="run the kvtierd daemon")
    serve.add_argument("--log-level", default="info")
    serve.set_defaults(func=_serve)

    calling = argparse.ArgumentParser(add_help=False, parents=[common])
    add_connection_options(calling)

    def admin(name: str, func: Callable[[argparse.Namespace], int], help: str) -> Any:
        p = sub.add_parser(name, parents=[calling], help=help)
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
        p.set_defaults(func=func)
        return p

    admin("stats", _stats, "usage and hits per tier, pool and replica")
    evict = admin("evict", _evict, "drop chunks matching every given filter")
    evict.add_argument("--tier", choices=[code.tier for code in TierCode])
    evict.add_argument("--pool")
    evict.add_argument("--namespace", help="16-byte namespace, hex")
    evict.add_argument("--replica")
    for name in ("pin", "unpin"):
        p = admin(name, _pin, f"{name} chunk keys (hex)")
        p.add_argument("keys", nargs="*")
        p.add_argument("--keys-file", help="file of hex keys, whitespace-separated")
    quota = admin("quota", _quota, "set a replica's quota in a pool (0 clears)")
    quota.add_argument("--replica", required=True)
    quota.add_argument("--pool", required=True)
    quota.add_argument("--bytes", required=True, help="e.g. 8GiB; 0 restores the default share")
    drain = admin("drain", _drain, "write every arena chunk to lmdb")
    drain.add_argument("--timeout", type=float, default=60.0)
    verify = admin("verify", _verify, "verify stored chunks; corrupt ones are quarantined")
    verify.add_argument("--tier", choices=[TierCode.LMDB.tier])
    warmup = admin("warmup", _warmup, "promote stored chunks into the arena")
    warmup.add_argument("--namespace", help="16-byte namespace, hex")
    warmup.add_argument("--max-chunks", type=int, default=0, help="chunks promoted at most")
    warmup.add_argument(
        "--object-index",
        action="store_true",
        help="first rebuild the object tier's index by listing the store (reads headers only)",
    )
    warmup.add_argument(
        "--fetch",
        action="store_true",
        help="download the namespace's objects into lmdb (verified) before promoting "
        "(without --namespace: every namespace registered on the node)",
    )
    gc = admin("gc", _gc, "delete objects older than the retention from the object store")
    gc.add_argument(
        "--retention-s",
        type=float,
        help="age in seconds (default: the daemon's object.retention_s)",
    )
    gc.add_argument("--dry-run", action="store_true", help="only count what would be deleted")
    swap = admin("draft-swap", _draft_swap, "switch the draft pool to a new revision")
    swap.add_argument("--revision", help="the draft's new revision")
    swap.add_argument("--draft-model", help="only this draft model's pools (default: all)")
    step = swap.add_mutually_exclusive_group()
    step.add_argument(
        "--begin",
        action="store_true",
        help="only begin: engines stop loading and storing draft chunks until the commit",
    )
    step.add_argument("--commit", metavar="SWAP_ID", help="commit a swap begun with --begin")
    quarantine = admin(
        "quarantine", _quarantine, "namespaces an engine found wrong KV in; --lift one"
    )
    quarantine.add_argument("--lift", metavar="NAMESPACE", help="16-byte namespace, hex")
    where = admin("locate", _locate, "where a prompt's KV is, and its load time against recompute")
    locate.add_arguments(where)
    from kvtier.cli.health import add_parser as add_health
    from kvtier.cli.hidden import add_parser as add_hidden
    from kvtier.observability.top import add_parser as add_top

    add_hidden(sub, common)
    add_top(sub, common)
    add_health(sub, calling)
    from kvtier.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"kvtier: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except (KVTierError, ValueError, OSError) as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
