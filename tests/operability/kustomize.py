"""A small kustomize: enough of it to render deploy/k8s without the kustomize binary.

It knows resources (files and directories), configMapGenerator (create, merge, replace) and
strategic-merge patches whose lists merge by name (volume mounts by mountPath, ports by
containerPort). Anything else in a kustomization is refused, so a feature it lacks cannot be
silently ignored. Generated names get no content hash; `normalise` strips kustomize's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

Doc = dict[str, Any]
_KNOWN = {"apiVersion", "kind", "resources", "configMapGenerator", "patches"}
_MERGE_KEYS = ("name", "mountPath", "containerPort")


def build(directory: Path) -> list[Doc]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - _KNOWN
    if unknown:
        raise ValueError(f"{directory}: unsupported kustomization fields {sorted(unknown)}")
    docs: list[Doc] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        if path.is_dir():
            docs += build(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for generator in kustomization.get("configMapGenerator", []):
        data = {Path(f).name: (directory / f).read_text() for f in generator["files"]}
        behavior = generator.get("behavior", "create")
        found = [d for d in docs if _is(d, "ConfigMap", generator["name"])]
        if behavior == "create":
            if found:
                raise ValueError(f"ConfigMap {generator['name']} exists already")
            docs.append(
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {"name": generator["name"]},
                    "data": data,
                }
            )
        elif len(found) != 1:
            raise ValueError(f"no ConfigMap {generator['name']} to {behavior}")
        elif behavior == "replace":
            found[0]["data"] = data
        else:
            found[0]["data"] = {**found[0].get("data", {}), **data}
    for patch in kustomization.get("patches", []):
        change = yaml.safe_load((directory / patch["path"]).read_text())
        targets = [d for d in docs if _is(d, change["kind"], change["metadata"]["name"])]
        if len(targets) != 1:
            raise ValueError(f"{patch['path']}: {len(targets)} targets")
        merge(targets[0], change)
    return docs


def _is(doc: Doc, kind: str, name: str) -> bool:
    return bool(doc["kind"] == kind and doc["metadata"]["name"] == name)


def _merge_key(items: list[Any]) -> str | None:
    if not items or not all(isinstance(i, dict) for i in items):
        return None
    for key in _MERGE_KEYS:
        if all(key in i for i in items):
            return key
    return None


def merge(base: Doc, change: Doc) -> None:
    for key, value in change.items():
        old = base.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            merge(old, value)
        elif isinstance(value, list) and isinstance(old, list) and _merge_key(old + value):
            by = _merge_key(old + value)
            for item in value:
                same = [o for o in old if o[by] == item[by]]
                if same:
                    merge(same[0], item)
                else:
                    old.append(item)
        else:
            base[key] = value


def normalise(docs: list[Doc]) -> list[Doc]:
    """Comparable renderings: no generated-name hashes, named lists sorted, docs sorted."""
    text = yaml.safe_dump_all(docs)
    text = re.sub(r"\b(kvtier-config)-[a-z0-9]{10}\b", r"\1", text)

    def sort(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: sort(v) for k, v in node.items()}
        if isinstance(node, list):
            items = [sort(i) for i in node]
            by = _merge_key(items)
            return sorted(items, key=lambda i: str(i[by])) if by else items
        return node

    out = [sort(d) for d in yaml.safe_load_all(text) if d]
    return sorted(out, key=lambda d: (d["kind"], d["metadata"]["name"]))
