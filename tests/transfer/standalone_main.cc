// An engine's use of transfer alone: this program links kvserve_transfer (and kv below it) and
// nothing else — no codec, model, profiler, controller or nodes. It moves a message over the TCP
// transport and a value through the embedded pool; exit 0 when both come back intact. Built
// and run by ctest (transfer_links_alone), so a dependency of transfer on anything above kv
// fails the build here.
#include <cstdio>
#include <thread>

#include "kvserve/pool.h"
#include "kvserve/transport.h"

int main() {
  using namespace kvserve;
  const std::unique_ptr<Transport> tcp = MakeTcpTransport();
  auto listener = tcp->Listen("127.0.0.1:0");
  if (!listener.ok()) return std::fprintf(stderr, "listen: %s\n", listener.status().ToString().c_str()), 1;
  const ByteBuffer sent(1 << 20, 0x5a);
  Status server;
  ByteBuffer got;
  std::thread peer([&] {
    auto c = listener.value()->Accept(DeadlineIn(10));
    if (!c.ok()) return void(server = c.status());
    auto m = c.value()->Receive(DeadlineIn(10));
    if (!m.ok()) return void(server = m.status());
    got = std::move(m->body);
  });
  auto c = tcp->Connect("127.0.0.1:" + std::to_string(listener.value()->port()), DeadlineIn(10));
  const Status st = c.ok() ? c.value()->Send(MessageKind::kFrame, sent, DeadlineIn(10)) : c.status();
  peer.join();
  if (!st.ok() || !server.ok() || got != sent) {
    std::fprintf(stderr, "transport: %s / %s\n", st.ToString().c_str(), server.ToString().c_str());
    return 1;
  }
  const std::unique_ptr<KvPool> pool = MakeEmbeddedPool({.capacity_bytes = 4 << 20});
  if (!pool->Put("chunk", sent).ok()) return 1;
  auto back = pool->GetMany({"chunk"});
  if (!back.ok() || !(*back)[0] || *(*back)[0] != sent) return std::fprintf(stderr, "pool: value lost\n"), 1;
  std::printf("transfer alone: 1 MiB over %s and through the %s pool\n", tcp->name().c_str(), pool->name().c_str());
  return 0;
}
