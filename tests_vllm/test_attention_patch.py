"""The canary's patch of vLLM's CPU attention forward hands the engine's arguments on unchanged, and
the connector keeps vLLM's per-layer load and save calls out of every layer."""

import pytest
import torch


@pytest.fixture
def patched(monkeypatch):
    """The patched forward, with the engine's own replaced by a recorder of what it was given."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from kvcanary.engines.vllm import patch

    patch.install()
    got = []

    def original(*args, **kwargs):
        got.append((args, kwargs))
        return "engine's"

    monkeypatch.setitem(patch.ORIGINAL, "forward", original)
    return CPUAttentionBackendImpl.forward, got


class _Layer:
    layer_name = "model.layers.0.self_attn.attn"


def _args():
    t = torch.zeros(2, 4)
    return object(), _Layer(), t, t.clone(), t.clone(), torch.zeros(1), object()


@pytest.mark.parametrize("audited", [False, True])
def test_forward_passes_the_engines_arguments_on(patched, monkeypatch, audited):
    from kvcanary.engines.vllm import patch

    forward, got = patched
    seen = []
    if audited:  # a covered layer: the audit's layer method runs the engine's forward

        class Audit:
            fa = object()

            def layer(self, t0, original, *args, **kwargs):
                seen.append((args, kwargs))
                return original(*args, **kwargs)

        monkeypatch.setitem(patch.REGISTRY, _Layer.layer_name, Audit())
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


def test_forward_hands_known_layers_to_the_planned_forward(patched, monkeypatch):
    """While a forward's checks run in one call after it (``ACTIVE``), a layer it has seen goes straight
    to it with its row, the engine's attention and arguments; any other layer, a call with output
    scales or extra arguments, and a call under a fault's tap take the lookup by name."""
    from types import SimpleNamespace

    from kvcanary.engines.vllm import patch

    forward, got = patched
    runs, by_name = [], []

    class Wide:
        by_layer: dict = {}
        base = SimpleNamespace(by_layer=by_layer)
        plain_by_layer: dict = {}
        live = True

        def attend(self, row, t0, *args):  # the plan's direct path: the engine's attention, with its arguments
            runs.append((row, args))
            return patch.ORIGINAL["forward"](*args)

    class Audit:
        fa = object()

        def layer(self, t0, original, *args, **kwargs):
            by_name.append(args)
            return original(*args, **kwargs)

    wide = Wide()
    impl, layer, q, k, v, kv, md = _args()
    other = _Layer()
    wide.base.by_layer[layer] = (3, "statics")
    monkeypatch.setattr(patch, "ACTIVE", [wide])
    monkeypatch.setitem(patch.REGISTRY, _Layer.layer_name, Audit())
    out = torch.zeros(2, 4)
    assert forward(impl, layer, q, k, v, kv, md, output=out, output_scale=None, output_block_scale=None) == "engine's"
    assert runs == [((3, "statics"), (impl, layer, q, k, v, kv, md, out))]
    assert got[-1] == ((impl, layer, q, k, v, kv, md, out), {}) and not by_name
    forward(impl, other, q, k, v, kv, md, output=out)  # not seen by object: by name
    forward(impl, layer, q, k, v, kv, md, output=out, output_scale=torch.ones(1))  # a scale: by name
    forward(impl, layer, q, k, v, kv, None, output=out)  # no metadata: by name
    monkeypatch.setitem(patch.TAPS, "forward", lambda original, *a, **kw: original(*a, **kw))
    forward(impl, layer, q, k, v, kv, md, output=out)  # a fault's tap: by name (it wraps the engine's)
    assert len(runs) == 1 and len(by_name) == 3  # the call without metadata reaches the engine directly
    patch.ACTIVE[0] = None
    monkeypatch.delitem(patch.TAPS, "forward")
    forward(impl, layer, q, k, v, kv, md, output=out)
    assert len(runs) == 1 and len(by_name) == 4


def test_forward_takes_a_plain_row_straight_to_its_write_check_and_the_engine(patched, monkeypatch):
    """A plain row seen in an earlier forward, still open in this one, under the metadata and with the K
    and V strides and dtypes of the forward's first layer, goes from the patch to its write check and
    fold (``keep_written``) and the engine's attention, with the engine's arguments, and is closed; a
    closed row, another metadata or another stride goes to the plan's direct path; a failure of the
    canary's own withdraws the plan and the engine's attention still runs, once."""
    from kvcanary.engines.vllm import patch

    forward, got = patched
    impl, layer, q, k, v, kv, md = _args()
    written, attended, failed = [], [], []

    class Plan:
        by_layer = {layer: (2, "statics")}
        plain_by_layer = {layer: 2}
        live = True
        md_plain = md
        kst, vst, kdt, vdt = k.stride(), v.stride(), k.dtype, v.dtype
        clock = [0.0]
        original = staticmethod(patch.ORIGINAL["forward"])
        audit = type("A", (), {"failed": staticmethod(lambda e: failed.append(e))})

        def __init__(self):
            self.open = bytearray(4)
            self.seen = bytearray(4)

        def keep_written(self, li, key, value):
            written.append((li, key, value))

        def attend(self, row, t0, *args):
            attended.append(row)
            return patch.ORIGINAL["forward"](*args)

    plan = Plan()
    plan.open[2] = 1
    monkeypatch.setattr(patch, "ACTIVE", [plan])
    out = torch.zeros(2, 4)
    assert forward(impl, layer, q, k, v, kv, md, output=out) == "engine's"
    assert written == [(2, k, v)] and not attended and plan.open[2] == 0 and plan.seen[2] == 1
    assert got[-1] == ((impl, layer, q, k, v, kv, md, out), {}) and plan.clock[0] > 0
    forward(impl, layer, q, k, v, kv, md, output=out)  # closed now: the direct path
    plan.open[2] = 1
    forward(impl, layer, q, k, v, kv, object(), output=out)  # another metadata
    forward(impl, layer, q, k.t(), v, kv, md, output=out)  # another stride
    assert len(written) == 1 and attended == [(2, "statics")] * 3 and len(got) == 4

    def boom(li, key, value):
        raise RuntimeError("the canary's own")

    plan.keep_written = boom
    assert forward(impl, layer, q, k, v, kv, md, output=out) == "engine's"
    assert len(failed) == 1 and len(got) == 5 and len(attended) == 3  # the engine's attention ran once
