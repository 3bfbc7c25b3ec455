// The experts of a mixture-of-experts layer in one call: every expert's
// gate|up -> silu(gate) * up -> down on the rows routed to it.
//
// The caller sorts the (token, slot) pairs by expert (kernels/fused_moe_reference.py,
// `group_by_expert`): row s of the sorted order reads token rows[s] of x, and expert e
// owns the sorted rows [offsets[e], offsets[e + 1]) (empty where no token chose it).
//
//   phase 1  act[s, j] = silu(x[rows[s]] . w13[e, j]) * (x[rows[s]] . w13[e, I + j])
//   phase 2  y[s, c]   = act[s] . w2[e, c]
//
// Each phase is a list of (expert, column block, row block) tasks run on torch's OpenMP
// pool with dynamic scheduling: a decode step (a row or two per expert) still spreads
// over the threads by column blocks, and a prefill's row blocks of one column block run
// back to back so that block's weights stay in cache. A task converts its rows to
// float32 once, then streams each weight row against all of them (one read of a weight
// byte per task, whatever its row count).
//
// Rounding follows the reference (F.linear, F.silu, *): the gate and up products, silu,
// the product and the output are each rounded to the dtype (no-ops in float32).
//
// Vectors are GCC/Clang vector extensions of 16 floats: one zmm register with -march
// that has AVX-512, two ymm with AVX2, four xmm on plain x86-64: the same code on every
// ISA. Built by native_build.py.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace {

using namespace kvflow_cpu;

typedef uint16_t u16x16 __attribute__((vector_size(32)));

constexpr int64_t LANES = 16;
constexpr int64_t ROW_BLOCK = 16;  // sorted rows per task
constexpr int64_t COL_BLOCK = 32;  // output columns per task

inline f32x16 load16(const float* p) {
    f32x16 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline f32x16 load16(const Bf16* p) {
    u16x16 h;
    std::memcpy(&h, p, sizeof h);
    const u32x16 u = __builtin_convertvector(h, u32x16) << 16;
    f32x16 v;
    std::memcpy(&v, &u, sizeof v);
    return v;
}

inline float hsum16(f32x16 v) {
    float sum = 0.0f;
    for (int i = 0; i < LANES; ++i) sum += v[i];
    return sum;
}

template <typename T>
inline float rounded(float x) {
    T t;
    store(&t, x);
    return load(t);
}

// out[r] = xs[r] . w for the n rows of xs (float32, [n][K]); w is one weight row [K].
template <typename T>
inline void dots(const float* xs, int64_t n, const T* w, int64_t K, float* out) {
    const int64_t body = K / LANES * LANES;
    for (int64_t r0 = 0; r0 < n; r0 += 4) {  // 4 rows' accumulators in registers
        const int64_t m = std::min<int64_t>(4, n - r0);
        f32x16 acc[4] = {};
        for (int64_t k = 0; k < body; k += LANES) {
            const f32x16 wv = load16(w + k);
            for (int64_t r = 0; r < m; ++r) acc[r] += load16(xs + (r0 + r) * K + k) * wv;
        }
        for (int64_t r = 0; r < m; ++r) {
            float sum = hsum16(acc[r]);
            for (int64_t k = body; k < K; ++k) sum += xs[(r0 + r) * K + k] * load(w[k]);
            out[r0 + r] = sum;
        }
    }
}

struct Task {
    int64_t expert, row0, rows, col0, cols;
};

// (expert, column block, row block) for every non-empty expert, row blocks innermost.
std::vector<Task> tasks(const int64_t* offsets, int64_t E, int64_t columns) {
    std::vector<Task> out;
    for (int64_t e = 0; e < E; ++e)
        for (int64_t c = 0; c < columns; c += COL_BLOCK)
            for (int64_t r = offsets[e]; r < offsets[e + 1]; r += ROW_BLOCK)
                out.push_back({e, r, std::min(ROW_BLOCK, offsets[e + 1] - r), c,
                               std::min(COL_BLOCK, columns - c)});
    return out;
}

struct Shape {
    int64_t experts, hidden, inter, x_stride;
};

template <typename T>
void gate_up(const T* x, const int64_t* rows, const int64_t* offsets, const T* w13, T* act,
             const Shape& s) {
    const int64_t H = s.hidden, I = s.inter;
    const std::vector<Task> work = tasks(offsets, s.experts, I);
#pragma omp parallel
    {
        std::vector<float> xs(ROW_BLOCK * H);
        float g[ROW_BLOCK], u[ROW_BLOCK];
#pragma omp for schedule(dynamic)
        for (size_t t = 0; t < work.size(); ++t) {
            const Task& task = work[t];
            for (int64_t r = 0; r < task.rows; ++r) {
                const T* src = x + rows[task.row0 + r] * s.x_stride;
                for (int64_t k = 0; k < H; ++k) xs[r * H + k] = load(src[k]);
            }
            const T* w = w13 + task.expert * 2 * I * H;
            for (int64_t j = task.col0; j < task.col0 + task.cols; ++j) {
                dots(xs.data(), task.rows, w + j * H, H, g);
                dots(xs.data(), task.rows, w + (I + j) * H, H, u);
                for (int64_t r = 0; r < task.rows; ++r) {
                    const float gate = rounded<T>(g[r]);
                    const float silu = rounded<T>(gate / (1.0f + std::exp(-gate)));
                    store(act + (task.row0 + r) * I + j, silu * rounded<T>(u[r]));
                }
            }
        }
    }
}

template <typename T>
void down(const T* act, const int64_t* offsets, const T* w2, T* y, const Shape& s) {
    const int64_t H = s.hidden, I = s.inter;
    const std::vector<Task> work = tasks(offsets, s.experts, H);
#pragma omp parallel
    {
        std::vector<float> as(ROW_BLOCK * I);
        float out[ROW_BLOCK];
#pragma omp for schedule(dynamic)
        for (size_t t = 0; t < work.size(); ++t) {
            const Task& task = work[t];
            for (int64_t r = 0; r < task.rows; ++r)
                for (int64_t k = 0; k < I; ++k)
                    as[r * I + k] = load(act[(task.row0 + r) * I + k]);
            const T* w = w2 + task.expert * H * I;
            for (int64_t c = task.col0; c < task.col0 + task.cols; ++c) {
                dots(as.data(), task.rows, w + c * I, I, out);
                for (int64_t r = 0; r < task.rows; ++r) store(y + (task.row0 + r) * H + c, out[r]);
            }
        }
    }
}

template <typename T>
void fused_moe(const void* x, const int64_t* rows, const int64_t* offsets, const void* w13,
               const void* w2, void* act, void* y, const Shape& s) {
    gate_up(static_cast<const T*>(x), rows, offsets, static_cast<const T*>(w13),
            static_cast<T*>(act), s);
    down(static_cast<const T*>(act), offsets, static_cast<const T*>(w2), static_cast<T*>(y), s);
}

}  // namespace

extern "C" {

// x [tokens, H] (row stride x_stride), rows [N] int64, offsets [E + 1] int64 (absolute
// sorted-row indices, non-decreasing), w13 [E, 2I, H], w2 [E, H, I], act [N, I] scratch,
// y [N, H]: the rows [offsets[0], offsets[E]) are written, the others left as they are.
// dtype 0 = float32, 1 = bfloat16. Returns 0, or 1 for an unknown dtype.
int kvflow_fused_moe(const void* x, const int64_t* rows, const int64_t* offsets,
                     const void* w13, const void* w2, void* act, void* y, int64_t experts,
                     int64_t hidden, int64_t inter, int64_t x_stride, int64_t dtype) {
    const Shape s{experts, hidden, inter, x_stride};
    if (dtype == 0) {
        fused_moe<float>(x, rows, offsets, w13, w2, act, y, s);
    } else if (dtype == 1) {
        fused_moe<Bf16>(x, rows, offsets, w13, w2, act, y, s);
    } else {
        return 1;
    }
    return 0;
}

// The vector width this build runs at: 512 with AVX-512, 256 with AVX, else 128.
int kvflow_fused_moe_isa() {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX__)
    return 256;
#else
    return 128;
#endif
}

}  // extern "C"
