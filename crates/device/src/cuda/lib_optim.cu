// An optimizer kernel's gradient of element e, scaled by the clipping factor: G[arg(goff) + e] ·
// S[arg(scale_at)], with goff and scale_at the indices of the kernel's arguments holding them.
__device__ float clipped_grad(const KilnParams& KP, uint e, uint goff, uint scale_at) {
    return ld_G(arg(goff) + e) * ld_S(arg(scale_at));
}

// The weight-decay factor: S[2] (the step's 1 − lr·wd) where the argument at `flag` is nonzero,
// else 1.
__device__ float decay_factor(const KilnParams& KP, uint flag) {
    if (arg(flag) != 0u) {
        return ld_S(2u);
    }
    return 1.0f;
}
