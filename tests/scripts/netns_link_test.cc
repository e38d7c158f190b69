// scripts/netns-link.sh: builds a shaped veth link between two namespaces that carries the
// transport, and leaves no namespace or qdisc behind — after success, after a failing command,
// after `down` twice. Where namespaces cannot be made, the script's clear skip (exit 77) is checked.
#include <gtest/gtest.h>

#include <string>

#include "test_paths.h"
#include "tools/cli_test_util.h"

namespace {

using kvserve::testing::CliRun;

// `cmd` under bash, bounded to two minutes.
CliRun Bash(const std::string& cmd) {
  return kvserve::testing::Shell("timeout -s KILL 120 bash -c '" + cmd + "' 2>&1");
}

const std::string kPrefix = "kvt" + std::to_string(::getpid() % 10000);
const std::string kScript = "KVSERVE_NETNS_PREFIX=" + kPrefix + " bash " + kvserve::SourceDir() + "/scripts/netns-link.sh";

bool NamespacesLeft() { return Bash("ip netns list").out.find(kPrefix + "-") != std::string::npos; }

TEST(NetnsLink, CarriesTheTransportAndCleansUpEvenOnFailure) {
  CliRun r = Bash(kScript + " down");
  if (r.code == 77) {
    // Without CAP_NET_ADMIN the script's promise is a clear skip that makes nothing.
    EXPECT_NE(r.out.find("needs CAP_NET_ADMIN"), std::string::npos) << r.out;
    EXPECT_FALSE(NamespacesLeft());
    return;
  }
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string cli = KVSERVE_CLI;
  const std::string a = kPrefix + "-a", b = kPrefix + "-b";
  r = Bash(kScript + " run 2 -- bash -c \"ip netns exec " + b + " " + cli +
            " bench link --listen 10.77.0.2:7100 & sleep 0.5; ip netns exec " + a + " " + cli +
            " bench link --connect 10.77.0.2:7100 --mib 16 --json; wait\"");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("\"gbps\""), std::string::npos) << r.out;
  EXPECT_FALSE(NamespacesLeft());
  // The command fails: the link is still torn down, and the failure is passed on.
  r = Bash(kScript + " run 1 -- false");
  EXPECT_NE(r.code, 0);
  EXPECT_FALSE(NamespacesLeft());
  // up, then down twice: the second down is a no-op.
  ASSERT_EQ(Bash(kScript + " up 1").code, 0);
  EXPECT_TRUE(NamespacesLeft());
  EXPECT_NE(Bash("tc -n " + a + " qdisc show").out.find("tbf"), std::string::npos);
  EXPECT_EQ(Bash(kScript + " down").code, 0);
  // Delay needs netem; a kernel without it gets a clear skip (77) and no half-built link.
  r = Bash(kScript + " up 1 5 1");
  if (r.code == 0) {
    EXPECT_NE(Bash("tc -n " + a + " qdisc show").out.find("netem"), std::string::npos);
  } else {
    EXPECT_EQ(r.code, 77) << r.out;
    EXPECT_NE(r.out.find("netem"), std::string::npos) << r.out;
    EXPECT_FALSE(NamespacesLeft());
  }
  EXPECT_EQ(Bash(kScript + " down").code, 0);
  EXPECT_EQ(Bash(kScript + " down").code, 0);
  EXPECT_FALSE(NamespacesLeft());
  // Bad arguments are refused before anything is made.
  r = Bash(kScript + " up fast");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("not a number"), std::string::npos) << r.out;
  EXPECT_FALSE(NamespacesLeft());
}

}  // namespace
