"""profiler/disk: a too-small file is named with its size, Ctrl-C stops the readers before the file is
closed."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from colibri_plan.errors import InputError
from colibri_plan.profiler import disk


def test_disk_probe_names_the_real_size_of_a_small_file(tmp_path):
    from colibri_plan.profiler.disk import probe_disk

    small = tmp_path / "small.json"
    small.write_bytes(b"x" * 1639)
    with pytest.raises(InputError, match="has 1,639 B"):
        probe_disk(small, block_bytes=1 << 20)


def test_ctrl_c_stops_the_disk_readers_before_the_fd_is_closed(tmp_path):
    f = tmp_path / "probe.bin"
    f.write_bytes(np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8).tobytes())
    errors = []
    old_hook, threading.excepthook = threading.excepthook, lambda a: errors.append(a.exc_value)
    old_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    main = threading.main_thread().ident
    timer = threading.Timer(0.3, lambda: signal.pthread_kill(main, signal.SIGINT))
    fd = os.open(f, os.O_RDONLY)
    try:
        timer.start()
        t0 = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            disk._timed_reads(fd, 1 << 20, 4096, 4, 30.0, False, 0)
        assert time.perf_counter() - t0 < 10  # stopped early, not after the 30 s
        # a joined thread may still be listed for a moment after it stopped: alive is what matters
        assert not [t for t in threading.enumerate()
                    if t.name.startswith("colibri-disk-reader") and t.is_alive()]
    finally:
        timer.cancel()
        os.close(fd)
        signal.signal(signal.SIGINT, old_sigint)
        time.sleep(0.05)
        threading.excepthook = old_hook
    assert errors == []


def test_stop_readers_releases_threads_waiting_to_start():
    stop, start = threading.Event(), threading.Barrier(3)
    ended = []

    def reader():
        try:
            start.wait()
        except threading.BrokenBarrierError:
            ended.append("aborted")
            return
        while not stop.is_set():
            time.sleep(0.001)
        ended.append("stopped")

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    disk.stop_readers(threads, stop, start)
    assert not any(t.is_alive() for t in threads) and ended == ["aborted", "aborted"]
