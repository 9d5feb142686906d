// Quantized weights repacked once at load: 16 output rows interleaved per 32-value block,
// so that one 512-bit `vpdpbusd` multiplies 4 values of 16 rows by 4 broadcast values of one row of
// x (64 products, no horizontal sums), and each decoded block serves every row of x in the tile.
//
// Four layouts, per group of 16 rows (zero-padded) and per block b, blocks of a group contiguous:
//   S8 (from Q8_0):  512 bytes: byte [j][row][i] = w[row][4j + i] ^ 0x80 (u8), then fp16 d[16]
//   U4 (from Q4_0, Q4_1): 256 bytes of nibbles, byte [k][row][i] = w[row][8k + i] |
//      w[row][8k + 4 + i] << 4 (unsigned), then fp16 d[16], fp16 m[16]
//   U5 (from Q5_0, Q5_1): U4's nibbles of the low 4 bits, then the fifth bits as 8 64-bit masks
//      (mask j, bit 4 row + i: value 4j + i of that row), then fp16 d[16], fp16 m[16]
//   U4F (from Q4_K): U4's nibbles, then fp32 d[16], fp32 m[16] (a sub-block's 6-bit scale times its
//      super-block's fp16 scale needs 17 bits: exact in fp32, not in fp16)
//   U5F (from Q5_K): U5's nibbles and fifth-bit masks, then fp32 d[16], fp32 m[16] (as U4F)
//   S6 (from Q6_K): 512 bytes laid out as S8's, of the 6-bit values u = w + 32, then fp32 d[16]
//      (values 0-15) and fp32 e[16] (values 16-31): Q6_K keeps a scale per 16 values, so each
//      half is summed apart and corrected exactly by -32 times its share of sum(x)
// so that w[row][c] = d[row] * u[row][c] + m[row] (S8: u = w + 128, m = -128 d; S6: (u - 32) times
// d or e), exactly as in the file.  AVX-512 (F, BW, VNNI) builds run a 512-bit `vpdpbusd` tile; AVX2 builds the same layouts
// as two 8-row halves with `vpmaddubsw` (the signed trick for S8).
#pragma once

#include <cstdint>

#include "quant_simd.h"

namespace il {

constexpr int ROWS = 16;
constexpr int S8 = 1001, U4 = 1002, U4F = 1003, U5 = 1004, U5F = 1005, S6 = 1006;  // type ids for the quantized linear call, beside ggml's

// The layout a ggml type repacks into, or -1.
int layout_of(int ggml_type);

// Rows [n0, n0 + cols) (n0 a multiple of ROWS) of a repacked weight against rows [m0, m1) of x.
void group(int layout, const uint8_t* w, int64_t n0, int64_t cols, const q::XBlock* xq, int64_t xs, int64_t m0,
           int64_t m1, float* y, int64_t ldy, int64_t k);

}  // namespace il
