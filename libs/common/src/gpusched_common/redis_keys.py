"""Redis keys that more than one service reads or writes (each service keeps its own keys
beside its code)."""

SCHEDULER_EPOCH_KEY = "gpusched:scheduler:epoch"
"""The current scheduler leader's fencing token; agents refuse placements with a lower one."""
SCHEDULER_RUNNING_KEY = "gpusched:scheduler:running"
"""Hash: placement id -> the leader's record of it while it counts it as running; a
placement it has retried elsewhere is no longer there."""
PLACEMENT_CLAIM_KEY = "gpusched:agent:placement:{}"
"""Who owns a placement (SET NX, first wins): the agent that runs it, or the scheduler when
it fenced the placement before retrying it elsewhere."""
CLAIM_TTL_S = 7 * 86_400
