"""kvserve: KV-cache compression for disaggregated LLM serving.

    import numpy as np, kvserve
    kv = np.random.default_rng(0).standard_normal((4, 2, 8, 256, 128)).astype(np.float16)
    frame = kvserve.encode(kv, "quant(kbits=4,vbits=4)|rans")      # bytes, self-describing
    back = kvserve.decode(frame)                                     # numpy array, no copy
    d = kvserve.Controller("bench/profiles/default.json").decide(kv.nbytes, 10.0, 0.5, 0.97)
    print(d.strategy, d.explanation)

The codec, controller, pool, evaluator and transport are the C++ library's (``_kvserve``);
``KVConnector`` is the engine-facing connector built on them (docs/PYTHON.md).
"""

from ._kvserve import (  # noqa: F401
    Connection,
    Controller,
    CorruptData,
    Decision,
    Error,
    Evaluator,
    InvalidArgument,
    IoError,
    LayerAssembler,
    Listener,
    NotFound,
    OutOfRange,
    Pool,
    Unavailable,
    Unsupported,
    __version__,
    canonical_strategy,
    chunk_key,
    connect,
    decode,
    decode_paged,
    detected_simd_tier,
    encode,
    encode_layer,
    encode_layer_paged,
    encode_paged,
    frame_info,
    message,
    parse_strategy,
    prefix_chain_hashes,
    set_simd_cap,
    simd_tier,
    stages,
)
from .connector import KVConnector  # noqa: F401
