"""How quiet the host was while a scenario ran: scheduling stalls, CPU pressure, other load.

A benchmark on a shared 2-core host is only as good as the host was quiet. ``HostMonitor`` runs
one thread in the orchestrator that sleeps 5 ms at a time and records how late it wakes up (a
late wake-up means no CPU was free for a runnable thread), and reads the kernel's CPU pressure
stall information (``/proc/pressure/cpu``: share of time some runnable task was waiting for a
CPU) and the load average before and after. The result goes into every scenario's JSON and
tables, so a reader can tell a quiet run from a noisy one.

Threads: one daemon thread per monitor, stopped by ``stop()``.
"""

from __future__ import annotations

import os
import threading
import time

_TICK_S = 0.005
STALL_S = 0.02  # a wake-up this late is recorded with its time (see ``stalls_between``)

_current: HostMonitor | None = None


def stalls_between(t0: float, t1: float) -> list[tuple[float, float]]:
    """(wall time, seconds late) of the running monitor's late wake-ups within [t0, t1]."""
    m = _current
    if m is None:
        return []
    return [(t, late) for t, late in list(m.stalls) if t0 <= t <= t1]


_TICK = os.sysconf("SC_CLK_TCK")


def _host_cpu_s() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole host since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = v
    busy = user + nice + system + irq + softirq + steal
    return busy / _TICK, (busy + idle + iowait) / _TICK


def _own_cpu_s() -> float:
    """CPU seconds of this process and of its reaped children (the bench's workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _psi_some_us() -> int | None:
    try:
        with open("/proc/pressure/cpu") as f:
            for line in f:
                if line.startswith("some"):
                    return int(line.rsplit("total=", 1)[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class HostMonitor:
    def __init__(self) -> None:
        self._stop = threading.Event()
        self._late: list[float] = []
        self.stalls: list[tuple[float, float]] = []
        self._thread = threading.Thread(target=self._run, name="bench-host-monitor", daemon=True)
        self._t0 = 0.0
        self._psi0: int | None = None
        self._host0: tuple[float, float] | None = None
        self._own0 = 0.0

    def start(self) -> HostMonitor:
        global _current
        _current = self
        self._t0 = time.monotonic()
        self._psi0 = _psi_some_us()
        self._host0 = _host_cpu_s()
        self._own0 = _own_cpu_s()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            time.sleep(_TICK_S)
            late = time.perf_counter() - t - _TICK_S
            self._late.append(late)
            if late > STALL_S:
                self.stalls.append((time.time(), late))

    def stop(self) -> dict[str, object]:
        global _current
        if _current is self:
            _current = None
        self._stop.set()
        self._thread.join(1.0)
        elapsed = time.monotonic() - self._t0
        psi1 = _psi_some_us()
        late = sorted(self._late)
        n = len(late)
        out: dict[str, object] = {
            "samples": n,
            "wakeup_late_p99_ms": round(late[int(n * 0.99)] * 1e3, 2) if n else None,
            "wakeup_late_max_ms": round(late[-1] * 1e3, 1) if n else None,
            "stalls_over_50ms": sum(1 for x in late if x > 0.05),
            "stalls_over_200ms": sum(1 for x in late if x > 0.2),
            "stalls": [[round(t, 3), round(x * 1e3, 1)] for t, x in self.stalls],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        }
        if self._psi0 is not None and psi1 is not None and elapsed > 0:
            out["cpu_pressure_pct"] = round((psi1 - self._psi0) / 1e6 / elapsed * 100, 1)
        host1 = _host_cpu_s()
        if self._host0 is not None and host1 is not None and host1[1] > self._host0[1]:
            busy = host1[0] - self._host0[0]
            cap = host1[1] - self._host0[1]
            own = _own_cpu_s() - self._own0
            # Everything the host did that was not this benchmark (its workers are reaped by
            # the time stop() runs, so their CPU is in children_*).
            out["host_busy_pct"] = round(busy / cap * 100, 1)
            out["others_cpu_pct"] = round(max(0.0, busy - own) / cap * 100, 1)
        return out


def describe(noise: dict[str, object]) -> str:
    """One line for people."""
    parts = []
    if "others_cpu_pct" in noise:
        parts.append(f"other jobs used {noise['others_cpu_pct']}% of the host's CPU")
    parts.append(
        f"a 5 ms timer woke > 50 ms late {noise.get('stalls_over_50ms', '?')} times "
        f"(max {noise.get('wakeup_late_max_ms', '?')} ms)"
    )
    if "cpu_pressure_pct" in noise:
        parts.append(
            f"some runnable task (this benchmark's included) waited for a CPU "
            f"{noise['cpu_pressure_pct']}% of the time"
        )
    return "host noise: " + "; ".join(parts)
