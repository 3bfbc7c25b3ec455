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
// Weights come packed once at load (fused_moe.py `pack`), per expert, in panels of
// PANEL = 64 output columns holding all of K:
//     packed[expert][panel][k / P][column in panel][k % P]     (K zero-padded to P)
// with P = 2 for bfloat16 (AVX512_BF16's vdpbf16ps multiplies a pair of k) and P = 1
// for float32. w13's panel p holds the gate and up columns of intermediate columns
// [32p, 32p + 32) as four vectors of 16: gate 0-15, up 0-15, gate 16-31, up 16-31, so
// the activation pairs vectors 0-1 and 2-3 without leaving registers. Columns past the
// matrix (I to a multiple of 32, H to one of 64) are zeros and never stored.
//
// A register tile is MR sorted rows x the panel's 4 vectors: per k (pair), 4 weight
// loads and MR broadcasts of x feed 4 MR multiply-adds into 4 MR accumulators (an
// outer product: no horizontal sums). A task is (expert, panel) over all of the
// expert's rows, so a decode step streams each expert's weights from memory once and a
// prefill rereads the panel (64 x K x 2 bytes: 128 KB at K = 1024) from L2 for every MR
// rows; the accumulators span all of K, so no K blocking is needed while a panel fits
// L2. Tasks are spread over torch's OpenMP pool with dynamic scheduling.
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
// that has AVX-512, two ymm with AVX2, four xmm on plain x86-64: the same code and the
// same packed layout on every ISA (bf16 pairs split into two float vectors by shifts
// where vdpbf16ps is missing). Built by native_build.py.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fused_moe.h"
#include "vec.h"

namespace {

using namespace kvflow_cpu;
using namespace kvflow_moe;

struct Task {
    int64_t expert, panel;
};

// (expert, panel) for every expert with rows.
std::vector<Task> tasks(const int64_t* offsets, int64_t E, int64_t panels) {
    std::vector<Task> out;
    for (int64_t e = 0; e < E; ++e)
        if (offsets[e + 1] > offsets[e])
            for (int64_t p = 0; p < panels; ++p) out.push_back({e, p});
    return out;
}

struct Shape {
    int64_t experts, hidden, inter, x_stride;
};

inline int64_t panels(int64_t columns, int64_t width) { return (columns + width - 1) / width; }

// Elements of one expert's packed matrix of `columns` outputs over K.
template <typename T>
inline int64_t packed_size(int64_t columns, int64_t width, int64_t K) {
    constexpr int64_t P = pair_of<T>();
    return panels(columns, width) * ((K + P - 1) / P) * PANEL * P;
}

struct Options {
    const void* b13;  // [E, 2I] or null
    const void* b2;   // [E, H] or null
    bool clamped;     // the clamped SwiGLU (else silu(gate) * up)
    float alpha, limit;
};

// The expert activation of 16 (gate, up) pairs of float32 sums (biases added), each op
// rounded to T as torch rounds it; exp by vec.h's polynomial (relative error ~2e-7).
template <typename T>
inline f32x16 activation(f32x16 g, f32x16 u, const Options& o) {
    f32x16 gate = rounded<T>(g);
    const f32x16 up = rounded<T>(u), one = splat(1.0f);
    if (!o.clamped) return rounded<T>(gate / (one + exp_approx(-gate))) * up;
    const f32x16 limit = splat(o.limit), low = splat(-o.limit);
    gate = limit < gate ? limit : gate;  // std::min(gate, limit)
    f32x16 clamped_up = up < low ? low : up;
    clamped_up = limit < clamped_up ? limit : clamped_up;
    const f32x16 scaled = rounded<T>(gate * o.alpha);
    const f32x16 glu = rounded<T>(gate * rounded<T>(one / (one + exp_approx(-scaled))));
    return rounded<T>(clamped_up + one) * glu;
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

// One task's gate|up: act[r, j] for the expert's rows and the panel's 32 columns j.
template <typename T>
void gate_up_task(const T* x, const int64_t* rows, const int64_t* offsets, const T* w13,
                  T* act, const Task& task, const Shape& s, const Options& o) {
    const int64_t H = s.hidden, I = s.inter, e = task.expert;
    const T* w = w13 + e * packed_size<T>(I, GATE_UP, H) +
                 task.panel * packed_size<T>(GATE_UP, GATE_UP, H);
    const int64_t j0 = task.panel * GATE_UP;
    for (int64_t r0 = offsets[e]; r0 < offsets[e + 1]; r0 += MR) {
        const int m = static_cast<int>(std::min<int64_t>(MR, offsets[e + 1] - r0));
        const T* a[MR];
        for (int r = 0; r < m; ++r) a[r] = x + rows[r0 + r] * s.x_stride;
        f32x16 acc[MR][NV];
        tile(a, m, w, H, acc);
        for (int half = 0; half < 2; ++half) {
            const int64_t j = j0 + 16 * half, n = std::min<int64_t>(16, I - j);
            if (n <= 0) break;
            const f32x16 gate_bias = bias16<T>(o.b13, e * 2 * I + j, n);
            const f32x16 up_bias = bias16<T>(o.b13, e * 2 * I + I + j, n);
            for (int r = 0; r < m; ++r)
                store_n(act + (r0 + r) * I + j,
                        activation<T>(acc[r][2 * half] + gate_bias, acc[r][2 * half + 1] + up_bias, o),
                        n);
        }
    }
}

// One task's down: y[r, c] for the expert's rows and the panel's 64 columns c.
template <typename T>
void down_task(const T* act, const int64_t* offsets, const T* w2, T* y, const Task& task,
               const Shape& s, const Options& o) {
    const int64_t H = s.hidden, I = s.inter, e = task.expert;
    const T* w = w2 + e * packed_size<T>(H, PANEL, I) + task.panel * packed_size<T>(PANEL, PANEL, I);
    const int64_t c0 = task.panel * PANEL;
    for (int64_t r0 = offsets[e]; r0 < offsets[e + 1]; r0 += MR) {
        const int m = static_cast<int>(std::min<int64_t>(MR, offsets[e + 1] - r0));
        const T* a[MR];
        for (int r = 0; r < m; ++r) a[r] = act + (r0 + r) * I;
        f32x16 acc[MR][NV];
        tile(a, m, w, I, acc);
        for (int v = 0; v < NV; ++v) {
            const int64_t c = c0 + 16 * v, n = std::min<int64_t>(16, H - c);
            if (n <= 0) break;
            const f32x16 bias = bias16<T>(o.b2, e * H + c, n);
            for (int r = 0; r < m; ++r) store_n(y + (r0 + r) * H + c, acc[r][v] + bias, n);
        }
    }
}

template <typename T>
void fused_moe(const void* x, const int64_t* rows, const int64_t* offsets, const void* w13,
               const void* w2, void* act, void* y, void* out, const Combine& c,
               const Shape& s, const Options& o) {
    const std::vector<Task> first = tasks(offsets, s.experts, panels(s.inter, GATE_UP));
    const std::vector<Task> second = tasks(offsets, s.experts, panels(s.hidden, PANEL));
#pragma omp parallel  // one team for both phases; the first `for`'s barrier parts them
    {
#pragma omp for schedule(dynamic)
        for (size_t t = 0; t < first.size(); ++t)
            gate_up_task(static_cast<const T*>(x), rows, offsets, static_cast<const T*>(w13),
                         static_cast<T*>(act), first[t], s, o);
#pragma omp for schedule(dynamic)
        for (size_t t = 0; t < second.size(); ++t)
            down_task(static_cast<const T*>(act), offsets, static_cast<const T*>(w2),
                      static_cast<T*>(y), second[t], s, o);
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
// sorted-row indices, non-decreasing), w13 and w2 packed (see the header; fused_moe.py
// `pack`), act [N, I] scratch, y [N, H]: the rows [offsets[0], offsets[E]) are written,
// the others left as they are. With `out` [tokens, H] (else null): phase 3 from inverse
// [tokens * top_k] int64 and weights [tokens * top_k] float32. b13 [E, 2I] and b2 [E, H]
// (x's dtype) or null; clamped != 0: the clamped SwiGLU with alpha and limit. dtype 0 =
// float32, 1 = bfloat16. Returns 0; 1 for an unknown dtype, 2 for top_k > 64.
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

// The packed layout's panel width (fused_moe.py checks its own against it).
int kvflow_fused_moe_panel() { return static_cast<int>(PANEL); }

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
