// ReadFile and WriteFileAtomic: regular files only in, nothing half-written out, devices written
// through, links followed, temp names never reused or followed, errors naming the path.
#include "kvserve/file.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

namespace kvserve {
namespace {

namespace fs = std::filesystem;

class Files : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/kvserve_file_test_" + std::to_string(::getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  static std::span<const uint8_t> Bytes(const std::string& s) {
    return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
  }
  static std::string Text(const ByteBuffer& b) { return std::string(b.begin(), b.end()); }
  std::vector<std::string> Leftovers() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_)) {
      if (e.path().filename().string().find(".tmp.") != std::string::npos) out.push_back(e.path());
    }
    return out;
  }
  std::string dir_;
};

TEST_F(Files, WritesAndReadsBack) {
  ASSERT_TRUE(WriteFileAtomic(Path("a"), Bytes("hello")).ok());
  EXPECT_EQ(Text(ReadFile(Path("a")).value()), "hello");
  ASSERT_TRUE(WriteFileAtomic(Path("a"), Bytes("")).ok());
  EXPECT_EQ(ReadFile(Path("a"))->size(), 0u);
  EXPECT_TRUE(Leftovers().empty());
}

TEST_F(Files, RefusesWhatIsNotARegularFile) {
  Result<ByteBuffer> r = ReadFile(dir_);
  EXPECT_NE(r.status().message().find("is a directory"), std::string::npos) << r.status().ToString();
  r = ReadFile("/dev/zero");
  EXPECT_NE(r.status().message().find("a character device"), std::string::npos) << r.status().ToString();
  ASSERT_EQ(::mkfifo(Path("fifo").c_str(), 0600), 0);
  r = ReadFile(Path("fifo"));  // would block forever waiting for a writer if opened plainly
  EXPECT_NE(r.status().message().find("a FIFO"), std::string::npos) << r.status().ToString();
  r = ReadFile(Path("missing"));
  EXPECT_EQ(r.status().code(), StatusCode::kIoError);
  EXPECT_NE(r.status().message().find("No such file"), std::string::npos);
  ASSERT_TRUE(WriteFileAtomic(Path("big"), Bytes("0123456789")).ok());
  r = ReadFile(Path("big"), 9);
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfRange) << r.status().ToString();
  EXPECT_EQ(WriteFileAtomic(dir_, Bytes("x")).code(), StatusCode::kInvalidArgument);
}

TEST_F(Files, DevicesAreWrittenThroughNotReplaced) {
  struct stat before, after;
  ASSERT_EQ(::stat("/dev/null", &before), 0);
  ASSERT_TRUE(WriteFileAtomic("/dev/null", Bytes("discarded")).ok());
  ASSERT_EQ(::stat("/dev/null", &after), 0);
  EXPECT_TRUE(S_ISCHR(after.st_mode));
  EXPECT_EQ(before.st_rdev, after.st_rdev);
  // A FIFO with a reader gets the bytes; one without a reader is an error, not a hang.
  ASSERT_EQ(::mkfifo(Path("fifo").c_str(), 0600), 0);
  Status st = WriteFileAtomic(Path("fifo"), Bytes("x"));
  EXPECT_NE(st.message().find("no reader"), std::string::npos) << st.ToString();
  std::string got;
  std::thread reader([&] {
    std::ifstream f(Path("fifo"));
    std::getline(f, got);
  });
  for (int i = 0; i < 200; ++i) {
    st = WriteFileAtomic(Path("fifo"), Bytes("through\n"));
    if (st.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  reader.join();
  EXPECT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(got, "through");
  EXPECT_TRUE(fs::is_fifo(Path("fifo")));
}

TEST_F(Files, LinksAreFollowedAndTempNamesNeverWrittenThrough) {
  ASSERT_TRUE(WriteFileAtomic(Path("target"), Bytes("old")).ok());
  fs::create_symlink(Path("target"), Path("link"));
  ASSERT_TRUE(WriteFileAtomic(Path("link"), Bytes("new")).ok());
  EXPECT_TRUE(fs::is_symlink(Path("link")));
  EXPECT_EQ(Text(ReadFile(Path("target")).value()), "new");
  // A link planted at every temp name this process could pick next points at a victim file:
  // the write picks another name (O_EXCL | O_NOFOLLOW) and the victim is untouched.
  ASSERT_TRUE(WriteFileAtomic(Path("victim"), Bytes("safe")).ok());
  for (int i = 0; i < 64; ++i) {
    fs::create_symlink(Path("victim"), Path("out.tmp." + std::to_string(::getpid()) + "." + std::to_string(i)));
  }
  Status st = WriteFileAtomic(Path("out"), Bytes("data"));
  EXPECT_EQ(Text(ReadFile(Path("victim")).value()), "safe");
  if (st.ok()) {
    EXPECT_EQ(Text(ReadFile(Path("out")).value()), "data");
  }
}

TEST_F(Files, ConcurrentWritersLeaveOneWholeFile) {
  std::vector<std::string> payloads;
  for (int w = 0; w < 8; ++w) payloads.push_back(std::string(100000 + w, char('a' + w)));
  std::vector<std::thread> writers;
  std::vector<Status> results(8);
  for (int w = 0; w < 8; ++w) {
    writers.emplace_back([&, w] { results[w] = WriteFileAtomic(Path("shared"), Bytes(payloads[w])); });
  }
  for (auto& t : writers) t.join();
  for (const Status& s : results) EXPECT_TRUE(s.ok()) << s.ToString();
  const std::string got = Text(ReadFile(Path("shared")).value());
  bool whole = false;
  for (const std::string& p : payloads) whole = whole || got == p;
  EXPECT_TRUE(whole) << "a torn file of " << got.size() << " bytes";
  EXPECT_TRUE(Leftovers().empty());
}

TEST_F(Files, FailuresNameTheOutputAndLeaveNothing) {
  Status st = WriteFileAtomic(Path("no/such/dir/out"), Bytes("x"));
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_NE(st.message().find(Path("no/such/dir/out")), std::string::npos) << st.ToString();
  EXPECT_EQ(st.message().find(".tmp."), std::string::npos) << st.ToString();
  if (::geteuid() != 0) {  // root writes anywhere
    fs::create_directories(Path("ro"));
    fs::permissions(Path("ro"), fs::perms::owner_read | fs::perms::owner_exec);
    st = WriteFileAtomic(Path("ro/out"), Bytes("x"));
    EXPECT_EQ(st.code(), StatusCode::kIoError);
    fs::permissions(Path("ro"), fs::perms::owner_all);
  }
  EXPECT_TRUE(Leftovers().empty());
}

}  // namespace
}  // namespace kvserve
