// The testbed's machinery (kvserve/testbed.h): the arrival driver's timing, a node's answer read
// back, child processes (pinned, ready line, stopped and reaped, failing clearly) and the
// kernel-shaped link's namespaces made and removed. The process testbed of real nodes is tested
// with the CLI binary (tests/tools/serve_cli_test.cc).
#include "kvserve/testbed.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <thread>

#include "test_paths.h"

namespace kvserve {
namespace {

double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

TEST(Testbed, DriveArrivalsCountsJctFromTheScheduledArrivalAndKeepsOrder) {
  // Each request takes 50 ms; three arrive at 0, 0 and 100 ms. The two at 0 run at once.
  std::atomic<int> running{0}, most{0};
  ServeFn serve = [&](const ServeRequest& r) -> Result<ServeResponse> {
    most = std::max(most.load(), ++running);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    --running;
    if (r.id == 2) return Status::Unavailable("node gone");
    ServeResponse out;
    out.id = r.id;
    out.timings.total_s = 0.001;         // what the node saw: replaced by the driver's JCT
    out.timings.first_token_s = 0.0005;  // moved by as much
    return out;
  };
  std::vector<ServeRequest> reqs(3);
  for (int i = 0; i < 3; ++i) reqs[i].id = uint64_t(i + 1);
  const double t0 = Now();
  auto answers = DriveArrivals(serve, reqs, {0, 0, 0.1});
  const double took = Now() - t0;
  ASSERT_EQ(answers.size(), 3u);
  EXPECT_EQ(most.load(), 2);
  ASSERT_TRUE(answers[0].ok());
  EXPECT_EQ(answers[0]->id, 1u);
  EXPECT_NEAR(answers[0]->timings.total_s, 0.050, 0.040);
  EXPECT_NEAR(answers[0]->timings.first_token_s, answers[0]->timings.total_s - 0.0005, 1e-9);
  EXPECT_FALSE(answers[1].ok());
  ASSERT_TRUE(answers[2].ok());
  EXPECT_EQ(answers[2]->id, 3u);
  EXPECT_NEAR(answers[2]->timings.total_s, 0.050, 0.040);  // from its own arrival at 100 ms
  EXPECT_GE(took, 0.145);
}

TEST(Testbed, ServeResponseReadsBackWhatTheNodeWrote) {
  ServeResponse r;
  r.id = 7;
  r.tokens = {1, 2, 3};
  r.strategy = "quant(kbits=8,vbits=8)";
  r.explanation = "fixed strategy";
  r.kv_bytes = 1 << 20, r.wire_bytes = 1 << 19, r.resent_layers = 2;
  r.decode_node = "10.77.0.2:4000";
  r.timings = {.queue_s = 0.001, .prefill_s = 0.02, .encode_s = 0.003, .wire_s = 0.1, .decode_s = 0.004, .transfer_s = 0.11,
               .generate_s = 0.05, .total_s = 0.2};
  auto back = ServeResponseFromJson(ServeResponseJson(r, nullptr));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->id, 7u);
  EXPECT_EQ(back->tokens, r.tokens);
  EXPECT_EQ(back->strategy, r.strategy);
  EXPECT_EQ(back->kv_bytes, r.kv_bytes);
  EXPECT_EQ(back->wire_bytes, r.wire_bytes);
  EXPECT_EQ(back->resent_layers, 2u);
  EXPECT_EQ(back->decode_node, r.decode_node);
  EXPECT_NEAR(back->timings.wire_s, 0.1, 1e-12);
  EXPECT_NEAR(back->timings.total_s, 0.2, 1e-12);
  EXPECT_TRUE(back->pool_action.empty());
  r.pool_action = "fetch", r.cached_tokens = 512, r.stored_bytes = 99, r.timings.first_token_s = 0.07;
  back = ServeResponseFromJson(ServeResponseJson(r, nullptr));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->pool_action, "fetch");
  EXPECT_EQ(back->cached_tokens, 512u);
  EXPECT_NEAR(back->timings.first_token_s, 0.07, 1e-12);
  // A node answering 200 with something else is a broken node: kCorrupt, naming the field.
  for (const auto& [body, field] : std::vector<std::pair<std::string, std::string>>{
           {"not json", "not valid JSON"},
           {"[1]", "JSON object"},
           {R"({"kv_bytes":1,"wire_bytes":1,"resent_layers":0,"tokens":[],"timings_ms":{}})", "'id'"},
           {R"({"id":-1,"kv_bytes":1,"wire_bytes":1,"resent_layers":0,"tokens":[],"timings_ms":{}})", "'id'"},
           {R"({"id":1,"kv_bytes":1,"wire_bytes":1,"resent_layers":0,"tokens":["a"],"timings_ms":{}})", "'tokens'"},
           {R"({"id":1,"kv_bytes":1,"wire_bytes":1,"resent_layers":0,"tokens":[]})", "'timings_ms'"},
           {R"({"id":1,"kv_bytes":1,"wire_bytes":1,"resent_layers":0,"tokens":[],"timings_ms":{"wire":"x"}})", "'wire'"},
           {R"({"id":1,"kv_bytes":1,"wire_bytes":1,"resent_layers":0,"tokens":[],"timings_ms":{},"strategy":3})", "'strategy'"}}) {
    auto bad = ServeResponseFromJson(body);
    ASSERT_FALSE(bad.ok()) << body;
    EXPECT_EQ(bad.status().code(), StatusCode::kCorrupt) << body;
    EXPECT_NE(bad.status().message().find(field), std::string::npos) << body << ": " << bad.status().ToString();
  }
}

std::string CpusAllowed(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("Cpus_allowed_list:", 0) == 0) return line.substr(line.find_last_of(" \t") + 1);
  return "";
}

bool Exists(pid_t pid) { return ::kill(pid, 0) == 0; }

ChildSpec Spec(std::string name, std::vector<std::string> argv, int cpu = -1, std::string netns = "", double ready_s = 120) {
  return {std::move(name), std::move(argv), cpu, std::move(netns), ready_s};
}

TEST(Testbed, ChildProcessIsPinnedSaysWhereItListensAndIsReapedOnStop) {
  auto c = ChildProcess::Start(Spec("sleeper", {"/bin/sh", "-c", "echo starting; echo node listening on 127.0.0.1:4242; exec sleep 60"}, 0));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ChildProcess& p = *c.value();
  EXPECT_EQ(p.address(), "127.0.0.1:4242");
  EXPECT_TRUE(p.Alive());
  EXPECT_EQ(CpusAllowed(p.pid()), "0");
  const pid_t pid = p.pid();
  const double t0 = Now();
  p.Stop();
  EXPECT_LT(Now() - t0, 2.0);  // SIGTERM ends sleep at once
  EXPECT_FALSE(p.Alive());
  EXPECT_FALSE(Exists(pid));  // reaped: no zombie left
  p.Stop();                   // idempotent
}

TEST(Testbed, ChildProcessThatHangsOnSigtermIsKilledAfterTheGrace) {
  auto c = ChildProcess::Start(Spec("stubborn", {"/bin/sh", "-c", "trap '' TERM; echo x listening on 127.0.0.1:1; while :; do sleep 0.05; done"}));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const pid_t pid = c.value()->pid();
  const double t0 = Now();
  c.value()->Stop(0.3);
  EXPECT_GE(Now() - t0, 0.25);
  EXPECT_FALSE(Exists(pid));
}

TEST(Testbed, ChildProcessThatFailsToStartSaysWhy) {
  auto exited = ChildProcess::Start(Spec("early", {"/bin/sh", "-c", "echo bad flag; exit 2"}));
  ASSERT_FALSE(exited.ok());
  EXPECT_EQ(exited.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(exited.status().message().find("exited before listening"), std::string::npos) << exited.status().ToString();
  EXPECT_NE(exited.status().message().find("bad flag"), std::string::npos) << exited.status().ToString();
  auto silent = ChildProcess::Start(Spec("silent", {"/bin/sh", "-c", "exec sleep 30"}, -1, "", 0.3));
  ASSERT_FALSE(silent.ok());
  EXPECT_NE(silent.status().message().find("did not say where it listens"), std::string::npos) << silent.status().ToString();
  auto missing = ChildProcess::Start(Spec("missing", {"/nonexistent/kvserve", "serve"}));
  EXPECT_FALSE(missing.ok());
  auto no_ns = ChildProcess::Start(Spec("nowhere", {"/bin/true"}, -1, "kvserve-test-no-such-ns"));
  ASSERT_FALSE(no_ns.ok());
  EXPECT_NE(no_ns.status().message().find("kvserve-test-no-such-ns"), std::string::npos);
}

// A server that says only that it is ready (redis-server): a bare name found in the system's
// program directories, its ready text awaited, the address it was told to listen on kept.
TEST(Testbed, ChildProcessWithReadyTextIsFoundByNameAndKeepsItsAddress) {
  ChildSpec spec = Spec("server", {"sh", "-c", "echo banner; echo '* Ready to accept connections'; exec sleep 60"});
  spec.ready_text = "Ready to accept connections";
  spec.address = "127.0.0.1:6379";
  auto c = ChildProcess::Start(spec);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c.value()->address(), "127.0.0.1:6379");
  const pid_t pid = c.value()->pid();
  c.value()->Stop();
  EXPECT_FALSE(Exists(pid));
  auto nowhere = ChildProcess::Start(Spec("absent", {"kvserve-no-such-program"}));
  ASSERT_FALSE(nowhere.ok());
  EXPECT_EQ(nowhere.status().code(), StatusCode::kNotFound);
  EXPECT_NE(nowhere.status().message().find("give its path"), std::string::npos) << nowhere.status().ToString();
}

TEST(Testbed, FreeLoopbackPortCanBeBound) {
  auto port = FreeLoopbackPort();
  ASSERT_TRUE(port.ok()) << port.status().ToString();
  EXPECT_GT(port.value(), 0);
}

TEST(Testbed, NetnsLinkIsMadeAndRemovedOrSaysWhyNot) {
  const std::string script = SourceDir() + "/scripts/netns-link.sh";
  const std::string prefix = "kvt" + std::to_string(::getpid() % 10000);
  {
    auto link = NetnsLink::Up(script, prefix, 1);
    if (!link.ok()) {
      // No privilege here: a clear kUnavailable with the script's reason, and nothing left behind.
      EXPECT_EQ(link.status().code(), StatusCode::kUnavailable) << link.status().ToString();
      EXPECT_NE(link.status().message().find("skipped"), std::string::npos) << link.status().ToString();
      EXPECT_TRUE(NetnsWithPrefix(prefix).empty());
      return;  // that refusal is this machine's behaviour, and it was checked above
    }
    EXPECT_EQ(NetnsWithPrefix(prefix).size(), 2u);
    // A child started in the receiver namespace sees the veth's address there; this thread can
    // enter the sender namespace (and returns when the scope ends).
    auto child = ChildProcess::Start(
        Spec("in-ns", {"/bin/sh", "-c", "ip -o addr show | grep -q 10.77.0.2 && echo ok listening on 10.77.0.2:1; exec sleep 30"}, -1,
             link.value()->receiver(), 10));
    ASSERT_TRUE(child.ok()) << child.status().ToString();
    {
      auto ns = ScopedNetns::Enter(link.value()->sender());
      ASSERT_TRUE(ns.ok()) << ns.status().ToString();
    }
    link.value()->Down();
    link.value()->Down();  // idempotent
    EXPECT_TRUE(NetnsWithPrefix(prefix).empty());
  }
  EXPECT_FALSE(NetnsLink::Up(script, "bad prefix!", 1).ok());
  EXPECT_FALSE(NetnsLink::Up(script, prefix, -1).ok());
  EXPECT_FALSE(NetnsLink::Up("/nonexistent/netns-link.sh", prefix, 1).ok());
}

}  // namespace
}  // namespace kvserve
