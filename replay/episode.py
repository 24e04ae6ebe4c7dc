"""`orch replay RUN --episode ID`: an episode's completion with its token arrays, as JSON.

The log keeps a trace's token ids, mask and logprobs packed in its row's payload
(docs/log-format.md); this reads the rows of that episode (their JSON first, then only their
payloads) and writes them back as lists.
"""

from __future__ import annotations

from eventlog import EventLog
from orchestrator.core.events import decode_event
from replay.source import ReplayInputError, guarded, one_line, row_data


def episode_completions(log: EventLog, episode_id: int) -> list[dict]:
    """Every `episode_completed` of `episode_id` in log order, each its fields (arrays as lists)
    and its `seq`; ReplayInputError (one line) for a row whose payload does not decode."""
    rows = []
    for seq, _ts, _kind, data in guarded(log.read_raw(kinds=("episode_completed",)), log.path):
        if row_data(seq, data, log.path).get("episode_id") == episode_id:
            rows.append((seq, data))
    payloads = log.read_payloads([seq for seq, _data in rows])
    out = []
    for seq, data in rows:
        try:
            event = decode_event("episode_completed", data, payloads.get(seq))
        except ValueError as err:
            raise ReplayInputError(
                one_line(f"{log.path}: seq {seq}: cannot decode episode {episode_id}: {err}")
            ) from None
        out.append({"seq": seq, **event.model_dump(mode="json", exclude={"kind"})})
    return out
