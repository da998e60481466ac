"""The ingest API picks partitions itself (`liverl.kafka.send_many`, keys hashed for the
whole batch); a feedback event must land on the partition of its trajectory, which the
gateway places with aiokafka's default partitioner, or the join never sees them
together. End to end, the data-plane tests join feedback to completions on a
two-partition topic."""

import random

from aiokafka.partitioner import murmur2

from liverl.kafka import murmur2_many


def test_batched_murmur2_equals_the_default_partitioner_hash():
    rng = random.Random(0)
    keys = [rng.randbytes(rng.randrange(0, 70)) for _ in range(2000)]
    keys += [f"cmpl-{rng.getrandbits(128):032x}".encode() for _ in range(200)]
    assert murmur2_many(keys).tolist() == [murmur2(k) for k in keys]
