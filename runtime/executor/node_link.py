"""A server whose ADP ranks span several pods: the leader's and the workers' link.

A server of N ranks over M pods (`--dp N --nodes M --node-rank j`) runs ranks j*N/M .. (j+1)*N/M - 1
in pod j. Pod 0, the leader, serves the OpenAI API and the server's KV endpoints and places every
request on a rank, as a one-pod server does; the other pods, the workers, only run their ranks.

Two connections join the pods, both to the leader's address (its stable DNS name on a cluster: the
server's headless Service):
- the link (this module), on the leader's `--group-port`: a worker joins it, learns where rank 0's
  rendezvous store listens, and from then on relays its ranks' pipe messages to the leader and the
  leader's messages to its ranks, so the leader's RankGroup treats a remote rank as a local one;
- the ranks' own `torch.distributed` group (gloo on CPU, NCCL on CUDA), rendezvoused at rank 0.

A group that loses a member is never mended: its collectives have lost a participant and its
requests a rank, so every pod of it exits non-zero (the leader at once when a worker's link drops,
a worker at once when the leader's does, and any rank within the collective timeout) and the
operator recreates the whole group.

The link authenticates both ends with the fleet's internal token (multiprocessing's HMAC
challenge) before any message is read: without a token it accepts anyone who reaches the port.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener

log = logging.getLogger(__name__)

LEADER_ADDRESS_ENV = "ADPFLEET_LEADER_ADDRESS"
DEFAULT_GROUP_PORT = 29400  # the leader's link port (torch's own rendezvous default is 29500)
DEFAULT_JOIN_TIMEOUT_S = 600.0  # how long the pods of a group wait for each other to start (model loads, imports)
JOIN_RETRY_S = 0.2
_NO_TOKEN = b"adpfleet-group-link"


@dataclass(frozen=True)
class NodeTopology:
    """Which share of a server's ranks this pod runs, and where its leader is."""
    nodes: int = 1
    node_rank: int = 0
    leader_host: str = "127.0.0.1"
    group_port: int = DEFAULT_GROUP_PORT
    token: str | None = None
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S

    def validate(self, dp: int) -> None:
        if self.nodes < 1:
            raise ValueError(f"--nodes must be a positive integer, got {self.nodes}")
        if dp % self.nodes:
            raise ValueError(f"--dp {dp} does not divide evenly over --nodes {self.nodes}: every pod runs "
                             "the same number of ranks")
        if not 0 <= self.node_rank < self.nodes:
            raise ValueError(f"--node-rank must be in 0..{self.nodes - 1}, got {self.node_rank}")

    @property
    def leader(self) -> bool:
        return self.node_rank == 0

    def ranks_of(self, node_rank: int, dp: int) -> range:
        per = dp // self.nodes
        return range(node_rank * per, (node_rank + 1) * per)

    @property
    def authkey(self) -> bytes:
        return self.token.encode() if self.token else _NO_TOKEN


class RemoteRank:
    """The leader's end of one rank in a worker pod: the same send/recv a local rank's pipe has."""

    def __init__(self, rank: int):
        self.rank = rank
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.link: Connection | None = None
        self.send_lock: threading.Lock | None = None
        self.exitcode: int | None = None

    def send(self, msg) -> None:
        if self.link is None:
            if msg[0] == "stop":  # the worker never joined: nothing of it to stop
                return
            raise BrokenPipeError(f"rank {self.rank}'s pod has not joined the group")
        with self.send_lock:
            self.link.send(("to", self.rank, msg))

    def recv(self):
        msg = self.inbox.get()
        if msg is None:
            raise EOFError(f"rank {self.rank}'s pod left the group")
        return msg

    # the parts of a Process the RankGroup uses
    def is_alive(self) -> bool:
        return self.link is not None and self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        pass

    def kill(self) -> None:
        pass


class LeaderLink:
    """Pod 0: accepts the workers, tells them where the rendezvous is, relays their ranks."""

    def __init__(self, topology: NodeTopology, host: str, dp: int, store_port: int,
                 remote: dict[int, RemoteRank], on_lost):
        self.topology, self.dp, self.store_port = topology, dp, store_port
        self.remote, self.on_lost = remote, on_lost
        self.joined: set[int] = set()
        self.all_joined = threading.Event()
        self.closing = False
        self.listener = Listener((host, topology.group_port), authkey=topology.authkey)
        threading.Thread(target=self._accept, name="group-link-accept", daemon=True).start()

    def _accept(self) -> None:
        while len(self.joined) < self.topology.nodes - 1 and not self.closing:
            try:
                conn = self.listener.accept()
            except Exception as e:  # noqa: BLE001 - a peer that fails authentication is refused, not fatal
                if self.closing:
                    return
                log.warning("refused a connection to the group link: %r", e)
                continue
            try:
                kind, node_rank = conn.recv()
                if kind != "join" or not 0 < node_rank < self.topology.nodes or node_rank in self.joined:
                    raise ValueError(f"unexpected join {kind!r} from node rank {node_rank!r}")
            except Exception as e:  # noqa: BLE001
                log.warning("refused a worker: %r", e)
                conn.close()
                continue
            conn.send(("rendezvous", self.store_port))
            self.joined.add(node_rank)
            lock = threading.Lock()
            ranks = self.topology.ranks_of(node_rank, self.dp)
            for r in ranks:
                self.remote[r].link, self.remote[r].send_lock = conn, lock
            log.info("worker pod %d joined with ranks %d..%d", node_rank, ranks[0], ranks[-1])
            threading.Thread(target=self._relay, args=(node_rank, conn), name=f"group-link-{node_rank}",
                             daemon=True).start()
        self.all_joined.set()
        self.listener.close()

    def wait_joined(self) -> None:
        """Until every worker joined: the ranks start only then, so that the rendezvous (bounded by
        the collective timeout) never waits for a pod that is still starting."""
        if not self.all_joined.wait(self.topology.join_timeout_s):
            missing = sorted(set(range(1, self.topology.nodes)) - self.joined)
            self.close()
            raise TimeoutError(f"worker pods {missing} did not join within {self.topology.join_timeout_s:g} s")

    def _relay(self, node_rank: int, conn: Connection) -> None:
        ranks = self.topology.ranks_of(node_rank, self.dp)
        try:
            while True:
                kind, rank, msg = conn.recv()
                if kind == "rank" and rank in ranks:
                    self.remote[rank].inbox.put(msg)
        except (EOFError, OSError):
            pass
        if not self.closing:  # first, so the server's reason names the pod rather than its ranks
            self.on_lost(f"worker pod {node_rank} left the group")
        for r in ranks:
            self.remote[r].exitcode = 1
            self.remote[r].inbox.put(None)

    def close(self) -> None:
        self.closing = True
        try:
            self.listener.close()
        except OSError:
            pass


class WorkerLink:
    """Pod j > 0: joins the leader, then relays between the leader and this pod's ranks."""

    def __init__(self, topology: NodeTopology):
        self.topology = topology
        timeout_s = topology.join_timeout_s
        self.send_lock = threading.Lock()
        deadline = time.monotonic() + timeout_s
        address = (topology.leader_host, topology.group_port)
        while True:
            try:
                self.conn = Client(address, authkey=topology.authkey)
                break
            except (ConnectionError, OSError) as e:  # the leader's pod is not up (or not resolvable) yet
                if time.monotonic() > deadline:
                    raise TimeoutError(f"could not join the leader at {address[0]}:{address[1]} within "
                                       f"{timeout_s:g} s: {e}") from None
                time.sleep(JOIN_RETRY_S)
        self.conn.send(("join", topology.node_rank))
        kind, self.store_port = self.conn.recv()
        log.info("joined the leader at %s:%d; rendezvous on port %d", *address, self.store_port)

    def send_up(self, rank: int, msg) -> None:
        with self.send_lock:
            self.conn.send(("rank", rank, msg))

    def serve(self, deliver, on_lost) -> None:
        """Relay the leader's messages to this pod's ranks (`deliver(rank, msg)`) until the link drops."""
        def relay():
            try:
                while True:
                    _, rank, msg = self.conn.recv()
                    deliver(rank, msg)
            except (EOFError, OSError):
                on_lost("the leader pod left the group")
        threading.Thread(target=relay, name="group-link", daemon=True).start()

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
