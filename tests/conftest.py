"""One embedded stack for the whole test session: engines start once, not per test."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from helpers import controller_idle, learner_health, wait_for

from liverl.keys import admin_headers
from liverl.pool import read_pool
from liverl.settings import (
    EmbeddedBroker,
    FeedbackConfig,
    LearnerConfig,
    PortsConfig,
    PromotionConfig,
    ServingConfig,
    Settings,
    StarterPolicyConfig,
)


@pytest.fixture(scope="session")
def starter_dir() -> Path:
    """The shipped starter policy (policies/starter_model, checked against its SHA-256), in the
    cache `liverl demo` serves it from; not built: `liverl policy build-starter` rebuilds it."""
    from policies.starter import build_starter_policy

    return build_starter_policy(StarterPolicyConfig().cache_dir, seed=0, progress=False)


@pytest.fixture(scope="session")
def settings(tmp_path_factory: pytest.TempPathFactory, starter_dir: Path) -> Settings:
    # Ports away from the defaults, so a developer's own stack keeps running; another
    # LIVERL_TEST_PORT_OFFSET lets two suites run side by side.
    offset = int(os.environ.get("LIVERL_TEST_PORT_OFFSET", "0"))
    # One tenant's windows close with a default reward (tests/test_stream_restart.py); every
    # other tenant keeps the default config, which emits none.
    rewards = tmp_path_factory.mktemp("rewards") / "rewards.yaml"
    rewards.write_text("tenants:\n  restart:\n    default_reward: 0.25\n")
    return Settings(
        data_dir=tmp_path_factory.mktemp("liverl"),
        ports=PortsConfig().shifted(10_000 + offset),
        broker=EmbeddedBroker(port=29092 + offset),
        starter=StarterPolicyConfig(model_dir=starter_dir),
        # Two replicas: swaps roll out canary first, and one serves while the other swaps;
        # a canary gets a quarter of the sessions.
        # An engine starts in about 50 s here alone, 2-3 times that on a slow day (CI, Nov 29).
        serving=ServingConfig(replicas=2, kv_cache_gib=1, canary_share=0.25, start_timeout_s=480),
        stream_cpus=[0],  # every machine has a CPU 0
        # A window outlasts a restart of the stream and the broker (tests/test_stream_restart.py),
        # and the feedback sent after it: 22-25 s from the kill to a recovered table on two
        # loaded cores (CI, Nov 29), so 30 s left a late verdict where an in-window one was due.
        feedback=FeedbackConfig(reward_window_s=45.0, sweep_interval_s=1.0, max_feedback_per_completion=4,
                                reward_config=rewards),
        # The learner at everyone's priority (by default nice 15, behind the data plane): the
        # tests wait for what it trains.
        learner=LearnerConfig(batch_samples=32, min_samples=1, max_version_lag=3, lr=3e-4,
                              gate_min_ess=1.0, gate_margin=1.0, nice=0),
        # Every candidate is promoted on the offline gate alone, so tests own the pace;
        # the live canary guard has its own test (it restarts the controller with it on).
        promotion=PromotionConfig(auto_promote=True, canary_guard=False),
    )


@pytest.fixture(scope="session")
def stack(settings: Settings):
    from app.stack import down, status, up

    up(settings, say=lambda _: None, progress=False)
    yield status(settings)
    try:
        down(settings, say=lambda _: None)
    finally:  # a drain that times out must not leave the stack holding the test ports
        if status(settings)["running"]:
            down(settings, say=lambda _: None, force=True)


@pytest.fixture(scope="session")
def dev_keys(stack, settings: Settings) -> dict:
    return json.loads((settings.data_dir / "dev-keys.json").read_text())


@pytest.fixture(scope="session")
def api(settings: Settings, dev_keys: dict) -> httpx.Client:
    with httpx.Client(base_url=settings.url(settings.ports.api), timeout=30,
                      headers={"Authorization": f"Bearer {dev_keys['tenant_key']}"}) as client:
        yield client


@pytest.fixture(scope="session")
def s3_endpoint():
    """An S3-compatible server on 127.0.0.1 (moto's), for the S3 delta store."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture()
def paused_learner(settings, stack):
    """Learning paused, no promotion in flight and a replica serving general traffic, so a
    test owns the replicas. (Seen once in a full run, Nov 29: a test's first request through
    the gateway waited the whole `no_replica_wait_s` for a replica and was answered 503.)"""
    httpx.post(settings.url(settings.ports.learner) + "/pause", headers=admin_headers(settings), timeout=620)
    wait_for(lambda: learner_health(settings) and controller_idle(settings)
             and any(r.enabled for r in read_pool(settings).general), timeout=120)
    yield
    httpx.post(settings.url(settings.ports.learner) + "/resume", headers=admin_headers(settings), timeout=10)
