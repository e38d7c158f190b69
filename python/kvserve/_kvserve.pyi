"""Type stubs of the compiled kvserve module (python/_kvserve.cc)."""

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt

__version__: str

Buffer = Union[bytes, bytearray, memoryview]
KvArray = npt.NDArray[Any]  # float16, float32, uint16 holding bf16, or uint8 holding e4m3/e5m2
# An FP8 cache's scales (value = code * scale): (n_layer, 2) per tensor or (n_layer, 2, n_head_kv) per head.
Scales = npt.ArrayLike

class Error(RuntimeError):
    """Base of every kvserve error; the message is the library's."""

class InvalidArgument(Error, ValueError): ...
class CorruptData(Error): ...
class Unsupported(Error): ...
class NotFound(Error, LookupError): ...
class IoError(Error, OSError): ...
class OutOfRange(Error, ValueError): ...
class Unavailable(Error, ConnectionError): ...

def simd_tier() -> str: ...
def detected_simd_tier() -> str: ...
def set_simd_cap(tier: str) -> str: ...
def canonical_strategy(strategy: str) -> str: ...
def parse_strategy(strategy: str) -> List[Tuple[str, Dict[str, str]]]: ...
def stages() -> List[Dict[str, Any]]: ...
def encode(
    kv: KvArray,
    strategy: str,
    *,
    layers: Optional[Tuple[int, int]] = None,
    request_id: int = 0,
    threads: int = 1,
    dtype: Optional[str] = None,
    token_scores: Optional[Sequence[float]] = None,
    token_offset: int = 0,
    scales: Optional[Scales] = None,
) -> bytes: ...
def encode_layer(
    kv_layer: KvArray,
    strategy: str,
    layer: int,
    n_layer: int,
    *,
    request_id: int = 0,
    threads: int = 1,
    dtype: Optional[str] = None,
    token_scores: Optional[Sequence[float]] = None,
    token_offset: int = 0,
    scales: Optional[Scales] = None,
) -> bytes: ...
def decode(
    frame: Buffer,
    *,
    out: Optional[KvArray] = None,
    threads: int = 1,
    dtype: Optional[str] = None,
    scales: Optional[Scales] = None,
) -> KvArray: ...
def encode_paged(
    layers: Sequence[KvArray],
    block_table: Sequence[int],
    n_token: int,
    strategy: str,
    *,
    request_id: int = 0,
    threads: int = 1,
    dtype: Optional[str] = None,
    token_offset: int = 0,
    scales: Optional[Scales] = None,
) -> bytes: ...
def encode_layer_paged(
    kv_layer: KvArray,
    block_table: Sequence[int],
    n_token: int,
    strategy: str,
    layer: int,
    n_layer: int,
    *,
    request_id: int = 0,
    threads: int = 1,
    dtype: Optional[str] = None,
    token_scores: Optional[Sequence[float]] = None,
    token_offset: int = 0,
    scales: Optional[Scales] = None,
) -> bytes: ...
def decode_paged(
    frame: Buffer,
    layers: Sequence[KvArray],
    block_table: Sequence[int],
    *,
    threads: int = 1,
    dtype: Optional[str] = None,
    scales: Optional[Scales] = None,
) -> None: ...
def frame_info(frame: Buffer) -> Dict[str, Any]: ...

class LayerAssembler:
    def __init__(
        self,
        request_id: int,
        out: Union[KvArray, Sequence[KvArray]],
        dtype: Optional[str] = None,
        *,
        block_table: Optional[Sequence[int]] = None,
        n_token: Optional[int] = None,
        scales: Optional[Scales] = None,
    ) -> None: ...
    def add(self, frame: Buffer, threads: int = 1) -> None: ...
    @property
    def complete(self) -> bool: ...
    @property
    def layers_done(self) -> int: ...
    def has_layer(self, layer: int) -> bool: ...
    @property
    def positions(self) -> List[int]: ...
    @property
    def token_offset(self) -> int: ...
    @property
    def out(self) -> Union[KvArray, Sequence[KvArray]]: ...

class Decision:
    strategy: str
    name: str
    explanation: str
    @property
    def index(self) -> int: ...
    @property
    def predicted_seconds(self) -> float: ...
    @property
    def meets_slo(self) -> bool: ...
    @property
    def explored(self) -> bool: ...
    @property
    def floor(self) -> float: ...
    @property
    def candidates(self) -> List[Dict[str, Any]]: ...

class Controller:
    def __init__(self, profile: str, *, pipelined: bool = False, n_layer: int = 32, bandit: bool = False, seed: int = 1) -> None: ...
    @staticmethod
    def from_strategies(
        strategies: Sequence[Dict[str, Any]], *, pipelined: bool = False, n_layer: int = 32, bandit: bool = False, seed: int = 1
    ) -> "Controller": ...
    def decide(
        self,
        kv_bytes: float,
        bandwidth_gbps: float,
        slo: float,
        floor: float = 0.97,
        label: str = "chat",
        *,
        model_seconds: float = 0.0,
        confidence: float = 1.0,
        prompt_tokens: int = 0,
    ) -> Decision: ...
    def observe(
        self, decision: Decision, observed_seconds: float, *, encode_seconds: float = 0.0, decode_seconds: float = 0.0
    ) -> None: ...
    @property
    def strategies(self) -> List[Dict[str, Any]]: ...

class Connection:
    def send(self, kind: int, body: Buffer, timeout_s: float = 30.0) -> None: ...
    def receive(self, timeout_s: float = 30.0) -> Tuple[int, bytes]: ...
    def close(self) -> None: ...
    @property
    def peer(self) -> str: ...

class Listener:
    def __init__(self, address: str = "127.0.0.1:0", shaper_gbps: float = 0.0) -> None: ...
    def accept(self, timeout_s: float = 30.0) -> Connection: ...
    @property
    def port(self) -> int: ...
    def close(self) -> None: ...

def connect(address: str, timeout_s: float = 10.0, shaper_gbps: float = 0.0) -> Connection: ...

class message:
    REQUEST: int
    FRAME: int
    END: int
    RESEND: int
    RESULT: int
    ERROR: int

class Pool:
    def __init__(self, uri: str = "embedded", capacity_bytes: int = ...) -> None: ...
    def put(self, key: str, value: Buffer) -> None: ...
    def get(self, key: str) -> Optional[bytes]: ...
    def get_many(self, keys: Sequence[str]) -> List[Optional[bytes]]: ...
    def exists(self, keys: Sequence[str]) -> List[bool]: ...
    def delete(self, key: str) -> None: ...
    def clear(self) -> None: ...
    def stats(self) -> Dict[str, int]: ...
    @property
    def name(self) -> str: ...

def prefix_chain_hashes(model_id: str, tokens: Sequence[int], chunk_tokens: int = 256, placement: str = "prefix") -> List[str]: ...
def chunk_key(
    model_id: str, chain: Sequence[str], chunk: int, strategy: str, chunk_tokens: int = 256, placement: str = "prefix"
) -> str: ...

class Evaluator:
    def __init__(
        self,
        model: str = "stories260K",
        *,
        models_dir: Optional[str] = None,
        cache_dir: Optional[str] = None,
        contexts: int = 0,
        prompt_len: int = 0,
        seed: int = 1,
        threads: int = 1,
    ) -> None: ...
    def evaluate(self, strategy: str) -> Dict[str, Any]: ...
    @property
    def model(self) -> str: ...
    @property
    def prompt_len(self) -> int: ...
    def prompt_kv(self, context: int) -> npt.NDArray[np.float16]: ...
