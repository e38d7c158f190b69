// Calibration: a lone request's stages against their predictions (kvserve/calibration.h).
#include "kvserve/calibration.h"

#include <algorithm>
#include <cmath>

namespace kvserve {

double PipelinedSeconds(double encode_s, double wire_s, double decode_s, uint32_t n_frames) {
  if (n_frames == 0) return 0;
  const double slowest = std::max({encode_s, wire_s, decode_s});
  const double one_frame = (encode_s + wire_s + decode_s) / n_frames;
  return slowest + one_frame - slowest / n_frames;
}

namespace {

// Valid when the total is within tolerance of its prediction; otherwise the fault is the stage
// furthest from its own.
void Judge(LoneRequestCheck* c, const CalibrationTolerance& tolerance) {
  c->valid = std::fabs(c->measured_s - c->predicted_s) <= std::max(tolerance.relative * c->predicted_s, tolerance.absolute_s);
  if (c->valid) return;
  double worst = -1;
  for (const StageCheck& s : c->stages) {
    const double off = std::fabs(s.measured_s - s.predicted_s);
    if (off > worst) worst = off, c->fault = s.stage;
  }
}

}  // namespace

LoneRequestCheck CheckLoneRequest(const ServeResponse& r, const SyntheticModel& model, double gbps, uint32_t prompt_tokens,
                                  uint32_t max_new_tokens, const CalibrationTolerance& tolerance) {
  const StageTimings& t = r.timings;
  LoneRequestCheck c;
  c.gbps = gbps;
  c.strategy = r.strategy;
  const uint32_t n_frames = TransferFrames(r.strategy, model.n_layer);
  const double wire_s = double(r.wire_bytes) * 8 / (gbps * 1e9);
  const double prefill_s = prompt_tokens / model.prefill_tokens_per_second;
  const double transfer_s = PipelinedSeconds(t.encode_s, wire_s, t.decode_s, n_frames);
  const double generate_s = max_new_tokens > 1 ? (max_new_tokens - 1) / model.decode_tokens_per_second : 0;
  const double other_s = t.total_s - (t.queue_s + t.prefill_s + t.transfer_s + t.generate_s);
  c.stages = {{"queue", t.queue_s, 0},
              {"prefill", t.prefill_s, prefill_s},
              {"transfer", t.transfer_s, transfer_s},
              {"generate", t.generate_s, generate_s},
              {"other", other_s, 0}};
  c.encode_s = t.encode_s, c.send_s = t.wire_s, c.decode_s = t.decode_s, c.wire_at_rate_s = wire_s;
  c.measured_s = t.total_s;
  c.predicted_s = prefill_s + transfer_s + generate_s;
  Judge(&c, tolerance);
  return c;
}

LoneRequestCheck CheckLonePoolRequest(const ServeResponse& r, const SyntheticModel& model, double gbps, uint32_t prompt_tokens,
                                      uint32_t chunk_tokens, const CalibrationTolerance& tolerance) {
  const StageTimings& t = r.timings;
  LoneRequestCheck c;
  c.gbps = gbps;
  c.strategy = r.strategy;
  const uint32_t cached = std::min(r.cached_tokens, prompt_tokens);
  const uint32_t n_chunks = chunk_tokens > 0 ? cached / chunk_tokens : 0;
  const double wire_s = double(r.wire_bytes) * 8 / (gbps * 1e9);
  const double fetch_s = n_chunks > 0 ? PipelinedSeconds(0, wire_s, t.decode_s, n_chunks) : 0;
  const double prefill_s = (prompt_tokens - cached) / model.prefill_tokens_per_second;
  c.stages = {{"queue", t.queue_s, 0},
              {"fetch", t.fetch_s, fetch_s},
              {"prefill", t.prefill_s, prefill_s},
              {"other", t.first_token_s - (t.queue_s + t.fetch_s + t.prefill_s), 0}};
  c.decode_s = t.decode_s, c.wire_at_rate_s = wire_s;
  c.measured_s = t.first_token_s;
  c.predicted_s = fetch_s + prefill_s;
  Judge(&c, tolerance);
  return c;
}

}  // namespace kvserve
