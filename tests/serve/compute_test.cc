// What a node computes with (serve/compute.h): the llama engine and the synthetic stand-in give
// the nodes the same interface — shapes, prefill, a session's KV and generation — and the
// engine's session gives the tokens the engine itself generates.
#include "serve/compute.h"

#include <gtest/gtest.h>

#include <chrono>

#include "model/model_test_util.h"

namespace kvserve::serve_internal {
namespace {

TEST(Compute, NeedsExactlyOneOfAModelAndAStandIn) {
  SyntheticModel sm;
  auto both = MakeCompute(&testing::Stories(), &sm, nullptr, "decode");
  ASSERT_FALSE(both.ok());
  EXPECT_NE(both.status().message().find("decode node needs a model or a synthetic model"), std::string::npos);
  EXPECT_FALSE(MakeCompute(nullptr, nullptr, nullptr, "pool").ok());
}

TEST(Compute, ShapesSayWhatEachHolds) {
  auto sm = SyntheticModelByName("qwen2.5-32b", "h100");
  ASSERT_TRUE(sm.ok());
  auto stand_in = MakeCompute(nullptr, &sm.value(), nullptr, "prefill");
  ASSERT_TRUE(stand_in.ok());
  const ComputeShape& s = stand_in.value()->shape();
  EXPECT_EQ(s.n_layer, 64u);
  EXPECT_EQ(s.kv_dtype, DType::kF16);
  EXPECT_EQ(s.kv_bytes_per_token(), 256u << 10);
  EXPECT_EQ(s.per_fp16, 1);
  EXPECT_EQ(s.identity, "qwen2.5-32b");
  EXPECT_EQ(s.modelled_prefill_tps, sm->prefill_tokens_per_second);
  const LlamaModel& m = testing::Stories();
  auto engine = MakeCompute(&m, nullptr, nullptr, "prefill");
  ASSERT_TRUE(engine.ok());
  const ComputeShape& e = engine.value()->shape();
  EXPECT_EQ(e.n_layer, m.config.n_layer);
  EXPECT_EQ(e.kv_dtype, DType::kF32);
  EXPECT_EQ(e.per_fp16, 2);
  EXPECT_EQ(e.vocab, m.config.vocab_size);
  EXPECT_EQ(e.max_prompt, m.config.seq_len - 1);
  EXPECT_EQ(e.identity, m.sha256);
  EXPECT_EQ(e.modelled_prefill_tps, 0);  // measured as it runs
  EXPECT_EQ(e.kv_bytes_per_token(), uint64_t{2} * m.config.n_layer * m.config.n_head_kv * m.config.head_dim() * 4);
}

TEST(Compute, EngineSessionsGenerateWhatTheEngineGenerates) {
  const LlamaModel& m = testing::Stories();
  auto compute = MakeCompute(&m, nullptr, nullptr, "decode");
  ASSERT_TRUE(compute.ok());
  const std::vector<int> prompt = {1, 403, 407, 261, 101, 365, 162, 293};
  EXPECT_FALSE(compute.value()->CheckPrompt({1, int(m.config.vocab_size)}).ok());
  auto pre = compute.value()->Prefill(prompt);
  ASSERT_TRUE(pre.ok()) << pre.status().ToString();
  EXPECT_EQ(pre->kv->shape().n_token, prompt.size());
  EXPECT_EQ(pre->scores.size(), prompt.size());
  EXPECT_GT(pre->prefill_s, 0);
  // The decode node's path: the transferred KV loaded, then generation.
  auto decode = compute.value()->NewSession();
  ASSERT_TRUE(decode.ok());
  ASSERT_TRUE(decode.value()->LoadPrefix(*pre->kv, uint32_t(prompt.size())).ok());
  auto tokens = decode.value()->Generate(pre->first_token, 6);
  ASSERT_TRUE(tokens.ok());
  // The pool node's path: the prompt's first 4 tokens placed as a fetched chunk, the rest
  // computed: the same first token and the same tokens.
  auto pool = compute.value()->NewSession();
  ASSERT_TRUE(pool.ok());
  auto chunk = pre->kv->SliceTokens(0, 4);
  ASSERT_TRUE(chunk.ok());
  ASSERT_TRUE(pool.value()->PlaceChunk(chunk.value(), 0));
  auto first = pool.value()->ComputeSuffix(prompt, 4);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first.value(), pre->first_token);
  ASSERT_TRUE(pool.value()->KeepPrefix(4).ok());
  auto again = pool.value()->Generate(first.value(), 6);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again.value(), tokens.value());
  auto kept = pool.value()->Kept(uint32_t(prompt.size()));
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(kept.value()->shape().n_token, 4u);  // taken before generation extended the cache
  // A chunk beyond the cache does not fit, and nothing is written.
  EXPECT_FALSE(pool.value()->PlaceChunk(chunk.value(), m.config.seq_len - 2));
}

TEST(Compute, TheStandInTakesItsModelledTimeOnePromptAtATime) {
  SyntheticModel sm;
  sm.n_layer = 2, sm.n_head_kv = 2, sm.head_dim = 16;
  sm.prefill_tokens_per_second = 1000;  // 50 ms a 50-token prompt
  sm.decode_tokens_per_second = 100;    // 10 ms a token
  auto compute = MakeCompute(nullptr, &sm, nullptr, "prefill");
  ASSERT_TRUE(compute.ok());
  ASSERT_TRUE(compute.value()->Prepare(50).ok());
  const std::vector<int> prompt(50, 1);
  auto t0 = std::chrono::steady_clock::now();
  auto a = compute.value()->Prefill(prompt);
  ASSERT_TRUE(a.ok());
  EXPECT_GE(a->prefill_s, 0.045);
  EXPECT_EQ(a->kv->dtype(), DType::kF16);
  EXPECT_EQ(a->kv->shape().n_token, 50u);
  auto session = compute.value()->NewSession();
  ASSERT_TRUE(session.ok());
  auto tokens = session.value()->Generate(a->first_token, 4);
  ASSERT_TRUE(tokens.ok());
  EXPECT_EQ(tokens->size(), 4u);
  EXPECT_GE(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 0.045 + 0.029);
  auto kept = session.value()->Kept(50);  // the stand-in's exact KV is its synthetic prompt KV
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(kept.value()->shape().n_token, 50u);
}

}  // namespace
}  // namespace kvserve::serve_internal
