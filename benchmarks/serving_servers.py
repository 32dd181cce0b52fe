"""The serving benchmark's servers: one case's vLLM server (its connector, kvtierd for a sidecar,
tiers past the arena, speculation, capture, profiling) and what they share (arenas in /dev/shm,
moto's S3)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import boto3.session
import yaml

from benchmarks.gpu_ratio import (
    DiskBandwidth,
    PageCacheDropper,
    node_scaled_disk,
    reads_throttled,
)
from benchmarks.harness.connector import kvtier_connector
from benchmarks.harness.kvtierd import Kvtierd
from benchmarks.harness.sizes import KiB, MiB, extent_for
from benchmarks.harness.system import process_tree, remove_arena
from benchmarks.models import ServingModel
from benchmarks.serving_cases import (
    ARENA_BYTES,
    BLOCK_SIZE,
    BUCKET,
    CAPTURE,
    LMDB_BUDGET,
    SERVER_START_S,
    SPEC_TOKENS,
    Case,
    Plan,
)
from benchmarks.serving_figures import histogram_args, profiler_args
from benchmarks.serving_lmcache import LmcacheServer
from tests.fixtures.s3 import SCRUBBED_ENV, MotoServer, irsa_env, patched_env
from tests.fixtures.servers import VllmServer, connector_arg

log = logging.getLogger("kvtier.bench.serving")

MOTO_NICE = 19
"""moto stands for a remote object store: at the lowest priority, its hashing and storing of
every upload takes none of the engine's cores that the engine or kvtierd wants."""
OBJECT_STORE_SETUP = f"moto's S3 on this machine at nice {MOTO_NICE}, standing for a remote store"


class Servers:
    """Starts and stops the cases' servers under ``root``; ``daemons`` are the sidecars' kvtierd
    by run name while their servers run."""

    def __init__(
        self,
        root: Path,
        model: Path,
        draft: Path,
        *,
        sizes: ServingModel,
        lmcache_python: str = "",
        blocks_per_chunk: int,
        chunk_bytes: int,
        working_set_bytes: int,
        kv_per_token: int,
        hidden_per_token: int,
        connector_extra: dict[str, Any],
    ) -> None:
        self.root = root
        self.model = model
        self.draft = draft
        self.sizes = sizes
        self.lmcache_python = lmcache_python
        self.bpc = blocks_per_chunk
        self.chunk_bytes = chunk_bytes
        self.working_set_bytes = working_set_bytes
        """Every user's whole history, in the chunks it is stored as."""
        self.kv_per_token = kv_per_token
        self.hidden_per_token = hidden_per_token
        self.connector_extra = connector_extra
        self.shm_paths: list[Path] = []
        self.daemons: dict[str, Kvtierd] = {}
        self.moto: MotoServer | None = None
        self.lmdb_disk: DiskBandwidth | None = None
        """On the GPU-ratio model, the bandwidth lmdb's disk reads at below an arena (set once
        the engine's prefill time is measured)."""
        self.lmdb_throttles: dict[str, str] = {}
        """How each server past the arena had its lmdb reads throttled, by run name."""

    def hidden_bytes(self, kv_bytes: int) -> int:
        """The captured hidden states' cache for the tokens ``kv_bytes`` of KV hold."""
        return kv_bytes * self.hidden_per_token // self.kv_per_token

    def shm(self, name: str) -> Path:
        path = Path(f"/dev/shm/kvtier-serving-{os.getpid()}-{name}")
        self.shm_paths.append(path)
        return path

    def kvtier(self, extra: dict[str, Any], case: Case) -> dict[str, Any]:
        policy = {"load_policy": case.load_policy} if case.load_policy else {}
        return kvtier_connector(
            {**extra, "blocks_per_chunk": self.bpc, **policy, **self.connector_extra}
        )

    def embedded_config(self, name: str, case: Case) -> dict[str, Any]:
        path = self.root / name / "kvtier.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        tree = {
            "arena": {
                "path": str(self.shm(name)),
                "size_bytes": ARENA_BYTES,
                "extent_bytes": extent_for(self.chunk_bytes),
                "min_slot_bytes": 64 * KiB,
            },
            "lmdb": {"path": str(self.root / name / "lmdb"), "budget_bytes": LMDB_BUDGET},
        }
        path.write_text(yaml.safe_dump(tree))
        return self.kvtier({"kvtier_config": str(path)}, case)

    def past_the_arena(self, tree: dict[str, Any], below: str, daemon: Kvtierd) -> None:
        """Tiers that hold less than the working set: an arena of a quarter of it (extents of
        up to 8 chunks, 4 of them at least, so that a quarter is whole extents; its tables get
        room beyond), then lmdb the rest, or lmdb a quarter and the object store
        (moto, reached through IRSA) everything."""
        quarter_chunks = max(1, round(self.working_set_bytes / 4 / self.chunk_bytes))
        extent = max(1, min(8, quarter_chunks // 4)) * self.chunk_bytes
        quarter = max(extent, round(quarter_chunks * self.chunk_bytes / extent) * extent)
        room = 2 * MiB  # the arena's tables: its data starts 2 MiB-aligned
        tree["arena"].update(size_bytes=quarter + room, extent_bytes=extent)
        if below == "object":
            moto = self.s3()
            tree["lmdb"]["budget_bytes"] = quarter
            tree["object"] = {
                "url": f"s3://{BUCKET}/{daemon.root.parent.name}",
                "index_path": str(daemon.root / "objindex"),
            }
            daemon.env = irsa_env(self.root, moto.url)
            daemon.env_drop = SCRUBBED_ENV

    def s3(self) -> MotoServer:
        """moto's S3, started at first use, with the run's bucket."""
        if self.moto is None:
            self.moto = MotoServer(self.root / "moto.log", nice=MOTO_NICE).start()
            log.info("object store: %s", OBJECT_STORE_SETUP)
            with patched_env(irsa_env(self.root, self.moto.url), drop=SCRUBBED_ENV):
                client = boto3.session.Session().client("s3")
                client.create_bucket(Bucket=BUCKET)
                client.close()
        return self.moto

    @contextmanager
    def server(
        self, case: Case, plan: Plan, run_name: str = ""
    ) -> Iterator[tuple[VllmServer, str | None]]:
        """``case``'s server, its files under ``run_name`` (the case's name by default)."""
        run_name = run_name or case.name
        tmp = self.root / run_name
        tmp.mkdir(parents=True, exist_ok=True)
        args: list[str] = []
        daemon: Kvtierd | None = None
        lmcache: LmcacheServer | None = None
        python = sys.executable
        metrics_url = None
        if case.connector == "embedded":
            args += connector_arg(self.embedded_config(run_name, case))
        elif case.connector == "sidecar":
            (tmp / "kvtierd").mkdir(exist_ok=True)
            daemon = Kvtierd(
                tmp / "kvtierd", self.shm(run_name), ARENA_BYTES, extent_for(self.chunk_bytes)
            )
            tree = yaml.safe_load(daemon.config_path.read_text())
            tree["lmdb"]["budget_bytes"] = LMDB_BUDGET
            if case.below:
                self.past_the_arena(tree, case.below, daemon)
                tree["lmdb"]["codec"] = case.codec
                if "object" in tree:
                    tree["object"]["codec"] = case.codec
            daemon.config_path.write_text(yaml.safe_dump(tree))
            try:
                daemon.start()
            except BaseException:
                daemon.stop()
                raise
            metrics_url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"
            self.daemons[run_name] = daemon
            extra = {"mode": "sidecar", "socket_path": str(daemon.socket_path)}
            args += connector_arg(self.kvtier(extra, case))
        elif case.connector == "lmcache":
            python = self.lmcache_python
            lmcache = LmcacheServer(
                python, tmp, budget_bytes=ARENA_BYTES, chunk_tokens=self.bpc * BLOCK_SIZE
            )
            lmcache.start()
            args += connector_arg(lmcache.connector())
        elif case.connector == "example":
            storage = tmp / "example-storage"
            storage.mkdir(exist_ok=True)
            args += connector_arg(
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(storage)},
                }
            )
        elif case.connector == "offloading":
            args += connector_arg(
                {
                    "kv_connector": "OffloadingConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"cpu_bytes_to_use": ARENA_BYTES},
                }
            )
        if case.spec:
            spec = {
                "method": "draft_model",
                "model": str(self.draft),
                "num_speculative_tokens": SPEC_TOKENS,
            }
            args += ["--speculative-config", json.dumps(spec)]
        if case.capture:
            args += ["--speculative-config", json.dumps(CAPTURE)]
        if case.connector != "lmcache":  # LMCache serves from a vLLM of its own
            args += histogram_args()
        env = {"VLLM_SERVER_DEV_MODE": "1"}
        if plan.profile:
            args += profiler_args(tmp / "traces")
            env["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"  # vLLM's own ranges, forward included
        # the hidden-state cache shares the KV memory: as much again for it, the same tokens held
        kv_bytes = self.sizes.kv_cache_bytes * case.kv_cache_scale
        kv_bytes += self.hidden_bytes(self.sizes.kv_cache_bytes) if case.capture else 0
        server = VllmServer(
            self.model,
            tmp,
            args=args,
            kv_cache_bytes=kv_bytes,
            max_model_len=self.sizes.max_model_len,
            block_size=BLOCK_SIZE,
            dtype=self.sizes.dtype,
            env=env,
            python=python,
            startup_s=SERVER_START_S,
        )
        try:
            server.start()
            engine_pid = server.proc.pid if server.proc is not None else None
            with self.lmdb_reads(case, daemon, run_name, engine_pid):
                yield server, metrics_url
        finally:
            server.stop()
            if daemon is not None:
                daemon.stop()
                self.daemons.pop(run_name, None)
            if lmcache is not None:
                lmcache.stop()
            # its own arena only: other servers may still be running
            remove_arena(self.shm(run_name))
            # the stored KV (a preallocated LMDB file is its whole budget): keep the logs only
            for heavy in (tmp / "lmdb", tmp / "kvtierd" / "lmdb", tmp / "example-storage"):
                shutil.rmtree(heavy, ignore_errors=True)

    def scale_lmdb_disk(self, prefill_s_per_token: float) -> None:
        """lmdb's disk below an arena, from now: a GPU node's NVMe scaled to this machine's
        prefill time a token (benchmarks/gpu_ratio.py)."""
        self.lmdb_disk = node_scaled_disk(prefill_s_per_token, self.kv_per_token)

    def page_cache_dropper(self, case: Case) -> PageCacheDropper | None:
        """On the GPU-ratio model, what a server keeps below its arena is read from the disk."""
        daemon = self.daemons.get(case.name)
        if not (self.sizes.gpu_ratio and case.below and daemon):
            return None
        return PageCacheDropper(daemon.lmdb_path / "data.mdb")

    @contextmanager
    def lmdb_reads(
        self, case: Case, daemon: Kvtierd | None, run_name: str, engine_pid: int | None
    ) -> Iterator[None]:
        """On the GPU-ratio model, lmdb below an arena (lmdb-backed, and object-backed's lmdb)
        is read at ``lmdb_disk`` from now (starts not throttled) until the server stops, by
        both its readers: kvtierd (promotions) and the engine's processes, which load hits
        straight from lmdb's map (``lmdb_loads``). The embedded server's lmdb is not
        throttled: its arena holds the working set."""
        pid = daemon.pid if daemon is not None else None
        if not (self.sizes.gpu_ratio and case.below and daemon is not None and pid):
            yield
            return
        readers = [pid, *process_tree(engine_pid)]
        with reads_throttled(daemon.lmdb_path, self.lmdb_disk, readers) as said:
            self.lmdb_throttles[run_name] = said
            log.info("%s: lmdb %s", run_name, said)
            yield

    def close(self) -> None:
        if self.moto is not None:
            self.moto.stop()
        for path in self.shm_paths:
            remove_arena(path)
