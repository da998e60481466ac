"""liverl's SDK for product teams: feedback, outcomes and trajectories to the ingest API,
batched in the background, retried, each event sent with an id made once.

    from liverl_client import FeedbackClient

See `liverl_client.client` for the details; this distribution depends on httpx only.
"""

from liverl_client.client import RETRYABLE, FeedbackClient

__all__ = ["FeedbackClient", "RETRYABLE"]
__version__ = "0.1.0"
