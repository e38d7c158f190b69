// Tokenizer for llama2.c-format vocabularies (SentencePiece BPE with scores): encode by greedy
// best-score merges, decode with byte-fallback tokens.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <queue>

#include "kvserve/file.h"
#include "kvserve/model.h"

namespace kvserve {

Result<Tokenizer> Tokenizer::LoadLlama2c(const std::string& path, uint32_t vocab_size) {
  KV_ASSIGN_OR_RETURN(ByteBuffer data, ReadFile(path));
  size_t off = 0;
  auto need = [&](size_t n, const std::string& what) -> Status {
    if (data.size() - off < n) {
      return Status::Corrupt("tokenizer '" + path + "' is truncated at byte " + std::to_string(off) + " (" + what + ")");
    }
    return Status::Ok();
  };
  KV_RETURN_IF_ERROR(need(4, "max_token_length"));
  off += 4;
  std::vector<std::string> pieces;
  std::vector<float> scores;
  for (uint32_t i = 0; i < vocab_size; ++i) {
    KV_RETURN_IF_ERROR(need(8, "token " + std::to_string(i)));
    float score;
    int32_t len;
    std::memcpy(&score, data.data() + off, 4);
    std::memcpy(&len, data.data() + off + 4, 4);
    off += 8;
    if (len < 0 || len > 1024) {
      return Status::Corrupt("tokenizer '" + path + "' token " + std::to_string(i) + " has length " + std::to_string(len));
    }
    KV_RETURN_IF_ERROR(need(size_t(len), "token " + std::to_string(i)));
    pieces.emplace_back(reinterpret_cast<const char*>(data.data() + off), size_t(len));
    scores.push_back(score);
    off += size_t(len);
  }
  if (off != data.size()) {
    return Status::Corrupt("tokenizer '" + path + "' has " + std::to_string(data.size() - off) +
                           " bytes after its " + std::to_string(vocab_size) + " tokens: it belongs to another model");
  }
  return FromVocab(std::move(pieces), std::move(scores));
}

Tokenizer Tokenizer::FromVocab(std::vector<std::string> pieces, std::vector<float> scores) {
  Tokenizer t;
  t.pieces_ = std::move(pieces);
  t.scores_ = std::move(scores);
  t.Index();
  return t;
}

void Tokenizer::Index() {
  sorted_.resize(pieces_.size());
  for (size_t i = 0; i < sorted_.size(); ++i) sorted_[i] = int(i);
  std::stable_sort(sorted_.begin(), sorted_.end(), [&](int a, int b) { return pieces_[a] < pieces_[b]; });
  byte_fallback_ = Lookup("<0x41>") >= 0;
}

int Tokenizer::Lookup(std::string_view s) const {
  auto it = std::lower_bound(sorted_.begin(), sorted_.end(), s,
                             [&](int id, std::string_view key) { return std::string_view(pieces_[id]) < key; });
  if (it != sorted_.end() && pieces_[*it] == s) return *it;
  return -1;
}

std::vector<int> Tokenizer::Encode(std::string_view text, bool bos) const {
  std::vector<int> ids;
  if (bos) ids.push_back(kBos);
  if (!text.empty()) {
    const int space = Lookup(" ");
    if (space >= 0) ids.push_back(space);  // SentencePiece's dummy prefix
  }
  for (size_t i = 0; i < text.size();) {
    // One UTF-8 code point (at most 4 bytes; continuation bytes are 10xxxxxx).
    size_t len = 1;
    while (i + len < text.size() && len < 4 && (static_cast<unsigned char>(text[i + len]) & 0xC0) == 0x80) ++len;
    const int id = Lookup(text.substr(i, len));
    if (id >= 0) {
      ids.push_back(id);
    } else {
      for (size_t b = 0; b < len; ++b) {
        char hex[8];
        std::snprintf(hex, sizeof hex, "<0x%02X>", static_cast<unsigned char>(text[i + b]));
        const int bid = byte_fallback_ ? Lookup(hex) : -1;
        ids.push_back(bid >= 0 ? bid : kUnk);
      }
    }
    i += len;
  }
  // Merges, best score first (the leftmost pair among equals), as the quadratic loop "rescan
  // every pair, merge the best" would do — over a linked list of symbols and a heap of candidate
  // pairs, so a long text costs O(n log n) instead of O(n^2). A heap entry whose symbols changed
  // since it was pushed is stale and skipped.
  const size_t first = bos ? 1 : 0;
  const size_t n = ids.size();
  if (n < first + 2) return ids;
  std::vector<size_t> prev(n), next(n);
  std::vector<uint32_t> version(n, 0);
  std::vector<bool> alive(n, true);
  for (size_t i = 0; i < n; ++i) prev[i] = i - 1, next[i] = i + 1;  // i - 1 wraps for i = 0: never followed
  struct Pair {
    float score;
    size_t left, right;
    uint32_t left_version, right_version;
    int id;
  };
  // std::priority_queue pops the largest: higher score first, then the smaller (leftmost) position.
  auto worse = [](const Pair& a, const Pair& b) { return a.score != b.score ? a.score < b.score : a.left > b.left; };
  std::priority_queue<Pair, std::vector<Pair>, decltype(worse)> heap(worse);
  std::string merged;
  auto consider = [&](size_t l, size_t r) {
    merged.assign(pieces_[ids[l]]);
    merged += pieces_[ids[r]];
    const int id = Lookup(merged);
    if (id >= 0 && scores_[id] > -1e30f) heap.push({scores_[id], l, r, version[l], version[r], id});
  };
  for (size_t i = first; i + 1 < n; ++i) consider(i, i + 1);
  while (!heap.empty()) {
    const Pair p = heap.top();
    heap.pop();
    if (!alive[p.left] || !alive[p.right] || version[p.left] != p.left_version || version[p.right] != p.right_version ||
        next[p.left] != p.right) {
      continue;
    }
    ids[p.left] = p.id;
    version[p.left]++;
    alive[p.right] = false;
    next[p.left] = next[p.right];
    if (next[p.left] < n) prev[next[p.left]] = p.left;
    if (p.left > first) consider(prev[p.left], p.left);
    if (next[p.left] < n) consider(p.left, next[p.left]);
  }
  std::vector<int> out;
  out.reserve(n);
  for (size_t i = 0; i < first; ++i) out.push_back(ids[i]);
  for (size_t i = first; i < n; i = next[i]) out.push_back(ids[i]);
  return out;
}

size_t Tokenizer::max_piece_bytes() const {
  size_t m = 1;
  for (const std::string& p : pieces_) m = std::max(m, p.size());
  return m;
}

std::string Tokenizer::Decode(int prev, int id) const {
  if (id < 0 || size_t(id) >= pieces_.size()) return "";
  if (id == kBos || id == kEos) return "\n";
  std::string_view p = pieces_[id];
  if (prev == kBos && !p.empty() && p[0] == ' ') p.remove_prefix(1);
  unsigned byte;
  if (p.size() == 6 && std::sscanf(std::string(p).c_str(), "<0x%02X>", &byte) == 1) return std::string(1, char(byte));
  return std::string(p);
}

std::string Tokenizer::DecodeAll(const std::vector<int>& ids) const {
  std::string s;
  int prev = kBos;
  for (int id : ids) {
    s += Decode(prev, id);
    prev = id;
  }
  return s;
}

}  // namespace kvserve
