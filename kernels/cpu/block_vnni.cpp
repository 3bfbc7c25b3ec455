// y = x W^T (+ b) for a few float32 rows of x (M <= 8), W in block_linear.cpp's tiled
// GGUF layout (Q8_0 / Q4_0 / Q4_1), with x quantized here to int8 digits so that the
// products run on AVX512-VNNI's vpdpbusd (64 u8 x s8 products per instruction) instead
// of expanding every code to float32 (block_linear.cpp: ~7 instructions per 16 weights,
// which keeps that kernel at ~13 GB/s per core, below DRAM speed).
//
// Activations: int8_linear.cpp's two-digit scheme, per row and block of 32: e = max|x| /
// 127, t = x / e, xq = round(t), xr = round(256 (t - xq)) clamped to +-127, so x ~= e (xq
// + xr / 256) to ~16 bits (one digit loses 1-3% per layer on this project's models);
// s = the float sum of the block's x. Weight w = u d + m with unsigned code u:
//   Q4_1: u = code, m as stored;  Q4_0: u = code, m = -8 d;
//   Q8_0: u = q + 128 (flipped at load), and 128 (256 sum xq + sum xr) subtracted from
//         the integer dot (so q . x stays an integer, no float cancellation).
//   y = sum_b d_b e_b / 256 (256 u.xq + u.xr)_b  +  m_b s_b   (+ bias)
// The integer dots are exact; results equal int8_linear's up to float summation order.
//
// Register picture of one record (one block of the tile's 4 weight rows):
//   Q4: 64 code bytes = one vector; low nibbles = weights 0-15 of rows 0..3 (16 bytes
//       each), high nibbles = weights 16-31; x's 16 first/second-half digits broadcast
//       to the four 128-bit lanes: lanes 4r..4r+3 of the dot hold row r's partial sums.
//   Q8: 128 code bytes = two vectors (rows 0-1, rows 2-3), x's 32 digits broadcast to
//       both 256-bit halves: lanes 8r'..8r'+7 hold row r' of the pair.
// Built by native_build.py (-march=native); without VNNI the entry point returns 2 and
// block_vnni.py never routes to it.
#include <omp.h>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVFLOW_VNNI 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

namespace {

constexpr int64_t kBlock = 32;
constexpr int kTile = 4;
constexpr int kMaxRows = 8;
constexpr int64_t kMaxBlocks = 1024;  // in_features <= 32768: the activations fit the stack
constexpr int64_t kPrefetchAhead = 1024;

enum Format { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };

template <int F>
constexpr int64_t header_bytes() { return (F == kQ4_1 ? 2 : 1) * kTile * 4; }
template <int F>
constexpr int64_t record_bytes() { return header_bytes<F>() + kTile * (F == kQ8_0 ? 32 : 16); }

#if defined(KVFLOW_VNNI)
// One row's activations, block by block: digits in natural order, e / 256, s and (Q8_0)
// the integer correction 128 (256 sum xq + sum xr) / 8 per lane.
struct Acts {
    alignas(64) int8_t q[kMaxBlocks * kBlock];
    alignas(64) int8_t r[kMaxBlocks * kBlock];
    float e[kMaxBlocks], s[kMaxBlocks];
    int32_t corr[kMaxBlocks];
};

void quantize_row(const float* x, Acts& a, int64_t blocks) {
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (int64_t b = 0; b < blocks; ++b) {
        const __m512 lo = _mm512_loadu_ps(x + b * kBlock), hi = _mm512_loadu_ps(x + b * kBlock + 16);
        const float amax = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_and_ps(lo, abs_mask), _mm512_and_ps(hi, abs_mask)));
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        int32_t digits = 0;
        for (int h = 0; h < 2; ++h) {
            const __m512 v = h ? hi : lo;
            const __m512 first = _mm512_roundscale_ps(_mm512_mul_ps(v, inv), kRound);
            // The residual by an explicit fma, rounded once (as int8_linear.cpp).
            __m512 second = _mm512_roundscale_ps(
                _mm512_mul_ps(_mm512_fmsub_ps(v, inv, first), _mm512_set1_ps(256.0f)), kRound);
            second = _mm512_min_ps(_mm512_max_ps(second, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
            const __m512i fq = _mm512_cvtps_epi32(first), fr = _mm512_cvtps_epi32(second);
            _mm_store_si128(reinterpret_cast<__m128i*>(a.q + b * kBlock + 16 * h), _mm512_cvtsepi32_epi8(fq));
            _mm_store_si128(reinterpret_cast<__m128i*>(a.r + b * kBlock + 16 * h), _mm512_cvtsepi32_epi8(fr));
            digits += 256 * _mm512_reduce_add_epi32(fq) + _mm512_reduce_add_epi32(fr);
        }
        a.e[b] = amax / 127.0f / 256.0f;
        a.s[b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
        a.corr[b] = 16 * digits;  // 128 (256 sum xq + sum xr) over a row's 8 lanes
    }
}

// 256 dot(u, xq) + dot(u, xr) of one vector of codes against 16-byte x halves broadcast.
inline __m512i dot2(__m512i u_first, __m512i u_second, const int8_t* xq, const int8_t* xr,
                    bool wide) {
    const auto bcast = [wide](const int8_t* p) {
        return wide ? _mm512_broadcast_i64x4(_mm256_load_si256(reinterpret_cast<const __m256i*>(p)))
                    : _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(p)));
    };
    const int64_t half = wide ? 0 : 16;  // Q4: second vector pairs with weights 16-31
    __m512i first = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u_first, bcast(xq));
    __m512i second = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u_first, bcast(xr));
    if (!wide) {
        first = _mm512_dpbusd_epi32(first, u_second, bcast(xq + half));
        second = _mm512_dpbusd_epi32(second, u_second, bcast(xr + half));
    }
    return _mm512_add_epi32(_mm512_slli_epi32(first, 8), second);
}

// d (4 floats) spread over the lanes of each row's partial sums: 4 lanes per row (Q4),
// or 8 lanes per row of a pair starting at row `pair` (Q8).
inline __m512 spread(__m128 d, int pair) {
    const __m512i four = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i eight = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512 v = _mm512_castps128_ps512(d);
    if (pair < 0) return _mm512_permutexvar_ps(four, v);
    return _mm512_permutexvar_ps(_mm512_add_epi32(eight, _mm512_set1_epi32(pair)), v);
}

// One record (block b of the tile) into the accumulators of parity set `acc`.
template <int F, int M>
inline void record(const Acts* acts, const uint8_t* rec, int64_t b, __m512 acc[M][2],
                   __m128 acc_m[M]) {
    const __m512i nibble = _mm512_set1_epi8(15), flip = _mm512_set1_epi8(-128);
    // Records are 96-160 bytes: one prefetch per record would skip every third line.
    for (int64_t line = 0; line < record_bytes<F>(); line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetchAhead + line), _MM_HINT_T0);
    const __m128 d = _mm_loadu_ps(reinterpret_cast<const float*>(rec));
    const uint8_t* codes = rec + header_bytes<F>();
    __m512i u[2];
    if constexpr (F == kQ8_0) {
        u[0] = _mm512_xor_si512(_mm512_loadu_si512(codes), flip);
        u[1] = _mm512_xor_si512(_mm512_loadu_si512(codes + 64), flip);
    } else {
        const __m512i c = _mm512_loadu_si512(codes);
        u[0] = _mm512_and_si512(c, nibble);
        u[1] = _mm512_and_si512(_mm512_srli_epi16(c, 4), nibble);
    }
    __m128 m = _mm_setzero_ps();
    if constexpr (F == kQ4_1) m = _mm_loadu_ps(reinterpret_cast<const float*>(rec + 16));
    if constexpr (F == kQ4_0) m = _mm_mul_ps(d, _mm_set1_ps(-8.0f));
    for (int i = 0; i < M; ++i) {
        const Acts& a = acts[i];
        const int8_t *xq = a.q + b * kBlock, *xr = a.r + b * kBlock;
        const __m128 de = _mm_mul_ps(d, _mm_set1_ps(a.e[b]));
        if constexpr (F == kQ8_0) {
            const __m512i corr = _mm512_set1_epi32(a.corr[b]);
            for (int v = 0; v < 2; ++v) {
                const __m512i dot = _mm512_sub_epi32(dot2(u[v], u[v], xq, xr, true), corr);
                acc[i][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), spread(de, 2 * v), acc[i][v]);
            }
        } else {
            const __m512i dot = dot2(u[0], u[1], xq, xr, false);
            acc[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), spread(de, -1), acc[i][0]);
            acc_m[i] = _mm_fmadd_ps(m, _mm_set1_ps(a.s[b]), acc_m[i]);
        }
    }
}

// One tile (4 output features) for M rows of x. Even and odd blocks accumulate apart:
// one chain of dependent FMAs per record would wait on the FMA's latency.
template <int F, int M>
void tile(const Acts* acts, const uint8_t* tile, int64_t blocks, float out[M][kTile]) {
    constexpr int V = F == kQ8_0 ? 2 : 1;  // code vectors per record
    __m512 acc[2][M][2];
    __m128 acc_m[2][M];  // sum m_b s_b per row of the tile (Q4_1, Q4_0)
    for (int p = 0; p < 2; ++p)
        for (int i = 0; i < M; ++i) {
            acc_m[p][i] = _mm_setzero_ps();
            acc[p][i][0] = acc[p][i][1] = _mm512_setzero_ps();
        }
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
        record<F, M>(acts, tile + b * record_bytes<F>(), b, acc[0], acc_m[0]);
        record<F, M>(acts, tile + (b + 1) * record_bytes<F>(), b + 1, acc[1], acc_m[1]);
    }
    for (; b < blocks; ++b) record<F, M>(acts, tile + b * record_bytes<F>(), b, acc[0], acc_m[0]);
    for (int i = 0; i < M; ++i) {
        alignas(64) float lanes[V * 16];
        for (int v = 0; v < V; ++v)
            _mm512_store_ps(lanes + 16 * v, _mm512_add_ps(acc[0][i][v], acc[1][i][v]));
        alignas(16) float offs[4];
        _mm_store_ps(offs, _mm_add_ps(acc_m[0][i], acc_m[1][i]));
        const int per_row = F == kQ8_0 ? 8 : 4;
        for (int r = 0; r < kTile; ++r) {
            float sum = 0.0f;
            for (int k = 0; k < per_row; ++k) sum += lanes[r * per_row + k];
            out[i][r] = sum + offs[r];
        }
    }
}

template <int F, int M>
void rows_pass(const Acts* acts, const uint8_t* packed, const float* bias, float* y, int64_t K,
               int64_t N) {
    const int64_t blocks = K / kBlock, tiles = (N + kTile - 1) / kTile;
    const int64_t tile_bytes = blocks * record_bytes<F>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
        float out[M][kTile];
        tile<F, M>(acts, packed + t * tile_bytes, blocks, out);
        for (int r = 0; r < kTile && t * kTile + r < N; ++r) {
            const int64_t n = t * kTile + r;
            for (int i = 0; i < M; ++i) y[i * N + n] = out[i][r] + (bias ? bias[n] : 0.0f);
        }
    }
}

template <int F>
void linear(const Acts* acts, const uint8_t* packed, const float* bias, float* y, int64_t M,
            int64_t K, int64_t N) {
    switch (M) {
        case 1: rows_pass<F, 1>(acts, packed, bias, y, K, N); break;
        case 2: rows_pass<F, 2>(acts, packed, bias, y, K, N); break;
        case 3: rows_pass<F, 3>(acts, packed, bias, y, K, N); break;
        case 4: rows_pass<F, 4>(acts, packed, bias, y, K, N); break;
        case 5: rows_pass<F, 5>(acts, packed, bias, y, K, N); break;
        case 6: rows_pass<F, 6>(acts, packed, bias, y, K, N); break;
        case 7: rows_pass<F, 7>(acts, packed, bias, y, K, N); break;
        default: rows_pass<F, 8>(acts, packed, bias, y, K, N); break;
    }
}
#endif

}  // namespace

extern "C" {

// 1 if this build has the VNNI kernel, 0 if not (the entry point then returns 2).
int kvflow_block_vnni_isa() {
#if defined(KVFLOW_VNNI)
    return 1;
#else
    return 0;
#endif
}

// format: 0 = Q8_0, 1 = Q4_0, 2 = Q4_1; packed: block_linear.cpp's tiles. x float32
// [rows, in_features] (row stride x_row_stride, unit column stride), rows 1..8; bias
// float32 [out_features] or null; y float32 [rows, out_features] contiguous. Returns 0;
// 1 for bad arguments; 2 where the build has no VNNI.
int kvflow_block_vnni_linear(int format, const float* x, const void* packed, const float* bias,
                             float* y, int64_t rows, int64_t in_features, int64_t out_features,
                             int64_t x_row_stride) {
    if (format < kQ8_0 || format > kQ4_1 || in_features <= 0 || in_features % kBlock ||
        in_features / kBlock > kMaxBlocks || rows < 1 || rows > kMaxRows)
        return 1;
#if defined(KVFLOW_VNNI)
    const int64_t blocks = in_features / kBlock;
    // Heap, once per calling thread (~600 KB: too large for a library's static TLS).
    static thread_local std::unique_ptr<Acts[]> storage(new Acts[kMaxRows]);
    Acts* acts = storage.get();
    for (int64_t i = 0; i < rows; ++i) quantize_row(x + i * x_row_stride, acts[i], blocks);
    const auto* p = static_cast<const uint8_t*>(packed);
    if (format == kQ8_0) linear<kQ8_0>(acts, p, bias, y, rows, in_features, out_features);
    else if (format == kQ4_0) linear<kQ4_0>(acts, p, bias, y, rows, in_features, out_features);
    else linear<kQ4_1>(acts, p, bias, y, rows, in_features, out_features);
    return 0;
#else
    (void)x, (void)packed, (void)bias, (void)y, (void)out_features, (void)x_row_stride;
    return 2;
#endif
}

}  // extern "C"
