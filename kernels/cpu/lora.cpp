// The LoRA terms of a mixed batch on the CPU: y[t] += (A[s] x[t]) B[s] for every row t
// whose adapter slot s = row_slots[t] is >= 0 (BGMV: each row reads its own slot).
//
//   x [T, K] (row stride x_stride)  A [L, S*R, K]  B [L, R, N]  y [T, N] (row stride y_stride)
//   slice i of the output: columns [off_i, off_i + n_i), its shrink rows [i*R, (i+1)*R)
//
// Rows run in parallel on torch's OpenMP pool; a row's work is a shrink (S*R dot
// products of length K against its slot's A, which stays in cache across the rows of
// that adapter) and an expand that adds R scaled rows of B (stored transposed, [R, N],
// so W output columns take one vector FMA per rank) to the row's output, rounded once.
// Vectors: 16 floats with AVX-512, else 8 (GCC's portable vector types); bfloat16 is
// widened 16 or 8 lanes at a time. The reference is kernels/lora.py.
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace {

using namespace kvflow_cpu;

#if defined(__AVX512F__)
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
typedef float fvec __attribute__((vector_size(W * 4)));
typedef uint16_t hvec __attribute__((vector_size(W * 2)));
typedef uint32_t uvec __attribute__((vector_size(W * 4)));

inline fvec loadw(const float* p) {
    fvec v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline fvec loadw(const Bf16* p) {  // bf16 -> fp32: the bits, shifted into the high half
    hvec h;
    std::memcpy(&h, p, sizeof h);
    const uvec u = __builtin_convertvector(h, uvec) << 16;
    fvec v;
    std::memcpy(&v, &u, sizeof v);
    return v;
}

inline void storew(float* p, fvec v) { std::memcpy(p, &v, sizeof v); }

inline void storew(Bf16* p, fvec v) {  // round to nearest even
    uvec u;
    std::memcpy(&u, &v, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    const hvec h = __builtin_convertvector(u >> 16, hvec);
    std::memcpy(p, &h, sizeof h);
}

inline float hsumw(fvec v) {
    float sum = 0.0f;
    for (int i = 0; i < W; ++i) sum += v[i];
    return sum;
}

// sum_k x[k] * w[k]; x is float32.
template <typename T>
inline float dot(const float* x, const T* w, int64_t K) {
    fvec acc{};
    int64_t k = 0;
    for (; k + W <= K; k += W) acc += loadw(x + k) * loadw(w + k);
    float sum = hsumw(acc);
    for (; k < K; ++k) sum += x[k] * load(w[k]);
    return sum;
}

// shrunk[j .. j+3] = A[j .. j+3] x: four rows of A per pass over x (half the loads).
template <typename T>
inline void dot4(const float* x, const T* a, int64_t K, float* out) {
    fvec acc0{}, acc1{}, acc2{}, acc3{};
    int64_t k = 0;
    for (; k + W <= K; k += W) {
        const fvec xv = loadw(x + k);
        acc0 += xv * loadw(a + k);
        acc1 += xv * loadw(a + K + k);
        acc2 += xv * loadw(a + 2 * K + k);
        acc3 += xv * loadw(a + 3 * K + k);
    }
    out[0] = hsumw(acc0), out[1] = hsumw(acc1), out[2] = hsumw(acc2), out[3] = hsumw(acc3);
    for (; k < K; ++k)
        for (int i = 0; i < 4; ++i) out[i] += x[k] * load(a[i * K + k]);
}

struct Shape {
    int64_t T, K, N, S, R, x_stride, y_stride;
};

// One row: shrink into s [S*R], then y[off_i : off_i + n_i] += s_i^T B[:, off_i : ...].
template <typename T>
void row(const T* x, const T* a, const T* b, T* y, const int64_t* offsets, const Shape& s,
         float* xf, float* shrunk) {
    const int64_t SR = s.S * s.R;
    for (int64_t k = 0; k < s.K; ++k) xf[k] = load(x[k]);
    int64_t j = 0;
    for (; j + 4 <= SR; j += 4) dot4(xf, a + j * s.K, s.K, shrunk + j);
    for (; j < SR; ++j) shrunk[j] = dot(xf, a + j * s.K, s.K);
    for (int64_t i = 0; i < s.S; ++i) {
        const int64_t begin = offsets[i], end = i + 1 < s.S ? offsets[i + 1] : s.N;
        const float* si = shrunk + i * s.R;
        int64_t n = begin;
        for (; n + W <= end; n += W) {
            fvec acc = loadw(y + n);
            for (int64_t r = 0; r < s.R; ++r) acc += si[r] * loadw(b + r * s.N + n);
            storew(y + n, acc);
        }
        for (; n < end; ++n) {
            float acc = load(y[n]);
            for (int64_t r = 0; r < s.R; ++r) acc += si[r] * load(b[r * s.N + n]);
            store(y + n, acc);
        }
    }
}

template <typename T>
int lora_add(const T* x, const T* a, const T* b, T* y, const int32_t* row_slots,
             const int64_t* offsets, const Shape& s) {
    const int64_t SR = s.S * s.R;
#pragma omp parallel
    {
        std::vector<float> xf(s.K), shrunk(SR);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < s.T; ++t) {
            const int64_t slot = row_slots[t];
            if (slot < 0) continue;
            row(x + t * s.x_stride, a + slot * SR * s.K, b + slot * s.R * s.N,
                y + t * s.y_stride, offsets, s, xf.data(), shrunk.data());
        }
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
