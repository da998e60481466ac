"""The ingest API partitions keys itself (record batches per partition); a feedback event
must land on the partition of its trajectory, which other producers place with aiokafka's
default partitioner, or the join never sees them together."""

import random

from aiokafka.partitioner import murmur2

from liverl.kafka import murmur2_many


def test_batched_murmur2_equals_the_default_partitioner_hash():
    rng = random.Random(0)
    keys = [rng.randbytes(rng.randrange(0, 70)) for _ in range(2000)]
    keys += [f"cmpl-{rng.getrandbits(128):032x}".encode() for _ in range(200)]
    assert murmur2_many(keys).tolist() == [murmur2(k) for k in keys]
