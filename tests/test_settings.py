"""Settings refuse values that cannot work, name the variable, and keep secrets out of files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.demo import demo_settings
from liverl.settings import (
    ClickHouseServer,
    LearnerConfig,
    PortsConfig,
    S3DeltaStore,
    ServingConfig,
    Settings,
)


def liverl(*args: str, env: dict[str, str], tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args, "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("variable, value, says", [
    ("LIVERL_LEARNER__LR", "abc", "LIVERL_LEARNER__LR='abc'"),
    ("LIVERL_LEARNER__HOLDOUT_FRACTION", "1.5", "LIVERL_LEARNER__HOLDOUT_FRACTION='1.5'"),
    ("LIVERL_SERVING__REPLICAS", "0", "LIVERL_SERVING__REPLICAS='0'"),
    ("LIVERL_LEARNER__MIN_SAMPLES", "999", "LIVERL_LEARNER__MIN_SAMPLES (999) must not exceed"),
    ("LIVERL_PORTS__GATEWAY", "18080", "LIVERL_PORTS__GATEWAY and LIVERL_PORTS__API are both port 18080"),
    ("LIVERL_LEARNER__LRR", "1", "LIVERL_LEARNER__LRR='1': Extra inputs are not permitted"),
])
def test_a_bad_variable_stops_up_with_one_line_naming_it(variable, value, says, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVERL_")}
    result = liverl("up", env=dict(env, **{variable: value}), tmp_path=tmp_path)
    assert result.returncode == 1
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()  # nothing was started


def test_bounds_and_cross_field_rules():
    with pytest.raises(ValidationError, match="min_samples"):
        LearnerConfig(batch_samples=8, min_samples=9)
    tcp = ServingConfig(listen="tcp")  # unix-socket replicas take no port
    Settings(ports=PortsConfig(replica_base=18080))
    with pytest.raises(ValidationError, match="both port"):
        Settings(ports=PortsConfig(replica_base=18080), serving=tcp)
    with pytest.raises(ValidationError, match="both port"):  # replicas 0..2 reach the API's port
        Settings(ports=PortsConfig(api=18102, replica_base=18100), serving=tcp.model_copy(update={"replicas": 3}))
    with pytest.raises(ValidationError):  # assignment is validated too (the CLI assigns flags)
        ServingConfig().replicas = 0


def test_demo_defaults_yield_to_the_environment(monkeypatch):
    monkeypatch.setenv("LIVERL_LEARNER__LR", "0.0005")
    settings = demo_settings()
    assert settings.learner.lr == 0.0005  # the variable wins over the demo's 6e-4
    assert settings.learner.batch_samples == 96  # the demo's own default
    assert settings.data_dir.name == "demo"
    monkeypatch.setenv("LIVERL_LEARNER__BATCH_SAMPLES", "4")  # fewer than min_samples (8)
    with pytest.raises(ValidationError, match="LIVERL_LEARNER__MIN_SAMPLES"):
        demo_settings()


def test_the_deployment_file_sets_the_analysis_below_the_environment(monkeypatch, tmp_path):
    import tomllib

    analysis = Path(__file__).parents[1] / "liverl.toml"  # the one compose.yaml mounts
    monkeypatch.setenv("LIVERL_CONFIG_FILE", str(analysis))
    monkeypatch.setenv("LIVERL_PROMOTION__MARGIN", "0.02")
    settings = Settings()
    written = tomllib.loads(analysis.read_text())
    assert settings.learner.gate_max_kl == written["learner"]["gate_max_kl"]
    assert settings.promotion.tenant_worse == written["promotion"]["tenant_worse"] == "hold"
    assert settings.promotion.margin == 0.02  # the variable wins over the file
    assert "LIVERL_CONFIG_FILE" not in settings.environment()  # children get the values themselves
    env = dict(os.environ, LIVERL_CONFIG_FILE=str(tmp_path / "typo.toml"))
    (tmp_path / "typo.toml").write_text("[promotion]\nmragin = 0.1\n")
    assert "LIVERL_PROMOTION__MRAGIN=0.1: Extra inputs are not permitted" in liverl("policy", "list", env=env,
                                                                                tmp_path=tmp_path).stdout
    env["LIVERL_CONFIG_FILE"] = str(tmp_path / "missing.toml")
    refused = liverl("policy", "list", env=env, tmp_path=tmp_path)
    assert refused.returncode == 1 and "missing.toml': no such file" in refused.stdout


def test_secrets_stay_out_of_the_settings_file_and_reach_children(monkeypatch):
    settings = Settings(warehouse=ClickHouseServer(password="hunter2-ch"),
                        delta_store=S3DeltaStore(secret_access_key="hunter2-s3"))
    public = settings.public_json()
    assert "hunter2" not in public and "hunter2" not in repr(settings) and "hunter2" not in str(settings)
    environment = settings.environment()  # a child process gets them through its environment
    assert json.loads(environment["LIVERL_WAREHOUSE"])["password"] == "hunter2-ch"
    # A command reading the running stack's file gets the secrets from its own environment.
    monkeypatch.setenv("LIVERL_WAREHOUSE__PASSWORD", "hunter2-ch")
    again = Settings(**json.loads(public))
    assert again.warehouse.password.get_secret_value() == "hunter2-ch"
    assert again.warehouse.host == settings.warehouse.host


def test_null_in_the_environment_turns_an_optional_setting_off(monkeypatch):
    monkeypatch.setenv("LIVERL_LEARNER__ROLLOUT_SHARE", "0.25")
    monkeypatch.setenv("LIVERL_ROLLOUTS__HELDOUT_EVERY_S", "null")  # no held-out evaluator
    assert Settings().learner.rollout_share == 0.25 and Settings().rollouts.heldout_every_s is None
    monkeypatch.setenv("LIVERL_LEARNER__ROLLOUT_SHARE", "null")  # every complete group, again
    assert Settings().learner.rollout_share is None
