//! Accelerator and interconnect catalogues, node shapes, and the `cpu-local` calibration file.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::PlanError;

pub use crate::policy::Precision;
use crate::policy::Names;

/// One interconnect level: per-GPU, per-direction bandwidth and a per-message latency (the α–β model).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Link {
    pub name: String,
    /// β⁻¹: peak bytes/s per GPU per direction.
    pub bw: f64,
    /// Fraction of `bw` a large NCCL-style collective achieves (bus bandwidth / link bandwidth).
    pub efficiency: f64,
    /// α: seconds per message hop (NCCL ring step).
    pub latency: f64,
    #[serde(default)]
    pub note: Option<String>,
}

impl Link {
    /// Achievable bytes/s per GPU per direction.
    pub fn eff_bw(&self) -> f64 {
        self.bw * self.efficiency
    }
}

/// How GPUs are packaged: the fast domain (node) and its way out.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NodeShape {
    pub gpus_per_node: u64,
    /// Link name inside a node (NVLink, xGMI, ICI, PCIe).
    pub intra: String,
    /// Link name between nodes (one NIC).
    pub inter: String,
    /// NICs per node; each GPU's share of the node's injection bandwidth is `nics · bw / gpus_per_node`.
    pub nics_per_node: u64,
}

/// Raw accelerator entry.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Accelerator {
    pub name: String,
    /// Peak dense FLOP/s per precision key ("bf16", "fp8", "fp32"). Missing precision = unsupported.
    pub peak_flops: BTreeMap<String, f64>,
    /// HBM (or DRAM) capacity in bytes.
    pub mem_bytes: f64,
    /// Peak memory bandwidth in bytes/s.
    pub mem_bw: f64,
    /// Fraction of `mem_bw` a streaming kernel reaches (STREAM-like copy).
    pub mem_bw_efficiency: f64,
    /// Fraction of peak a large, well-shaped GEMM reaches (the plateau of the efficiency curve).
    pub gemm_efficiency: f64,
    /// Parallel matmul units that each take one output tile at a time (SMs, CUs, MXUs, cores).
    pub compute_units: u64,
    /// Output tile of one unit, rows × cols (wave quantisation).
    pub tile_m: u64,
    pub tile_n: u64,
    /// K-depth at which a GEMM reaches half its plateau (main-loop prologue/epilogue cost).
    pub k_half: f64,
    /// Fixed cost of one kernel launch, seconds.
    pub kernel_overhead: f64,
    /// Memory the framework cannot use (CUDA context, NCCL buffers, allocator fragmentation), bytes.
    pub reserved_bytes: f64,
    /// Flash attention available (fused attention, no s² activations).
    pub flash_attention: bool,
    pub node: NodeShape,
    /// Measured matmul rate curve (CPUs calibrated by `kiln plan calibrate`). When present it replaces the
    /// GPU model of `gemm_efficiency` × wave quantisation × `K/(K+k_half)` in `cost::gemm_time`.
    #[serde(default)]
    pub gemm_curve: Option<GemmCurve>,
    /// Measured rate curve of the attention core's per-head products (CPU: one single-threaded product per
    /// (batch, head) task, tasks spread over the threads, as `tensor::attention` runs them). `None`: `gemm_time`.
    #[serde(default)]
    pub attention_curve: Option<GemmCurve>,
    /// Achieved bytes/s of the framework's own memory-bound kernels (norms, GELU, residual adds, softmax, cross
    /// entropy), as the cost model counts their bytes. On a GPU these kernels stream at `stream_bw`; on a CPU they
    /// are partly compute-bound (tanh, exp, row reductions), so `kiln plan calibrate` measures them. `None`:
    /// `stream_bw`.
    #[serde(default)]
    pub elementwise_bw: Option<f64>,
    /// Size dependence of GEMM efficiency in the output dimensions: a factor `x/(x + mn_half)` for each of M and N
    /// (0: none). Small products keep fewer tiles in flight per SM than the pipelined main loop needs to hide
    /// memory latency, and the faster an SM, the more work it needs in flight: H100's warp-group MMA runs 2.5× an
    /// A100 SM's rate (989/132 vs 312/108 TFLOP/s), so its products reach their plateau only at larger sizes.
    /// FITTED on the fit half of the published-runs catalogue, not measured.
    #[serde(default)]
    pub mn_half: f64,
    #[serde(default)]
    pub note: Option<String>,
}

impl Accelerator {
    pub fn peak(&self, p: Precision) -> Result<f64, PlanError> {
        // fp16 runs on the same tensor cores as bf16 on every catalogued part.
        let alt = if p == Precision::Fp16 {
            self.peak_flops.get("bf16")
        } else {
            None
        };
        self.peak_flops.get(p.name()).or(alt).copied().ok_or_else(|| {
            PlanError(format!(
                "--precision: accelerator '{}' has no {} peak in the catalogue",
                self.name,
                p.name()
            ))
        })
    }
    pub fn stream_bw(&self) -> f64 {
        self.mem_bw * self.mem_bw_efficiency
    }
    /// Bytes/s of the per-layer memory-bound kernels (see `elementwise_bw`).
    pub fn elem_bw(&self) -> f64 {
        self.elementwise_bw.unwrap_or_else(|| self.stream_bw())
    }
}

/// One measured matmul `C[m×n] = A[m×k]·B[k×n]` (all threads), as `kiln plan calibrate` records it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct MeasuredGemm {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    /// Achieved GFLOP/s (2mnk / seconds / 1e9), the best of a few repetitions.
    pub gflops: f64,
    /// Operand layout as in kiln's Linear: "nt" (forward, `inp·Wᵀ`), "nn" (data gradient, `dout·W`),
    /// "tn" (weight gradient, `doutᵀ·inp`).
    #[serde(default)]
    pub layout: Option<String>,
}

/// Matmul rate vs shape on a CPU (an assumption of this planner, fitted to measurements): one multiplicative
/// saturation per dimension, the same form as the GPU model's `K/(K+k_half)` applied to all three,
/// `rate(m,n,k) = peak · plateau · m/(m+m_half) · n/(n+n_half) · k/(k+k_half)`.
/// Small M or N starve the register-blocked micro-kernel and the threads (fewer output panels than cores); small
/// K cannot amortise packing and the C-tile load/store. `plateau` may exceed 1 when `peak` came from a noisy
/// square product.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GemmCurve {
    pub plateau: f64,
    pub m_half: f64,
    pub n_half: f64,
    pub k_half: f64,
}

impl GemmCurve {
    /// Fraction of `peak` reached by an m×n×k product.
    pub fn efficiency(&self, m: f64, n: f64, k: f64) -> f64 {
        self.plateau * m / (m + self.m_half) * n / (n + self.n_half) * k / (k + self.k_half)
    }

    /// Least squares in log space over a grid of half-points (0 and 2^(i/4), i = 0..=44, i.e. 1..2048);
    /// for each (m_half, n_half, k_half) the best plateau is the geometric mean of the residual ratios.
    /// Deterministic: the same products always give the same curve. Needs at least one product.
    pub fn fit(products: &[MeasuredGemm], peak_flops: f64) -> Result<GemmCurve, PlanError> {
        let pts: Vec<(f64, f64, f64, f64)> = products
            .iter()
            .filter(|p| p.gflops > 0.0 && p.m > 0 && p.n > 0 && p.k > 0)
            .map(|p| (p.m as f64, p.n as f64, p.k as f64, (p.gflops * 1e9 / peak_flops).ln()))
            .collect();
        if pts.is_empty() || peak_flops <= 0.0 {
            return Err(PlanError("gemm curve: no measured products with a positive rate".into()));
        }
        let mut grid = vec![0.0];
        grid.extend((0..=44).map(|i| 2f64.powf(i as f64 / 4.0)));
        let ln_sat = |x: f64, h: f64| (x / (x + h)).ln();
        // Per-dimension log-saturation tables: [point][grid index].
        let table = |dim: usize| -> Vec<Vec<f64>> {
            pts.iter()
                .map(|p| {
                    let x = [p.0, p.1, p.2][dim];
                    grid.iter().map(|&h| ln_sat(x, h)).collect()
                })
                .collect()
        };
        let (tm, tn, tk) = (table(0), table(1), table(2));
        let n = pts.len() as f64;
        let mut best = (f64::INFINITY, GemmCurve { plateau: 1.0, m_half: 0.0, n_half: 0.0, k_half: 0.0 });
        for (im, &mh) in grid.iter().enumerate() {
            for (inn, &nh) in grid.iter().enumerate() {
                for (ik, &kh) in grid.iter().enumerate() {
                    let r: Vec<f64> = (0..pts.len()).map(|j| pts[j].3 - tm[j][im] - tn[j][inn] - tk[j][ik]).collect();
                    let mean = r.iter().sum::<f64>() / n;
                    let sse: f64 = r.iter().map(|x| (x - mean).powi(2)).sum();
                    if sse < best.0 - 1e-12 {
                        best = (sse, GemmCurve { plateau: mean.exp(), m_half: mh, n_half: nh, k_half: kh });
                    }
                }
            }
        }
        Ok(best.1)
    }
}

/// The `cpu-local` file `kiln plan calibrate` writes for this machine (the first four fields are the minimal form;
/// the rest are optional and come from measurements).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CpuLocal {
    pub name: String,
    /// Best measured fp32 matmul FLOP/s (all threads), the curve's reference.
    pub peak_flops_fp32: f64,
    pub mem_bytes: f64,
    /// Measured STREAM-triad bytes/s on arrays well beyond the last-level cache (counts 2 reads + 1 write).
    pub mem_bw: f64,
    #[serde(default)]
    pub threads: Option<u64>,
    /// Measured products; `gemm_curve` is fitted to them when not given.
    #[serde(default)]
    pub products: Vec<MeasuredGemm>,
    #[serde(default)]
    pub gemm_curve: Option<GemmCurve>,
    /// Measured attention-core products `[T,T,HS]` and `[T,HS,T]`, batched over B·NH single-threaded tasks;
    /// `attention_curve` is fitted to them when not given.
    #[serde(default)]
    pub attention_products: Vec<MeasuredGemm>,
    #[serde(default)]
    pub attention_curve: Option<GemmCurve>,
    /// Measured bytes/s of kiln's memory-bound kernels (LayerNorm, GELU, residual; bytes as the cost model counts
    /// them) and the fixed cost of one such kernel call (thread-pool dispatch), seconds.
    #[serde(default)]
    pub elementwise_bw: Option<f64>,
    #[serde(default)]
    pub kernel_overhead: Option<f64>,
}

impl CpuLocal {
    /// A measured CPU: the measured matmul peak is the plateau (efficiency 1), measured bandwidth is the stream
    /// bandwidth (efficiency 1). Each planner "GPU" is one rank; with N ranks on one host, give the per-rank figures
    /// (machine peak / N). Ranks talk through shared memory at about half the stream bandwidth (a copy reads and
    /// writes).
    pub fn to_accelerator(&self) -> Accelerator {
        let curve = self
            .gemm_curve
            .or_else(|| GemmCurve::fit(&self.products, self.peak_flops_fp32).ok());
        let attention_curve = self
            .attention_curve
            .or_else(|| GemmCurve::fit(&self.attention_products, self.peak_flops_fp32).ok());
        let mut peak = BTreeMap::new();
        peak.insert("fp32".to_string(), self.peak_flops_fp32);
        Accelerator {
            name: self.name.clone(),
            peak_flops: peak,
            mem_bytes: self.mem_bytes,
            mem_bw: self.mem_bw,
            mem_bw_efficiency: 1.0,
            gemm_efficiency: 1.0,
            compute_units: 1,
            tile_m: 1,
            tile_n: 1,
            k_half: 16.0,
            kernel_overhead: self.kernel_overhead.unwrap_or(2e-6),
            reserved_bytes: 0.0,
            flash_attention: true, // tensor::flash (pass --attention to match the kernel the run uses)
            // All ranks on one host, talking through shared memory.
            node: NodeShape {
                gpus_per_node: 1024,
                intra: "shm".into(),
                inter: "shm".into(),
                nics_per_node: 1,
            },
            gemm_curve: curve,
            attention_curve,
            elementwise_bw: self.elementwise_bw,
            mn_half: 0.0,
            note: Some("measured on this machine (kiln plan calibrate)".into()),
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HardwareCatalog {
    #[serde(default)]
    pub accelerators: Vec<Accelerator>,
    #[serde(default)]
    pub links: Vec<Link>,
}

const BUILTIN_HARDWARE: &str = include_str!("../catalog/hardware.json");

impl HardwareCatalog {
    pub fn builtin() -> HardwareCatalog {
        serde_json::from_str(BUILTIN_HARDWARE).expect("built-in hardware catalogue is valid")
    }

    /// Parse a user file: a hardware catalogue (`{"accelerators":[..],"links":[..]}`) or a `cpu-local` bench file.
    pub fn parse_extra(text: &str, origin: &str) -> Result<HardwareCatalog, PlanError> {
        if let Ok(c) = serde_json::from_str::<CpuLocal>(text) {
            return Ok(HardwareCatalog {
                accelerators: vec![c.to_accelerator()],
                links: vec![],
            });
        }
        serde_json::from_str::<HardwareCatalog>(text).map_err(|e| {
            PlanError(format!(
                "{origin}: neither a hardware catalogue nor a cpu-local bench file \
                 ({{\"name\",\"peak_flops_fp32\",\"mem_bytes\",\"mem_bw\"}}): {e}"
            ))
        })
    }

    /// Add entries; later entries with the same name replace earlier ones.
    pub fn extend(&mut self, other: HardwareCatalog) {
        for a in other.accelerators {
            self.accelerators.retain(|x| x.name != a.name);
            self.accelerators.push(a);
        }
        for l in other.links {
            self.links.retain(|x| x.name != l.name);
            self.links.push(l);
        }
    }

    pub fn accelerator(&self, name: &str) -> Result<Accelerator, PlanError> {
        let key = name.to_ascii_lowercase();
        self.accelerators
            .iter()
            .find(|a| a.name.to_ascii_lowercase() == key)
            .cloned()
            .ok_or_else(|| {
                let names: Vec<&str> = self.accelerators.iter().map(|a| a.name.as_str()).collect();
                PlanError(format!(
                    "--gpu: unknown accelerator '{name}' (known: {})",
                    names.join(", ")
                ))
            })
    }

    pub fn link(&self, name: &str) -> Result<Link, PlanError> {
        if name == "shm" {
            // Shared memory between processes on one host; bandwidth filled in by `Cluster::new` from the CPU.
            return Ok(Link {
                name: "shm".into(),
                bw: 0.0,
                efficiency: 1.0,
                latency: 5e-6,
                note: None,
            });
        }
        self.links.iter().find(|l| l.name == name).cloned().ok_or_else(|| {
            let names: Vec<&str> = self.links.iter().map(|l| l.name.as_str()).collect();
            PlanError(format!("unknown link '{name}' (known: {})", names.join(", ")))
        })
    }
}

/// A resolved cluster: N accelerators of one kind in nodes of G.
#[derive(Clone, Debug, Serialize)]
pub struct Cluster {
    pub acc: Accelerator,
    pub gpus: u64,
    pub gpus_per_node: u64,
    pub intra: Link,
    pub inter: Link,
    /// Achievable inter-node bytes/s per GPU per direction (its share of the node's NICs).
    pub inter_bw_per_gpu: f64,
}

impl Cluster {
    pub fn new(cat: &HardwareCatalog, gpu: &str, gpus: u64, gpus_per_node: Option<u64>) -> Result<Cluster, PlanError> {
        let acc = cat.accelerator(gpu)?;
        if gpus == 0 {
            return Err(PlanError("--gpus: must be at least 1".into()));
        }
        let g = gpus_per_node.unwrap_or(acc.node.gpus_per_node.min(gpus).max(1));
        if g == 0 || (gpus > g && !gpus.is_multiple_of(g)) {
            return Err(PlanError(format!("--gpus-per-node: {g} does not divide --gpus {gpus}")));
        }
        let mut intra = cat.link(&acc.node.intra)?;
        let mut inter = cat.link(&acc.node.inter)?;
        for l in [&mut intra, &mut inter] {
            if l.name == "shm" {
                l.bw = acc.mem_bw / 2.0;
            }
        }
        let nics = acc.node.nics_per_node as f64;
        let inter_bw_per_gpu = inter.eff_bw() * nics / acc.node.gpus_per_node as f64;
        Ok(Cluster {
            acc,
            gpus,
            gpus_per_node: g.min(gpus),
            intra,
            inter,
            inter_bw_per_gpu,
        })
    }

    pub fn nodes(&self) -> u64 {
        self.gpus.div_ceil(self.gpus_per_node)
    }
}
