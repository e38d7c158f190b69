// The pool fetch decision: fetch beats recompute on a fast link, recompute wins on a slow one or
// a slow decoder, copies below the floor are never chosen, and the explanation says what was
// weighed. The live codec speeds it plans with (LiveCodecSpeeds).
#include <gtest/gtest.h>

#include <cmath>

#include "kvserve/controller.h"

namespace kvserve {
namespace {

const std::vector<StrategyCost> kStrategies = {
    {"none", "none", 1.0, 1.0, 0, 0},
    {"q4", "q4", 0.999, 3.7, 3e9, 8e9},
    {"q2", "q2", 0.98, 7.0, 3e9, 8e9},
};

PoolFetchRequest Req(double floor = 0.99) {
  PoolFetchRequest r;
  r.prompt_tokens = 4160;
  r.kv_bytes_per_token = 131072;  // llama3-8b fp16
  r.prefill_tokens_per_second = 25000;
  r.floor = floor;
  return r;
}

TEST(PoolDecision, FetchWinsOnAFastLinkRecomputeOnASlowOne) {
  const std::vector<PoolOption> options = {{0, 4096}, {1, 4096}, {2, 4096}};
  const PoolFetchDecision fast = DecidePoolFetch(kStrategies, options, Req(), 15e9 / 8);
  ASSERT_GE(fast.option, 0);
  EXPECT_EQ(options[size_t(fast.option)].strategy, 1u);  // q2 is below the floor
  EXPECT_LT(fast.predicted_seconds, fast.recompute_seconds);
  EXPECT_NE(fast.explanation.find("fetch 4096 cached tokens as q4"), std::string::npos) << fast.explanation;
  EXPECT_NE(fast.explanation.find("below the floor"), std::string::npos) << fast.explanation;
  // Raw at 15 Gbit/s: 512 MiB take 0.29 s, more than the 0.17 s recompute.
  const PoolFetchDecision raw_only = DecidePoolFetch(kStrategies, {{0, 4096}}, Req(), 15e9 / 8);
  EXPECT_EQ(raw_only.option, -1) << raw_only.explanation;
  EXPECT_NEAR(raw_only.recompute_seconds, 4160 / 25000.0, 1e-9);
  const PoolFetchDecision slow = DecidePoolFetch(kStrategies, options, Req(), 0.5e9 / 8);
  EXPECT_EQ(slow.option, -1);
  EXPECT_NE(slow.explanation.find("recompute 4160 tokens"), std::string::npos) << slow.explanation;
  // A lower floor admits q2, the fastest to fetch.
  const PoolFetchDecision low = DecidePoolFetch(kStrategies, options, Req(0.97), 15e9 / 8);
  ASSERT_GE(low.option, 0);
  EXPECT_EQ(options[size_t(low.option)].strategy, 2u);
}

TEST(PoolDecision, GpuQueueingFavoursFetchingWhichOverlapsIt) {
  PoolFetchRequest r = Req();
  r.gpu_wait_s = 0.5;
  const PoolFetchDecision d = DecidePoolFetch(kStrategies, {{0, 4096}}, r, 15e9 / 8);
  EXPECT_EQ(d.option, 0);  // the raw fetch (0.29 s) hides under the wait; only 64 tokens computed
  EXPECT_NEAR(d.predicted_seconds, 0.5 + 64 / 25000.0, 1e-6);
}

// The live decode factor: a decoder measured at a fifth of its profiled speed makes the q4
// fetch (wire 0.08 s at 15 Gbit/s, decode 0.07 s profiled, 0.34 s measured) slower than the
// 0.17 s recompute, and the explanation says what was measured.
TEST(PoolDecision, AMeasuredSlowDecoderMovesTheChoiceToRecompute) {
  const std::vector<PoolOption> options = {{1, 4096}};
  PoolFetchRequest r = Req();
  const PoolFetchDecision profiled = DecidePoolFetch(kStrategies, options, r, 15e9 / 8);
  EXPECT_EQ(profiled.option, 0) << profiled.explanation;
  EXPECT_EQ(profiled.explanation.find("decode measured"), std::string::npos) << profiled.explanation;
  r.decode_speed = 0.2;
  const PoolFetchDecision slowed = DecidePoolFetch(kStrategies, options, r, 15e9 / 8);
  EXPECT_EQ(slowed.option, -1) << slowed.explanation;
  EXPECT_NE(slowed.explanation.find("decode measured at 0.20× of profile"), std::string::npos) << slowed.explanation;
  EXPECT_NE(slowed.explanation.find("pool GETs at 15.00 Gbit/s"), std::string::npos) << slowed.explanation;
}

// Work in flight at the node is shared, not queued behind (processor sharing): other jobs delay
// a fetch's decode by what of them overlaps it, spread over the cores, and its wire time likewise
// on the pool link. The q4 fetch at 15 Gbit/s (wire 0.077 s, decode 0.067 s) beats the 0.17 s
// recompute alone and beside one store's encode; two encodes on one core push its decode past
// it, on four cores they do not; two GETs ahead on the link do.
TEST(PoolDecision, WorkInFlightAtTheNodeIsSharedByAFetch) {
  const std::vector<PoolOption> options = {{1, 4096}};
  const double bytes = 4096.0 * 131072, bw = 15e9 / 8;
  const double wire = bytes / (3.7 * bw), decode = bytes / 8e9;
  PoolFetchRequest r = Req();
  EXPECT_NEAR(PoolFetchSecondsShared(kStrategies[1], bytes, bw, 16, r), PoolFetchSeconds(kStrategies[1], bytes, bw, 16), 1e-12);
  EXPECT_EQ(DecidePoolFetch(kStrategies, options, r, bw).option, 0);

  r.codec_ahead_s = {0.5};
  EXPECT_NEAR(PoolFetchSecondsShared(kStrategies[1], bytes, bw, 16, r), 2 * decode + wire / 16, 1e-9);
  EXPECT_EQ(DecidePoolFetch(kStrategies, options, r, bw).option, 0);
  r.codec_ahead_s = {0.01};  // nearly done: delays it by what is left
  EXPECT_NEAR(PoolFetchSecondsShared(kStrategies[1], bytes, bw, 16, r), wire + (decode + 0.01) / 16, 1e-9);

  r.codec_ahead_s = {0.5, 0.5};
  const PoolFetchDecision busy = DecidePoolFetch(kStrategies, options, r, bw);
  EXPECT_EQ(busy.option, -1) << busy.explanation;
  EXPECT_NE(busy.explanation.find("in flight here: link 0.000 s (0), codec 1.000 s (2) on 1 core"), std::string::npos)
      << busy.explanation;
  r.codec_cores = 4;
  EXPECT_EQ(DecidePoolFetch(kStrategies, options, r, bw).option, 0);

  r = Req();
  r.link_ahead_s = {0.5, 0.5};
  EXPECT_NEAR(PoolFetchSecondsShared(kStrategies[1], bytes, bw, 16, r), 3 * wire + decode / 16, 1e-9);
  const PoolFetchDecision queued = DecidePoolFetch(kStrategies, options, r, bw);
  EXPECT_EQ(queued.option, -1) << queued.explanation;
  EXPECT_NE(queued.explanation.find("link 1.000 s (2)"), std::string::npos) << queued.explanation;
  // An uncompressed copy has no decode: the codec's work in flight does not touch it.
  r = Req();
  r.gpu_wait_s = 0.5;
  r.codec_ahead_s = {5.0};
  EXPECT_EQ(DecidePoolFetch(kStrategies, {{0, 4096}}, r, bw).option, 0);
}

// One factor per stage, from any strategy: the first measurement is taken whole, later ones
// averaged in log space; none, small stages and unmeasured stages teach nothing.
TEST(LiveCodecSpeeds, LearnsOneFactorPerStageFromWhateverRan) {
  LiveCodecSpeeds live;
  const StrategyCost& q4 = kStrategies[1];  // 3 GB/s encode, 8 GB/s decode
  const double bytes = 64e6;
  live.Observe(kStrategies[0], bytes, {1.0, 1.0});  // none: no codec
  live.Observe(q4, 1e6, {1.0, 1.0});                // 1 MB: fixed costs, not speed
  live.Observe(q4, bytes, {0, 0});                  // not measured
  EXPECT_FALSE(live.measured_encode());
  EXPECT_FALSE(live.measured_decode());
  live.Observe(q4, bytes, {0, bytes / 4e9});  // decode at half its profiled 8 GB/s
  EXPECT_FALSE(live.measured_encode());
  EXPECT_NEAR(live.decode(), 0.5, 1e-9);
  EXPECT_EQ(live.encode(), 1.0);
  const StrategyCost applied = live.Apply(kStrategies[2]);
  EXPECT_NEAR(applied.decode_Bps, 4e9, 1);
  EXPECT_EQ(applied.encode_Bps, 3e9);
  live.Observe(q4, bytes, {0, bytes / 8e9});  // back at full speed: EWMA of the logs, weight 0.3
  EXPECT_NEAR(live.decode(), std::exp(0.7 * std::log(0.5)), 1e-9);
}

// Send CPU time per byte: learned from any transfer that carried enough bytes (none's too), an
// EWMA like the stage factors; charged to the encode stage only where sends share its cores.
TEST(LiveCodecSpeeds, LearnsWhatSendsCostTheCpu) {
  const StrategyCost& q4 = kStrategies[1];  // 3 GB/s encode, ratio 3.7
  const double bytes = 64e6;
  for (const bool shared : {true, false}) {
    LiveSpeedOptions o;
    o.sends_share_codec_cores = shared;
    LiveCodecSpeeds live(o);
    live.Observe(kStrategies[0], bytes, {0, 0, 1.0, 1e6});  // 1 MB: fixed costs
    EXPECT_EQ(live.send_cpu_per_byte(), 0.0);
    live.Observe(kStrategies[0], bytes, {0, 0, 0.032, bytes});  // none: 0.5 ns a byte
    EXPECT_NEAR(live.send_cpu_per_byte(), 0.5e-9, 1e-18);
    EXPECT_FALSE(live.measured_encode());
    live.Observe(q4, bytes, {0, 0, 0.064, bytes});  // 1 ns a byte: EWMA of weight 0.3
    EXPECT_NEAR(live.send_cpu_per_byte(), 0.65e-9, 1e-18);
    EXPECT_EQ(live.encode_send_cost_per_byte(), shared ? 0.65e-9 : 0.0);
    const double expect = shared ? 1 / (1 / 3e9 + 0.65e-9 / 3.7) : 3e9;
    EXPECT_NEAR(live.EncodeStageBps(q4), expect, 1);
    // An encode whose sends took more than half its time still counts half of it.
    live.Observe(q4, bytes, {bytes / 3e9, 0, bytes / 3e9, bytes / 3.7});
    EXPECT_NEAR(live.encode(), shared ? 2.0 : 1.0, 1e-9);
  }
}

TEST(PoolDecision, FetchTimeOverlapsDecodeWithTheWire) {
  const StrategyCost& q4 = kStrategies[1];
  const double bytes = 512.0 * 1024 * 1024;
  const double wire = bytes / (3.7 * 1e9), decode = bytes / 8e9;
  EXPECT_NEAR(PoolFetchSeconds(q4, bytes, 1e9, 16), std::max(wire, decode) + std::min(wire, decode) / 16, 1e-9);
  EXPECT_NEAR(PoolFetchSeconds(kStrategies[0], bytes, 1e9, 16), bytes / 1e9, 1e-9);
}

}  // namespace
}  // namespace kvserve
