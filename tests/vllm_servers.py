"""Real `vllm serve` processes for tests: a random Llama built once, a server started, stopped.

vLLM runs from its own environment (`adpfleet.cluster.vllm_env`, built by `scripts/setup
--with-vllm`). `build_model()` (`adpfleet.cluster.vllm_model`, which the demo shares) writes a
random Llama with a tokenizer trained offline, cached by content beside that environment. `VllmServer` starts `vllm serve` the way this machine needs it:
- in a directory of its own: its engine processes are spawned children, and from a checkout's
  root they import its operator/ in place of the standard library's (a circular import of
  `collections`);
- with a TMPDIR of its own: vLLM leaves IPC sockets and `vllm_dist_*` files there;
- float32, eager (no torch.compile), a 1 GiB KV cache, OpenMP bound to one core, offline, no usage
  statistics; the API key through VLLM_API_KEY (as a pod gets it from a Secret, never on argv).

The `vllm_server` fixture (tests/conftest.py) shares one server of the tiny model per session.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import openai
import psutil
from servers import Process, free_port

from adpfleet.cluster import processes, vllm_env
from adpfleet.cluster.vllm_env import ENGINE_CORE  # noqa: F401 (the tests' names)
from adpfleet.cluster.vllm_model import TINY_LLAMA, LlamaRecipe, build_model  # noqa: F401
TEST_API_KEY = "vllm-test-key"
START_TIMEOUT_S = 300  # ~36 s to /health on an idle machine; minutes while other suites load the 2 cores


class VllmServer(Process):
    """`vllm serve MODEL` on 127.0.0.1, in `workdir` (its log, its TMPDIR), served as `name`."""

    def __init__(self, model: Path, workdir: Path, *args: str, name: str = "tiny", api_key: str = TEST_API_KEY,
                 threads_bind: str = "1", kv_cache_gib: int = 1, env: dict | None = None):
        self.environment = vllm_env.locate()
        self.name, self.workdir = name, workdir
        tmpdir = workdir / "tmp"
        tmpdir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        command = self.environment.serve_command(model, "--host", "127.0.0.1", "--port", str(port),
                                                 "--served-model-name", name, "--dtype", "float32",
                                                 "--enforce-eager", *args)
        server_env = {"TMPDIR": str(tmpdir), "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                      "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": threads_bind,
                      **({"VLLM_API_KEY": api_key} if api_key else {}), **(env or {})}
        super().__init__(command, port, workdir / "vllm.log", env=server_env,
                         headers={"Authorization": f"Bearer {api_key}"} if api_key else {}, cwd=workdir)

    def wait_healthy(self, timeout: float | None = None) -> "VllmServer":
        super().wait_healthy(START_TIMEOUT_S if timeout is None else timeout)
        return self

    def client(self, **kwargs) -> openai.OpenAI:
        """The official client, with this server's API key unless `api_key` says otherwise."""
        kwargs.setdefault("api_key", self.headers.get("Authorization", "Bearer none").removeprefix("Bearer "))
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, **kwargs)

    def titles(self) -> list[tuple[psutil.Process, str]]:
        """(process, title) of the server and every process under it."""
        return processes.process_titles([psutil.Process(self.proc.pid)])

    def engine_cores(self) -> list[psutil.Process]:
        """The server's engine processes (one per data-parallel rank)."""
        return [proc for proc, title in self.titles() if title.startswith(ENGINE_CORE)]

    @contextlib.contextmanager
    def frozen(self, title: str = ENGINE_CORE):
        """SIGSTOP the engine process titled `title` for the block, SIGCONT after it."""
        targets = processes.titled_processes([psutil.Process(self.proc.pid)], title)
        assert targets, f"no process titled {title!r} under {self.url}: {[t for _, t in self.titles()]}"
        for proc in targets:
            os.kill(proc.pid, signal.SIGSTOP)
        try:
            yield targets
        finally:
            for proc in targets:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)


@contextlib.contextmanager
def vllm_server(workdir: Path, *args: str, recipe: LlamaRecipe = TINY_LLAMA, **kwargs):
    """A healthy `VllmServer` of `recipe`'s model, stopped (its process group) on exit."""
    server = VllmServer(build_model(recipe), workdir, *args, **kwargs)
    try:
        yield server.wait_healthy()
    finally:
        server.stop()
