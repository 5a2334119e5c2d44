"""`kvdoctor check --format html`: one self-contained page with the findings, their block
histories and inline SVG plots over steps, and no reference to anything on the network."""

from __future__ import annotations

from html.parser import HTMLParser

from check_traces import clean_events, leaky_events, with_usage, write_trace

from kvdoctor.cli import main


class _Page(HTMLParser):
    """What the tests look at: finding rows' text, SVG titles, and every URL-ish attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self.svg_titles: list[str] = []
        self.urls: list[str] = []
        self.tags: set[str] = set()
        self._in_row = self._want_title = self._in_title = False

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        for name, value in attrs:
            if name in ("src", "href", "xlink:href", "action", "data") or (value and "url(" in value):
                self.urls.append(value or "")
        if tag == "tr" and ("class", "finding") in attrs:
            self._in_row = True
            self.rows.append([])
        if tag == "svg":
            self._want_title = True  # a plot's own title comes first; bars carry tooltips
        self._in_title |= tag == "title"

    def handle_endtag(self, tag):
        if tag == "tr":
            self._in_row = False
        if tag == "title":
            self._in_title = False

    def handle_data(self, data):
        if self._in_row:
            self.rows[-1].append(data)
        if self._want_title and self._in_title:
            self.svg_titles.append(data)
            self._want_title = False


def _render(tmp_path, capsys, events) -> tuple[int, str, _Page]:
    trace = write_trace(tmp_path / "t.kvtrace", events)
    out = tmp_path / "report.html"
    code = main(["check", "--trace", str(trace), "--format", "html", "-o", str(out)])
    err = capsys.readouterr().err
    page = _Page()
    text = out.read_text(encoding="utf-8")
    page.feed(text)
    return code, err + text, page


def test_a_trace_with_a_fault_gives_findings_histories_and_plots(tmp_path, capsys):
    # GIVEN a trace with a leaked swapped-out block (error) and an unknown-block share (warning)
    code, text, page = _render(tmp_path, capsys, with_usage(leaky_events()))
    # THEN the exit code is check's, and the table holds both findings with the leak's history
    assert code == 1 and "KVDOCTOR SUMMARY: 1 errors, 1 warnings, 0 info" in text
    assert len(page.rows) == 2
    leak = next(r for r in page.rows if "leak/unreachable-swapped" in r)
    assert "error" in leak and any(cell.startswith("alloc@1(device, seq 'r1') -> write@1") for cell in leak)
    # AND three plots drawn inline, the usage line from the trace's readings
    assert page.svg_titles == ["tier usage (blocks)", "swaps per step", "findings per step"]
    assert "<polyline" in text and "<script" not in text
    # AND nothing is fetched at view time
    assert page.urls == [] and "http://" not in text and "https://" not in text and "link" not in page.tags


def test_a_clean_trace_says_no_findings(tmp_path, capsys):
    code, _, page = _render(tmp_path, capsys, clean_events())
    assert code == 0 and page.rows == [] and len(page.svg_titles) == 3
