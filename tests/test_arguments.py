"""Hostile arguments to every public method (issue 14, item 5).

Each bad argument is a ``ValueError`` (or, for a pool that cannot be
allocated, a ``MemoryError`` naming the sizes) raised to the caller, before
anything is queued: the runtime's state and its ``contract_violations`` do not
change, and a refused ``start`` leaves no thread behind. Misuse that only the
actors can see in a non-blocking call is counted as a contract violation.
"""

from __future__ import annotations

import inspect
import math
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import kvactors.manager as manager_module
from kvactors import LookupResult, MemoryTier, ReqContext, TieringManager, TransferEngine
from tests.support import settled

CTX = ReqContext("r")
READY, PENDING = b"key-ready", b"key-pending"
BAD_TIMEOUTS = [-1, -0.5, math.nan, math.inf, -math.inf, "1", True, 1e300, [1]]


@pytest.fixture(scope="module")
def manager() -> Iterator[TieringManager]:
    """One running manager: CTX active, READY ready, PENDING prepared and not completed."""
    with TieringManager.start(num_blocks=4, block_bytes=8, secondary_tiers=[MemoryTier(capacity_blocks=4)]) as mgr:
        mgr.on_new_request(CTX)
        mgr.prepare_store([READY], CTX)
        mgr.complete_store([READY], CTX)
        assert mgr.prepare_store([PENDING], CTX) is not None
        yield mgr


def _state(mgr: TieringManager) -> tuple[Any, ...]:
    stats = settled(mgr)
    return (mgr.lookup([READY, PENDING], CTX), stats["contract_violations"], stats["blocks_ready"],
            stats["blocks_pending"], stats["blocks_pinned"], stats["active_requests"], mgr.stopped)


Call = Callable[[TieringManager], object]

HOSTILE: list[tuple[str, str, Call]] = [
    ("on_new_request", "a str ctx", lambda m: m.on_new_request("r")),  # type: ignore[arg-type]
    ("on_new_request", "a tuple ctx", lambda m: m.on_new_request(("r", 0))),  # type: ignore[arg-type]
    ("on_new_request", "None", lambda m: m.on_new_request(None)),  # type: ignore[arg-type]
    *[(method, label, call) for method in ("lookup", "prepare_load", "complete_load", "touch", "prepare_store",
                                           "complete_store")
      for label, call in (
          ("one key, not a list", lambda m, f=method: getattr(m, f)(READY, CTX)),
          ("the empty key", lambda m, f=method: getattr(m, f)([READY, b""], CTX)),
          ("a str key", lambda m, f=method: getattr(m, f)(["key-ready"], CTX)),
          ("a bytearray key", lambda m, f=method: getattr(m, f)([bytearray(READY)], CTX)),
          ("keys not iterable", lambda m, f=method: getattr(m, f)(5, CTX)),
          ("keys None", lambda m, f=method: getattr(m, f)(None, CTX)),
          ("arguments swapped", lambda m, f=method: getattr(m, f)(CTX, [READY])),
          ("a str ctx", lambda m, f=method: getattr(m, f)([READY], "r")),
      )],
    *[("complete_store", f"success={value!r}", lambda m, v=value: m.complete_store([PENDING], CTX, success=v))
      for value in ("False", "True", "", 0, 1, 0.0, None, [False], torch.tensor(False))],
    ("on_request_finished", "a str ctx", lambda m: m.on_request_finished("r")),  # type: ignore[arg-type]
    ("on_request_finished", "a tuple ctx", lambda m: m.on_request_finished(("r", 0))),  # type: ignore[arg-type]
    *[("wait_idle", f"timeout={value!r}", lambda m, v=value: m.wait_idle(timeout=v)) for value in BAD_TIMEOUTS],
    *[("stop", f"timeout={value!r}", lambda m, v=value: m.stop(timeout=v)) for value in BAD_TIMEOUTS],
]

# Nothing to check: Python refuses any argument.
NO_ARGUMENTS = {"reset_cache", "take_events", "stats", "metrics_snapshot"}
NOT_CALLS = {"pool", "stopped", "tier_names", "start", "door"}  # properties, an attribute; start: below


def test_every_public_method_has_hostile_cases():
    public = {name for name, _ in inspect.getmembers(TieringManager) if not name.startswith("_")}
    public |= {name for name in vars(TieringManager) if not name.startswith("_")}
    covered = {method for method, _, _ in HOSTILE} | NO_ARGUMENTS | NOT_CALLS
    assert public <= covered, f"public methods without hostile cases: {sorted(public - covered)}"


@pytest.mark.parametrize(("method", "label", "call"), HOSTILE, ids=[f"{m}-{label}" for m, label, _ in HOSTILE])
def test_a_hostile_argument_is_a_value_error_that_changes_nothing(manager, method, label, call):
    before = _state(manager)
    with pytest.raises(ValueError):
        call(manager)
    assert _state(manager) == before, f"{method} with {label} changed the runtime's state"


def test_success_must_be_a_bool_and_a_string_false_is_not_a_success(manager):
    """``bool("False")`` is True: the unwritten block was made ready, a failure taken for a success."""
    with pytest.raises(ValueError, match="success must be a bool"):
        manager.complete_store([PENDING], CTX, success="False")  # type: ignore[arg-type]
    assert manager.lookup([PENDING], CTX) == [LookupResult.HIT_PENDING]


def test_pool_sizes_are_ints_and_an_impossible_pool_is_a_memory_error_naming_them():
    threads = _kvactors_threads()
    with pytest.raises(MemoryError, match=r"num_blocks=1000000000000 x block_bytes=1048576"):
        TieringManager.start(num_blocks=10**12, block_bytes=1 << 20)
    assert _kvactors_threads() == threads, "a refused start left threads running"


def test_an_allocator_failure_is_a_memory_error_naming_the_sizes(monkeypatch):
    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(manager_module.torch, "zeros", refuse)
    threads = _kvactors_threads()
    with pytest.raises(MemoryError, match=r"num_blocks=4 x block_bytes=8") as info:
        TieringManager.start(num_blocks=4, block_bytes=8)
    assert "alloc_cpu" not in str(info.value)
    assert _kvactors_threads() == threads


def _kvactors_threads() -> set[str]:
    return {thread.name for thread in threading.enumerate() if thread.name.startswith("kvactors")}


START_HOSTILE: list[tuple[str, dict[str, Any]]] = [
    *[(f"num_blocks={v!r}", {"num_blocks": v}) for v in (0, -1, True, 1.5, "4", None)],
    *[(f"block_bytes={v!r}", {"block_bytes": v}) for v in (0, -8, True, 8.0, "8")],
    *[(f"eviction={v!r}", {"eviction": v}) for v in ("nope", "", ["lru"], None, 1)],
    *[(f"transfer_timeout_s={v!r}", {"transfer_timeout_s": v}) for v in (0, *BAD_TIMEOUTS, None)],
    *[(f"lookup_timeout_s={v!r}", {"lookup_timeout_s": v}) for v in (0, *BAD_TIMEOUTS, None)],
    *[(f"secondary_tiers={v!r}", {"secondary_tiers": v}) for v in (5, "memory", [object()], None)],
    *[(f"event_log={v!r}", {"event_log": v}) for v in (5, "", b"log")],
]


@pytest.mark.parametrize(("label", "kwargs"), START_HOSTILE, ids=[label for label, _ in START_HOSTILE])
def test_start_refuses_hostile_arguments_and_leaves_nothing_running(label, kwargs):
    threads = _kvactors_threads()
    with pytest.raises(ValueError):
        TieringManager.start(**{"num_blocks": 4, "block_bytes": 8, **kwargs})
    assert _kvactors_threads() == threads, f"start with {label} left threads running"


@pytest.mark.parametrize("kwargs", [
    {"req_id": 5}, {"req_id": ""}, {"req_id": None}, {"req_id": b"r"},
    {"req_id": "r", "attempt": -1}, {"req_id": "r", "attempt": True}, {"req_id": "r", "attempt": 1.0},
    {"req_id": "r", "attempt": "0"}, {"req_id": "r", "params": 5}, {"req_id": "r", "params": ["a"]},
], ids=repr)
def test_req_context_refuses_hostile_fields(kwargs):
    with pytest.raises(ValueError):
        ReqContext(**kwargs)


def _closing(engine: TransferEngine, use: Callable[[TransferEngine], object]) -> object:
    """``use(engine)``, then close the engine (its copy threads would outlive the test)."""
    try:
        return use(engine)
    finally:
        engine.close()


def _engine_hostile() -> list[tuple[str, Callable[[TieringManager, torch.Tensor], object]]]:
    def offload(*args: Any) -> Callable[[TieringManager, torch.Tensor], object]:
        return lambda m, cache: _closing(TransferEngine(m, cache), lambda e: e.offload(*args))

    def onboard(*args: Any) -> Callable[[TieringManager, torch.Tensor], object]:
        return lambda m, cache: _closing(TransferEngine(m, cache), lambda e: e.onboard(*args))

    cases: list[tuple[str, Callable[[TieringManager, torch.Tensor], object]]] = [
        ("manager not a TieringManager", lambda m, cache: TransferEngine("manager", cache)),  # type: ignore[arg-type]
        ("copy_workers=True", lambda m, cache: TransferEngine(m, cache, copy_workers=True)),
        ("copy_workers=0", lambda m, cache: TransferEngine(m, cache, copy_workers=0)),
        ("copy_workers=65", lambda m, cache: TransferEngine(m, cache, copy_workers=65)),
        *[(f"copy_timeout_s={v!r}", lambda m, cache, v=v: TransferEngine(m, cache, copy_timeout_s=v))
          for v in (0, *BAD_TIMEOUTS)],
        *[(f"copier={v!r}", lambda m, cache, v=v: TransferEngine(m, cache, copier=v))
          for v in ("", "NATIVE", "cuda", None, 0, b"native", ("native",))],
    ]
    for name, call in (("offload", offload), ("onboard", onboard)):
        cases += [
            (f"{name}: a str ctx, nothing to copy", call("r", [], [])),
            (f"{name}: a str ctx", call("r", [READY], [0])),
            (f"{name}: the empty key", call(CTX, [b""], [0])),
            (f"{name}: one key, not a list", call(CTX, READY, [0])),
            (f"{name}: a bool device row", call(CTX, [READY], [True])),
            (f"{name}: a float device row", call(CTX, [READY], [0.0])),
            (f"{name}: a negative device row", call(CTX, [READY], [-1])),
            (f"{name}: a device row out of range", call(CTX, [READY], [4])),
            (f"{name}: device rows not a sequence", call(CTX, [READY], 0)),
            (f"{name}: lengths differ", call(CTX, [READY], [0, 1])),
        ]
    return cases


ENGINE_HOSTILE = _engine_hostile()


@pytest.mark.parametrize(("label", "call"), ENGINE_HOSTILE, ids=[label for label, _ in ENGINE_HOSTILE])
def test_transfer_engine_refuses_hostile_arguments(manager, label, call):
    cache = torch.zeros((4, 8), dtype=torch.uint8)
    before = _state(manager)
    with pytest.raises(ValueError):
        call(manager, cache)
    assert _state(manager) == before, f"{label} changed the runtime's state"


# ---------------------------------------------------------------- decided meanings


def test_a_finish_of_an_unknown_request_is_a_no_op_not_a_violation():
    """After finalize nothing of a request is kept (contract rule 8), so a finish of an attempt
    never started looks exactly like a repeated finish, which is legal (idempotent)."""
    with TieringManager.start(num_blocks=2, block_bytes=8) as mgr:
        mgr.on_request_finished(ReqContext("never-started"))
        ctx = ReqContext("done")
        mgr.on_new_request(ctx)
        mgr.on_request_finished(ctx)
        assert mgr.wait_idle(10)
        mgr.on_request_finished(ctx)  # after its finalize
        stats = settled(mgr)
        assert stats["contract_violations"] == 0 and stats["active_requests"] == 0
        mgr.on_new_request(ctx)  # the identity may start a new lifetime
        mgr.on_request_finished(ctx)


def test_non_blocking_misuse_is_counted_and_changes_nothing():
    with TieringManager.start(num_blocks=2, block_bytes=8) as mgr:
        mgr.on_new_request(CTX)
        mgr.complete_store([READY], CTX)  # never prepared
        mgr.complete_load([READY], CTX)  # never pinned
        mgr.complete_load([READY], ReqContext("unknown"))
        stats = settled(mgr)
        assert stats["contract_violations"] == 3
        assert stats["blocks_ready"] == stats["blocks_pending"] == stats["blocks_pinned"] == 0
        mgr.on_request_finished(CTX)


# ---------------------------------------------------------------- a bool is not a number

NUMBER_TYPES = {"int", "float", "int | None", "float | None"}


def _number_parameters(function: Callable[..., object]) -> list[str]:
    """The parameters of ``function`` annotated as an int or float (optional or not)."""
    return [name for name, p in inspect.signature(function).parameters.items()
            if str(p.annotation).replace("<class '", "").replace("'>", "") in NUMBER_TYPES]


def _bool_cases() -> list[tuple[str, Callable[[bool], object]]]:
    """Every int- or float-valued argument of the public API (found by its annotation), given a bool."""
    import tempfile

    from kvactors import AsyncTieringManager, DiskTier, RedisTier
    from kvactors.integrations.vllm.config import parse_config
    from kvactors.integrations.vllm.shm import SharedPool

    cases: list[tuple[str, Callable[[bool], object]]] = []
    for name in _number_parameters(TieringManager.start):
        base = {"num_blocks": 4, "block_bytes": 8}
        cases.append((f"TieringManager.start({name})", lambda b, n=name, kw=base: TieringManager.start(**{**kw, n: b})))
    assert {"num_blocks", "block_bytes", "transfer_timeout_s", "lookup_timeout_s"} <= {c[0][21:-1] for c in cases}
    for name in _number_parameters(TieringManager.wait_idle):
        cases.append((f"TieringManager.wait_idle({name})", lambda b, n=name: _MANAGER[0].wait_idle(**{n: b})))
    for name in _number_parameters(TieringManager.stop):
        cases.append((f"TieringManager.stop({name})", lambda b, n=name: _MANAGER[0].stop(**{n: b})))
    for name in _number_parameters(TransferEngine.__init__):
        cases.append((f"TransferEngine({name})", lambda b, n=name: TransferEngine(
            _MANAGER[0], torch.zeros((4, 8), dtype=torch.uint8), **{n: b})))
    cases.append(("TransferEngine.offload(device_block_ids)", lambda b: _closing(TransferEngine(
        _MANAGER[0], torch.zeros((4, 8), dtype=torch.uint8)), lambda e: e.offload(CTX, [READY], [b]))))
    cases.append(("ReqContext(attempt)", lambda b: ReqContext("r", b)))
    # The other way round: a flag given an int.
    cases.append(("AsyncTieringManager(claims=int)", lambda b: AsyncTieringManager(_MANAGER[0], claims=int(b))))
    for name in _number_parameters(AsyncTieringManager.wait_idle):
        cases.append((f"AsyncTieringManager.wait_idle({name})",
                      lambda b, n=name: _run(AsyncTieringManager(_MANAGER[0]).wait_idle(**{n: b}))))

    class Tier(MemoryTier):
        def __init__(self, limit: object) -> None:
            super().__init__(name="limited", capacity_blocks=4)
            self.max_inflight_jobs = limit  # type: ignore[misc, assignment]

    cases.append(("SecondaryTier.max_inflight_jobs", lambda b: TieringManager.start(
        num_blocks=4, block_bytes=8, secondary_tiers=[Tier(b)])))
    root = tempfile.mkdtemp(prefix="kvactors-bools-")
    tier_bases: list[tuple[type, dict[str, Any]]] = [
        (MemoryTier, {"capacity_blocks": 4}), (DiskTier, {"root": root, "capacity_bytes": 1 << 20}),
        (RedisTier, {"url": "redis://127.0.0.1:1"})]
    for cls, base in tier_bases:
        for name in _number_parameters(cls.__init__):
            cases.append((f"{cls.__name__}({name})", lambda b, c=cls, n=name, kw=base: c(**{**kw, n: b}).shutdown()))
    for key in ("cpu_bytes_to_use", "transfer_timeout_s", "lookup_timeout_s"):
        cases.append((f"vllm config {key}", lambda b, k=key: parse_config({"cpu_bytes_to_use": 1 << 20, k: b})))
    for kind, entry, keys in (("disk", {"root": root, "capacity_bytes": 1 << 20}, ("capacity_bytes", "io_workers")),
                              ("memory", {"capacity_blocks": 4}, ("capacity_blocks",)),
                              ("redis", {"url": "redis://127.0.0.1:1"}, ("capacity_bytes", "io_workers"))):
        for key in keys:
            cases.append((f"vllm config tiers[0].{key} ({kind})", lambda b, k=key, e=entry, t=kind: parse_config(
                {"cpu_bytes_to_use": 1 << 20, "tiers": [{"type": t, **e, k: b}]})))
    for name in _number_parameters(SharedPool.__init__):
        cases.append((f"SharedPool({name})", lambda b, n=name: SharedPool(
            os.path.join(root, f"pool-{n}-{b}"), **{"num_blocks": 4, "block_bytes": 8, n: b})))
    try:
        from kvactors.metrics import serve_metrics
    except ImportError:
        pass
    else:
        cases.append(("serve_metrics(port)", lambda b: serve_metrics(_MANAGER[0], b)[0].server_close()))
    return cases


def _run(coroutine: Any) -> Any:
    import asyncio

    return asyncio.run(coroutine)


_MANAGER: list[TieringManager] = []  # the module's manager, for the cases above (built at collection)
# The tiers' own constructors (kvactors/tiers/, not this change's files) still take a bool for these.
BOOL_CASES = [pytest.param(label, call, id=label) for label, call in _bool_cases()]


@pytest.mark.parametrize(("label", "call"), BOOL_CASES)
@pytest.mark.parametrize("value", [True, False])
def test_a_bool_given_for_a_number_is_refused(manager, label, call, value):
    """``True`` is an ``int`` to Python; to every int- or float-valued argument it is a mistake."""
    _MANAGER[:] = [manager]
    before = _state(manager)
    with pytest.raises((ValueError, TypeError)):
        call(value)
    assert _state(manager) == before, f"{label}={value} changed the runtime's state"


# ---------------------------------------------------------------- one check, the same errors

SAME_ERROR_CASES = [("a str ctx", [READY], "r"), ("the empty key", [b""], CTX), ("a str key", ["k"], CTX),
                    ("one key, not a list", READY, CTX), ("bad keys and a bad ctx", [b""], "r"),
                    ("keys not iterable", 3, "r")]


@pytest.mark.parametrize(("label", "keys", "ctx"), SAME_ERROR_CASES, ids=[c[0] for c in SAME_ERROR_CASES])
def test_the_manager_and_the_engine_refuse_bad_keys_with_the_same_error(manager, label, keys, ctx):
    """The manager and the engine check ``(keys, ctx)`` with one function, in one order."""
    cache = torch.zeros((4, 8), dtype=torch.uint8)
    rows = [0]
    with pytest.raises(ValueError) as by_manager:
        manager.prepare_store(keys, ctx)
    for call in (TransferEngine(manager, cache).offload, TransferEngine(manager, cache).onboard):
        with pytest.raises(ValueError) as by_engine:
            call(ctx, keys, rows)
        assert str(by_engine.value) == str(by_manager.value), f"{label}: {call.__name__}"


# ---------------------------------------------------------------- flags are bools, configs are mappings

FLAG_VALUES = ["no", "false", 0, 1, None, 1.0]


def _flag_cases(root: str) -> list[tuple[str, Callable[[object], object]]]:
    from kvactors import DiskTier, RedisTier
    from kvactors.integrations.vllm.config import parse_config

    return [
        ("DiskTier(fsync)", lambda v: DiskTier(root, capacity_bytes=1 << 20, fsync=v).shutdown()),  # type: ignore[arg-type]
        ("DiskTier(direct_io)", lambda v: DiskTier(root, capacity_bytes=1 << 20, direct_io=v).shutdown()),  # type: ignore[arg-type]
        ("RedisTier(cluster)", lambda v: RedisTier("redis://127.0.0.1:1", cluster=v).shutdown()),  # type: ignore[arg-type]
        ("vllm config tiers[0].fsync", lambda v: parse_config(
            {"cpu_bytes_to_use": 1 << 20, "tiers": [{"type": "disk", "root": root, "capacity_bytes": 1 << 20,
                                                     "fsync": v}]})),
        ("vllm config tiers[0].direct_io", lambda v: parse_config(
            {"cpu_bytes_to_use": 1 << 20, "tiers": [{"type": "disk", "root": root, "capacity_bytes": 1 << 20,
                                                     "direct_io": v}]})),
        ("vllm config tiers[0].cluster", lambda v: parse_config(
            {"cpu_bytes_to_use": 1 << 20, "tiers": [{"type": "redis", "url": "redis://127.0.0.1:1", "cluster": v}]})),
    ]


@pytest.mark.parametrize("value", FLAG_VALUES, ids=repr)
@pytest.mark.parametrize("case", range(6))
def test_a_flag_given_anything_but_a_bool_is_refused(tmp_path, case: int, value: object) -> None:
    """``fsync="no"`` is truthy: taken as a flag it would turn fsync on. A flag is a bool."""
    label, call = _flag_cases(str(tmp_path / "tier"))[case]
    with pytest.raises(ValueError, match=r"fsync|direct_io|cluster"):
        call(value)
    assert not (tmp_path / "tier").exists() or label.startswith("vllm"), "a refused tier made its directory"


@pytest.mark.parametrize("extra", [None, [], "cpu_bytes_to_use", 3], ids=repr)
def test_a_vllm_config_that_is_not_a_mapping_is_refused(extra: object) -> None:
    from kvactors.integrations.vllm.config import parse_config

    with pytest.raises(ValueError, match="must be a mapping"):
        parse_config(extra)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", [["disk"], {"disk": 1}, None, 3, b"disk"], ids=repr)
def test_a_vllm_tier_type_that_is_not_a_known_name_is_refused(kind: object) -> None:
    from kvactors.integrations.vllm.config import parse_config

    with pytest.raises(ValueError, match=r"tiers\[0\]\.type"):
        parse_config({"cpu_bytes_to_use": 1 << 20, "tiers": [{"type": kind}]})


@pytest.mark.parametrize("where", ["a file", "below a file"])
def test_a_disk_root_that_cannot_be_a_directory_is_a_value_error(tmp_path, where: str) -> None:
    from kvactors import DiskTier
    from kvactors.integrations.vllm.config import build_tiers, parse_config

    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"")
    root = blocker if where == "a file" else blocker / "tier"
    with pytest.raises(ValueError, match="not a directory"):
        DiskTier(root, capacity_bytes=1 << 20)
    config = parse_config({"cpu_bytes_to_use": 1 << 20,
                           "tiers": [{"type": "disk", "root": str(root), "capacity_bytes": 1 << 20}]})
    with pytest.raises(ValueError, match=r"tiers\[0\] \(disk\)"):
        build_tiers(config, identity=None)


@pytest.mark.parametrize("where", ["missing folder", "a directory", "NUL", "not a path"])
def test_a_vllm_event_log_that_cannot_be_written_names_the_key(tmp_path, where: str) -> None:
    """Found in review: the runtime's own OSError came out of the engine's start, naming no key."""
    from kvactors.integrations.vllm.config import parse_config

    value = {"missing folder": str(tmp_path / "no" / "events.jsonl"), "a directory": str(tmp_path),
             "NUL": "ev\0.jsonl", "not a path": 5}[where]
    with pytest.raises(ValueError, match="kvactors: event_log"):
        parse_config({"cpu_bytes_to_use": 1 << 20, "event_log": value})
    assert parse_config({"cpu_bytes_to_use": 1 << 20, "event_log": str(tmp_path / "ok.jsonl")}).event_log


@pytest.mark.parametrize("failure", ["syntax", "import raises", "constructor raises"])
def test_a_custom_vllm_tier_that_fails_to_load_names_its_entry(tmp_path, monkeypatch, failure: str) -> None:
    from kvactors.integrations.vllm.config import build_tiers, parse_config

    source = {"syntax": "def broken(:\n",
              "import raises": "raise RuntimeError('planted at import')\n",
              "constructor raises": ("from kvactors import MemoryTier\n"
                                     "class Tier(MemoryTier):\n"
                                     "    def __init__(self):\n"
                                     "        raise RuntimeError('planted in __init__')\n")}[failure]
    (tmp_path / f"planted_{failure.replace(' ', '_')}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = parse_config({"cpu_bytes_to_use": 1 << 20, "tiers": [
        {"type": "memory", "capacity_blocks": 4},
        {"type": "custom", "class": f"planted_{failure.replace(' ', '_')}:Tier"}]})
    with pytest.raises(ValueError, match=r"kvactors: tiers\[1\]"):
        build_tiers(config, identity=None)


@pytest.mark.parametrize("spec", [":Good", "pkg:", " : ", "nocolon"])
def test_a_custom_vllm_tier_class_that_is_not_module_colon_class_is_refused(spec: str) -> None:
    from kvactors.integrations.vllm.config import parse_config

    with pytest.raises(ValueError, match=r"tiers\[0\]\.class must be 'module:Class'"):
        parse_config({"cpu_bytes_to_use": 1 << 20, "tiers": [{"type": "custom", "class": spec}]})


def test_a_vllm_pool_larger_than_the_machine_names_the_key_and_leaves_no_file(tmp_path, monkeypatch) -> None:
    """Found in review: cpu_bytes_to_use=1 << 50 gave a bare OSError and left a 1 PB file in /dev/shm."""
    from kvactors.integrations.vllm.shm import SharedPool, check_pool_fits

    with pytest.raises(ValueError, match=r"kvactors: cpu_bytes_to_use=1125899906842624: .*machine's"):
        check_pool_fits(1 << 50, 1 << 50, str(tmp_path))
    check_pool_fits(1 << 20, 1 << 20, str(tmp_path))  # fits
    real_statvfs = os.statvfs

    class Small:  # the shared-memory folder with 1 MiB free (a container's default /dev/shm is 64 MiB)
        f_bavail, f_frsize = 256, 4096

    monkeypatch.setattr(os, "statvfs", lambda folder: Small())
    with pytest.raises(ValueError, match=r"kvactors: cpu_bytes_to_use=2097152: .* 1048576 free"):
        check_pool_fits(2 << 20, 2 << 20, str(tmp_path))
    monkeypatch.setattr(os, "statvfs", real_statvfs)
    path = tmp_path / "pool"
    with pytest.raises(OSError):  # too large to size or map, past any check
        SharedPool(str(path), num_blocks=1 << 30, block_bytes=1 << 20)
    assert not path.exists()  # the file it created is gone
