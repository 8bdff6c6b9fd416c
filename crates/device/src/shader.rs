//! How a kernel's source is put together: a body from `wgsl/` (or its CUDA C twin from `cuda/`),
//! and a header generated for the types of the buffers it is launched with.
//!
//! Every kernel binds its shape arguments at binding 0 (a uniform block of [`MAX_ARGS`] words,
//! read with `arg(i)` / `argf(i)`), then its buffers in the order of [`Kernel::bindings`], each
//! an `array<u32>`. For a buffer `X` of a floating type the header defines `ld_X(i) -> f32`
//! (element `i`, widened from bf16 or f16), and for an fp32 buffer also `st_X(i, v)`. So one body
//! serves every storage type, and each combination is compiled once, on first use.

use crate::DType;

/// Words in a kernel's uniform argument block.
pub(crate) const MAX_ARGS: usize = 32;

/// One kernel: its WGSL body, its CUDA C twin, and the names of its buffers, in binding order.
pub(crate) struct Kernel {
    pub name: &'static str,
    pub body: &'static str,
    /// WGSL function libraries (`wgsl/lib_*.wgsl`) put before the body.
    pub libs: &'static [&'static str],
    /// The CUDA C twins of `body` and `libs` (`cuda/`), the body's entry point named `name`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub cuda: &'static str,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub cuda_libs: &'static [&'static str],
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

/// The CUDA C source of `k` for buffers of `dtypes`: the WGSL header's twin (`arg`, `argf`,
/// `flat_id`, `group_id`; each buffer `X` a `uint*` with `ld_X` and, for fp32, `st_X`), then the
/// libraries and the body. A kernel takes one [`MAX_ARGS`]-word argument block and up to
/// [`MAX_BUFFERS`] device pointers, by value (`KilnParams KP`), and every function passes `KP` on.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn cuda_source(k: &Kernel, dtypes: &[DType]) -> String {
    let mut s = format!(
        "typedef unsigned int uint;\n\
         struct KilnParams {{ uint a[{MAX_ARGS}]; uint* b[{MAX_BUFFERS}]; }};\n\
         #define arg(i) (KP.a[(i)])\n\
         #define argf(i) (__uint_as_float(KP.a[(i)]))\n\
         #define kiln_select(f, t, c) ((c) ? (t) : (f))\n\
         // The item a thread of a 1-D launch over `Gpu::grid` handles.\n\
         __device__ inline uint flat_id(uint3 wg, uint3 lid, uint size) {{ return (wg.y * 65535u + wg.x) * size + lid.x; }}\n\
         // The workgroup of a launch over `Gpu::grid` with one item per workgroup.\n\
         __device__ inline uint group_id(uint3 wg) {{ return wg.y * 65535u + wg.x; }}\n\
         // IEEE half bits and fp32, converted as the hardware rounds (to nearest, ties to even).\n\
         __device__ inline float kiln_h2f(uint h) {{ float f; unsigned short s = (unsigned short)(h & 0xffffu); asm(\"cvt.f32.f16 %0, %1;\" : \"=f\"(f) : \"h\"(s)); return f; }}\n\
         __device__ inline uint kiln_f2h(float f) {{ unsigned short s; asm(\"cvt.rn.f16.f32 %0, %1;\" : \"=h\"(s) : \"f\"(f)); return (uint)s; }}\n"
    );
    assert!(dtypes.len() <= MAX_BUFFERS, "kernel {} binds more than {MAX_BUFFERS} buffers", k.name);
    for (i, (name, dt)) in k.bindings.iter().zip(dtypes).enumerate() {
        s += &format!("#define {name} (KP.b[{i}])\n");
        s += &match dt {
            DType::F32 => format!("#define ld_{name}(i) (__uint_as_float({name}[(i)]))\n#define st_{name}(i, v) ({name}[(i)] = __float_as_uint(v))\n"),
            DType::Bf16 => format!("#define ld_{name}(i) (__uint_as_float(((i) & 1u) ? ({name}[(i) >> 1u] & 0xffff0000u) : ({name}[(i) >> 1u] << 16u)))\n"),
            DType::F16 => format!("#define ld_{name}(i) (kiln_h2f(((i) & 1u) ? ({name}[(i) >> 1u] >> 16u) : {name}[(i) >> 1u]))\n"),
            DType::U32 => String::new(),
        };
    }
    for lib in k.cuda_libs {
        s += lib;
    }
    s += k.cuda;
    s
}

/// The most buffers one kernel binds (`KilnParams::b`).
pub(crate) const MAX_BUFFERS: usize = 12;

/// A kernel's threads per workgroup, `(x, y)`, read from its WGSL's `@workgroup_size`: the CUDA
/// twin runs in blocks of the same shape over the same grid.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn workgroup_size(k: &Kernel) -> (u32, u32) {
    let at = k.body.find("@workgroup_size(").map(|i| i + "@workgroup_size(".len()).unwrap_or_else(|| panic!("kernel {} has no @workgroup_size", k.name));
    let dims: Vec<u32> = k.body[at..].split(')').next().unwrap_or("").split(',').map(|x| x.trim().parse().expect("a workgroup size")).collect();
    (dims[0], dims.get(1).copied().unwrap_or(1))
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
            cuda: include_str!(concat!("cuda/", $name, ".cu")),
            cuda_libs: &[$(include_str!(concat!("cuda/lib_", $l, ".cu"))),*],
            bindings: &[$($b),*],
            writes: &[$($w),*],
        }
    };
}
pub(crate) use kernel;
