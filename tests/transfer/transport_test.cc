// TCP transport: messages round-trip whole, lengths and headers are verified before anything is
// allocated, and a silent, stalled or vanished peer ends in kUnavailable by the deadline.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <thread>

#include "kvserve/transport.h"

namespace kvserve {
namespace {

struct Pair {
  std::unique_ptr<Listener> listener;
  std::unique_ptr<Connection> client, server;
};

Pair Connected(Transport& t) {
  Pair p;
  p.listener = t.Listen("127.0.0.1:0").value();
  const std::string addr = "127.0.0.1:" + std::to_string(p.listener->port());
  std::thread accept([&] { p.server = p.listener->Accept(DeadlineIn(5)).value(); });
  p.client = t.Connect(addr, DeadlineIn(5)).value();
  accept.join();
  return p;
}

TEST(Transport, MessagesOfEveryKindAndSizeRoundTrip) {
  auto t = MakeTcpTransport();
  Pair p = Connected(*t);
  std::mt19937 rng(3);
  std::vector<ByteBuffer> sent;
  for (size_t n : {size_t(0), size_t(1), size_t(15), size_t(65536), size_t(65537), size_t(9 << 20)}) {
    ByteBuffer b(n);
    for (auto& x : b) x = uint8_t(rng());
    sent.push_back(b);
  }
  // Sender and receiver run at once: a 9 MiB message does not fit the socket buffers.
  std::thread sender([&] {
    for (size_t i = 0; i < sent.size(); ++i) {
      ASSERT_TRUE(p.client->Send(MessageKind(1 + i % 6), sent[i], DeadlineIn(10)).ok());
    }
  });
  for (size_t i = 0; i < sent.size(); ++i) {
    auto m = p.server->Receive(DeadlineIn(10));
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_EQ(m->kind, MessageKind(1 + i % 6));
    EXPECT_EQ(m->body, sent[i]) << i;
  }
  sender.join();
}

TEST(Transport, ShapedLinkDeliversTheSameBytes) {
  LinkShaper shaper(2.0);  // 2 Gbit/s: 1 MiB takes about 4 ms
  auto t = MakeTcpTransport({.shaper = &shaper});
  Pair p = Connected(*t);
  ByteBuffer b(1 << 20);
  for (size_t i = 0; i < b.size(); ++i) b[i] = uint8_t(i * 7);
  std::thread sender([&] { EXPECT_TRUE(p.client->Send(MessageKind::kFrame, b, DeadlineIn(10)).ok()); });
  auto m = p.server->Receive(DeadlineIn(10));
  sender.join();
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->body, b);
}

// Bytes that began to cross earlier (a pool value copied out meanwhile) count that time as link
// time: 10 MiB at 0.1 Gbit/s (839 ms) whose copy took 900 ms pass at once; the next 10 MiB queue
// behind them (less the idle link's one burst of credit, 1 MiB: 755 ms).
TEST(Transport, ShaperCountsTheTimeSinceBytesBeganToCross) {
  LinkShaper shaper(0.1);
  const auto started = Clock::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(900));  // the copy
  const auto t0 = Clock::now();
  shaper.Take(10 << 20, started);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 0.3);
  shaper.Take(10 << 20);
  EXPECT_GE(std::chrono::duration<double>(Clock::now() - t0).count(), 0.75);
}

TEST(Transport, SilentPeerMissesTheDeadlineAndClosedPeerIsUnavailable) {
  auto t = MakeTcpTransport();
  Pair p = Connected(*t);
  auto m = p.server->Receive(DeadlineIn(0.2));
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(m.status().message().find("deadline"), std::string::npos) << m.status().message();
  Pair q = Connected(*t);
  q.client->Close();
  q.client.reset();
  m = q.server->Receive(DeadlineIn(5));
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kUnavailable);
  // Nobody listening: connect fails fast, naming the address.
  const uint16_t port = q.listener->port();
  q.listener.reset();
  auto c = t->Connect("127.0.0.1:" + std::to_string(port), DeadlineIn(2));
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("127.0.0.1:" + std::to_string(port)), std::string::npos);
}

TEST(Transport, GarbageAndOversizedMessagesAreRefused) {
  auto t = MakeTcpTransport({.max_message_bytes = 1 << 20});
  {
    // A client that speaks something else (HTTP, here) over a raw socket.
    auto listener = t->Listen("127.0.0.1:0").value();
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(listener->port());
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
    auto server = listener->Accept(DeadlineIn(5)).value();
    const char junk[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    ASSERT_EQ(::write(fd, junk, sizeof junk), ssize_t(sizeof junk));
    auto m = server->Receive(DeadlineIn(2));
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), StatusCode::kCorrupt);
    EXPECT_NE(m.status().message().find("kvserve message header"), std::string::npos) << m.status().message();
    ::close(fd);
  }
  {
    Pair p = Connected(*t);
    ByteBuffer big((1 << 20) + 1);
    std::thread sender([&] { (void)p.client->Send(MessageKind::kFrame, big, DeadlineIn(2)); });
    auto m = p.server->Receive(DeadlineIn(2));
    sender.join();
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), StatusCode::kOutOfRange) << m.status().ToString();
  }
}

TEST(Transport, AddressesAreParsedWithClearErrors) {
  std::string host;
  uint16_t port;
  ASSERT_TRUE(ParseHostPort("127.0.0.1:7000", &host, &port).ok());
  EXPECT_EQ(host, "127.0.0.1");
  EXPECT_EQ(port, 7000);
  ASSERT_TRUE(ParseHostPort("[::1]:80", &host, &port).ok());
  EXPECT_EQ(host, "::1");
  EXPECT_NE(ParseHostPort("localhost", &host, &port).message().find("want host:port"), std::string::npos);
  EXPECT_NE(ParseHostPort("h:70000", &host, &port).message().find("not in [0, 65535]"), std::string::npos);
  auto t = MakeTcpTransport();
  EXPECT_FALSE(t->Listen("not-an-ip:0").ok());
}

}  // namespace
}  // namespace kvserve
