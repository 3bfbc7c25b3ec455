// y = x W^T + b for a few rows of x (M <= 8): the linear layers of a decode step at small
// batch, which is a pass over the weights and so bound by memory bandwidth.
//
// Why native code: at one row, torch's BLAS path streams the weights at roughly half
// the machine's read bandwidth (and bf16 weights take a slow path on CPUs without bf16
// dot-product units). Here each thread owns a range of output features and streams
// their weight rows front to back; R rows of W are in flight at once, each FMA'd
// against every row of x, so each weight byte is read once per step whatever M is.
//
// Vectors and bf16 come from vec.h; the work runs on torch's OpenMP pool. Built by
// native_build.py; the reference is torch.nn.functional.linear.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace {

using namespace kvflow_cpu;

struct Shape {
    int64_t rows, in_features, out_features, x_row_stride;
};

// Output features [n, n + R) for all M rows. x is float32, [M, K] contiguous (converted
// once per call); K's tail past a multiple of 8 is done in scalar.
template <typename T, int M, int R>
inline void features(const float* x, const T* w, const T* bias, T* y, int64_t n,
                     const Shape& s) {
    const int64_t K = s.in_features, body = K / 8 * 8;
    f32x8 acc[M][R] = {};
    for (int64_t k = 0; k < body; k += 8) {
        f32x8 wv[R];
        for (int r = 0; r < R; ++r) {
            __builtin_prefetch(w + (n + r) * K + k + 512 / sizeof(T) * 4);
            wv[r] = load8(w + (n + r) * K + k);
        }
        for (int m = 0; m < M; ++m) {
            const f32x8 xv = load8(x + m * K + k);
            for (int r = 0; r < R; ++r) acc[m][r] += xv * wv[r];
        }
    }
    for (int m = 0; m < M; ++m)
        for (int r = 0; r < R; ++r) {
            float sum = hsum(acc[m][r]);
            for (int64_t k = body; k < K; ++k) sum += x[m * K + k] * load(w[(n + r) * K + k]);
            if (bias != nullptr) sum += load(bias[n + r]);
            store(y + m * s.out_features + n + r, sum);
        }
}

template <typename T, int M, int R>
void linear_rows(const float* x, const T* w, const T* bias, T* y, const Shape& s) {
    const int64_t N = s.out_features, groups = N / R;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; ++g) features<T, M, R>(x, w, bias, y, g * R, s);
    for (int64_t n = groups * R; n < N; ++n) features<T, M, 1>(x, w, bias, y, n, s);
}

// R (weight rows in flight) keeps M * R accumulators within the 16 vector registers.
template <typename T>
int linear(const T* x_in, const T* w, const T* bias, T* y, const Shape& s) {
    const int64_t M = s.rows, K = s.in_features;
    std::vector<float> x(M * K);
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) x[m * K + k] = load(x_in[m * s.x_row_stride + k]);
    switch (M) {
        case 1: linear_rows<T, 1, 4>(x.data(), w, bias, y, s); return 0;
        case 2: linear_rows<T, 2, 4>(x.data(), w, bias, y, s); return 0;
        case 3: linear_rows<T, 3, 2>(x.data(), w, bias, y, s); return 0;
        case 4: linear_rows<T, 4, 2>(x.data(), w, bias, y, s); return 0;
        case 5: linear_rows<T, 5, 1>(x.data(), w, bias, y, s); return 0;
        case 6: linear_rows<T, 6, 1>(x.data(), w, bias, y, s); return 0;
        case 7: linear_rows<T, 7, 1>(x.data(), w, bias, y, s); return 0;
        case 8: linear_rows<T, 8, 1>(x.data(), w, bias, y, s); return 0;
        default: return 2;
    }
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16 (x, w, bias and y alike). Pointer shapes:
//   x [rows, in_features] (row stride x_row_stride, unit column stride);
//   w [out_features, in_features] contiguous; bias [out_features] or null;
//   y [rows, out_features] contiguous. Returns 0, or nonzero for unsupported arguments.
int kvflow_skinny_linear(int dtype, const void* x, const void* w, const void* bias, void* y,
                         int64_t rows, int64_t in_features, int64_t out_features,
                         int64_t x_row_stride) {
    const Shape s{rows, in_features, out_features, x_row_stride};
    if (dtype == 0)
        return linear(static_cast<const float*>(x), static_cast<const float*>(w),
                      static_cast<const float*>(bias), static_cast<float*>(y), s);
    if (dtype == 1)
        return linear(static_cast<const Bf16*>(x), static_cast<const Bf16*>(w),
                      static_cast<const Bf16*>(bias), static_cast<Bf16*>(y), s);
    return 1;
}

}  // extern "C"
