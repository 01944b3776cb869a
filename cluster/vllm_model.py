"""The tiny random Llama that the tests and `adpfleet demo --engine vllm` serve with the real vLLM.

`build_model()` writes a random Llama with a tokenizer trained offline (the `tokenizers` BPE
trainer), in the vLLM environment's own transformers (its checkpoint is what its vLLM reads),
cached by recipe beside that environment: built once (seconds), then found.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from adpfleet.cluster import vllm_env


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
