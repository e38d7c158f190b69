// ParseJsonText: a SAX pass that checks nesting and locates syntax errors, then the DOM parse.
#include "profile/json_text.h"

namespace kvserve {
namespace {

using json = nlohmann::json;

// Counts nesting and records the first error; builds nothing.
struct CheckingSax : nlohmann::json_sax<json> {
  int depth = 0, max_depth = 0;
  bool too_deep = false;
  size_t error_at = 0;
  std::string error;

  bool Open() {
    if (++depth > max_depth) {
      too_deep = true;
      return false;
    }
    return true;
  }
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return Open(); }
  bool key(string_t&) override { return true; }
  bool end_object() override { return --depth, true; }
  bool start_array(std::size_t) override { return Open(); }
  bool end_array() override { return --depth, true; }
  bool parse_error(std::size_t position, const std::string&, const nlohmann::detail::exception& ex) override {
    error_at = position;
    error = ex.what();
    return false;
  }
};

}  // namespace

Result<nlohmann::json> ParseJsonText(std::string_view text, std::string_view origin, int max_depth) {
  CheckingSax sax;
  sax.max_depth = max_depth;
  const bool ok = json::sax_parse(text, &sax, json::input_format_t::json, /*strict=*/true, /*ignore_comments=*/false);
  if (sax.too_deep) {
    return Status::InvalidArgument(std::string(origin) + ": JSON nested deeper than " + std::to_string(max_depth) +
                                   " levels");
  }
  if (!ok) {
    // nlohmann's message already says "syntax error while parsing ... at line L, column C".
    std::string why = sax.error;
    if (const size_t at = why.find("] "); at != std::string::npos && why.rfind("[json.exception", 0) == 0) why = why.substr(at + 2);
    return Status::InvalidArgument(std::string(origin) + ": not valid JSON (byte " + std::to_string(sax.error_at) +
                                   "): " + why);
  }
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::InvalidArgument(std::string(origin) + ": not valid JSON");
  return j;
}

}  // namespace kvserve
