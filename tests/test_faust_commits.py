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


GENERATION = 7  # the consumer group's current generation


def bookkeeping(committed: int, acked: list[int], gaps: list[tuple[int, int]],
                in_flight: tuple[int, ...] = (), stale: tuple[int, ...] = ()) -> SimpleNamespace:
    """A consumer's commit records for one partition, as faust keeps them (`in_flight`:
    offsets delivered to the stream and not acked; `stale`: the same, delivered before the
    last rebalance, which faust skips)."""
    unacked = [SimpleNamespace(tp=PARTITION, offset=o, generation_id=GENERATION) for o in in_flight]
    unacked += [SimpleNamespace(tp=PARTITION, offset=o, generation_id=GENERATION - 1) for o in stale]
    return SimpleNamespace(app=SimpleNamespace(consumer_generation_id=GENERATION), _unacked_messages=unacked,
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


def test_offsets_acked_are_committed_at_once_whatever_gaps_faust_recorded_over_them():
    assert commits(TruthfulCommitConsumer._new_offset, bookkeeping(**AFTER_A_REBALANCE)) == [201]


def test_a_commit_never_passes_offsets_faust_skipped_and_never_processed():
    """A gap faust recorded while those offsets were never acked (fault run 6 lost 16 samples
    when they were counted done): the commit stops before them."""
    records = bookkeeping(101, [*range(101, 111), *range(151, 201)], [(111, 151)])
    assert commits(TruthfulCommitConsumer._new_offset, records) == [111]
    assert commits(FaustConsumer._new_offset, bookkeeping(101, [*range(101, 111), *range(151, 201)],
                                                          [(111, 151)]))[-1] == 201  # faust's passes them


def test_faust_itself_crawls_one_offset_per_commit_there():
    """Why the override exists: faust 0.15 needs a commit (one per 2.8 s) per repeated offset."""
    sent = commits(FaustConsumer._new_offset, bookkeeping(**AFTER_A_REBALANCE))
    assert sent[-1] == 201 and len(sent) == 50


@pytest.mark.parametrize("acked, gaps, in_flight, stale, expected", [
    (list(range(10, 20)), [], (), (), [20]),              # a plain run
    ([10, 11, 12, 14, 15], [], (13,), (), [13]),          # an offset in flight holds the rest back...
    ([10, 11, 12, 14, 15], [], (), (), [13, 16]),         # ...one never delivered is a hole in the log
    ([10, 11, 12, 15, 16], [(13, 15)], (), (), [13]),     # a gap faust recorded is not done
    ([12, 13], [], (), (), []),                           # two missing at the head: nothing committed
    ([11, 12, 13], [], (10,), (), []),                    # the head in flight: nothing committed
    ([11, 12, 13], [], (10, 14), (), []),                 # ...and so does one behind the head
    ([10, 11, 12], [], (), (5, 11), [13]),                # messages of the last generation hold nothing
    ([10, 11, 12], [], (10,), (), [13]),                  # nor a delivery skipped of an offset done since
])
def test_a_commit_goes_as_far_as_the_offsets_done(acked, gaps, in_flight, stale, expected):
    records = bookkeeping(10, acked, gaps, in_flight, stale)
    assert commits(TruthfulCommitConsumer._new_offset, records) == expected
