"""TensorBoard scalars in a run directory, local or on an object store, written with
tensorboard's own record format (no TensorFlow)."""

from __future__ import annotations

import io
import itertools
import os
import socket
import time

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.record_writer import RecordWriter

from effattn_jax import storage

ROLL_BYTES = 4 << 20  # past this, a flush starts the next event file
FLUSH_SECS = 30.0
_FILES = itertools.count()


class ScalarWriter:
    """One event stream per launch, written by process 0 only (`enabled=False` elsewhere).

    An object store has no append, so the launch's current event file is rewritten whole at each
    flush (at most every FLUSH_SECS, and when asked); past ROLL_BYTES a new file is begun, so a
    flush never rewrites more than that. TensorBoard reads the files of a directory in name order."""

    def __init__(self, logdir, enabled: bool = True):
        self._dir = storage.path(logdir) if enabled else None
        self._buffer: io.BytesIO | None = None
        if enabled:
            self._dir.mkdir(parents=True, exist_ok=True)
            self._begin()

    def _begin(self) -> None:
        stamp = f"{time.time():010.0f}.{socket.gethostname()}.{os.getpid()}.{next(_FILES)}"
        self._file = self._dir / f"events.out.tfevents.{stamp}"
        self._buffer = io.BytesIO()
        self._records = RecordWriter(self._buffer)
        self._add(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        self.flush()

    def _add(self, event: event_pb2.Event) -> None:
        self._records.write(event.SerializeToString())

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self._buffer is None:
            return
        summary = summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()]
        )
        self._add(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))
        if time.monotonic() - self._flushed > FLUSH_SECS:
            self.flush()

    def flush(self) -> None:
        if self._buffer is None:
            return
        storage.write_atomic(self._file, self._buffer.getvalue())
        self._flushed = time.monotonic()
        if self._buffer.tell() > ROLL_BYTES:
            self._begin()

    def close(self) -> None:
        self.flush()
        self._buffer = None


def read_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """All scalars of a run's event files: tag -> [(step, value)], in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: sorted((e.step, e.value) for e in acc.Scalars(tag)) for tag in acc.Tags()["scalars"]}
