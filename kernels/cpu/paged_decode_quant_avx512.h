// The AVX-512 loops of the paged decode attention over a quantized cache
// (paged_decode_quant.h has the format and the portable loops); head_dim % 32 == 0.
// Tiles of 16 context rows as in paged_decode_avx512.h, whose reduce16, exp and
// softmax they share.
//
// Codes to float32, 16 at a time: int8 by sign extension and vcvtdq2ps; fp8 by moving
// the bits into float16 and vcvtph2ps, which converts float16 subnormals exactly
// (MXCSR.DAZ does not apply to it): e5m2 is the top byte of a float16 (b << 8); e4m3's
// sign, exponent and mantissa land in a float16 whose exponent bias is 8 larger,
// ((b & 0x80) << 8) | ((b & 0x7F) << 7), so the value read is the code / 256 and the
// 256 joins the row's scale.
//
// int8 keys with AVX512_VNNI: the query is rounded once per task to int16 (relative
// error 2^-16 of its largest element) and vpdpwssd multiplies 32 sign-extended key
// codes per instruction with exact int32 sums, as many instructions per row as the
// bf16 path's vdpbf16ps.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#include "paged_decode_avx512.h"
#include "paged_decode_quant.h"

namespace kvflow_cpu {
namespace quant {
namespace avx512q {

using avx512::kTile;

// What codes16 must be multiplied by to give the code's value.
template <int C>
constexpr float code_factor() {
    return C == kE4M3 ? 256.0f : 1.0f;
}

// 16 codes from p as float32 (times 1 / code_factor).
template <int C>
inline __m512 codes16(const uint8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (C == kInt8) {
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    } else {
        const __m256i x = _mm256_cvtepu8_epi16(b);
        __m256i h;
        if constexpr (C == kE5M2) {
            h = _mm256_slli_epi16(x, 8);
        } else {
            h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8),
                                _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7F)), 7));
        }
        return _mm512_cvtph_ps(h);
    }
}

// Whether int8 keys are scored with vpdpwssd on an int16 query.
template <int C>
constexpr bool vnni_keys() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return C == kInt8;
#else
    return false;
#endif
}

// Whether int8 keys are scored with vpdpbusd on an int8 query (bfloat16 queries only:
// see score_tile_bytes); the other VNNI int8 cases keep the int16 query.
template <int C, typename T>
constexpr bool byte_query() {
    return vnni_keys<C>() && sizeof(T) == 2;
}

// The scales of the tile's 16 rows (rows past count repeat a valid row), gathered in
// registers: GCC makes a loop of loads a vpgatherqd, which Zen 4 runs as microcode (it
// was a quarter of the int8 value pass), and 16 scalar stores read back as one vector
// wait for the stores to retire (no store forwarding).
inline __m512 tile_scales(const uint8_t* const* rows, int64_t D) {
    __m128 q[4];
    for (int k = 0; k < 4; ++k) {
        const __m128 a = _mm_load_ss(reinterpret_cast<const float*>(rows[4 * k] + D));
        const __m128 b = _mm_load_ss(reinterpret_cast<const float*>(rows[4 * k + 1] + D));
        const __m128 c = _mm_load_ss(reinterpret_cast<const float*>(rows[4 * k + 2] + D));
        const __m128 d = _mm_load_ss(reinterpret_cast<const float*>(rows[4 * k + 3] + D));
        q[k] = _mm_movelh_ps(_mm_unpacklo_ps(a, b), _mm_unpacklo_ps(c, d));
    }
    const __m256 lo = _mm256_insertf128_ps(_mm256_castps128_ps256(q[0]), q[1], 1);
    const __m256 hi = _mm256_insertf128_ps(_mm256_castps128_ps256(q[2]), q[3], 1);
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)),
                                               _mm256_castps_pd(hi), 1));
}

// The tile's K codes converted once for the G query heads that score them: int16 for
// vpdpwssd (VNNI keys), else float32 (times 1 / code_factor); row r at r * D elements
// of `buf` (room for kTile * D floats, 64-byte aligned). Converting per head instead
// costs ~15% more at W1's shape (G = 3; measured).
template <int C>
inline void convert_tile(const uint8_t* const* rows, int64_t D, float* buf) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if constexpr (vnni_keys<C>()) {
        int16_t* bi = reinterpret_cast<int16_t*>(buf);
        for (int r = 0; r < kTile; ++r)
            for (int64_t c = 0; c < D; c += 32)
                _mm512_store_si512(bi + r * D + c, _mm512_cvtepi8_epi16(_mm256_loadu_si256(
                                                       reinterpret_cast<const __m256i*>(rows[r] + c))));
        return;
    }
#endif
    for (int r = 0; r < kTile; ++r)
        for (int64_t c = 0; c < D; c += 16) _mm512_store_ps(buf + r * D + c, codes16<C>(rows[r] + c));
}

// scores[0 .. count) of one query head against the tile converted by convert_tile
// (`buf`): qf is q * scale (float path), qi the int16 query (VNNI path); `scales` the
// rows' scales times post (the query's factor).
template <int C>
inline void score_tile(const float* buf, int count, int64_t D, const float* qf,
                       const int16_t* qi, __m512 scales, float* scores) {
    __m512 acc[kTile];
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if constexpr (vnni_keys<C>()) {
        (void)qf;
        const int16_t* bi = reinterpret_cast<const int16_t*>(buf);
        __m512i iacc[kTile];
        for (int r = 0; r < kTile; ++r) iacc[r] = _mm512_setzero_si512();
        for (int64_t c = 0; c < D; c += 32) {
            const __m512i qc = _mm512_loadu_si512(qi + c);
#pragma GCC unroll 16
            for (int r = 0; r < kTile; ++r)
                iacc[r] = _mm512_dpwssd_epi32(iacc[r], qc, _mm512_load_si512(bi + r * D + c));
        }
        for (int r = 0; r < kTile; ++r) acc[r] = _mm512_cvtepi32_ps(iacc[r]);
    } else
#endif
    {
        (void)qi;
        for (int r = 0; r < kTile; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t c = 0; c < D; c += 16) {
            const __m512 qc = _mm512_loadu_ps(qf + c);
#pragma GCC unroll 16
            for (int r = 0; r < kTile; ++r)
                acc[r] = _mm512_fmadd_ps(qc, _mm512_load_ps(buf + r * D + c), acc[r]);
        }
    }
    const __m512 s = _mm512_mul_ps(avx512::reduce16(acc), scales);
    _mm512_mask_storeu_ps(scores, static_cast<__mmask16>((1u << count) - 1), s);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// The byte path (byte_query): vpdpbusd multiplies unsigned by signed bytes, so the tile's
// K codes become unsigned by flipping their top bit (k + 128) and the query is the
// signed operand, q_i8 = round(q * 127 / max |q|) per head; the 128 * sum(q_i8) this adds
// to every score is one subtraction per 16 scores. A 64-byte row is then one
// instruction per head instead of vpdpwssd's two plus the conversion to int16.
//
// Pair layout: vector p of the converted tile holds two rows' 32-column chunk c side by
// side, [row a | row b], so its 16 int32 sums are 8 partial sums of each row and the
// tile's 16 scores come out of 8 vectors (reduce_pairs: 7 adds) instead of 16 (reduce16:
// 15). Rows are paired (k, k + 4) and (k + 8, k + 12) so that reduce_pairs's steps leave
// row i in lane i.
constexpr int kPairRows[kTile] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

// Writes the tile's K codes + 128 in the pair layout: pair p, chunk c at (p * D / 32 + c)
// * 64 bytes of buf (16 * D bytes in all).
inline void convert_tile_pairs(const uint8_t* const* rows, int64_t D, uint8_t* buf) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int p = 0; p < kTile / 2; ++p) {
        const uint8_t* a = rows[kPairRows[2 * p]];
        const uint8_t* b = rows[kPairRows[2 * p + 1]];
        for (int64_t c = 0; c < D; c += 32) {
            const __m512i x = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + c))),
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + c)), 1);
            _mm512_store_si512(buf + p * 2 * D + 2 * c, _mm512_xor_si512(x, flip));
        }
    }
}

// Lane i = the sum of row i's 8 partials, from the 8 pair vectors (rows as kPairRows).
inline __m512i reduce_pairs(const __m512i* v) {
    __m512i w[4];
    for (int k = 0; k < 4; ++k)  // 128-bit blocks: block j of w[k] is row 4j + k's 4 partials
        w[k] = _mm512_add_epi32(_mm512_shuffle_i32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_i32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512i x[2];
    for (int k = 0; k < 2; ++k)  // two partials of two rows per block
        x[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(w[2 * k], w[2 * k + 1]),
                                _mm512_unpackhi_epi64(w[2 * k], w[2 * k + 1]));
    const __m512 a = _mm512_castsi512_ps(x[0]), b = _mm512_castsi512_ps(x[1]);
    return _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0))),
                            _mm512_castps_si512(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1))));
}

// scores[0 .. count) of one head from the tile convert_tile_pairs wrote: qb its int8
// query, corr = 128 * sum(qb), scales the rows' scales times the query's factor.
inline void score_tile_bytes(const uint8_t* buf, int count, int64_t D, const int8_t* qb,
                             int32_t corr, __m512 scales, float* scores) {
    __m512i acc[kTile / 2];
    for (int p = 0; p < kTile / 2; ++p) acc[p] = _mm512_setzero_si512();
    for (int64_t c = 0; c < D; c += 32) {
        const __m512i qc = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + c)));
#pragma GCC unroll 8
        for (int p = 0; p < kTile / 2; ++p)
            acc[p] = _mm512_dpbusd_epi32(acc[p], _mm512_load_si512(buf + p * 2 * D + 2 * c), qc);
    }
    const __m512i sums = _mm512_sub_epi32(reduce_pairs(acc), _mm512_set1_epi32(corr));
    const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(sums), scales);
    _mm512_mask_storeu_ps(scores, static_cast<__mmask16>((1u << count) - 1), s);
}
#endif

// acc[g][col .. col + 16P) += sum over rows r < count of w[g * kTile + r] * codes_r, for
// GB heads (accumulators acc + g * D).
template <int C, int GB, int P>
inline void accumulate_cols(const uint8_t* const* rows, int count, int64_t col, const float* w,
                            float* acc, int64_t D) {
    __m512 a[GB][P];
    for (int g = 0; g < GB; ++g)
        for (int i = 0; i < P; ++i) a[g][i] = _mm512_loadu_ps(acc + g * D + col + 16 * i);
    for (int r = 0; r < count; ++r) {
        __m512 v[P];
        for (int i = 0; i < P; ++i) v[i] = codes16<C>(rows[r] + col + 16 * i);
        for (int g = 0; g < GB; ++g) {
            const __m512 wg = _mm512_set1_ps(w[g * kTile + r]);
            for (int i = 0; i < P; ++i) a[g][i] = _mm512_fmadd_ps(wg, v[i], a[g][i]);
        }
    }
    for (int g = 0; g < GB; ++g)
        for (int i = 0; i < P; ++i) _mm512_storeu_ps(acc + g * D + col + 16 * i, a[g][i]);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// accumulate_cols for int8 values with VNNI: the tile's weights of each head are rounded
// to int16 (w * mult[g], mult = 32767 / the tile's largest weight of that head, so the
// error is at most 2^-16 of that weight), rows are taken in pairs, sign-extended to int16
// and interleaved (unpacklo/hi_epi16) so that one vpdpwssd adds w_r * v_r + w_r+1 * v_r+1
// in exact int32 (16 rows * 32767 * 127 < 2^31); each tile's sums join the float
// accumulators once, divided by mult. Accumulator layout: that of the bf16 pairs,
// avx512::acc_index<Bf16> with AVX512_BF16 (see pair_index below).
template <int GB, int P>
inline void accumulate_cols_vnni(const uint8_t* const* rows, int count, int64_t col,
                                 const uint32_t* pairs, const float* inv_mult, float* acc,
                                 int64_t D) {
    __m512i a[GB][2 * P];
    for (int g = 0; g < GB; ++g)
        for (int i = 0; i < 2 * P; ++i) a[g][i] = _mm512_setzero_si512();
    for (int r = 0; r < count; r += 2) {
        __m512i v[2 * P];
        for (int i = 0; i < P; ++i) {
            const __m512i x = _mm512_cvtepi8_epi16(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[r] + col + 32 * i)));
            const __m512i y = _mm512_cvtepi8_epi16(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[r + 1] + col + 32 * i)));
            v[2 * i] = _mm512_unpacklo_epi16(x, y);
            v[2 * i + 1] = _mm512_unpackhi_epi16(x, y);
        }
        for (int g = 0; g < GB; ++g) {
            const __m512i w = _mm512_set1_epi32(static_cast<int>(pairs[g * kTile / 2 + r / 2]));
            for (int i = 0; i < 2 * P; ++i) a[g][i] = _mm512_dpwssd_epi32(a[g][i], v[i], w);
        }
    }
    for (int g = 0; g < GB; ++g) {
        const __m512 inv = _mm512_set1_ps(inv_mult[g]);
        for (int i = 0; i < 2 * P; ++i) {
            float* dst = acc + g * D + col + 16 * i;
            _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[g][i]), inv, _mm512_loadu_ps(dst)));
        }
    }
}
#endif

// Whether int8 values are accumulated by accumulate_cols_vnni (pair layout).
template <int C>
constexpr bool vnni_values() {
    return vnni_keys<C>();
}

// The accumulator of element d.
template <int C>
inline int64_t acc_index(int64_t d) {
    if (vnni_values<C>()) return (d & ~31) + ((d & 7) >= 4) * 16 + ((d & 31) / 8) * 4 + (d & 3);
    return d;
}

// All G heads of one KV head over a V tile: weights p * s_v (* code_factor), then columns
// in groups of 64 (32 for the rest) and heads in groups of at most 4 (registers).
template <int C>
inline void accumulate_tile(const uint8_t* const* rows, int count, int64_t D, int64_t G,
                            const float* p, int64_t n, float* acc) {
    const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
    const __m512 sv = _mm512_mul_ps(tile_scales(rows, D), _mm512_set1_ps(code_factor<C>()));
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t gb = std::min<int64_t>(4, G - g0);
        alignas(64) float w[4 * kTile];
        for (int64_t g = 0; g < gb; ++g)
            _mm512_store_ps(w + g * kTile, _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, p + (g0 + g) * n), sv));
        float* ag = acc + g0 * D;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        if constexpr (vnni_values<C>()) {
            alignas(64) uint32_t pairs[4 * kTile / 2];
            float inv_mult[4];
            for (int64_t g = 0; g < gb; ++g) {
                const __m512 wg = _mm512_load_ps(w + g * kTile);
                const float wmax = _mm512_reduce_max_ps(wg);
                const float mult = wmax > 0.0f ? 32767.0f / wmax : 0.0f;
                inv_mult[g] = wmax > 0.0f ? wmax / 32767.0f : 0.0f;
                // 16 int32 -> 16 int16 = 8 pairs (row 2i low, 2i + 1 high)
                const __m256i wi = _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(wg, _mm512_set1_ps(mult))));
                _mm256_store_si256(reinterpret_cast<__m256i*>(pairs + g * kTile / 2), wi);
            }
            for (int64_t col = 0; col < D; col += 64) {
                const bool wide = col + 64 <= D;
#define KVFLOW_ACC(GB)                                                                   \
    (wide ? accumulate_cols_vnni<GB, 2>(rows, count, col, pairs, inv_mult, ag, D)     \
          : accumulate_cols_vnni<GB, 1>(rows, count, col, pairs, inv_mult, ag, D))
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
#define KVFLOW_ACC(GB)                                                        \
    (wide ? accumulate_cols<C, GB, 4>(rows, count, col, w, ag, D)          \
          : accumulate_cols<C, GB, 2>(rows, count, col, w, ag, D))
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

// Allocates 64-byte aligned (the converted tile is read with aligned loads).
template <typename T>
struct AlignedAlloc {
    using value_type = T;
    AlignedAlloc() = default;
    template <typename U>
    AlignedAlloc(const AlignedAlloc<U>&) {}
    T* allocate(std::size_t n) {
        return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
    }
    void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
    bool operator==(const AlignedAlloc&) const { return true; }
    bool operator!=(const AlignedAlloc&) const { return false; }
};

// Per-thread buffers.
struct Scratch {
    std::vector<float> q, acc, scores, denom, post;
    std::vector<int16_t> qi;
    std::vector<int8_t> qb;      // [heads, D] (byte_query)
    std::vector<int32_t> corr;   // [heads]: 128 * sum of the head's qb
    std::vector<int64_t> rows;
    std::vector<float, AlignedAlloc<float>> tile;  // [kTile, D] (convert_tile)  // [n]: byte offset of each visible position's slot
};

// The query of each head, prepared for score_tile: q * scale, and for VNNI keys the
// int16 rounding of it with post = 1 / its multiplier. post also carries code_factor.
template <int C, typename T>
inline void prepare_queries(const T* q, int64_t heads, int64_t D, float scale, Scratch& w) {
    w.q.resize(heads * D);
    w.qi.resize(heads * D);
    w.qb.resize(heads * D);
    w.corr.resize(heads);
    w.post.resize(heads);
    for (int64_t h = 0; h < heads; ++h) {
        float* qf = w.q.data() + h * D;
        float amax = 0.0f;
        for (int64_t d = 0; d < D; ++d) {
            qf[d] = load(q[h * D + d]) * scale;
            amax = std::max(amax, std::fabs(qf[d]));
        }
        w.post[h] = code_factor<C>();
        if (byte_query<C, T>()) {
            const float mult = amax > 0.0f ? 127.0f / amax : 0.0f;
            int32_t sum = 0;
            for (int64_t d = 0; d < D; ++d) {
                const int8_t v = static_cast<int8_t>(std::nearbyint(qf[d] * mult));
                w.qb[h * D + d] = v;
                sum += v;
            }
            w.corr[h] = 128 * sum;
            w.post[h] = amax > 0.0f ? amax / 127.0f : 0.0f;
        } else if (vnni_keys<C>()) {
            const float mult = amax > 0.0f ? 32767.0f / amax : 0.0f;
            for (int64_t d = 0; d < D; ++d)
                w.qi[h * D + d] = static_cast<int16_t>(std::nearbyint(qf[d] * mult));
            w.post[h] = amax > 0.0f ? amax / 32767.0f : 0.0f;
        }
    }
}

// One task (see attend_one_avx512 of paged_decode_attention.cpp, which this follows):
// `slot_of(i0, f)` calls f(i, slot, count) per run of the block table.
template <int C, typename T, typename Runs>
void attend_one(const T* q, const uint8_t* k_cache, const uint8_t* v_cache, int64_t n,
                int64_t kv_begin, int64_t kv_end, T* out, int64_t G, int64_t D, int64_t KH,
                float scale, Runs&& runs, Scratch& w) {
    const int64_t heads = (kv_end - kv_begin) * G, h0 = kv_begin * G, kv_heads = kv_end - kv_begin;
    const int64_t row_bytes = D + kScaleBytes, slot_bytes = KH * row_bytes;
    const int64_t fetch_bytes = kv_heads * row_bytes;
    w.rows.resize(n);
    runs([&](int64_t i0, int64_t slot, int64_t count, int64_t) {
        for (int64_t i = 0; i < count; ++i)
            w.rows[i0 + i] = (slot + i) * slot_bytes + kv_begin * row_bytes;
    });
    prepare_queries<C>(q + h0 * D, heads, D, scale, w);
    w.scores.resize(heads * n);
    w.denom.resize(heads);
    w.acc.assign(heads * D, 0.0f);
    w.tile.resize(kTile * D);
    float* scores = w.scores.data();
    const int64_t* offsets = w.rows.data();
    // One prefetch cursor over the K rows then the V rows (positions 0 .. 2n), kept
    // kAhead rows ahead of the rows in use, so V's first rows are on the way while K's
    // last are scored. Rows of 68 bytes straddle cache lines and the rows of a block are
    // adjacent: each line is asked for once (a prefetch that waits on a full miss queue
    // stalls).
    constexpr int64_t kAhead = 2 * kTile;  // 4 or 8 tiles: no faster (measured)
    int64_t cursor = 0;
    uintptr_t first_line = 0, next_line = 0;  // the lines asked for by the last row
    auto prefetch_until = [&](int64_t end) {
        for (end = std::min(end, 2 * n); cursor < end; ++cursor) {
            const uint8_t* cache = cursor < n ? k_cache : v_cache;
            const uintptr_t begin = reinterpret_cast<uintptr_t>(cache + offsets[cursor < n ? cursor : cursor - n]);
            uintptr_t line = begin & ~uintptr_t{63};
            if (line >= first_line && line < next_line) line = next_line;  // the row after
            else first_line = line;
            for (; line < begin + fetch_bytes; line += 64)
                asm volatile("prefetcht2 %0" : : "m"(*reinterpret_cast<const char*>(line)));
            next_line = line;
        }
    };
    // Calls f(t0, count, rows, prefetch) per tile; f calls prefetch(i) at step i of
    // `steps` over its work, which moves the cursor a share of a tile on (a burst of a
    // tile's lines at once stalls on the full miss queue; paged_decode_attention.cpp).
    auto for_each_tile = [&](const uint8_t* cache, int64_t steps, auto&& f) {
        const uint8_t* rows[kTile];
        const int64_t base = cache == k_cache ? 0 : n, share = (kTile + steps - 1) / steps;
        for (int64_t t0 = 0; t0 < n; t0 += kTile) {
            const int count = static_cast<int>(std::min<int64_t>(kTile, n - t0));
            const int64_t from = base + t0 + kAhead;
            auto prefetch = [&](int64_t i) { prefetch_until(from + (i + 1) * share); };
            for (int r = 0; r < kTile; ++r) rows[r] = cache + offsets[t0 + (r < count ? r : 0)];
            f(t0, count, rows, prefetch);
        }
    };
    prefetch_until(kAhead);
    for_each_tile(k_cache, heads, [&](int64_t t0, int count, const uint8_t* const* rows, auto&& prefetch) {
        const uint8_t* kv_rows[kTile];
        for (int64_t kh = 0; kh < kv_heads; ++kh) {
            for (int r = 0; r < kTile; ++r) kv_rows[r] = rows[r] + kh * row_bytes;
            const __m512 sk = tile_scales(kv_rows, D);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
            if constexpr (byte_query<C, T>()) {
                const uint8_t* buf = reinterpret_cast<const uint8_t*>(w.tile.data());
                convert_tile_pairs(kv_rows, D, reinterpret_cast<uint8_t*>(w.tile.data()));
                for (int64_t h = kh * G; h < (kh + 1) * G; ++h) {
                    prefetch(h);
                    score_tile_bytes(buf, count, D, w.qb.data() + h * D, w.corr[h],
                                     _mm512_mul_ps(sk, _mm512_set1_ps(w.post[h])), scores + h * n + t0);
                }
                continue;
            }
#endif
            convert_tile<C>(kv_rows, D, w.tile.data());
            for (int64_t h = kh * G; h < (kh + 1) * G; ++h) {
                prefetch(h);
                score_tile<C>(w.tile.data(), count, D, w.q.data() + h * D,
                              w.qi.data() + h * D, _mm512_mul_ps(sk, _mm512_set1_ps(w.post[h])),
                              scores + h * n + t0);
            }
        }
    });
    avx512::softmax_numerators<false>(scores, heads, n, w.denom.data());
    for_each_tile(v_cache, kv_heads, [&](int64_t t0, int count, const uint8_t* const* rows, auto&& prefetch) {
        const uint8_t* kv_rows[kTile];
        for (int64_t kh = 0; kh < kv_heads; ++kh) {
            prefetch(kh);
            for (int r = 0; r < kTile; ++r) kv_rows[r] = rows[r] + kh * row_bytes;
            accumulate_tile<C>(kv_rows, count, D, G, scores + kh * G * n + t0, n,
                               w.acc.data() + kh * G * D);
        }
    });
    for (int64_t h = 0; h < heads; ++h) {
        const float inv = 1.0f / w.denom[h];
        for (int64_t d = 0; d < D; ++d)
            store(out + (h0 + h) * D + d, w.acc[h * D + acc_index<C>(d)] * inv);
    }
}

}  // namespace avx512q
}  // namespace quant
}  // namespace kvflow_cpu
