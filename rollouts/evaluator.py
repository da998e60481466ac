"""The held-out evaluator: while rollouts run, a version is scored greedily on the
environment's held-out tasks (never trained on) every `rollouts.heldout_every_s`: each
stable version once (what users get, which the controller's held-out watch compares), else
the learner's newest, so learning from rollouts can be followed as it happens and not
only afterwards. Each figure goes into the version's metrics (`heldout`: pass rate, the
tasks solved, seconds), so `liverl policy show` and the demo's live table have it, and
ClickHouse's `policy_versions` from the version's next change of state.

It is the one component that may wait: it runs at the lowest CPU priority on one
thread, so production and rollouts keep the cores, and it skips versions it had no turn
for. The starter is evaluated first: the baseline.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI

from liverl.http import service_app
from liverl.observability import log, setup_logging
from liverl.process import serve_beside
from liverl.settings import Settings, get_settings
from policies.registry import Registry
from rollouts.environment import configured_environment
from rollouts.evaluate import greedy_solved, task_set

logger = setup_logging("evaluator")


class Evaluator:
    def __init__(self, settings: Settings):
        self.settings, self.config = settings, settings.rollouts
        self.registry = Registry(settings.policies_dir)
        self.environment = configured_environment(self.config)
        self.tasks = self.environment.heldout(self.config.heldout_tasks)
        self.task_set = task_set(self.tasks)
        self.results: dict[str, float] = {}  # version -> held-out pass rate, in the order measured

    def step(self) -> dict | None:
        """Stable's held-out figures if it has none yet, else the newest version's (recorded too)."""
        stable = self.registry.stable()
        unscored = [v for v in (stable, self.registry.head()) if v is not None and "heldout" not in v.metrics]
        if not unscored:
            return None
        version = unscored[0]
        started = time.time()
        try:
            solved = greedy_solved(Path(version.model_dir), self.environment, self.tasks)
        except OSError as error:  # its weights removed by retention meanwhile: the next one, then
            log(logger, "could not evaluate", version=version.version, error=repr(error))
            return None
        # Which tasks, not only how many: two versions are compared task by task (paired).
        figures: dict[str, Any] = {"pass_rate": sum(solved) / len(solved), "tasks": len(solved),
                                   "solved": "".join("1" if s else "0" for s in solved), "task_set": self.task_set,
                                   "seconds": time.time() - started, "evaluated_at": time.time()}
        self.registry.update_metrics(version.version, heldout=figures)
        self.results[version.version] = figures["pass_rate"]
        log(logger, "evaluated", version=version.version, pass_rate=figures["pass_rate"],
            seconds=round(figures["seconds"], 1))
        return figures

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.step()
            except Exception as error:  # an evaluation never takes the service down
                logger.exception(f"evaluation failed: {error!r}")
            stop.wait(self.config.heldout_every_s)


def create_app(evaluator: Evaluator) -> FastAPI:
    def health() -> dict:
        return {"ok": True, "tasks": len(evaluator.tasks), "heldout": evaluator.results}

    return service_app("liverl held-out evaluator", evaluator.settings, health)


if __name__ == "__main__":
    torch.set_num_threads(1)  # and `liverl up` starts it at the lowest priority: production and rollouts first
    settings = get_settings()
    if settings.rollouts.heldout_every_s is None:  # compose starts it whatever the settings say
        raise SystemExit("the held-out evaluator needs LIVERL_ROLLOUTS__HELDOUT_EVERY_S (seconds between evaluations)")
    evaluator = Evaluator(settings)
    serve_beside(create_app(evaluator), settings.host, settings.ports.evaluator, evaluator.run)
