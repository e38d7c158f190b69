"""Controller, pool and evaluator through the Python module, checked against the C++ CLI."""

import json

import numpy as np
import pytest

import kvserve
from conftest import SOURCE_DIR, kv_array, run_cli

PROFILE = f"{SOURCE_DIR}/bench/profiles/default.json"

STRATEGIES = [
    {"strategy": "quant(kbits=8,vbits=8)", "quality": 1.0, "ratio": 1.9, "encode_gbps": 40, "decode_gbps": 60},
    {"strategy": "quant(kbits=4,vbits=4)|rans", "quality": 0.99, "ratio": 4.4, "encode_gbps": 6, "decode_gbps": 12},
    {"strategy": "quant(kbits=2,vbits=2)|rans", "quality": 0.9, "ratio": 9.0, "encode_gbps": 6, "decode_gbps": 12},
]


def test_decide_explains_and_moves_with_bandwidth():
    c = kvserve.Controller.from_strategies(STRATEGIES, bandit=False)
    assert [s["strategy"] for s in c.strategies][0] == "none"
    kv_bytes = 512 << 20
    fast = c.decide(kv_bytes, 400.0, 1.0, 0.97)
    slow = c.decide(kv_bytes, 1.0, 10.0, 0.97)
    assert fast.strategy == "none"  # the link outruns every codec
    assert slow.strategy.startswith("quant(kbits=4")  # 2-bit is below the floor
    assert "chose" in slow.explanation and "floor" in slow.explanation
    reasons = {n["reason"] for n in slow.candidates}
    assert "floor" in reasons
    low_floor = c.decide(kv_bytes, 1.0, 10.0, 0.85)
    assert low_floor.strategy.startswith("quant(kbits=2")
    c.observe(slow, slow.predicted_seconds * 1.1)
    # The codec measured 3x slower than profiled: every strategy is planned slower from then on.
    before = c.decide(kv_bytes, 1.0, 10.0, 0.97).predicted_seconds
    chosen = next(s for s in c.strategies if s["strategy"] == slow.strategy)
    enc = kv_bytes / (chosen["encode_gbps"] * 1e9 / 8)
    dec = kv_bytes / (chosen["decode_gbps"] * 1e9 / 8)
    c.observe(slow, slow.predicted_seconds * 2, encode_seconds=3 * enc, decode_seconds=3 * dec)
    after = c.decide(kv_bytes, 1.0, 10.0, 0.97)
    assert after.predicted_seconds > before
    assert "codec measured at 0.33" in after.explanation
    with pytest.raises(kvserve.InvalidArgument, match="encode_seconds"):
        c.observe(slow, 1.0, encode_seconds=-1.0)
    with pytest.raises(kvserve.InvalidArgument, match="bandwidth_gbps"):
        c.decide(kv_bytes, 0.0, 1.0)
    with pytest.raises(kvserve.InvalidArgument, match="floor"):
        c.decide(kv_bytes, 1.0, 1.0, 1.5)


def test_profile_controller_matches_the_cli(cli):
    tokens, per_token = 4096, 131072
    for gbps in (1, 5, 25, 100):
        c = kvserve.Controller(PROFILE)  # fresh, seed 1, as each CLI run is
        d = c.decide(tokens * per_token, float(gbps), 1.0, 0.97, prompt_tokens=tokens)
        r = run_cli("control", "decide", "--profile", PROFILE, "--bandwidth-gbps", str(gbps), "--tokens", str(tokens),
                    "--slo-ms", "1000", "--floor", "0.97", "--json")
        ref = json.loads(r.stdout)
        assert ref["spec"] == d.strategy, gbps
        assert ref["explanation"] == d.explanation
        assert ref["predicted_ms"] == pytest.approx(d.predicted_seconds * 1e3, rel=1e-12)
    with pytest.raises(kvserve.Error, match="nonexistent"):
        kvserve.Controller("/nonexistent/profile.json")


def _pool_round_trip(pool):
    kv = kv_array(n_token=512)
    tokens = list(range(1000, 1600))
    chain = kvserve.prefix_chain_hashes("synthetic-test", tokens, 256)
    assert len(chain) == 2  # full chunks only
    keys = [kvserve.chunk_key("synthetic-test", chain, c, "quant(kbits=4,vbits=4)", 256) for c in range(2)]
    assert keys[0].startswith("kvs:{")
    assert pool.exists(keys) == [False, False]
    frame = kvserve.encode(kv[:, :, :, :256], "quant(kbits=4,vbits=4)")
    pool.put(keys[0], frame)
    assert pool.exists(keys) == [True, False]
    assert pool.get(keys[0]) == frame
    assert pool.get(keys[1]) is None
    assert pool.get_many(keys) == [frame, None]
    pool.delete(keys[0])
    assert pool.get(keys[0]) is None
    assert pool.stats()["puts"] >= 1


def test_embedded_pool():
    pool = kvserve.Pool("embedded", capacity_bytes=64 << 20)
    assert pool.name.startswith("embedded")
    _pool_round_trip(pool)


def test_redis_pool(redis_server):
    pool = kvserve.Pool(redis_server)
    _pool_round_trip(pool)


def test_unreachable_redis_is_an_unavailable_error():
    with pytest.raises(kvserve.Error, match="127.0.0.1:1"):
        pool = kvserve.Pool("redis://127.0.0.1:1")
        pool.put("k", b"v")


def test_evaluator_matches_the_cli(cli):
    ev = kvserve.Evaluator("stories260K", contexts=4)
    assert ev.model == "stories260K"
    exact = ev.evaluate("none")
    assert exact["relative_accuracy"] == 1.0
    m = ev.evaluate("quant(kbits=2,vbits=2)")
    r = run_cli("eval", "-m", "stories260K", "-s", "quant(kbits=2,vbits=2)", "--contexts", "4", "--json")
    ref = json.loads(r.stdout)
    for key in ("relative_accuracy", "accuracy", "exact_accuracy", "kl", "ratio", "positions"):
        assert m[key] == pytest.approx(ref[key], rel=1e-12), key
    kv = ev.prompt_kv(0)
    assert kv.dtype == np.float16 and kv.shape[0] == 5 and kv.shape[3] == ev.prompt_len
    with pytest.raises(kvserve.NotFound):
        kvserve.Evaluator("no-such-model")
