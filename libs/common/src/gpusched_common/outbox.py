"""The records that end a placement (its final usage, then its result or its hand-back), as
the agent files them in the ledger (its node's claims hash) before publishing them: a run
that starts after a crash in between publishes them again instead of running the request a
second time, and if the node never comes back the scheduler publishes them on its behalf."""

from __future__ import annotations

import json

from gpusched_common import topics
from gpusched_common.contracts import REQUEST, RESULT_EVENT, USAGE, Message

Final = tuple[Message, str, str]
"""(message, topic, key) as the agent publishes it."""

_READERS = {topics.USAGE.name: USAGE.validate_json, topics.RESULTS.name: RESULT_EVENT.validate_json,
            **{spec.name: REQUEST.validate_json for spec in topics.REQUESTS.values()}}


def encode(finals: list[Final]) -> bytes:
    return json.dumps({"final": [{"topic": topic, "key": key, "value": message.to_bytes().decode()}
                                 for message, topic, key in finals]},
                      separators=(",", ":")).encode()


def decode(raw: bytes) -> list[Final] | None:
    """The records of an outbox; None when `raw` is a placement (what a claim files).
    Raises ValueError for anything else."""
    value = json.loads(raw)
    if not isinstance(value, dict) or "final" not in value:
        return None
    if not isinstance(value["final"], list):
        raise ValueError("an outbox whose records are not a list")
    out: list[Final] = []
    for record in value["final"]:
        if not isinstance(record, dict) or not {"topic", "value", "key"} <= record.keys() \
                or not all(isinstance(record[k], str) for k in ("topic", "value", "key")):
            raise ValueError(f"an outbox record that is not a topic, value and key: "
                             f"{str(record)[:100]}")
        read = _READERS.get(record["topic"])
        if read is None:
            raise ValueError(f"an outbox record for topic {record['topic']!r}")
        out.append((read(record["value"]), record["topic"], record["key"]))
    return out


def in_claim(entry: bytes) -> list[Final] | None:
    """The records filed in a node's claims-hash entry (`<agent run id>[;<trace headers>]
    <payload>`, as the agent's ledger writes it); None when it holds the placement itself."""
    return decode(entry.partition(b" ")[2])
