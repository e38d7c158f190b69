"""Codec through the Python module: frames equal the C++ CLI's byte for byte, arrays come back
without copies where promised, and errors carry the library's messages."""

import os

import numpy as np
import pytest

import kvserve
from conftest import kv_array, run_cli

SPECS = ["none", "quant(kbits=4,vbits=4)", "quant(kbits=2,vbits=2,group=32,residual=8)|zstd(level=3)",
         "mixhq|rans", "cast(dtype=bf16)", "fp8|rans", "fpsplit|rans"]


def test_strategy_text_round_trips():
    c = kvserve.canonical_strategy("quant(kbits=2)|rans")
    assert c.startswith("quant(kbits=2,vbits=")
    assert kvserve.canonical_strategy(c) == c
    stages = kvserve.parse_strategy(c)
    assert [s[0] for s in stages] == ["quant", "rans"]
    assert stages[0][1]["kbits"] == "2"
    names = {s["name"] for s in kvserve.stages()}
    assert {"quant", "prune", "rans", "zstd", "mixhq"} <= names


@pytest.mark.parametrize("spec", SPECS)
def test_frames_equal_the_cli_byte_for_byte(tmp_path, cli, spec):
    raw = tmp_path / "x.kvf"
    run_cli("kv", "synth", "--shape", "stories260k", "--tokens", "96", "-o", str(raw))
    kv = kvserve.decode(raw.read_bytes())
    assert kv.shape == (5, 2, 4, 96, 8) and kv.dtype == np.float16
    cli_frame = tmp_path / "y.kvf"
    run_cli("codec", "encode", "-s", spec, "-i", str(raw), "-o", str(cli_frame))
    py_frame = kvserve.encode(kv, spec)
    assert py_frame == cli_frame.read_bytes()
    # And the CLI decodes the module's frame to what the module decodes.
    (tmp_path / "p.kvf").write_bytes(py_frame)
    run_cli("codec", "decode", "-i", str(tmp_path / "p.kvf"), "-o", str(tmp_path / "z.kvf"))
    from_cli = kvserve.decode((tmp_path / "z.kvf").read_bytes())
    from_py = kvserve.decode(py_frame)
    np.testing.assert_array_equal(from_cli.view(np.uint16), from_py.view(np.uint16))


def test_decode_hands_over_the_block_without_a_copy():
    kv = kv_array()
    out = kvserve.decode(kvserve.encode(kv, "quant(kbits=8,vbits=8)"))
    assert not out.flags.owndata and out.base is not None  # the decoded block's own memory
    assert type(out.base).__name__ == "PyCapsule"
    assert out.flags.c_contiguous and out.shape == kv.shape
    assert np.abs(out.astype(np.float32) - kv.astype(np.float32)).max() < 0.05


def test_decode_into_a_cache_writes_it_in_place():
    kv = kv_array(n_token=40)
    frame = kvserve.encode(kv, "quant(kbits=4,vbits=4)")
    expected = kvserve.decode(frame)
    out = np.zeros_like(kv)
    assert kvserve.decode(frame, out=out) is out
    np.testing.assert_array_equal(out, expected)
    # A token slice of a larger cache (room for more tokens): the slice is filled, the rest kept.
    cache = np.full((4, 2, 2, 100, 16), 7, dtype=np.float16)
    got = kvserve.decode(frame, out=cache[:, :, :, :40])
    assert np.shares_memory(got, cache)
    np.testing.assert_array_equal(cache[:, :, :, :40], expected)
    assert (cache[:, :, :, 40:] == 7).all()
    # fp32 cache: decoded in its dtype.
    out32 = np.zeros(kv.shape, dtype=np.float32)
    kvserve.decode(frame, out=out32)
    np.testing.assert_allclose(out32, expected.astype(np.float32), rtol=2e-3, atol=1e-3)  # fp16 rounding


def test_encode_reads_strided_and_copied_layouts_alike():
    cache = kv_array(n_token=128)
    view = cache[:, :, :, 16:80]  # token slice: encoded in place
    assert not view.flags.c_contiguous
    assert kvserve.encode(view, "quant(kbits=4,vbits=4)") == kvserve.encode(np.ascontiguousarray(view), "quant(kbits=4,vbits=4)")
    odd = np.asfortranarray(cache)  # no KV layout: copied first, same frame
    assert kvserve.encode(odd, "none") == kvserve.encode(cache, "none")


def test_bf16_and_fp32_arrays():
    kv = kv_array(dtype=np.float32)
    f = kvserve.encode(kv, "none")
    assert kvserve.frame_info(f)["dtype"] == "f32"
    np.testing.assert_array_equal(kvserve.decode(f), kv)
    bf = (kv.view(np.uint32) >> 16).astype(np.uint16)
    fb = kvserve.encode(bf, "none", dtype="bf16")
    assert kvserve.frame_info(fb)["dtype"] == "bf16"
    np.testing.assert_array_equal(kvserve.decode(fb), bf)


def test_fp8_arrays_round_trip_losslessly():
    # An FP8 cache (vLLM --kv-cache-dtype fp8) as uint8 with the format named: stored as is, and
    # the lossless float coder gives the same bytes back.
    codes = (kv_array(dtype=np.float32) * 8).astype(np.float16).view(np.uint16)
    e4m3 = (codes >> 8).astype(np.uint8)  # some byte pattern per value: every code is valid
    for spec in ["none", "fpsplit(dtype=e4m3)|rans"]:
        f = kvserve.encode(e4m3, spec, dtype="e4m3")
        assert kvserve.frame_info(f)["dtype"] == "e4m3"
        back = kvserve.decode(f)
        assert back.dtype == np.uint8
        np.testing.assert_array_equal(back, e4m3)
    with pytest.raises(kvserve.Error, match="does not hold e5m2"):
        kvserve.encode(codes, "none", dtype="e5m2")


def test_fp8_scales_ride_the_frame_and_decoders_convert_to_their_own():
    # vLLM's FP8 cache: uint8 codes plus k_scale/v_scale per layer (value = code * scale).
    values = kv_array(n_layer=3, dtype=np.float32)
    n_layer = values.shape[0]
    unit = (values.astype(np.float16).view(np.uint16) >> 8).astype(np.uint8)  # valid E4M3 codes ...
    unit[(unit & 0x7F) == 0x7F] -= 1  # ... but NaN
    scales = np.array([[0.5, 2.0]] * n_layer, dtype=np.float32)  # the codes stand for codes * scale
    for spec in ["none", "fpsplit(dtype=e4m3)|rans", "fp8|rans"]:
        frame = kvserve.encode(unit, spec, dtype="e4m3", scales=scales)
        np.testing.assert_array_equal(kvserve.frame_info(frame)["fp8_scales"], scales)
        codes = kvserve.decode(frame)  # the frame's codes; their scales in frame_info
        assert codes.dtype == np.uint8
        as_f32 = kvserve.decode(frame, out=np.zeros(values.shape, np.float32))  # a float destination: values
        ref = kvserve.decode(kvserve.encode(codes, "none", dtype="e4m3"), out=np.zeros(values.shape, np.float32))
        np.testing.assert_allclose(as_f32, ref * scales[:, :, None, None, None], rtol=0.07, atol=0.02)
        # An engine whose scales are the frame's gets the codes untouched.
        same = kvserve.decode(frame, out=np.zeros_like(codes), dtype="e4m3", scales=scales)
        np.testing.assert_array_equal(same, codes)
        # One whose scales are twice as large gets codes of half the value.
        twice = kvserve.decode(frame, out=np.zeros_like(codes), dtype="e4m3", scales=scales * 2)
        halved = kvserve.decode(kvserve.encode(twice, "none", dtype="e4m3", scales=scales * 2),
                                out=np.zeros(values.shape, np.float32))
        np.testing.assert_allclose(halved, as_f32, rtol=0.07, atol=0.02)
    per_head = np.ones((n_layer, 2, values.shape[2]), np.float32)
    assert kvserve.frame_info(kvserve.encode(unit, "none", dtype="e4m3", scales=per_head))["fp8_scales"].shape == per_head.shape
    with pytest.raises(kvserve.InvalidArgument, match="scales hold 5 values"):
        kvserve.encode(unit, "none", dtype="e4m3", scales=np.ones(5, np.float32))
    with pytest.raises(kvserve.InvalidArgument, match="only e4m3 and e5m2"):
        kvserve.encode(values, "none", scales=scales)


def test_a_vllm_paged_cache_round_trips_in_place():
    # vLLM's layout: per layer (2, num_blocks, block_size, n_head_kv, head_dim), a block table.
    kv = kv_array(n_layer=3, n_token=45)  # (3, 2, H, T, D): the last page partly used
    n_layer, _, n_head, n_token, head_dim = kv.shape
    block_size, num_blocks = 16, 12
    table = [9, 2, 7, 0, 11, 4, 5, 1, 10, 3][: (n_token + block_size - 1) // block_size]
    layers = [np.full((2, num_blocks, block_size, n_head, head_dim), 7.0, dtype=np.float16) for _ in range(n_layer)]
    for t in range(n_token):
        page, row = table[t // block_size], t % block_size
        for l in range(n_layer):
            layers[l][:, page, row] = kv[l, :, :, t, :]
    for spec in ["none", "quant(kbits=4,vbits=4)|rans", "fp8|rans", "fpsplit|rans"]:
        frame = kvserve.encode_paged(layers, table, n_token, spec)
        assert frame == kvserve.encode(kv, spec), spec
        dest = [np.full_like(a, 7.0) for a in layers]
        kvserve.decode_paged(frame, dest, table)
        want = kvserve.decode(frame)
        for t in range(n_token):
            page, row = table[t // block_size], t % block_size
            for l in range(n_layer):
                np.testing.assert_array_equal(dest[l][:, page, row], want[l, :, :, t, :])
        unused = [p for p in range(num_blocks) if p not in table]
        assert all((dest[l][:, unused] == 7.0).all() for l in range(n_layer)), "pages outside the table were written"
    with pytest.raises(kvserve.Error, match="num_blocks"):
        kvserve.encode_paged(layers, [99] * len(table), n_token, "none")


def test_ml_dtypes_fp8_arrays_name_their_format():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    kv = kv_array(dtype=np.float32).astype(ml_dtypes.float8_e4m3fn)
    f = kvserve.encode(kv, "none")
    assert kvserve.frame_info(f)["dtype"] == "e4m3"
    np.testing.assert_array_equal(kvserve.decode(f), kv.view(np.uint8))


def test_layer_frames_assemble_into_the_cache():
    kv = kv_array(n_layer=5)
    spec = "quant(kbits=3,vbits=3)|rans"
    frames = [kvserve.encode_layer(kv[l], spec, l, 5, request_id=42) for l in range(5)]
    # The one-layer form equals slicing the whole block.
    assert frames[2] == kvserve.encode(kv, spec, layers=(2, 1), request_id=42)
    info = kvserve.frame_info(frames[3])
    assert (info["request_id"], info["layer_begin"], info["n_layer_total"]) == (42, 3, 5)
    dest = np.zeros_like(kv)
    asm = kvserve.LayerAssembler(42, dest)
    for f in reversed(frames):
        asm.add(f)
    assert asm.complete and asm.layers_done == 5
    np.testing.assert_array_equal(dest, kvserve.decode(kvserve.encode(kv, spec)))
    with pytest.raises(kvserve.InvalidArgument, match="request"):
        kvserve.LayerAssembler(7, np.zeros_like(kv)).add(frames[0])


def test_errors_carry_the_library_message():
    kv = kv_array()
    with pytest.raises(kvserve.InvalidArgument, match=r"kbits=9 out of range \(expected 1..8\)") as e:
        kvserve.encode(kv, "quant(kbits=9)")
    assert isinstance(e.value, ValueError) and isinstance(e.value, kvserve.Error)
    with pytest.raises(kvserve.InvalidArgument, match="unknown stage|stage 'zip'"):
        kvserve.canonical_strategy("zip")
    frame = kvserve.encode(kv, "quant(kbits=4,vbits=4)")
    with pytest.raises(kvserve.CorruptData, match="truncated frame"):
        kvserve.decode(frame[:-5])
    bad = bytearray(frame)
    bad[len(bad) // 2] ^= 0x40
    with pytest.raises(kvserve.CorruptData, match="checksum"):
        kvserve.decode(bytes(bad))
    with pytest.raises(kvserve.InvalidArgument, match="5 dimensions|dimensions; expected"):
        kvserve.encode(kv[0], "none")
    with pytest.raises(kvserve.InvalidArgument, match="is not float16 or float32"):
        kvserve.encode(kv.astype(np.int32), "none")
    with pytest.raises(kvserve.InvalidArgument, match="decodes to 4x2x64x16, the destination view is 4x2x10x16"):
        kvserve.decode(frame, out=np.zeros((4, 2, 2, 10, 16), dtype=np.float16))
    ro = np.zeros_like(kv)
    ro.setflags(write=False)
    with pytest.raises(kvserve.InvalidArgument, match="read-only"):
        kvserve.decode(frame, out=ro)


def test_simd_tiers_give_the_same_frames():
    kv = kv_array(n_token=256, head_dim=128)
    best = kvserve.simd_tier()
    frames = {}
    try:
        for tier in ("baseline", "avx2", "avx512"):
            got = kvserve.set_simd_cap(tier)
            frames[got] = kvserve.encode(kv, "quant(kbits=4,vbits=4)|rans")
    finally:
        kvserve.set_simd_cap(best)
    assert kvserve.simd_tier() == best
    assert len(set(frames.values())) == 1, f"tiers {list(frames)} disagree"
    with pytest.raises(kvserve.InvalidArgument, match="'sse9' unknown"):
        kvserve.set_simd_cap("sse9")
