"""Real `vllm serve` processes for tests: a random Llama built once, a server started, stopped.

vLLM runs from its own environment (`adpfleet.cluster.vllm_env`, built by `scripts/setup
--with-vllm`). `build_model()` writes a random Llama with a tokenizer trained offline (the
`tokenizers` BPE trainer), in the vLLM environment's own transformers, cached by content beside
that environment. `VllmServer` starts `vllm serve` the way this machine needs it:
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
import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import openai
import psutil
from servers import Process, free_port

from adpfleet.cluster import processes, vllm_env

ENGINE_CORE = "VLLM::EngineCore"  # the title of a DP=1 server's engine process (DP=N: VLLM::EngineCore_DP<r>)
TEST_API_KEY = "vllm-test-key"
START_TIMEOUT_S = 300  # ~36 s to /health on an idle machine; minutes while other suites load the 2 cores


@dataclass(frozen=True)
class LlamaRecipe:
    """A random Llama's shape. vLLM's CPU attention takes head sizes of 32 and up (not 16)."""
    hidden: int = 128
    intermediate: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    max_positions: int = 4096
    vocab: int = 512   # the BPE trainer's target; the corpus yields fewer (352)
    seed: int = 0


TINY_LLAMA = LlamaRecipe()

# Run by the vLLM environment's Python: its transformers writes the checkpoint its vLLM reads.
_BUILD_MODEL = r'''
import json, sys
from pathlib import Path
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

dest, recipe = Path(sys.argv[1]), json.loads(sys.argv[2])
words = ["the", "fleet", "server", "engine", "rank", "token", "stall", "progress", "cache", "block",
         "prefill", "decode", "router", "pod", "node", "metric", "request", "stream", "model", "layer"]
corpus = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) for i in range(400)]
bpe = Tokenizer(models.BPE(unk_token="<unk>"))
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.decoder = decoders.ByteLevel()
bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=recipe["vocab"], special_tokens=["<unk>", "<s>", "</s>"],
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                    model_max_length=recipe["max_positions"])
tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                           "{% if add_generation_prompt %}assistant:{% endif %}")
tokenizer.save_pretrained(dest)
torch.manual_seed(recipe["seed"])
config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=recipe["hidden"], intermediate_size=recipe["intermediate"],
                     num_hidden_layers=recipe["layers"], num_attention_heads=recipe["heads"],
                     num_key_value_heads=recipe["kv_heads"], max_position_embeddings=recipe["max_positions"],
                     bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     tie_word_embeddings=False)
LlamaForCausalLM(config).to(torch.float32).save_pretrained(dest)
'''


def build_model(recipe: LlamaRecipe = TINY_LLAMA) -> Path:
    """The checkpoint directory of `recipe`, built once per recipe and vLLM environment."""
    env = vllm_env.locate()
    key = hashlib.sha256(json.dumps([_BUILD_MODEL, asdict(recipe)]).encode()).hexdigest()[:12]
    dest = env.directory / "models" / key
    if (dest / "config.json").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=dest.parent))
    try:
        subprocess.run([str(env.python), "-I", "-c", _BUILD_MODEL, str(staging), json.dumps(asdict(recipe))],
                       cwd=staging, check=True, capture_output=True, timeout=600)
        with contextlib.suppress(OSError):  # another session may have finished first
            staging.rename(dest)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"building the model {recipe} failed:\n{exc.stderr.decode(errors='replace')[-3000:]}")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest


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
