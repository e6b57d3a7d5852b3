// The CPU quantized-matmul kernel's loop on one core, without JAX: built by
// benchmarks/quantized_matmul_cpu_kernel.py with -DKERNEL_SOURCE="<a version of
// forge_jax/ops/quantized_matmul_cpu.cc>" (it includes that file and runs its Work on
// one thread: every version has Prepare, Shared and Work).
//
// For each of a SmolLM2-135M decode step's product shapes (one row of activations):
//   hot:  the best of many runs on one weight (in cache): the loop's instruction cost;
//   cold: the first quartile of runs over copies of the weight totalling over 64 MB (each
//         streamed from memory, as a decode step streams its 96.5 MB), and the memory
//         bandwidth that makes;
// then the machine's memory bandwidth read by plain vector loads on 1 and 2 threads.
// One line per figure: "name value unit".
#include KERNEL_SOURCE

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>

namespace {

double Seconds(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

struct Weight {
  std::vector<uint8_t> values;
  std::vector<uint16_t> scales, minimums;
};

void Product(const std::string& name, int64_t n, int64_t k, bool int4, bool symmetric) {
  const int64_t group = 32, groups = k / group;
  const int64_t bytes = n * (int4 ? k / 2 : k) + (symmetric ? 2 : 4) * n * groups;
  const int copies = static_cast<int>(std::max<int64_t>(2, (64 << 20) / bytes + 1));
  std::mt19937 gen(0);
  std::vector<Weight> w(copies);
  for (auto& c : w) {
    c.values.resize(n * (int4 ? k / 2 : k));
    for (auto& v : c.values) v = static_cast<uint8_t>(gen());
    c.scales.assign(n * groups, 0x2c00);     // 0.0625
    c.minimums.assign(n * groups, 0xac00);   // -0.0625
  }
  std::vector<float> a(k), out(n);
  for (auto& x : a) x = static_cast<float>(gen() % 2001) / 1000.0f - 1.0f;
  auto run = [&](const Weight& c) {
    Shared s;
    s.p.m = 1;
    s.p.k = k;
    s.p.n = n;
    s.p.group = group;
    s.p.int4 = int4;
    s.p.symmetric = symmetric;
    Prepare(s, a.data());
    s.p.values = c.values.data();
    s.p.scales = {c.scales.data(), true};
    s.p.minimums = {c.minimums.data(), true};
    s.p.out = out.data();
    s.chunk = n;  // the whole product as one chunk, on this thread
    s.chunks = 1;
    const auto t = std::chrono::steady_clock::now();
    Work(s);
    return Seconds(t);
  };
  double hot = 1e9;
  for (int r = 0; r < 200; ++r) hot = std::min(hot, run(w[0]));
  std::vector<double> cold;
  for (int r = 0; r < std::max(4, 600 / copies); ++r) {
    for (const auto& c : w) cold.push_back(run(c));
  }
  std::sort(cold.begin(), cold.end());
  const double q1 = cold[cold.size() / 4];
  std::printf("%s_hot_ns_per_group %.3f ns\n", name.c_str(), hot * 1e9 / (n * groups));
  std::printf("%s_cold_us %.1f us\n", name.c_str(), q1 * 1e6);
  std::printf("%s_cold_bandwidth %.2f GB/s\n", name.c_str(), bytes / q1 / 1e9);
}

void Bandwidth(int threads) {
  const size_t n = size_t{256} << 20;
  std::vector<uint8_t> buffer(n, 1);
  double best = 1e9;
  for (int r = 0; r < 6; ++r) {
    std::vector<std::thread> pool;
    std::vector<uint64_t> sums(threads);
    const auto t = std::chrono::steady_clock::now();
    for (int i = 0; i < threads; ++i) {
      pool.emplace_back([&, i] {
        const uint8_t* p = buffer.data();
#if defined(__AVX512F__)
        __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
        for (size_t o = i * (n / threads); o < (i + 1) * (n / threads); o += 256) {
          s0 = _mm512_add_epi64(s0, _mm512_loadu_si512(p + o));
          s1 = _mm512_add_epi64(s1, _mm512_loadu_si512(p + o + 64));
          s2 = _mm512_add_epi64(s2, _mm512_loadu_si512(p + o + 128));
          s3 = _mm512_add_epi64(s3, _mm512_loadu_si512(p + o + 192));
        }
        sums[i] = _mm512_reduce_add_epi64(
            _mm512_add_epi64(_mm512_add_epi64(s0, s1), _mm512_add_epi64(s2, s3)));
#else
        uint64_t sum = 0;
        for (size_t o = i * (n / threads); o < (i + 1) * (n / threads); o += 64) {
          uint64_t x;
          std::memcpy(&x, p + o, 8);
          sum += x;  // one word a cache line: the line is read whole
        }
        sums[i] = sum;
#endif
      });
    }
    for (auto& t : pool) t.join();
    best = std::min(best, Seconds(t));
  }
  std::printf("memory_read_%d_threads %.2f GB/s\n", threads, n / best / 1e9);
}

}  // namespace

int main() {
  Product("gate_up_3072x576_q4_1", 3072, 576, true, false);
  Product("down_576x1536_q4_1", 576, 1536, true, false);
  Product("qkv_960x576_q4_1", 960, 576, true, false);
  Product("o_576x576_q4_1", 576, 576, true, false);
  Product("head_49152x576_q8_0", 49152, 576, false, true);
  Bandwidth(1);
  Bandwidth(2);
  return 0;
}
