"""Speculative methods beyond ngram (issue 35 item 5): each runs for real on v0.32.0's CPU engine, its drafter
built at run time (upstream/draft_models.py), and the spec probes record what it proposed and what the target kept.

Which methods ran where is the README's table "speculative methods: which ran where"; the GPU runner traces the
spec scenarios on v0.21.0 (runner.SPEC_SCENARIOS).
"""

import pytest

from vllm_tour.trace.reader import load_run
from vllm_tour.upstream.draft_models import head_config_and_weights

# scenario -> (proposer the records name, num_speculative_tokens k, KV slots the KV manager reserves for the
# drafter per request)
METHODS = {
    "spec_draft_model": ("draft_model", 3, 3),  # the draft model writes its own KV for its k passes
    "spec_eagle": ("eagle", 3, 3),
    "spec_eagle3": ("eagle3", 3, 3),
    "spec_medusa": ("medusa", 3, 0),  # heads on the target's hidden state: no KV of their own
    "spec_mtp": ("mtp", 1, 1),  # MiMo's one MTP layer (dummy weights)
}


@pytest.mark.parametrize("scenario", list(METHODS))
def test_method_runs_and_its_drafts_are_recorded(trace_runs, cli, scenario):
    proposer, k, lookahead = METHODS[scenario]
    run = load_run(trace_runs.get(scenario))
    proposals = [s for s in run.steps if s.spec_proposal]
    assert proposals and {s.spec_proposal.proposer for s in proposals} == {proposer}
    assert all(0 < len(d) <= k for s in proposals for rid, d in s.spec_proposal.proposed.items()
               if rid not in s.spec_proposal.ignored), "every request gets drafts, at most k"
    steps = {s.index: s for s in run.steps}
    verified = [(s, v) for s in run.steps if s.spec_verify for v in s.spec_verify.requests]
    assert verified and {s.spec_verify.num_lookahead_tokens for s, _ in verified} == {lookahead}
    for s, v in verified:
        a, drafts = v.num_accepted, v.draft_token_ids
        assert drafts == steps[s.index - 1].spec_proposal.proposed[v.req_id][: len(drafts)]
        # greedy: the kept drafts are the target's tokens, then one of its own
        assert v.sampled_token_ids[:a] == drafts[:a] and len(v.sampled_token_ids) == a + 1
        if a < len(drafts):
            assert v.sampled_token_ids[a] != drafts[a]
        assert s.runner[0].sampled_token_ids[v.req_id] == v.sampled_token_ids
    # the tokens each step gave a request, in order, are its output: accepted drafts add up to the generated text
    # (its last step may give more than max_tokens leaves room for: the request keeps what fits)
    for out in run.outputs.requests:
        got = [t for s in run.steps if s.runner for t in s.runner[0].sampled_token_ids.get(out.req_id, [])]
        assert got[: len(out.token_ids)] == out.token_ids and len(got) - len(out.token_ids) <= k
    if proposer == "draft_model":  # the target as its own draft, fp32, greedy: it agrees with every draft
        assert all(v.num_accepted == len(v.draft_token_ids) for s, v in verified)
    drafted, accepted = sum(len(v.draft_token_ids) for _, v in verified), sum(v.num_accepted for _, v in verified)
    p = cli("show", run.path, columns=200)
    assert p.returncode == 0, p.stderr
    assert f"{drafted} draft tokens, {accepted} accepted" in p.stdout


def test_draft_heads_have_upstreams_names_and_shapes():
    """What upstream's loaders read (vllm 0.32.0 llama_eagle.py, llama_eagle3.py, medusa.py): a layout change fails
    here in a second, before an engine start says the same in a minute."""
    cfg, w = head_config_and_weights("tiny-qwen3-eagle")
    assert cfg["architectures"] == ["EagleLlamaForCausalLM"] and w["fc.weight"].shape == (256, 512)
    assert "layers.0.input_layernorm.weight" not in w  # EAGLE-1's first layer has no input norm
    cfg, w = head_config_and_weights("tiny-qwen3-eagle3")
    n_aux = len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    # 0.21.0 reads the ids at the top level only: without them there it fed 2 hidden states to this 3-state head
    assert cfg["eagle_aux_hidden_state_layer_ids"] == cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert w["fc.weight"].shape == (256, n_aux * 256) and w["midlayer.self_attn.q_proj.weight"].shape == (256, 512)
    cfg, w = head_config_and_weights("tiny-qwen3-medusa")
    assert sorted(k for k in w if k.startswith("lm_heads.")) == [f"lm_heads.{i}.weight" for i in range(cfg["num_heads"])]


def test_no_drafter_changes_the_greedy_tokens(trace_runs):
    """Same target, same prompts, greedy: the self-draft that is always right and the random heads that are always
    wrong leave the same tokens (a verification that kept a wrong draft would show here).

    Tokens, not bits: a verification runs 1 + k positions where a plain decode runs one, so BLAS may pick other
    kernels and the logits differ in their last bits; only an argmax tie within that noise could change a token.
    It held on the Intel Xeon (AMX) here and on the H200 (vLLM 0.21.0, the same tokens as the CPU)."""
    outs = {name: {o.req_id: o.token_ids for o in load_run(trace_runs.get(name)).outputs.requests}
            for name in METHODS if name != "spec_mtp"}  # spec_mtp: another target (dummy weights)
    first = next(iter(outs.values()))
    assert all(len(t) == 12 for t in first.values())
    assert all(o == first for o in outs.values()), outs


def test_mtp_target_is_a_config_for_dummy_weights(tmp_path, monkeypatch):
    import json

    from vllm_tour.errors import TourError
    from vllm_tour.upstream.models import resolve_model

    monkeypatch.setenv("VLLM_TOUR_CACHE", str(tmp_path))
    with pytest.raises(TourError, match="load_format dummy"):
        resolve_model("tiny-mimo-mtp")
    d = resolve_model("tiny-mimo-mtp", "dummy")
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["architectures"], cfg["num_nextn_predict_layers"]) == (["MiMoForCausalLM"], 1)
    assert (d / "tokenizer.json").is_file() and not list(d.glob("*.safetensors"))
