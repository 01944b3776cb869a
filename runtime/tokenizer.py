"""Tokenizers: a byte-level one for the built-in models, `tokenizers` for model directories."""

from __future__ import annotations

import json
from pathlib import Path

from adpfleet.model_uri import BUILTIN_MODELS
from adpfleet.runtime.model.errors import ModelLoadError

# Without torch: the router tokenizes with these (a built-in model's tokenizer is this one).
BYTE_VOCAB = 256
BOS, EOS = 256, 257


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; 256 is BOS and 257 EOS. Chat messages are laid out as
    `<|role|>\ncontent\n` followed by `<|assistant|>\n` (a fixed template, no Jinja)."""

    bos_token_id = BOS
    chat_template = "builtin"

    def __init__(self, eos_token_ids: tuple[int, ...] = (EOS,)):
        self.eos_token_ids = tuple(eos_token_ids)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return ([BOS] if add_bos else []) + list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < BYTE_VOCAB).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> str:
        return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


class HFTokenizer:
    """A model directory's `tokenizer.json`, with BOS/EOS and chat template from its configs."""

    def __init__(self, path: Path, eos_from_config: tuple[int, ...], bos_from_config: int | None):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad JSON
            raise ModelLoadError(f"{path / 'tokenizer.json'}: cannot be loaded ({e})") from None
        tcfg = _read_json(path / "tokenizer_config.json")
        gcfg = _read_json(path / "generation_config.json")
        # newer checkpoints keep the template in its own file, which then takes precedence
        jinja = path / "chat_template.jinja"
        self.chat_template = jinja.read_text() if jinja.is_file() else tcfg.get("chat_template")
        eos = gcfg.get("eos_token_id", list(eos_from_config))
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if not eos and isinstance(tcfg.get("eos_token"), str):
            tid = self._tok.token_to_id(tcfg["eos_token"])
            eos = [tid] if tid is not None else []
        self.eos_token_ids = tuple(eos)
        self.bos_token_id = gcfg.get("bos_token_id", bos_from_config)
        self._add_bos = bool(tcfg.get("add_bos_token", False))

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        # the batch call releases the GIL (`encode` holds it: 1.5 s for a 3 MiB prompt, during which
        # the server's event loop, /health included, would stand still); `_fast` skips offsets
        encode_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        ids = encode_batch([text], add_special_tokens=False)[0].ids
        if add_bos and self._add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> str:
        """Renders the model's own Jinja chat template, as transformers does (sandboxed, with its
        `raise_exception`); ValueError when the template refuses the messages or breaks."""
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if not self.chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        bos = self._tok.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self._tok.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=True, bos_token=bos or "", eos_token=eos or "")
        except TemplateError as e:  # raise_exception, the sandbox (SecurityError), undefined names
            raise ValueError(f"the model's chat template refused the messages: {e}") from None


def _raise_exception(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)


def _read_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{file} is not valid JSON: {e}") from None
    return raw if isinstance(raw, dict) else {}


def load_tokenizer(spec: str, cfg) -> ByteTokenizer | HFTokenizer:
    """The byte tokenizer for built-in models and for directories without `tokenizer.json`."""
    if spec in BUILTIN_MODELS:
        return ByteTokenizer()
    if not (Path(spec) / "tokenizer.json").is_file():
        return ByteTokenizer(cfg.eos_token_id)
    return HFTokenizer(Path(spec), cfg.eos_token_id, cfg.bos_token_id)
