// The CPU sampler's counter-based RNG (kernels/sampling.py, `gumbel_noise`), compiled.
//
// For each row r and token v it computes the two 32-bit hashes of the reference,
//     hi = mix32(mix32(key_hi[r] ^ v) ^ key_hi[r]),  lo = the same with key_lo[r],
// and writes the uniform of whichever of U and 1 - U is below one half
// (U = (hi * 2^32 + lo + 0.5) * 2^-64), positive for U < 1/2 and negated otherwise:
//     out = +unit(hi, lo)    when hi <  2^31   (U itself)
//     out = -unit(~hi, ~lo)  when hi >= 2^31   (1 - U, exactly)
// `unit` is the reference's float32 arithmetic step for step (convert, scale, add 0.5,
// scale, add; no FMA: built with -ffp-contract=off), so the values are bit for bit those
// of `_unit` in kernels/sampling.py. The logarithms stay in PyTorch (its own log), so the
// noise the sampler adds is identical to the reference's however either is vectorised.
//
// Plain C ABI (ctypes), no allocation, no state; rows can be split across threads by the
// caller (ctypes releases the GIL during the call).

#include <cstdint>

namespace {

inline uint32_t mix32(uint32_t x) {  // lowbias32, as `_mix32`
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

inline float unit(uint32_t hi, uint32_t lo) {  // as `_unit`: float32 at every step
  const float a = static_cast<float>(hi) * 0x1p-32f;
  const float b = (static_cast<float>(lo) + 0.5f) * 0x1p-64f;
  return a + b;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(RHG_NO_CLONES)
#define RHG_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define RHG_CLONES
#endif


// Signed units in (0, 1/2] have float bits below 0x3F000001: their top 16 bits (exponent
// and 7 mantissa bits, a bucket 1/128 of an octave wide) index the bounds table.
constexpr int64_t kBuckets = (0x3F000000 >> 16) + 1;

inline uint32_t float_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof u);
  return u;
}

// +U where U < 1/2, -(1 - U) elsewhere (see the top of this file), for one token id.
inline float signed_unit(uint32_t key_hi, uint32_t key_lo, uint32_t id) {
  uint32_t hi = mix32(mix32(key_hi ^ id) ^ key_hi);
  uint32_t lo = mix32(mix32(key_lo ^ id) ^ key_lo);
  const bool low = hi < 0x80000000u;
  const float w = unit(low ? hi : ~hi, low ? lo : ~lo);
  return low ? w : -w;
}

RHG_CLONES void fill_row(uint32_t key_hi, uint32_t key_lo, int64_t vocab, float* out) {
  for (int64_t v = 0; v < vocab; ++v) out[v] = signed_unit(key_hi, key_lo, static_cast<uint32_t>(v));
}

RHG_CLONES int64_t screen_row(uint32_t key_hi, uint32_t key_lo, int64_t vocab, const float* scaled,
                              const float* bounds, int64_t num_buckets, int64_t max_cand, float* upper,
                              int64_t* cand, float* cand_units) {
  const float* high_bounds = bounds + 2 * num_buckets;
  float best_lower = -__builtin_inff();
  for (int64_t v = 0; v < vocab; ++v) {
    const float w = signed_unit(key_hi, key_lo, static_cast<uint32_t>(v));
    const float* b = (w > 0 ? bounds : high_bounds) + 2 * (float_bits(w < 0 ? -w : w) >> 16);
    const float s = scaled[v];
    if (s != s) return -1;  // NaN: the full path decides what the reference does with it
    const float lower = s + b[0];
    upper[v] = s + b[1];
    best_lower = lower > best_lower ? lower : best_lower;
  }
  int64_t n = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    if (upper[v] >= best_lower) {
      if (n == max_cand) return -1;
      cand[n] = v;
      cand_units[n++] = signed_unit(key_hi, key_lo, static_cast<uint32_t>(v));
    }
  }
  return n;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int rhg_abi_version() { return 3; }

// Rows [0, rows) of `out` ([rows, vocab] float32, row-major); the row keys are int64
// holding uint32 values (the reference's `_row_key`, passed as it is). Returns 0, or -1
// when an argument is out of range (nothing written).
__attribute__((visibility("default"))) int rhg_signed_units(const int64_t* key_hi, const int64_t* key_lo,
                                                           int64_t rows, int64_t vocab, float* out) {
  if (rows < 0 || vocab < 0 || vocab > (int64_t{1} << 32) || (rows > 0 && (!key_hi || !key_lo || !out))) return -1;
  for (int64_t r = 0; r < rows; ++r) {
    if (key_hi[r] < 0 || key_hi[r] > 0xFFFFFFFFll || key_lo[r] < 0 || key_lo[r] > 0xFFFFFFFFll) return -1;
  }
  for (int64_t r = 0; r < rows; ++r) {
    fill_row(static_cast<uint32_t>(key_hi[r]), static_cast<uint32_t>(key_lo[r]), vocab, out + r * vocab);
  }
  return 0;
}

// Gumbel-max sampling without every row's logarithms (kernels/gumbel_native.py,
// `sample_screened`): the noise g of token v is a monotone function of its signed unit w
// on each branch, so a table of bounds per bucket of w's float bits (`bounds`: [2
// branches][num_buckets][lo, hi], built from the reference's own arithmetic at the
// buckets' ends, widened by a margin) bounds every score scaled[v] + g from both sides
// without a logarithm. M, the largest lower bound, is at most the best score; every
// token whose upper bound reaches M is a candidate, so every token with the best score
// is one (float addition is monotone). The caller computes the candidates' noise exactly
// and takes the first best among them: the reference's token, bit for bit.
//
// Per row r: up to max_cand candidates' ids (ascending) and signed units into
// cand[r * max_cand ...] and cand_units[...]; count[r] = how many, or -1 when there are
// more (or a NaN score): the caller samples that row in full. scratch: [vocab] floats.
// Returns 0, or -1 when an argument is out of range (nothing written).
__attribute__((visibility("default"))) int rhg_screen(const int64_t* key_hi, const int64_t* key_lo, int64_t rows,
                                                     int64_t vocab, const float* scaled, int64_t stride,
                                                     const float* bounds, int64_t num_buckets, int64_t max_cand,
                                                     float* scratch, int64_t* cand, float* cand_units,
                                                     int64_t* count) {
  if (rows < 0 || vocab < 1 || vocab > (int64_t{1} << 32) || stride < vocab || max_cand < 1 ||
      num_buckets < kBuckets || (rows > 0 && (!key_hi || !key_lo || !scaled || !bounds || !scratch || !cand ||
                                              !cand_units || !count)))
    return -1;
  for (int64_t r = 0; r < rows; ++r) {
    if (key_hi[r] < 0 || key_hi[r] > 0xFFFFFFFFll || key_lo[r] < 0 || key_lo[r] > 0xFFFFFFFFll) return -1;
  }
  for (int64_t r = 0; r < rows; ++r) {
    count[r] = screen_row(static_cast<uint32_t>(key_hi[r]), static_cast<uint32_t>(key_lo[r]), vocab,
                          scaled + r * stride, bounds, num_buckets, max_cand, scratch, cand + r * max_cand,
                          cand_units + r * max_cand);
  }
  return 0;
}

}  // extern "C"
