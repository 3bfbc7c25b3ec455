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

}  // namespace kvflow_cpu
