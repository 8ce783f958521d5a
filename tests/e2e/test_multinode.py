"""Tensor parallelism across hosts, for real, on one machine: two launches of `tp-runtime` with
`--nnodes 2`, one rank each (TP=2), meeting through torchrun's c10d rendezvous on loopback.

Loopback rather than network namespaces: making namespaces needs CAP_SYS_ADMIN, which CI runners
do not grant, and what the test must show holds the same over loopback: two torchrun agents that
know each other only through the rendezvous, frames over tcp with the operator's keys read by each
"host" from its own copy, the same tokens as one host, the poison proof, and the loss of a host
(kill -9 of its whole process tree, whose sockets the kernel then closes, as a crashed host's
peers see a reset). The address choice for real hosts (never loopback when a peer is remote) is
tested directly below. Also here: on one host nothing of the group listens beyond loopback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from scripts.harness.processes import free_port
from tests.e2e.serving import RecordedStream, Server, alive, descendants
from tests.e2e.test_poison import POISON, PROMPTS, greedy
from tp_runtime import hosts
from tp_runtime.config import ConfigError
from tp_runtime import frame_keys
from tp_runtime.frame_keys import create_key_dirs

GENERATE = ("--dtype", "fp32", "--num-kv-pages", "64", "--max-model-len", "256", "--max-tokens", "12", "--raw")


@pytest.fixture(scope="module")
def key_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The operator's key directories, one per "host", as `tp-runtime keys OUT --hosts` makes them."""
    dirs = create_key_dirs(str(tmp_path_factory.mktemp("keys") / "out"), ["host0", "host1"])
    return str(dirs["host0"]), str(dirs["host1"])


class Node:
    """One `tp-runtime` launch of a two-host group, in a session of its own, stopped by its pids."""

    def __init__(self, command: list[str], rank: int, port: int, key_dir: str | None, extra: tuple[str, ...] = ()):
        keys = ["--frame-key-dir", key_dir] if key_dir else ["--trust-rendezvous-store"]
        argv = [
            sys.executable, "-m", "tp_runtime", *command, "--tensor-parallel-size", "2", "--nnodes", "2",
            "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port), *keys, *extra,
        ]
        self.rank = rank
        self.argv = argv
        self.start()

    def start(self) -> None:
        """Starts the launch (again, after kill(): a lost host brought back)."""
        # The two "hosts" share this machine's cores: one thread per rank, as one host's launch sets.
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(
            self.argv, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self.pids = [*getattr(self, "pids", []), self.process.pid]

    def tree(self) -> list[int]:
        self.pids = list(dict.fromkeys([*self.pids, *descendants(self.process.pid)]))
        return self.pids

    def runs_frontend(self) -> bool:
        for pid in descendants(self.process.pid):
            try:
                if b"tp_runtime.frontend" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return True
            except OSError:
                continue
        return False

    def kill(self) -> None:
        """The loss of this host: every process of it at once."""
        for pid in alive(self.tree()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout_s: float) -> tuple[int, str, str]:
        out, err = self.process.communicate(timeout=timeout_s)
        return self.process.returncode, out, err

    def stop(self) -> None:
        self.kill()
        try:
            self.process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            pass



def wait_healthy(nodes: list[Node], url: str, timeout_s: float = 180) -> None:
    """Until the two-host server answers /health 200; then each node's process tree is recorded."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert all(node.process.poll() is None for node in nodes), "a host exited during start-up"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the two-host server did not become healthy"
        time.sleep(0.3)
    for node in nodes:
        node.tree()

def two_nodes(
    command: list[str], key_dirs: tuple[str, str] | None, extra: tuple[str, ...] = (), extra1: tuple[str, ...] = ()
) -> list[Node]:
    """Two "hosts" with the operator's key directories, or (key_dirs None) with keys through the store."""
    port = free_port()
    dirs = key_dirs or (None, None)
    return [Node(command, 0, port, dirs[0], extra), Node(command, 1, port, dirs[1], (*extra, *extra1))]


def wait_all(nodes: list[Node], timeout_s: float) -> list[tuple[int, str, str]]:
    deadline = time.monotonic() + timeout_s
    return [node.wait(max(1.0, deadline - time.monotonic())) for node in nodes]


def assert_nothing_left(nodes: list[Node], timeout_s: float = 20) -> None:
    pids = [pid for node in nodes for pid in node.pids]
    deadline = time.monotonic() + timeout_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pids), f"processes left behind: {alive(pids)}"


def test_two_hosts_generate_what_one_host_generates(tiny_model: Path, key_dirs: tuple[str, str], server_tp2: Server) -> None:
    body = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}
    one_host = httpx.post(f"{server_tp2.url}/v1/completions", json=body, timeout=120)
    assert one_host.status_code == 200, one_host.text
    nodes = two_nodes(["generate", "The quick brown fox", "--model", str(tiny_model), *GENERATE], key_dirs)
    try:
        results = wait_all(nodes, 180)
        assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
        texts = [out for _, out, _ in results if out.strip()]
        # Printed once, by the host that ran the frontend.
        assert texts == [one_host.json()["choices"][0]["text"] + "\n"], (texts, one_host.text)
        assert_nothing_left(nodes)
    finally:
        for node in nodes:
            node.stop()


def test_two_hosts_detect_skipped_clears_with_keys_through_the_store(tiny_model: Path) -> None:
    nodes = two_nodes(
        ["generate", "The quick brown fox", "--model", str(tiny_model), *GENERATE, *POISON, "--debug-skip-clears"], None
    )
    try:
        results = wait_all(nodes, 180)
        assert all(code != 0 for code, _, _ in results), results
        assert not any(out.strip() for _, out, _ in results), "text was printed from a poisoned cache"
        assert any("finite" in err.lower() for _, _, err in results), [err[-2000:] for _, _, err in results]
        assert_nothing_left(nodes)
    finally:
        for node in nodes:
            node.stop()


def test_a_host_started_with_other_options_is_refused(tiny_model: Path, key_dirs: tuple[str, str]) -> None:
    nodes = two_nodes(["generate", "hi", "--model", str(tiny_model), *GENERATE], key_dirs, extra1=("--max-num-seqs", "16"))
    try:
        results = wait_all(nodes, 180)
        assert all(code != 0 for code, _, _ in results), results
        frontend_err = next(err for _, _, err in results if "tp-runtime: error:" in err)
        sentences = [line for line in frontend_err.splitlines() if line.startswith("tp-runtime: error:")]
        assert len(sentences) == 1, frontend_err  # one sentence; the lines around it are the ranks' logs
        assert "other options" in sentences[0] and "every host must be given the same model and options" in sentences[0]
        assert "Traceback" not in frontend_err
        assert_nothing_left(nodes)
    finally:
        for node in nodes:
            node.stop()


@pytest.fixture(scope="module")
def poisoned_two_hosts(tiny_model: Path, key_dirs: tuple[str, str]) -> Iterator[tuple[list[Node], str]]:
    """A poisoned two-host server with a pool small enough that pages are freed and reused."""
    http_port = free_port()
    options = (
        "--dtype", "fp32", "--num-kv-pages", "8", "--max-model-len", "64", "--max-num-seqs", "4", *POISON,
        "--port", str(http_port),
    )
    nodes = two_nodes(["serve", "--model", str(tiny_model), "--log-level", "warning"], key_dirs, options)
    url = f"http://127.0.0.1:{http_port}"
    try:
        wait_healthy(nodes, url)
        yield nodes, url
    finally:
        for node in nodes:
            node.stop()


def test_two_hosts_with_poison_and_clears_match_one_unpoisoned_host(
    server_tp2: Server, poisoned_two_hosts: tuple[list[Node], str]
) -> None:
    _, url = poisoned_two_hosts
    remote = type("Remote", (), {"url": url})()
    for _round in range(2):  # 8 pages: the second round runs on pages that were freed and poisoned
        for prompt in PROMPTS[:3]:
            clean, dirty = greedy(server_tp2, prompt), greedy(remote, prompt)  # type: ignore[arg-type]
            assert clean.status_code == dirty.status_code == 200, dirty.text
            assert dirty.json()["choices"][0]["text"] == clean.json()["choices"][0]["text"], prompt
    assert "tp_runtime_kv_pages_cleared_total 0.0" not in httpx.get(f"{url}/metrics", timeout=10).text


def test_a_stranger_on_the_frame_port_is_ignored(poisoned_two_hosts: tuple[list[Node], str]) -> None:
    """Frames on tcp need the scheduler's CURVE handshake: a peer without an admitted key (here, none
    at all) gets no frame through and ends nothing."""
    import zmq

    nodes, url = poisoned_two_hosts
    frontend = next(node for node in nodes if node.runs_frontend())
    http_port = url.rsplit(":", 1)[1]
    frontend_pids = [pid for pid in descendants(frontend.process.pid) if b"tp_runtime.frontend" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    frame_ports = [a for a in listening_addresses(frontend_pids) if not a.endswith(f":{http_port}")]
    assert len(frame_ports) == 1, frame_ports
    context = zmq.Context()
    try:
        for curve_client in (False, True):
            stranger = context.socket(zmq.DEALER)
            stranger.setsockopt(zmq.LINGER, 0)
            if curve_client:  # a CURVE client with a key of its own: the scheduler does not admit it
                stranger.curve_publickey, stranger.curve_secretkey = zmq.curve_keypair()
                stranger.curve_serverkey = zmq.curve_keypair()[0]
            stranger.connect(f"tcp://{frame_ports[0]}")
            stranger.send_multipart([b"HELLO", b"\xff" * 64])
            time.sleep(0.5)
            stranger.close()
    finally:
        context.term()
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    assert greedy(type("Remote", (), {"url": url})(), "Hello").status_code == 200  # type: ignore[arg-type]


def test_losing_the_other_host_fails_requests_fast_and_it_rejoins(
    server_tp2: Server, poisoned_two_hosts: tuple[list[Node], str]
) -> None:
    """Under `tp-runtime serve` the frontend runs on node 0 and outlives the loss of node 1: the
    stream fails at once, /health turns 503, and once node 1 is started again its ranks rejoin
    through the rendezvous and the service answers as an unpoisoned host does (the poison proof
    after a recovery across hosts)."""
    nodes, url = poisoned_two_hosts
    frontend, other = nodes
    assert frontend.runs_frontend()
    stream = RecordedStream(url, "keep going", 50)  # 8 + 50 tokens: within the fixture's --max-model-len 64
    killed_at = time.monotonic()
    other.kill()
    health: list[int] = []
    while time.monotonic() - killed_at < 5 and 503 not in health:
        try:
            health.append(httpx.get(f"{url}/health", timeout=1).status_code)
        except httpx.HTTPError:
            health.append(-1)
        time.sleep(0.05)
    stream.join(max(0.1, 6 - (time.monotonic() - killed_at)))
    assert stream.ended_at is not None and stream.ended_at - killed_at < 5, "the stream did not end within 5 s of losing a host"
    data = [line for line in stream.lines if line.startswith("data: ")]
    assert any("error" in line.lower() for line in data[-2:]), data[-3:]  # the error event (then [DONE])
    assert 503 in health, health
    assert_nothing_left([other])
    other.start()
    wait_healthy(nodes, url)
    remote = type("Remote", (), {"url": url})()
    for prompt in PROMPTS[:3]:
        clean, dirty = greedy(server_tp2, prompt), greedy(remote, prompt)  # type: ignore[arg-type]
        assert clean.status_code == dirty.status_code == 200, dirty.text
        assert dirty.json()["choices"][0]["text"] == clean.json()["choices"][0]["text"], prompt


def test_a_sigterm_to_the_frontend_host_stops_every_host_cleanly(tiny_model: Path, key_dirs: tuple[str, str]) -> None:
    """Node 1 starts first, so that it may get global rank 0 while node 0 hosts the rendezvous and
    the frontend: the drain reaches every host, and the end-of-service mark stops node 1's agent
    rather than leaving it to wait in the rendezvous or torchrun's exit barrier."""
    port, http_port = free_port(), free_port()
    command = ["serve", "--model", str(tiny_model), "--dtype", "fp32", "--num-kv-pages", "64", "--max-model-len", "256",
               "--port", str(http_port)]
    nodes = [Node(command, 1, port, key_dirs[1])]
    time.sleep(1.0)
    nodes.append(Node(command, 0, port, key_dirs[0]))
    try:
        wait_healthy(nodes, f"http://127.0.0.1:{http_port}")
        frontend = next(node for node in nodes if node.runs_frontend())
        stopped_at = time.monotonic()
        os.kill(frontend.process.pid, signal.SIGTERM)
        results = wait_all(nodes, 60)
        assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
        assert time.monotonic() - stopped_at < 30, "a host waited for the others to stop"
        assert all("Traceback" not in err for _, _, err in results), [err[-2000:] for _, _, err in results]
        assert_nothing_left(nodes)
    finally:
        for node in nodes:
            node.stop()


def listening_addresses(pids: list[int]) -> set[str]:
    """host:port of every listening TCP socket the processes hold (from /proc, IPv4 and IPv6)."""
    listening: dict[str, str] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            if len(raw) == 4:
                host = ".".join(str(b) for b in raw[::-1])
            else:
                words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
                host = "[" + b"".join(words).hex() + "]"
            listening[fields[9]] = f"{host}:{int(port, 16)}"
    found = set()
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        for link in links:
            if link.startswith("socket:[") and link[8:-1] in listening:
                found.add(listening[link[8:-1]])
    return found


def test_one_host_listens_on_loopback_only(server_tp2: Server) -> None:
    addresses = listening_addresses([server_tp2.pid, *descendants(server_tp2.pid)])
    # The HTTP port, the rendezvous store, the process group's store, gloo's pairs.
    assert len(addresses) >= 4, addresses
    assert all(a.startswith("127.0.0.1:") for a in addresses), addresses


def test_the_scheduler_is_never_advertised_on_loopback_to_another_host(monkeypatch: pytest.MonkeyPatch) -> None:
    assert hosts.scheduler_address("", "127.0.0.1") == "127.0.0.1"  # every "host" is this machine
    assert hosts.scheduler_address("", "localhost") == "127.0.0.1"
    with pytest.raises(ConfigError, match="loopback"):
        hosts.scheduler_address("127.0.0.1", "10.1.2.3")  # the peers reached this host on 10.1.2.3
    real = hosts.resolve
    monkeypatch.setattr(hosts, "resolve", lambda host: "127.0.1.1" if host == "node0" else real(host))
    with pytest.raises(ConfigError, match="--advertise-host"):
        hosts.scheduler_address("", "node0")  # the /etc/hosts trap: the host's own name is loopback
    assert hosts.route_address("127.0.0.1", 9) == "127.0.0.1"
    assert hosts.interface_of("127.0.0.1") == "lo"


def test_across_hosts_the_scheduler_takes_the_interface_of_the_rendezvous() -> None:
    try:  # TEST-NET-1: nothing answers there; only the route this host would take matters
        ip = hosts.route_address("192.0.2.1", 29500)
    except ConfigError:
        pytest.skip("this machine has no route off loopback")
    assert not ip.startswith("127."), ip
    assert hosts.scheduler_address("", ip) == ip
    assert hosts.interface_of(ip) not in (None, "lo")


def test_a_frame_key_sealed_to_one_rank_opens_for_that_rank_only() -> None:
    server, rank1, other = frame_keys.new_pair(), frame_keys.new_pair(), frame_keys.new_pair()
    key = os.urandom(32)
    sealed = frame_keys.seal_frame_key(key, server, rank1.public, "run", 1)
    assert key not in sealed
    assert frame_keys.open_frame_key(sealed, rank1, server.public, "run", 1) == key
    for pair, run, rank in ((other, "run", 1), (rank1, "other-run", 1), (rank1, "run", 2)):
        with pytest.raises(ConfigError, match="cannot open the frame key"):
            frame_keys.open_frame_key(sealed, pair, server.public, run, rank)
