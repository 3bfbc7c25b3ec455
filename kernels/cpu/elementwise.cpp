// The elementwise steps of a Llama block on CPUs, fused: residual add + RMSNorm, and
// SiLU(gate) * up. In torch each is a chain of 4-8 ops, each a pass over the
// activations and a dispatch; here one pass per row, rows spread over torch's OpenMP
// pool (only when there are enough of them to pay for waking it).
//
// Numerics follow the torch layers (gpu_worker/layers/norm.py, activation.py), which
// follow Hugging Face: the residual sum is rounded to the activation dtype, the
// variance taken in float32, the normalised value rounded before the weight multiplies
// it; SiLU is rounded before it multiplies `up`. Built by native_build.py.
#include <omp.h>

#include <cmath>
#include <cstdint>

#include "vec.h"

namespace {

using namespace kvflow_cpu;

constexpr int64_t kMinRowsForThreads = 8;

inline float to_dtype(float x, const float*) { return x; }
inline float to_dtype(float x, const Bf16*) { return round_bf16(x); }

// x + residual rounded to the dtype (or x alone without a residual), also written to
// residual_out.
template <typename T>
inline float summed(const T* x, const T* residual, T* residual_out, int64_t i) {
    if (residual == nullptr) return load(x[i]);
    const float v = to_dtype(load(x[i]) + load(residual[i]), x);
    store(residual_out + i, v);
    return v;
}

// One row: residual_out = x + residual (if residual), out = norm(sum) * weight.
template <typename T>
void rms_norm_row(const T* x, const T* residual, T* residual_out, const T* weight, T* out,
                  int64_t H, float eps) {
    float lanes[8] = {};  // 8 independent sums: vectorizes without reassociation
    int64_t i = 0;
    for (; i + 8 <= H; i += 8)
        for (int j = 0; j < 8; ++j) {
            const float v = summed(x, residual, residual_out, i + j);
            lanes[j] += v * v;
        }
    float sum_sq = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
                   ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    for (; i < H; ++i) {
        const float v = summed(x, residual, residual_out, i);
        sum_sq += v * v;
    }
    const float inv = 1.0f / std::sqrt(sum_sq / static_cast<float>(H) + eps);
    const T* sums = residual != nullptr ? residual_out : x;
    for (i = 0; i < H; ++i) store(out + i, to_dtype(load(sums[i]) * inv, x) * load(weight[i]));
}

template <typename T>
void rms_norm(const T* x, const T* residual, T* residual_out, const T* weight, T* out,
              int64_t rows, int64_t H, float eps) {
#pragma omp parallel for schedule(static) if (rows >= kMinRowsForThreads)
    for (int64_t r = 0; r < rows; ++r)
        rms_norm_row(x + r * H, residual == nullptr ? nullptr : residual + r * H,
                     residual_out == nullptr ? nullptr : residual_out + r * H, weight,
                     out + r * H, H, eps);
}

template <typename T>
void silu_and_mul(const T* x, T* out, int64_t rows, int64_t d) {
#pragma omp parallel for schedule(static) if (rows >= kMinRowsForThreads)
    for (int64_t r = 0; r < rows; ++r) {
        const T* gate = x + r * 2 * d;
        const T* up = gate + d;
        T* o = out + r * d;
        for (int64_t i = 0; i < d; ++i) {
            const float g = load(gate[i]);
            const float silu = to_dtype(g / (1.0f + exp_approx(-g)), x);
            store(o + i, silu * load(up[i]));
        }
    }
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16. All tensors contiguous. x, out [rows, H];
// residual (may be null) [rows, H] read, residual_out [rows, H] written with x + residual
// (may alias residual); weight [H].
int kvflow_rms_norm(int dtype, const void* x, const void* residual, void* residual_out,
                    const void* weight, void* out, int64_t rows, int64_t H, float eps) {
    if ((residual == nullptr) != (residual_out == nullptr)) return 2;
    if (dtype == 0) {
        rms_norm(static_cast<const float*>(x), static_cast<const float*>(residual),
                 static_cast<float*>(residual_out), static_cast<const float*>(weight),
                 static_cast<float*>(out), rows, H, eps);
        return 0;
    }
    if (dtype == 1) {
        rms_norm(static_cast<const Bf16*>(x), static_cast<const Bf16*>(residual),
                 static_cast<Bf16*>(residual_out), static_cast<const Bf16*>(weight),
                 static_cast<Bf16*>(out), rows, H, eps);
        return 0;
    }
    return 1;
}

// x [rows, 2 * d] as gate | up, out [rows, d], both contiguous.
int kvflow_silu_and_mul(int dtype, const void* x, void* out, int64_t rows, int64_t d) {
    if (dtype == 0) {
        silu_and_mul(static_cast<const float*>(x), static_cast<float*>(out), rows, d);
        return 0;
    }
    if (dtype == 1) {
        silu_and_mul(static_cast<const Bf16*>(x), static_cast<Bf16*>(out), rows, d);
        return 0;
    }
    return 1;
}

}  // extern "C"
