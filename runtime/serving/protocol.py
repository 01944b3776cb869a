"""OpenAI request parsing and response shapes, with errors that name the parameter."""

from __future__ import annotations

import time
import uuid

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from adpfleet.runtime.engine.sampling import InvalidRequestError, SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | list[int] | list[str]
    max_tokens: int = 16
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
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    user: str | None = None

    def unsupported(self) -> None:
        """Parameters OpenAI defines that this server does not implement: refuse, never ignore."""
        checks = [("n", self.n == 1, "only n=1 is supported"),
                  ("best_of", self.best_of in (None, 1), "only best_of=1 is supported"),
                  ("logprobs", self.logprobs is None, "logprobs are not supported"),
                  ("echo", not self.echo, "echo is not supported"),
                  ("presence_penalty", self.presence_penalty == 0, "presence_penalty is not supported"),
                  ("frequency_penalty", self.frequency_penalty == 0, "frequency_penalty is not supported"),
                  ("logit_bias", not self.logit_bias, "logit_bias is not supported"),
                  ("suffix", self.suffix is None, "suffix is not supported")]
        for param, ok, why in checks:
            if not ok:
                raise InvalidRequestError(f"'{param}': {why}", param)

    def the_prompt(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise InvalidRequestError("'prompt': one prompt per request (a list of strings must have one)",
                                          "prompt")
            return self.prompt[0]
        return self.prompt

    def sampling_params(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, seed=self.seed, stop=stop,
                              stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos)


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
        raise InvalidRequestError(f"'{param}': {err['msg']}", param) from None


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def completion_body(rid: str, model: str, text: str, finish_reason: str | None, usage: dict | None,
                    created: int | None = None) -> dict:
    body = {"id": rid, "object": "text_completion", "created": created or int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}]}
    if usage is not None:
        body["usage"] = usage
    return body


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
