"""The disaggregated router (`adpfleet router`): OpenAI requests in, context + generation servers out.

One request, top to bottom (`app.py` → `pipeline.py`):

1. `discovery.py` keeps the `ServerPool` (`pool.py`) up to date — a static list of URLs, or the
   fleet's pods watched in Kubernetes (pod IP, readiness, role label, drain annotation);
2. the policy (`policy.py`) picks the usable server(s) for the request: least-loaded, round
   robin, or — the default — cache-aware: context and aggregated servers, and their ADP rank, by
   the prefill they save (what each rank holds: `prefix_view.py`, from the servers' snapshots;
   the prompt's blocks: `prompt_tokens.py`, hashed as the engine does) and their load;
3. disaggregated: the context server answers the prompt's first token plus `disaggregated_params`
   (the KV handle); the generation server gets the client's body plus those params, pulls the KV
   and answers the whole request, which the router relays (SSE for streams);
   aggregated: the one server answers directly;
4. a failure before any token reached the client is retried on other servers (`retry.py` says
   which failures are retryable: never a 4xx); after that the stream ends with an explicit error
   event; every request ends within its deadline.

The router holds no model state; `metrics.py` exports its own counters on /metrics.
"""
