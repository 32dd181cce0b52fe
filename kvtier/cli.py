"""The `kvtier` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kvtier.config import describe, load_config
from kvtier.errors import ConfigError


def _config(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"kvtier: invalid configuration: {exc}", file=sys.stderr)
        return 2
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier", description="Tiered KV-cache offload.")
    sub = parser.add_subparsers(dest="command", required=True)
    config = sub.add_parser("config", help="show every configuration key, or check a file")
    config.add_argument("--config", type=Path, help="YAML file (KVTIER_ variables override it)")
    config.add_argument("--check", action="store_true", help="only validate")
    config.set_defaults(func=_config)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
