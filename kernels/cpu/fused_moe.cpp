// The experts of a mixture-of-experts layer in one call: every expert's
// gate|up -> silu(gate) * up -> down on the rows routed to it.
//
// The caller sorts the (token, slot) pairs by expert (kernels/fused_moe_reference.py,
// `group_by_expert`): row s of the sorted order reads token rows[s] of x, and expert e
// owns the sorted rows [offsets[e], offsets[e + 1]) (empty where no token chose it).
//
//   phase 1  act[s, j] = silu(x[rows[s]] . w13[e, j]) * (x[rows[s]] . w13[e, I + j])
//   phase 2  y[s, c]   = act[s] . w2[e, c]
//   phase 3  out[t]    = sum over the token's slots j of weight[t, j] * y[inverse[t, j]]
//            (optional: the routing's weighted sum, `combine` in the reference; a slot
//            whose expert is not among this call's adds nothing)
//
// Each phase is a list of (expert, column block, row block) tasks run on torch's OpenMP
// pool with dynamic scheduling: a decode step (a row or two per expert) still spreads
// over the threads by column blocks, and a prefill's row blocks of one column block run
// back to back so that block's weights stay in cache. Within a task, 4 rows x 4 weight
// rows are one register tile (16 accumulators; each loaded vector serves 4 products),
// on AVX512_BF16 with vdpbf16ps straight from the bf16 rows (no widening pass).
//
// Rounding follows the reference (F.linear, F.silu, *): the gate and up products, silu,
// the product and the output are each rounded to the dtype (no-ops in float32).
//
// Options (gpt-oss): biases b13 [E, 2I] (gate's, then up's) and b2 [E, H], added to the
// float32 sums before their rounding, and the clamped SwiGLU in place of silu * up:
//   gate = min(gate, limit), up = clamp(up, -limit, limit),
//   act = (up + 1) * (gate * sigmoid(alpha * gate)), each op rounded as torch rounds it.
//
// Vectors are GCC/Clang vector extensions of 16 floats: one zmm register with -march
// that has AVX-512, two ymm with AVX2, four xmm on plain x86-64: the same code on every
// ISA; vdpbf16ps only where the build has AVX512_BF16. Built by native_build.py.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define KVFLOW_MOE_DPBF16 1
#include <immintrin.h>
#endif

namespace {

using namespace kvflow_cpu;

typedef uint16_t u16x16 __attribute__((vector_size(32)));

constexpr int64_t LANES = 16;
constexpr int64_t ROW_BLOCK = 16;  // sorted rows per task
constexpr int64_t COL_BLOCK = 32;  // output columns per task
constexpr int TILE = 4;            // register tile: 4 rows x 4 weight rows

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

// out[m][n] = a[m] . b[n] over K for M rows a (activations) and N rows b (weights):
// each loaded vector feeds M or N products. bf16 with AVX512_BF16: vdpbf16ps on 32
// elements at a time (pairs multiplied exactly, summed in float32), else float32 FMAs
// on 16 at a time (bf16 widened on load). The tail past the vectors is scalar.
template <typename T, int M, int N>
inline void tile(const T* const* a, const T* const* b, int64_t K, float (*out)[TILE]) {
    f32x16 acc[M][N] = {};
    int64_t k = 0;
#ifdef KVFLOW_MOE_DPBF16
    if constexpr (std::is_same_v<T, Bf16>) {
        __m512 dp[M][N];
        for (int m = 0; m < M; ++m)
            for (int n = 0; n < N; ++n) dp[m][n] = _mm512_setzero_ps();
        for (; k + 32 <= K; k += 32) {
            __m512bh bv[N];
            for (int n = 0; n < N; ++n) bv[n] = (__m512bh)_mm512_loadu_si512(b[n] + k);
            for (int m = 0; m < M; ++m) {
                const __m512bh av = (__m512bh)_mm512_loadu_si512(a[m] + k);
                for (int n = 0; n < N; ++n) dp[m][n] = _mm512_dpbf16_ps(dp[m][n], av, bv[n]);
            }
        }
        for (int m = 0; m < M; ++m)
            for (int n = 0; n < N; ++n) std::memcpy(&acc[m][n], &dp[m][n], sizeof(f32x16));
    }
#endif
    for (; k + LANES <= K; k += LANES) {
        f32x16 bv[N];
        for (int n = 0; n < N; ++n) bv[n] = load16(b[n] + k);
        for (int m = 0; m < M; ++m) {
            const f32x16 av = load16(a[m] + k);
            for (int n = 0; n < N; ++n) acc[m][n] += av * bv[n];
        }
    }
    for (int m = 0; m < M; ++m)
        for (int n = 0; n < N; ++n) {
            float sum = hsum16(acc[m][n]);
            for (int64_t j = k; j < K; ++j) sum += load(a[m][j]) * load(b[n][j]);
            out[m][n] = sum;
        }
}

// out[m][n] = a[m] . b[n] for m < rows, n < cols (rows, cols <= TILE).
template <typename T, int N>
inline void tile_rows(const T* const* a, int rows, const T* const* b, int64_t K,
                      float (*out)[TILE]) {
    switch (rows) {
        case 4: tile<T, 4, N>(a, b, K, out); break;
        case 3: tile<T, 3, N>(a, b, K, out); break;
        case 2: tile<T, 2, N>(a, b, K, out); break;
        default: tile<T, 1, N>(a, b, K, out); break;
    }
}

template <typename T>
inline void dots(const T* const* a, int rows, const T* const* b, int cols, int64_t K,
                 float (*out)[TILE]) {
    if (cols == TILE) {
        tile_rows<T, TILE>(a, rows, b, K, out);
    } else {
        for (int n = 0; n < cols; ++n) {
            float one[TILE][TILE];
            tile_rows<T, 1>(a, rows, b + n, K, one);
            for (int m = 0; m < rows; ++m) out[m][n] = one[m][0];
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

struct Options {
    const void* b13;  // [E, 2I] or null
    const void* b2;   // [E, H] or null
    bool clamped;     // the clamped SwiGLU (else silu(gate) * up)
    float alpha, limit;
};

template <typename T>
inline float bias_at(const void* bias, int64_t i) {
    return bias == nullptr ? 0.0f : load(static_cast<const T*>(bias)[i]);
}

// The expert activation of one (gate, up) pair of float32 sums (biases added).
template <typename T>
inline float activation(float g, float u, const Options& o) {
    float gate = rounded<T>(g);
    const float up = rounded<T>(u);
    if (!o.clamped) return rounded<T>(gate / (1.0f + std::exp(-gate))) * up;
    gate = std::min(gate, o.limit);
    const float clamped_up = std::min(std::max(up, -o.limit), o.limit);
    const float scaled = rounded<T>(gate * o.alpha);
    const float glu = rounded<T>(gate * rounded<T>(1.0f / (1.0f + std::exp(-scaled))));
    return rounded<T>(clamped_up + 1.0f) * glu;
}

struct Combine {
    const int64_t* inverse;  // [T * k]: sorted row of each (token, slot) pair
    const float* weights;    // [T * k]: its routing weight
    int64_t tokens, top_k;
};

constexpr int64_t MAX_TOP_K = 64;

// out[t] = sum_j round(weight[t, j]) * y[inverse[t, j]] over the slots whose sorted row
// is in [lo, hi) (this call's experts), float32 sums rounded once (torch's bmm).
template <typename T>
void combine_token(const T* y, T* out, int64_t t, int64_t lo, int64_t hi, const Combine& c,
                   int64_t H) {
    float w[MAX_TOP_K];
    const T* src[MAX_TOP_K];
    int n = 0;
    for (int64_t j = 0; j < c.top_k; ++j) {
        const int64_t pos = c.inverse[t * c.top_k + j];
        if (pos >= lo && pos < hi) {
            w[n] = rounded<T>(c.weights[t * c.top_k + j]);
            src[n++] = y + pos * H;
        }
    }
    T* dst = out + t * H;
    int64_t h = 0;
    for (; h + 8 <= H; h += 8) {
        f32x8 acc = {};
        for (int i = 0; i < n; ++i) acc += w[i] * load8(src[i] + h);
        store8(dst + h, acc);
    }
    for (; h < H; ++h) {
        float acc = 0.0f;
        for (int i = 0; i < n; ++i) acc += w[i] * load(src[i][h]);
        store(dst + h, acc);
    }
}

// One task's gate|up: act[r, j] for its rows and columns, TILE x TILE at a time.
template <typename T>
void gate_up_task(const T* x, const int64_t* rows, const T* w13, T* act, const Task& task,
                  const Shape& s, const Options& o) {
    const int64_t H = s.hidden, I = s.inter;
    const T* w = w13 + task.expert * 2 * I * H;
    for (int64_t r0 = 0; r0 < task.rows; r0 += TILE) {
        const int m = static_cast<int>(std::min<int64_t>(TILE, task.rows - r0));
        const T* a[TILE];
        for (int r = 0; r < m; ++r) a[r] = x + rows[task.row0 + r0 + r] * s.x_stride;
        for (int64_t j0 = task.col0; j0 < task.col0 + task.cols; j0 += TILE) {
            const int n = static_cast<int>(std::min<int64_t>(TILE, task.col0 + task.cols - j0));
            const T *gw[TILE], *uw[TILE];
            for (int c = 0; c < n; ++c) gw[c] = w + (j0 + c) * H, uw[c] = w + (I + j0 + c) * H;
            float g[TILE][TILE], u[TILE][TILE];
            dots(a, m, gw, n, H, g);
            dots(a, m, uw, n, H, u);
            for (int c = 0; c < n; ++c) {
                const int64_t b = task.expert * 2 * I + j0 + c;
                const float gate_bias = bias_at<T>(o.b13, b), up_bias = bias_at<T>(o.b13, b + I);
                for (int r = 0; r < m; ++r)
                    store(act + (task.row0 + r0 + r) * I + j0 + c,
                          activation<T>(g[r][c] + gate_bias, u[r][c] + up_bias, o));
            }
        }
    }
}

// One task's down: y[r, c] for its rows and columns.
template <typename T>
void down_task(const T* act, const T* w2, T* y, const Task& task, const Shape& s,
               const Options& o) {
    const int64_t H = s.hidden, I = s.inter;
    const T* w = w2 + task.expert * H * I;
    for (int64_t r0 = 0; r0 < task.rows; r0 += TILE) {
        const int m = static_cast<int>(std::min<int64_t>(TILE, task.rows - r0));
        const T* a[TILE];
        for (int r = 0; r < m; ++r) a[r] = act + (task.row0 + r0 + r) * I;
        for (int64_t c0 = task.col0; c0 < task.col0 + task.cols; c0 += TILE) {
            const int n = static_cast<int>(std::min<int64_t>(TILE, task.col0 + task.cols - c0));
            const T* b[TILE];
            for (int c = 0; c < n; ++c) b[c] = w + (c0 + c) * I;
            float out[TILE][TILE];
            dots(a, m, b, n, I, out);
            for (int c = 0; c < n; ++c) {
                const float bias = bias_at<T>(o.b2, task.expert * H + c0 + c);
                for (int r = 0; r < m; ++r)
                    store(y + (task.row0 + r0 + r) * H + c0 + c, out[r][c] + bias);
            }
        }
    }
}

template <typename T>
void fused_moe(const void* x, const int64_t* rows, const int64_t* offsets, const void* w13,
               const void* w2, void* act, void* y, void* out, const Combine& c,
               const Shape& s, const Options& o) {
    const std::vector<Task> first = tasks(offsets, s.experts, s.inter);
    const std::vector<Task> second = tasks(offsets, s.experts, s.hidden);
#pragma omp parallel  // one team for both phases; the first `for`'s barrier parts them
    {
#pragma omp for schedule(dynamic)
        for (size_t t = 0; t < first.size(); ++t)
            gate_up_task(static_cast<const T*>(x), rows, static_cast<const T*>(w13),
                         static_cast<T*>(act), first[t], s, o);
#pragma omp for schedule(dynamic)
        for (size_t t = 0; t < second.size(); ++t)
            down_task(static_cast<const T*>(act), static_cast<const T*>(w2), static_cast<T*>(y),
                      second[t], s, o);
        if (out != nullptr) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < c.tokens; ++t)
                combine_token(static_cast<const T*>(y), static_cast<T*>(out), t, offsets[0],
                              offsets[s.experts], c, s.hidden);
        }
    }
}

}  // namespace

extern "C" {

// x [tokens, H] (row stride x_stride), rows [N] int64, offsets [E + 1] int64 (absolute
// sorted-row indices, non-decreasing), w13 [E, 2I, H], w2 [E, H, I], act [N, I] scratch,
// y [N, H]: the rows [offsets[0], offsets[E]) are written, the others left as they are.
// With `out` [tokens, H] (else null): phase 3 from inverse [tokens * top_k] int64 and
// weights [tokens * top_k] float32. b13 [E, 2I] and b2 [E, H] (x's dtype) or null;
// clamped != 0: the clamped SwiGLU with alpha and limit. dtype 0 = float32, 1 = bfloat16.
// Returns 0; 1 for an unknown dtype, 2 for top_k > 64.
int kvflow_fused_moe(const void* x, const int64_t* rows, const int64_t* offsets,
                     const void* w13, const void* w2, void* act, void* y,
                     const int64_t* inverse, const float* weights, void* out, int64_t experts,
                     int64_t hidden, int64_t inter, int64_t x_stride, int64_t tokens,
                     int64_t top_k, int64_t dtype, const void* b13, const void* b2,
                     int64_t clamped, float alpha, float limit) {
    const Shape s{experts, hidden, inter, x_stride};
    const Combine c{inverse, weights, tokens, top_k};
    const Options o{b13, b2, clamped != 0, alpha, limit};
    if (out != nullptr && top_k > MAX_TOP_K) return 2;
    if (dtype == 0) {
        fused_moe<float>(x, rows, offsets, w13, w2, act, y, out, c, s, o);
    } else if (dtype == 1) {
        fused_moe<Bf16>(x, rows, offsets, w13, w2, act, y, out, c, s, o);
    } else {
        return 1;
    }
    return 0;
}

// The vector width this build runs at: 512 with AVX-512, 256 with AVX, else 128; +1
// where bf16 dot products use vdpbf16ps.
int kvflow_fused_moe_isa() {
#if defined(KVFLOW_MOE_DPBF16)
    return 513;
#elif defined(__AVX512F__)
    return 512;
#elif defined(__AVX__)
    return 256;
#else
    return 128;
#endif
}

}  // extern "C"
