"""How far the feedback stream has read, as a time: the join closes windows by it.

A window closes when every event produced before its deadline has been read, not when
the clock passes it. By the clock, a worker behind a backlog (restarted, or reading one
topic faster than the other) called trajectories missing that were still waiting to be
read, and dead-lettered their feedback as unjoinable: the fault suite lost 7,323 samples
that way. Like a Flink watermark: the minimum, over the partitions a worker reads, of
the time of the last event it processed there, where a partition read to its end counts
as the clock's time (an idle partition holds nothing back).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from typing import Generic, TypeVar

Partition = TypeVar("Partition", bound=Hashable)


class StreamTime(Generic[Partition]):
    """Per partition: the next offset to process and the timestamp of the last event
    processed (None until one is)."""

    def __init__(self) -> None:
        self.read: dict[Partition, tuple[int, float | None]] = {}

    def starts_at(self, partition: Partition, offset: int) -> None:
        """Where a partition is read from (its committed offset), until an event is processed
        there: a place asked again moves it on (seen with two workers: a place taken while a
        rebalance gave the partition to the other worker, which then read and committed past it,
        held the stream's time back for good once the partition came back). A partition
        already processed keeps its place."""
        next_offset, last = self.read.get(partition, (offset, None))
        if last is None:
            self.read[partition] = (max(next_offset, offset), None)

    def processed(self, partition: Partition, offset: int, timestamp: float) -> None:
        """The event at `offset` (a partition's events come in order) was processed."""
        self.read[partition] = (offset + 1, timestamp)

    def forget(self, partitions: Iterable[Partition]) -> None:
        """Partitions taken away: another worker reads them now, and may give them back later."""
        for partition in partitions:
            self.read.pop(partition, None)

    def unplaced(self, ends: Mapping[Partition, int | None]) -> list[Partition]:
        """Partitions whose place to ask for: not known yet, or behind their end with nothing
        processed since they were placed."""
        return [p for p, end in ends.items() if p not in self.read
                or self.read[p][1] is None and (end is None or self.read[p][0] < end)]

    def at(self, now: float, ends: Mapping[Partition, int | None]) -> float:
        """The stream's time over the partitions read (`ends`: each one's end offset, None
        if not known yet): -inf while any lagging partition's place is unknown."""
        time = now
        for partition, end in ends.items():
            next_offset, last = self.read.get(partition, (None, None))
            if end is None or next_offset is None:
                return -math.inf
            if next_offset >= end:
                continue  # read to its end: nothing older waits there
            if last is None:
                return -math.inf  # events wait there, and how old they are is not known until one is read
            time = min(time, last)
        return time
