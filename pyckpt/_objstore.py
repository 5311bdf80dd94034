"""Object-store backend (S3 and S3-compatible stores) of the storage layer, on ``obstore``.

A checkpoint at ``s3://bucket/prefix`` is the same set of objects a directory holds as files:
``prefix/<rank>-<k>.<save_id>.pyckpt`` data objects and ``prefix/pyckpt.json`` written last.

Write path: chunks are encoded by the native pipeline into a :class:`pyckpt._C.BlockWriter`
(a ChunkSink whose blocks export the buffer protocol) and handed to an ``obstore`` writer that
uploads them as multipart parts, several in flight (memory bounded by ``part_bytes`` x
(``max_concurrency`` + 2)); the GIL is released while encoding and while ``obstore`` waits. A
failed upload is aborted. The metadata object is one PUT made by the coordinator after every
rank's data objects are complete, so a checkpoint becomes visible whole; objects of older saves
are deleted only after it is written.

Read path: for each batch of read requests, exactly the stored ranges of the chunks that overlap
the requested bytes are fetched with ranged GETs (many in flight, GIL released), then verified
and decoded natively in place (:func:`pyckpt._C.read_requests` with ``sources`` lends the downloaded buffers
through ``ChunkSource::view_at``).

Credentials, region and endpoint come from the standard ``AWS_*`` environment variables (read by
``obstore``), the AWS shared credentials and config files (:func:`aws_shared_config`), and
``storage_options`` (which win). Errors name the URL, never a secret.
Payloads are signed over http and sent as ``UNSIGNED-PAYLOAD`` over https unless either says
otherwise (``unsigned_payload``).
"""

from __future__ import annotations

import concurrent.futures
import configparser
import errno
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from pyckpt import _C, _format, _retry
from pyckpt._format import METADATA_FILE
from pyckpt.errors import CheckpointFormatError, ConcurrentSaveError, ObjectStoreError

logger = logging.getLogger("pyckpt.consolidate")

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_PART_BYTES",
    "DataUpload",
    "Location",
    "ObjectStoreError",
    "Fetcher",
    "is_url",
    "location",
]

SCHEMES = ("s3://",)
# Any other "scheme://" (two letters or more, so no drive letter): refused, never a local path.
_FOREIGN_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+)://")
# Multipart part size (S3 requires >= 5 MiB for every part but the last) and parts in flight.
DEFAULT_PART_BYTES = 16 << 20
MIN_PART_BYTES = 5 << 20
MAX_PART_BYTES = 5 << 30
DEFAULT_MAX_CONCURRENCY = 8
# Raw bytes per chunk of a checkpoint saved to an object store (files: 4 MiB). A resharded load
# fetches whole chunks, so a rank downloads up to one chunk more than it needs at each end of
# every slice it loads: at 512 KiB that stays within 1.1x for slices of 10 MiB and more (an
# FSDP shard of a 4096 x 4096 bf16 weight loaded by 3 ranks is 10.7 MiB; at 4 MiB chunks its
# middle rank fetched 1.5x). Chunks are merged into ranged GETs of about ``_RANGE_BYTES``, so
# smaller chunks add no requests; they cost ~60 bytes of metadata each and ~10% more client CPU
# on a zstd save (BENCHMARKS.md).
DEFAULT_CHUNK_BYTES = 512 << 10
# Ranged GETs: a range holds whole chunks, up to about this many bytes; this many in flight.
_RANGE_BYTES = 8 << 20
_GET_CONCURRENCY = 16
# Stored bytes downloaded and held at once by one read batch.
_FETCH_BATCH_BYTES = 256 << 20

# storage_options keys that are secrets (scrubbed from every message) and keys of the client.
_SECRET_KEYS = ("secret_access_key", "session_token", "token", "aws_secret_access_key",
                "aws_session_token")
_CLIENT_KEYS = frozenset((
    "allow_http", "allow_invalid_certificates", "connect_timeout", "timeout", "read_timeout",
    "pool_idle_timeout", "user_agent", "proxy_url",
))
_RETRY_KEYS = frozenset(("max_retries", "retry_timeout"))  # pyckpt._retry.policy
# Location.put's "no condition".
ANY = object()

# Test hook: called as _after_part(object_url, part_number) after each part is handed over.
_after_part: Callable[[str, int], None] | None = None


def _obstore() -> Any:
    """The ``obstore`` module, or an ImportError saying how to get it."""
    try:
        import obstore
    except ImportError as e:
        raise ImportError(
            "object-store URLs (s3://...) need the obstore client: pip install 'pyckpt[s3]'"
        ) from e
    return obstore


def is_url(path: Any) -> bool:
    """True when ``path`` is an object-store URL this backend serves (``s3://...``), False for
    a local path.

    Raises:
        ValueError: a URL of any other scheme (``gs://``, ``az://``, ``file://``, ``S3://``...),
            naming it. Taken as a path, ``gs://bucket/ckpt`` would be the relative directory
            ``gs:/bucket/ckpt``: a save would land on the local disk while its caller believed
            it was in the bucket.
    """
    if not isinstance(path, str):
        return False
    if path.startswith(SCHEMES):
        return True
    m = _FOREIGN_URL.match(path)
    if m is not None:
        raise ValueError(
            f"{path}: unsupported URL scheme {m.group(1)!r}; pyckpt reads and writes local "
            "paths and s3:// URLs (Amazon S3 and S3-compatible stores)"
        )
    return False


def _redact(text: str, secrets: Iterable[str]) -> str:
    for s in secrets:
        if s:
            text = text.replace(s, "***")
    return text


@dataclass
class Location:
    """A checkpoint's place in an object store: ``s3://bucket/prefix``.

    Args:
        url: the checkpoint URL.
        storage_options: see :func:`location`.

    Raises:
        ValueError: a malformed URL (no bucket, or ``.``/``..`` path segments).
    """

    url: str
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    bucket: str = field(init=False)
    prefix: str = field(init=False)
    _store: Any = field(default=None, init=False, repr=False, compare=False)
    _lock: Any = field(default=None, init=False, repr=False, compare=False)
    _file_secrets: list[str] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        rest = self.url.split("://", 1)[1]
        bucket, _, prefix = rest.partition("/")
        prefix = prefix.strip("/")
        if not bucket or any(p in (".", "..", "") for p in prefix.split("/") if prefix):
            raise ValueError(f"invalid object-store URL {self.url!r}: expected "
                             "s3://bucket[/prefix] with no empty, '.' or '..' segments")
        self.bucket, self.prefix = bucket, prefix
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_store"] = None
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # -- names -----------------------------------------------------------------------------

    def key(self, name: str) -> str:
        """The object key of ``name``: always ``prefix/name`` with ``name`` a plain checkpoint
        object name (a data object or the metadata), so nothing outside the prefix is reached.

        Raises:
            CheckpointFormatError: ``name`` is not such a name.
        """
        if name != METADATA_FILE and not _format.is_data_file(name):
            raise CheckpointFormatError(f"{self.url}: illegal object name {name!r}")
        return f"{self.prefix}/{name}" if self.prefix else name

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def name_of(self, url: str) -> str:
        """Inverse of :meth:`url_of` for names validated by the metadata reader."""
        name = url.rsplit("/", 1)[-1]
        if url != self.url_of(name):
            raise CheckpointFormatError(f"{url}: not an object of checkpoint {self.url}")
        return name

    # -- client ----------------------------------------------------------------------------

    def _secrets(self) -> list[str]:
        out = [str(self.storage_options.get(k) or "") for k in _SECRET_KEYS]
        out += [os.environ.get("AWS_SECRET_ACCESS_KEY", ""), os.environ.get("AWS_SESSION_TOKEN", "")]
        return [s for s in out + self._file_secrets if len(s) >= 4]

    def retry_policy(self) -> _retry.RetryPolicy:
        return _retry.policy(self.storage_options)

    def _retried(self, fn: Callable[[], Any], what: str) -> Any:
        return _retry.call(fn, self.retry_policy(), what)

    def store(self) -> Any:
        """The ``obstore.store.S3Store`` (made once; ``AWS_*`` variables, then options)."""
        with self._lock:
            if self._store is None:
                self._store = self._make_store()
            return self._store

    def _make_store(self) -> Any:
        _obstore()
        from obstore.store import S3Store

        # Lowest precedence: the shared files fill only what the AWS_* variables leave unset
        # (obstore reads those itself); storage_options, applied below, override both.
        try:
            has_keys = any(_config_key(k) in ("access_key_id", "credential_provider", "skip_signature")
                           for k in self.storage_options)
            config: dict[str, Any] = aws_shared_config(need_keys=not has_keys)
        except ValueError as e:
            raise ValueError(f"{self.url}: {e}") from None
        self._file_secrets = [str(config.get(k, "")) for k in ("secret_access_key", "session_token")]
        provider = None
        client: dict[str, Any] = {"connect_timeout": "5s", "timeout": "120s",
                                  "read_timeout": _retry.DEFAULT_STALL_TIMEOUT}
        retry = _retry.client_config(self.retry_policy())
        if os.environ.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true", "yes"):
            client["allow_http"] = True
        for k, v in self.storage_options.items():
            if k in _CLIENT_KEYS:
                client[k] = v
            elif k == "stall_timeout":
                client["read_timeout"] = v
            elif k in _RETRY_KEYS:
                pass  # in retry (retry_policy)
            elif k == "credential_provider":
                provider = v
            else:
                config[k] = v
        if _unsigned_payload_by_default(config):
            config["unsigned_payload"] = True
        try:
            return S3Store(self.bucket, config=cast(Any, config), client_options=cast(Any, client),
                           retry_config=cast(Any, retry), credential_provider=provider)
        except Exception as e:
            raise ValueError(
                f"{self.url}: cannot configure the object store client: "
                f"{_redact(str(e), self._secrets())}"
            ) from None

    def error(self, e: BaseException, what: str, url: str | None = None) -> OSError:
        """The typed error for a client failure ``e`` while doing ``what`` on ``url``:
        FileNotFoundError, PermissionError or ObjectStoreError, ``filename`` the URL."""
        from obstore import exceptions as ox

        url = url or self.url
        detail = " ".join(_redact(str(e), self._secrets()).split())
        if len(detail) > 600:
            detail = detail[:600] + "..."
        msg = f"{what} {url} failed: {detail}"
        # obstore raises the builtin FileNotFoundError / PermissionError for those statuses.
        if isinstance(e, (ox.NotFoundError, FileNotFoundError)) or "NoSuchBucket" in detail:
            return FileNotFoundError(errno.ENOENT, msg, url)
        if isinstance(e, (ox.PermissionDeniedError, ox.UnauthenticatedError, PermissionError)) or any(
            s in detail for s in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                                  "403 Forbidden")
        ):
            return PermissionError(errno.EACCES, msg, url)
        return ObjectStoreError(errno.EIO, msg, url)

    # -- operations ------------------------------------------------------------------------

    def head(self, name: str) -> int | None:
        """Size of object ``name``, or None when it does not exist."""
        meta = self.head_meta(name)
        return None if meta is None else int(meta["size"])

    def head_meta(self, name: str) -> dict[str, Any] | None:
        """obstore's ``ObjectMeta`` of ``name`` (``size``, ``e_tag``...), or None when absent."""
        obstore = _obstore()
        from obstore import exceptions as ox

        try:
            return dict(self._retried(lambda: obstore.head(self.store(), self.key(name)),
                                      f"HEAD {self.url_of(name)}"))
        except (ox.NotFoundError, FileNotFoundError):
            return None
        except (CheckpointFormatError, ValueError):
            raise
        except Exception as e:
            raise self.error(e, "HEAD", self.url_of(name)) from None

    def check_bucket(self) -> None:
        """Lists at most one key of the prefix: a missing bucket or refused credentials fail
        here, naming the URL, before anything is uploaded."""
        obstore = _obstore()

        try:
            self._retried(lambda: next(iter(obstore.list(
                self.store(), self.prefix + "/" if self.prefix else None, chunk_size=1)), None),
                f"LIST {self.url}")
        except ValueError:
            raise
        except Exception as e:
            raise self.error(e, "LIST", self.url) from None

    def list_names(self) -> dict[str, int]:
        """Objects directly under the prefix: name -> size."""
        obstore = _obstore()

        out: dict[str, int] = {}
        try:
            res = self._retried(lambda: obstore.list_with_delimiter(
                self.store(), self.prefix or None), f"LIST {self.url}")
        except Exception as e:
            raise self.error(e, "LIST", self.url) from None
        for meta in res["objects"]:
            name = str(meta["path"]).rsplit("/", 1)[-1]
            out[name] = int(meta["size"])
        return out

    def put(self, name: str, data: bytes, if_match: str | None | object = ANY) -> None:
        """Writes object ``name`` with one PUT (atomic: visible whole or not at all).

        Args:
            if_match: :data:`ANY` (unconditional), None (only if the object does not exist:
                ``If-None-Match: *``) or an ETag (only if the object still has it:
                ``If-Match``). A store that cannot make conditional writes (obstore raises
                NotSupported, e.g. with ``storage_options={"conditional_put": "disabled"}``)
                gets an unconditional PUT and a warning.

        Raises:
            ConcurrentSaveError: the condition failed.
        """
        obstore = _obstore()
        from obstore import exceptions as ox

        url = self.url_of(name)
        mode: Any = ("overwrite" if if_match is ANY else "create" if if_match is None
                     else {"e_tag": if_match})
        try:
            try:
                self._retried(lambda: obstore.put(self.store(), self.key(name), data,
                                                  use_multipart=False, mode=mode), f"PUT {url}")
            except (ox.NotSupportedError, NotImplementedError) as e:
                if mode == "overwrite":
                    raise
                logger.warning("pyckpt: %s: conditional PUT not supported (%s); writing "
                               "unconditionally, concurrent saves are not detected", url,
                               _redact(str(e), self._secrets()).splitlines()[0])
                self._retried(lambda: obstore.put(self.store(), self.key(name), data,
                                                  use_multipart=False), f"PUT {url}")
        except (ox.AlreadyExistsError, ox.PreconditionError, FileExistsError):
            raise ConcurrentSaveError(
                errno.EBUSY,
                "another save committed a checkpoint under this prefix while this save ran; "
                "this save is abandoned and the other checkpoint left intact",
                url,
            ) from None
        except Exception as e:
            raise self.error(e, "PUT", url) from None

    def get(self, name: str, limit: int) -> bytes:
        """Object ``name`` (at most ``limit`` bytes, else CheckpointFormatError)."""
        obstore = _obstore()

        size = self.head(name)
        if size is None:
            self.check_bucket()  # a missing bucket is reported as such
            raise FileNotFoundError(
                errno.ENOENT, f"not a complete pyckpt checkpoint: {METADATA_FILE} is missing",
                self.url_of(name),
            )
        if size > limit:
            raise CheckpointFormatError(
                f"{self.url_of(name)}: {size} bytes, more than the {limit} bytes this pyckpt reads"
            )
        try:
            return bytes(self._retried(lambda: obstore.get(self.store(), self.key(name)).bytes(),
                                       f"GET {self.url_of(name)}"))
        except Exception as e:
            raise self.error(e, "GET", self.url_of(name)) from None

    def get_range(self, name: str, start: int, end: int) -> Any:
        """Bytes [start, end) of object ``name`` (an ``obstore.Bytes``; buffer protocol)."""
        obstore = _obstore()

        try:
            return self._retried(
                lambda: obstore.get_range(self.store(), self.key(name), start=start, end=end),
                f"GET bytes {start}-{end - 1} of {self.url_of(name)}")
        except Exception as e:
            raise self.error(e, f"GET bytes {start}-{end - 1} of", self.url_of(name)) from None

    def delete(self, names: Iterable[str]) -> None:
        """Deletes objects (missing ones are fine)."""
        obstore = _obstore()

        keys = [self.key(n) for n in names]
        if not keys:
            return
        try:
            self._retried(lambda: obstore.delete(self.store(), keys), f"DELETE in {self.url}")
        except Exception as e:
            raise self.error(e, "DELETE", self.url) from None


# Profile settings that obtain credentials by running or asking something, which pyckpt does not do.
_INDIRECT_CREDENTIALS = ("credential_process", "role_arn", "sso_session", "sso_start_url",
                         "web_identity_token_file", "source_profile")
# Variables through which obstore obtains credentials itself (web identity, e.g. EKS IRSA; ECS).
_ENV_CREDENTIAL_SOURCES = ("AWS_ACCESS_KEY_ID", "AWS_WEB_IDENTITY_TOKEN_FILE",
                           "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                           "AWS_CONTAINER_CREDENTIALS_FULL_URI")


def _ini_section(path: str, section: str) -> dict[str, str] | None:
    """Section ``section`` of the INI file ``path`` (keys lower-cased), None when the file or the
    section does not exist.

    Raises:
        ValueError: the file cannot be read or parsed, naming it.
    """
    parser = configparser.RawConfigParser(default_section="\0none")
    try:
        with open(path, encoding="utf-8") as f:
            parser.read_file(f, source=path)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, configparser.Error) as e:
        raise ValueError(f"{path}: cannot read this AWS configuration file: {e}") from None
    if not parser.has_section(section):
        return None
    return {k.lower(): v.strip() for k, v in parser.items(section)}


def aws_shared_config(environ: Mapping[str, str] | None = None,
                      need_keys: bool = True) -> dict[str, str]:
    """``S3Config`` settings from the AWS shared files, for what the environment leaves unset.

    The files are those of the AWS CLI and SDKs: ``AWS_SHARED_CREDENTIALS_FILE`` (default
    ``~/.aws/credentials``, sections ``[name]``) and ``AWS_CONFIG_FILE`` (default
    ``~/.aws/config``, sections ``[profile name]``, or ``[default]``); the profile is
    ``AWS_PROFILE`` (or ``AWS_DEFAULT_PROFILE``), else ``default``. As in the SDKs, keys in the
    environment win over the files and the credentials file over the config file:

    - ``aws_access_key_id`` / ``aws_secret_access_key`` / ``aws_session_token``, unless
      ``AWS_ACCESS_KEY_ID``, ``AWS_WEB_IDENTITY_TOKEN_FILE`` or an ECS container-credentials
      variable is set (obstore then obtains the credentials itself);
    - ``region``, unless ``AWS_REGION`` or ``AWS_DEFAULT_REGION`` is set;
    - ``endpoint_url``, unless ``AWS_ENDPOINT_URL`` or ``AWS_ENDPOINT`` is set;
      ``AWS_ENDPOINT_URL_S3`` (which obstore does not read) beats all of them.

    ``need_keys=False`` (the caller has keys or a credential provider) skips the keys.

    Raises:
        ValueError: ``AWS_PROFILE`` names a profile in neither file; a file cannot be parsed; or
            the profile gets its credentials by a process, a role or SSO (``credential_process``,
            ``role_arn``, ``sso_session``...), which pyckpt does not run: pass
            ``storage_options={"credential_provider": ...}`` (e.g. obstore's
            ``Boto3CredentialProvider``) for those.
    """
    env = os.environ if environ is None else environ
    explicit = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE")
    profile = explicit or "default"
    aws_dir = os.path.join(os.path.expanduser("~"), ".aws")
    creds_path = env.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(aws_dir, "credentials")
    config_path = env.get("AWS_CONFIG_FILE") or os.path.join(aws_dir, "config")
    creds = _ini_section(creds_path, profile)
    conf = _ini_section(config_path, f"profile {profile}")
    if conf is None and profile == "default":
        conf = _ini_section(config_path, "default")
    if creds is None and conf is None and explicit:
        raise ValueError(f"AWS profile {profile!r} (AWS_PROFILE) is in neither {creds_path} "
                         f"nor {config_path}")
    creds, conf = creds or {}, conf or {}
    out: dict[str, str] = {}
    if need_keys and not any(env.get(k) for k in _ENV_CREDENTIAL_SOURCES):
        keys = creds if creds.get("aws_access_key_id") else conf
        if keys.get("aws_access_key_id") and keys.get("aws_secret_access_key"):
            out["access_key_id"] = keys["aws_access_key_id"]
            out["secret_access_key"] = keys["aws_secret_access_key"]
            if keys.get("aws_session_token"):
                out["session_token"] = keys["aws_session_token"]
        else:
            indirect = [k for k in _INDIRECT_CREDENTIALS if k in creds or k in conf]
            if indirect:
                raise ValueError(
                    f"AWS profile {profile!r} gets its credentials through {indirect[0]}, which "
                    "pyckpt does not evaluate: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or "
                    "pass storage_options={'credential_provider': ...} (e.g. obstore's "
                    "Boto3CredentialProvider)"
                )
    if not (env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")) and conf.get("region"):
        out["region"] = conf["region"]
    if not (env.get("AWS_ENDPOINT_URL") or env.get("AWS_ENDPOINT")) and conf.get("endpoint_url"):
        out["endpoint"] = conf["endpoint_url"]
    if env.get("AWS_ENDPOINT_URL_S3"):  # the SDKs' S3-only endpoint beats the general one
        out["endpoint"] = env["AWS_ENDPOINT_URL_S3"]
    return out


def _config_key(key: str) -> str:
    """An ``S3Config`` key in its short form (``AWS_ENDPOINT_URL`` -> ``endpoint_url``)."""
    key = key.lower()
    return key[4:] if key.startswith("aws_") else key


def _unsigned_payload_by_default(config: Mapping[str, Any]) -> bool:
    """Whether to send ``UNSIGNED-PAYLOAD`` where neither the options nor the environment say.

    Over TLS the transport already protects the bytes (and every chunk carries a checksum that
    each read verifies), so pyckpt does not hash each part with SHA-256 for the signature, as
    botocore and the AWS CRT do not for S3 over https: that hash costs a core-second per 1.8 GB
    with SHA extensions and several without. Over plain http the payload stays signed.
    """
    keys = {_config_key(k): v for k, v in config.items()}
    if "unsigned_payload" in keys or "AWS_UNSIGNED_PAYLOAD" in os.environ:
        return False
    endpoint = keys.get("endpoint") or keys.get("endpoint_url")
    if endpoint is None:
        endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT")
    return endpoint is None or str(endpoint).lower().startswith("https://")


def location(url: str, storage_options: Mapping[str, Any] | None = None) -> Location:
    """A :class:`Location` for ``url``.

    Args:
        url: ``s3://bucket/prefix``.
        storage_options: client settings that override the ``AWS_*`` environment and the AWS
            shared files (:func:`aws_shared_config`): any ``obstore`` ``S3Config`` key
            (``endpoint``, ``region``, ``access_key_id``, ``secret_access_key``,
            ``session_token``, ``virtual_hosted_style_request``, ``skip_signature``, ...),
            client keys (``allow_http``, ``timeout``, ``connect_timeout``, ...),
            ``max_retries`` / ``retry_timeout`` (seconds), and ``credential_provider`` (an
            obstore credential provider, called for credentials as they expire).
    """
    return Location(url, dict(storage_options or {}))


# -- write path -----------------------------------------------------------------------------


class DataUpload:
    """One data object uploaded as a multipart upload while it is encoded.

    Used like :class:`pyckpt._C.FileWriter` (``write_items``, ``commit``, ``size``); leaving the
    ``with`` block without :meth:`commit` aborts the upload, so no object appears.

    Raises:
        FileNotFoundError / PermissionError / ObjectStoreError: an upload failed (naming the
            object's URL).
    """

    def __init__(self, loc: Location, name: str, part_bytes: int, max_concurrency: int) -> None:
        obstore = _obstore()

        self.loc = loc
        self.name = name
        self.url = loc.url_of(name)
        self.parts = 0
        self.bytes_uploaded = 0
        self._writer = obstore.open_writer(
            loc.store(), loc.key(name), buffer_size=part_bytes, max_concurrency=max_concurrency
        )
        # A block's buffer is reused once the upload of its part lets go of it: up to as many
        # as can be in flight, so memory stays within the same bound.
        self._native = _C.BlockWriter(self.url, part_bytes, self._on_block,
                                      spare_blocks=max_concurrency + 2)
        self.committed = False

    def _on_block(self, block: Any) -> None:
        try:
            self._writer.write(block)
        except Exception as e:
            raise self.loc.error(e, "upload of", self.url) from None
        self.parts += 1
        self.bytes_uploaded += len(block)
        if _after_part is not None:
            _after_part(self.url, self.parts)

    def write_items(self, *args: Any) -> Any:
        return self._native.write_items(*args)

    def append(self, data: Any) -> int:
        return int(self._native.append(data))

    @property
    def size(self) -> int:
        return int(self._native.size)

    @property
    def reused_blocks(self) -> int:
        """Parts encoded into the buffer of an earlier part that had been uploaded."""
        return int(self._native.reused_blocks)

    def commit(self) -> None:
        """Uploads the last part and completes the object."""
        self._native.commit()
        try:
            self._writer.close()
        except Exception as e:
            raise self.loc.error(e, "completing upload of", self.url) from None
        self.committed = True

    def abort(self) -> None:
        """Aborts the multipart upload (best effort: the store may be unreachable)."""
        if self.committed:
            return
        self._native.abort()
        err = RuntimeError("pyckpt: upload aborted")
        try:
            self._writer.__exit__(RuntimeError, err, None)
        except Exception:  # the store failed: it keeps the incomplete upload until it expires
            pass

    def __enter__(self) -> DataUpload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


def check_part_bytes(part_bytes: int | None) -> int:
    """Validates a multipart part size; None means :data:`DEFAULT_PART_BYTES`."""
    if part_bytes is None:
        return DEFAULT_PART_BYTES
    if not MIN_PART_BYTES <= part_bytes <= MAX_PART_BYTES:
        raise ValueError(
            f"part_bytes must be in [{MIN_PART_BYTES}, {MAX_PART_BYTES}] (S3 limits), "
            f"got {part_bytes}"
        )
    return part_bytes


def set_up_save(loc: Location, is_coordinator: bool, overwrite: bool) -> str | None | object:
    """Checks the bucket is reachable (typed errors naming the URL) and, on the coordinator with
    ``overwrite=False``, that no checkpoint is there yet.

    Returns:
        On the coordinator, the ETag of the metadata object the save will replace (None when
        there is none, :data:`ANY` when the store gave it no ETag), for :func:`commit_save`;
        None on other ranks.

    Raises:
        FileExistsError: ``overwrite=False`` and ``pyckpt.json`` exists.
    """
    loc.check_bucket()
    if not is_coordinator:
        return None
    meta = loc.head_meta(METADATA_FILE)
    if meta is None:
        return None
    if not overwrite:
        raise FileExistsError(
            errno.EEXIST,
            "Checkpoint already exists and overwrite=False; pass overwrite=True or choose "
            "another prefix",
            loc.url_of(METADATA_FILE),
        )
    etag = meta.get("e_tag")
    return str(etag) if etag else ANY


def commit_save(loc: Location, files: Mapping[str, int], encoded: bytes,
                base_etag: str | None | object) -> None:
    """Writes the metadata object (one conditional PUT), then deletes data objects of other
    saves.

    The PUT succeeds only if the metadata object is still the one :func:`set_up_save` saw
    (``base_etag``; None: none existed). Otherwise another save committed under this prefix
    in the meantime (and may already have deleted this save's objects as stale): this save
    fails with :class:`ConcurrentSaveError` and the other checkpoint is left whole, instead of
    being replaced by metadata naming deleted objects.

    A PUT whose answer was lost may still have landed (and its retry then fails its own
    condition), so a failed PUT is followed by a look at the stored metadata: if it is this
    save's, the save has succeeded. If it is another's or absent, this save's data objects are
    deleted (best effort) and the error propagates; the previous checkpoint (its metadata and
    objects) is untouched. If the look fails too, the data objects are left for the next save
    to delete, rather than risk deleting the objects of a committed checkpoint.
    """
    try:
        loc.put(METADATA_FILE, encoded, if_match=base_etag)
    except Exception:
        landed = _stored_metadata_is(loc, encoded)
        if not landed:
            if landed is False:
                try:
                    loc.delete(files)
                except OSError:
                    pass
            raise
        logger.warning("pyckpt: %s: the metadata PUT reported a failure but the stored "
                       "metadata is this save's: committed", loc.url_of(METADATA_FILE))
    stale = [n for n in loc.list_names() if _format.is_data_file(n) and n not in files]
    loc.delete(stale)


def _stored_metadata_is(loc: Location, encoded: bytes) -> bool | None:
    """Whether the stored metadata object is ``encoded`` (it holds the save id, so only this
    save wrote those bytes); None when the store cannot tell."""
    try:
        size = loc.head(METADATA_FILE)
        if size != len(encoded):
            return False
        return bytes(loc.get(METADATA_FILE, size)) == encoded
    except FileNotFoundError:
        return False
    except Exception:
        return None


# -- read path ------------------------------------------------------------------------------


class _Validator(_format._Validator):
    """The metadata validator with data objects checked against one LIST of the prefix."""

    def __init__(self, loc: Location, meta: str, version: int) -> None:
        super().__init__(loc.url, meta, version)
        self.loc = loc
        self._listing: dict[str, int] | None = None

    def check_file(self, name: str, size: int) -> str:
        url = self.loc.url_of(name)
        if self._listing is None:
            self._listing = self.loc.list_names()
        have = self._listing.get(name)
        if have is None:
            raise FileNotFoundError(
                errno.ENOENT, f"data object of checkpoint {self.loc.url!r} is missing", url
            )
        if have < size:
            raise CheckpointFormatError(
                f"{url}: data object is truncated: {have} bytes, expected {size}"
            )
        return url


def read_index(loc: Location) -> _format.CheckpointIndex:
    """Reads and validates ``pyckpt.json`` of ``loc`` exactly as :func:`_format.read_index`
    does for a directory: object names must be plain data object names (checked before any
    data object is looked at), and every data object must exist with at least its size.

    Raises:
        FileNotFoundError: no ``pyckpt.json`` (or a missing bucket, or a missing data object).
        PermissionError: the store refused the credentials.
        CheckpointFormatError: as :func:`_format.read_index`.
    """
    meta = loc.url_of(METADATA_FILE)
    raw = loc.get(METADATA_FILE, _format.MAX_METADATA_BYTES)
    doc, version = _format._parse([raw], meta)
    return _Validator(loc, meta, version).index(doc)


def _stored_len(chunk: Any) -> int:
    return int(sum(chunk[4][1::2]))


def _needed(request: Any) -> list[tuple[int, int, str, int, int]]:
    """(raw_a, raw_b, url, stored_off, stored_end) of the chunks overlapping a request."""
    _, segments, lo, hi, _ = request
    out = []
    for url, raw_begin, _, chunks in segments:
        a = raw_begin
        for c in chunks:
            b = a + c[1]
            if a < hi and b > lo:
                out.append((a, b, url, c[0], c[0] + _stored_len(c)))
            a = b
    out.sort()
    return out


def _split(request: Any, budget: int) -> list[tuple[Any, int, list[tuple[str, int, int]]]]:
    """Cuts a request at chunk boundaries into pieces whose chunks hold about ``budget`` stored
    bytes; returns (piece, stored bytes, chunk ranges)."""
    name, segments, lo, hi, dst = request
    pieces = []
    cur_lo, cur_bytes, cur_ranges = lo, 0, []
    for _a, b, url, s0, s1 in _needed(request):
        cur_ranges.append((url, s0, s1))
        cur_bytes += s1 - s0
        if cur_bytes >= budget and b < hi:
            pieces.append(((name, segments, cur_lo, b, dst + (cur_lo - lo)), cur_bytes, cur_ranges))
            cur_lo, cur_bytes, cur_ranges = b, 0, []
    if cur_lo < hi:
        pieces.append(((name, segments, cur_lo, hi, dst + (cur_lo - lo)), cur_bytes, cur_ranges))
    return pieces


def _coalesce(ranges: Iterable[tuple[str, int, int]]) -> dict[str, list[tuple[int, int]]]:
    """Per object, the chunk ranges merged into GET ranges: adjacent chunks join until a range
    holds about _RANGE_BYTES; a chunk is never split (it is decoded from one buffer)."""
    by_url: dict[str, list[tuple[int, int]]] = {}
    for url, s0, s1 in ranges:
        if s1 > s0:
            by_url.setdefault(url, []).append((s0, s1))
    out: dict[str, list[tuple[int, int]]] = {}
    for url, rs in by_url.items():
        rs = sorted(set(rs))
        merged: list[list[int]] = []
        for s0, s1 in rs:
            if merged and (s0 < merged[-1][1] or (
                s0 == merged[-1][1] and merged[-1][1] - merged[-1][0] < _RANGE_BYTES
            )):
                merged[-1][1] = max(merged[-1][1], s1)
            else:
                merged.append([s0, s1])
        out[url] = [(a, b) for a, b in merged]
    return out


class Fetcher:
    """Serves read requests of checkpoint ``loc``: ranged GETs of the needed chunks, then the
    native verify+decode over the downloaded buffers.

    Attributes:
        bytes_fetched: bytes downloaded from data objects so far.
        requests_made: ranged GETs made so far.
    """

    def __init__(self, loc: Location) -> None:
        self.loc = loc
        self.bytes_fetched = 0
        self.requests_made = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _download(self, ranges: dict[str, list[tuple[int, int]]]) -> dict[str, Any]:
        jobs = [(url, a, b) for url, rs in ranges.items() for a, b in rs]
        names = {url: self.loc.name_of(url) for url in ranges}
        # A short object is caught by the length check below; the source's size only bounds
        # the records against what was downloaded.
        sources: dict[str, Any] = {url: (max(b for _, b in rs), []) for url, rs in ranges.items()}
        if not jobs:
            return sources

        def fetch(job: tuple[str, int, int]) -> tuple[str, int, Any]:
            url, a, b = job
            data = self.loc.get_range(names[url], a, b)
            if len(data) != b - a:
                raise CheckpointFormatError(
                    f"{url}: data object is truncated: GET bytes {a}-{b - 1} returned "
                    f"{len(data)} bytes"
                )
            return url, a, data

        workers = min(_GET_CONCURRENCY, len(jobs))
        with concurrent.futures.ThreadPoolExecutor(workers, "pyckpt-get") as ex:
            for url, a, data in ex.map(fetch, jobs):
                sources[url][1].append((a, data))
                with self._lock:
                    self.bytes_fetched += len(data)
                    self.requests_made += 1
        return sources

    def read_requests(self, requests: list[Any], pool: Any) -> tuple[int, int]:
        """As :func:`pyckpt._C.read_requests`; fetches in batches of about _FETCH_BATCH_BYTES."""
        nread = ndecoded = 0
        batch: list[Any] = []
        ranges: list[tuple[str, int, int]] = []
        held = 0

        def flush() -> None:
            nonlocal batch, ranges, held, nread, ndecoded
            if batch:
                sources = self._download(_coalesce(ranges))
                r, d = _C.read_requests(batch, pool, sources)
                nread += r
                ndecoded += d
            batch, ranges, held = [], [], 0

        for request in requests:
            for piece, nbytes, rs in _split(request, _FETCH_BATCH_BYTES):
                if batch and held + nbytes > _FETCH_BATCH_BYTES:
                    flush()
                batch.append(piece)
                ranges.extend(rs)
                held += nbytes
        flush()
        return nread, ndecoded

    def verify_segments(self, name: str, segments: list[Any], pool: Any) -> tuple[int, int]:
        """As :func:`pyckpt._C.verify_segments`, one segment at a time (bounded memory)."""
        nread = nchecked = 0
        for seg in segments:
            rs = [(seg[0], c[0], c[0] + _stored_len(c)) for c in seg[3]]
            sources = self._download(_coalesce(rs))
            r, c = _C.verify_segments(name, [seg], pool, sources)
            nread += r
            nchecked += c
        return nread, nchecked


# -- consolidation ---------------------------------------------------------------------------


def _plain_key(loc: Location, name: str) -> str:
    """``prefix/name`` for an output file's plain base name (no separators, not . or ..)."""
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise ValueError(f"{loc.url}: illegal object name {name!r}")
    return f"{loc.prefix}/{name}" if loc.prefix else name


def stage_shares(files: Mapping[str, int], world: int) -> list[list[str]]:
    """Data object names by rank: each object to exactly one rank, balanced by bytes (largest
    first, each to the least loaded rank, ties to the lower rank; deterministic)."""
    loads = [0] * world
    shares: list[list[str]] = [[] for _ in range(world)]
    for name in sorted(files, key=lambda n: (-files[n], n)):
        r = min(range(world), key=lambda i: (loads[i], i))
        shares[r].append(name)
        loads[r] += files[name]
    return shares


def stage_checkpoint(loc: Location, directory: str,
                     share: tuple[int, int] | None = None) -> list[str]:
    """Downloads the pyckpt checkpoint at ``loc`` (validated metadata, then its data objects,
    streamed) into ``directory``, which then holds the same checkpoint as files.

    Args:
        loc: the checkpoint.
        directory: created if needed.
        share: ``(rank, world)``: download only that rank's share of the data objects
            (:func:`stage_shares`); ``directory`` then holds a node-local checkpoint.

    Returns:
        The names of the data objects downloaded.
    """
    obstore = _obstore()

    index = read_index(loc)  # names validated; objects checked against a listing
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, METADATA_FILE), "wb") as f:
        f.write(loc.get(METADATA_FILE, _format.MAX_METADATA_BYTES))

    def fetch(name: str) -> None:
        url = loc.url_of(name)
        try:
            stream = obstore.get(loc.store(), loc.key(name)).stream(min_chunk_size=8 << 20)
            with open(os.path.join(directory, name), "wb") as f:
                for part in stream:
                    f.write(part)
        except OSError as e:
            if e.filename == url or isinstance(e, ObjectStoreError):
                raise
            raise loc.error(e, "GET", url) from None
        except Exception as e:
            raise loc.error(e, "GET", url) from None

    names = list(index.files)
    if share is not None:
        names = stage_shares(index.files, share[1])[share[0]]
    with concurrent.futures.ThreadPoolExecutor(max(1, min(8, len(names)))) as ex:
        list(ex.map(fetch, names))
    return names


def upload_file(loc: Location, path: str, part_bytes: int = DEFAULT_PART_BYTES,
                single_put: bool = False) -> str:
    """Uploads local file ``path`` as ``prefix/<basename>`` (multipart above ``part_bytes``,
    or one PUT with ``single_put``); returns its URL."""
    import pathlib

    obstore = _obstore()

    name = os.path.basename(path)
    key = _plain_key(loc, name)
    url = loc.url_of(name)
    try:
        if single_put:
            with open(path, "rb") as f:
                obstore.put(loc.store(), key, f.read(), use_multipart=False)
        else:
            obstore.put(loc.store(), key, pathlib.Path(path), chunk_size=part_bytes,
                        max_concurrency=DEFAULT_MAX_CONCURRENCY)
    except Exception as e:
        raise loc.error(e, "upload of", url) from None
    return url


def consolidate_staged(run: Callable[..., Any], src: str, dst: str, *, process_group: Any,
                       shared_filesystem: bool = True, batch_bytes: int | None = None,
                       **kwargs: Any) -> Any:
    """:func:`pyckpt.consolidate` with an ``s3://`` source and/or destination. Client settings
    come from the ``AWS_*`` environment and the AWS shared files (:func:`aws_shared_config`).

    One process: a source pyckpt checkpoint is downloaded into a temp directory, the outputs
    are written into one and then uploaded (safetensors files as multipart objects, the index
    JSON last with one PUT, so it names only complete objects).

    Several ranks: the work is split as node-local consolidation splits it. Each rank downloads
    the validated ``pyckpt.json`` and only its share of the data objects (each object to one
    rank, balanced by bytes) into a private temp directory (a local ``src`` is read in place,
    shared or node-local); all ranks then run ``run(..., shared_filesystem=False)`` over
    ``process_group`` into a private temp directory (or, for a local ``dst``, into each rank's
    own ``dst``, laid out as node-local consolidation lays it out). For an ``s3://``
    destination each rank uploads the files it wrote; once every rank has succeeded, rank 0
    uploads the index with one PUT, last. On any rank's failure no index is uploaded, the
    objects this call uploaded are deleted (best effort) and every rank raises.

    Raises:
        ValueError: ``dedup_tied`` with several ranks (as with ``shared_filesystem=False``).
        NotImplementedError: several ranks and a local ``src`` that is not a pyckpt checkpoint.
    """
    import dataclasses
    import tempfile

    from pyckpt._collective import agree, group_info

    group = group_info(process_group)
    if group.world == 1:
        with tempfile.TemporaryDirectory(prefix="pyckpt-consolidate-") as tmp:
            local_src = src
            if is_url(src):
                local_src = os.path.join(tmp, "src")
                stage_checkpoint(location(src), local_src)
            local_dst = os.path.join(tmp, "dst") if is_url(dst) else dst
            res = run(local_src, local_dst, process_group=process_group,
                      shared_filesystem=shared_filesystem, batch_bytes=batch_bytes, **kwargs)
            if not is_url(dst):
                return res
            loc = location(dst)
            loc.check_bucket()
            files = [upload_file(loc, p) for p in res.files]
            index = upload_file(loc, res.index_path, single_put=True)  # last: complete files
            return dataclasses.replace(res, files=files, index_path=index)

    if kwargs.get("dedup_tied", False) is not False:  # refused by the node-local mode
        raise ValueError(
            "dedup_tied is not supported by pyckpt.consolidate with s3:// URLs on several ranks"
        )
    if not is_url(src):
        def check_source() -> None:
            from pyckpt._consolidate.scan import is_pyckpt

            if not is_pyckpt(src):
                raise NotImplementedError(
                    f"{src}: pyckpt.consolidate to an s3:// destination on several ranks needs "
                    "a pyckpt checkpoint (pyckpt.json); consolidate safetensors inputs on one "
                    "rank"
                )

        agree(check_source, group, ranks="root", what="checking the source")
    dst_loc = location(dst) if is_url(dst) else None
    with tempfile.TemporaryDirectory(prefix="pyckpt-consolidate-") as tmp:
        local_src = os.path.join(tmp, "src") if is_url(src) else src
        local_dst = os.path.join(tmp, "dst") if dst_loc is not None else dst

        def prepare() -> None:
            if dst_loc is not None:
                dst_loc.check_bucket()
            if is_url(src):
                names = stage_checkpoint(location(src), local_src, (group.rank, group.world))
                logger.info(
                    "rank %d/%d downloaded %d data object(s) of %s", group.rank, group.world,
                    len(names), src, extra={"pyckpt_staged": list(names)},
                )

        agree(prepare, group, what="downloading the source")
        res = run(local_src, local_dst, process_group=process_group, shared_filesystem=False,
                  batch_bytes=batch_bytes, **kwargs)
        if dst_loc is None:
            return res
        loc = dst_loc
        uploaded: list[str] = []

        def upload() -> list[str]:
            for p in res.files:
                uploaded.append(upload_file(loc, p))
            return list(uploaded)

        def drop() -> None:  # best effort: the objects this rank uploaded
            keys = [_plain_key(loc, u.rsplit("/", 1)[-1]) for u in uploaded]
            if keys:
                try:
                    _obstore().delete(loc.store(), keys)
                except Exception:
                    pass

        _, per_rank = agree(upload, group, on_failure=drop, what="upload")
        index_url, _ = agree(lambda: upload_file(loc, res.index_path, single_put=True), group,
                             ranks="root", on_failure=drop, what="index upload")
        files = sorted((u for urls in per_rank for u in urls), key=lambda u: u.rsplit("/", 1)[-1])
        return dataclasses.replace(res, files=files, index_path=index_url)
