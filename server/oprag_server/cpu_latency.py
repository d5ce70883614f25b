"""``--cpu-latency-us``: hold a Linux CPU latency QoS request while the server runs.

A request served at c = 1 wakes several idle processes in turn (the gRPC frontend, each shard,
the client). When a CPU is idle the kernel's cpuidle governor may put it in a state that takes
long to leave; on a KVM guest whose halt-polling is off (``haltpoll.guest_halt_poll_ns=0``,
as on the machines of bench/RESULTS.md) every idle period halts the virtual CPU and each wake-up
goes through the hypervisor. A CPU latency QoS request of N microseconds (the kernel's user-space
interface, ``/dev/cpu_dma_latency``: write a 32-bit integer and keep the file open; the request
ends when it is closed; Documentation/power/pm_qos_interface.rst) keeps every CPU in idle states
whose exit latency is at most N: with 0 an idle CPU polls instead of halting. This is what
tuned's ``latency-performance`` profile does (``force_latency``).

The server checks the device at start-up, before it writes anything (:func:`check`), and holds
the request from when it starts serving (just before ``OPRAG READY``) until it stops.

Cost: idle CPUs spin while the request is held (the guest still counts the time as idle; the
host sees busy virtual CPUs, and a laptop draws more power). It changes the whole machine's idle
policy, not only this process's, for as long as the server runs, so it is off by default.

bench/RESULTS.md ("Session 29"): 12K-chunk hybrid Retrieve p50 over gRPC, the same server with
and without the request held, rounds alternated.
"""

from __future__ import annotations

import errno
import logging
import os
import struct

log = logging.getLogger(__name__)

#: the kernel's user-space interface to CPU latency QoS
DEVICE = "/dev/cpu_dma_latency"
#: largest request accepted (the kernel's own default target is 2,000 s: 2e9 us)
MAX_US = 2_000_000_000


class CpuLatencyRequest:
    """A held CPU latency QoS request of ``us`` microseconds (module docstring).

    :param us: int, 0 to :data:`MAX_US` microseconds (0: idle CPUs poll).
    :param device: the QoS device (None: :data:`DEVICE`; tests point it elsewhere).
    :raises ValueError: ``us`` out of range.
    :raises RuntimeError: from :meth:`open`: the device cannot be opened or written, with what to
        change (permissions, a container's device list, or leaving the option off).
    """

    def __init__(self, us: int, device: str | None = None) -> None:
        if not 0 <= int(us) <= MAX_US:
            raise ValueError(f"--cpu-latency-us must be -1 (off) or in [0, {MAX_US}] microseconds, got {us}")
        self.us, self.device, self.fd = int(us), device or DEVICE, None

    def open(self) -> "CpuLatencyRequest":
        """Open the device and write the request (held until :meth:`close`)."""
        fd = _open(self.us, self.device)
        try:
            os.write(fd, struct.pack("=i", self.us))
        except OSError as exc:
            os.close(fd)
            raise RuntimeError(f"--cpu-latency-us {self.us}: writing the request to {self.device} failed "
                               f"({exc.strerror}); leave --cpu-latency-us at -1 (off)") from None
        self.fd = fd
        log.info("holding a CPU latency QoS request of %d us (%s; effective target now %s us)", self.us, self.device,
                 self.effective())
        return self

    def effective(self) -> int | None:
        """The machine's effective CPU latency target in microseconds (the smallest request held
        by any process), read back from the device; None when it cannot be read."""
        if self.fd is None:
            return None
        try:
            raw = os.pread(self.fd, 4, 0)
        except OSError:
            return None
        return struct.unpack("=i", raw)[0] if len(raw) == 4 else None

    def close(self) -> None:
        """End the request (idempotent)."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)
            log.info("CPU latency QoS request of %d us released", self.us)

    def __enter__(self) -> "CpuLatencyRequest":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


def _open(us: int, device: str) -> int:
    """A writable descriptor of the QoS device. :raises RuntimeError: what to change."""
    try:
        return os.open(device, os.O_RDWR)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            hint = (f"no such device: in a container pass it in (docker: --device {DEVICE} --user 0), else this "
                    "kernel has no CPU latency QoS (CONFIG_CPU_IDLE)")
        elif exc.errno in (errno.EACCES, errno.EPERM):
            hint = ("the device is root's: run the server as root or give its user write access (docker: --device "
                    f"{DEVICE} --user 0; Kubernetes: privileged: true and runAsUser: 0), or hold the request on the "
                    "host instead (tuned-adm profile latency-performance; deploy/README.md)")
        else:
            hint = "see deploy/README.md, 'Low-latency hosts'"
        raise RuntimeError(f"--cpu-latency-us {us}: cannot open {device} ({exc.strerror}): {hint}; or leave "
                           "--cpu-latency-us at -1 (off)") from None


def check(us: int, device: str | None = None) -> None:
    """Start-up check, before anything is written (:func:`..startup.preflight`): ``us`` in range
    and the device writable by this process (opened and closed again; nothing requested).

    :raises ValueError | RuntimeError: as :class:`CpuLatencyRequest`."""
    if int(us) != -1:
        req = CpuLatencyRequest(us, device)
        os.close(_open(req.us, req.device))


def hold(us: int, device: str | None = None, gauge=None) -> CpuLatencyRequest | None:
    """:class:`CpuLatencyRequest` ``us`` opened, or None for ``us == -1`` (off). ``gauge``: a
    prometheus_client ``Gauge`` that then reads :meth:`CpuLatencyRequest.effective` at each scrape
    (another process may hold a lower request), -1 once released.

    :raises ValueError | RuntimeError: as :class:`CpuLatencyRequest`."""
    if int(us) == -1:
        return None
    req = CpuLatencyRequest(us, device).open()
    if gauge is not None:
        def value() -> int:
            e = req.effective()
            return -1 if e is None else e
        gauge.set_function(value)
    return req


def read_target(device: str | None = None) -> int | None:
    """The machine's effective CPU latency target in microseconds (2e9: no request held), read
    from a fresh read-only descriptor of the device (nothing requested); None when it cannot be
    read (no device, not permitted)."""
    try:
        fd = os.open(device or DEVICE, os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.read(fd, 4)
    except OSError:
        return None
    finally:
        os.close(fd)
    return struct.unpack("=i", raw)[0] if len(raw) == 4 else None


def release(req: CpuLatencyRequest | None) -> None:
    """Close ``req`` when there is one (the server's shutdown)."""
    if req is not None:
        req.close()
