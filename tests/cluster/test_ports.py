"""Ports for the cluster's components (and the tests' servers) are picked outside the kernel's
ephemeral range, where no outgoing connection and no bind to port 0 can take one between the pick
and the bind, and each pick is reserved from every other picker on the machine."""

import os
import socket
import subprocess
import sys

import pytest

from adpfleet.cluster import processes


@pytest.fixture
def fifty_ports(tmp_path, monkeypatch):
    """A machine whose only pickable ports are 14000-14049 (below what the suite's other servers are
    given, so none of them holds one), with its own reservations."""
    assert processes.PICKED_PORTS_FROM >= 14050  # the other pickers of the suite stay out of them
    monkeypatch.setattr(processes, "PORT_RESERVATIONS", tmp_path / "reservations")
    monkeypatch.setattr(processes, "PICKED_PORTS_FROM", 14000)
    monkeypatch.setattr(processes, "ephemeral_ports", lambda: range(14050, 65536))
    return range(14000, 14050)


def test_picks_come_from_outside_the_ephemeral_range():
    ephemeral = processes.ephemeral_ports()
    picks = [processes.free_port() for _ in range(20)]
    assert not [p for p in picks if p in ephemeral], (picks, ephemeral)


def test_a_picked_port_is_reserved_from_every_other_picker(fifty_ports):
    with socket.socket() as s:  # what a server that took one of them, before this picker, holds
        s.bind(("127.0.0.1", fifty_ports[7]))
        s.listen()
        picks = [processes.free_port() for _ in range(len(fifty_ports) - 1)]
    assert sorted(picks) == [p for p in fifty_ports if p != fifty_ports[7]]
    with pytest.raises(RuntimeError, match="no free port on 127.0.0.1"):
        processes.free_port()


def test_an_expired_reservation_is_picked_again(fifty_ports, monkeypatch):
    picks = {processes.free_port() for _ in fifty_ports}
    assert picks == set(fifty_ports)
    expired = processes.PORT_RESERVATIONS / str(fifty_ports[3])
    os.utime(expired, (0, 0))
    assert processes.free_port() == fifty_ports[3]
    assert sorted(os.listdir(processes.PORT_RESERVATIONS)) == sorted(str(p) for p in fifty_ports)


def test_the_owner_named_is_the_one_on_the_address_asked_about(tmp_path):
    """The same port on another loopback address (a pod's) is somebody else's: naming its listener
    sent a reader of `cluster up`'s refusal after the wrong process."""
    port = processes.free_port()
    elsewhere = subprocess.Popen(
        [sys.executable, "-c", "import socket, time\n"
         f"s = socket.socket(); s.bind(('127.0.0.3', {port})); s.listen(); print('up', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, cwd=tmp_path)
    try:
        assert elsewhere.stdout.readline() == b"up\n"
        with socket.create_server(("127.0.0.1", 0)) as peer, socket.socket() as client:
            peer_port = peer.getsockname()[1]
            client.bind(("127.0.0.1", port))
            client.connect(("127.0.0.1", peer_port))
            owner = processes.port_owner("127.0.0.1", port)
    finally:
        elsewhere.kill()
        elsewhere.wait()
    assert owner.startswith(f"pid {os.getpid()} (connected to 127.0.0.1:{peer_port}: "), owner
