// rANS kernels: the SIMD paths (decode: compare-scan or binary search over lane tables, slot
// tables, gather search, two streams over bucket tables or 16-symbol lane tables;
// encode: 16-lane vectors; symbol counting) against the scalar reference, for every alphabet size and
// channel layout.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "simd_test_util.h"
#include "codec/rans_kernels.h"

namespace kvserve::rans {
namespace {

using RansKernelTiers = testing::SimdTier;

// Random normalised tables: some symbols absent (leading, inner and trailing), some tables a
// single symbol.
std::vector<uint32_t> RandomTables(std::mt19937& rng, uint32_t n_tables, int bits) {
  const uint32_t A = 1u << bits;
  std::vector<uint32_t> entries(size_t(n_tables) * A);
  for (uint32_t t = 0; t < n_tables; ++t) {
    std::vector<uint32_t> w(A);
    const int kind = int(rng() % 4);
    for (uint32_t s = 0; s < A; ++s) w[s] = kind == 0 ? (s == rng() % A) : (rng() % 3 == 0 ? 0 : rng() % 1000);
    if (kind == 1) std::fill(w.begin() + A / 2, w.end(), 0);  // trailing zeros start at the scale
    uint64_t total = 0;
    for (uint32_t v : w) total += v;
    if (total == 0) w[rng() % A] = 1, total = 1;
    std::vector<uint32_t> f(A);
    uint32_t sum = 0, big = 0;
    for (uint32_t s = 0; s < A; ++s) {
      f[s] = w[s] ? std::max<uint32_t>(1, uint32_t(uint64_t(w[s]) * kProbScale / total)) : 0;
      sum += f[s];
      if (f[s] > f[big]) big = s;
    }
    while (sum > kProbScale) {
      const uint32_t take = std::min(sum - kProbScale, f[big] - 1);
      f[big] -= take, sum -= take;
      for (uint32_t s = 0; s < A; ++s) if (f[s] > f[big]) big = s;
    }
    f[big] += kProbScale - sum;
    for (uint32_t s = 0, start = 0; s < A; start += f[s], ++s) entries[size_t(t) * A + s] = start | f[s] << 16;
  }
  return entries;
}

TEST_P(RansKernelTiers, SimdDecodeMatchesScalar) {
  ASSERT_TRUE(testing::ReportSimdPath("rans decode", HaveSimdDecoder(), "AVX-512", "scalar only"));
  std::mt19937 rng(7);
  for (int bits = 1; bits <= 8; ++bits) {
    for (uint32_t channels : {1u, 2u, 8u, 16u, 24u, 32u, 48u, 128u}) {
      for (bool per_channel : {true, false}) {
        const std::vector<uint32_t> entries = RandomTables(rng, per_channel ? channels : 1, bits);
        const rans::Run run{entries.data(), per_channel ? 1u << bits : 0, channels, bits};
        const uint32_t n = kLanes * (40 + rng() % 20);
        std::vector<uint8_t> stream(n * 2 + 100);
        for (auto& b : stream) b = uint8_t(rng());
        DecoderState a;
        uint32_t x0[kLanes];
        for (int l = 0; l < kLanes; ++l) x0[l] = kLow + rng() % ((1u << 31) - kLow);
        std::memcpy(a.x, x0, sizeof(a.x));
        a.ptr = stream.data();
        a.end = stream.data() + stream.size();
        std::vector<uint8_t> out_a(n);
        const bool ok_a = DecodeRunScalar(a, run, 0, n, out_a.data());
        // Every SIMD variant: lane tables where they apply, slot tables, plain gather search.
        for (int variant = 0; variant < 3; ++variant) {
          DecoderState b;
          std::memcpy(b.x, x0, sizeof(b.x));
          b.ptr = stream.data();
          b.end = stream.data() + stream.size();
          std::vector<uint8_t> out_b(n);
          const bool ok_b = DecodeRun(b, run, variant == 0 ? LaneTables(run) : std::vector<uint32_t>{},
                                      variant == 1 ? SlotTables(run) : std::vector<uint32_t>{}, n, out_b.data());
          const std::string what = "bits " + std::to_string(bits) + " channels " + std::to_string(channels) +
                                   (per_channel ? " per channel" : " shared") + " variant " + std::to_string(variant);
          ASSERT_EQ(ok_a, ok_b) << what;
          ASSERT_EQ(out_a, out_b) << what;
          ASSERT_EQ(a.ptr, b.ptr) << what;
          ASSERT_EQ(std::memcmp(a.x, b.x, sizeof(a.x)), 0) << what;
        }
        const std::string what = "bits " + std::to_string(bits);
        for (uint32_t j = 0; j < n; ++j) {  // and only symbols the tables can produce
          const uint32_t* t = entries.data() + (per_channel ? size_t(j % channels) << bits : 0);
          ASSERT_NE(t[out_a[j]] >> 16, 0u) << what << " symbol " << j;
        }
      }
    }
  }
}

TEST_P(RansKernelTiers, SimdEncodeMatchesScalarAndDecodesBack) {
  ASSERT_TRUE(testing::ReportSimdPath("rans encode", HaveSimdEncoder(), "AVX-512", "scalar only"));
  std::mt19937 rng(11);
  for (int bits = 1; bits <= 8; ++bits) {
    for (uint32_t channels : {1u, 2u, 8u, 16u, 24u, 48u, 128u}) {
      for (bool per_channel : {true, false}) {
        const uint32_t n_tables = per_channel ? channels : 1, A = 1u << bits;
        const std::vector<uint32_t> entries = RandomTables(rng, n_tables, bits);
        std::vector<uint32_t> rcp(entries.size());
        for (size_t k = 0; k < entries.size(); ++k) rcp[k] = EncodeReciprocal(entries[k] >> 16);
        const rans::Run run{entries.data(), per_channel ? A : 0, channels, bits};
        // Symbols the tables can code (frequency > 0), drawn per channel.
        const uint32_t n = kLanes * (20 + rng() % 30);
        std::vector<uint8_t> sym(n);
        for (uint32_t j = 0; j < n; ++j) {
          const uint32_t* t = entries.data() + (per_channel ? size_t(j % channels) * A : 0);
          do sym[j] = uint8_t(rng() % A);
          while ((t[sym[j]] >> 16) == 0);
        }
        std::vector<uint8_t> buf_a(n * 2 + 64), buf_b(n * 2 + 64);
        EncoderState a;
        std::fill(a.x, a.x + kLanes, kLow);
        a.ptr = buf_a.data() + buf_a.size();
        EncodeRunScalar(a, run, rcp.data(), n, sym.data());
        const std::string what = "bits " + std::to_string(bits) + " channels " + std::to_string(channels) +
                                 (per_channel ? " per channel" : " shared");
        const size_t len_a = size_t(buf_a.data() + buf_a.size() - a.ptr);
        // Gathers, and permutes over lane tables where the run has them (small alphabets whose
        // channels line up with vectors).
        const std::vector<uint32_t> lanes = EncodeLaneTables(run, rcp.data());
        EXPECT_EQ(lanes.empty(), LaneTables(run).empty() || !per_channel) << what;
        for (bool use_lanes : {false, true}) {
          if (use_lanes && lanes.empty()) continue;
          EncoderState b;
          std::fill(b.x, b.x + kLanes, kLow);
          b.ptr = buf_b.data() + buf_b.size();
          EncodeRun(b, run, rcp.data(), use_lanes ? lanes : std::vector<uint32_t>{}, n, sym.data());
          const size_t len_b = size_t(buf_b.data() + buf_b.size() - b.ptr);
          ASSERT_EQ(len_a, len_b) << what << (use_lanes ? " lanes" : " gathers");
          ASSERT_EQ(std::memcmp(a.ptr, b.ptr, len_a), 0) << what << (use_lanes ? " lanes" : " gathers");
          ASSERT_EQ(std::memcmp(a.x, b.x, sizeof(a.x)), 0) << what << (use_lanes ? " lanes" : " gathers");
        }
        // And the stream decodes to the symbols, ending in the initial states.
        DecoderState d;
        std::memcpy(d.x, a.x, sizeof(d.x));
        d.ptr = a.ptr;
        d.end = buf_a.data() + buf_a.size();
        std::vector<uint8_t> back(n);
        ASSERT_TRUE(DecodeRunScalar(d, run, 0, n, back.data())) << what;
        ASSERT_EQ(back, sym) << what;
        EXPECT_EQ(d.ptr, d.end) << what;
        for (int l = 0; l < kLanes; ++l) EXPECT_EQ(d.x[l], kLow) << what;
      }
    }
  }
}

// A quantisation-code-shaped table: a discretised Gaussian of the given width, every symbol present.
std::vector<uint32_t> GaussianTable(int bits, double width) {
  const uint32_t A = 1u << bits;
  std::vector<double> p(A);
  double total = 0;
  for (uint32_t s = 0; s < A; ++s) total += p[s] = std::exp(-0.5 * std::pow((s - A / 2.0) / (A * width), 2));
  std::vector<uint32_t> entries(A);
  uint32_t start = 0;
  for (uint32_t s = 0; s < A; ++s) {
    const uint32_t f = s + 1 == A ? kProbScale - start : std::max<uint32_t>(1, uint32_t(p[s] / total * (kProbScale - A)));
    entries[s] = start | f << 16;
    start += f;
  }
  return entries;
}

// Two random streams for the pair decoders, each also decoded alone by the scalar reference:
// `pair` holds the starting states for the pair decoder, `ref` where the reference ended.
struct TwoStreams {
  std::vector<uint8_t> stream[2], out_ref[2], out_pair[2];
  DecoderState ref[2], pair[2];
  bool ok_ref[2];
  // `short_second`: the second stream holds only n bytes, so it runs out before n symbols.
  TwoStreams(std::mt19937& rng, const rans::Run* run, uint32_t n, bool short_second) {
    for (int q = 0; q < 2; ++q) {
      stream[q].resize(q == 1 && short_second ? n : n * 2 + 100);
      for (auto& b : stream[q]) b = uint8_t(rng());
      for (int l = 0; l < kLanes; ++l) ref[q].x[l] = kLow + rng() % ((1u << 31) - kLow);
      ref[q].ptr = stream[q].data();
      ref[q].end = stream[q].data() + stream[q].size();
      pair[q] = ref[q];
      out_ref[q].assign(n, 0);
      out_pair[q].assign(n, 0);
      ok_ref[q] = DecodeRunScalar(ref[q], run[q], 0, n, out_ref[q].data());
    }
  }
  // Finishes each run alone from where the pair stopped (DecodeRun over `lanes`, or none) and
  // checks symbols, read position and final states against the reference.
  void FinishAndCompare(const rans::Run* run, const std::vector<uint32_t>* lanes, uint32_t n, uint32_t done,
                        const std::string& what) {
    for (int q = 0; q < 2; ++q) {
      const bool ok = DecodeRun(pair[q], run[q], lanes ? lanes[q] : std::vector<uint32_t>{}, {}, n - done,
                                out_pair[q].data() + done);
      ASSERT_EQ(ok, ok_ref[q]) << what << " stream " << q;
      ASSERT_EQ(out_pair[q], out_ref[q]) << what << " stream " << q;
      ASSERT_EQ(pair[q].ptr, ref[q].ptr) << what << " stream " << q;
      ASSERT_EQ(std::memcmp(pair[q].x, ref[q].x, sizeof(ref[q].x)), 0) << what << " stream " << q;
    }
  }
};

// Two streams in one loop against two scalar decodes: bucket tables of shared tables (random
// ones, with absent symbols, and code-shaped ones), streams of different lengths so that the
// pair stops early and DecodeRun finishes each run.
TEST_P(RansKernelTiers, PairDecodeMatchesTwoScalarDecodes) {
  std::mt19937 rng(5);
  int paired = 0;
  for (int bits = 1; bits <= 7; ++bits) {
    for (int round = 0; round < 12; ++round) {
      std::vector<uint32_t> entries[2];
      for (int q = 0; q < 2; ++q) {
        entries[q] = round % 3 == 0 ? RandomTables(rng, 1, bits) : GaussianTable(bits, 0.2 + 0.05 * (rng() % 4));
      }
      const rans::Run run[2] = {{entries[0].data(), 0, 1, bits}, {entries[1].data(), 1u << bits, 1, bits}};
      const std::vector<uint32_t> buckets[2] = {BucketTables(run[0]), BucketTables(run[1])};
      const std::string what = "bits " + std::to_string(bits) + " round " + std::to_string(round);
      if (buckets[0].empty() || buckets[1].empty()) {
        if (round % 3 != 0 && bits <= 4) ADD_FAILURE() << what << ": a code-shaped table has no bucket tables";
        continue;
      }
      const uint32_t n = kLanes * (30 + rng() % 20);
      TwoStreams t(rng, run, n, round % 2);  // the second stream sometimes runs out before n symbols
      const uint32_t done = DecodeRunPair(t.pair[0], buckets[0], t.out_pair[0].data(), t.pair[1], buckets[1],
                                          t.out_pair[1].data(), n);
      ASSERT_EQ(done % kLanes, 0u) << what;
      ASSERT_LE(done, n) << what;
      if (HaveSimdDecoder() && round % 2 == 0) EXPECT_EQ(done, n) << what;
      paired += done > 0;
      t.FinishAndCompare(run, nullptr, n, done, what);
      if (HasFatalFailure()) return;
    }
  }
  if (HaveSimdDecoder()) EXPECT_GT(paired, 20);
}

// Two streams of 4-bit runs over lane tables (a table per channel, or one shared) in one loop
// against two scalar decodes: channel counts whose stretches differ (lcm of 32 and both), random
// tables with absent symbols, a second stream that sometimes runs out; DecodeRun, starting at
// channel 0 with lane tables, finishes each run where the pair stopped.
TEST_P(RansKernelTiers, PairLanesDecodeMatchesTwoScalarDecodes) {
  std::mt19937 rng(9);
  int paired = 0;
  const std::pair<uint32_t, uint32_t> layouts[] = {{128, 128}, {128, 16}, {48, 128}, {8, 1}, {16, 48}, {1, 1}};
  for (const auto& [ca, cb] : layouts) {
    for (int round = 0; round < 6; ++round) {
      const uint32_t channels[2] = {ca, cb};
      std::vector<uint32_t> entries[2];
      rans::Run run[2];
      for (int q = 0; q < 2; ++q) {
        const bool shared = channels[q] == 1 && round % 2;
        entries[q] = RandomTables(rng, shared ? 1 : channels[q], 4);
        run[q] = {entries[q].data(), shared ? 0u : 16u, channels[q], 4};
      }
      const std::vector<uint32_t> lanes[2] = {LaneTables(run[0]), LaneTables(run[1])};
      ASSERT_FALSE(lanes[0].empty() || lanes[1].empty());
      const uint32_t period = std::lcm(std::lcm(uint32_t(kLanes), ca), cb);
      const uint32_t n = period * (8 + rng() % 8) + kLanes * (rng() % 3);
      const std::string what = "channels " + std::to_string(ca) + "/" + std::to_string(cb) + " round " + std::to_string(round);
      TwoStreams t(rng, run, n, round % 3 == 1);  // the second sometimes runs out
      const uint32_t done = DecodeRunPairLanes(t.pair[0], run[0], lanes[0], t.out_pair[0].data(), t.pair[1], run[1],
                                               lanes[1], t.out_pair[1].data(), n);
      ASSERT_EQ(done % period, 0u) << what;
      ASSERT_LE(done, n) << what;
      if (HaveSimdDecoder() && round % 3 != 1) EXPECT_EQ(done, n / period * period) << what;
      paired += done > 0;
      t.FinishAndCompare(run, lanes, n, done, what);
      if (HasFatalFailure()) return;
    }
  }
  if (HaveSimdDecoder()) EXPECT_GT(paired, 20);
  // Other alphabets are not paired this way.
  const std::vector<uint32_t> three = RandomTables(rng, 16, 3);
  const rans::Run r3{three.data(), 8, 16, 3};
  DecoderState st{};
  std::vector<uint8_t> out(64);
  EXPECT_EQ(DecodeRunPairLanes(st, r3, LaneTables(r3), out.data(), st, r3, LaneTables(r3), out.data(), 64), 0u);
}

TEST(RansKernels, BucketTablesOnlyForOneTableWithFewStartsPerBucket) {
  const std::vector<uint32_t> code = GaussianTable(4, 0.2);
  EXPECT_FALSE(BucketTables(rans::Run{code.data(), 0, 128, 4}).empty());
  EXPECT_FALSE(BucketTables(rans::Run{code.data(), 16, 1, 4}).empty());  // one channel
  EXPECT_TRUE(BucketTables(rans::Run{code.data(), 16, 2, 4}).empty());   // a table per channel
  // Nine symbols starting inside the first 128 slots: past kMaxBounds.
  std::vector<uint32_t> rare(16);
  uint32_t start = 0;
  for (uint32_t s = 0; s < 16; ++s) {
    const uint32_t f = s < 9 ? 10 : s + 1 < 16 ? 300 : kProbScale - start;
    rare[s] = start | f << 16;
    start += f;
  }
  EXPECT_TRUE(BucketTables(rans::Run{rare.data(), 0, 1, 4}).empty());
  // Bytes do not fit the packing, even spread evenly (no start inside a bucket).
  std::vector<uint32_t> bytes(256);
  for (uint32_t s = 0; s < 256; ++s) bytes[s] = s * 16 | 16u << 16;
  EXPECT_TRUE(BucketTables(rans::Run{bytes.data(), 0, 1, 8}).empty());
  for (uint32_t s = 0; s < 128; ++s) bytes[s] = s * 32 | 32u << 16;  // three starts inside each bucket
  EXPECT_FALSE(BucketTables(rans::Run{bytes.data(), 0, 1, 7}).empty());
}

TEST(RansKernels, LaneTablesOnlyForAlignedSmallAlphabets) {
  std::vector<uint32_t> e(48 << 4, 0);
  EXPECT_FALSE(LaneTables(rans::Run{e.data(), 16, 16, 4}).empty());
  EXPECT_FALSE(LaneTables(rans::Run{e.data(), 16, 48, 4}).empty());
  EXPECT_FALSE(LaneTables(rans::Run{e.data(), 16, 8, 4}).empty());
  EXPECT_FALSE(LaneTables(rans::Run{e.data(), 0, 24, 4}).empty());  // one table for all lanes
  EXPECT_TRUE(LaneTables(rans::Run{e.data(), 16, 24, 4}).empty());
  EXPECT_TRUE(LaneTables(rans::Run{e.data(), 32, 16, 5}).empty());
}

TEST(RansKernels, TruncatedStreamIsReported) {
  std::mt19937 rng(3);
  const std::vector<uint32_t> entries = RandomTables(rng, 1, 4);
  const rans::Run run{entries.data(), 0, 1, 4};
  std::vector<uint8_t> stream(10, 0), out(kLanes * 64);
  DecoderState st;
  for (int l = 0; l < kLanes; ++l) st.x[l] = kLow;
  st.ptr = stream.data();
  st.end = stream.data() + stream.size();
  EXPECT_FALSE(DecodeRun(st, run, LaneTables(run), {}, uint32_t(out.size()), out.data()));
}

// The counter (byte accumulators for small alphabets, widened past 255 rows) against direct
// increments, over many sections of one context: short and long sections, partial last rows,
// one channel and wide rows, either variant alone, every alphabet.
using RansCounterTiers = testing::SimdTier;
TEST_P(RansCounterTiers, ContextCounterMatchesReference) {
  testing::ReportSimdPath("rans counter", cpu::Use(cpu::Tier::kAvx512), "AVX-512 register accumulators",
                          "vectorised loops over memory");
  std::mt19937 rng(11);
  for (int bits = 1; bits <= 8; ++bits) {
    for (uint32_t C : {1u, 8u, 64u, 128u, 200u}) {
      for (int variants = 1; variants <= 3; ++variants) {
        const uint32_t A = 1u << bits;
        std::vector<uint64_t> want(size_t(C) * A), want_pred(want.size()), got(want.size()), got_pred(want.size());
        uint64_t* g = variants & 1 ? got.data() : nullptr;
        uint64_t* gp = variants & 2 ? got_pred.data() : nullptr;
        {
          ContextCounter counter(C, bits, g, gp);
          for (int sec = 0; sec < 6; ++sec) {
            // Up to 700 rows: past the accumulators' 255; skewed values, as codes are.
            const uint32_t n = uint32_t(rng() % (700 * C)) + uint32_t(sec == 0);
            std::vector<uint8_t> sym(n);
            for (uint8_t& v : sym) v = uint8_t(rng() % 4 == 0 ? rng() % A : (A / 2 + rng() % 3) % A);
            counter.Add(sym.data(), n);
            CountSectionReference(sym.data(), n, C, bits, want.data(), want_pred.data());
          }
        }
        if (g) EXPECT_EQ(got, want) << "bits " << bits << " channels " << C;
        if (gp) EXPECT_EQ(got_pred, want_pred) << "bits " << bits << " channels " << C;
      }
    }
  }
}

// rans has SIMD kernels at the avx512 tier only; below it the scalar loop is the reference itself.
INSTANTIATE_TEST_SUITE_P(Tiers, RansKernelTiers, ::testing::Values(cpu::Tier::kAvx512), testing::TierParamName);
// The counter has a plain path below avx512 and a register-accumulator one at it.
INSTANTIATE_TEST_SUITE_P(Tiers, RansCounterTiers, ::testing::Values(cpu::Tier::kBaseline, cpu::Tier::kAvx512),
                         testing::TierParamName);

}  // namespace
}  // namespace kvserve::rans
