"""A long-running vLLM P or D "engine" around vLLM's real ``NixlPushConnector``, driven by files.

Runs inside the vLLM virtualenv (``scripts/vllm-venv.sh``), never in the project's: it imports
vLLM, torch, msgspec and numpy, and this directory's ``wiretap``. One process serves many
requests because importing vLLM takes seconds. Adapted from the team's vllm-harness
(``pd_push.py``): per process it does what an engine does for one rank with UniProcExecutor::

    sched = NixlPushConnector(cfg, SCHEDULER, kv_cache_config)
    work  = NixlPushConnector(cfg, WORKER,    kv_cache_config)
    work.register_kv_caches(caches)                      # NIXL registration + metadata
    sched.set_xfer_handshake_metadata_pp_aware({(pp, tp): work.get_handshake_metadata()})
    engine step: meta = sched.build_connector_meta(None); work.bind_connector_metadata(meta)
                 work.start_load_kv(None); res = work.get_transfer_results(set())
                 work.clear_connector_metadata(); sched.update_connector_output(res)

No model weights: a minimal ``VllmConfig`` from ``tinyllama/config.json`` (or one written for
another geometry into ``--model-dir``), ``VLLM_TARGET_DEVICE=cpu``, the ``CPU_ATTN`` backend,
layout ``LBHNC`` set by hand, per layer a ``torch.zeros(num_blocks, kv_heads, block_size,
2 * head_size)`` cache: one NIXL region per layer with K|V inside each block.

Files in ``--workdir`` W (every JSON file is written to a temporary name and renamed):

- ``W/info.json`` once the side-channel listener is up: who this engine is (engine id, port,
  compatibility hash, agent name, block_lens/strides, geometry, pid...).
- ``W/status.json`` every ~0.2 s: ``listener_alive``, ``writer_alive``, ``steps``,
  ``engine_error`` (repr of an exception raised by an engine step; the process then exits 3,
  as a dead engine would), ``time``, the active commands.
- ``W/cmd/<id>.json`` commands (written by the test); the answer goes to ``W/out/<id>.json``.
  ``prefill`` (P), ``decode`` (D) and ``stop``; see ``PrefillJob`` / ``DecodeJob``. Commands
  run concurrently: each is a generator advanced once per engine step.
- ``W/wire.jsonl``: every NIXL notification, transfer and agent load (``wiretap``), plus
  ``push_write`` (P posts a request's WRITE) and ``lease_expired`` records.
- At ``--tp-size`` N > 1 (a P or a D): one process per rank, all given the same
  ``--engine-id``, ``--port`` and ``--dist-port``; rank 0 is the engine above, rank r > 0 keeps
  its ``status.json`` and ``wire.jsonl`` in ``W/rank<r>/`` (see ``Engine``).

sha256 of a request (P: what it filled, D: what landed), the definition kvpush shares: over the
bytes of the request's blocks, region by region in region (= layer) order, and within a region
the blocks in the request's ``blocks`` order, each block's bytes as laid out in memory
(``cache[layer][block]``, contiguous). A P at TP > 1 reports the digest of its pattern over all
heads: what a TP-1 D holds once every rank has written its heads; a D at TP > 1 reports the
digest of what all its ranks hold together (each block's heads in rank order), the same bytes.

Exit status: 0 after ``stop`` or SIGTERM/SIGINT (an orderly vLLM shutdown, then ``os._exit``),
3 after an engine error, 4 when ``--port`` is taken, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import signal
import socket
import sys
import time
import traceback
import uuid
from collections.abc import Generator
from dataclasses import asdict, dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MODEL_DIR = os.path.join(HERE, "tinyllama")
STATUS_INTERVAL_S = 0.2
SENTINEL = -1.0  # D clears its blocks to this before registering them: stale bytes never pass

# One step of a command's generator; the main loop steps the engine between two of them.
Job = Generator[None, None, dict[str, Any]]


def write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def _s(x: Any) -> Any:
    return x.decode() if isinstance(x, (bytes, bytearray)) else x


@dataclass(frozen=True)
class Geometry:
    layers: int = 2
    kv_heads: int = 2
    head_size: int = 16
    block_size: int = 32  # tokens; CPU_ATTN needs a multiple of 32
    num_blocks: int = 16
    dtype: str = "float32"
    kv_cache_layout: str = "LBHNC"

    @property
    def layer_names(self) -> list[str]:
        return [f"model.layers.{i}.self_attn.attn" for i in range(self.layers)]


@dataclass(frozen=True)
class Parallel:
    """This process's rank. PP is 1; a P or a D may run at TP > 1 (one process per rank, see
    ``Engine``)."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0

    @property
    def lead(self) -> bool:
        """Rank 0: the one with the scheduler, the listener and the commands."""
        return self.tp_rank == 0

    def check(self, role: str, kv_heads: int) -> None:
        if self.pp_size != 1:
            raise SystemExit("peer.py: only --pp-size 1 is supported")
        if not 0 <= self.tp_rank < self.tp_size:
            raise SystemExit(f"peer.py: --tp-rank {self.tp_rank} not in 0..{self.tp_size - 1}")
        if self.tp_size > 1 and kv_heads % self.tp_size:
            raise SystemExit("peer.py: --tp-size > 1 needs kv_heads % tp == 0")


def model_dir_for(geo: Geometry, given: str | None) -> str:
    """The model directory handed to vLLM. Its path is part of vLLM's compatibility hash: a P
    and a D must be given the same one. A non-default geometry needs an explicit ``--model-dir``
    (shared by both sides); its ``config.json`` is (re)written to match the geometry."""
    with open(os.path.join(DEFAULT_MODEL_DIR, "config.json")) as f:
        cfg = json.load(f)
    want = {
        "num_hidden_layers": geo.layers,
        "num_key_value_heads": geo.kv_heads,
        "head_dim": geo.head_size,
        "torch_dtype": geo.dtype,
    }
    if given is None:
        if any(cfg[k] != v for k, v in want.items()):
            raise SystemExit(
                "peer.py: this geometry differs from tests/vllm/tinyllama/config.json; pass "
                "--model-dir DIR (the same for P and D): config.json is written there"
            )
        return DEFAULT_MODEL_DIR
    cfg.update(want)
    cfg["num_attention_heads"] = max(cfg["num_attention_heads"], geo.kv_heads)
    cfg["hidden_size"] = cfg["num_attention_heads"] * geo.head_size
    os.makedirs(given, exist_ok=True)
    write_json(os.path.join(given, "config.json"), cfg)
    return os.path.abspath(given)


class Engine:
    """vLLM's scheduler- and worker-side connector of one rank, stepped by ``run``.

    At TP > 1 there is one process per rank, as vLLM's multiprocess executor has one worker per
    rank: rank 0 (the lead) also owns the scheduler connector (its listener serves every rank's
    handshake metadata, gathered from the ranks over the gloo world group at start) and the
    commands; every engine step it broadcasts the connector metadata (and the per-rank work of
    the commands, e.g. filling a prefill's blocks) to the other ranks, each rank runs its
    worker connector, and the lead aggregates their ``KVConnectorOutput`` s with vLLM's own
    ``KVOutputAggregator`` (a request is finished when every rank says so). Rank r > 0 writes
    ``status.json`` and ``wire.jsonl`` into ``W/rank<r>/`` and runs ``follow``. Each rank holds
    ``kv_heads / tp`` heads; the prefill pattern is defined over all heads, rank r holding heads
    ``[r*h, (r+1)*h)``, so a TP-1 D that receives from every rank holds the TP-1 pattern.
    """

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.role: str = a.role
        self.wd: str = a.workdir
        self.geo = Geometry(
            layers=a.layers,
            kv_heads=a.kv_heads,
            head_size=a.head_size,
            block_size=a.block_size,
            num_blocks=a.num_blocks,
            dtype=a.dtype,
        )
        self.par = Parallel(tp_size=a.tp_size, tp_rank=a.tp_rank)
        self.par.check(self.role, self.geo.kv_heads)
        self.heads = self.geo.kv_heads // self.par.tp_size  # this rank's
        if not self.par.lead and not a.engine_id:
            raise SystemExit("peer.py: --tp-rank > 0 needs the lead's --engine-id")
        self.engine_id: str = a.engine_id or f"vllm-{a.role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # This rank's files: the lead's are W itself, another rank's W/rank<r>/.
        self.rwd = self.wd if self.par.lead else os.path.join(self.wd, f"rank{self.par.tp_rank}")
        os.makedirs(self.rwd, exist_ok=True)
        for d in ("cmd", "out", os.path.join("cmd", "taken")) if self.par.lead else ():
            os.makedirs(os.path.join(self.wd, d), exist_ok=True)

        import torch
        import wiretap
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
            NixlPushConnector,
        )

        self.torch = torch
        self.dtype = getattr(torch, self.geo.dtype)
        # Largest integer every value of the pattern stays below: exact in the dtype.
        self.modulus = {"float32": 1 << 24, "float16": 1 << 11, "bfloat16": 1 << 8}[self.geo.dtype]
        self.model_dir = model_dir_for(self.geo, a.model_dir)
        self.vc = self._vllm_config()
        self._init_dist()
        kvcfg = self._kv_cache_config()
        self._cfg_ctx = set_current_vllm_config(self.vc)
        self._cfg_ctx.__enter__()
        self.sched: Any = (
            NixlPushConnector(self.vc, KVConnectorRole.SCHEDULER, kvcfg) if self.par.lead else None
        )
        self.work = NixlPushConnector(self.vc, KVConnectorRole.WORKER, kvcfg)
        self.w: Any = self.work.connector_worker
        self.s: Any = self.sched.connector_scheduler if self.sched is not None else None
        self.tap = wiretap.install(self.w, os.path.join(self.rwd, "wire.jsonl"), self.role)
        self._observe_vllm_state()
        g = self.geo
        self.caches = {
            n: torch.zeros(
                g.num_blocks, self.heads, g.block_size, 2 * g.head_size, dtype=self.dtype
            )
            for n in g.layer_names
        }
        self.work.register_kv_caches(self.caches)
        rank_md = self.gather(self.work.get_handshake_metadata())  # every rank's, on the lead
        if self.sched is not None:
            self.sched.set_xfer_handshake_metadata_pp_aware(
                {(self.par.pp_rank, r): md for r, md in enumerate(rank_md)}
            )
        self.rank_work: list[tuple[Any, ...]] = []  # the lead's: for the other ranks, next step
        self.aggregator: Any = None
        if self.par.tp_size > 1:
            from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

            self.aggregator = KVOutputAggregator(expected_finished_count=self.par.tp_size)
        # Results of engine steps not yet consumed by a command, by request id.
        self.sent: set[str] = set()
        self.recvd: set[str] = set()
        self.failed: set[str] = set()
        self.expired: set[str] = set()  # P: leases vLLM reaped (no WRITE done in time)
        self.writes: dict[str, dict[str, Any]] = {}  # P: request id -> the WRITE vLLM posted
        self.jobs: dict[str, Job] = {}
        self.steps = 0
        self.engine_error: str | None = None
        self.stopping = False
        self._last_status = 0.0

    # ------------------------------------------------------------------ set-up
    def _vllm_config(self) -> Any:
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            VllmConfig,
        )

        mc = ModelConfig(
            model=self.model_dir,
            skip_tokenizer_init=True,
            dtype=self.geo.dtype,
            max_model_len=256,
            seed=0,
        )
        sc = SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=256,
            max_model_len=256,
            is_encoder_decoder=False,
        )
        cc = CacheConfig(block_size=self.geo.block_size, cache_dtype="auto")
        kvt = KVTransferConfig(
            kv_connector="NixlPushConnector",
            kv_role="kv_producer" if self.role == "P" else "kv_consumer",
            kv_buffer_device="cpu",
            engine_id=self.engine_id,
            kv_connector_extra_config={"kv_lease_duration": self.a.lease},
        )
        vc = VllmConfig(
            model_config=mc,
            scheduler_config=sc,
            cache_config=cc,
            kv_transfer_config=kvt,
            device_config=DeviceConfig("cpu"),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.par.tp_size, pipeline_parallel_size=self.par.pp_size
            ),
        )
        # Normally resolved by the engine core (resolve_kv_cache_layout); vLLM's own unit
        # tests set it by hand the same way.
        vc.cache_config.kv_cache_layout = self.geo.kv_cache_layout
        return vc

    def _init_dist(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel

        if self.par.tp_size > 1:
            # Ranks in several processes meet at the lead's TCP store (the harness picks
            # the port); a file store would race with its own clean-up.
            method = f"tcp://127.0.0.1:{self.a.dist_port}"
        else:
            init_file = os.path.join(self.wd, "dist_init")
            if os.path.exists(init_file):
                os.remove(init_file)
            method = f"file://{init_file}"
        with set_current_vllm_config(self.vc):
            init_distributed_environment(
                world_size=self.par.tp_size * self.par.pp_size,
                rank=self.par.pp_rank * self.par.tp_size + self.par.tp_rank,
                distributed_init_method=method,
                local_rank=self.par.tp_rank,
                backend="gloo",
            )
            initialize_model_parallel(self.par.tp_size, self.par.pp_size)

    def _kv_cache_config(self) -> Any:
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        g = self.geo
        spec = FullAttentionSpec(
            block_size=g.block_size,
            num_kv_heads=self.heads,
            head_size=g.head_size,
            dtype=self.dtype,
        )
        return KVCacheConfig(
            num_blocks=g.num_blocks,
            kv_cache_tensors=[],  # only the model runner reads this
            kv_cache_groups=[KVCacheGroupSpec(list(g.layer_names), spec)],
        )

    def _observe_vllm_state(self) -> None:
        """Record two vLLM decisions the NIXL calls alone do not name: which P request a WRITE
        belongs to, and which leases expired. Both wrappers call the original unchanged."""
        w, rec = self.w, self.tap.rec
        o_xfer_req = w._xfer_blocks_for_req
        o_reap = w._reap_expired_send_leases

        def xfer_blocks_for_req(req_id: str, meta: Any) -> Any:
            d = {
                "request_id": req_id,
                "d_engine_id": meta.remote.engine_id,
                "d_request_id": meta.remote.request_id,
                "local_block_ids": [list(g) for g in meta.local_physical_block_ids],
                "remote_block_ids": [list(g) for g in meta.remote.block_ids],
            }
            self.writes[req_id] = d  # a dict store: safe from the writer thread
            rec("push_write", **d)
            return o_xfer_req(req_id=req_id, meta=meta)

        def reap_expired_send_leases(done_sending: set[str]) -> None:
            before = set(done_sending)
            o_reap(done_sending)
            for rid in sorted(done_sending - before):
                self.expired.add(rid)
                rec("lease_expired", request_id=rid)

        w._xfer_blocks_for_req = xfer_blocks_for_req
        w._reap_expired_send_leases = reap_expired_send_leases

    def info(self) -> dict[str, Any]:
        import msgspec
        import vllm

        w = self.w
        payload = w.xfer_handshake_metadata
        md = msgspec.msgpack.decode(payload.agent_metadata_bytes)
        md_fields = {
            k: (f"<{len(v)} bytes>" if isinstance(v, bytes) else v)
            for k, v in md.items()
            if k != "agent_metadata"
        }
        return {
            "role": self.role,
            "engine_id": self.engine_id,
            "host": "127.0.0.1",
            "port": self.a.port,
            "address": f"127.0.0.1:{self.a.port}",
            "compat_hash": w.compat_hash,
            "agent": _s(w.nixl_wrapper.name),
            "block_lens": list(w.block_len_per_layer),
            "block_strides": list(w.block_stride_per_layer or []),
            "num_blocks": w.num_blocks,
            "kv_caches_base_addr": list(w.kv_caches_base_addr[self.engine_id][self.par.tp_rank]),
            "layer_names": self.geo.layer_names,
            "dtype": self.geo.dtype,
            "block_size": self.geo.block_size,
            "kv_heads": self.geo.kv_heads,
            "head_size": self.geo.head_size,
            "kv_cache_layout": w.kv_cache_layout,
            "backend": w.backend_name,
            "lease": self.a.lease,
            "heartbeat_interval": self.s._heartbeat_interval if self.s is not None else None,
            "heads_per_rank": self.heads,
            "tp_size": self.par.tp_size,
            "tp_rank": self.par.tp_rank,
            "pp_size": self.par.pp_size,
            "pp_rank": self.par.pp_rank,
            "model": self.model_dir,
            "vllm_version": vllm.__version__,
            "agent_metadata": md_fields,
            "geometry": asdict(self.geo),
            "pid": os.getpid(),
        }

    # ------------------------------------------------------------------ engine
    def step(self) -> None:
        """One engine step, as KVConnectorModelRunnerMixin and the Scheduler do it (the lead;
        at TP > 1 every other rank runs its worker half in ``follow``)."""
        meta = self.sched.build_connector_meta(None)
        work, self.rank_work = self.rank_work, []
        self.broadcast([meta, work])
        out = self.worker_step(meta)
        outs = self.gather(out)
        if self.aggregator is not None:
            from vllm.v1.outputs import ModelRunnerOutput

            for r, o in enumerate(outs):
                if isinstance(o, str):
                    raise RuntimeError(f"rank {r}: {o}")
            agg = self.aggregator.aggregate(
                [
                    ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=o)
                    for o in outs
                ]
            )
            out = agg.kv_connector_output
        self.sched.update_connector_output(out)
        self.steps += 1
        self.sent |= set(out.finished_sending or ())
        self.recvd |= set(out.finished_recving or ())
        self.failed |= set(out.failed_recving or ())

    def worker_step(self, meta: Any) -> Any:
        """This rank's worker half of an engine step: its ``KVConnectorOutput``."""
        from vllm.v1.outputs import KVConnectorOutput

        self.work.bind_connector_metadata(meta)
        self.work.start_load_kv(None)
        res = self.work.get_transfer_results(set())
        self.work.clear_connector_metadata()
        return KVConnectorOutput(
            finished_sending=res.finished_sending,
            finished_recving=res.finished_recving,
            failed_recving=res.failed_recving,
        )

    # ------------------------------------------------------------------ TP > 1
    def broadcast(self, obj: list[Any]) -> list[Any]:
        """The lead's ``obj`` on every rank (gloo world group); a no-op at TP 1."""
        if self.par.tp_size > 1:
            import torch.distributed as dist

            dist.broadcast_object_list(obj, src=0)
        return obj

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on the lead (``[]`` elsewhere); ``[obj]`` at TP 1."""
        if self.par.tp_size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.par.tp_size if self.par.lead else None
        dist.gather_object(obj, out, dst=0)
        return out or []

    def follow(self) -> int:
        """Rank r > 0: the worker half of every engine step the lead broadcasts, until it
        says stop. An error is handed to the lead (whose engine then dies) before exiting 3."""
        self.write_status()
        while True:
            got: list[Any] = self.broadcast([None, None])
            meta, work = got
            if any(w[0] == "stop" for w in work):
                break
            try:
                self.do_rank_work(work)
                out: Any = self.worker_step(meta)
            except Exception as e:
                traceback.print_exc()
                self.engine_error = repr(e)
                out = repr(e)
            self.gather(out)
            self.steps += 1
            if self.engine_error is not None:
                self.write_status(final=True)
                os._exit(3)
            if time.monotonic() - self._last_status >= STATUS_INTERVAL_S:
                self.write_status()
        self.work.shutdown()
        self.write_status(final=True)
        self.tap.close()
        print(f"[{self.role} rank {self.par.tp_rank}] shut down after {self.steps} steps")
        return 0

    def do_rank_work(self, work: list[tuple[Any, ...]]) -> None:
        """Rank r > 0: the lead's work for this rank, before this step's worker half."""
        if work and self.a.rank_work_delay:
            time.sleep(self.a.rank_work_delay)  # a slow rank (see the flag)
        for w in work:
            if w[0] == "fill":
                self.fill(int(w[1]), list(w[2]))
            elif w[0] == "clear":
                self.clear(list(w[1]))
            elif w[0] == "dump":
                self.dump(str(w[1]), list(w[2]))

    def status(self, final: bool = False) -> dict[str, Any]:
        lt = self.s._nixl_handshake_listener_t if self.s is not None else None
        wt = self.w._push_writer_thread
        return {
            "pid": os.getpid(),
            "tp_rank": self.par.tp_rank,
            "listener_alive": bool(lt is not None and lt.is_alive()) or not self.par.lead,
            "writer_alive": bool(wt is not None and wt.is_alive()),
            "steps": self.steps,
            "engine_error": self.engine_error,
            "jobs": sorted(self.jobs),
            "final": final,
            "time": time.time(),
        }

    def write_status(self, final: bool = False) -> None:
        write_json(os.path.join(self.rwd, "status.json"), self.status(final))
        self._last_status = time.monotonic()

    def run(self) -> int:
        if not self.par.lead:
            return self.follow()
        write_json(os.path.join(self.wd, "info.json"), self.info())
        self.write_status()
        while not self.stopping:
            self.take_commands()
            try:
                self.step()
            except Exception as e:
                return self.die(e)
            for cid, job in list(self.jobs.items()):
                self.advance(cid, job)
            if time.monotonic() - self._last_status >= STATUS_INTERVAL_S:
                self.write_status()
            if self.a.parent_pid and os.getppid() != self.a.parent_pid:
                self.stopping = True  # the test runner is gone
            time.sleep(0.005 if self.jobs else 0.02)
        return self.shutdown()

    def die(self, e: BaseException) -> int:
        """An engine step raised: record it and exit like a dead engine would (status 3)."""
        self.engine_error = repr(e)
        traceback.print_exc()
        for cid in list(self.jobs):
            self.answer(cid, {"ok": False, "finished": False, "error": f"engine died: {e!r}"})
        self.jobs.clear()
        self.write_status(final=True)
        self.tap.rec("engine_error", error=self.engine_error)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)

    def shutdown(self) -> int:
        for cid in list(self.jobs):
            self.answer(cid, {"ok": False, "finished": False, "error": "peer stopped"})
        self.jobs.clear()
        self.broadcast([None, [("stop",)]])
        t0 = time.monotonic()
        self.work.shutdown()
        t1 = time.monotonic()
        self.sched.shutdown()
        t2 = time.monotonic()
        self._cfg_ctx.__exit__(None, None, None)
        self.write_status(final=True)
        self.tap.close()
        print(
            f"[{self.role}] shut down after {self.steps} steps "
            f"(worker {t1 - t0:.2f}s, scheduler {t2 - t1:.2f}s)",
            flush=True,
        )
        return 0

    # ------------------------------------------------------------------ commands
    def take_commands(self) -> None:
        cdir = os.path.join(self.wd, "cmd")
        for name in sorted(os.listdir(cdir)):
            if not name.endswith(".json"):
                continue
            cid = name[: -len(".json")]
            src = os.path.join(cdir, name)
            try:
                with open(src) as f:
                    cmd = json.load(f)
            except (OSError, ValueError) as e:
                self.answer(cid, {"ok": False, "error": f"unreadable command: {e!r}"})
                cmd = None
            os.replace(src, os.path.join(cdir, "taken", name))
            if cmd is not None:
                self.start(cid, cmd)

    def start(self, cid: str, cmd: dict[str, Any]) -> None:
        op = cmd.get("op")
        try:
            if op == "stop":
                self.answer(cid, {"ok": True, "stopped": True})
                self.stopping = True
                return
            if op == "prefill" and self.role == "P":
                job = self.prefill(cid, cmd)
            elif op == "decode" and self.role == "D":
                job = self.decode(cmd)
            else:
                raise ValueError(f"op {op!r} is not one a {self.role} peer serves")
        except Exception as e:
            self.answer(cid, {"ok": False, "error": repr(e)})
            return
        self.jobs[cid] = job
        self.advance(cid, job)

    def advance(self, cid: str, job: Job) -> None:
        try:
            next(job)
        except StopIteration as done:
            del self.jobs[cid]
            self.answer(cid, done.value)
        except Exception as e:
            del self.jobs[cid]
            traceback.print_exc()
            self.answer(cid, {"ok": False, "finished": False, "error": repr(e)})

    def answer(self, cid: str, obj: dict[str, Any], suffix: str = "") -> None:
        write_json(os.path.join(self.wd, "out", f"{cid}{suffix}.json"), obj)

    # ------------------------------------------------------------------ data
    def blocks_arg(self, cmd: dict[str, Any]) -> list[int]:
        blocks = cmd.get("blocks")
        if (
            not isinstance(blocks, list)
            or not blocks
            or not all(isinstance(b, int) and 0 <= b < self.geo.num_blocks for b in blocks)
            or len(set(blocks)) != len(blocks)
        ):
            raise ValueError(f"blocks must be distinct ids in [0, {self.geo.num_blocks}): {blocks}")
        return list(blocks)

    def fill(self, seed: int, blocks: list[int]) -> None:
        """The "prefill": this rank's heads of the seed's pattern into every layer's blocks."""
        h0 = self.par.tp_rank * self.heads
        for li, name in enumerate(self.geo.layer_names):
            for b in blocks:
                self.caches[name][b].copy_(self.pattern(seed, li, b)[h0 : h0 + self.heads])

    def pattern_sha256(self, seed: int, blocks: list[int]) -> str:
        """``sha256`` of the pattern over all heads: what a TP-1 D holds once every rank wrote."""
        h = hashlib.sha256()
        for li in range(len(self.geo.layer_names)):
            for b in blocks:
                h.update(
                    self.pattern(seed, li, b).contiguous().view(self.torch.uint8).numpy().tobytes()
                )
        return h.hexdigest()

    def pattern(self, seed: int, layer: int, block: int) -> Any:
        """Integer-valued floats below ``modulus``, over all the model's heads: bit-exact in any
        implementation."""
        g, torch = self.geo, self.torch
        shape = (g.kv_heads, g.block_size, 2 * g.head_size)
        base = (seed * 1_000_003 + layer * 65_537 + block * 4_099) % self.modulus
        n = g.kv_heads * g.block_size * 2 * g.head_size
        vals = (torch.arange(n, dtype=torch.int64) + base) % self.modulus
        return vals.to(self.dtype).view(shape)

    def sha256(self, blocks: list[int]) -> str:
        h = hashlib.sha256()
        for name in self.geo.layer_names:  # region order
            t = self.caches[name]
            for b in blocks:  # the request's block order
                h.update(t[b].contiguous().view(self.torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def clear(self, blocks: list[int]) -> None:
        """D: this rank's blocks to the sentinel before they are registered."""
        for name in self.geo.layer_names:
            for b in blocks:
                self.caches[name][b].fill_(SENTINEL)

    def dump_path(self, rank: int, rid: str) -> str:
        safe = hashlib.sha256(rid.encode()).hexdigest()[:16]
        return os.path.join(self.wd, f"rank{rank}", f"dump-{safe}.bin")

    def dump(self, rid: str, blocks: list[int]) -> None:
        """Rank r > 0 of a D: its bytes of a received request, layer by layer, block by block,
        for the lead's digest (written to a temporary name, then renamed)."""
        path = self.dump_path(self.par.tp_rank, rid)
        with open(path + ".tmp", "wb") as f:
            for name in self.geo.layer_names:
                for b in blocks:
                    f.write(
                        self.caches[name][b].contiguous().view(self.torch.uint8).numpy().tobytes()
                    )
        os.replace(path + ".tmp", path)

    def rank_sha256(self, blocks: list[int], paths: list[str]) -> str:
        """The lead of a D at TP > 1: ``sha256`` over what all ranks hold, each block's heads
        in rank order -- the bytes a TP-1 D of the same model holds."""
        per = self.heads * self.geo.block_size * 2 * self.geo.head_size * self.dtype.itemsize
        others = []
        for p in paths:
            with open(p, "rb") as f:
                others.append(f.read())
            os.unlink(p)
        h = hashlib.sha256()
        for li, name in enumerate(self.geo.layer_names):
            for bi, b in enumerate(blocks):
                h.update(self.caches[name][b].contiguous().view(self.torch.uint8).numpy().tobytes())
                at = (li * len(blocks) + bi) * per
                for data in others:
                    h.update(data[at : at + per])
        return h.hexdigest()

    def make_request(
        self, req_id: str, params: dict[str, Any], n_blocks: int, max_tokens: int
    ) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        n = n_blocks * self.geo.block_size
        return Request(
            request_id=req_id,
            prompt_token_ids=list(range(n)),
            sampling_params=SamplingParams(
                max_tokens=max_tokens, extra_args={"kv_transfer_params": dict(params)}
            ),
            pooling_params=None,
        ), n

    @staticmethod
    def kv_blocks(ids: list[int]) -> Any:
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        return KVCacheBlocks((tuple(KVCacheBlock(i) for i in ids),))

    # ------------------------------------------------------------------ P
    def prefill(self, cid: str, cmd: dict[str, Any]) -> Job:
        """``{"op": "prefill", "request_id", "blocks", "seed"?, "order"?: "d_first",
        "timeout"?}``: fill the blocks of every layer with the seed's pattern, finish the request
        (``W/out/<id>.params.json`` gets ``kv_transfer_params`` at once), step until vLLM reports
        it in ``finished_sending`` (WRITE done, or lease expired)."""
        rid = str(cmd["request_id"])
        blocks = self.blocks_arg(cmd)
        seed = int(cmd.get("seed", int(hashlib.sha256(rid.encode()).hexdigest()[:8], 16)))
        order = cmd.get("order", "p_first")
        if order not in ("p_first", "d_first"):
            raise ValueError(f"order must be p_first or d_first, not {order!r}")
        timeout = float(cmd.get("timeout", 120.0))
        return self._prefill(cid, rid, blocks, seed, order, timeout)

    def _prefill(
        self, cid: str, rid: str, blocks: list[int], seed: int, order: str, timeout: float
    ) -> Job:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id
        from vllm.v1.request import RequestStatus

        t0 = time.monotonic()
        deadline = t0 + timeout
        self.sent.discard(rid)
        self.expired.discard(rid)
        self.writes.pop(rid, None)
        req, n = self.make_request(
            rid, {"do_remote_decode": True, "do_remote_prefill": False}, len(blocks), 1
        )
        self.sched.on_new_request(req)
        n_ext, _ = self.sched.get_num_new_matched_tokens(req, 0)
        self.sched.update_state_after_alloc(req, self.kv_blocks(blocks), n_ext)
        yield  # the worker learns reqs_in_batch from the next step's metadata
        self.fill(seed, blocks)  # the "prefill"; the other ranks' before the next step's WRITEs
        if self.par.tp_size > 1:
            self.rank_work.append(("fill", seed, blocks))
        digest = self.sha256(blocks) if self.par.tp_size == 1 else self.pattern_sha256(seed, blocks)
        if order == "d_first":
            base = get_base_request_id(rid)
            while not any(
                k == rid or get_base_request_id(k) == base for k in self.pending_registrations()
            ):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no PUSH_REG for {rid} within {timeout:g}s (d_first)")
                yield
        req.num_computed_tokens = n
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay_free, params = self.sched.request_finished_all_groups(req, (list(blocks),))
        self.answer(cid, {"params": params, "delay_free_blocks": delay_free}, suffix=".params")
        while rid not in self.sent:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{rid} not in finished_sending within {timeout:g}s")
            yield
        self.sent.discard(rid)
        expired = rid in self.expired
        self.expired.discard(rid)
        return {
            "ok": True,
            "finished": True,
            "request_id": rid,
            "params": params,
            "sha256": digest,
            "seed": seed,
            "blocks": blocks,
            "lease_expired": expired,
            "write": self.writes.pop(rid, None),
            "seconds": time.monotonic() - t0,
        }

    def pending_registrations(self) -> list[str]:
        """D request ids whose PUSH_REG vLLM's writer holds unmatched (its thread owns the dict:
        a copy taken while it changes size is retried on the next step)."""
        try:
            return list(self.w._pending_d_registrations)
        except RuntimeError:
            return []

    # ------------------------------------------------------------------ D
    def decode(self, cmd: dict[str, Any]) -> Job:
        """``{"op": "decode", "request_id", "params": kv_transfer_params, "blocks",
        "alloc_delay"?, "timeout"?}``: ``on_new_request`` (heartbeats start), step for
        ``alloc_delay`` s, allocate (blocks cleared to a sentinel first), step until vLLM reports
        the request received or failed, or ``timeout``."""
        rid = str(cmd["request_id"])
        blocks = self.blocks_arg(cmd)
        params = cmd.get("params")
        if not isinstance(params, dict):
            raise ValueError("params must be P's kv_transfer_params (a JSON object)")
        delay = float(cmd.get("alloc_delay", 0.0))
        timeout = float(cmd.get("timeout", 60.0))
        return self._decode(rid, blocks, dict(params), delay, timeout)

    def _decode(
        self, rid: str, blocks: list[int], params: dict[str, Any], delay: float, timeout: float
    ) -> Job:
        t0 = time.monotonic()
        self.recvd.discard(rid)
        self.failed.discard(rid)
        req, _ = self.make_request(rid, params, len(blocks), 4)
        self.sched.on_new_request(req)  # heartbeat tracking starts here
        while time.monotonic() < t0 + delay:
            yield  # queued, not yet scheduled: only heartbeats flow
        n_ext, is_async = self.sched.get_num_new_matched_tokens(req, 0)
        self.clear(blocks)
        if self.par.tp_size > 1:
            # The other ranks clear theirs one step before the step that sends PUSH_REG, and
            # that step ends only when every rank has done its part: a P may WRITE every rank's
            # heads on the first rank's PUSH_REG, so a clear in the same step as the PUSH_REGs
            # could run after P's bytes landed and wipe them (a loaded host did, once).
            self.rank_work.append(("clear", blocks))
            yield
        self.sched.update_state_after_alloc(req, self.kv_blocks(blocks), n_ext)
        t_alloc = time.monotonic()
        deadline = t_alloc + timeout
        timed_out = False
        while rid not in self.recvd and rid not in self.failed:
            if time.monotonic() > deadline:
                timed_out = True
                # As an abort would: stop heartbeating for it.
                self.sched.request_finished(req, list(blocks))
                break
            yield
        failed = rid in self.failed
        done = rid in self.recvd and not failed
        self.recvd.discard(rid)
        self.failed.discard(rid)
        if self.par.tp_size == 1:
            digest = self.sha256(blocks)
        else:  # every rank's heads, once they have all dumped them
            self.rank_work.append(("dump", rid, blocks))
            paths = [self.dump_path(r, rid) for r in range(1, self.par.tp_size)]
            while not all(os.path.exists(p) for p in paths):
                if time.monotonic() > deadline + 30:
                    raise TimeoutError(f"ranks did not dump {rid}: {paths}")
                yield
            digest = self.rank_sha256(blocks, paths)
        return {
            "ok": done,
            "failed": failed,
            "timed_out": timed_out,
            "request_id": rid,
            "blocks": blocks,
            "sha256": digest,
            "matched_tokens": n_ext,
            "async": is_async,
            "seconds": time.monotonic() - t0,
            "seconds_after_alloc": time.monotonic() - t_alloc,
        }


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def die_with_parent() -> None:
    """Linux: SIGTERM when the process that started us exits (no orphan engines)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["P", "D"], required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--port", type=int, required=True, help="side-channel port of the listener")
    ap.add_argument("--lease", type=int, default=30, help="kv_lease_duration (s)")
    ap.add_argument("--engine-id", default=None, help="default: fresh per process")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-size", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=32, help="tokens per block")
    ap.add_argument("--num-blocks", type=int, default=16)
    ap.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    ap.add_argument("--model-dir", default=None, help="needed for a non-default geometry")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--tp-rank", type=int, default=0)
    ap.add_argument("--dist-port", type=int, default=0, help="the lead's TCP store (tp > 1)")
    ap.add_argument("--parent-pid", type=int, default=0, help="exit when this parent is gone")
    ap.add_argument("--nice", type=int, default=0, help="lower this process's priority by N")
    ap.add_argument(
        "--rank-work-delay",
        type=float,
        default=0.0,
        help="rank r > 0: sleep this many seconds before the lead's per-step work (a fill, a "
        "clear, a dump) -- a slow rank, as a loaded host makes one",
    )
    a = ap.parse_args(argv)
    if a.num_blocks < 1 or a.block_size % 32 or a.lease < 1:
        ap.error("need --num-blocks >= 1, --block-size a multiple of 32, --lease >= 1")
    return a


def main() -> int:
    a = parse_args()
    die_with_parent()
    if a.nice:
        os.nice(a.nice)
    if a.tp_rank == 0 and not port_free(a.port):
        print(f"peer.py: port {a.port} is taken", file=sys.stderr)
        return 4
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(a.port)
    sys.path.insert(0, HERE)
    eng = Engine(a)

    def on_signal(signum: int, frame: Any) -> None:
        eng.stopping = True

    if eng.par.lead:  # another rank ends with the lead's stop, or dies of the signal
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    return eng.run()


if __name__ == "__main__":
    rc = main()
    # vLLM's connector is shut down by now (Engine.shutdown: writer joined, handles released,
    # listener joined). What is left is the interpreter's and the native libraries' teardown
    # (NIXL/UCX agent, gloo, torch): 4-40 s here under load, nothing the tests observe, and
    # nothing that outlives the process (no /dev/shm or temp files). Skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
