"""A fingerprint of a model's weights and config, for the identity of its blocks.

Blocks are keyed by what computed them (:mod:`~kvactors.integrations.vllm.identity`).
The same weights at another path must share blocks.
Other weights at the same path must never load them.
:func:`fingerprint_model` reads a model's folder in bounded time, whatever its size.

* ``config.json`` is read whole.
  So are the other small JSON files vLLM reads with the weights (``*.index.json``, ``params.json``).
* A safetensors file gives its header whole, its size, and samples.
  The header holds every tensor's name, dtype, shape and offsets, and the metadata.
  The samples are :data:`SAMPLES` samples of :data:`SAMPLE_BYTES` bytes, spread evenly over every tensor's bytes.
  The first and last bytes are included.
  A tensor of at most ``SAMPLES * SAMPLE_BYTES`` bytes is read whole.
  A fine-tune changes the tensors it touches densely.
  So a few ranges of each tensor catch it, where a few ranges per file would not.
* A torch zip checkpoint (``torch.save``'s format, ``.bin``/``.pt``/``.pth``) gives its zip directory,
  and the same samples of every record.
  The directory holds every record's name, size and CRC-32.
  The CRC-32 is a checksum of the record's whole content, written by ``torch.save``.
* Any other file that holds weights gives its whole SHA-256.
  Such files are a pickle ``.bin``, a ``.gguf``, and a safetensors file whose header cannot be read (see below).
  The hash is computed once and cached under ``$XDG_CACHE_HOME/kvactors/weights`` (``~/.cache/...``).
  The cache is keyed by the file's real path, size and modification time.
  An entry is reused while they are unchanged.

What it reads: ``SAMPLES * SAMPLE_BYTES`` (16 KiB) per tensor plus the headers, whatever the checkpoint's size.
That is about 5 MB for a 7B model of 300 tensors.
Other formats read every byte once, then nothing while their size and time hold.

What it cannot see is a change of a tensor's bytes that leaves its dtype, shape, and all of its sampled
ranges as they were.
That is a change confined to bytes between the samples of each tensor it touches.
Examples are an edit of a few elements, a sparse update, or a tensor rewritten in place
with the same first and last 4 KiB and the same two ranges between.
A safetensors header and samples forged to match are not seen either.
A fine-tune, a re-quantization or another revision rewrites its tensors throughout, and is seen.
For the rare cases, ``model_id`` names the weights explicitly.

Hostile or broken files never crash the engine.
A safetensors header may be cut short, not JSON, or larger than :data:`MAX_HEADER_BYTES`.
Its offsets may lie outside the file.
Such a file is fingerprinted by the whole file's hash instead, the same fallback as other formats.
A folder with no weights, or that cannot be read, is a :class:`FingerprintError`.
The caller turns that into the fallback it documents, the identity by name with a warning.

Plain code, with no vLLM import.
Threading: pure functions.
The cache is written atomically (a temporary file, then a rename), so concurrent engines may share it.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import os
import struct
import tempfile
import time
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

SAMPLES = 4
"""Samples per tensor (first and last bytes included, the others evenly between)."""
SAMPLE_BYTES = 4096
"""Bytes per sample."""
MAX_HEADER_BYTES = 100 * 1024 * 1024
"""The largest safetensors header read (safetensors' own limit): a larger length is a broken file."""
MAX_CONFIG_BYTES = 16 * 1024 * 1024
"""A JSON file larger than this is hashed as a weights file (with the cache), not read whole each start."""
FINGERPRINT_FORMAT = "kvactors-weights/1"
"""Bumped when what is hashed changes (every block's identity changes with it)."""

CONFIG_FILES = ("config.json", "params.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


class IdentityBy(enum.Enum):
    """What names the model in the identity of its blocks (``identity_by`` in the config)."""

    WEIGHTS = "weights"
    """A fingerprint of the weights and the model's config (the default): the same weights at
    another path share blocks, other weights at the same path never load them."""
    NAME = "name"
    """vLLM's model name (the path or hub name it was loaded from), as kvactors did before."""


class FingerprintError(ValueError):
    """The model's weights could not be fingerprinted (no folder, no weights, an unreadable file)."""


@dataclass(frozen=True)
class FileDigest:
    """One file's part of the fingerprint: its digest, how it was taken, and the bytes read for it."""

    name: str
    digest: str
    method: str  # "config", "safetensors", "torch-zip", "whole", "whole-cached"
    bytes_read: int
    note: str = ""


@dataclass(frozen=True)
class WeightsFingerprint:
    """The fingerprint of a model folder.

    ``digest`` is a hex SHA-256 over every file's part.
    """

    digest: str
    files: tuple[FileDigest, ...]
    seconds: float
    notes: tuple[str, ...] = field(default=())

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self.files)

    def describe(self) -> dict[str, Any]:
        """The digest, the files, how each was read, bytes and seconds, for the log."""
        methods: dict[str, int] = {}
        for f in self.files:
            methods[f.method] = methods.get(f.method, 0) + 1
        return {"weights": self.digest[:16], "files": len(self.files), "methods": methods,
                "bytes_read": self.bytes_read, "seconds": round(self.seconds, 3),
                **({"notes": list(self.notes)} if self.notes else {})}


class _Reader:
    """Reads ranges of one open file, counting the bytes."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.bytes_read = 0

    def read(self, offset: int, size: int) -> bytes:
        self.f.seek(offset)
        data = self.f.read(size)
        self.bytes_read += len(data)
        if len(data) != size:
            raise OSError(f"short read: {len(data)} of {size} bytes at {offset}")
        return data


def sample_offsets(start: int, end: int) -> list[tuple[int, int]]:
    """``(offset, size)`` of the samples of the bytes ``[start, end)``.

    When the range is at most ``SAMPLES * SAMPLE_BYTES``, it is sampled whole.
    Otherwise there are ``SAMPLES`` ranges of ``SAMPLE_BYTES``, evenly spread from the first byte to the last.
    """
    length = end - start
    if length <= SAMPLES * SAMPLE_BYTES:
        return [(start, length)] if length > 0 else []
    span = length - SAMPLE_BYTES
    return [(start + span * i // (SAMPLES - 1), SAMPLE_BYTES) for i in range(SAMPLES)]


class _BadHeader(Exception):
    """A safetensors header that cannot be trusted (the file is hashed whole instead)."""


def _safetensors_digest(path: str, size: int) -> tuple[str, int]:
    """The digest of a safetensors file: header, size and samples of every tensor.

    Raises ``_BadHeader`` if its header is cut short, too large, or not a JSON object of tensors.
    It also raises it if the header points outside the file.
    """
    h = hashlib.sha256(b"safetensors\0")
    with open(path, "rb") as f:
        r = _Reader(f)
        if size < 8:
            raise _BadHeader(f"{size} bytes: shorter than a header length")
        (n,) = struct.unpack("<Q", r.read(0, 8))
        if n > MAX_HEADER_BYTES:
            raise _BadHeader(f"header length {n} > {MAX_HEADER_BYTES}")
        if 8 + n > size:
            raise _BadHeader(f"header length {n} past the end of the file ({size} bytes)")
        raw = r.read(8, n)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _BadHeader(f"header is not JSON: {exc}") from None
        if not isinstance(header, dict):
            raise _BadHeader("header is not a JSON object")
        data_start, data_len = 8 + n, size - 8 - n
        ranges = []
        for name in sorted(header):
            if name == "__metadata__":
                continue
            entry = header[name]
            offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
            if not (isinstance(offsets, list) and len(offsets) == 2
                    and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1] <= data_len):
                raise _BadHeader(f"tensor {name[:80]!r}: data_offsets {str(offsets)[:80]} outside the data "
                                 f"({data_len} bytes)")
            ranges.append((data_start + offsets[0], data_start + offsets[1]))
        h.update(struct.pack("<QQ", size, n))
        h.update(raw)
        for start, end in ranges:
            for offset, length in sample_offsets(start, end):
                h.update(r.read(offset, length))
        return h.hexdigest(), r.bytes_read


def _torch_zip_digest(path: str) -> tuple[str, int]:
    """The digest of a torch zip checkpoint: its directory (names, sizes, CRC-32s) and samples of every record.

    Raises ``zipfile.BadZipFile`` (or ``OSError``) if it is not one.
    """
    h = hashlib.sha256(b"torch-zip\0")
    read = 0
    with zipfile.ZipFile(path) as z:
        infos = sorted(z.infolist(), key=lambda i: i.filename)
        for info in infos:
            h.update(json.dumps([info.filename, info.file_size, info.CRC, info.compress_type]).encode())
        for info in infos:
            if info.is_dir() or info.file_size == 0:
                continue
            with z.open(info) as member:
                for offset, length in sample_offsets(0, info.file_size):
                    member.seek(offset)
                    chunk = member.read(length)
                    read += len(chunk)
                    h.update(chunk)
    return h.hexdigest(), read + 22 + 46 * len(infos)  # the samples and (about) the directory


def cache_dir() -> str:
    """Where whole-file hashes are kept, ``$XDG_CACHE_HOME/kvactors/weights``.

    Without ``$XDG_CACHE_HOME``, ``~/.cache`` stands in for it.
    """
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvactors", "weights")


def _whole_file_digest(path: str, st: os.stat_result, cache: str | None) -> tuple[str, int, str]:
    """SHA-256 of the whole file, through the cache keyed by (real path, size, mtime).

    Returns ``(digest, bytes read, "whole" | "whole-cached")``.
    A cache that cannot be read or written is skipped, and the hash is still right.
    """
    real = os.path.realpath(path)
    key = {"path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    entry = None
    if cache is not None:
        entry = os.path.join(cache, hashlib.sha256(real.encode("utf-8", "surrogateescape")).hexdigest() + ".json")
        try:
            with open(entry, encoding="utf-8") as f:
                cached = json.load(f)
            if isinstance(cached, dict) and {k: cached.get(k) for k in key} == key \
                    and isinstance(cached.get("sha256"), str) and len(cached["sha256"]) == 64:
                return cached["sha256"], 0, "whole-cached"
        except (OSError, ValueError):
            pass
    h = hashlib.sha256()
    read = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
            read += len(chunk)
    digest = h.hexdigest()
    if cache is not None and entry is not None and os.stat(path).st_mtime_ns == st.st_mtime_ns:  # unchanged
        try:
            os.makedirs(cache, mode=0o700, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cache, prefix=".tmp-")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({**key, "sha256": digest}, f)
            os.replace(tmp, entry)
        except OSError:
            pass
    return digest, read, "whole"


def weight_files(folder: str) -> list[str]:
    """The files of ``folder`` (top level, sorted) that hold its weights and config, as vLLM picks them.

    * The safetensors files if any, else the ``.bin``/``.pt``/``.pth`` files.
    * The ``.gguf`` files.
    * The config and index JSON files.
    """
    names = sorted(os.listdir(folder))
    files = [n for n in names if os.path.isfile(os.path.join(folder, n))]
    safetensors = [n for n in files if n.endswith(".safetensors")]
    torch_files = [n for n in files if n.endswith((".bin", ".pt", ".pth"))]
    weights = (safetensors or torch_files) + [n for n in files if n.endswith(".gguf")]
    configs = [n for n in files if n in CONFIG_FILES or n.endswith(".index.json")]
    return sorted(set(weights) | set(configs))


def fingerprint_file(path: str, *, cache: str | None = None) -> FileDigest:
    """One file's part of the fingerprint (see the module docstring). ``OSError`` if it cannot be read."""
    st = os.stat(path)
    name = os.path.basename(path)
    if name.endswith(".json") and st.st_size <= MAX_CONFIG_BYTES:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
        return FileDigest(name, hashlib.sha256(b"config\0" + data).hexdigest(), "config", len(data))
    if name.endswith(".safetensors"):
        try:
            digest, read = _safetensors_digest(path, st.st_size)
            return FileDigest(name, digest, "safetensors", read)
        except _BadHeader as exc:
            digest, read, method = _whole_file_digest(path, st, cache)
            return FileDigest(name, digest, method, read, note=f"{name}: unreadable header ({exc}): hashed whole")
    if name.endswith((".bin", ".pt", ".pth")) and zipfile.is_zipfile(path):
        try:
            digest, read = _torch_zip_digest(path)
            return FileDigest(name, digest, "torch-zip", read)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, EOFError, RuntimeError, ValueError):
            pass  # a zip we cannot read record by record: hashed whole
    digest, read, method = _whole_file_digest(path, st, cache)
    return FileDigest(name, digest, method, read)


def fingerprint_files(paths: Iterable[str], *, cache: str | None = None) -> WeightsFingerprint:
    """The fingerprint over ``paths`` (each file named by its base name, in sorted order).
    ``FingerprintError`` if there is none or one cannot be read."""
    started = time.monotonic()
    parts: list[FileDigest] = []
    for path in sorted(paths, key=os.path.basename):
        try:
            parts.append(fingerprint_file(path, cache=cache))
        except OSError as exc:
            raise FingerprintError(f"{path}: {exc.strerror or exc}") from exc
    if not any(p.method != "config" for p in parts):
        raise FingerprintError("no weights file (.safetensors, .bin, .pt, .pth, .gguf)")
    h = hashlib.sha256(FINGERPRINT_FORMAT.encode() + b"\0")
    for p in parts:
        h.update(json.dumps([p.name, p.digest]).encode() + b"\n")
    return WeightsFingerprint(h.hexdigest(), tuple(parts), time.monotonic() - started,
                              tuple(p.note for p in parts if p.note))


def fingerprint_model(location: str, *, cache: str | None = None) -> WeightsFingerprint:
    """The fingerprint of the model at ``location``.

    ``location`` is a folder (its :func:`weight_files`) or one weights file (a ``.gguf``, say).
    ``cache`` is the whole-file hashes' folder, by default :func:`cache_dir`.
    Raises ``FingerprintError`` if ``location`` is neither, holds no weights, or a file cannot be read.
    """
    if cache is None:
        cache = cache_dir()
    if os.path.isdir(location):
        try:
            names = weight_files(location)
        except OSError as exc:
            raise FingerprintError(f"{location}: {exc.strerror or exc}") from exc
        return fingerprint_files([os.path.join(location, n) for n in names], cache=cache)
    if os.path.isfile(location):
        return fingerprint_files([location], cache=cache)
    raise FingerprintError(f"{location!r} is not a local folder or file")


def resolve_model_folder(name: str, *, revision: str | None = None, download_dir: str | None = None) -> str | None:
    """The local folder (or file) of vLLM's model ``name``, or None if there is none.

    That is ``name`` itself when it exists here.
    Otherwise it is the snapshot of the hub model ``name`` (at ``revision``) in the Hugging Face cache.
    That takes ``huggingface_hub`` installed and the snapshot there.
    vLLM downloads it before the engine's connector starts.
    """
    if os.path.exists(name):
        return name
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        folder = snapshot_download(name, revision=revision, cache_dir=download_dir, local_files_only=True)
    except Exception:  # not in the cache, not a repo id, an offline hub: no folder
        return None
    return folder if isinstance(folder, str) and os.path.isdir(folder) else None


def model_fingerprint(name: str, vllm_config: Any | None, *, model_id: str | None,
                      identity_by: IdentityBy) -> str | None:
    """The fingerprint (hex) of the weights and config of vLLM's model ``name``, for the blocks' identity.

    It is None when the model is named otherwise (``model_id`` set, ``identity_by`` NAME).
    It is also None when the weights cannot be read.
    A ``weights_fingerprint_failed`` warning then goes to kvactors' log and to vLLM's.
    The identity then falls back to the model's name, as before fingerprints.
    ``vllm_config`` (the engine's ``VllmConfig``, or None) gives the hub revision and download folder.
    Never raises.
    A broken checkpoint is vLLM's to report, not kvactors' reason to stop the engine.
    """
    if model_id is not None or identity_by is IdentityBy.NAME:
        return None
    from kvactors.logs import component_logger

    log = component_logger("vllm")
    model_config = getattr(vllm_config, "model_config", None)
    load_config = getattr(vllm_config, "load_config", None)
    revision = getattr(model_config, "revision", None)
    download_dir = getattr(load_config, "download_dir", None)
    try:
        folder = resolve_model_folder(name, revision=revision if isinstance(revision, str) else None,
                                      download_dir=download_dir if isinstance(download_dir, str) else None)
        if folder is None:
            raise FingerprintError(f"{name!r} is not a local folder, nor a model in the Hugging Face cache")
        fingerprint = fingerprint_model(folder)
    except Exception as exc:  # FingerprintError, or anything unforeseen: the documented fallback
        reason = f"{type(exc).__name__}: {exc}"
        log.warning("weights_fingerprint_failed", model=name, reason=reason, fallback="model name")
        logging.getLogger("vllm.kvactors").warning(
            "kvactors: the weights of %s could not be fingerprinted (%s): its blocks are named by the model's "
            "name (its path) instead; set model_id to name them explicitly", name, reason)
        return None
    log.info("weights_fingerprinted", model=name, folder=folder, **fingerprint.describe())
    for note in fingerprint.notes:
        logging.getLogger("vllm.kvactors").warning("kvactors: %s", note)
    return fingerprint.digest
