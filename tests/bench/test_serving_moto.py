"""The serving benchmark's object store (benchmarks/serving_servers.py): moto stands for a remote
service, so the harness starts it at the lowest CPU priority, every thread of it, while it
serves. A real moto process; its threads' nice values are read from /proc."""

from __future__ import annotations

import os
from pathlib import Path

import boto3.session
import pytest

from benchmarks.serving_cases import BUCKET
from benchmarks.serving_servers import MOTO_NICE
from tests.bench.serving_harness import small_servers
from tests.fixtures.s3 import SCRUBBED_ENV, irsa_env, patched_env
from tests.support import thread_nices


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads threads from /proc")
def test_the_serving_benchmarks_moto_runs_every_thread_at_the_lowest_priority(
    tmp_path: Path,
) -> None:
    servers = small_servers(tmp_path)
    try:
        moto = servers.s3()
        assert moto.pid is not None
        # it serves: the run's bucket was made, and an upload lands
        with patched_env(irsa_env(tmp_path, moto.url), drop=SCRUBBED_ENV):
            client = boto3.session.Session().client("s3")
            client.put_object(Bucket=BUCKET, Key="probe", Body=b"x" * 4096)
            client.close()
        nices = {nice for _name, nice in thread_nices(moto.pid).values()}
    finally:
        servers.close()
    assert MOTO_NICE == 19
    assert nices == {19}
