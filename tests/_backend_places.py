"""The places of the backend conformance suite (tests/backends/), importable by name from
tests and from child processes (tests/ is on sys.path via conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyckpt
from pyckpt.backends import Backend, open_backend

BUCKET = "pyckpt-conformance"
KINDS = ("posix", "memory", "s3", "peer")


@dataclass
class Place:
    """A checkpoint location of one backend kind, with the options its users pass."""

    kind: str
    location: str
    options: dict[str, Any] = field(default_factory=dict)
    server: Any = None

    def backend(self) -> Backend:
        return open_backend(self.location, self.options.get("storage_options"),
                            shared_filesystem=self.options.get("shared_filesystem", True))

    def save(self, sd: dict[str, Any], **writer_options: Any) -> None:
        pyckpt.save(sd, self.location, **self.options, **writer_options)

    def load(self, sd: dict[str, Any]) -> None:
        pyckpt.load(sd, self.location, **self.options)
