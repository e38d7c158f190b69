// The strategy table's presentation: a Markdown table and an SVG plot of quality against ratio.
#pragma once

#include <string>
#include <vector>

#include "kvserve/codec_bench.h"
#include "kvserve/eval.h"
#include "kvserve/status.h"
#include "model/studies.h"

namespace kvserve::cli {

struct TableRow {
  NamedStrategy named;
  EvalMetrics eval;
  CodecMeasurement codec;
};

std::string TableMarkdown(const LlamaModel& m, const Evaluator& ev, const std::vector<TableRow>& rows,
                          uint32_t bench_tokens);
// Relative accuracy (y) against compression ratio (x, log scale), one labelled point per row.
std::string TableSvg(const LlamaModel& m, const std::vector<TableRow>& rows);
Status WriteTextAtomic(const std::string& path, const std::string& text);

}  // namespace kvserve::cli
