// The interpretable latency model: sequential and layer-streamed forms and their break-even
// bandwidths (docs/CONTROLLER.md derives them).
#include <algorithm>
#include <cmath>

#include "kvserve/controller.h"

namespace kvserve {

double LatencyModel::Uncompressed(double bytes, double bandwidth_Bps) { return bytes / bandwidth_Bps; }

double LatencyModel::Sequential(const StrategyCost& s, double bytes, double bandwidth_Bps) {
  if (s.none()) return Uncompressed(bytes, bandwidth_Bps);
  return bytes / s.encode_Bps + bytes / (s.ratio * bandwidth_Bps) + bytes / s.decode_Bps;
}

double LatencyModel::Pipelined(const StrategyCost& s, double bytes, double bandwidth_Bps, uint32_t n_layer) {
  if (s.none()) return Uncompressed(bytes, bandwidth_Bps);
  const double layers = std::max<uint32_t>(1, n_layer);
  const double steady = std::max({bytes / s.encode_Bps, bytes / (s.ratio * bandwidth_Bps), bytes / s.decode_Bps});
  // The first layer's encode and the last layer's decode cannot overlap anything.
  const double fill = (bytes / layers) * (1 / s.encode_Bps + 1 / s.decode_Bps);
  return steady + fill;
}

double LatencyModel::BreakEvenSequential(const StrategyCost& s) {
  if (s.none() || s.ratio <= 1) return 0;
  const double serial = 1 / (1 / s.encode_Bps + 1 / s.decode_Bps);
  return (1 - 1 / s.ratio) * serial;
}

double LatencyModel::BreakEvenPipelined(const StrategyCost& s, uint32_t n_layer) {
  if (s.none() || s.ratio <= 1) return 0;
  const double layers = std::max<uint32_t>(1, n_layer);
  const double inv_serial = 1 / s.encode_Bps + 1 / s.decode_Bps;
  // Pays iff V/B > V/(r B) + fill (link-bound) and V/B > V/min(Se, Sd) + fill (codec-bound).
  const double link_bound = layers * (1 - 1 / s.ratio) / inv_serial;
  const double codec_bound = 1 / (1 / std::min(s.encode_Bps, s.decode_Bps) + inv_serial / layers);
  return std::min(link_bound, codec_bound);
}

}  // namespace kvserve
