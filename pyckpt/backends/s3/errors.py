"""Object-store client failures as errors a person can read.

``obstore`` reports a failed request as one string: a summary line, then ``Debug source:`` and a
page of the Rust client's debug structure (retry state, socket errors, the request that failed).
:func:`translate` turns it into the typed error pyckpt raises, with a message that says what
went wrong and what to do, and without the dump. The caller raises it ``from`` the client's
exception, so the full client text (secrets removed) stays in the cause chain: a traceback
(``--debug`` in the CLI) still shows it.

The cases recognised:

* **No credentials.** The AWS client looks for credentials in the ``AWS_*`` variables, the
  shared files and ``storage_options``, and last asks the EC2 instance metadata service (IMDS).
  Off EC2 that request is refused or times out, so a failed request to IMDS means that no
  credentials were found anywhere: :class:`pyckpt.errors.NoCredentialsError`, listing the ways
  to provide them.
* **Unreachable endpoint** (connection refused or timed out, unknown host, TLS failure):
  :class:`pyckpt.errors.ObjectStoreError` naming the endpoint, the reason and the retries.
* **An http endpoint the client refuses** (``AWS_ALLOW_HTTP`` not set): ``ValueError`` saying
  how to allow it.
* Otherwise the classification by status: ``FileNotFoundError`` (missing object or bucket),
  ``PermissionError`` (credentials refused), ``ObjectStoreError``; the message keeps the client's
  summary line only.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Iterable

from pyckpt.errors import NoCredentialsError, ObjectStoreError

__all__ = ["redact", "translate"]

# The EC2 instance metadata service (IPv4, IPv6) and the ECS task credentials endpoint.
_IMDS_HOSTS = ("169.254.169.254", "[fd00:ec2::254]", "169.254.170.2")
_IMDS_PATHS = ("/latest/api/token", "/latest/meta-data/")
_REQUEST = re.compile(r"Error performing (?:[A-Z]+ )?(?P<url>[a-z][a-z0-9+.-]*://[^\s,]+)")
_RETRIES = re.compile(r" in (?P<elapsed>[0-9.]+[a-zµ]+)(?:, after (?P<n>\d+) retries)?")
_DEBUG = "Debug source:"
_MAX_SUMMARY = 300

CREDENTIALS_HELP = (
    "provide them through the AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY environment variables "
    "(plus AWS_SESSION_TOKEN for temporary ones), a profile in ~/.aws/credentials or "
    "~/.aws/config (AWS_PROFILE chooses it), or storage_options={'access_key_id': ..., "
    "'secret_access_key': ...}; for a public bucket pass storage_options={'skip_signature': True}"
)


def redact(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every non-empty string of ``secrets`` replaced by ``***``."""
    for s in secrets:
        if s:
            text = text.replace(s, "***")
    return text


def _summary(text: str) -> str:
    """The client's message without its debug dump, on one line."""
    head = " ".join(text.split(_DEBUG, 1)[0].split())
    return head if len(head) <= _MAX_SUMMARY else head[:_MAX_SUMMARY] + "..."


def _endpoint(url: str) -> str:
    """``scheme://host[:port]`` of a request URL."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0].split('?', 1)[0]}"


def _quoted_reason(debug: str) -> str | None:
    """The innermost human-readable reason in the debug dump (``Connection refused``,
    ``failed to lookup address information: ...``), if any."""
    found = re.findall(r'(?:message|error): "([^"]+)"', debug)
    if found:
        return found[-1]
    for what in ("dns error", "tcp connect error", "operation timed out", "certificate",
                 "TimedOut", "Timeout"):
        if what in debug:
            return "timed out" if what in ("TimedOut", "Timeout", "operation timed out") else what
    return None


def _attempts(text: str) -> str:
    """`` (after 3 retries, 12.4 s)`` from the client's summary, or ``""``."""
    m = _RETRIES.search(text.split(_DEBUG, 1)[0])
    if m is None:
        return ""
    num = re.match(r"[0-9.]+", m.group("elapsed"))
    unit = m.group("elapsed")[num.end():] if num else ""
    scale = {"s": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6, "ns": 1e-9}.get(unit)
    secs = float(num.group()) * scale if num and scale is not None else None
    elapsed = m.group("elapsed") if secs is None else (
        f"{secs:.1f} s" if secs >= 1 else f"{secs * 1e3:.0f} ms")
    n = m.group("n")
    tries = "" if not n else f"after {n} retr{'y' if n == '1' else 'ies'}, "
    return f" ({tries}{elapsed})"


def _is_imds(url: str) -> bool:
    host_and_path = url.partition("://")[2]
    host = host_and_path.split("/", 1)[0]
    path = "/" + host_and_path.split("/", 1)[1] if "/" in host_and_path else "/"
    return host.rsplit(":", 1)[0] in _IMDS_HOSTS or host in _IMDS_HOSTS or path.startswith(
        _IMDS_PATHS)


def no_credentials(e: BaseException) -> bool:
    """Whether the client's error ``e`` is its failed last look for credentials (a request to
    the EC2 instance metadata service): no retry can change that."""
    request = _REQUEST.search(str(e).partition(_DEBUG)[0])
    return bool(request and _is_imds(request.group("url")))


def translate(e: BaseException, what: str, url: str, secrets: Iterable[str] = ()) -> Exception:
    """The typed error for the client failure ``e`` while doing ``what`` (``"PUT"``,
    ``"upload of"``...) on ``url`` (the object's or checkpoint's URL, set as ``filename`` of the
    OSErrors). ``secrets`` are removed from every text kept.

    Returns (the caller raises it ``from e``; ``e``'s text is redacted in place when it quoted a
    secret):
        NoCredentialsError, ObjectStoreError (unreachable endpoint, other failures),
        FileNotFoundError, PermissionError, or ValueError (an http endpoint not allowed).
    """
    from obstore import exceptions as ox

    full = redact(str(e), list(secrets))
    head, _, debug = full.partition(_DEBUG)
    summary = _summary(full)
    request = _REQUEST.search(head)
    request_url = request.group("url") if request else ""
    out: Exception
    if request_url and _is_imds(request_url):
        out = NoCredentialsError(
            errno.EACCES,
            f"no AWS credentials found for {what} {url}: none in the AWS_* environment "
            f"variables, ~/.aws or storage_options, and none from the EC2 instance metadata "
            f"service ({_endpoint(request_url)}). {CREDENTIALS_HELP[0].upper()}"
            f"{CREDENTIALS_HELP[1:]}",
            url,
        )
    elif "builder error" in head and "BadScheme" in debug:
        out = ValueError(
            f"{what} {url}: the endpoint {_endpoint(request_url) or '(unknown)'} is http and the "
            "client refuses plain http by default; set AWS_ALLOW_HTTP=true or pass "
            "storage_options={'allow_http': True}"
        )
    elif "error sending request" in head or "ConnectError" in debug:
        endpoint = _endpoint(request_url) if request_url else "the object store"
        reason = _quoted_reason(debug) or summary.rsplit(" - ", 1)[-1]
        out = ObjectStoreError(
            errno.EHOSTUNREACH,
            f"{what} {url}: cannot reach the object store endpoint {endpoint}: {reason}"
            f"{_attempts(head)}; check the endpoint (AWS_ENDPOINT_URL, ~/.aws/config "
            "endpoint_url, or storage_options={'endpoint': ...}), that the server runs, and the "
            "network",
            url,
        )
    elif isinstance(e, (ox.NotFoundError, FileNotFoundError)) or "NoSuchBucket" in full:
        # obstore raises the builtin FileNotFoundError / PermissionError for those statuses.
        out = FileNotFoundError(errno.ENOENT, f"{what} {url} failed: {summary}", url)
    elif isinstance(e, (ox.PermissionDeniedError, ox.UnauthenticatedError, PermissionError)) or any(
        s in full for s in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                            "403 Forbidden")
    ):
        out = PermissionError(
            errno.EACCES,
            f"{what} {url} failed: access refused (check the credentials and the bucket's "
            f"permissions): {summary}",
            url,
        )
    else:
        out = ObjectStoreError(errno.EIO, f"{what} {url} failed: {summary}", url)
    if full != str(e):  # the client's text quoted a secret: keep it out of the cause too
        e.args = (full,)
    return out
