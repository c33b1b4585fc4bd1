"""The static site in a real headless Chromium: pages render, notes are visible
beside the code, links resolve, the language switch works.

Chromium is driven over the DevTools protocol on a pipe (--remote-debugging-pipe:
JSON messages, NUL-terminated, on fds 3/4), so no extra Python package is needed.
Screenshots go to test-artifacts/.
"""

import base64
import re
import fcntl
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import tomllib
from pathlib import Path

import pytest

from vllm_tour.paths import GOLDEN_DIR, REPO_ROOT
from vllm_tour.notes.annotations import load_all, on_pin
from vllm_tour.site.html import write_site
from vllm_tour.notes.pinned import tree_for_pin
from vllm_tour.trace.reader import load_run

ARTIFACTS = REPO_ROOT / "test-artifacts"
SERVING = tomllib.loads((REPO_ROOT / "annotations" / "serving.toml").read_text(encoding="utf-8"))["title"]["en"]
SCHED_PAGE = "sym/vllm.v1.core.sched.scheduler.Scheduler.schedule.html"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """A minimal DevTools-protocol client over Chromium's debugging pipe."""

    def __init__(self, profile: Path):
        r_cmd, w_cmd = os.pipe()  # we write commands -> chromium reads fd 3
        r_ev, w_ev = os.pipe()  # chromium writes fd 4 -> we read
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={profile}", "--remote-debugging-pipe", "--window-size=1400,1000",
                 "--allow-file-access-from-files", "about:blank"]

        # bash (dash rejects fds > 9) puts our pipe ends on fds 3/4 for chromium. Move
        # them above 9 first, so that redirecting onto 3 cannot clobber the other end.
        hi_r, hi_w = (fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (r_cmd, w_ev))
        os.close(r_cmd)
        os.close(w_ev)
        cmd = " ".join(shlex.quote(x) for x in [CHROMIUM, *flags]) + f" 3<&{hi_r} 4>&{hi_w}"
        self.proc = subprocess.Popen(["bash", "-c", "exec " + cmd], pass_fds=(hi_r, hi_w),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(hi_r)
        os.close(hi_w)
        self.out = os.fdopen(w_cmd, "wb", buffering=0)
        self.inp = os.fdopen(r_ev, "rb", buffering=0)
        self.buf = b""
        self.next_id = 0
        targets = self.call("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
        self.call("Page.enable", session=True)
        self.call("Runtime.enable", session=True)

    def _read(self) -> dict:
        while b"\0" not in self.buf:
            chunk = self.inp.read(65536)
            if not chunk:
                raise RuntimeError("chromium closed the debugging pipe")
            self.buf += chunk
        msg, self.buf = self.buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method: str, session: bool = False, **params) -> dict:
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        self.out.write(json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def wait_event(self, name: str) -> dict:
        while True:
            msg = self._read()
            if msg.get("method") == name:
                return msg.get("params", {})

    def goto(self, url: str) -> None:
        self.call("Page.navigate", session=True, url=url)
        self.wait_event("Page.loadEventFired")

    def js(self, expr: str):
        r = self.call("Runtime.evaluate", session=True, expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"JS error in {expr!r}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def click(self, selector: str) -> None:
        """Click through the page like a user would (the element's centre)."""
        box = self.js(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); e.scrollIntoView({{block: 'center'}});"
                      f" const r = e.getBoundingClientRect(); return [r.x + r.width/2, r.y + r.height/2]; }})()")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", session=True, type=kind, x=box[0], y=box[1], button="left", clickCount=1)

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", session=True, format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    write_site(out, tree_for_pin("v0.32.0"), on_pin(load_all(), "v0.32.0"), "v0.32.0")  # as `vllm-tour site` does
    return out


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.fail("chromium not installed (make test installs it: apt-get install -y chromium)")
    profile = Path(tempfile.mkdtemp(prefix="vllm-tour-chromium-"))
    b = Browser(profile)
    yield b
    b.close()
    shutil.rmtree(profile, ignore_errors=True)


VISIBLE = "(e => !!e && e.offsetParent !== null && e.getBoundingClientRect().height > 0)"


def test_index_follows_the_journey_and_links_concepts(site, browser):
    browser.goto((site / "index.html").as_uri())
    subs = browser.js("[...document.querySelectorAll('section.sub h3 [lang=en]')].map(e => e.textContent)")
    # the request's journey, then what changed between releases (annotations/release_changes.toml)
    assert subs[0].startswith("Entrypoint") and "Scheduler" in subs
    # the request's way back out, then the same path behind `vllm serve`, then what changed between releases
    assert subs.index("Output processing") < subs.index(SERVING) == len(subs) - 2
    assert subs[-1] == "Between releases: what changed, and where"
    assert subs == [s.title["en"] for s in load_all()]
    # every concept row links to at least one note, and the preemption row to the scheduler
    rows = browser.js("[...document.querySelectorAll('tr[id^=concept-]')].map(r => [r.id, r.querySelectorAll('a').length])")
    assert rows and all(n > 0 for _, n in rows), rows
    pre = browser.js("[...document.querySelectorAll('#concept-preemption a')].map(a => a.getAttribute('href'))")
    assert "sym/vllm.v1.core.sched.scheduler.Scheduler.schedule.html?lang=en#note-sched-pick-victim" in pre, pre
    browser.screenshot(ARTIFACTS / "site-index.png")


def test_symbol_page_shows_notes_beside_code(site, browser):
    browser.goto((site / SCHED_PAGE).as_uri())
    n_notes = browser.js(f"[...document.querySelectorAll('.note')].filter({VISIBLE}).length")
    expected = sum(1 for s in on_pin(load_all(), "v0.32.0") for n in s.notes if n.symbol.endswith("Scheduler.schedule"))
    assert n_notes == expected > 5
    # the note on allocate_slots sits in the same row as the code it anchors, to its right
    geo = browser.js("""(() => {
        const note = document.getElementById('note-sched-allocate-running');
        const row = note.closest('.row');
        const hl = row.querySelector('.line.hl');
        const n = note.getBoundingClientRect(), c = hl.getBoundingClientRect();
        return {code: hl.textContent, noteLeft: n.left, codeRight: c.left + 200, noteTop: n.top, codeTop: c.top};
    })()""")
    assert "self.kv_cache_manager.allocate_slots(" in geo["code"]
    assert geo["noteLeft"] > geo["codeRight"]  # beside, not below
    assert abs(geo["noteTop"] - geo["codeTop"]) < 60
    # English shown, Chinese hidden
    en, zh = browser.js(f"""[
        {VISIBLE}(document.querySelector('#note-sched-pick-victim .body[lang=en]')),
        {VISIBLE}(document.querySelector('#note-sched-pick-victim .body[lang=zh]'))]""")
    assert en and not zh
    browser.screenshot(ARTIFACTS / "site-schedule-en.png")


def test_language_switch_and_links(site, browser):
    browser.goto((site / SCHED_PAGE).as_uri())
    browser.click("#lang-zh")
    state = browser.js(f"""({{
        lang: document.documentElement.dataset.lang,
        zh: {VISIBLE}(document.querySelector('#note-sched-pick-victim .body[lang=zh]')),
        en: {VISIBLE}(document.querySelector('#note-sched-pick-victim .body[lang=en]')),
        text: document.querySelector('#note-sched-pick-victim .body[lang=zh]').innerText,
        pressed: document.getElementById('lang-zh').getAttribute('aria-pressed'),
    }})""")
    assert state["lang"] == "zh" and state["zh"] and not state["en"], state
    assert "牺牲者" in state["text"] and state["pressed"] == "true"
    browser.screenshot(ARTIFACTS / "site-schedule-zh.png")

    # follow a "see" link from the page: it lands on the KV manager's page, still in Chinese
    href = browser.js("document.querySelector('#note-sched-allocate-running .tags a[title$=allocate_slots]').href")
    assert "lang=zh" in href
    browser.goto(href)
    landed = browser.js(f"""({{
        title: document.querySelector('header h1').textContent,
        lang: document.documentElement.dataset.lang,
        notes: [...document.querySelectorAll('.note')].filter({VISIBLE}).length,
    }})""")
    assert landed["title"] == "vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots"
    assert landed["lang"] == "zh" and landed["notes"] >= 3

    # every internal link of the index points at a file that exists
    browser.goto((site / "index.html").as_uri())
    hrefs = browser.js("[...document.querySelectorAll('a.internal')].map(a => a.href)")
    assert len(hrefs) > 40
    for h in hrefs:
        path = Path(h.split("?")[0].split("#")[0].removeprefix("file://"))
        assert path.is_file(), h
        frag = h.split("#")[1] if "#" in h else None
        if frag and frag.startswith("note-"):
            assert f'id="{frag}"' in path.read_text(), h


def test_a_page_reads_like_a_course(site, browser):
    """Off-path code folded (expandable), a list of the page's notes, previous/next along the journey."""
    browser.goto((site / SCHED_PAGE).as_uri())
    page = browser.js(f"""({{
        folds: document.querySelectorAll('details.fold').length,
        foldedLines: [...document.querySelectorAll('details.fold')].reduce((n, d) => n + d.querySelectorAll('.line').length, 0),
        visibleLines: [...document.querySelectorAll('.line')].filter(e => e.checkVisibility()).length,
        allLines: document.querySelectorAll('.line').length,
        toc: [...document.querySelectorAll('.toc li a')].map(a => a.getAttribute('href').split('#')[1]),
        notes: [...document.querySelectorAll('.note')].map(n => n.id),
        prev: document.querySelector('nav.pager a.prev').getAttribute('href'),
        next: document.querySelector('nav.pager a.next').getAttribute('href'),
        hlVisible: [...document.querySelectorAll('.line.hl')].every(e => e.checkVisibility()),
    }})""")
    assert page["folds"] > 3 and page["foldedLines"] > 100  # the schedule page's KV-connector/Mamba/spec-decode code
    assert page["visibleLines"] == page["allLines"] - page["foldedLines"] and page["hlVisible"]
    assert page["toc"] == page["notes"] and len(page["toc"]) > 5
    from vllm_tour.site.html import journey

    order = journey(load_all())
    i = order.index("vllm.v1.core.sched.scheduler.Scheduler.schedule")
    assert page["prev"].split("?")[0] == f"{order[i - 1]}.html" and page["next"].split("?")[0] == f"{order[i + 1]}.html"
    browser.click("details.fold > summary")
    opened = browser.js("[...document.querySelector('details.fold').querySelectorAll('.line')].filter(e => e.checkVisibility()).length")
    assert opened == browser.js("document.querySelector('details.fold').querySelectorAll('.line').length") > 0
    browser.goto((site / "index.html").as_uri())
    loop = browser.js("[...document.querySelectorAll('.loop a.box')].map(a => a.getAttribute('href').split('?')[0])")
    assert len(loop) == 6 and all((site / h).is_file() for h in loop)


def test_narrow_screens_put_notes_below_their_code(site, browser):
    browser.call("Emulation.setDeviceMetricsOverride", session=True, width=600, height=900, deviceScaleFactor=1, mobile=True)
    try:
        browser.goto((site / SCHED_PAGE).as_uri())
        geo = browser.js("""(() => {
            const note = document.getElementById('note-sched-allocate-running');
            const code = note.closest('.row').querySelector('.line.hl');
            const n = note.getBoundingClientRect(), c = code.getBoundingClientRect();
            return {noteTop: n.top, codeBottom: c.bottom, width: document.documentElement.scrollWidth};
        })()""")
        assert geo["noteTop"] > geo["codeBottom"] and geo["width"] <= 620, geo
        browser.screenshot(ARTIFACTS / "site-schedule-narrow.png")
    finally:
        browser.call("Emulation.clearDeviceMetricsOverride", session=True)


def test_golden_traces_step_by_step_link_events_to_notes(site, browser):
    """Trace ↔ code: each golden trace of the pin is a page whose events link to the notes on the code that made
    them; a note proven on a live run says so, with the command that re-proves it."""
    browser.goto((site / "index.html").as_uri())
    traces = browser.js("[...document.querySelectorAll('#traces ~ ul a')].map(a => a.textContent)")
    assert {"preemption", "shared_prefix", "chunked_prefill"} <= set(traces)
    browser.goto((site / "trace" / "preemption.html").as_uri() + "?lang=en")
    ev = browser.js("""(() => {
        const e = [...document.querySelectorAll('tr .ev-preemption')][0];
        const a = e.nextElementSibling;
        return {text: e.innerText, step: e.closest('tr').id, href: a.href};
    })()""")
    run = load_run(GOLDEN_DIR / "preemption")
    first = next(s for s in run.steps if s.scheduler.preempted)
    victim = first.scheduler.preempted[0].req_id
    assert ev["text"] == f"PREEMPT {victim}" and ev["step"] == f"step-{first.index}"
    browser.screenshot(ARTIFACTS / "site-trace-preemption.png")
    # In Chinese: the jump link at the top lands on the step, whose block tables open on a click
    browser.click("#lang-zh")
    browser.click(f'ul.jumps a[href="#step-{first.index}"]')
    zh = browser.js(f"""(() => {{
        const row = document.getElementById('step-{first.index}');
        return {{hash: location.hash, event: row.querySelector('.ev-preemption').innerText,
                 folded: [...document.querySelectorAll('details.steps > summary')].filter({VISIBLE})
                          .map(s => s.innerText)}};
    }})()""")
    assert zh["hash"] == f"#step-{first.index}" and zh["event"] == f"抢占 {victim}", zh
    assert zh["folded"] and all(t.startswith("第 ") for t in zh["folded"]), zh
    browser.click(f"#step-{first.index} details.blocks > summary")
    grid = browser.js(f"""[...document.querySelectorAll('#step-{first.index} table.grid tr')]
        .filter({VISIBLE}).map(r => [r.querySelector('th').innerText,
                                     [...r.querySelectorAll('td')].map(td => parseInt(td.innerText))])""")
    assert dict(grid) == first.kv.block_tables, grid
    browser.screenshot(ARTIFACTS / "site-trace-preemption-zh.png")
    browser.click("#lang-en")
    page, frag = ev["href"].split("?")[0].removeprefix("file://"), ev["href"].split("#")[1]
    assert frag.startswith("note-") and f'id="{frag}"' in Path(page).read_text()
    from vllm_tour.notes.verify import proofs_for_pin

    proven = proofs_for_pin("v0.32.0")
    note = next(iter(proven))
    symbol = next(n.symbol for s in load_all() for n in s.notes if n.id == note)
    browser.goto((site / "sym" / f"{symbol}.html").as_uri() + "?lang=en")  # an earlier test left zh chosen
    tag = browser.js(f"document.querySelector('#note-{note} .proven').parentElement.innerText")
    assert "proven on a live run of" in tag and f"vllm-tour annotations verify --note {note}" in tag
    # ... and links to the recorded run it was proven on, rendered step by step
    run_href = browser.js(f"document.querySelector('#note-{note} .proven a').href").split("?")[0]
    assert run_href.endswith(f"trace/{proven[note].scenario}.html") and Path(run_href.removeprefix("file://")).is_file()


def test_the_repro_library_page_links_each_repro_to_its_notes(site, browser):
    from vllm_tour.repro.library import library
    from vllm_tour.scenario import load_scenario

    browser.goto((site / "repros.html").as_uri() + "?lang=en")
    rows = browser.js("""[...document.querySelectorAll('tr[id^=repro-]')].map(r => ({
        id: r.id, notes: [...r.querySelectorAll('a.internal')].map(a => a.href), text: r.innerText}))""")
    scs = [load_scenario(p) for p in library()]
    assert [r["id"] for r in rows] == [f"repro-{sc.name}" for sc in scs]
    for sc, row in zip(scs, rows):
        assert len(row["notes"]) == len(sc.notes) > 0, sc.name
        for h in row["notes"]:
            page, frag = Path(h.split("?")[0].removeprefix("file://")), h.split("#")[1]
            assert f'id="{frag}"' in page.read_text(), (sc.name, h)
    reset = next(r for r in rows if r["id"] == "repro-async_reset_prefix_cache_placeholders")["text"]
    assert "v0.21.0 REPRODUCED (run on an H200)" in reset and "v0.32.0 NOT REPRODUCED" in reset


def _zh_bodies(html: str) -> list[str]:
    """The Chinese note texts of a page, tags stripped, in reading order."""
    return [re.sub(r"<[^>]+>", "", m) for m in re.findall(r'<div class="i18n body" lang="zh">(.*?)</div>', html, re.S)]


def test_glossary_page_and_first_use_glosses(site, browser):
    """Every glossary term is on the glossary page; on a source page each term's first use, and only that,
    carries its English (预填充（prefill）)."""
    from vllm_tour.notes.glossary import load_glossary

    terms = load_glossary()
    page = (site / "glossary.html").read_text(encoding="utf-8")
    for t in terms:
        assert f'<td lang="zh">{t.zh}</td>' in page, t.en
    browser.goto((site / "index.html").as_uri())
    link = browser.js("[...document.querySelectorAll('a')].filter(a => a.href.includes('glossary.html')).length")
    assert link == 1, link

    text = "\n".join(_zh_bodies((site / SCHED_PAGE).read_text(encoding="utf-8")))
    glossed = [t for t in terms if t.zh != t.en and t.zh in text]
    assert len(glossed) >= 5, [t.en for t in glossed]  # the page uses terms: the check below can fail
    for t in glossed:
        # the term's own uses: not inside a longer term (预填充 in 分块预填充 is that term's use)
        inside = {m.start() + o.zh.index(t.zh) for o in terms if o is not t and t.zh in o.zh
                  for m in re.finditer(re.escape(o.zh), text)}
        own = [m.start() for m in re.finditer(re.escape(t.zh), text) if m.start() not in inside]
        glossed_at = [i for i in own if text.startswith(f"（{t.en}）", i + len(t.zh))]
        # the first use not followed by a parenthesis of its own ("抢占（FCFS 下……）" passes the gloss on)
        first = [i for i in own if not text.startswith("（", i + len(t.zh)) or i in glossed_at][:1]
        assert glossed_at == first, (t.en, own, glossed_at)


def test_each_note_says_which_releases_it_was_checked_against(site):
    """A note card lists the releases it was checked against (its pins, its own texts, digests accepted in
    annotations/checked.json), marks a release with its own text, and names those it does not apply to."""
    from vllm_tour.notes.checked import load_checked

    checked = load_checked()
    page = (site / SCHED_PAGE).read_text(encoding="utf-8")
    notes = [n for n in load_all() if n.name == "scheduler"][0].notes
    on_page = [n for n in notes if f'id="note-{n.id}"' in page]
    assert any(n.variant for n in on_page) and any(n.not_on for n in on_page)  # both kinds: the checks can fail
    for n in on_page:
        card = page.split(f'id="note-{n.id}"')[1].split('<div class="note')[0]
        for tag in set(n.pins) | set(n.variant) | set(checked.get(n.id, {})):
            assert f"<code>{tag}</code>" in card, (n.id, tag)
        for tag in n.variant:
            assert f"<code>{tag}</code> (" in card, (n.id, tag)
        for tag in n.not_on:
            assert "not on" in card and f"<code>{tag}</code>" in card.split("not on")[-1], (n.id, tag)
