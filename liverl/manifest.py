"""What a running stack wrote about itself: its components and the settings it runs with.

`liverl up` writes both into `run/`; any command (the CLI, `liverl sync`, a benchmark)
reads them to reach the stack whatever its own environment says.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from liverl.settings import Settings


class Component(BaseModel):
    name: str
    pid: int
    url: str | None = None
    log: str
    argv: list[str] = Field(default_factory=list, description="The command that starts it; the supervisor "
                            "restarts it with the same.")
    env: dict[str, str] = Field(default_factory=dict, description="What its environment adds to the stack's.")
    health: str | None = Field(None, description="http(s) URL that answers 200 once it is healthy, or "
                               "tcp://host:port that accepts connections (the broker and its store).")
    nice: int | None = Field(None, description="The niceness it runs at, given to its whole session.")
    restarts: int = Field(0, description="Times the supervisor (or `liverl restart`) started it again.")
    state: Literal["running", "restarting", "down"] = Field(
        "running", description="down: it kept dying and the supervisor left it down (on-call was alerted).")


class Manifest(BaseModel):
    cluster_id: str
    started_at: float
    components: list[Component]


def manifest_file(settings: Settings) -> Path:
    return settings.run_dir / "stack.json"


def settings_file(settings: Settings) -> Path:
    return settings.run_dir / "settings.json"


def running_settings(data_dir: Path | None = None) -> Settings:
    """The settings the stack in `data_dir` (default: the configured one) runs with, if one
    runs there: commands from any shell then reach its ports and broker whatever their own
    environment says."""
    settings = Settings(data_dir=data_dir) if data_dir else Settings()
    if manifest_file(settings).exists() and settings_file(settings).exists():
        # Keyword arguments, so the secrets left out of the file come from the environment.
        return Settings(**json.loads(settings_file(settings).read_text()))
    return settings


def read_manifest(settings: Settings) -> Manifest | None:
    path = manifest_file(settings)
    return Manifest.model_validate_json(path.read_text()) if path.exists() else None


def write_manifest(settings: Settings, manifest: Manifest) -> None:
    """Whole or not at all: a reader never sees half a manifest."""
    path = manifest_file(settings)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(manifest.model_dump_json(indent=2))
    os.replace(tmp, path)
