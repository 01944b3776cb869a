"""Pieces of the stall end-to-end tests and of bench/remediation.py: a fleet of real servers that
accept injected faults, a steady client load through the fleet's router that accounts for every
request, and real Prometheus and Alertmanager processes wired to the operator's webhook."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
import yaml

from adpfleet.cluster.processes import free_port
from adpfleet.cluster.testing import wait_for
from adpfleet.operator.resource import names
from adpfleet.runtime.router import sse

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "charts" / "adpfleet" / "files" / "alert-rules.yaml"
VENV_BIN = Path(sys.executable).parent


def stall_fleet(name: str, *, mode: str = "Auto", window: int = 6, interval: int = 1,
                cooldown: int = 5, budget: int = 20, context_ranks: int = 2, pad: bool = False) -> dict:
    """One context server (2 ranks, padding off so a starved rank vetoes every forward), one
    generation server, the router; faults accepted; short windows so a test sees a stall in seconds."""
    probes = {"readinessPeriodSeconds": 1, "startupTimeoutSeconds": 120}

    def role(ranks: int, **engine) -> dict:
        return {"servers": 1, "adpRanks": ranks, "probes": probes, "terminationGracePeriodSeconds": 2,
                "engine": {"kvBlocks": 96, "maxNumTokens": 256, "collectiveTimeoutSeconds": 300, **engine}}
    return {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": name},
            "spec": {"image": "adpfleet:dev", "model": {"name": "tiny"}, "faultInjection": True,
                     "context": role(context_ranks, padEmptyBatch=pad), "generation": role(1),
                     "monitoring": {"scrapeIntervalSeconds": interval},
                     "remediation": {"mode": mode, "stallWindowSeconds": window, "cooldownSeconds": cooldown,
                                     "budgetPerHour": budget, "drainTimeoutSeconds": 5,
                                     "maxConcurrentPerRole": 1}}}


def vllm_stall_fleet(name: str, model_dir: str, *, window: int, interval: int, servers: int = 2, adp_ranks: int = 1,
                     cooldown: int = 5, budget: int = 20, auth: dict | None = None,
                     cache_dir: Path | None = None) -> dict:
    """`servers` aggregated `vllm serve` servers of the model at `model_dir` (`adp_ranks` data-parallel engines
    each), the router;
    short windows so a test sees a stall in seconds. Each server runs one OpenMP thread that vLLM does not
    bind (`VLLM_CPU_OMP_THREADS_BIND=nobind`): bound to one core, every server of the fleet and a
    replacement's start shared that core while the other one idled, and a replacement starved past its
    start-up timeout. `auth`: the fleet's spec.auth (none: the router and vLLM take any request).
    `cache_dir`: the node's directory the servers keep vLLM's cache in (vllm.cache.hostPath; none: each
    pod's scratch, and every start is cold)."""
    spec = {"image": "adpfleet:dev", "engine": "vllm", "model": {"uri": model_dir, "servedName": "tiny-llama"},
            "vllm": {"image": "vllm/vllm-openai:v0.32.0", "args": ["--dtype", "float32", "--enforce-eager"]},
            "aggregated": {"servers": servers, "adpRanks": adp_ranks, "probes": {"readinessPeriodSeconds": 1},
                           "terminationGracePeriodSeconds": 2,
                           "env": [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"},
                                   {"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"}]},
            "monitoring": {"scrapeIntervalSeconds": interval},
            "remediation": {"mode": "Auto", "stallWindowSeconds": window, "cooldownSeconds": cooldown,
                            "budgetPerHour": budget, "drainTimeoutSeconds": 5, "maxConcurrentPerRole": 1}}
    if auth:
        spec["auth"] = auth
    if cache_dir is not None:
        spec["vllm"]["cache"] = {"hostPath": {"path": str(cache_dir)}}
    return {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": name}, "spec": spec}


def vllm_requests_running(pod, engine: int | None = None) -> float | None:
    """Requests the vLLM server `pod`'s engines (or only engine `engine`) report running (its /metrics, read as
    the operator reads them); None when the server, sharing 2 loaded cores, did not answer within the read's
    timeout (in a CI run: 5 s), which says nothing of its engines (the caller reads again); 0 for an engine
    that has not served yet (its gauges appear with its first request)."""
    from adpfleet.operator.adapters.dialects import dialect_for
    try:
        text = httpx.get(f"http://{pod.status.pod_ip}:{names.SERVER_HTTP_PORT}/metrics", timeout=5).text
    except httpx.TimeoutException:
        return None
    ranks = dialect_for("vllm").parse(text)
    return sum(r.requests_running or 0 for e, r in ranks.items() if engine is None or e == engine)


class ProgressWatch:
    """Engine `engine` of the vLLM server `pod`, read as the operator reads it every `every` s from now on
    (start it before the freeze): when its reported progress last moved. vLLM's API server counts an
    engine's tokens as it handles the outputs the engine sent; on loaded cores it handles them seconds after
    the engine stopped, and until then the engine's counters still move. The operator's window starts there,
    not at the freeze. A read that the loaded API server answers late shows the moves made since the one
    before it: they are dated by the read that saw them (a CI run: the first read after a freeze answered
    ~4 s late, with the counters moved, and the operator's first still scrape came 4.4 s after the freeze).

    The first read is made before the constructor returns: a move is seen only against a read before it, and a
    first read the loaded API server answered after the freeze hid every move until then (a run alone: no move
    seen, the operator's window began 4.8 s after the freeze)."""

    def __init__(self, pod, engine: int, every: float = 0.5, first_within: float = 30):
        from adpfleet.operator.adapters.dialects import dialect_for
        self.samples: list[tuple[float, object]] = []  # (time.time() after the read, the engine's RankSample)
        self._stop = threading.Event()
        url, dialect = f"http://{pod.status.pod_ip}:{names.SERVER_HTTP_PORT}/metrics", dialect_for("vllm")

        def read() -> bool:
            try:
                rank = dialect.parse(httpx.get(url, timeout=5).text).get(engine)
            except httpx.HTTPError:
                return False
            if rank is not None:
                self.samples.append((time.time(), rank))
            return rank is not None

        def sample():
            while not self._stop.wait(every):
                read()
        wait_for(read, timeout=first_within, interval=every, what=f"engine {engine}'s /metrics on {pod.metadata.name}")
        self._thread = threading.Thread(target=sample, daemon=True, name="progress-watch")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def last_moved(self) -> float | None:
        """The time of the last read that found the engine's counters moved since the read before it (None
        when none did); stops the watch."""
        self.stop()
        assert self.samples, "the frozen engine's /metrics never answered"
        moving = [t for (_, s), (t, later) in zip(self.samples, self.samples[1:]) if later.progressed_since(s)]
        return max(moving, default=None)


# ---- client load ----------------------------------------------------------------------------------

@dataclass
class Outcome:
    start: float
    end: float
    kind: str                 # completed | error (an error the client saw) | lost (no answer by the deadline)
    streamed: bool = False
    ttft: float | None = None  # streamed: seconds to the first event with text
    attempts: int = 1         # X-Adpfleet-Attempts: > 1 when the router retried it on another server
    queued: float = 0.0       # X-Adpfleet-Queued-Seconds: held in the router's queue for a usable server
    tokens: int = 0
    detail: str = ""          # what the client saw, for an error: http | error body | stream_error_event | ...
    after_tokens: bool = False  # an error that came after text had reached the client


@dataclass
class Load:
    """`clients` threads sending completions through the router back to back, each with a deadline;
    every request ends completed, error or lost. With `streaming`, the odd clients stream."""
    url: str
    clients: int = 3
    max_tokens: int = 24
    deadline: float = 90.0
    streaming: bool = False
    api_key: str | None = None  # sent as a bearer token (a fleet with spec.auth refuses requests without it)
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)
    _abandoned: bool = False

    def __enter__(self) -> "Load":
        for i in range(self.clients):
            t = threading.Thread(target=self._client, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """No new requests; waits for those in flight to end (`deadline` at most)."""
        self._stop.set()
        for t in self._threads if not self._abandoned else ():
            t.join(self.deadline + 10)

    def abandon(self) -> None:
        """No new requests, and none waited for: for a test that asserts nothing of the outcomes and whose
        requests in flight would wait for what it does not (a replacement's start, when the fleet has no
        other server). Each ends with the fleet (an error), or by its deadline."""
        self._abandoned = True
        self._stop.set()

    def _client(self, i: int) -> None:
        n, streamed = 0, self.streaming and i % 2 == 1
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        with httpx.Client(timeout=httpx.Timeout(self.deadline, connect=5.0), headers=headers) as http:
            while not self._stop.is_set():
                n += 1
                body = {"prompt": f"client {i} request {n}: tell me about attention data parallelism " * 2,
                        "max_tokens": self.max_tokens, "ignore_eos": True, "stream": streamed}
                if streamed:
                    body["stream_options"] = {"include_usage": True}
                out = self._one(http, body, streamed)
                with self._lock:
                    self.outcomes.append(out)
                if out.kind != "completed":
                    time.sleep(1.0)  # a client backs off after an error

    def _one(self, http: httpx.Client, body: dict, streamed: bool) -> Outcome:
        start = time.time()
        out = Outcome(start, start, "error", streamed)
        try:
            with http.stream("POST", self.url + "/v1/completions", json=body) as r:
                out.attempts = int(r.headers.get("x-adpfleet-attempts", 1))
                out.queued = float(r.headers.get("x-adpfleet-queued-seconds", 0))
                if r.status_code != 200:
                    r.read()
                    out.detail = f"http {r.status_code}: {r.text[:160]}"
                elif not streamed:
                    r.read()
                    answer = r.json()
                    if "error" in answer:
                        out.detail = f"error body: {str(answer['error'])[:160]}"
                    else:
                        out.kind, out.tokens = "completed", answer["usage"]["completion_tokens"]
                else:
                    self._read_stream(r, start, out)
        except httpx.TimeoutException as e:
            out.kind, out.detail = "lost", f"no answer by the deadline ({type(e).__name__})"
            out.after_tokens = out.ttft is not None
        except httpx.HTTPError as e:  # connection refused / reset: an explicit failure
            out.detail, out.after_tokens = f"connection: {type(e).__name__}: {e}", out.ttft is not None
        out.end = time.time()
        return out

    def _read_stream(self, r: httpx.Response, start: float, out: Outcome) -> None:
        done = False
        for line in sse.iter_lines(r.iter_text()):  # as an SSE client splits them: httpx's iter_lines breaks more
            if time.time() - start > self.deadline:
                raise httpx.ReadTimeout("the client's deadline passed mid-stream")
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            try:
                event = json.loads(data)
            except ValueError:  # half an event: an outcome of its own, never a client thread that dies unseen
                out.detail, out.after_tokens = f"stream_malformed_event: {data[:160]}", out.ttft is not None
                return
            if "error" in event:
                out.detail = f"stream_error_event: {str(event['error'].get('message'))[:160]}"
                out.after_tokens = out.ttft is not None
                return
            if event.get("choices") and out.ttft is None:  # the first event that carries output
                out.ttft = time.time() - start
            if event.get("usage"):
                out.tokens = event["usage"]["completion_tokens"]
        if done:
            out.kind = "completed"
        else:
            out.detail, out.after_tokens = "stream_cut: ended without [DONE]", out.ttft is not None

    def snapshot(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)

    def completed_since(self, t: float) -> int:
        return sum(1 for o in self.snapshot() if o.kind == "completed" and o.end >= t)

    def counts(self) -> dict[str, int]:
        out = {"completed": 0, "error": 0, "lost": 0}
        for o in self.snapshot():
            out[o.kind] += 1
        return out


def tokens_per_second(outcomes: list[Outcome], start: float, end: float) -> list[tuple[float, float]]:
    """Tokens of the requests completed in each second from `start` to `end`."""
    done = [o for o in outcomes if o.kind == "completed"]
    series, t = [], start
    while t < end:
        series.append((round(t - start, 1), sum(o.tokens for o in done if t <= o.end < t + 1.0)))
        t += 1.0
    return series


# ---- real Prometheus and Alertmanager ---------------------------------------------------------------

class Monitoring:
    """Prometheus scraping the fleet's server pods with the chart's rule file, and Alertmanager
    routing the stall alerts to the operator's webhook with the bearer token.

    Debian's Prometheus is built without Kubernetes service discovery, so the targets come from a
    file (file_sd) that a thread keeps equal to the namespace's server pods, with the labels the
    chart's PodMonitor gives them (namespace, pod, fleet)."""

    def __init__(self, workdir: Path, core, namespace: str, webhook_url: str, token: str, rules: str | None = None):
        """`rules`: the rule file's text (default: the chart's, as shipped)."""
        self.workdir = workdir
        self.core, self.namespace = core, namespace
        self.prom_port, self.am_port = free_port(), free_port()
        self.procs: list[subprocess.Popen] = []
        self._stop = threading.Event()
        d = workdir / "monitoring"
        d.mkdir(parents=True, exist_ok=True)
        (d / "alert-rules.yaml").write_text(rules if rules is not None else RULES.read_text())
        self.targets_file = d / "targets.json"
        self.targets_file.write_text("[]")
        (d / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": [str(d / "alert-rules.yaml")],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{self.am_port}"]}]}]},
            "scrape_configs": [{"job_name": "adpfleet-servers",
                                "file_sd_configs": [{"files": [str(self.targets_file)], "refresh_interval": "1s"}]}]}))
        (d / "alertmanager.yml").write_text(yaml.safe_dump({
            "route": {"receiver": "adpfleet-operator", "group_by": ["alertname", "namespace", "fleet", "pod"],
                      "group_wait": "1s", "group_interval": "5s", "repeat_interval": "1h"},
            "receivers": [{"name": "adpfleet-operator", "webhook_configs": [{
                "url": webhook_url, "send_resolved": False,
                "http_config": {"authorization": {"type": "Bearer", "credentials": token}}}]}]}))
        self.dir = d

    def _discover(self) -> None:
        last = None
        while not self._stop.is_set():
            try:
                pods = self.core.list_namespaced_pod(self.namespace, label_selector=names.LABEL_ROLE).items
                groups = [{"targets": [f"{p.status.pod_ip}:{names.SERVER_HTTP_PORT}"],
                           "labels": {"namespace": self.namespace, "pod": p.metadata.name,
                                      "fleet": p.metadata.labels.get(names.LABEL_FLEET, "")}}
                          for p in pods if p.status.pod_ip and p.metadata.deletion_timestamp is None]
                text = json.dumps(sorted(groups, key=lambda g: g["labels"]["pod"]))
                if text != last:
                    tmp = self.targets_file.with_suffix(".tmp")
                    tmp.write_text(text)
                    tmp.replace(self.targets_file)
                    last = text
            except Exception:  # noqa: BLE001 - a transient API error: try again
                pass
            self._stop.wait(0.5)

    def start(self) -> "Monitoring":
        d = self.dir
        threading.Thread(target=self._discover, daemon=True).start()
        self._spawn("alertmanager", ["prometheus-alertmanager", f"--config.file={d / 'alertmanager.yml'}",
                                     f"--storage.path={d / 'am-data'}", f"--web.listen-address=127.0.0.1:{self.am_port}",
                                     "--cluster.listen-address="])
        self._spawn("prometheus", ["prometheus", f"--config.file={d / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={d / 'prom-data'}",
                                   f"--web.listen-address=127.0.0.1:{self.prom_port}"])
        deadline = time.monotonic() + 60
        for url in (f"http://127.0.0.1:{self.prom_port}/-/ready", f"http://127.0.0.1:{self.am_port}/-/ready"):
            while True:
                try:
                    if httpx.get(url, timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url} not ready; logs in {d}")
                time.sleep(0.3)
        return self

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.dir / f"{name}.log", "wb")
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def stop(self) -> None:
        self._stop.set()
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(f"http://127.0.0.1:{self.prom_port}/api/v1/query", params={"query": expr}, timeout=5)
        return r.json()["data"]["result"]

    def alerts(self) -> list[dict]:
        r = httpx.get(f"http://127.0.0.1:{self.prom_port}/api/v1/alerts", timeout=5)
        return r.json()["data"]["alerts"]

    def targets_up(self) -> int:
        return sum(1 for s in self.query('up{job="adpfleet-servers"}') if s["value"][1] == "1")


def inject(core, pod, kind: str, rank: int) -> dict:
    """POST /faults to the server `pod`, with its fleet's internal token (read through the CoreV1Api
    `core` from the Secret the operator created): /faults needs a credential like /v1/*."""
    secret = core.read_namespaced_secret(f"{pod.metadata.labels[names.LABEL_FLEET]}-internal-token",
                                         pod.metadata.namespace)
    token = base64.b64decode(secret.data["token"]).decode()
    r = httpx.post(f"http://{pod.status.pod_ip}:{names.SERVER_HTTP_PORT}/faults", json={"kind": kind, "rank": rank},
                   headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()



def inject_as_documented(cluster, pod, kind: str, rank: int) -> dict:
    """The same POST as `inject`, made by the commands of docs/remediation.md's "Rehearsing a stall"
    as a user runs them (the token from the fleet's Secret with kubectl, curl), with the page's
    placeholders filled in. The local cluster cannot port-forward: the commands reach the pod's IP,
    the alternative the page gives (tests/doc_commands.py)."""
    import doc_commands  # tests/, on the path under pytest (bench/remediation.py never injects this way)
    block, = doc_commands.blocks(ROOT / "docs" / "remediation.md", "Rehearsing a stall (fault injection)")
    commands = [c.replace('{"kind": "freeze", "rank": 1}', json.dumps({"kind": kind, "rank": rank}))
                for c in block.commands]
    place = doc_commands.Place(pod.metadata.namespace, fleet=pod.metadata.labels[names.LABEL_FLEET],
                               pod=pod.metadata.name)
    answer = json.loads(doc_commands.run(commands, place, cluster, timeout=30))
    assert answer == {"injected": kind, "rank": rank}, answer
    return answer


def remediations(fleet: dict) -> list[dict]:
    return (fleet.get("status") or {}).get("recentRemediations") or []


def verdict_line(operator_log: str, server: str) -> dict:
    """The operator's (JSON) log line of its verdict on `server`."""
    entries = (json.loads(line) for line in operator_log.splitlines() if line.startswith("{"))
    return next(e for e in entries if e["message"].startswith(f"stall detected: {server} "))


def verdict_time(operator_log: str, server: str) -> float:
    """When the operator judged `server` stalled: its log line of the verdict. The remediation
    record's time is later, when the action starts, after the Events went out: seconds under load."""
    return datetime.fromisoformat(verdict_line(operator_log, server)["timestamp"]).timestamp()


def assert_decided_in_time(operator_log: str, server: str, t_fault: float, window: float, interval: float,
                           moved_until: float | None = None) -> float:
    """The operator's verdict on `server`, frozen at time.time() `t_fault`, came no sooner than its rule
    allows and within the window plus two scrape intervals of the last progress the server reported
    (`moved_until`, a ProgressWatch's, when that is later than the freeze); its delay after the freeze (s).

    The bound is counted in the operator's scrape intervals as they ran: on cores shared with the servers
    (and with other runs) a scrape of a busy server is answered late, and ticks slip. Scaled by the stretch's
    mean spacing (the verdict's scrapes over the seconds they span), a doubled window still fails it, and a
    detection that needs more scrapes than the rule's does too. Never sooner: the verdict spans at least
    the window less the confirming scrape and a quarter interval of jitter (docs/remediation.md, Detection)."""
    verdict = verdict_line(operator_log, server)
    decided = datetime.fromisoformat(verdict["timestamp"]).timestamp()
    stopped = max(t_fault, moved_until or t_fault)
    spanned = verdict["decided_at"] - verdict["stalled_since"]
    spacing = spanned / (verdict["scrapes"] - 1)
    bound = (window + 2 * interval) * max(1.0, spacing / interval)
    print(f"{server}: hung decided {decided - t_fault:.1f} s after the freeze, {decided - stopped:.1f} s after its "
          f"last reported progress (bound {bound:.1f} s; the verdict spans {spanned:.1f} s over {verdict['scrapes']} "
          f"scrapes)", flush=True)
    assert spanned >= window - 1.25 * interval, f"decided over {spanned:.1f} s, less than the window allows"
    assert decided - stopped <= bound, (
        f"hung decided {decided - stopped:.1f} s after the last progress the server reported ({decided - t_fault:.1f} s "
        f"after the freeze): more than the window plus two scrape intervals ({bound:.1f} s at the scrapes' mean "
        f"spacing {spacing:.2f} s)")
    return decided - t_fault


def dump(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, default=str))
