"""Two-process harness for the transfer backend tests: a receiver and a sender, each in its own
spawned process, driven by the test through multiprocessing Pipes (every wait has a timeout).

    receiver: registers a 64 MiB region and an odd-sized one filled with a seeded pattern,
              sends its AgentInfo, then on "check" rebuilds the expected bytes from the ops and
              the sender's seed and compares byte for byte (written ranges and untouched ones).
    sender:   registers its own seeded random source, connects to the receiver's AgentInfo,
              posts the ops in batches, polls every handle to DONE/FAILED (bounded), reports.

The bytes never travel over the pipe: both sides regenerate them from the seeds.
"""

from __future__ import annotations

import os
import time
import traceback

MIB = 1 << 20
BIG = 64 * MIB
ODD = 1_000_003  # odd-sized second region
SRC = 32 * MIB + 5
SRC_SEED, DST_SEED = 1234, 99
NOTIFY = b"k3serve-test-done"


def _recv(conn, timeout: float):
    if not conn.poll(timeout):
        raise TimeoutError(f"no message within {timeout} s")
    return conn.recv()


def _pattern(n: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def op_plan() -> list[list[tuple[int, str, int, int]]]:
    """Batches of (src_offset, dst_region, dst_offset, length); no two ops overlap on the target."""
    return [
        [
            (0, "big", 0, 16 * MIB),  # large, aligned
            (12_345, "big", 20 * MIB + 3, 5 * MIB + 17),  # unaligned offsets and length
            (1, "big", BIG - 100, 7),  # tiny 7-byte op
        ],
        [
            (16 * MIB, "big", 30 * MIB, MIB),  # two ops contiguous on both sides (coalescable)
            (17 * MIB, "big", 31 * MIB, MIB + 1),
            (999, "odd", 1, ODD - 8),  # odd region, leaves byte 0 and the last 7 alone
            (SRC - 1, "big", BIG - 1, 1),  # last byte of source -> last byte of target
        ],
    ]


def receiver(backend: str, options: dict, conn) -> None:
    """Child process: the decode side."""
    try:
        import torch

        from k3serve.transfer.backends import make_backend

        b = make_backend(backend, **options)
        bufs = {"big": _pattern(BIG, DST_SEED), "odd": _pattern(ODD, DST_SEED + 1)}
        regions = {name: b.register(name, t) for name, t in bufs.items()}
        conn.send(("info", b.agent_info()))
        while True:
            msg = _recv(conn, 120)
            if msg[0] == "exit":
                break
            if msg[0] == "crash":  # die without closing anything, as a crashed process would
                os._exit(0)
            if msg[0] == "check":
                _, batches, want_notify = msg
                got_notify = None
                if want_notify is not None:
                    deadline = time.monotonic() + 20
                    seen: list[bytes] = []
                    while time.monotonic() < deadline and want_notify not in seen:
                        seen += [payload for _sender, payload in b.get_notifications()]
                        time.sleep(0.002)
                    got_notify = want_notify if want_notify in seen else seen
                src = _pattern(SRC, SRC_SEED)
                expect = {"big": _pattern(BIG, DST_SEED), "odd": _pattern(ODD, DST_SEED + 1)}
                for batch in batches:
                    for s, region, d, n in batch:
                        expect[region][d : d + n] = src[s : s + n]
                bad = {}
                for name, t in bufs.items():
                    if not torch.equal(t, expect[name]):
                        idx = (t != expect[name]).nonzero()
                        bad[name] = (int(idx.numel()), int(idx[0]), int(idx[-1]))
                conn.send(("checked", bad, got_notify, {k: r.addr for k, r in regions.items()}))
        b.close()
        conn.send(("closed",))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def sender(backend: str, options: dict, conn) -> None:
    """Child process: the prefill side. Messages: ("write", peer_info, batches, notify, timeout)
    -> ("wrote", [status names], seconds, error or None)."""
    try:
        from k3serve.transfer.backend import TransferError, TransferStatus, WriteOp
        from k3serve.transfer.backends import make_backend

        b = make_backend(backend, **options)
        src = _pattern(SRC, SRC_SEED)
        b.register("src", src)
        conn.send(("ready",))
        while True:
            msg = _recv(conn, 120)
            if msg[0] == "exit":
                break
            _, info, batches, notify, timeout = msg
            base = {r.name: r.addr for r in info.regions}
            t0 = time.monotonic()
            try:
                peer = b.connect(info)
                handles = [
                    b.write(peer, [WriteOp(src.data_ptr() + s, base[r] + d, n) for s, r, d, n in batch],
                            notify=notify if i == len(batches) - 1 else None)
                    for i, batch in enumerate(batches)
                ]
                post_s = time.monotonic() - t0
                status = [TransferStatus.PENDING] * len(handles)
                while any(s is TransferStatus.PENDING for s in status) and time.monotonic() - t0 < timeout:
                    status = [b.poll(h) for h in handles]
                    time.sleep(0.0005)
                for h in handles:
                    b.release(h)
                conn.send(("wrote", [s.name for s in status], time.monotonic() - t0, None, post_s))
            except TransferError as e:
                conn.send(("wrote", [], time.monotonic() - t0, str(e), None))
        b.close()
        conn.send(("closed",))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


# -- drivers (run in the test process) ---------------------------------------------------------


class Pair:
    """A spawned receiver and sender for one backend; always torn down (kill on timeout)."""

    def __init__(self, backend: str, options: dict | None = None) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.rx, rx_child = ctx.Pipe()
        self.tx, tx_child = ctx.Pipe()
        opts = options or {}
        self.procs = [
            ctx.Process(target=receiver, args=(backend, opts, rx_child), daemon=True),
            ctx.Process(target=sender, args=(backend, opts, tx_child), daemon=True),
        ]
        for p in self.procs:
            p.start()
        self.info = self._expect(self.rx, "info", 60)[1]
        self._expect(self.tx, "ready", 60)

    @staticmethod
    def _expect(conn, tag: str, timeout: float):
        msg = _recv(conn, timeout)
        if msg[0] == "error":
            raise AssertionError(f"child failed:\n{msg[1]}")
        assert msg[0] == tag, msg
        return msg

    def write(self, batches, notify: bytes | None = None, timeout: float = 60):
        self.tx.send(("write", self.info, batches, notify, timeout))
        return self._expect(self.tx, "wrote", timeout + 30)

    def check(self, batches, notify: bytes | None = None):
        self.rx.send(("check", batches, notify))
        return self._expect(self.rx, "checked", 60)

    def crash_receiver(self) -> None:
        self.rx.send(("crash",))
        self.procs[0].join(30)
        assert self.procs[0].exitcode is not None, "receiver did not exit"

    def close(self) -> None:
        for conn, p in ((self.rx, self.procs[0]), (self.tx, self.procs[1])):
            if p.is_alive():
                try:
                    conn.send(("exit",))
                    if conn.poll(30):
                        conn.recv()
                except (OSError, EOFError):
                    pass
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)

    def __enter__(self) -> "Pair":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def roundtrip(backend: str, options: dict | None = None, notify: bytes | None = None) -> dict:
    """Write op_plan() and verify; returns timings for the test to report."""
    batches = op_plan()
    with Pair(backend, options) as pair:
        _, status, secs, err, post_s = pair.write(batches, notify=notify)
        assert err is None, err
        assert status == ["DONE"] * len(batches), status
        _, bad, got_notify, _ = pair.check(batches, notify)
        assert not bad, f"bytes differ (count, first, last) per region: {bad}"
        if notify is not None:
            assert got_notify == notify, f"notification not received: {got_notify!r}"
        return {"seconds": secs, "post_seconds": post_s}


def peer_crash(
    backend: str, options: dict | None = None, bound_s: float = 30
) -> tuple[list[str], str | None, float]:
    """One good write, the receiver dies, a second write must fail (FAILED or TransferError)
    within bound_s: never hang, never report DONE."""
    batches = op_plan()
    with Pair(backend, options) as pair:
        _, status, _, err, _ = pair.write(batches[:1])
        assert err is None and status == ["DONE"], (status, err)
        pair.crash_receiver()
        t0 = time.monotonic()
        _, status, secs, err, _ = pair.write(batches, timeout=bound_s)
        wall = time.monotonic() - t0
        assert err is not None or "FAILED" in status, f"write to an exited peer: {status}"
        assert "PENDING" not in status or err is not None, f"still pending after {bound_s} s: {status}"
        assert wall < bound_s + 10, wall
        return status, err, secs
