"""Streams and events for the coordinator's copies, with a CPU stand-in.

On CUDA the coordinator copies on side streams and orders them with events. On the CPU every
copy runs at once, but an event may report completion only after a number of coordinator steps
(``cpu_event_delay_steps``) so that tests exercise the states in which a copy is still in flight.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["CopyEvent", "StreamSet"]


class CopyEvent:
    """Completion of copies enqueued on a stream."""

    def __init__(self, streams: "StreamSet", cuda_event: "torch.cuda.Event | None") -> None:
        self._streams = streams
        self._cuda_event = cuda_event
        self._ready_step = streams.step + streams.cpu_event_delay_steps

    def query(self) -> bool:
        if self._cuda_event is not None:
            return self._cuda_event.query()
        return self._streams.step >= self._ready_step

    def wait_on_current_stream(self) -> None:
        """Order later work of the current stream after these copies (no host wait)."""
        if self._cuda_event is not None:
            self._cuda_event.wait(torch.cuda.current_stream())
        else:
            self._ready_step = min(self._ready_step, self._streams.step)

    def synchronize(self) -> None:
        """Block the host until the copies are done."""
        if self._cuda_event is not None:
            self._cuda_event.synchronize()
        else:
            self._ready_step = min(self._ready_step, self._streams.step)


class StreamSet:
    """The coordinator's side streams on ``device`` (no-ops on the CPU).

    Attributes:
        step: coordinator step counter (drives CPU event completion).
        producer: the stream the scheduler runs forward passes on (SGLang's overlap scheduler
            hands it over); table updates that change what an in-flight forward reads wait on it.
    """

    def __init__(self, device: torch.device, cpu_event_delay_steps: int = 0) -> None:
        self.is_cuda = device.type == "cuda"
        if self.is_cuda and device.index is None:
            # An explicit index keeps torch.cuda.current_stream() off its slow device lookup.
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.cpu_event_delay_steps = cpu_event_delay_steps
        self.step = 0
        self.producer: "torch.cuda.Stream | None" = None
        if self.is_cuda:
            self.staging = torch.cuda.Stream(device=device)
            self.backup = torch.cuda.Stream(device=device)
            self.promotion = torch.cuda.Stream(device=device)
            # Reused for ordering: a wait takes the event's state when it is enqueued.
            self._order_events = (torch.cuda.Event(), torch.cuda.Event())
        else:
            self.staging = self.backup = self.promotion = None

    @contextlib.contextmanager
    def on(self, stream: "torch.cuda.Stream | None") -> Iterator[None]:
        """Run the block on ``stream``, after the current stream's and the producer's work."""
        if stream is None:
            yield
            return
        current = torch.cuda.current_stream(self.device)
        after_current, after_producer = self._order_events
        after_current.record(current)
        stream.wait_event(after_current)
        if self.producer is not None:
            after_producer.record(self.producer)
            stream.wait_event(after_producer)
        torch.cuda.set_stream(stream)
        try:
            yield
        finally:
            torch.cuda.set_stream(current)

    def record(self, stream: "torch.cuda.Stream | None") -> CopyEvent:
        if stream is None:
            return CopyEvent(self, None)
        event = torch.cuda.Event()
        event.record(stream)
        return CopyEvent(self, event)

    def wait_for_producer(self) -> None:
        """Order the current stream after the forward pass in flight (before changing its tables)."""
        if self.is_cuda and self.producer is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.producer)

    def keep_alive(self, tensor: torch.Tensor, stream: "torch.cuda.Stream | None") -> None:
        """Keep a temporary alive until ``stream`` has consumed it."""
        if stream is not None and tensor.is_cuda:
            tensor.record_stream(stream)
