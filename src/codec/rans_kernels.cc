// rANS loops: plain scalar references and AVX-512 versions that code two vectors of 16 states per
// step (decode: lane-table compares, slot tables or gathers, expand-load renormalisation, and
// two streams at once over bucket tables;
// encode: gathered tables, compress-stored words).
#include "codec/rans_kernels.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <numeric>

#include "kvserve/cpu.h"

#ifdef KVSERVE_HAVE_AVX512_REGION
#include <immintrin.h>
#define KVSERVE_RANS_AVX512 1
// GCC 12 reports the intrinsics' own _mm512_undefined_*() operands (the gathers' pass-through)
// as "may be used uninitialized" once inlined; the values are never read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

namespace kvserve::rans {
namespace {

// Largest symbol whose start is <= slot. Symbols of zero frequency share their start with the
// next symbol, so the search never ends on one; no sentinel is needed since slot < scale.
inline uint32_t FindSymbol(const uint32_t* table, int bits, uint32_t slot) {
  uint32_t s = 0;
  for (uint32_t step = (1u << bits) >> 1; step; step >>= 1) {
    if ((table[s + step] & 0xffff) <= slot) s += step;
  }
  return s;
}

// The decoders' packed entry of symbol s (table entry start | freq << 16): start << 20 |
// freq << 7 | s, so that comparing it with a slot's key (see PackedKey) compares the starts.
// Trailing symbols of zero frequency start at the scale, which does not fit 12 bits: they must
// never match, and all ones never does.
inline uint32_t PackedEntry(uint32_t entry, uint32_t s) {
  const uint32_t start = entry & 0xffff;
  return start >= kProbScale ? ~0u : start << 20 | (entry >> 16) << 7 | s;
}

}  // namespace

std::vector<uint32_t> LaneTables(const Run& r) {
  const uint32_t C = r.table_stride == 0 ? 1 : r.n_channel;
  if (r.bits > 4 || (16 % C != 0 && C % 16 != 0)) return {};
  const uint32_t A = 1u << r.bits, n_block = C % 16 == 0 ? C / 16 : 1;
  std::vector<uint32_t> t(size_t(n_block) * A * 16);
  for (uint32_t b = 0; b < n_block; ++b) {
    for (uint32_t l = 0; l < 16; ++l) {
      const uint32_t* table = r.entries + size_t((b * 16 + l) % C) * r.table_stride;
      for (uint32_t s = 0; s < A; ++s) t[(size_t(b) * A + s) * 16 + l] = PackedEntry(table[s], s);
    }
  }
  return t;
}

std::vector<uint32_t> BucketTables(const Run& r) {
  if (r.bits > 7 || (r.table_stride != 0 && r.n_channel != 1)) return {};
  constexpr uint32_t kWidth = kProbScale / kBuckets;
  const uint32_t A = 1u << r.bits;
  std::vector<uint32_t> base(kBuckets, 0);
  std::vector<std::vector<uint32_t>> inside(kBuckets);
  for (uint32_t b = 0; b < kBuckets; ++b) {
    // Symbol 0 starts at 0; a symbol of zero frequency shares its start with the next one, so
    // the last symbol starting at or before the bucket has a frequency. Starts at the scale
    // (trailing zero frequencies) fall in no bucket.
    for (uint32_t s = 0; s < A; ++s) {
      const uint32_t start = r.entries[s] & 0xffff;
      if (start <= b * kWidth) base[b] = PackedEntry(r.entries[s], s);
      else if (start < (b + 1) * kWidth) inside[b].push_back(PackedEntry(r.entries[s], s));
    }
    if (inside[b].size() > kMaxBounds) return {};
  }
  size_t bounds = 0;
  for (const auto& v : inside) bounds = std::max(bounds, v.size());
  std::vector<uint32_t> t((1 + bounds) * kBuckets, ~0u);
  std::copy(base.begin(), base.end(), t.begin());
  for (uint32_t b = 0; b < kBuckets; ++b) {
    for (size_t k = 0; k < inside[b].size(); ++k) t[(1 + k) * kBuckets + b] = inside[b][k];
  }
  return t;
}

std::vector<uint32_t> EncodeLaneTables(const Run& r, const uint32_t* rcp) {
  // One shared table needs none: EncodeRun keeps it in registers.
  const uint32_t C = r.n_channel;
  if (r.table_stride == 0 || r.bits > 4 || (16 % C != 0 && C % 16 != 0)) return {};
  const uint32_t A = 1u << r.bits, n_block = C % 16 == 0 ? C / 16 : 1;
  std::vector<uint32_t> t(size_t(n_block) * 2 * A * 16);
  for (uint32_t b = 0; b < n_block; ++b) {
    uint32_t* block = &t[size_t(b) * 2 * A * 16];
    for (uint32_t l = 0; l < 16; ++l) {
      const size_t table = size_t((b * 16 + l) % C) * r.table_stride;
      for (uint32_t s = 0; s < A; ++s) {
        block[s * 16 + l] = r.entries[table + s];
        block[(A + s) * 16 + l] = rcp[table + s];
      }
    }
  }
  return t;
}

std::vector<uint32_t> SlotTables(const Run& r) {
  const uint32_t n_tables = r.table_stride == 0 ? 1 : r.n_channel, A = 1u << r.bits;
  std::vector<uint32_t> t(size_t(n_tables) * kProbScale, 0);
  for (uint32_t k = 0; k < n_tables; ++k) {
    const uint32_t* table = r.entries + size_t(k) * r.table_stride;
    uint32_t* lut = &t[size_t(k) * kProbScale];
    for (uint32_t s = 0; s < A; ++s) {
      const uint32_t start = table[s] & 0xffff, freq = table[s] >> 16;
      if (freq == 0 || start + freq > kProbScale) continue;
      for (uint32_t i = 0; i < freq; ++i) lut[start + i] = (freq - 1) << 20 | i << 8 | s;
    }
  }
  return t;
}

bool DecodeRunScalar(DecoderState& st, const Run& r, uint32_t begin, uint32_t n, uint8_t* out) {
  for (uint32_t j = begin; j < n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const uint32_t* table = r.entries + size_t((j + l) % r.n_channel) * r.table_stride;
      uint32_t& x = st.x[l];
      const uint32_t slot = x & (kProbScale - 1);
      const uint32_t s = FindSymbol(table, r.bits, slot);
      const uint32_t e = table[s];
      x = (e >> 16) * (x >> kProbBits) + slot - (e & 0xffff);
      out[j + l] = uint8_t(s);
    }
    for (int l = 0; l < kLanes; ++l) {
      if (st.x[l] >= kLow) continue;
      if (st.end - st.ptr < 2) return false;
      uint16_t w;
      std::memcpy(&w, st.ptr, 2);
      st.ptr += 2;
      st.x[l] = (st.x[l] << 16) | w;
    }
  }
  return true;
}

uint32_t EncodeReciprocal(uint32_t freq) {
  if (freq < 2) return ~0u;
  uint32_t shift = 0;
  while (freq > (1u << shift)) ++shift;
  return uint32_t(((uint64_t(1) << (shift + 31)) + freq - 1) / freq);
}

namespace {
// Flush-then-encode of one symbol; the arithmetic the SIMD encoder reproduces lane by lane.
inline void EncPut(uint32_t& x, uint8_t*& ptr, uint32_t e, uint32_t rcp) {
  const uint32_t freq = e >> 16, start = e & 0xffff;
  if (x >= freq << 19) {  // ((kLow >> kProbBits) << 16) * freq; one word suffices as x < 2^31
    ptr -= 2;
    const uint16_t w = uint16_t(x);
    std::memcpy(ptr, &w, 2);
    x >>= 16;
  }
  const uint32_t shift = freq < 2 ? 0 : 31 - uint32_t(std::countl_zero(freq - 1));
  const uint32_t bias = freq < 2 ? start + kProbScale - 1 : start;
  const uint32_t q = uint32_t((uint64_t(x) * rcp) >> 32) >> shift;
  x = x + bias + q * (kProbScale - freq);  // == (x / f) * M + x % f + start
}
}  // namespace

void EncodeRunScalar(EncoderState& st, const Run& r, const uint32_t* rcp, uint32_t n, const uint8_t* sym) {
  for (uint32_t g = n; g > 0; g -= kLanes) {
    for (int l = kLanes - 1; l >= 0; --l) {
      const uint32_t j = g - kLanes + uint32_t(l);
      const size_t k = size_t(j % r.n_channel) * r.table_stride + sym[j];
      EncPut(st.x[l], st.ptr, r.entries[k], rcp[k]);
    }
  }
}

#if KVSERVE_RANS_AVX512
KVSERVE_BEGIN_AVX512
namespace {
// One vector of 16 lanes: flush (the words of the lanes that need it, compress-stored below
// ptr in lane order), then encode.
inline void EncodeVector(__m512i& x, uint8_t*& ptr, __m512i e, __m512i rcp) {
  const __m512i freq = _mm512_srli_epi32(e, 16), start = _mm512_and_si512(e, _mm512_set1_epi32(0xffff));
  const __mmask16 m = _mm512_cmpge_epu32_mask(x, _mm512_slli_epi32(freq, 19));
  const int count = std::popcount(unsigned(m));
  const __m256i words = _mm512_cvtepi32_epi16(_mm512_maskz_compress_epi32(m, x));
  ptr -= 2 * count;
  _mm256_mask_storeu_epi16(ptr, __mmask16((1u << count) - 1), words);
  x = _mm512_mask_srli_epi32(x, m, x, 16);
  const __m512i one = _mm512_set1_epi32(1);
  const __mmask16 single = _mm512_cmpeq_epu32_mask(freq, one);
  // shift = ceil(log2 freq) - 1 = 31 - lzcnt(freq - 1), 0 for freq 1.
  const __m512i shift = _mm512_maskz_sub_epi32(__mmask16(~single), _mm512_set1_epi32(31),
                                               _mm512_lzcnt_epi32(_mm512_sub_epi32(freq, one)));
  const __m512i bias = _mm512_mask_add_epi32(start, single, start, _mm512_set1_epi32(kProbScale - 1));
  // High 32 bits of x * rcp: even lanes from one 32x32->64 multiply, odd lanes from another.
  const __m512i even = _mm512_srli_epi64(_mm512_mul_epu32(x, rcp), 32);
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(x, 32), _mm512_srli_epi64(rcp, 32));
  const __m512i q = _mm512_srlv_epi32(_mm512_mask_blend_epi32(0xAAAA, even, odd), shift);
  const __m512i cmpl = _mm512_sub_epi32(_mm512_set1_epi32(kProbScale), freq);
  x = _mm512_add_epi32(_mm512_add_epi32(x, bias), _mm512_mullo_epi32(q, cmpl));
}

void EncodeRunAvx512(EncoderState& st, const Run& r, const uint32_t* rcp, uint32_t n, const uint8_t* sym) {
  if (n == 0) return;
  const int C = int(r.n_channel);
  // Channels of the lanes of the last group, stepped back one group at a time.
  alignas(64) int32_t ch_init[kLanes];
  for (int l = 0; l < kLanes; ++l) ch_init[l] = int32_t((n - kLanes + uint32_t(l)) % uint32_t(C));
  __m512i ch0 = _mm512_load_si512(ch_init), ch1 = _mm512_load_si512(ch_init + 16);
  const __m512i back = _mm512_set1_epi32(kLanes % C), n_channel = _mm512_set1_epi32(C);
  const __m512i stride = _mm512_set1_epi32(int(r.table_stride)), zero = _mm512_setzero_si512();
  const int* entries = reinterpret_cast<const int*>(r.entries);
  const int* rcps = reinterpret_cast<const int*>(rcp);
  __m512i x0 = _mm512_loadu_si512(st.x), x1 = _mm512_loadu_si512(st.x + 16);
  uint8_t* ptr = st.ptr;
  for (uint32_t g = n; g > 0; g -= kLanes) {
    const uint8_t* group = sym + g - kLanes;
    const __m512i k0 = _mm512_add_epi32(_mm512_mullo_epi32(ch0, stride),
                                        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group))));
    const __m512i k1 = _mm512_add_epi32(_mm512_mullo_epi32(ch1, stride),
                                        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group + 16))));
    // Lanes 31..16 flush above lanes 15..0, as the scalar loop's order puts them.
    EncodeVector(x1, ptr, _mm512_i32gather_epi32(k1, entries, 4), _mm512_i32gather_epi32(k1, rcps, 4));
    EncodeVector(x0, ptr, _mm512_i32gather_epi32(k0, entries, 4), _mm512_i32gather_epi32(k0, rcps, 4));
    ch0 = _mm512_sub_epi32(ch0, back);
    ch0 = _mm512_mask_add_epi32(ch0, _mm512_cmplt_epi32_mask(ch0, zero), ch0, n_channel);
    ch1 = _mm512_sub_epi32(ch1, back);
    ch1 = _mm512_mask_add_epi32(ch1, _mm512_cmplt_epi32_mask(ch1, zero), ch1, n_channel);
  }
  _mm512_storeu_si512(st.x, x0);
  _mm512_storeu_si512(st.x + 16, x1);
  st.ptr = ptr;
}

// Lane l's entry and reciprocal for its symbol s_l from a block of lane tables (see
// EncodeLaneTables): two-source permutes pick T[2k + (s & 1)][l] for each pair k of symbols,
// then blends on the higher bits of s choose among the pairs. In registers, instead of gathers.
template <uint32_t A>
inline void LookupLanes(const uint32_t* block, __m512i s, __m512i& e, __m512i& rcp) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i idx = _mm512_or_si512(lane, _mm512_slli_epi32(_mm512_and_si512(s, _mm512_set1_epi32(1)), 4));
  constexpr uint32_t P = A / 2;  // pairs
  __m512i ce[P], cr[P];
  for (uint32_t k = 0; k < P; ++k) {
    const uint32_t* te = block + 2 * k * 16;
    const uint32_t* tr = block + (A + 2 * k) * 16;
    ce[k] = _mm512_permutex2var_epi32(_mm512_loadu_si512(te), idx, _mm512_loadu_si512(te + 16));
    cr[k] = _mm512_permutex2var_epi32(_mm512_loadu_si512(tr), idx, _mm512_loadu_si512(tr + 16));
  }
  for (uint32_t bit = 2, width = P; width > 1; bit <<= 1, width /= 2) {
    const __mmask16 m = _mm512_test_epi32_mask(s, _mm512_set1_epi32(int(bit)));
    for (uint32_t i = 0; i < width / 2; ++i) {
      ce[i] = _mm512_mask_blend_epi32(m, ce[2 * i], ce[2 * i + 1]);
      cr[i] = _mm512_mask_blend_epi32(m, cr[2 * i], cr[2 * i + 1]);
    }
  }
  e = ce[0];
  rcp = cr[0];
}

// EncodeRunAvx512 with lookups in lane tables. Each vector's 16 lanes are one block of 16
// channels (C a multiple of 16), or repeat the C channels (C divides 16).
template <uint32_t A>
void EncodeRunLanesAvx512(EncoderState& st, const Run& r, const uint32_t* lane_tables, uint32_t n, const uint8_t* sym) {
  if (n == 0) return;
  const uint32_t C = r.table_stride == 0 ? 1 : r.n_channel;
  const bool blocks = C % 16 == 0;
  const size_t block_words = size_t(2) * A * 16;
  uint32_t c0 = blocks ? (n - kLanes) % C : 0;  // channel of the last group's lane 0
  const uint32_t back = blocks ? kLanes % C : 0;
  __m512i x0 = _mm512_loadu_si512(st.x), x1 = _mm512_loadu_si512(st.x + 16);
  uint8_t* ptr = st.ptr;
  for (uint32_t g = n; g > 0; g -= kLanes) {
    const uint8_t* group = sym + g - kLanes;
    const uint32_t c1 = blocks ? (c0 + 16 == C ? 0 : c0 + 16) : 0;
    const __m512i s0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group)));
    const __m512i s1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group + 16)));
    __m512i e0, r0, e1, r1;
    LookupLanes<A>(lane_tables + (c0 / 16) * block_words, s0, e0, r0);
    LookupLanes<A>(lane_tables + (c1 / 16) * block_words, s1, e1, r1);
    EncodeVector(x1, ptr, e1, r1);  // lanes 31..16 flush above lanes 15..0
    EncodeVector(x0, ptr, e0, r0);
    if (blocks) c0 = c0 >= back ? c0 - back : c0 + C - back;
  }
  _mm512_storeu_si512(st.x, x0);
  _mm512_storeu_si512(st.x + 16, x1);
  st.ptr = ptr;
}

// Runs with one table for all channels (stride 0) and alphabets <= 16: the frequencies and
// reciprocals sit in two registers, and every lookup is one permute.
void EncodeRunSharedAvx512(EncoderState& st, const Run& r, const uint32_t* rcp, uint32_t n, const uint8_t* sym) {
  const __mmask16 used = __mmask16((1u << (1u << r.bits)) - 1);
  const __m512i te = _mm512_maskz_loadu_epi32(used, r.entries), tr = _mm512_maskz_loadu_epi32(used, rcp);
  __m512i x0 = _mm512_loadu_si512(st.x), x1 = _mm512_loadu_si512(st.x + 16);
  uint8_t* ptr = st.ptr;
  for (uint32_t g = n; g > 0; g -= kLanes) {
    const uint8_t* group = sym + g - kLanes;
    const __m512i s0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group)));
    const __m512i s1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group + 16)));
    EncodeVector(x1, ptr, _mm512_permutexvar_epi32(s1, te), _mm512_permutexvar_epi32(s1, tr));
    EncodeVector(x0, ptr, _mm512_permutexvar_epi32(s0, te), _mm512_permutexvar_epi32(s0, tr));
  }
  _mm512_storeu_si512(st.x, x0);
  _mm512_storeu_si512(st.x + 16, x1);
  st.ptr = ptr;
}
}  // namespace
KVSERVE_END_TIER
#endif

bool HaveSimdEncoder() {
#if KVSERVE_RANS_AVX512
  return cpu::Use(cpu::Tier::kAvx512);
#else
  return false;
#endif
}

void EncodeRun(EncoderState& st, const Run& r, const uint32_t* rcp, const std::vector<uint32_t>& lane_tables,
               uint32_t n, const uint8_t* sym) {
#if KVSERVE_RANS_AVX512
  if (cpu::Use(cpu::Tier::kAvx512)) {
    if (r.table_stride == 0 && r.bits <= 4) return EncodeRunSharedAvx512(st, r, rcp, n, sym);
    if (lane_tables.empty()) return EncodeRunAvx512(st, r, rcp, n, sym);
    switch (r.bits) {
      case 1: return EncodeRunLanesAvx512<2>(st, r, lane_tables.data(), n, sym);
      case 2: return EncodeRunLanesAvx512<4>(st, r, lane_tables.data(), n, sym);
      case 3: return EncodeRunLanesAvx512<8>(st, r, lane_tables.data(), n, sym);
      default: return EncodeRunLanesAvx512<16>(st, r, lane_tables.data(), n, sym);  // bits <= 4
    }
  }
#endif
  EncodeRunScalar(st, r, rcp, n, sym);
}

#if KVSERVE_RANS_AVX512
KVSERVE_BEGIN_AVX512
namespace {

// The states below kLow take the next words of the stream, in lane order: one expand-load.
inline void Renormalize(__m512i& x, const uint8_t*& ptr) {
  const __mmask16 m = _mm512_cmplt_epu32_mask(x, _mm512_set1_epi32(kLow));
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ptr)));
  x = _mm512_mask_or_epi32(x, m, _mm512_slli_epi32(x, 16), _mm512_maskz_expand_epi32(m, w));
  ptr += 2 * std::popcount(unsigned(m));
}

// A slot's key against packed entries (see PackedEntry): an entry is <= key exactly when its
// start is <= slot. The low bits are above every entry's freq << 7 | s (at most 0x8007f), and
// below the all-ones of a never-matching entry even when slot is 4095.
inline __m512i PackedKey(__m512i slot) {
  return _mm512_or_si512(_mm512_slli_epi32(slot, 20), _mm512_set1_epi32((1 << 20) - 2));
}

// Decodes one vector of states whose packed entries are e: stores the 16 symbols at out and
// returns the states before renormalisation.
inline __m512i DecodePacked(__m512i x, __m512i slot, __m512i e, uint8_t* out) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(_mm512_and_si512(e, _mm512_set1_epi32(0x7f))));
  const __m512i freq = _mm512_and_si512(_mm512_srli_epi32(e, 7), _mm512_set1_epi32(0x1fff));
  return _mm512_add_epi32(_mm512_mullo_epi32(freq, _mm512_srli_epi32(x, kProbBits)),
                          _mm512_sub_epi32(slot, _mm512_srli_epi32(e, 20)));
}

// Per lane, the offset of its channel's table (channel = lane mod C, times `unit`) for the 32
// lanes of a group, moved on by kLanes channels per group.
class LaneTableOffsets {
 public:
  LaneTableOffsets(uint32_t C, uint32_t unit)
      : advance_(_mm512_set1_epi32(int(kLanes % C * unit))), wrap_(_mm512_set1_epi32(int(C * unit))) {
    alignas(64) uint32_t init[kLanes];
    for (int l = 0; l < kLanes; ++l) init[l] = uint32_t(l) % C * unit;
    v_[0] = _mm512_load_si512(init);
    v_[1] = _mm512_load_si512(init + 16);
  }
  __m512i operator[](int half) const { return v_[half]; }
  void Next() {
    for (__m512i& v : v_) {
      v = _mm512_add_epi32(v, advance_);
      v = _mm512_mask_sub_epi32(v, _mm512_cmpge_epu32_mask(v, wrap_), v, wrap_);
    }
  }

 private:
  __m512i v_[2];
  const __m512i advance_, wrap_;
};

// The packed entry of the largest symbol whose row (of 16, lane tables' layout) is <= key in each
// lane: rows are non-decreasing per lane and row 0 always matches, so a binary search finds it —
// 4 compares, each step's candidate row picked per lane by blends on the bits found so far (the
// blends on earlier bits first, so each step waits on one blend after its compare), against 15
// compares and selects of a scan (4-bit rans decode 1.3x as fast: docs/results/float_lossless.md).
inline __m512i SearchRows16(const uint32_t* t, __m512i key) {
  const auto row = [t](int s) { return _mm512_loadu_si512(t + s * 16); };
  const __m512i r8 = row(8);
  const __mmask16 m8 = _mm512_cmple_epu32_mask(r8, key);
  __m512i e = _mm512_mask_mov_epi32(row(0), m8, r8);
  const __m512i c4 = _mm512_mask_blend_epi32(m8, row(4), row(12));
  const __m512i a2 = _mm512_mask_blend_epi32(m8, row(2), row(10)), b2 = _mm512_mask_blend_epi32(m8, row(6), row(14));
  const __m512i a1 = _mm512_mask_blend_epi32(m8, row(1), row(9)), b1 = _mm512_mask_blend_epi32(m8, row(3), row(11));
  const __m512i c1 = _mm512_mask_blend_epi32(m8, row(5), row(13)), d1 = _mm512_mask_blend_epi32(m8, row(7), row(15));
  const __mmask16 m4 = _mm512_cmple_epu32_mask(c4, key);
  e = _mm512_mask_mov_epi32(e, m4, c4);
  const __m512i c2 = _mm512_mask_blend_epi32(m4, a2, b2);
  const __m512i ab1 = _mm512_mask_blend_epi32(m4, a1, c1), cd1 = _mm512_mask_blend_epi32(m4, b1, d1);
  const __mmask16 m2 = _mm512_cmple_epu32_mask(c2, key);
  e = _mm512_mask_mov_epi32(e, m2, c2);
  const __m512i last = _mm512_mask_blend_epi32(m2, ab1, cd1);
  return _mm512_mask_mov_epi32(e, _mm512_cmple_epu32_mask(last, key), last);
}

// Compare-scan decode over lane tables (see LaneTables), A = 2^bits symbols, unrolled; a binary
// search for 16 symbols.
template <uint32_t A>
bool DecodeRunScan(DecoderState& st, const Run& r, const uint32_t* lane_tables, uint32_t n, uint8_t* out) {
  const uint32_t C = r.table_stride == 0 ? 1 : r.n_channel;
  const bool blocks = C % 16 == 0;
  __m512i x0 = _mm512_loadu_si512(st.x), x1 = _mm512_loadu_si512(st.x + 16);
  const __m512i slot_mask = _mm512_set1_epi32(kProbScale - 1);
  const uint8_t* ptr = st.ptr;
  uint32_t j = 0, ch = 0;  // ch: channel of lane 0 (a multiple of 16 when blocks)
  for (; j < n && st.end - ptr >= 2 * kLanes; j += kLanes) {
    const uint32_t ch1 = blocks ? (ch + 16 == C ? 0 : ch + 16) : 0;
    const uint32_t* t0 = lane_tables + (blocks ? size_t(ch / 16) * A * 16 : 0);
    const uint32_t* t1 = lane_tables + (blocks ? size_t(ch1 / 16) * A * 16 : 0);
    const __m512i s0 = _mm512_and_si512(x0, slot_mask), s1 = _mm512_and_si512(x1, slot_mask);
    const __m512i k0 = PackedKey(s0), k1 = PackedKey(s1);
    __m512i e0, e1;
    if constexpr (A == 16) {
      e0 = SearchRows16(t0, k0);
      e1 = SearchRows16(t1, k1);
    } else {
      e0 = _mm512_loadu_si512(t0), e1 = _mm512_loadu_si512(t1);
#pragma GCC unroll 16
      for (uint32_t s = 1; s < A; ++s) {
        const __m512i v0 = _mm512_loadu_si512(t0 + s * 16), v1 = _mm512_loadu_si512(t1 + s * 16);
        e0 = _mm512_mask_mov_epi32(e0, _mm512_cmple_epu32_mask(v0, k0), v0);
        e1 = _mm512_mask_mov_epi32(e1, _mm512_cmple_epu32_mask(v1, k1), v1);
      }
    }
    x0 = DecodePacked(x0, s0, e0, out + j);
    x1 = DecodePacked(x1, s1, e1, out + j + 16);
    Renormalize(x0, ptr);
    Renormalize(x1, ptr);
    if (blocks) ch = ch1 + 16 == C ? 0 : ch1 + 16;
  }
  _mm512_storeu_si512(st.x, x0);
  _mm512_storeu_si512(st.x + 16, x1);
  st.ptr = ptr;
  return j >= n || DecodeRunScalar(st, r, j, n, out);
}

// Two streams' states in four vectors (a's two, then b's) and their read positions, as the pair
// decoders keep them in registers: loaded from the streams, renormalised group by group, stored back.
struct PairStates {
  __m512i x[4];
  const uint8_t* pa;
  const uint8_t* pb;
  PairStates(const DecoderState& a, const DecoderState& b)
      : x{_mm512_loadu_si512(a.x), _mm512_loadu_si512(a.x + 16), _mm512_loadu_si512(b.x), _mm512_loadu_si512(b.x + 16)},
        pa(a.ptr), pb(b.ptr) {}
  void Renormalize() {
    rans::Renormalize(x[0], pa);
    rans::Renormalize(x[1], pa);
    rans::Renormalize(x[2], pb);
    rans::Renormalize(x[3], pb);
  }
  void Store(DecoderState& a, DecoderState& b) const {
    _mm512_storeu_si512(a.x, x[0]);
    _mm512_storeu_si512(a.x + 16, x[1]);
    _mm512_storeu_si512(b.x, x[2]);
    _mm512_storeu_si512(b.x + 16, x[3]);
    a.ptr = pa;
    b.ptr = pb;
  }
};

// DecodeRunPair with K bound rows (the stream with fewer pads with all ones, which never match).
template <uint32_t K>
uint32_t DecodeRunPairAvx512(DecoderState& a, const std::vector<uint32_t>& ta, uint8_t* out_a, DecoderState& b,
                             const std::vector<uint32_t>& tb, uint8_t* out_b, uint32_t n) {
  // lo/hi: buckets 0-15 and 16-31 of each row, for two-source permutes; [stream][row].
  __m512i lo[2][K + 1], hi[2][K + 1];
  const std::vector<uint32_t>* tables[2] = {&ta, &tb};
  for (int q = 0; q < 2; ++q) {
    const uint32_t rows = uint32_t(tables[q]->size() / kBuckets);
    for (uint32_t k = 0; k <= K; ++k) {
      const uint32_t* row = tables[q]->data() + k * kBuckets;
      lo[q][k] = k < rows ? _mm512_loadu_si512(row) : _mm512_set1_epi32(-1);
      hi[q][k] = k < rows ? _mm512_loadu_si512(row + 16) : _mm512_set1_epi32(-1);
    }
  }
  const __m512i slot_mask = _mm512_set1_epi32(kProbScale - 1);
  PairStates st(a, b);
  __m512i* x = st.x;
  uint8_t* out[2] = {out_a, out_b};
  uint32_t j = 0;
  for (; j < n && a.end - st.pa >= 2 * kLanes && b.end - st.pb >= 2 * kLanes; j += kLanes) {
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      const int q = v / 2;
      const __m512i slot = _mm512_and_si512(x[v], slot_mask);
      const __m512i bucket = _mm512_srli_epi32(slot, 7);
      const __m512i key = PackedKey(slot);
      __m512i e = _mm512_permutex2var_epi32(lo[q][0], bucket, hi[q][0]);
#pragma GCC unroll 8
      for (uint32_t k = 1; k <= K; ++k) {
        const __m512i bound = _mm512_permutex2var_epi32(lo[q][k], bucket, hi[q][k]);
        e = _mm512_mask_mov_epi32(e, _mm512_cmple_epu32_mask(bound, key), bound);
      }
      x[v] = DecodePacked(x[v], slot, e, out[q] + j + 16 * (v % 2));
    }
    st.Renormalize();
  }
  st.Store(a, b);
  return j;
}

// One gather per vector into the slot tables (see SlotTables).
bool DecodeRunSlots(DecoderState& st, const Run& r, const int* lut, uint32_t n, uint8_t* out) {
  LaneTableOffsets base(r.table_stride == 0 ? 1 : r.n_channel, kProbScale);  // each lane's first slot entry
  const __m512i slot_mask = _mm512_set1_epi32(kProbScale - 1), bias_mask = _mm512_set1_epi32(0xfff);
  const __m512i one = _mm512_set1_epi32(1), sym_mask = _mm512_set1_epi32(0xff);
  __m512i x0 = _mm512_loadu_si512(st.x), x1 = _mm512_loadu_si512(st.x + 16);
  const uint8_t* ptr = st.ptr;
  uint32_t j = 0;
  for (; j < n && st.end - ptr >= 2 * kLanes; j += kLanes) {
    const __m512i e0 = _mm512_i32gather_epi32(_mm512_add_epi32(base[0], _mm512_and_si512(x0, slot_mask)), lut, 4);
    const __m512i e1 = _mm512_i32gather_epi32(_mm512_add_epi32(base[1], _mm512_and_si512(x1, slot_mask)), lut, 4);
    x0 = _mm512_add_epi32(
        _mm512_mullo_epi32(_mm512_add_epi32(_mm512_srli_epi32(e0, 20), one), _mm512_srli_epi32(x0, kProbBits)),
        _mm512_and_si512(_mm512_srli_epi32(e0, 8), bias_mask));
    x1 = _mm512_add_epi32(
        _mm512_mullo_epi32(_mm512_add_epi32(_mm512_srli_epi32(e1, 20), one), _mm512_srli_epi32(x1, kProbBits)),
        _mm512_and_si512(_mm512_srli_epi32(e1, 8), bias_mask));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), _mm512_cvtepi32_epi8(_mm512_and_si512(e0, sym_mask)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j + 16), _mm512_cvtepi32_epi8(_mm512_and_si512(e1, sym_mask)));
    Renormalize(x0, ptr);
    Renormalize(x1, ptr);
    base.Next();
  }
  _mm512_storeu_si512(st.x, x0);
  _mm512_storeu_si512(st.x + 16, x1);
  st.ptr = ptr;
  return j >= n || DecodeRunScalar(st, r, j, n, out);
}

bool DecodeRunAvx512(DecoderState& st, const Run& r, const std::vector<uint32_t>& lane_tables,
                     const std::vector<uint32_t>& slot_tables, uint32_t n, uint8_t* out) {
  if (!lane_tables.empty()) {
    switch (r.bits) {
      case 1: return DecodeRunScan<2>(st, r, lane_tables.data(), n, out);
      case 2: return DecodeRunScan<4>(st, r, lane_tables.data(), n, out);
      case 3: return DecodeRunScan<8>(st, r, lane_tables.data(), n, out);
      case 4: return DecodeRunScan<16>(st, r, lane_tables.data(), n, out);
      default: break;
    }
  }
  if (!slot_tables.empty()) return DecodeRunSlots(st, r, reinterpret_cast<const int*>(slot_tables.data()), n, out);
  // A binary search by gathers over each lane's table.
  LaneTableOffsets base(r.n_channel, r.table_stride);  // each lane's table's first entry
  const __m512i slot_mask = _mm512_set1_epi32(kProbScale - 1), lo16 = _mm512_set1_epi32(0xffff);
  __m512i x0 = _mm512_loadu_si512(st.x), x1 = _mm512_loadu_si512(st.x + 16);
  const uint8_t* ptr = st.ptr;
  const int* entries = reinterpret_cast<const int*>(r.entries);
  const uint32_t half = (1u << r.bits) >> 1;
  uint32_t j = 0;
  // Each group reads at most 2 bytes per state: 64 bytes left means no bounds test inside.
  for (; j < n && st.end - ptr >= 2 * kLanes; j += kLanes) {
    const __m512i b0 = base[0], b1 = base[1];
    const __m512i s0 = _mm512_and_si512(x0, slot_mask), s1 = _mm512_and_si512(x1, slot_mask);
    __m512i y0 = _mm512_setzero_si512(), y1 = _mm512_setzero_si512();
    for (uint32_t step = half; step; step >>= 1) {
      const __m512i inc = _mm512_set1_epi32(int(step));
      const __m512i c0 = _mm512_add_epi32(y0, inc), c1 = _mm512_add_epi32(y1, inc);
      const __m512i e0 = _mm512_i32gather_epi32(_mm512_add_epi32(b0, c0), entries, 4);
      const __m512i e1 = _mm512_i32gather_epi32(_mm512_add_epi32(b1, c1), entries, 4);
      y0 = _mm512_mask_mov_epi32(y0, _mm512_cmple_epu32_mask(_mm512_and_si512(e0, lo16), s0), c0);
      y1 = _mm512_mask_mov_epi32(y1, _mm512_cmple_epu32_mask(_mm512_and_si512(e1, lo16), s1), c1);
    }
    const __m512i e0 = _mm512_i32gather_epi32(_mm512_add_epi32(b0, y0), entries, 4);
    const __m512i e1 = _mm512_i32gather_epi32(_mm512_add_epi32(b1, y1), entries, 4);
    x0 = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_srli_epi32(e0, 16), _mm512_srli_epi32(x0, kProbBits)),
                          _mm512_sub_epi32(s0, _mm512_and_si512(e0, lo16)));
    x1 = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_srli_epi32(e1, 16), _mm512_srli_epi32(x1, kProbBits)),
                          _mm512_sub_epi32(s1, _mm512_and_si512(e1, lo16)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), _mm512_cvtepi32_epi8(y0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j + 16), _mm512_cvtepi32_epi8(y1));
    Renormalize(x0, ptr);
    Renormalize(x1, ptr);
    base.Next();
  }
  _mm512_storeu_si512(st.x, x0);
  _mm512_storeu_si512(st.x + 16, x1);
  st.ptr = ptr;
  return j >= n || DecodeRunScalar(st, r, j, n, out);
}

// DecodeRunPairLanes's loop: four state vectors (two per stream) searched side by side.
uint32_t DecodeRunPairLanesAvx512(DecoderState& a, const Run& ra, const uint32_t* lanes_a, uint8_t* out_a,
                                  DecoderState& b, const Run& rb, const uint32_t* lanes_b, uint8_t* out_b, uint32_t n,
                                  uint32_t period) {
  const uint32_t Ca = ra.table_stride == 0 ? 1 : ra.n_channel, Cb = rb.table_stride == 0 ? 1 : rb.n_channel;
  const bool blocks_a = Ca % 16 == 0, blocks_b = Cb % 16 == 0;
  const __m512i slot_mask = _mm512_set1_epi32(kProbScale - 1);
  PairStates st(a, b);
  __m512i* x = st.x;
  // A stretch of `period` symbols reads at most 2 bytes per state and group of kLanes.
  const ptrdiff_t need = ptrdiff_t(period / kLanes) * 2 * kLanes;
  uint32_t j = 0, ch_a = 0, ch_b = 0;  // channel of lane 0 (a multiple of 16 where blocks)
  auto rows = [](const uint32_t* lanes, bool blocks, uint32_t ch) { return lanes + (blocks ? size_t(ch / 16) * 256 : 0); };
  auto next = [](bool blocks, uint32_t ch, uint32_t C) { return blocks ? (ch + 16 == C ? 0 : ch + 16) : 0; };
  for (; j < n && a.end - st.pa >= need && b.end - st.pb >= need;) {
    for (const uint32_t stretch_end = j + period; j < stretch_end; j += kLanes) {
      const uint32_t ch1_a = next(blocks_a, ch_a, Ca), ch1_b = next(blocks_b, ch_b, Cb);
      const uint32_t* t[4] = {rows(lanes_a, blocks_a, ch_a), rows(lanes_a, blocks_a, ch1_a), rows(lanes_b, blocks_b, ch_b),
                              rows(lanes_b, blocks_b, ch1_b)};
      uint8_t* out[4] = {out_a + j, out_a + j + 16, out_b + j, out_b + j + 16};
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        const __m512i slot = _mm512_and_si512(x[v], slot_mask);
        x[v] = DecodePacked(x[v], slot, SearchRows16(t[v], PackedKey(slot)), out[v]);
      }
      st.Renormalize();
      ch_a = next(blocks_a, ch1_a, Ca);
      ch_b = next(blocks_b, ch1_b, Cb);
    }
  }
  st.Store(a, b);
  return j;
}
}  // namespace
KVSERVE_END_TIER
#endif

uint32_t DecodeRunPairLanes(DecoderState& a, const Run& ra, const std::vector<uint32_t>& lanes_a, uint8_t* out_a,
                            DecoderState& b, const Run& rb, const std::vector<uint32_t>& lanes_b, uint8_t* out_b,
                            uint32_t n) {
  if (ra.bits != 4 || rb.bits != 4 || lanes_a.empty() || lanes_b.empty()) return 0;
#if KVSERVE_RANS_AVX512
  if (cpu::Use(cpu::Tier::kAvx512)) {
    const uint32_t Ca = ra.table_stride == 0 ? 1 : ra.n_channel, Cb = rb.table_stride == 0 ? 1 : rb.n_channel;
    const uint32_t period = std::lcm(std::lcm(uint32_t(kLanes), Ca), Cb);
    return DecodeRunPairLanesAvx512(a, ra, lanes_a.data(), out_a, b, rb, lanes_b.data(), out_b, n / period * period, period);
  }
#endif
  (void)out_a, (void)out_b, (void)n;
  return 0;
}

bool HaveSimdDecoder() {
#if KVSERVE_RANS_AVX512
  return cpu::Use(cpu::Tier::kAvx512);
#else
  return false;
#endif
}

uint32_t DecodeRunPair(DecoderState& a, const std::vector<uint32_t>& buckets_a, uint8_t* out_a, DecoderState& b,
                       const std::vector<uint32_t>& buckets_b, uint8_t* out_b, uint32_t n) {
  if (buckets_a.empty() || buckets_b.empty()) return 0;
#if KVSERVE_RANS_AVX512
  if (cpu::Use(cpu::Tier::kAvx512)) {
    switch (std::max(buckets_a.size(), buckets_b.size()) / kBuckets - 1) {
      case 0: return DecodeRunPairAvx512<0>(a, buckets_a, out_a, b, buckets_b, out_b, n);
      case 1: return DecodeRunPairAvx512<1>(a, buckets_a, out_a, b, buckets_b, out_b, n);
      case 2: return DecodeRunPairAvx512<2>(a, buckets_a, out_a, b, buckets_b, out_b, n);
      case 3: return DecodeRunPairAvx512<3>(a, buckets_a, out_a, b, buckets_b, out_b, n);
      case 4: return DecodeRunPairAvx512<4>(a, buckets_a, out_a, b, buckets_b, out_b, n);
      case 5: return DecodeRunPairAvx512<5>(a, buckets_a, out_a, b, buckets_b, out_b, n);
      case 6: return DecodeRunPairAvx512<6>(a, buckets_a, out_a, b, buckets_b, out_b, n);
      default: return DecodeRunPairAvx512<kMaxBounds>(a, buckets_a, out_a, b, buckets_b, out_b, n);
    }
  }
#endif
  return 0;
}

bool DecodeRun(DecoderState& st, const Run& r, const std::vector<uint32_t>& lane_tables,
               const std::vector<uint32_t>& slot_tables, uint32_t n, uint8_t* out) {
#if KVSERVE_RANS_AVX512
  if (cpu::Use(cpu::Tier::kAvx512)) return DecodeRunAvx512(st, r, lane_tables, slot_tables, n, out);
#endif
  return DecodeRunScalar(st, r, 0, n, out);
}

ContextCounter::ContextCounter(uint32_t n_channel, int bits, uint64_t* cnt, uint64_t* cnt_pred)
    : C_(n_channel), A_(1u << bits), mask_(uint8_t(A_ - 1)), cnt_(cnt), cnt_pred_(cnt_pred),
      bytes_(bits <= 4 && n_channel <= 4096) {
  if (bytes_) acc_.assign(size_t(2) * A_ * C_, 0), wide_.assign(acc_.size(), 0);
  diff_.resize(C_);
}

ContextCounter::~ContextCounter() {
  if (!bytes_) return;
  if (pending_) Widen();
  for (uint32_t v = 0; v < A_; ++v) {
    for (uint32_t ch = 0; ch < C_; ++ch) {
      if (cnt_) cnt_[size_t(ch) * A_ + v] += wide_[size_t(v) * C_ + ch];
      if (cnt_pred_) cnt_pred_[size_t(ch) * A_ + v] += wide_[(size_t(A_) + v) * C_ + ch];
    }
  }
}

#if KVSERVE_RANS_AVX512
KVSERVE_BEGIN_AVX512
namespace {
// Adds the counts of `rows` rows of C (a multiple of 64) symbols below 2^bits = A to the byte
// accumulators acc ([value][channel]), 64 channels at a time with the A accumulators in
// registers for all the rows: one compare and one masked add per value and 64 symbols, the
// accumulators stored once. Predicted: each row minus the row above (mod A); `above` is the row
// before the first one, or null where the first row predicts from nothing (a section's start).
template <uint32_t A>
void CountRowsAvx512(const uint8_t* sym, uint32_t rows, uint32_t C, const uint8_t* above, bool predicted,
                     uint8_t* acc) {
  const __m512i mask = _mm512_set1_epi8(char(A - 1)), one = _mm512_set1_epi8(1);
  for (uint32_t c0 = 0; c0 < C; c0 += 64) {
    __m512i a[A];
    for (uint32_t v = 0; v < A; ++v) a[v] = _mm512_loadu_si512(acc + size_t(v) * C + c0);
    for (uint32_t r = 0; r < rows; ++r) {
      const uint8_t* row = sym + size_t(r) * C + c0;
      __m512i x = _mm512_loadu_si512(row);
      if (predicted) {
        const uint8_t* prev = r > 0 ? row - C : (above ? above + c0 : nullptr);
        if (prev) x = _mm512_and_si512(_mm512_sub_epi8(x, _mm512_loadu_si512(prev)), mask);
      }
      for (uint32_t v = 0; v < A; ++v) {
        a[v] = _mm512_mask_add_epi8(a[v], _mm512_cmpeq_epi8_mask(x, _mm512_set1_epi8(char(v))), a[v], one);
      }
    }
    for (uint32_t v = 0; v < A; ++v) _mm512_storeu_si512(acc + size_t(v) * C + c0, a[v]);
  }
}

void CountRows(const uint8_t* sym, uint32_t rows, uint32_t C, uint32_t A, const uint8_t* above, bool predicted,
               uint8_t* acc) {
  switch (A) {
    case 2: return CountRowsAvx512<2>(sym, rows, C, above, predicted, acc);
    case 4: return CountRowsAvx512<4>(sym, rows, C, above, predicted, acc);
    case 8: return CountRowsAvx512<8>(sym, rows, C, above, predicted, acc);
    default: return CountRowsAvx512<16>(sym, rows, C, above, predicted, acc);
  }
}
}  // namespace
KVSERVE_END_TIER
#endif

void ContextCounter::Add(const uint8_t* sym, uint32_t n) {
  const uint32_t rows = n / C_;
  uint8_t* a = acc_.data();
  uint8_t* ap = bytes_ ? a + size_t(A_) * C_ : nullptr;  // acc_ is empty without byte accumulators
#if KVSERVE_RANS_AVX512
  if (bytes_ && C_ % 64 == 0 && cpu::Use(cpu::Tier::kAvx512)) {
    // Whole rows in register accumulators, at most 255 rows into the bytes between widenings.
    for (uint32_t r0 = 0; r0 < rows;) {
      if (pending_ == 255) Widen();
      const uint32_t nr = std::min(255 - pending_, rows - r0);
      const uint8_t* first = sym + size_t(r0) * C_;
      if (cnt_) CountRows(first, nr, C_, A_, nullptr, false, a);
      if (cnt_pred_) CountRows(first, nr, C_, A_, r0 > 0 ? first - C_ : nullptr, true, ap);
      pending_ += nr;
      r0 += nr;
    }
    if (pending_ == 255) Widen();
    CountTail(sym, n, rows);
    return;
  }
#endif
  for (uint32_t r = 0; r < rows; ++r) {
    const uint8_t* row = sym + size_t(r) * C_;
    const uint8_t* pred = row;  // a section's first row predicts from nothing: unchanged
    if (cnt_pred_ && r > 0) {
      uint8_t* __restrict d = diff_.data();
      const uint8_t* above = row - C_;
      for (uint32_t ch = 0; ch < C_; ++ch) d[ch] = uint8_t((row[ch] - above[ch]) & mask_);
      pred = d;
    }
    if (!bytes_) {
      for (uint32_t ch = 0; ch < C_; ++ch) {
        if (cnt_) ++cnt_[size_t(ch) * A_ + row[ch]];
        if (cnt_pred_) ++cnt_pred_[size_t(ch) * A_ + pred[ch]];
      }
      continue;
    }
    if (cnt_) AddRow(a, row);
    if (cnt_pred_) AddRow(ap, pred);
    if (++pending_ == 255) Widen();
  }
  CountTail(sym, n, rows);
}

void ContextCounter::CountTail(const uint8_t* sym, uint32_t n, uint32_t rows) {
  for (uint32_t j = rows * C_; j < n; ++j) {
    const uint32_t ch = j - rows * C_;
    if (cnt_) ++cnt_[size_t(ch) * A_ + sym[j]];
    if (cnt_pred_) ++cnt_pred_[size_t(ch) * A_ + (j >= C_ ? uint8_t((sym[j] - sym[j - C_]) & mask_) : sym[j])];
  }
}

void ContextCounter::AddRow(uint8_t* __restrict to, const uint8_t* __restrict row) const {
  for (uint32_t v = 0; v < A_; ++v) {
    uint8_t* __restrict t = to + size_t(v) * C_;
    const uint8_t value = uint8_t(v);  // compared as bytes, so the loop stays in byte lanes
    for (uint32_t ch = 0; ch < C_; ++ch) t[ch] = uint8_t(t[ch] + uint8_t(row[ch] == value));
  }
}

void ContextCounter::Widen() {
  for (size_t k = 0; k < acc_.size(); ++k) wide_[k] += acc_[k];
  std::fill(acc_.begin(), acc_.end(), 0);
  pending_ = 0;
}

void CountSectionReference(const uint8_t* sym, uint32_t n, uint32_t n_channel, int bits, uint64_t* cnt,
                           uint64_t* cnt_pred) {
  const uint32_t A = 1u << bits;
  std::vector<uint8_t> pred(sym, sym + n);
  for (uint32_t j = n; j-- > n_channel;) pred[j] = uint8_t((sym[j] - sym[j - n_channel]) & (A - 1));
  for (uint32_t j = 0; j < n; ++j) {
    if (cnt) ++cnt[size_t(j % n_channel) * A + sym[j]];
    if (cnt_pred) ++cnt_pred[size_t(j % n_channel) * A + pred[j]];
  }
}

}  // namespace kvserve::rans
