"""RSS probe: agrees with psutil and sees memory the process touches."""

import mmap

import psutil

from kvdoctor.probes.rss import RssProbe


def test_rss_agrees_with_psutil_and_grows_with_touched_memory():
    # GIVEN a probe on this process
    probe = RssProbe()
    try:
        before = probe.read()
        # THEN it agrees with psutil's figure (both read /proc; allow for allocator noise)
        assert abs(before - psutil.Process().memory_info().rss) < 8 << 20
        # WHEN the process touches 64 MiB of fresh pages (an anonymous map: malloc could hand back
        # memory freed by earlier tests that is still resident, and RSS would rightly not move)
        hoard = mmap.mmap(-1, 64 << 20)
        for i in range(0, len(hoard), 4096):
            hoard[i] = 1
        # THEN the reading grows by about that much
        assert probe.read() - before > 48 << 20
        hoard.close()
    finally:
        probe.close()


def test_rss_after_close_still_reads_through_psutil():
    probe = RssProbe()
    probe.close()
    assert probe.read() > 0
