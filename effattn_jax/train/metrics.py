"""TensorBoard scalars written with tensorboard's own event writer (no TensorFlow)."""

from __future__ import annotations

import time
from pathlib import Path

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter


class ScalarWriter:
    """Writes on process 0 only (`enabled=False` elsewhere): one event stream per run."""

    def __init__(self, logdir: str | Path, enabled: bool = True):
        self._writer = EventFileWriter(str(logdir)) if enabled else None

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self._writer is None:
            return
        summary = summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()]
        )
        self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def read_scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """All scalars of a run's event files: tag -> [(step, value)], in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: sorted((e.step, e.value) for e in acc.Scalars(tag)) for tag in acc.Tags()["scalars"]}
