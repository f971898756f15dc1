"""The orchestrator's side of vLLM's pair in ``kvpush bench peer``: find the vLLM python, start
a P and a D ``driver.py``, run rounds through them, pause them between rounds, always stop them.

``vllm_python`` resolves ``--vllm-python``, then ``KVPUSH_VLLM_PYTHON``, else raises a
``ConfigError`` whose hint names ``scripts/vllm-venv.sh``. ``VllmPair`` is a context manager: on
exit every driver it started is resumed, asked to stop, and killed if it does not in time.
``pause``/``resume`` send SIGSTOP/SIGCONT to the pair's own process groups: vLLM's NIXL agent runs
NIXL's progress thread (vLLM's default), which spins a core per process even when idle, and
kvpush's rounds must not share this host's cores with it (kvpush's idle endpoints do not spin).

Threads: the caller's, and one reader thread per driver (resolves the answers' futures).
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from kvpush.commands.bench.peer_plan import PeerPlan
from kvpush.commands.bench.peer_vllm import DRIVER
from kvpush.commands.bench.rpc import LineRpc
from kvpush.commands.common import launch
from kvpush.commands.common.ports import free_port
from kvpush.errors import ConfigError

Json = dict[str, object]
START_TIMEOUT_S = 300.0  # importing vLLM takes 30-70 s here, more under load
VENV_HINT = "build it with scripts/vllm-venv.sh (it prints the python's path)"


def vllm_python(given: str | None) -> str:
    """The vLLM virtualenv's python: ``given`` (``--vllm-python``), else ``KVPUSH_VLLM_PYTHON``."""
    path = given or os.environ.get("KVPUSH_VLLM_PYTHON")
    if not path:
        raise ConfigError(
            "bench peer needs vLLM's python: pass --vllm-python PATH or set KVPUSH_VLLM_PYTHON",
            VENV_HINT,
        )
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise ConfigError(f"vLLM python {path} is not an executable file", VENV_HINT)
    return path


class Driver(LineRpc):
    """One ``driver.py`` process and its JSON-lines protocol (see the driver's docstring)."""

    def __init__(self, python: str, role: str, args: list[str], run_dir: Path) -> None:
        self.role = role
        self.log_path = run_dir / f"vllm-{role}.log"
        env = {
            k: v
            for k, v in launch.child_env(keep_kvpush=False, plain=True).items()
            if not k.startswith("VLLM_")
        }
        env.setdefault("NIXL_LOG_LEVEL", "WARN")
        cmd = [python, str(DRIVER), "--role", role, "--workdir", str(run_dir / f"vllm-{role}"),
               *args]  # fmt: skip
        popen = launch.spawn(cmd, self.log_path, env, piped=True, own_session=True)
        super().__init__(popen, self.log_path, f"vLLM {role} driver")

    def ready(self, timeout_s: float) -> Json:
        return self.started(timeout_s, reply=Json)

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)


class VllmPair:
    """vLLM P and D drivers at the plan's geometry, started together (their imports overlap)."""

    def __init__(self, python: str, plan: PeerPlan, run_dir: Path) -> None:
        self.python = python
        self.plan = plan
        self.run_dir = run_dir
        self.drivers: list[Driver] = []
        self.p_info: Json = {}
        self.d_info: Json = {}

    def __enter__(self) -> VllmPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def launch(self) -> None:
        """Start both drivers (not waiting: see ``wait_ready``)."""
        g, pl = self.plan.geometry, self.plan
        geo = ["--model-dir", str(self.run_dir / "vllm-model"), "--layers", str(g.layers),
               "--kv-heads", str(g.kv_heads), "--head-size", str(g.head_size),
               "--block-tokens", str(g.block_tokens), "--dtype", g.dtype,
               "--max-len", str(pl.max_len)]  # fmt: skip
        for role, blocks in (("P", pl.p_blocks), ("D", pl.d_blocks)):
            args = [*geo, "--num-blocks", str(blocks), "--port", str(free_port())]
            self.drivers.append(Driver(self.python, role, args, self.run_dir))

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        self.p_info = self.drivers[0].ready(timeout_s)
        self.d_info = self.drivers[1].ready(timeout_s)

    def pause(self) -> None:
        for d in self.drivers:
            d.signal(signal.SIGSTOP)

    def resume(self) -> None:
        for d in self.drivers:
            d.signal(signal.SIGCONT)

    def round(self, prefix: str, blocks: int, inflight: int, n: int, timeout_s: float) -> Json:
        """One closed-loop pass: P finishes ``{prefix}{i}`` ahead (at most twice ``inflight``
        finished and not yet sent), D registers them with ``inflight`` outstanding. D's answer
        (latencies, elapsed, CPU) with P's CPU seconds as ``p_cpu_s``."""
        p, d = self.drivers
        fp = p.call_async("serve", reply=Json, prefix=prefix, n=n, blocks=blocks,
                          ahead=2 * inflight, timeout_s=timeout_s)  # fmt: skip
        fd = d.call_async("run", reply=Json, p=self.p_info, prefix=prefix, n=n, blocks=blocks,
                          inflight=inflight, timeout_s=timeout_s)  # fmt: skip
        dr = d.result(fd, timeout_s + 30, "run")
        pr = p.result(fp, 60, "serve")
        return {**dr, "p_cpu_s": pr["cpu_s"]}

    def close(self) -> None:
        ds, self.drivers = self.drivers, []
        for d in ds:
            d.signal(signal.SIGCONT)  # a stopped process cannot take the stop command
            d.call_async("stop")
        launch.stop_all([d.popen for d in ds], lambda p: None, 20, group=True)
        for d in ds:
            launch.kill(d.popen, group=True)
            for s in (d.popen.stdin, d.popen.stdout):
                with contextlib.suppress(OSError):
                    if s is not None:
                        s.close()
