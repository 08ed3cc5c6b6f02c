// Test kernels for dsa_aot/cubin.py: each exercises one piece of cubin metadata.
struct P4200 { int v[1050]; };

__device__ __noinline__ float callee(const float* a, int n, int i) {
    volatile float loc[32];
    for (int k = 0; k < 32; ++k) loc[k] = a[k + i];
    return loc[i & 31] + loc[n & 31];
}

// static __shared__ + __launch_bounds__(maxThreads, minBlocks, maxClusterRank)
extern "C" __global__ void __launch_bounds__(256, 2, 4) k_bounds(float* out, const float* in, int n) {
    __shared__ float tile[512];
    tile[threadIdx.x] = in[blockIdx.x * 256 + threadIdx.x];
    tile[threadIdx.x + 256] = in[threadIdx.x];
    __syncthreads();
    out[blockIdx.x * 256 + threadIdx.x] = tile[511 - threadIdx.x] * n;
}

// stack frame from a local array + a non-inlined call
extern "C" __global__ void k_stack(float* out, const float* in, int n, int idx) {
    volatile float mine[16];
    for (int k = 0; k < 16; ++k) mine[k] = in[k + threadIdx.x];
    out[threadIdx.x] = callee(in, n, threadIdx.x) + mine[idx & 15];
}

// register spills under __maxnreg__
extern "C" __global__ void __maxnreg__(24) k_spill(double* out, const double* in, int n) {
    double acc[12];
#pragma unroll
    for (int k = 0; k < 12; ++k) acc[k] = in[k * n + threadIdx.x];
    for (int it = 0; it < n; ++it) {
#pragma unroll
        for (int k = 0; k < 12; ++k) acc[k] = acc[k] * acc[(k + 1) % 12] + acc[(k + 5) % 12];
    }
    double s = 0;
#pragma unroll
    for (int k = 0; k < 12; ++k) s += acc[k] * (k + 1);
    out[threadIdx.x] = s;
}

// compile-time cluster dims, mixed-size params
extern "C" __global__ void __cluster_dims__(2, 1, 1) k_cluster(float* out, char c, short s, long long l, double d) {
    out[threadIdx.x] = c + s + l + d;
}

// a > 4 KiB by-value parameter
extern "C" __global__ void k_bigparam(int* out, P4200 p) { out[threadIdx.x] = p.v[threadIdx.x]; }
