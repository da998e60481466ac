"""Running one component as a process: the uvicorn entry point every server shares."""

from __future__ import annotations

import uvicorn
from fastapi import FastAPI


def serve(app: FastAPI, host: str, port: int) -> None:
    # One worker: every component is a single process; scale-out is more processes.
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
