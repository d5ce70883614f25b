"""``--cpu-latency-us`` (:mod:`oprag_server.cpu_latency`): the request written as the kernel's
interface reads it (a native 32-bit integer, held while the file is open), read back, released;
refusals say what to change. The device is a temporary file here; the served test with the real
``/dev/cpu_dma_latency`` is ``tests/integration/test_cpu_latency_server.py``."""

from __future__ import annotations

import struct

import pytest

from oprag_server import cpu_latency
from oprag_server.cli import build_parser, config_from_args, main


def test_request_written_as_a_native_int32_read_back_and_released(tmp_path):
    dev = tmp_path / "qos"
    dev.write_bytes(struct.pack("=i", 2_000_000_000))
    req = cpu_latency.hold(55, str(dev))
    try:
        assert dev.read_bytes()[:4] == struct.pack("=i", 55)
        assert req.effective() == 55
    finally:
        req.close()
    assert req.fd is None and req.effective() is None
    req.close()  # idempotent


def test_off_holds_nothing(tmp_path):
    assert cpu_latency.hold(-1, str(tmp_path / "absent")) is None


@pytest.mark.parametrize("us", [-2, 2_000_000_001])
def test_out_of_range_is_refused(us):
    with pytest.raises(ValueError, match="must be -1 .off. or in"):
        cpu_latency.CpuLatencyRequest(us)
    with pytest.raises(ValueError, match="--cpu-latency-us must be -1"):
        config_from_args(build_parser().parse_args(["--cpu-latency-us", str(us)]))


def test_a_device_that_cannot_be_opened_names_it_and_the_way_out(tmp_path):
    with pytest.raises(RuntimeError) as e:
        cpu_latency.hold(0, str(tmp_path / "no-such-device"))
    msg = str(e.value)
    assert "no-such-device" in msg and "--cpu-latency-us at -1" in msg


def test_cli_default_is_off_and_a_bad_value_exits_2(capsys):
    assert config_from_args(build_parser().parse_args([])).cpu_latency_us == -1
    assert config_from_args(build_parser().parse_args(["--cpu-latency-us", "0"])).cpu_latency_us == 0
    assert main(["--cpu-latency-us", "-7", "--generator", "none"]) == 2
    assert "--cpu-latency-us must be -1 (off)" in capsys.readouterr().err


def test_gauge_reads_the_effective_target_at_each_scrape(tmp_path):
    from prometheus_client import CollectorRegistry, Gauge

    dev = tmp_path / "qos"
    dev.write_bytes(struct.pack("=i", 2_000_000_000))
    reg = CollectorRegistry()
    g = Gauge("qos_us", "test", registry=reg)
    req = cpu_latency.hold(7, str(dev), gauge=g)
    assert reg.get_sample_value("qos_us") == 7
    dev.write_bytes(struct.pack("=i", 3))  # (another process's lower request, as the device would read)
    assert reg.get_sample_value("qos_us") == 3
    cpu_latency.release(req)
    assert reg.get_sample_value("qos_us") == -1
    cpu_latency.release(None)


def test_messages_name_the_container_way_in(tmp_path):
    with pytest.raises(RuntimeError, match=r"no such device: in a container pass it in \(docker: --device /dev/cpu_dma_latency --user 0\)"):
        cpu_latency.check(0, str(tmp_path / "absent"))
    ro = tmp_path / "ro"
    ro.write_bytes(b"\0\0\0\0")
    ro.chmod(0o400)
    import os

    if os.access(ro, os.W_OK):  # root writes anyway: the permission branch is not reachable here
        pytest.skip("running as root")
    with pytest.raises(RuntimeError, match="runAsUser: 0"):  # pragma: no cover - non-root runs only
        cpu_latency.check(0, str(ro))


def test_a_refused_device_stops_preflight_before_the_data_dir_is_written(tmp_path, monkeypatch):
    """trial29 #1: the refusal came after preflight had created the data dir and its oprag.json,
    which then pinned --shards for a directory that never held a corpus."""
    from oprag_server.startup import preflight

    monkeypatch.setattr(cpu_latency, "DEVICE", str(tmp_path / "absent-device"))
    data = tmp_path / "data"
    cfg = config_from_args(build_parser().parse_args(
        ["--generator", "none", "--data-dir", str(data), "--port", "0", "--metrics-port", "0", "--cpu-latency-us", "0"]))
    with pytest.raises(RuntimeError, match="absent-device"):
        preflight(cfg)
    assert not data.exists()
    cpu_latency.check(-1)  # off: nothing opened, nothing raised



def test_read_target_reads_the_device_and_says_none_without_one(tmp_path):
    dev = tmp_path / "qos"
    dev.write_bytes(struct.pack("=i", 123))
    assert cpu_latency.read_target(str(dev)) == 123
    assert cpu_latency.read_target(str(tmp_path / "absent")) is None
