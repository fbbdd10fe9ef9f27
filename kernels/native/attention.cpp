// The CPU paged attention's two memory-bound passes (kernels/paged_attention_native.py),
// compiled: scores straight from the KV cache's blocks, and the probabilities' weighted
// sum of the cache's values. The reference (kernels/paged_attention.py) gathers each
// sequence's context into dense padded K and V first, copying every cached K and V row
// twice per layer per step before its matmuls read them again; at a real model's shapes
// (SmolLM2: 30 layers, 3 KV heads, 256 sequences of 600 tokens) those copies are most of
// a decode step. Here each cached row is read once per query row that sees it, in
// place, through the block table. The softmax between the two passes stays in PyTorch.
//
// Layouts (float32, C-contiguous):
//   q       [num_tokens, num_heads, head_dim]
//   cache   [num_blocks, block_size, num_kv_heads, head_dim]   (k_cache and v_cache)
//   tables  [num_seqs, max_blocks] int32;  seq_lens [num_seqs] int32;  starts [num_seqs + 1] int32
//   scores / probs  [num_tokens, num_heads, width]  (width >= every context length)
//   out     [num_tokens, num_heads, head_dim]
// Query row i of sequence s (rows starts[s]..starts[s+1]) sits at position
// seq_lens[s] - query_len + i and sees cache positions 0..its own; `rpa_scores` writes its
// scores there and -inf at every other column of its `width`; `rpa_values` reads the same
// columns only. Query heads h * group .. h * group + group - 1 share KV head h.
//
// Everything a caller controls is checked before any memory is touched (a bad sequence
// returns its index + 1, with nothing written); sequences [seq_begin, seq_end) of one
// call touch only their own rows, so a caller can split a batch across threads (ctypes
// releases the GIL during the call). Plain C ABI, no allocation, no state, no libm.

#include <cstdint>
#include <limits>

namespace {

struct Dims {
  int64_t num_tokens, num_heads, num_kv_heads, head_dim, num_blocks, block_size, max_blocks, width;
};

// The sequences' arguments, checked: 0 if every sequence in [begin, end) is valid, else
// the first bad one's index + 1.
int64_t check(const Dims& d, const int32_t* tables, const int32_t* seq_lens, const int32_t* starts, int64_t begin,
              int64_t end) {
  for (int64_t s = begin; s < end; ++s) {
    const int64_t first = starts[s], last = starts[s + 1], ctx = seq_lens[s];
    const int64_t qlen = last - first;
    if (first < 0 || qlen < 0 || last > d.num_tokens || ctx < qlen || ctx > d.width ||
        ctx > d.max_blocks * d.block_size)
      return s + 1;
    const int64_t used = (ctx + d.block_size - 1) / d.block_size;
    for (int64_t b = 0; b < (qlen ? used : 0); ++b) {
      const int64_t block = tables[s * d.max_blocks + b];
      if (block < 0 || block >= d.num_blocks) return s + 1;
    }
  }
  return 0;
}

// Calls fn(j, row) for positions j = 0..ctx - 1 in order, row = KV head h's cached row at
// j, walking the block table block by block (no division per position).
template <typename Fn>
inline void for_each_row(const float* cache, const Dims& d, const int32_t* table, int64_t ctx, int64_t h, Fn fn) {
  const int64_t stride = d.num_kv_heads * d.head_dim;
  for (int64_t b = 0, j = 0; j < ctx; ++b) {
    const float* row = cache + (int64_t(table[b]) * d.block_size * d.num_kv_heads + h) * d.head_dim;
    const int64_t end = j + d.block_size < ctx ? j + d.block_size : ctx;
    for (; j < end; ++j, row += stride) fn(j, row);
  }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(RPA_NO_CLONES)
#define RPA_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define RPA_CLONES
#endif

// Eight running sums: a fixed summation order that the compiler vectorises without
// reassociating (no -ffast-math), whatever the batch.
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) acc[k] += a[i + k] * b[i + k];
  for (; i < n; ++i) acc[i % 8] += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// A sequence's query rows are taken together: each cached row is read once, and dotted
// with (or added into) every query row that sees it. Row i sees positions 0..first_pos + i
// (first_pos = ctx - qlen), so position j is seen by rows max(0, j - first_pos)..qlen - 1.
// Each row's own arithmetic is the same whatever the other rows: its sums run over j in
// order, so a row's result does not depend on its query's length or its batch.
RPA_CLONES void scores_of(const Dims& d, const float* q, const float* k_cache, const int32_t* table, int64_t ctx,
                          int64_t first, int64_t qlen, float scale, float* scores) {
  const int64_t group = d.num_heads / d.num_kv_heads, first_pos = ctx - qlen;
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t h = 0; h < d.num_kv_heads; ++h) {
    for_each_row(k_cache, d, table, ctx, h, [&](int64_t j, const float* kr) {
      for (int64_t i = j > first_pos ? j - first_pos : 0; i < qlen; ++i) {
        const float* qh = q + ((first + i) * d.num_heads + h * group) * d.head_dim;
        float* out = scores + ((first + i) * d.num_heads + h * group) * d.width;
        for (int64_t g = 0; g < group; ++g) out[g * d.width + j] = dot(qh + g * d.head_dim, kr, d.head_dim) * scale;
      }
    });
    for (int64_t i = 0; i < qlen; ++i) {  // past each row's last visible position
      float* out = scores + ((first + i) * d.num_heads + h * group) * d.width;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t j = first_pos + i + 1; j < d.width; ++j) out[g * d.width + j] = ninf;
    }
  }
}

RPA_CLONES void values_of(const Dims& d, const float* probs, const float* v_cache, const int32_t* table, int64_t ctx,
                          int64_t first, int64_t qlen, float* out) {
  const int64_t group = d.num_heads / d.num_kv_heads, hd = d.head_dim, first_pos = ctx - qlen;
  for (int64_t h = 0; h < d.num_kv_heads; ++h) {
    for (int64_t i = 0; i < qlen; ++i) {
      float* o = out + ((first + i) * d.num_heads + h * group) * hd;
      for (int64_t x = 0; x < group * hd; ++x) o[x] = 0.0f;
    }
    for_each_row(v_cache, d, table, ctx, h, [&](int64_t j, const float* vr) {
      for (int64_t i = j > first_pos ? j - first_pos : 0; i < qlen; ++i) {
        const float* p = probs + ((first + i) * d.num_heads + h * group) * d.width;
        float* o = out + ((first + i) * d.num_heads + h * group) * hd;
        for (int64_t g = 0; g < group; ++g) {
          const float w = p[g * d.width + j];
          float* og = o + g * hd;
          for (int64_t x = 0; x < hd; ++x) og[x] += w * vr[x];
        }
      }
    });
  }
}

Dims dims_of(const int64_t* shape) {
  return Dims{shape[0], shape[1], shape[2], shape[3], shape[4], shape[5], shape[6], shape[7]};
}

bool dims_ok(const Dims& d) {
  return d.num_tokens >= 0 && d.num_heads > 0 && d.num_kv_heads > 0 && d.num_heads % d.num_kv_heads == 0 &&
         d.head_dim > 0 && d.num_blocks > 0 && d.block_size > 0 && d.max_blocks >= 0 && d.width >= 0;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int rpa_abi_version() { return 1; }

// shape: {num_tokens, num_heads, num_kv_heads, head_dim, num_blocks, block_size, max_blocks, width}.
// Returns 0, -1 for bad dimensions, or the first bad sequence's index + 1 (nothing written).
__attribute__((visibility("default"))) int64_t rpa_scores(const int64_t* shape, const float* q, const float* k_cache,
                                                          const int32_t* tables, const int32_t* seq_lens,
                                                          const int32_t* starts, int64_t seq_begin, int64_t seq_end,
                                                          float scale, float* scores) {
  const Dims d = dims_of(shape);
  if (!dims_ok(d) || seq_begin < 0 || seq_end < seq_begin) return -1;
  if (const int64_t bad = check(d, tables, seq_lens, starts, seq_begin, seq_end)) return bad;
  for (int64_t s = seq_begin; s < seq_end; ++s)
    scores_of(d, q, k_cache, tables + s * d.max_blocks, seq_lens[s], starts[s], starts[s + 1] - starts[s], scale,
              scores);
  return 0;
}

// The same checks; out's rows of the sequences get the probabilities' weighted sums.
__attribute__((visibility("default"))) int64_t rpa_values(const int64_t* shape, const float* probs,
                                                          const float* v_cache, const int32_t* tables,
                                                          const int32_t* seq_lens, const int32_t* starts,
                                                          int64_t seq_begin, int64_t seq_end, float* out) {
  const Dims d = dims_of(shape);
  if (!dims_ok(d) || seq_begin < 0 || seq_end < seq_begin) return -1;
  if (const int64_t bad = check(d, tables, seq_lens, starts, seq_begin, seq_end)) return bad;
  for (int64_t s = seq_begin; s < seq_end; ++s)
    values_of(d, probs, v_cache, tables + s * d.max_blocks, seq_lens[s], starts[s], starts[s + 1] - starts[s], out);
  return 0;
}

}  // extern "C"
