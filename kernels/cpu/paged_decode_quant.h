// Paged decode attention over a quantized KV cache (kernels/kv_codec.py's format): each
// (token, KV head) row is head_dim 8-bit codes, then the row's float32 scale, and stands
// for float(code) * scale. Included by paged_decode_attention.cpp.
//
// Why the scales cost nothing: a row's scale factors out of both sums,
//   score_t = s_k,t * sum_d q_d * code_d        out = sum_t (p_t * s_v,t) * code_t,
// so the loops read the codes as small numbers and one multiply per row and head applies
// the scale. The bytes read per row fall from 2 * head_dim (bf16) to head_dim + 4.
//
// These are the portable loops (any -march; vectors of 8 floats where head_dim allows):
// a row's codes are decoded into a float buffer once for its G query heads. fp8 codes
// are decoded through a 256-entry table (exact). The AVX-512 loops are in
// paged_decode_quant_avx512.h.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace kvflow_cpu {
namespace quant {

enum Codec : int { kInt8 = 0, kE4M3 = 1, kE5M2 = 2 };

constexpr int64_t kScaleBytes = 4;

// The exact value of an fp8 code with `man` mantissa bits and exponent bias `bias`
// (OCP formats: e4m3fn has no infinities, and the quantizer never writes a NaN).
inline float fp8_value(uint8_t b, int man, int bias) {
    const int e = (b & 0x7F) >> man, m = b & ((1 << man) - 1);
    const float mag = e == 0 ? std::ldexp(static_cast<float>(m), 1 - bias - man)
                             : std::ldexp(static_cast<float>(m + (1 << man)), e - bias - man);
    return (b & 0x80) ? -mag : mag;
}

template <int C>
inline const float* fp8_table() {
    static const std::vector<float> table = [] {
        std::vector<float> t(256);
        for (int b = 0; b < 256; ++b)
            t[b] = C == kE4M3 ? fp8_value(static_cast<uint8_t>(b), 3, 7)
                              : fp8_value(static_cast<uint8_t>(b), 2, 15);
        return t;
    }();
    return table.data();
}

inline float row_scale(const uint8_t* row, int64_t D) {
    float s;
    std::memcpy(&s, row + D, sizeof s);
    return s;
}

// codes[0 .. D) as floats (unscaled).
template <int C>
inline void decode_row(const uint8_t* codes, int64_t D, float* out) {
    if constexpr (C == kInt8) {
        const int8_t* c = reinterpret_cast<const int8_t*>(codes);
        for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(c[d]);
    } else {
        const float* table = fp8_table<C>();
        for (int64_t d = 0; d < D; ++d) out[d] = table[codes[d]];
    }
}

inline float dot(const float* a, const float* b, int64_t D) {
    int64_t d = 0;
    f32x8 a0 = {}, a1 = {};
    for (; d + 16 <= D; d += 16) {
        a0 += load8(a + d) * load8(b + d);
        a1 += load8(a + d + 8) * load8(b + d + 8);
    }
    for (; d + 8 <= D; d += 8) a0 += load8(a + d) * load8(b + d);
    float sum = hsum(a0 + a1);
    for (; d < D; ++d) sum += a[d] * b[d];
    return sum;
}

// Per-thread buffers of the portable loops.
struct QuantScratch {
    std::vector<float> q, acc, scores, denom, row;
};

// One task: query heads of KV heads [kv_begin, kv_end) of one request attend its
// positions [first, seq_len); k_cache/v_cache are byte planes of rows of D + 4 bytes.
// `run` walks the block table as for_each_run does.
template <int C, typename T, typename Runs, typename Softmax>
void attend_one_quant(const T* q, const uint8_t* k_cache, const uint8_t* v_cache,
                      int64_t seq_len, int64_t first, int64_t kv_begin, int64_t kv_end,
                      T* out, int64_t G, int64_t D, int64_t KH, float scale, Runs&& runs,
                      Softmax&& softmax, QuantScratch& w) {
    const int64_t heads = (kv_end - kv_begin) * G, h0 = kv_begin * G, n = seq_len - first;
    const int64_t row_bytes = D + kScaleBytes, slot_bytes = KH * row_bytes;
    w.q.resize(heads * D);
    for (int64_t i = 0; i < heads * D; ++i) w.q[i] = load(q[h0 * D + i]) * scale;
    w.acc.assign(heads * D, 0.0f);
    w.scores.resize(heads * n);
    w.denom.resize(heads);
    w.row.resize(D);
    float* scores = w.scores.data();
    float* row = w.row.data();
    auto prefetch_run = [&](const uint8_t* cache, int64_t next, int64_t count) {
        if (next < 0) return;
        const char* p = reinterpret_cast<const char*>(cache + next * slot_bytes);
        for (int64_t off = 0; off < count * slot_bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
    };
    // Pass 1: every visible position's score.
    runs([&](int64_t i0, int64_t slot, int64_t count, int64_t next) {
        prefetch_run(k_cache, next, count);
        for (int64_t t = 0; t < count; ++t)
            for (int64_t kh = kv_begin; kh < kv_end; ++kh) {
                const uint8_t* k = k_cache + (slot + t) * slot_bytes + kh * row_bytes;
                decode_row<C>(k, D, row);
                const float s = row_scale(k, D);
                for (int64_t g = 0; g < G; ++g) {
                    const int64_t h = (kh - kv_begin) * G + g;
                    scores[h * n + i0 + t] = dot(w.q.data() + h * D, row, D) * s;
                }
            }
    });
    softmax(scores, heads, n, w.denom.data());
    // Pass 2: acc[h] += p[h, t] * s_v,t * codes_t.
    runs([&](int64_t i0, int64_t slot, int64_t count, int64_t next) {
        prefetch_run(v_cache, next, count);
        for (int64_t t = 0; t < count; ++t)
            for (int64_t kh = kv_begin; kh < kv_end; ++kh) {
                const uint8_t* v = v_cache + (slot + t) * slot_bytes + kh * row_bytes;
                decode_row<C>(v, D, row);
                const float s = row_scale(v, D);
                for (int64_t g = 0; g < G; ++g) {
                    const int64_t h = (kh - kv_begin) * G + g;
                    const float p = scores[h * n + i0 + t] * s;
                    float* a = w.acc.data() + h * D;
                    for (int64_t d = 0; d < D; ++d) a[d] += p * row[d];
                }
            }
    });
    for (int64_t h = 0; h < heads; ++h) {
        const float inv = 1.0f / w.denom[h];
        for (int64_t d = 0; d < D; ++d) store(out + (h0 + h) * D + d, w.acc[h * D + d] * inv);
    }
}

}  // namespace quant
}  // namespace kvflow_cpu
