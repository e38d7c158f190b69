// What a server process does with the serving core, with no environment at all: it creates its
// resources (pool, calibration store), a pipeline, encodes a request layer by layer and assembles
// it into its own cache. And no library file may read the environment behind its back.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include "kvserve/calib.h"
#include "kvserve/codec.h"
#include "kvserve/synth.h"
#include "kvserve/thread_pool.h"
#include "test_paths.h"

namespace kvserve {
namespace {

namespace fs = std::filesystem;

// Runs in a forked child with an empty environment; exits 0 on success.
int ServeOneRequestWithoutEnvironment(const std::string& calib_dir) {
  ::clearenv();
  ThreadPool pool(2);
  CalibrationStore store(calib_dir);
  const CodecEnv env{&store};
  KvBlock kv = SynthesizeKv(KvShape{4, 2, 48, 16}, {.seed = 3, .pool = &pool}).value();
  LowRankBasis basis = FitLowRankBasis({&kv}).value();
  if (!SaveLowRankBasis(basis, calib_dir).ok()) return 1;
  // A whole-request strategy that needs calibration data, and a streamed one.
  auto lowrank = Pipeline::Create("lowrank(rank=8,basis=" + std::to_string(basis.id) + ")|quant|rans", env);
  if (!lowrank.ok()) return 2;
  ByteBuffer frame;
  CodecOptions o{.pool = &pool, .request_id = 11};
  if (!lowrank->Encode(kv, &frame, o).ok()) return 3;
  KvBlock back;
  if (!DecodeKv(frame, &back, o, env).ok()) return 4;
  auto streamed = Pipeline::Create("quant(kbits=4,vbits=4)|rans", env);
  if (!streamed.ok()) return 5;
  KvBlock cache = KvBlock::Create(kv.shape(), DType::kF16).value();
  LayerAssembler assembler(11, &cache, env);
  for (uint32_t l = 0; l < kv.shape().n_layer; ++l) {
    if (!streamed->EncodeLayers(kv, l, 1, &frame, o).ok()) return 6;
    if (!assembler.Add(frame, o).ok()) return 7;
  }
  return assembler.complete() ? 0 : 8;
}

TEST(ServerStyleDeathTest, PipelineNeedsNoEnvironment) {
  const std::string dir = ::testing::TempDir() + "/kvserve_server_style_" + std::to_string(::getpid());
  fs::remove_all(dir);
  EXPECT_EXIT(std::exit(ServeOneRequestWithoutEnvironment(dir)), ::testing::ExitedWithCode(0), "");
  fs::remove_all(dir);
}

TEST(ServerStyle, LibraryCodeReadsNoEnvironment) {
  const std::regex forbidden(R"(\b(secure_)?getenv\s*\(|KVSERVE_SOURCE_DIR|\benviron\b)");
  int files = 0;
  for (const char* root : {"src", "include"}) {
    for (const auto& e : fs::recursive_directory_iterator(SourceDir() + "/" + root)) {
      if (!e.is_regular_file()) continue;
      std::ifstream f(e.path());
      std::string line;
      for (int n = 1; std::getline(f, line); ++n) {
        EXPECT_FALSE(std::regex_search(line, forbidden)) << e.path().string() << ":" << n << ": " << line;
      }
      ++files;
    }
  }
  EXPECT_GT(files, 50);
}

}  // namespace
}  // namespace kvserve
