"""A model directory from outside (a base model, the starter) in as a policy version.

The registry takes only complete, servable versions: this checks the directory is of a
family every station supports (`policies/families.py`), copies it, writes
the probe a swap verifies replicas by (when the directory has none), and publishes it.
`liverl up` imports the starter this way; on-call imports a base model with `liverl
policy import` or the controller's `POST /admin/policies/import`.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

from liverl.settings import Settings
from policies.families import unsupported
from policies.registry import PolicyVersion, Registry, State


def import_version(settings: Settings, source: Path, actor: str) -> PolicyVersion:
    """A Hugging Face model directory in as the next version, with the probe a swap
    verifies it by (written here when the directory has none). The first version is
    stable (what replicas start from); later ones are candidates, to promote by hand."""
    from liverl.probe import PROBE_FILE, probe_logprobs  # torch: only when importing

    if why := unsupported(source):
        raise ValueError(why)
    registry = Registry(settings.policies_dir)
    staged = settings.policies_dir / f"staging-import-{uuid.uuid4().hex[:8]}"
    shutil.copytree(source, staged)
    if not (staged / PROBE_FILE).exists():
        from transformers import AutoTokenizer

        (staged / PROBE_FILE).write_text(json.dumps(probe_logprobs(staged, AutoTokenizer.from_pretrained(staged))))
    state: State = "candidate" if registry.stable() else "stable"
    return registry.publish(staged, parent=None, window=None, metrics={}, sample_ids=[], actor=actor, state=state)
