"""The node agent: one Node whose pods are local processes.

It plays the kubelet and the scheduler of the local cluster:

- `node.py`       registers the Node (capacity, an advertised GPU count) and keeps its Lease fresh;
- `scheduling.py` decides whether a pending pod fits (nodeSelector, affinity, taints, requests);
- `pod.py`        runs one bound pod: address, volumes, containers, status, deletion;
- `container.py`  runs one container: its process, probes, restart back-off;
- `podenv.py`, `volumes.py`, `probes.py`, `addresses.py`: the pieces a pod is made of;
- `podinit.py`    the tiny launcher that enters a private mount namespace and execs the command;
- `logserver.py`  the kubelet-style HTTPS endpoint behind `kubectl logs`;
- `agent.py`      the loop that watches pods and hands each to the right piece.
"""
