// The AttnRes depth read (ops.depth_mix) as fused CPU loops, forward and backward: the
// formulas of ops.DepthMixFunction in fp32, with no (n, B, T, d) temporary and no
// per-source tensor op. Built on first use by ops.fused_kernels() (torch.utils.cpp_extension);
// ops.py runs its torch form instead when it is not built, or for other dtypes and devices.
//
// Shapes: n sources v_i (N, d) fp32 contiguous (N = B T tokens), their 1/rms s_i (N, 1),
// u = w * g (d,). Per token:
//   forward:  r_i = v_i . u,  a = softmax_i(r_i s_i),  z = sum_i a_i v_i
//   backward: p_i = gz . v_i,  ge_i = a_i (p_i - sum_j a_j p_j),  c_i = ge_i s_i,
//             [gv_i, gs_i] = [a_i gz + c_i u, ge_i r_i],  gu = sum_tokens sum_i c_i v_i
//
// Why tiles: the sources are n separate tensors, and a loop over tokens that visits all n
// per token reads n rows far apart, which the CPU cannot prefetch (it measured 3x slower
// in a training step than on warm data). Both kernels instead take a tile of tokens and
// sweep the sources one by one over it, each source's rows being one contiguous block.
// The forward needs one sweep: an online softmax (running max and sum per token, as in
// flash attention) lets z accumulate while the logits arrive.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

namespace {

// The data pointers of n sources of one shape (..., d) and their n 1/rms (N values each),
// after checking them: raises (RuntimeError) before any kernel writes anything.
std::pair<std::vector<const float*>, std::vector<const float*>> inputs(
    const std::vector<torch::Tensor>& sources, const std::vector<torch::Tensor>& inv_rmses, int64_t d) {
  TORCH_CHECK(!sources.empty() && sources.size() == inv_rmses.size(),
              "depth_kernels: need n >= 1 sources and as many 1/rms tensors, got ", sources.size(), " and ",
              inv_rmses.size());
  TORCH_CHECK(d > 0 && sources[0].dim() >= 1 && sources[0].size(-1) == d,
              "depth_kernels: the sources' last dim must be u's length d > 0");
  const int64_t N = sources[0].numel() / d;
  std::vector<const float*> V, S;
  for (const auto& t : sources) {
    TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.device().is_cpu() &&
                t.sizes() == sources[0].sizes(), "depth_kernels: every source must be a contiguous fp32 CPU tensor "
                "of the first one's shape");
    V.push_back(t.data_ptr<float>());
  }
  for (const auto& t : inv_rmses) {
    TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.device().is_cpu() && t.numel() == N,
                "depth_kernels: every 1/rms must be a contiguous fp32 CPU tensor of N = ", N, " values");
    S.push_back(t.data_ptr<float>());
  }
  return {V, S};
}

void check_f32(const torch::Tensor& t, int64_t numel, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.device().is_cpu() && t.numel() == numel,
              "depth_kernels: ", name, " must be a contiguous fp32 CPU tensor of ", numel, " elements");
}

// x . y over d floats in 8 independent lanes, which the compiler turns into one SIMD
// register without reordering a reduction
inline float dot(const float* x, const float* y, int64_t d) {
  float lane[8] = {};
  int64_t k = 0;
  for (; k + 8 <= d; k += 8)
    for (int j = 0; j < 8; ++j) lane[j] += x[k + j] * y[k + j];
  float acc = 0.f;
  for (; k < d; ++k) acc += x[k] * y[k];
  for (int j = 0; j < 8; ++j) acc += lane[j];
  return acc;
}

// Tokens per tile: 16 K floats (64 KB) of each source, a block long enough for the
// prefetcher to stream; the tile's z (forward) or a and p (backward) stay in cache, and
// the backward's second sweep reads the tile's n blocks again from the L2/L3 cache.
int64_t tile_tokens(int64_t d) { return std::max<int64_t>(1, 16384 / d); }

}  // namespace

// Returns (z (N, d), a (n, N), r (n, N)), all fp32.
std::vector<torch::Tensor> mix_forward(const std::vector<torch::Tensor>& sources,
                                       const std::vector<torch::Tensor>& inv_rmses, const torch::Tensor& u) {
  const int64_t n = sources.size(), d = u.numel();
  auto [V, S] = inputs(sources, inv_rmses, d);
  const int64_t N = sources[0].numel() / d;
  check_f32(u, d, "u");
  const float* up = u.data_ptr<float>();
  auto z = torch::empty({N, d}, u.options());
  auto a = torch::empty({n, N}, u.options());
  auto r = torch::empty({n, N}, u.options());
  float *zp = z.data_ptr<float>(), *ap = a.data_ptr<float>(), *rp = r.data_ptr<float>();
  const int64_t tile = tile_tokens(d);
  at::parallel_for(0, (N + tile - 1) / tile, 1, [&](int64_t tb, int64_t te) {
    // per token of the tile: running max m and sum l of exp(e - m), this source's logit e,
    // and the factors that bring z up to date with the new max
    std::vector<float> m(tile), l(tile), e(tile), scale(tile), p(tile);
    for (int64_t b = tb; b < te; ++b) {
      const int64_t t0 = b * tile, nt = std::min(N, t0 + tile) - t0;
      std::fill(m.begin(), m.end(), -INFINITY);
      std::fill(l.begin(), l.end(), 0.f);
      std::fill(zp + t0 * d, zp + (t0 + nt) * d, 0.f);
      for (int64_t i = 0; i < n; ++i) {
        const float* v = V[i] + t0 * d;  // this source's block of the tile, (nt, d)
        for (int64_t j = 0; j < nt; ++j) {
          const float rj = dot(v + j * d, up, d);
          rp[i * N + t0 + j] = rj;
          e[j] = rj * S[i][t0 + j];
        }
        #pragma omp simd  // vector exp over the tile's tokens
        for (int64_t j = 0; j < nt; ++j) {
          const float mj = std::max(m[j], e[j]);
          scale[j] = std::exp(m[j] - mj);  // 0 at the first source (m = -inf)
          p[j] = std::exp(e[j] - mj);
          l[j] = l[j] * scale[j] + p[j];
          m[j] = mj;
        }
        for (int64_t j = 0; j < nt; ++j) {
          float* zt = zp + (t0 + j) * d;
          const float* vj = v + j * d;
          const float sj = scale[j], pj = p[j];
          #pragma omp simd
          for (int64_t k = 0; k < d; ++k) zt[k] = zt[k] * sj + pj * vj[k];
        }
      }
      for (int64_t j = 0; j < nt; ++j) {
        float* zt = zp + (t0 + j) * d;
        const float inv = 1.f / l[j];
        #pragma omp simd
        for (int64_t k = 0; k < d; ++k) zt[k] *= inv;
      }
      for (int64_t i = 0; i < n; ++i) {  // a from r, s and the final max and sum
        float* ai = ap + i * N + t0;
        const float* ri = rp + i * N + t0;
        const float* si = S[i] + t0;
        #pragma omp simd
        for (int64_t j = 0; j < nt; ++j) ai[j] = std::exp(ri[j] * si[j] - m[j]) / l[j];
      }
    }
  });
  return {z, a, r};
}

// g: the route's gradient (slots, N, d + 1) fp32 contiguous; sources i < routed add
// [gv_i, gs_i] into slot i in place, the others' go to the returned `rest`
// (n - routed, N, d + 1). gz (N, d), r (n, N) from the forward. Returns (gu (d,), rest).
std::vector<torch::Tensor> mix_backward(torch::Tensor g, const torch::Tensor& gz, const torch::Tensor& u,
                                        const torch::Tensor& r, const std::vector<torch::Tensor>& sources,
                                        const std::vector<torch::Tensor>& inv_rmses, int64_t routed) {
  const int64_t n = sources.size(), d = u.numel(), w = d + 1;
  auto [V, S] = inputs(sources, inv_rmses, d);
  const int64_t N = sources[0].numel() / d;
  TORCH_CHECK(g.scalar_type() == torch::kFloat && g.is_contiguous() && g.device().is_cpu() &&
              g.numel() % (N * w) == 0 && g.numel() / (N * w) >= routed && 0 <= routed && routed <= n,
              "depth_kernels: g must be a contiguous fp32 CPU tensor (slots >= routed, N, d + 1)");
  check_f32(gz, N * d, "gz");
  check_f32(r, n * N, "r");
  check_f32(u, d, "u");
  const float *gzp = gz.data_ptr<float>(), *up = u.data_ptr<float>(), *rp = r.data_ptr<float>();
  float* gp = g.data_ptr<float>();
  auto rest = torch::empty({n - routed, N, w}, u.options());
  float* restp = rest.data_ptr<float>();
  const int64_t tile = tile_tokens(d), tiles = (N + tile - 1) / tile;
  auto gu_parts = torch::zeros({at::get_num_threads(), d}, u.options());  // gu summed per thread, then over threads
  float* gup = gu_parts.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t tb, int64_t te) {
    std::vector<float> A(n * tile), P(n * tile), ap(tile), mx(tile), sum(tile);  // a_i, p_i per (source, token)
    float* gu = gup + at::get_thread_num() * d;
    for (int64_t b = tb; b < te; ++b) {
      const int64_t t0 = b * tile, t1 = std::min(N, t0 + tile), nt = t1 - t0;
      // sweep 1: the logits e (into A) and p = gz . v_i (into P)
      std::fill(mx.begin(), mx.end(), -INFINITY);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t t = t0; t < t1; ++t) {
          const float e = rp[i * N + t] * S[i][t];
          A[i * tile + t - t0] = e;
          mx[t - t0] = std::max(mx[t - t0], e);
          P[i * tile + t - t0] = dot(gzp + t * d, V[i] + t * d, d);
        }
      // the softmax a, recomputed as in the forward, and sum_j a_j p_j per token (ap)
      std::fill(ap.begin(), ap.end(), 0.f);
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t i = 0; i < n; ++i) {
        float* Ai = A.data() + i * tile;
        #pragma omp simd  // vector exp over the tile's tokens
        for (int64_t t = 0; t < nt; ++t) sum[t] += (Ai[t] = std::exp(Ai[t] - mx[t]));
      }
      for (int64_t i = 0; i < n; ++i) {
        float *Ai = A.data() + i * tile, *Pi = P.data() + i * tile;
        #pragma omp simd
        for (int64_t t = 0; t < nt; ++t) ap[t] += (Ai[t] /= sum[t]) * Pi[t];
      }
      // sweep 2: each source's gradient rows, and gu (its rows are still in cache)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t t = t0; t < t1; ++t) {
          const float* v = V[i] + t * d;
          const float* gzt = gzp + t * d;
          const float ai = A[i * tile + t - t0], ge = ai * (P[i * tile + t - t0] - ap[t - t0]);
          const float c = ge * S[i][t], gs = ge * rp[i * N + t];
          if (i < routed) {
            float* out = gp + (i * N + t) * w;
            #pragma omp simd
            for (int64_t k = 0; k < d; ++k) out[k] += ai * gzt[k] + c * up[k];
            out[d] += gs;
          } else {
            float* out = restp + ((i - routed) * N + t) * w;
            #pragma omp simd
            for (int64_t k = 0; k < d; ++k) out[k] = ai * gzt[k] + c * up[k];
            out[d] = gs;
          }
          #pragma omp simd
          for (int64_t k = 0; k < d; ++k) gu[k] += c * v[k];
        }
    }
  });
  return {gu_parts.sum(0), rest};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mix_forward", &mix_forward, "AttnRes depth read, forward (fp32)");
  m.def("mix_backward", &mix_backward, "AttnRes depth read, backward into the route gradient (fp32)");
}
