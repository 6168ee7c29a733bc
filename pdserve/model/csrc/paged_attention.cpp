// Paged decode attention on CPU: one new token per sequence attends to its cached K/V, read in
// place from the paged cache (no gather of every sequence padded to the longest).
//
// kv_layer: [num_blocks, 2, block_size, kv_heads, head_dim] (a strided view of the cache: one
// layer), q: [num_seqs, heads, head_dim], block_tables: [num_seqs, max_blocks] int64,
// context_lens: [num_seqs] int64. Work is split over sequences; a sequence's cached tokens are
// read once each (K, then V: every kv head of a token is one contiguous range). Scores and the
// softmax are in float32 whatever the cache's dtype: the queries' own, or FP8 (E4M3) read
// through a table of its 256 values.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <utility>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
// Sums of each of 16 vectors, in one vector (lane i: the sum of acc[i]): a transposing tree of
// adds instead of 16 horizontal reductions.
inline __m512 sum16(const __m512* acc) {
  __m512 pairs[8];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                             _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
  }
  __m512 quads[4];
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: [a, b, c, d], partial over that lane
    const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x44),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xEE));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x44),
                                   _mm512_shuffle_f32x4(quads[2], quads[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

// scores[i] = q . rows[i] for 16 rows of head_dim floats (head_dim a multiple of 16).
inline void dot16(const float* q, const float* const* rows, int64_t head_dim, float* scores) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 16) {
    const __m512 qv = _mm512_loadu_ps(q + d);
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(rows[i] + d), acc[i]);
  }
  _mm512_storeu_ps(scores, sum16(acc));
}
#endif

// Scores of positions [first, first + 16) for every head, 16 at a time (float caches on AVX-512);
// false when this build or dtype has no such path.
template <typename scalar_t>
inline bool score16(const float*, const scalar_t*, const int64_t*, int64_t, int64_t, int64_t,
                    int64_t, int64_t, int64_t, int64_t, int64_t, float*) {
  return false;
}

#if defined(__AVX512F__)
template <>
inline bool score16<float>(const float* query, const float* kv, const int64_t* table,
                           int64_t first, int64_t context, int64_t heads, int64_t group,
                           int64_t head_dim, int64_t block_size, int64_t block_stride,
                           int64_t token_stride, float* scores) {
  if (head_dim % 16 != 0) return false;
  const int64_t head_stride = head_dim;  // kv heads of a token are adjacent (checked by caller)
  const float* tokens[16];  // the 16 positions' K rows (kv head 0)
  if (block_size % 16 == 0) {  // one block holds them: one table lookup, no division per row
    const float* base =
        kv + table[first / block_size] * block_stride + (first % block_size) * token_stride;
    for (int i = 0; i < 16; ++i) tokens[i] = base + i * token_stride;
    if (first % block_size == 0 && first + block_size < context) {  // the next block's K
      const char* next = reinterpret_cast<const char*>(
          kv + table[first / block_size + 1] * block_stride);
      const int64_t bytes = block_size * token_stride * static_cast<int64_t>(sizeof(float));
      for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch(next + offset, _MM_HINT_T0);
    }
  } else {
    for (int i = 0; i < 16; ++i) {
      const int64_t pos = first + i;
      tokens[i] = kv + table[pos / block_size] * block_stride + (pos % block_size) * token_stride;
    }
  }
  const float* rows[16];
  for (int64_t h = 0; h < heads; ++h) {
    if (h % group == 0) {
      for (int i = 0; i < 16; ++i) rows[i] = tokens[i] + (h / group) * head_stride;
    }
    dot16(query + h * head_dim, rows, head_dim, scores + h * context + first);
  }
  return true;
}

// exp of 16 floats: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p the degree-6 Taylor polynomial
// (relative error ~2e-7, below float32's rounding of the scores themselves).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));  // below: 0 (exp underflows float32 anyway)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2, high bits
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);     // and the rest
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// row[0..count) = exp(row - max(row)), 16 at a time (the tail masked); returns their sum.
inline float exp_row16(float* row, int64_t count) {
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 mask = count - i >= 16 ? 0xFFFF : (__mmask16)((1u << (count - i)) - 1);
    top = _mm512_mask_max_ps(top, mask, top, _mm512_maskz_loadu_ps(mask, row + i));
  }
  const __m512 maximum = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 total = _mm512_setzero_ps();
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 mask = count - i >= 16 ? 0xFFFF : (__mmask16)((1u << (count - i)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, row + i), maximum));
    total = _mm512_mask_add_ps(total, mask, total, e);
    _mm512_mask_storeu_ps(row + i, mask, e);
  }
  return _mm512_reduce_add_ps(total);
}

// row[0..count) = softmax(row) x factor.
inline void softmax16(float* row, int64_t count, float factor) {
  const __m512 inverse = _mm512_set1_ps(factor / exp_row16(row, count));
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 mask = count - i >= 16 ? 0xFFFF : (__mmask16)((1u << (count - i)) - 1);
    _mm512_mask_storeu_ps(row + i, mask, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, row + i), inverse));
  }
}

// out[line] = weights[line] . V over the first `keys` positions for N lines (query heads of one
// kv head; prefill: rows x heads) of DV x 16: N x DV accumulators in registers over the whole
// context, the cache read block by block. `weights` rows are `width` apart.
template <int DV, int N>
void value_block(const float* weights, const float* values, const int64_t* table, int64_t keys,
                 int64_t width, int64_t block_size, int64_t block_stride, int64_t token_stride,
                 float* out) {
  __m512 acc[N][DV];
  for (int i = 0; i < N; ++i)
    for (int d = 0; d < DV; ++d) acc[i][d] = _mm512_setzero_ps();
  for (int64_t start = 0; start < keys; start += block_size) {  // block by block: no division
    const float* block = values + table[start / block_size] * block_stride;
    const int64_t stop = std::min(keys, start + block_size);
    for (int64_t pos = start; pos < stop; ++pos) {
      const float* v = block + (pos - start) * token_stride;
      __m512 row[DV];
      for (int d = 0; d < DV; ++d) row[d] = _mm512_loadu_ps(v + 16 * d);
      for (int i = 0; i < N; ++i) {
        const __m512 w = _mm512_set1_ps(weights[i * width + pos]);
        for (int d = 0; d < DV; ++d) acc[i][d] = _mm512_fmadd_ps(w, row[d], acc[i][d]);
      }
    }
  }
  for (int i = 0; i < N; ++i)
    for (int d = 0; d < DV; ++d) _mm512_storeu_ps(out + i * DV * 16 + 16 * d, acc[i][d]);
}

using ValueBlock = void (*)(const float*, const float*, const int64_t*, int64_t, int64_t, int64_t,
                           int64_t, int64_t, float*);

// The decode value pass for (group, head_dim): `value_block` with one line per query head of the
// group, or nullptr (more than 16 accumulators, or a head size that is not 32, 64 or 128).
inline ValueBlock values_for(int64_t group, int64_t head_dim) {
#define PDSERVE_VALUES(G, D) \
  if (group == G && head_dim == 16 * D) return &value_block<D, G>;
  PDSERVE_VALUES(1, 2) PDSERVE_VALUES(2, 2) PDSERVE_VALUES(4, 2) PDSERVE_VALUES(8, 2)
  PDSERVE_VALUES(1, 4) PDSERVE_VALUES(2, 4) PDSERVE_VALUES(4, 4)
  PDSERVE_VALUES(1, 8) PDSERVE_VALUES(2, 8)
#undef PDSERVE_VALUES
  return nullptr;
}
#endif

// The softmax and value pass of a float cache on AVX-512, given every head's scores (scaled),
// the weights times v_scale (V's scale); false when this build, dtype or shape has no such path.
template <typename scalar_t, typename cache_t>
inline bool softmax_values16(float*, const cache_t*, const int64_t*, int64_t, int64_t, int64_t,
                             int64_t, int64_t, int64_t, int64_t, int64_t, float, scalar_t*) {
  return false;
}

#if defined(__AVX512F__)
template <>
inline bool softmax_values16<float, float>(float* scores, const float* kv, const int64_t* table,
                                           int64_t context, int64_t heads, int64_t group,
                                           int64_t head_dim, int64_t block_size,
                                           int64_t block_stride, int64_t kv_stride,
                                           int64_t token_stride, float v_scale, float* out) {
  const ValueBlock values = values_for(group, head_dim);
  if (values == nullptr) return false;
  for (int64_t h = 0; h < heads; ++h) softmax16(scores + h * context, context, v_scale);
  for (int64_t kv_head = 0; kv_head < heads / group; ++kv_head) {
    values(scores + kv_head * group * context, kv + kv_stride + kv_head * head_dim, table,
           context, context, block_size, block_stride, token_stride,
           out + kv_head * group * head_dim);
  }
  return true;
}
#endif

template <typename T>
inline float to_float(T value) {
  return static_cast<float>(value);
}

// The float value of an FP8 E4M3 ("fn": no infinities) byte, bit for bit as torch converts it:
// a sign, 4 exponent bits (bias 7) and 3 mantissa bits; exponent 0 is subnormal (m x 2^-9), and
// S.1111.111 is NaN (torch's payload: 0x7ff00000 with the sign).
inline float fp8_e4m3fn_value(uint8_t byte) {
  const uint32_t sign = static_cast<uint32_t>(byte & 0x80) << 24;
  const uint32_t exponent = (byte >> 3) & 0xF, mantissa = byte & 0x7;
  if (exponent == 0) {
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -9);
    return sign != 0 ? -magnitude : magnitude;
  }
  const uint32_t bits = exponent == 0xF && mantissa == 0x7
                            ? sign | 0x7FF00000u
                            : sign | (exponent + 127 - 7) << 23 | mantissa << 20;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// Every byte's value, built once: reading an FP8 cache is one lookup per element.
const std::array<float, 256> kFp8E4m3fnValues = [] {
  std::array<float, 256> values{};
  for (int byte = 0; byte < 256; ++byte) values[byte] = fp8_e4m3fn_value(static_cast<uint8_t>(byte));
  return values;
}();

inline float to_float(c10::Float8_e4m3fn value) {
  return kFp8E4m3fnValues[value.x];
}

// One sequence, every head: for each cached token its K row (all kv heads, one contiguous range)
// is read once, scored against every query head, then V likewise. The cache's scales fold in
// where they cost nothing: k_scale into the query (q . (k x s) = (q x s) . k), v_scale into the
// softmax's normalisation.
template <typename scalar_t, typename cache_t>
void decode_sequence(const scalar_t* q, int64_t q_head_stride, const cache_t* kv,
                     const int64_t* table, int64_t context, int64_t heads, int64_t group,
                     int64_t head_dim, int64_t block_size, int64_t block_stride,
                     int64_t kv_stride, int64_t token_stride, int64_t head_stride, float scale,
                     float v_scale, scalar_t* out, std::vector<float>& scores,
                     std::vector<float>& acc, std::vector<float>& query) {
  scores.resize(static_cast<size_t>(heads * context));
  acc.assign(static_cast<size_t>(heads * head_dim), 0.0f);
  query.resize(static_cast<size_t>(heads * head_dim));
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t d = 0; d < head_dim; ++d) {
      query[h * head_dim + d] = to_float(q[h * q_head_stride + d]) * scale;
    }
  }
  int64_t vectorised = 0;  // positions scored 16 at a time
  if (head_stride == head_dim) {
    while (vectorised + 16 <= context &&
           score16<cache_t>(query.data(), kv, table, vectorised, context, heads, group, head_dim,
                            block_size, block_stride, token_stride, scores.data())) {
      vectorised += 16;
    }
  }
  for (int64_t pos = vectorised; pos < context; ++pos) {
    const cache_t* k_row =
        kv + table[pos / block_size] * block_stride + (pos % block_size) * token_stride;
    for (int64_t h = 0; h < heads; ++h) {
      const cache_t* k = k_row + (h / group) * head_stride;
      const float* qh = query.data() + h * head_dim;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * to_float(k[d]);
      scores[h * context + pos] = dot;
    }
  }
  if (head_stride == head_dim &&
      softmax_values16<scalar_t, cache_t>(scores.data(), kv, table, context, heads, group,
                                          head_dim, block_size, block_stride, kv_stride,
                                          token_stride, v_scale, out)) {
    return;
  }
  for (int64_t h = 0; h < heads; ++h) {
    float* row = scores.data() + h * context;
    float maximum = -std::numeric_limits<float>::infinity();
    for (int64_t pos = 0; pos < context; ++pos) maximum = std::max(maximum, row[pos]);
    float sum = 0.0f;
    for (int64_t pos = 0; pos < context; ++pos) {
      row[pos] = std::exp(row[pos] - maximum);
      sum += row[pos];
    }
    const float inverse = v_scale / sum;
    for (int64_t pos = 0; pos < context; ++pos) row[pos] *= inverse;
  }
  for (int64_t pos = 0; pos < context; ++pos) {
    const cache_t* v_row = kv + table[pos / block_size] * block_stride + kv_stride +
                           (pos % block_size) * token_stride;
    for (int64_t h = 0; h < heads; ++h) {
      const cache_t* v = v_row + (h / group) * head_stride;
      const float weight = scores[h * context + pos];
      float* a = acc.data() + h * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) a[d] += weight * to_float(v[d]);
    }
  }
  for (int64_t i = 0; i < heads * head_dim; ++i) out[i] = static_cast<scalar_t>(acc[i]);
}

}  // namespace

// Decode attention over the paged K/V cache (see the top of this file), [seqs, heads, head_dim]
// in q's dtype. The cache has q's dtype or is FP8 (E4M3) under float queries: the real K is the
// stored one times k_scale, V times v_scale.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv_layer, torch::Tensor block_tables,
                           torch::Tensor context_lens, double scale, double k_scale,
                           double v_scale) {
  TORCH_CHECK(q.dim() == 3 && kv_layer.dim() == 5, "q [seqs, heads, dim], kv [blocks, 2, ...]");
  const bool fp8 = kv_layer.scalar_type() == at::ScalarType::Float8_e4m3fn;
  TORCH_CHECK(q.scalar_type() == kv_layer.scalar_type() || fp8,
              "the cache must have q's dtype (", q.scalar_type(), ") or be float8_e4m3fn, got ",
              kv_layer.scalar_type());
  TORCH_CHECK(kv_layer.stride(4) == 1 && q.stride(2) == 1, "head_dim must be contiguous");
  auto tables = block_tables.to(torch::kLong).contiguous();
  auto lens = context_lens.to(torch::kLong).contiguous();
  const int64_t seqs = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = kv_layer.size(3), block_size = kv_layer.size(2);
  TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv heads");
  const int64_t group = heads / kv_heads;
  auto out = torch::empty_like(q, q.options().memory_format(torch::MemoryFormat::Contiguous));
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::BFloat16, at::ScalarType::Half, q.scalar_type(), "paged_decode", [&] {
        const scalar_t* q_data = q.data_ptr<scalar_t>();
        scalar_t* out_data = out.data_ptr<scalar_t>();
        const int64_t* table_data = tables.data_ptr<int64_t>();
        const int64_t* len_data = lens.data_ptr<int64_t>();
        const int64_t max_blocks = tables.size(1);
        auto run = [&](const auto* kv) {
          using cache_t = std::remove_const_t<std::remove_pointer_t<decltype(kv)>>;
          at::parallel_for(0, seqs, 1, [&](int64_t begin, int64_t end) {
            std::vector<float> scores, acc, query;
            for (int64_t seq = begin; seq < end; ++seq) {
              decode_sequence<scalar_t, cache_t>(
                  q_data + seq * q.stride(0), q.stride(1), kv, table_data + seq * max_blocks,
                  len_data[seq], heads, group, head_dim, block_size, kv_layer.stride(0),
                  kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
                  static_cast<float>(scale * k_scale), static_cast<float>(v_scale),
                  out_data + seq * heads * head_dim, scores, acc, query);
            }
          });
        };
        if (fp8) {
          run(kv_layer.data_ptr<c10::Float8_e4m3fn>());
        } else {
          run(kv_layer.data_ptr<scalar_t>());
        }
      });
  return out;
}

// Latent (MLA) decode attention: every head of a sequence attends to one cached latent per token
// (multi-query), whose first value_dim values are also its value. The work is split into items
// of (sequence, group of heads, range of its context) so that one long sequence still spreads
// over every thread; an item reads each latent of its range once (converted to float a tile at a
// time when the cache is not float) and uses it for all of its heads, keeping per head a running
// softmax (max, sum) and an unnormalised sum of values; the items of a sequence are merged last.
namespace {
namespace latent {

constexpr int64_t kTile = 16;           // tokens converted and scored together (a multiple of 4)
constexpr int64_t kMaxGroup = 16;       // heads of one item, at most
constexpr int64_t kMinSplit = 64;       // tokens of one item, at least (unless its context is less)
constexpr int64_t kItemsPerThread = 4;  // what the context splits aim at: items even out

// The tensors of one call, as pointers and strides (cache_t: the cache's element type).
template <typename scalar_t, typename cache_t>
struct Batch {
  const scalar_t* q;
  const cache_t* kv;
  const int64_t *tables, *lens;
  int64_t max_blocks, heads, dim, value_dim, block_size, block_stride, token_stride;
  int64_t q_seq_stride, q_head_stride;
  float score_scale;  // scale x kv_scale: q . (latent x s) = (q x s) . latent
};

struct Item {
  int64_t seq, first_head, heads, begin, end;  // heads [first_head, + heads), tokens [begin, end)
};

// An item's result per head, at `index x kMaxGroup + head in the item`: the running max and sum
// of its softmax and the sum of its values weighted by exp(score - max).
struct Partials {
  std::vector<float> max, sum, values;
};

struct Scratch {
  std::vector<float> query, scores, tile, zeros;
};

// Eight floats, the inner loops' unit: an AVX2 register with FMA (every AVX-512 CPU has them
// too), else a plain array. Explicit vectors, because GCC 12 keeps neither the several sums of an
// `omp simd` reduction nor arrays of float partial sums in registers: it stores them every step.
#if defined(__AVX2__) && defined(__FMA__)
struct Float8 {
  __m256 v;
};
inline Float8 load8(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void store8(float* p, Float8 x) { _mm256_storeu_ps(p, x.v); }
inline Float8 splat8(float x) { return {_mm256_set1_ps(x)}; }
inline Float8 fma8(Float8 a, Float8 b, Float8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline float sum8(Float8 x) {
  const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(x.v), _mm256_extractf128_ps(x.v, 1));
  const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}
#else
struct Float8 {
  float v[8];
};
inline Float8 load8(const float* p) {
  Float8 x;
  std::copy(p, p + 8, x.v);
  return x;
}
inline void store8(float* p, Float8 x) { std::copy(x.v, x.v + 8, p); }
inline Float8 splat8(float value) {
  Float8 x;
  std::fill(x.v, x.v + 8, value);
  return x;
}
inline Float8 fma8(Float8 a, Float8 b, Float8 c) {
  for (int i = 0; i < 8; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return c;
}
inline float sum8(Float8 x) {
  float sum = 0.0f;
  for (int i = 0; i < 8; ++i) sum += x.v[i];
  return sum;
}
#endif

// out[h x kTile + t] = q[h] . rows[t] for H (1 or 2) query rows and 4 latent rows: one pass over
// dim with 4 x H accumulators in registers, each loaded vector used in several products; dim's
// tail past a multiple of 8 summed apart.
template <int H>
inline void dots4(const float* q, int64_t dim, const float* const* rows, float* out) {
  Float8 acc[H][4];
  for (int h = 0; h < H; ++h)
    for (int t = 0; t < 4; ++t) acc[h][t] = splat8(0.0f);
  const int64_t body = dim / 8 * 8;
  for (int64_t d = 0; d < body; d += 8) {
    Float8 row[4];
    for (int t = 0; t < 4; ++t) row[t] = load8(rows[t] + d);
    for (int h = 0; h < H; ++h) {
      const Float8 qh = load8(q + h * dim + d);
      for (int t = 0; t < 4; ++t) acc[h][t] = fma8(qh, row[t], acc[h][t]);
    }
  }
  float sums[H][4];  // acc read once, by constant indices: else it lives in memory, not registers
  for (int h = 0; h < H; ++h)
    for (int t = 0; t < 4; ++t) sums[h][t] = sum8(acc[h][t]);
  for (int h = 0; h < H; ++h) {
    for (int t = 0; t < 4; ++t) {
      for (int64_t d = body; d < dim; ++d) {
        sums[h][t] = std::fma(q[h * dim + d], rows[t][d], sums[h][t]);
      }
      out[h * kTile + t] = sums[h][t];
    }
  }
}

// scores[h x kTile + t] = query[h] . rows[t] for every head of the item and row of the tile:
// four rows at a time (in cache while every head reads them), two heads at a time.
inline void score_tile(const float* query, int64_t heads, int64_t dim, const float* const* rows,
                       float* scores) {
  for (int64_t t = 0; t < kTile; t += 4) {
    int64_t h = 0;
    for (; h + 2 <= heads; h += 2) dots4<2>(query + h * dim, dim, rows + t, scores + h * kTile + t);
    if (h < heads) dots4<1>(query + h * dim, dim, rows + t, scores + h * kTile + t);
  }
}

// values[h][first .. first + 8 V) += sum over the tile of weights[h][t] x rows[t] for H (1 or 2)
// heads: the H x V sums stay in registers over the whole tile, each row vector loaded once for
// H products.
template <int H, int V>
inline void accumulate_span(const float* weights, const float* const* rows, int64_t first,
                            int64_t value_dim, float* values) {
  Float8 acc[H][V];
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < V; ++i) acc[h][i] = load8(values + h * value_dim + first + 8 * i);
  for (int64_t t = 0; t < kTile; ++t) {
    Float8 row[V];
    for (int i = 0; i < V; ++i) row[i] = load8(rows[t] + first + 8 * i);
    for (int h = 0; h < H; ++h) {
      const Float8 w = splat8(weights[h * kTile + t]);
      for (int i = 0; i < V; ++i) acc[h][i] = fma8(w, row[i], acc[h][i]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < V; ++i) store8(values + h * value_dim + first + 8 * i, acc[h][i]);
}

// values[h] += sum over the tile of weights[h][t] x rows[t][0 .. value_dim) for H (1 or 2)
// heads: 32 values at a time, then 8, then one.
template <int H>
inline void accumulate_tile(const float* weights, const float* const* rows, int64_t value_dim,
                            float* values) {
  int64_t first = 0;
  for (; first + 32 <= value_dim; first += 32) {
    accumulate_span<H, 4>(weights, rows, first, value_dim, values);
  }
  for (; first + 8 <= value_dim; first += 8) {
    accumulate_span<H, 1>(weights, rows, first, value_dim, values);
  }
  for (; first < value_dim; ++first) {
    for (int h = 0; h < H; ++h) {
      float& sum = values[h * value_dim + first];
      for (int64_t t = 0; t < kTile; ++t) sum = std::fma(weights[h * kTile + t], rows[t][first], sum);
    }
  }
}

// The float rows of tokens [first, first + count) of a sequence (count <= kTile): the cache's
// own rows when it is float, else each converted into `tile`; the rest of the kTile rows point
// at `zeros` (their scores are masked, their weights 0).
template <typename scalar_t, typename cache_t>
void tile_rows(const Batch<scalar_t, cache_t>& b, const int64_t* table, int64_t first,
               int64_t count, float* tile, const float* zeros, const float** rows) {
  for (int64_t t = 0; t < count; ++t) {
    const int64_t pos = first + t;
    const cache_t* latent =
        b.kv + table[pos / b.block_size] * b.block_stride + (pos % b.block_size) * b.token_stride;
    if constexpr (std::is_same_v<cache_t, float>) {
      rows[t] = latent;
    } else {
      float* row = tile + t * b.dim;
#pragma omp simd
      for (int64_t d = 0; d < b.dim; ++d) row[d] = to_float(latent[d]);
      rows[t] = row;
    }
  }
  for (int64_t t = count; t < kTile; ++t) rows[t] = zeros;
}

// Folds a tile's scores into one head's running softmax: the scores become exp(score - max) (0
// past `count`), and the head's sum and values are rescaled when its max grows.
inline void softmax_tile(float* scores, int64_t count, int64_t value_dim, float& max, float& sum,
                         float* values) {
  float top = max;
  for (int64_t t = 0; t < count; ++t) top = std::max(top, scores[t]);
  if (top > max) {
    const float correction = std::exp(max - top);  // 0 for the first tile (max = -inf)
    sum *= correction;
#pragma omp simd
    for (int64_t d = 0; d < value_dim; ++d) values[d] *= correction;
    max = top;
  }
  for (int64_t t = 0; t < count; ++t) {
    scores[t] = std::exp(scores[t] - max);
    sum += scores[t];
  }
  for (int64_t t = count; t < kTile; ++t) scores[t] = 0.0f;
}

// One item: its heads over its range of tokens, into its partials (max, sum, values per head).
template <typename scalar_t, typename cache_t>
void attend_item(const Batch<scalar_t, cache_t>& b, const Item& item, Scratch& work, float* max,
                 float* sum, float* values) {
  const int64_t heads = item.heads, dim = b.dim, value_dim = b.value_dim;
  work.query.resize(heads * dim);
  work.scores.resize(heads * kTile);
  work.tile.resize(kTile * dim);
  work.zeros.assign(dim, 0.0f);
  for (int64_t h = 0; h < heads; ++h) {
    const scalar_t* qh = b.q + item.seq * b.q_seq_stride + (item.first_head + h) * b.q_head_stride;
    for (int64_t d = 0; d < dim; ++d) work.query[h * dim + d] = to_float(qh[d]) * b.score_scale;
  }
  std::fill(max, max + heads, -std::numeric_limits<float>::infinity());
  std::fill(sum, sum + heads, 0.0f);
  std::fill(values, values + heads * value_dim, 0.0f);
  const int64_t* table = b.tables + item.seq * b.max_blocks;
  const float* rows[kTile];
  for (int64_t first = item.begin; first < item.end; first += kTile) {
    const int64_t count = std::min(kTile, item.end - first);
    tile_rows(b, table, first, count, work.tile.data(), work.zeros.data(), rows);
    score_tile(work.query.data(), heads, dim, rows, work.scores.data());
    for (int64_t h = 0; h < heads; ++h) {
      softmax_tile(work.scores.data() + h * kTile, count, value_dim, max[h], sum[h],
                   values + h * value_dim);
    }
    int64_t h = 0;
    for (; h + 2 <= heads; h += 2) {
      accumulate_tile<2>(work.scores.data() + h * kTile, rows, value_dim, values + h * value_dim);
    }
    if (h < heads) {
      accumulate_tile<1>(work.scores.data() + h * kTile, rows, value_dim, values + h * value_dim);
    }
  }
}

// The work items: each sequence's heads in groups of group_heads (at most kMaxGroup, as even as
// can be), its context in ranges of `split` tokens (one length for the whole batch, so that
// items cost about the same; chosen for about kItemsPerThread items per thread). The items of a
// sequence are adjacent, group by group: (seq, group, range) is item first_item[seq] + group x
// ranges[seq] + range.
struct Plan {
  std::vector<Item> items;
  std::vector<int64_t> first_item, ranges;
  int64_t group_heads;
};

inline Plan plan_items(const int64_t* lens, int64_t seqs, int64_t heads) {
  Plan plan;
  const int64_t groups = (heads + kMaxGroup - 1) / kMaxGroup;
  plan.group_heads = (heads + groups - 1) / groups;
  int64_t tokens = 0;
  for (int64_t s = 0; s < seqs; ++s) tokens += lens[s];
  const int64_t wanted = kItemsPerThread * at::get_num_threads();
  int64_t split = std::max(kMinSplit, (tokens * groups + wanted - 1) / wanted);
  split = (split + kTile - 1) / kTile * kTile;  // only an item's last tile may be partial
  for (int64_t s = 0; s < seqs; ++s) {
    plan.first_item.push_back(static_cast<int64_t>(plan.items.size()));
    plan.ranges.push_back((lens[s] + split - 1) / split);
    for (int64_t first_head = 0; first_head < heads; first_head += plan.group_heads) {
      const int64_t count = std::min(plan.group_heads, heads - first_head);
      for (int64_t begin = 0; begin < lens[s]; begin += split) {
        plan.items.push_back({s, first_head, count, begin, std::min(lens[s], begin + split)});
      }
    }
  }
  return plan;
}

// out[seq, head] from the partials of the items that hold that head (one per range of the
// context): their softmaxes brought to a common max, the values' sum divided by the softmax's
// (times kv_scale: the values' scale).
template <typename scalar_t>
void merge_head(const Plan& plan, const Partials& partials, int64_t seq, int64_t head,
                int64_t value_dim, float kv_scale, float* merged, scalar_t* out) {
  const int64_t group = head / plan.group_heads, ranges = plan.ranges[seq];
  const int64_t first_slot = (plan.first_item[seq] + group * ranges) * kMaxGroup +
                             head % plan.group_heads;  // range r: first_slot + r x kMaxGroup
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < ranges; ++r) top = std::max(top, partials.max[first_slot + r * kMaxGroup]);
  float sum = 0.0f;
  std::fill(merged, merged + value_dim, 0.0f);
  for (int64_t r = 0; r < ranges; ++r) {
    const int64_t slot = first_slot + r * kMaxGroup;
    const float weight = std::exp(partials.max[slot] - top);
    sum += weight * partials.sum[slot];
    const float* values = partials.values.data() + slot * value_dim;
#pragma omp simd
    for (int64_t d = 0; d < value_dim; ++d) merged[d] += weight * values[d];
  }
  const float factor = kv_scale / sum;
  for (int64_t d = 0; d < value_dim; ++d) out[d] = static_cast<scalar_t>(merged[d] * factor);
}

// Every item into its partials (in parallel), then every (sequence, head) merged into `out`.
template <typename scalar_t, typename cache_t>
void run(const Batch<scalar_t, cache_t>& b, int64_t seqs, float kv_scale, scalar_t* out) {
  const Plan plan = plan_items(b.lens, seqs, b.heads);
  const int64_t count = static_cast<int64_t>(plan.items.size());
  Partials partials;
  partials.max.resize(count * kMaxGroup);
  partials.sum.resize(count * kMaxGroup);
  partials.values.resize(count * kMaxGroup * b.value_dim);
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    Scratch work;
    for (int64_t i = begin; i < end; ++i) {
      attend_item(b, plan.items[i], work, partials.max.data() + i * kMaxGroup,
                  partials.sum.data() + i * kMaxGroup,
                  partials.values.data() + i * kMaxGroup * b.value_dim);
    }
  });
  at::parallel_for(0, seqs * b.heads, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(b.value_dim);
    for (int64_t row = begin; row < end; ++row) {
      merge_head(plan, partials, row / b.heads, row % b.heads, b.value_dim, kv_scale,
                 merged.data(), out + row * b.value_dim);
    }
  });
}

}  // namespace latent

// The block ids a sequence reads, checked against the cache: a bad table would read outside it.
void check_tables(const torch::Tensor& tables, const torch::Tensor& lens, int64_t block_size,
                  int64_t num_blocks) {
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  const int64_t max_blocks = tables.size(1);
  for (int64_t s = 0; s < tables.size(0); ++s) {
    TORCH_CHECK(len[s] >= 1 && len[s] <= max_blocks * block_size, "context_lens[", s, "] = ",
                len[s], ": a decode row attends to 1 .. ", max_blocks * block_size,
                " tokens (its block table's length x block_size)");
    for (int64_t k = 0; k < (len[s] + block_size - 1) / block_size; ++k) {
      const int64_t block = table[s * max_blocks + k];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block_tables[", s, ", ", k, "] = ", block,
                  " is not a block of the cache (", num_blocks, " blocks)");
    }
  }
}

}  // namespace

// Latent attention of one new token per sequence (DeepSeek's MLA, absorbed form): q [n, heads,
// dim] against the first context_lens[i] latents of sequence i in kv_layer [num_blocks, 1,
// block_size, 1, dim] (a strided view of one layer), weighting each latent's first value_dim
// values; [n, heads, value_dim] in q's dtype, scores and sums in float32. q is float32, bfloat16
// or float16; the cache has q's dtype or is FP8 (E4M3), a stored value times kv_scale being the
// real one.
torch::Tensor latent_decode(torch::Tensor q, torch::Tensor kv_layer, torch::Tensor block_tables,
                            torch::Tensor context_lens, double scale, int64_t value_dim,
                            double kv_scale) {
  TORCH_CHECK(q.device().is_cpu() && kv_layer.device().is_cpu(), "latent_decode runs on CPU");
  TORCH_CHECK(q.dim() == 3, "q must be [n, heads, dim], got ", q.sizes());
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(1) == 1 && kv_layer.size(3) == 1,
              "kv_layer must be [num_blocks, 1, block_size, 1, dim] (one latent per token), got ",
              kv_layer.sizes());
  TORCH_CHECK(kv_layer.size(4) == q.size(2), "q's dim (", q.size(2), ") and the latents' (",
              kv_layer.size(4), ") differ");
  TORCH_CHECK(q.stride(2) == 1 && kv_layer.stride(4) == 1, "q's and kv_layer's last dim must "
              "be contiguous");
  TORCH_CHECK(value_dim >= 1 && value_dim <= q.size(2), "value_dim must be in 1 .. dim (",
              q.size(2), "), got ", value_dim);
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat || dtype == torch::kBFloat16 || dtype == torch::kHalf,
              "q must be float32, bfloat16 or float16, got ", dtype);
  const bool fp8 = kv_layer.scalar_type() == at::ScalarType::Float8_e4m3fn;
  TORCH_CHECK(fp8 || kv_layer.scalar_type() == dtype, "the cache must have q's dtype (", dtype,
              ") or be float8_e4m3fn, got ", kv_layer.scalar_type());
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
                  context_lens.dim() == 1 && context_lens.size(0) == q.size(0),
              "block_tables must be [n, max_blocks] and context_lens [n], n = q.size(0) = ",
              q.size(0));
  auto tables = block_tables.to(torch::kLong).contiguous();
  auto lens = context_lens.to(torch::kLong).contiguous();
  check_tables(tables, lens, kv_layer.size(2), kv_layer.size(0));
  const int64_t seqs = q.size(0), heads = q.size(1), dim = q.size(2);
  auto out = torch::empty({seqs, heads, value_dim}, q.options());
  if (seqs == 0 || heads == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::BFloat16, at::ScalarType::Half, dtype, "latent_decode", [&] {
        auto call = [&](const auto* kv) {
          using cache_t = std::remove_const_t<std::remove_pointer_t<decltype(kv)>>;
          const latent::Batch<scalar_t, cache_t> batch{
              q.data_ptr<scalar_t>(), kv, tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
              tables.size(1), heads, dim, value_dim, kv_layer.size(2), kv_layer.stride(0),
              kv_layer.stride(2), q.stride(0), q.stride(1),
              static_cast<float>(scale * kv_scale)};
          latent::run(batch, seqs, static_cast<float>(kv_scale), out.data_ptr<scalar_t>());
        };
        if (fp8) {
          call(kv_layer.data_ptr<c10::Float8_e4m3fn>());
        } else {
          call(kv_layer.data_ptr<scalar_t>());
        }
      });
  return out;
}

// The float value of each FP8 E4M3 byte as the kernels read an FP8 cache, [256] float32.
torch::Tensor fp8_e4m3fn_values() {
  auto values = torch::empty({256}, torch::kFloat);
  std::copy(kFp8E4m3fnValues.begin(), kFp8E4m3fnValues.end(), values.data_ptr<float>());
  return values;
}


#if defined(__AVX512F__)
namespace {

// K of one kv head of one sequence, as floats transposed per 16 positions: kt[tile][d][16] (zero
// past the context), so that a query scores 16 keys with head_dim broadcast FMAs.
template <typename cache_t>
void transpose_keys(const cache_t* keys, const int64_t* table, int64_t context, int64_t head_dim,
                    int64_t block_size, int64_t block_stride, int64_t token_stride, float* kt) {
  const int64_t tiles = (context + 15) / 16;
  std::fill(kt, kt + tiles * head_dim * 16, 0.0f);
  for (int64_t start = 0; start < context; start += block_size) {
    const cache_t* block = keys + table[start / block_size] * block_stride;
    for (int64_t pos = start; pos < std::min(context, start + block_size); ++pos) {
      const cache_t* k = block + (pos - start) * token_stride;
      float* column = kt + (pos / 16) * head_dim * 16 + pos % 16;
      for (int64_t d = 0; d < head_dim; ++d) column[d * 16] = to_float(k[d]);
    }
  }
}

// V of one kv head of one sequence as floats, its rows one after another ([context, head_dim]).
template <typename cache_t>
void dequantise_values(const cache_t* values, const int64_t* table, int64_t context,
                       int64_t head_dim, int64_t block_size, int64_t block_stride,
                       int64_t token_stride, float* rows) {
  for (int64_t start = 0; start < context; start += block_size) {
    const cache_t* block = values + table[start / block_size] * block_stride;
    for (int64_t pos = start; pos < std::min(context, start + block_size); ++pos) {
      const cache_t* v = block + (pos - start) * token_stride;
      for (int64_t d = 0; d < head_dim; ++d) rows[pos * head_dim + d] = to_float(v[d]);
    }
  }
}

// scores of N query lines (rows x heads) against T tiles of 16 keys, from tile `tile` on: N x T
// accumulators in registers (compile-time counts), one broadcast FMA each per head dimension.
template <int N, int T>
inline void score_block(const float* query, const float* kt, int64_t tile, int64_t head_dim,
                        int64_t width, float* scores) {
  __m512 acc[N][T];
  for (int i = 0; i < N; ++i)
    for (int t = 0; t < T; ++t) acc[i][t] = _mm512_setzero_ps();
  const float* keys = kt + tile * head_dim * 16;
  for (int64_t d = 0; d < head_dim; ++d) {
    __m512 k[T];
    for (int t = 0; t < T; ++t) k[t] = _mm512_loadu_ps(keys + (t * head_dim + d) * 16);
    for (int i = 0; i < N; ++i) {
      const __m512 q = _mm512_set1_ps(query[i * head_dim + d]);
      for (int t = 0; t < T; ++t) acc[i][t] = _mm512_fmadd_ps(q, k[t], acc[i][t]);
    }
  }
  for (int i = 0; i < N; ++i)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(scores + i * width + (tile + t) * 16, acc[i][t]);
}

template <int N>
inline void score_rows(const float* query, const float* kt, int64_t tiles, int64_t head_dim,
                       int64_t width, float* scores) {
  int64_t tile = 0;
  for (; tile + 2 <= tiles; tile += 2) score_block<N, 2>(query, kt, tile, head_dim, width, scores);
  if (tile < tiles) score_block<N, 1>(query, kt, tile, head_dim, width, scores);
}

// scores[line][0..width) = query[line] . K, 8 lines at a time (then the rest).
inline void score_lines(const float* query, const float* kt, int64_t tiles, int64_t head_dim,
                        int64_t lines, int64_t width, float* scores) {
  using Rows = void (*)(const float*, const float*, int64_t, int64_t, int64_t, float*);
  static constexpr Rows kRows[8] = {nullptr,        &score_rows<1>, &score_rows<2>, &score_rows<3>,
                                    &score_rows<4>, &score_rows<5>, &score_rows<6>, &score_rows<7>};
  int64_t first = 0;
  for (; first + 8 <= lines; first += 8) {
    score_rows<8>(query + first * head_dim, kt, tiles, head_dim, width, scores + first * width);
  }
  if (first < lines) {
    kRows[lines - first](query + first * head_dim, kt, tiles, head_dim, width,
                         scores + first * width);
  }
}

template <int DV, std::size_t... N>
constexpr std::array<ValueBlock, sizeof...(N)> value_blocks(std::index_sequence<N...>) {
  return {&value_block<DV, static_cast<int>(N) + 1>...};
}

// `value_block` over every line, 24 / DV lines at a time (24 accumulators and DV for the row:
// within 32 registers), then the rest in one block.
template <int DV>
void value_lines(const float* weights, const float* values, const int64_t* table, int64_t keys,
                 int64_t lines, int64_t width, int64_t block_size, int64_t block_stride,
                 int64_t token_stride, float* out) {
  constexpr int LINES = 24 / DV;
  static constexpr auto kBlocks = value_blocks<DV>(std::make_index_sequence<LINES>());
  for (int64_t first = 0; first < lines; first += LINES) {
    const int64_t count = std::min<int64_t>(LINES, lines - first);
    kBlocks[count - 1](weights + first * width, values, table, keys, width, block_size,
                       block_stride, token_stride, out + first * DV * 16);
  }
}

struct PrefillTile {
  int64_t seq, kv_head, row;  // the tile's first query row, counted in its sequence's chunk
};

// What every tile of a `paged_prefill` call reads and writes (float32 views of its tensors; the
// cache's layout, its K and V being read through `transpose_keys` and `ValueRows`).
struct PrefillBatch {
  const float* q;
  float* out;
  const int64_t *tables, *first_rows, *counts, *contexts;
  int64_t max_blocks, group, head_dim, block_size, block_stride, kv_stride, token_stride;
  int64_t q_token_stride, q_head_stride, out_token_stride, out_head_stride;
  float scale;  // the softmax's scale x k_scale: q . (k x s) = (q x s) . k
  float v_scale;
};

// Where the tiles of one (sequence, kv head) read V as floats: a float cache's blocks in place,
// or V dequantised into consecutive rows (`dequantise_values`), read as one block.
struct ValueRows {
  const float* values;  // the kv head's V in the first row of block table[0]
  const int64_t* table;
  int64_t block_size, block_stride, token_stride;
};

constexpr int64_t kOnlyBlock[1] = {0};  // the table of dequantised rows

// K and V of one (sequence, kv head) prepared for its tiles: K transposed into `kt`; V in place
// for a float cache, else dequantised into `scratch` ([context, head_dim] floats).
template <typename cache_t>
ValueRows prepare_head(const cache_t* kv, const PrefillBatch& b, int64_t seq, int64_t kv_head,
                       float* kt, float* scratch) {
  const int64_t* table = b.tables + seq * b.max_blocks;
  const int64_t context = b.contexts[seq], dim = b.head_dim;
  transpose_keys(kv + kv_head * dim, table, context, dim, b.block_size, b.block_stride,
                 b.token_stride, kt);
  const cache_t* values = kv + b.kv_stride + kv_head * dim;
  if constexpr (std::is_same_v<cache_t, float>) {
    return {values, table, b.block_size, b.block_stride, b.token_stride};
  } else {
    dequantise_values(values, table, context, dim, b.block_size, b.block_stride, b.token_stride,
                      scratch);
    return {scratch, kOnlyBlock, std::max<int64_t>(context, 1), 0, dim};
  }
}

struct PrefillScratch {
  std::vector<float> query, scores, result, inverse;
};

constexpr int64_t kPrefillRows = 16;  // query rows per tile

// One tile: up to 16 query rows x the kv head's group of heads ("lines"), against the
// sequence's keys up to the tile's last position (`kt`: its K, transposed; `v`: its V).
void attend_tile(const PrefillBatch& b, PrefillTile tile, const float* kt, const ValueRows& v,
                 PrefillScratch& work) {
  const int64_t s = tile.seq, h = tile.kv_head, group = b.group, dim = b.head_dim;
  const int64_t rows = std::min(kPrefillRows, b.counts[s] - tile.row);
  const int64_t first_pos = b.contexts[s] - b.counts[s] + tile.row;
  const int64_t keys = first_pos + rows, width = (keys + 15) / 16 * 16;
  const int64_t lines = rows * group;  // line = row * group + head in the group
  work.query.resize(lines * dim);
  work.scores.resize(lines * width);
  work.result.resize(lines * dim);
  work.inverse.resize(lines);
  const int64_t first_row = b.first_rows[s] + tile.row;
  for (int64_t line = 0; line < lines; ++line) {
    const float* qh = b.q + (first_row + line / group) * b.q_token_stride +
                      (h * group + line % group) * b.q_head_stride;
    for (int64_t d = 0; d < dim; ++d) work.query[line * dim + d] = qh[d] * b.scale;
  }
  float* scores = work.scores.data();
  score_lines(work.query.data(), kt, width / 16, dim, lines, width, scores);
  for (int64_t line = 0; line < lines; ++line) {
    const int64_t attended = first_pos + line / group + 1;  // causal: up to its own position
    work.inverse[line] = b.v_scale / exp_row16(scores + line * width, attended);
    std::fill(scores + line * width + attended, scores + (line + 1) * width, 0.0f);
  }
  const auto lines_of = dim == 32 ? &value_lines<2> : dim == 64 ? &value_lines<4> : &value_lines<8>;
  lines_of(scores, v.values, v.table, keys, lines, width, v.block_size, v.block_stride,
           v.token_stride, work.result.data());
  for (int64_t line = 0; line < lines; ++line) {  // the softmax's normalisation, last
    const float* result = work.result.data() + line * dim;
    float* target = b.out + (first_row + line / group) * b.out_token_stride +
                    (h * group + line % group) * b.out_head_stride;
    for (int64_t d = 0; d < dim; ++d) target[d] = result[d] * work.inverse[line];
  }
}

}  // namespace
#endif

// Causal attention of the new tokens of several sequences (a chunk each, after `context -
// count` cached tokens) over their paged K/V, in one call: float32 queries, head sizes 32, 64 or
// 128, AVX-512; a float32 cache read in place, or an FP8 (E4M3) one dequantised as it is read
// (the real K is the stored one times k_scale, V times v_scale). Writes rows first_rows[s] .. +
// query_lens[s] of `out` (`[tokens, heads, dim]`); returns false (nothing written) when this
// build, dtype or shape has no such path.
bool paged_prefill(torch::Tensor q, torch::Tensor kv_layer, torch::Tensor block_tables,
                   torch::Tensor first_rows, torch::Tensor query_lens, torch::Tensor context_lens,
                   double scale, torch::Tensor out, double k_scale, double v_scale) {
#if defined(__AVX512F__)
  const int64_t heads = q.size(1), head_dim = q.size(2), kv_heads = kv_layer.size(3);
  const bool fp8 = kv_layer.scalar_type() == at::ScalarType::Float8_e4m3fn;
  if (q.scalar_type() != torch::kFloat || out.scalar_type() != torch::kFloat ||
      !(kv_layer.scalar_type() == torch::kFloat || fp8) ||
      !(head_dim == 32 || head_dim == 64 || head_dim == 128) || kv_layer.stride(4) != 1 ||
      kv_layer.stride(3) != head_dim || q.stride(2) != 1 || out.stride(2) != 1 ||
      heads % kv_heads != 0) {
    return false;
  }
  auto tables = block_tables.to(torch::kLong).contiguous();
  auto starts = first_rows.to(torch::kLong).contiguous();
  auto counts = query_lens.to(torch::kLong).contiguous();
  auto lens = context_lens.to(torch::kLong).contiguous();
  const PrefillBatch batch{
      q.data_ptr<float>(), out.data_ptr<float>(), tables.data_ptr<int64_t>(),
      starts.data_ptr<int64_t>(), counts.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
      tables.size(1), heads / kv_heads, head_dim, kv_layer.size(2), kv_layer.stride(0),
      kv_layer.stride(1), kv_layer.stride(2), q.stride(0), q.stride(1), out.stride(0),
      out.stride(1), static_cast<float>(scale * k_scale), static_cast<float>(v_scale)};
  const int64_t seqs = tables.size(0);
  // per (seq, head): room for its transposed K, which also holds its dequantised V
  std::vector<int64_t> kt_offsets(seqs * kv_heads + 1, 0);
  std::vector<PrefillTile> tiles;
  for (int64_t s = 0; s < seqs; ++s) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      kt_offsets[s * kv_heads + h + 1] =
          kt_offsets[s * kv_heads + h] + (batch.contexts[s] + 15) / 16 * 16 * head_dim;
      for (int64_t row = 0; row < batch.counts[s]; row += kPrefillRows) tiles.push_back({s, h, row});
    }
  }
  std::vector<float> kt(kt_offsets.back());
  std::vector<float> dequantised(fp8 ? kt_offsets.back() : 0);
  std::vector<ValueRows> values(seqs * kv_heads);
  const void* cache = kv_layer.data_ptr();
  at::parallel_for(0, seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / kv_heads, h = item % kv_heads;
      float* keys = kt.data() + kt_offsets[item];
      values[item] = fp8 ? prepare_head(static_cast<const c10::Float8_e4m3fn*>(cache), batch, s, h,
                                        keys, dequantised.data() + kt_offsets[item])
                         : prepare_head(static_cast<const float*>(cache), batch, s, h, keys,
                                        nullptr);
    }
  });
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    PrefillScratch work;
    for (int64_t index = begin; index < end; ++index) {
      const PrefillTile tile = tiles[index];
      const int64_t item = tile.seq * kv_heads + tile.kv_head;
      attend_tile(batch, tile, kt.data() + kt_offsets[item], values[item], work);
    }
  });
  return true;
#else
  return false;
#endif
}

// silu(gate) * up of a fused gate/up projection `[rows, 2 x width]` (gate first): one pass,
// float32 on AVX-512 (silu by the same polynomial exp as attention's softmax); an empty
// tensor when this build or dtype has no such path.
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
#if defined(__AVX512F__)
  if (gate_up.scalar_type() != torch::kFloat || gate_up.dim() != 2 || gate_up.stride(1) != 1 ||
      gate_up.size(1) % 32 != 0) {
    return torch::Tensor();
  }
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  auto out = torch::empty({rows, width}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* result = out.data_ptr<float>();
  const int64_t stride = gate_up.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = in + r * stride;
      const float* up = gate + width;
      for (int64_t i = 0; i < width; i += 16) {
        const __m512 g = _mm512_loadu_ps(gate + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, e));
        _mm512_storeu_ps(result + r * width + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
      }
    }
  });
  return out;
#else
  return torch::Tensor();
#endif
}

// Half-split rotary embedding of `x` `[tokens, heads, dim]` (any strides but a contiguous last
// dim) by `cos`/`sin` `[tokens, dim]`: x * cos + rotate_half(x) * sin, each product and sum
// rounded as torch rounds them (no fused multiply-add), into a new contiguous tensor; float32
// on AVX-512 with dim a multiple of 32, else an empty tensor.
torch::Tensor rotate(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
#if defined(__AVX512F__)
  if (x.scalar_type() != torch::kFloat || cos.scalar_type() != torch::kFloat ||
      sin.scalar_type() != torch::kFloat || x.dim() != 3 || x.stride(2) != 1 ||
      x.size(2) % 32 != 0 || !cos.is_contiguous() || !sin.is_contiguous()) {
    return torch::Tensor();
  }
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  auto out = torch::empty({tokens, heads, dim}, x.options());
  const float* in = x.data_ptr<float>();
  const float *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
  float* result = out.data_ptr<float>();
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const float* row = in + t * x.stride(0) + h * x.stride(1);
        float* target = result + (t * heads + h) * dim;
        for (int64_t i = 0; i < half; i += 16) {
          const __m512 lo = _mm512_loadu_ps(row + i), hi = _mm512_loadu_ps(row + half + i);
          const __m512 c_lo = _mm512_loadu_ps(c + t * dim + i);
          const __m512 c_hi = _mm512_loadu_ps(c + t * dim + half + i);
          const __m512 s_lo = _mm512_loadu_ps(s + t * dim + i);
          const __m512 s_hi = _mm512_loadu_ps(s + t * dim + half + i);
          const __m512 minus_hi = _mm512_castsi512_ps(  // -hi exactly: the sign bit flipped
              _mm512_xor_si512(_mm512_castps_si512(hi), _mm512_set1_epi32(0x80000000)));
          _mm512_storeu_ps(target + i,
                           _mm512_add_ps(_mm512_mul_ps(lo, c_lo), _mm512_mul_ps(minus_hi, s_lo)));
          _mm512_storeu_ps(target + half + i,
                           _mm512_add_ps(_mm512_mul_ps(hi, c_hi), _mm512_mul_ps(lo, s_hi)));
        }
      }
    }
  });
  return out;
#else
  return torch::Tensor();
#endif
}

// The experts of a mixture-of-experts layer, for few rows per expert (decode): every chosen
// expert's weights streamed once, in work items of a few output rows each spread over the
// threads, each weight row dotted with all of that expert's input rows while it is in cache.
// Portable C++ the compiler vectorises for the machine (-march=native): AVX2 or AVX-512.
//
// x [tokens, hidden], gate_up [experts, 2 x width, hidden] (gate rows, then up rows), down
// [experts, hidden, width], ids / weights [tokens, top_k] (ids of the model's experts; this
// rank holds `first ..`; float32 weights). Returns the weighted sum over each token's choices
// held here, [tokens, hidden]; an undefined tensor (None) for anything but contiguous float32.
namespace moe {

constexpr int64_t kRowsPerItem = 8;  // output rows of one work item

// sums0[r] = a[r] . w0 and sums1[r] = a[r] . w1 over n floats, for R (1 or 4) rows a[r]: one
// pass over k with 2 x R independent accumulators, each input loaded once for both weights.
template <int R>
inline void dots2(const float* const* a, const float* w0, const float* w1, int64_t n,
                  float* sums0, float* sums1) {
  if constexpr (R == 4) {
    const float *a0 = a[0], *a1 = a[1], *a2 = a[2], *a3 = a[3];
    float s00 = 0, s01 = 0, s02 = 0, s03 = 0, s10 = 0, s11 = 0, s12 = 0, s13 = 0;
#pragma omp simd reduction(+ : s00, s01, s02, s03, s10, s11, s12, s13)
    for (int64_t k = 0; k < n; ++k) {
      const float x0 = w0[k], x1 = w1[k];
      s00 += a0[k] * x0;
      s01 += a1[k] * x0;
      s02 += a2[k] * x0;
      s03 += a3[k] * x0;
      s10 += a0[k] * x1;
      s11 += a1[k] * x1;
      s12 += a2[k] * x1;
      s13 += a3[k] * x1;
    }
    sums0[0] = s00, sums0[1] = s01, sums0[2] = s02, sums0[3] = s03;
    sums1[0] = s10, sums1[1] = s11, sums1[2] = s12, sums1[3] = s13;
  } else {
    const float* a0 = a[0];
    float s0 = 0, s1 = 0;
#pragma omp simd reduction(+ : s0, s1)
    for (int64_t k = 0; k < n; ++k) {
      s0 += a0[k] * w0[k];
      s1 += a0[k] * w1[k];
    }
    sums0[0] = s0;
    sums1[0] = s1;
  }
}

// Every row of `rows` (pointers) dotted with w0 and with w1: 4 rows at a time, then one.
inline void dot_rows(const std::vector<const float*>& rows, const float* w0, const float* w1,
                     int64_t n, float* sums0, float* sums1) {
  const int64_t count = static_cast<int64_t>(rows.size());
  int64_t r = 0;
  for (; r + 4 <= count; r += 4) dots2<4>(rows.data() + r, w0, w1, n, sums0 + r, sums1 + r);
  for (; r < count; ++r) dots2<1>(rows.data() + r, w0, w1, n, sums0 + r, sums1 + r);
}

}  // namespace moe

torch::Tensor moe_experts(torch::Tensor x, torch::Tensor gate_up, torch::Tensor down,
                          torch::Tensor ids, torch::Tensor weights, int64_t first) {
  const bool usable = x.scalar_type() == torch::kFloat && gate_up.scalar_type() == torch::kFloat &&
                      down.scalar_type() == torch::kFloat &&
                      weights.scalar_type() == torch::kFloat && ids.scalar_type() == torch::kLong &&
                      x.is_contiguous() && gate_up.is_contiguous() && down.is_contiguous() &&
                      ids.is_contiguous() && weights.is_contiguous();
  if (!usable) return torch::Tensor();
  const int64_t tokens = x.size(0), hidden = x.size(1), top_k = ids.size(1);
  const int64_t experts = gate_up.size(0), width = down.size(2);
  const int64_t assignments = tokens * top_k;
  const int64_t* chosen = ids.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> rows(experts);  // each held expert's assignments
  for (int64_t a = 0; a < assignments; ++a) {
    const int64_t e = chosen[a] - first;
    if (e >= 0 && e < experts) rows[e].push_back(a);
  }
  std::vector<int64_t> active;
  for (int64_t e = 0; e < experts; ++e) {
    if (!rows[e].empty()) active.push_back(e);
  }
  auto activated = torch::empty({assignments, width}, x.options());
  auto outputs = torch::zeros({assignments, hidden}, x.options());
  const float* xs = x.data_ptr<float>();
  const float* w13 = gate_up.data_ptr<float>();
  const float* w2 = down.data_ptr<float>();
  const float* scale = weights.data_ptr<float>();
  float* act = activated.data_ptr<float>();
  float* out = outputs.data_ptr<float>();
  const int64_t n_active = static_cast<int64_t>(active.size());

  // gate/up: item = (expert, a run of kRowsPerItem of its width); act[a, j] = silu(g) * u
  const int64_t up_items = (width + moe::kRowsPerItem - 1) / moe::kRowsPerItem;
  at::parallel_for(0, n_active * up_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<const float*> inputs;
    std::vector<float> g, u;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t e = active[item / up_items];
      const std::vector<int64_t>& mine = rows[e];
      inputs.clear();
      for (const int64_t a : mine) inputs.push_back(xs + (a / top_k) * hidden);
      g.resize(mine.size());
      u.resize(mine.size());
      const int64_t j0 = (item % up_items) * moe::kRowsPerItem;
      const int64_t j1 = std::min(width, j0 + moe::kRowsPerItem);
      for (int64_t j = j0; j < j1; ++j) {
        const float* gate = w13 + (e * 2 * width + j) * hidden;
        moe::dot_rows(inputs, gate, gate + width * hidden, hidden, g.data(), u.data());
        for (size_t r = 0; r < mine.size(); ++r) {
          act[mine[r] * width + j] = g[r] / (1.0f + std::exp(-g[r])) * u[r];
        }
      }
    }
  });
  // down: item = (expert, a run of kRowsPerItem of hidden); out[a, i] = weight x (act[a] . w2)
  const int64_t down_items = (hidden + moe::kRowsPerItem - 1) / moe::kRowsPerItem;
  at::parallel_for(0, n_active * down_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<const float*> inputs;
    std::vector<float> first_sums, second_sums;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t e = active[item / down_items];
      const std::vector<int64_t>& mine = rows[e];
      inputs.clear();
      for (const int64_t a : mine) inputs.push_back(act + a * width);
      first_sums.resize(mine.size());
      second_sums.resize(mine.size());
      const int64_t i0 = (item % down_items) * moe::kRowsPerItem;
      const int64_t i1 = std::min(hidden, i0 + moe::kRowsPerItem);
      for (int64_t i = i0; i < i1; i += 2) {  // two output rows per pass (the same one at the end)
        const int64_t second = std::min(i + 1, i1 - 1);
        moe::dot_rows(inputs, w2 + (e * hidden + i) * width, w2 + (e * hidden + second) * width,
                      width, first_sums.data(), second_sums.data());
        for (size_t r = 0; r < mine.size(); ++r) {
          out[mine[r] * hidden + i] = first_sums[r] * scale[mine[r]];
          out[mine[r] * hidden + second] = second_sums[r] * scale[mine[r]];
        }
      }
    }
  });
  return outputs.view({tokens, top_k, hidden}).sum(1);
}

// The kernels run without the GIL (their arguments are converted before, their results after):
// while one runs, the instance's other threads (the output thread, gRPC) go on.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using no_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)", py::arg("q"),
        py::arg("kv_layer"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0, no_gil());
  m.def("latent_decode", &latent_decode, "latent (MLA) decode attention, paged (CPU)",
        py::arg("q"), py::arg("kv_layer"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("scale"), py::arg("value_dim"), py::arg("kv_scale") = 1.0, no_gil());
  m.def("fp8_e4m3fn_values", &fp8_e4m3fn_values,
        "the float value of each FP8 E4M3 byte, as the kernels read FP8 caches");
  m.def("paged_prefill", &paged_prefill, "paged causal prefill attention, every chunk (CPU)",
        py::arg("q"), py::arg("kv_layer"), py::arg("block_tables"), py::arg("first_rows"),
        py::arg("query_lens"), py::arg("context_lens"), py::arg("scale"), py::arg("out"),
        py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0, no_gil());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused gate/up projection (CPU)",
        no_gil());
  m.def("rotate", &rotate, "half-split rotary embedding (CPU)", no_gil());
  m.def("moe_experts", &moe_experts, "a mixture-of-experts layer's experts, few rows each (CPU)",
        no_gil());
}
