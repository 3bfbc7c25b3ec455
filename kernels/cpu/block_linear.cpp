// y = x W^T + b for a few float32 rows of x (M <= 8) where W is held in a GGUF block
// format (Q8_0, Q4_0, Q4_1: 32 weights per block, a float scale per block and, for
// Q4_1, a float offset). The weights are expanded to float32 in registers, exactly as
// the checkpoint defines them, so the result equals F.linear on the dequantized float32
// weights up to summation order; the win is the bytes: a decode step at small batch is
// one pass over the weights, and Q4_1 is 0.75 bytes per weight against float32's 4.
//
// Layout (packed from the GGUF blocks by block_linear.py), for W [N, K], K % 32 == 0:
// the rows go in tiles of 4 (the last one padded with zero rows), and a tile is one
// record per block of 32 columns, the records of a tile back to back:
//   record = [d of the 4 rows: float32 x 4][m x 4: Q4_1 only][codes of row 0 .. row 3]
//   codes  Q8_0: 32 int8; Q4_0/Q4_1: 16 bytes in the GGUF order (byte j holds weight j
//          in its low nibble and weight j + 16 in its high one)
// A thread's share of the weights is then one sequential stream: the prefetchers keep
// it at memory speed, where 4 row streams plus scale and offset streams (the layout
// before) left a single row at a third of the DRAM bandwidth on Zen 4.
// Weight value: Q8_0 q * d; Q4_0 (q - 8) * d; Q4_1 (q * d) + m. The products are exact
// in float32 (d is a float16: 11 significant bits, q at most 8), so whether the compiler
// fuses Q4_1's multiply-add or not, each weight is rounded once, as gguf computes it.
//
// Threads own ranges of tiles (output features); built by native_build.py, loaded by
// block_linear.py.
#include <omp.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace {

using namespace kvflow_cpu;

constexpr int64_t kBlock = 32;
constexpr int kTile = 4;  // weight rows per tile
// Bytes ahead of the weights being read that a software prefetch asks for: the
// hardware prefetcher follows the stream, this covers its ramp at each call's start.
constexpr int64_t kPrefetchAhead = 1024;

enum Format { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };

struct Shape {
    int64_t rows, in_features, out_features, x_row_stride;
};

template <int F>
constexpr int64_t code_bytes() { return F == kQ8_0 ? 32 : 16; }
template <int F>
constexpr int64_t header_bytes() { return (F == kQ4_1 ? 2 : 1) * kTile * 4; }
template <int F>
constexpr int64_t record_bytes() { return header_bytes<F>() + kTile * code_bytes<F>(); }

// One block of the tile: the 4 rows' d (and m) and codes.
template <int F>
struct Record {
    const uint8_t* p;
    float d(int r) const { return load_float(p + 4 * r); }
    float m(int r) const { return F == kQ4_1 ? load_float(p + 4 * (kTile + r)) : 0.0f; }
    const uint8_t* codes(int r) const { return p + header_bytes<F>() + r * code_bytes<F>(); }
    static float load_float(const uint8_t* at) {
        float v;
        std::memcpy(&v, at, sizeof v);
        return v;
    }
};

// 8 codes from `p` as float32: signed bytes (Q8_0), or the low or high nibbles of 8
// bytes (Q4_*). AVX2 widens bytes to 32-bit lanes in one instruction (GCC's generic
// vector conversion of bytes compiles to scalar code); elsewhere a plain loop.
#if defined(__AVX2__)
inline f32x8 signed_bytes(const uint8_t* p) {
    const __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return f32x8(_mm256_cvtepi32_ps(wide));
}
inline f32x8 nibbles(const uint8_t* p, bool high) {
    const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i q = high ? _mm256_srli_epi32(wide, 4) : _mm256_and_si256(wide, _mm256_set1_epi32(15));
    return f32x8(_mm256_cvtepi32_ps(q));
}
#else
inline f32x8 signed_bytes(const uint8_t* p) {
    f32x8 v;
    for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(static_cast<int8_t>(p[i]));
    return v;
}
inline f32x8 nibbles(const uint8_t* p, bool high) {
    f32x8 v;
    for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(high ? p[i] >> 4 : p[i] & 15);
    return v;
}
#endif

// Weights [8 * part, 8 * part + 8) of one block, part in 0..3, as float32.
template <int F>
inline f32x8 dequant8(const uint8_t* block_codes, float d, float m, int part) {
    if constexpr (F == kQ8_0) return signed_bytes(block_codes + 8 * part) * d;
    const f32x8 q = nibbles(block_codes + 8 * (part & 1), part >= 2);
    if constexpr (F == kQ4_0) return (q - 8.0f) * d;
    return q * d + m;
}

#if defined(__AVX512F__)
// AVX-512: a block (32 weights) is two 16-float vectors. The 4-bit formats look their
// weights up instead of converting each code: a block has at most 16 distinct weights,
// table[q] = q * d + m (Q4_1) or (q - 8) * d (Q4_0), computed once per block (exact, as
// above) and gathered by code with vpermps, which reads the low 4 bits of each 32-bit
// index: the low nibble needs no mask, the high one a shift. Per 32 weights: one
// widen, one shift, two permutes, the table's FMA and two FMAs against x.
template <int F>
inline void block16(const uint8_t* codes, float d, float m, __m512& lo, __m512& hi) {
    if constexpr (F == kQ8_0) {
        const __m512 scale = _mm512_set1_ps(d);
        const __m128i* p = reinterpret_cast<const __m128i*>(codes);
        lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p))), scale);
        hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1))), scale);
    } else {
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 table =
            F == kQ4_1 ? _mm512_fmadd_ps(iota, _mm512_set1_ps(d), _mm512_set1_ps(m))
                       : _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(8.0f)), _mm512_set1_ps(d));
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
        lo = _mm512_permutexvar_ps(q, table);
        hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
    }
}

// Rows [r0, r0 + R) of the tile at `tile` (output features n0 + r0 ...) for all M rows
// of x ([M, K] contiguous float32).
template <int F, int M, int R>
inline void tile_rows(const float* x, const uint8_t* tile, int64_t blocks, int r0, float acc_out[M][R],
                      int64_t K) {
    __m512 acc[M][R];
    for (int i = 0; i < M; ++i)
        for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        const Record<F> rec{tile + b * record_bytes<F>()};
        __builtin_prefetch(rec.p + kPrefetchAhead);
        __m512 lo[R], hi[R];
        for (int r = 0; r < R; ++r) block16<F>(rec.codes(r0 + r), rec.d(r0 + r), rec.m(r0 + r), lo[r], hi[r]);
        for (int i = 0; i < M; ++i) {
            const __m512 xlo = _mm512_loadu_ps(x + i * K + b * kBlock);
            const __m512 xhi = _mm512_loadu_ps(x + i * K + b * kBlock + 16);
            for (int r = 0; r < R; ++r)
                acc[i][r] = _mm512_fmadd_ps(xhi, hi[r], _mm512_fmadd_ps(xlo, lo[r], acc[i][r]));
        }
    }
    for (int i = 0; i < M; ++i)
        for (int r = 0; r < R; ++r) acc_out[i][r] = _mm512_reduce_add_ps(acc[i][r]);
}

// Tile rows per pass: M * R accumulators plus 2R weight vectors within 32 registers.
constexpr int rows_per_pass(int M) { return M <= 4 ? 4 : 2; }
#else
template <int F, int M, int R>
inline void tile_rows(const float* x, const uint8_t* tile, int64_t blocks, int r0, float acc_out[M][R],
                      int64_t K) {
    f32x8 acc[M][R] = {};
    for (int64_t b = 0; b < blocks; ++b) {
        const Record<F> rec{tile + b * record_bytes<F>()};
        __builtin_prefetch(rec.p + kPrefetchAhead);
        for (int part = 0; part < 4; ++part) {
            f32x8 wv[R];
            for (int r = 0; r < R; ++r) wv[r] = dequant8<F>(rec.codes(r0 + r), rec.d(r0 + r), rec.m(r0 + r), part);
            for (int i = 0; i < M; ++i) {
                const f32x8 xv = load8(x + i * K + b * kBlock + 8 * part);
                for (int r = 0; r < R; ++r) acc[i][r] += xv * wv[r];
            }
        }
    }
    for (int i = 0; i < M; ++i)
        for (int r = 0; r < R; ++r) acc_out[i][r] = hsum(acc[i][r]);
}

// Tile rows per pass: M * R accumulators within the 16 vector registers.
constexpr int rows_per_pass(int M) { return M <= 2 ? 4 : M <= 4 ? 2 : 1; }
#endif

// One tile (output features [n0, n0 + 4), those below N) for all M rows of x; rows
// beyond one pass re-read the tile from L1.
template <int F, int M>
inline void tile(const float* x, const uint8_t* tile, const float* bias, float* y, int64_t n0,
                 const Shape& s) {
    constexpr int R = rows_per_pass(M);
    const int64_t blocks = s.in_features / kBlock, N = s.out_features;
    for (int r0 = 0; r0 < kTile; r0 += R) {
        float acc[M][R];
        tile_rows<F, M, R>(x, tile, blocks, r0, acc, s.in_features);
        for (int r = 0; r < R && n0 + r0 + r < N; ++r) {
            const int64_t n = n0 + r0 + r;
            for (int i = 0; i < M; ++i) y[i * N + n] = acc[i][r] + (bias ? bias[n] : 0.0f);
        }
    }
}

template <int F, int M>
void linear_rows(const float* x, const uint8_t* packed, const float* bias, float* y, const Shape& s) {
    const int64_t tiles = (s.out_features + kTile - 1) / kTile;
    const int64_t tile_bytes = s.in_features / kBlock * record_bytes<F>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) tile<F, M>(x, packed + t * tile_bytes, bias, y, t * kTile, s);
}

// At most 8 rows per pass over the weights.
template <int F>
void rows_pass(const float* x, const uint8_t* packed, const float* bias, float* y, int64_t rows,
               const Shape& s) {
    switch (rows) {
        case 1: linear_rows<F, 1>(x, packed, bias, y, s); break;
        case 2: linear_rows<F, 2>(x, packed, bias, y, s); break;
        case 3: linear_rows<F, 3>(x, packed, bias, y, s); break;
        case 4: linear_rows<F, 4>(x, packed, bias, y, s); break;
        case 5: linear_rows<F, 5>(x, packed, bias, y, s); break;
        case 6: linear_rows<F, 6>(x, packed, bias, y, s); break;
        case 7: linear_rows<F, 7>(x, packed, bias, y, s); break;
        default: linear_rows<F, 8>(x, packed, bias, y, s); break;
    }
}

template <int F>
int linear(const float* x_in, const uint8_t* packed, const float* bias, float* y, const Shape& s) {
    const int64_t M = s.rows, K = s.in_features, N = s.out_features;
    std::vector<float> copy;  // contiguous rows, where the caller's stride is not K
    const float* x = x_in;
    if (M > 1 && s.x_row_stride != K) {
        copy.resize(M * K);
        for (int64_t i = 0; i < M; ++i) std::memcpy(&copy[i * K], x_in + i * s.x_row_stride, K * 4);
        x = copy.data();
    }
    for (int64_t start = 0; start < M; start += 8)
        rows_pass<F>(x + start * K, packed, bias, y + start * N, std::min<int64_t>(8, M - start), s);
    return 0;
}

template <int F>
void dequantize(const uint8_t* packed, float* out, int64_t K, int64_t N) {
    const int64_t blocks = K / kBlock;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t* tile = packed + n / kTile * blocks * record_bytes<F>();
        const int r = static_cast<int>(n % kTile);
        for (int64_t b = 0; b < blocks; ++b) {
            const Record<F> rec{tile + b * record_bytes<F>()};
            for (int part = 0; part < 4; ++part) {
                const f32x8 v = dequant8<F>(rec.codes(r), rec.d(r), rec.m(r), part);
                std::memcpy(out + n * K + b * kBlock + 8 * part, &v, sizeof v);
            }
        }
    }
}

bool valid(int format, int64_t in_features) {
    return format >= kQ8_0 && format <= kQ4_1 && in_features > 0 && in_features % kBlock == 0;
}

#include "block_linear_bf16.h"  // NOLINT: the bf16 rows' kernel, on the layout above

}  // namespace

extern "C" {

// format: 0 = Q8_0, 1 = Q4_0, 2 = Q4_1; packed: the tiles above. x float32 [rows,
// in_features] (row stride x_row_stride, unit column stride); bias float32
// [out_features] or null; y float32 [rows, out_features] contiguous. Returns 0, or
// nonzero for bad arguments.
int kvflow_block_linear(int format, const float* x, const void* packed, const float* bias,
                        float* y, int64_t rows, int64_t in_features, int64_t out_features,
                        int64_t x_row_stride) {
    if (!valid(format, in_features)) return 1;
    const Shape s{rows, in_features, out_features, x_row_stride};
    const auto* p = static_cast<const uint8_t*>(packed);
    if (format == kQ8_0) return linear<kQ8_0>(x, p, bias, y, s);
    if (format == kQ4_0) return linear<kQ4_0>(x, p, bias, y, s);
    return linear<kQ4_1>(x, p, bias, y, s);
}

// The same for bfloat16 rows (a bf16 model's decode step): x and bias widened to float32,
// the product computed as above (with the weights' unrounded float32 values) and rounded
// to bf16 once, to nearest even. Scratch reused per calling thread: the LM head's float32
// y is ~200 KB, which malloc would map and unmap on every call.
int kvflow_block_linear_bf16(int format, const Bf16* x, const void* packed, const Bf16* bias,
                             Bf16* y, int64_t rows, int64_t in_features, int64_t out_features,
                             int64_t x_row_stride) {
    if (!valid(format, in_features) || rows < 0) return 1;
    static thread_local std::vector<float> xf, bf, yf;
    xf.resize(rows * in_features);
    bf.resize(bias ? out_features : 0);
    yf.resize(rows * out_features);
    for (int64_t i = 0; i < rows; ++i)
        for (int64_t k = 0; k < in_features; ++k) xf[i * in_features + k] = load(x[i * x_row_stride + k]);
    for (int64_t n = 0; bias && n < out_features; ++n) bf[n] = load(bias[n]);
    const int status = kvflow_block_linear(format, xf.data(), packed, bias ? bf.data() : nullptr,
                                           yf.data(), rows, in_features, out_features, in_features);
    for (int64_t j = 0; j < rows * out_features; ++j) store(&y[j], yf[j]);
    return status;
}

// bf16 rows as the bf16 model computes them (block_linear_bf16.h): weights rounded to
// bf16, float32 sums, y rounded once; rows of any count (kDotMaxRows per pass), x's row
// stride in elements (unit column stride), bias bf16 or null, y contiguous. Returns 0, or
// nonzero for bad arguments.
int kvflow_block_linear_bf16_dot(int format, const Bf16* x, const void* packed, const Bf16* bias,
                                 Bf16* y, int64_t rows, int64_t in_features, int64_t out_features,
                                 int64_t x_row_stride) {
    if (!valid(format, in_features) || rows < 0) return 1;
    const auto* p = static_cast<const uint8_t*>(packed);
    const int64_t K = in_features, N = out_features;
    if (format == kQ8_0) dot_linear<kQ8_0>(x, x_row_stride, p, bias, y, rows, K, N);
    else if (format == kQ4_0) dot_linear<kQ4_0>(x, x_row_stride, p, bias, y, rows, K, N);
    else dot_linear<kQ4_1>(x, x_row_stride, p, bias, y, rows, K, N);
    return 0;
}

// 1 where the bf16 rows' kernel runs on vdpbf16ps (AVX512_BF16), 0 on float32 vectors.
int kvflow_block_linear_bf16_dot_isa() {
#if defined(KVFLOW_BLOCK_DPBF16)
    return 1;
#else
    return 0;
#endif
}

// The float32 weights [out_features, in_features] the tiles encode (same arithmetic as
// the portable kernel: what the loader compares with the checkpoint's float32 tensor).
int kvflow_block_dequantize(int format, const void* packed, float* out, int64_t in_features,
                            int64_t out_features) {
    if (!valid(format, in_features)) return 1;
    const auto* p = static_cast<const uint8_t*>(packed);
    if (format == kQ8_0) dequantize<kQ8_0>(p, out, in_features, out_features);
    else if (format == kQ4_0) dequantize<kQ4_0>(p, out, in_features, out_features);
    else dequantize<kQ4_1>(p, out, in_features, out_features);
    return 0;
}

// Bytes of one tile record (what block_linear.py packs), or -1 for an unknown format.
int64_t kvflow_block_record_bytes(int format) {
    if (format == kQ8_0) return record_bytes<kQ8_0>();
    if (format == kQ4_0) return record_bytes<kQ4_0>();
    if (format == kQ4_1) return record_bytes<kQ4_1>();
    return -1;
}

}  // extern "C"
