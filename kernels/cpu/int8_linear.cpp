// y = x W^T (+ b) with W in 32-weight blocks of unsigned 4- or 8-bit codes and x
// quantized here, per row and block of 32, to two int8 digits: the integer dot products
// run on AVX512-VNNI's vpdpbusd (u8 x s8, 64 products per instruction) where the CPU
// has it, else on portable scalar code that computes the same integers. Any number of rows.
//
// Weight of block b, code u: w = u * d_b + m_b (Q4_1 as stored; Q4_0: m = -8d; Q8_0
// from signed q: u = q + 128, m = -128d). d and m are IEEE half floats, as GGUF stores
// them: a decode step reads every byte of the weights, and float32 scales made an 8-bit
// block 36 bytes instead of 34. 8-bit codes always have m = -128d, which the VNNI path
// uses instead of reading the offsets.
// Activation of block b: e_b = max|x| / 127, t = x / e_b, xq = round(t) in [-127, 127]
// and a second digit for what that leaves, xr = round(256 (t - xq)) clamped to +-127,
// so x ~= e_b (xq + xr / 256) to ~16 bits (one int8 digit alone loses 1-3% per layer
// on this project's models, which compounds over 30 layers); s_b = the float sum of x.
//   y[i, n] = sum_b  d_b e_b / 256 (256 (u . xq)_b + (u . xr)_b)  +  m_b s_b  (+ bias[n])
// 256 |u . xq| + |u . xr| <= 257 * 32 * 255 * 127 < 2^31: the combined dot is an exact int32.
// The dot products are exact integers; only the float sums differ in order between the
// VNNI and the portable path (a few ulps).
//
// Layout (int8_linear.py builds it), K % 32 == 0: the blocks of a row go in units of 4
// blocks, then at most one of 2, then at most one of 1. Within a unit of U blocks the
// first halves (weights 0-15) of its U blocks come first, then the second halves:
//   8-bit codes: [U x 16 first-half codes][U x 16 second-half codes]   (32U bytes)
//   4-bit codes: 16U bytes, byte j of block k: low nibble weight j, high nibble j + 16
//                (GGUF's own Q4 order; the nibbles are the two halves)
// x is laid out the same way (as 8-bit codes), so one vpdpbusd lane (4 bytes) always
// lies within one block: lanes 4k..4k+3 hold block k's partial dot.
#include <omp.h>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVFLOW_VNNI 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 32, kHalf = 16;

struct Weights {
    const uint8_t* codes;    // [N, row_bytes]
    const uint16_t* scales;  // d [N, blocks], half floats
    const uint16_t* offsets; // m [N, blocks], half floats
    int bits;              // 4 or 8
    int64_t blocks, row_bytes;
};

struct Acts {  // quantized x, one row every `blocks` blocks
    std::vector<int8_t> q;        // first digit xq [M, K] in the unit layout
    std::vector<int8_t> r;        // second digit xr [M, K] in the unit layout
    std::vector<float> scale4;    // e_b / 256 repeated 4 times (one block's lanes) [M, 4 * blocks]
    std::vector<float> sums;      // s_b [M, blocks]
    std::vector<float> sums4;     // s_b / 4 repeated 4 times [M, 4 * blocks]
    std::vector<int32_t> corr4;   // 128 (256 sum xq + sum xr) / 4 repeated 4 times: 8-bit codes
    int64_t K, blocks;
};

int64_t code_bytes_per_block(int bits) { return bits == 4 ? 16 : 32; }

// IEEE half -> float, exactly (subnormals, infinities and NaN included), in portable code.
float half_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
    const uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else {  // zero or subnormal: mantissa * 2^-24, exact in float
        const float value = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
        std::memcpy(&bits, &value, sizeof bits);
        bits |= sign;
    }
    float out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
}

// First element of block b's half h (0, 1) within its unit, for the unit layout.
int64_t half_offset(int64_t b, int h, int64_t blocks) {
    const int64_t four = blocks / 4 * 4;
    int64_t start, size;
    if (b < four) start = b / 4 * 4, size = 4;
    else if (blocks - four >= 2 && b < four + 2) start = four, size = 2;
    else start = b, size = 1;
    return start * kBlock + h * kHalf * size + (b - start) * kHalf;
}

void quantize_row(const float* x, int8_t* q, int8_t* r, float* scale4, float* sums,
                  float* sums4, int32_t* corr4, int64_t blocks) {
    for (int64_t b = 0; b < blocks; ++b) {
        const float* xb = x + b * kBlock;
        float amax = 0.0f, sum = 0.0f;
        for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
        for (int j = 0; j < kBlock; ++j) sum += xb[j];
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int h = 0; h < 2; ++h) {
            const int64_t at = half_offset(b, h, blocks);
            for (int j = 0; j < kHalf; ++j) {
                // The residual by an explicit fma (x inv - first, rounded once): the same
                // digits whether or not the compiler would contract, on every ISA.
                const float first = std::nearbyint(xb[h * kHalf + j] * inv);
                const float second = std::nearbyint(std::fma(xb[h * kHalf + j], inv, -first) * 256.0f);
                q[at + j] = static_cast<int8_t>(first);
                r[at + j] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, second)));
            }
        }
        int32_t digits = 0;  // 256 sum xq + sum xr: what codes u = q + 128 add over q
        for (int h = 0; h < 2; ++h)
            for (int j = 0; j < kHalf; ++j)
                digits += 256 * q[half_offset(b, h, blocks) + j] + r[half_offset(b, h, blocks) + j];
        for (int t = 0; t < 4; ++t) corr4[4 * b + t] = 32 * digits;
        for (int t = 0; t < 4; ++t) scale4[4 * b + t] = amax / 127.0f / 256.0f;
        for (int t = 0; t < 4; ++t) sums4[4 * b + t] = sum * 0.25f;

        sums[b] = sum;
    }
}

Acts quantize(const float* x, int64_t rows, int64_t K, int64_t stride) {
    const int64_t blocks = K / kBlock;
    Acts a{std::vector<int8_t>(rows * K), std::vector<int8_t>(rows * K),
           std::vector<float>(rows * 4 * blocks),
           std::vector<float>(rows * blocks), std::vector<float>(rows * 4 * blocks),
           std::vector<int32_t>(rows * 4 * blocks), K, blocks};
#pragma omp parallel for schedule(static) if (rows >= 16)
    for (int64_t i = 0; i < rows; ++i)
        quantize_row(x + i * stride, &a.q[i * K], &a.r[i * K], &a.scale4[i * 4 * blocks],
                     &a.sums[i * blocks],
                     &a.sums4[i * 4 * blocks], &a.corr4[i * 4 * blocks], blocks);
    return a;
}

// Code of weight j (0-31) of block b of row n, unsigned.
inline int code(const Weights& w, int64_t n, int64_t b, int j) {
    const uint8_t* row = w.codes + n * w.row_bytes;
    if (w.bits == 8) return row[half_offset(b, j / kHalf, w.blocks) + j % kHalf];
    const uint8_t byte = row[b * 16 + j % kHalf];
    return j < kHalf ? byte & 15 : byte >> 4;
}

// The integer dot 256 (u . xq) + (u . xr) of block b (8-bit codes: of q = u - 128, so
// that no offset term cancels it in float): portable, and the VNNI path's tail.
inline int32_t block_dot(const Weights& w, int64_t n, const int8_t* xq, const int8_t* xr,
                         int64_t b) {
    int32_t first = 0, second = 0;
    for (int h = 0; h < 2; ++h) {
        const int64_t at = half_offset(b, h, w.blocks);
        for (int j = 0; j < kHalf; ++j) {
            const int u = code(w, n, b, h * kHalf + j) - (w.bits == 8 ? 128 : 0);
            first += u * xq[at + j];
            second += u * xr[at + j];
        }
    }
    return first * 256 + second;
}

// sum_b m_b s_b (4-bit codes; 8-bit ones have it in their signed dot).
inline float offset_part(const Weights& w, int64_t n, const float* sums) {
    if (w.bits == 8) return 0.0f;
    const uint16_t* m = w.offsets + n * w.blocks;
    float acc = 0.0f;
    for (int64_t b = 0; b < w.blocks; ++b) acc += half_to_float(m[b]) * sums[b];
    return acc;
}

// Blocks [from, blocks) of y[i, n], portably.
float portable_blocks(const Weights& w, int64_t n, const Acts& a, int64_t i, int64_t from) {
    const int8_t *xq = &a.q[i * a.K], *xr = &a.r[i * a.K];
    const float* e4 = &a.scale4[i * 4 * a.blocks];
    float acc = 0.0f;
    for (int64_t b = from; b < w.blocks; ++b) {
        const float dot = static_cast<float>(block_dot(w, n, xq, xr, b));
        acc += dot * (half_to_float(w.scales[n * w.blocks + b]) * e4[4 * b]);
    }
    return acc;
}

#if defined(KVFLOW_VNNI)
// The two u8 halves of a 4-block unit starting at block b of row n.
inline void codes4(const Weights& w, int64_t n, int64_t b, __m512i& lo, __m512i& hi) {
    const uint8_t* p = w.codes + n * w.row_bytes + b * code_bytes_per_block(w.bits);
    // Rows are short (a few hundred bytes): the hardware prefetcher does not ramp up
    // within one, so fetch the same unit of the row 8 rows on (the next tiles' rows).
    // Into L2, not L1: on the 1B shape's layers that read 86-88% of a plain read pass at
    // one row and 62-70% at four, against 57-80% and 56% into L1 (docs/benchmarks.md).
    const char* ahead = reinterpret_cast<const char*>(p + 8 * w.row_bytes);
    _mm_prefetch(ahead, _MM_HINT_T1);
    if (w.bits == 8) _mm_prefetch(ahead + 64, _MM_HINT_T1);
    if (w.bits == 8) {
        lo = _mm512_loadu_si512(p);
        hi = _mm512_loadu_si512(p + 64);
    } else {
        const __m512i c = _mm512_loadu_si512(p), mask = _mm512_set1_epi8(15);
        lo = _mm512_and_si512(c, mask);
        hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), mask);
    }
}

inline void codes2(const Weights& w, int64_t n, int64_t b, __m256i& lo, __m256i& hi) {
    const uint8_t* p = w.codes + n * w.row_bytes + b * code_bytes_per_block(w.bits);
    if (w.bits == 8) {
        lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
    } else {
        const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        const __m256i mask = _mm256_set1_epi8(15);
        lo = _mm256_and_si256(c, mask);
        hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), mask);
    }
}

// 256 (u . xq) + (u . xr) of a 2-block unit, lanes 4k..4k+3 block k.
inline __m256i dot2(__m256i lo, __m256i hi, const int8_t* xq, const int8_t* xr) {
    const auto load = [](const int8_t* p) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    };
    __m256i first = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, load(xq));
    first = _mm256_dpbusd_epi32(first, hi, load(xq + 32));
    __m256i second = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, load(xr));
    second = _mm256_dpbusd_epi32(second, hi, load(xr + 32));
    return _mm256_add_epi32(_mm256_slli_epi32(first, 8), second);
}

// d and m of blocks b, b + 1, ... (half floats) spread over the lanes of their blocks'
// dot products.
inline __m512 spread4(const uint16_t* p) {
    const __m512i index = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m128 four = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm512_permutexvar_ps(index, _mm512_castps128_ps512(four));
}

inline __m512 spread2(const uint16_t* p) {  // two blocks, upper 8 lanes zero
    const __m512i index = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
    int32_t pair;
    std::memcpy(&pair, p, sizeof pair);
    const __m128 two = _mm_cvtph_ps(_mm_cvtsi32_si128(pair));
    return _mm512_maskz_permutexvar_ps(0x00FF, index, _mm512_castps128_ps512(two));
}

// y[i0 .. i0 + MT, n0 .. n0 + R): all rows of a tile share each weight load, all
// weight rows share each activation load; every term of y lands in one float vector
// per output (d e dot + m s, lane by lane), reduced once at the end.
template <int MT, int R>
void tile(const Weights& w, const Acts& a, int64_t i0, int64_t n0, float* y, int64_t N) {
    const int64_t units4 = w.blocks / 4, b2 = units4 * 4;
    const bool has2 = w.blocks - b2 >= 2;
    __m512 acc[MT][R];
    for (int i = 0; i < MT; ++i)
        for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
    for (int64_t u = 0; u < units4; ++u) {
        const int64_t b = 4 * u;
        __m512i lo[R], hi[R];
        __m512 d[R], m[R];
        for (int r = 0; r < R; ++r) {
            codes4(w, n0 + r, b, lo[r], hi[r]);
            d[r] = spread4(w.scales + (n0 + r) * w.blocks + b);
            m[r] = w.bits == 4 ? spread4(w.offsets + (n0 + r) * w.blocks + b) : _mm512_setzero_ps();
        }
        for (int i = 0; i < MT; ++i) {
            const int64_t row = i0 + i;
            const int8_t* xq = &a.q[row * a.K + b * kBlock];
            const int8_t* xr = &a.r[row * a.K + b * kBlock];
            const __m512i xl = _mm512_loadu_si512(xq), xh = _mm512_loadu_si512(xq + 64);
            const __m512i rl = _mm512_loadu_si512(xr), rh = _mm512_loadu_si512(xr + 64);
            const __m512 e = _mm512_loadu_ps(&a.scale4[row * 4 * a.blocks + 4 * b]);
            const int64_t lanes = row * 4 * a.blocks + 4 * b;
            for (int r = 0; r < R; ++r) {
                __m512i first = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[r], xl);
                first = _mm512_dpbusd_epi32(first, hi[r], xh);
                __m512i second = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[r], rl);
                second = _mm512_dpbusd_epi32(second, hi[r], rh);
                const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(first, 8), second);
                if (w.bits == 8) {  // signed codes: q . x = u . x - 128 sum x, in integers
                    const __m512i corr = _mm512_loadu_si512(&a.corr4[lanes]);
                    const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot, corr));
                    acc[i][r] = _mm512_fmadd_ps(_mm512_mul_ps(f, e), d[r], acc[i][r]);
                } else {
                    const __m512 s = _mm512_loadu_ps(&a.sums4[lanes]);
                    const __m512 sum = _mm512_fmadd_ps(m[r], s, acc[i][r]);
                    const __m512 f = _mm512_cvtepi32_ps(dot);
                    acc[i][r] = _mm512_fmadd_ps(f, _mm512_mul_ps(d[r], e), sum);
                }
            }
        }
    }
    if (has2) {
        for (int r = 0; r < R; ++r) {
            __m256i lo, hi;
            codes2(w, n0 + r, b2, lo, hi);
            const __m512 d = spread2(w.scales + (n0 + r) * w.blocks + b2);
            const bool signed_codes = w.bits == 8;
            const __m512 m = signed_codes ? _mm512_setzero_ps()
                                          : spread2(w.offsets + (n0 + r) * w.blocks + b2);
            for (int i = 0; i < MT; ++i) {
                const int64_t row = i0 + i, lanes = row * 4 * a.blocks + 4 * b2;
                __m256i dot = dot2(lo, hi, &a.q[row * a.K + b2 * kBlock],
                                   &a.r[row * a.K + b2 * kBlock]);
                if (signed_codes)
                    dot = _mm256_sub_epi32(
                        dot, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.corr4[lanes])));
                const __m512 e = _mm512_maskz_loadu_ps(0x00FF, &a.scale4[lanes]);
                const __m512 s = _mm512_maskz_loadu_ps(0x00FF, &a.sums4[lanes]);
                const __m512 f = _mm512_zextps256_ps512(_mm256_cvtepi32_ps(dot));
                acc[i][r] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, e), _mm512_fmadd_ps(m, s, acc[i][r]));
            }
        }
    }
    const int64_t from = has2 ? b2 + 2 : b2;  // an odd last block, if any
    for (int i = 0; i < MT; ++i)
        for (int r = 0; r < R; ++r) {
            const int64_t row = i0 + i, n = n0 + r;
            float tail = 0.0f;
            if (from < w.blocks)
                tail = portable_blocks(w, n, a, row, from) +
                       (w.bits == 8 ? 0.0f
                                    : half_to_float(w.offsets[n * w.blocks + from]) *
                                          a.sums[row * a.blocks + from]);
            y[row * N + n] = _mm512_reduce_add_ps(acc[i][r]) + tail;
        }
}

// Rows [i0, i1) in tiles of MT (the caller's rows left over go to a smaller tile).
template <int MT, int R>
void rows_of_group(const Weights& w, const Acts& a, int64_t i0, int64_t i1, int64_t n0,
                   float* y, int64_t N) {
    int64_t i = i0;
    for (; i + MT <= i1; i += MT) tile<MT, R>(w, a, i, n0, y, N);
    for (; i < i1; ++i) tile<1, R>(w, a, i, n0, y, N);
}

template <int MT, int R>
void row_block(const Weights& w, const Acts& a, int64_t i0, int64_t i1, float* y, int64_t N) {
    const int64_t groups = N / R;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; ++g) rows_of_group<MT, R>(w, a, i0, i1, g * R, y, N);
    for (int64_t n = groups * R; n < N; ++n)
        for (int64_t i = i0; i < i1; ++i) tile<1, 1>(w, a, i, n, y, N);
}

// Threads own groups of R output features. Tiles of MT rows share each weight load MT
// ways; a block of 128 rows keeps its activations (128 x K bytes) in L2 while the
// weights stream past, once per block. A single row (decode, one stream) reads the
// weights from DRAM: there R = 1 keeps a thread's reads one sequential stream (codes
// rows one after the other), where R = 4 interleaved four rows' codes and scales (eight
// short streams): 28-29 GB/s of codes against 20-21 GB/s on the 1B shape's LM head
// (docs/benchmarks.md, "The 8-bit route at one row").
void compute(const Weights& w, const Acts& a, float* y, int64_t M, int64_t N) {
    constexpr int64_t kRowBlock = 128;
    for (int64_t i0 = 0; i0 < M; i0 += kRowBlock) {
        const int64_t i1 = std::min(M, i0 + kRowBlock), rows = i1 - i0;
        if (rows >= 4) row_block<4, 2>(w, a, i0, i1, y, N);
        else if (rows == 3) row_block<3, 2>(w, a, i0, i1, y, N);
        else if (rows == 2) row_block<2, 4>(w, a, i0, i1, y, N);
        else row_block<1, 1>(w, a, i0, i1, y, N);  // one row: see below
    }
}
#else
void compute(const Weights& w, const Acts& a, float* y, int64_t M, int64_t N) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n)
        for (int64_t i = 0; i < M; ++i)
            y[i * N + n] = portable_blocks(w, n, a, i, 0) + offset_part(w, n, &a.sums[i * a.blocks]);
}
#endif

}  // namespace

extern "C" {

// 1 if this build runs the integer dots on AVX512-VNNI, 0 if on portable code.
int kvflow_int8_linear_isa() {
#if defined(KVFLOW_VNNI)
    return 1;
#else
    return 0;
#endif
}

// x float32 [rows, in_features] (row stride x_row_stride, unit column stride); codes,
// scales, offsets (half floats) as in the header comment; bias float32 [out_features] or null; y
// float32 [rows, out_features] contiguous. Returns 0, or nonzero for bad arguments.
int kvflow_int8_linear(int bits, const float* x, const uint8_t* codes, const uint16_t* scales,
                       const uint16_t* offsets, const float* bias, float* y, int64_t rows,
                       int64_t in_features, int64_t out_features, int64_t x_row_stride) {
    if ((bits != 4 && bits != 8) || in_features <= 0 || in_features % kBlock || rows < 0)
        return 1;
    const int64_t blocks = in_features / kBlock;
    const Weights w{codes, scales, offsets, bits, blocks, blocks * code_bytes_per_block(bits)};
    const Acts a = quantize(x, rows, in_features, x_row_stride);
    compute(w, a, y, rows, out_features);
    if (bias != nullptr)
        for (int64_t i = 0; i < rows; ++i)
            for (int64_t n = 0; n < out_features; ++n) y[i * out_features + n] += bias[n];
    return 0;
}

// x quantized as the kernel does it, for tests: digits q, r int8 [rows, in_features] in
// natural order (not the unit layout), e float32 [rows, in_features / 32], s likewise.
int kvflow_int8_quantize_rows(const float* x, int8_t* q, int8_t* r, float* e, float* s,
                              int64_t rows, int64_t in_features) {
    if (in_features <= 0 || in_features % kBlock) return 1;
    const int64_t blocks = in_features / kBlock;
    const Acts a = quantize(x, rows, in_features, in_features);
    for (int64_t i = 0; i < rows; ++i)
        for (int64_t b = 0; b < blocks; ++b) {
            for (int h = 0; h < 2; ++h) {
                const int64_t to = i * in_features + b * kBlock + h * kHalf;
                const int64_t from = i * in_features + half_offset(b, h, blocks);
                std::memcpy(q + to, &a.q[from], kHalf);
                std::memcpy(r + to, &a.r[from], kHalf);
            }
            e[i * blocks + b] = a.scale4[i * 4 * blocks + 4 * b] * 256.0f;
            s[i * blocks + b] = a.sums[i * blocks + b];
        }
    return 0;
}

}  // extern "C"
