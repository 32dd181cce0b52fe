"""A small reader of Dockerfiles, enough for tests/unit/test_images.py to check deploy/images
offline: stages, instructions with their continuations joined, ARG (and ENV) values substituted,
JSON-array forms, labels, COPY sources, and the owners of the paths an image creates."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import PurePosixPath
from typing import Any

OCI = "org.opencontainers.image."

_VAR = re.compile(r"\$\{(\w+)\}|\$(\w+)")


@dataclass
class Stage:
    base: str
    lines: list[tuple[str, str]] = field(default_factory=list)  # (KEYWORD, arguments)

    def all(self, keyword: str) -> list[str]:
        return [args for k, args in self.lines if k == keyword]

    def last(self, keyword: str) -> str | None:  # CMD, ENTRYPOINT, USER...: the last one counts
        found = self.all(keyword)
        return found[-1] if found else None


def logical_lines(text: str) -> Iterator[str]:
    """Instructions, continuations joined; comments and blank lines dropped, also inside a
    continuation, as Docker does."""
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        yield pending + line
        pending = ""
    if pending:
        yield pending.strip()


def parse(text: str, build_args: dict[str, str] | None = None) -> list[Stage]:
    """The stages, with ARG (and ENV) values substituted as the build would."""
    given = build_args or {}
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    scope: dict[str, str] = global_args
    for line in logical_lines(text):
        word, _, rest = line.partition(" ")
        keyword = word.upper()
        values = global_args if keyword == "FROM" else scope
        rest = _VAR.sub(lambda m, v=values: v.get(m[1] or m[2], m[0]), rest.strip())
        if keyword == "FROM":
            tokens = [t for t in rest.split() if not t.startswith("--")]
            stages.append(Stage(tokens[0]))
            scope = {}
        elif keyword == "ARG":
            for decl in shlex.split(rest):
                name, eq, default = decl.partition("=")
                inherited = default if eq else global_args.get(name, "")
                scope[name] = given.get(name, inherited)
        elif keyword == "ENV":
            scope.update(p.split("=", 1) for p in shlex.split(rest) if "=" in p)
        if stages and keyword != "FROM":
            stages[-1].lines.append((keyword, rest))
    return stages


def exec_form(args: str | None) -> list[str]:
    """A JSON-array argument list; [] for the shell form, which these images do not use."""
    try:
        value = json.loads(args or "")
    except ValueError:
        return []
    return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else []


def options(tokens: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading ``--name=value`` options, and the rest."""
    opts: dict[str, str] = {}
    while tokens and tokens[0].startswith("--"):
        name, _, value = tokens.pop(0)[2:].partition("=")
        opts[name] = value
    return opts, tokens


@dataclass
class Image:
    name: str
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    @property
    def labels(self) -> dict[str, str]:
        pairs = [p for args in self.final.all("LABEL") for p in shlex.split(args)]
        return dict(p.split("=", 1) for p in pairs)

    @property
    def ref(self) -> str:
        return f"{self.labels.get(OCI + 'title')}:{self.labels.get(OCI + 'version')}"

    def copies(self) -> Iterator[tuple[dict[str, str], list[str], str, Stage]]:
        for stage in self.stages:
            for args in stage.all("COPY"):
                opts, paths = options(shlex.split(args))
                yield opts, paths[:-1], paths[-1], stage

    def owned(self) -> dict[str, str]:
        """uid:gid of each path the final stage creates: install -d, mkdir, chown, COPY."""
        owners: dict[str, str] = {}
        for args in self.final.all("RUN"):
            _, tokens = options(shlex.split(args))
            command: list[str] = []
            for token in [*tokens, "&&"]:
                if token not in ("&&", "||", ";", "|"):
                    command.append(token)
                    continue
                _record(command, owners)
                command = []
        for opts, _sources, dest, stage in self.copies():
            if stage is self.final:
                owners[dest.rstrip("/")] = opts.get("chown", "0:0")
        return owners


def _record(command: list[str], owners: dict[str, str]) -> None:
    if command[:1] == ["chown"]:
        ids, *paths = [t for t in command[1:] if not t.startswith("-")]
        owners.update(dict.fromkeys(paths, ids))
    elif command[:1] in (["install"], ["mkdir"]):
        ids = {"-o": "0", "-g": "0"}
        paths, rest = [], iter(command[1:])
        for token in rest:
            if token in ("-o", "-g", "-m"):
                ids[token] = next(rest)
            elif not token.startswith("-"):
                paths.append(token)
        owners.update(dict.fromkeys(paths, f"{ids['-o']}:{ids['-g']}"))


def under(path: str, directories: set[str] | dict[str, Any]) -> str | None:
    """The deepest of ``directories`` that holds ``path`` (or is it)."""
    found = [d for d in directories if PurePosixPath(path).is_relative_to(d)]
    return max(found, key=len) if found else None


def admitted(path: str, dockerignore: str) -> bool:
    """Whether .dockerignore lets ``path`` into the build context: the last pattern matching it,
    or a directory above it, decides; ``!`` admits."""
    verdict = True
    for pattern in (ln.strip() for ln in dockerignore.splitlines()):
        if not pattern or pattern.startswith("#"):
            continue
        parts = pattern.lstrip("!").strip("/").split("/")
        names = path.split("/")
        if len(names) >= len(parts) and all(map(fnmatchcase, names, parts)):
            verdict = pattern.startswith("!")
    return verdict
