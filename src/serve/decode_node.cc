// Decode node: receives a request's KV as per-layer frames, decodes each on arrival into the
// request's cache, asks once for layers whose frames failed verification, then generates.
#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <thread>

#include "kvserve/codec.h"
#include "kvserve/frame.h"
#include "kvserve/serve.h"
#include "serve/compute.h"
#include "serve/wire.h"

namespace kvserve {

using json = nlohmann::json;
using serve_internal::Seconds;
using serve_internal::SendJson;

DecodeNode::DecodeNode(Transport* transport, DecodeNodeOptions opts) : transport_(transport), opts_(std::move(opts)) {}
DecodeNode::~DecodeNode() { Stop(); }

// The compute is made by the first of Prepare and Start (the constructor cannot say why it fails).
Status DecodeNode::MakeComputeOnce() {
  if (compute_ != nullptr) return Status::Ok();
  KV_ASSIGN_OR_RETURN(compute_, serve_internal::MakeCompute(opts_.model, opts_.synthetic, nullptr, "decode"));
  return Status::Ok();
}

Status DecodeNode::Start(const std::string& listen_address) {
  KV_RETURN_IF_ERROR(MakeComputeOnce());
  KV_ASSIGN_OR_RETURN(listener_, transport_->Listen(listen_address));
  port_ = listener_->port();
  acceptor_ = std::thread([this] { AcceptLoop(); });
  return Status::Ok();
}

void DecodeNode::Stop() {
  if (stopping_.exchange(true)) return;
  if (listener_) listener_->Close();
  if (acceptor_.joinable()) acceptor_.join();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Connection* c : open_) c->Close();
  }
  for (std::thread& t : workers_) t.join();
}

void DecodeNode::AcceptLoop() {
  while (!stopping_) {
    auto c = listener_->Accept(DeadlineIn(0.2));
    if (!c.ok()) {
      // Out of descriptors (EMFILE) or another accept error: the pending connection stays
      // queued and poll() would wake at once, so back off instead of spinning on a core.
      if (c.status().code() != StatusCode::kUnavailable) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      continue;
    }
    std::lock_guard<std::mutex> lock(mu_);
    // Threads of connections that ended are joined here, so a long-lived node holds only the
    // threads of its open connections.
    for (std::thread::id id : finished_) {
      auto it = std::find_if(workers_.begin(), workers_.end(), [&](const std::thread& t) { return t.get_id() == id; });
      if (it == workers_.end()) continue;
      it->join();
      workers_.erase(it);
    }
    finished_.clear();
    std::unique_ptr<Connection> conn = std::move(c).value();
    if (open_.size() >= opts_.max_connections) {
      metrics_.errors++;
      (void)SendJson(conn.get(), MessageKind::kError,
                     {{"error", "decode node busy: " + std::to_string(open_.size()) + " connections open (--max-connections)"}},
                     DeadlineIn(0.1));
      conn->Close();
      continue;
    }
    std::shared_ptr<Connection> shared(std::move(conn));
    open_.push_back(shared.get());
    try {
      workers_.emplace_back([this, shared]() mutable { Serve(std::move(shared)); });
    } catch (const std::exception& e) {
      // No thread to be had (a pids or memory limit): this connection is refused, not the node.
      metrics_.errors++;
      open_.erase(std::remove(open_.begin(), open_.end(), shared.get()), open_.end());
      (void)SendJson(shared.get(), MessageKind::kError, {{"error", std::string("decode node cannot start a thread: ") + e.what()}},
                     DeadlineIn(0.1));
      shared->Close();
    }
  }
}

// One connection, one request at a time; the connection ends when the peer closes it.
void DecodeNode::ServeRequests(Connection* c) {
  // What the KV must look like.
  const serve_internal::ComputeShape& shape = compute_->shape();
  const uint32_t n_layer = shape.n_layer, n_head_kv = shape.n_head_kv, head_dim = shape.head_dim;
  const uint32_t max_prompt = shape.max_prompt, max_new_limit = shape.max_new, vocab = shape.vocab;
  const uint64_t values_per_token = uint64_t{2} * n_layer * n_head_kv * head_dim;
  // This connection's KV slot and frame buffer, taken from the node's and given back after: a
  // request decodes into memory an earlier one warmed, as an engine's block pool would, instead
  // of faulting in its whole KV and every frame afresh.
  std::unique_ptr<Scratch> scratch = TakeScratch();
  struct GiveBack {
    DecodeNode* node;
    std::unique_ptr<Scratch>* s;
    ~GiveBack() { node->GiveScratch(std::move(*s)); }
  } give_back{this, &scratch};
  KvBlock& kv = scratch->kv;
  while (!stopping_) {
    c->set_max_message_bytes(serve_internal::kControlMessageBytes);
    auto first = c->Receive(DeadlineIn(opts_.request_timeout_s * 4));
    if (!first.ok()) break;  // closed or idle: nothing in flight
    const Clock::time_point t0 = Clock::now();
    auto fail = [&](const Status& st) {
      metrics_.errors++;
      (void)SendJson(c, MessageKind::kError, {{"error", st.ToString()}}, DeadlineIn(1));
    };
    if (first->kind != MessageKind::kRequest) {
      fail(Status::InvalidArgument(std::string("expected a request, got a ") + MessageKindName(first->kind) + " message"));
      break;
    }
    auto parsed = serve_internal::ParseDecodeRequest(first->body, vocab, max_prompt, max_new_limit);
    if (!parsed.ok()) {
      fail(parsed.status());
      break;
    }
    const uint64_t id = parsed->id;
    const uint32_t max_new = parsed->max_new_tokens, prompt_len = parsed->prompt_len;
    const int first_token = parsed->first_token;
    const bool stream = parsed->stream;
    const Sampling sampling = parsed->sampling;
    // A frame holds at most the prompt's KV (all layers, for a whole-request strategy), coded.
    c->set_max_message_bytes(serve_internal::MaxFrameBytes(values_per_token * prompt_len, prompt_len));
    const Clock::time_point deadline = DeadlineIn(opts_.request_timeout_s);
    std::unique_ptr<LayerAssembler> assembler;
    double decode_s = 0;
    uint64_t wire_bytes = 0;
    int rounds = 0;
    Status st;
    bool done = false, connection_ok = true;
    while (!done && st.ok()) {
      auto m = c->Receive(deadline, &scratch->frame);
      if (!m.ok()) {
        st = m.status();
        connection_ok = false;
        break;
      }
      // The body's allocation goes back to the scratch buffer for the next message.
      struct Recycle {
        ByteBuffer* from;
        ByteBuffer* to;
        ~Recycle() { *to = std::move(*from); }
      } recycle{&m->body, &scratch->frame};
      if (m->kind == MessageKind::kFrame) {
        wire_bytes += m->body.size();
        const Clock::time_point d0 = Clock::now();
        if (assembler == nullptr) {
          // The first intact frame says what the request's KV looks like (kept tokens and all).
          auto v = ParseFrame(m->body);
          if (!v.ok()) {
            metrics_.corrupt_frames++;
            continue;
          }
          const FrameHeader& h = v->header;
          const uint32_t kept = h.has_positions ? uint32_t(h.positions.size()) : h.shape.n_token;
          if (h.request_id != id || h.n_layer_total != n_layer || h.shape.n_head_kv != n_head_kv ||
              h.shape.head_dim != head_dim || h.shape.n_token != prompt_len) {
            st = Status::InvalidArgument("request " + std::to_string(id) + ": frame does not fit this model's KV");
            break;
          }
          // Every layer is written before generation reads it (a request missing one fails), so
          // the slot is reshaped without being cleared.
          st = kv.Reset(KvShape{n_layer, n_head_kv, kept, head_dim}, shape.kv_dtype);
          if (!st.ok()) break;
          assembler = std::make_unique<LayerAssembler>(id, &kv, opts_.env);
        }
        const Status add = assembler->Add(m->body);
        decode_s += Seconds(d0, Clock::now());
        if (add.code() == StatusCode::kCorrupt) {
          metrics_.corrupt_frames++;  // asked for again at the end
        } else if (!add.ok()) {
          st = add;
        }
      } else if (m->kind == MessageKind::kEnd) {
        std::vector<uint32_t> missing;
        for (uint32_t l = 0; l < n_layer; ++l)
          if (assembler == nullptr || !assembler->has_layer(l)) missing.push_back(l);
        if (missing.empty()) {
          done = true;
        } else if (rounds++ == 0) {
          metrics_.resent_layers += missing.size();
          st = SendJson(c, MessageKind::kResend, {{"layers", missing}}, deadline);
          if (!st.ok()) connection_ok = false;
        } else {
          st = Status::Corrupt("request " + std::to_string(id) + ": " + std::to_string(missing.size()) +
                               " layers failed verification twice (first: " + std::to_string(missing[0]) + ")");
        }
      } else {
        st = Status::InvalidArgument(std::string("unexpected ") + MessageKindName(m->kind) + " message mid-request");
      }
    }
    if (!st.ok()) {
      if (connection_ok) fail(st);
      else metrics_.errors++;
      break;
    }
    const Clock::time_point g0 = Clock::now();
    // Greedy generation over the transferred prompt KV, from the prefill node's first token.
    auto out = [&]() -> Result<std::vector<int>> {
      KV_ASSIGN_OR_RETURN(std::unique_ptr<serve_internal::ComputeSession> session, compute_->NewSession());
      KV_RETURN_IF_ERROR(session->LoadPrefix(kv, prompt_len));
      if (!stream) return session->Generate(first_token, max_new, sampling);
      // Each token to the prefill node as it is made; a failed send (the request was dropped
      // upstream: its client left) ends generation.
      return session->Generate(first_token, max_new, sampling, [&](int token) {
        return SendJson(c, MessageKind::kTokens, {{"tokens", {token}}}, DeadlineIn(opts_.request_timeout_s)).ok();
      });
    }();
    if (!out.ok()) {
      fail(out.status());
      break;
    }
    metrics_.requests++;
    metrics_.wire_bytes += wire_bytes;
    metrics_.decode_us += uint64_t(decode_s * 1e6);
    const json result = {{"id", id},
                         {"tokens", out.value()},
                         {"decode_s", decode_s},
                         {"transfer_s", Seconds(t0, g0)},
                         {"generate_s", Seconds(g0, Clock::now())}};
    if (!SendJson(c, MessageKind::kResult, result, DeadlineIn(opts_.request_timeout_s)).ok()) break;
  }
}

Status DecodeNode::Prepare(uint32_t n_token) {
  KV_RETURN_IF_ERROR(MakeComputeOnce());
  const serve_internal::ComputeShape& s = compute_->shape();
  if (n_token == 0 || n_token > s.max_prompt) {
    return Status::InvalidArgument("decode node: cannot prepare for " + std::to_string(n_token) + " tokens (1 to " +
                                   std::to_string(s.max_prompt) + ")");
  }
  auto scratch = std::make_unique<Scratch>();
  KV_RETURN_IF_ERROR(scratch->kv.Reset(KvShape{s.n_layer, s.n_head_kv, n_token, s.head_dim}, s.kv_dtype));
  std::memset(scratch->kv.data(), 0, scratch->kv.bytes());
  // The largest per-layer frame: one layer's values, uncoded (`none`), and its header.
  const uint64_t layer_values = uint64_t{2} * s.n_head_kv * n_token * s.head_dim;
  scratch->frame.resize(size_t(layer_values * DTypeSize(s.kv_dtype) + (64 << 10)));
  std::memset(scratch->frame.data(), 0, scratch->frame.size());
  GiveScratch(std::move(scratch));
  return Status::Ok();
}

std::unique_ptr<DecodeNode::Scratch> DecodeNode::TakeScratch() {
  std::lock_guard<std::mutex> lock(scratch_mu_);
  if (scratch_.empty()) return std::make_unique<Scratch>();
  std::unique_ptr<Scratch> s = std::move(scratch_.back());
  scratch_.pop_back();
  return s;
}

void DecodeNode::GiveScratch(std::unique_ptr<Scratch> s) {
  if (s == nullptr) return;
  std::lock_guard<std::mutex> lock(scratch_mu_);
  if (scratch_.size() < opts_.kept_buffers) scratch_.push_back(std::move(s));
}

// The connection's thread: its requests, then (whatever happened, an exception included) the
// connection closed and this thread marked for joining.
void DecodeNode::Serve(std::shared_ptr<Connection> c) {
  const Status st = serve_internal::Guarded("decode connection", [&] {
    ServeRequests(c.get());
    return Status::Ok();
  });
  if (!st.ok()) {
    metrics_.errors++;
    (void)SendJson(c.get(), MessageKind::kError, {{"error", st.ToString()}}, DeadlineIn(0.5));
  }
  c->Close();
  std::lock_guard<std::mutex> lock(mu_);
  open_.erase(std::remove(open_.begin(), open_.end(), c.get()), open_.end());
  c.reset();
  finished_.push_back(std::this_thread::get_id());  // the last thing this thread does under the lock
}

}  // namespace kvserve
