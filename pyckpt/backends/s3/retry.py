"""Retries of object-store requests: one budget (a count and a time) with exponential backoff.

Two layers, one budget (docs/OBJECT_STORES.md, "Retries"):

* the ``obstore`` client retries each request itself (5xx, 429, refused and dropped
  connections, timeouts of reads) with jittered exponential backoff: :func:`client_config`
  gives it ``max_retries`` (default 30) and ``retry_timeout`` (default 180 s), and a first
  backoff of 1 s, so its retries of one request span at least ``max_retries`` seconds: a store
  refusing connections for half a minute (a restart, a gateway rolling over) is waited for;
* pyckpt re-issues a whole single-request operation (HEAD, LIST, GET, ranged GET, DELETE and
  the metadata PUT) that the client gave up on for a transient reason (:func:`call`), with
  backoff doubling from 1 s to 15 s, as long as ``retry_timeout`` has not passed since the
  operation began and at most ``max_retries`` times. A multipart data upload cannot be re-issued
  (its parts are streamed): its parts rely on the client's retries.

A connection that stalls is abandoned after ``stall_timeout`` without a byte received
(``read_timeout`` of the client, default 30 s) and retried; a request as a whole is abandoned
after ``timeout`` (default 120 s).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from pyckpt.backends.s3 import errors

__all__ = ["RetryPolicy", "policy", "client_config", "is_transient", "call",
           "DEFAULT_STALL_TIMEOUT"]

logger = logging.getLogger("pyckpt.objstore")

T = TypeVar("T")

#: 30: the client's waits are drawn between 1 s and twice the previous one (decorrelated jitter), so
#: its retries of one request span at least 30 s (typically until ``retry_timeout``). With 10 they
#: could end in ~12-15 s, shorter than a store's restart on a loaded machine.
DEFAULT_MAX_RETRIES = 30
DEFAULT_RETRY_TIMEOUT_S = 180.0
INIT_BACKOFF_S = 1.0
MAX_BACKOFF_S = 15.0
BASE = 2.0
#: Default ``read_timeout`` of the client: a response that sends no byte for this long is
#: abandoned and retried (``storage_options`` key ``stall_timeout`` or ``read_timeout``).
DEFAULT_STALL_TIMEOUT = "30s"

# What the client reports when a request failed for a reason worth another try: no connection,
# a dropped one, a timeout, a throttling or server status.
_TRANSIENT = re.compile(
    r"kind: (Connect|Timeout|Request|Interrupted)\b|error sending request|connection "
    r"(refused|reset|closed|aborted)|broken pipe|timed out|operation timed out|"
    r"status(?: code)?:? ?(5\d\d|429)\b|\b(500|502|503|504) (Internal|Bad Gateway|Service|"
    r"Gateway)|SlowDown|ServiceUnavailable|RequestTimeout",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class RetryPolicy:
    """The retry budget of one checkpoint location."""

    max_retries: int = DEFAULT_MAX_RETRIES
    retry_timeout_s: float = DEFAULT_RETRY_TIMEOUT_S
    init_backoff_s: float = INIT_BACKOFF_S
    max_backoff_s: float = MAX_BACKOFF_S

    def backoff(self, retry: int) -> float:
        """Seconds to wait before re-issuing for the ``retry``-th time (1-based)."""
        return float(min(self.max_backoff_s, self.init_backoff_s * BASE ** (retry - 1)))


def _seconds(value: Any) -> float:
    if isinstance(value, timedelta):
        return value.total_seconds()
    return float(value)


def policy(options: Mapping[str, Any]) -> RetryPolicy:
    """The policy of ``storage_options`` (keys ``max_retries``, ``retry_timeout`` in seconds).

    Raises:
        ValueError: a negative count or a non-positive time.
    """
    max_retries = int(options.get("max_retries", DEFAULT_MAX_RETRIES))
    budget = _seconds(options.get("retry_timeout", DEFAULT_RETRY_TIMEOUT_S))
    if max_retries < 0:
        raise ValueError(f"max_retries must be >= 0, got {max_retries}")
    if budget <= 0:
        raise ValueError(f"retry_timeout must be positive, got {budget}")
    return RetryPolicy(max_retries, budget)


def client_config(p: RetryPolicy) -> dict[str, Any]:
    """``retry_config`` of the obstore client for ``p``."""
    return {
        "max_retries": p.max_retries,
        "retry_timeout": timedelta(seconds=p.retry_timeout_s),
        "backoff": {"init_backoff": timedelta(seconds=p.init_backoff_s),
                    "max_backoff": timedelta(seconds=p.max_backoff_s), "base": BASE},
    }


def is_transient(exc: BaseException) -> bool:
    """Whether the client's error ``exc`` may succeed when the request is sent again."""
    try:
        from obstore import exceptions as ox
    except ImportError:  # pragma: no cover - obstore is what raises these
        return False
    if not isinstance(exc, ox.GenericError):  # not found, refused credentials, conditions...
        return False
    if errors.no_credentials(exc):  # no credentials anywhere: retrying cannot find them
        return False
    return _TRANSIENT.search(str(exc)) is not None


def call(fn: Callable[[], T], p: RetryPolicy, what: str,
         sleep: Callable[[float], None] = time.sleep,
         clock: Callable[[], float] = time.monotonic) -> T:
    """``fn()``, re-issued after a transient failure within ``p``'s budget.

    Raises:
        Exception: ``fn``'s last error once it is not transient, ``max_retries`` re-issues were
            made, or the next attempt would start after ``retry_timeout`` since the first.
    """
    start = clock()
    retry = 0
    while True:
        try:
            return fn()
        except Exception as e:
            if not is_transient(e):
                raise
            retry += 1
            delay = p.backoff(retry)
            if retry > p.max_retries or clock() - start + delay > p.retry_timeout_s:
                raise
            logger.warning("pyckpt: %s failed (%s); retrying in %.0f s (%d of %d, %.0f s "
                           "left)", what, str(e).splitlines()[0][:200], delay, retry,
                           p.max_retries, p.retry_timeout_s - (clock() - start))
            sleep(delay)
