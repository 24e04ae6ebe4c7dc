"""The inference client's errors (here, below the client and its weight-sync dialects, which
both raise them)."""

from __future__ import annotations

from orchestrator.contracts import ComponentFailed


class InferenceError(ComponentFailed):
    """Inference failed; the message names the endpoint(s) and what went wrong."""


class InferenceRequestError(InferenceError):
    """The endpoint rejected the request itself (HTTP 4xx, malformed answer): never retried."""

    def __init__(self, message: str, status_code: int | None = None):
        super().__init__(message)
        self.status_code = status_code


class InferenceUnavailable(InferenceError):
    """Every attempt failed on transport or server errors (endpoints down, timeouts, 5xx)."""


class Retryable(Exception):
    """A transport or server failure of one endpoint: the client marks it down and tries another."""

    def __init__(self, message: str, kind: str, counted: bool = False):
        super().__init__(message)
        self.message, self.kind = message, kind
        self.counted = counted  # the endpoint was already marked down for this failure
