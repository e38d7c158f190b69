"""The engine-shaped KVConnector end to end: a prefill-side producer in this process streams
numpy KV layer by layer over kvserve's TCP transport to a decode-side consumer in another
process, which decodes into its cache; the pool path stores and fetches prompt chunks; bad
frames and dropped connections fail the request's loads with the library's message."""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kvserve
from conftest import kv_array

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPE = (4, 2, 96, 16)


def start_peer(tmp_path, requests):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), HERE) if p)
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "connector_peer.py"), "--shape", ",".join(map(str, SHAPE)),
         "--requests", ",".join(map(str, requests)), "--out", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if not line.startswith("PORT "):
        proc.kill()
        raise AssertionError(f"peer did not start: {line!r} {proc.stderr.read()}")
    return proc, int(line.split()[1])


def expected_cache(kv, strategy, request_id):
    n = kv.shape[0]
    out = np.zeros_like(kv)
    asm = kvserve.LayerAssembler(request_id, out)
    for layer in range(n):
        asm.add(kvserve.encode_layer(kv[layer], strategy, layer, n, request_id=request_id))
    return out


def test_layers_stream_to_a_decode_process(tmp_path):
    requests = [11, 12, 13]
    proc, port = start_peer(tmp_path, requests)
    try:
        kvs = {rid: kv_array(*SHAPE, seed=rid) for rid in requests}
        controller = kvserve.Controller.from_strategies([
            {"strategy": "quant(kbits=8,vbits=8)", "quality": 1.0, "ratio": 1.9, "encode_gbps": 40, "decode_gbps": 60},
            {"strategy": "quant(kbits=4,vbits=4)|rans", "quality": 0.99, "ratio": 4.4, "encode_gbps": 8, "decode_gbps": 16},
        ])
        with kvserve.KVConnector("producer", n_layer=SHAPE[0], peer=f"127.0.0.1:{port}", controller=controller,
                                 bandwidth_gbps=0.05, slo=5.0) as prod:
            for rid in requests:
                for layer in range(SHAPE[0]):  # the engine's forward pass, one layer at a time
                    prod.save_kv_layer(rid, layer, kvs[rid][layer])
            prod.wait_for_save()
            sending, _ = prod.get_finished()
            assert sending == set(requests)
            used = dict(prod.saved_strategy)
        proc.stdin.close()  # the producer is closed: the peer may go
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
        for rid in requests:
            got = np.load(tmp_path / f"{rid}.npy")
            np.testing.assert_array_equal(got, expected_cache(kvs[rid], used[rid], rid))
            x = kvs[rid].astype(np.float32)
            assert np.linalg.norm(got.astype(np.float32) - x) / np.linalg.norm(x) < 0.1  # 4-bit or better
        # At 0.05 Gbit/s (the initial estimate) the controller compresses.
        assert used[requests[0]] != "none"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_pool_holds_prompt_chunks_for_a_later_request():
    pool = kvserve.Pool("embedded", capacity_bytes=256 << 20)
    n_layer, n_head, n_token, dim = 3, 2, 600, 16
    kv = kv_array(n_layer, n_head, n_token, dim, seed=5)
    tokens = list(range(7, 7 + n_token))
    spec = "quant(kbits=4,vbits=4)|rans"
    with kvserve.KVConnector("producer", n_layer=n_layer, pool=pool, strategy=spec, model_id="test-model") as prod:
        for layer in range(n_layer):
            prod.save_kv_layer(1, layer, kv[layer], tokens=tokens)
        prod.wait_for_save()
    with kvserve.KVConnector("consumer", n_layer=n_layer, pool=pool, strategy=spec, model_id="test-model") as cons:
        assert cons.num_matched_tokens(tokens) == 512  # two full 256-token chunks
        assert cons.num_matched_tokens([1] + tokens[1:]) == 0  # another prefix
        cache = np.full((n_layer, 2, n_head, 1024, dim), 3, dtype=np.float16)
        assert cons.start_load_kv(2, cache, tokens=tokens) == 512
        cons.wait_for_layer_load(2, n_layer - 1, timeout_s=1)
        for c in range(2):
            chunk = kv[:, :, :, c * 256:(c + 1) * 256]
            want = kvserve.decode(kvserve.encode(chunk, spec, token_offset=c * 256))
            np.testing.assert_array_equal(cache[:, :, :, c * 256:(c + 1) * 256], want)
        assert (cache[:, :, :, 512:] == 3).all()
        _, recving = cons.get_finished()
        assert recving == {2}
    # The keys are the serving nodes' own.
    chain = kvserve.prefix_chain_hashes("test-model", tokens, 256)
    assert pool.get(kvserve.chunk_key("test-model", chain, 1, spec, 256)) is not None


def to_pages(kv, table, block_size, num_blocks, fill):
    """A dense (n_layer, 2, H, T, D) array laid out as vLLM's paged cache: per-layer arrays."""
    n_layer, _, n_head, n_token, dim = kv.shape
    layers = [np.full((2, num_blocks, block_size, n_head, dim), fill, dtype=kv.dtype) for _ in range(n_layer)]
    for t in range(n_token):
        for l in range(n_layer):
            layers[l][:, table[t // block_size], t % block_size] = kv[l, :, :, t, :]
    return layers


def from_pages(layers, table, block_size, n_token):
    return np.stack([np.stack([l[:, table[t // block_size], t % block_size] for t in range(n_token)], axis=2)
                     for l in layers])


def test_paged_caches_stream_and_pool_in_place():
    # vLLM's layout on both sides: a producer saves layers of a paged cache, a consumer in this
    # process decodes them into its own pages; the pool path stores and loads whole pages.
    n_layer, n_head, n_token, dim, bs = 3, 2, 600, 16, 16
    kv = kv_array(n_layer, n_head, n_token, dim, seed=9)
    table = list(np.random.default_rng(3).permutation(48))[:38]  # 38 pages of 16 hold 600 tokens
    src = to_pages(kv, table, bs, 48, 0.0)
    spec = "quant(kbits=4,vbits=4)|rans"
    pool = kvserve.Pool("embedded", capacity_bytes=256 << 20)
    tokens = list(range(5, 5 + n_token))
    with kvserve.KVConnector("consumer", n_layer=n_layer, listen="127.0.0.1:0", pool=pool, strategy=spec,
                             model_id="m") as cons:
        with kvserve.KVConnector("producer", n_layer=n_layer, peer=f"127.0.0.1:{cons.port}", pool=pool,
                                 strategy=spec, model_id="m") as prod:
            dst_table = table[::-1]  # the consumer's pages differ
            dst = [np.full_like(l, 5.0) for l in src]
            cons.start_load_kv(4, dst, block_table=dst_table, n_token=n_token)
            for layer in range(n_layer):
                prod.save_kv_layer(4, layer, src[layer], tokens=tokens, block_table=table, n_token=n_token)
            prod.wait_for_save()
            cons.wait_for_load(4, timeout_s=10)
        want = expected_cache(kv, spec, 4)
        np.testing.assert_array_equal(from_pages(dst, dst_table, bs, n_token), want)
        unused = [p for p in range(48) if p not in table]
        assert all((l[:, unused] == 5.0).all() for l in dst), "pages outside the table were written"
        # The pool holds the prompt's two full chunks under the dense path's keys and frames.
        chain = kvserve.prefix_chain_hashes("m", tokens, 256)
        for c in range(2):
            frame = pool.get(kvserve.chunk_key("m", chain, c, spec, 256))
            assert frame == kvserve.encode(kv[:, :, :, c * 256:(c + 1) * 256], spec, token_offset=c * 256)
        cache = [np.full_like(l, 3.0) for l in src]
        assert cons.start_load_kv(5, cache, tokens=tokens, block_table=table) == 512
        got = from_pages(cache, table, bs, 512)
        for c in range(2):
            chunk = kvserve.decode(pool.get(kvserve.chunk_key("m", chain, c, spec, 256)))
            np.testing.assert_array_equal(got[:, :, :, c * 256:(c + 1) * 256], chunk)
        assert all((l[:, table[32:]] == 3.0).all() for l in cache)  # pages past the loaded prefix


def test_corrupt_frame_fails_the_load_with_the_reason():
    kv = kv_array(*SHAPE, seed=3)
    with kvserve.KVConnector("consumer", n_layer=SHAPE[0], listen="127.0.0.1:0", timeout_s=10) as cons:
        cache = np.zeros_like(kv)
        cons.start_load_kv(5, cache)
        conn = kvserve.connect(f"127.0.0.1:{cons.port}")
        good = kvserve.encode_layer(kv[0], "quant(kbits=4,vbits=4)", 0, SHAPE[0], request_id=5)
        conn.send(kvserve.message.FRAME, good)
        cons.wait_for_layer_load(5, 0, timeout_s=10)
        bad = bytearray(kvserve.encode_layer(kv[1], "quant(kbits=4,vbits=4)", 1, SHAPE[0], request_id=5))
        bad[-20] ^= 0xFF
        conn.send(kvserve.message.FRAME, bytes(bad))
        with pytest.raises(kvserve.CorruptData, match="checksum"):
            cons.wait_for_layer_load(5, 1, timeout_s=10)
        conn.close()


def test_dropped_producer_fails_pending_loads_quickly():
    kv = kv_array(*SHAPE, seed=4)
    with kvserve.KVConnector("consumer", n_layer=SHAPE[0], listen="127.0.0.1:0", timeout_s=30) as cons:
        cache = np.zeros_like(kv)
        cons.start_load_kv(9, cache)
        conn = kvserve.connect(f"127.0.0.1:{cons.port}")
        conn.send(kvserve.message.FRAME, kvserve.encode_layer(kv[0], "none", 0, SHAPE[0], request_id=9))
        cons.wait_for_layer_load(9, 0, timeout_s=10)
        conn.close()  # the prefill worker dies mid-request
        t0 = time.monotonic()
        with pytest.raises(kvserve.Unavailable):
            cons.wait_for_layer_load(9, 3, timeout_s=20)
        assert time.monotonic() - t0 < 10
        np.testing.assert_array_equal(cache[0], kv[0])  # what arrived stays


def test_roles_and_arguments_are_checked():
    with pytest.raises(kvserve.InvalidArgument, match="role 'decoder'"):
        kvserve.KVConnector("decoder", n_layer=2)
    with kvserve.KVConnector("producer", n_layer=2) as prod:
        with pytest.raises(kvserve.InvalidArgument, match="layer 2 is outside 0..1"):
            prod.save_kv_layer(1, 2, kv_array(2, 2, 8, 16)[0])
        with pytest.raises(kvserve.InvalidArgument, match="does not load"):
            prod.start_load_kv(1, kv_array(2, 2, 8, 16))
    with pytest.raises(kvserve.Unavailable):
        kvserve.KVConnector("producer", n_layer=2, peer="127.0.0.1:1", timeout_s=2)
