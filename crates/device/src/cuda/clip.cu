// Global-norm clipping's factor, on the device: norm = √S[sumsq], S[norm_at] = norm,
// S[scale_at] = norm > clip > 0 ? clip / (norm + 1e-6) : 1 (the CPU step's rule).
// args: sumsq_at norm_at scale_at clip
extern "C" __global__ void __launch_bounds__(1) clip(const KilnParams KP) {
    const auto norm = sqrtf(ld_S(arg(0u)));
    const auto clip = argf(3u);
    auto scale = 1.0f;
    if (clip > 0.0f && norm > clip) {
        scale = clip / (norm + 1e-6f);
    }
    st_S(arg(1u), norm);
    st_S(arg(2u), scale);
}
