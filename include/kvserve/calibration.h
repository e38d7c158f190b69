// Calibration of the serving testbed: a lone request's measured time against what its parts
// predict — its bytes at the link rate, its codec stages pipelined per layer, the modelled
// compute — so a benchmark shows that it measures the system, not itself, before it reports a
// ratio (docs/SERVING.md, "Calibration").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvserve/serve.h"

namespace kvserve {

// Seconds for n_frames equal frames through three stages (encode, wire, decode) whose totals
// over all frames are given, each stage taking one frame at a time: the slowest stage's total
// plus one frame's time in the other two (the pipeline filling and draining).
double PipelinedSeconds(double encode_s, double wire_s, double decode_s, uint32_t n_frames);

struct StageCheck {
  std::string stage;  // "queue", "prefill", "transfer" (pool: "fetch"), "generate" (PD), "other"
  double measured_s = 0, predicted_s = 0;
};

struct CalibrationTolerance {
  double relative = 0.10;   // of the predicted total
  double absolute_s = 0.050;  // whichever is larger
};

// One policy's lone request on one link, checked.
struct LoneRequestCheck {
  double gbps = 0;
  std::string policy, strategy;
  double measured_s = 0, predicted_s = 0;
  std::vector<StageCheck> stages;
  // The transfer's parts, each summed over the request's frames: encode and decode as the nodes
  // timed them, the time its sends took, and its bytes at the link rate (a pool hit: decode and
  // the bytes at the rate). Sends longer than the bytes at the rate: the link (or the receiver)
  // under-delivers; a transfer longer than its parts pipelined while the sends keep to the rate:
  // the stages do not overlap as predicted.
  double encode_s = 0, send_s = 0, decode_s = 0, wire_at_rate_s = 0;
  bool valid = false;
  std::string fault;  // the stage furthest from its prediction, when not valid
};

// Checks a PD request served alone on a link shaped to `gbps`: predicted = prefill of its prompt
// at the model's rate + its frames pipelined (encode and decode as measured, wire = its bytes at
// the link rate) + generation of max_new_tokens at the model's rate. The codec stages are taken
// as measured because their speed is the codec's, not the testbed's; everything else the
// request spends is overhead the check must expose.
LoneRequestCheck CheckLoneRequest(const ServeResponse& r, const SyntheticModel& model, double gbps, uint32_t prompt_tokens,
                                  uint32_t max_new_tokens, const CalibrationTolerance& tolerance = {});

// Checks a pool node's request served alone with its prefix in the pool, behind a link of
// `gbps`, on pool mode's figure, the time to first token at the client: predicted = its fetched
// chunks pipelined (wire = the fetched bytes at the link rate, decode as measured; chunk_tokens
// a chunk) + prefill of the tokens it computed at the model's rate.
LoneRequestCheck CheckLonePoolRequest(const ServeResponse& r, const SyntheticModel& model, double gbps, uint32_t prompt_tokens,
                                      uint32_t chunk_tokens, const CalibrationTolerance& tolerance = {});

}  // namespace kvserve
