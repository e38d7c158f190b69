// Whole-file reads that refuse non-regular and oversized inputs, and atomic writes (exclusive
// temp file, fsync, rename) that write through devices and leave nothing behind on failure.
#include "kvserve/file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace kvserve {
namespace {

std::string Errno() { return std::strerror(errno); }

const char* FileKind(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}

// Temp files of writes in flight, for the signal handler: fixed slots of fixed-size paths, so
// the handler touches no allocator and no lock.
constexpr int kTempSlots = 64;
constexpr size_t kTempPathMax = 4096;
char g_temp_paths[kTempSlots][kTempPathMax];
std::atomic<bool> g_temp_used[kTempSlots];

int ClaimTempSlot(const std::string& path) {
  if (path.size() >= kTempPathMax) return -1;
  for (int i = 0; i < kTempSlots; ++i) {
    bool expected = false;
    if (g_temp_used[i].compare_exchange_strong(expected, true)) {
      std::memcpy(g_temp_paths[i], path.c_str(), path.size() + 1);
      return i;
    }
  }
  return -1;  // more writes in flight than slots: that temp file is not cleaned on a signal
}
void ReleaseTempSlot(int slot) {
  if (slot >= 0) g_temp_used[slot].store(false);
}

void CleanupAndReraise(int sig) {
  for (int i = 0; i < kTempSlots; ++i) {
    if (g_temp_used[i].load()) ::unlink(g_temp_paths[i]);
  }
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

Status WriteAll(int fd, std::span<const uint8_t> bytes, const std::string& path) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      return Status::IoError("writing '" + path + "': " + Errno());
    }
    done += static_cast<size_t>(w);
  }
  return Status::Ok();
}

// Devices and FIFOs are written in place: replacing `/dev/null` by a regular file would break
// every other program on the machine.
Status WriteThrough(const std::string& path, std::span<const uint8_t> bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    return Status::IoError("cannot open '" + path + "' for writing: " +
                           (errno == ENXIO ? std::string("a FIFO with no reader") : Errno()));
  }
  // Blocking writes from here on (a FIFO's reader may be slower than us).
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  Status st = WriteAll(fd, bytes, path);
  if (::close(fd) != 0 && st.ok()) st = Status::IoError("closing '" + path + "': " + Errno());
  return st;
}

}  // namespace

Result<ByteBuffer> ReadFile(const std::string& path, uint64_t max_bytes) {
  // O_NONBLOCK so that opening a FIFO does not wait for a writer before we can refuse it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return Status::IoError("cannot open '" + path + "': " + Errno());
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const std::string why = Errno();
    ::close(fd);
    return Status::IoError("cannot stat '" + path + "': " + why);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::InvalidArgument("'" + path + "' is " + FileKind(st.st_mode) + ", not a regular file");
  }
  if (uint64_t(st.st_size) > max_bytes) {
    ::close(fd);
    return Status::OutOfRange("'" + path + "' is " + std::to_string(st.st_size) + " bytes, above the limit of " +
                              std::to_string(max_bytes));
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  ByteBuffer data;
  data.resize(size_t(st.st_size));
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t r = ::read(fd, data.data() + done, data.size() - done);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      const std::string why = Errno();
      ::close(fd);
      return Status::IoError("error reading '" + path + "': " + why);
    }
    if (r == 0) break;  // shrank while we read: keep what is there
    done += size_t(r);
  }
  ::close(fd);
  data.resize(done);
  return data;
}

Status WriteFileAtomic(const std::string& path_in, std::span<const uint8_t> bytes) {
  std::string path = path_in;
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0) {
    if (S_ISLNK(st.st_mode)) {
      // Follow the link: its target is what the user named; replacing the link itself would
      // silently detach it.
      char resolved[PATH_MAX];
      if (::realpath(path.c_str(), resolved) == nullptr) {
        return Status::IoError("cannot resolve the link '" + path_in + "': " + Errno());
      }
      path = resolved;
      if (::lstat(path.c_str(), &st) != 0) st.st_mode = S_IFREG;
    }
    if (S_ISDIR(st.st_mode)) return Status::InvalidArgument("cannot write '" + path_in + "': it is a directory");
    if (S_ISCHR(st.st_mode) || S_ISFIFO(st.st_mode)) return WriteThrough(path, bytes);
    if (!S_ISREG(st.st_mode)) return Status::InvalidArgument("cannot write '" + path_in + "': it is " + FileKind(st.st_mode));
  }
  static std::atomic<uint64_t> counter{0};
  auto temp_name = [&] { return path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1)); };
  // Preferably an unnamed file in the target's folder (O_TMPFILE), named only just before the
  // rename: a process killed while writing (SIGKILL cannot be caught) leaves nothing behind.
  const std::string folder = [&] {
    const size_t slash = path.rfind('/');
    return slash == std::string::npos ? std::string(".") : slash == 0 ? std::string("/") : path.substr(0, slash);
  }();
  int fd = ::open(folder.c_str(), O_WRONLY | O_TMPFILE | O_CLOEXEC, 0644);
  const bool unnamed = fd >= 0;
  std::string tmp;
  for (int attempt = 0; attempt < 16 && fd < 0; ++attempt) {
    tmp = temp_name();
    // O_EXCL | O_NOFOLLOW: a file or link planted at the temp name is never written through.
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) return Status::IoError("cannot create a temp file beside '" + path_in + "': " + Errno());
  int slot = unnamed ? -1 : ClaimTempSlot(tmp);
  auto fail = [&](Status s) {
    if (!tmp.empty()) ::unlink(tmp.c_str());
    ReleaseTempSlot(slot);
    return s;
  };
  if (Status s = WriteAll(fd, bytes, path_in); !s.ok()) {
    ::close(fd);
    return fail(s);
  }
  const bool synced = ::fsync(fd) == 0;
  const std::string sync_why = synced ? "" : Errno();
  if (synced && unnamed) {
    // Give the unnamed file a fresh name (linkat never replaces), then rename it over the target.
    const std::string proc = "/proc/self/fd/" + std::to_string(fd);
    for (int attempt = 0; attempt < 16; ++attempt) {
      tmp = temp_name();
      if (::linkat(AT_FDCWD, proc.c_str(), AT_FDCWD, tmp.c_str(), AT_SYMLINK_FOLLOW) == 0) break;
      const int e = errno;
      tmp.clear();
      if (e != EEXIST) break;
    }
    if (tmp.empty()) {
      const std::string why = Errno();
      ::close(fd);
      return fail(Status::IoError("writing '" + path_in + "': cannot name the temp file: " + why));
    }
    slot = ClaimTempSlot(tmp);
  }
  // The descriptor is closed whatever fsync said; either failure fails the write.
  const bool closed = ::close(fd) == 0;
  if (!synced) return fail(Status::IoError("flushing '" + path_in + "': " + sync_why));
  if (!closed) return fail(Status::IoError("closing '" + path_in + "': " + Errno()));
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return fail(Status::IoError("writing '" + path_in + "': rename failed: " + Errno()));
  }
  ReleaseTempSlot(slot);
  return Status::Ok();
}

void InstallTempFileCleanup() {
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = CleanupAndReraise;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &sa, nullptr);
}

}  // namespace kvserve
