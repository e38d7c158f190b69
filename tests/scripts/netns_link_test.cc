// scripts/netns-link.sh: builds a shaped veth link between two namespaces that carries the
// transport, and leaves no namespace or qdisc behind — after success, after a failing command,
// after `down` twice. Where namespaces cannot be made, the script's clear skip (exit 77) is checked.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
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
    // Without the privilege the script's promise is a clear skip that makes nothing.
    EXPECT_NE(r.out.find("netns-link: skipped: "), std::string::npos) << r.out;
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

// A machine that lets a namespace be made but not entered (a container whose `ip netns exec`
// cannot remount /): the probe tries what the script does, so the answer is a skip with the
// reason, not a failure halfway through building the link. `ip` is a stand-in on PATH.
TEST(NetnsLink, ProbeTriesEnteringANamespaceAndSkipsWithTheReason) {
  const std::string dir = ::testing::TempDir() + "/fake-ip-" + std::to_string(::getpid());
  ASSERT_EQ(Bash("mkdir -p " + dir).code, 0);
  const std::string shim = dir + "/ip";
  FILE* f = std::fopen(shim.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs("#!/bin/bash\n"
             "case \"$1 $2\" in\n"
             "  \"netns add\"|\"netns del\"|\"netns list\") exit 0 ;;\n"
             "  \"netns exec\") echo \"mount --make-rslave / failed: Permission denied\" >&2; exit 1 ;;\n"
             "esac\n"
             "exit 1\n",
             f);
  std::fclose(f);
  ASSERT_EQ(Bash("chmod +x " + shim).code, 0);
  CliRun r = Bash("PATH=" + dir + ":$PATH " + kScript + " run 1 -- true");
  EXPECT_EQ(r.code, 77) << r.out;
  EXPECT_NE(r.out.find("netns-link: skipped: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("mount --make-rslave"), std::string::npos) << r.out;
  Bash("rm -rf " + dir);
}

}  // namespace
