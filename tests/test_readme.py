"""The README's Python examples run as written.

Every ```python block of README.md runs, in order, in one namespace, in one fresh process, in a
scratch directory: after a prelude that makes the ``model`` and ``optim`` the README assumes (a
small model trained a few steps) and points the ``AWS_*`` variables at a local S3-compatible
server holding the README's bucket. The resume the Quickstart shows is then checked: the model
and optimizer it loaded continue the run bit-identically.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from _child_env import child_env
from _s3server import started

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK_RE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)

PRELUDE = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
batch = torch.linspace(-1, 1, 128).reshape(8, 16)

def train(steps):
    losses = []
    for _ in range(steps):
        optim.zero_grad()
        loss = (model(batch) ** 2).mean()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses

train(3)
import copy
_model0, _optim_sd0 = copy.deepcopy(model.state_dict()), copy.deepcopy(optim.state_dict())
_expected = train(3)                      # the uninterrupted run
model.load_state_dict(_model0)
optim.load_state_dict(_optim_sd0)
"""

# After the README: a fresh model and optimizer resume from the Quickstart's checkpoints.
EPILOGUE = """
for _path in ("ckpt/step-1000", "ckpt/step-2000"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if _path.endswith("1000"):
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, storage_reader=pyckpt.Reader(_path))
        set_state_dict(model, optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    else:
        resume = {"model": model, "optim": optim, "step": 0}
        pyckpt.load(resume, _path)
        assert resume["step"] == 2000, resume["step"]
    assert train(3) == _expected, (_path, _expected)
print("README OK")
"""


def readme_blocks() -> list[str]:
    return [m.group(1) for m in BLOCK_RE.finditer(README.read_text())]


def test_the_readme_has_its_examples() -> None:
    code = "\n".join(readme_blocks())
    for needle in ("get_state_dict(model, optim)", "pyckpt.Writer(", "pyckpt.Reader(",
                   "s3://bucket/", "pyckpt.find_error("):
        assert needle in code, needle


@pytest.fixture(scope="module")
def bucket_server() -> Any:
    srv = started("bucket")
    try:
        yield srv
    finally:
        srv.close()


@pytest.mark.slow
def test_readme_examples_run_as_written(tmp_path: Path, bucket_server: Any) -> None:
    script = "\n".join([textwrap.dedent(PRELUDE), *readme_blocks(), textwrap.dedent(EPILOGUE)])
    (tmp_path / "readme.py").write_text(script)
    env = child_env(**bucket_server.env())
    proc = subprocess.run([sys.executable, "-W", "error::pyckpt.PartialLoadWarning",
                           "readme.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "README OK" in proc.stdout
