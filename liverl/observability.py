"""Structured logs and Prometheus metrics shared by every component.

Log lines are JSON objects; callers pass fields, never secrets (API keys are hashed
before they reach any log or label).
"""

from __future__ import annotations

import json
import logging
import sys
import time

from fastapi import FastAPI
from prometheus_client import make_asgi_app


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname.lower(),
            "component": record.name,
            "msg": record.getMessage(),
        }
        line.update(getattr(record, "fields", {}))
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def setup_logging(component: str) -> logging.Logger:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    # aiokafka is chatty at INFO about every rebalance; the HTTP clients (httpx, and httpx2
    # under openai 3) about every request.
    for noisy in ("aiokafka", "kafka", "uvicorn.access", "httpx", "httpx2"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger(component)


def log(logger: logging.Logger, msg: str, **fields: object) -> None:
    logger.info(msg, extra={"fields": fields})


def mount_metrics(app: FastAPI) -> None:
    """Expose the process's Prometheus registry at /metrics."""
    app.mount("/metrics", make_asgi_app())
