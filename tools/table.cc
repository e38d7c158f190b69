// Markdown and SVG output of the strategy table (an SVG written by hand: a scatter plot needs
// no plotting library).
#include "table.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "kvserve/file.h"
#include "kvserve/frame.h"

namespace kvserve::cli {

namespace {
std::string Fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}
std::string Escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '<') o += "&lt;";
    else if (c == '>') o += "&gt;";
    else if (c == '&') o += "&amp;";
    else o += c;
  }
  return o;
}
}  // namespace

std::string TableMarkdown(const LlamaModel& m, const Evaluator& ev, const std::vector<TableRow>& rows,
                          uint32_t bench_tokens) {
  std::string s = "Model " + m.name + " (sha256 " + m.sha256.substr(0, 12) + "...), " +
                  std::to_string(rows.empty() ? 0 : rows[0].eval.contexts) + " contexts, " +
                  std::to_string(rows.empty() ? 0 : rows[0].eval.positions) + " scored positions, prompt " +
                  std::to_string(ev.prompt_len()) + " tokens. Codec speed: single thread, synthetic llama3-8b block of " +
                  std::to_string(bench_tokens) + " tokens (fp16 GB/s).\n\n";
  s += "| name | avg bits | ratio | rel. accuracy | top-1 | KL | greedy | enc GB/s | dec GB/s | spec |\n";
  s += "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n";
  for (const auto& r : rows) {
    const EvalMetrics& e = r.eval;
    s += "| " + r.named.name + " | " + Fmt("%.2f", 16.0 / e.ratio) + " | " + Fmt("%.2f", e.ratio) + " | " +
         Fmt("%.4f", e.relative_accuracy) + " ± " + Fmt("%.4f", e.relative_accuracy_se) + " | " +
         Fmt("%.4f", e.top1_agreement) + " | " + Fmt("%.5f", e.kl) + " | " + Fmt("%.1f", e.greedy_match) + " | " +
         Fmt("%.2f", r.codec.encode_gbps) + " | " + Fmt("%.2f", r.codec.decode_gbps) + " | `" + e.strategy + "` |\n";
  }
  s += "\nNotes:\n";
  for (const auto& r : rows) {
    if (!r.named.note.empty()) s += "- **" + r.named.name + "**: " + r.named.note + "\n";
  }
  return s;
}

std::string TableSvg(const LlamaModel& m, const std::vector<TableRow>& rows) {
  const double W = 900, H = 560, L = 70, R = 30, T = 40, B = 60;
  double xmax = 1.0, ymin = 1.0, ymax = 1.0;
  for (const auto& r : rows) {
    xmax = std::max(xmax, r.eval.ratio);
    ymin = std::min(ymin, r.eval.relative_accuracy);
    ymax = std::max(ymax, r.eval.relative_accuracy);
  }
  const double lx0 = std::log(0.9), lx1 = std::log(xmax * 1.15);
  // The interesting region is near the floor: rows far below it are pinned to the bottom edge.
  ymin = std::max(0.85, ymin - 0.02);
  ymax += 0.01;
  auto X = [&](double v) { return L + (std::log(v) - lx0) / (lx1 - lx0) * (W - L - R); };
  auto Y = [&](double v) { return T + (ymax - v) / (ymax - ymin) * (H - T - B); };
  std::string s = "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + Fmt("%.0f", W) + "\" height=\"" +
                  Fmt("%.0f", H) + "\" font-family=\"sans-serif\" font-size=\"11\">\n";
  s += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  s += "<text x=\"" + Fmt("%.0f", W / 2) + "\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">" + Escape(m.name) +
       ": relative accuracy vs compression ratio (higher and further right is better)</text>\n";
  // Axes, grid and ticks.
  for (double v : {1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0}) {
    if (v > xmax * 1.15) break;
    s += "<line x1=\"" + Fmt("%.1f", X(v)) + "\" y1=\"" + Fmt("%.1f", T) + "\" x2=\"" + Fmt("%.1f", X(v)) + "\" y2=\"" +
         Fmt("%.1f", H - B) + "\" stroke=\"#eee\"/>\n";
    s += "<text x=\"" + Fmt("%.1f", X(v)) + "\" y=\"" + Fmt("%.1f", H - B + 16) + "\" text-anchor=\"middle\">" +
         Fmt("%g", v) + "x</text>\n";
  }
  const double step = (ymax - ymin) > 0.2 ? 0.05 : 0.01;
  for (double v = std::ceil(ymin / step) * step; v <= ymax + 1e-9; v += step) {
    s += "<line x1=\"" + Fmt("%.1f", L) + "\" y1=\"" + Fmt("%.1f", Y(v)) + "\" x2=\"" + Fmt("%.1f", W - R) + "\" y2=\"" +
         Fmt("%.1f", Y(v)) + "\" stroke=\"#eee\"/>\n";
    s += "<text x=\"" + Fmt("%.1f", L - 6) + "\" y=\"" + Fmt("%.1f", Y(v) + 4) + "\" text-anchor=\"end\">" +
         Fmt("%.2f", v) + "</text>\n";
  }
  if (0.97 > ymin && 0.97 < ymax) {
    s += "<line x1=\"" + Fmt("%.1f", L) + "\" y1=\"" + Fmt("%.1f", Y(0.97)) + "\" x2=\"" + Fmt("%.1f", W - R) +
         "\" y2=\"" + Fmt("%.1f", Y(0.97)) + "\" stroke=\"#c33\" stroke-dasharray=\"5,4\"/>\n";
    s += "<text x=\"" + Fmt("%.1f", W - R - 4) + "\" y=\"" + Fmt("%.1f", Y(0.97) - 5) +
         "\" text-anchor=\"end\" fill=\"#c33\">quality floor 0.97</text>\n";
  }
  s += "<line x1=\"" + Fmt("%.1f", L) + "\" y1=\"" + Fmt("%.1f", H - B) + "\" x2=\"" + Fmt("%.1f", W - R) + "\" y2=\"" +
       Fmt("%.1f", H - B) + "\" stroke=\"black\"/>\n";
  s += "<line x1=\"" + Fmt("%.1f", L) + "\" y1=\"" + Fmt("%.1f", T) + "\" x2=\"" + Fmt("%.1f", L) + "\" y2=\"" +
       Fmt("%.1f", H - B) + "\" stroke=\"black\"/>\n";
  s += "<text x=\"" + Fmt("%.0f", (L + W - R) / 2) + "\" y=\"" + Fmt("%.0f", H - 18) +
       "\" text-anchor=\"middle\">compression ratio vs fp16 (log scale)</text>\n";
  s += "<text x=\"18\" y=\"" + Fmt("%.0f", (T + H - B) / 2) + "\" transform=\"rotate(-90 18 " +
       Fmt("%.0f", (T + H - B) / 2) + ")\" text-anchor=\"middle\">relative accuracy</text>\n";
  for (const auto& r : rows) {
    const bool below = r.eval.relative_accuracy < ymin;
    const double x = X(r.eval.ratio), y = Y(below ? ymin : r.eval.relative_accuracy);
    if (below) {
      s += "<text x=\"" + Fmt("%.1f", x + 6) + "\" y=\"" + Fmt("%.1f", y + 12) + "\" fill=\"#888\">(" +
           Fmt("%.2f", r.eval.relative_accuracy) + ", below the plot)</text>\n";
    }
    const bool published = !r.named.recomposition;
    s += "<circle cx=\"" + Fmt("%.1f", x) + "\" cy=\"" + Fmt("%.1f", y) + "\" r=\"4\" fill=\"" +
         (published ? "#36c" : "#e80") + "\"/>\n";
    s += "<text x=\"" + Fmt("%.1f", x + 6) + "\" y=\"" + Fmt("%.1f", y - 5) + "\">" + Escape(r.named.name) + "</text>\n";
  }
  s += "<circle cx=\"" + Fmt("%.0f", L + 14) + "\" cy=\"" + Fmt("%.0f", H - B - 30) + "\" r=\"4\" fill=\"#36c\"/>\n";
  s += "<text x=\"" + Fmt("%.0f", L + 22) + "\" y=\"" + Fmt("%.0f", H - B - 26) + "\">baselines and published methods</text>\n";
  s += "<circle cx=\"" + Fmt("%.0f", L + 14) + "\" cy=\"" + Fmt("%.0f", H - B - 14) + "\" r=\"4\" fill=\"#e80\"/>\n";
  s += "<text x=\"" + Fmt("%.0f", L + 22) + "\" y=\"" + Fmt("%.0f", H - B - 10) + "\">recompositions</text>\n";
  return s + "</svg>\n";
}

Status WriteTextAtomic(const std::string& path, const std::string& text) {
  return WriteFileAtomic(path, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
}

}  // namespace kvserve::cli
