"""KVTierConnector against vLLM 0.33's connector interface, read from the published wheel.

The CUDA wheel cannot run here, so its ``base.py`` is read as source: every abstract method of
``KVConnectorBase_V1`` must be implemented by our class, and every method we override must exist
there with parameters we accept.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
VERSION = "0.33.0"


@pytest.fixture(scope="module")
def wheel() -> Path:
    cache = Path.home() / ".cache" / "kvtier-tests" / f"vllm-{VERSION}"
    wheels = sorted(cache.glob("vllm-*.whl"))
    if not wheels:
        cache.mkdir(parents=True, exist_ok=True)
        fetched = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                f"vllm=={VERSION}",
                "-d",
                str(cache),
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        wheels = sorted(cache.glob("vllm-*.whl"))
        if fetched.returncode != 0 or not wheels:
            pytest.skip(f"the vllm {VERSION} wheel cannot be fetched here: {fetched.stderr[-300:]}")
    return wheels[0]


def _read(wheel: Path, name: str) -> str:
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(name).decode()


@pytest.fixture(scope="module")
def base_source(wheel: Path) -> str:
    return _read(wheel, BASE)


def _methods(source: str, name: str = "KVConnectorBase_V1") -> dict[str, tuple[bool, list[str]]]:
    """name -> (abstract, parameter names) for a class of the connector base module."""
    tree = ast.parse(source)
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    out = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            abstract = any(
                (isinstance(d, ast.Name) and d.id == "abstractmethod")
                or (isinstance(d, ast.Attribute) and d.attr == "abstractmethod")
                for d in node.decorator_list
            )
            params = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
            out[node.name] = (abstract, params)
    return out


def test_connector_implements_the_033_interface(base_source: str) -> None:
    from kvtier_vllm.connector import KVTierConnector

    methods = _methods(base_source)
    assert len(methods) > 20, "did not find the base class"
    # the hybrid allocator stays on for connectors that also derive from SupportsHMA
    hybrid = _methods(base_source, "SupportsHMA")
    assert hybrid["request_finished_all_groups"][0]
    methods.update(hybrid)
    assert "failed_recving" in base_source  # request-level load failures
    ours = {
        name: member
        for name, member in vars(KVTierConnector).items()
        if inspect.isfunction(member) and not name.startswith("_")
    }
    missing = [name for name, (abstract, _) in methods.items() if abstract and name not in ours]
    assert not missing, f"abstract in vllm {VERSION} but not implemented: {missing}"
    for name, function in ours.items():
        assert name in methods, f"{name} is not part of vllm {VERSION}'s connector interface"
        theirs = methods[name][1]
        params = inspect.signature(function).parameters
        accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        unknown = [p for p in theirs if p not in params and not accepts_any]
        assert not unknown, f"{name}: vllm {VERSION} passes {unknown}, which we do not take"
    init = inspect.signature(KVTierConnector.__init__).parameters
    assert "kv_cache_config" in init  # the factory refuses classes without it


def test_the_eagle_block_drop_is_asked_as_033_names_it(wheel: Path) -> None:
    """The connector drops a hit's last block exactly when vLLM's own prefix cache does."""
    source = _read(wheel, "vllm/config/speculative.py")
    (spec,) = [
        n
        for n in ast.parse(source).body
        if isinstance(n, ast.ClassDef) and n.name == "SpeculativeConfig"
    ]
    assert "use_eagle_block_drop" in {n.name for n in spec.body if isinstance(n, ast.FunctionDef)}
