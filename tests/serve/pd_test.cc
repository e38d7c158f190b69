// PD serving in process, over loopback TCP: text with `none` equals local generation for both
// shipped models; pipelined per-layer transfer gives what serial whole-block coding gives; a
// corrupted frame is resent and the answer is still right; a dead or stalled decode node ends in
// a clear error (or the next node) by the deadline; concurrent requests are answered once each.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <set>
#include <thread>

#include "kvserve/codec.h"
#include "kvserve/frame.h"
#include "kvserve/profile.h"
#include "kvserve/serve.h"
#include "model/model_test_util.h"
#include "test_paths.h"

namespace kvserve {
namespace {

using testing::Baby;
using testing::Stories;

// Local reference: the same prefill and greedy generation, with the prompt KV coded serially
// (one whole-block frame) instead of streamed per layer.
std::vector<int> LocalTokens(const LlamaModel& m, const std::vector<int>& prompt, uint32_t n, const std::string& spec) {
  LlamaEngine engine(m);
  KvCache cache = KvCache::Create(m.config).value();
  std::vector<float> logits(m.config.vocab_size);
  AttentionCapture cap;
  cap.window = std::min<uint32_t>(32, uint32_t(prompt.size()));
  EXPECT_TRUE(engine.Forward(prompt.data(), uint32_t(prompt.size()), &cache, logits.data(), true, &cap).ok());
  std::vector<float> scores(prompt.size(), 0.0f);
  for (size_t row = 0; row < cap.probs.size() / cap.n_prompt; ++row)
    for (uint32_t j = 0; j < prompt.size(); ++j) scores[j] += cap.probs[row * cap.n_prompt + j];
  KvBlock kv = cache.Prefix(uint32_t(prompt.size())).value();
  CodecOptions co;
  co.token_scores = &scores;
  ByteBuffer f = EncodeKv(kv, spec, co).value();
  KvBlock back;
  EXPECT_TRUE(DecodeKv(f, &back).ok());
  KvCache dec = KvCache::Create(m.config).value();
  EXPECT_TRUE(dec.LoadPrefix(back, uint32_t(prompt.size())).ok());
  std::vector<int> out = {int(Argmax(logits.data(), m.config.vocab_size))};
  int tok = out[0];
  while (out.size() < n && dec.next_pos < m.config.seq_len) {
    EXPECT_TRUE(engine.Forward(&tok, 1, &dec, logits.data(), true).ok());
    if (dec.next_pos >= m.config.seq_len) break;
    tok = int(Argmax(logits.data(), m.config.vocab_size));
    out.push_back(tok);
  }
  return out;
}

class Pd : public ::testing::Test {
 protected:
  void StartDecodeNodes(const LlamaModel& m, int n) {
    for (int i = 0; i < n; ++i) {
      auto node = std::make_unique<DecodeNode>(transport_.get(), DecodeNodeOptions{.model = &m, .request_timeout_s = 5});
      ASSERT_TRUE(node->Start("127.0.0.1:0").ok());
      peers_.push_back("127.0.0.1:" + std::to_string(node->port()));
      decoders_.push_back(std::move(node));
    }
  }
  std::unique_ptr<PrefillNode> Prefill(const LlamaModel& m, PrefillNodeOptions o = {}) {
    o.model = &m;
    if (o.decode_peers.empty()) o.decode_peers = peers_;
    if (o.request_timeout_s == 30) o.request_timeout_s = 5;
    return PrefillNode::Create(transport_.get(), o).value();
  }
  static ServeRequest Req(const LlamaModel& m, const std::string& text, uint32_t n, uint64_t id = 1) {
    ServeRequest r;
    r.id = id;
    r.prompt = m.tokenizer.Encode(text, true);
    r.max_new_tokens = n;
    return r;
  }
  std::unique_ptr<Transport> transport_ = MakeTcpTransport();
  std::vector<std::unique_ptr<DecodeNode>> decoders_;
  std::vector<std::string> peers_;
};

TEST_F(Pd, TextWithNoneEqualsLocalGenerationForBothModels) {
  for (const LlamaModel* m : {&Stories(), &Baby()}) {
    decoders_.clear();
    peers_.clear();
    StartDecodeNodes(*m, 1);
    auto prefill = Prefill(*m);
    const ServeRequest req = Req(*m, "Once upon a time, there was a little girl", 48);
    auto r = prefill->Serve(req);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    LlamaEngine engine(*m);
    const std::vector<int> local = engine.Generate(req.prompt, 48).value();
    EXPECT_EQ(r->tokens, local) << m->name;
    EXPECT_EQ(r->strategy, "none");
    EXPECT_EQ(r->wire_bytes, r->kv_bytes + m->config.n_layer * (kFrameFixedHeader + 4 + 8)) << m->name;
    EXPECT_GT(r->timings.prefill_s, 0);
    EXPECT_LE(r->timings.transfer_s, r->timings.total_s);
  }
}

TEST_F(Pd, PipelinedLayerStreamGivesWhatSerialCodingGives) {
  StartDecodeNodes(Baby(), 1);
  auto prefill = Prefill(Baby());
  for (const std::string spec : {"quant(kbits=4,vbits=4)|zstd", "quant(kbits=2,vbits=2,boost_layers=1)|rans",
                                 "prune(keep=0.5,recent=8)|quant|rans", "mixhq|rans", "rotate|quant(kbits=3)"}) {
    ServeRequest req = Req(Baby(), "The little dog ran to the park and", 32);
    req.strategy = CanonicalStrategy(spec).value();
    auto r = prefill->Serve(req);
    ASSERT_TRUE(r.ok()) << spec << ": " << r.status().ToString();
    EXPECT_EQ(r->tokens, LocalTokens(Baby(), req.prompt, 32, spec)) << spec;
    EXPECT_LT(r->wire_bytes, r->kv_bytes) << spec;
    EXPECT_EQ(r->explanation, "strategy given by the request");
  }
}

TEST_F(Pd, CorruptedFramesAreResentAndTheAnswerIsRight) {
  StartDecodeNodes(Stories(), 1);
  PrefillNodeOptions o;
  o.corrupt_every = 2;
  auto prefill = Prefill(Stories(), o);
  const ServeRequest req = Req(Stories(), "Lily wanted to play", 24);
  auto r = prefill->Serve(req);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_GE(r->resent_layers, 2u);
  EXPECT_EQ(r->tokens, LlamaEngine(Stories()).Generate(req.prompt, 24).value());
  EXPECT_GE(decoders_[0]->metrics().corrupt_frames.load(), 2u);
}

// A decode "node" that takes the request and one frame, then drops the connection, as a process
// killed mid-transfer would; and one that accepts and never reads.
class BadDecodeNode {
 public:
  enum Mode { kDropMidTransfer, kStall };
  BadDecodeNode(Transport* t, Mode mode) : listener_(t->Listen("127.0.0.1:0").value()) {
    thread_ = std::thread([this, mode] {
      while (!stop_) {
        auto c = listener_->Accept(DeadlineIn(0.1));
        if (!c.ok()) continue;
        if (mode == kDropMidTransfer) {
          (void)c.value()->Receive(DeadlineIn(5));
          (void)c.value()->Receive(DeadlineIn(5));
          c.value()->Close();
        } else {
          held_.push_back(std::move(c).value());
        }
      }
    });
  }
  ~BadDecodeNode() {
    stop_ = true;
    thread_.join();
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(listener_->port()); }

 private:
  std::unique_ptr<Listener> listener_;
  std::vector<std::unique_ptr<Connection>> held_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

TEST_F(Pd, DecodeNodeDyingMidTransferFailsOverOrFailsClearly) {
  StartDecodeNodes(Stories(), 1);
  BadDecodeNode dying(transport_.get(), BadDecodeNode::kDropMidTransfer);
  const ServeRequest req = Req(Stories(), "Tom had a red ball", 16);
  PrefillNodeOptions o;
  o.decode_peers = {dying.address(), peers_[0]};
  auto prefill = Prefill(Stories(), o);
  auto r = prefill->Serve(req);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->decode_node, peers_[0]);
  EXPECT_EQ(r->tokens, LlamaEngine(Stories()).Generate(req.prompt, 16).value());
  PrefillNodeOptions alone;
  alone.decode_peers = {dying.address()};
  auto lonely = Prefill(Stories(), alone);
  auto f = lonely->Serve(req);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kUnavailable) << f.status().ToString();
}

TEST_F(Pd, StalledDecodeNodeCostsAtMostTheDeadlineAndBlocksNoOtherRequest) {
  StartDecodeNodes(Stories(), 1);
  BadDecodeNode stalled(transport_.get(), BadDecodeNode::kStall);
  PrefillNodeOptions o;
  o.decode_peers = {stalled.address()};
  o.request_timeout_s = 1;
  auto stuck = Prefill(Stories(), o);
  auto healthy = Prefill(Stories());
  // A prompt whose KV does not fit the socket buffers, so the sender really waits on the peer.
  ServeRequest big;
  big.id = 9;
  big.max_new_tokens = 4;
  for (int i = 0; i < 500; ++i) big.prompt.push_back(1 + i % 400);
  const auto t0 = std::chrono::steady_clock::now();
  auto pending = std::async(std::launch::async, [&] { return stuck->Serve(big); });
  // Meanwhile another request on a healthy node is served.
  auto ok = healthy->Serve(Req(Stories(), "Sam saw a cat", 8));
  EXPECT_TRUE(ok.ok()) << ok.status().ToString();
  auto r = pending.get();
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find("deadline"), std::string::npos) << r.status().message();
  EXPECT_LT(took, 20.0) << "bounded by the 1 s deadline, with generous slack for a loaded machine";
}

TEST_F(Pd, ConcurrentRequestsAreEachAnsweredOnceWithSerialTokens) {
  StartDecodeNodes(Stories(), 2);
  auto prefill = Prefill(Stories());
  const char* prompts[] = {"Once upon a time", "The sun was", "A little bird", "Max and Mia"};
  std::vector<std::vector<int>> serial;
  for (const char* p : prompts) serial.push_back(LlamaEngine(Stories()).Generate(Req(Stories(), p, 12).prompt, 12).value());
  constexpr int kRequests = 64;
  std::vector<std::future<Result<ServeResponse>>> futures;
  for (int i = 0; i < kRequests; ++i) {
    futures.push_back(std::async(std::launch::async, [&, i] {
      ServeRequest req = Req(Stories(), prompts[i % 4], 12, uint64_t(1000 + i));
      if (i % 3 == 0) req.strategy = "none";
      return prefill->Serve(req);
    }));
  }
  std::set<uint64_t> ids;
  for (int i = 0; i < kRequests; ++i) {
    auto r = futures[i].get();
    ASSERT_TRUE(r.ok()) << i << ": " << r.status().ToString();
    EXPECT_EQ(r->tokens, serial[i % 4]) << i;
    EXPECT_TRUE(ids.insert(r->id).second) << "answered twice: " << r->id;
  }
  EXPECT_EQ(ids.size(), size_t(kRequests));
  EXPECT_EQ(decoders_[0]->metrics().requests + decoders_[1]->metrics().requests, uint64_t(kRequests));
}

TEST_F(Pd, AdaptiveChoiceComesFromTheProfileWithItsExplanation) {
  StartDecodeNodes(Baby(), 1);
  const Profile profile = LoadProfile(SourceDir() + "/bench/profiles/default.json").value();
  PrefillNodeOptions o;
  o.profile = &profile;
  o.assume_gbps = 0.01;  // a slow link: compression pays
  auto prefill = Prefill(Baby(), o);
  ServeRequest req = Req(Baby(), "The little dog ran to the park and", 16);
  req.floor = 0.95;
  auto r = prefill->Serve(req);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_NE(r->strategy, "none");
  EXPECT_FALSE(r->explanation.empty());
  bool in_profile = false;
  for (const ProfileEntry& e : profile.pareto) in_profile = in_profile || e.spec == r->strategy;
  EXPECT_TRUE(in_profile) << r->strategy;
  EXPECT_EQ(r->tokens, LocalTokens(Baby(), req.prompt, 16, r->strategy));
}

TEST(ServeJson, MalformedRequestsAreRefusedWithTheReason) {
  const Tokenizer& tok = Stories().tokenizer;
  auto bad = [&](const std::string& body, const std::string& want) {
    auto r = ParseServeRequest(body, &tok, 256);
    ASSERT_FALSE(r.ok()) << body;
    EXPECT_NE(r.status().message().find(want), std::string::npos) << body << " -> " << r.status().message();
  };
  bad("{not json", "not valid JSON");
  bad("[1,2]", "JSON object");
  bad(R"({"prompt":"hi","slo_ms":-5})", "'slo_ms' = -5");
  bad(R"({"prompt":"hi","floor":2})", "'floor' = 2");
  bad(R"({"prompt":"hi","max_new_tokens":0})", "'max_new_tokens' = 0");
  bad(R"({"prompt":"hi","strategy":"zzz"})", "unknown stage 'zzz'");
  bad(R"({"tokens":[1,2,"x"]})", "not a token id");
  bad(R"({"prompt":"a","tokens":[1]})", "exactly one of");
  std::string huge = R"({"tokens":[)";
  for (int i = 0; i < 300; ++i) huge += (i ? ",1" : "1");
  bad(huge + "]}", "above the limit of 256");
  auto ok = ParseServeRequest(R"({"prompt":"Once upon a time","max_new_tokens":5,"label":"chat","id":7})", &tok, 256);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->id, 7u);
  EXPECT_EQ(ok->prompt, tok.Encode("Once upon a time", true));
}

}  // namespace
}  // namespace kvserve
