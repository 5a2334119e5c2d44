"""Pilot tests of the TUI: keys, mouse and navigation over synthetic and recorded traces."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from textual.widgets import Input, TabbedContent

from kvdoctor.engine.bus import Bus
from kvdoctor.events import (
    PREFIX_CACHE, Alloc, Free, Header, SeqEnd, SeqStart, Share, StepEnd, TierSpec, TraceEnd,
)
from kvdoctor.trace import TraceWriter
from kvdoctor.tui.app import bus_app
from kvdoctor.tui.screens import DetailScreen, HelpScreen
from kvdoctor.tui.synthetic import SyntheticWorkload
from kvdoctor.tui.widgets.blockmap import BlockMap
from kvdoctor.tui.widgets.eventlog import EventLog
from kvdoctor.tui.widgets.findings import FindingDetail, FindingsList
from kvdoctor.tui.widgets.header import StatusHeader
from tui_helpers import RECORDED, live_app, replay_app, replayed, screen_text, sync, wait_ended, wait_for


@sync
async def test_number_keys_switch_screens(leak_trace: Path):
    async with replayed(leak_trace, size=(80, 24)) as (app, pilot):
        tabs = app.query_one(TabbedContent)
        for key, pane in (("2", "findings"), ("3", "attention-tab"), ("4", "memory-tab"), ("5", "events"), ("1", "overview")):
            await pilot.press(key)
            await pilot.pause()
            assert tabs.active == pane


@sync
async def test_findings_are_listed_newest_first_with_a_detail_pane(leak_trace: Path):
    async with replayed(leak_trace, size=(100, 30)) as (app, pilot):
        await pilot.press("2")
        await pilot.pause()
        flist = app.query_one("#findings-list", FindingsList)
        steps = [flist.finding(i).step for i in range(flist.row_count())]
        assert steps and steps == sorted(steps, reverse=True)
        # WHEN the cursor moves down THEN the detail pane follows the selected finding
        await pilot.press("down")
        await pilot.pause()
        assert flist.cursor == 1
        detail = str(app.query_one("#detail", FindingDetail).content)
        assert flist.selected.message in detail and "block history" in detail
        assert flist.selected.message[:30] in screen_text(app)


@sync
async def test_detail_key_opens_the_selected_finding_in_full_and_escape_closes_it(leak_trace: Path):
    async with replayed(leak_trace, size=(100, 30)) as (app, pilot):
        await pilot.press("2", "d")
        await pilot.pause()
        assert isinstance(app.screen, DetailScreen)
        assert "leak/" in screen_text(app) and "evidence" in screen_text(app)
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, DetailScreen)


@sync
async def test_search_finds_a_block_and_a_sequence(leak_trace: Path):
    async with replayed(leak_trace, size=(100, 30)) as (app, pilot):
        await pilot.press("s")
        await pilot.press(*"b3", "enter")
        await pilot.pause()
        assert isinstance(app.screen, DetailScreen)
        text = screen_text(app)
        assert "block 3" in text and "history" in text
        assert app.query_one("#blocks", BlockMap).selected == 3
        await pilot.press("escape", "s", *"s5", "enter")
        await pilot.pause()
        assert isinstance(app.screen, DetailScreen) and "prompt tokens" in screen_text(app)


@sync
async def test_search_for_an_unknown_block_says_so(leak_trace: Path):
    async with replayed(leak_trace, size=(100, 30)) as (app, pilot):
        await pilot.press("s", *"b99999", "enter")
        await pilot.pause()
        assert not isinstance(app.screen, DetailScreen)
        assert any("no block 99999" in str(n.message) for n in app._notifications)


@sync
async def test_filter_narrows_the_event_log(leak_trace: Path):
    async with replayed(leak_trace, size=(100, 30)) as (app, pilot):
        await pilot.press("slash")
        await pilot.pause()
        assert isinstance(app.focused, Input) and app.query_one(TabbedContent).active == "events"
        await pilot.press(*"swap -swap_in", "enter")
        await pilot.pause()
        log = app.query_one("#log", EventLog)
        kinds = {type(ev).__name__ for ev in log._rows}
        assert kinds == {"SwapOut"}
        assert isinstance(app.focused, EventLog)


@sync
async def test_help_opens_and_closes(leak_trace: Path):
    app = replay_app(leak_trace)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen) and "search: b17 (block)" in screen_text(app)
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, HelpScreen)


@sync
async def test_clicking_a_block_on_the_map_opens_its_history(leak_trace: Path):
    async with replayed(leak_trace, size=(100, 30)) as (app, pilot):
        blocks = app.query_one("#blocks", BlockMap)
        first = app.snapshot.cell_ids[2]
        cell_width, _ = blocks._layout()
        assert await pilot.click("#blocks", offset=(1 + 2 * cell_width, 1))  # past the border, the third cell
        await pilot.pause()
        assert blocks.selected == first
        assert isinstance(app.screen, DetailScreen) and f"block {first}" in screen_text(app)


@sync
async def test_clicking_a_finding_selects_it(leak_trace: Path):
    async with replayed(leak_trace, size=(100, 30)) as (app, pilot):
        await pilot.press("2")
        await pilot.pause()
        assert await pilot.click("#findings-list", offset=(5, 3))  # the third row
        await pilot.pause()
        assert app.query_one("#findings-list", FindingsList).cursor == 2


@sync
async def test_replay_steps_and_seeks_by_step(leak_trace: Path):
    app = replay_app(leak_trace, start=100)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.snapshot is not None and "step 100 of 299" in app.snapshot.status)
        await pilot.press("n")
        await wait_for(pilot, lambda: "step 101 of" in app.snapshot.status)
        await pilot.press("b", "b")
        await wait_for(pilot, lambda: "step 99 of" in app.snapshot.status)
        await pilot.press("g", *"250", "enter")
        await wait_for(pilot, lambda: "step 250 of" in app.snapshot.status)
        assert app.snapshot.step == 251  # the state after step 250
        await pilot.press("p")  # play
        await wait_for(pilot, lambda: app.snapshot.ended == "end of trace")


@sync
async def test_pause_freezes_the_display_while_the_checks_keep_up(tmp_path: Path):
    # GIVEN a workload that is writing its trace
    w = SyntheticWorkload(num_steps=200, fault="leak-swapped")
    events = list(w.events())
    path = tmp_path / "live.kvtrace"
    writer = TraceWriter(path, w.header())
    writer.write_many(events[:1000])
    app = live_app(path)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.snapshot is not None and app.snapshot.num_events >= 1000)
        # WHEN paused, and the workload writes the rest and closes
        await pilot.press("p")
        await pilot.pause()
        shown = app.snapshot
        assert "PAUSED" in screen_text(app) and app.query_one(StatusHeader).paused
        thread = threading.Thread(target=lambda: (writer.write_many(events[1000:]), writer.close()))
        thread.start()
        thread.join()
        await wait_for(pilot, lambda: not app.feed.is_alive())
        await pilot.pause(0.2)
        # THEN the display still shows the old state, but the checks saw every event
        assert app.snapshot is shown
        assert app.feed.monitor.num_events == len(events) + 1
        # WHEN resumed THEN the newest state appears, with the leak found meanwhile
        await pilot.press("p")
        await pilot.pause()
        assert app.snapshot.num_events == len(events) + 1 and app.snapshot.num_findings["error"] > 0


@sync
async def test_missing_trace_is_a_clear_message_on_screen(tmp_path: Path):
    app = live_app(tmp_path / "absent.kvtrace", wait_s=0.2)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_ended(pilot)
        text = screen_text(app)
        assert "no trace at" in text and "Traceback" not in text


@sync
async def test_quit_key_exits(leak_trace: Path):
    app = replay_app(leak_trace)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0 and not app.feed.is_alive()


@pytest.mark.skipif(not RECORDED.exists(), reason="recorded trace missing")
@sync
async def test_recorded_demo_trace_shows_the_leaked_swapped_blocks():
    # GIVEN a trace recorded from the real engine (tiny model) with the leak-swapped fault
    async with replayed(RECORDED, size=(100, 30)) as (app, pilot):
        s = app.snapshot
        leaks = [f for f in s.findings if f.check == "leak" and f.rule == "unreachable-swapped"]
        assert leaks, "the recorded leak is found"
        host = next(t for t in s.tiers if t.name == "host")
        assert host.leaked == len({f.block for f in leaks})
        await pilot.press("2", "enter")
        await pilot.pause()
        assert isinstance(app.screen, DetailScreen) and "swap_out" in screen_text(app)


def _replay_on_bus(bus, events) -> None:
    """Emit recorded events through a real engine Bus, step by step, as an engine would."""
    for ev in events:
        if type(ev) is StepEnd:
            bus.end_step(ev.num_tokens)
        elif type(ev) is not TraceEnd:
            bus.emit(type(ev), **{f: getattr(ev, f) for f in ev.__struct_fields__ if f not in ("t", "step")})


@sync
async def test_engine_in_this_process_is_watched_through_its_bus():
    # GIVEN an engine bus in this process and a serving loop that leaks swapped-out blocks
    w = SyntheticWorkload(num_steps=200, fault="leak-swapped")
    bus = Bus()
    app = bus_app(bus, w.header(), lambda: _replay_on_bus(bus, w.events()), show_pid=False)
    async with app.run_test(size=(100, 30)) as pilot:
        # WHEN the loop finishes THEN every event was checked, the leak shows, and the end is said
        await wait_ended(pilot)
        s = app.snapshot
        assert s.ended == "the engine's work finished" and s.step == 200
        assert any(f.rule == "unreachable-swapped" for f in s.findings)
        assert "the engine's work finished" in screen_text(app)


@sync
async def test_an_engine_loop_that_raises_is_reported_on_screen():
    bus = Bus()

    def boom() -> None:
        bus.end_step(0)
        raise RuntimeError("out of blocks")

    app = bus_app(bus, SyntheticWorkload().header(), boom, show_pid=False)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_ended(pilot)
        assert app.snapshot.ended == "the engine's work raised RuntimeError: out of blocks"


@sync
async def test_block_map_of_thousands_of_blocks_scrolls_and_maps_clicks(tmp_path: Path):
    # GIVEN 6000 blocks over three tiers
    from kvdoctor.events import Alloc, Header, SeqStart, TierSpec

    header = Header(block_size=16, num_layers=2, tiers=[TierSpec(name="device", capacity_blocks=2000),
                                                         TierSpec(name="host", capacity_blocks=2000),
                                                         TierSpec(name="disk", capacity_blocks=2000)])
    tiers = ("device", "host", "disk")
    events = [SeqStart(seq=0, prompt_len=1)] + [Alloc(block=b, tier=tiers[b // 2000], seq=0) for b in range(6000)]
    path = tmp_path / "big.kvtrace"
    with TraceWriter(path, header) as writer:
        writer.write_many(events + [StepEnd()])
    async with replayed(path, size=(100, 30)) as (app, pilot):
        blocks = app.query_one("#blocks", BlockMap)
        cols = blocks.scrollable_content_region.width
        # THEN one character per block, the map as tall as the blocks need; only visible rows are drawn
        assert blocks._layout() == (1, cols)
        assert blocks.virtual_size.height == -(-6000 // cols)
        # WHEN scrolled to the end and the last cell clicked THEN that block opens
        blocks.scroll_end(animate=False, immediate=True)
        await pilot.pause()
        last_row = 5999 // cols - round(blocks.scroll_offset.y)
        assert await pilot.click("#blocks", offset=(1 + 5999 % cols, 1 + last_row))
        await pilot.pause()
        assert blocks.selected == 5999 and "block 5999" in screen_text(app)


@sync
async def test_clicking_a_tab_switches_screens(leak_trace: Path):
    async with replayed(leak_trace, size=(100, 30)) as (app, pilot):
        assert await pilot.click("#--content-tab-attention-tab")
        await pilot.pause()
        assert app.query_one(TabbedContent).active == "attention-tab"
        assert "entropy" in screen_text(app)


@sync
async def test_a_prefix_cached_trace_shows_its_hit_rate_and_the_cached_blocks(tmp_path: Path):
    # GIVEN a trace where a prefix cache keeps a request's first block and a later request hits it
    path = tmp_path / "prefix.kvtrace"
    events = [SeqStart(seq=1, prompt_len=20), Alloc(block=0, tier="device", seq=1), Alloc(block=1, tier="device", seq=1),
              Share(block=0, seq=PREFIX_CACHE, hash="k0"), StepEnd(prefix_hits=0, prefix_misses=1),
              SeqEnd(seq=1, step=1), Free(block=1, step=1), SeqStart(seq=2, prompt_len=20, step=1),
              Share(block=0, seq=2, hash="k0", step=1), StepEnd(step=1, prefix_hits=1, prefix_misses=0),
              TraceEnd(step=2)]
    header = Header(block_size=16, num_layers=2, tiers=[TierSpec(name="device", capacity_blocks=8)])
    with TraceWriter(path, header) as w:
        w.write_many(events)
    # WHEN it is replayed THEN the header gives the hit rate and the block map's legend names cached blocks
    async with replayed(path, size=(120, 30)) as (app, pilot):
        text = screen_text(app)
        assert "prefix hit 50%" in text
        assert "cached" in str(app.query_one(BlockMap).border_subtitle)
