"""The built site as a reader sees it: headless Chromium, with every request off the local server blocked.

For every page of the site (chapters first): math is typeset by MathJax, every mermaid diagram is drawn as
SVG, no script logs an error, no request fails or leaves the machine, every image has loaded, no code block
needs horizontal scrolling on a 1440-px screen, and a search returns results. Every chapter page also shows
at least one executed cell's output (``<div class="chapter-output">``). Screenshots of the landing page and
of a chapter are saved under ``build/screenshots/``.

    scripts/test.sh                                   builds the site, then runs this file on it
    SITE_DIR=site pytest tests/test_site_browser.py   on a site already built (else it builds one)

Chromium comes from the OS packages (``/usr/bin/chromium``; scripts/setup.sh dev installs it where it can);
without it the tests are skipped. Playwright drives it; its own browser download is never used.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from minisgl_ref.book import OUTPUT_COLUMNS
from tests.test_chapter_sources import COMMIT_HASH, PROCESS

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOTS = ROOT / "build" / "screenshots"
VIEWPORT = {"width": 1440, "height": 900}
SEARCH_QUERY = "radix"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
# At VIEWPORT's width a code line of up to this many characters fits in the content column
# (docs/stylesheets/extra.css); only a block with a longer line may scroll sideways.
CODE_COLUMNS = 120
# A diagram's labels, as drawn (font size times the scale the SVG is shrunk or grown by to fit the column), must
# be at least this many pixels high, and the drawing at most this many viewports tall: a diagram wider than the
# column is scaled down until its text cannot be read, and a tall one cannot be seen whole.
DIAGRAM_MIN_LABEL_PX = 11
DIAGRAM_MAX_VIEWPORTS = 1.3
# A printed output line (the ``text`` blocks of a chapter's outputs) is at most OUTPUT_COLUMNS characters long:
# the width minisgl_ref.book wraps the chapters' printed text to.

pytestmark = pytest.mark.browser


def _chromium() -> str | None:
    for candidate in (os.environ.get("CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


# --- the site and a server for it ------------------------------------------------------------------

@pytest.fixture(scope="session")
def site_dir(tmp_path_factory) -> Path:
    """The built site: $SITE_DIR when it holds one, else a fresh strict build."""
    given = os.environ.get("SITE_DIR")
    if given and (Path(given) / "index.html").is_file():
        return Path(given).resolve()
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
                   cwd=ROOT, env=env, check=True)
    return out


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _serve(directory: Path):
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


@pytest.fixture(scope="session")
def browser():
    executable = _chromium()
    if executable is None:
        pytest.skip("no Chromium here (/usr/bin/chromium): install the OS package `chromium` "
                    "(scripts/setup.sh dev does so when it runs as root) to run the browser tests")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


# Material draws each diagram into a closed shadow root; opening it lets the test look inside. Uncaught
# errors are also noted in the page, so that a wait for a drawing stops as soon as one has failed.
_INIT_SCRIPT = """
const attach = Element.prototype.attachShadow;
Element.prototype.attachShadow = function (init) { return attach.call(this, {...init, mode: "open"}); };
window.__uncaught = 0;
window.addEventListener("error", () => { window.__uncaught += 1; });
window.addEventListener("unhandledrejection", () => { window.__uncaught += 1; });
"""


class PageVisit:
    """One page loaded with the network blocked, and everything that went wrong while it loaded."""

    def __init__(self, browser, base: str, path: str):
        self.base, self.path = base, path
        self.console_errors: list[str] = []
        self.failed: list[str] = []
        self.blocked: list[str] = []
        self.context = browser.new_context(viewport=VIEWPORT, service_workers="block")
        self.context.add_init_script(_INIT_SCRIPT)
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.on("console", lambda m: m.type == "error" and self.console_errors.append(m.text))
        self.page.on("pageerror", lambda e: self.console_errors.append(f"uncaught: {e}"))
        self.page.on("requestfailed", lambda r: self.failed.append(f"{r.url} ({r.failure})"))
        self.page.on("response", lambda r: r.status >= 400 and self.failed.append(f"{r.url} (HTTP {r.status})"))
        self.page.goto(base + path, wait_until="load")

    def _route(self, route):
        url = route.request.url
        if url.startswith(self.base) or url.startswith(("data:", "blob:")):
            route.continue_()
        else:
            self.blocked.append(url)
            route.abort("blockedbyclient")

    def close(self):
        self.context.close()

    # -- what a reader sees --

    def wait_for_math(self) -> dict:
        """Wait until MathJax has typeset the page; returns counts and any raw TeX left in the text."""
        self.page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.promise",
                                    timeout=60_000)
        self.page.evaluate("() => Promise.race([MathJax.startup.promise.then(() => MathJax.typesetPromise()),"
                           " new Promise((_, no) => setTimeout(() => no(new Error('MathJax timed out')), 60000))])")
        return self.page.evaluate("""() => {
            const spans = [...document.querySelectorAll('.arithmatex')];
            const article = document.querySelector('article').cloneNode(true);
            article.querySelectorAll('pre, code, mjx-container').forEach(e => e.remove());
            const raw = article.textContent.match(/\\\\[\\(\\[]/g) || [];
            return {arithmatex: spans.length,
                    typeset: spans.filter(s => s.querySelector('mjx-container')).length,
                    mjx: document.querySelectorAll('mjx-container').length,
                    raw_tex: raw.length};
        }""")

    def wait_for_diagrams(self, expected: int) -> list[dict]:
        """Wait until Material has replaced every diagram source by its drawing; one entry per diagram."""
        self.page.wait_for_function(
            """(n) => window.__uncaught > 0 || document.querySelectorAll('pre.mermaid').length === 0
                     && document.querySelectorAll('div.mermaid').length >= n
                     && [...document.querySelectorAll('div.mermaid')].every(d => d.shadowRoot
                            && d.shadowRoot.querySelector('svg'))""",
            arg=expected, timeout=60_000)
        return self.page.evaluate("""() => [...document.querySelectorAll('div.mermaid')].map(d => {
            const svg = d.shadowRoot && d.shadowRoot.querySelector('svg');
            if (!svg) return {width: 0, height: 0, text: 'no drawing'};
            const box = svg.getBoundingClientRect();
            return {width: box.width, height: box.height, text: svg.textContent.slice(0, 200)};
        })""")

    def diagram_sizes(self) -> list[dict]:
        """Each drawn diagram's rendered size and the smallest label on it, in CSS pixels: the computed font size
        of every visible text (SVG ``<text>`` and the HTML labels inside ``<foreignObject>``) times the scale
        from the SVG's coordinates to the screen."""
        return self.page.evaluate("""() => [...document.querySelectorAll('div.mermaid')].map(d => {
            const svg = d.shadowRoot && d.shadowRoot.querySelector('svg');
            if (!svg) return null;
            const box = svg.getBoundingClientRect();
            const scale = el => { const m = el.getScreenCTM(); return m ? Math.hypot(m.a, m.b) : 1; };
            const shown = el => { const r = el.getBoundingClientRect(); return r.width > 0 && r.height > 0; };
            const hasText = el => [...el.childNodes].some(n => n.nodeType === 3 && n.textContent.trim());
            let min = Infinity, smallest = '';
            const note = (el, px) => { if (px < min) { min = px; smallest = el.textContent.trim().slice(0, 60); } };
            for (const t of svg.querySelectorAll('text'))
                if (t.textContent.trim() && shown(t)) note(t, parseFloat(getComputedStyle(t).fontSize) * scale(t));
            for (const fo of svg.querySelectorAll('foreignObject'))
                for (const el of fo.querySelectorAll('*'))
                    if (hasText(el) && shown(el)) note(el, parseFloat(getComputedStyle(el).fontSize) * scale(fo));
            return {width: Math.round(box.width), height: Math.round(box.height),
                    min_label_px: min === Infinity ? null : Math.round(min * 10) / 10, smallest,
                    text: svg.textContent.replace(/\\s+/g, ' ').slice(0, 60)};
        }).filter(d => d)""")

    def images(self) -> list[dict]:
        self.page.evaluate("""() => Promise.all([...document.images].map(img => {
            img.loading = 'eager';
            return img.complete ? null : new Promise(r => { img.onload = img.onerror = r; setTimeout(r, 10000); });
        }))""")
        return self.page.evaluate("""() => [...document.images].map(img =>
            ({src: img.currentSrc || img.src, natural: img.naturalWidth, complete: img.complete}))""")

    def article_words(self) -> dict:
        """The article's text as a reader reads it: without code (blocks, outputs and inline code), scripts and
        typeset math; ``prose`` is the same without tables (a table of runs may name each run's commit)."""
        return self.page.evaluate("""() => {
            const article = document.querySelector('article');
            if (!article) return {text: '', prose: ''};
            const copy = article.cloneNode(true);
            copy.querySelectorAll('pre, code, script, style, mjx-container').forEach(e => e.remove());
            const text = copy.textContent;
            copy.querySelectorAll('table').forEach(e => e.remove());
            return {text: text, prose: copy.textContent};
        }""")

    def chapter_outputs(self) -> int:
        return self.page.locator("article .chapter-output").count()

    def undescribed_figures(self) -> list[dict]:
        """Images of a chapter's outputs that are not a numbered, captioned figure with a real alt text."""
        return self.page.evaluate("""() => [...document.querySelectorAll('article .chapter-output img')].map(img => {
            const figure = img.closest('figure');
            const caption = figure && figure.querySelector('figcaption');
            return {src: img.getAttribute('src'), alt: img.getAttribute('alt') || '',
                    caption: caption ? caption.textContent.trim() : null};
        }).filter(f => f.caption === null || !/^Figure \\d+\\.\\d+: /.test(f.caption) || f.alt.trim().length < 20
                       || /^Figure \\d+ of chapter/i.test(f.alt))""")

    def wide_code(self) -> list[dict]:
        return self.page.evaluate("""() => [...document.querySelectorAll('article pre > code')]
            .filter(c => c.scrollWidth > c.clientWidth + 1)
            .map(c => ({first_line: c.textContent.split('\\n')[0].trim(),
                        longest_line: Math.max(...c.textContent.split('\\n').map(l => l.length)),
                        scroll: c.scrollWidth, client: c.clientWidth}))""")

    def wide_output_lines(self, width: int) -> list[dict]:
        """Lines longer than ``width`` in the printed-text outputs of a chapter (the ``text`` fences the chapter
        renderer wraps in ``.chapter-output``, which the build highlights as ``.language-text``; code shown with
        ``show_code`` is ``.language-python`` and follows the code rule instead)."""
        return self.page.evaluate("""(width) => [...document.querySelectorAll(
                'article .chapter-output .language-text pre > code')]
            .flatMap(c => c.textContent.split('\\n').filter(l => l.length > width)
                .map(l => ({length: l.length, line: l.slice(0, 80)})))""", width)

    def search(self, query: str) -> int:
        box = self.page.locator("input.md-search__input")
        box.click()
        # The theme builds its search index in a web worker after the page loads (seconds for this site's index
        # on a slow machine), and a query set before it is ready can be lost; so wait for the result header to
        # leave its "Initializing search" state, then type the query key by key, as a reader does (the theme
        # searches on keyboard events: a value set in one go after start-up finds nothing).
        self.page.wait_for_function(
            "() => { const m = document.querySelector('.md-search-result__meta');"
            " return !m || !m.textContent.includes('Initializing'); }",
            timeout=90_000)
        box.press_sequentially(query, delay=20)
        self.page.wait_for_function(
            "() => document.querySelectorAll('.md-search-result__item').length > 0", timeout=60_000)
        return self.page.locator(".md-search-result__item").count()


def _pages(site: Path) -> list[str]:
    pages = sorted(p.parent.relative_to(site).as_posix() + "/" for p in site.rglob("index.html")
                   if "vendor" not in p.parts)
    pages = ["" if p == "./" else p for p in pages]
    return sorted(pages, key=lambda p: (not p.startswith("chapters/"), p))


def _is_chapter(path: str) -> bool:
    return re.fullmatch(r"chapters/\d\d_[a-z0-9_]+/", path) is not None


def _static_counts(site: Path, path: str) -> dict:
    html = (site / path / "index.html").read_text(encoding="utf-8")
    return {"mermaid": len(re.findall(r'<pre class="mermaid"', html)),
            "math": len(re.findall(r'class="arithmatex"', html))}


def _outputs_expected() -> bool:
    """Whether this build renders executed cell outputs: its chapter renderer wraps each one in
    ``<div class="chapter-output">``, so the class name appears in the repository's own files (outside this
    test). A build whose renderer shows code only has nothing to look for."""
    try:
        found = subprocess.run(["git", "grep", "--untracked", "-l", "-F", "chapter-output", "--", ".",
                                ":(exclude)tests/test_site_browser.py"],
                               cwd=ROOT, capture_output=True, text=True, check=False)
        if found.returncode in (0, 1):
            return bool(found.stdout.strip())
    except OSError:
        pass
    for path in (ROOT / "docs").rglob("*"):  # no git: the renderer lives under docs/
        if path.is_file() and path.suffix in {".py", ".html", ".md", ".js", ".css", ".yml"}:
            if "chapter-output" in path.read_text(encoding="utf-8", errors="replace"):
                return True
    return False


# --- the tests ---------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def served(site_dir):
    server, base = _serve(site_dir)
    yield site_dir, base
    server.shutdown()


def process_words_and_hashes(words: dict) -> list[str]:
    """Words about how a measurement was run, and commit hashes outside tables, in a page's rendered text: the
    patterns of tests/test_chapter_sources.py, applied to what a reader sees (generated pages and rendered
    docstrings included, which that test does not read)."""
    found = []
    for m in PROCESS.finditer(words["text"]):
        context = " ".join(words["text"][max(0, m.start() - 50):m.end() + 50].split())
        found.append(f"process word {m.group(0)!r} in the text: ...{context}...")
    for m in COMMIT_HASH.finditer(words["prose"]):
        context = " ".join(words["prose"][max(0, m.start() - 50):m.end() + 50].split())
        found.append(f"commit hash {m.group(0)} outside a table: ...{context}...")
    return found


def check_page(browser, site: Path, base: str, path: str, *, expect_outputs: bool) -> list[str]:
    """Every reader-facing check on one page; returns the problems found (empty when the page is right)."""
    problems: list[str] = []
    static = _static_counts(site, path)
    visit = PageVisit(browser, base, path)
    step = "math"
    try:
        if static["math"]:
            math = visit.wait_for_math()
            if math["typeset"] < math["arithmatex"] or math["mjx"] == 0:
                problems.append(f"math not typeset: {math}")
            if math["raw_tex"]:
                problems.append(f"raw TeX delimiters left in the text: {math}")
        step = "diagrams"
        if static["mermaid"]:
            diagrams = visit.wait_for_diagrams(static["mermaid"])
            if len(diagrams) != static["mermaid"]:
                problems.append(f"{static['mermaid']} diagrams in the page, {len(diagrams)} drawn")
            for d in diagrams:
                if d["width"] < 20 or d["height"] < 20 or "Syntax error" in d["text"]:
                    problems.append(f"diagram not drawn properly: {d}")
        step = "diagram sizes"
        if static["mermaid"]:
            for d in visit.diagram_sizes():
                if d["min_label_px"] is not None and d["min_label_px"] < DIAGRAM_MIN_LABEL_PX:
                    problems.append(f"diagram labels drawn {d['min_label_px']} px high (< {DIAGRAM_MIN_LABEL_PX}): "
                                    f"{d}")
                if d["height"] > DIAGRAM_MAX_VIEWPORTS * VIEWPORT["height"]:
                    problems.append(f"diagram {d['height']} px tall (> {DIAGRAM_MAX_VIEWPORTS} viewports): {d}")
        step = "images"
        for img in visit.images():
            if not img["complete"] or img["natural"] <= 0:
                problems.append(f"image did not load: {img}")
        if expect_outputs and visit.chapter_outputs() == 0:
            problems.append("no executed output (div.chapter-output) on this chapter page")
        step = "figures"
        if _is_chapter(path):
            problems += [f"figure without a numbered caption and an alt text that describes it: {f}"
                         for f in visit.undescribed_figures()]
        if _is_chapter(path):
            for block in visit.wide_code():
                if block["longest_line"] <= CODE_COLUMNS:
                    problems.append(f"code block wider than the column at {VIEWPORT['width']} px: {block}")
        if _is_chapter(path):
            for line in visit.wide_output_lines(OUTPUT_COLUMNS):
                problems.append(f"printed output line longer than {OUTPUT_COLUMNS} characters: {line}")
        step = "words"
        problems += process_words_and_hashes(visit.article_words())
        step = "search"
        hits = visit.search(SEARCH_QUERY)
        if hits == 0:
            problems.append(f"search for {SEARCH_QUERY!r} found nothing")
        visit.page.wait_for_load_state("networkidle")
        problems += [f"console error: {e}" for e in visit.console_errors]
        problems += [f"failed request: {f}" for f in visit.failed]
        problems += [f"request off the local server (blocked): {u}" for u in visit.blocked]
    except Exception as exc:  # a wait that timed out: report it with what was seen so far
        problems.append(f"{step}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
        problems += [f"console error: {e}" for e in visit.console_errors]
        problems += [f"failed request: {f}" for f in visit.failed]
        problems += [f"request off the local server (blocked): {u}" for u in visit.blocked]
    finally:
        visit.close()
    return problems


def test_every_page_reads_offline(browser, served):
    site, base = served
    pages = _pages(site)
    chapters = [p for p in pages if _is_chapter(p)]
    assert len(chapters) >= 12, f"expected the twelve chapter pages, found {chapters}"
    expect_outputs = _outputs_expected()
    report = {}
    for path in pages:
        problems = check_page(browser, site, base, path, expect_outputs=expect_outputs and _is_chapter(path))
        if problems:
            report[path or "/"] = problems
    assert not report, "pages a reader would see broken:\n" + "\n".join(
        f"  {page}:\n" + "\n".join(f"    - {p}" for p in problems) for page, problems in report.items())


def test_chapter_outputs_are_rendered(browser, served):
    """Every chapter page shows at least one executed cell's output."""
    site, base = served
    if not _outputs_expected():
        pytest.skip("this build's chapter renderer shows code only (no 'chapter-output' in the repository)")
    missing = []
    for path in filter(_is_chapter, _pages(site)):
        visit = PageVisit(browser, base, path)
        try:
            if visit.chapter_outputs() == 0:
                missing.append(path)
        finally:
            visit.close()
    assert not missing, f"chapter pages without any executed output: {missing}"


def test_output_and_image_checks_catch_problems(browser, tmp_path):
    """The checks on a small synthetic site: they pass on a page that has an output and a loaded image, and
    report a page without outputs, a page with a broken image and a page that reaches for a CDN."""
    site = tmp_path / "site"
    png = (ROOT / "docs" / "data").rglob("*.png")
    image = next(png, None)
    (site / "chapters" / "01_good").mkdir(parents=True)
    (site / "chapters" / "02_bare").mkdir(parents=True)
    (site / "chapters" / "03_broken").mkdir(parents=True)
    (site / "chapters" / "04_online").mkdir(parents=True)
    if image is None:  # a 1x1 PNG
        import base64
        data = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")
    else:
        data = image.read_bytes()
    (site / "chapters" / "01_good" / "figure.png").write_bytes(data)
    search = """<input class="md-search__input">
        <div class="md-search-result__item">hit</div>"""
    page = "<!doctype html><html><body>{search}<article>{body}</article></body></html>"
    (site / "chapters" / "01_good" / "index.html").write_text(page.format(search=search, body=
        '<pre><code>x = 1</code></pre><div class="chapter-output"><pre>1</pre><figure><img src="figure.png" '
        'alt="Line chart: one point per step, rising"><figcaption>Figure 1.1: Steps</figcaption></figure></div>'))
    (site / "chapters" / "02_bare" / "index.html").write_text(page.format(search=search, body=
        "<pre><code>x = 1</code></pre>"))
    (site / "chapters" / "03_broken" / "index.html").write_text(page.format(search=search, body=
        '<div class="chapter-output"><img src="missing.png"></div>'))
    (site / "chapters" / "04_online" / "index.html").write_text(page.format(search=search, body=
        '<div class="chapter-output">1</div><script src="https://unpkg.com/mermaid@11/dist/mermaid.min.js"></script>'))
    server, base = _serve(site)
    try:
        good = check_page(browser, site, base, "chapters/01_good/", expect_outputs=True)
        bare = check_page(browser, site, base, "chapters/02_bare/", expect_outputs=True)
        broken = check_page(browser, site, base, "chapters/03_broken/", expect_outputs=True)
        online = check_page(browser, site, base, "chapters/04_online/", expect_outputs=True)
    finally:
        server.shutdown()
    assert good == []
    assert bare == ["no executed output (div.chapter-output) on this chapter page"]
    assert any(p.startswith("image did not load") for p in broken), broken
    assert any("missing.png" in p and "HTTP 404" in p for p in broken), broken
    assert "request off the local server (blocked): https://unpkg.com/mermaid@11/dist/mermaid.min.js" in online


def test_diagram_checks_catch_problems(browser, tmp_path):
    """The diagram checks on a small synthetic site whose pages draw their diagram the way the theme does (the
    source in ``pre.mermaid`` replaced by a ``div.mermaid`` holding the SVG in a shadow root): a readable diagram
    passes; one squeezed into the column until its labels are 8 px high, and one three viewports tall, are
    reported."""
    site = tmp_path / "site"
    search = """<input class="md-search__input">
        <div class="md-search-result__item">hit</div>"""
    draw = """<script>
        for (const pre of document.querySelectorAll('pre.mermaid')) {
            const div = document.createElement('div'); div.className = 'mermaid';
            div.attachShadow({mode: 'closed'}).innerHTML = pre.textContent;
            pre.replaceWith(div);
        }</script>"""
    svgs = {  # viewBox width x height, drawn width (the theme caps a drawing at the column's width)
        "good": '<svg viewBox="0 0 400 200" style="max-width: 400px; width: 100%">'
                '<text x="10" y="40" font-size="16">ScheduledBatch</text>'
                '<foreignObject x="10" y="60" width="300" height="40"><div style="font-size: 16px">'
                '<span>Engine.step()</span></div></foreignObject></svg>',
        "tiny": '<svg viewBox="0 0 2400 200" style="max-width: 2400px; width: 100%">'
                '<text x="10" y="40" font-size="16">model + attention backend</text></svg>',
        "tall": '<svg viewBox="0 0 400 2700" style="max-width: 400px; width: 100%">'
                '<text x="10" y="40" font-size="16">decoder layer</text></svg>',
    }
    page = "<!doctype html><html><body>{search}<article style='width: 800px'>{body}</article>{draw}</body></html>"
    for name, svg in svgs.items():
        (site / "diagrams" / name).mkdir(parents=True)
        body = '<pre class="mermaid">' + svg.replace("&", "&amp;").replace("<", "&lt;") + "</pre>"
        (site / "diagrams" / name / "index.html").write_text(page.format(search=search, body=body, draw=draw))
    server, base = _serve(site)
    try:
        found = {name: check_page(browser, site, base, f"diagrams/{name}/", expect_outputs=False) for name in svgs}
    finally:
        server.shutdown()
    assert found["good"] == []
    assert len(found["tiny"]) == 1 and found["tiny"][0].startswith("diagram labels drawn 5.3 px high"), found["tiny"]
    assert len(found["tall"]) == 1 and found["tall"][0].startswith("diagram 2700 px tall"), found["tall"]


def test_wide_output_line_is_caught(browser, tmp_path):
    """A chapter page whose printed output has a 150-character line is reported; one whose printed lines fit,
    with a longer line in a highlighted python block (code, not printed text), is not."""
    site = tmp_path / "site"
    search = """<input class="md-search__input">
        <div class="md-search-result__item">hit</div>"""
    page = "<!doctype html><html><body>{search}<article>{body}</article></body></html>"
    text = '<div class="chapter-output"><div class="language-text highlight"><pre><span></span><code>{}</code></pre></div></div>'
    python = ('<div class="chapter-output"><div class="language-python highlight"><pre><span></span><code>{}'
              '</code></pre></div></div>')
    lines = "".join(f'<span id="__span-1-{i}"><a id="__codelineno-1-{i}"></a>{line}\n</span>'
                    for i, line in enumerate(["short", "y" * OUTPUT_COLUMNS]))
    for name, body in {"01_fits": text.format(lines) + python.format("z" * 110),
                       "02_wide": text.format("short\n" + "x" * 150 + "\nshort")}.items():
        (site / "chapters" / name).mkdir(parents=True)
        (site / "chapters" / name / "index.html").write_text(page.format(search=search, body=body))
    server, base = _serve(site)
    try:
        fits = check_page(browser, site, base, "chapters/01_fits/", expect_outputs=True)
        wide = check_page(browser, site, base, "chapters/02_wide/", expect_outputs=True)
    finally:
        server.shutdown()
    assert fits == []
    assert wide == [f"printed output line longer than {OUTPUT_COLUMNS} characters: "
                    f"{{'length': 150, 'line': '{'x' * 80}'}}"]


def test_word_check_catches_process_words_and_hashes(browser, tmp_path):
    """The rendered-text check on a synthetic site: a page of engine prose passes (a hash in a table, a word in
    code), a page that speaks of how its numbers were run, or names a commit in a sentence, does not."""
    site = tmp_path / "site"
    search = """<input class="md-search__input">
        <div class="md-search-result__item">hit</div>"""
    page = "<!doctype html><html><body>{search}<article>{body}</article></body></html>"
    bodies = {
        "good": "<p>Graphs replay the whole step with one call; a cold start compiles every kernel.</p>"
                "<table><tr><td>run</td><td>4d00637</td></tr></table>"
                "<pre><code>async with session.post(url) as r:</code></pre><p>Set <code>session</code> once.</p>",
        "call": "<p>Both kernels were timed in one GPU call.</p>",
        "hash": "<p>The kernel was removed after commit 4d00637.</p>",
    }
    for name, body in bodies.items():
        (site / name).mkdir(parents=True)
        (site / name / "index.html").write_text(page.format(search=search, body=body))
    server, base = _serve(site)
    try:
        found = {name: check_page(browser, site, base, f"{name}/", expect_outputs=False) for name in bodies}
    finally:
        server.shutdown()
    assert found["good"] == []
    assert [p.split(" in the text")[0] for p in found["call"]] == ["process word 'GPU call'"]
    assert [p.split(" outside")[0] for p in found["hash"]] == ["commit hash 4d00637"]


def test_screenshots(browser, served):
    """The landing page and a chapter as a reader first sees them, saved as build artefacts."""
    site, base = served
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shots = {"landing.png": ("", False), "chapter-04-radix-cache.png": ("chapters/04_radix_cache/", False),
             "chapter-04-radix-cache-full.png": ("chapters/04_radix_cache/", True),
             "chapter-01-models-full.png": ("chapters/01_models/", True)}
    for name, (path, full) in shots.items():
        visit = PageVisit(browser, base, path)
        try:
            static = _static_counts(site, path)
            if static["math"]:
                visit.wait_for_math()
            if static["mermaid"]:
                visit.wait_for_diagrams(static["mermaid"])
            visit.page.screenshot(path=str(SCREENSHOTS / name), full_page=full)
        finally:
            visit.close()
        assert (SCREENSHOTS / name).stat().st_size > 10_000, name


def test_figure_caption_check_catches_undescribed_figures(browser, tmp_path):
    """On a chapter page every output image is a ``<figure>`` captioned ``Figure C.K: ...`` with an alt text that
    describes it; a bare image, an unnumbered caption and the placeholder alt text are each reported."""
    import base64

    site = tmp_path / "site"
    folder = site / "chapters" / "05_figures"
    folder.mkdir(parents=True)
    (folder / "figure.png").write_bytes(base64.b64decode(
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="))
    alt = "Line chart: time per step against batch size, flat then rising"
    figures = [
        f'<figure><img src="figure.png" alt="{alt}"><figcaption>Figure 5.1: Step time</figcaption></figure>',
        '<img src="figure.png" alt="Figure 2 of chapter 05, Chunked prefill">',  # the old rendering: no caption
        f'<figure><img src="figure.png" alt="{alt}"><figcaption>Step time</figcaption></figure>',  # no number
        '<figure><img src="figure.png" alt="Figure 4 of chapter 05"><figcaption>Figure 5.4: x</figcaption></figure>',
        '<figure><img src="figure.png"><figcaption>Figure 5.5: no alt text</figcaption></figure>',
    ]
    body = "".join(f'<div class="chapter-output">{f}</div>' for f in figures)
    (folder / "index.html").write_text('<!doctype html><html><body><input class="md-search__input">'
                                       '<div class="md-search-result__item">hit</div>'
                                       f"<article>{body}</article></body></html>")
    server, base = _serve(site)
    try:
        problems = check_page(browser, site, base, "chapters/05_figures/", expect_outputs=True)
    finally:
        server.shutdown()
    reported = [p for p in problems if p.startswith("figure without")]
    assert len(reported) == 4 == len(problems), problems
    assert [("'caption': None" in p, "'caption': 'Step time'" in p, "Figure 4 of chapter" in p, "'alt': ''" in p)
            for p in reported] == [(True, False, False, False), (False, True, False, False),
                                   (False, False, True, False), (False, False, False, True)]
