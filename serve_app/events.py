"""Which engine outputs of one request become a streamed event (both replicas: serve_app/replica.py and
serve_app/vllm_replica.py).

The first token goes out at once (time to first token), then one event per ``stream_interval`` tokens, and the last
output always closes the stream with whatever is still held back.  A request with ``"stream": False`` (the ingress's
non-streaming path) gets only the first and the last event.  Each event crosses replica -> ingress -> proxy on the
engine's cores, so fewer, larger events leave the engine more CPU (vLLM's ``--stream-interval`` makes the same trade).
"""
from __future__ import annotations

FIRST_AND_LAST_ONLY = 1 << 30  # the interval of a non-streaming request


class EventCoalescer:
    def __init__(self, stream_interval: int, request: dict):
        self.interval = stream_interval if request.get("stream", True) else FIRST_AND_LAST_ONLY
        self.unsent: list[int] = []  # token ids not yet in an event
        self.unsent_logprobs: list = []  # their log-probabilities, when the request asked for them
        self.sent_logprobs: list = []  # the log-probabilities of the ids ``add`` returned last
        self.events = 0  # events sent

    def add(self, token_ids, finished: bool, logprobs=None) -> list[int] | None:
        """Hold ``token_ids`` (and their ``logprobs``, one entry per id) back; return the ids of the event to send
        now (their log-probabilities in ``sent_logprobs``), or None while they wait."""
        self.unsent.extend(token_ids)
        self.unsent_logprobs.extend(logprobs or [])
        if not finished and (not self.unsent or self.events and len(self.unsent) < self.interval):
            return None
        ids, self.unsent = self.unsent, []
        self.sent_logprobs, self.unsent_logprobs = self.unsent_logprobs, []
        self.events += 1
        return ids
