// Fatbin test input for tests/unit/test_cubin.py.
extern "C" __global__ void k_axpy(float* y, const float* x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
