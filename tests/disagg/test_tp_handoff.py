"""Disaggregated handoff between TP engines: prefill TP P -> decode TP D, ranks > 0 of both in
real processes (`prefill.rank.follower_main`, `decode.rank.follower_main`), rank 0 of both in
this process, state moved by a real transfer backend (Mooncake, else NIXL).

    (P, D) = (1, 2)   one prefill rank writes both decode shards (MLA to both, heads split)
    (P, D) = (2, 2)   rank s -> rank s (MLA and heads)
    (P, D) = (2, 1)   both prefill ranks write into the one decode rank
    (P, D, DCP) = (1, 2, 2), (2, 2, 2)   the decode ranks split the latent KV: each receives only its pages

Greedy outputs equal the colocated engine's; afterwards both engines hold nothing (no running
request, reservation or pin) and every follower exits 0. A byte corrupted in a decode rank's
landed shard (rank 0 here, or a follower in its own process) fails the request loudly and frees
everything.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import time
from contextlib import contextmanager

import pytest
import torch

from k3serve.decode import rank as decode_rank
from k3serve.decode.worker import DecodeWorker, HandoffFailedError
from k3serve.engine.config import EngineArgs
from k3serve.engine.llm import LLM
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.tp_group import TPGroup
from k3serve.prefill import rank as prefill_rank
from k3serve.prefill.handoff import RankSender
from k3serve.prefill.messages import HandoffTarget
from k3serve.prefill.worker import PrefillWorker
from k3serve.transfer.backend import TransferError, WriteOp
from k3serve.transfer.auth import ControlAuth, new_secret
from k3serve.transfer.backends import available_backends
from k3serve.transfer.control import ChecksumMismatchError, DecodeControlClient, InvalidArgumentError
from k3serve.transfer.tp_map import RequestSpan

from _local_ranks import free_port

pytestmark = pytest.mark.timeout(120)
SECRET = new_secret()  # the pair's deployment secret, which the spawned followers get too
AUTH = ControlAuth(SECRET)

BACKEND = next((b for b in ("mooncake", "nixl") if available_backends().get(b)), None)
PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 40, 64, 100)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _engine_kwargs(model) -> dict:
    return dict(model=str(model), block_size=8, max_model_len=512, cache_memory_bytes=64 << 20)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint) -> list[list[int]]:
    llm = LLM(**_engine_kwargs(tiny_checkpoint))
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


class Pair:
    """A prefill engine (TP P) and a decode engine (TP D); followers in spawned processes."""

    def __init__(self, model, prefill_tp: int, decode_tp: int, decode_dcp: int = 1, **decode_args) -> None:
        kw = _engine_kwargs(model)
        ctx = multiprocessing.get_context("spawn")
        self.procs: list = []
        self.prefill = self.decode = None
        pargs = EngineArgs(**kw, tensor_parallel_size=prefill_tp)
        dargs = EngineArgs(**kw, tensor_parallel_size=decode_tp, decode_context_parallel_size=decode_dcp, **decode_args)

        def group(tp, target, args_of) -> TPGroup | None:
            if tp == 1:
                return None
            init = f"tcp://127.0.0.1:{free_port()}"
            for rank in range(1, tp):
                proc = ctx.Process(target=target, args=args_of(rank, init), daemon=True)
                proc.start()
                self.procs.append(proc)
            return TPGroup(0, tp, init, timeout_s=60)

        try:
            pgroup = group(prefill_tp, functools.partial(prefill_rank.follower_main, control_auth=AUTH),
                           lambda r, i: (r, pargs, i, BACKEND, None, 1))
            self.prefill = PrefillWorker(pargs, transfer=BACKEND, group=pgroup, control_auth=AUTH)
            dgroup = group(decode_tp, functools.partial(decode_rank.follower_main, control_auth=AUTH),
                           lambda r, i: (r, dargs, i, BACKEND, "127.0.0.1", prefill_tp, None, 1))
            self.decode = DecodeWorker(dargs, transfer=BACKEND, prefill_tp=prefill_tp, group=dgroup,
                                       control_auth=AUTH)
        except BaseException:
            self.close()
            raise

    async def run(self, rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
        d = self.decode
        reservation = await d.admit(rid, prompt, params)
        stream = d.stream(rid)
        result = await self.prefill.prefill(rid, prompt, params, HandoffTarget(await d.addresses(), reservation))
        assert not result.finished
        tokens = []
        async for delta in stream:
            tokens += delta.new_token_ids
        return tokens

    async def idle(self) -> tuple:
        """What must be back to its start value once every request ended."""
        ds, ps = await self.decode.stats(), await self.prefill.stats()
        return (ds.num_running, ds.num_waiting, ds.num_reserved, ds.num_free_blocks, ds.num_free_slots,
                ps.num_running, ps.num_waiting, ps.num_free_slots, self.prefill.pins.num_leases)

    def close(self) -> list[int | None]:
        """Shut both engines down; the followers' exit codes."""
        for worker in (self.prefill, self.decode):
            if worker is not None:
                worker.shutdown()
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        return [p.exitcode for p in self.procs]


@contextmanager
def pair(model, prefill_tp: int, decode_tp: int, decode_dcp: int = 1, **decode_args):
    p = Pair(model, prefill_tp, decode_tp, decode_dcp, **decode_args)
    ok = False
    try:
        yield p
        ok = True
    finally:
        codes = p.close()
    if ok:
        assert codes == [0] * (prefill_tp - 1 + decode_tp - 1), f"followers exited with {codes}"


@pytest.mark.skipif(BACKEND is None, reason="needs the mooncake or nixl package")
@pytest.mark.parametrize(("prefill_tp", "decode_tp", "decode_dcp"), [(1, 2, 1), (2, 2, 1), (2, 1, 1), (1, 2, 2), (2, 2, 2)],
                         ids=lambda t: str(t))
def test_greedy_outputs_match_colocated(tiny_checkpoint, reference, prefill_tp: int, decode_tp: int,
                                        decode_dcp: int) -> None:
    start = time.monotonic()
    with pair(tiny_checkpoint, prefill_tp, decode_tp, decode_dcp) as p:
        async def main():
            before = await p.idle()
            outs = await asyncio.gather(*[p.run(f"r{i}", prompt) for i, prompt in enumerate(PROMPTS)])
            assert outs == reference
            assert await p.idle() == before  # nothing running, reserved, or pinned
            addresses = await p.decode.addresses()
            assert len(set(addresses)) == decode_tp and addresses[0] == await p.decode.address()
            return addresses

        addresses = asyncio.run(main())
        if decode_tp > 1:
            asyncio.run(_rank_0_address_alone_is_refused(p))
        for rank, address in enumerate(addresses[1:], start=1):  # followers answer handshakes only
            with DecodeControlClient(address, p.decode.compat_hash, secret=SECRET) as client:
                with pytest.raises(InvalidArgumentError, match=f"rank {rank} of a decode engine only answers handshakes"):
                    client.reserve("x", 8, 5.0)
    assert time.monotonic() - start < 30


async def _rank_0_address_alone_is_refused(p: Pair) -> None:
    """A target naming only rank 0 (what a router unaware of decode TP would send) fails clearly."""
    before = await p.idle()
    reservation = await p.decode.admit("only-rank-0", PROMPTS[1], GREEDY)
    target = HandoffTarget(p.decode.control_address, reservation)  # one address: normalized to a 1-tuple
    assert target.decode_addresses == (p.decode.control_address,)
    with pytest.raises(TransferError, match="must list every decode rank's address, in rank order"):
        await p.prefill.prefill("only-rank-0", PROMPTS[1], GREEDY, target)
    await p.decode.abort_request("only-rank-0")  # what the router does when the prefill fails
    # a failed handoff keeps its pin until the lease ends (a write might still land): end it now
    assert await p.prefill.handoff.call(lambda: p.prefill.pins.expire(float("inf"))) == ["only-rank-0"]
    assert await p.idle() == before


def _corrupt_after_landing(sender: RankSender, decode_rank_to_hit: int):
    """Wrap `sender.push`: after the real writes landed (and were checksummed), flip one byte of
    the KDA state at the source, write that one byte again into decode rank `decode_rank_to_hit`,
    and restore the source. The decode rank's landed shard then differs from the sums sent."""
    push = sender.push

    def corrupting_push(job):
        share = push(job)
        peer = sender.peer(job.decode_addresses)
        span = RequestSpan(job.src_block_ids, job.reservation.block_ids, job.src_slot, job.reservation.slot_id,
                           job.num_tokens)
        last = peer.mapping.ops(span)[(sender.layout.tp_rank, decode_rank_to_hit)][-1]  # a KDA slot op
        byte = _byte_at(sender.cache, last.src_addr + last.length // 2)
        byte ^= 0x5A
        try:
            sender._write_and_wait([(peer.keys[decode_rank_to_hit], [WriteOp(last.src_addr + last.length // 2,
                                                                            last.dst_addr + last.length // 2, 1)])])
        finally:
            byte ^= 0x5A
        return share

    return corrupting_push


def _byte_at(cache, addr: int) -> torch.Tensor:
    """A one-byte view of the cache tensor holding address `addr`."""
    for tensor in (*cache.mla_kv, *cache.kda_recurrent, *cache.kda_conv):
        base = tensor.data_ptr()
        if base <= addr < base + tensor.numel() * tensor.element_size():
            return tensor.view(-1).view(torch.uint8)[addr - base : addr - base + 1]
    raise AssertionError(f"address {addr:#x} is in no cache tensor")


@pytest.mark.skipif(BACKEND is None, reason="needs the mooncake or nixl package")
def test_corrupted_byte_on_any_decode_rank_fails_the_request(tiny_checkpoint, reference, monkeypatch) -> None:
    with pair(tiny_checkpoint, 1, 2) as p:
        async def main():
            before = await p.idle()
            d = p.decode
            for hit in (0, 1):  # rank 0 (this process), rank 1 (a follower process)
                monkeypatch.setattr(p.prefill.sender, "push", _corrupt_after_landing(p.prefill.sender, hit))
                rid = f"bad-{hit}"
                reservation = await d.admit(rid, PROMPTS[2], GREEDY)
                stream = d.stream(rid)
                target = HandoffTarget(await d.addresses(), reservation)
                with pytest.raises(ChecksumMismatchError, match=rf"state corrupted in transfer, regions \['{hit}/kda_"):
                    await p.prefill.prefill(rid, PROMPTS[2], GREEDY, target)
                monkeypatch.undo()
                with pytest.raises(HandoffFailedError, match=rf"corrupted in transfer, regions \['{hit}/kda_"):
                    async for _ in stream:  # what a client following the request gets
                        pass
                assert await p.idle() == before  # reservation and pins freed
            assert await p.run("good", PROMPTS[2]) == reference[2]  # the ranks are still in step
            assert await p.idle() == before

        asyncio.run(main())


@pytest.mark.skipif(BACKEND is None, reason="needs the mooncake or nixl package")
def test_a_dcp_decode_engine_preempts_and_recomputes_from_its_pages(tiny_checkpoint) -> None:
    """Prefill TP 2 (a second wave extends two prompts of the first: prefix-cache hits) into decode TP 2, DCP 2,
    whose cache holds one longest request (32 blocks of 2 x 8 tokens): four ~100-token prompts decoding 40 tokens
    each outgrow it, so the decode engine preempts and recomputes a request from its tokens there (the MLA prefill
    over the group's pages). The greedy tokens are the colocated engine's."""
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 500, (64,), generator=gen).tolist()
    prompts = [prefix + torch.randint(0, 500, (n,), generator=gen).tolist() for n in (30, 33, 36, 40)]
    prompts += [prompts[i] + torch.randint(0, 500, (n,), generator=gen).tolist() for i, n in ((0, 9), (1, 17))]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = LLM(**_engine_kwargs(tiny_checkpoint))
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with pair(tiny_checkpoint, 2, 2, 2, num_gpu_blocks_override=32) as p:
        async def main():
            before = await p.idle()
            first = await asyncio.gather(*[p.run(f"a{i}", prompt, params) for i, prompt in enumerate(prompts[:4])])
            second = await asyncio.gather(*[p.run(f"b{i}", prompt, params) for i, prompt in enumerate(prompts[4:])])
            assert first + second == reference
            assert await p.idle() == before
            preempted = await p.decode.handoff.call(lambda: p.decode.handoff._llm().num_preemptions)
            hits = await p.prefill.handoff.call(lambda: p.prefill.handoff._llm().scheduler.prefix_cache.num_hits)
            assert preempted > 0 and hits > 0

        asyncio.run(main())
