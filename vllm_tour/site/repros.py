"""The site's repro page: the library of reproduced upstream issues (traces/repros/, traces/scenarios/repro_*.toml),
each with its upstream thread, its verdict per pin and the notes on the code involved.

Verdicts: the one each file declares per pin; v0.32.0's is what CI asserts on the live engine
(tests/test_repro_library.py), v0.21.0's what the H200 run brought back (traces/repros/cuda-v0.21.0/, re-checked by
tests/test_repro_cuda.py).
"""

from __future__ import annotations

import json

from vllm_tour.repro.library import REPROS_DIR, library
from vllm_tour.scenario import load_scenario
from vllm_tour.site.markup import both, esc

GITHUB = "https://github.com/vllm-project/vllm"
VERDICT_ZH = {"REPRODUCED": "已复现", "NOT REPRODUCED": "未复现"}


def _measured(name: str, pin: str) -> str | None:
    """The verdict a run on another machine brought back for `pin`, if one did."""
    saved = REPROS_DIR / f"cuda-{pin}" / name / "repro.json"
    return json.loads(saved.read_text())["verdict"] if saved.is_file() else None


def repros_body(note_href) -> str:
    """The page's body; note_href(note id) -> the link to a note in the site."""
    rows = []
    for path in library():
        sc = load_scenario(path)
        refs = " ".join(x for x in (
            f'<a href="{GITHUB}/issues/{sc.issue}">#{sc.issue}</a>' if sc.issue else "",
            f'<a href="{GITHUB}/pull/{sc.pr}">PR #{sc.pr}</a>' if sc.pr else "") if x) or "—"
        pins = sc.pins() or ["v0.32.0"]
        verdicts = []
        for pin in pins:
            declared = sc.declared_verdict(pin)
            measured = _measured(sc.name, pin)
            ran = f" ({both({'en': 'run on an H200', 'zh': '在 H200 上运行'})})" if measured == declared else ""
            verdicts.append(f"<code>{esc(pin)}</code> {both({'en': declared, 'zh': VERDICT_ZH[declared]})}{ran}")
        notes = " ".join(f'<a class="internal" href="{esc(note_href(n))}"><code>{esc(n)}</code></a>' for n in sc.notes)
        rel = path.relative_to(path.parents[2]).as_posix()
        rows.append(f'<tr id="repro-{esc(sc.name)}"><td><code>{esc(sc.name)}</code><br><span class="muted">'
                    f'<code>vllm-tour repro {esc(rel)}</code></span></td><td>{refs}</td><td>{"<br>".join(verdicts)}</td>'
                    f'<td>{both({"en": sc.description, "zh": sc.description_zh or sc.description}, "div", md=True)}</td>'
                    f'<td>{notes or "—"}</td></tr>')
    head = [{"en": "repro", "zh": "复现"}, {"en": "upstream", "zh": "上游"}, {"en": "verdict per pin", "zh": "各 pin 的结论"},
            {"en": "what it shows", "zh": "它展示了什么"}, {"en": "notes on the code", "zh": "相关代码的注解"}]
    return (f'<p class="muted"><code>vllm-tour repro --all</code></p><table class="concepts repros"><tr>'
            f'{"".join(f"<th>{both(h)}</th>" for h in head)}</tr>{"".join(rows)}</table>')
