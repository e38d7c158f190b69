// Prefill node: runs the prompt, chooses a strategy for its KV under the measured bandwidth
// (or uses a fixed one), and streams the KV to a decode node layer by layer — the next layer
// encodes while the previous one is on the wire.
#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "kvserve/codec.h"
#include "kvserve/serve.h"
#include "serve/compute.h"
#include "serve/wire.h"

namespace kvserve {

using json = nlohmann::json;
using serve_internal::Seconds;
using serve_internal::SendJson;

using serve_internal::BoundedQueue;
using FrameQueue = BoundedQueue<ByteBuffer>;

namespace {
// Frame buffers a transfer holds at once: one encoding, two queued behind it, one on the wire.
constexpr size_t kFramesPerTransfer = 4;
// Kept for reuse across requests: enough for the transfers of a few concurrent requests.
constexpr size_t kKeptFrames = 8;
}  // namespace

Status PrefillNode::Prepare(uint32_t n_token) {
  KV_RETURN_IF_ERROR(compute_->Prepare(n_token));
  const serve_internal::ComputeShape& s = compute_->shape();
  // The largest per-layer frame: one layer's KV uncoded (`none`) and a header (positions and all).
  const size_t frame_bytes = size_t(uint64_t{2} * s.n_head_kv * n_token * s.head_dim * DTypeSize(s.kv_dtype)) + (64 << 10);
  std::lock_guard<std::mutex> lock(buffers_mu_);
  for (size_t i = 0; i < kFramesPerTransfer; ++i) {
    if (i == buffers_.size()) buffers_.emplace_back();
    ByteBuffer& b = buffers_[i];
    if (b.capacity() >= frame_bytes) continue;
    b.clear();
    b.shrink_to_fit();
    b.resize(frame_bytes);
    std::memset(b.data(), 0, b.size());  // the faults now
    b.clear();  // capacity and resident pages kept
  }
  return Status::Ok();
}

PrefillNode::PrefillNode(Transport* transport, PrefillNodeOptions opts)
    : transport_(transport), opts_(std::move(opts)) {}
PrefillNode::~PrefillNode() = default;

Result<std::unique_ptr<PrefillNode>> PrefillNode::Create(Transport* transport, PrefillNodeOptions opts) {
  KV_ASSIGN_OR_RETURN(std::unique_ptr<serve_internal::Compute> compute,
                      serve_internal::MakeCompute(opts.model, opts.synthetic, opts.pool, "prefill"));
  if (opts.decode_peers.empty()) return Status::InvalidArgument("prefill node needs at least one decode peer");
  if (!(opts.assume_gbps > 0)) return Status::InvalidArgument("assume_gbps must be positive");
  KV_ASSIGN_OR_RETURN(opts.strategy, CanonicalStrategy(opts.strategy));
  std::unique_ptr<PrefillNode> n(new PrefillNode(transport, std::move(opts)));
  n->compute_ = std::move(compute);
  if (n->opts_.profile != nullptr) {
    // Profiles measure ratio and speed against fp16 KV. A real model's node ships its f32 KV,
    // so per raw byte every ratio and speed is twice the profiled one; synthetic KV is fp16.
    const double per_fp16 = n->compute_->shape().per_fp16;
    std::vector<StrategyCost> s = StrategiesFromProfile(*n->opts_.profile);
    for (StrategyCost& c : s) c.ratio *= per_fp16, c.encode_Bps *= per_fp16, c.decode_Bps *= per_fp16;
    ControllerOptions co = n->opts_.controller;
    co.n_layer = n->compute_->shape().n_layer;
    co.pipelined = true;
    // The encoder thread and the codec's pool fill the cores this process may run on: frame sends
    // then take their CPU time from the encode (LiveSpeedOptions).
    const int codec_threads = n->opts_.pool ? n->opts_.pool->size() : 1;
    co.speeds.sends_share_codec_cores = codec_threads >= serve_internal::UsableCores();
    n->controller_ = std::make_unique<Controller>(std::move(s), co);
  }
  return n;
}

double PrefillNode::bandwidth_estimate_gbps() const {
  std::lock_guard<std::mutex> lock(mu_);
  return estimator_.has_estimate() ? estimator_.estimate() * 8 / 1e9 : opts_.assume_gbps;
}

double PrefillNode::link_latency_seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return estimator_.latency_seconds();
}

std::array<double, 2> PrefillNode::codec_speed_factors() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!controller_) return {1, 1};
  return {controller_->EncodeSpeedFactor(), controller_->DecodeSpeedFactor()};
}

double PrefillNode::send_cost_seconds_per_byte() const {
  std::lock_guard<std::mutex> lock(mu_);
  return controller_ ? controller_->SendCostPerByte() : 0;
}

double PrefillNode::InFlight::WireLeft() const {
  const double expected = frames_encoded ? wire_encoded * n_frames / frames_encoded : wire_predicted;
  return std::max(0.0, expected - wire_sent);
}

QueueState PrefillNode::QueuesLocked(double bw, double ready) const {
  // Transfers share the link and the CPU rather than queue in turn; counting their work as a
  // queue ahead is what a newcomer's own bytes and codec time wait out either way.
  QueueState q;
  double link_bytes = 0, encode_s = 0;
  const double encode_factor = controller_ ? controller_->EncodeSpeedFactor() : 1;
  const double send_cost = controller_ ? controller_->SendCostPerByte() : 0;  // per wire byte, on the codec's cores
  for (const auto& [id, t] : in_flight_) {
    const double left = t.WireLeft();
    if (left > 0) link_bytes += left, q.link_jobs++;
    if (const double kv_left = t.KvLeftToEncode(); t.encode_Bps > 0 && kv_left > 0)
      encode_s += kv_left / (t.encode_Bps * encode_factor) + left * send_cost, q.encode_jobs++;
  }
  // The decoder's backlog is the decode node's; it decodes each layer as it lands, so what it
  // has left is about what the link has left (not counted twice).
  if (q.link_jobs) q.link_wait = ready + link_bytes / bw;
  if (q.encode_jobs) q.encode_wait = ready + encode_s;
  return q;
}

QueueState PrefillNode::queues() const {
  std::lock_guard<std::mutex> lock(mu_);
  return QueuesLocked(serve_internal::PlanningBps(estimator_, opts_.assume_gbps), 0);
}

void PrefillNode::TransferEnded(uint64_t transfer) {
  std::lock_guard<std::mutex> lock(mu_);
  in_flight_.erase(transfer);
}

PrefillNode::Choice PrefillNode::Choose(const ServeRequest& req, double kv_bytes, double model_seconds) {
  Choice c;
  InFlight t;
  t.kv_bytes = kv_bytes;
  t.wire_predicted = kv_bytes;
  std::lock_guard<std::mutex> lock(mu_);
  const StrategyCost* cost = nullptr;  // the chosen strategy's profiled costs, where known
  if (!req.strategy.empty() || controller_ == nullptr) {
    c.spec = req.strategy.empty() ? opts_.strategy : req.strategy;
    c.explanation = req.strategy.empty() ? "fixed strategy of this node" : "strategy given by the request";
    if (controller_)
      for (const StrategyCost& s : controller_->strategies())
        if (s.spec == c.spec) cost = &s;
  } else {
    Request& r = c.request;
    r.id = req.id;
    r.label = req.label;
    r.prompt_tokens = uint32_t(req.prompt.size());
    r.kv_bytes = kv_bytes;
    r.slo_seconds = req.slo_ms / 1e3;
    r.floor = req.floor;
    r.model_seconds = model_seconds;
    const double bw = serve_internal::PlanningBps(estimator_, opts_.assume_gbps);
    // The queues ahead: every transfer in flight (this one is not entered yet), from the moment
    // its KV is ready, which is now.
    controller_->Decide(r, bw, estimator_.has_estimate() ? estimator_.Confidence(serve_internal::NowSeconds()) : 0.0,
                        QueuesLocked(bw, model_seconds), &c.decision);
    cost = &controller_->strategies()[c.decision.choice];
    c.spec = cost->spec;
    c.explanation = controller_->Explain(r, c.decision);
    c.adaptive = true;
  }
  if (cost != nullptr && !cost->none()) t.wire_predicted = kv_bytes / cost->ratio, t.encode_Bps = cost->encode_Bps;
  c.transfer = next_transfer_++;
  in_flight_.emplace(c.transfer, t);
  return c;
}

Status PrefillNode::Transfer(Connection* c, const ServeRequest& req, const KvBlock& kv,
                             const std::vector<float>& scores, const std::string& spec, uint64_t transfer,
                             int first_token, const TokenSink& on_token, uint32_t* streamed, ServeResponse* out) {
  const Clock::time_point deadline = DeadlineIn(opts_.request_timeout_s);
  const uint32_t n_layer = kv.shape().n_layer;
  KV_ASSIGN_OR_RETURN(Pipeline pipeline, Pipeline::Create(spec, opts_.env));
  CodecOptions co;
  co.request_id = req.id;
  co.pool = opts_.pool;
  co.token_scores = &scores;
  const uint32_t n_frames = TransferFrames(spec, n_layer);
  auto encode = [&](uint32_t frame, ByteBuffer* f) {
    return n_frames == n_layer ? pipeline.EncodeLayers(kv, frame, 1, f, co) : pipeline.Encode(kv, f, co);
  };
  // Progress of this attempt, for the decisions of the requests behind it (queues()).
  auto progress = [&](double encoded_bytes, double sent_bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = in_flight_.find(transfer);
    if (it == in_flight_.end()) return;
    if (encoded_bytes > 0) it->second.frames_encoded++, it->second.wire_encoded += encoded_bytes;
    it->second.wire_sent += sent_bytes;
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = in_flight_.find(transfer); it != in_flight_.end()) {
      InFlight& t = it->second;
      t.n_frames = n_frames, t.frames_encoded = 0, t.wire_encoded = 0, t.wire_sent = 0;  // a new attempt starts over
    }
  }
  KV_RETURN_IF_ERROR(SendJson(c, MessageKind::kRequest,
                              {{"id", req.id}, {"max_new_tokens", req.max_new_tokens}, {"first_token", first_token},
                               {"prompt_len", kv.shape().n_token}, {"stream", on_token != nullptr},
                               {"temperature", req.sampling.temperature}, {"top_p", req.sampling.top_p}, {"seed", req.sampling.seed}},
                              deadline));
  auto send_frame = [&](ByteBuffer& f, bool first_send) -> Status {
    if (first_send && opts_.corrupt_every && ++frames_sent_ % opts_.corrupt_every == 0 && f.size() > 64) {
      f[f.size() / 2] ^= 0x5a;  // a wire fault the frame checksum must catch
    }
    const Clock::time_point w0 = Clock::now();
    const double cpu0 = serve_internal::ThreadCpuSeconds();
    Status st = c->Send(MessageKind::kFrame, f, deadline);
    out->timings.send_cpu_s += serve_internal::ThreadCpuSeconds() - cpu0;
    out->timings.wire_s += Seconds(w0, Clock::now());
    out->wire_bytes += f.size();
    if (first_send) progress(0, double(f.size()));
    return st;
  };
  const Clock::time_point t0 = Clock::now();
  FrameQueue queue(2);
  Status encode_status;
  double encode_s = 0;
  std::thread encoder([&] {
    encode_status = serve_internal::Guarded("encoding a frame", [&]() -> Status {
      for (uint32_t l = 0; l < n_frames; ++l) {
        ByteBuffer f = TakeFrameBuffer();
        const Clock::time_point e0 = Clock::now();
        KV_RETURN_IF_ERROR(encode(l, &f));
        encode_s += Seconds(e0, Clock::now());
        progress(double(f.size()), 0);
        if (!queue.Push(std::move(f))) break;
      }
      return Status::Ok();
    });
    queue.Finish();
  });
  Status send_status;
  while (auto f = queue.Pop()) {
    send_status = send_frame(*f, true);
    GiveFrameBuffer(std::move(*f));
    if (!send_status.ok()) {
      queue.Close();
      break;
    }
  }
  encoder.join();
  out->timings.encode_s = encode_s;
  KV_RETURN_IF_ERROR(encode_status);
  KV_RETURN_IF_ERROR(send_status);
  KV_RETURN_IF_ERROR(c->Send(MessageKind::kEnd, {}, deadline));
  // A reply holds at most the tokens asked for: a longer one is refused before it is read.
  const uint32_t vocab = compute_->shape().vocab;
  c->set_max_message_bytes(serve_internal::ResultMessageLimit(req.max_new_tokens));
  Clock::time_point first_token_at = t0;
  for (int round = 0;; ++round) {
    KV_ASSIGN_OR_RETURN(Message reply, c->Receive(deadline));
    if (reply.kind == MessageKind::kTokens && on_token) {
      if (*streamed == 0) first_token_at = Clock::now();
      auto tokens = serve_internal::ParseTokensMessage(reply.body, req.max_new_tokens - std::min(*streamed, req.max_new_tokens), vocab);
      if (!tokens.ok()) return tokens.status().WithContext("decode node " + c->peer());
      for (int t : *tokens) {
        ++*streamed;
        out->tokens.push_back(t);
        if (!on_token(t)) {
          // The caller has what it wants (a stop text, or its client left): the answer is the
          // tokens so far, and closing the connection ends the decode node's generation.
          // No result message: the transfer ends where the first streamed token arrived.
          out->timings.generate_s = Seconds(first_token_at, Clock::now());
          out->timings.transfer_s = Seconds(t0, first_token_at);
          return Status::Ok();
        }
      }
      --round;
      continue;
    }
    if (reply.kind == MessageKind::kError) {
      return Status::Unavailable("decode node " + c->peer() + " failed the request: " + serve_internal::ParseErrorMessage(reply.body));
    }
    if (reply.kind == MessageKind::kResend && round == 0) {
      // Each frame at most once, each one this request has: a resend list is no way to make
      // this node encode more than the request's KV once more.
      auto layers = serve_internal::ParseResendMessage(reply.body, n_frames);
      if (!layers.ok()) return layers.status().WithContext("decode node " + c->peer());
      for (uint32_t l : *layers) {
        ByteBuffer f;
        const Clock::time_point e0 = Clock::now();
        KV_RETURN_IF_ERROR(encode(l, &f));
        out->timings.encode_s += Seconds(e0, Clock::now());
        KV_RETURN_IF_ERROR(send_frame(f, false));
        out->resent_layers++;
      }
      KV_RETURN_IF_ERROR(c->Send(MessageKind::kEnd, {}, deadline));
      continue;
    }
    if (reply.kind != MessageKind::kResult) {
      return Status::Corrupt(std::string("unexpected ") + MessageKindName(reply.kind) + " reply from " + c->peer());
    }
    auto result = serve_internal::ParseDecodeResult(reply.body, req.max_new_tokens, vocab);
    if (!result.ok()) return result.status().WithContext("decode node " + c->peer());
    out->tokens = std::move(result->tokens);  // all of them, streamed or not
    out->timings.decode_s = result->decode_s;
    out->timings.generate_s = result->generate_s;
    out->timings.transfer_s = std::max(0.0, Seconds(t0, Clock::now()) - out->timings.generate_s);
    return Status::Ok();
  }
}

uint32_t TransferFrames(const std::string& spec, uint32_t n_layer) {
  // A whole-request basis (lowrank) covers every layer, so its strategy cannot split.
  return spec.find("lowrank") == std::string::npos ? n_layer : 1;
}

ByteBuffer PrefillNode::TakeFrameBuffer() {
  std::lock_guard<std::mutex> lock(buffers_mu_);
  if (buffers_.empty()) return ByteBuffer();
  ByteBuffer b = std::move(buffers_.back());
  buffers_.pop_back();
  return b;
}

void PrefillNode::GiveFrameBuffer(ByteBuffer b) {
  std::lock_guard<std::mutex> lock(buffers_mu_);
  if (buffers_.size() < kKeptFrames) buffers_.push_back(std::move(b));
}

Result<ServeResponse> PrefillNode::Serve(const ServeRequest& req, const TokenSink& on_token) {
  const Clock::time_point t0 = Clock::now();
  if (req.prompt.empty()) return Status::InvalidArgument("empty prompt");
  if (req.max_new_tokens < 1) return Status::InvalidArgument("max_new_tokens must be at least 1");
  ServeResponse out;
  out.id = req.id;
  KV_ASSIGN_OR_RETURN(serve_internal::Prefilled prefilled, compute_->Prefill(req.prompt, req.sampling));
  out.timings.queue_s = prefilled.queue_s;
  out.timings.prefill_s = prefilled.prefill_s;
  const std::shared_ptr<const KvBlock> kv = std::move(prefilled.kv);
  const std::vector<float>& scores = prefilled.scores;
  const int first_token = prefilled.first_token;
  metrics_.requests++;
  out.kv_bytes = kv->bytes();
  const Choice choice = Choose(req, double(kv->bytes()), out.timings.queue_s + out.timings.prefill_s);
  struct Ended {
    PrefillNode* node;
    uint64_t transfer;
    ~Ended() { node->TransferEnded(transfer); }
  } ended{this, choice.transfer};
  out.strategy = choice.spec;
  out.explanation = choice.explanation;
  // Decode peers in turn from a rotating start; one that cannot be reached, or that drops the
  // request mid-transfer, hands it to the next. Other failures end the request.
  const size_t n_peers = opts_.decode_peers.size();
  const size_t start = next_peer_++ % n_peers;
  Status last;
  for (size_t k = 0; k < n_peers; ++k) {
    const std::string& peer = opts_.decode_peers[(start + k) % n_peers];
    ServeResponse attempt = out;
    auto conn = transport_->Connect(peer, DeadlineIn(std::min(5.0, opts_.request_timeout_s)));
    if (!conn.ok()) {
      last = conn.status();
      continue;
    }
    uint32_t streamed = 0;
    last = Transfer(conn.value().get(), req, *kv, scores, choice.spec, choice.transfer, first_token, on_token, &streamed,
                    &attempt);
    conn.value()->Close();
    if (last.ok()) {
      out = std::move(attempt);
      out.decode_node = peer;
      break;
    }
    // Tokens the client has cannot be taken back: no second decode node for a request that streamed.
    if (last.code() != StatusCode::kUnavailable || streamed > 0) break;
  }
  if (!last.ok()) {
    metrics_.errors++;
    return last.WithContext("request " + std::to_string(req.id));
  }
  out.timings.total_s = Seconds(t0, Clock::now());
  metrics_.kv_bytes += out.kv_bytes;
  metrics_.wire_bytes += out.wire_bytes;
  metrics_.resent_layers += out.resent_layers;
  metrics_.encode_us += uint64_t(out.timings.encode_s * 1e6);
  metrics_.wire_us += uint64_t(out.timings.wire_s * 1e6);
  {
    std::lock_guard<std::mutex> lock(mu_);
    const double now = serve_internal::NowSeconds();
    // What the link carried and how long the sends took: a throughput sample for the estimator.
    if (out.timings.wire_s > 0) estimator_.AddSample(double(out.wire_bytes), out.timings.wire_s, now);
    // The encode this node timed and the decode the decode node reported: the live codec speeds.
    if (choice.adaptive) controller_->Observe(choice.decision, choice.request,
                                              out.timings.queue_s + out.timings.prefill_s + out.timings.transfer_s,
                                              StageTimes{out.timings.encode_s, out.timings.decode_s,
                                                         out.timings.send_cpu_s, double(out.wire_bytes)});
  }
  return out;
}

}  // namespace kvserve
