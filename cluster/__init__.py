"""The local Kubernetes cluster for development, tests and the demo (docs/cluster.md).

`controlplane.py` runs etcd, kube-apiserver, kube-controller-manager and the node agent
(`agent/`, which runs pods as processes) from binaries that `binaries.py` obtains through
tools/k8s/build.sh; `cli.py` is `adpfleet cluster up|down|status`; `testing.py` is the pytest plugin.
Nothing here is imported by the operator's logic.
"""
