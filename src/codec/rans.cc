// rans(tables=channel|part, predict=token|none): static rANS entropy coding of the quantisation codes that the
// previous stage (quant) reports as code sections, with one frequency table per (layer, K/V part,
// channel) — CacheGen found per-channel statistics matter — or per (layer, part). Bytes outside
// the code sections (ranges, residual tokens) pass through unchanged.
//
// Coder: byte-wise rANS, 32-bit states, 11-bit probabilities, 4 interleaved states sharing one
// stream (the encoder runs backwards, so the decoder reads forwards). Every state must end where
// the encoder started it, which catches corrupted streams the checksum did not (it always does).
//
// Payload: u8 version | u8 prob_bits | u8 tables (0 channel, 1 part) | u8 n_states | u32 n_tables
//          | per table: u8 bits, (1 << bits) x varint frequency | u64 raw_len, raw bytes
//          | u64 n_symbols | n_states x u32 final state | u64 stream_len, stream bytes
#include <algorithm>
#include <bit>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "codec/quant_kernels.h"
#include "codec/stage.h"

namespace kvserve {
namespace {

constexpr uint32_t kProbBits = 11;
constexpr uint32_t kProbScale = 1u << kProbBits;
constexpr uint32_t kRansLow = 1u << 23;
constexpr int kStates = 4;

// Table numbering: contexts in order of first appearance, each with n_channel tables (channel
// mode) or one (part mode).
struct TableMap {
  std::vector<uint32_t> context_base;  // indexed by context id
  std::vector<uint8_t> bits;           // per table
  std::vector<uint32_t> offset;        // per table: first entry in the per-symbol arrays
  uint32_t n_tables = 0;
  uint32_t n_entries = 0;              // sum of the tables' alphabet sizes
};

Result<TableMap> MapTables(const std::vector<CodeSection>& sections, bool per_channel) {
  TableMap m;
  std::vector<uint32_t> ctx_channels, ctx_bits;
  for (const CodeSection& s : sections) {
    if (s.context >= m.context_base.size()) {
      m.context_base.resize(s.context + 1, UINT32_MAX);
      ctx_channels.resize(s.context + 1, 0);
      ctx_bits.resize(s.context + 1, 0);
    }
    if (s.bits < 1 || s.bits > 8) return Status::Internal("code section with " + std::to_string(s.bits) + " bits");
    if (m.context_base[s.context] == UINT32_MAX) {
      m.context_base[s.context] = m.n_tables;
      ctx_channels[s.context] = s.n_channel;
      ctx_bits[s.context] = s.bits;
      const uint32_t n = per_channel ? s.n_channel : 1;
      m.n_tables += n;
      m.bits.insert(m.bits.end(), n, s.bits);
      for (uint32_t k = 0; k < n; ++k) {
        m.offset.push_back(m.n_entries);
        m.n_entries += 1u << s.bits;
      }
    } else if (ctx_channels[s.context] != s.n_channel || ctx_bits[s.context] != s.bits) {
      return Status::Internal("code sections of one context disagree on bits or channels");
    }
  }
  return m;
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

// Encoder side of one symbol: division by the frequency replaced by a multiply with a
// precomputed reciprocal (x / f == (x * rcp) >> 32 >> shift for every 32-bit x).
struct EncSymbol {
  uint32_t x_max = 0, rcp_freq = 0;
  uint32_t bias = 0, cmpl_freq = 0;
  uint32_t rcp_shift = 0;
};

EncSymbol MakeEncSymbol(uint32_t start, uint32_t freq) {
  EncSymbol e;
  e.x_max = ((kRansLow >> kProbBits) << 8) * freq;
  e.cmpl_freq = kProbScale - freq;
  if (freq < 2) {
    // x / 1 = x: a reciprocal of 2^32 - 1 with the bias below makes the formula exact.
    e.rcp_freq = ~0u;
    e.rcp_shift = 0;
    e.bias = start + kProbScale - 1;
  } else {
    uint32_t shift = 0;
    while (freq > (1u << shift)) ++shift;
    e.rcp_freq = uint32_t(((uint64_t(1) << (shift + 31)) + freq - 1) / freq);
    e.rcp_shift = shift - 1;
    e.bias = start;
  }
  return e;
}

inline void EncPut(uint32_t& x, uint8_t*& ptr, const EncSymbol& e) {
  while (x >= e.x_max) {
    *--ptr = uint8_t(x & 0xff);
    x >>= 8;
  }
  const uint32_t q = uint32_t((uint64_t(x) * e.rcp_freq) >> 32) >> e.rcp_shift;
  x = x + e.bias + q * e.cmpl_freq;  // == (x / f) * M + x % f + start
}

// Symbol whose [start, start + freq) holds `slot`: the number of starts <= slot, minus one.
inline uint32_t FindSymbol(const uint16_t* start, uint32_t alphabet, uint32_t slot) {
  uint32_t lo = 0, hi = alphabet;  // start[lo] <= slot < start[hi] (start[alphabet] = scale)
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) / 2;
    if (start[mid] <= slot) lo = mid;
    else hi = mid;
  }
  return lo;
}

// For alphabets of at most 16 symbols: the starts padded to 16 lanes (unused lanes = 0x7fff),
// searched with one vector compare.
inline uint32_t FindSymbol16(const uint16_t* start16, uint32_t slot) {
#if defined(__AVX2__)
  const __m256i st = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(start16));
  const __m256i gt = _mm256_cmpgt_epi16(st, _mm256_set1_epi16(int16_t(slot)));  // start > slot
  const uint32_t le = ~uint32_t(_mm256_movemask_epi8(gt));                       // 2 bits per lane
  return uint32_t(std::popcount(le)) / 2 - 1;
#else
  uint32_t n = 0;
  for (int s = 0; s < 16; ++s) n += start16[s] <= slot;
  return n - 1;
#endif
}

// Frequencies are stored as LEB128 varints: most are below 128, and most tables are sparse.
void PutVarint(ByteBuffer* out, uint32_t v) {
  while (v >= 0x80) {
    out->push_back(uint8_t(v | 0x80));
    v >>= 7;
  }
  out->push_back(uint8_t(v));
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

// With prediction, code j is replaced by its difference (mod 2^bits) from the code of the same
// channel one row (token) earlier in the section: KV changes slowly along tokens, so residuals
// gather at 0 where the codes themselves spread over the range.
void Predict(uint8_t* codes, uint32_t n, uint32_t row, int bits) {
  const uint8_t mask = uint8_t((1u << bits) - 1);
  for (uint32_t j = n; j-- > row;) codes[j] = uint8_t((codes[j] - codes[j - row]) & mask);
}
void Unpredict(uint8_t* codes, uint32_t n, uint32_t row, int bits) {
  const uint8_t mask = uint8_t((1u << bits) - 1);
  for (uint32_t j = row; j < n; ++j) codes[j] = uint8_t((codes[j] + codes[j - row]) & mask);
}

class RansStage final : public Stage {
 public:
  RansStage(bool per_channel, bool predict) : per_channel_(per_channel), predict_(predict) {}

  Status Encode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    if (ctx.sections == nullptr) return Status::Internal("rans needs the code sections of the previous stage");
    const std::vector<CodeSection>& secs = *ctx.sections;
    KV_ASSIGN_OR_RETURN(TableMap tm, MapTables(secs, per_channel_));
    const uint8_t* payload = in.bytes.data();
    // Pass 1: counts per table.
    std::vector<uint64_t> counts(tm.n_entries, 0);
    std::vector<uint8_t> codes;
    uint64_t n_symbols = 0;
    for (const CodeSection& s : secs) {
      if (s.offset + quant::PackedBytes(s.n_codes, s.bits) > in.bytes.size()) {
        return Status::Internal("code section beyond the payload");
      }
      codes.resize(s.n_codes);
      quant::UnpackCodes(payload + s.offset, s.n_codes, s.bits, codes.data());
      if (predict_) Predict(codes.data(), s.n_codes, s.n_channel, s.bits);
      const uint32_t base = tm.context_base[s.context];
      for (uint32_t j = 0, ch = 0; j < s.n_codes; ++j) {
        ++counts[tm.offset[base + (per_channel_ ? ch : 0)] + codes[j]];
        if (++ch == s.n_channel) ch = 0;
      }
      n_symbols += s.n_codes;
    }
    std::vector<uint16_t> freq(tm.n_entries, 0);
    std::vector<EncSymbol> enc(tm.n_entries);
    for (uint32_t t = 0; t < tm.n_tables; ++t) {
      const uint32_t a = 1u << tm.bits[t], o0 = tm.offset[t];
      Normalize(&counts[o0], a, &freq[o0]);
      for (uint32_t s = 0, start = 0; s < a; start += freq[o0 + s], ++s) enc[o0 + s] = MakeEncSymbol(start, freq[o0 + s]);
    }
    // Pass 2: encode backwards into a stream that grows downwards.
    thread_local ByteBuffer stream;  // reused: a fresh buffer per call costs its page faults
    stream.resize(n_symbols * 2 + 64);  // at most 2 bytes per symbol at 11-bit precision
    uint8_t* ptr = stream.data() + stream.size();
    uint32_t state[kStates];
    std::fill(state, state + kStates, kRansLow);
    uint64_t i = n_symbols;
    for (size_t si = secs.size(); si-- > 0;) {
      const CodeSection& s = secs[si];
      codes.resize(s.n_codes);
      quant::UnpackCodes(payload + s.offset, s.n_codes, s.bits, codes.data());
      if (predict_) Predict(codes.data(), s.n_codes, s.n_channel, s.bits);
      const uint32_t base = tm.context_base[s.context];
      uint32_t ch = per_channel_ ? (s.n_codes - 1) % s.n_channel : 0;
      for (uint32_t j = s.n_codes; j-- > 0;) {
        --i;
        EncPut(state[i % kStates], ptr, enc[tm.offset[base + ch] + codes[j]]);
        if (per_channel_) ch = ch == 0 ? s.n_channel - 1 : ch - 1;
      }
    }
    // Header, tables, raw bytes, states, stream.
    ByteBuffer* o = out.bytes;
    Put<uint8_t>(o, 1);
    Put<uint8_t>(o, kProbBits);
    Put<uint8_t>(o, per_channel_ ? 0 : 1);
    Put<uint8_t>(o, kStates);
    Put<uint32_t>(o, tm.n_tables);
    for (uint32_t t = 0; t < tm.n_tables; ++t) {
      Put<uint8_t>(o, tm.bits[t]);
      for (uint32_t s = 0; s < (1u << tm.bits[t]); ++s) PutVarint(o, freq[tm.offset[t] + s]);
    }
    uint64_t raw_len = in.bytes.size();
    for (const CodeSection& s : secs) raw_len -= quant::PackedBytes(s.n_codes, s.bits);
    Put<uint64_t>(o, raw_len);
    uint64_t at = 0;
    for (const CodeSection& s : secs) {
      o->insert(o->end(), payload + at, payload + s.offset);
      at = s.offset + quant::PackedBytes(s.n_codes, s.bits);
    }
    o->insert(o->end(), payload + at, payload + in.bytes.size());
    Put<uint64_t>(o, n_symbols);
    for (int k = 0; k < kStates; ++k) Put<uint32_t>(o, state[k]);
    const uint64_t stream_len = uint64_t(stream.data() + stream.size() - ptr);
    Put<uint64_t>(o, stream_len);
    o->insert(o->end(), ptr, ptr + stream_len);
    return Status::Ok();
  }

  Status Decode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    if (ctx.sections == nullptr) return Status::Internal("rans needs the code sections of the previous stage");
    const std::vector<CodeSection>& secs = *ctx.sections;
    KV_ASSIGN_OR_RETURN(TableMap tm, MapTables(secs, per_channel_));
    Reader r(in.bytes);
    KV_ASSIGN_OR_RETURN(uint8_t version, r.Get<uint8_t>("version"));
    KV_ASSIGN_OR_RETURN(uint8_t prob_bits, r.Get<uint8_t>("prob_bits"));
    KV_ASSIGN_OR_RETURN(uint8_t mode, r.Get<uint8_t>("tables"));
    KV_ASSIGN_OR_RETURN(uint8_t n_states, r.Get<uint8_t>("n_states"));
    KV_ASSIGN_OR_RETURN(uint32_t n_tables, r.Get<uint32_t>("n_tables"));
    if (version != 1 || prob_bits != kProbBits || mode != (per_channel_ ? 0 : 1) || n_states != kStates ||
        n_tables != tm.n_tables) {
      return Status::Corrupt("rans header does not match the strategy and shape (version " + std::to_string(version) +
                             ", " + std::to_string(n_tables) + " tables, expected " + std::to_string(tm.n_tables) + ")");
    }
    // Tables: frequencies must sum to the scale. `start` keeps one extra entry per table (the
    // scale) so the symbol search needs no bounds test.
    std::vector<uint16_t> freq(tm.n_entries, 0), start(tm.n_entries + n_tables, 0);
    std::vector<uint32_t> start_off(n_tables);
    std::vector<uint16_t> start16(size_t(n_tables) * 16);
    for (uint32_t t = 0, so = 0; t < n_tables; ++t) {
      KV_ASSIGN_OR_RETURN(uint8_t bits, r.Get<uint8_t>("table bits"));
      if (bits != tm.bits[t]) return Status::Corrupt("rans table " + std::to_string(t) + " has " + std::to_string(bits) + " bits");
      const uint32_t a = 1u << bits;
      start_off[t] = so;
      uint32_t sum = 0;
      for (uint32_t s = 0; s < a; ++s) {
        KV_ASSIGN_OR_RETURN(uint32_t f, r.Varint("frequency"));
        if (f > kProbScale) return Status::Corrupt("rans table " + std::to_string(t) + " has a frequency above 2^11");
        freq[tm.offset[t] + s] = uint16_t(f);
        start[so + s] = uint16_t(std::min<uint32_t>(sum, kProbScale));
        sum += f;
      }
      start[so + a] = kProbScale;
      so += a + 1;
      if (a <= 16) {
        std::fill_n(&start16[size_t(t) * 16], 16, uint16_t(0x7fff));
        std::copy_n(&start[start_off[t]], a, &start16[size_t(t) * 16]);
      }
      if (sum != kProbScale) return Status::Corrupt("rans table " + std::to_string(t) + " frequencies do not sum to 2^11");
    }
    KV_ASSIGN_OR_RETURN(uint64_t raw_len, r.Get<uint64_t>("raw_len"));
    KV_ASSIGN_OR_RETURN(std::span<const uint8_t> raw, r.Bytes(raw_len, "raw bytes"));
    KV_ASSIGN_OR_RETURN(uint64_t n_symbols, r.Get<uint64_t>("n_symbols"));
    uint32_t state[kStates];
    for (int k = 0; k < kStates; ++k) {
      KV_ASSIGN_OR_RETURN(state[k], r.Get<uint32_t>("states"));
      if (state[k] < kRansLow) return Status::Corrupt("rans state below its lower bound");
    }
    KV_ASSIGN_OR_RETURN(uint64_t stream_len, r.Get<uint64_t>("stream_len"));
    KV_ASSIGN_OR_RETURN(std::span<const uint8_t> stream, r.Bytes(stream_len, "stream"));
    if (r.remaining() != 0) return Status::Corrupt("rans payload has " + std::to_string(r.remaining()) + " trailing bytes");
    uint64_t code_bytes = 0, want_symbols = 0, prev_end = 0;
    for (const CodeSection& s : secs) {
      if (s.offset < prev_end) return Status::Internal("code sections overlap");
      prev_end = s.offset + quant::PackedBytes(s.n_codes, s.bits);
      code_bytes += quant::PackedBytes(s.n_codes, s.bits);
      want_symbols += s.n_codes;
    }
    if (n_symbols != want_symbols || prev_end > raw_len + code_bytes) {
      return Status::Corrupt("rans payload holds " + std::to_string(n_symbols) + " symbols, the shape needs " +
                             std::to_string(want_symbols));
    }
    if (raw_len + code_bytes > ctx.max_decoded_bytes) return Status::OutOfRange("rans output above the decode limit");
    ByteBuffer& o = *out.bytes;
    o.resize(raw_len + code_bytes);
    // Each symbol reads at most two bytes (11-bit probabilities, 2^23 lower bound), so a group
    // of four needs at most eight: the hot loop checks bounds once per group.
    const uint8_t* ptr = stream.data();
    const uint8_t* const end = stream.data() + stream.size();
    std::vector<uint8_t> codes;
    uint64_t at = 0, raw_at = 0;
    uint32_t x0 = state[0], x1 = state[1], x2 = state[2], x3 = state[3];
    auto renorm = [&ptr](uint32_t& x) {
      while (x < kRansLow) x = (x << 8) | *ptr++;
    };
    bool overrun = false;
    auto renorm_checked = [&](uint32_t& x) {
      while (x < kRansLow) {
        if (ptr == end) {
          overrun = true;
          return;
        }
        x = (x << 8) | *ptr++;
      }
    };
    for (const CodeSection& s : secs) {
      const uint64_t gap = s.offset - at;
      std::memcpy(o.data() + at, raw.data() + raw_at, gap);
      raw_at += gap;
      codes.resize(s.n_codes);
      const uint32_t base = tm.context_base[s.context];
      // n_codes is a multiple of 8, so every section starts on state 0 and fills groups of four.
      uint32_t ch = 0;
      auto table = [&]() {
        const uint32_t t = base + (per_channel_ ? ch : 0);
        if (++ch == s.n_channel) ch = 0;
        return t;
      };
      auto decode_one = [&](uint32_t& x, uint32_t t) -> uint8_t {
        const uint32_t slot = x & (kProbScale - 1);
        const uint16_t* st = &start[start_off[t]];
        const uint32_t sym = s.bits <= 4 ? FindSymbol16(&start16[size_t(t) * 16], slot) : FindSymbol(st, 1u << s.bits, slot);
        x = freq[tm.offset[t] + sym] * (x >> kProbBits) + slot - st[sym];
        return uint8_t(sym);
      };
      for (uint32_t j = 0; j < s.n_codes; j += 4) {
        const uint32_t t0 = table(), t1 = table(), t2 = table(), t3 = table();
        codes[j] = decode_one(x0, t0);
        codes[j + 1] = decode_one(x1, t1);
        codes[j + 2] = decode_one(x2, t2);
        codes[j + 3] = decode_one(x3, t3);
        if (end - ptr >= 8) {
          renorm(x0), renorm(x1), renorm(x2), renorm(x3);
        } else {
          renorm_checked(x0), renorm_checked(x1), renorm_checked(x2), renorm_checked(x3);
          if (overrun) return Status::Corrupt("rans stream ends early");
        }
      }
      if (predict_) Unpredict(codes.data(), s.n_codes, s.n_channel, s.bits);
      quant::PackCodes(codes.data(), s.n_codes, s.bits, o.data() + s.offset);
      at = s.offset + quant::PackedBytes(s.n_codes, s.bits);
    }
    state[0] = x0, state[1] = x1, state[2] = x2, state[3] = x3;
    std::memcpy(o.data() + at, raw.data() + raw_at, raw_len - raw_at);
    for (int k = 0; k < kStates; ++k) {
      if (state[k] != kRansLow) return Status::Corrupt("rans stream is corrupt (a final state is off)");
    }
    static_assert(kStates == 4, "the decode loop is unrolled for four states");
    if (ptr != end) return Status::Corrupt("rans stream has unread bytes");
    return Status::Ok();
  }

 private:
  bool per_channel_, predict_;
};

Result<std::unique_ptr<Stage>> MakeRans(const StageSpec& spec) {
  return std::unique_ptr<Stage>(new RansStage(spec.Get("tables") == "channel", spec.Get("predict") == "token"));
}

}  // namespace

StageRegistration RansStageRegistration() {
  StageInfo info;
  info.name = "rans";
  info.summary = "static rANS over quantisation codes, frequency tables per channel or per layer/part";
  info.input = DataKind::kSymbols;
  info.output = DataKind::kBytes;
  info.lossless = true;
  info.params = {{"tables", ParamSpec::Type::kEnum, 0, 0, {"channel", "part"}, "channel",
                  "one frequency table per (layer, K/V, channel), or per (layer, K/V)"},
                 {"predict", ParamSpec::Type::kEnum, 0, 0, {"token", "none"}, "token",
                  "code each value as its difference from the same channel one token earlier"}};
  return {info, &MakeRans};
}

}  // namespace kvserve
