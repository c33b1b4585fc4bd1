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
