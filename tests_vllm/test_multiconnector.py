"""The canary beside a real connector, through vLLM's MultiConnector: ExampleConnector stores each
prompt's KV in files (one engine), a second engine loads it on a prefix hit (a prefill/decode split
in miniature). The stamps travel with the KV and every landed byte is verified at landing, so a
torn or wrong load is reported there, with the request that loaded it."""

import glob

from test_vllm import engine


def multi(tmp_path, mode=None):
    """The canary beside ExampleConnector; with ``mode`` (repair), the policy is given at the top (the
    scheduler reads it there) and in the canary's own entry (which sees only that entry)."""
    canary = {"kv_connector": "KvCanaryConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"stamp_store": str(tmp_path / "stamps")}}
    top = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
         "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")}}, canary]}}
    if mode == "repair":
        canary["kv_connector_extra_config"]["mode"] = mode
        canary["kv_load_failure_policy"] = top["kv_load_failure_policy"] = "recompute"
    return top


def test_landed_kv_is_verified_against_the_stamps_that_travelled_with_it(tiny_llama, tmp_path):
    cfg = dict(canary=True, kv_transfer_config=multi(tmp_path), requests=4, max_seqs=1)
    stored = engine(tiny_llama, **cfg)  # the first engine computes and stores
    assert stored["violations"] == [] and glob.glob(str(tmp_path / "stamps" / "*.stamps"))
    loaded = engine(tiny_llama, **cfg)  # a fresh engine loads the stored KV on a prefix hit
    st = loaded["stats"]
    assert loaded["violations"] == [] and st["slots_scrubbed"] > 0  # the landed slots were checked
    assert sorted(loaded["tokens"].values()) == sorted(stored["tokens"].values())


def test_a_torn_load_is_reported_at_landing_and_repaired(tiny_llama, tmp_path):
    """Half of one layer's stored KV never lands: the landing check reports it with the request that
    loaded it, and in repair mode that request computes the bad blocks again and finishes with the
    tokens of the engine that stored them."""
    cfg = dict(canary=True, kv_transfer_config=multi(tmp_path), requests=4, max_seqs=1)
    stored = engine(tiny_llama, **cfg)
    files = sorted(glob.glob(str(tmp_path / "kv" / "**" / "*.safetensors"), recursive=True))
    assert files
    for f in files[:1]:  # tear the stored KV of one layer of one prompt: its second half never landed
        with open(f, "r+b") as fh:
            size = fh.seek(0, 2)
            fh.seek(size // 2)
            fh.write(bytes(size - size // 2))
    loaded = engine(tiny_llama, **{**cfg, "kv_transfer_config": multi(tmp_path, "repair")})
    hits = [v for v in loaded["violations"] if v["site"] == "transfer"]
    assert hits and all(v["checks"] == ["CONTENT"] and v["request"] for v in hits)
    assert loaded["stats"]["repairs"] >= 1 and loaded["stats"]["requests_failed"] == 0
    assert sorted(loaded["tokens"].values()) == sorted(stored["tokens"].values())
