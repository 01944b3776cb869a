"""OpenAI request parsing and response shapes, with errors that name the parameter.

Both APIs (`/v1/completions`, `/v1/chat/completions`) share one request base; each has a
formatter for whole responses and stream chunks. `disaggregated_params` is the one extension
field the router uses between context and generation servers.
"""

from __future__ import annotations

import time
import uuid
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from adpfleet.runtime.engine.sampling import InvalidRequestError, SamplingParams
from adpfleet.runtime.executor.kv_endpoint import HANDLE_PATTERN, parse_endpoint


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class DisaggregatedParams(_Strict):
    """What a context server returns and a generation server needs to continue the request. The
    endpoint and handle go onto a socket: only HOST:PORT and a plain handle pass."""
    ctx_request_id: str = Field(max_length=128)
    first_token_id: int
    prompt_token_ids: list[int]
    kv_endpoint: str
    kv_handle: str = Field(pattern=HANDLE_PATTERN)

    @field_validator("kv_endpoint")
    @classmethod
    def _endpoint(cls, value: str) -> str:
        parse_endpoint(value)  # ValueError: a 400 naming disaggregated_params.kv_endpoint
        return value


class _Common(_Strict):
    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # vLLM extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    disaggregated_params: DisaggregatedParams | None = None

    def _unsupported_checks(self) -> list[tuple[str, bool, str]]:
        return [("n", self.n == 1, "only n=1 is supported"),
                ("presence_penalty", self.presence_penalty == 0, "presence_penalty is not supported"),
                ("frequency_penalty", self.frequency_penalty == 0, "frequency_penalty is not supported"),
                ("logit_bias", not self.logit_bias, "logit_bias is not supported")]

    def unsupported(self) -> None:
        """Parameters OpenAI defines that this server does not implement: refuse, never ignore."""
        for param, ok, why in self._unsupported_checks():
            if not ok:
                raise InvalidRequestError(f"'{param}': {why}", param)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, seed=self.seed, stop=stop,
                              stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    max_tokens: int = 16
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def _unsupported_checks(self):
        return super()._unsupported_checks() + [
            ("best_of", self.best_of in (None, 1), "only best_of=1 is supported"),
            ("logprobs", self.logprobs is None, "logprobs are not supported"),
            ("echo", not self.echo, "echo is not supported"),
            ("suffix", self.suffix is None, "suffix is not supported")]

    def prompt_input(self, tokenizer) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise InvalidRequestError("'prompt': one prompt per request (a list of strings must have one)",
                                          "prompt")
            return self.prompt[0]
        return self.prompt

    def requested_max_tokens(self, prompt_len: int, limit: int) -> int:
        return self.max_tokens


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError("'messages': only text content parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    DEFAULT_MAX_TOKENS: ClassVar[int] = 1024  # when neither max_tokens nor max_completion_tokens is given

    def _unsupported_checks(self):
        return super()._unsupported_checks() + [
            ("logprobs", not self.logprobs, "logprobs are not supported"),
            ("top_logprobs", self.top_logprobs is None, "top_logprobs are not supported")]

    def prompt_input(self, tokenizer) -> str:
        messages = [{"role": m.role, "content": m.text()} for m in self.messages]
        try:
            return tokenizer.apply_chat_template(messages)
        except ValueError as e:  # no template, or the template refused these messages
            raise InvalidRequestError(f"'messages': {e}", "messages") from None

    def requested_max_tokens(self, prompt_len: int, limit: int) -> int:
        asked = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return asked if asked is not None else max(1, min(self.DEFAULT_MAX_TOKENS, limit - prompt_len))


def parse(model: type[BaseModel], body) -> BaseModel:
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object", None)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = str(err["loc"][0]) if err["loc"] else None  # the top-level field, as OpenAI's `param`
        if err["type"] == "extra_forbidden":
            raise InvalidRequestError(f"unrecognized request argument supplied: '{param}'", param) from None
        where = ".".join(str(x) for x in err["loc"])
        raise InvalidRequestError(f"'{where}': {err['msg']}", param) from None


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class CompletionFormat:
    prefix, obj, chunk_obj = "cmpl", "text_completion", "text_completion"

    def __init__(self, model: str):
        self.model, self.created = model, int(time.time())
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def choice(self, text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}

    def delta(self, text: str, finish_reason: str | None, first: bool) -> dict:
        return self.choice(text, finish_reason)

    def full(self, text: str, finish_reason: str | None, use: dict) -> dict:
        return {**self._base(self.obj), "choices": [self.choice(text, finish_reason)], "usage": use}

    def chunk(self, text: str, finish_reason: str | None, first: bool) -> dict:
        return {**self._base(self.chunk_obj), "choices": [self.delta(text, finish_reason, first)]}

    def usage_chunk(self, use: dict) -> dict:
        return {**self._base(self.chunk_obj), "choices": [], "usage": use}


class ChatFormat(CompletionFormat):
    prefix, obj, chunk_obj = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def choice(self, text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason, "logprobs": None}

    def delta(self, text: str, finish_reason: str | None, first: bool) -> dict:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
