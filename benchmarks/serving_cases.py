"""The serving benchmark's settings (model sizes, workload, tiers), its servers (cases) and what
each runs (plans), its modes and targets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from benchmarks.harness.sizes import GiB, MiB
from benchmarks.harness.targets import Target
from tests.fixtures import engines

BLOCK_SIZE = 32
ROUNDS = 4
USERS = 8
WARMUP = ROUNDS  # one session of its own before a server's first level
ARENA_BYTES = 768 * MiB
LMDB_BUDGET = 1 * GiB
BUCKET = "kvtier-serving"
SPEC_TOKENS = 3
SERVER_START_S = 600.0
"""A server's start on a 2-core machine others share can take minutes."""
CAPTURE_LAYERS = [2, 6, 9]
CAPTURE = engines.capture_config(CAPTURE_LAYERS)
"""EAGLE-3's auxiliary layers of a 12-layer target: low, middle and high."""
HEADLINE_CONCURRENCY = 4
PROFILE_USERS = 4
PROFILE_ROUNDS = 2
PROFILE_ANSWER_TOKENS = 8

TARGETS: dict[str, Target] = {
    "throughput_vs_vllm_alone": (">=", 2.0),
    "ttft_p50_vs_vllm_alone": ("<=", 0.25),
    "ttft_p99_vs_vllm_alone": ("<=", 0.5),
    "no_reuse_throughput_vs_vllm_alone": (">=", 0.98),
    "no_reuse_throughput_vs_vllm_alone_embedded": (">=", 0.98),
    "spec_throughput_vs_vllm_alone_spec": (">=", 2.0),
    "throughput_vs_example_connector": (">=", 1.5),
    "lmdb_backed_vs_arena_backed": (">=", 0.9),
    "object_backed_vs_arena_backed": (">=", 0.75),
}
PAST_THE_ARENA = (
    "kvtier_sidecar",
    "kvtier_sidecar_lmdb",
    "kvtier_sidecar_lmdb_fp8",
    "kvtier_sidecar_lmdb_i8",
    "kvtier_sidecar_object",
    "kvtier_sidecar_obj_fp8",
    "vllm_more_hbm",
)


SERVERS = (
    "vllm",
    "kvtier_embedded",
    "kvtier_sidecar",
    "lmcache",
    "vllm_b",
    "example_connector",
    "offloading_connector",
    "vllm_spec",
    "kvtier_sidecar_spec",
    "kvtier_embedded_capture",
    *PAST_THE_ARENA[1:],
)


@dataclass(frozen=True)
class Mode:
    name: str
    concurrency: tuple[int, ...]
    no_reuse_cycles: int
    pairs: int
    """The GPU-ratio model's multi-round levels of each server beside vLLM alone's (0: one
    level per concurrency, the servers one after another)."""


QUICK = Mode("quick", (HEADLINE_CONCURRENCY,), 3, 3)
FULL = Mode("full", (1, 2, 4, 8), 12, 6)
NO_REUSE_REQUESTS = 8
NO_REUSE_BACKLOG = 4
"""Unmeasured requests right before each measured no-reuse level: its write-back backlog."""


@dataclass(frozen=True)
class Plan:
    """What one server runs, in order."""

    multi_round: bool = True
    profile: bool = False
    measure_prefill: bool = False
    """First the engine's prefill time per token (benchmarks/gpu_ratio.py)."""


@dataclass(frozen=True)
class Case:
    name: str
    label: str
    connector: str | None = None
    """None, "embedded", "sidecar", "example" or "offloading"."""
    spec: bool = False
    capture: bool = False
    """Capture hidden states (``extract_hidden_states``)."""
    below: str = ""
    """Past the arena (sidecar): "lmdb" (an arena of a quarter of the working set, lmdb the
    rest) or "object" (arena and lmdb a quarter each, the object store all)."""
    kv_cache_scale: int = 1
    """The KV cache over every other server's (``vllm_more_hbm``)."""
    codec: str = "none"
    """``lmdb.codec`` and ``object.codec`` below the arena."""
    load_policy: str = ""
    """The connector's ``load_policy`` (none given when empty)."""


VLLM = Case("vllm", "vLLM alone")
EMBEDDED = Case("kvtier_embedded", "kvtier embedded", "embedded")
SIDECAR = Case("kvtier_sidecar", "kvtier sidecar", "sidecar")
VLLM_B = Case("vllm_b", "vLLM alone (a second server)")
"""No-reuse only: one vLLM-alone server over another is the floor of what the figure resolves,
since each server started runs at a speed of its own (several per cent apart here)."""
NO_REUSE_CASES = {case.name: case for case in (VLLM, VLLM_B, EMBEDDED, SIDECAR)}
LMDB_BACKED = Case(
    "kvtier_sidecar_lmdb", "kvtier sidecar, arena 1/4, lmdb", "sidecar", below="lmdb"
)
LMDB_FP8_BACKED = Case(
    "kvtier_sidecar_lmdb_fp8",
    "kvtier sidecar, arena 1/4, lmdb in fp8",
    "sidecar",
    below="lmdb",
    codec="fp8",
)
LMDB_INT8_BACKED = Case(
    "kvtier_sidecar_lmdb_i8",
    "kvtier sidecar, arena 1/4, lmdb in int8",
    "sidecar",
    below="lmdb",
    codec="int8",
)
OBJECT_BACKED = Case(
    "kvtier_sidecar_object",
    "kvtier sidecar, arena 1/4, lmdb 1/4, S3",
    "sidecar",
    below="object",
)
OBJECT_FP8_BACKED = Case(
    "kvtier_sidecar_obj_fp8",
    "kvtier sidecar, arena 1/4, lmdb 1/4, S3, both in fp8",
    "sidecar",
    below="object",
    codec="fp8",
)
MORE_HBM = Case("vllm_more_hbm", "vLLM alone, 6x the KV cache", kv_cache_scale=6)
"""6 x 4,096 tokens: every user's history (16,384 tokens) with room for the batch."""


LMCACHE = Case("lmcache", "LMCache 0.5.6, multiprocess", "lmcache")


def every_case(profile: bool) -> list[tuple[Case, Plan]]:
    """The multi-round servers in the order they run; ``profile``: trace the sidecar's level."""
    return [
        (VLLM, Plan()),
        (EMBEDDED, Plan()),
        (SIDECAR, Plan(profile=profile)),
        (LMCACHE, Plan()),
        (Case("example_connector", "ExampleConnector", "example"), Plan()),
        (Case("offloading_connector", "OffloadingConnector", "offloading"), Plan()),
        (Case("vllm_spec", "vLLM alone + spec", spec=True), Plan()),
        (Case("kvtier_sidecar_spec", "kvtier sidecar + spec", "sidecar", spec=True), Plan()),
        (
            Case(
                "kvtier_embedded_capture",
                "kvtier embedded + hidden-state capture",
                "embedded",
                capture=True,
            ),
            Plan(),
        ),
        (LMDB_BACKED, Plan()),
        (LMDB_FP8_BACKED, Plan()),
        (LMDB_INT8_BACKED, Plan()),
        (OBJECT_BACKED, Plan()),
        (OBJECT_FP8_BACKED, Plan()),
        (MORE_HBM, Plan()),
    ]


# -- the GPU-ratio model (``--model gpu-ratio``) ---------------------------------------------

LOAD_POLICIES = ("always", "measured")
GPU_RATIO_TARGETS: dict[str, Target] = {
    "gpu_ratio_throughput_vs_vllm_alone": (">=", 1.3),
    "gpu_ratio_vs_lmcache": (">=", 1.1),
    "hit_ttft_vs_recompute_p90": ("<=", 1.0),
    "hit_ttft_vs_recompute_p90_lmdb": ("<=", 1.0),
    "hit_ttft_vs_recompute_p90_object": ("<=", 1.0),
    "gpu_ratio_no_reuse": (">=", 0.98),
}
HEADLINE_POLICY = "measured"
"""The policy whose servers the GPU-ratio targets judge, where the connector has policies."""


def with_policy(case: Case, policy: str) -> Case:
    return dataclasses.replace(
        case,
        name=f"{case.name}_{policy}",
        label=f"{case.label}, load_policy {policy}",
        load_policy=policy,
    )


def gpu_ratio_cases(policies: bool) -> list[tuple[Case, Plan]]:
    """vLLM alone, kvtier (embedded, sidecar, lmdb- and object-backed), each with every load
    policy where the connector has them, and LMCache."""
    kvtier = [EMBEDDED, SIDECAR, LMDB_BACKED, OBJECT_BACKED]
    if policies:
        kvtier = [with_policy(case, p) for case in kvtier for p in LOAD_POLICIES]
    return [
        (VLLM, Plan(measure_prefill=True)),
        *((case, Plan()) for case in kvtier),
        (LMCACHE, Plan()),
    ]


def headline_name(name: str, policies: bool) -> str:
    """The server the GPU-ratio targets judge for the case ``name``."""
    return f"{name}_{HEADLINE_POLICY}" if policies else name


def server_names(gpu_ratio: bool, policies: bool) -> tuple[str, ...]:
    """What ``--servers`` may name: the model's servers and the no-reuse phase's."""
    if not gpu_ratio:
        return SERVERS
    names = [case.name for case, _ in gpu_ratio_cases(policies)] + list(NO_REUSE_CASES)
    return tuple(dict.fromkeys(names))
