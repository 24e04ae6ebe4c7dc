"""The inference client's errors (here, below the client and its weight-sync dialects, which
both raise them)."""

from __future__ import annotations

from orchestrator.contracts import ComponentFailed


class InferenceError(ComponentFailed):
    """Inference failed; the message names the endpoint(s) and what went wrong."""

    failure_source = "inference"


class InferenceRequestError(InferenceError):
    """The endpoint rejected the request itself (HTTP 4xx, malformed answer): never retried."""

    def __init__(self, message: str, status_code: int | None = None):
        super().__init__(message)
        self.status_code = status_code


class InferenceUnavailable(InferenceError):
    """Every attempt failed on transport or server errors (endpoints down, timeouts, 5xx)."""


# A 5xx answer: (HTTP status, route, the error's message).
ServerError = tuple[int, str, str]


def same_server_error_again(previous: ServerError | None, error: ServerError | None) -> bool:
    """The same server error twice in a row, of one endpoint to one request (or load), means
    permanent: an HTTP 500 that repeats on the same route with the same message is the endpoint's
    state (a dead engine, a bug), refused at once rather than retried for minutes. Another 5xx (a
    503 while a server loads) or one that changes is transient."""
    return error is not None and error[0] == 500 and previous == error


class Retryable(Exception):
    """A transport or server failure of one endpoint: the client marks it down and tries another.
    ``orch_side``: a timeout that orch's own stalled loop or connection cap caused, which says
    nothing of the endpoint: it is not marked down and the request is sent again. ``timed_out``:
    the endpoint did not answer in time (a load that did is a server stuck in it)."""

    def __init__(
        self,
        message: str,
        kind: str,
        counted: bool = False,
        server_error: ServerError | None = None,
        orch_side: bool = False,
        stalled: bool = False,
        timed_out: bool = False,
    ):
        super().__init__(message)
        self.message, self.kind = message, kind
        self.counted = counted  # the endpoint was already marked down for this failure
        self.server_error = server_error  # a 5xx answer's, for `same_server_error_again`
        self.orch_side = orch_side
        self.stalled = stalled  # orch's side for its stalled loop (`LoopLag.caused`)
        self.timed_out = timed_out

    def permanent(self) -> InferenceRequestError:
        """This server error as the refusal it is when it came twice in a row."""
        return InferenceRequestError(f"{self.message} (the same server error twice in a row: not retried)", 500)
