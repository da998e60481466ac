"""Fault injection for crash tests: die at a named line, as `kill -9` would.

A real process can be killed at any moment but not at a chosen line; tests that
must hit the one dangerous window set LIVERL_FAULT to its name. Unset, this is a no-op.
"""

from __future__ import annotations

import os


def crash_point(name: str) -> None:
    if os.environ.get("LIVERL_FAULT") == name:
        os._exit(137)
