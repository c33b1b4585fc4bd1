"""Probes and other general plugins (vllm-metax patches upstream functions too): vLLM calls general plugins
in no set order, so a probe target may be replaced before the probes install or after. Either way the probe
wraps what is there when the run starts, records it once per call, and the run says it was replaced."""

import inspect
import json

from vllm_tour.upstream.pins import active_pin_tag
from vllm_tour.probes import base
from vllm_tour.probes.base import Probe
from vllm_tour.scenario import load_scenario
from vllm_tour.trace.reader import load_run
from vllm_tour.trace.writer import Recorder

POOL = "vllm.v1.core.block_pool.BlockPool"


SCENARIO = """
name = "two_short_requests"
mode = "scheduler"
max_steps = 20

[engine]
kv_cache_memory_bytes = 1048576
max_model_len = 128

[[requests]]
id = "r0"
token_ids = [5, 6, 7, 8, 9, 10, 11, 12]
max_tokens = 3
ignore_eos = true

[[requests]]
id = "r1"
token_ids = [15, 16, 17, 18, 19]
max_tokens = 2
ignore_eos = true
"""

# A second general plugin, as vllm-metax's `register_customized` is one: at load it replaces a function the
# probes wrap (KVCacheManager.free) with its own, which calls the one it found.
PLUGIN = '''
CALLS = []


def register():
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    found = KVCacheManager.free

    def free(self, request):
        CALLS.append(request.request_id)
        return found(self, request)

    KVCacheManager.free = free
'''


def test_a_target_another_general_plugin_replaced_is_wrapped_and_recorded(tmp_path, monkeypatch):
    import vllm.plugins
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from vllm_tour.engine.sched_harness import run_scheduler

    site = tmp_path / "site"
    info = site / "tour_replacing_plugin-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tour-replacing-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nreplace_free = tour_replacing_plugin:register\n")
    (site / "tour_replacing_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(KVCacheManager, "free", KVCacheManager.free)  # put back after the test
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)  # EngineArgs loads the general plugins again here
    (tmp_path / "sc.toml").write_text(SCENARIO)
    run = load_run(run_scheduler(load_scenario(tmp_path / "sc.toml"), tmp_path / "run"))

    import tour_replacing_plugin

    assert sorted(r.split("-")[0] for r in tour_replacing_plugin.CALLS) == ["r0", "r1"]  # the plugin's function ran
    [rec] = run.replaced_targets
    assert (rec.probe, rec.when) == ("kv.free", "before_install")
    assert rec.target == "vllm.v1.core.kv_cache_manager.KVCacheManager.free"
    assert rec.replaced_by == "tour_replacing_plugin.register.<locals>.free"
    assert any("replaced it before install" in w for w in run.warnings)
    # the probe wraps the plugin's function: r1 (done first) has its blocks freed in the trace, once
    freed = [b for s in run.steps for b in s.kv.freed]
    r1 = {b for s in run.steps for b in s.kv.allocated.get("r1", [])}
    assert r1 and set(freed) >= r1 and len(freed) == len(set(freed))


def test_a_target_replaced_after_install_is_wrapped_again_at_the_first_probe_call(tmp_path, monkeypatch):
    from vllm.v1.core.block_pool import BlockPool

    pin = active_pin_tag()
    calls = []
    probe = Probe(name="test.evict", target=f"{POOL}._maybe_evict_cached_block", params=("self", "block"),
                  records="the blocks it is called with", pins=(pin,),
                  before=lambda self, block, *a, **kw: calls.append(block.block_id))
    monkeypatch.setattr(BlockPool, "_maybe_evict_cached_block", BlockPool._maybe_evict_cached_block)
    rec = Recorder()
    rec.activate(tmp_path)
    r = base.resolve(probe, pin)
    assert r.replaced_by is None  # upstream's own function
    base.install([r], rec)
    ours = BlockPool._maybe_evict_cached_block
    seen = []

    def evict(self, block):  # a plugin loaded after the probes: it keeps, and calls, what it found (our wrapper)
        seen.append(block.block_id)
        return ours(self, block)

    BlockPool._maybe_evict_cached_block = evict
    pool = BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=16)
    for i in (1, 2, 3):
        pool._maybe_evict_cached_block(pool.blocks[i])
    rec.close()
    assert seen == [1, 2, 3] and calls == [1, 2, 3]  # every call reaches the plugin's function, recorded once
    installed = BlockPool._maybe_evict_cached_block
    assert installed.__vllm_tour_original__ is evict and not ours.__vllm_tour_live__[0]
    [line] = [json.loads(x) for f in tmp_path.glob("records.*.jsonl") for x in f.read_text().splitlines()]
    assert line["kind"] == "probe_target" and line["when"] == "after_install" and line["probe"] == "test.evict"
    assert line["replaced_by"].endswith("test_a_target_replaced_after_install_is_wrapped_again_at_the_first_probe_call"
                                        ".<locals>.evict")
    assert base.replaced_by(BlockPool, "free_blocks", BlockPool.free_blocks) is None
    assert base.replaced_by(BlockPool, "free_blocks", evict) == evict.__module__ + "." + evict.__qualname__



def test_a_target_put_back_after_a_replacement_is_not_wrapped_again(tmp_path, monkeypatch):
    """A plugin's replacement undone (a test's monkeypatch puts back what it found: our earlier wrapper) is not
    a replacement: the next install's first probe call leaves it alone, with no wrapper around a wrapper of
    ours, and resolving the target still finds upstream's function."""
    from vllm.v1.core.block_pool import BlockPool

    pin = active_pin_tag()
    upstream = inspect.unwrap(BlockPool._maybe_evict_cached_block)  # an in-process run before may have left ours
    monkeypatch.setattr(BlockPool, "_maybe_evict_cached_block", upstream)
    monkeypatch.setattr(BlockPool, "get_new_blocks", inspect.unwrap(BlockPool.get_new_blocks))
    evict = Probe(name="test.evict", target=f"{POOL}._maybe_evict_cached_block", params=("self", "block"),
                  records="the blocks it is called with", pins=(pin,))
    other = Probe(name="test.get_new_blocks", target=f"{POOL}.get_new_blocks", params=("self", "num_blocks"),
                  records="nothing", pins=(pin,))
    rec = Recorder()
    rec.activate(tmp_path)
    base.install([base.resolve(evict, pin)], rec)
    ours = BlockPool._maybe_evict_cached_block

    def plugin_evict(self, block):
        return ours(self, block)

    BlockPool._maybe_evict_cached_block = plugin_evict
    pool = BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=16)
    pool._maybe_evict_cached_block(pool.blocks[1])  # settles: the plugin's function is wrapped, ours goes quiet
    BlockPool._maybe_evict_cached_block = ours  # the plugin's patch undone
    base.install([base.resolve(other, pin)], rec)  # a later install in this process
    pool.get_new_blocks(1)  # its first probe call settles again
    rec.close()
    assert BlockPool._maybe_evict_cached_block is ours
    assert base.resolve(evict, pin).original is upstream
