"""`vllm-tour show --lang zh`: the step table, its events, the block grid, the outputs and a request's view in
Chinese, read from the same records as the English (the preemption golden: a real upstream run)."""

from vllm_tour.trace.reader import load_run
from vllm_tour.views.explain import request_summary


def test_show_in_chinese_names_each_event_from_the_records(cli):
    run = load_run("preemption")
    p = cli("show", "preemption", "--lang", "zh", columns=200)
    assert p.returncode == 0, p.stderr
    assert f"preemption — 共 {len(run.steps)} 步" in p.stdout
    assert "PREEMPT" not in p.stdout and "events" not in p.stdout.split("preemption — ")[1].split("\n")[0]
    preempted = [(s.index, x.req_id) for s in run.steps if s.scheduler for x in s.scheduler.preempted]
    assert preempted  # the golden preempts: the row check below can fail
    for index, rid in preempted:
        row = next(line for line in p.stdout.splitlines() if line.startswith(f"│ {index:>2} │"))
        assert f"抢占 {rid}" in row, row
    busiest = max(run.steps, key=lambda s: (s.kv.num_blocks - s.kv.free_blocks) if s.kv else -1)
    assert f"第 {busiest.index} 步分配之后的块表" in p.stdout
    assert "本次运行中的事件" in p.stdout and "输出" in p.stdout


def test_a_request_in_chinese_carries_its_chinese_explanation(cli):
    run = load_run("preemption")
    rid = next(x.req_id for s in run.steps if s.scheduler for x in s.scheduler.preempted)
    p = cli("show", "preemption", "--request", rid, "--lang", "zh", columns=400)
    assert p.returncode == 0, p.stderr
    assert f"{rid}：每一步的块" in p.stdout and "为什么" in p.stdout
    for line in request_summary(run, rid, "zh"):
        assert line in p.stdout, line
    en = cli("show", "preemption", "--request", rid, columns=400)
    assert all(line in en.stdout for line in request_summary(run, rid, "en"))


def test_an_unknown_language_is_one_line(cli):
    p = cli("show", "preemption", "--lang", "fr")
    assert p.returncode == 2 and p.stderr.strip() == "error: --lang 'fr': choose one of en, zh"
