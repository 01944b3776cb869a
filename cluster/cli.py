"""`adpfleet cluster up|down|status`: the local control plane for development and tests."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from adpfleet.cluster.binaries import BinariesUnavailable
from adpfleet.cluster.controlplane import ClusterError, ControlPlane, default_state_dir


def main(args: argparse.Namespace) -> int:
    plane = ControlPlane(Path(args.state_dir) if args.state_dir else None,
                         apiserver_port=args.apiserver_port, agent_args=args.agent_arg or None)
    try:
        return {"up": _up, "down": _down, "status": _status}[args.action](plane)
    except (ClusterError, BinariesUnavailable) as exc:
        print(f"adpfleet cluster {args.action}: {exc}", file=sys.stderr)
        if args.action == "up" and plane.state_file.exists():
            print(f"What did start is still running: `{command('status', plane)}` shows it, "
                  f"`{command('down', plane)}` stops it.", file=sys.stderr)
        return 1


def command(action: str, plane: ControlPlane) -> str:
    """The exact command that acts on this cluster: `--state-dir` unless it is the default one."""
    if plane.dir == default_state_dir().resolve():
        return f"adpfleet cluster {action}"
    return f"adpfleet cluster {action} --state-dir {shlex.quote(str(plane.dir))}"


def _up(plane: ControlPlane) -> int:
    report = plane.up()
    for note in report.notes:
        print(f"note: {note}")
    if report.started:
        timing = f"; apiserver ready in {report.apiserver_ready_s:.1f} s" if report.apiserver_ready_s else ""
        print(f"started {', '.join(report.started)}{timing}")
    else:
        print("the local cluster was already up")
    print(f"""
  apiserver   {report.server}
  node        adpfleet-node (pods run as local processes; the image is ignored)
  state, logs {report.state_dir}  (logs/<component>.log; pod files in agent/pods/)

To use it:
  export KUBECONFIG={report.kubeconfig}
  export PATH={report.binaries.directory}:$PATH   # kubectl and helm of the pinned version
  kubectl get nodes
Check it with `{command('status', plane)}`; stop it with `{command('down', plane)}`.""")
    return 0


def _down(plane: ControlPlane) -> int:
    for line in plane.down():
        print(line)
    return 0


def _status(plane: ControlPlane) -> int:
    statuses = plane.status()
    print(f"local cluster in {plane.dir}  (KUBECONFIG={plane.kubeconfig})")
    for s in statuses:
        pid = str(s.pid) if s.pid else "-"
        print(f"  {s.name:<24} pid {pid:<8} {'ok' if s.healthy else 'NOT OK':<7} {s.detail}")
        if not s.healthy:
            print(f"  {'':<24} log: {s.log}")
    return 0 if all(s.healthy for s in statuses) else 1
