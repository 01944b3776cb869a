import os
import sys

import torch

# Several rank processes share two cores here; one intra-op thread each keeps them from fighting.
torch.set_num_threads(int(os.environ.get("ADPFLEET_TEST_THREADS", "1")))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "runtime"))

# Kubernetes fixtures (k8s_cluster, k8s_namespace) for tests against the local control plane.
pytest_plugins = ["adpfleet.cluster.testing"]
