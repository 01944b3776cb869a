"""`adpfleet demo`: starts a server on the built-in tiny model and sends it one completion.

This is the first stage of the demo; the full loop (local cluster, operator, fleet, injected
stall, remediation) replaces it as those parts land.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(args) -> int:
    import httpx

    port = args.port or _free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"demo: starting `adpfleet serve --model tiny` on {url}", flush=True)
    proc = subprocess.Popen([sys.executable, "-m", "adpfleet", "serve", "--model", "tiny", "--port", str(port)],
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                print(f"demo: the server exited with {proc.returncode}", file=sys.stderr)
                return 1
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                print("demo: the server did not become healthy within 120 s", file=sys.stderr)
                return 1
            time.sleep(0.2)
        body = {"model": "tiny", "prompt": "adpfleet keeps fleets moving", "max_tokens": 24, "temperature": 0}
        start = time.monotonic()
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        r.raise_for_status()
        out = r.json()
        print(f"demo: completion in {time.monotonic() - start:.2f} s, usage {out['usage']}")
        print(f"demo: text {out['choices'][0]['text']!r} (random weights: bytes, not prose)")
        return 0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
