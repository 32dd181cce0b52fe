"""The documentation: the generated reference pages match the code, the MkDocs site builds
strictly (and a broken one does not), and the README stays short with every link resolving."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_LINES = 260
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    # Material prints a notice about MkDocs 2.0 on every build unless told not to
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=ROOT,
        check=False,
    )


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return _run("-m", "mkdocs", "build", "--strict", "-f", str(config), "--site-dir", str(site))


def _gen_docs(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up by name; the script then puts the tree first on the path
    monkeypatch.setitem(sys.modules, "gen_docs", module)
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec.loader.exec_module(module)
    return module


def test_reference_pages_match_the_code() -> None:
    out = _run(str(ROOT / "scripts" / "gen_docs.py"), "--check")
    assert out.returncode == 0, out.stderr + out.stdout


def test_check_names_a_drifted_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gen = _gen_docs(monkeypatch)
    # stand-in pages: the comparison, not the rendering (which needs vLLM) is under test
    monkeypatch.setattr(gen, "PAGES", {"a.md": lambda: "# A\n", "b.md": lambda: "# B\n"})
    monkeypatch.setattr(gen, "OUT", tmp_path)
    monkeypatch.setattr(sys, "argv", ["gen_docs.py"])
    assert gen.main() == 0
    monkeypatch.setattr(sys, "argv", ["gen_docs.py", "--check"])
    assert gen.main() == 0
    (tmp_path / "b.md").write_text("# B, edited by hand\n")
    (tmp_path / "c.md").write_text("# C\n")
    assert gen.main() == 1
    err = capsys.readouterr().err
    assert "docs/reference/b.md differs" in err
    assert "docs/reference/c.md is not generated" in err
    assert "a.md" not in err
    assert "run scripts/gen_docs.py" in err


def test_site_builds_strictly(tmp_path: Path) -> None:
    out = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert out.returncode == 0, out.stderr + out.stdout
    assert "WARNING" not in out.stderr
    assert (tmp_path / "site" / "reference" / "metrics" / "index.html").is_file()


BREAKAGES = {
    "page left out of nav": ("orphan.md", "# Orphan\n", "orphan.md"),
    "link to a missing page": ("index.md", "[gone](no-such-page.md)\n", "no-such-page.md"),
    "link to a missing anchor": (
        "index.md",
        "[gone](daemon.md#no-such-anchor)\n",
        "no-such-anchor",
    ),
    "absolute link": ("index.md", "[abs](/daemon.md)\n", "'/daemon.md'"),
    "unrecognized link": ("index.md", "[folder](reference/)\n", "'reference/'"),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_broken_site_fails_the_build(tmp_path: Path, breakage: str) -> None:
    page, text, named = BREAKAGES[breakage]
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    target = tmp_path / "docs" / page
    target.write_text((target.read_text() + "\n" if target.exists() else "") + text)
    out = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert out.returncode != 0, f"{breakage}: the strict build passed"
    assert "WARNING" in out.stderr, out.stderr
    assert named in out.stderr, out.stderr


def test_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_readme_links_resolve() -> None:
    targets = LINK.findall(README.read_text())
    relative = [t for t in targets if not re.match(r"[a-z]+:|#", t)]
    assert relative, "README.md links to nothing"
    missing = [t for t in relative if not (ROOT / t.split("#")[0]).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
    # the demonstration comes first, before anything else is asked of the reader
    assert relative[0] == "scripts/demo.sh"
