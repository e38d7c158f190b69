// `bench link --compare`: each transport between two processes of this machine, in one run —
// throughput per message size over repeats, and a small message's round trip — with a memcpy of
// the same bytes as the baseline (kvserve/testbed.h).
#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>

#include "kvserve/stats.h"
#include "kvserve/testbed.h"
#include "serve/wire.h"

namespace kvserve {

namespace {

// A receiver process (`cli bench link --listen 127.0.0.1:0 --transport T`, one connection) and
// this process's connection to it; destroyed connection first, receiver last.
struct LinkPeer {
  std::unique_ptr<ChildProcess> rx;
  std::unique_ptr<Transport> transport;
  std::unique_ptr<Connection> c;
};

Result<LinkPeer> ConnectToReceiver(const LinkCompareOptions& o, const std::string& name) {
  LinkPeer p;
  KV_ASSIGN_OR_RETURN(p.rx, ChildProcess::Start({.name = "link receiver",
                                                 .argv = {o.cli, "bench", "link", "--listen", "127.0.0.1:0", "--transport", name},
                                                 .cpu = o.receiver_cpu}));
  KV_ASSIGN_OR_RETURN(p.transport, MakeTransport(name));
  KV_ASSIGN_OR_RETURN(p.c, p.transport->Connect(p.rx->address(), DeadlineIn(10)));
  return p;
}

Result<double> Throughput(const LinkCompareOptions& o, const std::string& name, uint32_t message_mib) {
  KV_ASSIGN_OR_RETURN(LinkPeer peer, ConnectToReceiver(o, name));
  Connection* c = peer.c.get();
  const uint64_t message = uint64_t(message_mib) << 20;
  const uint64_t total = std::max<uint64_t>(uint64_t(o.total_mib) << 20, message);
  ByteBuffer buf(message, 0x5a);
  // One message first, untimed: connection set-up and first-touch of both sides' buffers.
  KV_RETURN_IF_ERROR(c->Send(MessageKind::kFrame, buf, DeadlineIn(60)));
  const double t0 = serve_internal::NowSeconds();
  for (uint64_t sent = 0; sent < total; sent += message) KV_RETURN_IF_ERROR(c->Send(MessageKind::kFrame, buf, DeadlineIn(60)));
  KV_RETURN_IF_ERROR(c->Send(MessageKind::kEnd, {}, DeadlineIn(10)));
  KV_ASSIGN_OR_RETURN(Message reply, c->Receive(DeadlineIn(120)));
  const double seconds = serve_internal::NowSeconds() - t0;
  if (reply.kind != MessageKind::kResult) return Status::Corrupt("link receiver: unexpected reply");
  const nlohmann::json j = nlohmann::json::parse(std::string(reply.body.begin(), reply.body.end()), nullptr, false);
  const uint64_t want = (total + message - 1) / message * message + message;
  if (!j.is_object() || j.value("bytes", uint64_t{0}) != want) {
    return Status::Corrupt("link receiver counted " + std::string(j.is_object() ? j.value("bytes", nlohmann::json()).dump() : "nothing") +
                           " bytes of " + std::to_string(want));
  }
  return double(want - message) * 8 / seconds / 1e9;
}

// Round trips of a small message (the receiver echoes a request as a result), microseconds.
Result<std::vector<double>> RoundTrips(const LinkCompareOptions& o, const std::string& name) {
  KV_ASSIGN_OR_RETURN(LinkPeer peer, ConnectToReceiver(o, name));
  Connection* c = peer.c.get();
  ByteBuffer buf(size_t(o.pingpong_kib) << 10, 0x3c);
  std::vector<double> us;
  for (int i = 0; i < o.pingpongs + 5; ++i) {
    const double t0 = serve_internal::NowSeconds();
    KV_RETURN_IF_ERROR(c->Send(MessageKind::kRequest, buf, DeadlineIn(10)));
    KV_ASSIGN_OR_RETURN(Message back, c->Receive(DeadlineIn(10)));
    if (back.kind != MessageKind::kResult || back.body.size() != buf.size()) return Status::Corrupt("link receiver: bad echo");
    if (i >= 5) us.push_back((serve_internal::NowSeconds() - t0) * 1e6);  // five to warm up
  }
  KV_RETURN_IF_ERROR(c->Send(MessageKind::kEnd, {}, DeadlineIn(10)));
  (void)c->Receive(DeadlineIn(10));
  return us;
}

}  // namespace

Result<LinkCompareResult> CompareLinks(const LinkCompareOptions& o, const std::function<void(const std::string&)>& progress) {
  if (o.cli.empty()) return Status::InvalidArgument("link compare: no kvserve executable to start receivers with");
  LinkCompareResult out;
  for (const std::string& name : o.transports) {
    auto t = MakeTransport(name);
    if (!t.ok()) return t.status().WithContext("link compare");
  }
  for (int r = 0; r < o.repeats; ++r) {
    // Transports alternate within a repeat, so drift on a shared machine hits both alike.
    for (uint32_t mib : o.message_mib) {
      for (const std::string& name : o.transports) {
        if (progress) progress(name + ", " + std::to_string(mib) + " MiB messages, repeat " + std::to_string(r + 1));
        KV_ASSIGN_OR_RETURN(double gbps, Throughput(o, name, mib));
        auto it = std::find_if(out.points.begin(), out.points.end(), [&](const LinkComparePoint& p) {
          return p.transport == name && p.message_mib == mib;
        });
        if (it == out.points.end()) it = out.points.insert(out.points.end(), {name, mib, {}});
        it->gbps.push_back(gbps);
      }
    }
  }
  for (const std::string& name : o.transports) {
    if (progress) progress(name + ", " + std::to_string(o.pingpong_kib) + " KiB round trips");
    KV_ASSIGN_OR_RETURN(std::vector<double> us, RoundTrips(o, name));
    out.round_trip_us.push_back({name, std::move(us)});
  }
  // Baseline: memcpy of the largest message size, as many bytes as one throughput run.
  const size_t message = size_t(*std::max_element(o.message_mib.begin(), o.message_mib.end())) << 20;
  ByteBuffer a(message, 1), b(message, 0);
  const double m0 = serve_internal::NowSeconds();
  uint64_t copied = 0;
  for (; copied < (uint64_t(o.total_mib) << 20); copied += message) std::memcpy(b.data(), a.data(), message);
  out.memcpy_gbps = double(copied) * 8 / std::max(1e-9, serve_internal::NowSeconds() - m0) / 1e9;
  return out;
}

double LinkComparePoint::median_gbps() const { return Percentile(gbps, 0.5); }

std::string LinkCompareJson(const LinkCompareOptions& o, const LinkCompareResult& r) {
  nlohmann::json points = nlohmann::json::array();
  for (const LinkComparePoint& p : r.points) {
    points.push_back({{"transport", p.transport}, {"message_mib", p.message_mib}, {"gbps", p.gbps}, {"median_gbps", p.median_gbps()},
                      {"min_gbps", *std::min_element(p.gbps.begin(), p.gbps.end())},
                      {"max_gbps", *std::max_element(p.gbps.begin(), p.gbps.end())}});
  }
  nlohmann::json rtt = nlohmann::json::object();
  for (const auto& [name, us] : r.round_trip_us) {
    rtt[name] = {{"median_us", Percentile(us, 0.5)}, {"p10_us", Percentile(us, 0.1)}, {"p90_us", Percentile(us, 0.9)}, {"n", us.size()}};
  }
  const nlohmann::json j = {{"transports", o.transports}, {"message_mib", o.message_mib}, {"total_mib", o.total_mib},
                            {"repeats", o.repeats}, {"pingpong_kib", o.pingpong_kib}, {"points", points}, {"round_trip", rtt},
                            {"memcpy_gbps", r.memcpy_gbps},
                            {"processes", "receiver in its own process (bench link --listen), sender in this one"}};
  return j.dump(1);
}

}  // namespace kvserve
