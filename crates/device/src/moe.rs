//! Mixture-of-experts routing on the device (`tensor::moe`'s twins): top-k softmax routing,
//! slot assignment with capacity, dispatch of tokens to experts' packed rows, the weighted
//! combine, and the backward of each. The experts themselves are [`Gpu::gemm`]s and SwiGLU.

use crate::kernels::u;
use crate::shader::{kernel, Kernel};
use crate::{Buf, Gpu};

const ROUTE: Kernel = kernel!("moe_route", ["P", "LSE", "IDX", "G", "L"], writes ["P", "LSE", "G"]);
const ASSIGN: Kernel = kernel!("moe_assign", ["SLOT", "ROWTOK", "OFFSETS", "COUNTS", "IDX"], writes []);
const DISPATCH: Kernel = kernel!("moe_dispatch", ["A", "B", "ROWTOK", "SLOT", "OFFSETS"], writes ["A"]);
const COMBINE: Kernel = kernel!("moe_combine", ["Y", "EO", "G", "SLOT"], writes ["Y"]);
const COMBINE_BACKWARD: Kernel = kernel!("moe_combine_backward", ["DG", "DEO", "DY", "EO", "G", "SLOT", "ROWTOK", "OFFSETS"], writes ["DG", "DEO"]);
const AUX_COEF: Kernel = kernel!("moe_aux_coef", ["AUX", "COUNTS"], writes ["AUX"]);
const ROUTER_BACKWARD: Kernel = kernel!("moe_router_backward", ["DL", "P", "LSE", "IDX", "G", "DG", "AUX"], writes ["DL"]);
/// This module's kernels (the CUDA build compiles each).
pub(crate) const KERNELS: &[&Kernel] = &[&ROUTE, &ASSIGN, &DISPATCH, &COMBINE, &COMBINE_BACKWARD, &AUX_COEF, &ROUTER_BACKWARD];

/// One MoE layer's routing state on the device: `N` tokens, `E` experts, `K` per token.
pub struct Routing {
    pub n: usize,
    pub e: usize,
    pub k: usize,
    /// softmax of the router's logits `[N, E]`, its logsumexp `[N]`
    pub probs: Buf,
    pub lse: Buf,
    /// the top-k experts `[N, K]` (u32) and their gates `[N, K]`
    pub idx: Buf,
    pub gates: Buf,
    /// token-assignment → packed row or `tensor::moe::DROPPED` `[N, K]`; packed row → token
    /// `[N·K]`; the experts' row offsets `[E + 1]` (the last is `R`); pre-drop counts `[E]`
    /// (all u32)
    pub slot: Buf,
    pub row_token: Buf,
    pub offsets: Buf,
    pub counts: Buf,
}

impl Gpu {
    /// Zeroed routing buffers for `n` tokens, `e` experts, `k` per token.
    pub fn routing(&self, n: usize, e: usize, k: usize) -> Routing {
        let idx = |len| self.zeros_of(len, crate::DType::U32);
        Routing {
            n,
            e,
            k,
            probs: self.zeros(n * e),
            lse: self.zeros(n),
            idx: idx(n * k),
            gates: self.zeros(n * k),
            slot: idx(n * k),
            row_token: idx(n * k),
            offsets: idx(e + 1),
            counts: idx(e),
        }
    }

    /// Softmax, logsumexp, top-k and gates from `logits[N, E]` (`tensor::moe::moe_route`),
    /// then the slots with `capacity` (`tensor::moe::moe_assign`).
    pub fn moe_route(&self, r: &Routing, logits: &Buf, renormalize: bool, capacity: usize) {
        assert!(logits.len() >= r.n * r.e && r.k >= 1 && r.k <= r.e, "moe_route: shapes");
        let bufs = [Some(&r.probs), Some(&r.lse), Some(&r.idx), Some(&r.gates), Some(logits)];
        self.launch(&ROUTE, Gpu::grid(r.n, 64), &[u(r.n), u(r.e), u(r.k), renormalize as u32], &bufs);
        let cap = u(capacity.min(u32::MAX as usize));
        let bufs = [Some(&r.slot), Some(&r.row_token), Some(&r.offsets), Some(&r.counts), Some(&r.idx)];
        self.launch(&ASSIGN, [1, 1, 1], &[u(r.n * r.k), u(r.k), u(r.e), cap], &bufs);
    }

    /// `xe[row] = x[row_token[row]]` for the kept rows (`tensor::moe::moe_dispatch`).
    pub fn moe_dispatch(&self, xe: &Buf, x: &Buf, r: &Routing, c: usize) {
        let rows = r.n * r.k;
        assert!(xe.len() >= rows * c && x.len() >= r.n * c, "moe_dispatch: shapes");
        let bufs = [Some(xe), Some(x), Some(&r.row_token), Some(&r.slot), Some(&r.offsets)];
        self.launch(&DISPATCH, Gpu::grid(rows * c, 256), &[u(rows), u(c), u(r.k), u(r.e), 0], &bufs);
    }

    /// `dx[t] += Σ_j dxe[slot[t, j]]` in rank order (`tensor::moe::moe_dispatch_backward`).
    pub fn moe_dispatch_backward(&self, dx: &Buf, dxe: &Buf, r: &Routing, c: usize) {
        assert!(dx.len() >= r.n * c, "moe_dispatch_backward: shapes");
        let bufs = [Some(dx), Some(dxe), Some(&r.row_token), Some(&r.slot), Some(&r.offsets)];
        self.launch(&DISPATCH, Gpu::grid(r.n * c, 256), &[u(r.n), u(c), u(r.k), u(r.e), 1], &bufs);
    }

    /// `y[t] (=|+=) Σ_j gate[t, j]·eo[slot[t, j]]` (`tensor::moe::moe_combine`).
    pub fn moe_combine(&self, y: &Buf, eo: &Buf, r: &Routing, c: usize, accumulate: bool) {
        assert!(y.len() >= r.n * c, "moe_combine: shapes");
        self.launch(&COMBINE, Gpu::grid(r.n * c, 256), &[u(r.n), u(c), u(r.k), accumulate as u32], &[Some(y), Some(eo), Some(&r.gates), Some(&r.slot)]);
    }

    /// Backward of [`Gpu::moe_combine`]: `dgate[t, j] = ⟨dy[t], eo[slot[t, j]]⟩` and `deo[row] =
    /// gate·dy[t]`, both overwritten (`tensor::moe::moe_combine_backward`).
    pub fn moe_combine_backward(&self, (dgate, deo): (&Buf, &Buf), dy: &Buf, eo: &Buf, r: &Routing, c: usize) {
        assert!(dgate.len() >= r.n * r.k && deo.len() >= r.n * r.k * c, "moe_combine_backward: shapes");
        let bufs = [Some(dgate), Some(deo), Some(dy), Some(eo), Some(&r.gates), Some(&r.slot), Some(&r.row_token), Some(&r.offsets)];
        self.launch(&COMBINE_BACKWARD, Gpu::grid(r.n * r.k, 256), &[u(r.n), u(c), u(r.k), u(r.e), 0], &bufs);
        self.launch(&COMBINE_BACKWARD, Gpu::grid(r.n * r.k * c, 256), &[u(r.n), u(c), u(r.k), u(r.e), 1], &bufs);
    }

    /// The load-balancing loss's gradient with respect to each expert's mean probability,
    /// `aux_coef[e] = aux_weight·E·counts[e] / (N·K·N)`, from the routing's counts on the device
    /// (the batch is the routing group).
    pub fn moe_aux_coef(&self, aux_coef: &Buf, r: &Routing, aux_weight: f32) {
        let coef = (aux_weight as f64 * r.e as f64 / ((r.n * r.k) as f64 * r.n as f64)) as f32;
        self.launch(&AUX_COEF, Gpu::grid(r.e, 64), &[u(r.e), coef.to_bits()], &[Some(aux_coef), Some(&r.counts)]);
    }

    /// The router's backward into `dlogits[N, E]` (overwritten) from the gates' gradient, the
    /// load-balancing coefficients `aux_coef[E]` and the z-loss's `z_coef`
    /// (`tensor::moe::moe_router_backward`).
    pub fn moe_router_backward(&self, dlogits: &Buf, r: &Routing, dgate: &Buf, aux_coef: &Buf, z_coef: f32, renormalize: bool) {
        assert!(dlogits.len() >= r.n * r.e && aux_coef.len() >= r.e, "moe_router_backward: shapes");
        let bufs = [Some(dlogits), Some(&r.probs), Some(&r.lse), Some(&r.idx), Some(&r.gates), Some(dgate), Some(aux_coef)];
        self.launch(&ROUTER_BACKWARD, Gpu::grid(r.n, 64), &[u(r.n), u(r.e), u(r.k), renormalize as u32, z_coef.to_bits()], &bufs);
    }
}
