"""`python -m adpfleet.cluster.agent`: run the node agent (normally started by `adpfleet cluster up`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path

from adpfleet.cluster.agent.agent import AgentConfig, NodeAgent


def parse_args(argv: list[str] | None = None) -> AgentConfig:
    p = argparse.ArgumentParser(prog="python -m adpfleet.cluster.agent", description=__doc__)
    p.add_argument("--kubeconfig", type=Path, required=True)
    p.add_argument("--state-dir", type=Path, required=True, help="pod directories (volumes, logs, work)")
    p.add_argument("--serving-cert", type=Path, required=True, help="TLS certificate of the log endpoint")
    p.add_argument("--serving-key", type=Path, required=True)
    p.add_argument("--client-ca", type=Path, required=True, help="CA that signs the apiserver's client cert")
    p.add_argument("--node-name", default="adpfleet-node")
    p.add_argument("--port", type=int, default=10250, help="log endpoint port (kubelet port)")
    p.add_argument("--gpus", type=int, default=8, help="nvidia.com/gpu capacity to advertise")
    p.add_argument("--capacity", action="append", default=[], metavar="RESOURCE=QUANTITY",
                   help="another resource to advertise for scheduling, e.g. rdma/ib=8 or hugepages-2Mi=1Gi")
    p.add_argument("--max-pods", type=int, default=1000)
    p.add_argument("--node-label", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--status-only", action="store_true",
                   help="run no processes; report every pod Running and Ready (for control-plane benchmarks)")
    p.add_argument("--backoff-initial", type=float, default=10.0, help="first crash-loop back-off (s)")
    p.add_argument("--backoff-max", type=float, default=300.0, help="longest crash-loop back-off (s)")
    p.add_argument("--kubelet-version", default="v0.0.0", help="version the Node reports")
    p.add_argument("--pass-env", action="append", default=[], metavar="NAME",
                   help="an environment variable of the agent to pass to every pod (e.g. HF_HOME)")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return AgentConfig(
        kubeconfig=a.kubeconfig, state_dir=a.state_dir.resolve(), serving_cert=a.serving_cert,
        serving_key=a.serving_key, client_ca=a.client_ca, node_name=a.node_name, port=a.port, gpus=a.gpus,
        max_pods=a.max_pods, labels=dict(label.split("=", 1) for label in a.node_label),
        capacity=dict(item.split("=", 1) for item in a.capacity),
        status_only=a.status_only, backoff_initial=a.backoff_initial, backoff_max=a.backoff_max,
        kubelet_version=a.kubelet_version, pass_env=tuple(a.pass_env))


async def _main(config: AgentConfig) -> None:
    config.state_dir.mkdir(parents=True, exist_ok=True)
    agent = NodeAgent(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    running = asyncio.create_task(agent.run())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({running, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if running.done():
        running.result()  # raise what stopped it
    logging.info("stopping; pod processes keep running and the next agent adopts them")
    await agent.close()


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    code = 0
    try:
        asyncio.run(_main(config))
    except Exception:  # noqa: BLE001 - logged, then the exit code says it
        logging.exception("the node agent failed")
        code = 1
    finally:
        logging.shutdown()
        # Skip interpreter teardown: nothing of it may touch the pod processes, which must outlive us.
        os._exit(code)


if __name__ == "__main__":
    main()

