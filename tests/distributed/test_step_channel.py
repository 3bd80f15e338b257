"""StepChannel kinds: the shared-memory ring delivers every message intact and in order to every reader
(wrapping, and messages longer than the ring streamed through it), an idle reader sleeps instead of
spinning, a dead writer or reader surfaces as ChannelClosedError, and create_step_channel picks shm for
ranks on one machine (gloo when asked) with the same bytes and meta either way."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import threading
import time

import pytest

from runtime.distributed import shm_ring
from runtime.distributed.shm_ring import ChannelClosedError, ShmRing

pytestmark = pytest.mark.skipif(not shm_ring.usable(), reason="the shm ring needs x86-64 Linux with /dev/shm")

SIZES = [0, 1, 100, 4000, 4095, 20000, 5, 3, 9000]


def _ring(tmp_name: str, readers: int, capacity: int = 4096, **kw) -> tuple[ShmRing, list[ShmRing]]:
    path = f"/dev/shm/shoal-test-{os.getpid()}-{tmp_name}"
    writer = ShmRing.create(path, capacity, readers, **kw)
    ends = [ShmRing.attach(path, i, readers, **kw) for i in range(readers)]
    writer.unlink()
    assert not os.path.exists(path)  # mapped by all: the file is gone, the memory stays
    return writer, ends


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_every_reader_gets_every_message_in_order():
    writer, readers = _ring("order", 2)
    msgs = [os.urandom(n) for n in SIZES]
    got: list[list] = [[], []]

    def read(i: int) -> None:
        got[i].extend(readers[i].read() for _ in msgs)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for k, m in enumerate(msgs):  # 20000 B > the 4096 B ring: streams through in pieces
        writer.write(m, 1000 + k, (k, -k))
    for t in threads:
        t.join(10)
    for frames in got:
        assert [f.data for f in frames] == msgs
        assert [f.sent_ns for f in frames] == [1000 + k for k in range(len(msgs))]
        assert [f.meta[:3] for f in frames] == [(k, -k, 0) for k in range(len(msgs))]


def test_idle_reader_sleeps_and_wakes_on_a_message():
    writer, (reader,) = _ring("idle", 1, spin_s=0.002, poll_s=0.1)
    result: dict = {}

    def read() -> None:
        c0 = time.thread_time()
        result["frame"] = reader.read()
        result["woke"] = time.monotonic()
        result["cpu_s"] = time.thread_time() - c0

    t = threading.Thread(target=read)
    t.start()
    time.sleep(0.6)
    sent = time.monotonic()
    writer.write(b"step", 0)
    t.join(5)
    assert result["frame"].data == b"step"
    assert result["woke"] - sent < 0.05  # the futex wake, not the 0.1 s poll
    assert result["cpu_s"] < 0.05 * 0.6  # an idle follower: well under 5% of a core


def test_dead_writer_surfaces_on_the_reader():
    writer, (reader,) = _ring("deadw", 1, poll_s=0.05)
    writer._wpid.value = _dead_pid()
    t0 = time.monotonic()
    with pytest.raises(ChannelClosedError, match="writer"):
        reader.read()
    assert time.monotonic() - t0 < 2


def test_writer_blocked_on_a_full_ring_gives_up_on_a_dead_reader_or_abort():
    writer, (reader,) = _ring("deadr", 1, capacity=1024, poll_s=0.05)
    reader._rpids[0].value = _dead_pid()
    with pytest.raises(ChannelClosedError, match="reader 0"):
        writer.write(b"x" * 5000, 0)
    writer2, (reader2,) = _ring("abort", 1, capacity=1024, poll_s=10)
    errors: list = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(ChannelClosedError, writer2.write, b"x" * 5000, 0)))
    t.start()
    time.sleep(0.2)
    writer2.abort()
    t.join(5)
    assert errors and not t.is_alive()


def _channel_rank(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from runtime.distributed.step_channel import create_step_channel

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    msgs = [bytes([i % 251]) * n for i, n in enumerate(SIZES + [5 << 20])]  # 5 MiB > the shm ring's 4 MiB
    for kind in ("auto", "gloo"):
        ch = create_step_channel(rank, 2, kind)
        for k, m in enumerate(msgs):
            if rank == 0:
                ch.send(m, (k, 7))
            else:
                f = ch.recv()
                assert f.data == m and f.meta[:2] == (k, 7) and f.sent_ns <= time.monotonic_ns()
        results[(kind, rank)] = ch.kind
    dist.destroy_process_group()


def test_create_step_channel_picks_shm_on_one_machine():
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_channel_rank, args=(port, results), nprocs=2)
    assert dict(results) == {("auto", 0): "shm", ("auto", 1): "shm", ("gloo", 0): "gloo", ("gloo", 1): "gloo"}
