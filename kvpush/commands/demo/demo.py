"""The embedded demo: one P and several D endpoints as child processes, driven on loopback.

Owns ``Demo`` (configured by ``kvpush.commands.demo.config.DemoConfig``: a
``kvpush.commands.demo.cluster.Cluster`` of child endpoints, requests driven through it with a
``Driver``, one more D brought in mid-run, a ``DemoReport``). Threads: the caller's thread owns the
cluster and the stats client; the driver runs on its own thread (``start_driving``); the extra D is
spawned on a short-lived thread. Nothing here imports typer or rich: the CLI renders
``Demo.progress()`` / ``Demo.prefill_stats()`` and the final ``DemoReport``.

Clean-up guarantee: ``cancel`` (the CLI calls it on SIGINT, SIGTERM and SIGHUP) stops intake,
interrupts a start still waiting for a child, and ``finish``/``abort`` stop every child and
remove the work directory unless the logs are asked for (``keep_logs``) or something failed.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from kvpush.commands.common import control
from kvpush.commands.demo.cluster import Child, Cluster, DemoInterrupted
from kvpush.commands.demo.config import DemoConfig, DemoModel
from kvpush.commands.drive.driver import DriveConfig, DriveHooks, Driver, DriveReport, RequestResult
from kvpush.config import Role
from kvpush.errors import KvpushError
from kvpush.wire import protocol

if TYPE_CHECKING:
    from kvpush.transport.client import SideChannelClient


class ChildRow(TypedDict):
    """One endpoint the demo ran, as its report says it."""

    name: str
    role: Role
    address: str
    returncode: int | None
    requests: int  # requests it served
    extra: bool  # the decoder that joined mid-run
    log: str


@dataclass(frozen=True)
class DemoReport:
    drive: DriveReport
    children: list[ChildRow]
    events: list[str]
    extra_decoder_requests: int
    workdir: str
    kept_logs: bool
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        return (
            not self.interrupted
            and self.drive.all_verified
            and all(c["returncode"] == 0 for c in self.children)
            and (self.extra_decoder_requests > 0 or not any(c["extra"] for c in self.children))
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "interrupted": self.interrupted,
            "drive": self.drive.to_dict(),
            "children": self.children,
            "events": self.events,
            "extra_decoder_requests": self.extra_decoder_requests,
            "workdir": self.workdir if self.kept_logs else None,
        }


class Demo:
    """Lifecycle: ``start()`` -> ``start_driving()`` -> poll ``done()`` -> ``finish()``."""

    def __init__(self, cfg: DemoConfig) -> None:
        self.cfg = cfg
        self._own_dir = cfg.workdir is None
        self.workdir = Path(cfg.workdir or tempfile.mkdtemp(prefix="kvpush-demo-"))
        self.cluster = Cluster(cfg, self.workdir)
        self.prefill: Child | None = None
        self.decoders: list[Child] = []
        self.extra: Child | None = None
        self.events: list[str] = []
        self._extra_ready = threading.Event()
        self._extra_started = False
        self._driver: Driver | None = None
        self._thread: threading.Thread | None = None
        self._report: DriveReport | None = None
        self._error: BaseException | None = None
        self._stats_client: SideChannelClient | None = None
        self._t0 = time.monotonic()

    def _event(self, text: str) -> None:
        self.events.append(f"{time.monotonic() - self._t0:6.2f}s {text}")

    # ------------------------------------------------------------------ cluster
    def start(self) -> None:
        """Spawn P and the decoders in parallel and wait until all are ready."""
        self.prefill = self.cluster.spawn(Role.PREFILL, "p0", self.cfg.p_tp)
        self.decoders = [
            self.cluster.spawn(Role.DECODE, f"d{i}", self.cfg.d_tp)
            for i in range(self.cfg.decoders)
        ]
        for c in [self.prefill, *self.decoders]:
            self.cluster.wait_ready(c)
            self._event(f"{c.name} ({c.role}) ready on {c.address}")

    def _spawn_extra(self) -> None:
        try:
            child = self.cluster.spawn(Role.DECODE, f"d{self.cfg.decoders}", self.cfg.d_tp)
            self.extra = child
            self._event(f"{child.name} starting (mid-run)")
            self.cluster.wait_ready(child)
            assert self._driver is not None
            self._driver.add_decode(child.address)
            self._event(f"{child.name} ready on {child.address}: added to the rotation")
        except KvpushError as e:
            self._event(f"extra decoder failed: {e.message}")
        finally:
            self._extra_ready.set()

    def _before_request(self, i: int) -> None:
        n = self.cfg.requests
        if not self.cfg.extra_decoder or n < 3:
            return
        with self.cluster._lock:
            start_now = i >= n // 5 and not self._extra_started
            if start_now:
                self._extra_started = True
        if start_now:
            threading.Thread(target=self._spawn_extra, name="demo-extra-d", daemon=True).start()
        if i >= n // 2 and self._extra_started:
            # Hold the second half until the new D has joined, so that it takes traffic.
            self._extra_ready.wait(self.cfg.start_timeout_s)

    # ------------------------------------------------------------------ driving
    def start_driving(self, on_result: Callable[[RequestResult], None] | None = None) -> None:
        assert self.prefill is not None
        if self.interrupted:
            raise DemoInterrupted("demo interrupted before driving", "nothing was driven")
        cfg = DriveConfig(
            prefill=(self.prefill.address,),
            decode=tuple(c.address for c in self.decoders),
            requests=self.cfg.requests,
            concurrency=self.cfg.concurrency,
            blocks=self.cfg.blocks,
            timeout_s=self.cfg.timeout_s,
        )
        hooks = DriveHooks(on_result=on_result, before_request=self._before_request)
        self._driver = Driver(cfg, hooks)
        self._event(f"driving {self.cfg.requests} requests")

        def run() -> None:
            try:
                assert self._driver is not None
                self._report = self._driver.run()
            except BaseException as e:
                self._error = e

        self._thread = threading.Thread(target=run, name="demo-driver", daemon=True)
        self._thread.start()

    def done(self, timeout_s: float | None = 0.0) -> bool:
        assert self._thread is not None
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def progress(self) -> tuple[int, int, int, int]:
        """(done, ok, failed, decoders in rotation)."""
        if self._driver is None:
            return 0, 0, 0, len(self.decoders)
        done, ok, failed = self._driver.progress()
        return done, ok, failed, len(self._driver.decodes)

    @property
    def interrupted(self) -> bool:
        return self.cluster.cancelled.is_set()

    def cancel(self) -> None:
        """Stop: no more requests (in-flight ones get the driver's grace), no more waiting for a
        child to start. Safe from a signal handler (it only sets flags)."""
        self.cluster.cancelled.set()
        self._extra_ready.set()
        if self._driver is not None:
            self._driver.cancel()

    def prefill_stats(self, timeout_s: float = 1.0) -> dict[str, object] | None:
        """P's telemetry snapshot (StatsReq); None when it does not answer in time.

        Call from one thread only (the client it keeps is not thread-safe).
        """
        if self.prefill is None or not self.prefill.address:
            return None
        if self._stats_client is None:
            self._stats_client = control.connect(self.prefill.address, None, timeout_s)
        try:
            rep = self._stats_client.request(protocol.StatsReq())
        except KvpushError:
            return None
        return dict(rep.snapshot) if isinstance(rep, protocol.StatsRep) else None

    # ------------------------------------------------------------------ end
    def finish(self, keep_logs: bool | None = None) -> DemoReport:
        """Stop the children (SIGTERM, then SIGKILL) and build the report."""
        if self._thread is not None:
            self._thread.join()
        if self._stats_client is not None:
            self._stats_client.close()
        self.cluster.stop_all()
        self._event("endpoints stopped")
        if self._error is not None:
            raise self._error
        assert self._report is not None
        extra_addr = self.extra.address if self.extra else ""
        extra_n = self._report.by_decode.get(extra_addr, 0) if extra_addr else 0
        children: list[ChildRow] = [
            {
                "name": c.name,
                "role": c.role,
                "address": c.address,
                "returncode": c.returncode,
                "requests": self._report.by_decode.get(c.address, 0)
                if c.role == Role.DECODE
                else self._report.by_prefill.get(c.address, 0),
                "extra": c is self.extra,
                "log": str(c.log_path),
            }
            for c in self.cluster.children
        ]
        cut = self.interrupted
        report = DemoReport(
            self._report, children, self.events, extra_n, str(self.workdir), True, cut
        )
        failed = not report.ok and not cut  # an interrupt is not a failure: no logs kept for it
        keep = failed if keep_logs is None else (keep_logs or failed)
        if self._own_dir and not keep:
            shutil.rmtree(self.workdir, ignore_errors=True)
            report = DemoReport(
                self._report, children, self.events, extra_n, str(self.workdir), False, cut
            )
        return report

    def abort(self, keep_logs: bool = False) -> bool:
        """Cleanup after an error or an interrupt: stop every child; keep the logs after an
        error (or when asked), remove them after an interrupt. Returns whether they were kept."""
        interrupted = self.interrupted
        self.cancel()
        if self._stats_client is not None:
            self._stats_client.close()
            self._stats_client = None
        self.cluster.stop_all(timeout_s=10.0)
        keep = keep_logs or not interrupted
        if self._own_dir and not keep:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return keep or not self._own_dir


def run_demo(
    cfg: DemoConfig, on_result: Callable[[RequestResult], None] | None = None
) -> DemoReport:  # pragma: no cover - convenience for scripts
    demo = Demo(cfg)
    try:
        demo.start()
        demo.start_driving(on_result)
        demo.done(None)
        return demo.finish()
    except BaseException:
        demo.abort()
        raise


__all__ = [
    "Child",
    "Cluster",
    "Demo",
    "DemoConfig",
    "DemoModel",
    "DemoReport",
    "RequestResult",
    "run_demo",
]
