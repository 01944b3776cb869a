"""Server-sent events as the OpenAI streaming API uses them: read, classify, write."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass

DONE = b"data: [DONE]\n\n"
_LINE_END = re.compile(r"\r\n|\n|\r")


class LineSplitter:
    """Lines of an event stream fed in pieces, ended as the SSE spec ends them: CRLF, LF or CR, and
    nothing else. (`str.splitlines`, and with it httpx's `iter_lines`, also breaks at \\x0b, \\x0c,
    \\x1c-\\x1e, \\x85, U+2028 and U+2029; a model's text may hold the last three, which JSON
    leaves unescaped (vLLM sends them as they are), and an event split there reached the client as
    half its JSON.)"""

    def __init__(self) -> None:
        self._parts: list[str] = []  # the line begun: joined once its end arrives, so a long line costs O(n)

    def feed(self, text: str) -> list[str]:
        if "\n" not in text and "\r" not in text and not (self._parts and self._parts[-1].endswith("\r")):
            if text:
                self._parts.append(text)
            return []
        text = "".join(self._parts) + text
        cr = text.endswith("\r")  # perhaps the first half of a CRLF: decided by what comes next
        lines = _LINE_END.split(text[:-1] if cr else text)
        rest = lines.pop() + ("\r" if cr else "")
        self._parts = [rest] if rest else []
        return lines

    def close(self) -> list[str]:
        """The last line, when the stream ended without a line end after it."""
        rest, self._parts = "".join(self._parts), []
        return [rest.removesuffix("\r")] if rest else []


def iter_lines(chunks: Iterable[str]) -> Iterator[str]:
    splitter = LineSplitter()
    for chunk in chunks:
        yield from splitter.feed(chunk)
    yield from splitter.close()


async def aiter_lines(chunks: AsyncIterable[str]) -> AsyncIterator[str]:
    splitter = LineSplitter()
    async for chunk in chunks:
        for line in splitter.feed(chunk):
            yield line
    for line in splitter.close():
        yield line


@dataclass
class Event:
    raw: bytes          # the event as received, blank-line terminated, ready to relay
    data: str           # the joined `data:` fields

    @property
    def is_done(self) -> bool:
        return self.data.strip() == "[DONE]"

    def json(self):
        try:
            return json.loads(self.data)
        except ValueError:
            return None

    @property
    def error(self) -> dict | None:
        body = self.json()
        return body.get("error") if isinstance(body, dict) and isinstance(body.get("error"), dict) else None

    @property
    def has_output(self) -> bool:
        """Whether it carries a token or tells the client something: a completion chunk (its text
        may be empty while the server holds the token back), chat content, a finish reason or
        usage. A chat stream's opening `{"role": "assistant"}` delta is not output, even with an
        empty `content` (vLLM opens so, before any token), so a failure right after it is still
        retried; a later delta with empty content is a token held back."""
        body = self.json()
        if not isinstance(body, dict):
            return False
        if body.get("usage"):
            return True
        for choice in body.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            if "text" in choice or choice.get("finish_reason") or delta.get("content") \
                    or ("content" in delta and "role" not in delta):
                return True
        return False


async def events(lines: AsyncIterator[str]) -> AsyncIterator[Event]:
    """Group an SSE line stream into events (comments and blank keep-alives are dropped). An event the
    stream ended in, before its blank line, is dropped as the SSE spec says: it was cut (a vLLM server
    killed mid-stream ended its body inside an event's JSON), so the stream ends without [DONE] and the
    relay says so with an error event, never by passing half an event to the client."""
    data: list[str] = []
    raw: list[str] = []
    async for line in lines:
        if line == "":
            if data:
                yield Event(("\n".join(raw) + "\n\n").encode(), "\n".join(data))
            data, raw = [], []
            continue
        if line.startswith(":"):
            continue
        raw.append(line)
        if line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)


def encode(body: dict) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


def stream_of(result: dict, chat: bool, include_usage: bool) -> list[bytes]:
    """A finished (non-streamed) completion as the SSE events the client asked for: used when the
    context server's first token already ended the request."""
    base = {"id": result.get("id"), "created": result.get("created"), "model": result.get("model")}
    chunks = []
    for choice in result.get("choices") or []:
        if chat:
            message = choice.get("message") or {}
            piece = {"index": choice.get("index", 0), "logprobs": None, "finish_reason": choice.get("finish_reason"),
                     "delta": {"role": message.get("role", "assistant"), "content": message.get("content") or ""}}
        else:
            piece = {"index": choice.get("index", 0), "text": choice.get("text", ""), "logprobs": None,
                     "finish_reason": choice.get("finish_reason")}
        chunks.append(encode({**base, "object": "chat.completion.chunk" if chat else "text_completion",
                              "choices": [piece]}))
    if include_usage and result.get("usage"):
        chunks.append(encode({**base, "object": "chat.completion.chunk" if chat else "text_completion",
                              "choices": [], "usage": result["usage"]}))
    chunks.append(DONE)
    return chunks
