"""The `adpfleet` command line: one parser, each command dispatched to its own floor.

Commands import their implementation lazily so that the operator's image (no torch) can run
`adpfleet operator` and `adpfleet crds` without the runtime's dependencies.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import types

from adpfleet.contract.engines import ADPFLEET, ENGINES
from adpfleet.contract.env import LEADER_ADDRESS_ENV
from adpfleet.contract.ports import SERVER_GROUP_PORT
from adpfleet.contract.roles import AGGREGATED, SPLIT_ROLES
from adpfleet.contract.router_policy import DEFAULT_ROUTER_POLICY, ROUTER_POLICIES

from adpfleet.model_uri import CACHE_ENV, ModelSourceError, write_termination_message


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help=f"where hf:// and s3:// models are downloaded (default: ${CACHE_ENV} or "
                        "~/.cache/adpfleet/models)")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    from adpfleet.runtime.config import DEVICES, DTYPES, EngineConfig

    default = EngineConfig()
    p.add_argument("--model", default=default.model, metavar="URI",
                   help="'tiny' (built-in MoE), 'tiny-dense' (built-in Llama), a model directory, "
                        "hf://ORG/REPO[@REVISION], s3://BUCKET/PREFIX or pvc://CLAIM/PATH")
    _add_model_args(p)
    p.add_argument("--device", choices=DEVICES, default=default.device)
    p.add_argument("--dtype", choices=DTYPES, default=default.dtype)
    p.add_argument("--kv-blocks", type=int, default=default.kv_blocks, help="KV cache blocks per rank")
    p.add_argument("--tokens-per-block", type=int, default=default.tokens_per_block)
    p.add_argument("--max-num-tokens", type=int, default=default.max_num_tokens, help="token budget of one batch")
    p.add_argument("--max-batch-size", type=int, default=default.max_batch_size, help="requests in one batch")
    p.add_argument("--max-num-active-requests", type=int, default=default.max_num_active_requests,
                   help="requests a rank holds at once (running + waiting for KV)")
    p.add_argument("--draft-tokens", type=int, default=default.draft_tokens,
                   help="speculative decoding: draft tokens per decode step, proposed by prompt lookup (0: off)")
    p.add_argument("--prompt-lookup-max", type=int, default=default.prompt_lookup_max,
                   help="longest n-gram prompt lookup matches")
    p.add_argument("--prompt-lookup-min", type=int, default=default.prompt_lookup_min,
                   help="shortest n-gram prompt lookup matches")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="recompute every prompt instead of sharing cached KV blocks of common prefixes")
    p.add_argument("--seed", type=int, default=default.seed, help="seed of the built-in tiny models")


def _add_http_args(p: argparse.ArgumentParser) -> None:
    """Who may call, and what one request may cost (server and router alike; docs/security.md).
    Unset limits take the runtime's defaults (runtime/serving/limits.py), which this image-neutral
    parser does not import."""
    p.add_argument("--api-key", default=None,
                   help="clients must send 'Authorization: Bearer KEY' on every path but /health and /metrics "
                        "(or --api-key-file, or $ADPFLEET_API_KEY)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from a file (a mounted Secret)")
    p.add_argument("--internal-token-file", default=None, metavar="PATH",
                   help="the fleet's own secret between router and servers, on the KV port and on the group "
                        "link (required with --nodes > 1; or $ADPFLEET_INTERNAL_TOKEN)")
    p.add_argument("--enable-docs", action="store_true", help="serve /docs and /openapi.json (off by default)")
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="largest request body; a larger one is answered 413 (default 4 MiB)")
    p.add_argument("--read-timeout", type=float, default=None,
                   help="seconds a client has to send a whole request (headers and body) before the connection "
                        "is closed (default 15)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adpfleet", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_command in (_add_serve, _add_router, _add_generate, _add_fetch_model, _add_cluster, _add_operator,
                        _add_crds, _add_demo):  # in the order `adpfleet --help` lists them
        add_command(sub)
    return parser


def _add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="run an inference server (OpenAI-compatible HTTP API)")
    serve.add_argument("--role", choices=[AGGREGATED, *SPLIT_ROLES], default=AGGREGATED)
    serve.add_argument("--dp", type=int, default=1, help="attention-data-parallel ranks")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="model id reported by /v1/models")
    serve.add_argument("--no-pad-empty-batch", action="store_true",
                       help="disable post-schedule padding (only to reproduce the ADP stall)")
    serve.add_argument("--no-padding-reserve", dest="padding_reserve", action="store_false",
                       help="let admission use the padding dummy's KV blocks (only to measure what the reserve "
                            "rescues)")
    serve.add_argument("--collective-timeout", type=float, default=120.0,
                       help="seconds a rank may block in a collective (or stay silent) before the server "
                            "declares it hung, turns unhealthy and exits non-zero")
    serve.add_argument("--drain-timeout", type=float, default=25.0, metavar="SECONDS",
                       help="on SIGTERM: how long in-flight requests may run before they are handed back "
                            "(the operator passes the pod's terminationGracePeriodSeconds less a margin)")
    serve.add_argument("--fault-injection", action="store_true",
                       help="accept POST /faults to freeze a rank, stop KV reaping or starve a rank "
                            "(tests and the demo only)")
    serve.add_argument("--kv-port", type=int, default=None,
                       help="context role: rank r serves held KV on this port + r (default: --port + 1)")
    serve.add_argument("--kv-lease", type=float, default=60.0,
                       help="context role: seconds held KV waits to be pulled before it is freed")
    serve.add_argument("--kv-transfer-timeout", type=float, default=30.0,
                       help="seconds one KV transfer may take, at both ends: the pull fails its request (the router "
                            "retries) and the context server frees the KV")
    serve.add_argument("--kv-peer", action="append", default=[], metavar="HOST|CIDR",
                       help="generation role: a host or network a request may name as its KV endpoint without the "
                            "internal token (repeatable; default: loopback only)")
    serve.add_argument("--nodes", type=int, default=1,
                       help="pods this server's --dp ranks are spread over (docs/adp.md: servers over several pods); "
                            "above 1, every pod needs the internal token")
    serve.add_argument("--node-rank", type=int, default=0,
                       help="this pod's place in the server: 0 the leader (API, KV endpoints), 1.. the workers; "
                            "pod j runs ranks j*dp/nodes .. (j+1)*dp/nodes - 1")
    serve.add_argument("--leader-address", default=os.environ.get(LEADER_ADDRESS_ENV, "127.0.0.1"),
                       metavar="HOST", help="workers: where the leader pod is (on a cluster its headless Service's "
                                            "DNS name; default $ADPFLEET_LEADER_ADDRESS, else 127.0.0.1)")
    serve.add_argument("--group-port", type=int, default=SERVER_GROUP_PORT,
                       help="the leader's port where worker pods join the server (with --nodes > 1)")
    serve.add_argument("--join-timeout", type=float, default=600.0, metavar="SECONDS",
                       help="with --nodes > 1: how long the pods of a server wait for each other to start "
                            "before exiting non-zero")
    serve.add_argument("--max-waiting-requests", type=int, default=None,
                       help="requests accepted but not yet generating; one more is answered 429 with Retry-After "
                            "(default 128)")
    serve.add_argument("--request-timeout", type=float, default=None,
                       help="seconds a request may take on this server before it is aborted (504, or an error "
                            "event in a stream; default 300)")
    _add_http_args(serve)
    _add_engine_args(serve)
    serve.set_defaults(run="adpfleet.runtime.server:main")


def _add_router(sub) -> None:
    router = sub.add_parser("router", help="run the disaggregated router in front of context and generation servers")
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=8000)
    router.add_argument("--context", action="append", default=[], metavar="URL", help="a context server (repeatable)")
    router.add_argument("--generation", action="append", default=[], metavar="URL",
                        help="a generation server (repeatable)")
    router.add_argument("--aggregated", action="append", default=[], metavar="URL",
                        help="an aggregated server (repeatable); used when no context+generation pair is usable")
    router.add_argument("--kube-namespace", default=None, help="discover the fleet's pods in this namespace")
    router.add_argument("--kube-selector", default=None, metavar="SELECTOR",
                        help="label selector of the fleet's pods, e.g. 'adpfleet.io/fleet=demo'")
    router.add_argument("--server-port", type=int, default=8000, help="port of the servers in discovered pods")
    router.add_argument("--request-timeout", type=float, default=300.0,
                        help="seconds a request may take in all, retries included")
    router.add_argument("--max-attempts", type=int, default=3,
                        help="attempts per request while no token has reached the client")
    router.add_argument("--first-token-timeout", type=float, default=None,
                        help="seconds one attempt may wait for its first token before trying other servers "
                             "(default: only the request timeout applies)")
    router.add_argument("--health-interval", type=float, default=2.0,
                        help="seconds between /health probes of every known server")
    router.add_argument("--queue-size", type=int, default=256,
                        help="requests held while no server can take them (none of a role Ready: starting, drained, "
                             "restarting, failed); one more is answered 503 with Retry-After (0: no queue)")
    router.add_argument("--queue-timeout", type=float, default=60.0,
                        help="seconds a request may wait in all for a server before the router answers 503 with "
                             "Retry-After")
    router.add_argument("--queue-max-bytes", type=int, default=None,
                        help="bytes the bodies of the held requests may take in memory in all (parsed JSON); one "
                             "more is answered 429 with Retry-After at once (default 256 MiB)")
    router.add_argument("--policy", choices=ROUTER_POLICIES, default=DEFAULT_ROUTER_POLICY,
                        help="how servers are chosen: cache-aware (context and aggregated servers, and their ADP "
                             "rank, by the prefill they save and their load; generation servers by load), "
                             "least-loaded (fewest requests in flight), round-robin")
    router.add_argument("--tokenizer", default=None, metavar="MODEL",
                        help="cache-aware: the servers' --model (a built-in name or a model directory), to tokenize "
                             "prompts as they do; without it every request is routed by load")
    router.add_argument("--cache-poll-interval", type=float, default=0.5, metavar="SECONDS",
                        help="cache-aware: seconds between polls of each server's GET /internal/prefix_cache (how "
                             "stale the router's view of the caches may be)")
    _add_http_args(router)
    router.set_defaults(run="adpfleet.runtime.router.app:main")


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="generate one completion and print it")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    _add_engine_args(gen)
    gen.set_defaults(run="adpfleet.runtime.generate:main")


def _add_fetch_model(sub) -> None:
    fetch = sub.add_parser("fetch-model", help="download a model (hf://, s3://) into the cache, or check that a "
                                              "directory or pvc:// model is there; print its directory")
    fetch.add_argument("model", metavar="URI", help="hf://ORG/REPO[@REVISION], s3://BUCKET/PREFIX, pvc://CLAIM/PATH, "
                                                   "a directory, or a built-in name")
    fetch.add_argument("--dest", default=None, metavar="DIR",
                       help="download into exactly this directory (default: a directory per source under the cache)")
    fetch.add_argument("--engine", choices=ENGINES, default=ADPFLEET,
                       help="the engine that will load the model: adpfleet checks that it runs the model_type; "
                            "vllm leaves the architecture to vLLM (both: config.json and safetensors weights)")
    _add_model_args(fetch)
    fetch.set_defaults(run="adpfleet.runtime.model.sources.fetch:main")


def _add_cluster(sub) -> None:
    cluster = sub.add_parser("cluster", help="the local Kubernetes control plane and node agent (no Docker)")
    cluster.add_argument("action", choices=["up", "down", "status"])
    cluster.add_argument("--state-dir", default=None,
                         help="certificates, data, logs and the kubeconfig (default: $ADPFLEET_CLUSTER_DIR "
                              "or ~/.local/state/adpfleet/cluster)")
    cluster.add_argument("--apiserver-port", type=int, default=0, help="up: apiserver port (0: a free one)")
    cluster.add_argument("--agent-arg", action="append", default=[], metavar="ARG",
                         help="up: extra node-agent argument, e.g. --agent-arg=--gpus=4")
    cluster.set_defaults(run="adpfleet.cluster.cli:main")


def _add_operator(sub) -> None:
    operator = sub.add_parser("operator", help="run the Kubernetes operator (kopf) that reconciles InferenceFleets")
    from adpfleet.operator.main import add_arguments as add_operator_arguments
    add_operator_arguments(operator)
    operator.set_defaults(run="adpfleet.operator.main:main")


def _add_crds(sub) -> None:
    crds = sub.add_parser("crds", help="print the InferenceFleet CRD generated from the operator's models")
    crds.add_argument("--reference", action="store_true",
                      help="print the spec reference (Markdown, docs/configuration.md) instead")
    crds.set_defaults(run="adpfleet.cli:print_crds")


def _add_demo(sub) -> None:
    demo = sub.add_parser("demo", help="run the whole loop on this machine")
    demo.add_argument("--quick", action="store_true",
                      help="shortened run (CI): stop soon after the stall is remediated")
    demo.add_argument("--engine", choices=("adpfleet", "vllm"), default="adpfleet",
                      help="the fleet's engine: adpfleet's own (a frozen ADP rank), or the real vLLM (a frozen "
                           "EngineCore; needs `scripts/setup --with-vllm`)")
    demo.add_argument("--keep", action="store_true", help="leave the cluster, operator and fleet running")
    demo.add_argument("--out", default="adpfleet-demo", help="directory for the plot and the summary JSON")
    demo.set_defaults(run="adpfleet.demo:main")


def print_crds(args) -> int:
    """`adpfleet crds`: the CRD, or with --reference docs/configuration.md, from the operator's models."""
    if args.reference:
        from adpfleet.operator.resource.reference import reference_markdown
        print(reference_markdown(), end="")
    else:
        from adpfleet.operator.resource.crd import crd_yaml
        print(crd_yaml(), end="")
    return 0


def _without_httpx_command_line() -> None:
    """httpx imports its own command-line client (rich, pygments) when it is imported, unless that
    import fails: ~0.15-0.3 of the ~1.3 CPU-seconds of a router start, which runs no such client. An
    empty `httpx._main` makes it fail, and httpx falls back to a stub `httpx.main` by its own design."""
    if "httpx" not in sys.modules:
        sys.modules.setdefault("httpx._main", types.ModuleType("httpx._main"))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _without_httpx_command_line()
    module_name, func_name = args.run.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    try:
        return int(func(args) or 0)
    except ModelSourceError as e:  # the model cannot be had: a stable reason for the operator
        if os.environ.get("ADPFLEET_DEBUG"):
            raise
        write_termination_message(e)
        print(f"adpfleet {args.command}: error: {e.reason}: {e}", file=sys.stderr)
        return e.exit_code
    except ValueError as e:  # bad flags, a broken model directory, ...: the message says which
        if os.environ.get("ADPFLEET_DEBUG"):
            raise
        print(f"adpfleet {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
