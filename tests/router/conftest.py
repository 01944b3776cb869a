import pytest

from router_harness import FakeServer, RouterProcess


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("router")


@pytest.fixture(scope="module")
def fakes(log_dir):
    """One context, two generation and one aggregated fake server, shared by a module; every test
    starts from their default behaviour (see the `fresh_fakes` fixture)."""
    servers = {"ctx": FakeServer("context", log_dir), "gen1": FakeServer("generation", log_dir),
               "gen2": FakeServer("generation", log_dir), "agg": FakeServer("aggregated", log_dir)}
    try:
        for s in servers.values():
            s.wait_healthy()
        yield servers
    finally:
        for s in servers.values():
            s.stop()


@pytest.fixture
def fresh_fakes(fakes):
    for s in fakes.values():
        if s.proc.poll() is None:
            s.reset()
    return fakes


@pytest.fixture
def start_router(log_dir):
    """start_router(*flags) -> a healthy RouterProcess, stopped after the test. A request that finds
    no usable server waits 1 s for one (flags given override it; the queue: test_router_queue*.py)."""
    started = []

    def start(*args, env=None, healthy=True):
        r = RouterProcess(log_dir, "--health-interval", "0.5", "--queue-timeout", "1", *args, env=env)
        started.append(r)
        return r.wait_healthy() if healthy else r
    yield start
    for r in started:
        r.stop()
