// Shared by the tests: where the source tree's data lives. Tests, like the CLI, pass folders to
// the library explicitly.
#pragma once

#include <string>

namespace kvserve {

inline std::string SourceDir() { return KVSERVE_SOURCE_DIR; }
inline std::string ModelsDir() { return SourceDir() + "/models"; }

}  // namespace kvserve
