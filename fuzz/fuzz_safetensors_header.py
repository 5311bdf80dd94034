"""libFuzzer (atheris) harness: the native safetensors header parser.

Input: header bytes after the 8-byte length; the claimed file size comes from the last 8 bytes.
Every input must be accepted or refused with a typed error (pyckpt.PyckptError / OSError); any
other exception, a crash or a sanitizer report is a finding.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports(include=["pyckpt"]):  # not torch: minutes of start-up
    from pyckpt import _C
    from pyckpt.errors import PyckptError


@atheris.instrument_func
def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    size_choice = fdp.ConsumeIntInRange(0, 3)
    header = fdp.ConsumeBytes(fdp.remaining_bytes())
    file_size = [len(header) + 8, len(header) + 8 + 4096, 0, (1 << 64) - 1][size_choice]
    try:
        _C.parse_safetensors_header(header, file_size)
    except (PyckptError, OSError):
        pass


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
