// y = x W^T + b for a few float32 rows of x (M <= 8) where W is held in a GGUF block
// format (Q8_0, Q4_0, Q4_1: 32 weights per block, a float scale per block and, for
// Q4_1, a float offset). The weights are expanded to float32 in registers, exactly as
// the checkpoint defines them, so the result equals F.linear on the dequantized float32
// weights up to summation order; the win is the bytes: a decode step at small batch is
// one pass over the weights, and Q4_1 is 0.75 bytes per weight against float32's 4.
//
// Layout (repacked from the GGUF blocks by block_linear.py), for W [N, K], K % 32 == 0:
//   codes  Q8_0: int8 [N, K]; Q4_0/Q4_1: uint8 [N, K/2], per block of 32 the GGUF order
//          (byte j holds weight j in its low nibble and weight j + 16 in its high one)
//   scales float32 [N, K/32]; mins float32 [N, K/32] (Q4_1 only)
// Weight value: Q8_0 q * d; Q4_0 (q - 8) * d; Q4_1 (q * d) + m. The products are exact
// in float32 (d is a float16: 11 significant bits, q at most 8), so whether the compiler
// fuses Q4_1's multiply-add or not, each weight is rounded once, as gguf computes it.
//
// Threads own ranges of output features, as in skinny_linear.cpp; built by
// native_build.py, loaded by block_linear.py.
#include <omp.h>
#if defined(__AVX2__)
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

enum Format { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };

struct Shape {
    int64_t rows, in_features, out_features, x_row_stride;
};

struct Weights {
    const uint8_t* codes;
    const float* scales;
    const float* mins;
    int64_t code_row_bytes, blocks_per_row;
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

template <int F>
constexpr int64_t block_bytes() { return F == kQ8_0 ? 32 : 16; }

// Output features [n, n + R) for all M rows of x ([M, K] contiguous float32).
template <int F, int M, int R>
inline void features(const float* x, const Weights& w, const float* bias, float* y, int64_t n,
                     const Shape& s) {
    const int64_t K = s.in_features;
    f32x8 acc[M][R] = {};
    for (int64_t b = 0; b < w.blocks_per_row; ++b) {
        const uint8_t* codes[R];
        float d[R], m[R];
        for (int r = 0; r < R; ++r) {
            codes[r] = w.codes + (n + r) * w.code_row_bytes + b * block_bytes<F>();
            __builtin_prefetch(codes[r] + 256);
            d[r] = w.scales[(n + r) * w.blocks_per_row + b];
            m[r] = F == kQ4_1 ? w.mins[(n + r) * w.blocks_per_row + b] : 0.0f;
        }
        for (int part = 0; part < 4; ++part) {
            f32x8 wv[R];
            for (int r = 0; r < R; ++r) wv[r] = dequant8<F>(codes[r], d[r], m[r], part);
            for (int i = 0; i < M; ++i) {
                const f32x8 xv = load8(x + i * K + b * kBlock + 8 * part);
                for (int r = 0; r < R; ++r) acc[i][r] += xv * wv[r];
            }
        }
    }
    for (int i = 0; i < M; ++i)
        for (int r = 0; r < R; ++r)
            y[i * s.out_features + n + r] = hsum(acc[i][r]) + (bias ? bias[n + r] : 0.0f);
}

template <int F, int M, int R>
void linear_rows(const float* x, const Weights& w, const float* bias, float* y, const Shape& s) {
    const int64_t N = s.out_features, groups = N / R;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; ++g) features<F, M, R>(x, w, bias, y, g * R, s);
    for (int64_t n = groups * R; n < N; ++n) features<F, M, 1>(x, w, bias, y, n, s);
}

// At most 8 rows per pass over the weights: M * R accumulators stay within the 16
// vector registers. R (weight rows in flight) as in skinny_linear.cpp.
template <int F>
void rows_pass(const float* x, const Weights& w, const float* bias, float* y, int64_t rows,
               const Shape& s) {
    switch (rows) {
        case 1: linear_rows<F, 1, 4>(x, w, bias, y, s); break;
        case 2: linear_rows<F, 2, 4>(x, w, bias, y, s); break;
        case 3: linear_rows<F, 3, 2>(x, w, bias, y, s); break;
        case 4: linear_rows<F, 4, 2>(x, w, bias, y, s); break;
        case 5: linear_rows<F, 5, 1>(x, w, bias, y, s); break;
        case 6: linear_rows<F, 6, 1>(x, w, bias, y, s); break;
        case 7: linear_rows<F, 7, 1>(x, w, bias, y, s); break;
        default: linear_rows<F, 8, 1>(x, w, bias, y, s); break;
    }
}

template <int F>
int linear(const float* x_in, const Weights& w, const float* bias, float* y, const Shape& s) {
    const int64_t M = s.rows, K = s.in_features, N = s.out_features;
    std::vector<float> x(M * K);  // contiguous rows, whatever the caller's stride
    for (int64_t i = 0; i < M; ++i) std::memcpy(&x[i * K], x_in + i * s.x_row_stride, K * 4);
    for (int64_t start = 0; start < M; start += 8)
        rows_pass<F>(&x[start * K], w, bias, y + start * N, std::min<int64_t>(8, M - start), s);
    return 0;
}

template <int F>
void dequantize(const Weights& w, float* out, int64_t N) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n)
        for (int64_t b = 0; b < w.blocks_per_row; ++b) {
            const uint8_t* codes = w.codes + n * w.code_row_bytes + b * block_bytes<F>();
            const float d = w.scales[n * w.blocks_per_row + b];
            const float m = F == kQ4_1 ? w.mins[n * w.blocks_per_row + b] : 0.0f;
            for (int part = 0; part < 4; ++part) {
                const f32x8 v = dequant8<F>(codes, d, m, part);
                std::memcpy(out + (n * w.blocks_per_row + b) * kBlock + 8 * part, &v, sizeof v);
            }
        }
}

Weights weights_of(int format, const void* codes, const float* scales, const float* mins,
                   int64_t in_features) {
    const int64_t blocks = in_features / kBlock;
    return {static_cast<const uint8_t*>(codes), scales, mins,
            format == kQ8_0 ? in_features : in_features / 2, blocks};
}

bool valid(int format, const float* mins, int64_t in_features) {
    return format >= kQ8_0 && format <= kQ4_1 && in_features > 0 &&
           in_features % kBlock == 0 && (format != kQ4_1 || mins != nullptr);
}

}  // namespace

extern "C" {

// format: 0 = Q8_0, 1 = Q4_0, 2 = Q4_1 (layout above). x float32 [rows, in_features]
// (row stride x_row_stride, unit column stride); bias float32 [out_features] or null;
// y float32 [rows, out_features] contiguous. Returns 0, or nonzero for bad arguments.
int kvflow_block_linear(int format, const float* x, const void* codes, const float* scales,
                        const float* mins, const float* bias, float* y, int64_t rows,
                        int64_t in_features, int64_t out_features, int64_t x_row_stride) {
    if (!valid(format, mins, in_features)) return 1;
    const Shape s{rows, in_features, out_features, x_row_stride};
    const Weights w = weights_of(format, codes, scales, mins, in_features);
    if (format == kQ8_0) return linear<kQ8_0>(x, w, bias, y, s);
    if (format == kQ4_0) return linear<kQ4_0>(x, w, bias, y, s);
    return linear<kQ4_1>(x, w, bias, y, s);
}

// The float32 weights [out_features, in_features] the blocks encode (same arithmetic as
// the kernel: what the loader compares with the checkpoint's float32 tensor).
int kvflow_block_dequantize(int format, const void* codes, const float* scales,
                            const float* mins, float* out, int64_t in_features,
                            int64_t out_features) {
    if (!valid(format, mins, in_features)) return 1;
    const Weights w = weights_of(format, codes, scales, mins, in_features);
    if (format == kQ8_0) dequantize<kQ8_0>(w, out, out_features);
    else if (format == kQ4_0) dequantize<kQ4_0>(w, out, out_features);
    else dequantize<kQ4_1>(w, out, out_features);
    return 0;
}

}  // extern "C"
