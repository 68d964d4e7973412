// How fast one thread copies 1, 4 and 16 MiB: one memcpy call, the same bytes in 256 KiB and
// 1 MiB calls, and non-temporal (streaming) SSE2 stores; with the source and destination
// warm (the same buffers every sample) or cold (each sample at a new place in 512 MiB). It
// chose kernels::copy_bytes' piece size (kernels/copy.hpp). Results: results_copy.md.
//
//   g++ -O2 benchmarks/bench_copy.cpp -o /tmp/bench_copy && taskset -c 0 /tmp/bench_copy
#include <emmintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <initializer_list>

namespace {

void streaming_copy(char* d, const char* s, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  _mm_sfence();
}

void pieces(char* d, const char* s, size_t n, size_t piece) {
  for (size_t o = 0; o < n; o += piece) std::memcpy(d + o, s + o, std::min(piece, n - o));
}

}  // namespace

int main() {
  constexpr size_t kSpan = size_t(512) << 20;
  constexpr int kSamples = 15;
  auto* s = static_cast<char*>(mmap(nullptr, kSpan, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  auto* d = static_cast<char*>(mmap(nullptr, kSpan, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (s == MAP_FAILED || d == MAP_FAILED) return 1;
  std::memset(s, 1, kSpan);  // fault every page in first
  std::memset(d, 2, kSpan);
  const char* names[] = {"memcpy", "memcpy in 256 KiB calls", "memcpy in 1 MiB calls", "streaming stores"};
  std::printf("| size | source | method | median | GB/s |\n|---|---|---|---|---|\n");
  for (size_t n : {size_t(1) << 20, size_t(4) << 20, size_t(16) << 20}) {
    for (int cold = 0; cold < 2; ++cold) {
      for (int m = 0; m < 4; ++m) {
        double t[kSamples];
        size_t at = 0;
        for (int i = 0; i < kSamples; ++i) {
          if (cold) at = (at + n + 4096) % (kSpan - n) / 4096 * 4096;
          char* dd = d + at;
          const char* ss = s + at;
          const auto t0 = std::chrono::steady_clock::now();
          if (m == 0) std::memcpy(dd, ss, n);
          else if (m == 1) pieces(dd, ss, n, 256 << 10);
          else if (m == 2) pieces(dd, ss, n, 1 << 20);
          else streaming_copy(dd, ss, n);
          t[i] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        }
        std::sort(t, t + kSamples);
        std::printf("| %zu MiB | %s | %s | %.0f us | %.1f |\n", n >> 20, cold ? "cold" : "warm", names[m],
                    t[kSamples / 2], double(n) / t[kSamples / 2] / 1e3);
      }
    }
  }
}
