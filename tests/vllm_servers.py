"""What the suite's real vLLM servers share: the random Llama they serve, built once
(`adpfleet.cluster.vllm_model`, which the demo shares: a tokenizer trained offline, cached by
content beside the vLLM environment), the engine's process title, and how long a start may take.

The suite runs vLLM in pods (tests/cluster/test_vllm_pod.py, the vLLM fleet e2e modules), started by
the node agent from the environment `scripts/setup --with-vllm` builds; a bench starts its own
(bench/prefix_routing.py, bench/vllm_peer.py).
"""

from adpfleet.cluster.vllm_env import ENGINE_CORE  # noqa: F401 (the tests' names)
from adpfleet.cluster.vllm_model import build_model  # noqa: F401

START_TIMEOUT_S = 300  # ~36 s to /health on an idle machine; minutes while other suites load the 2 cores
