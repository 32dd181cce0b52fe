"""deploy/images against deploy/k8s, offline: every image the manifests name is built by one
Dockerfile here, and runs the way the manifests run it (user, ports, paths, command, health).

The Dockerfiles are read by tests/unit/dockerfiles.py. Each check returns the problems it finds,
and `test_each_check_can_fail` shows every one of them reporting a mutated copy of the files."""

from __future__ import annotations

import ast
import contextlib
import copy
import io
import ipaddress
import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from prometheus_client import CollectorRegistry

from kvtier._version import __version__
from kvtier.cli.main import _parser
from kvtier.core.config import KVTierConfig, from_mapping
from kvtier.server.http_port import HEALTH_PATH, start_http_port
from tests.operability.kustomize import build
from tests.unit.dockerfiles import OCI, Image, admitted, exec_form, parse, under

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
IMAGES = "deploy/images"
DAEMON, ENGINE = "kvtier.Dockerfile", "vllm-kvtier.Dockerfile"
OVERLAYS = ["sidecar", "daemonset", "s3", "gcs"]
THIRD_PARTY = {"busybox"}  # utilities the manifests pull as published
RUNTIME_DIRS = {"/dev/shm"}  # every container runtime mounts a tmpfs there
Problems = list[str]


# -- what is checked: the files, loaded once, and copied for each mutation -------------------------


@dataclass
class World:
    dockerfiles: dict[str, str]  # file name -> text
    files: dict[str, str]  # other build-context files the Dockerfiles copy
    dockerignore: str
    manifests: list[tuple[str, Any]]  # (file, document) of every YAML document in deploy/k8s
    overlays: dict[str, list[dict[str, Any]]]  # rendered
    pyproject: dict[str, Any]

    def image(self, name: str) -> Image:
        return Image(name, parse(self.dockerfiles[name]))

    def title(self, name: str) -> str:
        return self.image(name).labels.get(OCI + "title", "")

    def config(self, overlay: str) -> KVTierConfig:
        maps = [d for d in self.overlays[overlay] if d["kind"] == "ConfigMap"]
        return from_mapping(yaml.safe_load(maps[0]["data"]["kvtier.yaml"]))

    def pods(self, overlay: str) -> Iterator[dict[str, Any]]:
        for doc in self.overlays[overlay]:
            if doc["kind"] in ("Deployment", "DaemonSet"):
                yield doc["spec"]["template"]["spec"]

    def containers(self, overlay: str, image: str) -> Iterator[tuple[dict[str, Any], Any]]:
        """(pod, container) of each container running ``image`` (a name, without its tag)."""
        for pod in self.pods(overlay):
            for c in pod.get("initContainers", []) + pod.get("containers", []):
                if str(c.get("image", "")).rpartition(":")[0] == image:
                    yield pod, c


def load() -> World:
    dockerfiles = {p.name: p.read_text() for p in sorted((ROOT / IMAGES).glob("*.Dockerfile"))}
    manifests = [
        (str(p.relative_to(ROOT)), doc)
        for p in sorted(K8S.rglob("*.yaml"))
        for doc in yaml.safe_load_all(p.read_text())
        if doc
    ]
    world = World(
        dockerfiles,
        {},
        (ROOT / ".dockerignore").read_text(),
        manifests,
        {o: build(K8S / "overlays" / o) for o in OVERLAYS},
        tomllib.loads((ROOT / "pyproject.toml").read_text()),
    )
    for name in dockerfiles:
        for opts, sources, _dest, _stage in world.image(name).copies():
            for source in sources:
                if "from" not in opts and not source.endswith(".whl"):
                    world.files[source] = (ROOT / source).read_text()
    return world


def _pod_containers(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        for key in ("containers", "initContainers"):
            yield from (c for c in node.get(key) or [] if isinstance(c, dict))
        for value in node.values():
            yield from _pod_containers(value)
    elif isinstance(node, list):
        for item in node:
            yield from _pod_containers(item)


# -- the checks ------------------------------------------------------------------------------------


def check_images_are_built(w: World) -> Problems:
    problems = []
    images = [w.image(n) for n in w.dockerfiles]
    used = set()
    for source, doc in w.manifests:
        for c in _pod_containers(doc):
            ref = c.get("image")
            if ref is None:
                continue  # a patch of a container named elsewhere
            name, _, tag = ref.rpartition(":")
            if name in THIRD_PARTY:
                if tag in ("", "latest"):
                    problems.append(f"{source}: {ref} is not pinned to a version")
                continue
            builders = [i.name for i in images if i.ref == ref]
            used.add(ref)
            if len(builders) != 1:
                problems.append(f"{source}: {ref} is built by {builders or 'no Dockerfile'}")
            if tag != __version__:
                problems.append(f"{source}: {ref}'s tag is not kvtier's version {__version__}")
    for overlay in OVERLAYS:  # else the checks below would pass on no container at all
        for file in w.dockerfiles:
            if not any(w.containers(overlay, w.title(file))):
                problems.append(f"{overlay}: no container runs the image of {file}")
    bases = sorted({stage.base for stage in w.image(DAEMON).stages})  # the venv is copied
    python = re.fullmatch(r"python:(3\.\d+)-slim-\w+", bases[0] if len(bases) == 1 else "")
    if python is None or not SpecifierSet(w.pyproject["project"]["requires-python"]).contains(
        python[1] + ".0"
    ):
        problems.append(f"{DAEMON}: FROM {bases} is not one official python:3.X-slim-<os>")
    for image in images:
        title = image.labels.get(OCI + "title")
        if image.name != f"{title}.Dockerfile":
            problems.append(f"{image.name} builds {title!r}: name the file after the image")
        if image.labels.get(OCI + "version") != __version__:
            problems.append(f"{image.name}: version label {image.ref} is not {__version__}")
        if image.ref not in used:
            problems.append(f"{image.name}: no manifest runs {image.ref}")
    return problems


def _ids(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, Any]:
    return {**pod.get("securityContext", {}), **container.get("securityContext", {})}


def check_user(w: World) -> Problems:
    image = w.image(DAEMON)
    user = image.final.last("USER") or ""
    if not re.fullmatch(r"\d+:\d+", user):
        return [f"{DAEMON}: USER {user!r} is not numeric uid:gid (runAsNonRoot needs it)"]
    uid, gid = map(int, user.split(":"))
    problems = []
    title = w.title(DAEMON)
    for overlay in OVERLAYS:
        group = w.config(overlay).server.group
        if group is not None and str(group) != str(gid):
            problems.append(f"{overlay}: server.group {group} is not the image's gid {gid}")
        for pod, c in w.containers(overlay, title):
            ctx = _ids(pod, c)
            found = (ctx.get("runAsUser"), ctx.get("runAsGroup"), ctx.get("fsGroup", gid))
            if found != (uid, gid, gid):
                problems.append(f"{overlay}: {c['name']} runs as {found}, the image as {user}")
            for init in pod.get("initContainers", []):  # host directories handed to the user
                for ids in re.findall(r"chown (\S+)", " ".join(init.get("command", []))):
                    if ids != user:
                        problems.append(f"{overlay}: {init['name']} chowns to {ids}, not {user}")
    return problems


def check_ports(w: World) -> Problems:
    image = w.image(DAEMON)
    exposed = {int(p.split("/")[0]) for args in image.final.all("EXPOSE") for p in args.split()}
    problems = []
    for overlay in OVERLAYS:
        cfg = w.config(overlay).server
        # an admin API on the pod's loopback is reached from inside only: not exposed
        listening = [
            cfg.metrics_address,
            *([] if _loopback(cfg.admin_address) else [cfg.admin_address]),
        ]
        wanted = {int(a.rpartition(":")[2]) for a in listening}
        for _pod, c in w.containers(overlay, w.title(DAEMON)):
            wanted |= {p["containerPort"] for p in c.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                for kind in ("grpc", "httpGet", "tcpSocket"):
                    port = c.get(probe, {}).get(kind, {}).get("port")
                    wanted |= {port} if isinstance(port, int) else set()
        if wanted != exposed:
            problems.append(f"{overlay}: kvtierd uses ports {sorted(wanted)}, EXPOSE {exposed}")
    return problems


def check_paths(w: World) -> Problems:
    """The socket, arena, lmdb, object index and token directories are mounts the image
    creates owned by its user (or /dev/shm); the config file is there; so in the image's own
    configuration too."""
    image = w.image(DAEMON)
    user, owned = image.final.last("USER"), image.owned()
    config_path = _flag(exec_form(image.final.last("CMD")), "--config")
    problems = []

    def writable(where: str, path: Any, roots: set[str] | dict[str, Any]) -> None:
        root = under(str(path), roots)
        if root is None:
            problems.append(f"{where}: {path} lies under no mount, nor anything the image makes")
        elif root not in RUNTIME_DIRS and owned.get(root) != user:
            problems.append(f"{where}: {root}, holding {path}, is not created owned by {user}")

    def state_paths(cfg: KVTierConfig) -> list[Any]:
        server = cfg.server
        paths = [server.socket_path.parent, cfg.arena.path.parent, cfg.lmdb.path]
        paths.append(cfg.object.index_path)
        return paths + ([server.admin_token_file.parent] if server.admin_token_file else [])

    for overlay in OVERLAYS:
        for _pod, c in w.containers(overlay, w.title(DAEMON)):
            mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
            if config_path not in mounts or config_path not in owned:
                problems.append(f"{overlay}: {config_path} is not mounted, or not in the image")
            for path in state_paths(w.config(overlay)):
                writable(overlay, path, mounts)
    sources = [s for o, ss, dest, _ in image.copies() if dest == config_path for s in ss]
    if len(sources) != 1:
        return [*problems, f"{DAEMON}: no single COPY to {config_path}"]
    own = from_mapping(yaml.safe_load(w.files[sources[0]]))
    for path in state_paths(own):
        writable(sources[0], path, {*owned, *RUNTIME_DIRS})
    return problems


def _loopback(address: str) -> bool:
    host = address.rpartition(":")[0].strip("[]")
    return host == "localhost" or ipaddress.ip_address(host).is_loopback


def _image_config(w: World) -> tuple[str, KVTierConfig]:
    """The configuration file the image copies to its CMD's --config, and what it holds."""
    image = w.image(DAEMON)
    config_path = _flag(exec_form(image.final.last("CMD")), "--config")
    (source,) = [s for _o, ss, dest, _ in image.copies() if dest == config_path for s in ss]
    return source, from_mapping(yaml.safe_load(w.files[source]))


def healthcheck(w: World) -> tuple[list[str], str]:
    """The daemon image's HEALTHCHECK command and the one URL its code asks ("" if none)."""
    health = (w.image(DAEMON).final.last("HEALTHCHECK") or "").partition("CMD")[2]
    check = exec_form(health.strip())
    urls = re.findall(r"https?://[^'\"\s]+", " ".join(check))
    return check, urls[0] if len(urls) == 1 else ""


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def _parses(argv: list[str], command: str) -> str | None:
    """None if ``kvtier argv`` parses as ``command``; else why not."""
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            args = _parser().parse_args(argv)
        except SystemExit:
            return f"kvtier {' '.join(argv)}: {err.getvalue().strip().splitlines()[-1]}"
    return None if args.command == command else f"kvtier {' '.join(argv)} is not {command}"


def check_command(w: World) -> Problems:
    image = w.image(DAEMON)
    entrypoint = exec_form(image.final.last("ENTRYPOINT"))
    cmd = exec_form(image.final.last("CMD"))
    scripts = w.pyproject["project"]["scripts"]
    if not entrypoint or entrypoint[0] not in scripts:
        return [f"{DAEMON}: ENTRYPOINT {entrypoint} is not a console script of {sorted(scripts)}"]
    problems = [p for p in [_parses(entrypoint[1:] + cmd, "serve")] if p]
    # the check asks /healthz where the image's own configuration serves it, from inside
    check, url = healthcheck(w)
    source, own = _image_config(w)
    metrics_port = own.server.metrics_address.rpartition(":")[2]
    parts = urlsplit(url)
    if check[:2] != ["python", "-c"] or not url:
        problems.append(f"{DAEMON}: HEALTHCHECK {check} is not python -c asking one URL")
    elif (parts.hostname, str(parts.port), parts.path) != ("127.0.0.1", metrics_port, HEALTH_PATH):
        problems.append(
            f"{DAEMON}: HEALTHCHECK asks {url}, not {HEALTH_PATH} on 127.0.0.1:{metrics_port} "
            f"(server.metrics_address in {source})"
        )
    for overlay in OVERLAYS:
        for _pod, c in w.containers(overlay, w.title(DAEMON)):
            if c.get("command", entrypoint) + c.get("args", cmd) != entrypoint + cmd:
                problems.append(f"{overlay}: {c['name']} runs otherwise than the image")
    return problems


def check_engine_image(w: World) -> Problems:
    image = w.image(ENGINE)
    repository, _, tag = image.final.base.partition(":")
    problems = []
    if repository != "vllm/vllm-openai" or not re.fullmatch(r"v\d+\.\d+\.\d+", tag):
        problems.append(f"{ENGINE}: FROM {image.final.base} is not vllm/vllm-openai:vX.Y.Z")
    extra = [Requirement(r) for r in w.pyproject["project"]["optional-dependencies"]["vllm"]]
    if tag.startswith("v") and not extra[0].specifier.contains(tag[1:]):
        problems.append(f"{ENGINE}: {tag} is outside the vllm extra's {extra[0].specifier}")
    if image.final.all("ENTRYPOINT") or image.final.all("CMD"):
        problems.append(f"{ENGINE}: keep vLLM's own ENTRYPOINT and CMD")
    installs = [a for a in image.final.all("RUN") if "pip install" in a]
    if not installs or any("--no-cache-dir" not in a for a in installs):
        problems.append(f"{ENGINE}: pip install without --no-cache-dir")
    for overlay in OVERLAYS:
        for _pod, c in w.containers(overlay, w.title(ENGINE)):
            if c.get("command", ["vllm"])[:1] != ["vllm"]:
                problems.append(f"{overlay}: {c['name']} runs {c['command']}, not vllm")
    return problems


def check_wheels(w: World) -> Problems:
    project = w.pyproject["project"]
    name = re.sub(r"[-_.]+", "_", project["name"]).lower()
    wheel = f"dist/{name}-{__version__}-py3-none-any.whl"
    extras = {"s3", "gcs"}
    problems = []
    for file in w.dockerfiles:
        image = w.image(file)
        wheels = [s for _o, ss, _d, _s in image.copies() for s in ss if s.endswith(".whl")]
        if wheels != [wheel]:
            problems.append(f"{file}: copies {wheels}, not {wheel}")
        runs = [a for stage in image.stages for a in stage.all("RUN")]
        commands = [c for a in runs for c in a.split("&&") if "pip install" in c and ".whl" in c]
        if len(commands) != 1:
            problems.append(f"{file}: {len(commands)} pip installs of the wheel, not 1")
        for command in commands:
            for spec in re.findall(r"[\w/.-]+\.whl(?:\[[^]]*\])?", command):
                path, _, listed = spec.partition("[")
                chosen = set(listed.rstrip("]").split(",")) - {""}
                if PurePosixPath(path).name != PurePosixPath(wheel).name:
                    problems.append(f"{file}: installs {path}, not {wheel}")
                if chosen & {"vllm", "vllm-cpu"} or not extras <= chosen:
                    problems.append(f"{file}: installs extras {sorted(chosen)}")
                if not chosen <= set(project["optional-dependencies"]):
                    problems.append(f"{file}: unknown extras in {sorted(chosen)}")
    return problems


def check_build_context(w: World) -> Problems:
    return [
        f"{file}: .dockerignore keeps {source} out of the build context"
        for file in w.dockerfiles
        for opts, sources, _dest, _stage in w.image(file).copies()
        if "from" not in opts
        for source in sources
        if not admitted(source, w.dockerignore)
    ]


def check_transfer_config(w: World) -> Problems:
    tree = ast.parse((ROOT / "connectors" / "kvtier_vllm" / "connector.py").read_text())
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    problems = []
    for overlay in OVERLAYS:
        for _pod, c in w.containers(overlay, w.title(ENGINE)):
            args = c.get("args", [])
            try:
                given = json.loads(args[args.index("--kv-transfer-config") + 1])
            except (ValueError, IndexError) as exc:
                problems.append(f"{overlay}: {c['name']}'s --kv-transfer-config: {exc}")
                continue
            if given.get("kv_connector_module_path") != "kvtier_vllm.connector":
                problems.append(f"{overlay}: {c['name']} loads no kvtier_vllm.connector")
            if given.get("kv_connector") not in classes:
                problems.append(f"{overlay}: {given.get('kv_connector')} is no connector class")
    return problems


CHECKS = [
    check_images_are_built,
    check_user,
    check_ports,
    check_paths,
    check_command,
    check_engine_image,
    check_wheels,
    check_build_context,
    check_transfer_config,
]


@pytest.fixture(scope="module")
def world() -> World:
    return load()


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_images_match_the_manifests(world: World, check: Callable[[World], Problems]) -> None:
    assert check(world) == []


def test_the_reader_joins_lines_and_substitutes_args() -> None:
    text = 'ARG B=img:1\n# c\nFROM ${B} AS x\nARG V=2\nRUN a \\\n  # c\n  b$V\nCMD ["x", "y"]'
    (stage,) = parse(text)
    assert (stage.base, stage.all("RUN"), exec_form(stage.last("CMD"))) == (
        "img:1",
        ["a b2"],
        ["x", "y"],
    )
    assert parse(text, {"V": "3"})[0].all("RUN") == ["a b3"]


# -- every check can fail ---------------------------------------------------------------------


def mutate(w: World, where: str, old: str, new: str) -> None:
    """Replace the first ``old`` with ``new`` in a Dockerfile, a build-context file,
    .dockerignore, the YAML of one rendered overlay, or (``k8s``) the files in deploy/k8s; or
    (``copy``) add Dockerfile ``old`` again as ``new``."""

    def swap(text: str) -> str:
        assert old in text, (where, old)
        return text.replace(old, new, 1)

    def dump(doc: Any) -> str:
        return yaml.safe_dump(doc, width=1 << 20)

    if where == "copy":
        w.dockerfiles[new] = w.dockerfiles[old]
    elif where in w.dockerfiles:
        w.dockerfiles[where] = swap(w.dockerfiles[where])
    elif where in w.files:
        w.files[where] = swap(w.files[where])
    elif where == ".dockerignore":
        w.dockerignore = swap(w.dockerignore)
    elif where == "k8s":
        i = next(i for i, (_f, doc) in enumerate(w.manifests) if old in dump(doc))
        w.manifests[i] = (w.manifests[i][0], yaml.safe_load(swap(dump(w.manifests[i][1]))))
    else:
        w.overlays[where] = list(
            yaml.safe_load_all(swap(yaml.safe_dump_all(w.overlays[where], width=1 << 20)))
        )


D, E, CONFIG = DAEMON, ENGINE, f"{IMAGES}/kvtier.yaml"
MODULE = '"kv_connector_module_path":"kvtier_vllm.connector"'
MUTATIONS: dict[Callable[[World], Problems], list[tuple[str, str, str, str, str]]] = {
    check_images_are_built: [
        ("unbuilt", "k8s", "image: kvtier:0.1.0", "image: kvtier:0.0.9", "no Dockerfile"),
        ("latest", "k8s", "busybox:1.36", "busybox:latest", "not pinned"),
        ("label", D, 'version="${KVTIER_VERSION}"', 'version="0.2.0"', "version label"),
        ("file-name", "copy", D, "kvtierd.Dockerfile", "name the file"),
        (
            "two-builders",
            "copy",
            D,
            "kvtierd.Dockerfile",
            "built by ['kvtier.Dockerfile', 'kvtierd",
        ),
        ("python", D, "python:3.12-slim-bookworm", "python:latest", "official python"),
        ("unused", "sidecar", "image: vllm-kvtier:", "image: vllm:", "no container runs"),
    ],
    check_user: [
        ("uid", D, "USER 10001:10001", "USER 10002:10001", "runs as"),
        ("user-name", D, "USER 10001:10001", "USER kvtier", "not numeric"),
        ("fsGroup", "daemonset", "fsGroup: 10001", "fsGroup: 10003", "runs as"),
        ("server.group", "daemonset", "group: 10001", "group: 10002", "server.group"),
        ("host-dirs", "daemonset", "chown 10001:10001", "chown 0:0", "chowns to 0:0"),
    ],
    check_ports: [
        ("expose", D, "EXPOSE 7462", "EXPOSE 7461", "EXPOSE"),
        ("admin-exposed", D, "EXPOSE 7462", "EXPOSE 7461 7462", "EXPOSE"),
        (
            "admin-open",
            "s3",
            "admin_address: 127.0.0.1:7461",
            "admin_address: 0.0.0.0:7461",
            "7461",
        ),
        (
            "probe",
            "sidecar",
            "/healthz\n            port: 7462",
            "/healthz\n            port: 7463",
            "7463",
        ),
    ],
    check_paths: [
        ("owner", D, "-o 10001 -g 10001 -m 0750", "-o 0 -g 0 -m 0750", "/run/kvtier"),
        ("missing", D, "-m 0700 /var/lib/kvtier", "-m 0700", "/var/lib/kvtier"),
        ("mount", "sidecar", "path: /run/kvtier/kvtierd.sock", "path: /k.sock", "under no"),
        ("own-config", CONFIG, "/var/lib/kvtier/lmdb", "/srv/lmdb", "/srv/lmdb"),
        ("config", D, "kvtier.yaml /etc/kvtier/kvtier.yaml", "kvtier.yaml /etc/", "not in the"),
    ],
    check_command: [
        ("entrypoint", D, 'ENTRYPOINT ["kvtier"]', 'ENTRYPOINT ["kvtierd"]', "console script"),
        ("cmd", D, 'CMD ["serve"', 'CMD ["serv"', "invalid choice"),
        ("health", D, '["python", "-c"', '["kvtier", "health"', "not python -c"),
        ("health-port", D, "127.0.0.1:7462/healthz", "127.0.0.1:7461/healthz", "7461/healthz"),
        ("health-path", D, "7462/healthz", "7462/metrics", "/metrics"),
        (
            "health-config",
            CONFIG,
            "metrics_address: 0.0.0.0:7462",
            "metrics_address: 0.0.0.0:9464",
            "9464",
        ),
        ("args", "sidecar", "- --config", "- --configuration", "otherwise"),
    ],
    check_engine_image: [
        ("latest", E, "vllm-openai:v0.32.0", "vllm-openai:latest", "vX.Y.Z"),
        ("range", E, "vllm-openai:v0.32.0", "vllm-openai:v0.31.2", "outside"),
        ("entrypoint", E, "ENV HOME=/home/vllm", 'ENTRYPOINT ["sh"]', "keep vLLM's"),
        ("pip-cache", E, "--no-cache-dir ", "", "no-cache-dir"),
        ("command", "daemonset", "- vllm\n", "- python3\n", "not vllm"),
    ],
    check_wheels: [
        ("name", D, "COPY dist/kvtier-", "COPY dist/kv_tier-", "copies"),
        ("vllm-extra", E, "whl[s3,gcs]", "whl[s3,gcs,vllm]", "extras"),
        ("no-extras", D, "whl[s3,gcs]", "whl", "extras"),
    ],
    check_build_context: [("wheel", ".dockerignore", "!dist/*.whl", "", "dist/kvtier-")],
    check_transfer_config: [
        ("json", "sidecar", '{"kv_connector":', "{kv_connector:", "--kv-transfer-config"),
        ("module", "sidecar", MODULE, MODULE.replace("_vllm", ""), "kvtier_vllm.connector"),
        ("class", "sidecar", '"KVTierConnector"', '"Nope"', "no connector class"),
    ],
}
CASES = [(check, *m[1:]) for check, ms in MUTATIONS.items() for m in ms]
IDS = [f"{check.__name__}-{m[0]}" for check, ms in MUTATIONS.items() for m in ms]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_each_check_can_fail(world: World, case: tuple[Any, str, str, str, str]) -> None:
    check, where, old, new, expected = case
    mutated = copy.deepcopy(world)
    mutate(mutated, where, old, new)
    problems = check(mutated)
    assert any(expected in p for p in problems), problems


def test_every_check_is_mutated() -> None:
    assert set(MUTATIONS) == set(CHECKS)


def test_the_healthcheck_passes_while_kvtierd_serves_and_fails_once_it_stops(
    world: World,
) -> None:
    """The HEALTHCHECK's own command, run against kvtierd's real HTTP port (its port swapped
    for a free one): Docker reads its exit status."""
    check, url = healthcheck(world)
    serving = [True]
    server = start_http_port("127.0.0.1", 0, CollectorRegistry(), lambda: serving[0])
    port = server.server_address[1]
    argv = [
        sys.executable,
        *(a.replace(url, f"http://127.0.0.1:{port}{HEALTH_PATH}") for a in check[1:]),
    ]
    try:
        assert subprocess.run(argv, capture_output=True, timeout=30).returncode == 0
        serving[0] = False  # stopping: /healthz answers 503
        assert subprocess.run(argv, capture_output=True, timeout=30).returncode != 0
    finally:
        server.shutdown()
        server.server_close()
    assert subprocess.run(argv, capture_output=True, timeout=30).returncode != 0  # none listens
