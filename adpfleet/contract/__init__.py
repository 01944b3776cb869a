"""The contract floor: what the runtime, the operator and the local cluster must agree on, spelled once.

Standard library only, and importing nothing of adpfleet's but itself (and `adpfleet.model_uri`, its
neighbour on the same floor): every tower imports it, the operator's image has no torch, and the
node agent runs without kopf or pydantic (tests/test_layering.py keeps it so).

    metrics        the per-rank families a server exports (name, help, what the operator reads) and
                   RankSample, one rank at one scrape as the operator judges it, whatever the engine
    exposition     their Prometheus text, rendered once for the runtime and the synthetic servers
    signatures     the words for how a stalled server makes no progress
    engines        the engines a fleet's servers can run (adpfleet's, vLLM)
    env, ports     environment variable names and ports a pod and its server agree on
    quantity       Kubernetes resource quantities: the grammar and a parser
    pod_requests   what the scheduler reserves for a pod (Kubernetes' PodRequests)
    name_patterns  names a model source may use (Hugging Face repositories, buckets, claims)
    router_policy  the router's policies (its --policy, the CRD's router.policy)
"""
