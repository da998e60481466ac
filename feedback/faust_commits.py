"""faust's Kafka consumer with its commit bookkeeping corrected in the two places where, in
the fault suite, it kept the broker's committed offsets behind what the worker had processed
(faust-streaming 0.15): the backlog then never drained as on-call, the supervisor and
`liverl down` see it, and a restarted worker was "not caught up" for minutes."""

from __future__ import annotations

import math
from typing import Any

from faust.transport.drivers import aiokafka as faust_kafka
from faust.utils.functional import consecutive_numbers

from liverl.observability import setup_logging

logger = setup_logging("feedback")


class TruthfulCommitConsumer(faust_kafka.Consumer):
    async def _commit_offsets(self, offsets: Any, start_new_transaction: bool = True) -> bool:
        """faust records offsets as committed even when the commit failed (it swallows
        aiokafka's "the group has already rebalanced") and never sends them again: the broker
        had a partition at 11,706 for minutes while the worker had processed it to 18,007.
        Here a failed commit leaves faust's record as it was, so the next commit sends those
        offsets again (a broker that acknowledged a commit and lost it would look the same)."""
        before = {tp: self._committed_offset[tp] for tp in offsets}
        if await super()._commit_offsets(offsets, start_new_transaction):
            return True
        self._committed_offset.update(before)
        if assigned := [f"{tp.topic}:{tp.partition}" for tp in offsets if tp in self.assignment()]:
            logger.warning("offsets on %s not committed: sent again at the next commit", assigned)
        return False

    def _new_offset(self, tp: Any) -> int | None:
        """The offset to commit on `tp`: one past the run of offsets acked that starts at the
        last commit. faust's own adds the offsets of the gaps it recorded, listing an offset
        twice when it is both acked and in a gap, and its run-finding then ends each run at the
        repeat: with many repeats the commit moved one offset per commit (robinhood/faust#625),
        a restarted worker at the end of its partitions while its commits crawled about 4
        offsets in 12 s. Never past an offset delivered and not acked."""
        acked = self._acked[tp]
        if not acked:
            return None
        # Gaps faust recorded are not done: liverl's topics have no holes (no compaction, no
        # transactions), so a gap is offsets faust skipped (a stale fetch after a rebalance's
        # seek, its re-read then dropped as already read) and never processed. Counted done,
        # a kill lost them: fault run 6, 16 samples, once the commit no longer crawled. A
        # commit stops before them; a worker that never reads them is restarted by the
        # backlog watch and reads them.
        self._gap[tp].clear()
        done = sorted(set(acked))
        committed = self._committed_offset[tp]
        # As faust, one offset missing at the head is a hole in the log (a seek records no gap
        # for it)... unless it was delivered and is still in flight (faust-streaming#606). Not in
        # flight: a delivery faust skipped unacked during a rebalance, or of an earlier generation,
        # whose offset came again and is done (the two-worker test ended with 4 offsets never
        # committed after a rebalance: offset 5 acked, and a skipped delivery of it unacked).
        generation, finished = self.app.consumer_generation_id, set(done)
        in_flight = min((m.offset for m in self._unacked_messages if m.tp == tp and m.generation_id == generation
                         and m.offset >= (committed or 0) and m.offset not in finished), default=math.inf)
        run = [offset for offset in next(consecutive_numbers(done)) if offset < in_flight]
        if not run or committed and run[0] - committed > 1:
            acked[:] = done
            return None
        acked[:] = done[len(run):]
        self._acked_index[tp].difference_update(run)
        return run[-1] + 1

    def held_at(self, tp: Any) -> int | None:
        """The offset the commit on `tp` is held at while offsets past it are acked and none
        before them is in flight: one the worker never got (None: not held)."""
        committed, acked = self._committed_offset.get(tp), self._acked.get(tp)
        if committed is None or not acked or min(acked) <= committed + 1:  # +1: as _new_offset
            return None
        if any(m.tp == tp and committed <= m.offset < min(acked) for m in self._unacked_messages):
            return None
        return committed

    def count_done(self, tp: Any, start: int, end: int) -> None:
        """Offsets [start, end) of `tp` hold no record (a hole in the log): nothing to process,
        so the commit may pass them."""
        offsets = [offset for offset in range(start, end) if offset not in self._acked_index[tp]]
        self._acked[tp].extend(offsets)
        self._acked_index[tp].update(offsets)


class Transport(faust_kafka.Transport):
    Consumer = TruthfulCommitConsumer
