// The fused experts' register tile (fused_moe.cpp): MR sorted rows x one packed panel
// of PANEL = 64 output columns over all of K, as outer products (a broadcast x value
// or bf16 pair times 16 columns per instruction; no horizontal sums), plus the
// 16-lane loads and stores of its epilogues. The packed layout is fused_moe.cpp's.
#pragma once

#include <cstdint>
#include <cstring>

#include "vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define KVFLOW_MOE_DPBF16 1
#include <immintrin.h>
#endif

namespace kvflow_moe {

using namespace kvflow_cpu;

constexpr int NV = 4;                 // vectors of 16 columns per panel
constexpr int64_t PANEL = 16 * NV;    // packed columns per panel (fused_moe.py PANEL)
constexpr int64_t GATE_UP = PANEL / 2;  // intermediate columns per w13 panel
#if defined(__AVX512F__)
constexpr int MR = 6;  // 24 accumulators of the 32 zmm registers
#else
constexpr int MR = 2;  // 16 ymm registers: 8 accumulators' worth
#endif

template <typename T>
constexpr int64_t pair_of() { return sizeof(T) == 2 ? 2 : 1; }

inline f32x16 load16(const float* p) {
    f32x16 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline f32x16 bits_to_f32(u32x16 u) {
    f32x16 v;
    std::memcpy(&v, &u, sizeof v);
    return v;
}

inline float bits_to_f32(uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

// x[2kp], x[2kp + 1] of a bf16 row as one 32-bit word (x[2kp] low).
inline uint32_t pair_at(const Bf16* row, int64_t kp) {
    uint32_t p;
    std::memcpy(&p, row + 2 * kp, sizeof p);
    return p;
}

// acc[m][v] = a[m] . (the panel's column vector v), float32 rows: one k at a time.
template <int M>
inline void panel_dots(const float* const* a, const float* w, int64_t K, f32x16 (&acc)[MR][NV]) {
    for (int m = 0; m < M; ++m)
        for (int v = 0; v < NV; ++v) acc[m][v] = f32x16{};
    for (int64_t k = 0; k < K; ++k) {
        f32x16 wv[NV];
        for (int v = 0; v < NV; ++v) wv[v] = load16(w + k * PANEL + 16 * v);
        for (int m = 0; m < M; ++m) {
            const float xv = a[m][k];
            for (int v = 0; v < NV; ++v) acc[m][v] += xv * wv[v];
        }
    }
}

// The same for bf16 rows, a pair of k at a time: vdpbf16ps where the build has it
// (pairs multiplied exactly, summed in float32), else the pair split into its even and
// odd k (a bf16 is the top half of a float32) and two float32 multiply-adds.
template <int M>
inline void panel_dots(const Bf16* const* a, const Bf16* w, int64_t K, f32x16 (&acc)[MR][NV]) {
    const int64_t pairs = K / 2;  // whole pairs; an odd K's last k pairs with a zero
#ifdef KVFLOW_MOE_DPBF16
    __m512 dp[M][NV];
    for (int m = 0; m < M; ++m)
        for (int v = 0; v < NV; ++v) dp[m][v] = _mm512_setzero_ps();
    const auto step = [&](int64_t kp, const uint32_t* x_pairs) {
        __m512bh wv[NV];
        for (int v = 0; v < NV; ++v)
            wv[v] = (__m512bh)_mm512_loadu_si512(w + (kp * PANEL + 16 * v) * 2);
        for (int m = 0; m < M; ++m) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x_pairs[m]));
            for (int v = 0; v < NV; ++v) dp[m][v] = _mm512_dpbf16_ps(dp[m][v], xv, wv[v]);
        }
    };
    for (int64_t kp = 0; kp < pairs; ++kp) {
        uint32_t x_pairs[M];
        for (int m = 0; m < M; ++m) x_pairs[m] = pair_at(a[m], kp);
        step(kp, x_pairs);
    }
    if (K % 2 != 0) {
        uint32_t x_pairs[M];
        for (int m = 0; m < M; ++m) x_pairs[m] = a[m][K - 1].bits;
        step(pairs, x_pairs);
    }
    for (int m = 0; m < M; ++m)
        for (int v = 0; v < NV; ++v) std::memcpy(&acc[m][v], &dp[m][v], sizeof(f32x16));
#else
    for (int m = 0; m < M; ++m)
        for (int v = 0; v < NV; ++v) acc[m][v] = f32x16{};
    for (int64_t kp = 0; kp < (K + 1) / 2; ++kp) {
        f32x16 even[NV], odd[NV];
        for (int v = 0; v < NV; ++v) {
            u32x16 u;
            std::memcpy(&u, w + (kp * PANEL + 16 * v) * 2, sizeof u);
            even[v] = bits_to_f32(u << 16);
            odd[v] = bits_to_f32(u & 0xFFFF0000u);
        }
        for (int m = 0; m < M; ++m) {
            const uint32_t p = kp < pairs ? pair_at(a[m], kp) : a[m][K - 1].bits;
            const float xe = bits_to_f32(p << 16), xo = bits_to_f32(p & 0xFFFF0000u);
            for (int v = 0; v < NV; ++v) acc[m][v] += xe * even[v] + xo * odd[v];
        }
    }
#endif
}

template <typename T>
inline void tile(const T* const* a, int rows, const T* w, int64_t K, f32x16 (&acc)[MR][NV]) {
    static_assert(MR == 6 || MR == 2, "one case per row count below");
    switch (rows) {
        case 1: panel_dots<1>(a, w, K, acc); break;
        case 2: panel_dots<2>(a, w, K, acc); break;
#if defined(__AVX512F__)
        case 3: panel_dots<3>(a, w, K, acc); break;
        case 4: panel_dots<4>(a, w, K, acc); break;
        case 5: panel_dots<5>(a, w, K, acc); break;
        default: panel_dots<6>(a, w, K, acc); break;
#endif
    }
}

typedef uint16_t u16x16 __attribute__((vector_size(32)));

inline f32x16 load16(const Bf16* p) {
    u16x16 h;
    std::memcpy(&h, p, sizeof h);
    return bits_to_f32(__builtin_convertvector(h, u32x16) << 16);
}

inline void store16(float* dst, f32x16 v) { std::memcpy(dst, &v, sizeof v); }

inline void store16(Bf16* dst, f32x16 v) {  // round to nearest even, as `store`
    const u16x16 h = __builtin_convertvector(round_bf16_bits(v) >> 16, u16x16);
    std::memcpy(dst, &h, sizeof h);
}

// The first n (<= 16) lanes of v to dst, each rounded as `store` rounds.
template <typename T>
inline void store_n(T* dst, f32x16 v, int64_t n) {
    if (n == 16) {
        store16(dst, v);
        return;
    }
    for (int64_t i = 0; i < n; ++i) store(dst + i, v[i]);
}

// 16 lanes of a bias from element i, zero past n lanes or without a bias.
template <typename T>
inline f32x16 bias16(const void* bias, int64_t i, int64_t n) {
    f32x16 v{};
    if (bias == nullptr) return v;
    const T* p = static_cast<const T*>(bias) + i;
    if (n == 16) return load16(p);
    for (int64_t l = 0; l < n; ++l) v[l] = load(p[l]);
    return v;
}

template <typename T>
inline float rounded(float x) {
    T t;
    store(&t, x);
    return load(t);
}

template <typename T>
inline f32x16 rounded(f32x16 v) {
    if constexpr (sizeof(T) == 2) return round_bf16(v);
    return v;
}

inline f32x16 splat(float x) { return f32x16{} + x; }

}  // namespace kvflow_moe
