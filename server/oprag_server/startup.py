"""Start-up checks that fail fast, before any model loads or shard starts: the models exist,
the data directory fits this configuration and no other server uses it, the ports are free.

Each raises ``RuntimeError`` (or ``ValueError`` from a model loader) with a message that says
which option to change; the server CLI prints it and exits with status 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from . import cpu_latency
from .config import ChunkingConfig, ServerConfig

#: Version of the data directory layout, written to ``<data_dir>/oprag.json``.
DATA_FORMAT = 1
_LOCKS: list[IO] = []  # held for the life of the process
log = logging.getLogger("oprag")


def preflight(cfg: ServerConfig) -> tuple[Any, Any | None]:
    """Find the models (not loaded yet), check the chunk size against the embedder's special
    tokens (:func:`check_chunk_size`), the ``--cpu-latency-us`` device and the gRPC, metrics and
    HTTP ports, then check and lock the data directory (a start refused for a taken port or an
    unwritable QoS device writes nothing there).

    :returns: the (not yet warmed up) encoder and generator (None for ``--generator none``).
    :raises RuntimeError | ValueError: with a message that says what to change.
    """
    from .models.encoder import TransformersEncoder
    from .models.backends import load_backend

    encoder = TransformersEncoder(cfg.embed.model, device=cfg.embed.device, batch_size=cfg.embed.batch_size,
                                  max_tokens=cfg.embed.max_tokens, compile=cfg.embed.compile)
    check_chunk_size(cfg.chunking.size, encoder)
    generator = load_backend(cfg.generate)
    # the storage first, writing nothing: a refused start leaves no oprag.json in an empty --data-dir
    check_storage(cfg.storage_uri, cfg.shards, encoder.dim, record=False)
    if cfg.storage_uri is not None and not cfg.storage_takeover:  # (taken later: Runtime.start_shards)
        from .index.lease import OwnerLease
        from .index.objstore import ObjectStore

        OwnerLease(ObjectStore.from_uri(cfg.storage_uri)).acquire(check_only=True)
    check_security_files(cfg)
    cpu_latency.check(cfg.cpu_latency_us)  # the QoS device writable (held once serving: app.serve)
    check_port(cfg.host, cfg.port, "gRPC port (--port)")
    check_port(cfg.metrics_host or cfg.host, cfg.metrics_port, "metrics port (--metrics-port)")
    check_port(cfg.host, cfg.http_port, "HTTP port (--http-port)")
    check_data_dir(cfg, encoder.dim, encoder.name)
    lock_data_dir(cfg.data_dir)
    note_compile()  # before the shards start: they compile the kernels
    return encoder, generator


def check_chunk_size(size: int, encoder: Any) -> None:
    """``--chunk-size`` must leave room for text next to the special tokens the embedder adds to
    every chunk (MiniLM: 2, ``[CLS]`` and ``[SEP]``), counted with the ``tokenizer.json`` of its
    model directory (the tokenizers library alone, ~50 ms: transformers loads with the warm-up,
    beside the shards' start). Without that file the ingest pipeline's chunker checks it.

    :param size: the chunk size in tokens, special tokens included.
    :param encoder: a ``TransformersEncoder`` (its model directory ``path``; an encoder without
        one, e.g. a test's fake, is not checked here).
    :raises ValueError: naming the option and the smallest size that leaves room.
    """
    path = getattr(encoder, "path", None)
    if path is None or not (path / "tokenizer.json").is_file():
        return
    from tokenizers import Tokenizer

    special = Tokenizer.from_file(str(path / "tokenizer.json")).num_special_tokens_to_add(False)
    if size <= special:
        raise ValueError(f"--chunk-size {size} leaves no room for text next to the {special} special tokens the "
                         f"embedder adds to each chunk: use --chunk-size {special + 1} or more (default {ChunkingConfig.size})")


def lock_data_dir(d: Path) -> IO:
    """Hold an exclusive ``flock`` on ``d/.lock`` for the life of the process (creates ``d``).

    :returns: the open lock file (closing it releases the lock).
    :raises RuntimeError: another server (or another open lock in this process) holds it.
    """
    d.mkdir(parents=True, exist_ok=True)
    f = open(d / ".lock", "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        f.close()
        raise RuntimeError(f"{d} is in use by another OpRAG server: stop it or use another --data-dir") from exc
    _LOCKS.append(f)
    return f


def check_port(host: str, port: int, what: str) -> None:
    """Check that a TCP listener could bind ``host:port`` now (port 0 = any, always passes).

    :param what: how the message names the port, e.g. ``"gRPC port (--port)"``.
    :raises RuntimeError: the port is taken (or the address is not local).
    """
    if port == 0:
        return
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR: a port left in TIME_WAIT by a server that just stopped is free to use;
        # on Linux a port with a live listener still fails
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise RuntimeError(f"{what} {host}:{port} is not available ({exc.strerror}): choose another port") from exc


def check_data_dir(cfg: ServerConfig, dim: int, embedder: str) -> None:
    """Create ``cfg.data_dir`` and record its layout in ``oprag.json``
    (``{"format", "shards", "dim", "embedder"}``), or check an existing record against it.

    :param dim: the embedder's output width D.
    :raises RuntimeError: the directory holds a corpus over another shard count or width, is a
        file or cannot be created, or its ``oprag.json`` is not a layout record.
    """
    d = cfg.data_dir
    if d.exists() and not d.is_dir():
        raise RuntimeError(f"--data-dir {d} is a file, not a directory: name a directory (it is created if missing)")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RuntimeError(f"--data-dir {d} cannot be created ({exc.strerror}): name a writable directory") from exc
    meta_path = d / "oprag.json"
    if meta_path.exists():
        try:
            old = json.loads(meta_path.read_text())
            if not isinstance(old, dict):
                raise ValueError(f"a JSON {type(old).__name__}, not an object")
        except (ValueError, UnicodeDecodeError) as exc:
            raise RuntimeError(f"{meta_path} is not the layout record OpRAG writes ({exc}): restore it, or start "
                               f"on another --data-dir") from exc
        if old.get("shards") != cfg.shards:
            raise RuntimeError(
                f"{d} holds a corpus split over {old.get('shards')} shards; start with --shards {old.get('shards')} "
                f"or use another --data-dir"
            )
        if old.get("dim") != dim:
            raise RuntimeError(f"{d} holds {old.get('dim')}-dimensional vectors; the embedder produces {dim}")
        stale = sorted(str(p.parent.relative_to(d)) for p in d.glob("shard-*/STALE"))
        if stale and cfg.replicas == 1:  # replica 0 missed writes its siblings hold (shards/replicas.py)
            raise RuntimeError(f"{d}: replica 0 of {', '.join(stale)} is behind its siblings; start with the "
                               f"--replicas the corpus ran with (it catches up), then lower it")
    else:
        meta_path.write_text(json.dumps({"format": DATA_FORMAT, "shards": cfg.shards, "dim": dim, "embedder": embedder}))


def check_storage(uri: str | None, shards: int | None = None, dim: int | None = None, record: bool = True) -> None:
    """Open ``--storage-uri`` and write, list, read and delete a probe object there; check the
    layout recorded there (``oprag.json``: shards, vector width), or record it (``record``).

    :raises RuntimeError: not a storage URI, the storage refused one of those, or it holds a
        corpus over another shard count or width (messages name the flag).
    """
    if uri is None:
        return
    from .index.objstore import ObjectStore

    try:
        store = ObjectStore.from_uri(uri)
        store.probe()
        raw = store.get("oprag.json")
        if raw is None and shards is not None and record:
            store.put_atomic("oprag.json", json.dumps({"format": DATA_FORMAT, "shards": shards, "dim": dim}).encode())
    except ValueError as exc:
        raise RuntimeError(f"--storage-uri: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - OSError, ArrowInvalid, a cloud SDK's error
        raise RuntimeError(f"--storage-uri {uri!r}: objects cannot be written and read there "
                           f"({type(exc).__name__}: {exc})") from exc
    old = json.loads(raw) if raw is not None else {}
    for key, want, flag in (("shards", shards, "--shards"), ("dim", dim, "an embedder of that width")):
        if raw is not None and want is not None and old.get(key) != want:
            raise RuntimeError(f"--storage-uri {uri!r} holds a corpus with {key} = {old.get(key)} (this start: "
                               f"{want}); use {flag} {old.get(key)} or another --storage-uri")


def acquire_storage(cfg: ServerConfig, dim: int) -> Any:
    """Check ``--storage-uri`` (:func:`check_storage`, nothing written), take its owner lease
    (:mod:`.index.lease`; ``--storage-takeover`` from a live holder), then record the layout.

    :returns: the held :class:`~.index.lease.OwnerLease` (None without a storage URI).
    :raises RuntimeError: as :func:`check_storage`; another live server holds the lease.
    """
    if cfg.storage_uri is None:
        return None
    import logging

    from .index.lease import OwnerLease
    from .index.objstore import ObjectStore

    check_storage(cfg.storage_uri, cfg.shards, dim, record=False)
    lease = OwnerLease(ObjectStore.from_uri(cfg.storage_uri))
    old = lease.acquire(cfg.storage_takeover)
    if old is not None:
        logging.getLogger("oprag").warning("took the --storage-uri owner lease from %s", lease.describe(old))
    check_storage(cfg.storage_uri, cfg.shards, dim)
    return lease


def check_security(cfg: ServerConfig, tokens: set[str]) -> None:
    """:raises RuntimeError: a token is required but none was loaded, or TLS has only one of
    certificate and key."""
    sec = cfg.security
    if sec.require_token and not tokens:
        raise RuntimeError("a token is required but none was given: use --tokens-file or OPRAG_TOKENS")
    if (sec.tls_cert is None) != (sec.tls_key is None):
        raise RuntimeError("TLS needs both --tls-cert and --tls-key")


def check_security_files(cfg: ServerConfig) -> None:
    """Read ``--tokens-file`` and the TLS files before anything starts (trial20: a missing or
    unreadable file was found after the shards had started and written to the data directory,
    as a bare ``[Errno 2]``, and a certificate that is not PEM as "Failed to bind to address").
    The TLS pair is loaded as a server's (``ssl.SSLContext.load_cert_chain``: the key must match
    the certificate), ``--tls-client-ca`` as CA certificates (``load_verify_locations``).

    :raises RuntimeError: naming the option, the file and what is wrong with it."""
    import ssl  # noqa: PLC0415

    from .service.auth import load_tokens  # noqa: PLC0415

    sec = cfg.security
    try:
        tokens = load_tokens(sec.tokens_file)
    except OSError as exc:
        raise RuntimeError(f"--tokens-file {sec.tokens_file}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise RuntimeError(f"--tokens-file {exc}: put one token per line") from exc
    check_security(cfg, tokens)
    if sec.tls_cert is None:
        return
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    checks = [("--tls-cert/--tls-key", f"{sec.tls_cert}, {sec.tls_key}", "a PEM certificate and matching private key",
               lambda: ctx.load_cert_chain(sec.tls_cert, sec.tls_key))]
    if sec.tls_client_ca is not None:
        checks.append(("--tls-client-ca", str(sec.tls_client_ca), "PEM CA certificates",
                       lambda: ctx.load_verify_locations(sec.tls_client_ca)))
    for opt, files, want, load in checks:
        try:
            load()
        except ssl.SSLError as exc:  # (before OSError, its base: a bad PEM, a key of another certificate)
            raise RuntimeError(f"{opt} {files}: not {want} ({exc})") from exc
        except OSError as exc:
            raise RuntimeError(f"{opt} {files}: {exc.strerror or exc}") from exc


def announce_ready(host: str, port: int) -> None:
    """Print the line a supervisor waits for (``OPRAG READY host:port``), after moving every
    object of the start-up (models, corpus statistics, modules: ~400K) out of the cyclic
    garbage collector's generations (``gc.freeze``): a full collection then visits only what
    serving creates, instead of stalling the event loop ~0.5 s every few thousand requests."""
    import gc  # noqa: PLC0415

    gc.collect()
    gc.freeze()
    print(f"OPRAG READY {host}:{port}", flush=True)


#: the modules with numba kernels (``cache=True``), relative to the package
JIT_MODULES = ("index/kernels*.py", "index/term_ids.py", "operators/union.py")
#: seconds the first start spends compiling them all (measured: 2 cores, 1-2 shards; the trial saw ~95 s)
COMPILE_ESTIMATE_S = 95


def uncached_kernels(package: Path | None = None, env: dict | None = None, drop: bool = False
                     ) -> tuple[list[Path], int]:
    """``(modules whose kernels numba has not cached, all kernel modules)``: a module counts as
    cached when an index file of it (``<module>.<function>-<line>.pyXY.nbi``) at least as new as
    the newest kernel module's source is where numba keeps it: under ``$NUMBA_CACHE_DIR`` when
    set (only there; the kernel modules set it under the temp dir when their folder is not
    writable, see index/kernels.py), else in its ``__pycache__`` or the user-wide cache
    (``~/.cache/numba``); under a cache root numba names the folder ``<source folder name>_<sha1
    of its absolute path>`` (``numba.core.caching._CacheLocator.get_suitable_cache_subpath``).

    Any kernel source, not only its own: numba checks a cached function against its own file
    only, so ``kernels_carry.carry_band`` kept the ``kernels.skyband`` it was compiled with
    after ``kernels.py`` changed (numba's documented limit). With ``drop`` the cache files
    (``.nbi``, ``.nbc``) of every module found cold are deleted, so that numba compiles it anew
    (what a start does before its shards warm the kernels, and ``precompile``)."""
    package = package or Path(os.path.abspath(__file__)).parent  # the path numba hashes (not symlink-resolved)
    env = os.environ if env is None else env
    sources = sorted(p for pattern in JIT_MODULES for p in package.glob(pattern))
    user = env.get("NUMBA_CACHE_DIR")
    if not user and not os.access(package / "index", os.W_OK):  # as index/kernels.py sets it
        user = os.path.join(tempfile.gettempdir(), f"oprag-numba-{os.getuid()}")
    root = Path(user) if user else Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "numba"
    latest = max((src.stat().st_mtime for src in sources), default=0.0)
    cold = []
    for src in sources:
        dirs = [] if user else [src.parent / "__pycache__"]
        folder = os.path.dirname(os.path.abspath(src))
        dirs.append(root / f"{os.path.basename(folder)}_{hashlib.sha1(folder.encode()).hexdigest()}")
        newest = max((f.stat().st_mtime for d in dirs if d.is_dir() for f in d.glob(f"{src.stem}.*.nbi")), default=None)
        if newest is None or newest < latest:
            cold.append(src)
            for f in (f for d in dirs if drop and d.is_dir() for f in d.glob(f"{src.stem}.*.nb[ic]")):
                with contextlib.suppress(OSError):  # (another start deleted it, or a read-only cache)
                    f.unlink()
    return cold, len(sources)


_COMPILING: list[float] = []  # when a start that compiles began (note_compile -> warm_beside)


def note_compile() -> bool:
    """Log one line when the search kernels are not compiled yet (the first start after an
    install or an upgrade, :func:`uncached_kernels`), with an estimate: the start is otherwise
    silent for a minute or two. :func:`warm_beside` then logs the time taken.
    :returns: whether they will be compiled."""
    cold, total = uncached_kernels(drop=True)  # (stale caches dropped: the shards compile those anew)
    if not cold:
        return False
    est = max(10, round(COMPILE_ESTIMATE_S * len(cold) / max(total, 1) / 5) * 5)
    log.info("compiling search kernels, first start only, ~%d s (%d of %d kernel modules not in numba's cache; "
             "cached for the next start)", est, len(cold), total)
    _COMPILING[:] = [time.perf_counter()]
    return True


async def warm_beside(encoder: Any, generator: Any | None, start: Any) -> None:
    """Warm up the encoder, then the generator, off the event loop while ``start`` (the shard
    processes' start) runs: a warm-up is mostly importing transformers' model modules (~5 s on 2
    cores). Awaits both to the end, then raises the first failure, so that ``serve``'s clean-up
    never meets a half-started shard pool. Logs each model's warm-up as it starts and ends and
    the shards' start as it ends, with seconds (trial22: ~4 s of warm-up without a line); after a
    :func:`note_compile` that logged a compile, the time taken (from that line)."""
    t0 = _COMPILING.pop() if _COMPILING else None

    async def warm() -> None:
        loop = asyncio.get_running_loop()
        for what, model in (("embedder", encoder), ("generator", generator)):
            if model is not None:
                t = time.perf_counter()
                log.info("%s %s: warming up beside the shards' start (imports torch and transformers, reads the weights)",
                         what, getattr(model, "name", "?"))
                await loop.run_in_executor(None, model.warm_up)
                log.info("%s %s: ready in %.1f s", what, getattr(model, "name", "?"), time.perf_counter() - t)

    async def shards() -> Any:
        t = time.perf_counter()
        out = await start
        log.info("every shard is ready after %.1f s (snapshots loaded, write-ahead logs replayed)", time.perf_counter() - t)
        return out

    results = await asyncio.gather(warm(), shards(), return_exceptions=True)
    if t0 is not None and not any(isinstance(r, BaseException) for r in results):
        log.info("search kernels compiled and models warmed up in %.1f s (the shards'; the frontend's merge "
                 "kernels follow, a few seconds)", time.perf_counter() - t0)
    for r in results:
        if isinstance(r, BaseException):
            raise r
