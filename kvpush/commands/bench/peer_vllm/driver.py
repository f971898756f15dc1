"""vLLM 0.33's own ``NixlPushConnector`` as one P or D engine, driven at rate for
``kvpush bench peer``; run by path with the vLLM virtualenv's python (imports the standard
library, torch and vllm only -- never kvpush).

One process per side, as an engine with UniProcExecutor: the connector's scheduler-side and
worker-side halves, a hand-built ``VllmConfig`` (a local ``config.json``, no weights, no
tokenizer, ``VLLM_TARGET_DEVICE=cpu``, layout ``LBHNC``), per layer one ``torch.zeros(num_blocks,
kv_heads, block_tokens, 2 * head_size)`` cache (one NIXL region per layer, K|V in each block). No
model forward: an engine step is the connector's part of one, stepped every ~1 ms while
requests are in flight (``STEP_GAP_S``). The CPU attention kernels want blocks of a
multiple of 32 tokens; none runs here, so smaller blocks are declared supported (the connector
is unchanged).

Protocol: JSON lines; ``{"id", "cmd", "args"}`` in on stdin, one ``{"id", "ok", "result" |
"error"}`` out per command on a private copy of stdout (fd 1 goes to stderr). ``id`` 0 answers
first, once the side-channel listener is up, with ``info``. ``serve`` (P), ``run`` (D), ``stop``;
EOF on stdin stops too, and the kernel sends SIGTERM when the parent dies.

Threads: the main thread runs the engine loop and the commands (generators advanced once per
step); one thread reads stdin; vLLM's own (listener, writer, handshake executor, NIXL progress).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import queue
import resource
import signal
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Generator
from typing import IO

Result = dict[str, object]
Job = Generator[None, None, Result]
P_SUFFIX, D_SUFFIX = "-0000aaaa", "-1111bbbb"  # one base id, two of vLLM's -<8 hex> suffixes
IDLE_WAIT_S = 0.02
#: A pause between two engine steps: back to back, the engine loop starves vLLM's writer thread
#: of the GIL (a WRITE submission of 2048 descriptors then took seconds); 1 ms gave 2-10x the rate.
STEP_GAP_S = 0.001


def cpu_s() -> float:
    """This process's CPU seconds, every thread (vLLM's writer and NIXL's included)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def request_ids(prefix: str, i: int) -> tuple[str, str]:
    base = f"bench-{prefix}{i}"
    return base + P_SUFFIX, base + D_SUFFIX


class Wire:
    """The answer channel: a private handle on the original stdout, one line per answer."""

    def __init__(self) -> None:
        self._out: IO[str] = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        self._lock = threading.Lock()

    def send(self, mid: object, ok: bool, body: object) -> None:
        msg = {"id": mid, "ok": ok, "result" if ok else "error": body}
        with self._lock:
            self._out.write(json.dumps(msg, separators=(",", ":")) + "\n")
            self._out.flush()


def write_model_dir(a: argparse.Namespace) -> str:
    """A Llama ``config.json`` of the geometry. Its path is part of vLLM's compatibility hash:
    P and D are given the same directory."""
    heads = max(4, a.kv_heads)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": heads * a.head_size, "intermediate_size": 2 * heads * a.head_size,
        "num_attention_heads": heads, "num_key_value_heads": a.kv_heads,
        "head_dim": a.head_size, "num_hidden_layers": a.layers, "vocab_size": 128,
        "max_position_embeddings": a.max_len, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "torch_dtype": a.dtype, "bos_token_id": 1, "eos_token_id": 2,
        "tie_word_embeddings": False,
    }  # fmt: skip
    os.makedirs(a.model_dir, exist_ok=True)
    path = os.path.join(a.model_dir, "config.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(cfg, f)
    os.replace(tmp, path)
    return os.path.abspath(str(a.model_dir))


def allow_block_tokens(tokens: int) -> None:
    """Let the CPU backend accept ``tokens``-token blocks (see the module docstring)."""
    if tokens % 32 == 0:
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    def sizes(kv_cache_spec: object = None) -> list[int]:
        return [tokens]

    CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(sizes)


class Engine:
    """One rank's scheduler- and worker-side connector, stepped by ``run``."""

    def __init__(self, a: argparse.Namespace) -> None:
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import connector as nixl

        self.a = a
        self.engine_id = f"vllm-bench-{a.role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(a.layers)]
        allow_block_tokens(a.block_tokens)
        self.vc = self._config(write_model_dir(a))
        self._init_dist()
        dtype = getattr(torch, a.dtype)
        kvcfg = self._kv_cache_config(dtype)
        self._cfg_ctx = set_current_vllm_config(self.vc)
        self._cfg_ctx.__enter__()
        self.sched = nixl.NixlPushConnector(self.vc, KVConnectorRole.SCHEDULER, kvcfg)
        self.work = nixl.NixlPushConnector(self.vc, KVConnectorRole.WORKER, kvcfg)
        shape = (a.num_blocks, a.kv_heads, a.block_tokens, 2 * a.head_size)
        self.caches = {n: torch.zeros(shape, dtype=dtype) for n in self.layer_names}
        self.work.register_kv_caches(self.caches)
        md = self.work.get_handshake_metadata()
        self.sched.set_xfer_handshake_metadata_pp_aware({(0, 0): md})
        self.sent: set[str] = set()
        self.recvd: dict[str, float] = {}  # request id -> when a step reported it
        self.failed: set[str] = set()
        self.jobs: dict[object, Job] = {}
        self.stopping = False

    # ------------------------------------------------------------------ set-up
    def _config(self, model_dir: str) -> object:
        import vllm.config as c

        a = self.a
        mc = c.ModelConfig(
            model=model_dir, skip_tokenizer_init=True, dtype=a.dtype, max_model_len=a.max_len,
            seed=0,
        )  # fmt: skip
        sc = c.SchedulerConfig(
            max_num_seqs=256, max_num_batched_tokens=a.max_len, max_model_len=a.max_len,
            is_encoder_decoder=False,
        )  # fmt: skip
        kvt = c.KVTransferConfig(
            kv_connector="NixlPushConnector",
            kv_role="kv_producer" if a.role == "P" else "kv_consumer",
            kv_buffer_device="cpu",
            engine_id=self.engine_id,
            kv_connector_extra_config={"kv_lease_duration": a.lease},
        )
        vc = c.VllmConfig(
            model_config=mc, scheduler_config=sc,
            cache_config=c.CacheConfig(block_size=a.block_tokens, cache_dtype="auto"),
            kv_transfer_config=kvt, device_config=c.DeviceConfig("cpu"),
            parallel_config=c.ParallelConfig(tensor_parallel_size=1, pipeline_parallel_size=1),
        )  # fmt: skip
        # The engine core resolves the layout; vLLM's own unit tests set it by hand like this.
        vc.cache_config.kv_cache_layout = "LBHNC"
        return vc

    def _init_dist(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel

        init_file = os.path.join(self.a.workdir, f"dist_init.{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            os.remove(init_file)
        with set_current_vllm_config(self.vc):
            init_distributed_environment(
                world_size=1, rank=0, distributed_init_method=f"file://{init_file}",
                local_rank=0, backend="gloo",
            )  # fmt: skip
            initialize_model_parallel(1, 1)

    def _kv_cache_config(self, dtype: object) -> object:
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        a = self.a
        spec = FullAttentionSpec(
            block_size=a.block_tokens, num_kv_heads=a.kv_heads, head_size=a.head_size, dtype=dtype
        )
        return KVCacheConfig(
            num_blocks=a.num_blocks,
            kv_cache_tensors=[],  # only the model runner reads this
            kv_cache_groups=[KVCacheGroupSpec(list(self.layer_names), spec)],
        )

    def info(self) -> Result:
        import vllm

        w = self.work.connector_worker
        return {
            "role": self.a.role, "engine_id": self.engine_id, "host": "127.0.0.1",
            "port": self.a.port, "pid": os.getpid(), "vllm_version": vllm.__version__,
            "block_lens": list(w.block_len_per_layer), "num_blocks": self.a.num_blocks,
            "block_tokens": self.a.block_tokens, "layers": self.a.layers,
            "backend": w.backend_name, "kv_cache_layout": w.kv_cache_layout,
        }  # fmt: skip

    # ------------------------------------------------------------------ engine
    def step(self) -> None:
        """One engine step's connector part, as the Scheduler and the model runner call it."""
        from vllm.v1.outputs import KVConnectorOutput

        meta = self.sched.build_connector_meta(None)
        self.work.bind_connector_metadata(meta)
        self.work.start_load_kv(None)
        res = self.work.get_transfer_results(set())
        self.work.clear_connector_metadata()
        out = KVConnectorOutput(
            finished_sending=res.finished_sending,
            finished_recving=res.finished_recving,
            failed_recving=res.failed_recving,
        )
        self.sched.update_connector_output(out)
        now = time.perf_counter()
        self.sent |= set(out.finished_sending or ())
        for rid in out.finished_recving or ():
            self.recvd[rid] = now
        self.failed |= set(out.failed_recving or ())

    def run(self, inbox: queue.Queue[dict[str, object] | None], wire: Wire) -> None:
        while not self.stopping:
            self._take(inbox, wire, block=not self.jobs)
            self.step()
            for mid, job in list(self.jobs.items()):
                try:
                    next(job)
                except StopIteration as done:
                    del self.jobs[mid]
                    wire.send(mid, True, done.value)
                except Exception as e:  # reported to the orchestrator, which raises it
                    del self.jobs[mid]
                    wire.send(mid, False, f"{type(e).__name__}: {e}")
            time.sleep(STEP_GAP_S)  # vLLM's writer thread needs the GIL between two steps

    def _take(self, inbox: queue.Queue[dict[str, object] | None], wire: Wire, block: bool) -> None:
        while True:
            try:
                msg = inbox.get(timeout=IDLE_WAIT_S) if block else inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if msg is None or msg.get("cmd") == "stop":
                self.stopping = True
                if msg is not None:
                    wire.send(msg.get("id"), True, {"stopped": True})
                return
            kw = args if isinstance(args := msg.get("args"), dict) else {}
            cmds: dict[str, Callable[..., Job]] = {"serve": self.serve, "run": self.decode_run}
            fn = cmds.get(str(msg.get("cmd")))
            try:
                if fn is None:
                    raise ValueError(f"unknown command {msg.get('cmd')!r}")
                self.jobs[msg.get("id")] = fn(**kw)
            except (ValueError, TypeError) as e:
                wire.send(msg.get("id"), False, f"{type(e).__name__}: {e}")

    def shutdown(self) -> None:
        self.work.shutdown()
        self.sched.shutdown()

    # ------------------------------------------------------------------ requests
    @staticmethod
    def kv_blocks(ids: list[int]) -> object:
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        return KVCacheBlocks((tuple(KVCacheBlock(i) for i in ids),))

    def _admit(
        self, rid: str, params: dict[str, object], ids: list[int], max_tokens: int
    ) -> object:
        """What the scheduler does when it schedules a request: the connector learns of it,
        says how many tokens are external, and gets the blocks allocated for it."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        req = Request(
            request_id=rid,
            prompt_token_ids=list(range(len(ids) * self.a.block_tokens)),
            sampling_params=SamplingParams(
                max_tokens=max_tokens, extra_args={"kv_transfer_params": params}
            ),
            pooling_params=None,
        )
        self.sched.on_new_request(req)
        n_ext, _ = self.sched.get_num_new_matched_tokens(req, 0)
        self.sched.update_state_after_alloc(req, self.kv_blocks(ids), n_ext)
        return req

    def _finish_p(self, req: object, ids: list[int]) -> None:
        """P's model has produced the request's KV: the request ends (length-capped) and the
        connector keeps its blocks for the push."""
        from vllm.v1.request import RequestStatus

        req.num_computed_tokens = len(ids) * self.a.block_tokens  # type: ignore[attr-defined]
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED  # type: ignore[attr-defined]
        self.sched.request_finished_all_groups(req, (list(ids),))

    # ------------------------------------------------------------------ P
    def serve(self, prefix: str, n: int, blocks: int, ahead: int, timeout_s: float = 300.0) -> Job:
        """Finish ``n`` requests, at most ``ahead`` finished and not yet sent at once, as fast
        as the pool allows; free each one's blocks when vLLM reports it sent."""
        free = deque(range(self.a.num_blocks))
        admitted: list[tuple[str, object, list[int]]] = []
        waiting: dict[str, list[int]] = {}
        done = i = 0
        cpu0, t0 = cpu_s(), time.perf_counter()
        deadline = t0 + timeout_s
        while done < n:
            for rid in [r for r in waiting if r in self.sent]:
                free.extend(waiting.pop(rid))
                self.sent.discard(rid)
                done += 1
            for rid, req, ids in admitted:  # admitted on the previous step: now finished
                self._finish_p(req, ids)
                waiting[rid] = ids
            admitted = []
            while i < n and len(free) >= blocks and len(waiting) + len(admitted) < ahead:
                rid = request_ids(prefix, i)[0]
                ids = [free.popleft() for _ in range(blocks)]
                req = self._admit(
                    rid, {"do_remote_decode": True, "do_remote_prefill": False}, ids, 1
                )
                admitted.append((rid, req, ids))
                i += 1
            if time.perf_counter() > deadline:
                raise TimeoutError(f"P: {done}/{n} sent within {timeout_s:g}s")
            yield
        return {"n": n, "elapsed_s": time.perf_counter() - t0, "cpu_s": cpu_s() - cpu0}

    # ------------------------------------------------------------------ D
    def decode_run(
        self, p: dict[str, object], prefix: str, n: int, blocks: int, inflight: int,
        timeout_s: float = 300.0,
    ) -> Job:  # fmt: skip
        """Register ``n`` requests with P, ``inflight`` outstanding; each one's latency runs from
        its registration (``update_state_after_alloc``) to the step that reports it received."""
        free = deque(range(self.a.num_blocks))
        active: dict[str, tuple[object, list[int], float]] = {}
        lat: list[float] = []
        failed = i = 0
        cpu0, t0 = cpu_s(), time.perf_counter()
        deadline = t0 + timeout_s
        while len(lat) + failed < n:
            for rid in [r for r in active if r in self.recvd or r in self.failed]:
                req, ids, t_reg = active.pop(rid)
                if rid in self.failed:
                    failed += 1
                else:
                    lat.append(self.recvd[rid] - t_reg)
                self.recvd.pop(rid, None)
                self.failed.discard(rid)
                self.sched.request_finished(req, (list(ids),))  # the request ends (the engine's)
                free.extend(ids)
            while i < n and len(active) < inflight and len(free) >= blocks:
                p_id, d_id = request_ids(prefix, i)
                params = {
                    "do_remote_prefill": True, "do_remote_decode": False,
                    "remote_engine_id": p["engine_id"], "remote_request_id": p_id,
                    "remote_host": p["host"], "remote_port": p["port"],
                    "tp_size": 1, "pp_size": 1, "transfer_mode": "push",
                }  # fmt: skip
                ids = [free.popleft() for _ in range(blocks)]
                t_reg = time.perf_counter()
                active[d_id] = (self._admit(d_id, params, ids, 4), ids, t_reg)
                i += 1
            if time.perf_counter() > deadline:
                raise TimeoutError(f"D: {len(lat)}/{n} received within {timeout_s:g}s")
            yield
        return {"n": n, "ok": len(lat), "failed": failed, "latency_s": lat,
                "elapsed_s": time.perf_counter() - t0, "cpu_s": cpu_s() - cpu0}  # fmt: skip


def read_commands(inbox: queue.Queue[dict[str, object] | None], wire: Wire) -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
        except ValueError as e:
            wire.send(None, False, f"unreadable command: {e}")
            continue
        inbox.put(msg if isinstance(msg, dict) else None)
    inbox.put(None)  # EOF: the orchestrator is done or gone


GEOMETRY_FLAGS = (("--layers", 8), ("--kv-heads", 2), ("--head-size", 64), ("--block-tokens", 16),
                  ("--num-blocks", 1024), ("--max-len", 8192), ("--lease", 120))  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """--max-len is vLLM's max_model_len (tokens), --lease its kv_lease_duration (s); P and D
    are given the same --model-dir (its config.json is written there)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--role", choices=["P", "D"], required=True)
    ap.add_argument("--port", type=int, required=True, help="side-channel port")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float16")
    for flag, default in GEOMETRY_FLAGS:
        ap.add_argument(flag, type=int, default=default)
    return ap.parse_args(argv)


def main() -> int:
    a = parse_args()
    with contextlib.suppress(OSError):  # Linux: SIGTERM when the orchestrator exits
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    wire = Wire()
    os.makedirs(a.workdir, exist_ok=True)
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(a.port)
    try:
        eng = Engine(a)
    except Exception as e:
        wire.send(0, False, f"start-up failed: {type(e).__name__}: {e}")
        raise
    # No signal handler (only StopFlag installs them): stop command, else SIGKILL/SIGTERM.
    inbox: queue.Queue[dict[str, object] | None] = queue.Queue()
    threading.Thread(target=read_commands, args=(inbox, wire), daemon=True).start()
    wire.send(0, True, eng.info())
    eng.run(inbox, wire)
    eng.shutdown()
    return 0


if __name__ == "__main__":
    rc = main()
    # The connector is shut down; what is left is NIXL/UCX, gloo and torch teardown (seconds
    # under load, nothing observable): skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
