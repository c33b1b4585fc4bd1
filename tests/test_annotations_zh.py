"""The Chinese texts of the notes: wrapped lines joined without spaces, the glossary lint, the terminal labels."""

import io
import re

from rich.console import Console

from vllm_tour.paths import ANNOTATIONS_DIR
from vllm_tour.site import commands
from vllm_tour.notes.annotations import CJK_PUNCT, CJK_WORD, join_cjk_lines, load_all
from vllm_tour.site.markup import _MD

# a line break Markdown renders as a space where Chinese has none: beside its punctuation, between its characters
_SPACED_BREAK = re.compile(f"[{CJK_PUNCT}]\n|\n[{CJK_PUNCT}]|[{CJK_WORD}]\n[{CJK_WORD}]")


def _zh_texts(subs):
    for s in subs:
        yield f"{s.name} (title)", s.title["zh"]
        yield f"{s.name} (intro)", s.intro["zh"]
        for n in s.notes:
            yield n.id, n.zh
            yield from ((f"{n.id} ({pin})", v.zh) for pin, v in n.variant.items())


def test_rendered_chinese_has_no_wrap_space_where_chinese_has_none():
    """A soft break left in the HTML shows as a space; the files wrap Chinese at ~100 columns."""
    raw = "".join(p.read_text(encoding="utf-8") for p in ANNOTATIONS_DIR.glob("*.toml"))
    assert len(_SPACED_BREAK.findall(raw)) > 50  # the files do wrap Chinese lines there: the check below can fail
    bad = [(where, m.group()) for where, zh in _zh_texts(load_all()) for m in _SPACED_BREAK.finditer(_MD.render(zh))]
    assert not bad, bad[:10]


def test_join_keeps_markdown_structure_and_the_space_before_a_latin_word():
    text = ("第一段的第一行，\n第二行接着写 `code`\nand English，每个 rank\n都持有——\n*不是*\n\n"
            "- 列表第一项\n- 第二项，\n  续行\n\n```\n代码\n第二行\n```\n最后一行\n接上")
    assert join_cjk_lines(text) == ("第一段的第一行，第二行接着写 `code`\nand English，每个 rank\n都持有——*不是*\n\n"
                                    "- 列表第一项\n- 第二项，续行\n\n```\n代码\n第二行\n```\n最后一行接上")


def _lint(monkeypatch, directory=None):
    if directory is not None:
        monkeypatch.setattr(commands, "load_all", lambda: load_all(directory))
    out = io.StringIO()
    code = commands.run_lint(Console(file=out, width=200))
    return code, out.getvalue()


def test_lint_passes_on_every_note(monkeypatch):
    code, out = _lint(monkeypatch)
    assert code == 0, out


def test_lint_names_the_note_of_each_planted_mistake(tmp_path, monkeypatch):
    src = (ANNOTATIONS_DIR / "sampler.toml").read_text(encoding="utf-8")
    ids = re.findall(r'^id = "([^"]+)"', src, re.M)
    texts = re.findall(r"^zh = '''\n(.*?)'''", src, re.M | re.S)
    assert len(ids) >= 3 and len(texts) == len(ids)
    planted = {ids[0]: "占位块之外，还有空块。", ids[1]: "调度器把请求交给 runner ，然后返回。", ids[2]: "先调度,再执行。"}
    for i, zh in enumerate(texts[:3]):
        src = src.replace(zh, planted[ids[i]] + "\n", 1)
    (tmp_path / "sampler.toml").write_text(src, encoding="utf-8")
    code, out = _lint(monkeypatch, tmp_path)
    assert code == 1
    lines = out.strip().splitlines()
    assert any(l.startswith(f'{ids[0]}: "空块"') for l in lines), out
    assert any(l.startswith(f"{ids[1]}: space beside fullwidth punctuation") for l in lines), out
    assert any(l.startswith(f'{ids[2]}: half-width ","') for l in lines), out
    assert lines[-1].startswith("3 problem(s)")


def test_gpu_memory_is_only_for_notes_about_a_gpu(tmp_path, monkeypatch):
    src = (ANNOTATIONS_DIR / "sampler.toml").read_text(encoding="utf-8")
    first = re.search(r"^zh = '''\n(.*?)'''", src, re.M | re.S).group(1)
    note = re.search(r'^id = "([^"]+)"', src, re.M).group(1)
    (tmp_path / "sampler.toml").write_text(src.replace(first, "KV 缓存池在显存里。\n", 1), encoding="utf-8")
    code, out = _lint(monkeypatch, tmp_path)
    assert code == 1 and out.startswith(f'{note}: "显存"'), out
    en = re.search(r"^en = '''\n(.*?)'''", src, re.M | re.S).group(1)
    (tmp_path / "sampler.toml").write_text(src.replace(first, "KV 缓存池在显存里。\n", 1)
                                           .replace(en, "On a GPU the pool is in device memory.\n", 1), encoding="utf-8")
    assert _lint(monkeypatch, tmp_path)[0] == 0


def test_source_labels_in_chinese(cli):
    r = cli("source", "vllm.v1.core.sched.scheduler.Scheduler.schedule", "--lang", "zh")
    assert r.returncode == 0, r.stderr
    assert "条注解 · zh" in r.stdout.splitlines()[0] and "探针: " in r.stdout
    assert not re.search(r"\b(probes|concepts|see): ", r.stdout)


def test_lint_flags_a_term_rendered_another_way(tmp_path, monkeypatch):
    """The glossary gives each term one rendering: "prefill" in a Chinese text, or 空闲队列 for the free block
    queue, is named with the glossary's word; the right words, code spans and an English gloss pass."""
    src = (ANNOTATIONS_DIR / "sampler.toml").read_text(encoding="utf-8")
    ids = re.findall(r'^id = "([^"]+)"', src, re.M)
    texts = re.findall(r"^zh = '''\n(.*?)'''", src, re.M | re.S)
    planted = {ids[0]: "一个 prefill 分块被放回空闲队列。", ids[1]: "预填充分块的 `prefill` 和持久批次（persistent batch）。"}
    for i, zh in enumerate(texts[:2]):
        src = src.replace(zh, planted[ids[i]] + "\n", 1)
    (tmp_path / "sampler.toml").write_text(src, encoding="utf-8")
    code, out = _lint(monkeypatch, tmp_path)
    lines = out.strip().splitlines()
    assert code == 1 and lines[-1].startswith("2 problem(s)"), out
    assert any(l.startswith(f"{ids[0]}: \"prefill\"") and "'prefill' as 预填充" in l for l in lines), out
    assert any(l.startswith(f"{ids[0]}: \"空闲队列\"") and "as 空闲块队列" in l for l in lines), out


def test_glossary_refuses_a_term_that_avoids_another_terms_rendering(tmp_path):
    from vllm_tour.errors import TourError
    from vllm_tour.notes.glossary import GLOSSARY_FILE, load_glossary

    bad = GLOSSARY_FILE.read_text(encoding="utf-8").replace('avoid = ["散列"]', 'avoid = ["散列", "块表"]')
    (tmp_path / "terms.toml").write_text(bad, encoding="utf-8")
    try:
        load_glossary(tmp_path / "terms.toml")
    except TourError as e:
        assert "'hash' avoids '块表', the rendering of 'block table'" in str(e)
    else:
        raise AssertionError("a glossary whose lint would flag a right word was accepted")


def test_source_view_glosses_each_terms_first_use():
    from vllm_tour.notes.glossary import FirstUse

    gloss = FirstUse()
    first, second = gloss("先做分块预填充，再预填充。"), gloss("预填充之后解码，`decode` 不算。")
    assert first == "先做分块预填充（chunked prefill），再预填充（prefill）。"
    assert second == "预填充之后解码（decode），`decode` 不算。"
    # a parenthesis of the text's own passes the gloss to the next use; the text's own gloss counts as one
    assert gloss("抢占（FCFS 下从尾部）后再抢占，命中（hit）后命中。") == "抢占（FCFS 下从尾部）后再抢占（preemption），命中（hit）后命中。"
