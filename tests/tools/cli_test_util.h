// Runs the kvserve CLI for the CLI tests: exit code and output (stdout and stderr together).
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace kvserve::testing {

struct CliRun {
  int code;
  std::string out;  // stdout and stderr together
};

// `prefix` runs first in the same shell (environment variables, `ulimit`); every run is bounded
// by `timeout_s`, so a hang fails its test instead of the suite.
// A shell command line (stdout and stderr together), as it stands.
inline CliRun Shell(const std::string& cmd) {
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

inline CliRun Cli(const std::string& args, const std::string& prefix = "", int timeout_s = 600) {
  return Shell(prefix + (prefix.empty() ? "" : " ") + "timeout -s KILL " + std::to_string(timeout_s) + " " +
               std::string(KVSERVE_CLI) + " " + args + " 2>&1");
}

}  // namespace kvserve::testing
