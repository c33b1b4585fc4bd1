"""The site's trace and repro pages read like course pages: both languages, each request's finish an event, quiet
runs of steps folded, jump links to the steps where something happens, a block-table picture per step. Checked
on the HTML the site writes for every golden run of the pin, each expectation derived from the run's records
(the browser test looks at one page in Chromium)."""

import re

import pytest

from vllm_tour.repro.library import library
from vllm_tour.scenario import load_scenario
from vllm_tour.site.markup import _MD
from vllm_tour.site.repros import repros_body
from vllm_tour.site.traces import FOLD_FROM, golden_runs, trace_page

PIN = "v0.32.0"
RUNS = golden_runs(PIN)


@pytest.fixture(scope="module")
def pages():
    return {run.path.name: (run, trace_page(run, PIN, lambda nid: f"#{nid}")[1]) for run in RUNS}


def _row(page: str, index: int) -> str:
    return page.split(f'<tr id="step-{index}">')[1].split('<tr id="step-')[0]


def _finish_steps(run) -> dict[str, int]:
    """Each finished request -> the last step that scheduled it (its last token computed there)."""
    last = {r.req_id: s.index for s in run.steps for r in s.scheduler.scheduled}
    return {o.req_id: last[o.req_id] for o in run.outputs.requests if o.finish_reason}


def _expected_folds(run) -> list[tuple[int, int]]:
    """(first, last) of each run of FOLD_FROM or more steps in a row with the same batch in which nothing else
    happened: no admission, chunk, preemption, prefix hit, eviction, finish, block given or freed."""
    finishing = set(_finish_steps(run).values())

    def quiet(s):
        sch, kv = s.scheduler, s.kv
        busy = (any(r.kind != "running" or (r.is_prefill and r.num_computed_tokens + r.num_scheduled_tokens
                                            < r.num_prompt_tokens) for r in sch.scheduled)
                or sch.preempted or s.index in finishing
                or (kv and (kv.prefix_hits or kv.evicted or kv.allocated or kv.freed)))
        return not busy

    def batch(s):
        return [(r.req_id, r.num_scheduled_tokens) for r in s.scheduler.scheduled]

    spans, cur = [], []
    for s in run.steps:
        if cur and quiet(s) and batch(s) == batch(cur[-1]):
            cur.append(s)
            continue
        spans.append(cur)
        cur = [s] if quiet(s) else []
    spans.append(cur)
    return [(c[0].index, c[-1].index) for c in spans if len(c) >= FOLD_FROM]


def test_quiet_runs_of_steps_fold_into_one_line(pages):
    assert len(RUNS) >= 10
    for name, (run, page) in pages.items():
        folds = [(int(a), int(b)) for a, b in re.findall(r'<tr class="folded" id="steps-(\d+)-(\d+)">', page)]
        assert folds == _expected_folds(run), name
        for a, b in folds:  # its line says which steps, their batch, in both languages
            batch = " ".join(f"{r.req_id}×{r.num_scheduled_tokens}" for r in run.step(a).scheduler.scheduled)
            assert f"steps {a}–{b} ({b - a + 1}): {batch} decode each, nothing else happened" in page, name
            assert f"第 {a}–{b} 步（共 {b - a + 1} 步）：每步 {batch} 解码" in page, name
        assert sorted(int(i) for i in re.findall(r'<tr id="step-(\d+)">', page)) == [s.index for s in run.steps]
    preemption, page = pages["preemption"]
    folded = sum(b - a + 1 for a, b in _expected_folds(preemption))
    assert folded > len(preemption.steps) / 2  # most of its 83 steps are decode steps where nothing happens


def test_every_request_finishes_as_an_event_and_the_top_links_to_it(pages):
    for name, (run, page) in pages.items():
        finishes = _finish_steps(run)
        assert len(finishes) == len(run.meta.requests), name
        reasons = {o.req_id: o.finish_reason for o in run.outputs.requests}
        table = page.split('<table class="concepts trace">', 1)[1]
        assert table.count('class="ev ev-finish"') == len(finishes), name
        top = page.split('<ul class="jumps">')[1].split("</ul>")[0]
        for rid, step in finishes.items():
            row = _row(page, step)
            assert f'<span class="i18n " lang="en">finish {rid} ({reasons[rid]})</span>' in row, (name, rid)
            assert f'<span class="i18n " lang="zh">结束 {rid} ({reasons[rid]})</span>' in row, (name, rid)
            assert f'<a href="#step-{step}"><span class="i18n " lang="en">step {step} ({rid})</span>' in top, (name, rid)


def test_jump_links_name_every_preemption_hit_and_eviction(pages):
    seen = set()
    for name, (run, page) in pages.items():
        top = page.split('<ul class="jumps">')[1].split("</ul>")[0]
        links = re.findall(r'<a href="#step-(\d+)"><span class="i18n " lang="en">step \d+(?: \(([^)]*)\))?</span>', top)
        want = ([(str(s.index), p.req_id) for s in run.steps for p in s.scheduler.preempted]
                + [(str(s.index), h.req_id) for s in run.steps if s.kv for h in s.kv.prefix_hits]
                + [(str(s.index), "") for s in run.steps if s.kv and s.kv.evicted]
                + sorted(((str(i), rid) for rid, i in _finish_steps(run).items()), key=lambda x: int(x[0])))
        assert sorted(links) == sorted(want), name
        seen |= {k for k, title in (("preemption", "Preemption"), ("prefix-hit", "Prefix-cache hit"),
                                    ("eviction", "Cached-block eviction")) if title in top}
    assert seen == {"preemption", "prefix-hit", "eviction"}  # the goldens show each kind somewhere


def test_each_step_draws_its_block_tables_from_the_records(pages):
    for name, (run, page) in pages.items():
        for s in run.steps:
            row = _row(page, s.index)
            if s.kv is None or not s.kv.block_tables:
                assert 'class="blocks"' not in row
                continue
            for rid, ids in s.kv.allocated.items():  # what was given and freed is said in the events cell too
                assert not ids or f"{rid} +{ids}" in row.split('<details class="blocks">')[0], (name, s.index)
            assert not s.kv.freed or f'lang="zh">释放 {s.kv.freed}</span>' in row, (name, s.index)
            grid = row.split('<details class="blocks">')[1].split("</details>")[0]
            drawn = {rid: cells for rid, cells in re.findall(r'<tr><th class="own-\d+">([^<]+)</th>(.*?)</tr>', grid)}
            assert set(drawn) == set(s.kv.block_tables), (name, s.index)
            for rid, cells in drawn.items():
                ids = [(int(b), mark) for b, mark in re.findall(r"<td[^>]*>(\d+)([+*]?)</td>", cells)]
                assert [b for b, _ in ids] == s.kv.block_tables[rid], (name, s.index, rid)
                assert [b for b, m in ids if m == "+"] == [b for b in s.kv.block_tables[rid]
                                                           if b in s.kv.allocated.get(rid, [])], (name, s.index, rid)
                hits = {b for h in s.kv.prefix_hits if h.req_id == rid for b in h.block_ids}
                assert hits <= {b for b, m in ids if m == "*"}, (name, s.index, rid)


def test_trace_pages_speak_chinese_too(pages):
    run, page = pages["preemption"]
    assert f"共 {len(run.steps)} 步" in page and "KV 缓存池" in page
    for s in run.steps:
        row = _row(page, s.index)
        for p in s.scheduler.preempted:
            assert f'lang="zh">抢占 {p.req_id}</span>' in row
        for r in s.scheduler.scheduled:
            if r.kind == "resumed":
                assert f'lang="zh">恢复 {r.req_id}</span>' in row
    _, shared = pages["shared_prefix"]
    assert 'lang="zh">前缀缓存命中 ' in shared and 'lang="zh">准入 ' in shared
    _, evict = pages["cmp_evict"]
    assert 'lang="zh">驱逐 [' in evict


def test_repro_page_in_both_languages_with_code_rendered():
    body = repros_body(lambda nid: f"#{nid}")
    scs = [load_scenario(p) for p in library()]
    for sc in scs:
        assert re.search(r"[\u4e00-\u9fff]", sc.description_zh), f"{sc.name}: no Chinese description"
        row = body.split(f'<tr id="repro-{sc.name}">')[1].split("</tr>")[0]
        for lang, text in (("en", sc.description), ("zh", sc.description_zh)):
            rendered = _MD.render(text)
            assert f'<div class="i18n " lang="{lang}">{rendered}</div>' in row, (sc.name, lang)
            assert "`" not in re.sub(r"<[^>]+>", "", rendered), (sc.name, lang)  # every backtick span became <code>
            assert rendered.count("<code>") == text.count("`") // 2, (sc.name, lang)
        declared = sc.declared_verdict(PIN)
        assert f'lang="zh">{ {"REPRODUCED": "已复现", "NOT REPRODUCED": "未复现"}[declared]}</span>' in row, sc.name
    assert sum("`" in sc.description for sc in scs) >= 5
