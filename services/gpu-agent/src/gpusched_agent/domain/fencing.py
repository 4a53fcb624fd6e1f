"""Scheduler fencing: a command from a deposed scheduler leader must not run. Pure."""

from __future__ import annotations


def stale_reason(command_epoch: int, leader_epoch: int | None, highest_seen: int) -> str | None:
    """Why a command carrying `command_epoch` is stale, or None when it may run.

    `leader_epoch` is the current leader's fencing token (Redis `gpusched:scheduler:epoch`,
    None when no leader has written one yet); `highest_seen` the highest epoch this agent has
    already accepted while Redis held it as the leader's. Equal epochs are the same leader
    and pass; one beyond the leader's was never a leader's.
    """
    if leader_epoch is not None and command_epoch < leader_epoch:
        return (f"scheduler epoch {command_epoch} is older than the current leader's "
                f"{leader_epoch}: a deposed scheduler sent it")
    if leader_epoch is not None and command_epoch > leader_epoch:
        # a leader takes its token in Redis before it sends anything: no scheduler sent
        # this, and taking it would fence the agent off from the real leader
        return (f"scheduler epoch {command_epoch} is newer than the current leader's "
                f"{leader_epoch}: no scheduler has led with it")
    if leader_epoch is not None:  # Redis names the leader: an epoch seen before it lost
        return None  # its data (the new leader counts from 1 again) does not fence it off
    if command_epoch < highest_seen:
        return (f"scheduler epoch {command_epoch} is older than epoch {highest_seen} this agent "
                "already took commands from")
    return None
