// The LoRA terms of a mixed batch on the CPU: y[t] += (A[s] x[t]) B[s] for every row t
// whose adapter slot s = row_slots[t] is >= 0.
//
//   x [T, K] (row stride x_stride)  A [L, S*R, K]  B [L, R, N]  y [T, N] (row stride y_stride)
//   slice i of the output: columns [off_i, off_i + n_i), its shrink rows [i*R, (i+1)*R)
//
// Grouped (SGMV): the rows are sorted by slot (a counting sort, O(T), in the call: the
// row -> slot map is the only per-step input, so a recorded decode graph replays it)
// and cut into blocks of up to BLOCK rows of one slot. A block's shrink is register
// tiles of TILE rows x TILE rows of A over K; its expand loads each row of B (stored
// transposed, [R, N], contiguous over the outputs) once for all the block's rows, and
// rounds each output once. Blocks of one slot are neighbours, and threads (torch's
// OpenMP pool) take contiguous runs of blocks, so a slot's A and B are read from
// memory about once per thread rather than once per row (the weights of 8 adapters do
// not fit in cache; rows of a decode batch alternate between them).
// bf16 with AVX512_BF16: the shrink is vdpbf16ps on the bf16 rows (pairs multiplied
// exactly, summed in float32); elsewhere float32 FMAs, bf16 widened on load. Vectors
// are 16 floats (GCC vector types: two AVX2 registers on an AVX2 build). The reference
// is kernels/lora.py.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define KVFLOW_LORA_DPBF16 1
#include <immintrin.h>
#endif

namespace {

using namespace kvflow_cpu;

typedef uint16_t u16x16 __attribute__((vector_size(32)));

constexpr int64_t LANES = 16;
constexpr int TILE = 4;   // register tile of the shrink: 4 rows x 4 rows of A
constexpr int BLOCK = 8;  // rows per block: each row of B is loaded once for 8 rows

inline f32x16 load16(const float* p) {
    f32x16 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline f32x16 load16(const Bf16* p) {  // bf16 -> fp32: the bits, shifted into the high half
    u16x16 h;
    std::memcpy(&h, p, sizeof h);
    const u32x16 u = __builtin_convertvector(h, u32x16) << 16;
    f32x16 v;
    std::memcpy(&v, &u, sizeof v);
    return v;
}

inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }

inline void store16(Bf16* p, f32x16 v) {  // round to nearest even
    const u16x16 h = __builtin_convertvector(round_bf16_bits(v) >> 16, u16x16);
    std::memcpy(p, &h, sizeof h);
}

inline float hsum16(f32x16 v) {
    float sum = 0.0f;
    for (int i = 0; i < LANES; ++i) sum += v[i];
    return sum;
}

// out[m][n] = x[m] . a[n] over K for M activation rows and N rows of A.
template <typename T, int M, int N>
inline void tile(const T* const* x, const T* const* a, int64_t K, float (*out)[TILE]) {
    f32x16 acc[M][N] = {};
    int64_t k = 0;
#ifdef KVFLOW_LORA_DPBF16
    if constexpr (std::is_same_v<T, Bf16>) {
        __m512 dp[M][N];
        for (int m = 0; m < M; ++m)
            for (int n = 0; n < N; ++n) dp[m][n] = _mm512_setzero_ps();
        for (; k + 32 <= K; k += 32) {
            __m512bh av[N];
            for (int n = 0; n < N; ++n) av[n] = (__m512bh)_mm512_loadu_si512(a[n] + k);
            for (int m = 0; m < M; ++m) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(x[m] + k);
                for (int n = 0; n < N; ++n) dp[m][n] = _mm512_dpbf16_ps(dp[m][n], xv, av[n]);
            }
        }
        for (int m = 0; m < M; ++m)
            for (int n = 0; n < N; ++n) std::memcpy(&acc[m][n], &dp[m][n], sizeof(f32x16));
    }
#endif
    for (; k + LANES <= K; k += LANES) {
        f32x16 av[N];
        for (int n = 0; n < N; ++n) av[n] = load16(a[n] + k);
        for (int m = 0; m < M; ++m) {
            const f32x16 xv = load16(x[m] + k);
            for (int n = 0; n < N; ++n) acc[m][n] += xv * av[n];
        }
    }
    for (int m = 0; m < M; ++m)
        for (int n = 0; n < N; ++n) {
            float sum = hsum16(acc[m][n]);
            for (int64_t j = k; j < K; ++j) sum += load(x[m][j]) * load(a[n][j]);
            out[m][n] = sum;
        }
}

template <typename T, int N>
inline void tile_rows(const T* const* x, int rows, const T* const* a, int64_t K,
                      float (*out)[TILE]) {
    switch (rows) {
        case 4: tile<T, 4, N>(x, a, K, out); break;
        case 3: tile<T, 3, N>(x, a, K, out); break;
        case 2: tile<T, 2, N>(x, a, K, out); break;
        default: tile<T, 1, N>(x, a, K, out); break;
    }
}

struct Shape {
    int64_t T, K, N, S, R, x_stride, y_stride;
};

// shrunk[m][j] = x[m] . A[j] for up to TILE of the block's rows, j < S*R.
template <typename T>
void shrink(const T* const* x, int rows, const T* a, const Shape& s, float (*shrunk)[TILE],
            float* out) {
    const int64_t SR = s.S * s.R;
    for (int64_t j = 0; j < SR; j += TILE) {
        const int cols = static_cast<int>(std::min<int64_t>(TILE, SR - j));
        const T* arows[TILE];
        for (int n = 0; n < TILE; ++n) arows[n] = a + std::min(j + n, SR - 1) * s.K;
        if (cols == TILE) {
            tile_rows<T, TILE>(x, rows, arows, s.K, shrunk);
        } else {
            tile_rows<T, 1>(x, rows, arows, s.K, shrunk);  // a short tail: one row at a time
            for (int n = 1; n < cols; ++n) {
                float one[TILE][TILE];
                tile_rows<T, 1>(x, rows, arows + n, s.K, one);
                for (int m = 0; m < rows; ++m) shrunk[m][n] = one[m][0];
            }
        }
        for (int m = 0; m < rows; ++m)
            for (int n = 0; n < cols; ++n) out[m * SR + j + n] = shrunk[m][n];
    }
}

// y[m][off_i : off_i + n_i] += shrunk[m][i*R : (i+1)*R] B[:, off_i : off_i + n_i].
template <typename T, int M>
void expand(T* const* y, const float* shrunk, const T* b, const int64_t* offsets,
            const Shape& s) {
    const int64_t SR = s.S * s.R;
    for (int64_t i = 0; i < s.S; ++i) {
        const int64_t begin = offsets[i], end = i + 1 < s.S ? offsets[i + 1] : s.N;
        int64_t n = begin;
        for (; n + LANES <= end; n += LANES) {
            f32x16 acc[M];
            for (int m = 0; m < M; ++m) acc[m] = load16(y[m] + n);
            for (int64_t r = 0; r < s.R; ++r) {
                const f32x16 bv = load16(b + r * s.N + n);
                for (int m = 0; m < M; ++m) acc[m] += shrunk[m * SR + i * s.R + r] * bv;
            }
            for (int m = 0; m < M; ++m) store16(y[m] + n, acc[m]);
        }
        for (; n < end; ++n)
            for (int m = 0; m < M; ++m) {
                float acc = load(y[m][n]);
                for (int64_t r = 0; r < s.R; ++r)
                    acc += shrunk[m * SR + i * s.R + r] * load(b[r * s.N + n]);
                store(y[m] + n, acc);
            }
    }
}

struct Block {
    int64_t slot, first, rows;  // sorted[first : first + rows], all of slot `slot`
};

// The adapted rows sorted by slot (stable), cut into blocks of up to BLOCK rows.
std::vector<Block> blocks(const int32_t* row_slots, int64_t T, std::vector<int64_t>& sorted) {
    int64_t slots = 0;
    for (int64_t t = 0; t < T; ++t) slots = std::max<int64_t>(slots, row_slots[t] + 1);
    std::vector<int64_t> start(slots + 1, 0);
    for (int64_t t = 0; t < T; ++t)
        if (row_slots[t] >= 0) ++start[row_slots[t] + 1];
    for (int64_t l = 0; l < slots; ++l) start[l + 1] += start[l];
    sorted.assign(start[slots], 0);
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t t = 0; t < T; ++t)
        if (row_slots[t] >= 0) sorted[next[row_slots[t]]++] = t;
    std::vector<Block> out;
    for (int64_t l = 0; l < slots; ++l)
        for (int64_t r = start[l]; r < start[l + 1]; r += BLOCK)
            out.push_back({l, r, std::min<int64_t>(BLOCK, start[l + 1] - r)});
    return out;
}

template <typename T>
int lora_add(const T* x, const T* a, const T* b, T* y, const int32_t* row_slots,
             const int64_t* offsets, const Shape& s) {
    const int64_t SR = s.S * s.R;
    std::vector<int64_t> sorted;
    const std::vector<Block> work = blocks(row_slots, s.T, sorted);
    const int64_t count = static_cast<int64_t>(work.size());
#pragma omp parallel if (count > 1)
    {
        std::vector<float> shrunk(BLOCK * SR);
        float scratch[TILE][TILE];
#pragma omp for schedule(static)
        for (int64_t w = 0; w < count; ++w) {
            const Block& block = work[w];
            const int rows = static_cast<int>(block.rows);
            const T* xr[BLOCK];
            T* yr[BLOCK];
            for (int m = 0; m < BLOCK; ++m) {
                const int64_t t = sorted[block.first + std::min(m, rows - 1)];
                xr[m] = x + t * s.x_stride;
                yr[m] = y + t * s.y_stride;
            }
            const T* as = a + block.slot * SR * s.K;
            for (int m = 0; m < rows; m += TILE)  // the second pass finds A in cache
                shrink(xr + m, std::min(TILE, rows - m), as, s, scratch, shrunk.data() + m * SR);
            const T* bs = b + block.slot * s.R * s.N;
            switch (rows) {
                case 8: expand<T, 8>(yr, shrunk.data(), bs, offsets, s); break;
                case 7: expand<T, 7>(yr, shrunk.data(), bs, offsets, s); break;
                case 6: expand<T, 6>(yr, shrunk.data(), bs, offsets, s); break;
                case 5: expand<T, 5>(yr, shrunk.data(), bs, offsets, s); break;
                case 4: expand<T, 4>(yr, shrunk.data(), bs, offsets, s); break;
                case 3: expand<T, 3>(yr, shrunk.data(), bs, offsets, s); break;
                case 2: expand<T, 2>(yr, shrunk.data(), bs, offsets, s); break;
                default: expand<T, 1>(yr, shrunk.data(), bs, offsets, s); break;
            }
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
