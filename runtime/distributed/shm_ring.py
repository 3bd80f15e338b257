"""ShmRing: one writer, a few readers, a byte ring in a /dev/shm file mapped by every process of one node.

vLLM broadcasts each step to its workers through a shared-memory ring for the same reason: a loopback
socket costs a send and a wake-up of the reader per step (245-510 µs one way on a busy 2-core VM), where
a store into shared memory is seen by a spinning reader in about a microsecond.

Layout: a header (write position, a futex word, the writer's pid, each reader's read position and pid, each
on its own cache line) and then `capacity` bytes of data used as a stream: a message is a frame header
(length, send time, META_SLOTS ints) and its bytes, wrapping at the end, and one longer than the ring
streams through it in pieces. Positions only grow, so "readable" is write_pos - read_pos.

Waiting: a reader spins for `spin_s` (the next step of a busy replica usually comes within it), then sleeps
in futex(FUTEX_WAIT) on the generation word the writer bumps and wakes after every publish — an idle replica
holds no busy core. Sleeps end every `poll_s` to check that the writer still lives. The writer waits for
space (rare: readers are at most a step or two behind) by polling, checking that every reader still lives.

Ordering relies on x86-64's total store order (payload stores become visible before the position store
that publishes them); usable() says where that holds."""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import struct
import sys
import time

from runtime.distributed.step_frame import META_SLOTS, StepFrame

_FRAME = struct.Struct(f"<qq{META_SLOTS}q")  # payload length, send time (ns, monotonic), meta
_LINE = 64
_MAX_READERS = 15
_W, _GEN, _WPID = 0, 8, 16  # write position, futex word (u32), writer pid
_READERS = _LINE  # reader i: read position at _READERS + i * _LINE, its pid 8 bytes further
_DATA = _READERS + _MAX_READERS * _LINE
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


class ChannelClosedError(RuntimeError):
    """The other side of the ring is gone (its process died) or the ring was aborted."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def usable() -> bool:
    """Linux on x86-64 with a writable /dev/shm: futexes, TSO, and a place for the file."""
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64") and os.access("/dev/shm", os.W_OK)


class ShmRing:
    def __init__(self, path: str, mm: mmap.mmap, reader: int | None, spin_s: float, poll_s: float):
        self.path, self._mm, self.reader = path, mm, reader
        self.spin_s, self.poll_s = spin_s, poll_s
        self.capacity = len(mm) - _DATA
        self._view = memoryview(mm)
        self._data = self._view[_DATA:]
        self._w = ctypes.c_uint64.from_buffer(mm, _W)
        self._gen = ctypes.c_uint32.from_buffer(mm, _GEN)
        self._wpid = ctypes.c_uint64.from_buffer(mm, _WPID)
        self._reads = [ctypes.c_uint64.from_buffer(mm, _READERS + i * _LINE) for i in range(_MAX_READERS)]
        self._rpids = [ctypes.c_uint64.from_buffer(mm, _READERS + i * _LINE + 8) for i in range(_MAX_READERS)]
        self._gen_addr = ctypes.addressof(self._gen)
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.syscall.restype = ctypes.c_long
        self._aborted = False
        self.num_readers = 0

    # ---- set-up ---------------------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str, capacity: int, num_readers: int, spin_s: float = 0.002,
               poll_s: float = 1.0) -> ShmRing:
        """The writer's side: a new file at `path` (fails if it exists)."""
        if not 0 < num_readers <= _MAX_READERS:
            raise ValueError(f"a ShmRing has 1..{_MAX_READERS} readers, not {num_readers}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, _DATA + capacity)
            mm = mmap.mmap(fd, _DATA + capacity)
        finally:
            os.close(fd)
        ring = cls(path, mm, None, spin_s, poll_s)
        ring.num_readers = num_readers
        ring._wpid.value = os.getpid()
        return ring

    @classmethod
    def attach(cls, path: str, reader: int, num_readers: int, spin_s: float = 0.002,
               poll_s: float = 1.0) -> ShmRing:
        """Reader `reader` (0-based) of a ring the writer created."""
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        ring = cls(path, mm, reader, spin_s, poll_s)
        ring.num_readers = num_readers
        ring._rpids[reader].value = os.getpid()
        return ring

    def unlink(self) -> None:
        """Removes the file once every side has mapped it: nothing is left in /dev/shm if a process dies."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def abort(self) -> None:
        """A writer blocked waiting for space raises ChannelClosedError (its group has failed)."""
        self._aborted = True

    # ---- writer ---------------------------------------------------------------------------------------
    def write(self, data: bytes, sent_ns: int, meta: tuple[int, ...] = ()) -> None:
        head = _FRAME.pack(len(data), sent_ns, *meta, *(0,) * (META_SLOTS - len(meta)))
        if len(head) + len(data) <= self.capacity - self._used():  # the usual case: one publish
            pos = self._put(self._w.value, head)
            self._publish(self._put(pos, data))
            return
        self._stream(head)
        self._stream(data)

    def _used(self) -> int:
        return self._w.value - min(self._reads[i].value for i in range(self.num_readers))

    def _put(self, pos: int, data: bytes | memoryview) -> int:
        """Copies data into the ring at stream position pos (wrapping); returns the position after it."""
        data, n = memoryview(data), len(data)
        at = pos % self.capacity
        first = min(n, self.capacity - at)
        self._data[at:at + first] = data[:first]
        if first < n:
            self._data[:n - first] = data[first:]
        return pos + n

    def _publish(self, pos: int) -> None:
        self._w.value = pos
        self._gen.value = (self._gen.value + 1) & 0xFFFFFFFF
        # Always wake (about a microsecond with nobody asleep): checking for sleepers first would race them.
        self._futex(_FUTEX_WAKE, 0x7FFFFFFF, None)

    def _futex(self, op: int, val: int, timeout: object) -> None:
        # Every argument as a C long: syscall() reads its variadic arguments as longs.
        L = ctypes.c_long
        self._libc.syscall(L(_SYS_FUTEX), L(self._gen_addr), L(op), L(val), timeout, L(0), L(0))

    def _stream(self, data: bytes) -> None:
        view, done = memoryview(data), 0
        while done < len(view):
            free = self.capacity - self._used()
            if free == 0:
                self._wait_for_space()
                continue
            n = min(free, len(view) - done)
            self._publish(self._put(self._w.value, view[done:done + n]))
            done += n

    def _wait_for_space(self) -> None:
        start = last_check = time.monotonic()
        delay = 1e-5
        while self.capacity - self._used() == 0:
            if self._aborted:
                raise ChannelClosedError(f"ring {self.path} aborted")
            now = time.monotonic()
            if now - last_check > self.poll_s:
                last_check = now
                for i in range(self.num_readers):
                    if not _alive(self._rpids[i].value):
                        raise ChannelClosedError(f"reader {i} of {self.path} (pid {self._rpids[i].value}) is gone")
            time.sleep(delay if now - start > self.spin_s else 0)
            delay = min(delay * 2, 1e-3)

    # ---- reader ---------------------------------------------------------------------------------------
    def read(self) -> StepFrame:
        length, sent_ns, *meta = _FRAME.unpack(self._take(_FRAME.size))
        return StepFrame(self._take(length), sent_ns, tuple(meta))

    def _take(self, n: int) -> bytes:
        parts, cell = [], self._reads[self.reader]
        while n:
            pos = cell.value
            avail = self._w.value - pos
            if not avail:
                self._wait_for_data(pos)
                continue
            k = min(n, avail)
            at = pos % self.capacity
            first = min(k, self.capacity - at)
            parts.append(bytes(self._data[at:at + first]))
            if first < k:
                parts.append(bytes(self._data[:k - first]))
            cell.value = pos + k  # after the copy: the writer may now reuse those bytes
            n -= k
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _wait_for_data(self, pos: int) -> None:
        deadline = time.monotonic() + self.spin_s
        while time.monotonic() < deadline:
            if self._w.value != pos:
                return
            os.sched_yield()  # lets this process's other threads have the GIL
        timeout = _Timespec(int(self.poll_s), int((self.poll_s % 1) * 1e9))
        while True:
            gen = self._gen.value
            if self._w.value != pos:  # read after gen: a publish in between changes gen, so the wait returns
                return
            self._futex(_FUTEX_WAIT, gen, ctypes.byref(timeout))
            if self._w.value != pos:
                return
            if not _alive(self._wpid.value):
                raise ChannelClosedError(f"the writer of {self.path} (pid {self._wpid.value}) is gone")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
