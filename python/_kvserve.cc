// The `kvserve` Python module (pybind11): strategies, frames to and from numpy arrays without
// copies where the layout allows, the controller, the KV pool, the evaluator and the TCP
// transport, each a thin layer over the public C++ API. Status errors become exceptions of a
// small hierarchy (kvserve.Error and one subclass per status code) carrying the library's
// message; long calls release the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kvserve/calib.h"
#include "kvserve/codec.h"
#include "kvserve/controller.h"
#include "kvserve/cpu.h"
#include "kvserve/eval.h"
#include "kvserve/frame.h"
#include "kvserve/kv.h"
#include "kvserve/model.h"
#include "kvserve/pool.h"
#include "kvserve/profile.h"
#include "kvserve/status.h"
#include "kvserve/thread_pool.h"
#include "kvserve/transport.h"

namespace py = pybind11;

namespace kvserve::python {
namespace {

// ---- Errors ---------------------------------------------------------------------------------------
struct StatusError {
  Status status;
};

[[noreturn]] void Throw(Status st) { throw StatusError{std::move(st)}; }
void Check(Status st) {
  if (!st.ok()) Throw(std::move(st));
}
template <typename T>
T Unwrap(Result<T> r) {
  if (!r.ok()) Throw(r.status());
  return std::move(*r);
}

// Exception class per status code, created at import.
PyObject* g_exceptions[16] = {};

void RegisterExceptions(py::module_& m) {
  auto make = [&](const char* name, StatusCode code, py::tuple bases, const char* doc) {
    const std::string full = std::string("kvserve.") + name;
    PyObject* e = PyErr_NewExceptionWithDoc(full.c_str(), doc, bases.ptr(), nullptr);
    if (e == nullptr) throw py::error_already_set();
    m.attr(name) = py::handle(e);
    g_exceptions[static_cast<int>(code)] = e;
    return py::handle(e);
  };
  py::handle base = make("Error", StatusCode::kInternal, py::make_tuple(py::handle(PyExc_RuntimeError)),
                         "Base of every kvserve error; the message is the library's.");
  auto sub = [&](const char* name, StatusCode code, PyObject* also, const char* doc) {
    make(name, code, also ? py::make_tuple(base, py::handle(also)) : py::make_tuple(base), doc);
  };
  sub("InvalidArgument", StatusCode::kInvalidArgument, PyExc_ValueError,
      "A malformed argument: a spec, a shape, a name.");
  sub("CorruptData", StatusCode::kCorrupt, nullptr, "Bytes that fail verification: checksum, length, magic.");
  sub("Unsupported", StatusCode::kUnsupported, nullptr, "Well formed but not handled by this build.");
  sub("NotFound", StatusCode::kNotFound, PyExc_LookupError, "A file, key or stage that does not exist.");
  sub("IoError", StatusCode::kIoError, PyExc_OSError, "The operating system refused (open, read, socket).");
  sub("OutOfRange", StatusCode::kOutOfRange, PyExc_ValueError, "A value beyond a configured limit.");
  sub("Unavailable", StatusCode::kUnavailable, PyExc_ConnectionError,
      "A peer is unreachable, closed or missed its deadline.");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      PyObject* cls = g_exceptions[static_cast<int>(e.status.code())];
      if (cls == nullptr) cls = g_exceptions[static_cast<int>(StatusCode::kInternal)];
      PyErr_SetString(cls, e.status.message().c_str());
    }
  });
}

// ---- Arrays <-> KV blocks ---------------------------------------------------------------------------
DType DTypeOfArray(const py::array& a, const std::optional<std::string>& dtype) {
  if (dtype) {
    DType want = Unwrap(ParseDType(*dtype));
    const char kind = a.dtype().kind();
    const size_t item = size_t(a.itemsize());
    const bool fits = (want == DType::kF32 && kind == 'f' && item == 4) ||
                      (want == DType::kF16 && kind == 'f' && item == 2) ||
                      (want == DType::kBF16 && (kind == 'u' || kind == 'V' || kind == 'f') && item == 2) ||
                      // FP8: uint8 arrays with the dtype named, or ml_dtypes' float8 types (kind 'V').
                      ((want == DType::kE4M3 || want == DType::kE5M2) && (kind == 'u' || kind == 'V') && item == 1);
    if (!fits) {
      Throw(Status::InvalidArgument("array dtype " + std::string(py::str(a.dtype())) + " does not hold " + *dtype));
    }
    return want;
  }
  if (a.dtype().is(py::dtype::of<float>())) return DType::kF32;
  if (a.dtype().kind() == 'f' && a.itemsize() == 2) return DType::kF16;
  // ml_dtypes' FP8 types name themselves (their numpy kind is 'V').
  const std::string name = py::str(a.dtype());
  if (name == "float8_e4m3fn") return DType::kE4M3;
  if (name == "float8_e5m2") return DType::kE5M2;
  Throw(Status::InvalidArgument("array dtype " + std::string(py::str(a.dtype())) +
                                " is not float16 or float32 (bf16: a uint16 array with dtype='bf16'; FP8: a uint8 array with "
                                "dtype='e4m3' or 'e5m2')"));
}

// A view over the array's memory when its layout is the KV layout: [layer][K|V][head] slabs of
// dense [token][dim] rows, slabs a fixed stride apart (C-contiguous, or a token slice of a larger
// cache such as cache[:, :, :, :n]). Empty when it is not.
std::optional<KvBlock> ViewOfArray(const py::array& a, DType dt, bool one_layer) {
  const int want_ndim = one_layer ? 4 : 5;
  if (a.ndim() != want_ndim) {
    Throw(Status::InvalidArgument(
        std::string("array has ") + std::to_string(a.ndim()) + " dimensions; expected " +
        (one_layer ? "(2, n_head_kv, n_token, head_dim)" : "(n_layer, 2, n_head_kv, n_token, head_dim)")));
  }
  const int o = one_layer ? 0 : 1;  // index of the K|V axis
  if (a.shape(o) != 2) {
    Throw(Status::InvalidArgument("axis " + std::to_string(o) + " (K|V) has size " + std::to_string(a.shape(o)) +
                                  "; expected 2"));
  }
  KvShape shape{one_layer ? 1u : uint32_t(a.shape(0)), uint32_t(a.shape(o + 1)), uint32_t(a.shape(o + 2)),
                uint32_t(a.shape(o + 3))};
  Check(shape.Validate());
  const ssize_t item = a.itemsize();
  const ssize_t D = a.shape(o + 3), T = a.shape(o + 2), H = a.shape(o + 1);
  const ssize_t s_dim = a.strides(o + 3), s_tok = a.strides(o + 2), s_head = a.strides(o + 1), s_part = a.strides(o);
  const bool rows_dense = s_dim == item && (T <= 1 || s_tok == D * item);
  const bool slabs_even = s_head > 0 && s_head % item == 0 && s_head >= T * D * item && s_part == H * s_head &&
                          (one_layer || shape.n_layer <= 1 || a.strides(0) == 2 * s_part);
  if (!rows_dense || !slabs_even) return std::nullopt;
  return Unwrap(KvBlock::View(shape, dt, const_cast<void*>(a.data()), uint64_t(s_head / item)));
}

py::dtype NumpyDType(DType dt) {
  switch (dt) {
    case DType::kF32:
      return py::dtype::of<float>();
    case DType::kF16:
      return py::dtype("float16");
    case DType::kBF16:
      return py::dtype::of<uint16_t>();
    case DType::kE4M3:
    case DType::kE5M2:
      return py::dtype::of<uint8_t>();
  }
  return py::dtype::of<float>();
}

// Hands an owning block to numpy without a copy: the array's base is a capsule that owns it.
py::array ArrayOfBlock(KvBlock&& block) {
  auto* owner = new KvBlock(std::move(block));
  py::capsule cap(owner, [](void* p) { delete static_cast<KvBlock*>(p); });
  const KvShape& s = owner->shape();
  const ssize_t item = ssize_t(DTypeSize(owner->dtype()));
  std::vector<ssize_t> shape = {ssize_t(s.n_layer), 2, ssize_t(s.n_head_kv), ssize_t(s.n_token), ssize_t(s.head_dim)};
  std::vector<ssize_t> strides(5);
  strides[4] = item;
  strides[3] = item * shape[4];
  strides[2] = strides[3] * shape[3];
  strides[1] = strides[2] * shape[2];
  strides[0] = strides[1] * 2;
  return py::array(NumpyDType(owner->dtype()), shape, strides, owner->data(), cap);
}

ThreadPool* PoolFor(int threads) {
  if (threads <= 1) return nullptr;
  static std::mutex mu;
  static std::map<int, std::unique_ptr<ThreadPool>> pools;
  std::lock_guard<std::mutex> lock(mu);
  auto& p = pools[threads];
  if (!p) p = std::make_unique<ThreadPool>(threads);
  return p.get();
}

std::string EnvOr(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

// Where models and calibration live when the caller does not say: $KVSERVE_MODELS, the source
// tree of this build, or the installed data folder.
std::string DefaultModelsDir() {
  if (const char* v = std::getenv("KVSERVE_MODELS"); v && *v) return v;
  const std::string source = std::string(KVSERVE_SOURCE_DIR) + "/models";
  if (std::filesystem::exists(source)) return source;
  return std::string(KVSERVE_DATA_DIR) + "/models";
}

// Calibration (lowrank bases) as the CLI finds it: $KVSERVE_CALIB, $KVSERVE_CACHE/calib, or the
// source tree's cache.
const CodecEnv& DefaultCodecEnv() {
  static CalibrationStore store(
      EnvOr("KVSERVE_CALIB", EnvOr("KVSERVE_CACHE", std::string(KVSERVE_SOURCE_DIR) + "/.kvserve-cache") + "/calib"));
  static const CodecEnv env{&store};
  return env;
}

struct Buffer {
  py::buffer_info info;
  std::span<const uint8_t> bytes() const {
    return {static_cast<const uint8_t*>(info.ptr), size_t(info.size * info.itemsize)};
  }
};
Buffer BytesOf(const py::buffer& b) {
  py::buffer_info info = b.request();
  if (info.ndim > 1 && info.strides.back() != info.itemsize)
    Throw(Status::InvalidArgument("frame buffer is not contiguous"));
  return Buffer{std::move(info)};
}

py::bytes ToBytes(const ByteBuffer& b) { return py::bytes(reinterpret_cast<const char*>(b.data()), b.size()); }

// ---- Codec ------------------------------------------------------------------------------------------
struct PipelineCache {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<Pipeline>> by_spec;
  std::shared_ptr<Pipeline> Get(const std::string& spec) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = by_spec.find(spec);
    if (it != by_spec.end()) return it->second;
    auto p = std::make_shared<Pipeline>(Unwrap(Pipeline::Create(spec, DefaultCodecEnv())));
    by_spec.emplace(spec, p);
    return p;
  }
};
PipelineCache& Pipelines() {
  static PipelineCache cache;
  return cache;
}

// The array as a block: its own memory when the layout allows, else a dense copy.
KvBlock BlockOfArray(const py::array& kv, const std::optional<std::string>& dtype, bool one_layer, py::array* keep) {
  const DType dt = DTypeOfArray(kv, dtype);
  if (auto view = ViewOfArray(kv, dt, one_layer)) {
    *keep = kv;
    return std::move(*view);
  }
  *keep = py::array::ensure(kv, py::array::c_style);
  return *ViewOfArray(*keep, dt, one_layer);
}

// An engine's FP8 scales for a block of `shape`, from a float array: 2 * n_layer values (one per
// layer and K/V, vLLM's k_scale/v_scale) or one per (layer, K/V, head), in that order.
using ScalesArg = std::optional<py::array_t<float, py::array::c_style | py::array::forcecast>>;
Fp8Scales ScalesOfArray(const ScalesArg& a, const KvShape& shape) {
  Fp8Scales s;
  if (!a) return s;
  const uint64_t n = uint64_t(a->size());
  if (n == Fp8Scales::Count(Fp8Scales::Granularity::kTensor, shape)) s.granularity = Fp8Scales::Granularity::kTensor;
  else if (n == Fp8Scales::Count(Fp8Scales::Granularity::kHead, shape)) s.granularity = Fp8Scales::Granularity::kHead;
  else {
    Throw(Status::InvalidArgument("scales hold " + std::to_string(n) + " values; shape " + shape.ToString() + " takes " +
                                  std::to_string(Fp8Scales::Count(Fp8Scales::Granularity::kTensor, shape)) +
                                  " (per layer and K/V) or " +
                                  std::to_string(Fp8Scales::Count(Fp8Scales::Granularity::kHead, shape)) + " (per head)"));
  }
  s.scale.assign(a->data(), a->data() + n);
  return s;
}
void SetScales(KvBlock& block, const ScalesArg& a) {
  if (a) Check(block.set_fp8_scales(ScalesOfArray(a, block.shape())));
}

// What encode and encode_layer share: the array as a block, the cached pipeline, the options,
// and `run` (one of Pipeline's encoders) without the GIL.
struct EncodeArgs {
  uint64_t request_id = 0;
  int threads = 1;
  std::optional<std::string> dtype;
  std::optional<std::vector<float>> scores;
  uint32_t token_offset = 0;
  ScalesArg scales;
};
template <typename Run>
py::bytes EncodeBlock(KvBlock& block, const std::string& strategy, const EncodeArgs& a, Run run) {
  block.set_token_offset(a.token_offset);
  SetScales(block, a.scales);
  auto pipeline = Pipelines().Get(strategy);
  ByteBuffer frame;
  CodecOptions o;
  o.pool = PoolFor(a.threads);
  o.request_id = a.request_id;
  if (a.scores) o.token_scores = &*a.scores;
  {
    py::gil_scoped_release release;
    Check(run(*pipeline, block, &frame, o));
  }
  return ToBytes(frame);
}
template <typename Run>
py::bytes EncodeArray(const py::array& kv, bool one_layer, const std::string& strategy, const EncodeArgs& a, Run run) {
  py::array keep;
  KvBlock block = BlockOfArray(kv, a.dtype, one_layer, &keep);
  return EncodeBlock(block, strategy, a, run);
}

py::bytes Encode(const py::array& kv, const std::string& strategy, std::optional<std::pair<uint32_t, uint32_t>> layers,
                 uint64_t request_id, int threads, std::optional<std::string> dtype,
                 std::optional<std::vector<float>> scores, uint32_t token_offset, ScalesArg scales) {
  return EncodeArray(kv, false, strategy, {request_id, threads, dtype, scores, token_offset, scales},
                     [&](const Pipeline& p, const KvBlock& b, ByteBuffer* f, const CodecOptions& o) {
                       return layers ? p.EncodeLayers(b, layers->first, layers->second, f, o) : p.Encode(b, f, o);
                     });
}

py::bytes EncodeLayer(const py::array& kv_layer, const std::string& strategy, uint32_t layer, uint32_t n_layer,
                      uint64_t request_id, int threads, std::optional<std::string> dtype,
                      std::optional<std::vector<float>> scores, uint32_t token_offset, ScalesArg scales) {
  return EncodeArray(kv_layer, true, strategy, {request_id, threads, dtype, scores, token_offset, scales},
                     [&](const Pipeline& p, const KvBlock& b, ByteBuffer* f, const CodecOptions& o) {
                       return p.EncodeLayerSlice(b, layer, n_layer, f, o);
                     });
}

py::object Decode(const py::buffer& frame, std::optional<py::array> out, int threads,
                  std::optional<std::string> dtype, ScalesArg scales) {
  Buffer buf = BytesOf(frame);
  CodecOptions o;
  o.pool = PoolFor(threads);
  if (out) {
    if (!out->writeable()) Throw(Status::InvalidArgument("out is read-only"));
    const DType dt = DTypeOfArray(*out, dtype);
    auto view = ViewOfArray(*out, dt, false);
    if (!view) {
      Throw(
          Status::InvalidArgument("out must be C-contiguous (n_layer, 2, n_head_kv, n_token, head_dim), or a token "
                                  "slice of such an array, to be decoded into in place"));
    }
    SetScales(*view, scales);
    {
      py::gil_scoped_release release;
      Check(DecodeKv(buf.bytes(), &*view, o, DefaultCodecEnv()));
    }
    return *out;
  }
  KvBlock block;
  {
    py::gil_scoped_release release;
    Check(DecodeKv(buf.bytes(), &block, o, DefaultCodecEnv()));
    if (dtype) {
      const DType want = Unwrap(ParseDType(*dtype));
      if (want != block.dtype()) block = Unwrap(block.ConvertTo(want));
    }
  }
  return ArrayOfBlock(std::move(block));
}

// A vLLM-style paged cache as a block, no copy: `layers` holds one C-contiguous array per layer,
// (2, num_blocks, block_size, n_head_kv, head_dim); the sequence's n_token tokens sit in the pages
// `block_table` lists, block_size tokens each.
KvBlock PagedOfArrays(const std::vector<py::array>& layers, const std::vector<uint32_t>& block_table, uint32_t n_token,
                      const std::optional<std::string>& dtype, bool write) {
  if (layers.empty()) Throw(Status::InvalidArgument("paged cache has no layers"));
  const py::array& a0 = layers[0];
  const DType dt = DTypeOfArray(a0, dtype);
  if (a0.ndim() != 5 || a0.shape(0) != 2) {
    Throw(Status::InvalidArgument("paged layer arrays must be (2, num_blocks, block_size, n_head_kv, head_dim)"));
  }
  KvPages p;
  p.num_blocks = uint32_t(a0.shape(1));
  p.block_size = uint32_t(a0.shape(2));
  p.part_stride = uint64_t(a0.shape(1)) * a0.shape(2) * a0.shape(3) * a0.shape(4);
  p.block_table = block_table;
  for (size_t l = 0; l < layers.size(); ++l) {
    const py::array& a = layers[l];
    bool same = a.ndim() == 5;
    for (int d = 0; same && d < 5; ++d) same = a.shape(d) == a0.shape(d);
    if (!same || !a.dtype().is(a0.dtype())) {
      Throw(Status::InvalidArgument("paged layer " + std::to_string(l) + " differs in shape or dtype from layer 0"));
    }
    if (!(a.flags() & py::array::c_style)) Throw(Status::InvalidArgument("paged layer " + std::to_string(l) + " is not C-contiguous"));
    if (write && !a.writeable()) Throw(Status::InvalidArgument("paged layer " + std::to_string(l) + " is read-only"));
    p.layer_base.push_back(static_cast<uint8_t*>(const_cast<void*>(a.data())));
  }
  const KvShape shape{uint32_t(layers.size()), uint32_t(a0.shape(3)), n_token, uint32_t(a0.shape(4))};
  return Unwrap(KvBlock::PagedView(shape, dt, std::move(p)));
}

py::bytes EncodePaged(const std::vector<py::array>& layers, const std::vector<uint32_t>& block_table, uint32_t n_token,
                      const std::string& strategy, uint64_t request_id, int threads, std::optional<std::string> dtype,
                      uint32_t token_offset, ScalesArg scales) {
  KvBlock block = PagedOfArrays(layers, block_table, n_token, dtype, false);
  return EncodeBlock(block, strategy, {request_id, threads, dtype, std::nullopt, token_offset, scales},
                     [](const Pipeline& p, const KvBlock& b, ByteBuffer* f, const CodecOptions& o) { return p.Encode(b, f, o); });
}

py::bytes EncodeLayerPaged(const py::array& kv_layer, const std::vector<uint32_t>& block_table, uint32_t n_token,
                           const std::string& strategy, uint32_t layer, uint32_t n_layer, uint64_t request_id, int threads,
                           std::optional<std::string> dtype, std::optional<std::vector<float>> scores,
                           uint32_t token_offset, ScalesArg scales) {
  KvBlock block = PagedOfArrays({kv_layer}, block_table, n_token, dtype, false);
  return EncodeBlock(block, strategy, {request_id, threads, dtype, scores, token_offset, scales},
                     [&](const Pipeline& p, const KvBlock& b, ByteBuffer* f, const CodecOptions& o) {
                       return p.EncodeLayerSlice(b, layer, n_layer, f, o);
                     });
}

void DecodePaged(const py::buffer& frame, const std::vector<py::array>& layers, const std::vector<uint32_t>& block_table,
                 int threads, std::optional<std::string> dtype, ScalesArg scales) {
  Buffer buf = BytesOf(frame);
  FrameView v = Unwrap(ParseFrame(buf.bytes()));
  KvBlock block = PagedOfArrays(layers, block_table, v.header.shape.n_token, dtype, true);
  SetScales(block, scales);
  CodecOptions o;
  o.pool = PoolFor(threads);
  py::gil_scoped_release release;
  Check(DecodeKv(buf.bytes(), &block, o, DefaultCodecEnv()));
}

py::dict FrameInfo(const py::buffer& frame) {
  Buffer buf = BytesOf(frame);
  FrameView v = Unwrap(ParseFrame(buf.bytes()));
  const FrameHeader& h = v.header;
  py::dict d;
  d["version"] = h.version;
  d["strategy"] = h.spec;
  d["dtype"] = DTypeName(h.dtype);
  d["shape"] = py::make_tuple(h.shape.n_layer, 2, h.shape.n_head_kv, h.shape.n_token, h.shape.head_dim);
  d["token_offset"] = h.token_offset;
  d["request_id"] = h.request_id;
  d["layer_begin"] = h.layer_begin;
  d["n_layer_total"] = h.n_layer_total;
  d["positions"] = h.positions;
  d["payload_bytes"] = h.payload_len;
  d["frame_bytes"] = h.frame_len();
  // An FP8 cache's scales: None, or a float32 array (n_layer, 2) per tensor / (n_layer, 2, n_head_kv) per head.
  if (h.fp8_scales.empty()) {
    d["fp8_scales"] = py::none();
  } else {
    std::vector<ssize_t> shape{ssize_t(h.shape.n_layer), 2};
    if (h.fp8_scales.granularity == Fp8Scales::Granularity::kHead) shape.push_back(ssize_t(h.shape.n_head_kv));
    py::array_t<float> a(shape);
    std::memcpy(a.mutable_data(), h.fp8_scales.scale.data(), 4 * h.fp8_scales.scale.size());
    d["fp8_scales"] = a;
  }
  return d;
}

// One request's layer frames decoded straight into the caller's array, in any order.
class PyLayerAssembler {
 public:
  // `out`: an array (n_layer, 2, n_head_kv, n_token, head_dim); or, with a block table, a paged
  // cache in vLLM's layout (a list of per-layer arrays, as encode_paged takes) holding n_token tokens.
  PyLayerAssembler(uint64_t request_id, py::object out, std::optional<std::string> dtype,
                   std::optional<std::vector<uint32_t>> block_table, std::optional<uint32_t> n_token,
                   ScalesArg scales)
      : out_(out) {
    if (block_table) {
      if (!n_token) Throw(Status::InvalidArgument("a paged LayerAssembler needs n_token"));
      const std::vector<py::array> layers = out.cast<std::vector<py::array>>();
      view_ = std::make_unique<KvBlock>(PagedOfArrays(layers, *block_table, *n_token, dtype, true));
    } else {
      py::array a = out.cast<py::array>();
      if (!a.writeable()) Throw(Status::InvalidArgument("out is read-only"));
      auto view = ViewOfArray(a, DTypeOfArray(a, dtype), false);
      if (!view) Throw(Status::InvalidArgument("out must be C-contiguous or a token slice of such an array"));
      view_ = std::make_unique<KvBlock>(std::move(*view));
    }
    SetScales(*view_, scales);
    asm_ = std::make_unique<LayerAssembler>(request_id, view_.get(), DefaultCodecEnv());
  }
  void Add(const py::buffer& frame, int threads) {
    Buffer buf = BytesOf(frame);
    CodecOptions o;
    o.pool = PoolFor(threads);
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(mu_);
    Check(asm_->Add(buf.bytes(), o));
  }
  bool complete() const { return asm_->complete(); }
  uint32_t layers_done() const { return asm_->layers_done(); }
  bool has_layer(uint32_t l) const { return asm_->has_layer(l); }
  std::vector<uint32_t> positions() const { return asm_->positions(); }
  uint32_t token_offset() const { return asm_->token_offset(); }
  const py::object& out() const { return out_; }

 private:
  py::object out_;  // keeps the caller's arrays alive
  std::unique_ptr<KvBlock> view_;
  std::unique_ptr<LayerAssembler> asm_;
  std::mutex mu_;
};

// ---- Controller -------------------------------------------------------------------------------------
struct PyDecision {
  Decision d;
  Request r;
  std::string strategy, name, explanation;
};

class PyController {
 public:
  PyController(std::vector<StrategyCost> s, ControllerOptions o) : c_(std::move(s), o) {}
  explicit PyController(Controller c) : c_(std::move(c)) {}

  PyDecision Decide(double kv_bytes, double bandwidth_gbps, double slo, double floor, const std::string& label,
                    double model_seconds, double confidence, uint32_t prompt_tokens) {
    if (!(kv_bytes >= 0)) Throw(Status::InvalidArgument("kv_bytes " + std::to_string(kv_bytes) + " is negative"));
    if (!(bandwidth_gbps > 0))
      Throw(Status::InvalidArgument("bandwidth_gbps " + std::to_string(bandwidth_gbps) + " must be > 0"));
    if (!(slo > 0)) Throw(Status::InvalidArgument("slo " + std::to_string(slo) + " must be > 0"));
    if (!(floor >= 0 && floor <= 1))
      Throw(Status::InvalidArgument("floor " + std::to_string(floor) + " is outside [0, 1]"));
    PyDecision out;
    out.r.id = next_id_++;
    out.r.label = label;
    out.r.kv_bytes = kv_bytes;
    out.r.prompt_tokens = prompt_tokens;
    out.r.slo_seconds = slo;
    out.r.floor = floor;
    out.r.model_seconds = model_seconds;
    c_.Decide(out.r, bandwidth_gbps * 1e9 / 8, confidence, QueueState{}, &out.d);
    const StrategyCost& s = c_.strategies()[out.d.choice];
    out.strategy = s.spec;
    out.name = s.name;
    out.explanation = c_.Explain(out.r, out.d);
    return out;
  }
  void Observe(const PyDecision& d, double seconds, double encode_seconds, double decode_seconds) {
    if (!(seconds >= 0)) Throw(Status::InvalidArgument("observed seconds " + std::to_string(seconds) + " is negative"));
    if (!(encode_seconds >= 0) || !(decode_seconds >= 0))
      Throw(Status::InvalidArgument("encode_seconds " + std::to_string(encode_seconds) + " / decode_seconds " +
                                    std::to_string(decode_seconds) + " must be >= 0"));
    if (d.d.choice >= c_.strategies().size()) Throw(Status::InvalidArgument("decision is not this controller's"));
    c_.Observe(d.d, d.r, seconds, StageTimes{encode_seconds, decode_seconds});
  }
  py::list Strategies() const {
    py::list l;
    for (const StrategyCost& s : c_.strategies()) {
      py::dict d;
      d["strategy"] = s.spec, d["name"] = s.name, d["quality"] = s.quality, d["ratio"] = s.ratio;
      d["encode_gbps"] = s.encode_Bps * 8 / 1e9, d["decode_gbps"] = s.decode_Bps * 8 / 1e9;
      l.append(d);
    }
    return l;
  }
  const Controller& controller() const { return c_; }

 private:
  Controller c_;
  uint64_t next_id_ = 0;  // request ids as the CLI numbers them
};

ControllerOptions MakeControllerOptions(bool pipelined, uint32_t n_layer, bool bandit, uint64_t seed) {
  ControllerOptions o;
  o.pipelined = pipelined;
  o.n_layer = n_layer;
  o.bandit = bandit;
  o.seed = seed;
  return o;
}

// ---- Transport ---------------------------------------------------------------------------------------
struct Tcp {
  std::unique_ptr<LinkShaper> shaper;
  std::unique_ptr<Transport> transport;
};
std::shared_ptr<Tcp> MakeTcp(double shaper_gbps) {
  auto t = std::make_shared<Tcp>();
  TcpOptions o;
  if (shaper_gbps > 0) t->shaper = std::make_unique<LinkShaper>(shaper_gbps), o.shaper = t->shaper.get();
  t->transport = MakeTcpTransport(o);
  return t;
}

class PyConnection {
 public:
  PyConnection(std::shared_ptr<Tcp> tcp, std::unique_ptr<Connection> c) : tcp_(std::move(tcp)), c_(std::move(c)) {}
  void Send(int kind, const py::buffer& body, double timeout_s) {
    if (kind < 1 || kind > 6) Throw(Status::InvalidArgument("message kind " + std::to_string(kind) + " is not 1..6"));
    Buffer b = BytesOf(body);
    py::gil_scoped_release release;
    Check(c_->Send(static_cast<MessageKind>(kind), b.bytes(), DeadlineIn(timeout_s)));
  }
  py::tuple Receive(double timeout_s) {
    Message m;
    {
      py::gil_scoped_release release;
      m = Unwrap(c_->Receive(DeadlineIn(timeout_s)));
    }
    return py::make_tuple(int(m.kind), ToBytes(m.body));
  }
  void Close() { c_->Close(); }
  std::string peer() const { return c_->peer(); }

 private:
  std::shared_ptr<Tcp> tcp_;
  std::unique_ptr<Connection> c_;
};

class PyListener {
 public:
  PyListener(const std::string& address, double shaper_gbps) : tcp_(MakeTcp(shaper_gbps)) {
    l_ = Unwrap(tcp_->transport->Listen(address));
  }
  std::unique_ptr<PyConnection> Accept(double timeout_s) {
    std::unique_ptr<Connection> c;
    {
      py::gil_scoped_release release;
      c = Unwrap(l_->Accept(DeadlineIn(timeout_s)));
    }
    return std::make_unique<PyConnection>(tcp_, std::move(c));
  }
  uint16_t port() const { return l_->port(); }
  void Close() { l_->Close(); }

 private:
  std::shared_ptr<Tcp> tcp_;
  std::unique_ptr<Listener> l_;
};

std::unique_ptr<PyConnection> Connect(const std::string& address, double timeout_s, double shaper_gbps) {
  auto tcp = MakeTcp(shaper_gbps);
  std::unique_ptr<Connection> c;
  {
    py::gil_scoped_release release;
    c = Unwrap(tcp->transport->Connect(address, DeadlineIn(timeout_s)));
  }
  return std::make_unique<PyConnection>(tcp, std::move(c));
}

// ---- Pool -------------------------------------------------------------------------------------------
class PyPool {
 public:
  PyPool(const std::string& uri, uint64_t capacity) { p_ = Unwrap(MakePool(uri, capacity)); }
  void Put(const std::string& key, const py::buffer& value) {
    Buffer b = BytesOf(value);
    py::gil_scoped_release release;
    Check(p_->Put(key, b.bytes()));
  }
  py::object Get(const std::string& key) {
    std::optional<ByteBuffer> v;
    {
      py::gil_scoped_release release;
      v = Unwrap(p_->Get(key));
    }
    if (!v) return py::none();
    return ToBytes(*v);
  }
  py::list GetMany(const std::vector<std::string>& keys) {
    std::vector<std::optional<ByteBuffer>> v;
    {
      py::gil_scoped_release release;
      v = Unwrap(p_->GetMany(keys));
    }
    py::list l;
    for (auto& x : v) l.append(x ? py::object(ToBytes(*x)) : py::object(py::none()));
    return l;
  }
  std::vector<bool> Exists(const std::vector<std::string>& keys) {
    py::gil_scoped_release release;
    return Unwrap(p_->ExistsMany(keys));
  }
  void Delete(const std::string& key) { Check(p_->Delete(key)); }
  void Clear() { Check(p_->Clear()); }
  py::dict Stats() {
    PoolStats s = Unwrap(p_->Stats());
    py::dict d;
    d["puts"] = s.puts, d["gets"] = s.gets, d["hits"] = s.hits, d["misses"] = s.misses, d["deletes"] = s.deletes;
    d["evictions"] = s.evictions, d["bytes"] = s.bytes, d["entries"] = s.entries, d["errors"] = s.errors;
    d["reconnects"] = s.reconnects;
    return d;
  }
  std::string name() const { return p_->name(); }

 private:
  std::unique_ptr<KvPool> p_;
};

PoolKeyOptions KeyOptions(const std::string& model_id, uint32_t chunk_tokens, const std::string& placement) {
  PoolKeyOptions o;
  o.model_id = model_id;
  o.chunk_tokens = chunk_tokens;
  if (chunk_tokens == 0) Throw(Status::InvalidArgument("chunk_tokens 0 must be > 0"));
  if (placement == "prefix")
    o.placement = KeyPlacement::kPrefix;
  else if (placement == "spread")
    o.placement = KeyPlacement::kSpread;
  else
    Throw(Status::InvalidArgument("placement '" + placement + "' is not prefix or spread"));
  return o;
}

// ---- Evaluator --------------------------------------------------------------------------------------
class PyEvaluator {
 public:
  PyEvaluator(const std::string& model, std::optional<std::string> models_dir, std::optional<std::string> cache_dir,
              uint32_t contexts, uint32_t prompt_len, uint64_t seed, int threads) {
    const std::string dir = models_dir ? *models_dir : DefaultModelsDir();
    EvalOptions o;
    o.n_contexts = contexts, o.prompt_len = prompt_len, o.seed = seed, o.threads = threads;
    o.cache_dir = cache_dir ? *cache_dir : EnvOr("KVSERVE_CACHE", "");
    o.codec_env = DefaultCodecEnv();
    py::gil_scoped_release release;
    model_ = std::make_unique<LlamaModel>(Unwrap(LoadModel(model, "", dir)));
    ev_ = Unwrap(Evaluator::Create(*model_, o));
  }
  py::dict Evaluate(const std::string& strategy) {
    EvalMetrics m;
    {
      py::gil_scoped_release release;
      m = Unwrap(ev_->Evaluate(strategy));
    }
    py::dict d;
    d["strategy"] = m.strategy, d["relative_accuracy"] = m.relative_accuracy;
    d["relative_accuracy_se"] = m.relative_accuracy_se, d["top1_agreement"] = m.top1_agreement, d["kl"] = m.kl;
    d["ppl_ratio"] = m.ppl_ratio, d["greedy_match"] = m.greedy_match, d["ratio"] = m.ratio;
    d["accuracy"] = m.accuracy, d["exact_accuracy"] = m.exact_accuracy, d["contexts"] = m.contexts;
    d["positions"] = m.positions, d["seconds"] = m.seconds;
    return d;
  }
  std::string model_name() const { return model_->name; }
  uint32_t prompt_len() const { return ev_->prompt_len(); }
  py::array prompt_kv(uint32_t i) const {
    if (i >= ev_->eval_set().contexts.size())
      Throw(Status::OutOfRange("context " + std::to_string(i) + " out of range"));
    return ArrayOfBlock(Unwrap(ev_->prompt_kv(i).ConvertTo(DType::kF16)));
  }

 private:
  std::unique_ptr<LlamaModel> model_;
  std::unique_ptr<Evaluator> ev_;
};

}  // namespace
}  // namespace kvserve::python

PYBIND11_MODULE(_kvserve, m) {
  using namespace kvserve;
  using namespace kvserve::python;
  m.doc() = "kvserve: KV-cache compression for disaggregated LLM serving (C++ core).";
  m.attr("__version__") = KVSERVE_VERSION;
  RegisterExceptions(m);
  if (const char* simd = std::getenv("KVSERVE_SIMD"); simd && *simd) cpu::SetCap(Unwrap(cpu::ParseTier(simd)));

  m.def(
      "simd_tier", [] { return std::string(cpu::TierName(cpu::Active())); },
      "SIMD tier the codec kernels run now: 'baseline', 'avx2' or 'avx512'.");
  m.def(
      "detected_simd_tier", [] { return std::string(cpu::TierName(cpu::Detected())); },
      "Widest SIMD tier this CPU supports.");
  m.def(
      "set_simd_cap",
      [](const std::string& t) { return std::string(cpu::TierName(cpu::SetCap(Unwrap(cpu::ParseTier(t))))); },
      py::arg("tier"), "Caps the SIMD tier (as KVSERVE_SIMD does); returns the tier now active.");

  m.def(
      "canonical_strategy", [](const std::string& s) { return Unwrap(CanonicalStrategy(s)); }, py::arg("strategy"),
      "The canonical text of a strategy spec (defaults filled in); raises InvalidArgument naming the bad part.");
  m.def(
      "parse_strategy",
      [](const std::string& s) {
        StrategySpec spec = Unwrap(ParseStrategy(s));
        py::list stages;
        for (const StageSpec& st : spec.stages) {
          py::dict params;
          for (const auto& [k, v] : st.params) params[py::str(k)] = v;
          stages.append(py::make_tuple(st.name, params));
        }
        return stages;
      },
      py::arg("strategy"), "The stages of a strategy as [(name, {param: value})], canonical values.");
  m.def(
      "stages",
      [] {
        py::list l;
        for (const StageInfo& s : RegisteredStages()) {
          py::dict d;
          d["name"] = s.name, d["summary"] = s.summary, d["lossless"] = s.lossless;
          d["input"] = DataKindName(s.input), d["output"] = DataKindName(s.output);
          py::list params;
          for (const ParamSpec& p : s.params) {
            params.append(py::dict(py::arg("name") = p.name, py::arg("range") = p.RangeText(),
                                   py::arg("default") = p.default_value, py::arg("help") = p.help));
          }
          d["params"] = params;
          l.append(d);
        }
        return l;
      },
      "Every registered codec stage with its parameters and ranges.");

  m.def("encode", &Encode, py::arg("kv"), py::arg("strategy"), py::kw_only(), py::arg("layers") = py::none(),
        py::arg("request_id") = 0, py::arg("threads") = 1, py::arg("dtype") = py::none(),
        py::arg("token_scores") = py::none(), py::arg("token_offset") = 0, py::arg("scales") = py::none(),
        "Encodes a KV array (n_layer, 2, n_head_kv, n_token, head_dim) of float16/float32 (bf16: uint16 with "
        "dtype='bf16'; FP8: uint8 with dtype='e4m3'/'e5m2') into a frame. Reads the array in place when it is "
        "C-contiguous or a token slice of such an array. layers=(begin, count) encodes those layers into a per-layer "
        "frame tagged with request_id. scales: an FP8 cache's dequantisation scales (value = code * scale), "
        "(n_layer, 2) per tensor or (n_layer, 2, n_head_kv) per head; the frame carries them.");
  m.def("encode_layer", &EncodeLayer, py::arg("kv_layer"), py::arg("strategy"), py::arg("layer"), py::arg("n_layer"),
        py::kw_only(), py::arg("request_id") = 0, py::arg("threads") = 1, py::arg("dtype") = py::none(),
        py::arg("token_scores") = py::none(), py::arg("token_offset") = 0, py::arg("scales") = py::none(),
        "Encodes one layer's KV (2, n_head_kv, n_token, head_dim), layer `layer` of a request with n_layer layers, "
        "into the frame encode(kv, layers=(layer, 1)) gives from the whole array.");
  m.def("decode", &Decode, py::arg("frame"), py::kw_only(), py::arg("out") = py::none(), py::arg("threads") = 1,
        py::arg("dtype") = py::none(), py::arg("scales") = py::none(),
        "Decodes a frame. Without out: a new array whose memory is the decoded block (no copy; an FP8 frame's codes, "
        "its scales in frame_info()['fp8_scales']). With out: decodes into that array in place (its dtype; shape "
        "must match) and returns it; scales are out's own FP8 scales (none: 1), to which the frame's codes are "
        "converted, and a non-FP8 out receives the values.");
  m.def("encode_paged", &EncodePaged, py::arg("layers"), py::arg("block_table"), py::arg("n_token"),
        py::arg("strategy"), py::kw_only(), py::arg("request_id") = 0, py::arg("threads") = 1,
        py::arg("dtype") = py::none(), py::arg("token_offset") = 0, py::arg("scales") = py::none(),
        "Encodes a sequence held in a paged cache, vLLM's layout: one C-contiguous array per layer, (2, num_blocks, "
        "block_size, n_head_kv, head_dim), the sequence's n_token tokens in the pages block_table lists. Reads the "
        "pages in place; the frame is byte for byte what encode() gives from the dense array.");
  m.def("encode_layer_paged", &EncodeLayerPaged, py::arg("kv_layer"), py::arg("block_table"), py::arg("n_token"),
        py::arg("strategy"), py::arg("layer"), py::arg("n_layer"), py::kw_only(), py::arg("request_id") = 0,
        py::arg("threads") = 1, py::arg("dtype") = py::none(), py::arg("token_scores") = py::none(),
        py::arg("token_offset") = 0, py::arg("scales") = py::none(),
        "Encodes one layer of a paged cache (2, num_blocks, block_size, n_head_kv, head_dim), layer `layer` of a "
        "request with n_layer layers, into the frame encode_layer() gives from the dense layer.");
  m.def("decode_paged", &DecodePaged, py::arg("frame"), py::arg("layers"), py::arg("block_table"), py::kw_only(),
        py::arg("threads") = 1, py::arg("dtype") = py::none(), py::arg("scales") = py::none(),
        "Decodes a frame into a paged cache (vLLM's layout, as encode_paged takes it) in place: the frame's tokens go "
        "to the pages block_table lists; no other row is written.");
  m.def("frame_info", &FrameInfo, py::arg("frame"), "The verified header of a frame as a dict.");

  py::class_<PyLayerAssembler>(
      m, "LayerAssembler", "Decodes one request's per-layer frames into a caller's array as they arrive, in any order.")
      .def(py::init<uint64_t, py::object, std::optional<std::string>, std::optional<std::vector<uint32_t>>,
                    std::optional<uint32_t>, ScalesArg>(),
           py::arg("request_id"), py::arg("out"), py::arg("dtype") = py::none(), py::kw_only(),
           py::arg("block_table") = py::none(), py::arg("n_token") = py::none(), py::arg("scales") = py::none())
      .def("add", &PyLayerAssembler::Add, py::arg("frame"), py::arg("threads") = 1)
      .def_property_readonly("complete", &PyLayerAssembler::complete)
      .def_property_readonly("layers_done", &PyLayerAssembler::layers_done)
      .def("has_layer", &PyLayerAssembler::has_layer, py::arg("layer"))
      .def_property_readonly("positions", &PyLayerAssembler::positions)
      .def_property_readonly("token_offset", &PyLayerAssembler::token_offset)
      .def_property_readonly("out", &PyLayerAssembler::out);

  py::class_<PyDecision>(m, "Decision", "One controller decision, with its explanation.")
      .def_readonly("strategy", &PyDecision::strategy)
      .def_readonly("name", &PyDecision::name)
      .def_readonly("explanation", &PyDecision::explanation)
      .def_property_readonly("index", [](const PyDecision& d) { return d.d.choice; })
      .def_property_readonly("predicted_seconds", [](const PyDecision& d) { return d.d.predicted_seconds; })
      .def_property_readonly("meets_slo", [](const PyDecision& d) { return d.d.meets_slo; })
      .def_property_readonly("explored", [](const PyDecision& d) { return d.d.explored; })
      .def_property_readonly("floor", [](const PyDecision& d) { return d.d.floor; })
      .def_property_readonly("candidates",
                             [](const PyDecision& d) {
                               py::list l;
                               for (const CandidateNote& n : d.d.notes) {
                                 l.append(py::dict(py::arg("index") = n.strategy,
                                                   py::arg("reason") = std::string(DropReasonName(n.reason)),
                                                   py::arg("predicted_seconds") = n.predicted_seconds));
                               }
                               return l;
                             })
      .def("__repr__", [](const PyDecision& d) { return "<kvserve.Decision " + d.strategy + ">"; });

  py::class_<PyController>(m, "Controller", "The online controller: latency model, quality and SLO filter, bandit.")
      .def(py::init([](const std::string& profile, bool pipelined, uint32_t n_layer, bool bandit, uint64_t seed) {
             Profile p = Unwrap(LoadProfile(profile));
             return std::make_unique<PyController>(
                 Unwrap(Controller::FromProfile(p, MakeControllerOptions(pipelined, n_layer, bandit, seed))));
           }),
           py::arg("profile"), py::kw_only(), py::arg("pipelined") = false, py::arg("n_layer") = 32,
           py::arg("bandit") = false, py::arg("seed") = 1, "A controller over a profile file's Pareto set.")
      .def_static(
          "from_strategies",
          [](const std::vector<py::dict>& items, bool pipelined, uint32_t n_layer, bool bandit, uint64_t seed) {
            std::vector<StrategyCost> s;
            for (const py::dict& d : items) {
              StrategyCost c;
              c.spec = Unwrap(CanonicalStrategy(d["strategy"].cast<std::string>()));
              c.name = ShortSpec(c.spec);
              c.quality = d.contains("quality") ? d["quality"].cast<double>() : 1.0;
              c.ratio = d.contains("ratio") ? d["ratio"].cast<double>() : 1.0;
              c.encode_Bps = d.contains("encode_gbps") ? d["encode_gbps"].cast<double>() * 1e9 / 8 : 0;
              c.decode_Bps = d.contains("decode_gbps") ? d["decode_gbps"].cast<double>() * 1e9 / 8 : 0;
              if (c.spec != "none" && (c.ratio <= 0 || c.encode_Bps <= 0 || c.decode_Bps <= 0)) {
                Throw(
                    Status::InvalidArgument("strategy '" + c.spec + "' needs ratio, encode_gbps and decode_gbps > 0"));
              }
              if (c.spec != "none") s.push_back(std::move(c));
            }
            return std::make_unique<PyController>(std::move(s),
                                                  MakeControllerOptions(pipelined, n_layer, bandit, seed));
          },
          py::arg("strategies"), py::kw_only(), py::arg("pipelined") = false, py::arg("n_layer") = 32,
          py::arg("bandit") = false, py::arg("seed") = 1,
          "A controller over [{'strategy', 'quality', 'ratio', 'encode_gbps', 'decode_gbps'}] ('none' is added).")
      .def("decide", &PyController::Decide, py::arg("kv_bytes"), py::arg("bandwidth_gbps"), py::arg("slo"),
           py::arg("floor") = 0.97, py::arg("label") = "chat", py::kw_only(), py::arg("model_seconds") = 0.0,
           py::arg("confidence") = 1.0, py::arg("prompt_tokens") = 0,
           "Picks a strategy for moving kv_bytes of fp16 KV over a bandwidth_gbps link within slo seconds at "
           "relative accuracy >= floor; the Decision explains why.")
      .def("observe", &PyController::Observe, py::arg("decision"), py::arg("observed_seconds"), py::kw_only(),
           py::arg("encode_seconds") = 0.0, py::arg("decode_seconds") = 0.0,
           "Feeds back the transfer time a decision took and, where measured, its encode and decode times "
           "(the live codec speeds every strategy is then planned with; 0: not measured).")
      .def_property_readonly("strategies", &PyController::Strategies);

  py::class_<PyConnection>(m, "Connection", "A kvserve TCP connection: typed messages (kind, body).")
      .def("send", &PyConnection::Send, py::arg("kind"), py::arg("body"), py::arg("timeout_s") = 30.0)
      .def("receive", &PyConnection::Receive, py::arg("timeout_s") = 30.0, "Returns (kind, body).")
      .def("close", &PyConnection::Close)
      .def_property_readonly("peer", &PyConnection::peer);
  py::class_<PyListener>(m, "Listener", "Listens for kvserve TCP connections.")
      .def(py::init<const std::string&, double>(), py::arg("address") = "127.0.0.1:0", py::arg("shaper_gbps") = 0.0)
      .def("accept", &PyListener::Accept, py::arg("timeout_s") = 30.0)
      .def_property_readonly("port", &PyListener::port)
      .def("close", &PyListener::Close);
  m.def("connect", &Connect, py::arg("address"), py::arg("timeout_s") = 10.0, py::arg("shaper_gbps") = 0.0,
        "Connects to a Listener (host:port); shaper_gbps > 0 paces what this side sends.");
  py::module_ kinds = m.def_submodule("message", "Message kinds of the transport.");
  kinds.attr("REQUEST") = int(MessageKind::kRequest);
  kinds.attr("FRAME") = int(MessageKind::kFrame);
  kinds.attr("END") = int(MessageKind::kEnd);
  kinds.attr("RESEND") = int(MessageKind::kResend);
  kinds.attr("RESULT") = int(MessageKind::kResult);
  kinds.attr("ERROR") = int(MessageKind::kError);

  py::class_<PyPool>(m, "Pool",
                     "A KV pool: 'embedded' (in process, LRU), 'redis://host:port' or 'redis-cluster://...'.")
      .def(py::init<const std::string&, uint64_t>(), py::arg("uri") = "embedded",
           py::arg("capacity_bytes") = uint64_t{8} << 30)
      .def("put", &PyPool::Put, py::arg("key"), py::arg("value"))
      .def("get", &PyPool::Get, py::arg("key"), "The value, or None on a miss.")
      .def("get_many", &PyPool::GetMany, py::arg("keys"))
      .def("exists", &PyPool::Exists, py::arg("keys"))
      .def("delete", &PyPool::Delete, py::arg("key"))
      .def("clear", &PyPool::Clear)
      .def("stats", &PyPool::Stats)
      .def_property_readonly("name", &PyPool::name);
  m.def(
      "prefix_chain_hashes",
      [](const std::string& model_id, const std::vector<int>& tokens, uint32_t chunk_tokens,
         const std::string& placement) {
        return PrefixChainHashes(KeyOptions(model_id, chunk_tokens, placement), tokens);
      },
      py::arg("model_id"), py::arg("tokens"), py::arg("chunk_tokens") = kDefaultChunkTokens,
      py::arg("placement") = "prefix", "Chain hashes of the full chunks of a token sequence.");
  m.def(
      "chunk_key",
      [](const std::string& model_id, const std::vector<std::string>& chain, size_t chunk, const std::string& strategy,
         uint32_t chunk_tokens, const std::string& placement) {
        if (chunk >= chain.size()) Throw(Status::OutOfRange("chunk " + std::to_string(chunk) + " beyond the chain"));
        return PoolChunkKey(KeyOptions(model_id, chunk_tokens, placement), chain, chunk,
                            Unwrap(CanonicalStrategy(strategy)));
      },
      py::arg("model_id"), py::arg("chain"), py::arg("chunk"), py::arg("strategy"),
      py::arg("chunk_tokens") = kDefaultChunkTokens, py::arg("placement") = "prefix",
      "The pool key of a chunk stored with a strategy, as the serving nodes name it.");

  py::class_<PyEvaluator>(m, "Evaluator",
                          "Relative accuracy of strategies on a shipped model (next-token accuracy "
                          "with compressed prompt KV over accuracy with exact KV).")
      .def(py::init<const std::string&, std::optional<std::string>, std::optional<std::string>, uint32_t, uint32_t,
                    uint64_t, int>(),
           py::arg("model") = "stories260K", py::kw_only(), py::arg("models_dir") = py::none(),
           py::arg("cache_dir") = py::none(), py::arg("contexts") = 0, py::arg("prompt_len") = 0, py::arg("seed") = 1,
           py::arg("threads") = 1)
      .def("evaluate", &PyEvaluator::Evaluate, py::arg("strategy"))
      .def_property_readonly("model", &PyEvaluator::model_name)
      .def_property_readonly("prompt_len", &PyEvaluator::prompt_len)
      .def("prompt_kv", &PyEvaluator::prompt_kv, py::arg("context"), "The fp16 prompt KV of an evaluation context.");
}
