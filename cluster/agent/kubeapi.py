"""A small asyncio client for the Kubernetes REST API: plain dicts in and out.

The agent watches every pod and patches status often; the official client's model classes cost
more CPU than the agent itself, so it speaks JSON over one aiohttp session instead.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

import aiohttp

from adpfleet.cluster.kubeconfig import Credentials


class ApiError(Exception):
    def __init__(self, status: int, body: dict | str):
        self.status = status
        self.body = body if isinstance(body, dict) else {"message": str(body)}
        super().__init__(f"{status} {self.reason}: {self.message}")

    @property
    def reason(self) -> str:
        return self.body.get("reason", "")

    @property
    def message(self) -> str:
        return self.body.get("message", "")


class KubeApi:
    def __init__(self, credentials: Credentials):
        self.server = credentials.server.rstrip("/")
        self._ssl = credentials.ssl_context
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._ssl, limit=32))
        return self._session

    async def close(self) -> None:
        if self._session:
            await self._session.close()

    async def request(self, method: str, path: str, *, params: dict | None = None, body: dict | None = None,
                      patch: str | None = None, timeout: float = 30) -> dict:
        """`patch` is the patch type ("merge" or "strategic") when method is PATCH."""
        headers = {"Accept": "application/json"}
        if patch:
            headers["Content-Type"] = {"merge": "application/merge-patch+json",
                                       "strategic": "application/strategic-merge-patch+json"}[patch]
        elif body is not None:
            headers["Content-Type"] = "application/json"
        data = json.dumps(body) if body is not None else None
        async with self.session.request(method, self.server + path, params=_params(params), data=data,
                                        headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            text = await resp.text()
            if resp.status >= 400:
                try:
                    raise ApiError(resp.status, json.loads(text))
                except ValueError:
                    raise ApiError(resp.status, text) from None
            return json.loads(text) if text else {}

    async def get(self, path: str, **params) -> dict:
        return await self.request("GET", path, params=params)

    async def watch(self, path: str, resource_version: str, **params) -> AsyncIterator[dict]:
        """Yield watch events from `resource_version` until the server ends the stream.

        Raises ApiError(410) when the version is too old; the caller then lists again.
        """
        query = {**params, "watch": "true", "resourceVersion": resource_version,
                 "allowWatchBookmarks": "true", "timeoutSeconds": "300"}
        async with self.session.get(self.server + path, params=_params(query),
                                    timeout=aiohttp.ClientTimeout(total=None, sock_read=330)) as resp:
            if resp.status >= 400:
                raise ApiError(resp.status, await resp.text())
            async for line in resp.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    status = event["object"]
                    raise ApiError(status.get("code", 500), status)
                yield event


def _params(params: dict | None) -> dict | None:
    if not params:
        return None
    return {k: ("true" if v is True else "false" if v is False else str(v)) for k, v in params.items()
            if v is not None}


async def retrying(what: str, call, *, attempts: int = 5, retry_conflicts: bool = True, log=None):
    """Run `call()` again on connection errors and 429/5xx (and 409, unless told not to) answers,
    with a short back-off."""
    delay = 0.2
    for attempt in range(attempts):
        try:
            return await call()
        except ApiError as exc:
            retryable = {429, 500, 503, 504} | ({409} if retry_conflicts else set())
            if exc.status not in retryable or attempt == attempts - 1:
                raise
            err = exc
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            if attempt == attempts - 1:
                raise
            err = exc
        if log:
            log.debug("%s failed (%s); retrying in %.1f s", what, err, delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5)
