// The CUDA path of the design core: the C ABI of certchat_core.h for the functions
// marked [cuda], computed on the device from host arrays (copied in, computed, copied
// back, each leg timed with CUDA events). The algorithms mirror design_cpu.cpp step for
// step, sharing design_common.hpp (Philox, unit weight, water-filling solver), so the
// draws are bit-identical and the probabilities agree to rounding:
//   units      one thread per unit sums its tokens in token order (a stable radix sort
//              groups them), so unit weights equal the CPU's bit for bit;
//   top slice  the CPU's "longest prefix in (key desc, index asc) order" found by
//              bisection on the keys' bit patterns plus an ordered scan of the tie group;
//   pi         the shared Newton/bisection solver, its sweeps as block reductions in one
//              1024-thread block.
// Without a usable device every entry point returns CERTCHAT_ERR_NO_DEVICE.
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <cub/cub.cuh>
#include <mutex>
#include <type_traits>

#include "certchat_core.h"
#include "design_common.hpp"
#include "status.hpp"

namespace certchat {
namespace {

constexpr int kDesignThreads = 1024;
constexpr int kThreads = 256;
constexpr uint8_t kUndecided = 255;
constexpr uint64_t kAboveInfBits = 0x7FF0000000000001ull;  // larger than any finite key's bits

struct Timing {
    double h2d_ms, kernel_ms, d2h_ms;
};
thread_local Timing g_timing{0.0, 0.0, 0.0};

#define CERTCHAT_CUDA_TRY(expr)                                                                     \
    do {                                                                                            \
        const cudaError_t err_ = (expr);                                                            \
        if (err_ != cudaSuccess) return fail(CERTCHAT_ERR_CUDA, "%s: %s", #expr, cudaGetErrorString(err_)); \
    } while (0)

// ---------------------------------------------------------------- device, memory, timing

int g_device_count = 0;
cudaError_t g_device_error = cudaSuccess;
std::once_flag g_device_once;

void probe_device() {
    g_device_error = cudaGetDeviceCount(&g_device_count);
    if (g_device_error != cudaSuccess) {
        g_device_count = 0;
        return;
    }
    if (g_device_count > 0) {
        // Keep freed blocks in the stream-ordered pool: per-call allocations then cost ~nothing.
        cudaMemPool_t pool;
        if (cudaDeviceGetDefaultMemPool(&pool, 0) == cudaSuccess) {
            uint64_t threshold = UINT64_MAX;
            cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold);
        }
    }
}

int ensure_device() {
    std::call_once(g_device_once, probe_device);
    if (g_device_count <= 0)
        return fail(CERTCHAT_ERR_NO_DEVICE, "no usable CUDA device (%s)",
                    g_device_error == cudaSuccess ? "none found" : cudaGetErrorString(g_device_error));
    return CERTCHAT_OK;
}

// One stream-ordered allocation carved into 256-byte aligned pieces, freed on scope exit.
class Arena {
  public:
    explicit Arena(cudaStream_t stream) : stream_(stream) {}
    Arena(const Arena &) = delete;
    Arena &operator=(const Arena &) = delete;
    ~Arena() {
        if (base_ != nullptr) cudaFreeAsync(base_, stream_);
    }
    // Phase 1: declare sizes; phase 2 (after allocate): the same calls return pointers.
    template <class T>
    T *piece(size_t count) {
        const size_t at = used_;
        used_ += (count * sizeof(T) + 255) / 256 * 256;
        return base_ == nullptr ? nullptr : reinterpret_cast<T *>(static_cast<char *>(base_) + at);
    }
    cudaError_t allocate() {
        const size_t bytes = used_ > 0 ? used_ : 256;
        used_ = 0;
        return cudaMallocAsync(&base_, bytes, stream_);
    }

  private:
    cudaStream_t stream_;
    void *base_ = nullptr;
    size_t used_ = 0;
};

class Events {
  public:
    Events() {
        for (auto &e : ev_) cudaEventCreate(&e);
    }
    Events(const Events &) = delete;
    Events &operator=(const Events &) = delete;
    ~Events() {
        for (auto &e : ev_) cudaEventDestroy(e);
    }
    void mark(int i, cudaStream_t s) { cudaEventRecord(ev_[i], s); }
    int finish() {
        const cudaError_t err = cudaEventSynchronize(ev_[3]);
        if (err != cudaSuccess) return fail(CERTCHAT_ERR_CUDA, "synchronize: %s", cudaGetErrorString(err));
        float a = 0.f, b = 0.f, c = 0.f;
        cudaEventElapsedTime(&a, ev_[0], ev_[1]);
        cudaEventElapsedTime(&b, ev_[1], ev_[2]);
        cudaEventElapsedTime(&c, ev_[2], ev_[3]);
        g_timing = Timing{a, b, c};
        return CERTCHAT_OK;
    }

  private:
    cudaEvent_t ev_[4];
};

int grid_for(int64_t n) {
    const int64_t blocks = (n + kThreads - 1) / kThreads;
    return static_cast<int>(blocks < 4096 ? (blocks > 0 ? blocks : 1) : 4096);
}

template <class T>
cudaError_t to_device(T *dst, const T *src, int64_t n, cudaStream_t s) {
    if (src == nullptr || n == 0) return cudaSuccess;
    return cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * sizeof(T), cudaMemcpyHostToDevice, s);
}

template <class T>
cudaError_t to_host(T *dst, const T *src, int64_t n, cudaStream_t s) {
    if (dst == nullptr || n == 0) return cudaSuccess;
    return cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * sizeof(T), cudaMemcpyDeviceToHost, s);
}

// ---------------------------------------------------------------- block reductions (one block)

__device__ double warp_reduce(double v, int op) {
    for (int off = 16; off > 0; off >>= 1) {
        const double o = __shfl_down_sync(0xffffffffu, v, off);
        v = op == 0 ? v + o : (op == 1 ? fmax(v, o) : fmin(v, o));
    }
    return v;
}

// op: 0 sum, 1 max, 2 min. Every thread of the block gets the result; fixed order for a
// fixed block size, so repeated runs agree.
__device__ double block_reduce(double v, int op, double *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    const double identity = op == 0 ? 0.0 : (op == 1 ? -HUGE_VAL : HUGE_VAL);
    v = warp_reduce(v, op);
    __syncthreads();  // scratch may still be read by a previous reduction
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        double r = lane < nwarps ? scratch[lane] : identity;
        r = warp_reduce(r, op);
        if (lane == 0) scratch[32] = r;
    }
    __syncthreads();
    return scratch[32];
}

__device__ uint64_t key_bits(double key) { return static_cast<uint64_t>(__double_as_longlong(key)); }

// ---------------------------------------------------------------- kernels: checks and units

__global__ void check_tokens_kernel(int64_t n, const double *scores, const int32_t *unit_ids, int64_t n_units,
                                    const int64_t *positions, const double *prev_cum, int *bad) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        bool ok = scores[i] >= 0.0 && scores[i] <= DBL_MAX;
        if (unit_ids != nullptr) ok &= unit_ids[i] >= 0 && unit_ids[i] < n_units;
        if (positions != nullptr) ok &= positions[i] >= 0;
        if (prev_cum != nullptr) ok &= prev_cum[i] <= 0.0 && prev_cum[i] >= -DBL_MAX;
        if (!ok) atomicExch(bad, 1);
    }
}

// Token-level units: unit i is token i.
__global__ void token_units_kernel(int64_t n, const double *scores, const uint8_t *prot, const int64_t *positions,
                                   double floor, double *weight, double *size, uint8_t *uprot, int64_t *upos) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        weight[i] = scores[i] + floor;
        size[i] = 1.0;
        uprot[i] = prot != nullptr ? (prot[i] != 0) : 0;
        upos[i] = positions != nullptr ? positions[i] : i;  // no positions: token order
    }
}

__global__ void count_units_kernel(int64_t n, const int32_t *unit_ids, int64_t n_units, uint32_t *keys,
                                   int32_t *order, int32_t *counts) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int32_t k = unit_ids[i];
        keys[i] = static_cast<uint32_t>(k);  // invalid ids sort after every valid one
        order[i] = static_cast<int32_t>(i);
        if (k >= 0 && k < n_units) atomicAdd(&counts[k], 1);
    }
}

// One thread per unit walks its tokens in token order (the stable sort kept it), so the
// floating-point sum matches the CPU's bit for bit.
__global__ void sum_units_kernel(int64_t n_units, const int32_t *offsets, const int32_t *counts,
                                 const int32_t *sorted_tokens, const double *scores, const uint8_t *prot,
                                 const int64_t *positions, double floor, double *weight, double *size,
                                 uint8_t *uprot, int64_t *upos) {
    for (int64_t u = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; u < n_units;
         u += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        double mass = 0.0;
        uint8_t any_prot = 0;
        int64_t pmin = INT64_MAX;
        const int32_t begin = offsets[u], count = counts[u];
        for (int32_t j = begin; j < begin + count; ++j) {
            const int32_t i = sorted_tokens[j];
            mass += scores[i] + floor;
            if (prot != nullptr && prot[i]) any_prot = 1;
            const int64_t p = positions != nullptr ? positions[i] : i;  // no positions: token order
            if (p < pmin) pmin = p;
        }
        const double s = static_cast<double>(count);
        size[u] = s;
        weight[u] = count > 0 ? unit_weight(mass, s) : 0.0;
        uprot[u] = any_prot;
        upos[u] = count > 0 ? pmin : 0;
    }
}

// ---------------------------------------------------------------- the design kernel (one block)

struct DesignArgs {
    int64_t n_units;
    const double *weight;
    const double *size;
    const uint8_t *prot;
    const int64_t *pos;
    certchat_design design;
    double *pi;
    uint8_t *kind;
    int *status;
};

struct DesignShared {
    double scratch[33];
    WaterfillSolver solver;
    typename cub::BlockScan<double, kDesignThreads>::TempStorage scan;
};

__device__ double unit_key(const DesignArgs &a, int64_t u) {
    return a.design.method == CERTCHAT_METHOD_WINDOW ? static_cast<double>(a.pos[u]) : a.weight[u];
}

// Longest prefix of the undecided units in (key desc, index asc) order with total size <=
// target; marks them `mark` with pi = 1 and returns their total size (design_cpu.cpp's
// select_prefix, computed without sorting).
__device__ double select_prefix_dev(const DesignArgs &a, double target, uint8_t mark, DesignShared &sh) {
    const int64_t U = a.n_units;
    double part = 0.0;
    for (int64_t u = threadIdx.x; u < U; u += blockDim.x)
        if (a.kind[u] == kUndecided) part += a.size[u];
    const double total = block_reduce(part, 0, sh.scratch);
    if (total <= target) {
        for (int64_t u = threadIdx.x; u < U; u += blockDim.x)
            if (a.kind[u] == kUndecided) {
                a.kind[u] = mark;
                a.pi[u] = 1.0;
            }
        __syncthreads();
        return total;
    }
    if (target < 1.0) return 0.0;
    // Largest key k* with sum_{key >= k*} size > target: the key of the first unit that does not fit.
    uint64_t lo = 0, hi = kAboveInfBits;
    while (hi - lo > 1) {
        const uint64_t mid = lo + (hi - lo) / 2;
        double s = 0.0;
        for (int64_t u = threadIdx.x; u < U; u += blockDim.x)
            if (a.kind[u] == kUndecided && key_bits(unit_key(a, u)) >= mid) s += a.size[u];
        if (block_reduce(s, 0, sh.scratch) > target)
            lo = mid;
        else
            hi = mid;
    }
    const uint64_t kstar = lo;
    double above = 0.0;
    for (int64_t u = threadIdx.x; u < U; u += blockDim.x)
        if (a.kind[u] == kUndecided && key_bits(unit_key(a, u)) > kstar) above += a.size[u];
    const double size_above = block_reduce(above, 0, sh.scratch);
    // The tie group at k*, in index order, while it fits (sizes are whole numbers: exact sums).
    const double rem = target - size_above;
    double running = 0.0, taken = 0.0;
    for (int64_t base = 0; base < U; base += blockDim.x) {
        const int64_t u = base + threadIdx.x;
        const bool tie = u < U && a.kind[u] == kUndecided && key_bits(unit_key(a, u)) == kstar;
        const double v = tie ? a.size[u] : 0.0;
        double incl = 0.0, chunk = 0.0;
        cub::BlockScan<double, kDesignThreads>(sh.scan).InclusiveSum(v, incl, chunk);
        if (tie && running + incl <= rem) taken += v;
        if (tie && running + incl <= rem) {
            a.kind[u] = mark;
            a.pi[u] = 1.0;
        }
        running += chunk;
        __syncthreads();
    }
    for (int64_t u = threadIdx.x; u < U; u += blockDim.x)
        if (a.kind[u] == kUndecided && key_bits(unit_key(a, u)) > kstar) {
            a.kind[u] = mark;
            a.pi[u] = 1.0;
        }
    const double tie_taken = block_reduce(taken, 0, sh.scratch);
    return size_above + tie_taken;
}

__device__ void set_pi(const DesignArgs &a, int64_t u, double v) {
    a.pi[u] = v;
    a.kind[u] = v >= 1.0 ? CERTCHAT_KIND_CERTAIN : CERTCHAT_KIND_SAMPLED;
}

// design_cpu.cpp's waterfill over the undecided units; returns a status.
__device__ int waterfill_dev(const DesignArgs &a, double target, bool unit_weights, DesignShared &sh) {
    const int64_t U = a.n_units;
    const double p = a.design.pi_min;
    auto w_of = [&](int64_t u) { return unit_weights ? 1.0 : a.weight[u]; };
    double s_part = 0.0, w_part = 0.0;
    for (int64_t u = threadIdx.x; u < U; u += blockDim.x)
        if (a.kind[u] == kUndecided) {
            s_part += a.size[u];
            w_part = fmax(w_part, w_of(u));
        }
    const double s_rest = block_reduce(s_part, 0, sh.scratch);
    const double wmax = block_reduce(w_part, 1, sh.scratch);
    if (s_rest == 0.0) return CERTCHAT_OK;
    int status = CERTCHAT_OK;
    double level = -1.0;  // a single value for every undecided unit, when one applies
    if (target <= p * s_rest) {
        level = p;
        if (target < p * s_rest * (1.0 - 1e-12)) status = CERTCHAT_WARN_BUDGET_INFEASIBLE;
    } else if (target >= s_rest) {
        level = 1.0;
    } else if (wmax == 0.0) {
        level = target / s_rest;
    }
    if (level >= 0.0) {
        for (int64_t u = threadIdx.x; u < U; u += blockDim.x)
            if (a.kind[u] == kUndecided) set_pi(a, u, level);
        __syncthreads();
        return status;
    }
    const double inv_wmax = 1.0 / wmax;
    double sp = 0.0, sz = 0.0, sw = 0.0, wmin = 1.0;
    for (int64_t u = threadIdx.x; u < U; u += blockDim.x)
        if (a.kind[u] == kUndecided) {
            const double w = w_of(u) * inv_wmax;
            if (w > 0.0) {
                sp += a.size[u];
                sw += a.size[u] * w;
                wmin = fmin(wmin, w);
            } else {
                sz += a.size[u];
            }
        }
    const double s_pos = block_reduce(sp, 0, sh.scratch);
    const double s_zero = block_reduce(sz, 0, sh.scratch);
    const double sum_w = block_reduce(sw, 0, sh.scratch);
    const double wmin_pos = block_reduce(wmin, 2, sh.scratch);
    if (s_zero > 0.0 && target >= s_pos + p * s_zero) {
        const double zero_level = (target - s_pos) / s_zero;
        for (int64_t u = threadIdx.x; u < U; u += blockDim.x)
            if (a.kind[u] == kUndecided) set_pi(a, u, w_of(u) * inv_wmax > 0.0 ? 1.0 : zero_level);
        __syncthreads();
        return CERTCHAT_OK;
    }
    if (threadIdx.x == 0) waterfill_init(&sh.solver, target, (target - p * s_zero) / sum_w, 1.0 / wmin_pos);
    __syncthreads();
    while (true) {
        const double c = sh.solver.c;
        double hi = 0.0, lo = 0.0, slope = 0.0;
        for (int64_t u = threadIdx.x; u < U; u += blockDim.x)
            if (a.kind[u] == kUndecided) {
                const double w = w_of(u) * inv_wmax;
                const double cw = c * w;
                if (cw >= 1.0)
                    hi += a.size[u];
                else if (cw <= p)
                    lo += a.size[u];
                else
                    slope += a.size[u] * w;
            }
        hi = block_reduce(hi, 0, sh.scratch);
        lo = block_reduce(lo, 0, sh.scratch);
        slope = block_reduce(slope, 0, sh.scratch);
        if (threadIdx.x == 0) waterfill_step(&sh.solver, WaterfillStats{hi + p * lo, slope});
        __syncthreads();
        if (sh.solver.done != 0) break;
    }
    if (sh.solver.done < 0) return CERTCHAT_ERR_INTERNAL;
    const double c = sh.solver.c;
    double got = 0.0;
    for (int64_t u = threadIdx.x; u < U; u += blockDim.x)
        if (a.kind[u] == kUndecided) {
            const double v = clamp_pi(c * (w_of(u) * inv_wmax), p);
            got += a.size[u] * v;
            set_pi(a, u, v);
        }
    got = block_reduce(got, 0, sh.scratch);
    if (fabs(got - target) > 1e-9 * fmax(1.0, target)) return CERTCHAT_ERR_INTERNAL;
    return CERTCHAT_OK;
}

__global__ void __launch_bounds__(kDesignThreads) design_kernel(DesignArgs a) {
    __shared__ DesignShared sh;
    const int64_t U = a.n_units;
    const certchat_design &d = a.design;
    const bool deterministic = d.method == CERTCHAT_METHOD_TOPK || d.method == CERTCHAT_METHOD_WINDOW;
    double s_part = 0.0, m_part = 0.0;
    for (int64_t u = threadIdx.x; u < U; u += blockDim.x) {
        s_part += a.size[u];
        if (a.size[u] == 0.0) {
            a.pi[u] = 1.0;
            a.kind[u] = CERTCHAT_KIND_CERTAIN;
        } else if (a.prot[u]) {
            m_part += a.size[u];
            a.pi[u] = 1.0;
            a.kind[u] = CERTCHAT_KIND_PROTECTED;
        } else {
            a.kind[u] = kUndecided;
        }
    }
    const double s_tot = block_reduce(s_part, 0, sh.scratch);
    const double m = block_reduce(m_part, 0, sh.scratch);
    int status = CERTCHAT_OK;
    if (d.budget >= s_tot) {
        for (int64_t u = threadIdx.x; u < U; u += blockDim.x)
            if (a.kind[u] == kUndecided) {
                a.pi[u] = 1.0;
                a.kind[u] = deterministic ? CERTCHAT_KIND_TOP : CERTCHAT_KIND_CERTAIN;
            }
    } else {
        const double t = d.budget - m;
        if (deterministic) {
            if (t > 0.0) select_prefix_dev(a, t, CERTCHAT_KIND_TOP, sh);
            __syncthreads();
            for (int64_t u = threadIdx.x; u < U; u += blockDim.x)
                if (a.kind[u] == kUndecided) {
                    a.pi[u] = 0.0;
                    a.kind[u] = CERTCHAT_KIND_DROPPED;
                }
            if (t < 0.0) status = CERTCHAT_WARN_BUDGET_INFEASIBLE;
        } else if (d.method == CERTCHAT_METHOD_UNIFORM) {
            status = waterfill_dev(a, t, true, sh);
        } else {
            double top = 0.0;
            if (d.top_share > 0.0 && t > 0.0) top = select_prefix_dev(a, d.top_share * t, CERTCHAT_KIND_TOP, sh);
            __syncthreads();
            status = waterfill_dev(a, t - top, false, sh);
        }
    }
    if (threadIdx.x == 0) *a.status = status;
}

// ---------------------------------------------------------------- kernels: draws and tokens

__global__ void unit_keep_kernel(int64_t n_units, const double *pi, const int64_t *pos, uint64_t seed,
                                 uint64_t round, uint8_t *keep) {
    for (int64_t u = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; u < n_units;
         u += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const double p = pi[u];
        keep[u] = p >= 1.0 ? 1 : (p <= 0.0 ? 0 : (design_uniform(seed, round, pos[u]) < p ? 1 : 0));
    }
}

__device__ void update_one_dev(double pi, bool kept, double prev, double *cum, float *bias) {
    if (kept) {
        *cum = prev + log(pi);
        *bias = static_cast<float>(0.0 - *cum);
    } else {
        *cum = -HUGE_VAL;
        *bias = 0.0f;
    }
}

__global__ void token_outputs_kernel(int64_t n, const int32_t *unit_ids, int64_t n_units, const double *pi_u,
                                     const uint8_t *kind_u, const uint8_t *keep_u, const double *prev_cum,
                                     double *pi_out, uint8_t *kind_out, uint8_t *keep_out, double *cum_out,
                                     float *bias_out) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        int64_t k = unit_ids != nullptr ? unit_ids[i] : i;
        if (k < 0 || k >= n_units) k = 0;  // rejected on the host afterwards; stay in bounds
        if (pi_out != nullptr) pi_out[i] = pi_u[k];
        if (kind_out != nullptr) kind_out[i] = kind_u[k];
        if (keep_out != nullptr) {
            keep_out[i] = keep_u[k];
            if (cum_out != nullptr && bias_out != nullptr)
                update_one_dev(pi_u[k], keep_u[k] != 0, prev_cum != nullptr ? prev_cum[i] : 0.0, &cum_out[i],
                               &bias_out[i]);
        }
    }
}

__global__ void uniforms_kernel(int64_t n, const int64_t *positions, uint64_t seed, uint64_t round, double *u) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x)
        u[i] = design_uniform(seed, round, positions[i]);
}

__global__ void draw_kernel(int64_t n, const double *pi, const int64_t *positions, uint64_t seed, uint64_t round,
                            uint8_t *keep, int *bad) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const double p = pi[i];
        if (!(p >= 0.0 && p <= 1.0)) atomicExch(bad, 1);
        keep[i] = p >= 1.0 ? 1 : (p <= 0.0 ? 0 : (design_uniform(seed, round, positions[i]) < p ? 1 : 0));
    }
}

__global__ void update_kernel(int64_t n, const double *pi, const uint8_t *keep, const double *prev_cum,
                              double *cum, float *bias, int *bad) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        bool ok = !keep[i] || (pi[i] > 0.0 && pi[i] <= 1.0);
        if (prev_cum != nullptr) ok &= prev_cum[i] <= 0.0 && prev_cum[i] >= -DBL_MAX;
        if (!ok) atomicExch(bad, 1);
        update_one_dev(pi[i], keep[i] != 0, prev_cum != nullptr ? prev_cum[i] : 0.0, &cum[i], &bias[i]);
    }
}

// ---------------------------------------------------------------- the round, end to end

struct PlanIO {
    int64_t n;
    const double *scores;
    const uint8_t *prot;
    const int32_t *unit_ids;
    int64_t n_units;
    const int64_t *positions;
    const double *prev_cum;
    const certchat_design *design;
    uint8_t *keep_out;
    double *pi_out;
    uint8_t *kind_out;
    double *cum_out;
    float *bias_out;
};

int plan_on_device(const PlanIO &io) {
    const int64_t n = io.n;
    if (n > INT32_MAX - 1) return fail(CERTCHAT_ERR_INVALID, "the CUDA path takes fewer than 2^31 tokens");
    const bool units = io.unit_ids != nullptr;
    const int64_t U = units ? io.n_units : n;
    const bool draws = io.keep_out != nullptr;
    const cudaStream_t st = cudaStreamPerThread;

    // CUB scratch sizes for grouping tokens by unit.
    size_t sort_bytes = 0, scan_bytes = 0;
    if (units) {
        CERTCHAT_CUDA_TRY(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<const uint32_t *>(nullptr),
                                                          static_cast<uint32_t *>(nullptr),
                                                          static_cast<const int32_t *>(nullptr),
                                                          static_cast<int32_t *>(nullptr), static_cast<int>(n), 0,
                                                          32, st));
        CERTCHAT_CUDA_TRY(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, static_cast<const int32_t *>(nullptr),
                                                        static_cast<int32_t *>(nullptr), static_cast<int>(U), st));
    }
    Arena arena(st);
    auto carve = [&](auto &&take) {
        struct P {
            double *scores, *prev, *weight, *size, *pi_u, *pi_out, *cum_out;
            uint8_t *prot, *uprot, *kind_u, *keep_u, *kind_out, *keep_out;
            int32_t *ids, *counts, *offsets, *keys_order, *sorted_tokens;
            uint32_t *keys, *keys_sorted;
            int64_t *positions, *upos;
            float *bias_out;
            int *flags;  // [0] bad input, [1] design status
            void *cub_tmp;
        } p{};
        p.scores = take(static_cast<double *>(nullptr), n);
        p.prev = io.prev_cum != nullptr ? take(static_cast<double *>(nullptr), n) : nullptr;
        p.prot = io.prot != nullptr ? take(static_cast<uint8_t *>(nullptr), n) : nullptr;
        p.positions = io.positions != nullptr ? take(static_cast<int64_t *>(nullptr), n) : nullptr;
        p.weight = take(static_cast<double *>(nullptr), U);
        p.size = take(static_cast<double *>(nullptr), U);
        p.uprot = take(static_cast<uint8_t *>(nullptr), U);
        p.upos = take(static_cast<int64_t *>(nullptr), U);
        p.pi_u = take(static_cast<double *>(nullptr), U);
        p.kind_u = take(static_cast<uint8_t *>(nullptr), U);
        p.keep_u = draws ? take(static_cast<uint8_t *>(nullptr), U) : nullptr;
        p.pi_out = take(static_cast<double *>(nullptr), n);
        p.kind_out = io.kind_out != nullptr ? take(static_cast<uint8_t *>(nullptr), n) : nullptr;
        p.keep_out = draws ? take(static_cast<uint8_t *>(nullptr), n) : nullptr;
        p.cum_out = draws ? take(static_cast<double *>(nullptr), n) : nullptr;
        p.bias_out = draws ? take(static_cast<float *>(nullptr), n) : nullptr;
        p.flags = take(static_cast<int *>(nullptr), 2);
        if (units) {
            p.ids = take(static_cast<int32_t *>(nullptr), n);
            p.keys = take(static_cast<uint32_t *>(nullptr), n);
            p.keys_sorted = take(static_cast<uint32_t *>(nullptr), n);
            p.keys_order = take(static_cast<int32_t *>(nullptr), n);
            p.sorted_tokens = take(static_cast<int32_t *>(nullptr), n);
            p.counts = take(static_cast<int32_t *>(nullptr), U + 1);
            p.offsets = take(static_cast<int32_t *>(nullptr), U + 1);
            p.cub_tmp = take(static_cast<char *>(nullptr), sort_bytes > scan_bytes ? sort_bytes : scan_bytes);
        }
        return p;
    };
    auto take = [&](auto *tag, int64_t count) {
        using T = std::remove_pointer_t<decltype(tag)>;
        return arena.piece<T>(static_cast<size_t>(count > 0 ? count : 1));
    };
    carve(take);  // sizes
    CERTCHAT_CUDA_TRY(arena.allocate());
    const auto d = carve(take);  // pointers

    Events ev;
    ev.mark(0, st);
    CERTCHAT_CUDA_TRY(to_device(d.scores, io.scores, n, st));
    CERTCHAT_CUDA_TRY(to_device(d.prev, io.prev_cum, n, st));
    CERTCHAT_CUDA_TRY(to_device(d.prot, io.prot, n, st));
    CERTCHAT_CUDA_TRY(to_device(d.positions, io.positions, n, st));
    if (units) CERTCHAT_CUDA_TRY(to_device(d.ids, io.unit_ids, n, st));
    ev.mark(1, st);

    const int grid_n = grid_for(n), grid_u = grid_for(U);
    CERTCHAT_CUDA_TRY(cudaMemsetAsync(d.flags, 0, 2 * sizeof(int), st));
    check_tokens_kernel<<<grid_n, kThreads, 0, st>>>(n, d.scores, units ? d.ids : nullptr, io.n_units, d.positions,
                                                     d.prev, d.flags);
    if (units) {
        CERTCHAT_CUDA_TRY(cudaMemsetAsync(d.counts, 0, static_cast<size_t>(U + 1) * sizeof(int32_t), st));
        count_units_kernel<<<grid_n, kThreads, 0, st>>>(n, d.ids, io.n_units, d.keys, d.keys_order, d.counts);
        size_t bytes = sort_bytes;
        CERTCHAT_CUDA_TRY(cub::DeviceRadixSort::SortPairs(d.cub_tmp, bytes, d.keys, d.keys_sorted, d.keys_order,
                                                          d.sorted_tokens, static_cast<int>(n), 0, 32, st));
        bytes = scan_bytes;
        CERTCHAT_CUDA_TRY(cub::DeviceScan::ExclusiveSum(d.cub_tmp, bytes, d.counts, d.offsets, static_cast<int>(U), st));
        sum_units_kernel<<<grid_u, kThreads, 0, st>>>(U, d.offsets, d.counts, d.sorted_tokens, d.scores, d.prot,
                                                      d.positions, io.design->floor, d.weight, d.size, d.uprot,
                                                      d.upos);
    } else {
        token_units_kernel<<<grid_n, kThreads, 0, st>>>(n, d.scores, d.prot, d.positions, io.design->floor, d.weight,
                                                        d.size, d.uprot, d.upos);
    }
    DesignArgs args{U, d.weight, d.size, d.uprot, d.upos, *io.design, d.pi_u, d.kind_u, d.flags + 1};
    design_kernel<<<1, kDesignThreads, 0, st>>>(args);
    if (draws)
        unit_keep_kernel<<<grid_u, kThreads, 0, st>>>(U, d.pi_u, d.upos, io.design->seed, io.design->round,
                                                      d.keep_u);
    token_outputs_kernel<<<grid_n, kThreads, 0, st>>>(n, units ? d.ids : nullptr, U, d.pi_u, d.kind_u, d.keep_u,
                                                      d.prev, d.pi_out, d.kind_out, d.keep_out, d.cum_out,
                                                      d.bias_out);
    CERTCHAT_CUDA_TRY(cudaGetLastError());
    ev.mark(2, st);

    int flags[2] = {0, 0};
    CERTCHAT_CUDA_TRY(to_host(flags, d.flags, 2, st));
    CERTCHAT_CUDA_TRY(to_host(io.pi_out, d.pi_out, n, st));
    CERTCHAT_CUDA_TRY(to_host(io.kind_out, d.kind_out, n, st));
    CERTCHAT_CUDA_TRY(to_host(io.keep_out, d.keep_out, n, st));
    CERTCHAT_CUDA_TRY(to_host(io.cum_out, d.cum_out, n, st));
    CERTCHAT_CUDA_TRY(to_host(io.bias_out, d.bias_out, n, st));
    ev.mark(3, st);
    const int rc = ev.finish();
    if (rc != CERTCHAT_OK) return rc;
    if (flags[0] != 0)
        return explain_tokens(n, io.scores, io.unit_ids, io.n_units, io.positions, io.prev_cum);
    if (flags[1] == CERTCHAT_ERR_INTERNAL) return fail(CERTCHAT_ERR_INTERNAL, "water-filling did not converge on the device");
    if (flags[1] == CERTCHAT_WARN_BUDGET_INFEASIBLE)
        return fail(CERTCHAT_WARN_BUDGET_INFEASIBLE, "budget infeasible: %g cannot hold the protected tokens plus pi_min on the rest",
                    io.design->budget);
    return flags[1];
}

template <class Fn>
int guarded(Fn &&fn) {
    clear_error();
    const int rc = ensure_device();
    if (rc != CERTCHAT_OK) return rc;
    return fn();
}

}  // namespace
}  // namespace certchat

using namespace certchat;

extern "C" {

int certchat_cuda_device_count(void) {
    std::call_once(g_device_once, probe_device);
    return g_device_count;
}

int certchat_cuda_last_timing(double *h2d_ms, double *kernel_ms, double *d2h_ms) {
    clear_error();
    if (h2d_ms == nullptr || kernel_ms == nullptr || d2h_ms == nullptr)
        return fail(CERTCHAT_ERR_INVALID, "timing outputs are required");
    *h2d_ms = g_timing.h2d_ms;
    *kernel_ms = g_timing.kernel_ms;
    *d2h_ms = g_timing.d2h_ms;
    return CERTCHAT_OK;
}

int certchat_uniforms(int64_t n, const int64_t *positions, uint64_t seed, uint64_t round, double *u_out) {
    return guarded([&]() -> int {
        if (n < 0) return fail(CERTCHAT_ERR_INVALID, "n must be >= 0");
        if (n > 0 && (positions == nullptr || u_out == nullptr))
            return fail(CERTCHAT_ERR_INVALID, "positions and u_out are required");
        if (n == 0) return CERTCHAT_OK;
        const cudaStream_t st = cudaStreamPerThread;
        Arena arena(st);
        arena.piece<int64_t>(n);
        arena.piece<double>(n);
        CERTCHAT_CUDA_TRY(arena.allocate());
        int64_t *d_pos = arena.piece<int64_t>(n);
        double *d_u = arena.piece<double>(n);
        Events ev;
        ev.mark(0, st);
        CERTCHAT_CUDA_TRY(to_device(d_pos, positions, n, st));
        ev.mark(1, st);
        uniforms_kernel<<<grid_for(n), kThreads, 0, st>>>(n, d_pos, seed, round, d_u);
        CERTCHAT_CUDA_TRY(cudaGetLastError());
        ev.mark(2, st);
        CERTCHAT_CUDA_TRY(to_host(u_out, d_u, n, st));
        ev.mark(3, st);
        return ev.finish();
    });
}

int certchat_draw(int64_t n, const double *pi, const int64_t *positions, uint64_t seed, uint64_t round,
                  uint8_t *keep_out) {
    return guarded([&]() -> int {
        if (n < 0) return fail(CERTCHAT_ERR_INVALID, "n must be >= 0");
        if (n > 0 && (pi == nullptr || positions == nullptr || keep_out == nullptr))
            return fail(CERTCHAT_ERR_INVALID, "pi, positions and keep_out are required");
        if (n == 0) return CERTCHAT_OK;
        const cudaStream_t st = cudaStreamPerThread;
        Arena arena(st);
        arena.piece<double>(n);
        arena.piece<int64_t>(n);
        arena.piece<uint8_t>(n);
        arena.piece<int>(1);
        CERTCHAT_CUDA_TRY(arena.allocate());
        double *d_pi = arena.piece<double>(n);
        int64_t *d_pos = arena.piece<int64_t>(n);
        uint8_t *d_keep = arena.piece<uint8_t>(n);
        int *d_bad = arena.piece<int>(1);
        Events ev;
        ev.mark(0, st);
        CERTCHAT_CUDA_TRY(to_device(d_pi, pi, n, st));
        CERTCHAT_CUDA_TRY(to_device(d_pos, positions, n, st));
        ev.mark(1, st);
        CERTCHAT_CUDA_TRY(cudaMemsetAsync(d_bad, 0, sizeof(int), st));
        draw_kernel<<<grid_for(n), kThreads, 0, st>>>(n, d_pi, d_pos, seed, round, d_keep, d_bad);
        CERTCHAT_CUDA_TRY(cudaGetLastError());
        ev.mark(2, st);
        int bad = 0;
        CERTCHAT_CUDA_TRY(to_host(&bad, d_bad, 1, st));
        CERTCHAT_CUDA_TRY(to_host(keep_out, d_keep, n, st));
        ev.mark(3, st);
        const int rc = ev.finish();
        if (rc != CERTCHAT_OK) return rc;
        return bad ? explain_pi_range(n, pi) : CERTCHAT_OK;
    });
}

int certchat_update_log_pi(int64_t n, const double *pi, const uint8_t *keep, const double *prev_cum,
                           double *cum_out, float *bias_out) {
    return guarded([&]() -> int {
        if (n < 0) return fail(CERTCHAT_ERR_INVALID, "n must be >= 0");
        if (n > 0 && (pi == nullptr || keep == nullptr || cum_out == nullptr || bias_out == nullptr))
            return fail(CERTCHAT_ERR_INVALID, "pi, keep, cum_out and bias_out are required");
        if (n == 0) return CERTCHAT_OK;
        const cudaStream_t st = cudaStreamPerThread;
        Arena arena(st);
        arena.piece<double>(n);
        arena.piece<uint8_t>(n);
        arena.piece<double>(prev_cum != nullptr ? n : 1);
        arena.piece<double>(n);
        arena.piece<float>(n);
        arena.piece<int>(1);
        CERTCHAT_CUDA_TRY(arena.allocate());
        double *d_pi = arena.piece<double>(n);
        uint8_t *d_keep = arena.piece<uint8_t>(n);
        double *d_prev = arena.piece<double>(prev_cum != nullptr ? n : 1);
        double *d_cum = arena.piece<double>(n);
        float *d_bias = arena.piece<float>(n);
        int *d_bad = arena.piece<int>(1);
        Events ev;
        ev.mark(0, st);
        CERTCHAT_CUDA_TRY(to_device(d_pi, pi, n, st));
        CERTCHAT_CUDA_TRY(to_device(d_keep, keep, n, st));
        CERTCHAT_CUDA_TRY(to_device(d_prev, prev_cum, n, st));
        ev.mark(1, st);
        CERTCHAT_CUDA_TRY(cudaMemsetAsync(d_bad, 0, sizeof(int), st));
        update_kernel<<<grid_for(n), kThreads, 0, st>>>(n, d_pi, d_keep, prev_cum != nullptr ? d_prev : nullptr, d_cum,
                                                        d_bias, d_bad);
        CERTCHAT_CUDA_TRY(cudaGetLastError());
        ev.mark(2, st);
        int bad = 0;
        CERTCHAT_CUDA_TRY(to_host(&bad, d_bad, 1, st));
        CERTCHAT_CUDA_TRY(to_host(cum_out, d_cum, n, st));
        CERTCHAT_CUDA_TRY(to_host(bias_out, d_bias, n, st));
        ev.mark(3, st);
        const int rc = ev.finish();
        if (rc != CERTCHAT_OK) return rc;
        return bad ? explain_update(n, pi, keep, prev_cum) : CERTCHAT_OK;
    });
}

int certchat_inclusion_probabilities(int64_t n, const double *scores, const uint8_t *protected_,
                                     const int32_t *unit_ids, int64_t n_units, const certchat_design *design,
                                     double *pi_out, uint8_t *kind_out) {
    return guarded([&]() -> int {
        int rc = check_design(design);
        if (rc == CERTCHAT_OK) rc = check_token_args(n, scores, unit_ids, n_units);
        if (rc != CERTCHAT_OK) return rc;
        if (n > 0 && pi_out == nullptr) return fail(CERTCHAT_ERR_INVALID, "pi_out is NULL");
        if (n == 0) return CERTCHAT_OK;
        return plan_on_device(PlanIO{n, scores, protected_, unit_ids, n_units, nullptr, nullptr, design, nullptr,
                                     pi_out, kind_out, nullptr, nullptr});
    });
}

int certchat_plan_eviction(int64_t n, const double *scores, const uint8_t *protected_, const int32_t *unit_ids,
                           int64_t n_units, const int64_t *positions, const double *prev_cum,
                           const certchat_design *design, uint8_t *keep_out, double *pi_out, uint8_t *kind_out,
                           double *cum_out, float *bias_out) {
    return guarded([&]() -> int {
        int rc = check_design(design);
        if (rc == CERTCHAT_OK) rc = check_token_args(n, scores, unit_ids, n_units);
        if (rc != CERTCHAT_OK) return rc;
        if (n > 0 && (positions == nullptr || keep_out == nullptr || pi_out == nullptr || cum_out == nullptr ||
                      bias_out == nullptr))
            return fail(CERTCHAT_ERR_INVALID, "positions, keep_out, pi_out, cum_out and bias_out are required");
        if (n == 0) return CERTCHAT_OK;
        return plan_on_device(PlanIO{n, scores, protected_, unit_ids, n_units, positions, prev_cum, design, keep_out,
                                     pi_out, kind_out, cum_out, bias_out});
    });
}

}  // extern "C"
