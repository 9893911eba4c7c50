"""Errors more than one part of the coordinator raises or answers."""

from __future__ import annotations

DEFAULT_RETRY_AFTER_S = 5


class Unavailable(Exception):
    """The cluster cannot take a run now (a stage, the store or the queue); HTTP 503 with Retry-After."""

    def __init__(self, message: str, retry_after: int = DEFAULT_RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after = retry_after
