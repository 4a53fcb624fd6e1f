"""Redis keys that more than one service reads or writes (each service keeps its own keys
beside its code)."""

import json

SCHEDULER_EPOCH_KEY = "gpusched:scheduler:epoch"
"""The current scheduler leader's fencing token; agents refuse placements with a lower one."""
SCHEDULER_RUNNING_KEY = "gpusched:scheduler:running"
"""Hash: placement id -> the leader's record of it while it counts it as running; a
placement it has retried elsewhere is no longer there."""
PLACEMENT_CLAIM_KEY = "gpusched:agent:placement:{}"
"""Who owns a placement (SET NX, first wins): the agent that runs it, or the scheduler when
it fenced the placement before retrying it elsewhere."""
FENCED_CLAIM = "scheduler:fenced"
"""The owner a placement's claim names when the scheduler fenced it."""
CLAIM_TTL_S = 7 * 86_400
NODE_CLAIMS_KEY = "gpusched:agent:node:{}:claims"
"""Hash: placement id -> '<agent run started_at_ms>[;<W3C trace headers, URL-encoded>]
<placement JSON>' (or, while its final records go out, their outbox) while the agent run
that claimed the placement holds it; removed once that run ended it (final usage sent)."""
NODE_ALIVE_KEY = "gpusched:agent:node:{}:alive"
"""Refreshed by a node's agent every second, whether or not Kafka takes its reports;
expires after NODE_ALIVE_TTL_S. While it exists the scheduler does not declare the node
lost: a node it cannot hear (Kafka away) but that is alive keeps its work, and no retry runs
that work a second time."""
NODE_ALIVE_TTL_S = 10
CANCELLED_KEY = "gpusched:cancelled:{}"
"""Set by the router (value: the reason) when it cancels a request, before the cancel goes
out on the control topic, and by every scheduler (if unset) as it reads a cancel there, one
produced straight to Kafka too: an agent that was down when the cancel went out, and so
never read it, still ends the request unrun when it is placed there later."""
CANCELLED_TTL_S = 86_400
BUDGET_EXHAUSTED_KEY = "gpusched:budget:exhausted:{}"
"""Set by accounting (TTL to the period's end) while a tenant's budget is spent; the router
reads it per request and answers 429, and so does the scheduler for a tenant's first
attempts it admits (reading it once a second per tenant). Value: JSON with period,
period_start_ms, limit, spent, unit, a `reason` and whether its event went out (announced);
readers take the `reason` alone, so fields may be added."""


def budget_reason(flag: bytes) -> str:
    """What a client refused for a spent budget is told: the flag's `reason`."""
    try:
        return str(json.loads(flag)["reason"])
    except (ValueError, KeyError, TypeError):
        return "this tenant's budget for the current period is spent"
