"""Server counters, exposed at /metrics in Prometheus text format."""

from __future__ import annotations

import threading
from typing import Any

from specdec.speculative import SpecStats


def source_metric(name: str) -> str:
    """The counter of a `SpecStats.source_counts` entry: `draft_<name>_total`, the draft
    model's as `draft_model_total` and `draft_model_accepted_total`."""
    return f"draft_{name.replace('drafted', 'model', 1)}_total"


class Metrics:
    """Monotonic counters updated by the HTTP handlers (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.c: dict[str, float] = {
            "requests_total": 0, "requests_constrained_total": 0, "request_errors_total": 0,
            "prompt_tokens_total": 0, "completion_tokens_total": 0,
            "draft_proposed_total": 0, "draft_accepted_total": 0,
            **{source_metric(name): 0 for name in SpecStats().source_counts()},
            "grammar_cuts_total": 0, "budget_closings_total": 0,
            "budget_steered_tokens_total": 0, "budget_unguaranteed_total": 0,
            "mask_seconds_total": 0.0, "decode_seconds_total": 0.0,
            "requests_rejected_total": 0, "store_errors_total": 0,
            # the prompt store: requests that restored part of their prompt, and the prompt
            # positions restored and computed
            "prompt_cache_hits_total": 0, "prompt_tokens_cached_total": 0,
            "prompt_tokens_computed_total": 0,
        }

    def add(self, **kv: float) -> None:
        with self._lock:
            for k, v in kv.items():
                self.c[k] += v

    def observe(self, prompt_tokens: int, completion_tokens: int, stats: SpecStats,
                seconds: float, unguaranteed: bool = False) -> None:
        """One finished request; `unguaranteed`: it was served without the budget rule."""
        cached = min(stats.prompt_cached, prompt_tokens)
        self.add(prompt_cache_hits_total=int(cached > 0), prompt_tokens_cached_total=cached,
                 prompt_tokens_computed_total=prompt_tokens - cached,
                 budget_unguaranteed_total=int(unguaranteed), prompt_tokens_total=prompt_tokens,
                 completion_tokens_total=completion_tokens,
                 draft_proposed_total=stats.proposed, draft_accepted_total=stats.accepted,
                 **{source_metric(k): v for k, v in stats.source_counts().items()},
                 grammar_cuts_total=stats.grammar_cuts,
                 budget_closings_total=int(stats.budget_steered > 0),
                 budget_steered_tokens_total=stats.budget_steered,
                 mask_seconds_total=stats.mask_s, decode_seconds_total=seconds)

    def render(self, queue_depth: int, sched: Any = None, active: int = 0,
               collective_s: float | None = None) -> str:
        """Prometheus text. Counters and the queue/active gauges add up across replicas;
        the ratio gauges (acceptance rate, mean batch size) are derived from counters, so
        across replicas derive them from the summed counters instead."""
        with self._lock:
            c = dict(self.c)
        lines = []
        for k, v in c.items():
            lines += [f"# TYPE specdec_{k} counter", f"specdec_{k} {v:g}"]
        rate = c["draft_accepted_total"] / c["draft_proposed_total"] \
            if c["draft_proposed_total"] else 0.0
        lines += ["# TYPE specdec_draft_acceptance_rate gauge",
                  f"specdec_draft_acceptance_rate {rate:g}",
                  "# TYPE specdec_queue_depth gauge", f"specdec_queue_depth {queue_depth}",
                  "# TYPE specdec_active_requests gauge", f"specdec_active_requests {active}"]
        if sched is not None:  # the scheduler's rounds: batch size and round time
            rounds = sched.rounds
            lines += ["# TYPE specdec_rounds_total counter", f"specdec_rounds_total {rounds}",
                      "# TYPE specdec_round_seconds_total counter",
                      f"specdec_round_seconds_total {sched.round_s:g}",
                      "# TYPE specdec_batch_rows_total counter",
                      f"specdec_batch_rows_total {sched.batch_rows_sum}",
                      "# TYPE specdec_batch_size_mean gauge",
                      f"specdec_batch_size_mean {sched.batch_rows_sum / rounds if rounds else 0:g}",
                      "# TYPE specdec_batch_size gauge", f"specdec_batch_size {sched.last_batch}",
                      "# TYPE specdec_cancelled_total counter",
                      f"specdec_cancelled_total {sched.cancelled}",
                      "# TYPE specdec_timed_out_total counter",
                      f"specdec_timed_out_total {sched.timed_out}",
                      "# TYPE specdec_history_prefills_total counter",
                      f"specdec_history_prefills_total {sched.history_prefills}",
                      "# TYPE specdec_history_tokens_computed_total counter",
                      f"specdec_history_tokens_computed_total {sched.history_computed}",
                      "# TYPE specdec_history_prefills_superseded_total counter",
                      "specdec_history_prefills_superseded_total "
                      f"{sched.history_superseded}"]
        if collective_s is not None:  # a sharded target: rank 0's per-round broadcasts
            lines += ["# TYPE specdec_broadcast_seconds_total counter",
                      f"specdec_broadcast_seconds_total {collective_s:g}"]
        return "\n".join(lines) + "\n"
