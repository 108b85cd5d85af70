"""A CPU twin of the executor's CUDA stage streams: the CUDA code paths, on the CPU.

Why: with stage streams the executor takes other paths than on a CPU (each stage's work
inside ``streams.on(stage)``, a batch of backwards run one stage at a time), and an op
enqueued on the wrong stream races on a GPU without failing anywhere else. On the H100, a
failed backward left ``found_inf`` at 1 (issue 22): the CUDA path of a batched backward
never dropped the batch, and discards ran on the caller's stream, unordered with the stage
stream's adds. :class:`StreamTwin` reports ``cuda`` and ``separate`` True so the executor
takes the CUDA paths, runs everything in program order on the CPU, and records which stage
stream is current, so a test can assert that every op on a stage's state ran on that stage's stream.

Use: ``monkeypatch.setattr(assemble, "make_streams", twin_factory(box))`` (``assemble``:
``engine.runtime.assemble``, where a local build makes its streams); the twin of the
next pipeline built lands in ``box[0]``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from engine.runtime.exec.streams import StageStreams


class StreamTwin(StageStreams):
    """``cuda=True`` without a GPU: ``on(s)`` only records that stage ``s``'s stream is
    current; events are tokens; waits and joins do nothing (the CPU runs in order)."""

    def __init__(self, stages: list[int]) -> None:
        super().__init__(stages, None)
        self.cuda = True
        self.separate = True  # each stage's work runs "on" its own stream, as on a GPU
        self.current: int | None = None  # None: the caller's stream
        self.log: list[tuple[str, int | None]] = []

    @contextlib.contextmanager
    def _on(self, stage: int) -> Iterator[None]:
        outer, self.current = self.current, stage
        try:
            yield
        finally:
            self.current = outer

    def on(self, stage: int) -> contextlib.AbstractContextManager[Any]:
        return self._on(stage)

    def record(self, stage: int) -> Any:
        return ("event", stage)

    def wait(self, stage: int, event: Any, tensor: Any = None) -> None:
        pass

    def wait_caller(self) -> None:
        pass

    def join(self) -> None:
        pass

    def to_caller(self, tensor: Any, stage: int) -> None:
        pass

    def shared(self, tensor: Any, stage: int) -> None:
        pass

    def from_caller(self, tensors: Any, stages: Any) -> None:
        pass

    def note(self, what: str) -> None:
        """Record ``what`` happening on the current stream."""
        self.log.append((what, self.current))


def twin_factory(box: list[StreamTwin]) -> Callable[..., StreamTwin]:
    def make(stages: list[Any], want: Any = None, l2: bool = False,
             captured_async: bool = False) -> StreamTwin:
        twin = StreamTwin([st.index for st in stages])
        box.append(twin)
        return twin

    return make
