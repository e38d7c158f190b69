// Shared helpers of the kvserve CLI: error reporting, timing, progress lines.
#pragma once

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "kvserve/codec.h"
#include "kvserve/status.h"
#include "kvserve/thread_pool.h"
#include "kvserve/transport.h"

namespace kvserve::cli {

// Each subcommand's action returns a Status; main prints a failure as one line and exits 1.
using Action = std::function<Status()>;
void SetAction(CLI::App* cmd, Action action);
int Run(CLI::App& app, int argc, char** argv);

// The CLI's environment, resolved here and passed to the library as arguments (library code
// reads no variables): folders default to $KVSERVE_MODELS, $KVSERVE_CACHE (calibration data in
// its calib/ unless $KVSERVE_CALIB says otherwise), else the source tree's models/ and
// .kvserve-cache/.
std::string SourceDir();
std::string ModelsDir();
std::string CacheDir();
std::string CalibDir();
// The process's codec environment (one calibration store over CalibDir()).
const CodecEnv& Codec();
// One reusable pool per thread count for the process; null for threads <= 1.
ThreadPool* Pool(int threads);

// A flag's number must lie in [lo, hi]; NaN, infinities and text are refused by name, so a
// nonsense value never reaches a computation whose result would be printed.
CLI::Validator InRange(double lo, double hi);
// An output file: its folder must exist and be writable and the path must not be a folder,
// checked when the flags are read — before minutes of measuring, not after.
CLI::Validator OutputPath();

double NowSeconds();
double Median(std::vector<double> v);  // kvserve/stats.h's Percentile at 0.5
// "a | b | c" for help texts.
std::string JoinNames(const std::vector<std::string>& names, const std::string& separator = " | ");
bool StderrIsTerminal();

// A single self-overwriting status line on stderr, shown only on a terminal.
class Progress {
 public:
  explicit Progress(std::string what, uint64_t total) : what_(std::move(what)), total_(total), start_(NowSeconds()) {}
  void Update(uint64_t done, const std::string& extra = "");
  void Done();

 private:
  std::string what_;
  uint64_t total_;
  double start_;
  double last_ = 0;
};

void AddCodecCommands(CLI::App& app);
void AddModelCommands(CLI::App& app);
void AddProfileCommands(CLI::App& app);
void AddControlCommands(CLI::App& app);
// What the transport carries over a link: `mib` MiB sent to a `bench link --listen` at
// `connect`, or with `connect` empty to a receiver in this process over loopback, timed until
// the receiver confirms the last byte. `ends` puts the in-process receiver and the sender in
// network namespaces (a veth between them, kvserve/testbed.h's NetnsLink) instead of loopback.
struct LinkEnds {
  std::string listen_netns, listen_ip = "127.0.0.1", connect_netns;
};
struct LinkMeasurement {
  std::string target;
  uint64_t bytes = 0;
  double seconds = 0, gbps = 0;
};
Result<LinkMeasurement> MeasureLink(Transport* transport, const std::string& connect, uint32_t mib, const LinkEnds& ends = {});

void AddServeCommands(CLI::App& app);
void AddBenchE2eCommand(CLI::App& bench);
void AddBenchPoolCommand(CLI::App& bench);

}  // namespace kvserve::cli
