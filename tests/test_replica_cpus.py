"""On a CPU machine each replica can have cores of its own, as it would have a device of
its own: `serving.replica_cpus`, applied to every (re)launch of that replica."""

from __future__ import annotations

import os
from pathlib import Path

from helpers import wait_for

from liverl.settings import Settings
from serving import replicas


def launched_affinity(process) -> set[int]:
    """The CPUs the replica's own program runs on, once taskset has handed over to it."""
    wait_for(lambda: Path(f"/proc/{process.pid}/cmdline").read_bytes().startswith(b"sleep"), 5, 0.01)
    return os.sched_getaffinity(process.pid)


def test_each_replica_runs_on_the_cpus_given_for_its_index(monkeypatch, tmp_path):
    # A stand-in process for vLLM (its start-up is not what is tested): the launch is real.
    monkeypatch.setattr(replicas, "replica_command", lambda settings, model_dir, url: ["sleep", "30"])
    first, *rest = sorted(os.sched_getaffinity(0))
    settings = Settings(data_dir=tmp_path, serving={"replica_cpus": [[first], rest or [first]]})
    launched = []
    try:
        for name, cpus in (("replica-0", {first}), ("replica-2", {first}), ("replica-1", set(rest or [first]))):
            replica, process = replicas.launch_replica(settings, name, tmp_path, "http://127.0.0.1:1", "v0")
            launched.append(process)
            assert launched_affinity(process) == cpus
            assert replica.pid == process.pid  # the pid `down` stops is the replica's, not a wrapper's
        _, process = replicas.launch_replica(Settings(data_dir=tmp_path), "replica-0", tmp_path,
                                             "http://127.0.0.1:1", "v0")
        launched.append(process)
        assert launched_affinity(process) == os.sched_getaffinity(0)  # None: any CPU
    finally:
        for process in launched:
            process.kill()
            process.wait()
