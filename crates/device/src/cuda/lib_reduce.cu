// A workgroup-wide sum over 256 threads, in a fixed tree (the same order every time).
__shared__ float part[256];

__device__ float wg_sum(const KilnParams& KP, float v, uint lid) {
    part[lid] = v;
    __syncthreads();
    for (auto s = 128u; s > 0u; s >>= 1u) {
        if (lid < s) {
            part[lid] += part[lid + s];
        }
        __syncthreads();
    }
    const auto total = part[0];
    __syncthreads();
    return total;
}


// The largest of every thread's `v` over the workgroup.
__device__ float wg_max(const KilnParams& KP, float v, uint lid) {
    part[lid] = v;
    __syncthreads();
    for (auto s = 128u; s > 0u; s >>= 1u) {
        if (lid < s) {
            part[lid] = max(part[lid], part[lid + s]);
        }
        __syncthreads();
    }
    const auto m = part[0];
    __syncthreads();
    return m;
}
