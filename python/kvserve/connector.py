"""A KV connector with the shape of the serving engines' connector interfaces.

An engine's prefill worker hands the connector one layer of a request's KV at a time
(``save_kv_layer``); the connector encodes it with the strategy the controller picks for the
live bandwidth, SLO and quality floor, and streams it over kvserve's TCP transport to the decode
worker, and/or stores the prompt's chunks in a KV pool under the serving nodes' keys. The decode
worker's connector decodes each arriving layer straight into the engine's cache array
(``start_load_kv`` / ``wait_for_layer_load``), or fetches the prefix the pool holds
(``num_matched_tokens``). docs/PYTHON.md maps each method to the vLLM V1 connector's.

Frames are verified on arrival; a frame that fails (checksum, shape, request) fails that
request's loads with the library's message instead of corrupting the cache.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple, Union

import numpy as np

from . import _kvserve as _k

__all__ = ["KVConnector"]


@dataclass
class _Save:
    """A request being saved (producer side)."""

    strategy: str
    decision: Optional[object]
    started: float
    layers: Dict[int, np.ndarray] = field(default_factory=dict)
    tokens: Optional[List[int]] = None
    block_table: Optional[List[int]] = None  # a paged cache: its pages, and the tokens they hold
    n_token: int = 0
    frame_bytes: int = 0
    busy_seconds: float = 0.0  # encoding and sending, layer by layer
    send_seconds: float = 0.0
    futures: List[Future] = field(default_factory=list)


@dataclass
class _Load:
    """A request being loaded (consumer side)."""

    assembler: Optional[object] = None
    pending: List[bytes] = field(default_factory=list)  # frames that came before start_load_kv
    error: Optional[BaseException] = None
    ended: bool = False
    pool_done: bool = False
    loaded_tokens: int = 0


class KVConnector:
    """Moves a request's KV layer by layer between prefill and decode workers, or via a pool.

    role: "producer" (prefill worker), "consumer" (decode worker) or "both".
    n_layer: layers of the model's KV.
    peer: "host:port" of the consumer a producer streams to (None: no streaming).
    listen: "host:port" a consumer listens on (port 0 picks a free one; see ``port``).
    pool: a ``kvserve.Pool``, or a pool URI ("embedded", "redis://host:port"), or None.
    strategy: the fixed strategy when no controller is given.
    controller: a ``kvserve.Controller``; each request's strategy is then its decision.
    model_id, chunk_tokens: pool key space (as the serving nodes use them).
    """

    def __init__(
        self,
        role: str,
        *,
        n_layer: int,
        peer: Optional[str] = None,
        listen: Optional[str] = None,
        pool: Union[None, str, "_k.Pool"] = None,
        strategy: str = "none",
        controller: Optional["_k.Controller"] = None,
        slo: float = 1.0,
        floor: float = 0.97,
        label: str = "chat",
        bandwidth_gbps: float = 10.0,
        model_id: str = "",
        chunk_tokens: int = 256,
        threads: int = 1,
        timeout_s: float = 30.0,
        shaper_gbps: float = 0.0,
    ) -> None:
        if role not in ("producer", "consumer", "both"):
            raise _k.InvalidArgument(f"role '{role}' is not producer, consumer or both")
        if n_layer <= 0:
            raise _k.InvalidArgument(f"n_layer {n_layer} must be > 0")
        self.role = role
        self.n_layer = n_layer
        self.strategy = _k.canonical_strategy(strategy)
        self.controller = controller
        self.slo, self.floor, self.label = slo, floor, label
        self.bandwidth_gbps = bandwidth_gbps  # estimate, updated from each finished transfer
        self.model_id, self.chunk_tokens = model_id, chunk_tokens
        self.threads, self.timeout_s = threads, timeout_s
        self.pool = _k.Pool(pool) if isinstance(pool, str) else pool
        self._lock = threading.Condition()
        self._saves: Dict[int, _Save] = {}
        self._loads: Dict[int, _Load] = {}
        self.saved_strategy: Dict[int, str] = {}  # request -> the strategy its layers went with
        self._finished_sending: Set[int] = set()
        self._finished_recving: Set[int] = set()
        self._closed = False
        # One sender: frames leave in the order layers were saved; encoding overlaps the engine's
        # next layer because the codec releases the GIL.
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-save")
        self._conn = None
        if peer is not None and role != "consumer":
            self._conn = _k.connect(peer, timeout_s, shaper_gbps)
        self._listener = None
        self._accepted: List[object] = []
        self._threads: List[threading.Thread] = []
        if listen is not None and role != "producer":
            self._listener = _k.Listener(listen)
            t = threading.Thread(target=self._accept_loop, name="kvserve-accept", daemon=True)
            t.start()
            self._threads.append(t)

    # ---- common -----------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        """The port a consumer listens on."""
        if self._listener is None:
            raise _k.InvalidArgument("this connector does not listen")
        return self._listener.port

    def close(self) -> None:
        """Stops listening, finishes pending saves and closes the connection."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify_all()
        self._encoder.shutdown(wait=True)
        if self._listener is not None:
            self._listener.close()
        if self._conn is not None:
            self._conn.close()
        for conn in list(self._accepted):
            conn.close()  # wakes its reader
        for t in self._threads:
            t.join(timeout=self.timeout_s)

    def __enter__(self) -> "KVConnector":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _strategies(self) -> List[str]:
        if self.controller is None:
            return [self.strategy]
        return [s["strategy"] for s in self.controller.strategies]

    # ---- producer -----------------------------------------------------------------------------------
    def save_kv_layer(
        self,
        request_id: int,
        layer: int,
        kv_layer: np.ndarray,
        *,
        tokens: Optional[Sequence[int]] = None,
        token_scores: Optional[Sequence[float]] = None,
        block_table: Optional[Sequence[int]] = None,
        n_token: Optional[int] = None,
    ) -> None:
        """Queues layer `layer` (an array (2, n_head_kv, n_token, head_dim)) of a request.

        With `block_table` and `n_token`, `kv_layer` is instead the layer of a paged cache in
        vLLM's layout, (2, num_blocks, block_size, n_head_kv, head_dim), read in place: the
        request's tokens are in the pages the table lists (the same table for every layer).
        The first layer saved fixes the request's strategy. With a peer, the layer's frame is
        encoded and sent in the background; with a pool and `tokens`, the prompt's full chunks are
        stored once every layer is saved. The array must stay unchanged until wait_for_save().
        """
        if (block_table is None) != (n_token is None):
            raise _k.InvalidArgument("block_table and n_token go together (a paged cache)")
        if self.role == "consumer":
            raise _k.InvalidArgument("a consumer connector does not save")
        if not 0 <= layer < self.n_layer:
            raise _k.InvalidArgument(f"layer {layer} is outside 0..{self.n_layer - 1}")
        with self._lock:
            s = self._saves.get(request_id)
            if s is None:
                s = self._begin_save(request_id, kv_layer, n_token)
                if block_table is not None:
                    s.block_table, s.n_token = list(block_table), int(n_token)
                self._saves[request_id] = s
                self.saved_strategy[request_id] = s.strategy
            if layer in s.layers:
                raise _k.InvalidArgument(f"layer {layer} of request {request_id} was already saved")
            s.layers[layer] = kv_layer
            if tokens is not None and s.tokens is None:
                s.tokens = list(tokens)
            last = len(s.layers) == self.n_layer
        scores = None if token_scores is None else list(token_scores)
        if self._conn is not None:
            s.futures.append(self._encoder.submit(self._send_layer, request_id, s, layer, kv_layer, scores, last))
        if last and self.pool is not None and s.tokens is not None:
            s.futures.append(self._encoder.submit(self._store_chunks, s))
        if last and self._conn is None:
            s.futures.append(self._encoder.submit(self._finish_save, request_id, s))

    def _begin_save(self, request_id: int, kv_layer: np.ndarray, n_token: Optional[int]) -> _Save:
        decision = None
        strategy = self.strategy
        if self.controller is not None:
            per_layer = kv_layer.size if n_token is None else 2 * n_token * kv_layer.shape[3] * kv_layer.shape[4]
            fp16_bytes = per_layer * 2 * self.n_layer
            decision = self.controller.decide(fp16_bytes, self.bandwidth_gbps, self.slo, self.floor, self.label)
            strategy = decision.strategy
        return _Save(strategy=strategy, decision=decision, started=time.monotonic())

    def _send_layer(self, request_id, s: _Save, layer, kv_layer, scores, last) -> None:
        t0 = time.monotonic()
        if s.block_table is not None:
            frame = _k.encode_layer_paged(kv_layer, s.block_table, s.n_token, s.strategy, layer, self.n_layer,
                                          request_id=request_id, threads=self.threads, token_scores=scores)
        else:
            frame = _k.encode_layer(kv_layer, s.strategy, layer, self.n_layer, request_id=request_id,
                                    threads=self.threads, token_scores=scores)
        t1 = time.monotonic()
        self._conn.send(_k.message.FRAME, frame, self.timeout_s)
        t2 = time.monotonic()
        s.frame_bytes += len(frame)
        s.send_seconds += t2 - t1
        s.busy_seconds += t2 - t0
        if last:
            end = json.dumps({"request_id": request_id, "n_layer": self.n_layer, "strategy": s.strategy})
            self._conn.send(_k.message.END, end.encode(), self.timeout_s)
            self._finish_save(request_id, s)

    def _finish_save(self, request_id: int, s: _Save) -> None:
        if s.send_seconds > 0 and s.frame_bytes >= (1 << 20):
            # The pace the link took the frames at (small transfers say more about latency than
            # bandwidth, and are left out), folded into the estimate the next decision uses.
            self.bandwidth_gbps = 0.7 * self.bandwidth_gbps + 0.3 * (s.frame_bytes * 8 / s.send_seconds / 1e9)
        if self.controller is not None and s.decision is not None and s.busy_seconds > 0:
            # What the decision cost this side: encoding and sending every layer (the engine's
            # own time between layers left out).
            self.controller.observe(s.decision, s.busy_seconds)
        with self._lock:
            self._finished_sending.add(request_id)
            self._lock.notify_all()

    def _store_chunks(self, s: _Save) -> None:
        if s.block_table is not None:
            return self._store_paged_chunks(s)
        kv = np.stack([s.layers[i] for i in range(self.n_layer)])
        chain = _k.prefix_chain_hashes(self.model_id, s.tokens, self.chunk_tokens)
        n_full = min(len(chain), kv.shape[3] // self.chunk_tokens)
        keys = [_k.chunk_key(self.model_id, chain, c, s.strategy, self.chunk_tokens) for c in range(n_full)]
        present = self.pool.exists(keys) if keys else []
        for c in range(n_full):
            if present[c]:
                continue
            t0 = c * self.chunk_tokens
            chunk = kv[:, :, :, t0:t0 + self.chunk_tokens]
            self.pool.put(keys[c], _k.encode(chunk, s.strategy, threads=self.threads, token_offset=t0))

    def _store_paged_chunks(self, s: _Save) -> None:
        # Each chunk encoded in place from its slice of the block table, into the frame the dense
        # path stores under the same key.
        layers = [s.layers[i] for i in range(self.n_layer)]
        per_chunk = self._pages_per_chunk(layers)
        chain = _k.prefix_chain_hashes(self.model_id, s.tokens, self.chunk_tokens)
        n_full = min(len(chain), s.n_token // self.chunk_tokens)
        keys = [_k.chunk_key(self.model_id, chain, c, s.strategy, self.chunk_tokens) for c in range(n_full)]
        present = self.pool.exists(keys) if keys else []
        for c in range(n_full):
            if not present[c]:
                table = s.block_table[c * per_chunk:(c + 1) * per_chunk]
                frame = _k.encode_paged(layers, table, self.chunk_tokens, s.strategy, threads=self.threads,
                                        token_offset=c * self.chunk_tokens)
                self.pool.put(keys[c], frame)

    def wait_for_save(self) -> None:
        """Blocks until every queued layer is sent and every chunk stored; raises the first error."""
        with self._lock:
            saves = list(self._saves.items())
        error = None
        for request_id, s in saves:
            for f in list(s.futures):
                try:
                    f.result(timeout=self.timeout_s)
                except BaseException as e:  # noqa: BLE001 - re-raised below, first one wins
                    error = error or e
            with self._lock:
                if len(s.layers) == self.n_layer:
                    self._saves.pop(request_id, None)
        if error is not None:
            raise error

    # ---- consumer -----------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
            try:
                conn = self._listener.accept(0.2)
            except _k.Unavailable:
                continue  # deadline passed or the listener closed: check _closed
            with self._lock:
                self._accepted.append(conn)
            t = threading.Thread(target=self._read_loop, args=(conn,), name="kvserve-recv", daemon=True)
            t.start()
            self._threads.append(t)

    def _read_loop(self, conn) -> None:
        # A receive that misses its deadline closes the connection, so the reader waits long and
        # close() wakes it by closing the connection.
        while True:
            try:
                kind, body = conn.receive(24 * 3600.0)
            except _k.Unavailable as e:
                with self._lock:
                    if self._closed:
                        return
                self._fail_open_loads(e)  # the producer went away mid-request
                return
            if kind == _k.message.FRAME:
                self._on_frame(body)
            elif kind == _k.message.END:
                rid = json.loads(body.decode())["request_id"]
                with self._lock:
                    self._loads.setdefault(rid, _Load()).ended = True
                    self._lock.notify_all()

    def _fail_open_loads(self, error: BaseException) -> None:
        with self._lock:
            for load in self._loads.values():
                if not load.ended and load.error is None:
                    load.error = error
            self._lock.notify_all()

    def _on_frame(self, frame: bytes) -> None:
        try:
            rid = _k.frame_info(frame)["request_id"]
        except _k.Error as e:
            self._fail_open_loads(e)  # unattributable: every open request may be missing it
            return
        with self._lock:
            load = self._loads.setdefault(rid, _Load())
            assembler = load.assembler
            if assembler is None:
                load.pending.append(frame)
                return
        self._add(load, assembler, frame)

    def _add(self, load: _Load, assembler, frame: bytes) -> None:
        try:
            assembler.add(frame, self.threads)
        except _k.Error as e:
            load.error = load.error or e
        with self._lock:
            self._lock.notify_all()

    def num_matched_tokens(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of a prompt the pool holds, in whole chunks, under any strategy."""
        if self.pool is None:
            return 0
        chain = _k.prefix_chain_hashes(self.model_id, list(tokens), self.chunk_tokens)
        return self._matched_chunks(chain, len(chain))[0] * self.chunk_tokens

    def _matched_chunks(self, chain: List[str], limit: int) -> Tuple[int, str]:
        """(leading chunks of `chain` the pool holds, up to `limit`; the strategy holding most)."""
        best: Tuple[int, str] = (0, self.strategy)
        for strategy in self._strategies():
            keys = [_k.chunk_key(self.model_id, chain, c, strategy, self.chunk_tokens) for c in range(limit)]
            present = self.pool.exists(keys) if keys else []
            n = 0
            while n < len(present) and present[n]:
                n += 1
            best = max(best, (n, strategy))
        return best

    def start_load_kv(
        self,
        request_id: int,
        kv_cache,
        *,
        tokens: Optional[Sequence[int]] = None,
        block_table: Optional[Sequence[int]] = None,
        n_token: Optional[int] = None,
    ) -> int:
        """Starts filling `kv_cache` (n_layer, 2, n_head_kv, n_token, head_dim) for a request.

        With `block_table`, `kv_cache` is instead a paged cache in vLLM's layout (a list of
        per-layer arrays (2, num_blocks, block_size, n_head_kv, head_dim)) written in place: the
        request's n_token tokens go to the pages the table lists (from the pool: as many as it
        holds). With `tokens` and a pool, the prefix the pool holds is decoded into the cache's
        first tokens (in place, chunk by chunk) and its length returned. Otherwise the request's
        layers come from the producer and are decoded into the cache as they arrive; returns 0.
        """
        if self.role == "producer":
            raise _k.InvalidArgument("a producer connector does not load")
        if tokens is not None and self.pool is not None:
            if block_table is not None:
                return self._load_paged_from_pool(request_id, kv_cache, list(block_table), list(tokens))
            return self._load_from_pool(request_id, kv_cache, list(tokens))
        if block_table is not None:
            if n_token is None:
                raise _k.InvalidArgument("a paged load from the producer needs n_token")
            assembler = _k.LayerAssembler(request_id, list(kv_cache), block_table=list(block_table), n_token=n_token)
        else:
            assembler = _k.LayerAssembler(request_id, kv_cache)
        with self._lock:
            load = self._loads.setdefault(request_id, _Load())
            load.assembler = assembler
            pending, load.pending = load.pending, []
        for frame in pending:
            self._add(load, assembler, frame)
        return 0

    def _load_from_pool(self, request_id: int, kv_cache: np.ndarray, tokens: List[int]) -> int:
        def decode(c: int, frame: bytes) -> None:
            t0 = c * self.chunk_tokens
            _k.decode(frame, out=kv_cache[:, :, :, t0:t0 + self.chunk_tokens], threads=self.threads)

        return self._load_chunks(request_id, tokens, kv_cache.shape[3] // self.chunk_tokens, decode)

    def _pages_per_chunk(self, layers) -> int:
        """Pages of a pool chunk: a chunk is whole pages of the paged cache."""
        block_size = layers[0].shape[2]
        if self.chunk_tokens % block_size:
            raise _k.InvalidArgument(f"chunk_tokens {self.chunk_tokens} is not a multiple of block_size {block_size}")
        return self.chunk_tokens // block_size

    def _load_paged_from_pool(self, request_id: int, layers, block_table: List[int], tokens: List[int]) -> int:
        per_chunk = self._pages_per_chunk(layers)

        def decode(c: int, frame: bytes) -> None:
            _k.decode_paged(frame, layers, block_table[c * per_chunk:(c + 1) * per_chunk], threads=self.threads)

        return self._load_chunks(request_id, tokens, len(block_table) // per_chunk, decode)

    def _load_chunks(self, request_id: int, tokens: List[int], room: int, decode) -> int:
        """Decodes the prompt's leading chunks the pool holds (at most `room`) with decode(c, frame)."""
        chain = _k.prefix_chain_hashes(self.model_id, tokens, self.chunk_tokens)
        n, strategy = self._matched_chunks(chain, min(len(chain), room))
        keys = [_k.chunk_key(self.model_id, chain, c, strategy, self.chunk_tokens) for c in range(n)]
        frames = self.pool.get_many(keys) if keys else []
        loaded = 0
        for c, frame in enumerate(frames):
            if frame is None:
                break  # evicted since the lookup: the engine recomputes the rest
            decode(c, frame)
            loaded = (c + 1) * self.chunk_tokens
        with self._lock:
            load = self._loads.setdefault(request_id, _Load())
            load.pool_done, load.loaded_tokens = True, loaded
            self._finished_recving.add(request_id)
            self._lock.notify_all()
        return loaded

    def wait_for_layer_load(self, request_id: int, layer: int, timeout_s: Optional[float] = None) -> None:
        """Blocks until layer `layer` of the request is in its cache; raises the request's error."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        with self._lock:
            while True:
                load = self._loads.get(request_id)
                if load is not None:
                    if load.error is not None:
                        raise load.error
                    if load.pool_done:
                        return
                    if load.assembler is not None and load.assembler.has_layer(layer):
                        if load.assembler.complete:
                            self._finished_recving.add(request_id)
                        return
                    if load.ended and load.assembler is not None and not load.pending and load.assembler.complete:
                        return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _k.Unavailable(f"layer {layer} of request {request_id} did not arrive within the timeout")
                if self._closed:
                    raise _k.Unavailable("connector closed")
                self._lock.wait(min(left, 0.2))

    def wait_for_load(self, request_id: int, timeout_s: Optional[float] = None) -> None:
        """Blocks until every layer of the request is in its cache."""
        for layer in range(self.n_layer):
            self.wait_for_layer_load(request_id, layer, timeout_s)

    # ---- both -------------------------------------------------------------------------------------------
    def get_finished(self) -> Tuple[Set[int], Set[int]]:
        """(requests whose saves finished, requests whose loads finished) since the last call."""
        with self._lock:
            sending, self._finished_sending = self._finished_sending, set()
            recving, self._finished_recving = self._finished_recving, set()
        return sending, recving

    def request_finished(self, request_id: int) -> None:
        """Forgets a request's state (the engine freed its cache)."""
        with self._lock:
            self._loads.pop(request_id, None)
            self._saves.pop(request_id, None)
            self.saved_strategy.pop(request_id, None)
