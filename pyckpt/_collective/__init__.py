"""Small collectives over a ``torch.distributed`` process group (objects, not tensors).

Three subsystems, one module each: :mod:`.group` (a process's place in a group, pyckpt's own
groups, the gloo group derived from a user's group for coordination), :mod:`.liveness` (bounded waits, heartbeats, telling which rank was lost),
:mod:`.transport` (broadcast, all-gather, all-to-all of pickled objects over the bounded wait)
and :mod:`.agreement` (:func:`agree`: run a step, agree on its outcome, raise the same error
everywhere). This package re-exports what the rest of pyckpt uses.

Used by consolidation and by node-local checkpoints. ``torch`` is imported lazily: a single
process without ``torch.distributed`` works too (every function then acts on one rank).

No collective here waits forever on a lost rank (docs/RELIABILITY.md, "Peers that die"):

* a rank that sees a collective fail (gloo reports a closed connection at once when a peer
  dies) marks the group lost, sets a key in the group's store, and raises
  :class:`~pyckpt.errors.PeerLostError`; every waiting rank polls that key each second, so a
  survivor that waits on another survivor (one that left the collective) stops too;
* a wait longer than :func:`bound_s` (``PYCKPT_PEER_TIMEOUT``, default 300 s) checks the other
  ranks' heartbeats (a counter each rank's daemon thread advances in the store every 2 s): a
  rank that stopped beating is lost; ranks that still beat are busy with local work, and the
  wait goes on (up to the group's own timeout);
* the survivors report in through the store (:func:`.liveness._missing_ranks`), so each names the rank
  that did not;
* any later collective of pyckpt on a lost group raises at once instead of entering an
  operation the other ranks will never match.
"""

from pyckpt._collective.agreement import add_note, agree, attempt, portable, raise_first
from pyckpt._collective.group import (
    Group,
    bound_s,
    coordination_arg,
    coordination_group,
    coordination_info,
    group_info,
    own_group,
    peer_group,
)
from pyckpt._collective.liveness import bounded_group, is_peer_failure, peer_errors
from pyckpt._collective.transport import all_gather, all_to_all_single, broadcast

__all__ = ["Group", "group_info", "broadcast", "all_gather", "all_to_all_single", "bound_s",
           "peer_errors", "bounded_group", "peer_group", "own_group", "portable", "add_note", "agree",
           "is_peer_failure", "coordination_arg", "coordination_group", "coordination_info",
           "raise_first", "attempt"]
