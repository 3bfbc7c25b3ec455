// Paged decode attention on CPUs: one query token per request, attending the request's
// whole context read in place from the paged KV cache.
//
// Why native code: torch has no paged-attention op on CPU, so the torch path first
// gathers every context into a padded tensor (a full extra read + write of the KV) and
// then runs SDPA, whose per-(request, head) overhead dominates at one query row. Here
// each request is one task that walks its blocks in order (the G = H / KH query heads
// of a KV head share every K/V row read), scores are kept for the whole context (two
// passes: softmax needs the max), and the tasks run on torch's own OpenMP thread pool
// (same libgomp). Where -march enables AVX-512 and head_dim is a multiple of 32, the
// inner loops are paged_decode_avx512.h's (tiles of 16 rows, AVX512_BF16 where present);
// elsewhere vectors of 8 floats and a vectorizable exp come from vec.h, and a head_dim
// that is not a multiple of 8 takes the scalar loops.
//
// Built at first use by native_build.py; the torch reference is
// paged_decode_attention_ref in paged_decode.py.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "paged_decode_quant.h"
#include "vec.h"
#if defined(__AVX512F__)
#include "paged_decode_avx512.h"
#include "paged_decode_quant_avx512.h"
#endif

namespace {

using namespace kvflow_cpu;

struct Shape {
    int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
    int64_t q_token_stride, out_token_stride;  // elements between consecutive tokens
    int64_t window;  // <= 0: no sliding window
    float scale;
};

// Per-thread buffers, reused across the thread's tasks.
struct Scratch {
    std::vector<f32x8> q, acc;  // [heads, head_dim / 8] (vector path)
    std::vector<float> q_flat, acc_flat, scores, denom;
    std::vector<uint16_t> q_bf16;  // [heads, head_dim] (AVX-512 BF16 path)
    std::vector<uint16_t> q_packed;  // [kv heads, head_dim / 8, 4, 8] (score_tile_heads)
    std::vector<int64_t> slots;    // [n]: the cache slot of each visible position
};

// Calls f(i, slot, count, next) for each run of consecutive slots (at most a block)
// holding the context positions first + i .. first + i + count - 1, walking the block
// table; `next` is the first slot of the following run (-1 after the last), to prefetch.
template <typename F>
inline void for_each_run(const int32_t* table, int64_t first, int64_t end, int64_t block_size,
                         F&& f) {
    for (int64_t pos = first; pos < end;) {
        const int64_t block = pos / block_size;
        const int64_t stop = std::min(end, (block + 1) * block_size);
        const int64_t next = stop < end ? static_cast<int64_t>(table[block + 1]) * block_size : -1;
        f(pos - first, static_cast<int64_t>(table[block]) * block_size + (pos - block * block_size),
          stop - pos, next);
        pos = stop;
    }
}

// Asks for the `bytes` from p to be brought to cache ahead of use: the block table makes
// the context's blocks discontiguous, which the hardware prefetchers do not follow.
inline void prefetch_bytes(const void* p, int64_t bytes) {
    const char* c = static_cast<const char*>(p);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

// Scores of `heads` query heads (G per KV head) against `count` K rows starting at
// k_rows (row stride `stride` elements), written to scores[h * n + t]. A KV head's K
// row is loaded (and converted from bf16) once into registers for its G query heads.
constexpr int64_t kMaxRegisterChunks = 16;  // head_dim <= 128

template <typename T>
void score_rows_vec(const f32x8* q, const T* k_rows, int64_t stride, int64_t count,
                    int64_t kv_heads, int64_t G, int64_t chunks, float* scores, int64_t n,
                    const T* next_rows) {
    for (int64_t t = 0; t < count; ++t) {
        if (next_rows) prefetch_bytes(next_rows + t * stride, kv_heads * chunks * 8 * sizeof(T));
        for (int64_t kh = 0; kh < kv_heads; ++kh) {
            const T* k = k_rows + t * stride + kh * chunks * 8;
            f32x8 kv[kMaxRegisterChunks];
            const bool in_registers = chunks <= kMaxRegisterChunks;
            if (in_registers)
                for (int64_t c = 0; c < chunks; ++c) kv[c] = load8(k + c * 8);
            for (int64_t g = 0; g < G; ++g) {
                const int64_t h = kh * G + g;
                const f32x8* qh = q + h * chunks;
                f32x8 a0 = {}, a1 = {};  // two chains: the FMA latency is hidden
                int64_t c = 0;
                for (; c + 2 <= chunks; c += 2) {
                    a0 += qh[c] * (in_registers ? kv[c] : load8(k + c * 8));
                    a1 += qh[c + 1] * (in_registers ? kv[c + 1] : load8(k + c * 8 + 8));
                }
                if (c < chunks) a0 += qh[c] * (in_registers ? kv[c] : load8(k + c * 8));
                scores[h * n + t] = hsum(a0 + a1);
            }
        }
    }
}

// acc[h] += sum over the `count` V rows of p[h * n + t] * row_t[h / G].
template <typename T>
void accumulate_rows_vec(f32x8* acc, const float* p, const T* v_rows, int64_t stride,
                         int64_t count, int64_t kv_heads, int64_t G, int64_t chunks, int64_t n,
                         const T* next_rows) {
    if (next_rows)
        for (int64_t t = 0; t < count; ++t)
            prefetch_bytes(next_rows + t * stride, kv_heads * chunks * 8 * sizeof(T));
    for (int64_t h = 0; h < kv_heads * G; ++h) {
        const T* v = v_rows + (h / G) * chunks * 8;  // once per head and block: cheap
        const float* ph = p + h * n;
        f32x8* a = acc + h * chunks;
        int64_t c = 0;
        for (; c + 4 <= chunks; c += 4) {  // 4 accumulators stay in registers over the rows
            f32x8 a0 = a[c], a1 = a[c + 1], a2 = a[c + 2], a3 = a[c + 3];
            for (int64_t t = 0; t < count; ++t) {
                const T* row = v + t * stride + c * 8;
                const float w = ph[t];
                a0 += w * load8(row);
                a1 += w * load8(row + 8);
                a2 += w * load8(row + 16);
                a3 += w * load8(row + 24);
            }
            a[c] = a0, a[c + 1] = a1, a[c + 2] = a2, a[c + 3] = a3;
        }
        for (; c < chunks; ++c) {
            f32x8 a0 = a[c];
            for (int64_t t = 0; t < count; ++t) a0 += ph[t] * load8(v + t * stride + c * 8);
            a[c] = a0;
        }
    }
}

template <typename T>
void score_rows_scalar(const float* q, const T* k_rows, int64_t stride, int64_t count,
                       int64_t heads, int64_t G, int64_t D, float* scores, int64_t n) {
    for (int64_t t = 0; t < count; ++t)
        for (int64_t h = 0; h < heads; ++h) {
            const T* k = k_rows + t * stride + (h / G) * D;
            float sum = 0.0f;
            for (int64_t d = 0; d < D; ++d) sum += q[h * D + d] * load(k[d]);
            scores[h * n + t] = sum;
        }
}

template <typename T>
void accumulate_rows_scalar(float* acc, const float* p, const T* v_rows, int64_t stride,
                            int64_t count, int64_t heads, int64_t G, int64_t D, int64_t n) {
    for (int64_t t = 0; t < count; ++t)
        for (int64_t h = 0; h < heads; ++h) {
            const T* v = v_rows + t * stride + (h / G) * D;
            for (int64_t d = 0; d < D; ++d) acc[h * D + d] += p[h * n + t] * load(v[d]);
        }
}

// In place: scores[h * n + i] becomes exp(score - max over i); denom[h] gets their sum.
inline void softmax_numerators(float* scores, int64_t heads, int64_t n, float* denom) {
    for (int64_t h = 0; h < heads; ++h) {
        float* sh = scores + h * n;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n; ++i) m = std::max(m, sh[i]);
        for (int64_t i = 0; i < n; ++i) sh[i] = exp_approx(sh[i] - m);
        float sum = 0.0f;
        for (int64_t i = 0; i < n; ++i) sum += sh[i];
        denom[h] = sum;
    }
}

// One task: query heads [h0, h0 + heads) of one request (whole KV heads, from kv_begin)
// attend its positions [first, seq_len).
template <typename T>
void attend_one(const T* q, const T* k_cache, const T* v_cache, const int32_t* table,
                int64_t seq_len, int64_t kv_begin, int64_t kv_end, T* out, const Shape& s,
                Scratch& w) {
    const int64_t G = s.num_heads / s.num_kv_heads, D = s.head_dim, KH = s.num_kv_heads;
    const int64_t heads = (kv_end - kv_begin) * G, h0 = kv_begin * G;
    const int64_t first = s.window > 0 ? std::max<int64_t>(0, seq_len - s.window) : 0;
    const int64_t n = seq_len - first, stride = KH * D;
    const bool vec = D % 8 == 0;
    const int64_t chunks = D / 8;
    w.scores.resize(heads * n);
    w.denom.resize(heads);
    w.q_flat.resize(heads * D);
    for (int64_t i = 0; i < heads * D; ++i) w.q_flat[i] = load(q[h0 * D + i]) * s.scale;
    if (vec) {
        w.q.resize(heads * chunks);
        std::memcpy(w.q.data(), w.q_flat.data(), heads * D * sizeof(float));
        w.acc.assign(heads * chunks, f32x8{});
    } else {
        w.acc_flat.assign(heads * D, 0.0f);
    }
    float* scores = w.scores.data();

    // Pass 1: every visible position's score (each K row read once for its G heads).
    auto score_run = [&](int64_t i0, int64_t slot, int64_t count, int64_t next) {
        const T* k_rows = k_cache + (slot * KH + kv_begin) * D;
        const T* k_next = next >= 0 ? k_cache + (next * KH + kv_begin) * D : nullptr;
        if (vec)
            score_rows_vec(w.q.data(), k_rows, stride, count, heads / G, G, chunks, scores + i0, n,
                           k_next);
        else
            score_rows_scalar(w.q_flat.data(), k_rows, stride, count, heads, G, D, scores + i0, n);
    };
    for_each_run(table, first, seq_len, s.block_size, score_run);
    softmax_numerators(scores, heads, n, w.denom.data());
    // Pass 2: probability-weighted sum of the values.
    auto accumulate_run = [&](int64_t i0, int64_t slot, int64_t count, int64_t next) {
        const T* v_rows = v_cache + (slot * KH + kv_begin) * D;
        const T* v_next = next >= 0 ? v_cache + (next * KH + kv_begin) * D : nullptr;
        if (vec)
            accumulate_rows_vec(w.acc.data(), scores + i0, v_rows, stride, count, heads / G, G,
                                chunks, n, v_next);
        else
            accumulate_rows_scalar(w.acc_flat.data(), scores + i0, v_rows, stride, count, heads, G,
                                   D, n);
    };
    for_each_run(table, first, seq_len, s.block_size, accumulate_run);
    const float* acc = vec ? reinterpret_cast<const float*>(w.acc.data()) : w.acc_flat.data();
    for (int64_t h = 0; h < heads; ++h) {
        const float inv = 1.0f / w.denom[h];
        for (int64_t d = 0; d < D; ++d) store(out + (h0 + h) * D + d, acc[h * D + d] * inv);
    }
}

#if defined(__AVX512F__)
// attend_one with the AVX-512 tiles (paged_decode_avx512.h); head_dim % 32 == 0.
template <typename T>
void attend_one_avx512(const T* q, const T* k_cache, const T* v_cache, const int32_t* table,
                       int64_t seq_len, int64_t kv_begin, int64_t kv_end, T* out,
                       const Shape& s, Scratch& w) {
    namespace x = avx512;
    const int64_t G = s.num_heads / s.num_kv_heads, D = s.head_dim, KH = s.num_kv_heads;
    const int64_t heads = (kv_end - kv_begin) * G, h0 = kv_begin * G;
    const int64_t first = s.window > 0 ? std::max<int64_t>(0, seq_len - s.window) : 0;
    const int64_t n = seq_len - first, row_bytes = (kv_end - kv_begin) * D * sizeof(T);
    w.slots.resize(n);
    for_each_run(table, first, seq_len, s.block_size,
                 [&](int64_t i0, int64_t slot, int64_t count, int64_t) {
                     for (int64_t i = 0; i < count; ++i) w.slots[i0 + i] = (slot + i) * KH * D;
                 });
    w.scores.resize(heads * n);
    w.denom.resize(heads);
    w.q_flat.resize(heads * D);
    w.q_bf16.resize(heads * D);
    w.acc_flat.assign(heads * D, 0.0f);
    for (int64_t h = 0; h < heads; ++h)
        x::prepare_query(q + (h0 + h) * D, D, s.scale, w.q_flat.data() + h * D,
                         w.q_bf16.data() + h * D);
    const float post_scale = x::deferred_scale<T>(s.scale);
    const bool together = x::heads_together<T>(G);
#if defined(__AVX512BF16__)
    const int64_t packed_size = D / 8 * x::kHeadSlots * 8;
    if (together) {
        w.q_packed.resize((kv_end - kv_begin) * packed_size);
        for (int64_t kh = 0; kh < kv_end - kv_begin; ++kh)
            x::pack_heads(w.q_bf16.data() + kh * G * D, G, D, w.q_packed.data() + kh * packed_size);
    }
#endif
    float* scores = w.scores.data();
    const int64_t* slots = w.slots.data();

    // The tile from t0 in `cache` at KV head kv_begin; rows past count repeat row t0.
    auto tile_rows = [&](const T* cache, int64_t t0, int count, const T** rows) {
        for (int r = 0; r < x::kTile; ++r)
            rows[r] = cache + slots[t0 + (r < count ? r : 0)] + kv_begin * D;
    };
    // One prefetch cursor over the K rows then the V rows (positions 0 .. 2n), kept about
    // kAhead rows ahead of the rows in use, so V's first rows are on the way while K's
    // last are scored. The block table scatters the context over the cache, which the
    // hardware prefetchers do not follow. The cursor advances a few lines at a time
    // between the dot products of a tile rather than a tile's 96 lines at once: a burst
    // fills the core's miss queue and stalls it until lines return, while a trickle
    // keeps the queue busy as the work goes on (W1's shape from DRAM: 1.31 -> 1.04 ms).
    // prefetcht2 (to the L2): on Zen 4 it keeps many more lines in flight than prefetcht0
    // (1.5x slower here). asm because GCC deletes a loop of __builtin_prefetch calls it
    // sees no use of.
    constexpr int64_t kAhead = 2 * x::kTile;  // 16 rows: 13% slower; 48, 64: the same
    const int64_t lines_per_row = (row_bytes + 63) / 64;
    int64_t cursor = 0, cursor_line = 0;  // the next row to prefetch, and its next line
    auto prefetch_until = [&](int64_t row_end, int64_t max_lines) {
        for (row_end = std::min(row_end, 2 * n); cursor < row_end && max_lines > 0;) {
            const int64_t t = cursor < n ? cursor : cursor - n;
            const char* row = reinterpret_cast<const char*>((cursor < n ? k_cache : v_cache) +
                                                            slots[t] + kv_begin * D);
            const int64_t stop = std::min(lines_per_row, cursor_line + max_lines);
            for (int64_t l = cursor_line; l < stop; ++l)
                asm volatile("prefetcht2 %0" : : "m"(row[64 * l]));
            max_lines -= stop - cursor_line;
            cursor_line = stop;
            if (cursor_line == lines_per_row) cursor_line = 0, ++cursor;
        }
    };
    prefetch_until(kAhead, kAhead * lines_per_row);
    const int64_t kv_heads = kv_end - kv_begin;
    // Calls f(t0, count, rows, prefetch) per tile of `cache`, base its first row in the
    // cursor's numbering; f calls prefetch() `steps` times over its work on a tile, each
    // asking for a share of the tile kAhead rows on.
    auto for_each_tile = [&](const T* cache, int64_t base, int64_t steps, auto&& f) {
        const T* rows[x::kTile];
        const int64_t share = (x::kTile * lines_per_row + steps - 1) / steps;
        for (int64_t t0 = 0; t0 < n; t0 += x::kTile) {
            const int count = static_cast<int>(std::min<int64_t>(x::kTile, n - t0));
            const int64_t goal = base + t0 + x::kTile + kAhead;
            auto prefetch = [&] { prefetch_until(goal, share); };
            tile_rows(cache, t0, count, rows);
            f(t0, count, rows, prefetch);
        }
    };
    for_each_tile(k_cache, 0, together ? kv_heads : heads, [&](int64_t t0, int count, const T* const* rows, auto&& prefetch) {
        const T* kv_rows[x::kTile];
        for (int64_t kh = 0; kh < kv_heads; ++kh) {
            for (int r = 0; r < x::kTile; ++r) kv_rows[r] = rows[r] + kh * D;
#if defined(__AVX512BF16__)
            if constexpr (sizeof(T) == 2) {
                if (together) {
                    prefetch();
                    x::score_tile_heads(kv_rows, count, D, w.q_packed.data() + kh * packed_size, G,
                                        post_scale, scores + kh * G * n + t0, n);
                    continue;
                }
            }
#endif
            for (int64_t h = kh * G; h < (kh + 1) * G; ++h) {
                prefetch();
                x::score_tile(kv_rows, count, D, w.q_flat.data() + h * D,
                              w.q_bf16.data() + h * D, post_scale, scores + h * n + t0);
            }
        }
    });
    x::softmax_numerators<x::bf16_weights<T>()>(scores, heads, n, w.denom.data());
    for_each_tile(v_cache, n, kv_heads, [&](int64_t t0, int count, const T* const* rows, auto&& prefetch) {
        const T* kv_rows[x::kTile];
        for (int64_t kh = 0; kh < kv_heads; ++kh) {
            prefetch();
            for (int r = 0; r < x::kTile; ++r) kv_rows[r] = rows[r] + kh * D;
            x::accumulate_tile(kv_rows, count, D, G, scores + kh * G * n + t0, n,
                               w.acc_flat.data() + kh * G * D);
        }
    });
    for (int64_t h = 0; h < heads; ++h) {
        const float inv = 1.0f / w.denom[h];
        const float* acc = w.acc_flat.data() + h * D;
        for (int64_t d = 0; d < D; ++d)
            store(out + (h0 + h) * D + d, acc[x::acc_index<T>(d)] * inv);
    }
}
#endif

template <typename T>
void paged_decode(const T* q, const T* k_cache, const T* v_cache, const int32_t* block_tables,
                  const int32_t* seq_lens, const int32_t* req_indices, const int32_t* token_rows,
                  int64_t num_decodes, T* out, const Shape& s) {
    // A task covers a whole request, reading each block's rows front to back; only when
    // requests are fewer than ~4 per thread are they split by KV head.
    const int64_t threads = omp_get_max_threads();
    const int64_t splits = num_decodes >= 4 * threads ? 1 : s.num_kv_heads;
    const int64_t per_split = s.num_kv_heads / splits;
    const int64_t tasks = num_decodes * splits;
#pragma omp parallel
    {
        Scratch scratch;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; ++task) {
            const int64_t i = task / splits, split = task % splits;
            const int64_t req = req_indices[i], row = token_rows[i];
            const T* q_row = q + row * s.q_token_stride;
            const int32_t* table = block_tables + req * s.max_blocks;
            const int64_t kv_begin = split * per_split, kv_end = (split + 1) * per_split;
            T* out_row = out + row * s.out_token_stride;
#if defined(__AVX512F__)
            if (s.head_dim % 32 == 0) {
                attend_one_avx512(q_row, k_cache, v_cache, table, seq_lens[req], kv_begin,
                                  kv_end, out_row, s, scratch);
                continue;
            }
#endif
            attend_one(q_row, k_cache, v_cache, table, seq_lens[req], kv_begin, kv_end,
                       out_row, s, scratch);
        }
    }
}

// paged_decode over a quantized cache of codec C (paged_decode_quant.h): the same tasks
// and thread split, rows of D + 4 bytes.
template <int C, typename T>
void paged_decode_quant(const T* q, const uint8_t* k_cache, const uint8_t* v_cache,
                        const int32_t* block_tables, const int32_t* seq_lens,
                        const int32_t* req_indices, const int32_t* token_rows,
                        int64_t num_decodes, T* out, const Shape& s) {
    const int64_t threads = omp_get_max_threads();
    const int64_t splits = num_decodes >= 4 * threads ? 1 : s.num_kv_heads;
    const int64_t per_split = s.num_kv_heads / splits;
    const int64_t tasks = num_decodes * splits;
    const int64_t G = s.num_heads / s.num_kv_heads, D = s.head_dim, KH = s.num_kv_heads;
#pragma omp parallel
    {
        quant::QuantScratch scratch;
#if defined(__AVX512F__)
        quant::avx512q::Scratch scratch512;
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; ++task) {
            const int64_t i = task / splits, split = task % splits;
            const int64_t req = req_indices[i], seq_len = seq_lens[req];
            const int64_t first = s.window > 0 ? std::max<int64_t>(0, seq_len - s.window) : 0;
            const int32_t* table = block_tables + req * s.max_blocks;
            const int64_t kv_begin = split * per_split, kv_end = (split + 1) * per_split;
            const T* q_row = q + token_rows[i] * s.q_token_stride;
            T* out_row = out + token_rows[i] * s.out_token_stride;
            auto runs = [&](auto&& f) { for_each_run(table, first, seq_len, s.block_size, f); };
#if defined(__AVX512F__)
            if (D % 32 == 0) {
                quant::avx512q::attend_one<C>(q_row, k_cache, v_cache, seq_len - first, kv_begin,
                                              kv_end, out_row, G, D, KH, s.scale, runs,
                                              scratch512);
                continue;
            }
#endif
            quant::attend_one_quant<C>(q_row, k_cache, v_cache, seq_len, first, kv_begin, kv_end,
                                       out_row, G, D, KH, s.scale, runs, softmax_numerators,
                                       scratch);
        }
    }
}

template <typename T>
int paged_decode_codec(int codec, const T* q, const void* k_cache, const void* v_cache,
                       const int32_t* block_tables, const int32_t* seq_lens,
                       const int32_t* req_indices, const int32_t* token_rows,
                       int64_t num_decodes, T* out, const Shape& s) {
    const auto* k = static_cast<const uint8_t*>(k_cache);
    const auto* v = static_cast<const uint8_t*>(v_cache);
#define KVFLOW_CODEC(C)                                                                     \
    paged_decode_quant<C>(q, k, v, block_tables, seq_lens, req_indices, token_rows,          \
                          num_decodes, out, s)
    switch (codec) {
        case quant::kInt8: KVFLOW_CODEC(quant::kInt8); return 0;
        case quant::kE4M3: KVFLOW_CODEC(quant::kE4M3); return 0;
        case quant::kE5M2: KVFLOW_CODEC(quant::kE5M2); return 0;
        default: return 2;
    }
#undef KVFLOW_CODEC
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16. Pointer shapes:
//   q [num_tokens, H, D] (token stride q_token_stride), out likewise;
//   k_cache, v_cache [num_blocks, block_size, KH, D] contiguous;
//   block_tables [num_reqs, max_blocks] int32; seq_lens [num_reqs] int32;
//   req_indices, token_rows [num_decodes] int32: which request / query row each decode is.
int kvflow_paged_decode_attention(int dtype, const void* q, const void* k_cache,
                                  const void* v_cache, const int32_t* block_tables,
                                  const int32_t* seq_lens, const int32_t* req_indices,
                                  const int32_t* token_rows, int64_t num_decodes, void* out,
                                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                  int64_t block_size, int64_t max_blocks, int64_t q_token_stride,
                                  int64_t out_token_stride, int64_t window, float scale) {
    const Shape s{num_heads, num_kv_heads, head_dim, block_size, max_blocks,
                  q_token_stride, out_token_stride, window, scale};
    if (dtype == 0) {
        paged_decode(static_cast<const float*>(q), static_cast<const float*>(k_cache),
                     static_cast<const float*>(v_cache), block_tables, seq_lens, req_indices,
                     token_rows, num_decodes, static_cast<float*>(out), s);
        return 0;
    }
    if (dtype == 1) {
        paged_decode(static_cast<const Bf16*>(q), static_cast<const Bf16*>(k_cache),
                     static_cast<const Bf16*>(v_cache), block_tables, seq_lens, req_indices,
                     token_rows, num_decodes, static_cast<Bf16*>(out), s);
        return 0;
    }
    return 1;
}

// The same over a quantized cache: codec 0 = int8, 1 = fp8 e4m3, 2 = fp8 e5m2; k_cache
// and v_cache [num_blocks, block_size, KH, head_dim + 4] bytes (kv_codec.py's rows); q
// and out of `dtype` as above.
int kvflow_paged_decode_attention_quant(int dtype, int codec, const void* q,
                                        const void* k_cache, const void* v_cache,
                                        const int32_t* block_tables, const int32_t* seq_lens,
                                        const int32_t* req_indices, const int32_t* token_rows,
                                        int64_t num_decodes, void* out, int64_t num_heads,
                                        int64_t num_kv_heads, int64_t head_dim,
                                        int64_t block_size, int64_t max_blocks,
                                        int64_t q_token_stride, int64_t out_token_stride,
                                        int64_t window, float scale) {
    const Shape s{num_heads, num_kv_heads, head_dim, block_size, max_blocks,
                  q_token_stride, out_token_stride, window, scale};
    if (dtype == 0)
        return paged_decode_codec(codec, static_cast<const float*>(q), k_cache, v_cache,
                                  block_tables, seq_lens, req_indices, token_rows, num_decodes,
                                  static_cast<float*>(out), s);
    if (dtype == 1)
        return paged_decode_codec(codec, static_cast<const Bf16*>(q), k_cache, v_cache,
                                  block_tables, seq_lens, req_indices, token_rows, num_decodes,
                                  static_cast<Bf16*>(out), s);
    return 1;
}

}  // extern "C"
