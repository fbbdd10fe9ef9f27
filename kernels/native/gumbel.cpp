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

RHG_CLONES void fill_row(uint32_t key_hi, uint32_t key_lo, int64_t vocab, float* out) {
  for (int64_t v = 0; v < vocab; ++v) {
    const uint32_t id = static_cast<uint32_t>(v);
    uint32_t hi = mix32(mix32(key_hi ^ id) ^ key_hi);
    uint32_t lo = mix32(mix32(key_lo ^ id) ^ key_lo);
    const bool low = hi < 0x80000000u;
    hi = low ? hi : ~hi;
    lo = low ? lo : ~lo;
    const float w = unit(hi, lo);
    out[v] = low ? w : -w;
  }
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int rhg_abi_version() { return 2; }

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

}  // extern "C"
