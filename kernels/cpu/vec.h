// Shared by the native CPU kernels: 8-float vectors as GCC/Clang vector extensions
// (explicit enough that hot loops keep accumulators in registers, portable to any target
// the compiler knows; -march=native picks AVX2/AVX-512 where present), and bfloat16 as
// the top half of a float32.
#pragma once

#include <cstdint>
#include <cstring>

namespace kvflow_cpu {

typedef float f32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

struct Bf16 {
    uint16_t bits;
};

inline float load(float x) { return x; }

inline float load(Bf16 x) {
    const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

inline f32x8 load8(const float* p) {
    f32x8 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline f32x8 load8(const Bf16* p) {
    u16x8 h;
    std::memcpy(&h, p, sizeof h);
    const u32x8 u = __builtin_convertvector(h, u32x8) << 16;
    f32x8 v;
    std::memcpy(&v, &u, sizeof v);
    return v;
}

inline float hsum(f32x8 v) {
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

inline void store(float* dst, float x) { *dst = x; }

inline void store(Bf16* dst, float x) {  // round to nearest even
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    dst->bits = static_cast<uint16_t>(u >> 16);
}

// Round a float to the nearest bfloat16 and back (what storing and reloading does).
inline float round_bf16(float x) {
    Bf16 b;
    store(&b, x);
    return load(b);
}

// Eight lanes of `store` and `round_bf16`: the same rounding, lane by lane.
inline void store8(float* dst, f32x8 v) { std::memcpy(dst, &v, sizeof v); }

inline u32x8 round_bf16_bits(f32x8 v) {
    u32x8 u;
    std::memcpy(&u, &v, sizeof u);
    return u + (0x7FFFu + ((u >> 16) & 1u));
}

inline void store8(Bf16* dst, f32x8 v) {
    const u16x8 h = __builtin_convertvector(round_bf16_bits(v) >> 16, u16x8);
    std::memcpy(dst, &h, sizeof h);
}

inline f32x8 round_bf16(f32x8 v) {
    const u32x8 u = round_bf16_bits(v) & 0xFFFF0000u;
    std::memcpy(&v, &u, sizeof v);
    return v;
}

// exp(x) in a form the compiler vectorizes (libm's expf is a scalar call): x = k ln2 + r
// with |r| <= ln2 / 2, e^r by a degree-6 polynomial (relative error ~2e-7, like expf),
// 2^k from the exponent bits. k is rounded by adding and removing 1.5 * 2^23, which is
// plain arithmetic (nearbyint would not vectorize; the ternaries need
// -fno-trapping-math). x is clamped to [-87, 88]: e^-87 ~ 1e-38 is 0 for a softmax
// weight, e^88 ~ 1.7e38 is near FLT_MAX.
typedef int32_t i32x8 __attribute__((vector_size(32)));

// 2^k for an integral k (as a float or eight of them) from the exponent bits.
inline float pow2_of_integral(float k) {
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    float two_k;
    std::memcpy(&two_k, &bits, sizeof two_k);
    return two_k;
}

inline f32x8 pow2_of_integral(f32x8 k) {
    const i32x8 bits = (__builtin_convertvector(k, i32x8) + 127) << 23;
    f32x8 two_k;
    std::memcpy(&two_k, &bits, sizeof two_k);
    return two_k;
}

// Sixteen lanes (one zmm register where -march has AVX-512): the same arithmetic.
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

inline f32x16 pow2_of_integral(f32x16 k) {
    const i32x16 bits = (__builtin_convertvector(k, i32x16) + 127) << 23;
    f32x16 two_k;
    std::memcpy(&two_k, &bits, sizeof two_k);
    return two_k;
}

inline u32x16 round_bf16_bits(f32x16 v) {
    u32x16 u;
    std::memcpy(&u, &v, sizeof u);
    return u + (0x7FFFu + ((u >> 16) & 1u));
}

inline f32x16 round_bf16(f32x16 v) {
    const u32x16 u = round_bf16_bits(v) & 0xFFFF0000u;
    std::memcpy(&v, &u, sizeof v);
    return v;
}

// One definition for a float and for eight lanes (so both forms round alike).
template <typename V>
inline V exp_approx(V x) {
    constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
    const V zero{};
    x = x < -87.0f ? zero - 87.0f : x;
    x = x > 88.0f ? zero + 88.0f : x;
    const V k = (x * 1.44269504088896341f + kRound) - kRound;
    const V r = x - k * 0.693145751953125f - k * 1.428606765330187e-06f;
    V p = zero + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return p * pow2_of_integral(k);
}

}  // namespace kvflow_cpu
