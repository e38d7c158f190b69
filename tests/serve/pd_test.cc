// PD serving in process, over loopback TCP: text with `none` equals local generation for both
// shipped models; pipelined per-layer transfer gives what serial whole-block coding gives; a
// corrupted frame is resent and the answer is still right; a dead or stalled decode node ends in
// a clear error (or the next node) by the deadline; concurrent requests are answered once each;
// an adaptive decision sees the transfers in flight ahead of it.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include <chrono>
#include <condition_variable>
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

// The decode node reuses its request buffers (a KV slot and a frame buffer) across requests:
// a long prompt, then a short one with token selection, then the long one again, each into a
// slot an earlier request of another shape left behind — every answer is the local one.
TEST_F(Pd, ReusedRequestBuffersGiveEachRequestItsOwnKv) {
  StartDecodeNodes(Stories(), 1);
  auto prefill = Prefill(Stories());
  const ServeRequest long_req = Req(Stories(), "Once upon a time, there was a little girl named Lily. She loved to play outside", 12, 1);
  ServeRequest pruned_req = Req(Stories(), "Tom had a red ball", 12, 2);
  pruned_req.strategy = CanonicalStrategy("prune(sink=2,recent=2,keep=0.5)|quant(kbits=4,vbits=4)").value();
  ServeRequest again_req = long_req;
  again_req.id = 3;
  const ServeRequest &pruned = pruned_req, &again = again_req;
  for (const ServeRequest* r : {&long_req, &pruned, &again, &pruned}) {
    auto out = prefill->Serve(*r);
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    const std::string spec = r->strategy.empty() ? "none" : r->strategy;
    EXPECT_EQ(out->tokens, LocalTokens(Stories(), r->prompt, 12, spec)) << r->id;
  }
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

// Holds every frame of the first connection it makes until Open(): that transfer stays in flight
// (its frames encoded, none on the wire) for as long as a test needs.
class HeldTransport : public Transport {
 public:
  explicit HeldTransport(Transport* inner) : inner_(inner) {}
  std::string name() const override { return "held"; }
  Result<std::unique_ptr<Listener>> Listen(const std::string& address) override { return inner_->Listen(address); }
  Result<std::unique_ptr<Connection>> Connect(const std::string& address, Clock::time_point deadline) override {
    KV_ASSIGN_OR_RETURN(std::unique_ptr<Connection> c, inner_->Connect(address, deadline));
    return std::unique_ptr<Connection>(new Held(std::move(c), connections_++ == 0 ? this : nullptr));
  }
  void Open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }

 private:
  class Held : public Connection {
   public:
    Held(std::unique_ptr<Connection> c, HeldTransport* gate) : c_(std::move(c)), gate_(gate) {}
    Status Send(MessageKind kind, std::span<const uint8_t> body, Clock::time_point deadline) override {
      if (gate_ != nullptr && kind == MessageKind::kFrame) {
        std::unique_lock<std::mutex> lock(gate_->mu_);
        gate_->cv_.wait(lock, [&] { return gate_->open_; });
      }
      return c_->Send(kind, body, deadline);
    }
    Result<Message> Receive(Clock::time_point deadline, ByteBuffer* storage) override { return c_->Receive(deadline, storage); }
    void set_max_message_bytes(uint64_t bytes) override { c_->set_max_message_bytes(bytes); }
    void Close() override { c_->Close(); }
    std::string peer() const override { return c_->peer(); }

   private:
    std::unique_ptr<Connection> c_;
    HeldTransport* gate_;
  };
  Transport* inner_;
  std::atomic<int> connections_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

// The adaptive rule decides behind the node's own transfers in flight (docs/CONTROLLER.md
// "Queues"): a request arriving while another's KV waits for the link sees that link work, says
// so, and picks at least the ratio it picks on an idle link.
TEST_F(Pd, AdaptiveDecisionsSeeTheTransfersInFlight) {
  StartDecodeNodes(Baby(), 1);
  const Profile profile = LoadProfile(SourceDir() + "/bench/profiles/default.json").value();
  HeldTransport held(transport_.get());
  PrefillNodeOptions o;
  o.model = &Baby();
  o.decode_peers = peers_;
  o.request_timeout_s = 20;
  o.profile = &profile;
  o.assume_gbps = 0.05;
  auto prefill = PrefillNode::Create(&held, o).value();
  auto idle = PrefillNode::Create(transport_.get(), o).value();
  EXPECT_EQ(prefill->queues().link_jobs, 0u);

  ServeRequest first = Req(Baby(), "Once upon a time, there was a little girl named Lily. She loved to play outside in the park", 4, 1);
  first.strategy = "none";
  auto pending = std::async(std::launch::async, [&] { return prefill->Serve(first); });
  QueueState q;
  for (int i = 0; i < 1000 && (q = prefill->queues()).link_jobs == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(q.link_jobs, 1u) << "the held transfer is in flight";
  EXPECT_EQ(q.encode_jobs, 0u) << "none has no encode work";

  ServeRequest second = Req(Baby(), "The little dog ran to the park and", 8, 2);
  second.floor = 0.95;
  auto behind = prefill->Serve(second);
  ASSERT_TRUE(behind.ok()) << behind.status().ToString();
  EXPECT_NE(behind->explanation.find("queued: link"), std::string::npos) << behind->explanation;
  EXPECT_NE(behind->explanation.find("(1)"), std::string::npos) << behind->explanation;
  EXPECT_EQ(behind->tokens, LocalTokens(Baby(), second.prompt, 8, behind->strategy));
  auto alone = idle->Serve(second);
  ASSERT_TRUE(alone.ok()) << alone.status().ToString();
  EXPECT_EQ(alone->explanation.find("queued:"), std::string::npos) << alone->explanation;
  auto ratio = [&](const std::string& spec) {
    for (const ProfileEntry& e : profile.pareto)
      if (e.spec == spec) return e.ratio;
    return 1.0;
  };
  EXPECT_GE(ratio(behind->strategy), ratio(alone->strategy)) << behind->strategy << " vs " << alone->strategy;

  held.Open();
  auto r = pending.get();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  // What was seen waiting is the held request's KV at the assumed rate (frame headers aside).
  EXPECT_NEAR(q.link_wait, double(r->kv_bytes) / (o.assume_gbps * 1e9 / 8), 0.05 * q.link_wait);
  const QueueState after = prefill->queues();
  EXPECT_EQ(after.link_jobs + after.encode_jobs, 0u);
  EXPECT_EQ(after.link_wait, 0.0);
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

// A decode "node" that takes the request and its frames and then answers `reply` (of `kind`) —
// a decode node that lies, or a stranger on the port: the prefill node must refuse each answer
// with a clear error, not throw, truncate or do what it is told.
class ScriptedDecodeNode {
 public:
  ScriptedDecodeNode(Transport* t, MessageKind kind, std::string reply)
      : listener_(t->Listen("127.0.0.1:0").value()), kind_(kind), reply_(std::move(reply)) {
    thread_ = std::thread([this] {
      while (!stop_) {
        auto c = listener_->Accept(DeadlineIn(0.1));
        if (!c.ok()) continue;
        while (!stop_) {
          auto m = c.value()->Receive(DeadlineIn(5));
          if (!m.ok()) break;
          if (m->kind == MessageKind::kFrame) frames_++;
          if (m->kind != MessageKind::kEnd) continue;
          if (ends_++ > 0) break;  // a second end: whatever was resent has arrived
          (void)c.value()->Send(kind_, std::span(reinterpret_cast<const uint8_t*>(reply_.data()), reply_.size()), DeadlineIn(5));
        }
        c.value()->Close();
      }
    });
  }
  ~ScriptedDecodeNode() {
    stop_ = true;
    thread_.join();
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(listener_->port()); }
  int frames() const { return frames_; }

 private:
  std::unique_ptr<Listener> listener_;
  MessageKind kind_;
  std::string reply_;
  std::atomic<int> frames_{0}, ends_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

TEST_F(Pd, RepliesThatLieAreRefusedNotTruncatedOrObeyed) {
  const ServeRequest req = Req(Stories(), "Tom had a red ball", 3);
  const uint32_t n_layer = Stories().config.n_layer;
  std::string many_tokens = R"({"id":1,"tokens":[)";
  for (int i = 0; i < 200000; ++i) many_tokens += i ? ",5" : "5";
  many_tokens += "]}";
  std::string zeros = R"({"layers":[)";
  for (int i = 0; i < 100000; ++i) zeros += i ? ",0" : "0";
  zeros += "]}";
  const struct {
    MessageKind kind;
    std::string body, want;
  } cases[] = {
      {MessageKind::kError, R"({"error":5})", "gives no reason"},
      {MessageKind::kError, "\xff\xfe", "malformed"},
      {MessageKind::kResult, R"({"id":1,"tokens":[4294967728]})", "not a token id"},
      {MessageKind::kResult, R"({"id":1,"tokens":[5,6,7,8]})", "3 were asked for"},
      {MessageKind::kResult, many_tokens, "above the limit"},
      {MessageKind::kResult, R"({"id":1,"tokens":[5],"decode_s":"x"})", "'decode_s'"},
      {MessageKind::kResend, zeros, "above the limit"},
      {MessageKind::kResend, R"({"layers":[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15]})", "16 frames of " + std::to_string(n_layer)},
      {MessageKind::kResend, R"({"layers":[0,0]})", "twice"},
      {MessageKind::kResend, R"({"layers":[99]})", "frame 99"},
  };
  for (const auto& c : cases) {
    ScriptedDecodeNode liar(transport_.get(), c.kind, c.body);
    PrefillNodeOptions o;
    o.decode_peers = {liar.address()};
    auto prefill = Prefill(Stories(), o);
    auto r = prefill->Serve(req);
    ASSERT_FALSE(r.ok()) << c.body.substr(0, 80);
    EXPECT_NE(r.status().message().find(c.want), std::string::npos) << c.body.substr(0, 80) << " -> " << r.status().ToString();
    EXPECT_LE(liar.frames(), int(n_layer)) << "no frame sent again on a bad resend list";
  }
}

// Speaks the decode port's framing by hand: a 16-byte header ("KVSM", kind, length) and a body.
class RawPeer {
 public:
  explicit RawPeer(uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port);
    EXPECT_EQ(::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    timeval tv{5, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  ~RawPeer() { ::close(fd_); }
  void Send(MessageKind kind, uint64_t announced, const std::string& body) {
    uint8_t h[16] = {'K', 'V', 'S', 'M', uint8_t(kind)};
    std::memcpy(h + 8, &announced, 8);
    (void)::send(fd_, h, 16, MSG_NOSIGNAL);
    if (!body.empty()) (void)::send(fd_, body.data(), body.size(), MSG_NOSIGNAL);
  }
  // What the node sent back before closing: its bytes (a header and a JSON body, or nothing).
  std::string ReadUntilClosed() {
    std::string got;
    char buf[4096];
    ssize_t n;
    while ((n = ::recv(fd_, buf, sizeof buf, 0)) > 0) got.append(buf, size_t(n));
    closed_ = n == 0;
    return got;
  }
  bool closed() const { return closed_; }

 private:
  int fd_ = -1;
  bool closed_ = false;
};

TEST_F(Pd, DecodePortBoundsWhatAPeerMayAnnounceOrAskFor) {
  StartDecodeNodes(Stories(), 1);
  const uint16_t port = decoders_[0]->port();
  // A first token past 2^32 is refused by name, not truncated to a token id.
  {
    RawPeer p(port);
    const std::string body = R"({"id":3,"max_new_tokens":2,"first_token":4294967728,"prompt_len":5})";
    p.Send(MessageKind::kRequest, body.size(), body);
    const std::string got = p.ReadUntilClosed();
    EXPECT_NE(got.find("'first_token'"), std::string::npos) << got;
  }
  // A request message announcing 4 GiB - 1, and one a little over the control limit: closed
  // after the header, nothing read or answered.
  for (uint64_t announced : {uint64_t{0xFFFFFFFF}, uint64_t{100} << 10}) {
    RawPeer p(port);
    p.Send(MessageKind::kRequest, announced, "");
    EXPECT_EQ(p.ReadUntilClosed(), "") << announced;
    EXPECT_TRUE(p.closed()) << "closed at once, not after the deadline";
  }
  // A frame announcing more than twice the KV of the prompt it follows.
  {
    RawPeer p(port);
    const std::string body = R"({"id":4,"max_new_tokens":2,"first_token":5,"prompt_len":5})";
    p.Send(MessageKind::kRequest, body.size(), body);
    p.Send(MessageKind::kFrame, uint64_t{400} << 20, "");
    EXPECT_EQ(p.ReadUntilClosed(), "");
    EXPECT_TRUE(p.closed());
  }
  // The node still serves.
  auto prefill = Prefill(Stories());
  const ServeRequest req = Req(Stories(), "Sam saw a cat", 8);
  auto r = prefill->Serve(req);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->tokens, LlamaEngine(Stories()).Generate(req.prompt, 8).value());
}

// The decode port's frame limit must admit the largest frame any strategy makes, whatever the
// KV's dtype: an 8-bit code with its own fp16 range per value (group=1) is 40 bits a value,
// 2.5x the synthetic stand-in's fp16 KV.
TEST_F(Pd, SyntheticNodesTakeTheLargestFramesAStrategyMakes) {
  const SyntheticModel sm;
  DecodeNode node(transport_.get(), DecodeNodeOptions{.synthetic = &sm, .request_timeout_s = 10});
  ASSERT_TRUE(node.Start("127.0.0.1:0").ok());
  PrefillNodeOptions o;
  o.synthetic = &sm;
  o.decode_peers = {"127.0.0.1:" + std::to_string(node.port())};
  o.strategy = "quant(kbits=8,vbits=8,group=1)";
  o.request_timeout_s = 10;
  auto prefill = PrefillNode::Create(transport_.get(), o).value();
  ServeRequest r;
  r.id = 5;
  r.prompt.assign(16, 1);
  r.max_new_tokens = 2;
  auto out = prefill->Serve(r);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_GT(out->wire_bytes, 2 * out->kv_bytes);
  EXPECT_EQ(out->tokens.size(), 2u);
}

TEST_F(Pd, DecodeNodeServesAtMostMaxConnectionsAndTellsTheRestWhy) {
  DecodeNode node(transport_.get(), DecodeNodeOptions{.model = &Stories(), .request_timeout_s = 5, .max_connections = 3});
  ASSERT_TRUE(node.Start("127.0.0.1:0").ok());
  const std::string address = "127.0.0.1:" + std::to_string(node.port());
  std::vector<std::unique_ptr<Connection>> idle;
  for (int i = 0; i < 3; ++i) idle.push_back(transport_->Connect(address, DeadlineIn(5)).value());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // accepted (the loop polls every 0.2 s)
  auto extra = transport_->Connect(address, DeadlineIn(5)).value();
  auto m = extra->Receive(DeadlineIn(5));
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->kind, MessageKind::kError);
  EXPECT_NE(std::string(m->body.begin(), m->body.end()).find("busy"), std::string::npos);
  idle.clear();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  PrefillNodeOptions o;
  o.decode_peers = {address};
  auto prefill = Prefill(Stories(), o);
  const ServeRequest req = Req(Stories(), "Sam saw a cat", 6);
  auto r = prefill->Serve(req);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->tokens, LlamaEngine(Stories()).Generate(req.prompt, 6).value());
}

TEST(ServeJson, RequestsAreBoundedBeforeTheyCostAnything) {
  const Tokenizer& tok = Stories().tokenizer;
  auto bad = [&](const std::string& body, const std::string& want, uint32_t max_prompt = 256) {
    auto r = ParseServeRequest(body, &tok, max_prompt);
    ASSERT_FALSE(r.ok()) << body.substr(0, 80);
    EXPECT_NE(r.status().message().find(want), std::string::npos) << body.substr(0, 80) << " -> " << r.status().message();
  };
  bad(R"({"prompt":"hi","max_new_tokens":1.5})", "'max_new_tokens' = 1.5 is not a whole number");
  bad(R"({"prompt":"hi","id":3.7})", "'id' = 3.7 is not a whole number");
  bad(R"({"prompt":""})", "empty prompt");
  bad(R"({"tokens":[]})", "empty prompt");
  bad("{\"prompt\":\"a\",\"x\":" + std::string(100000, '[') + std::string(100000, ']') + "}", "deeper than 16");
  bad("{\"prompt\":\"Once \xff\xfe\"}", "not valid JSON");
  // Text that cannot fit in the prompt limit is refused by its length, before tokenizing.
  bad(R"({"prompt":")" + std::string(20000, 'a') + R"("})", "cannot fit in 511 tokens", 511);
  // A strategy a request names is bounded: stages, repeats, length.
  std::string many = "quant";
  for (int i = 0; i < 270; ++i) many += "|zstd(level=19)";
  bad(R"({"prompt":"hi","strategy":")" + many + R"("})", "above the limit");
  bad(R"({"prompt":"hi","strategy":"quant|zstd|zstd"})", "stage 'zstd' twice");
  const std::string five = "prune|rotate|delta|quant|rans";
  auto ok = ParseServeRequest(R"({"prompt":"hi","strategy":")" + five + R"(","max_new_tokens":7.0})", &tok, 256);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->max_new_tokens, 7u);
}

TEST(ServeJson, TheRouterForwardsOnlyWhatANodeReadsAndRefusesWhatItWouldRefuse) {
  auto r = RouteRequest(R"({"prompt":"Once upon a time","max_new_tokens":4,"x":[[1]],"floor":0.9})", 256);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->label, "short");
  const auto j = nlohmann::json::parse(r->body);
  EXPECT_FALSE(j.contains("x"));
  EXPECT_EQ(j["floor"], 0.9);
  EXPECT_EQ(j["label"], "short");
  auto tagged = RouteRequest(R"({"prompt":"hi","label":"chat"})", 256);
  ASSERT_TRUE(tagged.ok());
  EXPECT_EQ(tagged->label, "chat");
  for (const std::string& bad : {std::string(R"({"prompt":"hi","label":5})"), std::string("[1]"), std::string("{bad"),
                                "{\"prompt\":\"a\",\"x\":" + std::string(100000, '[') + std::string(100000, ']') + "}"}) {
    auto b = RouteRequest(bad, 256);
    ASSERT_FALSE(b.ok()) << bad.substr(0, 60);
    EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  }
}

// Production shapes and GPU presets: the KV shape of each released model, and compute rates by
// the rule of docs/SERVING.md — which gives the llama3-8b-on-H100 figures the shipped results
// used (25,000 and 200 tokens/s).
TEST(SyntheticModels, ShapesAndGpuPresetsFollowTheDocumentedRule) {
  const SyntheticModel l8 = SyntheticModelByName("llama3-8b").value();
  EXPECT_EQ(l8.kv_bytes_per_token(), 131072u);
  EXPECT_EQ(l8.prefill_tokens_per_second, 25000);
  EXPECT_EQ(l8.decode_tokens_per_second, 200);
  EXPECT_EQ(l8.tensor_parallel, 1u);
  const SyntheticModel def;
  EXPECT_EQ(def.prefill_tokens_per_second, l8.prefill_tokens_per_second);
  EXPECT_EQ(def.decode_tokens_per_second, l8.decode_tokens_per_second);
  const SyntheticModel q32 = SyntheticModelByName("qwen2.5-32b").value();
  EXPECT_EQ(q32.n_layer, 64u);
  EXPECT_EQ(q32.kv_bytes_per_token(), 262144u);
  EXPECT_EQ(q32.tensor_parallel, 1u);  // 65.5 GB of weights in 80 GB
  EXPECT_EQ(q32.prefill_tokens_per_second, 6000);  // 0.4 x 989.4e12 / (2 x 32.76e9)
  EXPECT_EQ(q32.decode_tokens_per_second, 50);     // 3.35e12 / (65.5e9 + 4096 x 256 KiB)
  const SyntheticModel l70 = SyntheticModelByName("llama3-70b").value();
  EXPECT_EQ(l70.kv_bytes_per_token(), 327680u);
  EXPECT_EQ(l70.tensor_parallel, 2u);  // 141 GB of weights: two H100s
  EXPECT_EQ(l70.prefill_tokens_per_second, 5600);
  const SyntheticModel l70s = SyntheticModelByName("llama3-70b", "l40s").value();
  EXPECT_EQ(l70s.tensor_parallel, 4u);
  EXPECT_LT(l70s.decode_tokens_per_second, l70.decode_tokens_per_second);
  auto bad = SyntheticModelByName("llama9-1t");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("qwen2.5-32b"), std::string::npos) << bad.status().ToString();
  auto gpu = SyntheticModelByName("llama3-8b", "tpu");
  ASSERT_FALSE(gpu.ok());
  EXPECT_NE(gpu.status().message().find("h100"), std::string::npos) << gpu.status().ToString();
}

}  // namespace
}  // namespace kvserve
