// The CPU product of float32 activations with a quantized weight, for the decode-sized
// products (1-32 rows): out[m, n] = sum_k a[m, k] * w[n, k], with
//
//   int4: values uint8 [N, K/2], element 2j in the low nibble of byte j, 2j+1 in the high;
//         w = s * q + mn (asymmetric, minimums given) or w = s * (q - 8) (symmetric);
//   int8: values int8 [N, K]; w = s * q (+ mn);
//
// s and mn [N, K/group], float16 or float32. The activations stay float32 (the weight is
// expanded to float32 in registers, never in memory), so the result is the float32 product
// of the dequantized weight, summed in another order: no activation quantization.
//
// Per group: sum_k a[k] * q[k] in vector lanes, then acc += s * that (one FMA), and the
// minimums' term sum_g mn[g] * sum_{k in g} a[k] from per-group sums of a computed once a
// call. Rows of the weight are split over XLA's intra-op thread pool (the calling thread
// works too, and waits only for chunks another thread has started).
//
// Built at first use by forge_jax.ops.quantized_matmul_cpu with the machine's C++ compiler
// and -march=native: AVX-512, AVX2 or portable scalar code, whichever the machine has.

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float HalfToFloat(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal
      float f = std::ldexp(static_cast<float>(man), -24);
      std::memcpy(&bits, &f, 4);
      bits |= sign;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
#endif
}

// Scales or minimums, float16 or float32, read as float.
struct Params {
  const void* data = nullptr;
  bool half = false;
  float at(int64_t i) const {
    return half ? HalfToFloat(static_cast<const uint16_t*>(data)[i])
                : static_cast<const float*>(data)[i];
  }
};

struct Problem {
  int64_t m, n, k, group;
  bool int4;
  bool symmetric;
  const float* a;      // [m, k]; for int4 permuted: per 32 values, the even then the odd ones
  const float* asum;   // [m, k / group]: sums of a per group (for the minimums' term)
  const uint8_t* values;
  Params scales, minimums;
  float* out;          // [m, n]
};

constexpr int kRowTile = 4;  // rows of a that share one expansion of the weight

#if defined(__AVX512F__)
inline float Sum(__m512 v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__)
inline float Sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// One row of scales or minimums as float32, into `dst` (G values).
void RowParams(const Params& src, int64_t offset, int64_t count, float* dst) {
  if (!src.half) {
    std::memcpy(dst, static_cast<const float*>(src.data) + offset, count * sizeof(float));
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(src.data) + offset;
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= count; i += 16) {
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
  }
#endif
  for (; i < count; ++i) dst[i] = HalfToFloat(h[i]);
}

// Rows [n0, n1) of the weight against rows [m0, m0 + MT) of a. MT is a compile-time
// constant so that the accumulators stay in registers.
template <int MT, bool kInt4>
void Rows(const Problem& p, int64_t n0, int64_t n1, int64_t m0) {
  const int64_t groups = p.k / p.group;
  std::vector<float> sbuf(groups), mbuf(groups);
  for (int64_t n = n0; n < n1; ++n) {
    float* sc = sbuf.data();
    RowParams(p.scales, n * groups, groups, sc);
    float tail[MT] = {};
    if (p.symmetric) {
      if (kInt4) {
        for (int64_t g = 0; g < groups; ++g) {
          for (int r = 0; r < MT; ++r) tail[r] -= 8.0f * sc[g] * p.asum[(m0 + r) * groups + g];
        }
      }
    } else {
      RowParams(p.minimums, n * groups, groups, mbuf.data());
      for (int64_t g = 0; g < groups; ++g) {
        for (int r = 0; r < MT; ++r) tail[r] += mbuf[g] * p.asum[(m0 + r) * groups + g];
      }
    }
#if defined(__AVX512F__)
    __m512 acc[MT];
    for (int r = 0; r < MT; ++r) acc[r] = _mm512_setzero_ps();
#elif defined(__AVX2__)
    __m256 acc[MT];
    for (int r = 0; r < MT; ++r) acc[r] = _mm256_setzero_ps();
#else
    float acc[MT] = {};
#endif
    for (int64_t g = 0; g < groups; ++g) {
      const float s = sc[g];
      const int64_t k0 = g * p.group;
#if defined(__AVX512F__)
      __m512 v[MT];
      for (int r = 0; r < MT; ++r) v[r] = _mm512_setzero_ps();
      if (kInt4) {
        const uint8_t* q = p.values + (n * p.k + k0) / 2;
        for (int64_t c = 0; c < p.group; c += 32, q += 16) {
          __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
          __m128i lo = _mm_and_si128(bytes, _mm_set1_epi8(0x0f));
          __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0f));
          __m512 wl = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
          __m512 wh = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
          for (int r = 0; r < MT; ++r) {
            const float* x = p.a + (m0 + r) * p.k + k0 + c;
            v[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x), wl, v[r]);
            v[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + 16), wh, v[r]);
          }
        }
      } else {
        const int8_t* q = reinterpret_cast<const int8_t*>(p.values) + n * p.k + k0;
        for (int64_t c = 0; c < p.group; c += 16, q += 16) {
          __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
          __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
          for (int r = 0; r < MT; ++r) {
            v[r] = _mm512_fmadd_ps(_mm512_loadu_ps(p.a + (m0 + r) * p.k + k0 + c), w, v[r]);
          }
        }
      }
      const __m512 sv = _mm512_set1_ps(s);
      for (int r = 0; r < MT; ++r) acc[r] = _mm512_fmadd_ps(v[r], sv, acc[r]);
#elif defined(__AVX2__)
      __m256 v[MT];
      for (int r = 0; r < MT; ++r) v[r] = _mm256_setzero_ps();
      if (kInt4) {
        const uint8_t* q = p.values + (n * p.k + k0) / 2;
        for (int64_t c = 0; c < p.group; c += 32, q += 16) {
          __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
          __m128i lo = _mm_and_si128(bytes, _mm_set1_epi8(0x0f));
          __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0f));
          __m256 w[4] = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))};
          for (int r = 0; r < MT; ++r) {
            const float* x = p.a + (m0 + r) * p.k + k0 + c;
            for (int j = 0; j < 4; ++j) {
              v[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8 * j), w[j], v[r]);
            }
          }
        }
      } else {
        const int8_t* q = reinterpret_cast<const int8_t*>(p.values) + n * p.k + k0;
        for (int64_t c = 0; c < p.group; c += 16, q += 16) {
          __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
          __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
          __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
          for (int r = 0; r < MT; ++r) {
            const float* x = p.a + (m0 + r) * p.k + k0 + c;
            v[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x), w0, v[r]);
            v[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), w1, v[r]);
          }
        }
      }
      const __m256 sv = _mm256_set1_ps(s);
      for (int r = 0; r < MT; ++r) acc[r] = _mm256_fmadd_ps(v[r], sv, acc[r]);
#else
      float v[MT] = {};
      for (int64_t c = 0; c < p.group; ++c) {
        float w;
        if (kInt4) {
          // permuted a: within each 32, the 16 even elements (low nibbles) first
          const int64_t block = c / 32, j = c % 32;
          const uint8_t byte = p.values[(n * p.k + k0) / 2 + block * 16 + (j % 16)];
          w = static_cast<float>(j < 16 ? (byte & 0x0f) : (byte >> 4));
        } else {
          w = static_cast<float>(reinterpret_cast<const int8_t*>(p.values)[n * p.k + k0 + c]);
        }
        for (int r = 0; r < MT; ++r) v[r] += p.a[(m0 + r) * p.k + k0 + c] * w;
      }
      for (int r = 0; r < MT; ++r) acc[r] += s * v[r];
#endif
    }
    for (int r = 0; r < MT; ++r) {
#if defined(__AVX512F__) || defined(__AVX2__)
      p.out[(m0 + r) * p.n + n] = Sum(acc[r]) + tail[r];
#else
      p.out[(m0 + r) * p.n + n] = acc[r] + tail[r];
#endif
    }
  }
}

template <bool kInt4>
void Tile(const Problem& p, int64_t n0, int64_t n1, int64_t m0, int64_t mt) {
  switch (mt) {
    case 1: return Rows<1, kInt4>(p, n0, n1, m0);
    case 2: return Rows<2, kInt4>(p, n0, n1, m0);
    case 3: return Rows<3, kInt4>(p, n0, n1, m0);
    default: return Rows<4, kInt4>(p, n0, n1, m0);
  }
}

void Chunk(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t m0 = 0; m0 < p.m; m0 += kRowTile) {
    const int64_t mt = std::min<int64_t>(kRowTile, p.m - m0);
    if (p.int4) {
      Tile<true>(p, n0, n1, m0, mt);
    } else {
      Tile<false>(p, n0, n1, m0, mt);
    }
  }
}

// Work shared between the calling thread and the pool: chunks are claimed by an atomic
// counter, so a task the pool starts late finds nothing left and returns; the caller waits
// only for chunks already claimed. The state outlives the call (a late task holds it).
struct Shared {
  Problem p;
  int64_t chunk = 0, chunks = 0;
  std::atomic<int64_t> next{0}, done{0};
};

void Work(Shared& s) {
  for (int64_t i; (i = s.next.fetch_add(1)) < s.chunks;) {
    Chunk(s.p, i * s.chunk, std::min(s.p.n, (i + 1) * s.chunk));
    s.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> asum,
                ffi::AnyBuffer values, ffi::AnyBuffer scales, ffi::AnyBuffer minimums,
                ffi::ResultBuffer<ffi::F32> out, int64_t group, bool int4, bool symmetric) {
  auto ad = a.dimensions();
  auto vd = values.dimensions();
  if (ad.size() != 2 || vd.size() != 2) {
    return ffi::Error::InvalidArgument("a and values must be 2-D");
  }
  auto shared = std::make_shared<Shared>();
  Problem& p = shared->p;
  p.m = ad[0];
  p.k = ad[1];
  p.n = vd[0];
  p.group = group;
  p.int4 = int4;
  p.symmetric = symmetric;
  if (group <= 0 || p.k % group != 0 || group % (int4 ? 32 : 16) != 0 ||
      vd[1] != (int4 ? p.k / 2 : p.k)) {
    return ffi::Error::InvalidArgument("values, group and a's K disagree");
  }
  p.a = a.typed_data();
  p.asum = asum.typed_data();
  p.values = static_cast<const uint8_t*>(values.untyped_data());
  p.scales = {scales.untyped_data(), scales.element_type() == ffi::DataType::F16};
  p.minimums = {minimums.untyped_data(), minimums.element_type() == ffi::DataType::F16};
  p.out = out->typed_data();
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // About 64 KiB of weight a chunk: small enough to balance, large enough that claiming one
  // costs nothing next to it.
  const int64_t row_bytes = int4 ? p.k / 2 : p.k;
  shared->chunk = std::max<int64_t>(8, (64 << 10) / std::max<int64_t>(1, row_bytes));
  shared->chunks = (p.n + shared->chunk - 1) / shared->chunk;
  const int64_t helpers = std::min<int64_t>(threads, shared->chunks) - 1;
  for (int64_t t = 0; t < helpers; ++t) {
    pool.Schedule([shared] { Work(*shared); });
  }
  Work(*shared);
  while (shared->done.load(std::memory_order_acquire) < shared->chunks) {
#if defined(__x86_64__) || defined(_M_X64)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ForgeJaxQuantizedMatmulCpu, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("group")
                                  .Attr<bool>("int4")
                                  .Attr<bool>("symmetric"));
