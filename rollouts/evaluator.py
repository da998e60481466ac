"""The held-out evaluator: a version is scored greedily on the environment's held-out
tasks (never trained on), and the figures go into its metrics (`heldout`: pass rate, which
tasks it solved, the task set's name, seconds), so `liverl policy show`, the demo's live
table and ClickHouse's `policy_versions` (from the version's next change of state) have
them. What it scores, first first:

1. stable and the starter (the first version), if either has no figures: the references;
2. a candidate the promotion controller asked for (its metrics' `skill` waiting): the skill
   guard judges a candidate on these figures before its canary (`promotion/controller.py`),
   so this is looked for every `rollouts.heldout_poll_s`, newest first;
3. every `rollouts.heldout_every_s`, the learner's newest version, so learning from
   rollouts can be followed as it happens.

It runs at the lowest CPU priority on one thread, so production and rollouts keep the
cores: greedy completions of all tasks in batches, and each (task, first line) scored in
the sandbox once (consecutive versions write the same line for most tasks).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from liverl.http import service_app
from liverl.observability import log, setup_logging
from liverl.process import serve_beside, yield_cpu
from liverl.settings import Settings, get_settings
from policies.registry import PolicyVersion, Registry
from rollouts.environment import configured_environment
from rollouts.evaluate import greedy_solved, task_set

logger = setup_logging("evaluator")


def asked_for(version: PolicyVersion) -> bool:
    """The controller waits for this candidate's held-out figures (its skill verdict)."""
    return (version.metrics.get("skill") or {}).get("verdict") == "waiting" and "heldout" not in version.metrics


class Evaluator:
    def __init__(self, settings: Settings):
        self.settings, self.config = settings, settings.rollouts
        self.registry = Registry(settings.policies_dir)
        self.environment = configured_environment(self.config)
        self.tasks = self.environment.heldout(self.config.heldout_tasks)
        self.task_set = task_set(self.tasks)
        self.results: dict[str, float] = {}  # version -> held-out pass rate, in the order measured
        self.known: dict[tuple[str, str], bool] = {}  # (task, first line) -> solved
        self.next_newest = 0.0

    def next_version(self) -> PolicyVersion | None:
        """What to score now (the module's order), or None."""
        versions = self.registry.versions()
        for reference in (self.registry.stable(), versions[0] if versions else None):
            if reference is not None and "heldout" not in reference.metrics and Path(reference.model_dir).is_dir():
                return reference
        if asked := [v for v in self.registry.in_state("candidate") if asked_for(v)]:
            return asked[-1]
        head = self.registry.head()
        if time.time() >= self.next_newest and head is not None and "heldout" not in head.metrics:
            self.next_newest = time.time() + (self.config.heldout_every_s or 0.0)
            return head
        return None

    def step(self) -> dict | None:
        """Score the next version (`next_version`) and record its figures; None if none is due."""
        version = self.next_version()
        if version is None:
            return None
        started = time.time()
        try:
            solved = greedy_solved(Path(version.model_dir), self.environment, self.tasks, known=self.known)
        except OSError as error:  # its weights removed by retention meanwhile: the next one, then
            log(logger, "could not evaluate", version=version.version, error=repr(error))
            return None
        # Which tasks, not only how many: two versions are compared task by task (paired).
        figures: dict[str, Any] = {"pass_rate": sum(solved) / len(solved), "tasks": len(solved),
                                   "solved": "".join("1" if s else "0" for s in solved), "task_set": self.task_set,
                                   "evaluation": self.environment.name or self.config.environment,
                                   "seconds": time.time() - started, "evaluated_at": time.time()}
        self.registry.update_metrics(version.version, heldout=figures)
        self.results[version.version] = figures["pass_rate"]
        log(logger, "evaluated", version=version.version, pass_rate=figures["pass_rate"],
            seconds=round(figures["seconds"], 1))
        return figures

    def run(self, stop: threading.Event) -> None:
        import torch  # after the health check answers: on busy cores at nice 19, torch takes a while to load

        torch.set_num_threads(1)  # and a low priority (rollouts.heldout_nice): production and rollouts first
        try:
            os.setpriority(os.PRIO_PROCESS, 0, self.config.heldout_nice)
            yield_cpu(os.getpid(), self.config.heldout_nice)  # its session's too: autogroups weigh sessions
        except PermissionError as error:  # a lower niceness than it was started at needs the privilege
            log(logger, "could not set the evaluator's niceness", nice=self.config.heldout_nice, error=repr(error))
        while not stop.is_set():
            try:
                scored = self.step()
            except Exception as error:  # an evaluation never takes the service down
                logger.exception(f"evaluation failed: {error!r}")
                scored = None
            if scored is None:  # nothing due: look again soon (a candidate may be asked for)
                stop.wait(self.config.heldout_poll_s)


def create_app(evaluator: Evaluator) -> FastAPI:
    def health() -> dict:
        return {"ok": True, "tasks": len(evaluator.tasks), "heldout": evaluator.results}

    return service_app("liverl held-out evaluator", evaluator.settings, health)


if __name__ == "__main__":
    settings = get_settings()
    if settings.rollouts.heldout_every_s is None:  # compose starts it whatever the settings say
        raise SystemExit("the held-out evaluator needs LIVERL_ROLLOUTS__HELDOUT_EVERY_S (seconds between evaluations)")
    evaluator = Evaluator(settings)
    serve_beside(create_app(evaluator), settings.host, settings.ports.evaluator, evaluator.run)
