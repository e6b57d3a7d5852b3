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
// call, when a is reordered to the order the int4 expansion produces. Rows of the weight
// are split over XLA's intra-op thread pool (the calling thread works too, and waits only
// for chunks another thread has started).
//
// One loop for every instruction set: `Lanes` is AVX-512, AVX2 or portable scalar code,
// whichever the machine has (built at first use by forge_jax.ops.quantized_matmul_cpu with
// the machine's C++ compiler and -march=native). The AVX-512 int4 expansion avoids the
// byte-widening shuffles and the integer-to-float conversions (and, at one row of
// activations, expands four groups a load): 1.4-1.9 ns a group of 32 on one core of this
// repository's AMD EPYC (Zen 4) host with the weight in cache. A decode step streams its
// weights from memory (96.5 MB for SmolLM2-135M's Q4_1 GGUF), 5-20% slower than from
// cache on one core: hence the prefetching a few rows ahead
// (benchmarks/quantized_matmul_cpu_kernel.py).

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

#if defined(__GNUC__)
#define INLINE __attribute__((always_inline))  // a lambda's sums stay in registers
#else
#define INLINE
#endif

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
  bool block4 = false;  // a in Lanes::Block4's order in whole blocks of four groups
  const float* a;      // [m, k]; for int4 in the order Lanes::Int4 expands each 32 values
  const float* asum;   // [m, k / group]: sums of a per group (for the minimums' term)
  const uint8_t* values;
  Params scales, minimums;
  float* out;          // [m, n]
};

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

// The vector lanes the loop below runs on, one type per instruction set with the same
// interface: expanding a step of stored values to float32 lanes, loading, multiplying
// and adding, summing the lanes.
#if defined(__AVX512F__)
struct Lanes {
  using V = __m512;
  static constexpr int kWidth = 16;
  static V Zero() { return _mm512_setzero_ps(); }
  static V Load(const float* x) { return _mm512_loadu_ps(x); }
  static V Set(float s) { return _mm512_set1_ps(s); }
  static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float Sum(V v) { return _mm512_reduce_add_ps(v); }
  // 16 bytes of int4 to 32 floats: the bytes broadcast to every 128-bit lane, each 32-bit
  // lane shifted to its own byte (lane i of w[0] holds the low nibble of byte
  // 4 (i % 4) + i / 4, w[1] the high one), and the nibble looked up in a table of the
  // floats 0-15 (vpermps reads the index's low 4 bits: no masking, no conversion).
  static void Int4(const uint8_t* q, V* w) {
    const __m512i bytes = _mm512_broadcast_i32x4(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(q)));
    const __m512i shift = _mm512_set_epi32(24, 24, 24, 24, 16, 16, 16, 16, 8, 8, 8, 8,
                                           0, 0, 0, 0);
    const __m512 table = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i lo = _mm512_srlv_epi32(bytes, shift);
    w[0] = _mm512_permutexvar_ps(lo, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(lo, 4), table);
  }
  // The element of a 32-value block that slot j (0-31) of Int4's output holds.
  static constexpr int Int4Element(int j) {
    return 2 * (4 * (j % 16 % 4) + j % 16 / 4) + j / 16;
  }
  // 16 int8 values to 16 floats.
  static void Int8(const int8_t* q, V* w) {
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  }
  // Four groups of 32 int4 (64 bytes) at once, for one row of activations: one load and
  // immediate shifts instead of Int4's four broadcasts and per-lane shifts (1.73 against
  // 2.0 ns a group on one core). Lane i of the J-th vector holds nibble J of the 32-bit
  // word i: element 8 i + J of the 128, in group i / 4.
  static constexpr bool kBlock4 = true;
  static constexpr int Block4Element(int slot) { return 8 * (slot % 16) + slot / 16; }
  template <int J>
  static V Nibble(__m512i words) {
    const __m512 table = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    if constexpr (J == 0) {
      return _mm512_permutexvar_ps(words, table);
    } else {
      return _mm512_permutexvar_ps(_mm512_srli_epi32(words, 4 * J), table);
    }
  }
  // Lane i holds the scale of group i / 4 of the four at sc.
  static V GroupScales(const float* sc) {
    const __m512i index = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(index, _mm512_castps128_ps512(_mm_loadu_ps(sc)));
  }
  // One block: the sum over its 128 values of a * q, each group's part times its scale,
  // added to total (x: the activations in Block4Element's order).
  static void Block4(const uint8_t* q, const float* x, const float* sc, V& total) {
    const __m512i words = _mm512_loadu_si512(q);
    V v = Fma(Load(x), Nibble<0>(words), Zero());
    v = Fma(Load(x + 16), Nibble<1>(words), v);
    v = Fma(Load(x + 32), Nibble<2>(words), v);
    v = Fma(Load(x + 48), Nibble<3>(words), v);
    v = Fma(Load(x + 64), Nibble<4>(words), v);
    v = Fma(Load(x + 80), Nibble<5>(words), v);
    v = Fma(Load(x + 96), Nibble<6>(words), v);
    v = Fma(Load(x + 112), Nibble<7>(words), v);
    total = Fma(v, GroupScales(sc), total);
  }
};
#elif defined(__AVX2__)
struct Lanes {
  using V = __m256;
  static constexpr bool kBlock4 = false;  // (Block4: AVX-512 only)
  static constexpr int Block4Element(int slot) { return slot; }
  static void Block4(const uint8_t*, const float*, const float*, V&) {}
  static constexpr int kWidth = 8;
  static V Zero() { return _mm256_setzero_ps(); }
  static V Load(const float* x) { return _mm256_loadu_ps(x); }
  static V Set(float s) { return _mm256_set1_ps(s); }
  static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float Sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static V Unsigned(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
  static V Signed(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
  static void Int4(const uint8_t* q, V* w) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(bytes, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    w[0] = Unsigned(lo);
    w[1] = Unsigned(_mm_srli_si128(lo, 8));
    w[2] = Unsigned(hi);
    w[3] = Unsigned(_mm_srli_si128(hi, 8));
  }
  // Slot j of Int4's output: the low nibbles of the 16 bytes, then the high ones.
  static constexpr int Int4Element(int j) { return 2 * (j % 16) + j / 16; }
  static void Int8(const int8_t* q, V* w) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    w[0] = Signed(bytes);
    w[1] = Signed(_mm_srli_si128(bytes, 8));
  }
};
#else
struct Lanes {  // portable: one float a lane
  using V = float;
  static constexpr bool kBlock4 = false;  // (Block4: AVX-512 only)
  static constexpr int Block4Element(int slot) { return slot; }
  static void Block4(const uint8_t*, const float*, const float*, V&) {}
  static constexpr int kWidth = 1;
  static V Zero() { return 0.0f; }
  static V Load(const float* x) { return *x; }
  static V Set(float s) { return s; }
  static V Fma(V a, V b, V c) { return a * b + c; }
  static float Sum(V v) { return v; }
  static void Int4(const uint8_t* q, V* w) {
    for (int j = 0; j < 16; ++j) {
      w[j] = static_cast<float>(q[j] & 0x0f);
      w[16 + j] = static_cast<float>(q[j] >> 4);
    }
  }
  static constexpr int Int4Element(int j) { return 2 * (j % 16) + j / 16; }
  static void Int8(const int8_t* q, V* w) {
    for (int j = 0; j < 16; ++j) w[j] = static_cast<float>(q[j]);
  }
};
#endif

// sum_i x[i] * y[i] in vector lanes (a row's minimums' term: one float a group, so a
// scalar loop is a chain of dependent multiply-adds as long as the row's groups, which
// cost a quarter of the row's time at 48 groups).
inline float Dot(const float* x, const float* y, int64_t n) {
  typename Lanes::V t = Lanes::Zero();
  int64_t i = 0;
  for (; i + Lanes::kWidth <= n; i += Lanes::kWidth) {
    t = Lanes::Fma(Lanes::Load(x + i), Lanes::Load(y + i), t);
  }
  float sum = Lanes::Sum(t);
  for (; i < n; ++i) sum += x[i] * y[i];
  return sum;
}

// Stored values one step of the inner loop expands: 32 for int4 (16 bytes), 16 for int8.
template <bool kInt4>
constexpr int kStep = kInt4 ? 32 : 16;

// Row n of the weight against rows [m0, m0 + MT) of a, with the row's scales in sc and
// minimums in mn; kGroup is the group size when known at compile time (GGUF's 32: the loop
// over a group unrolled), else 0. MT is a compile-time constant so that the sums stay in
// registers. Two running totals alternate between groups, so that a group's
// multiply-adds do not wait on the previous group's. (Several weight rows a pass, sharing
// each load of a, measured slower: the loop is bound by its instructions, not by loads.)
template <int MT, bool kInt4, int kGroup>
void Tile(const Problem& p, int64_t n, int64_t m0, const float* sc, const float* mn) {
  using V = typename Lanes::V;
  constexpr int kVectors = kStep<kInt4> / Lanes::kWidth;
  const int64_t group = kGroup ? kGroup : p.group;
  const int64_t groups = p.k / group;
  const uint8_t* row = p.values + n * (kInt4 ? p.k / 2 : p.k);
  V acc[2][MT];
  for (int r = 0; r < MT; ++r) acc[0][r] = acc[1][r] = Lanes::Zero();
  auto add_group = [&](int64_t g, V (&total)[MT]) INLINE {
    const int64_t k0 = g * group;
    V v[MT];
    for (int r = 0; r < MT; ++r) v[r] = Lanes::Zero();
    for (int64_t c = 0; c < group; c += kStep<kInt4>) {
      V w[kVectors];
      if constexpr (kInt4) {
        Lanes::Int4(row + (k0 + c) / 2, w);
      } else {
        Lanes::Int8(reinterpret_cast<const int8_t*>(row) + k0 + c, w);
      }
      for (int r = 0; r < MT; ++r) {
        const float* x = p.a + (m0 + r) * p.k + k0 + c;
        for (int j = 0; j < kVectors; ++j) {
          v[r] = Lanes::Fma(Lanes::Load(x + j * Lanes::kWidth), w[j], v[r]);
        }
      }
    }
    const V s = Lanes::Set(sc[g]);
    for (int r = 0; r < MT; ++r) total[r] = Lanes::Fma(v[r], s, total[r]);
  };
  int64_t g = 0;
  if constexpr (MT == 1 && kInt4 && kGroup == 32 && Lanes::kBlock4) {
    if (p.block4) {
      const float* x = p.a + m0 * p.k;
      V b0 = Lanes::Zero(), b1 = Lanes::Zero();
      for (; g + 8 <= groups; g += 8) {
        Lanes::Block4(row + g * 16, x + g * 32, sc + g, b0);
        Lanes::Block4(row + g * 16 + 64, x + g * 32 + 128, sc + g + 4, b1);
      }
      if (g + 4 <= groups) {
        Lanes::Block4(row + g * 16, x + g * 32, sc + g, b0);
        g += 4;
      }
      acc[0][0] = Lanes::Fma(b1, Lanes::Set(1.0f), b0);  // the rest goes on adding to it
    }
  }
  for (; g + 2 <= groups; g += 2) {
    add_group(g, acc[0]);
    add_group(g + 1, acc[1]);
  }
  if (g < groups) add_group(g, acc[0]);
  for (int r = 0; r < MT; ++r) {
    // The minimums' term (int4's -8 when symmetric) from the per-group sums of a.
    const float* asum = p.asum + (m0 + r) * groups;
    float tail = 0.0f;
    if (!p.symmetric) {
      tail = Dot(mn, asum, groups);
    } else if (kInt4) {
      tail = -8.0f * Dot(sc, asum, groups);
    }
    p.out[(m0 + r) * p.n + n] =
        Lanes::Sum(Lanes::Fma(acc[1][r], Lanes::Set(1.0f), acc[0][r])) + tail;
  }
}

// A decode step streams every weight from memory once (96.5 MB a token for SmolLM2-135M's
// Q4_1 GGUF, far over the caches), so the weight's rows are asked for a few rows ahead of
// the loop: one thread streamed a 3072 x 576 Q4_1 weight from memory 5-10% faster so,
// costing about 5% where the weight is in cache (benchmarks/quantized_matmul_cpu_kernel.py).
constexpr int64_t kPrefetchRows = 8;

inline void Prefetch(const void* at, int64_t bytes) {
#if defined(__x86_64__) || defined(_M_X64)
  const char* p = static_cast<const char*>(at);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
#else
  (void)at;
  (void)bytes;
#endif
}

// Weight rows [n0, n1) against rows [m0, m0 + MT) of a; sc and mn: room for a row's
// scales and minimums as float32.
template <int MT, bool kInt4>
void Rows(const Problem& p, int64_t n0, int64_t n1, int64_t m0, float* sc, float* mn) {
  const int64_t groups = p.k / p.group;
  const int64_t row_bytes = p.int4 ? p.k / 2 : p.k;
  const int64_t param_bytes = groups * (p.scales.half ? 2 : 4);
  for (int64_t n = n0; n < n1; ++n) {
    if (n + kPrefetchRows < n1) {
      Prefetch(p.values + (n + kPrefetchRows) * row_bytes, row_bytes);
      Prefetch(static_cast<const char*>(p.scales.data) + (n + kPrefetchRows) * param_bytes,
               param_bytes);
      if (!p.symmetric) {
        Prefetch(static_cast<const char*>(p.minimums.data) + (n + kPrefetchRows) * param_bytes,
                 param_bytes);
      }
    }
    RowParams(p.scales, n * groups, groups, sc);
    if (!p.symmetric) RowParams(p.minimums, n * groups, groups, mn);
    if (p.group == 32) {
      Tile<MT, kInt4, 32>(p, n, m0, sc, mn);
    } else {
      Tile<MT, kInt4, 0>(p, n, m0, sc, mn);
    }
  }
}

constexpr int kRowTile = 4;  // rows of a that share one expansion of the weight

template <bool kInt4>
void Block(const Problem& p, int64_t n0, int64_t n1, int64_t m0, int64_t mt, float* sc,
           float* mn) {
  switch (mt) {
    case 1: return Rows<1, kInt4>(p, n0, n1, m0, sc, mn);
    case 2: return Rows<2, kInt4>(p, n0, n1, m0, sc, mn);
    case 3: return Rows<3, kInt4>(p, n0, n1, m0, sc, mn);
    default: return Rows<4, kInt4>(p, n0, n1, m0, sc, mn);
  }
}

// Weight rows [n0, n1) against every row of a; sc and mn: room for a row's scales and
// minimums (k / group floats each).
void Chunk(const Problem& p, int64_t n0, int64_t n1, float* sc, float* mn) {
  for (int64_t m0 = 0; m0 < p.m; m0 += kRowTile) {
    const int64_t mt = std::min<int64_t>(kRowTile, p.m - m0);
    if (p.int4) {
      Block<true>(p, n0, n1, m0, mt, sc, mn);
    } else {
      Block<false>(p, n0, n1, m0, mt, sc, mn);
    }
  }
}

// Work shared between the calling thread and the pool: chunks are claimed by an atomic
// counter, so a task the pool starts late finds nothing left and returns; the caller waits
// only for chunks already claimed. The state outlives the call (a late task holds it).
struct Shared {
  Problem p;
  std::vector<float> a, asum;  // what p.a and p.asum point to
  int64_t chunk = 0, chunks = 0;
  std::atomic<int64_t> next{0}, done{0};
};

void Work(Shared& s) {
  const int64_t groups = s.p.k / s.p.group;
  std::vector<float> params(2 * groups);
  for (int64_t i; (i = s.next.fetch_add(1)) < s.chunks;) {
    Chunk(s.p, i * s.chunk, std::min(s.p.n, (i + 1) * s.chunk), params.data(),
          params.data() + groups);
    s.done.fetch_add(1, std::memory_order_release);
  }
}

// a in the order the loop reads it, and its sums per group, into s.a and s.asum.
void Prepare(Shared& s, const float* a) {
  Problem& p = s.p;
  const int64_t groups = p.k / p.group;
  s.asum.resize(p.m * groups);
  for (int64_t i = 0; i < p.m * groups; ++i) {
    float sum = 0.0f;
    for (int64_t j = 0; j < p.group; ++j) sum += a[i * p.group + j];
    s.asum[i] = sum;
  }
  p.asum = s.asum.data();
  p.a = a;
  if (!p.int4) return;
  s.a.resize(p.m * p.k);
  int element[32], block[128];
  for (int j = 0; j < 32; ++j) element[j] = Lanes::Int4Element(j);
  for (int j = 0; j < 128; ++j) block[j] = Lanes::Block4Element(j);
  // One row of a (decode at batch 1) with groups of 32: whole blocks of four groups in
  // Block4's order (Tile reads them so), the rest in Int4's.
  p.block4 = Lanes::kBlock4 && p.m == 1 && p.group == 32;
  const int64_t blocked = p.block4 ? p.k / 128 * 128 : 0;
  for (int64_t b = 0; b < blocked; b += 128) {
    for (int j = 0; j < 128; ++j) s.a[b + j] = a[b + block[j]];
  }
  for (int64_t b = blocked; b < p.m * p.k; b += 32) {
    for (int j = 0; j < 32; ++j) s.a[b + j] = a[b + element[j]];
  }
  p.a = s.a.data();
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::AnyBuffer values,
                ffi::AnyBuffer scales, ffi::AnyBuffer minimums,
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
  Prepare(*shared, a.typed_data());
  p.values = static_cast<const uint8_t*>(values.untyped_data());
  p.scales = {scales.untyped_data(), scales.element_type() == ffi::DataType::F16};
  p.minimums = {minimums.untyped_data(), minimums.element_type() == ffi::DataType::F16};
  p.out = out->typed_data();
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // About 64 KiB of weight a chunk: small enough to balance, large enough that claiming one
  // costs nothing next to it. (16 KiB chunks, and a waiting caller that yields, measured no
  // faster a decode step: benchmarks/quantized_matmul_cpu_kernel.py --decode.)
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
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("group")
                                  .Attr<bool>("int4")
                                  .Attr<bool>("symmetric"));
