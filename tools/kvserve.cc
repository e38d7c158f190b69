// kvserve: the one CLI. Subcommands per area live in tools/cmd_*.cc.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <new>

#include "cli.h"
#include "kvserve/stats.h"
#include "kvserve/calib.h"
#include "kvserve/cpu.h"
#include "kvserve/file.h"

namespace kvserve::cli {

namespace {
Action* g_action = nullptr;
}

void SetAction(CLI::App* cmd, Action action) {
  auto holder = std::make_shared<Action>(std::move(action));
  cmd->callback([holder] { g_action = holder.get(); });
  // Keep the Action alive as long as the App.
  static std::vector<std::shared_ptr<Action>> keep;
  keep.push_back(holder);
}

int Run(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    std::printf("%s\n", e.what());
    return 0;
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "kvserve: error: %s (see --help)\n", e.what());
    return 2;
  }
  if (g_action == nullptr) {
    std::fputs(app.help().c_str(), stdout);
    return 0;
  }
  // KVSERVE_SIMD caps the kernels' SIMD tier (kvserve/cpu.h), e.g. to time the baseline path.
  if (const char* simd = std::getenv("KVSERVE_SIMD"); simd && *simd) {
    auto tier = cpu::ParseTier(simd);
    if (!tier.ok()) {
      std::fprintf(stderr, "kvserve: error: KVSERVE_SIMD: %s\n", tier.status().message().c_str());
      return 2;
    }
    cpu::SetCap(*tier);
  }
  Status st;
  try {
    st = (*g_action)();
  } catch (const std::bad_alloc&) {
    // A size the limits allow but this machine's memory does not.
    st = Status::OutOfRange("out of memory (the input or a flag asks for more memory than this machine has)");
  }
  if (!st.ok()) {
    std::fprintf(stderr, "kvserve: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}

namespace {
std::string EnvOr(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}
}  // namespace

std::string SourceDir() { return KVSERVE_SOURCE_DIR; }
// The source tree of this build when it is there; an installed CLI (a package) uses the data
// folder it was installed with and a per-user cache.
bool HaveSourceTree() { return std::filesystem::exists(SourceDir() + "/models"); }
std::string ModelsDir() {
  return EnvOr("KVSERVE_MODELS", HaveSourceTree() ? SourceDir() + "/models" : std::string(KVSERVE_DATA_DIR) + "/models");
}
std::string CacheDir() {
  if (HaveSourceTree()) return EnvOr("KVSERVE_CACHE", SourceDir() + "/.kvserve-cache");
  const std::string home = EnvOr("HOME", "/tmp");
  return EnvOr("KVSERVE_CACHE", EnvOr("XDG_CACHE_HOME", home + "/.cache") + "/kvserve");
}
std::string CalibDir() { return EnvOr("KVSERVE_CALIB", CacheDir() + "/calib"); }

const CodecEnv& Codec() {
  static CalibrationStore store(CalibDir());
  static const CodecEnv env{&store};
  return env;
}

ThreadPool* Pool(int threads) {
  if (threads <= 1) return nullptr;
  static std::map<int, std::unique_ptr<ThreadPool>> pools;
  auto& p = pools[threads];
  if (!p) p = std::make_unique<ThreadPool>(threads);
  return p.get();
}

CLI::Validator OutputPath() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        namespace fs = std::filesystem;
        if (s.empty()) return "empty output path";
        std::error_code ec;
        if (fs::is_directory(s, ec)) return "'" + s + "' is a directory, not an output file";
        const fs::path parent = fs::path(s).parent_path();
        const std::string dir = parent.empty() ? "." : parent.string();
        if (!fs::exists(dir, ec)) return "folder '" + dir + "' of output '" + s + "' does not exist";
        if (!fs::is_directory(dir, ec)) return "'" + dir + "' (folder of output '" + s + "') is not a directory";
        if (::access(dir.c_str(), W_OK) != 0) {
          return "folder '" + dir + "' of output '" + s + "' is not writable: " + std::strerror(errno);
        }
        return "";
      },
      "PATH");
}

CLI::Validator InRange(double lo, double hi) {
  auto text = [](double v) {
    char b[32];
    std::snprintf(b, sizeof b, "%g", v);
    return std::string(b);
  };
  const std::string range = "[" + text(lo) + ", " + text(hi) + "]";
  return CLI::Validator(
      [lo, hi, range](std::string& s) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(s.c_str(), &end);
        if (s.empty() || *end != '\0' || !(v >= lo && v <= hi)) return "want a number in " + range + ", got '" + s + "'";
        return "";
      },
      range);
}

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double Median(std::vector<double> v) { return Percentile(std::move(v), 0.5); }

std::string JoinNames(const std::vector<std::string>& names, const std::string& separator) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : separator) + n;
  return s;
}

bool StderrIsTerminal() { return ::isatty(2) != 0; }

void Progress::Update(uint64_t done, const std::string& extra) {
  if (!StderrIsTerminal()) return;
  const double now = NowSeconds();
  if (done < total_ && now - last_ < 0.1) return;
  last_ = now;
  const double el = now - start_;
  const double eta = done > 0 ? el * double(total_ - done) / double(done) : 0;
  std::fprintf(stderr, "\r\033[K%s %llu/%llu  %.1fs elapsed, ETA %.1fs%s%s", what_.c_str(),
               static_cast<unsigned long long>(done), static_cast<unsigned long long>(total_), el, eta,
               extra.empty() ? "" : "  ", extra.c_str());
  std::fflush(stderr);
}

void Progress::Done() {
  if (StderrIsTerminal()) std::fprintf(stderr, "\r\033[K");
}

}  // namespace kvserve::cli

int main(int argc, char** argv) {
  CLI::App app{
      "kvserve — KV-cache compression for disaggregated LLM serving.\n"
      "Encode KV caches with composable codec strategies, measure them on real models, and move them.",
      "kvserve"};
  app.require_subcommand(0, 1);
  kvserve::InstallTempFileCleanup();
  app.set_version_flag("--version", std::string("kvserve ") + KVSERVE_VERSION);
  kvserve::cli::AddCodecCommands(app);
  kvserve::cli::AddModelCommands(app);
  kvserve::cli::AddProfileCommands(app);
  kvserve::cli::AddControlCommands(app);
  kvserve::cli::AddServeCommands(app);
  return kvserve::cli::Run(app, argc, argv);
}
