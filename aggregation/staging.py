"""Updates moved to the aggregation device through pinned host buffers, one copy ahead of the adds.

A received update lives in the record's bytes, in pageable host memory. ``tensor.to("cuda",
non_blocking=True)`` from pageable memory is not asynchronous: CUDA stages it through its own
pinned buffer while the host waits, and the add of one update cannot overlap the copy of the next.
``DeviceStager.pipeline`` does what the issue asks for instead, with two slots (each one pinned
host buffer and one device buffer, sized to the largest update seen, so O(model size)):

1. the host packs update ``k + 1``'s tensors into the free pinned slot (a CPU memcpy, after the
   copy that last read that slot has finished);
2. a side copy stream copies the slot to its device buffer, non-blocking, after the adds that last
   read that device buffer (an event on the compute stream), and records a "copied" event;
3. when update ``k`` is handed to the caller, the compute stream waits for its "copied" event
   (on the device, not the host), and the caller's adds are queued behind that; when the caller
   asks for the next update, a "consumed" event is recorded on the compute stream for the slot.

Update ``k + 1`` is staged before update ``k`` is handed over, so its copy runs while the caller
checks and adds ``k`` (a norm check that reads a value back to the host syncs on ``k``'s work only).
The compute stream's wait for ``k + 1``'s copy is queued only when ``k + 1`` is handed over: queued
at staging, it sat in front of ``k``'s adds, and every norm check of ``k`` waited for the copy of
``k + 1`` as well (found on an H200: no overlap at all).
The device operations go through a small ``ops`` object (``CudaOps`` on CUDA); the tests drive the
same code on CPU with operations that complete only when waited for, so a missing wait shows up as
a wrong sum. On CPU the aggregator does not stage at all (the kernels read the records' bytes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ._errors import AggregationError

ALIGN = 256  # bytes: every tensor of a slot starts at a multiple (any dtype's alignment, CUDA's 256)


class CudaOps:
    """The stager's device operations on one CUDA device: pinned host buffers, a side copy stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def event(self) -> Any:
        return torch.cuda.Event()

    def host_wait(self, event: Any) -> None:
        event.synchronize()

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, after: Any, done: Any) -> None:
        """``dst.copy_(src)`` on the copy stream once ``after`` has happened; ``done`` recorded after it."""
        self.copy_stream.wait_event(after)
        with torch.cuda.stream(self.copy_stream):
            dst.copy_(src, non_blocking=True)
            done.record(self.copy_stream)

    def compute_wait(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def compute_record(self, event: Any) -> None:
        event.record(torch.cuda.current_stream(self.device))


@dataclasses.dataclass
class _Slot:
    host: torch.Tensor
    dev: torch.Tensor
    copied: Any  # event: the host -> device copy of this slot's update has finished
    consumed: Any  # event: the adds queued for this slot's update have finished


class DeviceStager:
    """Parsed updates (``aggregation.codecs.Parsed``) moved onto ``device`` two slots at a time.

    ``ops``: the device operations (default ``CudaOps(device)``; the tests pass their own).
    """

    def __init__(self, device: torch.device | str, slots: int = 2, ops: Any = None) -> None:
        if not isinstance(slots, int) or slots < 2:
            raise AggregationError(f"staging slots must be an integer >= 2. Found {slots!r}.")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # as tensors name it: "cuda" is "cuda:N"
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.ops = ops if ops is not None else CudaOps(self.device)
        self._slots: list[_Slot | None] = [None] * slots
        self._next = 0

    @property
    def slot_bytes(self) -> int:
        """Bytes of each slot's host (and device) buffer: 0 before the first update."""
        return max((s.host.numel() for s in self._slots if s is not None), default=0)

    def _slot(self, i: int, nbytes: int) -> _Slot:
        slot = self._slots[i]
        if slot is None or slot.host.numel() < nbytes:
            if slot is not None:  # its last copy and adds must be over before the buffers go
                self.ops.host_wait(slot.copied)
                self.ops.host_wait(slot.consumed)
            size = max(nbytes, ALIGN)
            # fresh events: waiting on an event never recorded passes at once (CUDA's rule)
            slot = _Slot(self.ops.host_buffer(size), self.ops.device_buffer(size), self.ops.event(), self.ops.event())
            self._slots[i] = slot
        return slot

    def stage(self, parsed: Any) -> tuple[Any, int]:
        """Start moving ``parsed`` to the device; returns (its device copy, the slot it holds). The
        copy is ordered before anything queued on the compute stream after this call."""
        staged, i, copied = self._start(parsed)
        if copied is not None:
            self.ops.compute_wait(copied)
        return staged, i

    def _start(self, parsed: Any) -> tuple[Any, int, Any]:
        """``stage`` without the compute stream's wait: also returns the event it must wait for
        before it reads the device copy (None: nothing was copied)."""
        i = self._next
        self._next = (i + 1) % len(self._slots)
        if not dataclasses.is_dataclass(parsed) or not isinstance(getattr(parsed, "tensors", None), dict):
            return parsed, i, None  # a duck-typed source: its own ``add_into`` moves what it reads
        layout, end = [], 0
        for name, t in parsed.tensors.items():
            if t.device == self.device and t.device.type != "cpu":
                continue  # already there (a caller's own device tensor); a CPU "device" is the tests' simulation
            if t.device.type != "cpu" or not t.is_contiguous():
                t = t.detach().to("cpu").contiguous()
            nbytes = t.numel() * t.element_size()
            layout.append((name, t, end, nbytes))
            end += -(-nbytes // ALIGN) * ALIGN
        if not layout:
            return parsed, i, None
        slot = self._slot(i, end)
        self.ops.host_wait(slot.copied)  # the slot's previous copy has read its host buffer
        for _, t, off, nbytes in layout:
            if nbytes:
                slot.host[off:off + nbytes].copy_(t.reshape(-1).view(torch.uint8))
        self.ops.copy_async(slot.dev[:end], slot.host[:end], slot.consumed, slot.copied)
        tensors = dict(parsed.tensors)
        for name, t, off, nbytes in layout:
            tensors[name] = slot.dev[off:off + nbytes].view(t.dtype) if nbytes else torch.empty(0, dtype=t.dtype,
                                                                                                   device=self.device)
        return dataclasses.replace(parsed, tensors=tensors), i, slot.copied  # ``host`` arrays stay (small host reads)

    def consumed(self, i: int) -> None:
        """The caller has queued every operation that reads slot ``i``'s update."""
        slot = self._slots[i]
        if slot is not None:
            self.ops.compute_record(slot.consumed)

    def pipeline(self, batch: Iterable[Any]) -> Iterator[Any]:
        """Each update of ``batch`` on the device, in order; the next one is staged before one is
        handed over. Use each before asking for the next (its slot is reused two updates later)."""
        pending: tuple[Any, int, Any] | None = None
        for parsed in batch:
            staged = self._start(parsed)
            if pending is not None:
                yield self._hand_over(*pending)
                self.consumed(pending[1])
            pending = staged
        if pending is not None:
            yield self._hand_over(*pending)
            self.consumed(pending[1])

    def _hand_over(self, staged: Any, i: int, copied: Any) -> Any:
        if copied is not None:  # what the caller queues from now on reads the device copy
            self.ops.compute_wait(copied)
        return staged
