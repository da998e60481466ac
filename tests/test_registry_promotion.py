"""Whoever asks the registry for stable while promotions and rollbacks run always gets a
version: the gateway, the learner and the load generator of the fault suite read it at any
moment, and None would mean "nothing serves" to each of them."""

import shutil
import threading
import uuid

from liverl.settings import EmbeddedBroker, Settings
from policies.registry import Registry
from promotion.promoter import Promoter


def test_stable_is_never_missing_while_promotions_and_rollbacks_run(tmp_path, starter_dir):
    # No replicas in the pool (a promotion is then its registry moves alone) and no broker
    # (the announcements fail at once, as analytics may).
    settings = Settings(data_dir=tmp_path, broker=EmbeddedBroker(port=1))
    registry = Registry(settings.policies_dir)

    def publish(state="candidate") -> str:
        staged = tmp_path / f"staged-{uuid.uuid4().hex}"
        shutil.copytree(starter_dir, staged)
        return registry.publish(staged, parent=None, window=None, metrics={}, sample_ids=[],
                                actor="test", state=state).version

    publish("stable")
    seen: list[str | None] = []
    done = threading.Event()

    def poll() -> None:  # another reader, as another process would have its own connection
        reader = Registry(settings.policies_dir)
        while not done.is_set():
            stable = reader.stable()
            seen.append(stable.version if stable else None)

    reader = threading.Thread(target=poll)
    reader.start()
    promoter = Promoter(settings, registry)
    try:
        for _ in range(20):
            version = publish()
            assert promoter.promote(version, "test").state == "stable"
            promoter.rollback("test", "the fault suite's reader must see one stable throughout")
    finally:
        done.set()
        reader.join()
    assert len(set(seen) - {None}) > 10, "the reader saw the promotions"
    assert None not in seen, f"stable() answered None {seen.count(None)} times in {len(seen)} reads"
