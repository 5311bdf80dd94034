"""The peer backend with two real ranks: what a single process cannot show."""

from __future__ import annotations

from pathlib import Path

from _backend_workers import peer_clean_up_fails_on_rank_1
from dist_utils import run_distributed


def test_a_rank_whose_clean_up_fails_still_reports_the_committed_save(tmp_path: Path) -> None:
    """Issue 24 item 2 on peers: the metadata copy on rank 1 is written, its removal of the
    previous save's files fails: a warning there, no exception on any rank, and the new
    checkpoint loads bit-exact (checked inside)."""
    warnings = run_distributed(peer_clean_up_fails_on_rank_1, 2, str(tmp_path))
    assert warnings[0] == []
    assert len(warnings[1]) == 1 and str(tmp_path / "node1") in warnings[1][0]
    left = {p.name for p in (tmp_path / "node1").iterdir() if p.name.endswith(".pyckpt")}
    assert len(left) == 2  # the previous save's file stays for the next save to remove
