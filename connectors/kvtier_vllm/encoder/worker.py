"""The encoder-cache connector's worker side: encoder outputs copied between vLLM's encoder
cache and the arena slots the scheduler side leased or reserved, or read from lmdb's map where
it leased them there (`kvtier_vllm.shared.lmdb_reads`, verified as they are read).

Every worker reads the hits (each holds the whole output); only the first tensor-parallel rank
writes, since every rank computes the same output. A read is checked against the slots'
generations once copied: a slot reused meanwhile (its daemon restarted) makes a load error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvtier.client import ArenaAtPath, ArenaMemory
from kvtier.core.errors import KVTierError
from kvtier.core.keys import ChunkKey
from kvtier.core.protocol import SlotRef, in_lmdb
from kvtier_vllm.encoder.metadata import ECReport, ECStepPlan, ItemSlots
from kvtier_vllm.shared.copies import copies_for
from kvtier_vllm.shared.lmdb_reads import LmdbReads

log = logging.getLogger(__name__)


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


class EncoderCacheWorker:
    def __init__(self, device: torch.device, writes: bool) -> None:
        self.device = device
        self.writes = writes
        self.copies = copies_for(device)
        """Pins the arena for a CUDA device (cudaHostRegister): parts copy at DMA speed."""
        self._arena: ArenaAtPath | None = None
        self._pinned: ArenaMemory | None = None
        self._lmdb = LmdbReads()
        self._plan = ECStepPlan()
        self._report = ECReport()
        self._said: set[str] = set()

    def bind(self, plan: ECStepPlan) -> None:
        self._plan = plan
        self._report = ECReport(step=plan.step)

    def _memory(self) -> ArenaMemory:
        path = Path(self._plan.arena_path)
        if self._arena is None or self._arena.path != path:
            self.close()
            self._arena = ArenaAtPath(path, populate=False)
        memory = self._arena.current()
        if memory is not self._pinned:  # mapped anew (a restarted daemon's file)
            self.copies.attach(torch.frombuffer(memory.view(0, memory.size), dtype=torch.uint8))
            self._pinned = memory
        return memory

    # -- loads -------------------------------------------------------------------------------

    def load(self, encoder_cache: dict[str, torch.Tensor]) -> None:
        """Read this step's hits into ``encoder_cache``. vLLM needs each one there: one that
        cannot be read is filled with zeros and reported, and its requests fail."""
        started = time.perf_counter()
        below = [ChunkKey(r.key) for s in self._plan.loads for r in s.refs if in_lmdb(r)]
        self._lmdb.read_ahead(self._plan.lmdb_path, below)
        for slots in self._plan.loads:
            if slots.identifier in encoder_cache:
                self._report.loaded.add(slots.identifier)
                continue
            try:
                tensor = self._read(slots)
            except Exception:  # never let vLLM find the item missing: it would stop the engine
                log.exception("kvtier: reading encoder output %s failed", slots.identifier)
                tensor = None
            if tensor is None:
                self._report.load_failed.add(slots.identifier)
                shape = (slots.rows, slots.layout.width)
                tensor = torch.zeros(shape, dtype=self._dtype(slots), device=self.device)
            else:
                self._report.loaded.add(slots.identifier)
                self._report.loaded_bytes += slots.nbytes
            encoder_cache[slots.identifier] = tensor
        self._report.failed_chunks += self._lmdb.take_failed()
        self._report.load_seconds += time.perf_counter() - started

    @staticmethod
    def _dtype(slots: ItemSlots) -> torch.dtype:
        return _torch_dtype(slots.layout.dtype)

    def _read(self, slots: ItemSlots, device: torch.device | None = None) -> torch.Tensor | None:
        """The stored output on ``device`` (the worker's), or None where a slot changed while
        it was read, or a part leased in lmdb could not be read from it whole. Each part is
        copied once (`_copy_parts`, `_copy_parts_to_device`)."""
        arena = None
        if not all(map(in_lmdb, slots.refs)):
            try:
                arena = self._memory()
            except KVTierError as exc:
                self._say("arena", f"kvtier: encoder outputs cannot be read: {exc}")
                return None
        layout = slots.layout
        out = torch.empty(
            len(slots.refs) * layout.part_bytes, dtype=torch.uint8, device=device or self.device
        )  # whole parts: one in lmdb is read whole, its padding too
        if out.device.type == "cpu":
            read = self._copy_parts(slots, arena, _bytes(out))
        else:
            read = self._copy_parts_to_device(slots, arena, out)
        if not read:
            return None
        _landed(out)  # the bytes read are those the generations below vouch for
        if arena is not None and not all(
            in_lmdb(ref) or arena.is_current(ref.slot, ref.generation) for ref in slots.refs
        ):
            self._say("reused", "kvtier: an encoder output's slot was reused while read")
            return None
        raw = out[: slots.rows * layout.row_bytes]
        return raw.view(self._dtype(slots)).view(slots.rows, layout.width)

    def _copy_parts(self, slots: ItemSlots, arena: ArenaMemory | None, out: memoryview) -> bool:
        """Whether every part was copied into ``out`` (host memory), each by one memcpy: from
        its arena slot, or out of lmdb's map where it was verified (one read transaction for
        the output)."""
        with self._lmdb.holding():
            for ref, start, used in _parts(slots):
                if in_lmdb(ref):
                    whole = out[start : start + slots.layout.part_bytes]
                    if not self._from_lmdb(ref, whole, used, in_place=True):
                        return False
                else:
                    assert arena is not None
                    out[start : start + used] = arena.view(ref.offset, used)
        return True

    def _copy_parts_to_device(
        self, slots: ItemSlots, arena: ArenaMemory | None, out: torch.Tensor
    ) -> bool:
        """Whether every part was copied to ``out`` on a device: from its arena slot straight,
        at the arena's pinned bandwidth where the KV connector registered it with CUDA; from
        lmdb, verified into host memory and copied from there."""
        host = None
        for ref, start, used in _parts(slots):
            if in_lmdb(ref):
                if host is None:
                    host = torch.empty(len(out), dtype=torch.uint8)
                whole = _bytes(host[start : start + slots.layout.part_bytes])
                if not self._from_lmdb(ref, whole, used, in_place=False):
                    return False
                src = host[start : start + used]
            else:
                assert arena is not None
                src = torch.frombuffer(arena.view(ref.offset, used), dtype=torch.uint8)
            out[start : start + used].copy_(src, non_blocking=True)
        return True

    def _from_lmdb(self, ref: SlotRef, whole: memoryview, used: int, in_place: bool) -> bool:
        """Whether part ``ref`` was read from lmdb into ``whole`` (a part's bytes), verified:
        with ``in_place`` (in `LmdbReads.holding`), verified in lmdb's map and its ``used``
        bytes copied out of it before the next read; otherwise decoded into ``whole``."""
        read = self._lmdb.read(
            self._plan.lmdb_path, ChunkKey(ref.key), len(whole), lambda: whole, in_place
        )
        if read is None:
            return False
        if read is not whole:
            whole[:used] = read[:used]
        return True

    # -- stores and checks -------------------------------------------------------------------

    def save(self, encoder_cache: dict[str, torch.Tensor], identifier: str) -> None:
        """An output the encoder computed: written where the scheduler reserved slots for it,
        compared where its hit was sampled."""
        for slots in self._plan.checks:
            if slots.identifier == identifier:
                stored = self._read(slots, torch.device("cpu"))
                if stored is not None:
                    computed = encoder_cache[identifier]
                    self._report.errors[identifier] = relative_error(stored, computed)
        if not self.writes:
            return
        for slots in self._plan.stores:
            if slots.identifier == identifier:
                if self._write(slots, encoder_cache[identifier]):
                    self._report.stored.add(identifier)
                    self._report.stored_bytes += slots.nbytes
                else:
                    self._report.store_failed.add(identifier)

    def _write(self, slots: ItemSlots, output: torch.Tensor) -> bool:
        layout = slots.layout
        shape = (slots.rows, layout.width)
        if tuple(output.shape) != shape or output.dtype != self._dtype(slots):
            self._say(
                "shape",
                f"kvtier: encoder outputs of shape {tuple(output.shape)} {output.dtype} are not "
                f"stored: this namespace holds [rows, {layout.width}] {layout.dtype} (set "
                "ec_connector_extra_config.output_width to the encoder's width)",
            )
            return False
        try:
            arena = self._memory()
        except KVTierError as exc:
            self._say("arena", f"kvtier: encoder outputs cannot be written: {exc}")
            return False
        # each part straight from the device into its slot, all queued before one wait
        raw = output.detach().contiguous().view(torch.uint8).reshape(-1)
        for part, ref in enumerate(slots.refs):
            rows = layout.rows_of(part, slots.rows)
            start = part * layout.part_bytes
            dest = torch.frombuffer(arena.view(ref.offset, layout.part_bytes), dtype=torch.uint8)
            used = rows * layout.row_bytes
            dest[:used].copy_(raw[start : start + used], non_blocking=True)
            dest[used:] = 0  # the last part's padding: every copy of an item is the same bytes
        _landed(raw)  # in the slots before the scheduler side commits them
        return True

    def report(self) -> ECReport:
        """This step's report: items planned and never saved were not stored."""
        report = self._report
        if self.writes:
            report.store_failed |= {
                s.identifier for s in self._plan.stores if s.identifier not in report.stored
            }
        self._plan, self._report = ECStepPlan(), ECReport()
        return report

    def _say(self, what: str, message: str) -> None:
        if what not in self._said:
            self._said.add(what)
            log.error(message)

    def close(self) -> None:
        self._lmdb.close()
        self.copies.detach()
        self._pinned = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None


def _landed(tensor: torch.Tensor) -> None:
    """Wait for the copies queued on the tensor's device (none to wait for on the CPU)."""
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


def _parts(slots: ItemSlots) -> Iterator[tuple[SlotRef, int, int]]:
    """Each part's ref, where it starts in the output's whole parts, and its bytes in use."""
    layout = slots.layout
    for part, ref in enumerate(slots.refs):
        yield ref, part * layout.part_bytes, layout.rows_of(part, slots.rows) * layout.row_bytes


def _bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU byte tensor's memory, to read into."""
    return tensor.numpy().data


def relative_error(stored: torch.Tensor, computed: Any) -> float:
    """Norm of the difference over the computed output's norm."""
    computed = computed.detach().to("cpu", torch.float32)
    stored = stored.to(torch.float32)
    if stored.shape != computed.shape:
        return float("inf")
    scale = float(torch.linalg.vector_norm(computed)) or 1.0
    return float(torch.linalg.vector_norm(stored - computed)) / scale
