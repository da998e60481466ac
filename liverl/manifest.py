"""What a running stack wrote about itself: its components and the settings it runs with.

`liverl up` writes both into `run/`; any command (the CLI, `liverl sync`, a benchmark)
reads them to reach the stack whatever its own environment says.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel

from liverl.settings import Settings


class Component(BaseModel):
    name: str
    pid: int
    url: str | None = None
    log: str


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
