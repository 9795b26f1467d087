"""SGLang's CPU engine runs here: greedy generation with a shared prefix, twice; the second time
the radix cache serves the prompts (meta_info["cached_tokens"]) and the tokens are the same."""

import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
PREFIX = list(range(100, 132))  # 32 tokens shared by every prompt
PROMPTS = [PREFIX + [300 + i, 400 + i, 500 + i] for i in range(3)]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def test_the_engine_runs_on_the_stand_ins():
    import sgl_kernel
    import torchvision

    for mod in (sgl_kernel, torchvision):
        assert mod.__file__.startswith(os.path.join(HERE, "stubs") + os.sep), mod.__file__
    # no operator is registered, so SGLang's AMX check fails and every layer takes its torch path
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")


def test_stand_in_writes_request_slots_and_refuses_the_rest():
    import pytest
    import sgl_kernel

    table = torch.zeros((4, 8), dtype=torch.int32)
    sgl_kernel.assign_req_to_token_pool_cpu(torch.tensor([3, 1]), table, torch.tensor([2, 0]), torch.tensor([5, 1]),
                                            torch.tensor([7, 8, 9, 4], dtype=torch.int64), table.shape[1])
    assert table[3].tolist() == [0, 0, 7, 8, 9, 0, 0, 0]
    assert table[1].tolist() == [4, 0, 0, 0, 0, 0, 0, 0]
    assert table[0].sum() == 0 and table[2].sum() == 0
    t = torch.ones(3)
    assert sgl_kernel.weak_ref_tensor(t) is t
    with pytest.raises(sgl_kernel.StandInError, match="copy_all_layer_kv_cache_cpu"):
        sgl_kernel.copy_all_layer_kv_cache_cpu()


def test_shared_prefix_is_served_from_the_radix_cache_and_tokens_repeat(engine):
    first = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    second = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    for p, a, b in zip(PROMPTS, first, second):
        assert a["meta_info"]["prompt_tokens"] == len(p)
        assert len(a["output_ids"]) == len(b["output_ids"]) == GREEDY["max_new_tokens"]
        assert a["output_ids"] == b["output_ids"]
        # the whole prompt but its last token, whose logits the request needs, comes from the cache
        assert b["meta_info"]["cached_tokens"] == len(p) - 1
    assert sum(a["meta_info"]["cached_tokens"] for a in first) < sum(b["meta_info"]["cached_tokens"] for b in second)


def test_without_kvcanary_mode_the_plugin_leaves_sglangs_methods_as_they_are(engine):
    from importlib.metadata import entry_points

    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.model_runner import ModelRunner

    assert "kvcanary" in {ep.name for ep in entry_points(group="sglang.srt.plugins")}
    import sglang.srt.plugins as plugins

    assert plugins._plugins_loaded  # SGLang loaded the plugins in this process (the engine's)
    for fn in (ModelRunner.forward, TpModelWorker.forward_batch_generation, TokenToKVPoolAllocator.free,
               TokenToKVPoolAllocator.clear, ReqToTokenPool.free):
        assert fn.__module__.startswith("sglang.") and not hasattr(fn, "__wrapped__"), fn
