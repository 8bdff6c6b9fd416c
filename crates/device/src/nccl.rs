//! Collectives on CUDA device buffers through NCCL (feature `cuda`): one communicator per group
//! of ranks, each rank on its own device (or ranks sharing one), the collectives queued on the
//! device's stream in order with its kernels. The library is opened at run time (`cudarc`'s
//! dynamic loading, which looks for `libnccl.so`): a build needs no NCCL, and a machine without
//! it gets one line naming where to get it ([`NCCL_HINT`]). The group's first member makes its unique id
//! ([`unique_id`]); the host group hands it to the others before [`Nccl::new`].

use crate::{At, DeviceError, Gpu};
use cudarc::nccl::{result, sys};
use std::ffi::c_void;

/// The library NCCL's collectives need, and the pip wheel that ships it.
pub const NCCL_HINT: &str = "libnccl.so (NCCL: Debian's libnccl-dev installs it; or link a file named libnccl.so to the libnccl.so.2 that the `nvidia-nccl-cu13` pip wheel ships under site-packages/nvidia/nccl/lib, in a directory on LD_LIBRARY_PATH)";

/// Bytes of a group's unique id.
pub const ID_BYTES: usize = 128;

/// Whether NCCL can be opened.
pub fn nccl_present() -> bool {
    // SAFETY: only opens the library (dlopen), calling nothing in it.
    unsafe { sys::is_culib_present() }
}

fn missing() -> DeviceError {
    DeviceError(format!("NCCL is not installed: {NCCL_HINT}"))
}

fn nccl_err(what: &str) -> impl Fn(result::NcclError) -> DeviceError + '_ {
    move |e| DeviceError(format!("NCCL: {what}: {e:?}"))
}

/// NCCL's version (`major·10000 + minor·100 + patch` from 2.9 on).
pub fn version() -> Result<i32, DeviceError> {
    if !nccl_present() {
        return Err(missing());
    }
    result::get_nccl_version().map_err(nccl_err("reading the version"))
}

/// A new group's unique id, made by its first member (the others receive it from the host).
pub fn unique_id() -> Result<[u8; ID_BYTES], DeviceError> {
    if !nccl_present() {
        return Err(missing());
    }
    let id = result::get_uniqueid().map_err(nccl_err("making a unique id"))?;
    Ok(id.internal.map(|c| c as u8))
}

/// One rank's NCCL communicator, on its device's stream.
pub struct Nccl {
    comm: sys::ncclComm_t,
    stream: sys::cudaStream_t,
    pub rank: usize,
    pub size: usize,
}

// SAFETY: the communicator is used by one thread at a time (its rank's), as NCCL requires.
unsafe impl Send for Nccl {}

impl Nccl {
    /// Rank `rank` of the `size` ranks of the group whose first member made `id`, on `gpu`
    /// (collective: every member calls it). A Vulkan device, or no NCCL, is refused.
    pub fn new(gpu: &Gpu, id: [u8; ID_BYTES], rank: usize, size: usize) -> Result<Nccl, DeviceError> {
        if !nccl_present() {
            return Err(missing());
        }
        let stream = gpu.cuda_stream().ok_or_else(|| DeviceError(format!("NCCL runs on CUDA devices, not {}", gpu.info.describe())))?;
        let id = sys::ncclUniqueId { internal: id.map(|b| b as std::ffi::c_char) };
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: `comm` is written by NCCL on success; the device's context is current on
        // this thread (its stream was made there).
        let comm = unsafe {
            result::comm_init_rank(comm.as_mut_ptr(), size as i32, id, rank as i32).map_err(nccl_err("joining the group"))?;
            comm.assume_init()
        };
        Ok(Nccl { comm, stream: stream as sys::cudaStream_t, rank, size })
    }

    /// `buf[..n] ← Σ_r buf_r[..n]` (fp32).
    pub fn all_reduce_sum(&self, buf: At, n: usize) {
        assert!(buf.fits(n), "NCCL all_reduce: {n} elements past the buffer");
        let p = address(buf);
        // SAFETY: `p` holds `n` fp32 elements on this rank's device (checked above).
        unsafe { result::all_reduce(p as *const c_void, p, n, sys::ncclDataType_t::ncclFloat32, sys::ncclRedOp_t::ncclSum, self.comm, self.stream) }.map_err(nccl_err("all_reduce")).unwrap_or_else(|e| panic!("{}", e.0));
    }

    /// `out[r·n .. (r+1)·n] = mine_r[..n]` for every rank `r` (fp32).
    pub fn all_gather(&self, mine: At, n: usize, out: At) {
        assert!(mine.fits(n) && out.fits(n * self.size), "NCCL all_gather: shapes");
        // SAFETY: both regions lie in this rank's device buffers (checked above).
        unsafe { result::all_gather(address(mine) as *const c_void, address(out), n, sys::ncclDataType_t::ncclFloat32, self.comm, self.stream) }.map_err(nccl_err("all_gather")).unwrap_or_else(|e| panic!("{}", e.0));
    }

    /// `out[..n] = (Σ_r full_r)[rank·n .. (rank+1)·n]` (fp32).
    pub fn reduce_scatter_sum(&self, full: At, n: usize, out: At) {
        assert!(full.fits(n * self.size) && out.fits(n), "NCCL reduce_scatter: shapes");
        // SAFETY: as `all_gather`.
        unsafe { result::reduce_scatter(address(full) as *const c_void, address(out), n, sys::ncclDataType_t::ncclFloat32, sys::ncclRedOp_t::ncclSum, self.comm, self.stream) }.map_err(nccl_err("reduce_scatter")).unwrap_or_else(|e| panic!("{}", e.0));
    }

    /// `x[..n]` to rank `peer` (paired with its [`Nccl::recv`]).
    pub fn send(&self, x: At, n: usize, peer: usize) {
        assert!(x.fits(n), "NCCL send: {n} elements past the buffer");
        // SAFETY: as `all_gather`.
        unsafe { result::send(address(x) as *const c_void, n, sys::ncclDataType_t::ncclFloat32, peer as i32, self.comm, self.stream) }.map_err(nccl_err("send")).unwrap_or_else(|e| panic!("{}", e.0));
    }

    /// `x[..n]` from rank `peer`.
    pub fn recv(&self, x: At, n: usize, peer: usize) {
        assert!(x.fits(n), "NCCL recv: {n} elements past the buffer");
        // SAFETY: as `all_gather`.
        unsafe { result::recv(address(x), n, sys::ncclDataType_t::ncclFloat32, peer as i32, self.comm, self.stream) }.map_err(nccl_err("recv")).unwrap_or_else(|e| panic!("{}", e.0));
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        // SAFETY: the communicator is live until here and used by nothing else.
        let _ = unsafe { result::comm_destroy(self.comm) };
    }
}

/// The device address of `at` (a CUDA buffer's: [`Nccl::new`] refuses other devices).
fn address(at: At) -> *mut c_void {
    let base = at.buf.cuda_ptr().expect("a CUDA buffer");
    (base + 4 * at.off as u64) as *mut c_void
}
