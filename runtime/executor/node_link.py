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

Wire format: frames of 4 bytes (big-endian length) and a UTF-8 JSON object, never a pickle. The
handshake proves the fleet's internal token both ways (a server over several pods refuses to start
without one), within HANDSHAKE_TIMEOUT_S of the connection, in frames of at most
MAX_HANDSHAKE_BYTES:

    leader -> peer     {"link": "adpfleet-group-link/2", "challenge": C1}
    worker -> leader   {"join": j, "challenge": C2, "proof": HMAC(token, "join|C1|j")}
    leader -> worker   {"rendezvous": PORT, "proof": HMAC(token, "rendezvous|C2|PORT")}
                       or {"refused": "why"} (and the leader closes)

(HMAC-SHA256, hex.) Then each frame is one message of `link_messages`, checked against its schema.
Every connection gets a thread of its own, so a stranger who connects and says nothing holds only
that thread, until the deadline; at most MAX_UNPROVEN wait at once (`unproven`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import queue
import secrets
import socket
import threading
import time
from dataclasses import dataclass

from adpfleet.contract import ports
from adpfleet.runtime.executor.link_messages import FROM_RANK, TO_RANK, LinkMessageError, decode, encode
from adpfleet.runtime.executor.unproven import UnprovenConnections

log = logging.getLogger(__name__)

DEFAULT_GROUP_PORT = ports.SERVER_GROUP_PORT  # the leader's link port
DEFAULT_JOIN_TIMEOUT_S = 600.0  # how long the pods of a group wait for each other to start (model loads, imports)
JOIN_RETRY_S = 0.2
LINK_VERSION = "adpfleet-group-link/2"
HANDSHAKE_TIMEOUT_S = 5.0  # a real worker proves itself in one round trip
MAX_UNPROVEN = 8  # connections in their handshake at once; one more closes the oldest
MAX_HANDSHAKE_BYTES = 1024
MAX_MESSAGE_BYTES = 64 << 20  # an authenticated peer's frame (a Request's prompt, a batch of outputs)


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
        if self.nodes > 1 and not self.token:
            raise ValueError(f"--nodes {self.nodes}: a server over several pods needs the fleet's internal token "
                             "(--internal-token-file PATH or $ADPFLEET_INTERNAL_TOKEN, the same in every pod): the "
                             "group link lets only its holders join the server")

    @property
    def leader(self) -> bool:
        return self.node_rank == 0

    def ranks_of(self, node_rank: int, dp: int) -> range:
        per = dp // self.nodes
        return range(node_rank * per, (node_rank + 1) * per)

    @property
    def key(self) -> bytes:
        return self.token.encode()



class LinkRefused(RuntimeError):
    """The other end of the link is not of this server: it proved no token, or refused ours."""


def _proof(key: bytes, *parts) -> str:
    return hmac.new(key, "|".join(map(str, parts)).encode(), hashlib.sha256).hexdigest()


def _proven(given, key: bytes, *parts) -> bool:
    return isinstance(given, str) and hmac.compare_digest(given.encode(), _proof(key, *parts).encode())


class LinkConnection:
    """One end of the link: frames of a 4-byte big-endian length and a UTF-8 JSON object."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, obj: dict) -> None:
        data = json.dumps(obj, separators=(",", ":")).encode()
        with self._send_lock:
            self.sock.sendall(len(data).to_bytes(4, "big") + data)

    def recv(self, limit: int = MAX_MESSAGE_BYTES, deadline: float | None = None) -> dict:
        """The next frame's object; EOFError when the peer closed, TimeoutError past `deadline`,
        LinkMessageError for a frame over `limit` bytes or one that is not a JSON object."""
        size = int.from_bytes(self._exactly(4, deadline), "big")
        if size > limit:
            raise LinkMessageError(f"a frame of {size} bytes, over the {limit} a peer may send here")
        try:
            obj = json.loads(self._exactly(size, deadline))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise LinkMessageError(f"a frame that is not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise LinkMessageError("a frame that is not a JSON object")
        return obj

    def _exactly(self, n: int, deadline: float | None) -> bytes:
        data = bytearray()
        while len(data) < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the handshake's deadline passed")
                self.sock.settimeout(left)
            chunk = self.sock.recv(min(n - len(data), 1 << 20))
            if not chunk:
                raise EOFError("the peer closed the link")
            data += chunk
        return bytes(data)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # the peer sees the end, and so does our own reader
        except OSError:
            pass
        self.sock.close()


class RemoteRank:
    """The leader's end of one rank in a worker pod: the same send/recv a local rank's pipe has."""

    def __init__(self, rank: int):
        self.rank = rank
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.link: LinkConnection | None = None
        self.exitcode: int | None = None

    def send(self, msg) -> None:
        if self.link is None:
            if msg[0] == "stop":  # the worker never joined: nothing of it to stop
                return
            raise BrokenPipeError(f"rank {self.rank}'s pod has not joined the group")
        self.link.send(encode(self.rank, msg))

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
    """Pod 0: lets in the workers that prove the token, tells them where the rendezvous is, relays
    their ranks. Each connection has a thread of its own: its handshake, then its relay."""

    def __init__(self, topology: NodeTopology, host: str, dp: int, store_port: int,
                 remote: dict[int, RemoteRank], on_lost):
        self.topology, self.dp, self.store_port = topology, dp, store_port
        self.remote, self.on_lost = remote, on_lost
        self.joined: set[int] = set()  # proved the token
        self.welcomed = 0  # ... and were told where the rendezvous is
        self.all_joined = threading.Event()
        self.closing = False
        self.unproven = UnprovenConnections(MAX_UNPROVEN)
        self._lock = threading.Lock()
        self.sock = socket.create_server((host, topology.group_port), backlog=64)
        threading.Thread(target=self._accept, name="group-link-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.sock.accept()
            except OSError:  # closed: every worker joined, or the server stops
                return
            self.unproven.admit(sock)
            threading.Thread(target=self._peer, args=(sock,), name="group-link-peer", daemon=True).start()

    def _peer(self, sock: socket.socket) -> None:
        link = LinkConnection(sock)
        try:
            node_rank, challenge = self._handshake(link)
        except (LinkRefused, LinkMessageError, EOFError, OSError) as e:
            log.warning("refused a connection to the group link: %s", e)
            self.unproven.settle(sock)
            link.close()
            return
        with self._lock:
            in_time = self.unproven.settle(sock)  # False: closed to make room meanwhile (the worker retries)
            again = node_rank in self.joined
            admitted = in_time and not again and not self.closing
            if admitted:
                self.joined.add(node_rank)
        if again:
            self._refuse(link, f"worker {node_rank} has joined already", raises=False)
        if not admitted:
            link.close()
            return
        self._welcome(node_rank, link, challenge)

    def _handshake(self, link: LinkConnection) -> tuple[int, str]:
        """The joining worker's node rank and challenge, once it proved the token."""
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        link.sock.settimeout(HANDSHAKE_TIMEOUT_S)
        challenge = secrets.token_hex(16)
        link.send({"link": LINK_VERSION, "challenge": challenge})
        join = link.recv(MAX_HANDSHAKE_BYTES, deadline)
        node_rank, theirs = join.get("join"), join.get("challenge")
        if not _proven(join.get("proof"), self.topology.key, "join", challenge, node_rank):
            self._refuse(link, "the proof does not match this server's internal token")
        if type(node_rank) is not int or not 0 < node_rank < self.topology.nodes:
            self._refuse(link, f"node rank {str(node_rank)[:20]!r} is not a worker of this server "
                               f"(1..{self.topology.nodes - 1})")
        if not isinstance(theirs, str) or not 16 <= len(theirs) <= 64:
            self._refuse(link, "the join's challenge must be a string of 16 to 64 characters")
        return node_rank, theirs

    @staticmethod
    def _refuse(link: LinkConnection, reason: str, raises: bool = True) -> None:
        try:
            link.send({"refused": reason})
        except OSError:
            pass
        if raises:
            raise LinkRefused(reason)

    def _welcome(self, node_rank: int, link: LinkConnection, challenge: str) -> None:
        """A worker proved the token: its ranks are reached through this link from now on."""
        ranks = self.topology.ranks_of(node_rank, self.dp)
        for r in ranks:
            self.remote[r].link = link
        try:  # before the ranks start (all_joined), so that the rendezvous is the first it hears
            link.send({"rendezvous": self.store_port,
                       "proof": _proof(self.topology.key, "rendezvous", challenge, self.store_port)})
            link.sock.settimeout(None)
        except OSError:
            pass  # it left at once: the relay finds it gone
        log.info("worker pod %d joined with ranks %d..%d", node_rank, ranks[0], ranks[-1])
        with self._lock:
            self.welcomed += 1
            if self.welcomed == self.topology.nodes - 1:
                self.all_joined.set()
                self._stop_listening()  # nobody else may join
        self._relay(node_rank, link)

    def wait_joined(self) -> None:
        """Until every worker joined: the ranks start only then, so that the rendezvous (bounded by
        the collective timeout) never waits for a pod that is still starting."""
        if not self.all_joined.wait(self.topology.join_timeout_s):
            missing = sorted(set(range(1, self.topology.nodes)) - self.joined)
            self.close()
            raise TimeoutError(f"worker pods {missing} did not join within {self.topology.join_timeout_s:g} s")

    def _relay(self, node_rank: int, link: LinkConnection) -> None:
        ranks = self.topology.ranks_of(node_rank, self.dp)
        reason = f"worker pod {node_rank} left the group"
        try:
            while True:
                rank, msg = decode(link.recv(), FROM_RANK)
                if rank not in ranks:
                    raise LinkMessageError(f"rank {rank} is not one of this pod's ({ranks[0]}..{ranks[-1]})")
                self.remote[rank].inbox.put(msg)
        except (EOFError, OSError):
            pass
        except LinkMessageError as e:
            reason = f"worker pod {node_rank} sent what the group link does not carry ({e})"
            link.close()
        if not self.closing:  # first, so the server's reason names the pod rather than its ranks
            self.on_lost(reason)
        for r in ranks:
            self.remote[r].exitcode = 1
            self.remote[r].inbox.put(None)

    def _stop_listening(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone may not)
        except OSError:
            pass
        self.sock.close()

    def close(self) -> None:
        self.closing = True
        self._stop_listening()


class WorkerLink:
    """Pod j > 0: joins the leader, then relays between the leader and this pod's ranks."""

    def __init__(self, topology: NodeTopology):
        self.topology = topology
        timeout_s = topology.join_timeout_s
        deadline = time.monotonic() + timeout_s
        address = (topology.leader_host, topology.group_port)
        while True:
            try:
                self.link, self.store_port = self._join(address)
                break
            except (EOFError, OSError) as e:  # the leader's pod is not up (or not resolvable) yet, or busy
                if time.monotonic() > deadline:
                    raise TimeoutError(f"could not join the leader at {address[0]}:{address[1]} within "
                                       f"{timeout_s:g} s: {e}") from None
                time.sleep(JOIN_RETRY_S)
        log.info("joined the leader at %s:%d; rendezvous on port %d", *address, self.store_port)

    def _join(self, address) -> tuple[LinkConnection, int]:
        """The handshake, worker's side: the link and the rendezvous port, once the leader proved
        the token too. LinkRefused when either side's proof fails (no retry can mend that)."""
        link = LinkConnection(socket.create_connection(address, timeout=HANDSHAKE_TIMEOUT_S))
        try:
            deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
            hello = link.recv(MAX_HANDSHAKE_BYTES, deadline)
            if hello.get("link") != LINK_VERSION or not isinstance(hello.get("challenge"), str):
                raise LinkRefused(f"{address[0]}:{address[1]} does not speak {LINK_VERSION}")
            node_rank, challenge = self.topology.node_rank, secrets.token_hex(16)
            link.send({"join": node_rank, "challenge": challenge,
                       "proof": _proof(self.topology.key, "join", hello["challenge"], node_rank)})
            answer = link.recv(MAX_HANDSHAKE_BYTES, deadline)
            if "refused" in answer:
                raise LinkRefused(f"the leader refused this pod: {str(answer['refused'])[:200]}")
            port = answer.get("rendezvous")
            if type(port) is not int or not _proven(answer.get("proof"), self.topology.key, "rendezvous",
                                                    challenge, port):
                raise LinkRefused("the leader's proof does not match this server's internal token")
            link.sock.settimeout(None)
            return link, port
        except BaseException:
            link.close()
            raise

    def send_up(self, rank: int, msg) -> None:
        self.link.send(encode(rank, msg))

    def serve(self, deliver, on_lost) -> None:
        """Relay the leader's messages to this pod's ranks (`deliver(rank, msg)`) until the link drops."""
        def relay():
            reason = "the leader pod left the group"
            try:
                while True:
                    deliver(*decode(self.link.recv(), TO_RANK))
            except (EOFError, OSError):
                pass
            except LinkMessageError as e:
                reason = f"the leader sent what the group link does not carry ({e})"
                self.link.close()
            on_lost(reason)
        threading.Thread(target=relay, name="group-link", daemon=True).start()

    def close(self) -> None:
        self.link.close()
