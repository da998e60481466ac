"""No secret in any file of the running stack, its logs or its metrics; secret files are
private from their first byte."""

from __future__ import annotations

import os
import stat

import httpx

from liverl.keys import KeyStore


def test_secret_files_are_private_from_the_first_byte(tmp_path, monkeypatch):
    modes = []
    real_fsync = os.fsync

    def observe(fd):  # a look at the file while it is being written, before the rename
        modes.append(stat.S_IMODE(os.fstat(fd).st_mode))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", observe)
    old = os.umask(0)  # the most permissive umask: nothing may depend on it
    try:
        KeyStore(tmp_path / "keys.json").create("acme")
    finally:
        os.umask(old)
    assert modes == [0o600]
    assert stat.S_IMODE((tmp_path / "keys.json").stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["keys.json"]


def test_no_key_in_the_run_directory_logs_or_metrics(settings, stack, dev_keys, api):
    secrets = [dev_keys["tenant_key"], dev_keys["admin_key"]]
    api.post("/v1/ingestion", json={"batch": []})  # the key has been used at least once
    assert stat.S_IMODE(settings.dev_keys_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(settings.keys_file.stat().st_mode) == 0o600
    leaks = []
    for path in settings.run_dir.rglob("*"):
        if path.is_file():
            text = path.read_text(errors="replace")
            leaks += [f"{path}: {s[:10]}..." for s in secrets if s in text]
    leaks += [f"keys file: {s[:10]}..." for s in secrets if s in settings.keys_file.read_text()]
    for component in stack["components"]:
        if component["url"] and component["name"] not in ("broker",) and "replica" not in component["name"]:
            metrics = httpx.get(component["url"] + "/metrics", timeout=10)
            leaks += [f"{component['name']} /metrics" for s in secrets if s in metrics.text]
    assert leaks == []
