"""The fault soak: continuous load on a 2P2D deployment while faults are injected at random.

Real in-process workers (transfer "local", the tiny model) behind handles that fail as Ray actors do
(`_faulty_replicas.py`), a real router. Four clients send greedy requests back to back; every FAULT_EVERY_S
one fault, each in turn:

    kill_prefill / kill_decode   a replica dies (calls in flight fail, its feeds are cut) and restarts later
    corrupt_byte                 one landed MLA value of a handoff is changed before decode verifies it
    delay_write                  a prefill replica's next write batch is posted 0.5 s late
    expire_lease                 a control-plane peer reserves and never hands off (a short lease)
    bogus_peer                   a control-plane peer sends TransferReady / Abort for junk ids and attempts
    disconnect                   a client leaves its request at a random point

Afterwards: every request was exact (the colocated greedy tokens) or a clean error (the 503 kinds); no
request hung; every pool holds no block, slot, reservation or pin and every pool gauge reads 0; the router
counts nothing in flight; no dead worker is kept alive and the process's RSS grew by at most MAX_RSS_GROWTH_MB;
the router is healthy and serves exactly. The summary is printed like a benchmark (docs/BENCHMARKS.md, "Fault soak").
`K3SERVE_SOAK_SECONDS` sets the load's length (default 40).
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import gc
import itertools
import logging
import os
import random
import time
from pathlib import Path

import pytest

from k3serve.cluster.errors import EngineOverloadedError
from k3serve.cluster.metrics import IngressMetrics
from k3serve.cluster.router import DisaggregatedRouter
from k3serve.decode.worker import DecodeWorker
from k3serve.engine.config import EngineArgs
from k3serve.engine.llm import LLM
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.stream_types import GenerateRequest
from k3serve.model.config import ModelConfig
from k3serve.model.tokenizer import Tokenizer
from k3serve.prefill.worker import PrefillWorker
from k3serve.transfer.auth import process_auth
from k3serve.transfer.control import ControlPlaneError, DecodeControlClient

from _faulty_replicas import KillableDecode, KillablePrefill, wait_decode_idle

SOAK_SECONDS = float(os.environ.get("K3SERVE_SOAK_SECONDS", "40"))
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(int(SOAK_SECONDS) + 180)]

ENGINE_ARGS = dict(block_size=16, max_model_len=512, cache_memory_bytes=64 << 20)
LEASE_SECONDS = 3.0  # short, so the soak's abandoned reservations and pins are seen to expire
NUM_CLIENTS, FAULT_EVERY_S, RESTART_AFTER_S, REQUEST_DEADLINE_S = 4, 2.0, 1.5, 60.0
MAX_RSS_GROWTH_MB = 256
PROMPTS = [[(i * 31 + j * 13) % 450 + 20 for j in range(20 + 9 * i)] for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
FAULTS = ("kill_prefill", "kill_decode", "corrupt_byte", "delay_write", "expire_lease", "bogus_peer", "disconnect")


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in LLM(str(tiny_checkpoint), **ENGINE_ARGS).generate(PROMPTS, GREEDY)]


def _rss_mb() -> float:
    """This process's resident memory once garbage is collected and malloc returned its free pages."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


class Soak:
    """The deployment, its load, its faults, and what came of them."""

    def __init__(self, tiny_checkpoint: Path, reference: list[list[int]]) -> None:
        self.args = EngineArgs(model=str(tiny_checkpoint), **ENGINE_ARGS)
        self.reference = reference
        self.rng = random.Random(20261202)
        self.prefill = [KillablePrefill(self._prefill_worker(f"prefill-{i}")) for i in range(2)]
        self.decode = [KillableDecode(self._decode_worker(f"decode-{i}")) for i in range(2)]
        self.metrics = IngressMetrics(model_name="k3-tiny")
        self.router = DisaggregatedRouter(self.prefill, self.decode, Tokenizer.from_dir(tiny_checkpoint), "k3-tiny",
                                          ENGINE_ARGS["max_model_len"],
                                          ModelConfig.from_dir(tiny_checkpoint).vocab_size, self.metrics)
        self.faults: collections.Counter[str] = collections.Counter()
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.wrong: list[str] = []
        self.restarts: list[asyncio.Task] = []
        self.num_requests = 0
        self.corrupt_next = self.disconnect_next = False

    def _prefill_worker(self, name: str) -> PrefillWorker:
        return PrefillWorker(self.args, transfer="local", lease_seconds=LEASE_SECONDS, name=name)

    def _decode_worker(self, name: str) -> DecodeWorker:
        worker = DecodeWorker(self.args, transfer="local", lease_seconds=LEASE_SECONDS, name=name)
        handler = worker.transfer_ready

        def transfer_ready(request_id, *args):  # the gRPC handler's entry: corrupt a landed value first
            if self.corrupt_next:
                self.corrupt_next = False
                with worker._lock:
                    pending = worker._pending.get(request_id)
                if pending is not None:
                    worker.handoff.cache_view.cache.mla_kv[0][pending.state.block_ids[0], 0, 0] += 1.0
            return handler(request_id, *args)

        worker.transfer_ready = transfer_ready
        return worker

    # ---- load ---------------------------------------------------------------------------------
    async def client(self, c: int, until: float) -> None:
        while time.monotonic() < until:
            i = self.rng.randrange(len(PROMPTS))
            rid = f"soak-{c}-{self.num_requests}"
            self.num_requests += 1
            request = asyncio.ensure_future(self.tokens(rid, PROMPTS[i]))
            if self.disconnect_next:
                self.disconnect_next = False
                await asyncio.sleep(self.rng.uniform(0.0, 0.6))
                request.cancel()
            try:
                tokens = await asyncio.wait_for(request, REQUEST_DEADLINE_S)
            except asyncio.CancelledError:
                self.outcomes["disconnected"] += 1
                continue
            except asyncio.TimeoutError:
                self.outcomes["hung"] += 1
                continue
            except EngineOverloadedError as e:
                self.outcomes[f"clean error: {type(e).__name__}"] += 1
                continue
            except Exception as e:  # anything else is a failure of the soak
                self.outcomes[f"unclean error: {type(e).__name__}: {e}"] += 1
                continue
            if tokens == self.reference[i]:
                self.outcomes["exact"] += 1
            else:
                self.outcomes["wrong"] += 1
                self.wrong.append(rid)

    async def tokens(self, rid: str, prompt: list[int]) -> list[int]:
        return [t async for d in self.router.generate(GenerateRequest(rid, prompt, GREEDY)) for t in d.new_token_ids]

    # ---- faults -------------------------------------------------------------------------------
    async def inject(self, until: float) -> None:
        order = self.rng.sample(FAULTS, len(FAULTS))  # each fault in turn, in a random order
        for k in itertools.count():
            await asyncio.sleep(FAULT_EVERY_S)
            if time.monotonic() >= until:
                return
            fault = order[k % len(order)]
            if await getattr(self, fault)():
                self.faults[fault] += 1

    async def _kill(self, pool: list, make) -> bool:
        alive = [r for r in pool if not r.killed.is_set()]
        if len(alive) < len(pool):  # one death at a time: the pool keeps a live replica
            return False
        victim = self.rng.choice(alive)
        await victim.kill()

        async def restart() -> None:
            await asyncio.sleep(RESTART_AFTER_S)
            await victim.restart(lambda: make(victim.name))

        self.restarts.append(asyncio.ensure_future(restart()))
        return True

    async def kill_prefill(self) -> bool:
        return await self._kill(self.prefill, self._prefill_worker)

    async def kill_decode(self) -> bool:
        return await self._kill(self.decode, self._decode_worker)

    async def corrupt_byte(self) -> bool:
        self.corrupt_next = True
        return True

    async def delay_write(self) -> bool:
        replica = self.rng.choice([r for r in self.prefill if not r.killed.is_set()])
        backend = replica.worker.sender.backend
        write = backend.write

        def late_write(*args, **kwargs):
            backend.write = write  # once
            time.sleep(0.5)  # on the prefill engine thread, as a slow NIC queue would hold it
            return write(*args, **kwargs)

        backend.write = late_write
        return True

    def _control_client(self, secret: str) -> DecodeControlClient | None:
        """A control-plane client of a live decode replica, sending `secret` (the deployment's: the in-process
        workers' `process_auth`; another: a peer that does not have it)."""
        live = [r.worker for r in self.decode if not r.killed.is_set()]
        if not live:
            return None
        worker = self.rng.choice(live)
        return DecodeControlClient(worker.control_address, worker.compat_hash, secret=secret)

    async def expire_lease(self) -> bool:
        client = self._control_client(process_auth().secret)  # a peer with the secret that abandons its reservation
        if client is None:
            return False
        with client:
            try:
                await asyncio.to_thread(client.reserve, f"abandoned-{self.faults['expire_lease']}", 40, 0.5)
            except ControlPlaneError:  # full, or refused: nothing was reserved
                pass
        return True

    async def bogus_peer(self) -> bool:
        secret = self.rng.choice([process_auth().secret, "not-the-deployments-secret"])  # junk, with or without it
        client = self._control_client(secret)
        if client is None:
            return False
        n = self.rng.randrange(1 << 30)
        calls = [lambda: client.transfer_ready(f"junk-{n}", 0, 1, 16, {"0/mla.0": "00"}, n),
                 lambda: client.transfer_ready(f"soak-0-{n % 50}", 0, 1, 16, {"0/mla.0": "00"}, n),
                 lambda: client.transfer_ready("", 7, -1, 0, {"x": "y"}, 0),
                 lambda: client.abort(f"junk-{n}", "bogus"),
                 lambda: client.heartbeat([f"junk-{n}"], "bogus")]
        with client:
            for call in calls:
                try:
                    await asyncio.to_thread(call)
                except ControlPlaneError:
                    pass
        return True

    async def disconnect(self) -> bool:
        self.disconnect_next = True
        return True

    # ---- afterwards ---------------------------------------------------------------------------
    async def settle(self) -> None:
        """Restarts done, then every lease expired: the pools must be back to idle."""
        await asyncio.gather(*self.restarts)
        deadline = time.monotonic() + LEASE_SECONDS + 15
        while True:
            try:
                await self.router.check_health()
                break
            except EngineOverloadedError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        for replica in self.decode:
            await wait_decode_idle(replica.worker, deadline_s=LEASE_SECONDS + 15)
        for replica in self.prefill:
            for _ in range(int((LEASE_SECONDS + 15) / 0.1)):
                s = await replica.worker.stats()
                held = (s.num_running, s.num_waiting, s.block_usage, s.slot_usage, replica.worker.pins.num_leases)
                if held == (0, 0, 0.0, 0.0, 0):
                    break
                await asyncio.sleep(0.1)
            assert held == (0, 0, 0.0, 0.0, 0), f"{replica.name} holds (running, waiting, blocks, slots, pins) {held}"

    def gauges(self) -> dict[str, float]:
        """Every nonzero pool gauge, after a refresh."""
        out = {}
        for name in ("k3serve:num_requests_running", "k3serve:num_requests_waiting", "k3serve:kv_block_usage_ratio",
                     "k3serve:kda_slot_usage_ratio"):
            for r, pool in [(r, "prefill") for r in self.prefill] + [(r, "decode") for r in self.decode]:
                value = self.metrics.registry.get_sample_value(name, {"model_name": "k3-tiny", "pool": pool,
                                                                      "replica": r.name})
                if value:
                    out[f"{name}{{{r.name}}}"] = value
        return out

    def summary(self, seconds: float, rss_growth_mb: float) -> str:
        lines = [f"fault soak: {self.num_requests} requests in {seconds:.0f} s, {NUM_CLIENTS} clients, 2P2D",
                 "  faults:   " + ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())),
                 "  outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items())),
                 f"  handoff retries {self._count('k3serve:handoff_retries_total'):.0f}, "
                 f"migrations {self._count('k3serve:request_migrations_total'):.0f}, "
                 f"RSS growth {rss_growth_mb:.0f} MB"]
        return "\n".join(lines)

    def _count(self, name: str) -> float:
        return self.metrics.registry.get_sample_value(name, {"model_name": "k3-tiny"}) or 0.0

    def shutdown(self) -> None:
        for replica in self.prefill + self.decode:
            if not replica.killed.is_set():
                replica.worker.shutdown()


async def test_under_faults_every_request_is_exact_or_a_clean_error_and_nothing_leaks(
    tiny_checkpoint: Path, reference
) -> None:
    soak = Soak(tiny_checkpoint, reference)
    quiet = logging.getLogger("k3serve")  # the soak's expected warnings, kept by pytest's log capture with their
    level, quiet.level = quiet.level, logging.ERROR  # exceptions' tracebacks, would keep every dead worker alive
    try:
        for i, prompt in enumerate(PROMPTS[:2]):  # warm: the first requests are not the soak's
            assert await soak.tokens(f"warm-{i}", prompt) == reference[i]
        rss_before, start = _rss_mb(), time.monotonic()
        until = start + SOAK_SECONDS
        await asyncio.gather(soak.inject(until), *(soak.client(c, until) for c in range(NUM_CLIENTS)))
        seconds = time.monotonic() - start
        await soak.settle()
        await soak.router._refresh()
        rss_growth = _rss_mb() - rss_before
        print("\n" + soak.summary(seconds, rss_growth))
        bad = {k: v for k, v in soak.outcomes.items() if k in ("wrong", "hung") or k.startswith("unclean")}
        assert not bad, f"{bad}; wrong: {soak.wrong[:5]}\n{soak.summary(seconds, rss_growth)}"
        assert soak.outcomes["exact"] > soak.num_requests // 2, soak.summary(seconds, rss_growth)
        assert set(soak.faults) >= {"kill_prefill", "kill_decode"} or SOAK_SECONDS < 8 * FAULT_EVERY_S, soak.faults
        assert not soak.gauges(), soak.gauges()
        router = soak.router
        assert (set(router._decoding.values()), set(router._inflight.values()), router.admission.num_waiting) == (
            {0}, {0}, 0)
        assert rss_growth < MAX_RSS_GROWTH_MB, f"RSS grew by {rss_growth:.0f} MB"
        assert await soak.tokens("after-soak", PROMPTS[3]) == reference[3]
        live = [w for w in gc.get_objects() if type(w) in (PrefillWorker, DecodeWorker)]
        assert len(live) == len(soak.prefill) + len(soak.decode), f"{len(live)} workers alive: dead ones are kept"
    finally:
        quiet.level = level
        await soak.router.close()
        soak.shutdown()
