"""The feedback stream's commits (feedback/faust_commits.py): what the worker has done is
what it commits, in one commit, whatever faust recorded on the way."""

from collections import defaultdict
from types import SimpleNamespace

import pytest
from faust.transport.consumer import Consumer as FaustConsumer
from faust.types import TP
from intervaltree import IntervalTree

from feedback.faust_commits import TruthfulCommitConsumer

PARTITION = TP("liverl.feedback", 0)


def bookkeeping(committed: int, acked: list[int], gaps: list[tuple[int, int]],
                in_flight: tuple[int, ...] = ()) -> SimpleNamespace:
    """A consumer's commit records for one partition, as faust keeps them (`in_flight`:
    offsets delivered to the stream and not acked)."""
    return SimpleNamespace(_unacked_messages=[SimpleNamespace(tp=PARTITION, offset=o) for o in in_flight],
                           _acked=defaultdict(list, {PARTITION: list(acked)}),
                           _acked_index=defaultdict(set, {PARTITION: set(acked)}),
                           _gap=defaultdict(IntervalTree, {PARTITION: IntervalTree.from_tuples(gaps)}),
                           _committed_offset=defaultdict(lambda: None, {PARTITION: committed}))


def commits(new_offset, records: SimpleNamespace) -> list[int]:
    """The offsets successive commits send until there is nothing more to commit."""
    sent = []
    while (offset := new_offset(records, PARTITION)) is not None:
        sent.append(offset)
        records._committed_offset[PARTITION] = offset
    return sent


# After a rebalance faust recorded offsets 101-150 as a gap while the worker had processed and
# acked them too: every offset is done, twice over.
AFTER_A_REBALANCE = dict(committed=101, acked=list(range(101, 201)), gaps=[(102, 151)])


def test_offsets_both_acked_and_skipped_are_committed_at_once():
    assert commits(TruthfulCommitConsumer._new_offset, bookkeeping(**AFTER_A_REBALANCE)) == [201]


def test_faust_itself_crawls_one_offset_per_commit_there():
    """Why the override exists: faust 0.15 needs a commit (one per 2.8 s) per repeated offset."""
    sent = commits(FaustConsumer._new_offset, bookkeeping(**AFTER_A_REBALANCE))
    assert sent[-1] == 201 and len(sent) == 50


@pytest.mark.parametrize("acked, gaps, in_flight, expected", [
    (list(range(10, 20)), [], (), [20]),                 # a plain run
    ([10, 11, 12, 14, 15], [], (13,), [13]),             # an offset in flight holds the rest back...
    ([10, 11, 12, 14, 15], [], (), [13, 16]),            # ...one never delivered is a hole in the log
    ([10, 11, 12, 15, 16], [(13, 15)], (), [17]),        # a gap faust recorded is skipped
    ([12, 13], [], (), []),                              # two missing at the head: nothing committed
    ([11, 12, 13], [], (10,), []),                       # the head in flight: nothing committed
])
def test_a_commit_goes_as_far_as_the_offsets_done(acked, gaps, in_flight, expected):
    assert commits(TruthfulCommitConsumer._new_offset, bookkeeping(10, acked, gaps, in_flight)) == expected
