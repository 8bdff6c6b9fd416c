// Global-norm clipping's factor, on the device: norm = √S[sumsq], S[norm_at] = norm,
// S[scale_at] = norm > clip > 0 ? clip / (norm + 1e-6) : 1 (the CPU step's rule).
// args: sumsq_at norm_at scale_at clip
@compute @workgroup_size(1)
fn main() {
    let norm = sqrt(ld_S(arg(0u)));
    let clip = argf(3u);
    var scale = 1.0;
    if (clip > 0.0 && norm > clip) {
        scale = clip / (norm + 1e-6);
    }
    st_S(arg(1u), norm);
    st_S(arg(2u), scale);
}
