// Hot loops of uniform asymmetric quantisation: min/max, code computation, and bit packing.
// Plain loops over contiguous arrays written for the auto-vectoriser; the *Reference functions
// are the scalar definitions tests compare against.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvserve/kv.h"

namespace kvserve::quant {

// Codes of `bits` bits are stored as bit planes: bits = sum of plane widths (8, or some of
// 4, 2, 1, highest first). A plane of width w packs k = 8/w codes per byte; the codes of a
// block of n values (n padded to a multiple of 8) are split into k segments of n/k, and byte j
// holds code j + i*(n/k) in its bits [i*w, i*w + w). Every byte of a plane is computed from
// k contiguous streams, so packing and unpacking vectorise without shuffles.
size_t PackedBytes(size_t n, int bits);  // n rounded up to a multiple of 8, times bits / 8
// Whether the *Fast and fused kernels run their AVX-512/F16C loops now: the CPU has them and
// the tier is not capped (kvserve/cpu.h); else the portable loops.
bool HaveAvx512Kernels();
void PackCodes(const uint8_t* codes, size_t n_padded, int bits, uint8_t* out);
void UnpackCodes(const uint8_t* in, size_t n_padded, int bits, uint8_t* codes);
void PackCodesReference(const uint8_t* codes, size_t n_padded, int bits, uint8_t* out);

// Range of a group, stored as two fp16 values: the minimum rounded down and the step rounded up,
// so every value of the group lies within [lo, lo + levels * step] and dequantises to within
// step / 2 of itself. Returns false if the range does not fit fp16.
bool GroupRange(float min, float max, int levels, uint16_t* lo_h, uint16_t* step_h, float* lo, float* step);
// GroupRange over m groups at once (vectorised): reads mn/mx, writes the fp16 pair, their float
// values and 1/step (0 for an empty range). Returns the index of the first group whose range
// does not fit fp16, or m if all fit.
size_t GroupRanges(const float* mn, const float* mx, size_t m, int levels, uint16_t* lo_h, uint16_t* step_h,
                   float* lo, float* step, float* inv_step);

// codes[i] = clamp(round((x[i] - lo[c]) / step[c]), 0, levels), c = i % n_channel
// (per-channel: one lo/step per column of a [rows][n_channel] block).
void QuantizeColumns(const float* x, size_t rows, size_t n_channel, const float* lo, const float* inv_step,
                     int levels, uint8_t* codes);
// Per row and per group of `group` columns: one lo/step per (row, group).
void QuantizeRowGroups(const float* x, size_t rows, size_t n_channel, size_t group, const float* lo,
                       const float* inv_step, int levels, uint8_t* codes);
void DequantizeColumns(const uint8_t* codes, size_t rows, size_t n_channel, const float* lo, const float* step,
                       float* x);
void DequantizeRowGroups(const uint8_t* codes, size_t rows, size_t n_channel, size_t group, const float* lo,
                         const float* step, float* x);

// Column-wise min and max of a [rows][n_channel] block.
void ColumnMinMax(const float* x, size_t rows, size_t n_channel, float* mn, float* mx);
// Min and max of every (row, group of `group` columns) of a [rows][n_channel] block, row-major
// in (row, group) order.
void RowGroupMinMax(const float* x, size_t rows, size_t n_channel, size_t group, float* mn, float* mx);

// Fast kernels: each equals its plain counterpart and uses AVX-512 when the CPU has it and the
// widths are multiples of 16; otherwise it runs the plain loop.
// As RowGroupMinMax, vectorised over each group.
void RowGroupMinMaxFast(const float* x, size_t rows, size_t n_channel, size_t group, float* mn, float* mx);
void QuantizeColumnsFast(const float* x, size_t rows, size_t n_channel, const float* lo, const float* inv_step,
                         int levels, uint8_t* codes);
void QuantizeRowGroupsFast(const float* x, size_t rows, size_t n_channel, size_t group, const float* lo,
                           const float* inv_step, int levels, uint8_t* codes);
// Dequantise straight into fp16 with streaming stores.
void DequantizeColumnsF16(const uint8_t* codes, size_t rows, size_t n_channel, const float* lo, const float* step,
                          float* scratch, uint16_t* dst);
void DequantizeRowGroupsF16(const uint8_t* codes, size_t rows, size_t n_channel, size_t group, const float* lo,
                            const float* step, float* scratch, uint16_t* dst);

// One quantisation block of `rows` x `n_channel` values, as the quant stage stores it: the m
// minima (fp16), the m steps (fp16), then the codes packed in bit planes. `group` == 0 means
// ranges per channel over the block's rows (m = n_channel); otherwise ranges per row and group
// of `group` channels (m = rows * ceil(n_channel / group)).
struct BlockScratch {
  std::vector<float> x, mn, mx, lo, step, inv;
  std::vector<uint16_t> lo_h, step_h;
  std::vector<uint8_t> codes;
  void Reserve(size_t n_values, size_t m);
};
size_t BlockMetaCount(size_t rows, size_t n_channel, size_t group);
size_t BlockBytes(size_t rows, size_t n_channel, size_t group, int bits);
// What an encode asks the memory system for while it computes: the next block's lines. By
// default the block after this one in memory (a dense slab); a paged cache's next block is
// `n_rows` page rows of `row_bytes` each at `rows` (every head's rows of those tokens).
struct NextRows {
  const uint8_t* const* rows = nullptr;
  size_t n_rows = 0, row_bytes = 0;
};
// Encodes a block of `dt` values. fp16 or f32 (a transform's output) with 16-multiple widths
// takes the fused AVX-512 loop on CPUs that have it (one pass over the source for min/max, the
// codes from its float copy in L1); everything else converts to float and runs the *Fast kernels. Returns the index of the first
// group whose range does not fit fp16 metadata (its min/max are left in s.mn/s.mx), or m.
// `next`: what to ask for meanwhile (default: the block after this one in memory).
size_t EncodeBlock(const void* src, DType dt, size_t rows, size_t n_channel, size_t group, int bits, uint8_t* dst,
                   BlockScratch& s, const NextRows* next = nullptr);
// EncodeBlock of rows that lie anywhere (row r at row_in[r]: a paged cache's rows, read where they
// lie, with no gathered copy), the same bytes and the same return; `next` is asked for meanwhile.
size_t EncodeBlockFromRows(const uint8_t* const* row_in, DType dt, size_t rows, size_t n_channel, size_t group, int bits,
                           uint8_t* dst, BlockScratch& s, const NextRows* next);
// Decodes such a block into `dt`. For fp16 and f32 the fused loop unpacks the bit planes and
// dequantises (and converts) in registers, 16 values at a time, when the block's rows line up
// with the planes (a multiple of 8 covers every width).
// Call StreamFence() after the last block, before dst is handed to another thread: the other
// paths may use streaming stores, which are weakly ordered; fencing once per slab instead of
// per block keeps them flowing.
void StreamFence();
void DecodeBlock(const uint8_t* src, size_t rows, size_t n_channel, size_t group, int bits, DType dt, void* dst,
                 BlockScratch& s);
// DecodeBlock with row r written to row_out[r] (a paged cache's rows; non-temporal stores where
// aligned, so StreamFence() after the slab).
void DecodeBlockToRows(const uint8_t* src, size_t rows, size_t n_channel, size_t group, int bits, DType dt,
                       uint8_t* const* row_out, BlockScratch& s);
// The same two as compositions of the plain kernels above: the definitions the fast loops are
// tested against (encode byte for byte; decode within one fp16 ulp, as fma rounds once).
size_t EncodeBlockReference(const void* src, DType dt, size_t rows, size_t n_channel, size_t group, int bits,
                            uint8_t* dst, BlockScratch& s);
void DecodeBlockReference(const uint8_t* src, size_t rows, size_t n_channel, size_t group, int bits, DType dt,
                          void* dst, BlockScratch& s);

}  // namespace kvserve::quant
