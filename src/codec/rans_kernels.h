// rANS kernels for the `rans` stage: 32 interleaved states with 16-bit renormalisation, laid out
// so AVX-512 codes 16 states per vector while the scalar reference reads and writes the same stream.
#pragma once

#include <cstdint>
#include <vector>

namespace kvserve::rans {

constexpr int kLanes = 32;
constexpr uint32_t kProbBits = 12;
constexpr uint32_t kProbScale = 1u << kProbBits;
// States live in [kLow, 2^31): below 2^31 the encoder's reciprocal division is exact, and one
// 16-bit word always brings a decoded state back above kLow (12-bit probabilities).
constexpr uint32_t kLow = 1u << 15;

// A run of symbols (a multiple of kLanes long): symbol j is decoded by state j % kLanes with the
// table of channel j % n_channel, which starts at entries + (j % n_channel) * table_stride
// (stride 0: one table for every channel) and has 1 << bits entries, each start | freq << 16.
struct Run {
  const uint32_t* entries = nullptr;
  uint32_t table_stride = 0;
  uint32_t n_channel = 1;
  int bits = 8;
};

// After each group of kLanes symbols, the states below kLow read one little-endian word each,
// in lane order.
struct DecoderState {
  uint32_t x[kLanes];
  const uint8_t* ptr = nullptr;
  const uint8_t* end = nullptr;
};

// Decodes symbols [begin, n) of a run into out[begin, n); false if the stream ends early.
bool DecodeRunScalar(DecoderState& st, const Run& run, uint32_t begin, uint32_t n, uint8_t* out);

// For runs of small alphabets (bits <= 4) whose channels line up with 16-lane vectors (n_channel
// divides 16 or is a multiple of it, or one table for all): the tables rearranged so that one
// vector load gives symbol s's entry for 16 lanes, packed start << 20 | freq << 7 | s. The
// decoder then finds each lane's symbol with 2^bits compares instead of dependent gathers.
// Empty when the run does not qualify.
std::vector<uint32_t> LaneTables(const Run& run);

// For larger alphabets: each table's slot entries (kProbScale per table), everything a state
// needs from its slot in one word: (freq - 1) << 20 | (slot - start) << 8 | s. The decoder then
// needs one gather per vector instead of a `bits`-step search or a symbol gather followed by an
// entry gather. Worth building only when the run is long next to the tables (the caller decides).
std::vector<uint32_t> SlotTables(const Run& run);

// Bucket tables for runs with one table for all channels (stride 0, or a single channel) and
// alphabets up to 2^7: the 4096 slots cut into kBuckets buckets of 128. Per bucket, the entry
// (packed start << 20 | freq << 7 | s) of the symbol holding the bucket's first slot, then
// kBounds rows of the entries of the symbols that start inside the bucket, in symbol order
// (all ones where a bucket has fewer): a state's symbol is then one permute plus a permute and a
// compare per row, with no loads. Laid out [1 + kBounds][kBuckets], kBounds = size / kBuckets - 1.
// Empty when the run does not qualify or some bucket holds more than kMaxBounds starts (a
// table with many rare symbols), which DecodeRun's compare scan handles instead.
constexpr uint32_t kBuckets = 32;
constexpr uint32_t kMaxBounds = 7;
std::vector<uint32_t> BucketTables(const Run& run);

// Two streams' runs decoded in one loop (AVX-512), n symbols (a multiple of kLanes) from each,
// with their bucket tables: one stream's chain from state to symbol to the next state is
// latency-bound, and the other stream's work fills its gaps (twice the symbols per second of two
// DecodeRun calls on the synthetic llama3-8b payload, docs/results/codec_speed.md). Stops early
// where either stream has less than 2 * kLanes bytes left. Returns the symbols decoded from each
// (a multiple of kLanes; 0 without AVX-512); the caller decodes the rest of each run with DecodeRun.
uint32_t DecodeRunPair(DecoderState& a, const std::vector<uint32_t>& buckets_a, uint8_t* out_a, DecoderState& b,
                       const std::vector<uint32_t>& buckets_b, uint8_t* out_b, uint32_t n);

// The same for two runs of 16-symbol alphabets with lane tables (LaneTables; a table per channel
// allowed): each vector's binary search (4 dependent compares) is latency-bound, and the other
// stream's vectors fill its gaps. Decodes whole stretches of lcm(kLanes, both runs' channel
// counts) symbols, so each run stops at channel 0, where DecodeRun resumes it; stops early where
// either stream has less than a stretch's bytes left. Returns the symbols decoded from each (0
// without AVX-512 or where the runs do not qualify).
uint32_t DecodeRunPairLanes(DecoderState& a, const Run& run_a, const std::vector<uint32_t>& lanes_a, uint8_t* out_a,
                            DecoderState& b, const Run& run_b, const std::vector<uint32_t>& lanes_b, uint8_t* out_b,
                            uint32_t n);

// The same decode with the widest SIMD the CPU has (kvserve/cpu.h) (AVX-512: compares over `lane_tables`
// where given, else slot lookups in `slot_tables` where given, else a binary search by
// gathers), falling back to the scalar loop for the last groups near the end of the stream.
bool DecodeRun(DecoderState& st, const Run& run, const std::vector<uint32_t>& lane_tables,
               const std::vector<uint32_t>& slot_tables, uint32_t n, uint8_t* out);
bool HaveSimdDecoder();
// Whether the encoder runs its AVX-512 loop (the CPU has AVX-512 F/BW/VL/DQ/CD and no cap says otherwise).
bool HaveSimdEncoder();

// Encoder side of a run: the same tables (entries start | freq << 16) plus, per entry, the
// reciprocal that replaces the division by freq (x / f == (x * rcp) >> 32 >> shift for every
// x < 2^31, shift = ceil(log2 f) - 1; for f = 1, rcp = 2^32 - 1 and shift 0 with start + scale - 1
// as the bias make the same formula exact). See EncodeReciprocal.
uint32_t EncodeReciprocal(uint32_t freq);

struct EncoderState {
  uint32_t x[kLanes];
  uint8_t* ptr = nullptr;  // the stream grows downwards from here; at least 2 bytes per symbol + 2 of room below
};

// Encodes a run's symbols (a multiple of kLanes) backwards — the last group first, lanes from
// 31 down — so that DecodeRun reads them forwards. `rcp` is laid out like `run.entries`.
void EncodeRunScalar(EncoderState& st, const Run& run, const uint32_t* rcp, uint32_t n, const uint8_t* sym);
// For the runs LaneTables takes with a table per channel (bits <= 4, channels aligned with
// 16-lane vectors): per block of 16 lanes, the entries then the reciprocals laid out
// [symbol][lane], so the encoder picks each lane's pair with permutes instead of gathers. Empty
// when the run does not qualify, and for one shared table, which the encoder holds in registers
// (two permutes per vector). Build once per set of tables: runs of one context share them.
std::vector<uint32_t> EncodeLaneTables(const Run& run, const uint32_t* rcp);
// The same stream with AVX-512 where the CPU has it (16 lanes per vector, compress-stored words;
// lookups in `lane_tables` where given, else gathers).
void EncodeRun(EncoderState& st, const Run& run, const uint32_t* rcp, const std::vector<uint32_t>& lane_tables,
               uint32_t n, const uint8_t* sym);

// Per-channel symbol counts of one code context (cnt[ch * 2^bits + s]) and, where cnt_pred is
// given, those of its predicted symbols (each code minus the same channel's code one row
// earlier, mod 2^bits; a section's first row unchanged), section by section in one pass and
// without writing the predicted symbols. Alphabets up to 16 count in byte accumulators laid out
// [value][channel], one compare per value and row, which vectorise over channels; they are
// widened before they can wrap and added to the counts when the counter goes, once per context,
// since a context's sections are short (one quantisation block each). With AVX-512 and rows of a
// multiple of 64 channels, a section's rows count into accumulators held in registers and
// stored once (the vectorised compares over memory cost a load and a store per value). Larger alphabets
// increment the counters directly. Null cnt or cnt_pred: that variant is not counted.
class ContextCounter {
 public:
  ContextCounter(uint32_t n_channel, int bits, uint64_t* cnt, uint64_t* cnt_pred);
  ContextCounter(const ContextCounter&) = delete;
  ContextCounter& operator=(const ContextCounter&) = delete;
  ~ContextCounter();  // adds what the byte accumulators hold
  // One section's n symbols: rows of n_channel, then a partial row.
  void Add(const uint8_t* sym, uint32_t n);

 private:
  void AddRow(uint8_t* to, const uint8_t* row) const;
  void CountTail(const uint8_t* sym, uint32_t n, uint32_t rows);  // a partial last row
  void Widen();

  const uint32_t C_, A_;
  const uint8_t mask_;
  uint64_t* const cnt_;
  uint64_t* const cnt_pred_;
  const bool bytes_;
  uint32_t pending_ = 0;  // rows in the byte accumulators
  std::vector<uint8_t> acc_, diff_;
  std::vector<uint32_t> wide_;
};
// The plain reference: one section's counts by direct increments, predicting in a copy.
void CountSectionReference(const uint8_t* sym, uint32_t n, uint32_t n_channel, int bits, uint64_t* cnt,
                           uint64_t* cnt_pred);

}  // namespace kvserve::rans
