// Whole-file I/O for kvserve's artefacts (frames, models, profiles): reads that refuse what is
// not a regular file or is larger than asked for, and writes that never leave a half-written
// output behind.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "kvserve/kv.h"
#include "kvserve/status.h"

namespace kvserve {

// Default cap on one file read: far above any model or frame kvserve ships, far below what
// `/dev/zero`-like inputs would make a reader allocate.
inline constexpr uint64_t kDefaultMaxFileBytes = uint64_t{32} << 30;

// Reads a whole regular file. Directories, FIFOs, devices and sockets are refused with the
// reason (a read from them may never end); so is a file above max_bytes.
Result<ByteBuffer> ReadFile(const std::string& path, uint64_t max_bytes = kDefaultMaxFileBytes);

// Writes `bytes` to `path` so that readers see the old file or the whole new one, never a part:
// a temp file beside it (created exclusively, never through a link), fsync, rename. A symlink
// at `path` is followed and its target replaced; a character device or FIFO (`/dev/null`,
// `/dev/stdout`) is written through, never replaced; a directory is refused. Errors name `path`.
Status WriteFileAtomic(const std::string& path, std::span<const uint8_t> bytes);

// Installs SIGINT/SIGTERM/SIGHUP handlers that remove the temp files of writes in flight and
// then end the process with that signal, so an interrupted command leaves no `.tmp.` files. For
// programs (the CLI, servers); a library caller decides its own signal handling.
void InstallTempFileCleanup();

}  // namespace kvserve
