"""What every liverl HTTP service does the same way with hostile input."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


def refuse_deep_json(app: FastAPI) -> None:
    """JSON nested deeper than Python's parser recurses is a client's error (400), not
    a crash of the request (500)."""

    @app.exception_handler(RecursionError)
    async def too_deep(request: Request, error: RecursionError) -> JSONResponse:
        return JSONResponse({"detail": "malformed JSON: nested too deeply"}, status_code=400)
