// rans(tables=auto|channel|part, predict=auto|token|none): static rANS entropy coding of what the
// previous stage (quant, mixhq) reports as sections: its quantisation codes, with one frequency
// table per (layer, K/V part, channel) — CacheGen found per-channel statistics matter — or one
// per (layer, part); and its fp16 metadata (ranges, scales), as low and high bytes with a table
// each per kind of value. Other bytes (headers, residual fp16 tokens) pass through unchanged.
//
// Prediction: with it, a code is replaced by its difference (mod 2^bits) from the same channel
// one token earlier. It pays on smooth KV and costs on noisy KV (the difference of two
// independent codes spreads wider than either). Per-channel tables pay where channels differ
// and cost their own bytes where they do not. `auto` makes both choices per (layer, part) from
// the counts, tables' bytes included. Metadata of a context is coded only when that is smaller
// than storing it (small blocks can lose).
//
// Coder: 32 interleaved rANS states, 12-bit probabilities, 16-bit renormalisation words (the
// encoder runs backwards, so the decoder reads forwards); every run of symbols is
// padded to a multiple of 32 with its tables' likeliest symbols so that a group of 32 never
// straddles two tables' layouts. The loops over symbols (rans_kernels.h) use AVX-512 where built
// with it. Every state must end where the encoder started it, which catches corruption the
// frame checksum did not.
//
// Streams: the runs, in decoding order, are cut into streams with states of their own, so that
// the contexts of a large frame are coded on several threads and decoded two streams at a time
// per thread (rans::DecodeRunPair). A cut falls where a code context begins, once the stream
// before it holds kStreamSymbols codes: a function of the layout alone, so a frame is the same
// however many threads wrote it, and a frame of one layer (the serving path) still has a stream
// for K and one for V.
//
// Payload: u8 version 3 | u8 prob_bits | u8 lanes
//          | u32 n_code_contexts, u8 flags each (bit 0: predicted, bit 1: one table for all channels)
//          | u32 n_half_contexts, u8 flags each (bit 0: entropy coded)
//          | u32 n_tables, per table: u8 bits, frequencies as varints (a 0 is followed by the
//            varint count of further zeros)
//          | u64 raw_len, raw bytes | u64 n_symbols
//          | u32 n_streams, per stream: u32 first run (not for the first stream, which starts at
//            run 0), 32 x u32 final state, u64 stream_len | the streams, in order
#include <algorithm>
#include <cmath>
#include <cstring>

#include "codec/quant_kernels.h"
#include "codec/rans_kernels.h"
#include "codec/stage.h"

namespace kvserve {
namespace {

using rans::ContextCounter;
using rans::kLanes;
using rans::kLow;
using rans::kProbBits;
using rans::kProbScale;
using Kind = CodeSection::Kind;

constexpr uint8_t kVersion = 3;
constexpr uint64_t kStreamSymbols = uint64_t{1} << 18;  // before a stream may end
constexpr int kHalfBits = 8;  // metadata symbols are bytes: the low and the high byte of an fp16

enum class Choice { kAuto, kYes, kNo };  // a per-context option: decided from the counts, or fixed

uint64_t SectionBytes(const CodeSection& s) {
  return s.kind == Kind::kHalf ? uint64_t(s.n_codes) * 2 : quant::PackedBytes(s.n_codes, s.bits);
}
uint32_t Padded(uint64_t n) { return uint32_t((n + kLanes - 1) / kLanes * kLanes); }

// What both sides derive from the sections: the contexts (code contexts, then metadata
// contexts, each in order of first appearance) and their tables.
struct Context {
  uint32_t first_table = 0;
  uint32_t n_channel = 1;  // channels cycled through by the symbols (metadata: 2, low/high byte)
  uint8_t bits = 0;
  bool per_channel = true;        // one table per channel, else one for all (the first)
  std::vector<uint32_t> sections;  // indices, in offset order
  uint64_t n_symbols = 0;          // unpadded (metadata: both bytes of every value)
  // Tables in use; room is kept for n_channel either way.
  uint32_t n_tables() const { return per_channel ? n_channel : 1; }
};
struct Layout {
  std::vector<Context> code, half;
  std::vector<uint8_t> table_bits;      // per table
  std::vector<uint32_t> table_offset;   // per table: first entry in the per-symbol arrays
  uint32_t n_entries = 0;
  std::vector<uint32_t> context_of;     // per section: index into code or half
  uint64_t code_bytes = 0;              // packed code bytes of all code sections
};

// The kernels' view of a context's tables in `entries` (laid out by table_offset): contiguous,
// 2^bits entries apart, or stride 0 for one shared table.
rans::Run RunOf(const Layout& L, const Context& c, const uint32_t* entries) {
  return rans::Run{entries + L.table_offset[c.first_table], c.per_channel ? 1u << c.bits : 0, c.n_channel, c.bits};
}

void AddTables(Layout& L, Context& c) {
  c.first_table = uint32_t(L.table_bits.size());
  for (uint32_t k = 0; k < c.n_channel; ++k) {
    L.table_bits.push_back(c.bits);
    L.table_offset.push_back(L.n_entries);
    L.n_entries += 1u << c.bits;
  }
}

Result<Layout> MakeLayout(const std::vector<CodeSection>& secs) {
  Layout L;
  std::vector<int64_t> code_index, half_index;
  uint64_t prev_end = 0;
  for (uint32_t i = 0; i < secs.size(); ++i) {
    const CodeSection& s = secs[i];
    if (s.offset < prev_end) return Status::Internal("code sections overlap or are out of order");
    prev_end = s.offset + SectionBytes(s);
    const bool half = s.kind == Kind::kHalf;
    if (half ? (s.bits != 16 || s.n_channel != 1) : (s.bits < 1 || s.bits > 8 || s.n_channel == 0 || s.n_codes % 8)) {
      return Status::Internal("malformed code section (" + std::to_string(s.bits) + " bits)");
    }
    std::vector<int64_t>& index = half ? half_index : code_index;
    std::vector<Context>& list = half ? L.half : L.code;
    if (s.context >= index.size()) index.resize(s.context + 1, -1);
    if (index[s.context] < 0) {
      index[s.context] = int64_t(list.size());
      Context c;
      c.bits = half ? kHalfBits : s.bits;
      c.n_channel = half ? 2 : s.n_channel;
      list.push_back(c);
    }
    Context& c = list[size_t(index[s.context])];
    if (!half && (c.n_channel != s.n_channel || c.bits != s.bits)) {
      return Status::Internal("code sections of one context disagree on bits or channels");
    }
    c.sections.push_back(i);
    c.n_symbols += half ? uint64_t(s.n_codes) * 2 : s.n_codes;
    L.context_of.push_back(uint32_t(index[s.context]));
    if (!half) L.code_bytes += SectionBytes(s);
  }
  for (Context& c : L.code) AddTables(L, c);
  for (Context& c : L.half) AddTables(L, c);
  return L;
}

// Scales counts to frequencies summing to kProbScale, every seen symbol at least 1.
void Normalize(const uint64_t* count, uint32_t alphabet, uint16_t* freq) {
  uint64_t total = 0;
  for (uint32_t s = 0; s < alphabet; ++s) total += count[s];
  if (total == 0) {
    std::fill(freq, freq + alphabet, 0);
    freq[0] = kProbScale;
    return;
  }
  int64_t sum = 0;
  uint32_t largest = 0;
  for (uint32_t s = 0; s < alphabet; ++s) {
    freq[s] = count[s] ? uint16_t(std::max<uint64_t>(1, count[s] * kProbScale / total)) : 0;
    sum += freq[s];
    if (freq[s] > freq[largest]) largest = s;
  }
  if (sum < kProbScale) freq[largest] = uint16_t(freq[largest] + (kProbScale - sum));
  while (sum > kProbScale) {  // rounding up rare symbols to 1 overshot: take from the largest
    uint32_t big = 0;
    for (uint32_t s = 0; s < alphabet; ++s)
      if (freq[s] > freq[big]) big = s;
    const int64_t take = std::min<int64_t>(sum - kProbScale, freq[big] - 1);
    freq[big] = uint16_t(freq[big] - take);
    sum -= take;
  }
}

// Bits an ideal coder spends on these counts with their own frequencies.
double CostBits(const uint64_t* count, uint32_t alphabet) {
  uint64_t total = 0;
  for (uint32_t s = 0; s < alphabet; ++s) total += count[s];
  double bits = 0;
  for (uint32_t s = 0; s < alphabet; ++s) {
    if (count[s]) bits -= double(count[s]) * std::log2(double(count[s]) / double(total));
  }
  return bits;
}

// Frequencies are stored as LEB128 varints (most are below 128), with runs of zeros as a
// count: metadata tables have 256 entries and most are empty.
void PutVarint(ByteBuffer* out, uint32_t v) {
  while (v >= 0x80) {
    out->push_back(uint8_t(v | 0x80));
    v >>= 7;
  }
  out->push_back(uint8_t(v));
}
void PutTable(ByteBuffer* out, const uint16_t* freq, uint32_t alphabet) {
  for (uint32_t s = 0; s < alphabet;) {
    PutVarint(out, freq[s]);
    if (freq[s++] != 0) continue;
    uint32_t zeros = 0;
    while (s < alphabet && freq[s] == 0) ++zeros, ++s;
    PutVarint(out, zeros);
  }
}
size_t VarintBytes(uint32_t v) {
  size_t n = 1;
  for (; v >= 0x80; v >>= 7) ++n;
  return n;
}
// What PutTable writes, plus the table's bits byte; counted without writing.
size_t TableBytes(const uint16_t* freq, uint32_t alphabet) {
  size_t bytes = 1;
  for (uint32_t s = 0; s < alphabet;) {
    bytes += VarintBytes(freq[s]);
    if (freq[s++] != 0) continue;
    uint32_t zeros = 0;
    while (s < alphabet && freq[s] == 0) ++zeros, ++s;
    bytes += VarintBytes(zeros);
  }
  return bytes;
}

template <typename T>
void Put(ByteBuffer* out, T v) {
  const uint8_t* b = reinterpret_cast<const uint8_t*>(&v);
  out->insert(out->end(), b, b + sizeof(T));
}

class Reader {
 public:
  explicit Reader(std::span<const uint8_t> b) : b_(b) {}
  template <typename T>
  Result<T> Get(const char* what) {
    if (b_.size() - off_ < sizeof(T)) return Status::Corrupt(std::string("rans payload truncated at ") + what);
    T v;
    std::memcpy(&v, b_.data() + off_, sizeof(T));
    off_ += sizeof(T);
    return v;
  }
  Result<uint32_t> Varint(const char* what) {
    uint32_t v = 0;
    for (int shift = 0; shift < 21; shift += 7) {
      KV_ASSIGN_OR_RETURN(uint8_t b, Get<uint8_t>(what));
      v |= uint32_t(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
    return Status::Corrupt(std::string("rans ") + what + " varint is too long");
  }
  Result<std::span<const uint8_t>> Bytes(uint64_t n, const char* what) {
    if (b_.size() - off_ < n) return Status::Corrupt(std::string("rans payload truncated in ") + what);
    auto s = b_.subspan(off_, n);
    off_ += n;
    return s;
  }
  size_t remaining() const { return b_.size() - off_; }

 private:
  std::span<const uint8_t> b_;
  size_t off_ = 0;
};

void SubtractRow(uint8_t* __restrict cur, const uint8_t* __restrict prev, uint32_t len, uint8_t mask) {
  for (uint32_t c = 0; c < len; ++c) cur[c] = uint8_t((cur[c] - prev[c]) & mask);
}
void Predict(uint8_t* codes, uint32_t n, uint32_t row, int bits) {
  // Last row first, so every row still subtracts its unchanged predecessor; within a row the
  // two spans are disjoint and the loop vectorises.
  const uint8_t mask = uint8_t((1u << bits) - 1);
  if (n <= row) return;
  const uint32_t full = n / row * row;
  SubtractRow(codes + full, codes + full - row, n - full, mask);
  for (uint32_t j = full; (j -= row) >= row;) SubtractRow(codes + j, codes + j - row, row, mask);
}
void Unpredict(uint8_t* codes, uint32_t n, uint32_t row, int bits) {
  // Row by row, so the inner loop has no dependence and vectorises.
  const uint8_t mask = uint8_t((1u << bits) - 1);
  uint32_t j = row;
  for (; j + row <= n; j += row) {
    uint8_t* cur = codes + j;
    const uint8_t* prev = cur - row;
    for (uint32_t c = 0; c < row; ++c) cur[c] = uint8_t((cur[c] + prev[c]) & mask);
  }
  for (; j < n; ++j) codes[j] = uint8_t((codes[j] + codes[j - row]) & mask);
}

// The symbols of one run: a code section's codes (unpacked, predicted if its context is), or
// every metadata byte of a context; padded with each table's likeliest symbol.
void CodeSymbols(const CodeSection& s, const uint8_t* payload, bool predicted, std::vector<uint8_t>& sym) {
  sym.resize(Padded(s.n_codes));
  quant::UnpackCodes(payload + s.offset, s.n_codes, s.bits, sym.data());
  if (predicted) Predict(sym.data(), s.n_codes, s.n_channel, s.bits);
}
void HalfSymbols(const Context& c, const std::vector<CodeSection>& secs, const uint8_t* payload,
                 std::vector<uint8_t>& sym) {
  sym.resize(Padded(c.n_symbols));
  size_t at = 0;
  for (uint32_t i : c.sections) {
    std::memcpy(sym.data() + at, payload + secs[i].offset, SectionBytes(secs[i]));
    at += SectionBytes(secs[i]);
  }
}

constexpr uint8_t kPredicted = 1, kShared = 2;  // code context flags

// Picks prediction and table sharing for one code context from its counts (cnt, cnt_pred: its
// n_channel tables of 2^bits each): the smallest estimated size, tables included, among what the
// strategy allows (counts of a disallowed variant are all zero and never chosen). Leaves the
// chosen counts in `cnt` and returns the flags.
uint8_t ChooseTables(Context& c, uint64_t* cnt_plain, const uint64_t* cnt_pred, Choice per_channel, Choice predict) {
  const uint32_t A = 1u << c.bits;
  std::vector<uint64_t> shared(A);
  std::vector<uint16_t> freq(A);
  auto table_bits = [&](const uint64_t* cnt) {
    Normalize(cnt, A, freq.data());
    return CostBits(cnt, A) + 8.0 * double(TableBytes(freq.data(), A));
  };
  auto sum_channels = [&](const uint64_t* cnt) {
    std::fill(shared.begin(), shared.end(), 0);
    for (uint32_t ch = 0; ch < c.n_channel; ++ch)
      for (uint32_t s = 0; s < A; ++s) shared[s] += cnt[size_t(ch) * A + s];
  };
  double best = INFINITY;
  uint8_t flags = 0;
  for (uint8_t f = 0; f < 4; ++f) {
    const bool pred = f & kPredicted, share = f & kShared;
    if ((predict == Choice::kYes && !pred) || (predict == Choice::kNo && pred) ||
        (per_channel == Choice::kYes && share) || (per_channel == Choice::kNo && !share)) {
      continue;
    }
    const uint64_t* cnt = pred ? cnt_pred : cnt_plain;
    double bits = 0;
    if (share) {
      sum_channels(cnt);
      bits = table_bits(shared.data());
    } else {
      for (uint32_t ch = 0; ch < c.n_channel; ++ch) bits += table_bits(cnt + size_t(ch) * A);
    }
    if (bits < best) best = bits, flags = f;
  }
  const uint64_t* cnt = (flags & kPredicted) ? cnt_pred : cnt_plain;
  if (flags & kShared) {
    sum_channels(cnt);
    std::fill_n(cnt_plain, size_t(c.n_channel) * A, 0);
    std::copy(shared.begin(), shared.end(), cnt_plain);
  } else if (flags & kPredicted) {
    std::copy_n(cnt, size_t(c.n_channel) * A, cnt_plain);
  }
  c.per_channel = !(flags & kShared);
  return flags;
}

// The runs of a payload in decoding order: coded metadata contexts, then the code sections.
struct RunRef {
  bool half;
  uint32_t index;  // context (metadata) or section (codes)
  uint32_t n;      // symbols before padding
};
std::vector<RunRef> MakeRuns(const Layout& L, const std::vector<CodeSection>& secs, const uint8_t* coded) {
  std::vector<RunRef> runs;
  for (uint32_t k = 0; k < L.half.size(); ++k) {
    if (coded[k]) runs.push_back({true, k, uint32_t(L.half[k].n_symbols)});
  }
  for (uint32_t i = 0; i < secs.size(); ++i) {
    if (secs[i].kind == Kind::kCodes) runs.push_back({false, i, secs[i].n_codes});
  }
  return runs;
}

// Stream bounds: stream s covers runs [bounds[s], bounds[s + 1]). A new stream begins where a
// code context begins once the current one holds kStreamSymbols codes. Metadata does not count:
// it is small next to the codes, and a stream of metadata alone would leave one of two threads
// idle on a one-layer frame.
std::vector<uint32_t> CutStreams(const std::vector<RunRef>& runs, const Layout& L) {
  std::vector<uint32_t> bounds = {0};
  uint64_t held = 0;
  for (uint32_t r = 0; r < runs.size(); ++r) {
    const bool starts_context = !runs[r].half && (r == 0 || runs[r - 1].half ||
                                                  L.context_of[runs[r - 1].index] != L.context_of[runs[r].index]);
    if (starts_context && held >= kStreamSymbols) bounds.push_back(r), held = 0;
    if (!runs[r].half) held += Padded(runs[r].n);
  }
  bounds.push_back(uint32_t(runs.size()));
  return bounds;
}

// Tasks of `per_task` consecutive streams each (the last may hold fewer), split into
// contiguous ranges of about equal work, one per thread of the pool: returns the first task of
// each range, then the task count. All metadata sits in the first stream, and a metadata symbol
// (byte alphabets: gathers) costs about 1.5x a code symbol on the VM of
// docs/results/codec_speed.md, so equal task counts would leave the first thread last.
std::vector<uint32_t> SplitByWork(const std::vector<RunRef>& runs, const std::vector<uint32_t>& bounds,
                                  uint32_t per_task, ThreadPool* pool) {
  const uint32_t n_streams = uint32_t(bounds.size() - 1), n_tasks = (n_streams + per_task - 1) / per_task;
  const uint32_t parts = pool != nullptr ? std::min<uint32_t>(uint32_t(pool->size()), n_tasks) : std::min(1u, n_tasks);
  std::vector<double> work(n_tasks + 1, 0);  // work[t]: of the tasks before t
  for (uint32_t t = 0; t < n_tasks; ++t) {
    double w = 0;
    for (uint32_t r = bounds[t * per_task]; r < bounds[std::min(n_streams, (t + 1) * per_task)]; ++r) {
      w += (runs[r].half ? 1.5 : 1.0) * Padded(runs[r].n);
    }
    work[t + 1] = work[t] + w;
  }
  std::vector<uint32_t> begin(parts + 1, n_tasks);
  begin[0] = 0;
  for (uint32_t p = 1; p < parts; ++p) {
    const double target = work[n_tasks] * p / parts;
    begin[p] = uint32_t(std::lower_bound(work.begin(), work.end(), target) - work.begin());
    begin[p] = std::clamp(begin[p], begin[p - 1], n_tasks);
  }
  return begin;
}

class RansStage final : public Stage {
 public:
  RansStage(Choice per_channel, Choice predict) : per_channel_(per_channel), predict_(predict) {}

  Status Encode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    if (ctx.sections == nullptr) return Status::Internal("rans needs the code sections of the previous stage");
    const std::vector<CodeSection>& secs = *ctx.sections;
    KV_ASSIGN_OR_RETURN(Layout L, MakeLayout(secs));
    const uint8_t* payload = in.bytes.data();
    for (const CodeSection& s : secs) {
      if (s.offset + SectionBytes(s) > in.bytes.size()) return Status::Internal("code section beyond the payload");
    }
    std::vector<uint64_t> counts(L.n_entries, 0);
    std::vector<uint16_t> freq(L.n_entries, 0);
    std::vector<uint32_t> entries(L.n_entries), rcp(L.n_entries);
    std::vector<uint8_t> likeliest(L.table_bits.size());
    auto build_table = [&](uint32_t t) {
      const uint32_t a = 1u << L.table_bits[t], o0 = L.table_offset[t];
      Normalize(&counts[o0], a, &freq[o0]);
      likeliest[t] = uint8_t(std::max_element(&freq[o0], &freq[o0] + a) - &freq[o0]);
      for (uint32_t s = 0, start = 0; s < a; start += freq[o0 + s], ++s) {
        entries[o0 + s] = start | uint32_t(freq[o0 + s]) << 16;
        rcp[o0 + s] = rans::EncodeReciprocal(freq[o0 + s]);
      }
    };
    // Pass 1, one code context per task: counts with and without prediction, the choice they
    // lead to and its tables (contexts own disjoint table slots).
    std::vector<uint8_t> flags(L.code.size()), coded(L.half.size());
    std::vector<std::vector<uint32_t>> lane_tables(L.code.size());  // the encoder's, where they apply
    ParallelFor(ctx.pool, L.code.size(), [&](uint64_t k) {
      Context& c = L.code[k];
      const uint32_t o0 = L.table_offset[c.first_table];
      thread_local std::vector<uint64_t> pred;
      thread_local std::vector<uint8_t> sym;
      pred.assign(size_t(c.n_channel) << c.bits, 0);
      {
        ContextCounter counter(c.n_channel, c.bits, predict_ != Choice::kYes ? &counts[o0] : nullptr,
                               predict_ != Choice::kNo ? pred.data() : nullptr);
        for (uint32_t i : c.sections) {
          CodeSymbols(secs[i], payload, false, sym);
          counter.Add(sym.data(), secs[i].n_codes);
        }
      }
      flags[k] = ChooseTables(c, &counts[o0], pred.data(), per_channel_, predict_);
      for (uint32_t t = c.first_table; t < c.first_table + c.n_tables(); ++t) build_table(t);
      lane_tables[k] = rans::EncodeLaneTables(RunOf(L, c, entries.data()), &rcp[o0]);
    });
    // Metadata is entropy coded only where that beats storing it, tables included; one
    // context per task (a 1024-token llama3-8b block has 128, 8 M symbols in all).
    ParallelFor(ctx.pool, L.half.size(), [&](uint64_t k) {
      thread_local std::vector<uint8_t> sym;
      const Context& c = L.half[k];
      HalfSymbols(c, secs, payload, sym);
      uint64_t* lo = &counts[L.table_offset[c.first_table]];
      uint64_t* hi = &counts[L.table_offset[c.first_table + 1]];
      for (uint64_t j = 0; j + 1 < c.n_symbols; j += 2) ++lo[sym[j]], ++hi[sym[j + 1]];
      double bytes = 0;
      for (uint32_t t = c.first_table; t < c.first_table + 2; ++t) {
        build_table(t);
        bytes += CostBits(&counts[L.table_offset[t]], 256) / 8 + double(TableBytes(&freq[L.table_offset[t]], 256));
      }
      coded[k] = bytes < double(c.n_symbols);
    });
    const std::vector<RunRef> runs = MakeRuns(L, secs, coded.data());
    const std::vector<uint32_t> bounds = CutStreams(runs, L);
    const size_t n_streams = bounds.size() - 1;
    // Pass 2, one stream per task: its runs backwards into its own region of one buffer, growing
    // downwards (at most one word per symbol).
    std::vector<uint64_t> region_end(n_streams);
    uint64_t n_symbols = 0, room = 0;
    for (size_t s = 0; s < n_streams; ++s) {
      for (uint32_t r = bounds[s]; r < bounds[s + 1]; ++r) n_symbols += Padded(runs[r].n), room += 2 * Padded(runs[r].n);
      region_end[s] = room += 64;
    }
    thread_local ByteBuffer stream_buffer;  // reused: a fresh buffer per call costs its page faults
    ByteBuffer& buffer = stream_buffer;     // this thread's, also where the pool's threads write
    buffer.resize(room);
    std::vector<rans::EncoderState> est(n_streams);
    auto encode_stream = [&](uint64_t s) {
      thread_local std::vector<uint8_t> sym;
      rans::EncoderState& e = est[s];
      std::fill(e.x, e.x + kLanes, kLow);
      e.ptr = buffer.data() + region_end[s];
      for (uint32_t r = bounds[s + 1]; r-- > bounds[s];) {
        const RunRef& run = runs[r];
        const Context& c = run.half ? L.half[run.index] : L.code[L.context_of[run.index]];
        if (run.half) HalfSymbols(c, secs, payload, sym);
        else CodeSymbols(secs[run.index], payload, flags[L.context_of[run.index]] & kPredicted, sym);
        for (size_t j = run.n; j < sym.size(); ++j) sym[j] = likeliest[c.first_table + (c.per_channel ? j % c.n_channel : 0)];
        static const std::vector<uint32_t> kNone;
        rans::EncodeRun(e, RunOf(L, c, entries.data()), &rcp[L.table_offset[c.first_table]],
                        run.half ? kNone : lane_tables[L.context_of[run.index]], uint32_t(sym.size()), sym.data());
      }
    };
    const std::vector<uint32_t> part_begin = SplitByWork(runs, bounds, 1, ctx.pool);
    ParallelFor(ctx.pool, part_begin.size() - 1, [&](uint64_t p) {
      for (uint32_t s = part_begin[p]; s < part_begin[p + 1]; ++s) encode_stream(s);
    });
    // Header, flags, tables, raw bytes, streams.
    ByteBuffer* o = out.bytes;
    Put<uint8_t>(o, kVersion);
    Put<uint8_t>(o, kProbBits);
    Put<uint8_t>(o, kLanes);
    Put<uint32_t>(o, uint32_t(L.code.size()));
    o->insert(o->end(), flags.begin(), flags.end());
    Put<uint32_t>(o, uint32_t(L.half.size()));
    o->insert(o->end(), coded.begin(), coded.end());
    uint32_t n_tables = 0;
    for (const Context& c : L.code) n_tables += c.n_tables();
    for (size_t k = 0; k < L.half.size(); ++k) n_tables += coded[k] ? 2 : 0;
    Put<uint32_t>(o, n_tables);
    auto put_tables = [&](const Context& c) {
      for (uint32_t t = c.first_table; t < c.first_table + c.n_tables(); ++t) {
        Put<uint8_t>(o, L.table_bits[t]);
        PutTable(o, &freq[L.table_offset[t]], 1u << L.table_bits[t]);
      }
    };
    for (const Context& c : L.code) put_tables(c);
    for (size_t k = 0; k < L.half.size(); ++k) {
      if (coded[k]) put_tables(L.half[k]);
    }
    // Raw: everything outside the coded sections, in order.
    const size_t raw_at = o->size();
    Put<uint64_t>(o, 0);
    uint64_t at = 0;
    for (size_t i = 0; i < secs.size(); ++i) {
      const CodeSection& s = secs[i];
      if (s.kind == Kind::kHalf && !coded[L.context_of[i]]) continue;
      o->insert(o->end(), payload + at, payload + s.offset);
      at = s.offset + SectionBytes(s);
    }
    o->insert(o->end(), payload + at, payload + in.bytes.size());
    const uint64_t raw_len = o->size() - raw_at - 8;
    std::memcpy(o->data() + raw_at, &raw_len, 8);
    Put<uint64_t>(o, n_symbols);
    Put<uint32_t>(o, uint32_t(n_streams));
    for (size_t s = 0; s < n_streams; ++s) {
      if (s > 0) Put<uint32_t>(o, bounds[s]);
      for (int k = 0; k < kLanes; ++k) Put<uint32_t>(o, est[s].x[k]);
      Put<uint64_t>(o, uint64_t(buffer.data() + region_end[s] - est[s].ptr));
    }
    // The streams, copied on the pool: 34 MiB for a 4-bit 1024-token llama3-8b block, a serial
    // copy of which held two-thread encoding back.
    std::vector<size_t> stream_at(n_streams + 1, o->size());
    for (size_t s = 0; s < n_streams; ++s) stream_at[s + 1] = stream_at[s] + (buffer.data() + region_end[s] - est[s].ptr);
    o->resize(stream_at[n_streams]);
    ParallelFor(PoolForBytes(ctx.pool, stream_at[n_streams] - stream_at[0]), n_streams, [&](uint64_t s) {
      std::memcpy(o->data() + stream_at[s], est[s].ptr, stream_at[s + 1] - stream_at[s]);
    });
    return Status::Ok();
  }

  Status Decode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    if (ctx.sections == nullptr) return Status::Internal("rans needs the code sections of the previous stage");
    const std::vector<CodeSection>& secs = *ctx.sections;
    KV_ASSIGN_OR_RETURN(Layout L, MakeLayout(secs));
    Reader r(in.bytes);
    KV_ASSIGN_OR_RETURN(uint8_t version, r.Get<uint8_t>("version"));
    KV_ASSIGN_OR_RETURN(uint8_t prob_bits, r.Get<uint8_t>("prob_bits"));
    KV_ASSIGN_OR_RETURN(uint8_t lanes, r.Get<uint8_t>("lanes"));
    KV_ASSIGN_OR_RETURN(uint32_t n_code, r.Get<uint32_t>("code contexts"));
    if (version != kVersion || prob_bits != kProbBits || lanes != kLanes ||
        n_code != L.code.size()) {
      return Status::Corrupt("rans header does not match the strategy and shape (version " + std::to_string(version) +
                             ", " + std::to_string(n_code) + " code contexts, expected " +
                             std::to_string(L.code.size()) + ")");
    }
    KV_ASSIGN_OR_RETURN(std::span<const uint8_t> flags, r.Bytes(n_code, "context flags"));
    KV_ASSIGN_OR_RETURN(uint32_t n_half, r.Get<uint32_t>("metadata contexts"));
    if (n_half != L.half.size()) {
      return Status::Corrupt("rans header does not match the strategy and shape (" + std::to_string(n_half) +
                             " metadata contexts, expected " + std::to_string(L.half.size()) + ")");
    }
    KV_ASSIGN_OR_RETURN(std::span<const uint8_t> coded, r.Bytes(n_half, "metadata flags"));
    for (size_t k = 0; k < n_code; ++k) {
      // A flag the strategy rules out is as corrupt as an unknown one.
      const uint8_t f = flags[k];
      if (f > 3 || (predict_ == Choice::kYes && !(f & kPredicted)) || (predict_ == Choice::kNo && (f & kPredicted)) ||
          (per_channel_ == Choice::kYes && (f & kShared)) || (per_channel_ == Choice::kNo && !(f & kShared))) {
        return Status::Corrupt("rans context flag " + std::to_string(f) + " does not fit the strategy");
      }
      L.code[k].per_channel = !(f & kShared);
    }
    for (uint8_t f : coded) {
      if (f > 1) return Status::Corrupt("rans metadata flag " + std::to_string(f) + " is not 0 or 1");
    }
    uint32_t want_tables = 0;
    for (const Context& c : L.code) want_tables += c.n_tables();
    for (uint32_t k = 0; k < n_half; ++k) want_tables += coded[k] ? 2 : 0;
    KV_ASSIGN_OR_RETURN(uint32_t n_tables, r.Get<uint32_t>("n_tables"));
    if (n_tables != want_tables) {
      return Status::Corrupt("rans header does not match the strategy and shape (" + std::to_string(n_tables) +
                             " tables, expected " + std::to_string(want_tables) + ")");
    }
    // Decoder tables: per symbol start | freq << 16.
    std::vector<uint32_t> entries(L.n_entries, 0);
    auto read_tables = [&](const Context& c) -> Status {
      for (uint32_t t = c.first_table; t < c.first_table + c.n_tables(); ++t) {
        KV_ASSIGN_OR_RETURN(uint8_t bits, r.Get<uint8_t>("table bits"));
        if (bits != L.table_bits[t]) {
          return Status::Corrupt("rans table " + std::to_string(t) + " has " + std::to_string(bits) + " bits, expected " +
                                 std::to_string(L.table_bits[t]));
        }
        const uint32_t a = 1u << bits;
        uint32_t* e = &entries[L.table_offset[t]];
        uint32_t sum = 0;
        for (uint32_t s = 0; s < a;) {
          KV_ASSIGN_OR_RETURN(uint32_t f, r.Varint("frequency"));
          if (f > kProbScale || sum + f > kProbScale) {
            return Status::Corrupt("rans table " + std::to_string(t) + " frequencies do not sum to 2^12");
          }
          e[s++] = sum | f << 16;
          sum += f;
          if (f != 0) continue;
          KV_ASSIGN_OR_RETURN(uint32_t zeros, r.Varint("zero run"));
          if (zeros > a - s) return Status::Corrupt("rans table " + std::to_string(t) + " has a zero run past its end");
          for (uint32_t z = 0; z < zeros; ++z) e[s++] = sum;
        }
        if (sum != kProbScale) return Status::Corrupt("rans table " + std::to_string(t) + " frequencies do not sum to 2^12");
      }
      return Status::Ok();
    };
    for (const Context& c : L.code) KV_RETURN_IF_ERROR(read_tables(c));
    for (uint32_t k = 0; k < n_half; ++k) {
      if (coded[k]) KV_RETURN_IF_ERROR(read_tables(L.half[k]));
    }
    KV_ASSIGN_OR_RETURN(uint64_t raw_len, r.Get<uint64_t>("raw_len"));
    KV_ASSIGN_OR_RETURN(std::span<const uint8_t> raw, r.Bytes(raw_len, "raw bytes"));
    KV_ASSIGN_OR_RETURN(uint64_t n_symbols, r.Get<uint64_t>("n_symbols"));
    // The output: coded sections, with the raw bytes filling everything between them.
    uint64_t covered = L.code_bytes, want_symbols = 0;
    for (uint32_t k = 0; k < n_half; ++k) {
      if (coded[k]) covered += L.half[k].n_symbols, want_symbols += Padded(L.half[k].n_symbols);
    }
    for (const CodeSection& s : secs) want_symbols += s.kind == Kind::kCodes ? Padded(s.n_codes) : 0;
    if (n_symbols != want_symbols) {
      return Status::Corrupt("rans payload holds " + std::to_string(n_symbols) + " symbols, the shape needs " +
                             std::to_string(want_symbols));
    }
    const std::vector<RunRef> runs = MakeRuns(L, secs, coded.data());
    KV_ASSIGN_OR_RETURN(uint32_t n_streams, r.Get<uint32_t>("n_streams"));
    if (n_streams == 0 || n_streams > std::max<size_t>(1, runs.size())) {
      return Status::Corrupt("rans payload has " + std::to_string(n_streams) + " streams for " +
                             std::to_string(runs.size()) + " runs of symbols");
    }
    // Stream s covers runs [bounds[s], bounds[s + 1]), as CutStreams wrote them.
    std::vector<uint32_t> bounds(n_streams + 1, 0);
    bounds[n_streams] = uint32_t(runs.size());
    std::vector<rans::DecoderState> states(n_streams);
    std::vector<uint64_t> stream_len(n_streams);
    for (uint32_t s = 0; s < n_streams; ++s) {
      if (s > 0) {
        KV_ASSIGN_OR_RETURN(bounds[s], r.Get<uint32_t>("stream start"));
        if (bounds[s] <= bounds[s - 1] || bounds[s] >= runs.size()) {
          return Status::Corrupt("rans stream " + std::to_string(s) + " starts at run " + std::to_string(bounds[s]) +
                                 ", after run " + std::to_string(bounds[s - 1]) + " and before run " +
                                 std::to_string(runs.size()) + " expected");
        }
      }
      for (int k = 0; k < kLanes; ++k) {
        KV_ASSIGN_OR_RETURN(states[s].x[k], r.Get<uint32_t>("states"));
        if (states[s].x[k] < kLow || states[s].x[k] >= (1u << 31)) return Status::Corrupt("rans state outside its range");
      }
      KV_ASSIGN_OR_RETURN(stream_len[s], r.Get<uint64_t>("stream_len"));
    }
    for (uint32_t s = 0; s < n_streams; ++s) {
      KV_ASSIGN_OR_RETURN(std::span<const uint8_t> bytes, r.Bytes(stream_len[s], "stream"));
      states[s].ptr = bytes.data();
      states[s].end = bytes.data() + bytes.size();
    }
    if (r.remaining() != 0) return Status::Corrupt("rans payload has " + std::to_string(r.remaining()) + " trailing bytes");
    const uint64_t total = raw_len + covered;
    if (total > ctx.max_decoded_bytes) return Status::OutOfRange("rans output above the decode limit");
    uint64_t need = 0;  // the end of the last coded section must fit in the output
    for (size_t i = 0; i < secs.size(); ++i) {
      if (secs[i].kind == Kind::kCodes || coded[L.context_of[i]]) need = secs[i].offset + SectionBytes(secs[i]);
    }
    if (need > total) return Status::Corrupt("rans raw bytes are too few for the sections (" + std::to_string(raw_len) + ")");
    ByteBuffer& o = *out.bytes;
    o.resize(total);
    uint64_t at = 0, raw_at = 0;
    for (size_t i = 0; i < secs.size(); ++i) {
      const CodeSection& s = secs[i];
      if (s.kind == Kind::kHalf && !coded[L.context_of[i]]) continue;
      std::memcpy(o.data() + at, raw.data() + raw_at, s.offset - at);
      raw_at += s.offset - at;
      at = s.offset + SectionBytes(s);
    }
    std::memcpy(o.data() + at, raw.data() + raw_at, raw_len - raw_at);
    // Lookup tables for the SIMD decoder: lane tables for small alphabets, slot tables for the
    // others where the context has enough symbols to pay for building them, and bucket tables
    // where code contexts qualify for decoding two streams side by side.
    struct Lookup {
      std::vector<uint32_t> lanes;
      std::vector<uint32_t> slots;
      std::vector<uint32_t> buckets;
    };
    const bool simd = rans::HaveSimdDecoder();
    auto lookup_for = [&](const Context& c) {
      Lookup t;
      const rans::Run run = RunOf(L, c, entries.data());
      t.lanes = rans::LaneTables(run);
      if (t.lanes.empty() && uint64_t(c.n_tables()) * kProbScale <= c.n_symbols) t.slots = rans::SlotTables(run);
      return t;
    };
    std::vector<Lookup> code_lookup(L.code.size());
    auto build_lookup = [&](uint64_t k) {
      code_lookup[k] = lookup_for(L.code[k]);
      if (simd) code_lookup[k].buckets = rans::BucketTables(RunOf(L, L.code[k], entries.data()));
    };
    // A few contexts (a one-layer frame has two) take microseconds: less than waking a thread.
    if (L.code.size() >= 16) ParallelFor(ctx.pool, L.code.size(), build_lookup);
    else for (uint64_t k = 0; k < L.code.size(); ++k) build_lookup(k);
    // A stream's place: runs [run, end) left, `done` symbols of the current one decoded into sym.
    struct Cursor {
      uint32_t stream = 0, run = 0, end = 0, done = 0;
      std::vector<uint8_t>* sym = nullptr;
    };
    std::vector<Status> errors(n_streams);
    auto context_of = [&](const RunRef& run) -> const Context& {
      return run.half ? L.half[run.index] : L.code[L.context_of[run.index]];
    };
    auto start = [&](Cursor& cur) {
      cur.done = 0;
      if (cur.run < cur.end) cur.sym->resize(Padded(runs[cur.run].n));
    };
    // Decodes what is left of the current run, writes the run to its sections and moves on.
    auto finish = [&](Cursor& cur) -> bool {
      const RunRef& run = runs[cur.run];
      const Context& c = context_of(run);
      std::vector<uint8_t>& sym = *cur.sym;
      Lookup half_lookup;  // a metadata context is one run: its lookup is built where it is used
      if (run.half) half_lookup = lookup_for(c);
      const Lookup& t = run.half ? half_lookup : code_lookup[L.context_of[run.index]];
      // A run is resumed only after a pair: DecodeRunPair's runs have one table for every channel
      // and DecodeRunPairLanes stops where its runs are back at channel 0, so the rest needs no
      // channel offset.
      if (!rans::DecodeRun(states[cur.stream], RunOf(L, c, entries.data()), t.lanes, t.slots,
                           uint32_t(sym.size()) - cur.done, sym.data() + cur.done)) {
        errors[cur.stream] = Status::Corrupt("rans stream " + std::to_string(cur.stream) + " ends early");
        return false;
      }
      if (run.half) {
        size_t at = 0;
        for (uint32_t i : c.sections) {
          std::memcpy(o.data() + secs[i].offset, sym.data() + at, SectionBytes(secs[i]));
          at += SectionBytes(secs[i]);
        }
      } else {
        const CodeSection& s = secs[run.index];
        if (flags[L.context_of[run.index]] & kPredicted) Unpredict(sym.data(), s.n_codes, s.n_channel, s.bits);
        quant::PackCodes(sym.data(), s.n_codes, s.bits, o.data() + s.offset);
      }
      ++cur.run;
      start(cur);
      return true;
    };
    auto check_end = [&](const Cursor& cur) {
      const rans::DecoderState& st = states[cur.stream];
      for (int l = 0; l < kLanes; ++l) {
        if (st.x[l] != kLow) {
          errors[cur.stream] =
              Status::Corrupt("rans stream " + std::to_string(cur.stream) + " is corrupt (a final state is off)");
          return;
        }
      }
      if (st.ptr != st.end) errors[cur.stream] = Status::Corrupt("rans stream " + std::to_string(cur.stream) + " has unread bytes");
    };
    // Each task decodes its streams into their sections of the output on its own thread: two
    // streams, whose runs with bucket tables decode side by side (rans::DecodeRunPair) at about
    // the speed of two threads decoding one stream each, so a one-layer frame (two streams)
    // takes one thread either way.
    const bool pairs = simd && n_streams >= 2;
    auto decode_task = [&](uint32_t task) {
      thread_local std::vector<uint8_t> sym[2];
      Cursor cur[2];
      const uint32_t n_cur = pairs && 2 * task + 1 < n_streams ? 2 : 1;
      for (uint32_t q = 0; q < n_cur; ++q) {
        const uint32_t k = pairs ? uint32_t(2 * task) + q : uint32_t(task);
        cur[q] = Cursor{k, bounds[k], bounds[k + 1], 0, &sym[q]};
        start(cur[q]);
      }
      Cursor& a = cur[0];
      Cursor& b = cur[1];
      // How a run pairs: by bucket tables (one table for all channels), by 16-symbol lane tables
      // (rans::DecodeRunPairLanes), or not at all (metadata, other alphabets).
      enum class Pairs { kNo, kBuckets, kLanes };
      auto pairs_by = [&](const RunRef& run) {
        if (run.half) return Pairs::kNo;
        const Lookup& t = code_lookup[L.context_of[run.index]];
        if (!t.buckets.empty()) return Pairs::kBuckets;
        return L.code[L.context_of[run.index]].bits == 4 && !t.lanes.empty() ? Pairs::kLanes : Pairs::kNo;
      };
      while (n_cur == 2 && a.run < a.end && b.run < b.end) {
        const RunRef& ra = runs[a.run];
        const RunRef& rb = runs[b.run];
        const Pairs pa = pairs_by(ra), pb = pairs_by(rb);
        if (pa == Pairs::kNo || (pa != pb && pb != Pairs::kNo)) {
          if (!finish(a)) return;
          continue;
        }
        if (pb == Pairs::kNo) {
          if (!finish(b)) return;
          continue;
        }
        const uint32_t left_a = uint32_t(a.sym->size()) - a.done, left_b = uint32_t(b.sym->size()) - b.done;
        const uint32_t n = std::min(left_a, left_b);
        const Lookup& la = code_lookup[L.context_of[ra.index]];
        const Lookup& lb = code_lookup[L.context_of[rb.index]];
        const uint32_t got =
            pa == Pairs::kBuckets
                ? rans::DecodeRunPair(states[a.stream], la.buckets, a.sym->data() + a.done, states[b.stream], lb.buckets,
                                      b.sym->data() + b.done, n)
                : rans::DecodeRunPairLanes(states[a.stream], RunOf(L, L.code[L.context_of[ra.index]], entries.data()),
                                           la.lanes, a.sym->data() + a.done, states[b.stream],
                                           RunOf(L, L.code[L.context_of[rb.index]], entries.data()), lb.lanes,
                                           b.sym->data() + b.done, n);
        a.done += got;
        b.done += got;
        // A stream near its end stops the pair: both runs are finished alone.
        if ((got < n || got == left_a) && !finish(a)) return;
        if ((got < n || got == left_b) && !finish(b)) return;
      }
      for (uint32_t q = 0; q < n_cur; ++q) {
        while (cur[q].run < cur[q].end) {
          if (!finish(cur[q])) return;
        }
        check_end(cur[q]);
      }
    };
    const std::vector<uint32_t> part_begin = SplitByWork(runs, bounds, pairs ? 2 : 1, ctx.pool);
    ParallelFor(ctx.pool, part_begin.size() - 1, [&](uint64_t p) {
      for (uint32_t t = part_begin[p]; t < part_begin[p + 1]; ++t) decode_task(t);
    });
    for (const Status& e : errors) KV_RETURN_IF_ERROR(e);
    return Status::Ok();
  }

 private:
  Choice per_channel_, predict_;
};

Result<std::unique_ptr<Stage>> MakeRans(const StageSpec& spec, const CodecEnv&) {
  const std::string& t = spec.Get("tables");
  const std::string& p = spec.Get("predict");
  return std::unique_ptr<Stage>(new RansStage(t == "channel" ? Choice::kYes : t == "part" ? Choice::kNo : Choice::kAuto,
                                              p == "token" ? Choice::kYes : p == "none" ? Choice::kNo : Choice::kAuto));
}

}  // namespace

StageRegistration RansStageRegistration() {
  StageInfo info;
  info.name = "rans";
  info.summary = "static rANS over quantisation codes and their fp16 ranges, tables per channel or per layer/part";
  info.input = DataKind::kSymbols;
  info.output = DataKind::kBytes;
  info.lossless = true;
  info.params = {{"tables", ParamSpec::Type::kEnum, 0, 0, {"auto", "channel", "part"}, "auto",
                  "one frequency table per (layer, K/V, channel), or per (layer, K/V) (auto: per layer and K/V, "
                  "whichever is smaller with the tables' bytes)"},
                 {"predict", ParamSpec::Type::kEnum, 0, 0, {"auto", "token", "none"}, "auto",
                  "code each value as its difference from the same channel one token earlier (auto: per "
                  "layer and K/V, where that is smaller)"}};
  return {info, &MakeRans};
}

}  // namespace kvserve
