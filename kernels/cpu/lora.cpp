// The LoRA terms of a mixed batch on the CPU: y[t] += B[s] (A[s] x[t]) for every row t
// whose adapter slot s = row_slots[t] is >= 0 (BGMV: each row gathers its own slot).
//
//   x [T, K] (row stride x_stride)  A [L, S*R, K]  B [L, N, R]  y [T, N] (row stride y_stride)
//   slice i of the output: columns [off_i, off_i + n_i), its shrink rows [i*R, (i+1)*R)
//
// Two passes, each parallel on torch's OpenMP pool: shrink (row, rank-row) dot products
// of length K into a float32 scratch [T, S*R]; expand (row, output column) dot products of
// length R, added to y with one rounding. The slot's A (S*R x K) is small and stays in
// cache across the rows of its adapter. Vectors: 16 floats with AVX-512, else 8 (the
// portable GCC vector type of vec.h). The reference is kernels/lora.py.
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace {

using namespace kvflow_cpu;

#if defined(__AVX512F__)
typedef float fvec __attribute__((vector_size(64)));
constexpr int W = 16;
#else
typedef float fvec __attribute__((vector_size(32)));
constexpr int W = 8;
#endif

inline fvec loadw(const float* p) {
    fvec v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline fvec loadw(const Bf16* p) {
    fvec v;
    for (int i = 0; i < W; ++i) v[i] = load(p[i]);  // unrolled: W is a constant
    return v;
}

inline float hsumw(fvec v) {
    float sum = 0.0f;
    for (int i = 0; i < W; ++i) sum += v[i];
    return sum;
}

// sum_k x[k] * w[k] over K elements; x is float32.
template <typename T>
inline float dot(const float* x, const T* w, int64_t K) {
    fvec acc{};
    int64_t k = 0;
    for (; k + W <= K; k += W) acc += loadw(x + k) * loadw(w + k);
    float sum = hsumw(acc);
    for (; k < K; ++k) sum += x[k] * load(w[k]);
    return sum;
}

struct Shape {
    int64_t T, K, N, S, R, x_stride, y_stride;
};

template <typename T>
int lora_add(const T* x, const T* a, const T* b, T* y, const int32_t* row_slots,
             const int64_t* slice_offsets, const Shape& s) {
    const int64_t SR = s.S * s.R;
    std::vector<float> xf(s.T * s.K), shrunk(s.T * SR, 0.0f);
    std::vector<int32_t> col_slice(s.N, -1);
    for (int64_t i = 0; i < s.S; ++i) {
        const int64_t end = i + 1 < s.S ? slice_offsets[i + 1] : s.N;
        for (int64_t n = slice_offsets[i]; n < end; ++n) col_slice[n] = static_cast<int32_t>(i);
    }
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < s.T; ++t)
        if (row_slots[t] >= 0)
            for (int64_t k = 0; k < s.K; ++k) xf[t * s.K + k] = load(x[t * s.x_stride + k]);
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t t = 0; t < s.T; ++t)
        for (int64_t j = 0; j < SR; ++j) {
            const int32_t slot = row_slots[t];
            if (slot < 0) continue;
            shrunk[t * SR + j] = dot(xf.data() + t * s.K, a + (slot * SR + j) * s.K, s.K);
        }
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t t = 0; t < s.T; ++t)
        for (int64_t n = 0; n < s.N; ++n) {
            const int32_t slot = row_slots[t];
            if (slot < 0) continue;
            const float* r = shrunk.data() + t * SR + col_slice[n] * s.R;
            const T* bn = b + (slot * s.N + n) * s.R;
            float sum = 0.0f;
            for (int64_t k = 0; k < s.R; ++k) sum += r[k] * load(bn[k]);
            T* out = y + t * s.y_stride + n;
            store(out, load(*out) + sum);
        }
    return 0;
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16. Returns 0, or 1 for an unknown dtype.
int kvflow_lora_add(int dtype, const void* x, const void* a, const void* b, void* y,
                    const int32_t* row_slots, const int64_t* slice_offsets, int64_t T,
                    int64_t K, int64_t N, int64_t S, int64_t R, int64_t x_stride,
                    int64_t y_stride) {
    const Shape s{T, K, N, S, R, x_stride, y_stride};
    if (dtype == 0)
        return lora_add(static_cast<const float*>(x), static_cast<const float*>(a),
                        static_cast<const float*>(b), static_cast<float*>(y), row_slots,
                        slice_offsets, s);
    if (dtype == 1)
        return lora_add(static_cast<const Bf16*>(x), static_cast<const Bf16*>(a),
                        static_cast<const Bf16*>(b), static_cast<Bf16*>(y), row_slots,
                        slice_offsets, s);
    return 1;
}

}  // extern "C"
