// The AVX-512 inner loops of the paged decode attention (paged_decode_attention.cpp),
// compiled only where -march enables AVX-512F; elsewhere the portable f32x8 loops run.
//
// Why tiles of 16 context rows: one K row's score against one query head is a dot
// product whose 16 partial sums sit in one vector, and reducing each alone (a horizontal
// sum per row and head) costs more than the dot product itself. Sixteen rows' vectors
// are reduced together instead (reduce16: 15 shuffle-and-add steps give one vector of
// the 16 scores), and rows are gathered into a tile through the block table, so small
// blocks fill whole tiles too.
//
// bfloat16: with AVX512_BF16 a K row is multiplied as bf16 pairs (vdpbf16ps: exact
// products, float32 sums) against the query's own bf16 values, unscaled, so nothing is
// rounded that the model did not already round; the scale multiplies the 16 scores.
// Without it, and for V in every case, a vector of 32 bf16 becomes two float32 vectors
// by shifts and masks alone: its even elements (x << 16) and its odd ones (x & ~0xFFFF).
// Accumulators of bf16 rows therefore hold each 32-element chunk as [16 even | 16 odd],
// which `unsplit` puts back in order once per head.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "vec.h"

namespace kvflow_cpu {
namespace avx512 {

constexpr int kTile = 16;

// Lane i of the result is the sum of v[i]'s 16 lanes. Inputs are taken in the order
// s -> v[4 * (s % 4) + s / 4], which the steps below transpose back into place.
inline __m512 reduce16(const __m512* v) {
    __m512 pairs[8], quads[4], octs[2];
    for (int k = 0; k < 8; ++k) {  // 128-bit halves: lanes 0-7 keep a's partials, 8-15 b's
        const int s0 = 2 * k, s1 = 2 * k + 1;
        const __m512 a = v[4 * (s0 % 4) + s0 / 4], b = v[4 * (s1 % 4) + s1 / 4];
        pairs[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    }
    for (int k = 0; k < 4; ++k) {  // 128-bit lanes: one source vector's partials per lane
        const __m512 a = pairs[2 * k], b = pairs[2 * k + 1];
        quads[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
    }
    for (int k = 0; k < 2; ++k) {  // 64-bit pairs within each lane
        const __m512d a = _mm512_castps_pd(quads[2 * k]), b = _mm512_castps_pd(quads[2 * k + 1]);
        octs[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    return _mm512_add_ps(_mm512_shuffle_ps(octs[0], octs[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(octs[0], octs[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// 32 bf16 -> their even and odd elements as float32 (see the file comment).
inline __m512 bf16_even(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
inline __m512 bf16_odd(__m512i x) {
    return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Element d of a head_dim-long row, in the layout its accumulators use.
inline int64_t split_index(int64_t d) { return (d & ~31) + (d & 1) * 16 + (d & 31) / 2; }

// The query of one head, prepared once per task for the score loop:
// float32 rows: q * scale; bf16 rows with AVX512_BF16: the bf16 bits as they are;
// bf16 rows without: q * scale in the split layout.
template <typename T>
inline void prepare_query(const T* q, int64_t D, float scale, float* qf, uint16_t* qb) {
    if constexpr (sizeof(T) == 4) {
        for (int64_t d = 0; d < D; ++d) qf[d] = load(q[d]) * scale;
    } else {
#if defined(__AVX512BF16__)
        (void)qf, (void)scale;
        std::memcpy(qb, q, D * sizeof(T));
#else
        (void)qb;
        for (int64_t d = 0; d < D; ++d) qf[split_index(d)] = load(q[d]) * scale;
#endif
    }
}

// The scale the score loop leaves to be applied to the 16 sums.
template <typename T>
inline float deferred_scale(float scale) {
#if defined(__AVX512BF16__)
    if constexpr (sizeof(T) == 2) return scale;
#endif
    (void)scale;
    return 1.0f;
}

// scores[0 .. count) = the query head (prepared as above) against the tile's rows
// rows[r] (each D elements of this KV head; rows past count repeat a valid row).
template <typename T>
inline void score_tile(const T* const* rows, int count, int64_t D, const float* qf,
                       const uint16_t* qb, float post_scale, float* scores) {
    __m512 acc[kTile];
    for (int r = 0; r < kTile; ++r) acc[r] = _mm512_setzero_ps();
    if constexpr (sizeof(T) == 4) {
        (void)qb;
        for (int64_t c = 0; c < D; c += 16) {
            const __m512 qc = _mm512_loadu_ps(qf + c);
#pragma GCC unroll 16
            for (int r = 0; r < kTile; ++r)
                acc[r] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(reinterpret_cast<const float*>(rows[r]) + c), acc[r]);
        }
    } else {
#if defined(__AVX512BF16__)
        (void)qf;
        for (int64_t c = 0; c < D; c += 32) {
            const __m512bh qc = (__m512bh)_mm512_loadu_si512(qb + c);
#pragma GCC unroll 16
            for (int r = 0; r < kTile; ++r)
                acc[r] = _mm512_dpbf16_ps(acc[r], qc, (__m512bh)_mm512_loadu_si512(rows[r] + c));
        }
#else
        (void)qb;
        for (int64_t c = 0; c < D; c += 32) {
            const __m512 qe = _mm512_loadu_ps(qf + c), qo = _mm512_loadu_ps(qf + c + 16);
#pragma GCC unroll 16
            for (int r = 0; r < kTile; ++r) {
                const __m512i k = _mm512_loadu_si512(rows[r] + c);
                acc[r] = _mm512_fmadd_ps(qo, bf16_odd(k), _mm512_fmadd_ps(qe, bf16_even(k), acc[r]));
            }
        }
#endif
    }
    const __m512 s = _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(post_scale));
    _mm512_mask_storeu_ps(scores, static_cast<__mmask16>((1u << count) - 1), s);
}

#if defined(__AVX512BF16__)
// Scores of the G <= 4 query heads of one KV head against a tile of bf16 rows at once.
// Why: score_tile leaves each row's 16 partial sums in a vector of its own and pays a
// 16-vector reduction per head (45 shuffles and adds for 16 scores, three times at
// G = 3). Here each 128-bit block of a vector belongs to one head: the query vector of
// columns 8c .. 8c + 7 holds the 8 columns of each head side by side ([head 0 | head 1 |
// head 2 | head 3], see pack_heads), the row's 8 columns are broadcast to all four
// blocks, and one vdpbf16ps gives 4 partial sums of the row for every head. One
// reduction (44 shuffles and adds) then yields all heads' 16 scores. The products and
// sums are the same float32 arithmetic as score_tile's, in another order.
constexpr int kHeadSlots = 4;

// q of heads h0 .. h0 + G - 1 (bf16 bits, D each) in the layout above: D / 8 vectors of
// 32 bf16, the blocks of missing heads zero.
inline void pack_heads(const uint16_t* q, int64_t G, int64_t D, uint16_t* packed) {
    for (int64_t c = 0; c < D / 8; ++c)
        for (int64_t j = 0; j < kHeadSlots; ++j)
            for (int64_t e = 0; e < 8; ++e)
                packed[(c * kHeadSlots + j) * 8 + e] = j < G ? q[j * D + 8 * c + e] : 0;
}

// scores[j * n + 0 .. count) for the G heads packed by pack_heads, times post_scale.
inline void score_tile_heads(const Bf16* const* rows, int count, int64_t D, const uint16_t* packed,
                             int64_t G, float post_scale, float* scores, int64_t n) {
    __m512 acc[kTile];
    for (int r = 0; r < kTile; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D / 8; ++c) {
        const __m512bh qc = (__m512bh)_mm512_loadu_si512(packed + c * 32);
#pragma GCC unroll 16
        for (int r = 0; r < kTile; ++r) {
            const __m512i k = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + 8 * c)));
            acc[r] = _mm512_dpbf16_ps(acc[r], qc, (__m512bh)k);
        }
    }
    __m512 y[4];  // block j of y[m]: head j's scores of rows 4m .. 4m + 3
    for (int m = 0; m < 4; ++m) {
        __m512 x[2];
        for (int i = 0; i < 2; ++i) {  // rows 4m + 2i, 4m + 2i + 1: two partials each per block
            const __m512d a = _mm512_castps_pd(acc[4 * m + 2 * i]), b = _mm512_castps_pd(acc[4 * m + 2 * i + 1]);
            x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
        }
        y[m] = _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
    }
    // 4 x 4 transpose of 128-bit blocks: head j's 16 scores in one vector
    const __m512 t0 = _mm512_shuffle_f32x4(y[0], y[1], 0x44), t1 = _mm512_shuffle_f32x4(y[0], y[1], 0xEE);
    const __m512 t2 = _mm512_shuffle_f32x4(y[2], y[3], 0x44), t3 = _mm512_shuffle_f32x4(y[2], y[3], 0xEE);
    const __m512 out[4] = {_mm512_shuffle_f32x4(t0, t2, 0x88), _mm512_shuffle_f32x4(t0, t2, 0xDD),
                           _mm512_shuffle_f32x4(t1, t3, 0x88), _mm512_shuffle_f32x4(t1, t3, 0xDD)};
    const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
    const __m512 ps = _mm512_set1_ps(post_scale);
    for (int64_t j = 0; j < G; ++j) _mm512_mask_storeu_ps(scores + j * n, valid, _mm512_mul_ps(out[j], ps));
}
#endif

// Whether bf16 rows of G query heads per KV head are scored by score_tile_heads.
template <typename T>
inline bool heads_together(int64_t G) {
#if defined(__AVX512BF16__)
    return sizeof(T) == 2 && G >= 2 && G <= kHeadSlots;
#else
    (void)G;
    return false;
#endif
}

// Loads the 2 * P float32 vectors of 32 * P elements (split layout for bf16).
template <int P>
inline void load_cols(const float* row, __m512* v) {
    for (int i = 0; i < 2 * P; ++i) v[i] = _mm512_loadu_ps(row + 16 * i);
}
template <int P>
inline void load_cols(const Bf16* row, __m512* v) {
    for (int i = 0; i < P; ++i) {
        const __m512i x = _mm512_loadu_si512(row + 32 * i);
        v[2 * i] = bf16_even(x), v[2 * i + 1] = bf16_odd(x);
    }
}

// acc[g][0 .. 32P) += sum over the tile's rows r < count of p[g][r] * rows[r][0 .. 32P),
// for GB heads whose weights are p[g * n + r] and accumulators acc + g * acc_stride.
template <int GB, int P, typename T>
inline void accumulate_cols(const T* const* rows, int count, int64_t col, const float* p,
                            int64_t n, float* acc, int64_t acc_stride) {
    __m512 a[GB][2 * P];
    for (int g = 0; g < GB; ++g)
        for (int i = 0; i < 2 * P; ++i) a[g][i] = _mm512_loadu_ps(acc + g * acc_stride + col + 16 * i);
    for (int r = 0; r < count; ++r) {
        __m512 v[2 * P];
        load_cols<P>(rows[r] + col, v);
        for (int g = 0; g < GB; ++g) {
            const __m512 w = _mm512_set1_ps(p[g * n + r]);
            for (int i = 0; i < 2 * P; ++i) a[g][i] = _mm512_fmadd_ps(w, v[i], a[g][i]);
        }
    }
    for (int g = 0; g < GB; ++g)
        for (int i = 0; i < 2 * P; ++i) _mm512_storeu_ps(acc + g * acc_stride + col + 16 * i, a[g][i]);
}

#if defined(__AVX512BF16__)
// accumulate_cols for bf16 rows with AVX512_BF16: rows are taken in pairs, interleaved
// (unpacklo/hi_epi16) so that one vdpbf16ps adds p[r] * v[r] + p[r + 1] * v[r + 1]; the
// weights are bf16 already (softmax_numerators rounded them). Accumulator layout of a
// 32-element chunk: [elements 8k + 0..3 of k = 0..3 | elements 8k + 4..7], see pair_index.
template <int GB, int P>
inline void accumulate_cols_pairs(const Bf16* const* rows, int count, int64_t col,
                                  const uint32_t* pairs, float* acc, int64_t acc_stride) {
    __m512 a[GB][2 * P];
    for (int g = 0; g < GB; ++g)
        for (int i = 0; i < 2 * P; ++i) a[g][i] = _mm512_loadu_ps(acc + g * acc_stride + col + 16 * i);
    for (int r = 0; r < count; r += 2) {
        __m512bh v[2 * P];
        for (int i = 0; i < P; ++i) {
            const __m512i x = _mm512_loadu_si512(rows[r] + col + 32 * i);
            const __m512i y = _mm512_loadu_si512(rows[r + 1] + col + 32 * i);
            v[2 * i] = (__m512bh)_mm512_unpacklo_epi16(x, y);
            v[2 * i + 1] = (__m512bh)_mm512_unpackhi_epi16(x, y);
        }
        for (int g = 0; g < GB; ++g) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[g * kTile / 2 + r / 2]));
            for (int i = 0; i < 2 * P; ++i) a[g][i] = _mm512_dpbf16_ps(a[g][i], v[i], w);
        }
    }
    for (int g = 0; g < GB; ++g)
        for (int i = 0; i < 2 * P; ++i) _mm512_storeu_ps(acc + g * acc_stride + col + 16 * i, a[g][i]);
}
#endif

// All G heads and D columns of one KV head over a tile: columns in groups of 64 (32 for
// the rest), heads in groups of at most 4, so the accumulators stay in registers.
template <typename T>
inline void accumulate_tile(const T* const* rows, int count, int64_t D, int64_t G,
                            const float* p, int64_t n, float* acc) {
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t gb = std::min<int64_t>(4, G - g0);
        const float* pg = p + g0 * n;
        float* ag = acc + g0 * D;
#if defined(__AVX512BF16__)
        if constexpr (sizeof(T) == 2) {
            // The tile's weights as bf16 pairs (rows 2i, 2i + 1), past count zero.
            uint32_t pairs[4 * kTile / 2];
            const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
            for (int64_t g = 0; g < gb; ++g)
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + g * kTile / 2),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(valid, pg + g * n)));
            for (int64_t col = 0; col < D; col += 64) {
                const bool wide = col + 64 <= D;
#define KVFLOW_ACC(GB)                                                                    \
    (wide ? accumulate_cols_pairs<GB, 2>(rows, count, col, pairs, ag, D)               \
          : accumulate_cols_pairs<GB, 1>(rows, count, col, pairs, ag, D))
                switch (gb) {
                    case 1: KVFLOW_ACC(1); break;
                    case 2: KVFLOW_ACC(2); break;
                    case 3: KVFLOW_ACC(3); break;
                    default: KVFLOW_ACC(4); break;
                }
#undef KVFLOW_ACC
            }
            continue;
        }
#endif
        for (int64_t col = 0; col < D; col += 64) {
            const bool wide = col + 64 <= D;
#define KVFLOW_ACC(GB)                                                                     \
    (wide ? accumulate_cols<GB, 2>(rows, count, col, pg, n, ag, D)                      \
          : accumulate_cols<GB, 1>(rows, count, col, pg, n, ag, D))
            switch (gb) {
                case 1: KVFLOW_ACC(1); break;
                case 2: KVFLOW_ACC(2); break;
                case 3: KVFLOW_ACC(3); break;
                default: KVFLOW_ACC(4); break;
            }
#undef KVFLOW_ACC
        }
    }
}

// exp_approx of vec.h on 16 lanes (the same steps, so both paths round alike).
inline __m512 exp16(__m512 x) {
    const __m512 round = _mm512_set1_ps(12582912.0f);  // 1.5 * 2^23
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 k = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), round), round);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// softmax_numerators of paged_decode_attention.cpp, 16 scores at a time.
// With `round_bf16` the numerators are rounded to bf16 before they are summed, so the
// denominator is the sum of the weights the values are actually multiplied by.
template <bool round_bf16>
inline __m512 maybe_round(__m512 x) {
#if defined(__AVX512BF16__)
    if constexpr (round_bf16) return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(x));
#endif
    return x;
}

template <bool round_bf16>
inline void softmax_numerators(float* scores, int64_t heads, int64_t n, float* denom) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n % 16)) - 1);
    const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t h = 0; h < heads; ++h) {
        float* sh = scores + h * n;
        __m512 m = lowest;
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(sh + i));
        if (tail) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(lowest, tail, sh + i));
        const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        __m512 sum = _mm512_setzero_ps();
        for (i = 0; i + 16 <= n; i += 16) {
            const __m512 e = maybe_round<round_bf16>(exp16(_mm512_sub_ps(_mm512_loadu_ps(sh + i), max)));
            _mm512_storeu_ps(sh + i, e);
            sum = _mm512_add_ps(sum, e);
        }
        if (tail) {
            const __m512 e = maybe_round<round_bf16>(exp16(_mm512_sub_ps(_mm512_mask_loadu_ps(max, tail, sh + i), max)));
            _mm512_mask_storeu_ps(sh + i, tail, e);
            sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
        }
        denom[h] = _mm512_reduce_add_ps(sum);
    }
}

// The accumulator of element d (float32 rows keep the natural order).
template <typename T>
inline int64_t acc_index(int64_t d) {
    if constexpr (sizeof(T) == 4) return d;
#if defined(__AVX512BF16__)
    return (d & ~31) + ((d & 7) >= 4) * 16 + ((d & 31) / 8) * 4 + (d & 3);  // pair layout
#else
    return split_index(d);
#endif
}

// Whether softmax_numerators rounds the weights to bf16 (for accumulate_cols_pairs).
template <typename T>
constexpr bool bf16_weights() {
#if defined(__AVX512BF16__)
    return sizeof(T) == 2;
#else
    return false;
#endif
}

}  // namespace avx512
}  // namespace kvflow_cpu
