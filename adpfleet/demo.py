"""`adpfleet demo`: the whole promise on one machine, in a few minutes.

A local control plane and node agent (pods are local processes), the operator installed with the
real `helm` chart, a small disaggregated fleet (1 context + 1 generation server, 2 ADP ranks
each, a router), client traffic with a live display, a rank frozen half-way (the server stays
Running and Ready, and stops making progress), the operator detecting the stall and draining and
restarting the server, and a summary with a plot of progress over time.

`--engine vllm` tells the same story with the real vLLM (`scripts/setup --with-vllm`): two
aggregated `vllm serve` servers of a tiny random Llama behind the router, one server's
`VLLM::EngineCore` frozen from the node's side (SIGSTOP, while its engine runs requests: a vLLM
engine frozen idle cannot be told from an idle one), the fleet serving on the peer meanwhile.
"""

from __future__ import annotations

import base64
import json
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

NAMESPACE = "adpfleet-demo"
RELEASE = "adpfleet"
FLEET = "demo"
ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "adpfleet"


class DemoError(RuntimeError):
    """A prerequisite or a step failed; the message says what and how to fix it."""


@dataclass
class Timeline:
    start: float = field(default_factory=time.monotonic)
    samples: list[tuple[float, float]] = field(default_factory=list)  # (t, generated tokens/s)
    events: list[tuple[float, str]] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.start

    def mark(self, what: str, ago: float = 0.0) -> float:
        """Note `what` as happening now, or `ago` seconds before now."""
        t = self.now() - ago
        self.events.append((t, what))
        return t

    def first(self, prefix: str) -> float | None:
        return next((t for t, what in self.events if what.startswith(prefix)), None)


@dataclass
class Traffic:
    completed: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (sent at, seconds) of completed requests
    retried: int = 0  # completed, after the router tried another server (X-Adpfleet-Attempts > 1)
    held: int = 0     # completed, after waiting in the router's queue for a usable server


API_KEY_SECRET = f"{FLEET}-api-key"
# vLLM's CPU build here: a 1 GiB KV cache, and OpenMP threads left unbound (the pod's OMP_NUM_THREADS=1,
# placed by the kernel): bound, every server (and a replacement's start) shared one core.
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


@dataclass(frozen=True)
class Plan:
    """What the run does for its engine: how long, when the fault comes, which role is watched and frozen."""
    engine: str
    duration: float
    fault_at: float
    window: int
    scrape: int
    ready_timeout: float
    role: str  # the role whose tokens the display counts and one of whose servers is frozen

    @classmethod
    def of(cls, engine: str, quick: bool) -> "Plan":
        # --quick (CI) faults once the traffic is steady (it is from its first seconds), not a third
        # of the way in: the run stops 10 s after the recovery anyway
        window, scrape = (8, 2) if quick else (12, 3)
        if engine == "vllm":
            # the replacement's vLLM start comes before its recovery: a minute on quiet cores, and more than
            # 4.5 minutes beside the busy peer on 2 loaded ones (the run ends 10 s after the recovery anyway)
            return cls(engine, 600 if quick else 720, 20 if quick else 60, window, scrape, 900, "aggregated")
        duration = 70 if quick else 150
        return cls(engine, duration, 12 if quick else duration / 3, window, scrape, 300, "generation")


def fleet_manifest(window: int, scrape: int, vllm_model: str | None = None) -> dict:
    """The demo's fleet: adpfleet's engine, disaggregated; with `vllm_model` (a model directory on
    this machine), two aggregated vLLM servers of it."""
    # spec.image is adpfleet's: its servers, and for a vLLM fleet the router and the model check
    spec = {"image": "adpfleet-runtime:demo", "auth": {"apiKeySecret": {"name": API_KEY_SECRET, "key": "key"}},
            "router": {"replicas": 1},
            "monitoring": {"scrapeIntervalSeconds": scrape},
            "remediation": {"mode": "Auto", "stallWindowSeconds": window, "cooldownSeconds": 60,
                            "drainTimeoutSeconds": 2}}
    if vllm_model is None:
        role = {"servers": 1, "adpRanks": 2, "engine": {"kvBlocks": 128, "collectiveTimeoutSeconds": 600}}
        spec.update(model={"name": "tiny"}, context=role, generation=role,
                    faultInjection=True)  # the demo freezes a rank on purpose
    else:
        # two servers: the peer serves while the frozen one is replaced (a vLLM start takes a minute or more)
        spec.update(engine="vllm", model={"uri": vllm_model, "servedName": "tiny"},
                    vllm={"image": "vllm/vllm-openai:v0.32.0", "args": ["--dtype", "float32", "--enforce-eager"]},
                    aggregated={"servers": 2, "adpRanks": 1, "terminationGracePeriodSeconds": 5,
                                "env": [{"name": k, "value": v} for k, v in VLLM_CPU_ENV.items()]})
    return {"apiVersion": "adpfleet.io/v1alpha1", "kind": "InferenceFleet",
            "metadata": {"name": FLEET, "namespace": NAMESPACE}, "spec": spec}


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    ordered = sorted(xs)
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))], 2)



# The timeline's marks in the plot, in the order they happen: (the event's prefix, the legend's word).
MARKS = (("Fault", "fault"), ("Stalled", "detected"), ("Remediation", "remediation"))
_MARK_STYLES = (("#c53030", "--", 3.0), ("#dd6b20", ":", 2.2), ("#2f855a", "-.", 1.4))


def draw_marks(ax, marks: list[tuple[str, float | None]]) -> None:
    """A vertical line per mark that happened, each with its own colour, dash and width (drawn
    widest first), and its word at its own height: marks that fall on the same second (detection and
    remediation often do) stay visible side by side instead of the last one hiding the others."""
    for i, ((label, t), (color, dash, width)) in enumerate(zip(marks, _MARK_STYLES)):
        if t is None:
            continue
        ax.axvline(t, color=color, linestyle=dash, linewidth=width, label=label, zorder=3 + i)
        ax.annotate(f"{label} {t:.0f} s", xy=(t, 0.96 - 0.1 * i), xycoords=ax.get_xaxis_transform(),
                    xytext=(4, 0), textcoords="offset points", color=color, fontsize=8, va="top")


class Demo:
    def __init__(self, args):
        self.args = args
        self.quick = args.quick
        self.plan = Plan.of(getattr(args, "engine", "adpfleet"), self.quick)
        self.duration, self.fault_at = self.plan.duration, self.plan.fault_at
        self.window, self.scrape = self.plan.window, self.plan.scrape
        self.vllm_model: str | None = None
        self.before_fault: set[str] = set()    # uids of the serving role's pods when the fault came
        self.first_tokens: dict[str, float] = {}  # pod uid -> when it had first generated tokens
        self.out = Path(args.out)
        self.timeline = Timeline()
        self.traffic = Traffic()
        self.stop = threading.Event()
        self._lock = threading.Lock()

    # -- steps ---------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        print(f"demo: {text}", flush=True)

    def preflight(self) -> None:
        missing = []
        for module, extra in (("rich", "dev"), ("matplotlib", "dev"), ("kubernetes", "operator"),
                              ("kopf", "operator"), ("torch", "runtime")):
            try:
                __import__(module)
            except ImportError:
                missing.append(f"{module} (extra '{extra}')")
        if missing:
            raise DemoError(f"missing Python packages: {', '.join(missing)}. Run ./scripts/demo (it installs "
                            f"them into .venv/) or `pip install -e '.[runtime,operator,dev]'`.")
        from adpfleet.cluster.binaries import BinariesUnavailable, ensure_binaries

        try:
            self.say("checking the control-plane binaries and helm (the first run builds them from the Go "
                     "module proxy: several minutes, cached in ~/.cache/adpfleet)")
            self.binaries = ensure_binaries()
        except BinariesUnavailable as e:
            raise DemoError(f"{e}\nThe demo needs Go 1.26+ to build them once: run ./scripts/setup.") from None
        if self.plan.engine == "vllm":
            self.vllm_model = self.tiny_vllm_model()

    def tiny_vllm_model(self) -> str:
        from adpfleet.cluster import vllm_env, vllm_model

        try:
            vllm_env.locate()
        except vllm_env.VllmUnavailable as e:
            raise DemoError(f"{e}\n--engine vllm runs the real vLLM: build its environment once with "
                            f"`scripts/setup --with-vllm` (./scripts/demo --engine vllm does).") from None
        self.say("the tiny random Llama for vLLM (built once, cached beside the vLLM environment)")
        return str(vllm_model.build_model())

    def cluster_up(self) -> None:
        from adpfleet.cluster.controlplane import ControlPlane

        self.plane = ControlPlane(None)
        report = self.plane.up()
        self.started_cluster = bool(report.started)
        self.say(f"local cluster {'started' if report.started else 'already up'} "
                 f"(KUBECONFIG={report.kubeconfig})")
        self.kubeconfig = str(report.kubeconfig)
        from kubernetes import client, config

        api = config.new_client_from_config(config_file=self.kubeconfig)
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [str(self.binaries.helm), f"--kubeconfig={self.kubeconfig}", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if check and proc.returncode:
            raise DemoError(f"helm {' '.join(args[:2])} failed:\n{proc.stderr.strip()}")
        return proc

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(self.binaries.kubectl), f"--kubeconfig={self.kubeconfig}", *args],
                              input=input, capture_output=True, text=True, timeout=120)
        if check and proc.returncode:
            raise DemoError(f"kubectl {' '.join(args[:2])} failed:\n{proc.stderr.strip()}")
        return proc

    def install(self) -> None:
        self.say("installing the operator with helm (chart charts/adpfleet, namespace-scoped)")
        self.helm("upgrade", "--install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace",
                  "--set", f"watch.namespaces={{{NAMESPACE}}}", "--set", "operator.logFormat=plain",
                  "--wait", "--timeout", "180s")
        servers = ("1 context + 1 generation server x 2 ADP ranks" if self.plan.engine == "adpfleet"
                   else "2 aggregated vLLM servers (vllm serve)")
        self.say(f"applying InferenceFleet {FLEET!r}: tiny model, {servers}, router; stall window {self.window} s, "
                 f"scrape every {self.scrape} s, remediation Auto")
        # The chart requires every fleet to have an API key (security.requireApiKey): the demo's own.
        self.api_key = secrets.token_urlsafe(24)
        self.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": API_KEY_SECRET, "namespace": NAMESPACE},
            "stringData": {"key": self.api_key}}))
        self.kubectl("apply", "-f", "-", input=json.dumps(fleet_manifest(self.window, self.scrape, self.vllm_model)))
        self.wait(lambda: self.condition("Ready") == "True", self.plan.ready_timeout, "the fleet to become Ready")
        self.timeline = Timeline()
        self.say("fleet Ready")

    def fleet(self) -> dict:
        return self.custom.get_namespaced_custom_object("adpfleet.io", "v1alpha1", NAMESPACE, "inferencefleets", FLEET)

    def condition(self, kind: str) -> str | None:
        for c in self.fleet().get("status", {}).get("conditions", []):
            if c["type"] == kind:
                return c["status"]
        return None

    def pods(self, role: str | None = None) -> list:
        selector = f"adpfleet.io/fleet={FLEET}" + (f",adpfleet.io/role={role}" if role else "")
        return self.core.list_namespaced_pod(NAMESPACE, label_selector=selector).items

    def router_url(self) -> str:
        pods = self.core.list_namespaced_pod(NAMESPACE, label_selector="app.kubernetes.io/component=router").items
        ready = [p for p in pods if p.status.pod_ip and any(c.type == "Ready" and c.status == "True"
                                                             for c in p.status.conditions or [])]
        if not ready:
            raise DemoError("no Ready router pod")
        return f"http://{ready[0].status.pod_ip}:8000"

    def wait(self, check, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if check():
                    return
            except Exception:  # the API or a pod may be briefly unreachable while things start
                pass
            time.sleep(0.5)
        raise DemoError(f"timed out after {timeout:.0f} s waiting for {what}")

    # -- traffic, observation, the fault -------------------------------------------------------
    def client_loop(self, url: str, worker: int) -> None:
        import httpx

        i = 0
        with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {self.api_key}"}) as http:
            while not self.stop.is_set():
                i += 1
                body = {"model": "tiny", "prompt": f"worker {worker} request {i}: tell me about ADP padding",
                        "max_tokens": 48, "temperature": 0, "ignore_eos": True}
                started, sent_at = time.monotonic(), self.timeline.now()
                try:
                    r = http.post(url + "/v1/completions", json=body)
                    ok = r.status_code == 200
                    reason = None if ok else f"HTTP {r.status_code}"
                    retried = int(r.headers.get("x-adpfleet-attempts", 1)) > 1
                    held = float(r.headers.get("x-adpfleet-queued-seconds", 0)) >= 0.05
                except httpx.HTTPError as e:
                    ok, reason, retried, held = False, type(e).__name__, False, False
                with self._lock:
                    if ok:
                        self.traffic.completed += 1
                        self.traffic.retried += retried
                        self.traffic.held += held
                        self.traffic.latencies.append((sent_at, time.monotonic() - started))
                    else:
                        self.traffic.failed += 1
                        self.traffic.errors[reason] = self.traffic.errors.get(reason, 0) + 1
                if not ok:
                    time.sleep(0.5)

    def samples(self, pod) -> dict:
        """The server's ranks as the operator reads them (its engine's dialect); {} while it cannot say."""
        import httpx

        from adpfleet.operator.adapters.dialects import ScrapeError, dialect_for

        if not pod.status.pod_ip:
            return {}
        try:
            return dialect_for(self.plan.engine).parse(
                httpx.get(f"http://{pod.status.pod_ip}:8000/metrics", timeout=2).text)
        except (httpx.HTTPError, ScrapeError):
            return {}

    def tokens_generated(self) -> float:
        """Tokens the serving role's servers have generated; notes when each server first generated any."""
        total = 0.0
        for pod in self.pods(self.plan.role):
            tokens = sum(rank.generation_tokens for rank in self.samples(pod).values())
            if tokens > 0:
                self.first_tokens.setdefault(pod.metadata.uid, self.timeline.now())
            total += tokens
        return total

    def observe(self) -> None:
        """Tokens/s every second, and the operator's view of the fleet (conditions, remediations)."""
        last_total, last_t, seen = None, None, set()
        while not self.stop.is_set():
            t = self.timeline.now()
            total = self.tokens_generated()
            if last_total is not None and total >= last_total:
                self.timeline.samples.append((t, (total - last_total) / max(1e-3, t - last_t)))
            last_total, last_t = total, t  # a restarted server starts its counters at 0 again
            try:
                status = self.fleet().get("status", {})
            except Exception:
                status = {}
            for c in status.get("conditions", []):
                key = (c["type"], c["status"], c.get("reason"))
                if c["type"] in ("Stalled", "Remediating") and c["status"] == "True" and key not in seen:
                    seen.add(key)
                    self.timeline.mark(f"{c['type']}: {c.get('reason')} - {c.get('message', '')[:100]}")
            for rec in status.get("recentRemediations", []):
                key = ("rem", rec["time"], rec["server"], rec["action"], rec["outcome"])
                if key not in seen:
                    seen.add(key)
                    self.timeline.mark(f"Remediation: {rec['action']} {rec['server']} ({rec['signature']}) "
                                       f"-> {rec['outcome']}")
            self.stop.wait(1.0)

    def inject_fault(self) -> None:
        self.before_fault = {p.metadata.uid for p in self.pods(self.plan.role)}
        (self.freeze_vllm_engine if self.plan.engine == "vllm" else self.freeze_rank)()

    def freeze_vllm_engine(self) -> None:
        """SIGSTOP one server's VLLM::EngineCore from the node's side, while its engine runs requests."""
        from adpfleet.cluster import processes
        from adpfleet.cluster.vllm_env import ENGINE_CORE

        pods = {p.metadata.name: p for p in self.pods(self.plan.role)}

        def running(name: str) -> float:
            return sum(rank.requests_running or 0 for rank in self.samples(pods[name]).values())
        victim, t_fault = processes.freeze_busy_pod({n: p.metadata.uid for n, p in pods.items()}, ENGINE_CORE,
                                                    running)
        self.fault_pod = victim
        self.timeline.mark(f"Fault: froze {ENGINE_CORE} of {victim} (SIGSTOP from the node; it stays Running and "
                           f"Ready, /health 200)", ago=time.time() - t_fault)

    def freeze_rank(self) -> None:
        import httpx

        pod = self.pods("generation")[0]
        # /faults needs a credential like /v1/*: the fleet's internal token, from the Secret the operator made
        token = base64.b64decode(self.core.read_namespaced_secret(f"{FLEET}-internal-token", NAMESPACE)
                                 .data["token"]).decode()
        r = httpx.post(f"http://{pod.status.pod_ip}:8000/faults", json={"kind": "freeze", "rank": 1}, timeout=10,
                       headers={"Authorization": f"Bearer {token}"})
        r.raise_for_status()
        self.fault_pod = pod.metadata.name
        self.timeline.mark(f"Fault: froze rank 1 of {pod.metadata.name} (it stays Running and Ready)")

    def run_traffic(self) -> None:
        from rich.console import Console
        from rich.live import Live
        from rich.table import Table

        url = self.url = self.router_url()
        workers = [threading.Thread(target=self.client_loop, args=(url, w), daemon=True) for w in range(4)]
        observer = threading.Thread(target=self.observe, daemon=True)
        for th in workers + [observer]:
            th.start()
        fault_at = self.fault_at
        faulted = False
        console = Console()

        def view() -> Table:
            table = Table(title=f"adpfleet demo — {self.timeline.now():5.1f} s of {self.duration} s")
            table.add_column("what")
            table.add_column("value")
            rate = self.timeline.samples[-1][1] if self.timeline.samples else 0.0
            bar = "█" * min(40, int(rate / 20))
            with self._lock:
                table.add_row("requests completed / failed", f"{self.traffic.completed} / {self.traffic.failed}")
            table.add_row("generation tokens/s", f"{rate:7.1f} {bar}")
            for t, what in self.timeline.events[-5:]:
                table.add_row(f"{t:6.1f} s", what)
            return table

        with Live(view(), console=console, refresh_per_second=2, transient=False) as live:
            while self.timeline.now() < self.duration:
                if not faulted and self.timeline.now() >= fault_at:
                    self.inject_fault()
                    faulted = True
                live.update(view())
                time.sleep(0.5)
                if self.quick and faulted and self.recovered_at() is not None and \
                        self.timeline.now() > self.recovered_at() + 10:
                    break  # CI's shortened run: recovery shown, stop early
            live.update(view())
        self.stop.set()
        for th in workers:
            th.join(timeout=70)
        observer.join(timeout=10)

    def router_counts(self) -> dict[str, float]:
        """The router's retries and queued requests (all outcomes), or {} when it cannot be read."""
        import httpx

        try:
            text = httpx.get(self.url + "/metrics", timeout=5).text
        except (httpx.HTTPError, AttributeError):
            return {}
        counts: dict[str, float] = {}
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in ("adpfleet_router_retries_total", "adpfleet_router_queued_total") and 'outcome="full"' not in line:
                counts[name] = counts.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return counts

    def recovered_at(self) -> float | None:
        """When a server that replaced the frozen one first generated tokens, after the remediation."""
        action = self.timeline.first("Remediation")
        if action is None:
            return None
        return min((t for uid, t in self.first_tokens.items() if uid not in self.before_fault and t > action),
                   default=None)

    # -- the end -------------------------------------------------------------------------------
    def summary(self) -> dict:
        fault = self.timeline.first("Fault")
        detected = self.timeline.first("Stalled")
        acted = self.timeline.first("Remediation")
        recovered = self.recovered_at()

        def since(t):
            return None if t is None or fault is None else round(t - fault, 1)

        router = self.router_counts()
        before = [s for t, s in self.traffic.latencies if fault is None or t < fault]
        after = [s for t, s in self.traffic.latencies if fault is not None and t >= fault]
        latency = {name: {"requests": len(xs), "p50_s": percentile(xs, 50), "p99_s": percentile(xs, 99)}
                   for name, xs in (("before_fault", before), ("from_fault", after))}
        result = {"engine": self.plan.engine,
                  "requests_completed": self.traffic.completed, "requests_failed": self.traffic.failed,
                  "errors": self.traffic.errors, "requests_retried": self.traffic.retried,
                  "requests_held": self.traffic.held, "router_retries": router.get("adpfleet_router_retries_total"),
                  "router_queued": router.get("adpfleet_router_queued_total"), "latency": latency,
                  "fault_at_s": fault and round(fault, 1),
                  "detection_s": since(detected), "first_action_s": since(acted), "recovery_s": since(recovered),
                  "stall_window_s": self.window, "scrape_interval_s": self.scrape,
                  "events": [(round(t, 1), what) for t, what in self.timeline.events]}
        from rich.console import Console
        from rich.table import Table

        table = Table(title="adpfleet demo — summary")
        table.add_column("what")
        table.add_column("value", justify="right")
        table.add_row("requests completed", str(self.traffic.completed))
        table.add_row("client-visible errors (error answers, no answer)",
                      f"{self.traffic.failed} {self.traffic.errors or ''}")
        table.add_row("completed after a retry on another server / after waiting in the router's queue",
                      f"{self.traffic.retried} / {self.traffic.held}")
        for name, what in (("before_fault", "latency before the fault"), ("from_fault", "latency from the fault on")):
            row = latency[name]
            table.add_row(f"{what} p50 / p99", f"{row['p50_s']} / {row['p99_s']} s ({row['requests']} requests)")
        table.add_row("fault → stall detected", f"{result['detection_s']} s (window {self.window} s)")
        table.add_row("fault → drain + restart", f"{result['first_action_s']} s")
        table.add_row("fault → progress restored", f"{result['recovery_s']} s")
        Console().print(table)
        return result

    def plot(self, result: dict) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 3.6))
        ts = [t for t, _ in self.timeline.samples]
        ax.plot(ts, [r for _, r in self.timeline.samples], color="#2b6cb0", label="generated tokens/s")
        draw_marks(ax, [(label, self.timeline.first(prefix)) for prefix, label in MARKS])
        ax.set_xlabel("seconds")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"adpfleet demo: {'a frozen vLLM engine' if self.plan.engine == 'vllm' else 'a frozen rank'}, "
                     f"detected and remediated")
        ax.legend(loc="upper right", fontsize=8)
        fig.tight_layout()
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / "demo-progress.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        (self.out / "demo-summary.json").write_text(json.dumps(result, indent=2))
        return path

    def cleanup(self) -> None:
        if self.args.keep:
            self.say(f"--keep: everything stays up (KUBECONFIG={getattr(self, 'kubeconfig', '?')}); "
                     f"`adpfleet cluster down` stops it")
            return
        if getattr(self, "kubeconfig", None):
            self.say("cleaning up: fleet, operator release")
            self.kubectl("delete", "inferencefleet", FLEET, "-n", NAMESPACE, "--ignore-not-found", "--wait=true",
                         check=False)
            self.helm("uninstall", RELEASE, "--namespace", NAMESPACE, check=False)
            self.kubectl("delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=false", check=False)
        if getattr(self, "started_cluster", False):
            self.say("stopping the local cluster the demo started")
            self.plane.down()


def main(args) -> int:
    demo = Demo(args)
    try:
        demo.preflight()
        demo.cluster_up()
        demo.install()
        demo.run_traffic()
        result = demo.summary()
        path = demo.plot(result)
        demo.say(f"plot: {path}; summary: {path.with_name('demo-summary.json')}")
        ok = result["detection_s"] is not None and result["recovery_s"] is not None
        if not ok:
            demo.say("the stall was not detected and recovered within the run; see the events above")
        return 0 if ok else 1
    except DemoError as e:
        print(f"adpfleet demo: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nadpfleet demo: interrupted", file=sys.stderr)
        return 130
    finally:
        demo.stop.set()
        demo.cleanup()


