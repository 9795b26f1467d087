"""The canary's patch of vLLM's CPU attention forward hands the engine's arguments on unchanged, and
the connector keeps vLLM's per-layer load and save calls out of every layer."""

import pytest
import torch


@pytest.fixture
def patched(monkeypatch):
    """The patched forward, with the engine's own replaced by a recorder of what it was given."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from kvcanary.engines.vllm import audit

    audit.install()
    got = []

    def original(*args, **kwargs):
        got.append((args, kwargs))
        return "engine's"

    monkeypatch.setitem(audit._ORIGINAL, "forward", original)
    return CPUAttentionBackendImpl.forward, got


class _Layer:
    layer_name = "model.layers.0.self_attn.attn"


def _args():
    t = torch.zeros(2, 4)
    return object(), _Layer(), t, t.clone(), t.clone(), torch.zeros(1), object()


@pytest.mark.parametrize("audited", [False, True])
def test_forward_passes_the_engines_arguments_on(patched, monkeypatch, audited):
    from kvcanary.engines.vllm import audit

    forward, got = patched
    seen = []
    if audited:  # a covered layer: the audit's layer method runs the engine's forward

        class Audit:
            fa = object()

            def layer(self, t0, original, *args, **kwargs):
                seen.append((args, kwargs))
                return original(*args, **kwargs)

        monkeypatch.setitem(audit.REGISTRY, _Layer.layer_name, Audit())
    impl, layer, q, k, v, kv, md = _args()
    out, scale, block = torch.zeros(2, 4), torch.ones(1), torch.ones(2)
    # as vLLM calls it: output and the scales by keyword
    assert forward(impl, layer, q, k, v, kv, md, output=out, output_scale=None, output_block_scale=None) == "engine's"
    assert got[-1] == ((impl, layer, q, k, v, kv, md, out), {})  # no scales: none passed on
    assert forward(impl, layer, q, k, v, kv, md, output=out, output_scale=scale, output_block_scale=None) == "engine's"
    assert got[-1][0] == (impl, layer, q, k, v, kv, md, out)
    assert got[-1][1] == {"output_scale": scale, "output_block_scale": None}
    forward(impl, layer, q, k, v, kv, md, out, None, block)  # the scales given by position
    assert got[-1][1] == {"output_scale": None, "output_block_scale": block}
    forward(impl, layer, q, k, v, kv, md, output=out)
    assert got[-1] == ((impl, layer, q, k, v, kv, md, out), {})
    assert len(got) == 4
    assert len(seen) == (4 if audited else 0)


def test_connector_skips_vllms_per_layer_calls():
    """vLLM's per-layer wrapper (``maybe_transfer_kv_layer``) calls a connector's per-layer load and save
    only where ``has_connector_metadata()`` is true: the canary's says false, bound or not."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

    from kvcanary.engines.vllm.entry import KvCanaryConnector

    conn = KvCanaryConnector.__new__(KvCanaryConnector)  # the method reads no state
    conn._connector_metadata = KVConnectorMetadata()
    assert conn.has_connector_metadata() is False
