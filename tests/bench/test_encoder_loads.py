"""benchmarks/encoder_loads.py, small: every case reads each output back byte-exact (the
benchmark checks each load against the output it stored) and has its figures, and the read that
ends each timed load reads every byte, so a load that only maps its file pays its reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch

from benchmarks.encoder_loads import CASES, Bench, read, table
from benchmarks.harness.system import drop_page_cache, resident_pages


def test_every_case_loads_each_output_and_has_its_figures(tmp_path: Path) -> None:
    bench = Bench(tmp_path, 2)
    try:
        result = bench.run()
    finally:
        bench.close()
    assert set(result["median_ms"]) == set(result["min_ms"]) == set(CASES)
    assert all(len(bench.ms[case]) == 2 for case in CASES)
    assert all(ms > 0 for ms in result["min_ms"].values())
    ratio = result["median_ms"]["kvtier_lmdb"] / result["median_ms"]["example"]
    assert result["lmdb_vs_example"] == pytest.approx(ratio, abs=1e-3)
    assert "kvtier_lmdb / example" in table(result)


def test_the_read_after_a_load_faults_in_every_page_of_a_mapped_file(tmp_path: Path) -> None:
    path = tmp_path / "output.safetensors"
    safetensors.torch.save_file({"ec_cache": torch.randn(576, 4096).to(torch.bfloat16)}, path)
    drop_page_cache([path])
    in_cache, pages = resident_pages(path)
    if in_cache == pages:
        pytest.skip(f"the page cache keeps {path}'s pages here: nothing to fault in")
    tensor = safetensors.torch.load_file(str(path))["ec_cache"]
    read(tensor)
    assert resident_pages(path) == (pages, pages)
