// Chunk codec. See codec.hpp for the stored layout; this file explains the choices.
//
// Hot path budget: on the 2-core target machine a compressed save has to beat the raw disk
// (~3.5 GB/s) with ~1 GB/s/core of zstd. That only works because grouped bf16/fp32 data splits
// into one low-entropy exponent plane (worth compressing) and near-random mantissa planes (copied,
// never fed to zstd). So the code around zstd must cost little: byte grouping runs in SSE2 loops
// with the rotation fused, the decision "compress or copy" is made from a 64 KiB sample before any
// zstd work, and zstd runs with an output capacity just below the raw size so an incompressible
// plane fails fast instead of producing a frame we would throw away.
#include "core/codec.hpp"

// For ZSTD_c_literalCompressionMode (see plane_cctx); used only if the run-time libzstd accepts it.
#define ZSTD_STATIC_LINKING_ONLY
#include <zstd.h>
#include <zstd_errors.h>

#include <climits>
#include <cmath>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "core/checksum.hpp"
#include "core/detail/scratch.hpp"
#include "core/error.hpp"

namespace pyckpt {

namespace {

// ---------------------------------------------------------------------------------------------
// Per-thread state: one reused zstd context of each kind and one scratch buffer per worker.
// Creating a CCtx costs far more than compressing a small chunk, and reusing the scratch keeps the
// pages hot (first touch of fresh memory is slow on the target VMs, see DESIGN.md).
// ---------------------------------------------------------------------------------------------

struct ZstdFree {
  void operator()(ZSTD_CCtx* c) const noexcept { ZSTD_freeCCtx(c); }
  void operator()(ZSTD_DCtx* d) const noexcept { ZSTD_freeDCtx(d); }
};

struct WorkerState {
  std::unique_ptr<ZSTD_CCtx, ZstdFree> cctx;        // plain zstd at the requested level
  int cctx_level = INT_MIN;                         // level cctx is configured for
  std::unique_ptr<ZSTD_CCtx, ZstdFree> plane_cctx;  // entropy-oriented profile, see below
  std::unique_ptr<ZSTD_DCtx, ZstdFree> dctx;
  detail::Scratch planes;  // encode: grouped planes; decode: decompressed planes
};

WorkerState& worker() {
  thread_local WorkerState state;
  return state;
}

void zstd_check(std::size_t r, const char* what) {
  if (ZSTD_isError(r)) {
    throw CompressionError(detail::concat("zstd ", what, " failed: ", ZSTD_getErrorName(r)));
  }
}

void set_param(ZSTD_CCtx* c, ZSTD_cParameter p, int v) {
  zstd_check(ZSTD_CCtx_setParameter(c, p, v), "parameter setup");
}

ZSTD_CCtx* new_cctx() {
  ZSTD_CCtx* c = ZSTD_createCCtx();
  if (c == nullptr) throw std::bad_alloc();
  return c;
}

ZSTD_CCtx* cctx_for(int level) {
  WorkerState& w = worker();
  if (!w.cctx) {
    w.cctx.reset(new_cctx());
    w.cctx_level = INT_MIN;
  }
  if (w.cctx_level != level) {
    ZSTD_CCtx* c = w.cctx.get();
    set_param(c, ZSTD_c_compressionLevel, level);
    // Frames carry their content size (any zstd can then size the output); no zstd checksum,
    // the chunk has its own XXH64 over the stored bytes.
    set_param(c, ZSTD_c_contentSizeFlag, 1);
    set_param(c, ZSTD_c_checksumFlag, 0);
    w.cctx_level = level;
  }
  return w.cctx.get();
}

// Profile for byte-grouped planes at fast levels. An exponent plane is close to i.i.d. symbols
// (~2.5 bits of order-0 entropy for bf16/fp32 weights): LZ matches there are short and cost more
// bits than they save, so level 1 reaches only 2.78x where Huffman-coded literals alone reach
// ~3.1x (the bound is 3.14x). A 64-entry hash table with 7-byte minimum matches leaves almost
// everything to the literal Huffman coder, yet still catches long runs (zeros, padding), and it
// is 2-3x faster than level 1 on such planes. Measured on randn*0.02 bf16 and Kaiming-init
// weights: 3.07x / 3.34x vs 2.78x / 2.92x at level 1.
ZSTD_CCtx* plane_cctx() {
  WorkerState& w = worker();
  if (!w.plane_cctx) {
    w.plane_cctx.reset(new_cctx());
    ZSTD_CCtx* c = w.plane_cctx.get();
    set_param(c, ZSTD_c_strategy, ZSTD_fast);
    set_param(c, ZSTD_c_windowLog, 17);
    set_param(c, ZSTD_c_hashLog, 6);
    set_param(c, ZSTD_c_chainLog, 6);
    set_param(c, ZSTD_c_searchLog, 1);
    set_param(c, ZSTD_c_minMatch, 7);
    // For the fast strategy targetLength is an "acceleration" (skip ahead faster when nothing
    // matches), which pays off here since matches are rare anyway: ~1.3x faster, same ratio.
    // But by default zstd then stops Huffman-coding literals, which is all the gain on these
    // planes, so acceleration is used only where the (experimental, hence optional) literal
    // mode parameter can force Huffman coding back on; frames stay standard either way.
    const std::size_t lit = ZSTD_CCtx_setParameter(c, ZSTD_c_literalCompressionMode,
                                                   1 /* ZSTD_ps_enable / ZSTD_lcm_huffman */);
    set_param(c, ZSTD_c_targetLength, ZSTD_isError(lit) ? 0 : 4096);
    set_param(c, ZSTD_c_contentSizeFlag, 1);
    set_param(c, ZSTD_c_checksumFlag, 0);
  }
  return w.plane_cctx.get();
}

ZSTD_DCtx* dctx() {
  WorkerState& w = worker();
  if (!w.dctx) {
    w.dctx.reset(ZSTD_createDCtx());
    if (!w.dctx) throw std::bad_alloc();
  }
  return w.dctx.get();
}

// ---------------------------------------------------------------------------------------------
// Byte grouping. Scalar loops handle the tail (and non-x86 builds); SSE2 is part of the x86-64
// baseline, so the vector paths need no run-time dispatch.
// ---------------------------------------------------------------------------------------------

template <typename T>
inline T load_le(const std::uint8_t* p) noexcept {
  T v;
  std::memcpy(&v, p, sizeof v);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  if constexpr (sizeof(T) == 2) v = __builtin_bswap16(v);
  if constexpr (sizeof(T) == 4) v = __builtin_bswap32(v);
  if constexpr (sizeof(T) == 8) v = __builtin_bswap64(v);
#endif
  return v;
}

template <typename T>
inline void store_le(std::uint8_t* p, T v) noexcept {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  if constexpr (sizeof(T) == 2) v = __builtin_bswap16(v);
  if constexpr (sizeof(T) == 4) v = __builtin_bswap32(v);
  if constexpr (sizeof(T) == 8) v = __builtin_bswap64(v);
#endif
  std::memcpy(p, &v, sizeof v);
}

template <typename T>
inline T rotl1(T v) noexcept {
  return static_cast<T>((v << 1) | (v >> (sizeof(T) * 8 - 1)));
}

template <typename T>
inline T rotr1(T v) noexcept {
  return static_cast<T>((v >> 1) | (v << (sizeof(T) * 8 - 1)));
}

template <bool Rotl>
void group2(const std::uint8_t* src, std::size_t n, std::uint8_t* p0, std::uint8_t* p1) {
  std::size_t i = 0;
#if defined(__SSE2__)
  const __m128i lo_mask = _mm_set1_epi16(0x00FF);
  for (; i + 16 <= n; i += 16) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i + 16));
    if constexpr (Rotl) {
      a = _mm_or_si128(_mm_slli_epi16(a, 1), _mm_srli_epi16(a, 15));
      b = _mm_or_si128(_mm_slli_epi16(b, 1), _mm_srli_epi16(b, 15));
    }
    // Low bytes: mask then pack (values <= 255, so unsigned saturation is exact).
    const __m128i lo = _mm_packus_epi16(_mm_and_si128(a, lo_mask), _mm_and_si128(b, lo_mask));
    const __m128i hi = _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p0 + i), lo);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p1 + i), hi);
  }
#endif
  for (; i < n; ++i) {
    std::uint16_t v = load_le<std::uint16_t>(src + 2 * i);
    if constexpr (Rotl) v = rotl1(v);
    p0[i] = static_cast<std::uint8_t>(v);
    p1[i] = static_cast<std::uint8_t>(v >> 8);
  }
}

template <bool Rotl>
void ungroup2(const std::uint8_t* p0, const std::uint8_t* p1, std::size_t n, std::uint8_t* dst) {
  std::size_t i = 0;
#if defined(__SSE2__)
  for (; i + 16 <= n; i += 16) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p0 + i));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1 + i));
    __m128i a = _mm_unpacklo_epi8(lo, hi);  // elements i .. i+7
    __m128i b = _mm_unpackhi_epi8(lo, hi);  // elements i+8 .. i+15
    if constexpr (Rotl) {
      a = _mm_or_si128(_mm_srli_epi16(a, 1), _mm_slli_epi16(a, 15));
      b = _mm_or_si128(_mm_srli_epi16(b, 1), _mm_slli_epi16(b, 15));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i), a);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i + 16), b);
  }
#endif
  for (; i < n; ++i) {
    std::uint16_t v = static_cast<std::uint16_t>(p0[i] | (p1[i] << 8));
    if constexpr (Rotl) v = rotr1(v);
    store_le(dst + 2 * i, v);
  }
}

#if defined(__SSE2__)
template <bool Rotl>
inline __m128i load_rot32(const std::uint8_t* p) {
  __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (Rotl) x = _mm_or_si128(_mm_slli_epi32(x, 1), _mm_srli_epi32(x, 31));
  return x;
}

// Low 16 bits of each 32-bit lane of a and b, packed into 8 16-bit lanes. Sign-extending first
// makes the signed saturation of packs_epi32 an exact truncation (SSE2 has no packus_epi32).
inline __m128i low16(__m128i a, __m128i b) {
  return _mm_packs_epi32(_mm_srai_epi32(_mm_slli_epi32(a, 16), 16),
                         _mm_srai_epi32(_mm_slli_epi32(b, 16), 16));
}
inline __m128i high16(__m128i a, __m128i b) {
  return _mm_packs_epi32(_mm_srai_epi32(a, 16), _mm_srai_epi32(b, 16));
}
#endif

template <bool Rotl>
void group4(const std::uint8_t* src, std::size_t n, std::uint8_t* const* planes) {
  std::uint8_t* p0 = planes[0];
  std::uint8_t* p1 = planes[1];
  std::uint8_t* p2 = planes[2];
  std::uint8_t* p3 = planes[3];
  std::size_t i = 0;
#if defined(__SSE2__)
  const __m128i lo_mask = _mm_set1_epi16(0x00FF);
  for (; i + 16 <= n; i += 16) {
    const std::uint8_t* s = src + 4 * i;
    const __m128i a = load_rot32<Rotl>(s);
    const __m128i b = load_rot32<Rotl>(s + 16);
    const __m128i c = load_rot32<Rotl>(s + 32);
    const __m128i d = load_rot32<Rotl>(s + 48);
    // Two stages: split 32-bit elements into 16-bit halves, then each half into bytes.
    const __m128i lab = low16(a, b);
    const __m128i lcd = low16(c, d);
    const __m128i hab = high16(a, b);
    const __m128i hcd = high16(c, d);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p0 + i),
                     _mm_packus_epi16(_mm_and_si128(lab, lo_mask), _mm_and_si128(lcd, lo_mask)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p1 + i),
                     _mm_packus_epi16(_mm_srli_epi16(lab, 8), _mm_srli_epi16(lcd, 8)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p2 + i),
                     _mm_packus_epi16(_mm_and_si128(hab, lo_mask), _mm_and_si128(hcd, lo_mask)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p3 + i),
                     _mm_packus_epi16(_mm_srli_epi16(hab, 8), _mm_srli_epi16(hcd, 8)));
  }
#endif
  for (; i < n; ++i) {
    std::uint32_t v = load_le<std::uint32_t>(src + 4 * i);
    if constexpr (Rotl) v = rotl1(v);
    p0[i] = static_cast<std::uint8_t>(v);
    p1[i] = static_cast<std::uint8_t>(v >> 8);
    p2[i] = static_cast<std::uint8_t>(v >> 16);
    p3[i] = static_cast<std::uint8_t>(v >> 24);
  }
}

template <bool Rotl>
void ungroup4(const std::uint8_t* const* planes, std::size_t n, std::uint8_t* dst) {
  const std::uint8_t* p0 = planes[0];
  const std::uint8_t* p1 = planes[1];
  const std::uint8_t* p2 = planes[2];
  const std::uint8_t* p3 = planes[3];
  std::size_t i = 0;
#if defined(__SSE2__)
  for (; i + 16 <= n; i += 16) {
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p0 + i));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1 + i));
    const __m128i q2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p2 + i));
    const __m128i q3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p3 + i));
    const __m128i l0 = _mm_unpacklo_epi8(q0, q1);  // low 16 bits of elements 0..7
    const __m128i l1 = _mm_unpackhi_epi8(q0, q1);  // ... of elements 8..15
    const __m128i h0 = _mm_unpacklo_epi8(q2, q3);
    const __m128i h1 = _mm_unpackhi_epi8(q2, q3);
    __m128i e[4] = {_mm_unpacklo_epi16(l0, h0), _mm_unpackhi_epi16(l0, h0),
                    _mm_unpacklo_epi16(l1, h1), _mm_unpackhi_epi16(l1, h1)};
    for (int k = 0; k < 4; ++k) {
      __m128i x = e[k];
      if constexpr (Rotl) x = _mm_or_si128(_mm_srli_epi32(x, 1), _mm_slli_epi32(x, 31));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 4 * i + 16 * k), x);
    }
  }
#endif
  for (; i < n; ++i) {
    std::uint32_t v = static_cast<std::uint32_t>(p0[i]) | (static_cast<std::uint32_t>(p1[i]) << 8) |
                      (static_cast<std::uint32_t>(p2[i]) << 16) |
                      (static_cast<std::uint32_t>(p3[i]) << 24);
    if constexpr (Rotl) v = rotr1(v);
    store_le(dst + 4 * i, v);
  }
}

// fp64/int64 are rare in checkpoints (optimizer step counters, RNG state); a scalar loop is fine.
template <bool Rotl>
void group8(const std::uint8_t* src, std::size_t n, std::uint8_t* const* planes) {
  for (std::size_t i = 0; i < n; ++i) {
    std::uint64_t v = load_le<std::uint64_t>(src + 8 * i);
    if constexpr (Rotl) v = rotl1(v);
    for (int p = 0; p < 8; ++p) planes[p][i] = static_cast<std::uint8_t>(v >> (8 * p));
  }
}

template <bool Rotl>
void ungroup8(const std::uint8_t* const* planes, std::size_t n, std::uint8_t* dst) {
  for (std::size_t i = 0; i < n; ++i) {
    std::uint64_t v = 0;
    for (int p = 0; p < 8; ++p) v |= static_cast<std::uint64_t>(planes[p][i]) << (8 * p);
    if constexpr (Rotl) v = rotr1(v);
    store_le(dst + 8 * i, v);
  }
}

// ---------------------------------------------------------------------------------------------
// Entropy pre-check.
// ---------------------------------------------------------------------------------------------

// Above this order-0 entropy (bits/byte) zstd level 1 cannot get below the 0.97 raw threshold
// in practice (Huffman alone would need < 7.76 bits), so the plane is copied without trying.
constexpr double kRawEntropyBits = 7.6;
constexpr std::size_t kSampleBytes = 64 << 10;  // sample size per chunk
constexpr std::size_t kSampleRuns = 64;         // spread over the chunk in this many runs
// Below this many sampled bytes per plane the estimate is biased low (log2(n) caps it), so small
// planes always go through zstd and the raw threshold decides.
constexpr std::size_t kMinSampleForSkip = 1024;

// Histograms of byte p of every (rotated) element, p < elem_size, over an evenly spaced sample.
// Sampling the source directly (instead of the grouped planes) lets the caller decide which
// planes are raw before grouping, and group those straight into the output.
template <typename T, bool Rotl>
void sample_histograms(const std::uint8_t* src, std::size_t n_elems, std::uint32_t (*hist)[256],
                       std::size_t& sampled) {
  constexpr std::size_t E = sizeof(T);
  const std::size_t sample_elems = kSampleBytes / E;
  auto add = [&](std::size_t first, std::size_t count) {
    for (std::size_t i = first; i < first + count; ++i) {
      T v = load_le<T>(src + E * i);
      if constexpr (Rotl) v = rotl1(v);
      for (std::size_t p = 0; p < E; ++p) ++hist[p][static_cast<std::uint8_t>(v >> (8 * p))];
    }
  };
  if (n_elems <= sample_elems) {
    add(0, n_elems);
    sampled = n_elems;
    return;
  }
  const std::size_t run = sample_elems / kSampleRuns;
  const std::size_t stride = (n_elems - run) / (kSampleRuns - 1);
  for (std::size_t r = 0; r < kSampleRuns; ++r) add(r * stride, run);
  sampled = run * kSampleRuns;
}

double entropy_bits(const std::uint32_t* hist, std::size_t n) {
  if (n == 0) return 0.0;
  double s = 0.0;
  for (int b = 0; b < 256; ++b) {
    if (hist[b] != 0) s += hist[b] * std::log2(static_cast<double>(hist[b]));
  }
  return std::log2(static_cast<double>(n)) - s / static_cast<double>(n);
}

// Fills raw[p] = true for the planes the pre-check says to copy without compressing.
void precheck(const std::uint8_t* src, std::size_t n_elems, std::uint32_t E, bool rotl, bool* raw) {
  std::uint32_t hist[8][256] = {};
  std::size_t sampled = 0;
  switch (E) {
    case 1: sample_histograms<std::uint8_t, false>(src, n_elems, hist, sampled); break;
    case 2:
      rotl ? sample_histograms<std::uint16_t, true>(src, n_elems, hist, sampled)
           : sample_histograms<std::uint16_t, false>(src, n_elems, hist, sampled);
      break;
    case 4:
      rotl ? sample_histograms<std::uint32_t, true>(src, n_elems, hist, sampled)
           : sample_histograms<std::uint32_t, false>(src, n_elems, hist, sampled);
      break;
    default:
      rotl ? sample_histograms<std::uint64_t, true>(src, n_elems, hist, sampled)
           : sample_histograms<std::uint64_t, false>(src, n_elems, hist, sampled);
      break;
  }
  for (std::uint32_t p = 0; p < E; ++p) {
    raw[p] = sampled >= kMinSampleForSkip && entropy_bits(hist[p], sampled) > kRawEntropyBits;
  }
}

// Levels up to this use plane_cctx() for grouped planes; higher levels are an explicit request
// for more effort and get the standard level parameters.
constexpr int kPlaneProfileMaxLevel = 3;

// Compresses `n` bytes into `dst` if that beats the threshold; otherwise copies them raw.
// The output capacity is capped just below the threshold so an incompressible input ends with
// dstSize_tooSmall as soon as zstd overruns it rather than after a full frame.
PlaneRecord store_plane(const std::uint8_t* src, std::size_t n, bool force_raw, bool grouped,
                        const CodecParams& params, std::uint8_t* dst) {
  if (!force_raw && n > 0) {
    const auto cap = static_cast<std::size_t>(params.raw_threshold * static_cast<double>(n));
    if (cap > 0) {
      ZSTD_CCtx* c = (grouped && params.level >= 1 && params.level <= kPlaneProfileMaxLevel)
                         ? plane_cctx()
                         : cctx_for(params.level);
      const std::size_t r = ZSTD_compress2(c, dst, cap, src, n);
      if (ZSTD_isError(r)) {
        // A failed compress2 leaves the session mid-frame, where the context refuses parameter
        // changes; reset it so the next chunk (maybe at another level) starts clean.
        ZSTD_CCtx_reset(c, ZSTD_reset_session_only);
      }
      if (!ZSTD_isError(r)) {
        if (static_cast<double>(r) < params.raw_threshold * static_cast<double>(n)) {
          return PlaneRecord{PlaneMode::Zstd, r};
        }
      } else if (ZSTD_getErrorCode(r) != ZSTD_error_dstSize_tooSmall) {
        zstd_check(r, "compression");
      }
    }
  }
  std::memcpy(dst, src, n);
  return PlaneRecord{PlaneMode::Raw, n};
}

bool grouping_applies(const CodecParams& params, std::size_t raw_len) {
  return params.codec == Codec::Zstd && params.transform != Transform::None &&
         params.elem_size > 1 && raw_len % params.elem_size == 0;
}

}  // namespace

void validate_params(const CodecParams& params) {
  PYCKPT_EXPECT(params.codec == Codec::None || params.codec == Codec::Zstd, std::invalid_argument,
                "unknown codec id ", static_cast<int>(params.codec));
  PYCKPT_EXPECT(static_cast<int>(params.transform) <= 2, std::invalid_argument,
                "unknown transform id ", static_cast<int>(params.transform));
  const std::uint32_t e = params.elem_size;
  PYCKPT_EXPECT(e == 1 || e == 2 || e == 4 || e == 8, std::invalid_argument,
                "elem_size must be 1, 2, 4 or 8, got ", e);
  PYCKPT_EXPECT(params.raw_threshold > 0.0 && params.raw_threshold <= 1.0, std::invalid_argument,
                "raw_threshold must be in (0, 1], got ", params.raw_threshold);
  if (params.codec == Codec::Zstd) {
    PYCKPT_EXPECT(params.level >= ZSTD_minCLevel() && params.level <= ZSTD_maxCLevel(),
                  std::invalid_argument, "zstd level must be in [", ZSTD_minCLevel(), ", ",
                  ZSTD_maxCLevel(), "], got ", params.level);
  }
}

void group_bytes(const void* src, std::size_t n_elems, std::uint32_t elem_size, bool rotl1_,
                 std::uint8_t* const* planes) {
  const auto* s = static_cast<const std::uint8_t*>(src);
  switch (elem_size) {
    case 1:
      if (n_elems) std::memcpy(planes[0], s, n_elems);
      return;
    case 2:
      rotl1_ ? group2<true>(s, n_elems, planes[0], planes[1])
             : group2<false>(s, n_elems, planes[0], planes[1]);
      return;
    case 4: rotl1_ ? group4<true>(s, n_elems, planes) : group4<false>(s, n_elems, planes); return;
    case 8: rotl1_ ? group8<true>(s, n_elems, planes) : group8<false>(s, n_elems, planes); return;
    default: throw std::invalid_argument(detail::concat("group_bytes: bad elem_size ", elem_size));
  }
}

void ungroup_bytes(const std::uint8_t* const* planes, std::size_t n_elems, std::uint32_t elem_size,
                   bool rotl1_, void* dst) {
  auto* d = static_cast<std::uint8_t*>(dst);
  switch (elem_size) {
    case 1:
      if (n_elems) std::memcpy(d, planes[0], n_elems);
      return;
    case 2:
      rotl1_ ? ungroup2<true>(planes[0], planes[1], n_elems, d)
             : ungroup2<false>(planes[0], planes[1], n_elems, d);
      return;
    case 4:
      rotl1_ ? ungroup4<true>(planes, n_elems, d) : ungroup4<false>(planes, n_elems, d);
      return;
    case 8:
      rotl1_ ? ungroup8<true>(planes, n_elems, d) : ungroup8<false>(planes, n_elems, d);
      return;
    default:
      throw std::invalid_argument(detail::concat("ungroup_bytes: bad elem_size ", elem_size));
  }
}

std::size_t max_encoded_size(std::size_t raw_len, const CodecParams&) noexcept { return raw_len; }

ChunkRecord encode_chunk(const void* src, std::size_t raw_len, const CodecParams& params,
                         void* dst) {
  validate_params(params);
  const auto* in = static_cast<const std::uint8_t*>(src);
  auto* out = static_cast<std::uint8_t*>(dst);
  ChunkRecord rec;
  rec.raw_len = raw_len;

  if (params.codec == Codec::None || raw_len == 0) {
    if (raw_len) std::memcpy(out, in, raw_len);
    rec.transform = Transform::None;
    rec.planes.push_back(PlaneRecord{PlaneMode::Raw, raw_len});
  } else if (!grouping_applies(params, raw_len)) {
    bool raw = false;
    precheck(in, raw_len, 1, false, &raw);
    rec.transform = Transform::None;
    rec.planes.push_back(store_plane(in, raw_len, raw, false, params, out));
  } else {
    const std::uint32_t E = params.elem_size;
    const bool rotl = params.transform == Transform::ByteGroupRotl1;
    const std::size_t n = raw_len / E;
    bool raw[8];
    precheck(in, n, E, rotl, raw);

    // Leading planes that will be stored raw sit at fixed offsets p * n of the output, so they
    // are grouped straight into place; only the others go through the scratch buffer. For bf16
    // with rotl1 that is the mantissa plane: half of the chunk is never copied twice.
    std::uint8_t* scratch = worker().planes.get(raw_len);
    std::uint8_t* plane_ptr[8];
    std::uint32_t direct = 0;
    while (direct < E && raw[direct]) ++direct;
    for (std::uint32_t p = 0; p < E; ++p) plane_ptr[p] = (p < direct ? out : scratch) + p * n;
    group_bytes(in, n, E, rotl, plane_ptr);

    std::size_t off = 0;
    rec.transform = params.transform;
    for (std::uint32_t p = 0; p < E; ++p) {
      if (p < direct) {
        rec.planes.push_back(PlaneRecord{PlaneMode::Raw, n});
      } else {
        rec.planes.push_back(store_plane(plane_ptr[p], n, raw[p], true, params, out + off));
      }
      off += rec.planes.back().stored_len;
    }
  }

  std::uint64_t stored = 0;
  for (const PlaneRecord& pl : rec.planes) stored += pl.stored_len;
  rec.stored_len = stored;
  rec.checksum = xxh64(out, stored);
  return rec;
}

namespace {

// The frame of one zstd plane must declare exactly the plane's size and be exactly the plane's
// stored bytes: checked from the frame header before any output is produced, so a frame that
// would expand beyond what the record promises (a decompression bomb) is never decoded.
void check_frame(const std::uint8_t* src, std::size_t len, std::size_t expected, std::uint32_t p) {
  const unsigned long long declared = ZSTD_getFrameContentSize(src, len);
  // Both are undecodable frames as far as the format goes (pyckpt frames always carry their
  // content size), reported like any other zstd failure.
  if (declared == ZSTD_CONTENTSIZE_ERROR) {
    throw CompressionError(detail::concat("zstd plane ", p, " is not a valid zstd frame"));
  }
  if (declared == ZSTD_CONTENTSIZE_UNKNOWN) {
    throw CompressionError(
        detail::concat("zstd plane ", p, " is a zstd frame without its content size"));
  }
  PYCKPT_EXPECT_FORMAT(declared == expected, FormatKind::Header, "zstd plane ", p, " declares ",
                       declared, " decoded bytes, the chunk record says ", expected);
  const std::size_t frame = ZSTD_findFrameCompressedSize(src, len);
  zstd_check(frame, "frame parsing");
  PYCKPT_EXPECT_FORMAT(frame == len, FormatKind::Header, "zstd plane ", p, " holds ", len,
                       " stored bytes but its frame is ", frame, " bytes");
}

void decompress_plane(const std::uint8_t* src, std::size_t len, std::uint8_t* dst,
                      std::size_t expected, std::uint32_t p) {
  check_frame(src, len, expected, p);
  const std::size_t r = ZSTD_decompressDCtx(dctx(), dst, expected, src, len);
  zstd_check(r, "decompression");
  PYCKPT_EXPECT_FORMAT(r == expected, FormatKind::Header, "zstd plane ", p, " decoded to ", r,
                       " bytes, the chunk record says ", expected);
}

// Decodes one frame through a small window, discarding the output: proves the plane decodes to
// exactly `expected` bytes with O(window) memory, whatever the plane's size.
void check_plane_decodes(const std::uint8_t* src, std::size_t len, std::size_t expected,
                         std::uint32_t p) {
  check_frame(src, len, expected, p);
  ZSTD_DCtx* d = dctx();
  zstd_check(ZSTD_DCtx_reset(d, ZSTD_reset_session_only), "reset");
  constexpr std::size_t kWindow = 128u << 10;
  thread_local std::unique_ptr<std::uint8_t[]> window(new std::uint8_t[kWindow]);
  ZSTD_inBuffer in{src, len, 0};
  std::uint64_t produced = 0;
  for (;;) {
    ZSTD_outBuffer out{window.get(), kWindow, 0};
    const std::size_t r = ZSTD_decompressStream(d, &out, &in);
    if (ZSTD_isError(r)) {
      ZSTD_DCtx_reset(d, ZSTD_reset_session_only);
      zstd_check(r, "decompression");
    }
    produced += out.pos;
    PYCKPT_EXPECT_FORMAT(produced <= expected, FormatKind::Header, "zstd plane ", p,
                         " decodes to more than the ", expected, " bytes of the chunk record");
    if (r == 0) break;  // frame complete
    if (in.pos == in.size && out.pos < out.size) {
      ZSTD_DCtx_reset(d, ZSTD_reset_session_only);
      throw CompressionError(detail::concat("zstd plane ", p, " ends in the middle of its frame"));
    }
  }
  PYCKPT_EXPECT_FORMAT(produced == expected, FormatKind::Header, "zstd plane ", p, " decoded to ",
                       produced, " bytes, the chunk record says ", expected);
}

}  // namespace

std::vector<std::uint8_t> zstd_frame(const void* src, std::size_t len, int level) {
  std::vector<std::uint8_t> out(ZSTD_compressBound(len));
  ZSTD_CCtx* c = cctx_for(level);
  const std::size_t r = ZSTD_compress2(c, out.data(), out.size(), src, len);
  if (ZSTD_isError(r)) ZSTD_CCtx_reset(c, ZSTD_reset_session_only);
  zstd_check(r, "compression");
  out.resize(r);
  return out;
}

std::vector<std::uint8_t> zstd_unframe(const void* src, std::size_t len, std::size_t max_len) {
  const auto* in = static_cast<const std::uint8_t*>(src);
  const unsigned long long declared = ZSTD_getFrameContentSize(in, len);
  if (declared == ZSTD_CONTENTSIZE_ERROR) throw CompressionError("not a valid zstd frame");
  if (declared == ZSTD_CONTENTSIZE_UNKNOWN) {
    throw CompressionError("a zstd frame without its content size");
  }
  PYCKPT_EXPECT_FORMAT(declared <= max_len, FormatKind::Header, "the zstd frame declares ",
                       declared, " decoded bytes, more than the ", max_len, " allowed");
  const std::size_t frame = ZSTD_findFrameCompressedSize(in, len);
  zstd_check(frame, "frame parsing");
  PYCKPT_EXPECT_FORMAT(frame == len, FormatKind::Header, len, " bytes hold a zstd frame of ", frame,
                       " bytes");
  std::vector<std::uint8_t> out(static_cast<std::size_t>(declared));
  const std::size_t r = ZSTD_decompressDCtx(dctx(), out.data(), out.size(), in, len);
  zstd_check(r, "decompression");
  PYCKPT_EXPECT_FORMAT(r == out.size(), FormatKind::Header, "the zstd frame decoded to ", r,
                       " bytes, it declares ", declared);
  return out;
}

bool is_plain_chunk(const ChunkRecord& rec) noexcept {
  return rec.transform == Transform::None && rec.planes.size() == 1 &&
         rec.planes[0].mode == PlaneMode::Raw && rec.stored_len == rec.raw_len;
}

void validate_record(const ChunkRecord& rec, const CodecParams& params) {
  const auto transform = static_cast<unsigned>(rec.transform);
  PYCKPT_EXPECT_FORMAT(transform <= 2, FormatKind::Header, "unknown transform code ", transform);
  PYCKPT_EXPECT_FORMAT(!rec.planes.empty() && rec.planes.size() <= 8, FormatKind::Header,
                       "a chunk has 1 to 8 planes, the record has ", rec.planes.size());
  std::uint64_t sum = 0;
  for (std::size_t p = 0; p < rec.planes.size(); ++p) {
    const PlaneRecord& pl = rec.planes[p];
    const auto mode = static_cast<unsigned>(pl.mode);
    PYCKPT_EXPECT_FORMAT(mode <= 1, FormatKind::Header, "plane ", p, " has unknown mode code ",
                         mode);
    PYCKPT_EXPECT_FORMAT(pl.stored_len <= UINT64_MAX - sum, FormatKind::Header,
                         "plane lengths of the chunk record overflow");
    sum += pl.stored_len;
  }
  PYCKPT_EXPECT_FORMAT(sum == rec.stored_len, FormatKind::Header, "chunk record planes sum to ",
                       sum, " bytes but stored_len is ", rec.stored_len);
  // The encoder keeps a plane compressed only when it is smaller than its raw bytes, so no valid
  // chunk stores more than it decodes to; a record saying otherwise is corrupt.
  PYCKPT_EXPECT_FORMAT(rec.stored_len <= rec.raw_len, FormatKind::Header, "chunk stores ",
                       rec.stored_len, " bytes for ", rec.raw_len, " decoded bytes");
  if (params.codec == Codec::None) {
    PYCKPT_EXPECT_FORMAT(is_plain_chunk(rec), FormatKind::Header,
                         "a chunk of codec 'none' must be one raw plane of its raw length");
  }
  if (rec.transform == Transform::None) {
    PYCKPT_EXPECT_FORMAT(rec.planes.size() == 1, FormatKind::Header,
                         "untransformed chunk must have 1 plane, record has ", rec.planes.size());
    PYCKPT_EXPECT_FORMAT(rec.planes[0].mode != PlaneMode::Raw || rec.stored_len == rec.raw_len,
                         FormatKind::Header, "raw chunk stores ", rec.stored_len,
                         " bytes for raw_len ", rec.raw_len);
    return;
  }
  const std::uint32_t E = params.elem_size;
  PYCKPT_EXPECT_FORMAT(E == 2 || E == 4 || E == 8, FormatKind::Header,
                       "grouped chunk needs elem_size 2, 4 or 8, params say ", E);
  PYCKPT_EXPECT_FORMAT(rec.raw_len % E == 0, FormatKind::Header, "grouped chunk raw_len ",
                       rec.raw_len, " is not a multiple of elem_size ", E);
  PYCKPT_EXPECT_FORMAT(rec.planes.size() == E, FormatKind::Header, "grouped chunk needs ", E,
                       " planes, record has ", rec.planes.size());
  const std::uint64_t n = rec.raw_len / E;
  for (std::uint32_t p = 0; p < E; ++p) {
    const PlaneRecord& pl = rec.planes[p];
    if (pl.mode == PlaneMode::Raw) {
      PYCKPT_EXPECT_FORMAT(pl.stored_len == n, FormatKind::Header, "raw plane ", p, " stores ",
                           pl.stored_len, " bytes, expected ", n);
    } else {
      PYCKPT_EXPECT_FORMAT(pl.stored_len <= n, FormatKind::Header, "zstd plane ", p, " stores ",
                           pl.stored_len, " bytes for a ", n, "-byte plane");
    }
  }
}

void verify_chunk_checksum(const void* stored, const ChunkRecord& rec) {
  // The message never shows the hash of the bytes read: for a data file replaced by another
  // file, it would disclose that file's contents to whoever can make it be read.
  PYCKPT_EXPECT_FORMAT(xxh64(stored, rec.stored_len) == rec.checksum, FormatKind::Checksum,
                       "checksum mismatch over ", rec.stored_len, " stored bytes");
}

void DecodedChunk::copy_out(std::uint64_t offset, std::uint64_t n, void* dst) const {
  auto* d = static_cast<std::uint8_t*>(dst);
  if (n == 0) return;
  if (_flat) {
    std::memcpy(d, _flat + offset, n);
    return;
  }
  const std::uint32_t E = _elem;
  std::uint64_t k = offset / E;  // element holding the first byte
  std::uint8_t one[8] = {};
  const std::uint8_t* at[8] = {};
  const auto point = [&](std::uint64_t elem) {
    for (std::uint32_t p = 0; p < E; ++p) at[p] = _planes[p] + elem;
  };
  if (const auto skip = static_cast<std::uint32_t>(offset % E)) {  // starts inside an element
    point(k);
    ungroup_bytes(at, 1, E, _rotl1, one);
    const std::uint64_t take = std::min<std::uint64_t>(E - skip, n);
    std::memcpy(d, one + skip, take);
    d += take;
    n -= take;
    ++k;
  }
  if (const std::uint64_t whole = n / E) {
    point(k);
    ungroup_bytes(at, whole, E, _rotl1, d);
    d += whole * E;
    n -= whole * E;
    k += whole;
  }
  if (n) {  // ends inside an element
    point(k);
    ungroup_bytes(at, 1, E, _rotl1, one);
    std::memcpy(d, one, n);
  }
}

namespace {

// validate + checksum + zstd planes decoded; an untransformed zstd chunk decodes into `flat_out`
// when given (else into scratch).
DecodedChunk decode_parts(const std::uint8_t* in, const ChunkRecord& rec, const CodecParams& params,
                          std::uint8_t* flat_out) {
  validate_record(rec, params);
  // Checksum before decoding: decoding corrupted zstd input would report a misleading zstd error.
  verify_chunk_checksum(in, rec);

  if (rec.transform == Transform::None) {
    const PlaneRecord& pl = rec.planes[0];
    if (pl.mode == PlaneMode::Raw) return DecodedChunk::flat(in, rec.raw_len);
    std::uint8_t* out =
        flat_out ? flat_out : worker().planes.get(static_cast<std::size_t>(rec.raw_len));
    decompress_plane(in, pl.stored_len, out, rec.raw_len, 0);
    return DecodedChunk::flat(out, rec.raw_len);
  }
  return DecodedChunk{};  // grouped: filled by decode_chunk_planes()
}

}  // namespace

DecodedChunk decode_chunk_planes(const void* stored, const ChunkRecord& rec,
                                 const CodecParams& params) {
  const auto* in = static_cast<const std::uint8_t*>(stored);
  DecodedChunk d = decode_parts(in, rec, params, nullptr);
  if (rec.transform == Transform::None) return d;

  const std::uint32_t E = params.elem_size;
  const std::size_t n = rec.raw_len / E;
  // Raw planes stay in the stored bytes; only zstd planes need scratch, packed one after the
  // other (near-random planes are stored raw, so bf16 and fp32 chunks usually need a half or a
  // quarter of the chunk: less memory first touched per thread).
  std::uint32_t zstd_planes = 0;
  for (std::uint32_t p = 0; p < E; ++p) zstd_planes += rec.planes[p].mode != PlaneMode::Raw;
  std::uint8_t* scratch = zstd_planes ? worker().planes.get(zstd_planes * n) : nullptr;
  std::size_t off = 0;
  for (std::uint32_t p = 0; p < E; ++p) {
    const PlaneRecord& pl = rec.planes[p];
    if (pl.mode == PlaneMode::Raw) {
      d._planes[p] = in + off;
    } else {
      decompress_plane(in + off, pl.stored_len, scratch, n, p);
      d._planes[p] = scratch;
      scratch += n;
    }
    off += pl.stored_len;
  }
  d._elem = E;
  d._rotl1 = rec.transform == Transform::ByteGroupRotl1;
  d._size = rec.raw_len;
  return d;
}

void decode_chunk(const void* stored, const ChunkRecord& rec, const CodecParams& params,
                  void* dst) {
  auto* out = static_cast<std::uint8_t*>(dst);
  if (rec.transform == Transform::None) {
    const DecodedChunk d = decode_parts(static_cast<const std::uint8_t*>(stored), rec, params, out);
    if (d.flat_bytes() != out) d.copy_out(0, d.size(), out);
    return;
  }
  decode_chunk_planes(stored, rec, params).copy_out(0, rec.raw_len, out);
}

void verify_chunk(const void* stored, const ChunkRecord& rec, const CodecParams& params) {
  const auto* in = static_cast<const std::uint8_t*>(stored);
  validate_record(rec, params);
  verify_chunk_checksum(in, rec);
  // Ungrouping cannot fail once every plane has its exact size, so decoding each zstd plane once
  // (output discarded) checks everything decode_chunk() would.
  const std::size_t n =
      rec.transform == Transform::None ? rec.raw_len : rec.raw_len / params.elem_size;
  std::size_t off = 0;
  for (std::uint32_t p = 0; p < rec.planes.size(); ++p) {
    const PlaneRecord& pl = rec.planes[p];
    if (pl.mode == PlaneMode::Zstd) check_plane_decodes(in + off, pl.stored_len, n, p);
    off += pl.stored_len;
  }
}

void trim_codec_scratch(std::size_t keep) noexcept { worker().planes.trim(keep); }

}  // namespace pyckpt
