// The elementwise steps of a Llama block on CPUs, fused: residual add + RMSNorm,
// SiLU(gate) * up, rotary embedding of query and key together, and the store of a
// step's keys/values into their paged-cache slots. In torch each is a chain of 4-8 ops,
// each a pass over the activations and a dispatch (5-15 us apiece for one decode row);
// here one call, one pass per row, rows spread over torch's OpenMP pool (only when there
// are enough of them to pay for waking it).
//
// Numerics follow the torch layers (gpu_worker/layers/norm.py, activation.py,
// rotary.py), which follow Hugging Face: the residual sum is rounded to the activation
// dtype, the variance taken in float32, the normalised value rounded before the weight
// multiplies it; SiLU is rounded before it multiplies `up`; each rotary product is
// rounded before the sum (as torch's bf16 ops do). Built by native_build.py.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec.h"

namespace {

using namespace kvflow_cpu;

constexpr int64_t kMinRowsForThreads = 8;

inline float to_dtype(float x, const float*) { return x; }
inline float to_dtype(float x, const Bf16*) { return round_bf16(x); }

inline f32x8 to_dtype(f32x8 x, const float*) { return x; }
inline f32x8 to_dtype(f32x8 x, const Bf16*) { return round_bf16(x); }

// x + residual rounded to the dtype (or x alone without a residual), also written to
// residual_out.
template <typename T>
inline float summed(const T* x, const T* residual, T* residual_out, int64_t i) {
    if (residual == nullptr) return load(x[i]);
    const float v = to_dtype(load(x[i]) + load(residual[i]), x);
    store(residual_out + i, v);
    return v;
}

template <typename T>
inline f32x8 summed8(const T* x, const T* residual, T* residual_out, int64_t i) {
    if (residual == nullptr) return load8(x + i);
    const f32x8 v = to_dtype(load8(x + i) + load8(residual + i), x);
    store8(residual_out + i, v);
    return v;
}

// One row: residual_out = x + residual (if residual), out = norm(sum) * weight. Lane j of
// the sum of squares adds elements j, j + 8, ... as the scalar tail's order assumes.
template <typename T>
void rms_norm_row(const T* x, const T* residual, T* residual_out, const T* weight, T* out,
                  int64_t H, float eps) {
    f32x8 lanes = {};
    int64_t i = 0;
    for (; i + 8 <= H; i += 8) {
        const f32x8 v = summed8(x, residual, residual_out, i);
        lanes += v * v;
    }
    float sum_sq = hsum(lanes);
    for (; i < H; ++i) {
        const float v = summed(x, residual, residual_out, i);
        sum_sq += v * v;
    }
    const float inv = 1.0f / std::sqrt(sum_sq / static_cast<float>(H) + eps);
    const T* sums = residual != nullptr ? residual_out : x;
    for (i = 0; i + 8 <= H; i += 8)
        store8(out + i, to_dtype(load8(sums + i) * inv, x) * load8(weight + i));
    for (; i < H; ++i) store(out + i, to_dtype(load(sums[i]) * inv, x) * load(weight[i]));
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
        int64_t i = 0;
        for (; i + 8 <= d; i += 8) {
            const f32x8 g = load8(gate + i);
            const f32x8 silu = to_dtype(g / (1.0f + exp_approx(-g)), x);
            store8(o + i, silu * load8(up + i));
        }
        for (; i < d; ++i) {
            const float g = load(gate[i]);
            const float silu = to_dtype(g / (1.0f + exp_approx(-g)), x);
            store(o + i, silu * load(up[i]));
        }
    }
}

// Rotate the heads of one token in place, neox layout (pairs x[i], x[i + half]):
// (a, b) -> (a cos - b sin, b cos + a sin), each product rounded to the dtype first.
// No fused multiply-add (GCC contracts by default in C++): torch rounds each product,
// and so the rotation is its result bit for bit.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rotate_heads(T* x, int64_t heads, int64_t head_dim, const T* cos, const T* sin) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; ++h, x += head_dim)
        for (int64_t i = 0; i < half; ++i) {
            const float a = load(x[i]), b = load(x[i + half]);
            const float c = load(cos[i]), s = load(sin[i]);
            store(x + i, to_dtype(a * c, x) - to_dtype(b * s, x));
            store(x + i + half, to_dtype(b * c, x) + to_dtype(a * s, x));
        }
}

template <typename T>
void rotary_qk(T* q, T* k, const T* cos, const T* sin, int64_t rows, int64_t q_heads,
               int64_t k_heads, int64_t head_dim, int64_t q_stride, int64_t k_stride) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (rows >= kMinRowsForThreads)
    for (int64_t r = 0; r < rows; ++r) {
        rotate_heads(q + r * q_stride, q_heads, head_dim, cos + r * half, sin + r * half);
        rotate_heads(k + r * k_stride, k_heads, head_dim, cos + r * half, sin + r * half);
    }
}

// Row r of key/value ([width] each) to slot slots[r] of the K and V planes.
template <typename T>
void store_kv(const T* key, const T* value, T* cache, const int64_t* slots, int64_t rows,
              int64_t width, int64_t key_stride, int64_t value_stride, int64_t num_slots) {
    T* values = cache + num_slots * width;
#pragma omp parallel for schedule(static) if (rows >= 4 * kMinRowsForThreads)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t slot = slots[r];
        if (slot < 0) continue;  // a padding row: not stored
        std::memcpy(cache + slot * width, key + r * key_stride, width * sizeof(T));
        std::memcpy(values + slot * width, value + r * value_stride, width * sizeof(T));
    }
}

// The quantizing store (kernels/kv_codec.py's rows: head_dim codes, then the float32
// scale), rounding exactly as kv_codec.quantize_rows: scale = max|x| / qmax, code =
// x / scale (a division, as torch does; 1 for an all-zero row) rounded half to even,
// int8 clamped to +-127, fp8 clamped to +-qmax before it is rounded.
enum Codec : int { kInt8 = 0, kE4M3 = 1, kE5M2 = 2 };

// x (|x| <= the format's max, finite) to the fp8 code of MAN mantissa bits and exponent
// bias BIAS, rounded to nearest even; branch-free so that the row loop vectorizes.
template <int MAN, int BIAS>
inline uint8_t encode_fp8(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    const uint32_t sign = (u >> 24) & 0x80u;
    u &= 0x7FFFFFFFu;
    float a;
    std::memcpy(&a, &u, sizeof a);
    constexpr float kMinNormal = 1.0f / static_cast<float>(1u << (BIAS - 1));  // 2^(1 - BIAS)
    // Below the smallest normal the codes are multiples of 2^(1 - BIAS - MAN): scaling by a
    // power of two is exact, so this rounds once.
    constexpr float kSubnormalScale = static_cast<float>(1u << (BIAS - 1 + MAN));
    const uint32_t sub = static_cast<uint32_t>(std::nearbyint(std::min(a, kMinNormal) * kSubnormalScale));
    // Normal: drop 23 - MAN mantissa bits, round to nearest even (a carry moves into the
    // exponent, as it should), then move the exponent bias from 127 to BIAS.
    constexpr int kShift = 23 - MAN;
    const uint32_t rounded = (u + ((1u << (kShift - 1)) - 1u) + ((u >> kShift) & 1u)) >> kShift;
    const uint32_t normal = rounded - (static_cast<uint32_t>(127 - BIAS) << MAN);
    return static_cast<uint8_t>(sign | (a < kMinNormal ? sub : normal));
}

template <int C>
constexpr float codec_qmax() {
    return C == kInt8 ? 127.0f : C == kE4M3 ? 448.0f : 57344.0f;
}

// encode_fp8 on 8 lanes, step for step (vector extensions: the compiler picks the
// instructions; the ternary is a lane select).
template <int MAN, int BIAS>
inline u32x8 encode_fp8(f32x8 x) {
    u32x8 u;
    std::memcpy(&u, &x, sizeof u);
    const u32x8 sign = (u >> 24) & 0x80u;
    u &= 0x7FFFFFFFu;
    f32x8 a;
    std::memcpy(&a, &u, sizeof a);
    constexpr float kMinNormal = 1.0f / static_cast<float>(1u << (BIAS - 1));
    constexpr float kSubnormalScale = static_cast<float>(1u << (BIAS - 1 + MAN));
    constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding and removing it rounds half to even
    const f32x8 low = (a < kMinNormal ? a : f32x8{} + kMinNormal) * kSubnormalScale;
    const u32x8 sub = __builtin_convertvector((low + kRound) - kRound, u32x8);
    constexpr int kShift = 23 - MAN;
    const u32x8 rounded = (u + ((1u << (kShift - 1)) - 1u) + ((u >> kShift) & 1u)) >> kShift;
    const u32x8 normal = rounded - (static_cast<uint32_t>(127 - BIAS) << MAN);
    const i32x8 is_sub = a < kMinNormal;  // lanes of all ones where true
    return sign | (sub & u32x8(is_sub)) | (normal & ~u32x8(is_sub));
}

// One code as quantize_row computes it.
template <int C>
inline uint8_t encode(float v) {
    if constexpr (C == kInt8)
        return static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(v)));
    else if constexpr (C == kE4M3)
        return encode_fp8<3, 7>(v);
    else
        return encode_fp8<2, 15>(v);
}

// Eight codes (low byte of each lane).
template <int C>
inline u32x8 encode(f32x8 v) {
    if constexpr (C == kInt8) {
        constexpr float kRound = 12582912.0f;  // |v| <= 127: exact round half to even
        return u32x8(__builtin_convertvector((v + kRound) - kRound, i32x8)) & 0xFFu;
    } else if constexpr (C == kE4M3) {
        return encode_fp8<3, 7>(v);
    } else {
        return encode_fp8<2, 15>(v);
    }
}

// One row of D values to D codes and the scale at dst + D; 8 lanes at a time where D
// allows (the same operations lane by lane, so the codes are the same).
template <int C, typename T>
inline void quantize_row(const T* x, int64_t D, uint8_t* dst) {
    constexpr float qmax = codec_qmax<C>();
    const int64_t vec_end = D - D % 8;
    f32x8 m8 = {};
    for (int64_t d = 0; d < vec_end; d += 8) {
        const f32x8 v = load8(x + d);
        const f32x8 a = v < 0.0f ? -v : v;
        m8 = a > m8 ? a : m8;
    }
    float amax = 0.0f;
    for (int i = 0; i < 8; ++i) amax = std::max(amax, m8[i]);
    for (int64_t d = vec_end; d < D; ++d) amax = std::max(amax, std::fabs(load(x[d])));
    const float scale = amax / qmax;
    const float divisor = scale > 0.0f ? scale : 1.0f;
    for (int64_t d = 0; d < vec_end; d += 8) {
        f32x8 v = load8(x + d) / divisor;
        v = v < -qmax ? f32x8{} - qmax : v;
        v = v > qmax ? f32x8{} + qmax : v;
        typedef uint8_t u8x8 __attribute__((vector_size(8)));
        const u8x8 codes = __builtin_convertvector(encode<C>(v), u8x8);
        std::memcpy(dst + d, &codes, sizeof codes);
    }
    for (int64_t d = vec_end; d < D; ++d)
        dst[d] = encode<C>(std::min(std::max(load(x[d]) / divisor, -qmax), qmax));
    std::memcpy(dst + D, &scale, sizeof scale);
}

// store_kv into a quantized cache [2, num_slots, heads, D + 4] (bytes).
template <int C, typename T>
void store_kv_quant(const T* key, const T* value, uint8_t* cache, const int64_t* slots,
                    int64_t rows, int64_t heads, int64_t D, int64_t key_stride,
                    int64_t value_stride, int64_t num_slots) {
    const int64_t row_bytes = D + 4, slot_bytes = heads * row_bytes;
    uint8_t* values = cache + num_slots * slot_bytes;
#pragma omp parallel for schedule(static) if (rows >= kMinRowsForThreads)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t slot = slots[r];
        if (slot < 0) continue;  // a padding row: not stored
        for (int64_t h = 0; h < heads; ++h) {
            quantize_row<C>(key + r * key_stride + h * D, D, cache + slot * slot_bytes + h * row_bytes);
            quantize_row<C>(value + r * value_stride + h * D, D,
                            values + slot * slot_bytes + h * row_bytes);
        }
    }
}

template <typename T>
int store_kv_codec(int codec, const T* key, const T* value, void* cache, const int64_t* slots,
                   int64_t rows, int64_t heads, int64_t D, int64_t key_stride,
                   int64_t value_stride, int64_t num_slots) {
    auto* c = static_cast<uint8_t*>(cache);
    switch (codec) {
        case kInt8:
            store_kv_quant<kInt8>(key, value, c, slots, rows, heads, D, key_stride, value_stride, num_slots);
            return 0;
        case kE4M3:
            store_kv_quant<kE4M3>(key, value, c, slots, rows, heads, D, key_stride, value_stride, num_slots);
            return 0;
        case kE5M2:
            store_kv_quant<kE5M2>(key, value, c, slots, rows, heads, D, key_stride, value_stride, num_slots);
            return 0;
        default:
            return 1;
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

// q [rows, q_heads, head_dim] and k [rows, k_heads, head_dim], rotated in place: heads
// contiguous within a row, rows `q_stride` / `k_stride` elements apart (views of the
// fused qkv projection). cos, sin [rows, head_dim / 2] contiguous, in the same dtype.
int kvflow_rotary_qk(int dtype, void* q, void* k, const void* cos, const void* sin,
                     int64_t rows, int64_t q_heads, int64_t k_heads, int64_t head_dim,
                     int64_t q_stride, int64_t k_stride) {
    if (head_dim % 2 != 0) return 2;
    if (dtype == 0) {
        rotary_qk(static_cast<float*>(q), static_cast<float*>(k), static_cast<const float*>(cos),
                  static_cast<const float*>(sin), rows, q_heads, k_heads, head_dim, q_stride,
                  k_stride);
        return 0;
    }
    if (dtype == 1) {
        rotary_qk(static_cast<Bf16*>(q), static_cast<Bf16*>(k), static_cast<const Bf16*>(cos),
                  static_cast<const Bf16*>(sin), rows, q_heads, k_heads, head_dim, q_stride,
                  k_stride);
        return 0;
    }
    return 1;
}

// key/value rows of `width` elements (`key_stride` / `value_stride` apart) to the paged
// cache [2, num_slots, cache_width] (contiguous; status 2 unless width == cache_width) at slots[rows] (int64; -1 = not stored). Every
// slot is checked against num_slots before anything is written (status 3 if out of range).
int kvflow_store_kv(int dtype, const void* key, const void* value, void* cache,
                    const int64_t* slots, int64_t rows, int64_t width, int64_t key_stride,
                    int64_t value_stride, int64_t num_slots, int64_t cache_width) {
    if (width != cache_width) return 2;  // rows of another shape than the cache's
    for (int64_t r = 0; r < rows; ++r)
        if (slots[r] >= num_slots) return 3;
    if (dtype == 0) {
        store_kv(static_cast<const float*>(key), static_cast<const float*>(value),
                 static_cast<float*>(cache), slots, rows, width, key_stride, value_stride,
                 num_slots);
        return 0;
    }
    if (dtype == 1) {
        store_kv(static_cast<const Bf16*>(key), static_cast<const Bf16*>(value),
                 static_cast<Bf16*>(cache), slots, rows, width, key_stride, value_stride,
                 num_slots);
        return 0;
    }
    return 1;
}

// store_kv into a quantized cache (kernels/kv_codec.py): codec 0 = int8, 1 = fp8 e4m3,
// 2 = fp8 e5m2; key/value rows of heads * head_dim elements of `dtype`; the cache
// [2, num_slots, cache_width] bytes, status 2 unless heads * (head_dim + 4) == cache_width.
int kvflow_store_kv_quant(int dtype, int codec, const void* key, const void* value, void* cache,
                          const int64_t* slots, int64_t rows, int64_t heads, int64_t head_dim,
                          int64_t key_stride, int64_t value_stride, int64_t num_slots,
                          int64_t cache_width) {
    if (heads * (head_dim + 4) != cache_width) return 2;
    for (int64_t r = 0; r < rows; ++r)
        if (slots[r] >= num_slots) return 3;
    if (dtype == 0)
        return store_kv_codec(codec, static_cast<const float*>(key),
                              static_cast<const float*>(value), cache, slots, rows, heads,
                              head_dim, key_stride, value_stride, num_slots);
    if (dtype == 1)
        return store_kv_codec(codec, static_cast<const Bf16*>(key),
                              static_cast<const Bf16*>(value), cache, slots, rows, heads,
                              head_dim, key_stride, value_stride, num_slots);
    return 1;
}

}  // extern "C"

#ifdef KVFLOW_PYTHON_MODULE
// The same kernels as a CPython module (native_build.load_module). A ctypes call
// converts every argument through Python objects, about 0.25 us apiece: 2-3 us for these
// signatures, more than the kernel itself at one decode row, 120 calls a step. Here
// METH_FASTCALL reads the ints directly. Pointers come as ints (0 = null); the GIL is
// released around the kernel as ctypes does.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

namespace {

// args[0..n) as int64; false (with the Python error set) if one is not an int.
bool read_ints(PyObject* const* args, Py_ssize_t n, int64_t* out) {
    for (Py_ssize_t i = 0; i < n; ++i) {
        out[i] = PyLong_AsLongLong(args[i]);
        if (out[i] == -1 && PyErr_Occurred()) return false;
    }
    return true;
}

bool arity(const char* name, Py_ssize_t got, Py_ssize_t expected) {
    if (got == expected) return true;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, expected, got);
    return false;
}

void* ptr(int64_t address) { return reinterpret_cast<void*>(address); }

PyObject* py_rms_norm(PyObject*, PyObject* const* args, Py_ssize_t n) {
    int64_t a[8];
    if (!arity("kvflow_rms_norm", n, 9) || !read_ints(args, 8, a)) return nullptr;
    const double eps = PyFloat_AsDouble(args[8]);
    if (eps == -1.0 && PyErr_Occurred()) return nullptr;
    int status;
    Py_BEGIN_ALLOW_THREADS;
    status = kvflow_rms_norm(static_cast<int>(a[0]), ptr(a[1]), ptr(a[2]), ptr(a[3]), ptr(a[4]),
                             ptr(a[5]), a[6], a[7], static_cast<float>(eps));
    Py_END_ALLOW_THREADS;
    return PyLong_FromLong(status);
}

PyObject* py_silu_and_mul(PyObject*, PyObject* const* args, Py_ssize_t n) {
    int64_t a[5];
    if (!arity("kvflow_silu_and_mul", n, 5) || !read_ints(args, 5, a)) return nullptr;
    int status;
    Py_BEGIN_ALLOW_THREADS;
    status = kvflow_silu_and_mul(static_cast<int>(a[0]), ptr(a[1]), ptr(a[2]), a[3], a[4]);
    Py_END_ALLOW_THREADS;
    return PyLong_FromLong(status);
}

PyObject* py_rotary_qk(PyObject*, PyObject* const* args, Py_ssize_t n) {
    int64_t a[11];
    if (!arity("kvflow_rotary_qk", n, 11) || !read_ints(args, 11, a)) return nullptr;
    int status;
    Py_BEGIN_ALLOW_THREADS;
    status = kvflow_rotary_qk(static_cast<int>(a[0]), ptr(a[1]), ptr(a[2]), ptr(a[3]), ptr(a[4]),
                              a[5], a[6], a[7], a[8], a[9], a[10]);
    Py_END_ALLOW_THREADS;
    return PyLong_FromLong(status);
}

PyObject* py_store_kv(PyObject*, PyObject* const* args, Py_ssize_t n) {
    int64_t a[11];
    if (!arity("kvflow_store_kv", n, 11) || !read_ints(args, 11, a)) return nullptr;
    int status;
    Py_BEGIN_ALLOW_THREADS;
    status = kvflow_store_kv(static_cast<int>(a[0]), ptr(a[1]), ptr(a[2]), ptr(a[3]),
                             static_cast<const int64_t*>(ptr(a[4])), a[5], a[6], a[7], a[8],
                             a[9], a[10]);
    Py_END_ALLOW_THREADS;
    return PyLong_FromLong(status);
}

PyObject* py_store_kv_quant(PyObject*, PyObject* const* args, Py_ssize_t n) {
    int64_t a[13];
    if (!arity("kvflow_store_kv_quant", n, 13) || !read_ints(args, 13, a)) return nullptr;
    int status;
    Py_BEGIN_ALLOW_THREADS;
    status = kvflow_store_kv_quant(static_cast<int>(a[0]), static_cast<int>(a[1]), ptr(a[2]),
                                   ptr(a[3]), ptr(a[4]), static_cast<const int64_t*>(ptr(a[5])),
                                   a[6], a[7], a[8], a[9], a[10], a[11], a[12]);
    Py_END_ALLOW_THREADS;
    return PyLong_FromLong(status);
}

PyMethodDef kMethods[] = {
    {"kvflow_rms_norm", reinterpret_cast<PyCFunction>(py_rms_norm), METH_FASTCALL, nullptr},
    {"kvflow_silu_and_mul", reinterpret_cast<PyCFunction>(py_silu_and_mul), METH_FASTCALL,
     nullptr},
    {"kvflow_rotary_qk", reinterpret_cast<PyCFunction>(py_rotary_qk), METH_FASTCALL, nullptr},
    {"kvflow_store_kv", reinterpret_cast<PyCFunction>(py_store_kv), METH_FASTCALL, nullptr},
    {"kvflow_store_kv_quant", reinterpret_cast<PyCFunction>(py_store_kv_quant), METH_FASTCALL,
     nullptr},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "kvflow_elementwise", nullptr, -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit_kvflow_elementwise(void) { return PyModule_Create(&kModule); }
#endif  // KVFLOW_PYTHON_MODULE
