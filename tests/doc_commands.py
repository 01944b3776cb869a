"""The shell commands of the docs, read from the pages and run as a user would against the local cluster.

A page's commands are its ```bash blocks (every line a command; `\\` continues a line, a heredoc is
part of its command, comments are dropped) and the `$ ` lines of its plain ``` blocks (the lines
after one are the output the page shows for it). A block that a test cannot run says so, and why,
in an HTML comment on the line before it:

    <!-- not run by tests: REASON -->

`as_run_here` makes a command this test's: the page's namespaces and placeholders become the test's,
and what the local cluster lacks becomes the documented alternative (the pods listen on loopback
addresses, which the API server will neither proxy nor port-forward to: a pod's `/proxy/` GET and a
port-forward reach the pod's IP instead). `run` runs a page's commands in order, in one shell.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not run by tests: (.+?) -->\s*$", re.S)
HEREDOC = re.compile(r"<<-?\s*'?(\w+)'?")


@dataclass(frozen=True)
class Block:
    page: Path
    section: str            # the `## ` heading it is under ("" before the first)
    kind: str               # "bash", or "console" (a plain block with `$ ` lines)
    text: str
    not_run: str | None     # why no test runs it, as the page says
    commands: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)  # console: the output shown after each command

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)} ({self.section or 'top'}): {self.text.splitlines()[0]}"


def blocks(page: Path, section: str | None = None) -> list[Block]:
    """The command blocks of a page, in order (only those under `## {section}` when given)."""
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        lang, body = match.group(1), match.group(2)
        before = text[:match.start()]
        heading = re.findall(r"^## (.+)$", before, re.M)
        reason = NOT_RUN.search(before.rstrip("\n").rsplit("\n", 1)[-1])
        where = heading[-1].strip() if heading else ""
        if lang == "bash":
            found.append(Block(page, where, "bash", body, reason and reason.group(1), bash_commands(body)))
        elif lang == "" and re.search(r"^\$ ", body, re.M):
            commands, outputs = [], []
            for chunk in re.split(r"^\$ ", body, flags=re.M)[1:]:
                command, _, output = chunk.partition("\n")
                commands.append(command.strip())
                outputs.append(output)
            found.append(Block(page, where, "console", body, reason and reason.group(1), commands, outputs))
    return [b for b in found if section is None or b.section == section]


def bash_commands(text: str) -> list[str]:
    """One command per line of a bash block: continuations joined, comments and blank lines dropped,
    a heredoc kept whole with the line that starts it."""
    lines = text.replace("\\\n", " ").splitlines()
    commands: list[str] = []
    while lines:
        line = _without_comment(lines.pop(0)).strip()
        if not line:
            continue
        if heredoc := HEREDOC.search(line):
            body = []
            while lines and lines[0].strip() != heredoc.group(1):
                body.append(lines.pop(0))
            body.append(lines.pop(0) if lines else heredoc.group(1))
            line = "\n".join([line, *body])
        commands.append(line)
    return commands


def _without_comment(line: str) -> str:
    """The line up to a `#` that starts a comment (at the start or after a space, not in quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


@dataclass(frozen=True)
class Place:
    """Where a page's commands run: the test's namespace for every namespace the page names (unless
    `renamed` gives one its own), and the fleet and pod its placeholders (FLEET, POD) stand for."""
    namespace: str
    fleet: str = "tiny"
    pod: str = "tiny-context-0"
    renamed: tuple[tuple[str, str], ...] = ()
    page_namespaces: tuple[str, ...] = ("adpfleet-system", "NS", "team-a", "team-b", "inference")


POD_PROXY = re.compile(r'kubectl get --raw "?/api/v1/namespaces/([^/]+)/pods/([^/:]+):(\d+)/proxy(/[^"\s]*)"?'
                       r"(?: --request-timeout=\S+)?")
PORT_FORWARD = re.compile(r"kubectl (?:-n (\S+) )?port-forward (?:-n (\S+) )?(pod|service|svc)/(\S+) (\d+):(\d+)"
                          r"(?: -n (\S+))? &$")
WATCH = re.compile(r"kubectl (-n \S+ )?get (\S+) (\S+)((?: -o \S+)?) -w$")


def as_run_here(command: str, place: Place) -> str:
    """A page's command as this test runs it (the module docstring says why each rewrite):
    - the page's namespaces (`adpfleet-system`, `NS`, `team-a`, `-n inference`) are the test's, and
      so is the current namespace of a kubectl command that names none; FLEET and POD are the
      test's fleet and pod;
    - a pod's `kubectl get --raw .../proxy/PATH` is the same GET sent to the pod's IP with curl;
    - `kubectl port-forward KIND/NAME L:R &` finds the address of the pod (a Service's: the first
      pod its selector picks) and every later `localhost:L` is that address, port R;
    - a watch (`get KIND NAME -w`, "until READY becomes True") is `kubectl wait --for=condition=Ready`;
    - the cluster is shared with the other tests: `delete ... --all -A` deletes in the test's
      namespace only, and `kubectl delete crd` is a server-side dry run;
    - a grep of a log may find nothing; a grep -E of /metrics must find every name it lists; a
      trailing head leaves the rest of the output unread (the producer must not die of SIGPIPE).
    """
    line = command
    renamed = dict(place.renamed)
    for name in place.page_namespaces:
        ours = renamed.get(name, place.namespace)
        if name == "inference":  # a word of its own elsewhere ("inferencefleets")
            line = re.sub(r"(-n|--namespace)[ =]inference(?![\w-])", rf"\1 {ours}", line)
        else:
            line = re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w])", ours, line)
    line = re.sub(r"(?<![\w$])FLEET(?!\w)", place.fleet, line)
    line = re.sub(r"(?<![\w$])POD(?!\w)", place.pod, line)
    line = POD_PROXY.sub(lambda m: f'curl -sf --max-time 10 "http://$(kubectl -n {m.group(1)} get pod {m.group(2)} '
                                   f"-o jsonpath='{{.status.podIP}}'):{m.group(3)}{m.group(4)}\"", line)
    if forward := PORT_FORWARD.fullmatch(line):
        ns = forward.group(1) or forward.group(2) or forward.group(7) or place.namespace
        kind, name, local, remote = forward.group(3, 4, 5, 6)
        selector = (f"kubectl -n {ns} get service {name} -o go-template='{{{{$s := \"\"}}}}{{{{range $k, $v := "
                    f".spec.selector}}}}{{{{$s}}}}{{{{$k}}}}={{{{$v}}}}{{{{$s = \",\"}}}}{{{{end}}}}'")
        if kind == "pod":
            find = f"ip=$(kubectl -n {ns} get pod {name} -o jsonpath='{{.status.podIP}}')"
        else:  # the Service must exist and select a pod
            find = (f"selector=$({selector}) && [ -n \"$selector\" ] && "
                    f"ip=$(kubectl -n {ns} get pods -l \"$selector\" -o jsonpath='{{.items[0].status.podIP}}')")
        return f"{find} && [ -n \"$ip\" ] && PORT_FORWARD_{local}=$ip:{remote}"
    line = re.sub(r"localhost:(\d+)", r"$PORT_FORWARD_\1", line)
    if watch := WATCH.fullmatch(line):
        namespace, kind, name = watch.group(1) or "", watch.group(2), watch.group(3)
        return f"kubectl {namespace}wait --for=condition=Ready {kind}/{name} --timeout=180s"
    if line.startswith("kubectl ") and not re.search(r" (-n|--namespace|-A|--all-namespaces)\b", line):
        line = f"kubectl -n {place.namespace} {line[len('kubectl '):]}"  # a user's current namespace
    line = re.sub(r"(kubectl delete \S+ --all) -A\b", rf"\1 -n {place.namespace}", line)
    line = re.sub(r"^(kubectl (?:-n \S+ )?delete crd \S+)", r"\1 --dry-run=server", line)
    producer, bar, last = line.rpartition("| ")
    if bar and last.startswith("grep ") and " logs " in producer:  # a log may have no error lines
        return f"{producer}| {{ {last} || [ $? = 1 ]; }}"
    if bar and (metrics := re.fullmatch(r"grep -E '([\w|]+)'", last.strip())):  # every name the page greps for
        checks = " && ".join(f"grep -q -E '{name}' <<< \"$out\"" for name in metrics.group(1).split("|"))
        return f"out=$({producer.strip()}) && {checks}"
    if bar and last.startswith("head"):
        return f"{producer}| {{ {last}; cat > /dev/null; }}"
    return line


def shell_env(cluster=None) -> dict[str, str]:
    """The environment of a user of the local cluster (docs/cluster.md): its KUBECONFIG, kubectl and
    helm on PATH, and the checkout's `adpfleet`."""
    env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}
    if cluster is not None:
        env.update(KUBECONFIG=str(cluster.kubeconfig), PATH=f"{Path(cluster.kubectl_path).parent}:{env['PATH']}")
    return env


def run(commands: list[str], place: Place, cluster=None, *, timeout: float = 240, cwd: Path = ROOT) -> str:
    """Run the commands, as `as_run_here` makes them, in order in one shell, from the repository
    root unless told (a command may use what an earlier one set); fail naming the first that fails.
    Returns what they printed."""
    assert commands, "no commands to run"
    script = "set -o pipefail\n" + "\n".join(
        f"{as_run_here(c, place)} || {{ echo 'failed: {i}' >&2; exit 1; }}" for i, c in enumerate(commands))
    proc = subprocess.run(["bash", "-c", script], env=shell_env(cluster), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    failed = re.search(r"failed: (\d+)", proc.stderr)
    assert proc.returncode == 0, (f"{commands[int(failed.group(1))] if failed else '?'}\n--- as run:\n{script}\n"
                                  f"--- stderr:\n{proc.stderr[-3000:]}\n--- stdout:\n{proc.stdout[-2000:]}")
    return proc.stdout


def run_console(block: Block, place: Place, cluster) -> list[str]:
    """Run each `$ ` command of a console block. Where the page shows a table, the command prints
    the same columns (the header line's words); where it shows an error, the command fails with
    every line the page shows. Returns what each printed."""
    printed = []
    for command, shown in zip(block.commands, block.outputs):
        if shown.startswith("Error:"):
            proc = subprocess.run(["bash", "-c", as_run_here(command, place)], env=shell_env(cluster), cwd=ROOT,
                                  capture_output=True, text=True, timeout=120)
            assert proc.returncode != 0, f"{block}: {command} succeeded:\n{proc.stdout}"
            missing = [line for line in shown.splitlines() if line.strip() not in proc.stderr]
            assert not missing, f"{block}: {command} did not print {missing}:\n{proc.stderr}"
            printed.append(proc.stderr)
            continue
        out = run([command], place, cluster)
        header = shown.splitlines()[0] if shown.strip() else ""
        if header.startswith("NAME "):
            assert out.splitlines()[0].split() == header.split(), f"{block}: {command}\n{out}"
        printed.append(out)
    return printed
