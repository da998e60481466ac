"""How every liverl HTTP service is built: one factory, so each has the same key store,
audit log, metrics, health route and answer to hostile input."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from liverl.audit import AuditLog
from liverl.keys import KeyStore
from liverl.observability import mount_metrics
from liverl.settings import Settings

TOO_DEEP = "malformed JSON: nested too deeply"


def healthy() -> dict:
    return {"ok": True}


def service_app(title: str, settings: Settings, health: Callable[..., Any] = healthy,
                lifespan: Callable[[FastAPI], AbstractAsyncContextManager] | None = None) -> FastAPI:
    """A service's app: its key store (`app.state.keys`, read by `require_key`), the audit
    log (`app.state.audit`, or the `Audit` dependency), `/metrics`, `/health` answered by
    `health` (a route function: it may take dependencies), and JSON nested too deeply
    refused with a 400."""
    app = FastAPI(title=title, lifespan=lifespan)
    app.state.keys = KeyStore(settings.keys_file)
    app.state.audit = AuditLog(settings.audit_file)
    # JSON nested just less deeply than the parser gives up at is parsed, and a 422 that
    # echoes it back cannot be encoded: the client's error (400), not a crash (500).
    app.add_exception_handler(RecursionError, too_deep)
    mount_metrics(app)
    app.add_api_route("/health", health, methods=["GET"])
    return app


async def too_deep(request: Request, error: Exception) -> JSONResponse:
    return JSONResponse({"detail": TOO_DEEP}, status_code=400)


def audit_log(request: Request) -> AuditLog:
    return request.app.state.audit


Audit = Annotated[AuditLog, Depends(audit_log)]


class MalformedJSON(HTTPException):
    def __init__(self, why: str):
        super().__init__(400, why)


def read_json(raw: bytes) -> Any:
    """A body that a service parses itself: not JSON, or nested deeper than the parser
    recurses, is a MalformedJSON (400) that says which."""
    try:
        return json.loads(raw)
    except ValueError as error:
        raise MalformedJSON(f"malformed JSON: {str(error)[:200]}") from None
    except RecursionError:
        raise MalformedJSON(TOO_DEEP) from None
