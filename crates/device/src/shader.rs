//! How a kernel's WGSL is put together: a body from `wgsl/`, and a header generated for the
//! types of the buffers it is launched with.
//!
//! Every kernel binds its shape arguments at binding 0 (a uniform block of [`MAX_ARGS`] words,
//! read with `arg(i)` / `argf(i)`), then its buffers in the order of [`Kernel::bindings`], each
//! an `array<u32>`. For a buffer `X` of a floating type the header defines `ld_X(i) -> f32`
//! (element `i`, widened from bf16 or f16), and for an fp32 buffer also `st_X(i, v)`. So one body
//! serves every storage type, and each combination is compiled once, on first use.

use crate::DType;

/// Words in a kernel's uniform argument block.
pub(crate) const MAX_ARGS: usize = 32;

/// One kernel: its WGSL body and the names of its buffers, in binding order.
pub(crate) struct Kernel {
    pub name: &'static str,
    pub body: &'static str,
    /// WGSL function libraries (`wgsl/lib_*.wgsl`) put before the body.
    pub libs: &'static [&'static str],
    pub bindings: &'static [&'static str],
    /// Buffers it writes through `st_X` (so they must be fp32 or u32).
    pub writes: &'static [&'static str],
}

/// The header for `k` launched with buffers of `dtypes`, followed by its body.
pub(crate) fn source(k: &Kernel, dtypes: &[DType]) -> String {
    let mut s = String::from(
        "@group(0) @binding(0) var<uniform> ARGS: array<vec4<u32>, 8>;\n\
         fn arg(i: u32) -> u32 { return ARGS[i / 4u][i % 4u]; }\n\
         fn argf(i: u32) -> f32 { return bitcast<f32>(arg(i)); }\n\
         // The item a thread of a 1-D launch over `Gpu::grid` handles.\n\
         fn flat_id(wg: vec3<u32>, lid: vec3<u32>, size: u32) -> u32 { return (wg.y * 65535u + wg.x) * size + lid.x; }\n\
         // The workgroup of a launch over `Gpu::grid` with one item per workgroup.\n\
         fn group_id(wg: vec3<u32>) -> u32 { return wg.y * 65535u + wg.x; }\n",
    );
    for (i, (name, dt)) in k.bindings.iter().zip(dtypes).enumerate() {
        s += &format!("@group(0) @binding({}) var<storage, read_write> {name}: array<u32>;\n", i + 1);
        s += &match dt {
            DType::F32 => format!(
                "fn ld_{name}(i: u32) -> f32 {{ return bitcast<f32>({name}[i]); }}\n\
                 fn st_{name}(i: u32, v: f32) {{ {name}[i] = bitcast<u32>(v); }}\n"
            ),
            DType::Bf16 => format!("fn ld_{name}(i: u32) -> f32 {{ let w = {name}[i >> 1u]; return bitcast<f32>(select(w << 16u, w & 0xffff0000u, (i & 1u) == 1u)); }}\n"),
            DType::F16 => format!("fn ld_{name}(i: u32) -> f32 {{ return unpack2x16float({name}[i >> 1u])[i & 1u]; }}\n"),
            DType::U32 => String::new(),
        };
    }
    for lib in k.libs {
        s += lib;
    }
    s += k.body;
    s
}

macro_rules! kernel {
    ($name:literal, [$($b:literal),*], writes [$($w:literal),*]) => {
        crate::shader::kernel!($name, libs [], [$($b),*], writes [$($w),*])
    };
    ($name:literal, libs [$($l:literal),*], [$($b:literal),*], writes [$($w:literal),*]) => {
        crate::shader::Kernel {
            name: $name,
            body: include_str!(concat!("wgsl/", $name, ".wgsl")),
            libs: &[$(include_str!(concat!("wgsl/lib_", $l, ".wgsl"))),*],
            bindings: &[$($b),*],
            writes: &[$($w),*],
        }
    };
}
pub(crate) use kernel;
