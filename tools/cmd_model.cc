// CLI: model commands (generate, kv capture, eval, model heads).
#include "cli.h"

namespace kvserve::cli {
void AddModelCommands(CLI::App& app) {}
}  // namespace kvserve::cli
