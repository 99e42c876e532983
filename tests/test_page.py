"""The one-page HTML report: built as a console is printed to, escaped, self-contained, and
rendered for real in headless Chromium (Debian's ``chromium``; .ci/run installs it)."""

from __future__ import annotations

import os
import shutil
import subprocess
from html.parser import HTMLParser

import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.image import imread
from rich.table import Table

from kvstrata.cli import main
from kvstrata.page import HtmlPage, table_html, text_html
from kvstrata.plots import png_bytes
from kvstrata.sim.synthetic import SyntheticConfig, generate
from kvstrata.sim.traceio import write_trace

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# As root Chromium needs --no-sandbox; the rest keep it off this machine's closed network.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium not found: apt-get install chromium (.ci/run installs it)"
)


class Dom(HTMLParser):
    """The parts of a page the tests look at: text per tag, tables' cells, image sources."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text: dict[str, list[str]] = {}
        self.images: list[dict[str, str]] = []
        self.tables = 0
        self._open: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs))
            return
        self.tables += tag == "table"
        self._open.append(tag)
        self.text.setdefault(tag, []).append("")

    def handle_endtag(self, tag):
        if tag in self._open:
            while self._open.pop() != tag:
                pass

    def handle_data(self, data):
        for tag in set(self._open):
            self.text[tag][-1] += data


def test_a_table_keeps_its_title_headers_cells_and_justification_and_escapes_them():
    t = Table(title="SLO: p90 <= 2 s")
    t.add_column("arch")
    t.add_column("tok/s", justify="right")
    t.add_row("<b>hbm</b> & co", "1,234")
    t.add_row("[green]yes[/]", "[red]no[/]")
    out = table_html(t)
    assert "<caption>SLO: p90 &lt;= 2 s</caption>" in out
    assert '<th>arch</th><th class="r">tok/s</th>' in out
    assert "<td>&lt;b&gt;hbm&lt;/b&gt; &amp; co</td>" in out and "<b>" not in out
    assert '<td class="r">1,234</td>' in out
    assert '<span style="color:#008000">yes</span>' in out and "[green]" not in out


def test_markup_becomes_inline_styles_and_text_is_escaped():
    assert text_html("[bold]a[/] <x>") == '<span style="font-weight:bold">a</span> &lt;x&gt;'
    assert text_html("[dim]n/a[/]") == '<span style="opacity:.65">n/a</span>'


def test_a_page_is_one_self_contained_file(tmp_path):
    page = HtmlPage("plan <for> \"llama\"")
    page.print("header [bold]line[/]")
    fig = Figure()
    fig.subplots().plot([1, 2], [1, 2])
    page.image(png_bytes(fig), 'restore "time"')
    out = page.write(tmp_path / "sub" / "r.html")
    text = out.read_text()
    dom = Dom(text)
    assert dom.text["title"] == ['plan <for> "llama"'] and dom.text["h1"] == ['plan <for> "llama"']
    assert [img["alt"] for img in dom.images] == ['restore "time"']
    assert dom.images[0]["src"].startswith("data:image/png;base64,iVBOR")
    assert "default-src 'none'" in text  # the page may load nothing: no scripts, fonts or remote images
    assert "http://" not in text and "https://" not in text and "<script" not in text


def chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "chromium-profile"
    profile.mkdir(exist_ok=True)
    env = os.environ | {"HOME": str(tmp_path)}
    return subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args], env=env,
                          capture_output=True, text=True, timeout=120, check=True)


def rendered(tmp_path, page) -> tuple[Dom, np.ndarray]:
    """The page as Chromium parsed it (``--dump-dom``), and a screenshot of it as RGB pixels (one launch)."""
    shot = tmp_path / "shot.png"
    dom = Dom(chromium(tmp_path, "--dump-dom", "--window-size=1280,2000", f"--screenshot={shot}", page.as_uri()).stdout)
    return dom, imread(shot)[..., :3]


def assert_plots_were_drawn(pixels: np.ndarray) -> None:
    """Not blank, and the embedded PNGs decoded: matplotlib's first line colour (C0, #1f77b4) is on screen."""
    assert pixels.std() > 0.05, "the page rendered blank"
    blue = np.abs(pixels - np.array([0x1F, 0x77, 0xB4]) / 255).max(axis=-1) < 0.05
    assert blue.sum() > 200, "no plot on screen: the embedded images did not render"


@pytest.mark.server  # a headless browser beside the test
@needs_chromium
def test_simulate_report_renders_its_table_and_cdfs_in_chromium(tmp_path, capsys):
    trace = tmp_path / "chat.jsonl"
    write_trace(trace, generate(SyntheticConfig(requests=40, rate=2.0, seed=1)))
    page = tmp_path / "sim.html"
    assert main(["simulate", "--trace", str(trace), "--hardware", "h200-cx7-gen5", "--model", "llama-3-8b",
                 "--arch", "hbm,remote-gdr", "--instances", "2", "--html", str(page)]) == 0
    assert f"report written to {page}" in capsys.readouterr().out
    dom, pixels = rendered(tmp_path, page)
    assert dom.text["h1"] == ["kvstrata simulate: chat.jsonl, llama-3-8b on h200-cx7-gen5, 2 instance(s) x 1 GPU(s)"]
    assert dom.tables == 1
    assert dom.text["caption"] == ["40 requests; SLO: TTFT p90 <= 2 s, TPOT p99 <= 100 ms; goodput: requests with "
                                   "TTFT <= 2000 ms and TPOT <= 100 ms"]
    assert {"TTFT p50/p90/p99 s", "TPOT p50/p90/p99 ms", "SLO"} <= set(dom.text["th"])
    assert {"hbm", "remote-gdr"} <= set(dom.text["td"])
    assert any(p.startswith("offered prefill load") for p in dom.text["p"])
    captions = dom.text["figcaption"]
    assert [c.split(":")[0] for c in captions] == ["TTFT CDF per architecture", "TPOT CDF per architecture"]
    assert all("chat.jsonl: llama-3-8b on h200-cx7-gen5" in c for c in captions)
    assert len(dom.images) == 2 and all(i["src"].startswith("data:image/png;base64,") for i in dom.images)
    assert_plots_were_drawn(pixels)


@pytest.mark.server  # a headless browser beside the test
@needs_chromium
def test_plan_report_renders_both_profiles_the_speedups_and_the_plot_in_chromium(tmp_path, capsys):
    page = tmp_path / "plan.html"
    assert main(["plan", "--model", "llama-3-8b", "--context", "4096", "--vs", "+cx8", "--html", str(page),
                 "--json"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("{") and f"report written to {page}" in out.err  # stdout stays JSON
    dom, pixels = rendered(tmp_path, page)
    assert dom.text["h1"] == ["kvstrata plan: llama-3-8b on h200-cx7-gen5 vs h200-cx7-gen5+cx8, 4,096-token context"]
    assert dom.tables == 5  # restore paths and architectures for each profile, then the speed-ups
    assert "h200-cx7-gen5+cx8 vs h200-cx7-gen5: speed-up (>1 = faster)" in dom.text["caption"]
    assert {"DRAM -> HBM", "remote -> HBM (GDR)", "hbm", "nvme"} <= set(dom.text["td"])
    assert dom.text["figcaption"] == [
        "KV restore time per path: llama-3-8b (bf16), 1 GPU(s) on h200-cx7-gen5 vs h200-cx7-gen5+cx8"
    ]
    assert_plots_were_drawn(pixels)
