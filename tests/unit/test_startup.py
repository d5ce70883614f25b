"""Start-up checks (oprag_server.startup) without a server: data-dir layout, lock, ports, security."""

from __future__ import annotations

import json
import socket

import pytest

from oprag_server import startup
from oprag_server.config import SecurityConfig, ServerConfig


def test_data_dir_is_recorded_then_checked(tmp_path):
    cfg = ServerConfig(data_dir=tmp_path / "d", shards=2)
    startup.check_data_dir(cfg, 384, "minilm")
    meta = json.loads((tmp_path / "d" / "oprag.json").read_text())
    assert meta == {"format": startup.DATA_FORMAT, "shards": 2, "dim": 384, "embedder": "minilm"}
    startup.check_data_dir(cfg, 384, "minilm")  # same layout: fine
    with pytest.raises(RuntimeError, match="split over 2 shards; start with --shards 2"):
        startup.check_data_dir(ServerConfig(data_dir=tmp_path / "d", shards=3), 384, "minilm")
    with pytest.raises(RuntimeError, match="holds 384-dimensional vectors; the embedder produces 16"):
        startup.check_data_dir(cfg, 16, "hashing")


def test_a_stale_replica_zero_refuses_a_single_replica_start(tmp_path):
    cfg = ServerConfig(data_dir=tmp_path / "d", shards=2)
    startup.check_data_dir(cfg, 384, "minilm")
    (tmp_path / "d" / "shard-1").mkdir()
    (tmp_path / "d" / "shard-1" / "STALE").write_bytes(b"")
    with pytest.raises(RuntimeError, match="replica 0 of shard-1 is behind its siblings"):
        startup.check_data_dir(cfg, 384, "minilm")
    startup.check_data_dir(ServerConfig(data_dir=tmp_path / "d", shards=2, replicas=2), 384, "minilm")


def test_data_dir_lock_is_exclusive(tmp_path):
    f = startup.lock_data_dir(tmp_path / "d")
    try:
        with pytest.raises(RuntimeError, match="in use by another OpRAG server"):
            startup.lock_data_dir(tmp_path / "d")
    finally:
        f.close()
    startup.lock_data_dir(tmp_path / "d").close()  # free again once closed


def test_port_check():
    startup.check_port("127.0.0.1", 0, "gRPC port (--port)")  # any port: always fine
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"gRPC port \(--port\) 127.0.0.1:{port} is not available"):
            startup.check_port("127.0.0.1", port, "gRPC port (--port)")
    startup.check_port("127.0.0.1", port, "gRPC port (--port)")  # closed: free


def test_security_checks(tmp_path):
    startup.check_security(ServerConfig(), set())
    with pytest.raises(RuntimeError, match="a token is required"):
        startup.check_security(ServerConfig(security=SecurityConfig(require_token=True)), set())
    startup.check_security(ServerConfig(security=SecurityConfig(require_token=True)), {"t"})
    with pytest.raises(RuntimeError, match="TLS needs both --tls-cert and --tls-key"):
        startup.check_security(ServerConfig(security=SecurityConfig(tls_cert=tmp_path / "c.pem")), set())


@pytest.mark.parametrize("which", ["port", "metrics_port", "http_port"])
def test_a_taken_port_refuses_the_start_before_the_data_dir_is_written(tmp_path, monkeypatch, which):
    from types import SimpleNamespace

    import oprag_server.models.backends as backends
    import oprag_server.models.encoder as enc

    monkeypatch.setattr(enc, "TransformersEncoder", lambda *a, **k: SimpleNamespace(dim=4, name="fake"))
    monkeypatch.setattr(backends, "load_backend", lambda cfg: None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        ports = {"port": 0, "metrics_port": 0, "http_port": 0, which: s.getsockname()[1]}
        cfg = ServerConfig(host="127.0.0.1", data_dir=tmp_path / "d", **ports)
        with pytest.raises(RuntimeError, match="is not available"):
            startup.preflight(cfg)
    assert not (tmp_path / "d").exists()  # no oprag.json, no .lock


def test_a_data_dir_that_is_a_file_or_cannot_be_made_or_holds_a_bad_record_says_so(tmp_path):
    """Were bare OS/JSON errors: 'oprag: [Errno 17] File exists: ...', '[Errno 2] No such file or
    directory: ...', 'Expecting value: line 1 column 1 (char 0)'."""
    f = tmp_path / "corpus.jsonl"
    f.write_text("{}\n")
    with pytest.raises(RuntimeError, match=r"--data-dir .*corpus.jsonl is a file, not a directory"):
        startup.check_data_dir(ServerConfig(data_dir=f, shards=2), 384, "minilm")
    with pytest.raises(RuntimeError, match=r"--data-dir .*corpus.jsonl/sub cannot be created \(Not a directory\)"):
        startup.check_data_dir(ServerConfig(data_dir=f / "sub", shards=2), 384, "minilm")
    d = tmp_path / "d"
    d.mkdir()
    for bad in ("", "[1, 2]", "\xff"):
        (d / "oprag.json").write_text(bad, encoding="latin-1")
        with pytest.raises(RuntimeError, match=r"oprag.json is not the layout record OpRAG writes"):
            startup.check_data_dir(ServerConfig(data_dir=d, shards=2), 384, "minilm")
