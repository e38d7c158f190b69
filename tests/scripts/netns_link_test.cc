// scripts/netns-link.sh: builds a shaped veth link between two namespaces that carries the
// transport, and leaves no namespace or qdisc behind — after success, after a failing command,
// after `down` twice. Skips (with the script's reason) where namespaces cannot be made.
#include <gtest/gtest.h>

#include <string>

#include "test_paths.h"
#include "tools/cli_test_util.h"

namespace {

using kvserve::testing::CliRun;

CliRun Shell(const std::string& cmd) {
  FILE* p = popen(("timeout -s KILL 120 bash -c '" + cmd + "' 2>&1").c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

const std::string kScript = "KVSERVE_NETNS_PREFIX=kvt" + std::to_string(::getpid() % 10000) + " bash " +
                            kvserve::SourceDir() + "/scripts/netns-link.sh";
const std::string kPrefix = "kvt" + std::to_string(::getpid() % 10000);

bool NamespacesLeft() { return Shell("ip netns list").out.find(kPrefix + "-") != std::string::npos; }

TEST(NetnsLink, CarriesTheTransportAndCleansUpEvenOnFailure) {
  CliRun r = Shell(kScript + " down");
  if (r.code == 77) GTEST_SKIP() << r.out;
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string cli = KVSERVE_CLI;
  const std::string a = kPrefix + "-a", b = kPrefix + "-b";
  r = Shell(kScript + " run 2 -- bash -c \"ip netns exec " + b + " " + cli +
            " bench link --listen 10.77.0.2:7100 & sleep 0.5; ip netns exec " + a + " " + cli +
            " bench link --connect 10.77.0.2:7100 --mib 16 --json; wait\"");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("\"gbps\""), std::string::npos) << r.out;
  EXPECT_FALSE(NamespacesLeft());
  // The command fails: the link is still torn down, and the failure is passed on.
  r = Shell(kScript + " run 1 -- false");
  EXPECT_NE(r.code, 0);
  EXPECT_FALSE(NamespacesLeft());
  // up, then down twice: the second down is a no-op.
  ASSERT_EQ(Shell(kScript + " up 1").code, 0);
  EXPECT_TRUE(NamespacesLeft());
  EXPECT_NE(Shell("tc -n " + a + " qdisc show").out.find("tbf"), std::string::npos);
  EXPECT_EQ(Shell(kScript + " down").code, 0);
  // Delay needs netem; a kernel without it gets a clear skip (77) and no half-built link.
  r = Shell(kScript + " up 1 5 1");
  if (r.code == 0) {
    EXPECT_NE(Shell("tc -n " + a + " qdisc show").out.find("netem"), std::string::npos);
  } else {
    EXPECT_EQ(r.code, 77) << r.out;
    EXPECT_NE(r.out.find("netem"), std::string::npos) << r.out;
    EXPECT_FALSE(NamespacesLeft());
  }
  EXPECT_EQ(Shell(kScript + " down").code, 0);
  EXPECT_EQ(Shell(kScript + " down").code, 0);
  EXPECT_FALSE(NamespacesLeft());
  // Bad arguments are refused before anything is made.
  r = Shell(kScript + " up fast");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("not a number"), std::string::npos) << r.out;
  EXPECT_FALSE(NamespacesLeft());
}

}  // namespace
