"""Production load as the gateway reports it (`/admin/load`): what the capacity scheduler
lends replicas by and what tells the promotion controller whether a canary can be judged.
The gateway writes it; the readers import it from here, not from the gateway."""

from __future__ import annotations

import httpx
from pydantic import BaseModel, Field

from liverl.keys import admin_headers
from liverl.settings import Settings


class GatewayLoad(BaseModel):
    """Production load as the gateway sees it."""

    in_flight: dict[str, int] = Field(description="Requests each replica is answering now.")
    waiting: int = Field(description="Requests waiting for an enabled replica.")
    requests_per_s: float = Field(description="Requests routed per second over the last `window_s`.")
    tokens_per_s: float = Field(0.0, description="Completion tokens answered per second over the last `window_s`.")
    window_s: float


def read_gateway_load(settings: Settings, client: httpx.Client, timeout: float = 5.0) -> GatewayLoad:
    """The running gateway's load (admin key), through the reader's long-lived client: a
    client per reading costs about 25 ms of CPU (its SSL context), and the capacity
    scheduler reads ten times a second on the cores the replicas serve from. Raises
    httpx.HTTPError if the gateway does not answer."""
    response = client.get(settings.url(settings.ports.gateway) + "/admin/load", headers=admin_headers(settings),
                          timeout=timeout)
    return GatewayLoad.model_validate(response.raise_for_status().json())
