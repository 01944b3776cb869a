"""A tiny model directory with a real `tokenizer.json` and a chat template of the test's choosing
(a byte-level BPE without merges: every byte is one token, like the built-in tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from adpfleet.runtime.model.tiny import tiny_checkpoint

# Mistral-style: the template itself refuses some conversations; `escape` reaches for Python
# internals, which the sandbox must stop.
HOSTILE_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['content'] == 'raise' %}{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    "{% endif %}"
    "{% if m['content'] == 'escape' %}{{ m.__class__.__mro__[1].__subclasses__() }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n"
    "{% endfor %}assistant:")


def save_chat_model(path: Path, chat_template: str = HOSTILE_TEMPLATE) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    cfg, weights = tiny_checkpoint("tiny-dense")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    save_file(weights, str(path / "model.safetensors"))
    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": chat_template}))
    return path
